# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpu_reset main(): arguments, results, check mode and failures, against the simulator.

SAFETY: the tool lookup searches only the simulator's bin so that the module only ever finds the simulator's fake
nvidia-smi / amd-smi (tests/sim/bin) and the tests' fake systemctl, never a real tool.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import disruption, processes, reset, safe_files
from ansible_collections.gpufleet.reclaim.plugins.module_utils import gpu_module
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_reset
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.modules.module_docs import documented_options
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_reset import (  # noqa: F401 pylint: disable=unused-import
    BUS, SIM_BIN, audit, blocker, by_index, check_of, gpu_state, node, systemctl_log)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='the fake nvidia-smi resets only as root, like the real one')


@pytest.fixture(autouse=True)
def module_exits(monkeypatch):
    h.patch_module_exits(monkeypatch)
    monkeypatch.delenv('GPU_SIM_STATE', raising=False)


@pytest.fixture(autouse=True)
def fake_tools_only(monkeypatch):
    """The module finds tools only in the simulator's bin and in ``dirs`` (a list the test may extend), through the
    one lookup of the core (safe_files.find_program, with its checks), never a real tool on PATH."""
    dirs = [SIM_BIN] if SIM_BIN else []
    lookup = safe_files.find_program
    monkeypatch.setattr(reset, 'find_program', lambda name, refused=None: lookup(name, os.pathsep.join(dirs), refused=refused))
    return dirs


STATE = {}


@pytest.fixture(autouse=True)
def state_path(tmp_path, monkeypatch):
    """The ladder's state file the module records its resets in: the test's own, never the host's /var/lib/gpufleet;
    and no slurmd here (one this machine runs for another test's fleet is not the test's, its Slurm not asked)."""
    monkeypatch.setattr(disruption, 'scheduler_daemon', lambda: None)
    STATE['path'] = str(tmp_path / 'lib' / 'remediation.json')
    return STATE['path']


def run_module(args, check_mode=False):
    """main() with ``args``; returns the result dict (``failed`` set when it failed)."""
    return h.run_main(gpu_reset.main, dict({'state_path': STATE['path']}, **args), check_mode=check_mode)


@pytest.fixture
def sim(node, audit, monkeypatch):
    """The simulated node (fake NVML loaded in this process); the fd scan looks at its temp device dir."""
    monkeypatch.setattr(processes, 'DEFAULT_DEV_ROOTS', tuple(node.dev_roots))
    node.audit = audit
    return node


def test_argument_spec_matches_the_documented_options():
    doc = yaml.safe_load(gpu_reset.DOCUMENTATION)
    spec = gpu_reset.argument_spec()
    options = documented_options(gpu_reset)
    # driver_timeout (issue #17) is documented by the doc fragment _attributes.DRIVER_TIMEOUT
    assert set(spec) == set(options)
    assert 'gpufleet.reclaim._attributes.DRIVER_TIMEOUT' in doc['extends_documentation_fragment']
    for name, option in options.items():
        assert spec[name].get('default') == option.get('default'), name
        assert spec[name]['type'] == option['type'], name


@pytest.mark.parametrize('args, field', [({}, 'gpus'), ({'gpus': ['0'], 'all': True}, 'all'),
                                         ({'all': True, 'stop_services': ['-H host']}, 'stop_services')])
def test_invalid_arguments_fail_naming_the_field(args, field):
    result = run_module(args)
    assert result['failed'] is True and result['field'] == field


def test_missing_psutil_fails_with_missing_required_lib(monkeypatch):
    monkeypatch.setattr(gpu_module, 'psutil_error', lambda: 'Traceback: No module named psutil')
    result = run_module({'all': True})
    assert result['failed'] is True and 'psutil' in result['msg']


def test_host_without_gpus_changes_nothing():
    result = run_module({'when_needed': True, 'audit_log': ''})
    assert not result.get('failed') and result['changed'] is False and result['resets'] == []
    assert result['msg'] == 'no GPU needs a reset'


@needs_root
def test_when_needed_resets_the_leak_then_reports_no_change(sim):
    sim.gpusim('leak', '--gpu', '2', '--mib', '8192')
    first = run_module({'when_needed': True, 'audit_log': sim.audit})
    assert not first.get('failed'), first['msg']
    assert first['changed'] is True and first['reset_gpus'] == [2] and first['failed_gpus'] == []
    gpu = first['resets'][0]
    assert (gpu['index'], gpu['status'], gpu['verified']) == (2, 'reset', True)
    assert gpu['before']['orphaned_mib'] == 8192 and gpu['after']['orphaned_mib'] == 0
    assert gpu['command'] == [os.path.join(SIM_BIN, 'nvidia-smi'), '--gpu-reset', '-i', BUS[2]]
    assert first['msg'] == 'reset 1 GPU(s): 2 (verified)'
    second = run_module({'when_needed': True, 'audit_log': sim.audit})
    assert second['changed'] is False and second['resets'] == [] and not second.get('failed')
    assert gpu_state(sim, 2)['reset_count'] == 1 and gpu_state(sim, 2)['persistence'] is True


@needs_root
def test_a_reset_is_recorded_for_the_budget_and_the_fleet_limit(sim, state_path):
    """issue #30: the reset goes into the ladder's disruption history; check mode predicts it and records nothing."""
    sim.gpusim('leak', '--gpu', '1', '--mib', '4096')
    plan = run_module({'when_needed': True, 'audit_log': sim.audit}, check_mode=True)
    assert [(d['action'], d['gpu']) for d in plan['disruptive']] == [('reset', 1)] and not os.path.exists(state_path)
    assert plan['disruption'] == {'drained': None, 'reboot_flag': None, 'scheduler': None, 'actions': [], 'errors': []}
    done = run_module({'when_needed': True, 'audit_log': sim.audit})
    assert [(d['action'], d['gpu']) for d in done['disruptive']] == [('reset', 1)]
    with open(state_path) as handle:
        history = json.load(handle)['disruptions']
    assert [(e['action'], e['gpu'], e['by'], e['detail']) for e in history] == [('reset', done['resets'][0]['uuid'], 'gpu_reset', 'reset')]
    assert [(a['action'], a['by']) for a in done['disruption']['actions']] == [('reset', 'gpu_reset')]
    assert 0 <= done['disruption']['actions'][0]['ago_s'] < 60
    assert run_module({'when_needed': True, 'audit_log': sim.audit})['disruptive'] == []


@needs_root
def test_check_mode_changes_nothing(sim):
    sim.gpusim('leak', '--gpu', '0', '--mib', '4096')
    pid = sim.spawn(gpu=0, mib=1024)
    result = run_module({'gpus': ['0'], 'kill_processes': True, 'audit_log': sim.audit}, check_mode=True)
    assert not result.get('failed') and result['changed'] is True
    gpu = result['resets'][0]
    assert gpu['status'] == 'would_reset' and [k['pid'] for k in gpu['would_kill']] == [pid] and gpu['command'] is None
    state = gpu_state(sim, 0)
    assert (state['leaked_mib'], state['reset_count'], state['persistence']) == (4096, 0, True)
    assert sim.alive(pid) and not os.path.exists(sim.audit)


@needs_root
def test_a_live_process_fails_the_task_and_says_what_to_do(sim):
    pid = sim.spawn(gpu=1, mib=1024)
    result = run_module({'gpus': ['1', '2'], 'audit_log': sim.audit})
    assert result['failed'] is True and result['failed_gpus'] == [1] and result['reset_gpus'] == [2]
    assert 'GPU 1 (%s): processes: 1 process(es) use the GPU: pid %d' % (BUS[1], pid) in result['msg']
    assert 'kill_processes: true' in result['msg']
    assert by_index(result)[1]['status'] == 'refused' and sim.alive(pid)
    assert gpu_state(sim, 2)['reset_count'] == 1


@needs_root
def test_kill_processes_empties_and_resets(sim):
    pid = sim.spawn(gpu=1, mib=1024, children=1)
    result = run_module({'gpus': [by_index(run_module({'gpus': ['1'], 'audit_log': ''}, check_mode=True))[1]['uuid']],
                         'kill_processes': True, 'kill_timeout': 2, 'audit_log': sim.audit})
    assert not result.get('failed'), result['msg']
    assert pid in [k['pid'] for k in result['resets'][0]['killed']]
    with open(sim.audit) as handle:
        assert json.loads(handle.readline())['event'] == 'gpu_reset'


@needs_root
def test_missing_nvidia_smi_is_a_clear_error(sim, fake_tools_only):
    del fake_tools_only[:]
    sim.gpusim('leak', '--gpu', '0', '--mib', '4096')
    result = run_module({'gpus': ['0'], 'audit_log': sim.audit})
    assert result['failed'] is True and result['failed_gpus'] == [0]
    assert 'tool: nvidia-smi was not found on PATH' in result['msg']
    assert gpu_state(sim, 0)['leaked_mib'] == 4096


@needs_root
def test_stop_services_uses_systemctl_from_path(sim, blocker, fake_tools_only, monkeypatch):
    fake_tools_only.append(blocker)
    monkeypatch.setenv('PATH', blocker + os.pathsep + os.environ.get('PATH', ''))
    refused = run_module({'gpus': ['0'], 'audit_log': sim.audit})
    assert refused['failed'] is True and 'nv-hostengine' in refused['msg'] and 'stop_services: [nvidia-dcgm]' in refused['msg']
    result = run_module({'gpus': ['0'], 'stop_services': ['nvidia-dcgm'], 'audit_log': sim.audit})
    assert not result.get('failed'), result['msg']
    assert result['services']['stopped'] == ['nvidia-dcgm'] and result['services']['started'] == ['nvidia-dcgm']
    assert check_of(result['resets'][0], 'blocking_clients')['status'] == 'pass'
    assert [entry[0] for entry in systemctl_log(blocker)] == ['is-active', 'stop', 'start']
