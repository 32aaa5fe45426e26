# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpu_kill main(): arguments, results, check and diff mode, idempotence, the audit log and
input errors, against workloads that ``gpusim spawn`` started on the test's own simulated node.

The module reads device files under the default device roots, which these tests point at the
node's temp dir (processes.DEFAULT_DEV_ROOTS), and NVML is the shim loaded into this process.
"""

from __future__ import annotations

import os
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, processes
from ansible_collections.gpufleet.reclaim.plugins.module_utils import gpu_module
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_kill
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

needs_sim = h.needs_gpusim


@pytest.fixture(autouse=True)
def module_exits(monkeypatch):
    h.patch_module_exits(monkeypatch)
    monkeypatch.delenv('GPU_SIM_STATE', raising=False)


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A simulated 2-GPU node; the module's default device root is its fake /dev."""
    with h.gpusim_node(gpus=2) as sim:
        monkeypatch.setattr(processes, 'DEFAULT_DEV_ROOTS', sim.dev_roots)
        sim.audit = str(tmp_path / 'actions.jsonl')
        sim.history = str(tmp_path / 'utilization.json')
        yield sim


def run_module(sim, args, check_mode=False, diff=False):
    """main() with ``args`` (short timeouts, the node's audit log); returns the result dict."""
    args = dict(args)
    if sim is not None:
        args.setdefault('audit_log', sim.audit)
        args.setdefault('utilization_history', sim.history)
    args.setdefault('timeout', 5)
    args.setdefault('release_timeout', 5)
    return h.run_main(gpu_kill.main, args, check_mode=check_mode, diff=diff)


def pids(entries):
    return sorted(e['pid'] for e in entries)


def test_argument_spec_and_defaults():
    spec = gpu_kill.argument_spec()
    assert spec['signal']['default'] == 'TERM' and spec['timeout']['default'] == 10.0
    assert spec['release_timeout']['default'] == 15.0 and spec['tree']['default'] is True and spec['force']['default'] is False
    assert spec['audit_log']['default'] == '/var/log/gpufleet/actions.jsonl'
    for name in ('Xorg', 'gnome-shell', 'WindowServer', 'nvidia-persistenced', 'nv-hostengine', 'dcgm-exporter', 'sshd'):
        assert name in spec['protect_names']['default']


def test_no_selector_fails_before_reading_anything():
    result = run_module(None, {'gpus': ['0']})
    assert result['failed'] is True and result['field'] == 'selectors'
    assert 'give at least one of pids' in result['msg']


def test_missing_psutil_fails_with_missing_required_lib(monkeypatch):
    monkeypatch.setattr(gpu_module, 'psutil_error', lambda: 'Traceback: No module named psutil')
    result = run_module(None, {'users': ['bob']})
    assert result['failed'] is True and 'psutil' in result['msg']


@needs_sim
@pytest.mark.parametrize('args, field, value', [
    ({'gpus': ['7'], 'all_on_gpus': True}, 'gpus', '7'),
    ({'gpus': ['GPU-nope'], 'users': ['root']}, 'gpus', 'GPU-nope'),
    ({'name': '(python'}, 'name', '(python'),
    ({'cmdline': '(a+)+'}, 'cmdline', '(a+)+'),
    ({'idle_for': '30 fortnights'}, 'idle_for', '30 fortnights'),
    ({'older_than': 'ages'}, 'older_than', 'ages'),
    ({'users': ['root'], 'timeout': -1}, 'timeout', '-1.0'),
    ({'users': ['root'], 'release_timeout': -3}, 'release_timeout', '-3.0'),
    ({'users': ['root'], 'min_used_mib': -5}, 'min_used_mib', '-5'),
    ({'users': ['root'], 'audit_log': 'relative.jsonl'}, 'audit_log', 'relative.jsonl'),
    ({'all_on_gpus': True}, 'all_on_gpus', 'True'),
])
def test_invalid_input_fails_naming_the_field_and_signals_nothing(node, args, field, value):
    victim = node.spawn(0, 1024)
    result = run_module(node, dict(args, force=True))
    assert result['failed'] is True
    assert result['field'] == field and result['value'] == value
    assert result['msg'].startswith('%s: invalid value' % field)
    assert node.alive(victim) and not os.path.exists(node.audit)


@needs_sim
def test_kill_by_name_then_rerun_is_unchanged(node):
    victim = node.spawn(0, 4096, argv=['trainer', '--big'])
    other = node.spawn(0, 1024, argv=['python', 'serve.py'])
    result = run_module(node, {'name': '^trainer$'})
    assert result['changed'] is True and not result.get('failed')
    assert pids(result['killed']) == [victim] and result['killed'][0]['signals'] == ['SIGTERM']
    assert result['freed_mib'] == {'0': 4096}
    assert result['msg'] == 'killed 1 process(es), skipped 0, failed 0; freed 4096 MiB'
    assert not node.alive(victim) and node.alive(other)
    again = run_module(node, {'name': '^trainer$'})
    assert again['changed'] is False and again['killed'] == []


@needs_sim
def test_check_mode_signals_nothing_and_matches_the_real_run(node):
    victims = [node.spawn(0, 1024, argv=['trainer']), node.spawn(1, 2048, argv=['trainer'], ignore_term=True)]
    node.spawn(1, 512, argv=['Xorg'])
    checked = run_module(node, {'gpus': ['0', '1'], 'all_on_gpus': True, 'force': True}, check_mode=True)
    assert checked['changed'] is True and pids(checked['killed']) == sorted(victims)
    assert [e['name'] for e in checked['skipped_processes']] == ['Xorg']
    assert all(node.alive(p) for p in victims) and not os.path.exists(node.audit)
    real = run_module(node, {'gpus': ['0', '1'], 'all_on_gpus': True, 'force': True, 'timeout': 0.5})
    assert pids(real['killed']) == pids(checked['killed'])
    assert real['freed_mib'] == {'0': 1024, '1': 2048}


@needs_sim
def test_diff_shows_the_processes_before_and_after(node):
    victim = node.spawn(0, 1024, argv=['trainer', '--epochs', '3'])
    survivor = node.spawn(0, 1024, argv=['stubborn'], ignore_term=True)
    result = run_module(node, {'gpus': ['0'], 'all_on_gpus': True, 'timeout': 0.5}, diff=True)
    diff = result['diff']
    assert diff['before'] == '%d root stubborn\n%d root trainer --epochs 3\n' % (survivor, victim) or \
        diff['before'] == '%d root trainer --epochs 3\n%d root stubborn\n' % (victim, survivor)
    assert diff['after'] == '%d root stubborn\n' % survivor
    assert result['failed'] is True  # a survivor fails the task
    assert pids(result['failed_processes']) == [survivor] and 'force=true' in result['failed_processes'][0]['reason']
    checked = run_module(node, {'pids': [survivor]}, check_mode=True, diff=True)
    assert checked['diff']['before'] == '%d root stubborn\n' % survivor and checked['diff']['after'] == ''


@needs_sim
def test_audit_log_lines_chain_and_name_the_actor(node):
    first = node.spawn(0, 512, argv=['trainer'])
    run_module(node, {'pids': [first]})
    second = node.spawn(1, 512, argv=['trainer'])
    run_module(node, {'name': 'trainer', 'force': True})
    run_module(node, {'name': 'trainer'})  # nothing left: no line
    assert audit_log.verify(node.audit) == {'valid': True, 'lines': 4, 'errors': []}
    with open(node.audit) as handle:
        lines = handle.read().splitlines()
    # per run: the signals (written before the release check), then the whole run
    assert '"event":"gpu_kill_signalled"' in lines[0] and '"event":"gpu_kill"' in lines[1] and '"actor":' in lines[1]
    assert str(second) in lines[3] and '"event":"gpu_kill_signalled"' in lines[2]


@needs_sim
def test_audit_log_can_be_disabled(node):
    victim = node.spawn(0, 512)
    result = run_module(node, {'pids': [victim], 'audit_log': ''})
    assert pids(result['killed']) == [victim] and not os.path.exists(node.audit)


@needs_sim
def test_protected_processes_are_reported_skipped(node):
    engine = node.spawn(0, 300, argv=['nv-hostengine'])
    result = run_module(node, {'pids': [engine], 'force': True})
    assert result['changed'] is False and result['killed'] == []
    assert result['skipped_processes'][0]['reason'] == 'protected name nv-hostengine (protect_names)'
    assert 'skipped' not in result and 'failed' not in result  # Ansible's own status keys stay unset
    assert node.alive(engine)


@needs_sim
def test_idle_for_through_the_module(node):
    idle = node.spawn(0, 1024, util=0)
    busy = node.spawn(0, 1024, util=50)
    first = run_module(node, {'idle_for': '1s'}, check_mode=True)
    assert first['changed'] is False and first['killed'] == []
    assert os.path.exists(node.history)  # check mode records samples too
    time.sleep(1.2)
    second = run_module(node, {'idle_for': '1s'})
    assert pids(second['killed']) == [idle] and node.alive(busy)


@needs_sim
def test_pids_and_users_that_lead_nowhere_are_warnings_not_a_silent_ok(node, monkeypatch):
    from ansible.module_utils import basic  # pylint: disable=import-outside-toplevel
    warned = []
    monkeypatch.setattr(basic.AnsibleModule, 'warn', lambda self, text: warned.append(text))
    gone = h.unused_pid()
    result = run_module(node, {'pids': [gone, 1], 'users': ['nosuchuser-gpufleet']})
    assert not result.get('failed') and result['changed'] is False and result['killed'] == []
    reasons = dict((e['value'], e['reason']) for e in result['unmatched'])
    assert reasons[gone] == 'no process with pid %d exists here (it has exited, or never existed)' % gone
    assert 'pid 1 is never signalled' in reasons[1]
    assert reasons['nosuchuser-gpufleet'].startswith('no user nosuchuser-gpufleet exists on this node')
    assert set(warned) == set(reasons.values())
    assert '3 request(s) led nowhere' in result['msg']


WALLET = '44AFFq5kSiGBoZ4NMDwYtN18obc8AemS33DBLWs3H7otXft3XjrpDtQGv7SqSsaBYBb98uNbr2VBBEt7f2wfn3RVGQBEP3A'


@needs_sim
def test_rogue_returns_the_findings_it_acted_on_as_gpu_audit_reports_them(node, tmp_path):
    """One call audits, kills and proves the release (rogue_cleanup's one round trip): the findings come from the
    detection that selected, every level, holders included, the same as gpu_audit's on the same node."""
    from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_audit  # pylint: disable=import-outside-toplevel
    miner = node.spawn(1, 4096, util=100, children=1,
                       argv=['python', 'train.py', '--url', 'stratum+tcp://pool.example.net:3333', '--user', WALLET, '-p', 'x'])
    legit = node.spawn(0, 2048, util=90, argv=['python', 'train.py', '--epochs', '3'])
    detector = {'history_path': str(tmp_path / 'none.db'), 'require_allocation': 'never'}
    audit = h.run_main(gpu_audit.main, dict(detector), check_mode=True)
    checked = run_module(node, dict(detector, rogue=True, force=True), check_mode=True)
    assert checked['changed'] is True and not checked.get('failed'), checked
    strip = ('notes',)
    assert ([dict((k, v) for k, v in f.items() if k not in strip) for f in checked['findings']]
            == [dict((k, v) for k, v in f.items() if k not in strip) for f in audit['findings']])
    critical = [f for f in checked['findings'] if f['level'] == 'critical']
    child = [f['pid'] for f in critical if not f['listed']]
    assert [f['pid'] for f in critical if f['listed']] == [miner] and len(child) == 1   # the child: a holder
    assert legit not in [f['pid'] for f in critical]
    assert checked['rogue_summary'] == dict(audit['summary'])
    assert pids(checked['killed']) == sorted([miner] + child)   # the miner and (tree) its child, nothing else
    assert node.alive(miner) and node.alive(legit) and not os.path.exists(node.audit)   # check mode signals nothing

    real = run_module(node, dict(detector, rogue=True, force=True, timeout=1))
    assert pids(real['killed']) == pids(checked['killed']) and real['freed_mib'] == {'1': 4096}, real
    assert [f['pid'] for f in real['findings'] if f['level'] == 'critical' and f['listed']] == [miner]
    assert not node.alive(miner) and node.alive(legit)
    again = run_module(node, dict(detector, rogue=True, force=True))
    assert again['changed'] is False and again['killed'] == [] and again['rogue_summary']['critical'] == 0


@needs_sim
def test_without_rogue_no_findings_are_returned(node):
    node.spawn(0, 1024, argv=['trainer'])
    result = run_module(node, {'name': '^nothing-matches$'})
    assert 'findings' not in result and 'rogue_summary' not in result
