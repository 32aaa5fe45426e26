# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/validation.py: the one validator of the policy, the rogue rules file and the agent settings."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard_settings, rogue, validation as V
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.policy import validation as policy_validation


def test_errors_collects_every_failure_with_path_value_why_line():
    errors = V.Errors()
    assert errors.run(V.boolean, True, 'a') is True
    assert errors.run(V.boolean, 'yes', 'a') is None
    assert errors.run(V.only, {'x': 1, 'ok': 2, 'y': 3}, 'top', ('ok',)) is None
    errors.add('z', 5, 'too big', 7)
    assert errors.run(_raise_invalid_argument, 'field.path') is None
    assert len(errors) == 5
    assert errors.items == [
        ('a', 'yes', 'expected true or false', None),
        ('top.x', 1, 'unknown key; expected one of ok', None),
        ('top.y', 3, 'unknown key; expected one of ok', None),
        ('z', 5, 'too big', 7),
        ('field.path', -1, 'negative', None)]
    with pytest.raises(V.Invalid) as exc:
        errors.check()
    assert (exc.value.path, exc.value.value, exc.value.why, exc.value.line) == ('a', 'yes', 'expected true or false', None)
    assert exc.value.items == errors.items
    V.Errors().check()  # nothing collected: nothing raised


def _raise_invalid_argument(path):
    raise InvalidArgument(path, -1, 'negative')


@pytest.mark.parametrize('args, why', [
    (('x', 'p', 1, 9, True), 'expected a whole number from 1 to 9, got text'),
    ((2.0, 'p', 1, 9, True), 'expected a whole number from 1 to 9, got a number'),
    ((True, 'p', 1, 9), 'expected a number from 1 to 9, got a boolean'),
    ((10, 'p', 1, 9, True), '10 is out of range 1-9'),
    ((0, 'p', 1, 9, True), '0 is out of range 1-9'),
    ((float('nan'), 'p', 0, 100), 'nan is out of range 0-100'),
    ((float('inf'), 'p', 0, 1e308, False, 'expected a finite number'), 'expected a finite number'),
    ((0, 'p', 0, 10, False, 'expected a positive number', True), 'expected a positive number'),
])
def test_in_range_refuses(args, why):
    with pytest.raises(V.Invalid) as exc:
        V.in_range(*args)
    assert exc.value.why == why and exc.value.path == 'p'


def test_in_range_and_the_other_checks_accept():
    assert V.in_range(5, 'p', 1, 9, True) == 5
    assert V.in_range(0.5, 'p', 0, 1, False, None, True) == 0.5
    assert V.in_range(10 ** 12, 'p', 0) == 10 ** 12
    assert V.mapping({'a': 1}, 'p') == {'a': 1}
    assert V.sequence([1], 'p') == [1]
    assert V.text(' ', 'p', blank=True) == ' '
    for check, value, why in ((V.mapping, [1], 'expected a mapping, got a list'), (V.mapping, {1: 2}, 'keys must be text, got a number'),
                              (V.sequence, 'abc', 'expected a list, got text'), (V.text, ' ', 'expected a non-empty string, got text'),
                              (V.text, b'x', 'expected a non-empty string, got bytes')):
        with pytest.raises(V.Invalid) as exc:
            check(value, 'p')
        assert exc.value.why == why


def test_paths_lines_and_nesting():
    assert V.join('', 'a') == 'a' and V.join('a', 'b') == 'a.b' and V.join('a', 'b.c') == 'a["b.c"]' and V.join('a', 3) == 'a.3'
    assert V.line_of({'a': 1, 'a.b[0]': 4}, 'a.b[0].c') == 4 and V.line_of({'a': 1}, 'a.x') == 1 and V.line_of({}, 'a') is None
    assert V.unknown_key('k', {'b', 'a'}, 'setting', named=True) == "unknown setting 'k'; expected one of a, b"
    nested = []
    for _level in range(V.MAX_NESTING - 1):
        nested = [nested]
    V.check_nesting(nested)
    with pytest.raises(V.DocumentLimitError) as exc:
        V.check_nesting([nested])
    assert exc.value.why == V.too_deep()


def test_policy_names_are_the_leaf_validator():
    """One validator: the policy's parser names are the leaf's objects, not copies."""
    assert policy_validation._Bad is V.Invalid and policy_validation._Errors is V.Errors and policy_validation._only is V.only
    assert policy_validation.DocumentLimitError is V.DocumentLimitError and policy_validation.check_nesting is V.check_nesting
    assert issubclass(policy_validation.PolicyError, InvalidArgument)


def test_rules_and_settings_use_the_same_unknown_key_reason():
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules={'poolz': []})
    assert exc.value.why == "unknown key 'poolz'; expected one of %s" % ', '.join(sorted(rogue.TOP_KEYS))
    assert list(guard_settings.SETTINGS_KEYS) == sorted(guard_settings.SETTINGS_KEYS)


def test_settings_with_a_key_that_is_not_text_is_a_clean_error(tmp_path):
    """A settings key YAML reads as a number (``1: x``) is named like any unknown setting (it used to crash)."""
    paths = guard_settings.Paths(root=str(tmp_path))
    os.makedirs(os.path.dirname(paths.settings))
    with open(paths.settings, 'w') as handle:
        handle.write('1: x\nwebhook_allow_http: maybe\nwebhook_timeout: .nan\n')
    with pytest.raises(InvalidArgument) as exc:
        guard_settings.load_settings(paths.settings, paths)
    assert str(exc.value).splitlines() == [
        "%s:1: 1: invalid value 'x': unknown setting; expected one of %s" % (paths.settings, ', '.join(guard_settings.SETTINGS_KEYS)),
        "%s:2: webhook_allow_http: invalid value 'maybe': expected true or false" % paths.settings,
        "%s:3: webhook_timeout: invalid value nan: expected a positive number" % paths.settings]
