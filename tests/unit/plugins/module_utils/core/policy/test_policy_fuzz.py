# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fuzzing the policy loader: any document gives a Policy or a clear PolicyError, never a crash."""

from __future__ import annotations

import datetime

import pytest

hypothesis = pytest.importorskip('hypothesis')
yaml = pytest.importorskip('yaml')

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402  pylint: disable=wrong-import-position

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P  # noqa: E402  pylint: disable=wrong-import-position
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import (  # noqa: E402  pylint: disable=wrong-import-position
    MONDAY_NOON, proc, snapshot)

# The words of the schema (and of gpu-kill's), so that the fuzzer reaches deep into the validators.
KEYS = sorted(set(P.TOP_KEYS + P.GPUKILL_KEYS + tuple(P.LIMIT_ALIASES) + P.GROUP_EXTRA + P.GPU_KEYS + P.TIME_WINDOW_KEYS
                  + P.EXEMPTION_MATCH_KEYS + P.PROTECT_KEYS + P.ESCALATION_KEYS + tuple(P.IDLE_KEYS)
                  + ('match', 'rules', 'expires', 'alice', 'bob', '*', '0', '0-1', 'phd', 'url', 'timeout', 'after', 'action',
                     'memory_limit_gb', 'members', 'username', 'max_memory_gb', 'gpu_index', 'start_time', 'end_time',
                     'days_of_week', 'overrides', 'dry_run', 'hard_enforcement', 'grace_period_seconds', 'notifications')))
WORDS = ['8GB', '512MiB', '30m', '2h', '10', '-1', 'mon-fri', 'weekdays', '09:00', '25:99', 'UTC', 'Europe/Berlin', '+05:30',
         'enforce', 'dry-run', 'warn', 'kill', 'terminate', 'group:phd', '@interns', 'a' * 64, '2030-01-01', 'critical',
         'http://127.0.0.1:1/x', '/usr/bin/true', '(a+)+', 'GPU-0000', '', ' ', 'null', '\u00e9t\u00e9']

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10 ** 12, max_value=10 ** 12),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WORDS), st.text(max_size=20),
    st.dates(min_value=datetime.date(1970, 1, 2), max_value=datetime.date(2200, 1, 1)),
)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(KEYS), children, max_size=5)),
    max_leaves=25,
)
PIECES = list('[]{}"\'=:-#,.\n abcxyz_019*&!|>@%\t') + ['null', 'true', '"""', 'a = ', '[[t]]\n', 'mode: ', '\n  - ']
SNAP = snapshot([proc(1, 'alice', {0: 9000}, util=0), proc(2, 'bob', {1: 20000}, util=50), proc(3, 'alice', {0: 100, 2: 5000})])


def _check(text):
    try:
        policy = P.load_policy_text(text, 'fuzz.yaml')
    except P.PolicyError as exc:
        message = str(exc)
        assert message.startswith('fuzz.yaml: ') or message.startswith('fuzz.yaml')
        assert exc.errors and all(len(e) == 3 for e in exc.errors)
        return
    # a valid policy evaluates without crashing, at any time of the week
    for hours in (0, 13, 50, 130):
        now = MONDAY_NOON + hours * 3600
        state = P.observe(policy, SNAP, {}, now, P.Context(groups={}))
        for violation in P.evaluate(policy, SNAP, state, now, P.Context(groups={})):
            assert violation.rule in P.RULES
            violation.to_dict()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS)
def test_random_documents_load_or_fail_clearly(document):
    try:
        text = yaml.safe_dump(document, default_flow_style=False, allow_unicode=True)
    except yaml.YAMLError:
        return
    _check(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=60))
def test_random_text_loads_or_fails_clearly(pieces):
    _check(''.join(pieces))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(P.GPUKILL_KEYS + ('metadata',)), DOCUMENTS, min_size=1, max_size=4))
def test_random_gpukill_documents_load_or_fail_clearly(document):
    _check(yaml.safe_dump(document, default_flow_style=False))
