# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""MIG (issue #19) against the simulator: facts per instance, MIG selectors, policy counting, reset with recreate.

The node: GPU 0 in MIG mode (3g.71gb, 2g.35gb, 1g.18gb), alice and bob on GI 1, bob on GI 2; GPU 1 without MIG,
alice on it.  Every process is a gpusim workload of this test (gpusim kill-all ends them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import reset as core_reset
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import MigUnit
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.policy import evaluate, parse_policy
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.reclaim import ReclaimOptions, reclaim
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam

pytestmark = [h.needs_gpusim, h.needs_root]

LAYOUT = '0:3g.71gb,2g.35gb,1g.18gb'


@pytest.fixture
def node():
    redteam.ensure_users()
    with h.gpusim_node(gpus=2, init_args=('--mig', LAYOUT)) as sim:
        sim.procs = {
            'alice_gi1': _spawn(sim, 0, 4096, 'alice', '1'),
            'bob_gi1': _spawn(sim, 0, 2048, 'bob', '1'),
            'bob_gi2': _spawn(sim, 0, 8000, 'bob', '2'),
            'alice_gpu1': _spawn(sim, 1, 1000, 'alice', None),
        }
        yield sim


def _spawn(sim, gpu, mib, user, instance):
    args = ['spawn', '--gpu', gpu, '--mib', mib, '--user', user]
    if instance is not None:
        args += ['--mig-instance', instance]
    pid = int(sim.gpusim(*(args + ['--', 'python', 'train.py'])).strip())
    sim.pids.append(pid)
    return pid


def _snapshot(sim):
    return take_snapshot(vendor='nvidia', dev_roots=sim.dev_roots)


def test_facts_match_gpusim_show_per_instance(node):
    facts = _snapshot(node).to_facts()
    shown = node.show()['gpus']
    board, plain = facts['devices']
    assert board['mig_mode'] is True and plain['mig_mode'] is False and plain['mig_devices'] is None
    want = [(i['gi'], i['ci'], i['profile'], i['uuid'], i['memory_mib'], i['used_mib'], sorted(i['processes']))
            for i in shown[0]['mig_instances']]
    got = [(m['gpu_instance_id'], m['compute_instance_id'], m['profile'], m['uuid'], m['memory_total_mib'],
            m['memory_used_mib'], m['processes']) for m in board['mig_devices']]
    assert got == want
    assert [m['placement'] for m in board['mig_devices']] == [{'start': 0, 'size': 4}, {'start': 4, 'size': 2},
                                                              {'start': 6, 'size': 1}]
    # the board's figure holds the instances' memory once
    assert board['memory_used_mib'] == shown[0]['used_mib'] == sum(m['memory_used_mib'] for m in board['mig_devices'])
    assert board['orphaned_mib'] == 0 and all(m['orphaned_mib'] == 0 for m in board['mig_devices'])
    by_pid = dict((p['pid'], p) for p in facts['processes'])
    gi1 = board['mig_devices'][0]
    assert by_pid[node.procs['alice_gi1']]['mig'] == {'gpu_instance_id': 1, 'compute_instance_id': 0, 'uuid': gi1['uuid']}
    assert by_pid[node.procs['bob_gi2']]['mig']['gpu_instance_id'] == 2
    assert by_pid[node.procs['alice_gpu1']]['mig'] is None
    assert by_pid[node.procs['bob_gi1']]['used_mib'] == 2048   # not doubled by the board and the MIG lists


def test_attribution_ignores_capability_files_a_user_opens(node):
    """A process that opens another instance's /dev/nvidia-caps files is not put on that instance."""
    caps = sorted(os.listdir(os.path.join(node.dev, 'nvidia-caps')))
    assert caps, 'gpusim --create-dev-files made no capability files'
    kids = h.Children()
    try:
        holder = kids.sleeper(open_files=[os.path.join(node.dev, 'nvidia-caps', name) for name in caps])
        snap = _snapshot(node)
        assert snap.process(holder.pid) is None
        assert all(holder.pid not in m.pids for m in snap.devices[0].mig_devices)
    finally:
        kids.close()


def test_non_root_board_aggregate_unknown_with_note(node):
    python = h.python_for_user('nobody')
    if python is None:
        pytest.skip('no interpreter that nobody can run with pynvml')
    exe, extra = python
    code = ('import json, sys; sys.path.insert(0, %r); from core.snapshot import take_snapshot; '
            'print(json.dumps(take_snapshot(vendor="nvidia", dev_roots=[%r]).to_facts()))' % (h.MODULE_UTILS_DIR, node.dev))
    env = h.shim_env(node.state)
    env['PYTHONPATH'] = extra
    out = subprocess.run([exe, '-c', code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, check=True,
                         **h._as_user('nobody'))  # pylint: disable=protected-access
    board = json.loads(out.stdout.decode())['devices'][0]
    assert board['memory_used_mib'] is None and board['orphaned_mib'] is None
    assert any('MIG mode' in reason and 'root only' in reason for reason in board['health']['reasons'])
    assert 'reading_failed' not in board['health_reasons']
    assert [m['memory_used_mib'] for m in board['mig_devices']] == [6144, 8000, 0]
    assert board['processes'] == sorted([node.procs['alice_gi1'], node.procs['bob_gi1'], node.procs['bob_gi2']])


@pytest.mark.parametrize('form', ['uuid', 'gpu_gi', 'gpu_gi_ci'])
def test_selector_mig_forms(node, form):
    snap = _snapshot(node)
    gi1 = snap.devices[0].mig_devices[0]
    value = {'uuid': gi1.uuid, 'gpu_gi': '0:1', 'gpu_gi_ci': '0:1:0'}[form]
    matches = Selector(gpus=[value], all_on_gpus=True).select(snap)
    assert sorted(m.proc.pid for m in matches) == sorted([node.procs['alice_gi1'], node.procs['bob_gi1']])
    assert matches[0].reasons == ['on GPU 0:1 (all_on_gpus)']
    # a whole board still selects every instance's processes
    assert len(Selector(gpus=['0'], all_on_gpus=True).select(snap)) == 3


def test_selector_unknown_mig_device_names_the_known_ones(node):
    snap = _snapshot(node)
    with pytest.raises(InvalidArgument) as info:
        Selector(gpus=['0:7'], users=['bob']).select(snap)
    assert "'0:7'" in str(info.value) and 'MIG devices here: 0:1 (MIG-' in str(info.value)
    with pytest.raises(InvalidArgument):
        Selector(gpus=['MIG-00000000-0000-5000-8000-000000000000'], users=['bob']).select(snap)


def test_kill_by_mig_uuid_kills_only_that_instance_and_memory_comes_back(node):
    uuid = node.show()['gpus'][0]['mig_instances'][0]['uuid']
    result = reclaim(Selector(gpus=[uuid], all_on_gpus=True), ReclaimOptions(timeout=5, release_timeout=10),
                     dev_roots=node.dev_roots)
    assert sorted(e['pid'] for e in result['killed']) == sorted([node.procs['alice_gi1'], node.procs['bob_gi1']])
    assert not result['unreleased']
    assert node.alive(node.procs['bob_gi2']) and node.alive(node.procs['alice_gpu1'])
    after = _snapshot(node).devices[0].mig_devices
    assert [m.memory_used_mib for m in after] == [0, 8000, 0]


def test_per_user_limits_count_mig_devices(node):
    snap = _snapshot(node)
    policy = parse_policy({'users': {'bob': {'max_mem_gib_per_gpu': 7, 'max_gpus': 1},
                                     'alice': {'max_mem_gib_per_gpu': 3.5}}}, 'policy')
    found = dict(((v.rule, v.user), v) for v in evaluate(policy, snap, {}, now=snap.taken_at))
    per_gpu = found[('max_mem_per_gpu', 'bob')]    # 8000 MiB on 0:2; the 2048 on 0:1 is another instance
    assert (per_gpu.gpu, per_gpu.measured, per_gpu.pids) == ('0:2', 8000, [node.procs['bob_gi2']])
    assert 'on GPU 0:2' in per_gpu.message
    assert isinstance(per_gpu.gpu, MigUnit) and json.loads(json.dumps(per_gpu.to_dict()))['gpu'] == '0:2'
    max_gpus = found[('max_gpus', 'bob')]          # two MIG devices of one board count as two GPUs
    assert (max_gpus.measured, max_gpus.limit) == (2, 1)
    alice = found[('max_mem_per_gpu', 'alice')]     # 4096 MiB on 0:1 over 3.5 GiB; 1000 MiB on GPU 1 is fine
    assert (alice.gpu, alice.measured) == ('0:1', 4096)
    assert ('max_mem_per_gpu', 'alice') in found and len([v for v in found.values() if v.user == 'alice']) == 1


def test_reservation_by_mig_uuid_covers_only_that_instance(node):
    snap = _snapshot(node)
    uuid = snap.devices[0].mig_devices[1].uuid    # GI 2: bob's
    policy = parse_policy({'gpus': {uuid: {'reserved_for': ['alice']}}}, 'policy')
    violations = [v for v in evaluate(policy, snap, {}, now=snap.taken_at) if v.rule == 'gpu_reserved']
    assert [(v.gpu, v.user, v.pids) for v in violations] == [('0:2', 'bob', [node.procs['bob_gi2']])]


@pytest.mark.parametrize('form', ['gpu_gi', 'gpu_gi_ci', 'uuid'])
def test_policy_gpus_key_takes_the_selector_forms(node, form):
    """A ``gpus:`` key ``0:2`` / ``0:2:0`` / the MIG UUID covers GI 2 only, as ``gpu_kill gpus=`` would select it."""
    snap = _snapshot(node)
    key = {'gpu_gi': '0:2', 'gpu_gi_ci': '0:2:0', 'uuid': snap.devices[0].mig_devices[1].uuid}[form]
    policy = parse_policy({'gpus': {key: {'reserved_for': ['alice'], 'max_mem_gib_total': 7}}}, 'policy')
    found = sorted((v.rule, v.gpu, v.pids) for v in evaluate(policy, snap, {}, now=snap.taken_at))
    assert found == [('gpu_max_mem_total', '0:2', [node.procs['bob_gi2']]), ('gpu_reserved', '0:2', [node.procs['bob_gi2']])]
    selected = Selector(gpus=[key], all_on_gpus=True).select(snap)
    assert [m.proc.pid for m in selected] == [node.procs['bob_gi2']]
    # a key naming an instance this board lacks matches nothing (a fleet-wide policy names instances of other nodes)
    assert evaluate(parse_policy({'gpus': {'0:7': {'reserved_for': ['alice']}}}, 'policy'), snap, {}, now=snap.taken_at) == []


def test_allowed_and_blocked_gpus_per_mig_device(node):
    snap = _snapshot(node)
    bob_gi1, bob_gi2 = node.procs['bob_gi1'], node.procs['bob_gi2']

    def access(limits):
        policy = parse_policy({'users': {'bob': limits}}, 'policy')
        return sorted((v.pids, v.measured) for v in evaluate(policy, snap, {}, now=snap.taken_at) if v.rule == 'gpu_access')
    assert access({'allowed_gpus': '0:1'}) == [([bob_gi2], ['0:2'])]
    assert access({'allowed_gpus': ['0:1:0', snap.devices[0].mig_devices[1].uuid]}) == []
    assert access({'allowed_gpus': [0]}) == []                     # the board covers its instances
    assert access({'allowed_gpus': [1]}) == [([bob_gi1], ['0:1']), ([bob_gi2], ['0:2'])]
    assert access({'blocked_gpus': '0:2'}) == [([bob_gi2], ['0:2'])]
    assert access({'blocked_gpus': [snap.devices[0].uuid]}) == [([bob_gi1], ['0:1']), ([bob_gi2], ['0:2'])]
    assert access({'blocked_gpus': '1, 0:3'}) == []


def _reset(node, check_mode, **options):
    """The reset item of GPU 0 (None when when_needed selects nothing)."""
    host = core_reset.Host(dev_roots=list(node.dev_roots), tools={'nvidia-smi': os.path.join(h.sim_dir(), 'bin', 'nvidia-smi'),
                                                                  'systemctl': None, 'scontrol': None})
    resets = core_reset.reset(core_reset.ResetOptions(gpus=['0'], **options), host, check_mode=check_mode)['resets']
    return resets[0] if resets else None


def test_reset_explains_and_refuses_without_recreate(node):
    item = _reset(node, check_mode=True)
    assert item['status'] == 'refused'
    check = [c for c in item['preconditions'] if c['name'] == 'mig'][0]
    assert check['status'] == 'fail' and 'mig_reset: recreate' in check['detail']
    assert 'GPU instance 1 / compute instance 0 (3g.71gb' in check['detail']
    assert [(d['gpu_instance_id'], d['profile'], d['processes']) for d in item['mig']['destroys']] == [
        (1, '3g.71gb', sorted([node.procs['alice_gi1'], node.procs['bob_gi1']])), (2, '2g.35gb', [node.procs['bob_gi2']]),
        (3, '1g.18gb', [])]
    assert node.show()['gpus'][0]['reset_count'] == 0


def test_reset_recreate_records_resets_recreates_and_verifies(node, monkeypatch):
    before = node.show()['gpus'][0]['mig_instances']
    monkeypatch.setenv('PATH', os.path.join(h.sim_dir(), 'bin') + os.pathsep + os.environ.get('PATH', ''))
    item = _reset(node, check_mode=False, mig_reset='recreate', kill_processes=True, verify_timeout=10)
    assert item['status'] == 'reset', item['error']
    assert item['mig']['error'] is None and len(item['mig']['recreated']) == 3
    after = node.show()['gpus'][0]
    assert after['reset_count'] == 1
    assert [(i['profile'], i['placement'], i['ci']) for i in after['mig_instances']] == \
        [(i['profile'], i['placement'], i['ci']) for i in before]
    assert node.alive(node.procs['alice_gpu1'])      # the other board was not touched
    facts = _snapshot(node).to_facts()['devices'][0]
    assert [m['profile'] for m in facts['mig_devices']] == ['3g.71gb', '2g.35gb', '1g.18gb']


@pytest.fixture
def slow_mig_node():
    """GPU 0 in MIG mode whose driver keeps a dead workload's memory for two minutes (an orphan on its MIG device)."""
    redteam.ensure_users()
    with h.gpusim_node(gpus=2, release_delay_ms=120000, init_args=('--mig', LAYOUT)) as sim:
        yield sim


def test_when_needed_decides_on_each_mig_devices_orphaned_memory(slow_mig_node):
    sim = slow_mig_node
    assert _reset(sim, check_mode=True, when_needed=True, orphan_threshold_mib=1024) is None
    sim.gpusim('leak', '--gpu', '0', '--mib', '4096')   # on the board, in no instance: not an instance's orphan
    assert _reset(sim, check_mode=True, when_needed=True, orphan_threshold_mib=1024) is None
    small, big = _spawn(sim, 0, 512, 'bob', '3'), _spawn(sim, 0, 6000, 'alice', '2')
    for pid in (small, big):
        os.kill(pid, 9)   # a workload of this test; its supervisor records the exit, the memory stays
    h.wait_for(lambda: sim.show()['gpus'][0]['mig_instances'][2]['processes'] == []
               and sim.show()['gpus'][0]['mig_instances'][1]['processes'] == [], timeout=10)
    migs = _snapshot(sim).devices[0].mig_devices
    assert [m.orphaned_mib for m in migs] == [0, 6000, 512]
    item = _reset(sim, check_mode=True, when_needed=True, orphan_threshold_mib=1024)
    assert [r for r in item['selected_because'] if 'MiB' in r] == [
        '6000 MiB of GPU memory on MIG device 0:2 (2g.35gb) held by no process (orphan_threshold_mib 1024)']
    assert _reset(sim, check_mode=True, when_needed=True, orphan_threshold_mib=8000) is None


def test_release_wait_as_non_root_reads_the_mig_devices_memory(node):
    """As non-root the board's memory is unknown: the wait reads the killed process's MIG device instead."""
    victim = node.procs['bob_gi2']
    result = h.run_reclaim_as('bob', node.state, {'pids': [victim]}, {'timeout': 5, 'release_timeout': 10}, node.dev_roots)
    assert [e['pid'] for e in result['killed']] == [victim]
    assert result['unreleased'] == [] and result['release']['0']['released'] is True
    assert result['freed_mib'] == {'0': 8000}
    assert node.alive(node.procs['bob_gi1']) and [m.memory_used_mib for m in _snapshot(node).devices[0].mig_devices] == [
        6144, 0, 0]


def test_release_wait_on_a_mig_device_reports_what_its_driver_keeps(slow_mig_node):
    sim = slow_mig_node
    victim, other = _spawn(sim, 0, 2048, 'bob', '1'), _spawn(sim, 0, 1000, 'bob', '2')
    result = h.run_reclaim_as('bob', sim.state, {'pids': [victim]}, {'timeout': 5, 'release_timeout': 1}, sim.dev_roots)
    assert [e['pid'] for e in result['killed']] == [victim] and sim.alive(other)
    (unreleased,) = result['unreleased']
    assert (unreleased['gpu'], unreleased['unreleased_mib']) == (0, 2048)
    # bob's process on GI 2 holds the board's device file, but the driver lists it on another MIG device: not the cause
    assert str(other) not in unreleased['cause'] and 'leak' in unreleased['cause'], unreleased['cause']


def test_nvitop_agrees_on_the_instances(node):
    code = ('import json; from nvitop import Device; b = Device(0); '
            'print(json.dumps([[m.gpu_instance_id(), m.compute_instance_id(), m.uuid(), m.memory_used() // 1048576, '
            'sorted(m.processes())] for m in b.mig_devices()]))')
    env = h.shim_env(node.state)
    out = subprocess.run([sys.executable, '-c', code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
                         check=False)
    if out.returncode != 0 and b'No module named' in out.stderr:
        pytest.skip('nvitop is not installed')
    assert out.returncode == 0, out.stderr.decode(errors='replace')
    nvitop = json.loads(out.stdout.decode())
    ours = [[m.gpu_instance_id, m.compute_instance_id, m.uuid, m.memory_used_mib, m.pids]
            for m in _snapshot(node).devices[0].mig_devices]
    assert nvitop == ours
