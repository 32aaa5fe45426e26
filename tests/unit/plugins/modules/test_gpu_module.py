# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""module_utils/gpu_module: the shared options match their doc fragments and core/constants.py, every
module's documented options (fragments merged) match its argument spec, and run_module turns each core
exception into the fail_json arguments the modules have always returned."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils import gpu_module
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import constants
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import (
    AuditLogError, GpuFleetError, InvalidArgument, MissingArgument, MissingLibrary)
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.policy import PolicyError
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.rogue import RulesError
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.watchdog import DriverHung
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_audit, gpu_facts, gpu_kill, gpu_remediate, gpu_reset
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.modules.module_docs import documented_options, fragment_options

MODULES = (gpu_audit, gpu_facts, gpu_kill, gpu_remediate, gpu_reset)


def test_protection_fragment_lists_the_default_protect_names():
    options = fragment_options('gpufleet.reclaim._protection')
    assert options['protect_names']['default'] == list(constants.DEFAULT_PROTECT_NAMES)
    assert gpu_module.protection_options()['protect_names']['default'] == list(constants.DEFAULT_PROTECT_NAMES)


def test_shared_fragments_name_the_constants():
    assert fragment_options('gpufleet.reclaim._audit_log')['audit_log']['default'] == constants.ACTIONS_LOG_PATH
    assert fragment_options('gpufleet.reclaim._selection')['vendor']['choices'] == list(constants.VENDOR_CHOICES)


@pytest.mark.parametrize('module', MODULES, ids=lambda m: m.__name__.rsplit('.', 1)[1])
def test_documented_options_match_the_argument_spec(module):
    """What validate-modules checks, without ansible-test: names, types, defaults, choices, elements."""
    options, spec = documented_options(module), module.argument_spec()
    assert set(options) == set(spec)
    for name, option in options.items():
        for key in ('type', 'default', 'choices', 'elements'):
            assert option.get(key) == spec[name].get(key), (name, key)
        assert option['description'], name


@pytest.mark.parametrize('module', (gpu_kill, gpu_remediate, gpu_reset), ids=lambda m: m.__name__.rsplit('.', 1)[1])
def test_modules_that_signal_share_protection_and_audit_log(module):
    spec = module.argument_spec()
    for piece in (gpu_module.gpu_options(), gpu_module.protection_options(), gpu_module.audit_log_option()):
        for name, option in piece.items():
            assert spec[name] == option, name


def hung():
    return DriverHung('nvmlDeviceGetMemoryInfo', 2.0, vendor='nvidia', gpu=0, pci_bus_id='00000000:07:00.0')


@pytest.mark.parametrize('exc, expected', [
    (InvalidArgument('gpus', 7, 'no such GPU'), {'msg': 'gpus: invalid value 7: no such GPU', 'field': 'gpus', 'value': '7'}),
    (MissingArgument('selectors', 'give at least one'), {'msg': 'selectors: give at least one', 'field': 'selectors', 'value': 'None'}),
    (MissingLibrary('amdsmi', purpose='reset an AMD GPU'),
     {'msg': 'the Python package amdsmi is required to reset an AMD GPU', 'package': 'amdsmi'}),
    (GpuFleetError('the driver refused'), {'msg': 'the driver refused'}),
    (AuditLogError('cannot open audit log /x: Permission denied'), {'msg': 'cannot open audit log /x: Permission denied'}),
])
def test_failure_of_core_errors(exc, expected):
    assert gpu_module.failure('gpu_kill', exc) == expected


def test_failure_of_a_hung_driver_names_the_call():
    failure = gpu_module.failure('gpu_facts', hung())
    assert failure['msg'].startswith('the GPU driver did not answer within 2s: nvmlDeviceGetMemoryInfo hung on nvidia GPU 0')
    assert failure['driver_hung']['call'] == 'nvmlDeviceGetMemoryInfo' and failure['driver_hung']['timeout_s'] == 2.0


def test_failure_of_domain_errors_the_module_names():
    rules = RulesError('/etc/gpufleet/rogue.yml', 4, 'allowlist[0].cmdline', 'bad regular expression')
    policy = PolicyError([('defaults.max_gpus', -1, 'expected 0 or more')], source='/etc/gpufleet/policy.yaml')
    errors = ((PolicyError, gpu_module.invalid_policy), (RulesError, gpu_module.invalid_rules))
    assert gpu_module.failure('gpu_audit', rules, errors) == {
        'msg': 'invalid rogue rules: /etc/gpufleet/rogue.yml:4: allowlist[0].cmdline: bad regular expression',
        'file': '/etc/gpufleet/rogue.yml', 'line': 4, 'field': 'allowlist[0].cmdline'}
    failure = gpu_module.failure('gpu_audit', policy, errors)
    assert failure['msg'] == 'invalid policy: %s' % policy
    assert (failure['source'], failure['field'], failure['value']) == ('/etc/gpufleet/policy.yaml', 'defaults.max_gpus', '-1')
    # a module that does not name them gets the plain mapping of their base class
    assert gpu_module.failure('gpu_kill', policy) == {'msg': str(policy), 'field': 'defaults.max_gpus', 'value': '-1'}
    # the pairs may come from a function, called only when the work failed (gpu_audit imports the policy lazily)
    calls = []
    assert gpu_module.failure('gpu_audit', policy, lambda: calls.append(1) or errors) == failure and calls == [1]


def test_gpu_audit_imports_the_policy_engine_and_history_only_when_asked():
    """A plain audit (the common call, once per node) does not pay for core.guard, core.policy or sqlite3."""
    code = ('import sys; import ansible_collections.gpufleet.reclaim.plugins.modules.gpu_audit; '
            'print(" ".join(m for m in sys.modules if m.endswith((".core.guard", ".core.policy", ".core.history")) or m == "sqlite3"))')
    # a fresh interpreter finds the collection as a plain package: under ansible-test its collection loader is not there,
    # so the directory above ansible_collections/ goes on the child's path
    here = os.path.abspath(gpu_module.__file__)
    root = here[:here.rindex(os.sep + 'ansible_collections' + os.sep)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in sys.path if p]))
    out = subprocess.run([sys.executable, '-c', code], check=True, stdout=subprocess.PIPE, universal_newlines=True, env=env).stdout
    assert out.split() == [], out


def raised(exc):
    """``exc`` after it was raised (with its traceback)."""
    try:
        raise exc
    except Exception as caught:  # pylint: disable=broad-except
        return caught


def test_failure_of_a_bug_carries_the_traceback():
    failure = gpu_module.failure('gpu_reset', raised(KeyError('gpus')))
    assert failure['msg'] == "gpu_reset failed: 'gpus'"
    assert failure['exception'].startswith('Traceback') and 'KeyError' in failure['exception']


class Failed(Exception):
    pass


class Exited(Exception):
    pass


class FakeModule(object):
    def __init__(self):
        self.warnings = []

    def fail_json(self, **kwargs):
        raise Failed(kwargs)

    def exit_json(self, **kwargs):
        raise Exited(kwargs)

    def warn(self, warning):
        self.warnings.append(warning)


@pytest.fixture
def module(monkeypatch):
    monkeypatch.setattr(gpu_module, 'respawn_if_needed', lambda module: None)
    return FakeModule()


def test_run_module_returns_the_work(module):
    assert gpu_module.run_module(module, 'gpu_facts', lambda m: ('done', m)) == ('done', module)


def test_run_module_fails_with_the_mapping(module):
    def work(_module):
        raise InvalidArgument('hours', 0, 'expected more than 0')
    with pytest.raises(Failed) as failed:
        gpu_module.run_module(module, 'gpu_audit', work)
    assert failed.value.args[0] == {'msg': 'hours: invalid value 0: expected more than 0', 'field': 'hours', 'value': '0'}


def test_run_module_without_psutil_does_no_work(module, monkeypatch):
    monkeypatch.setattr(gpu_module, 'psutil_error', lambda: 'Traceback: No module named psutil')
    with pytest.raises(Failed) as failed:
        gpu_module.run_module(module, 'gpu_kill', lambda m: pytest.fail('work ran without psutil'))
    assert 'psutil' in failed.value.args[0]['msg'] and failed.value.args[0]['exception'] == 'Traceback: No module named psutil'


@pytest.mark.parametrize('failed, ending', [(False, Exited), (True, Failed)])
def test_finish_warns_then_exits_or_fails(module, failed, ending):
    with pytest.raises(ending) as ended:
        gpu_module.finish(module, {'msg': 'done', 'warnings': ['first', 'second']}, failed=failed)
    assert ended.value.args[0] == {'msg': 'done'} and module.warnings == ['first', 'second']
