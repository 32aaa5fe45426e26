# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The guard's ``remediation`` policy section: validation, and the ladder in a tick (dry-run predicts,
enforce acts, the next tick changes nothing).  Constructed snapshots only: nothing is signalled or reset."""

from __future__ import annotations

import functools
import json
import os

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes, xid
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import remediate as rem
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import MONDAY_NOON, snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_guard import Node

POLICY = '''
mode: %s
notify: {tty: false}
remediation:
  enabled: true
  reboot_flag: %s
  drain_command: [/bin/true]
'''


@pytest.fixture(autouse=True)
def no_scheduler_here(monkeypatch):
    """The ladder in these ticks drains through its hook: a slurmd this machine runs (another test's simulated fleet)
    is not the test's, and its Slurm is not asked (the partition check, core/budget.py)."""
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import remediate
    monkeypatch.setattr(remediate, 'scheduler_daemon', lambda: None)


def test_the_section_is_off_unless_enabled_and_validated_field_by_field():
    assert P.parse_policy({}).remediation.enabled is False
    assert P.parse_policy({'remediation': True}).remediation.enabled is True
    section = P.parse_policy({'remediation': {'stop_services': 'auto', 'verify_timeout': '2m', 'reboot_flag': False,
                                              'kill_application_xids': False}}).remediation
    assert (section.enabled, section.stop_services, section.verify_timeout, section.reboot_flag,
            section.kill_application_xids) == (True, ['auto'], 120.0, None, False)


@pytest.mark.parametrize('section, field, why', [
    ({'drain_command': '/usr/bin/drain --now'}, 'remediation.drain_command', 'never a shell line'),
    ({'drain_command': ['drain']}, 'remediation.drain_command', 'absolute path'),
    ({'reboot_flag': 'flag'}, 'remediation.reboot_flag', 'absolute path'),
    ({'reset': 'yes'}, 'remediation.reset', ''),
    ({'stop_services': ['dcgm; reboot']}, 'remediation.stop_services', 'not a systemd unit name'),
    ({'orphan_threshold_mib': -1}, 'remediation.orphan_threshold_mib', 'whole number'),
    ({'verify_timeout': 60}, 'remediation.verify_timeout', ''),
    ({'node_name': 'a b'}, 'remediation.node_name', 'node name'),
    ({'bogus': 1}, 'remediation.bogus', 'unknown key'),
    ({'max_resets': -1}, 'remediation.max_resets', 'whole number'),
    ({'max_resets': 101}, 'remediation.max_resets', 'from 0 to 100'),
    ({'max_resets': 'two'}, 'remediation.max_resets', 'whole number'),
    ({'window': '0s'}, 'remediation.window', 'more than 0'),
    ({'window': '8d'}, 'remediation.window', 'at most 7d'),
    ({'window': 3600}, 'remediation.window', 'unit'),
    ({'max_drained_pct': 150}, 'remediation.max_drained_pct', 'percentage from 0 to 100'),
    ({'max_drained_pct': -1}, 'remediation.max_drained_pct', 'percentage from 0 to 100'),
    ({'max_drained_pct': 'half'}, 'remediation.max_drained_pct', 'percentage'),
])
def test_an_invalid_section_names_the_field(section, field, why):
    with pytest.raises(P.PolicyError) as exc:
        P.parse_policy({'remediation': section})
    assert field in str(exc.value) and why in str(exc.value)


def test_the_budget_keys_default_to_2_resets_per_24h_and_half_a_partition_and_reach_the_ladder(tmp_path):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard
    section = P.parse_policy({'remediation': True}).remediation
    assert (section.max_resets, section.window, section.max_drained_pct) == (2, 86400.0, 50.0)
    policy = P.parse_policy({'remediation': {'max_resets': 1, 'window': '6h', 'max_drained_pct': 25}})
    budget = guard.remediation_options(policy, guard.Paths(root=str(tmp_path))).budget
    assert budget.to_dict() == {'max_resets': 1, 'window_s': 21600.0, 'max_drained_pct': 25.0}
    assert budget.fields == ('remediation.max_resets', 'remediation.window', 'remediation.max_drained_pct')
    assert 'remediation.max_resets 1' in budget.reset_refusal([{'action': 'reset', 'gpu': 'g', 'time': 100.0}], 'g', 200.0)


def remediation_records(node):
    if not os.path.exists(node.paths.log):
        return []
    return [r for r in node.log() if r['event'] == 'guard_remediation']


@pytest.fixture
def own_scheduler(tmp_path, monkeypatch):
    """The ladder reads the scheduler from a process table of the test's own, which holds a user's slurmd only (the
    host's may hold a real slurmd: the simulated Slurm fleet starts one), so its drain is the drain_command."""
    with h.a_user_named_slurmd(str(tmp_path / 'proc')) as proc_root:
        monkeypatch.setattr(rem, 'scheduler_daemon', functools.partial(processes.scheduler_daemon, proc_root))
        yield


@pytest.mark.usefixtures('own_scheduler')
def test_a_tick_predicts_in_dry_run_acts_in_enforce_and_then_changes_nothing(tmp_path):
    flag = str(tmp_path / 'lib' / 'reboot-wanted')
    snap = snapshot(gpus=3)
    snap.all_devices[2].add_xid_event(xid.make_event(79, 'kmsg', time_s=MONDAY_NOON, message='GPU has fallen off the bus.'))
    node = Node(tmp_path, policy=POLICY % ('dry-run', flag), snap=snap)
    summary = node.tick()
    assert summary['rc'] == 0
    ladder = summary['remediation']['gpus'][2]['ladder']
    assert [(s['step'], s['status']) for s in ladder] == [('drain', 'node_would_run'), ('reboot_flag', 'node_would_write')]
    assert not os.path.exists(flag)
    records = remediation_records(node)
    assert [(r.get('step'), r.get('status'), r['check_mode']) for r in records] == [
        ('drain', 'node_would_run', True), ('reboot_flag', 'node_would_write', True),
        ('drain', 'would_run', True), ('reboot_flag', 'would_write', True)]
    assert records[1]['findings'][0]['code'] == 79 and records[1]['evidence']['code'] == 79

    node.write_policy(POLICY % ('enforce', flag))
    summary = node.tick(advance=60)
    assert summary['remediation']['changed'] is True and summary['remediation']['node']['drain']['status'] == 'done'
    with open(flag) as handle:
        assert 'Xid 79' in json.dumps(json.load(handle)['gpus'])
    with open(node.paths.metrics) as handle:   # the metric and the ladder's flag agree; the steps are counted
        text = handle.read()
    assert 'gpufleet_guard_remediation_steps_total{step="drain"} 1' in text
    assert 'gpufleet_guard_remediation_steps_total{step="reboot_flag"} 1' in text
    wanted = [line for line in text.splitlines() if line.startswith('gpufleet_gpu_reboot_wanted{')]
    assert [line.split()[-1] for line in wanted] == ['0', '0', '1'], wanted
    count = len(remediation_records(node))
    summary = node.tick(advance=60)
    assert summary['remediation']['changed'] is False and len(remediation_records(node)) == count
    assert summary['remediation']['gpus'][2]['status'] == 'awaiting_reboot'


def test_without_the_section_a_tick_runs_no_ladder(tmp_path):
    snap = snapshot(gpus=1)
    snap.all_devices[0].add_xid_event(xid.make_event(79, 'nvml', time_s=MONDAY_NOON))
    summary = Node(tmp_path, policy='mode: enforce\nnotify: {tty: false}\n', snap=snap).tick()
    assert summary['rc'] == 0 and 'remediation' not in summary


def test_every_error_of_the_section_is_reported():
    with pytest.raises(P.PolicyError) as exc:
        P.parse_policy({'remediation': {'drain_command': 'drain --now', 'reboot_flag': 'flag', 'reset': 'yes', 'bogus': 1}})
    text = str(exc.value)
    for field in ('remediation.drain_command', 'remediation.reboot_flag', 'remediation.reset', 'remediation.bogus'):
        assert field in text, (field, text)


def test_with_the_section_the_tick_reads_health_from_after_each_gpus_last_verified_reset(tmp_path):
    """The Xid that asked for a reset stays in the kernel log: the tick's snapshot leaves it out of that GPU's health."""
    snap = snapshot(gpus=2)
    node = Node(tmp_path, policy=POLICY % ('enforce', str(tmp_path / 'lib' / 'reboot-wanted')), snap=snap)
    now = node.clock.now
    os.makedirs(os.path.dirname(node.paths.state), exist_ok=True)
    with open(os.path.join(os.path.dirname(node.paths.state), 'remediation.json'), 'w') as handle:
        json.dump({'handled': {}, 'drained': None, 'reset_at': {snap.all_devices[1].key: now - 60}}, handle)
    seen = {}

    def take_snapshot(**kwargs):
        seen.update(kwargs)
        return snap
    assert node.tick(snapshot=None, take_snapshot=take_snapshot)['rc'] == 0
    since = seen['xid_since']
    assert since(snap.all_devices[1]) == now - 60 and since(snap.all_devices[0]) is None
    seen.clear()
    node.write_policy('mode: enforce\nnotify: {tty: false}\n')   # without the section: the default window
    node.tick(snapshot=None, take_snapshot=take_snapshot)
    assert seen['xid_since'] is None
