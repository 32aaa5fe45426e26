# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.reclaim end to end against a simulated node: real workloads (``gpusim spawn``), the real
pynvml over the NVML shim, real signals, and the release of GPU memory confirmed through the shim.

SAFETY: the driver (the shim) lists only the workloads of the test's own state file, and the
device files live in the test's own temp dir, so a selection can only ever name processes the
test started; gpusim kill-all on that state cleans up.  Nothing is signalled by a pid read
from a file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, killer
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import identity as I
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import reclaim as core_reclaim
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.reclaim import ReclaimOptions, plan, reclaim
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import guard_test_helpers as fake

pytestmark = h.needs_gpusim
needs_root = h.needs_root


@pytest.fixture
def node():
    with h.gpusim_node(gpus=2) as sim:
        yield sim


@pytest.fixture
def slow_node():
    """Dead processes' memory stays used for 500 ms (the driver tearing down contexts)."""
    with h.gpusim_node(gpus=2, release_delay_ms=500) as sim:
        yield sim


def run(sim, check_mode=False, snapshot=None, **kwargs):
    """reclaim() on ``sim``: Selector keywords plus ReclaimOptions keywords (short timeouts)."""
    option_names = ('signal', 'timeout', 'force', 'tree', 'release_timeout', 'protect_names', 'protect_users',
                    'audit_path', 'history_path', 'kill_timeout', 'max_kills')
    options = dict((k, kwargs.pop(k)) for k in list(kwargs) if k in option_names)
    options.setdefault('timeout', 5)
    options.setdefault('release_timeout', 5)
    return reclaim(Selector(**kwargs), ReclaimOptions(**options), check_mode=check_mode, snapshot=snapshot,
                   dev_roots=sim.dev_roots)


def pids(entries):
    return sorted(e['pid'] for e in entries)


# ---------------------------------------------------------------------------- escalation
def test_term_honouring_process_exits_and_its_memory_is_freed(node):
    victim = node.spawn(0, 4096)
    bystander = node.spawn(0, 1024, argv=['python', 'serve.py'])
    result = run(node, pids=[victim])
    assert result['changed'] is True
    (entry,) = result['killed']
    assert (entry['pid'], entry['signals'], entry['used_mib'], entry['gpu_indexes']) == (victim, ['SIGTERM'], 4096, [0])
    assert entry['user'] == 'root' and entry['cmdline'] == ['python', 'train.py'] and entry['name'] == 'python'
    assert entry['seconds_to_exit'] is not None and entry['seconds_to_release'] is not None
    assert entry['selected_because'] == ['pid %d requested' % victim]
    assert result['freed_mib'] == {'0': 4096}
    assert result['release']['0']['released'] is True and result['unreleased'] == []
    assert result['msg'] == 'killed 1 process(es), skipped 0, failed 0; freed 4096 MiB'
    assert not node.alive(victim) and node.alive(bystander)
    assert node.used_mib(0) == 1024


def test_rerun_changes_nothing(node):
    victim = node.spawn(0, 2048)
    assert run(node, pids=[victim])['changed'] is True
    again = run(node, pids=[victim])
    assert again['changed'] is False
    assert again['killed'] == [] and again['failed'] == [] and again['freed_mib'] == {}
    gone = 'no process with pid %d exists here (it has exited, or never existed)' % victim
    assert again['msg'] == 'killed 0 process(es), skipped 0, failed 0; freed 0 MiB; 1 request(s) led nowhere: ' + gone
    assert again['unmatched'] == [{'request': 'pid', 'value': victim, 'reason': gone}] and again['warnings'] == [gone]


def test_term_ignoring_process_fails_without_force(node):
    stubborn = node.spawn(0, 2048, ignore_term=True)
    result = run(node, pids=[stubborn], timeout=0.5)
    assert result['changed'] is True  # a signal was sent
    (entry,) = result['failed']
    assert entry['signals'] == ['SIGTERM']
    assert 'still running 0.5 s after SIGTERM; use force=true' in entry['reason']
    assert result['killed'] == [] and result['freed_mib'] == {}
    assert node.alive(stubborn)


def test_term_ignoring_process_is_killed_with_force(node):
    stubborn = node.spawn(0, 2048, ignore_term=True)
    result = run(node, pids=[stubborn], timeout=0.5, force=True)
    (entry,) = result['killed']
    assert entry['signals'] == ['SIGTERM', 'SIGKILL']
    assert entry['seconds_to_exit'] >= 0.5  # SIGKILL only after the TERM timeout
    assert result['freed_mib'] == {'0': 2048} and not node.alive(stubborn)


def test_signal_kill_is_not_sent_twice(node):
    stubborn = node.spawn(0, 512, ignore_term=True)
    result = run(node, pids=[stubborn], signal='KILL', force=True)
    assert result['killed'][0]['signals'] == ['SIGKILL']


def test_many_processes_are_signalled_together(node):
    procs = [node.spawn(i % 2, 100 + i, ignore_term=bool(i % 2)) for i in range(20)]
    result = run(node, pids=procs, timeout=1, force=True)
    assert pids(result['killed']) == sorted(procs) and result['failed'] == []
    stubborn = [e for e in result['killed'] if e['signals'] == ['SIGTERM', 'SIGKILL']]
    assert len(stubborn) == 10
    assert result['freed_mib'] == {'0': sum(100 + i for i in range(0, 20, 2)), '1': sum(100 + i for i in range(1, 20, 2))}


def test_max_kills_signals_the_largest_first_and_holds_the_rest_with_a_family_whole(node):
    """The blast-radius limit's share of a node (issue #30): whole families in the kill order (most GPU memory first)."""
    small = [node.spawn(1, 100 + i) for i in range(3)]     # 100, 101, 102 MiB
    parent = node.spawn(0, 4096, children=2)
    big = node.spawn(1, 2048)
    kids = node.child_pids(parent)
    everything = sorted(small + [parent, big])
    plan_ = run(node, check_mode=True, pids=everything, max_kills=4)      # check mode predicts the same
    assert pids(plan_['killed']) == sorted([parent, big] + kids) and pids(plan_['held']) == sorted(small)
    done = run(node, pids=everything, max_kills=4)
    assert pids(done['killed']) == sorted([parent, big] + kids) and pids(done['held']) == sorted(small)
    assert all(e['reason'] == 'held: blast-radius limit (max_kills=4 on this node in this run)' and e['signals'] == []
               for e in done['held'])
    assert all(node.entry(pid)['alive'] for pid in small) and '3 held by max_kills=4' in done['msg']
    rest = run(node, check_mode=True, pids=small, max_kills=2)
    assert pids(rest['killed']) == sorted(small[1:]) and pids(rest['held']) == [small[0]]
    assert run(node, check_mode=True, pids=small, max_kills=0)['killed'] == []
    # a family of 3 does not fit in 2: it and everything after it are held, so the order stays the worst first
    family = node.spawn(0, 500, children=2)
    both = run(node, check_mode=True, pids=[family, small[0]], max_kills=2)
    assert both['killed'] == [] and pids(both['held']) == sorted([family, small[0]] + node.child_pids(family))
    with pytest.raises(InvalidArgument) as exc:
        ReclaimOptions(max_kills=-1)
    assert exc.value.field == 'max_kills'


# ---------------------------------------------------------------------------- trees and orphans
def test_tree_collects_children_before_the_first_signal(node):
    parent = node.spawn(0, 3072, children=3)
    kids = node.child_pids(parent)
    result = run(node, pids=[parent])
    assert pids(result['killed']) == sorted([parent] + kids)
    for entry in result['killed']:
        if entry['pid'] != parent:
            assert entry['parent_pid'] == parent
            assert entry['selected_because'] == ['child of selected pid %d (tree)' % parent]
            assert entry['gpu_indexes'] == [0]  # from the device file it holds
    assert result['freed_mib'] == {'0': 3072} and result['unreleased'] == []
    entry = node.entry(parent)
    assert not entry['alive'] and entry['children_alive'] == []


def test_children_left_by_tree_false_keep_the_memory_and_are_named(node):
    parent = node.spawn(0, 1500, children=2)
    kids = sorted(node.child_pids(parent))
    result = run(node, pids=[parent], tree=False, release_timeout=1)
    assert pids(result['killed']) == [parent]
    (unreleased,) = result['unreleased']
    assert unreleased['gpu'] == 0 and unreleased['unreleased_mib'] == 1500
    assert 'child process(es) %s' % ', '.join(map(str, kids)) in unreleased['cause'] and 'tree=true' in unreleased['cause']
    assert result['release']['0'] == {'released': False, 'freed_mib': 0, 'seconds': None, 'unreleased_mib': 1500}
    assert result['unreleased_mib'] == 1500 and '1500 MiB not released' in result['msg']
    assert sorted(node.entry(parent)['children_alive']) == kids


def test_orphans_left_behind_by_a_dead_parent_are_reclaimed(node):
    parent = node.spawn(1, 2048, children=2)
    kids = sorted(node.child_pids(parent))
    assert killer.send_signal(parent, node.entry(parent)['starttime'], signal.SIGKILL) == 'sent'
    h.wait_for(lambda: not node.alive(parent), what='the parent to die')
    assert node.used_mib(1) == 2048  # the children still hold it
    result = run(node, orphans=True)
    assert pids(result['killed']) == kids
    assert all(e['gpu_indexes'] == [1] and 'orphan' in e['selected_because'][0] for e in result['killed'])
    assert result['freed_mib'] == {'1': 2048} and result['release']['1']['released'] is True
    assert node.used_mib(1) == 0


# ---------------------------------------------------------------------------- exits, reuse, namespaces
def test_process_that_exits_between_discovery_and_signal_counts_as_gone(node):
    victim = node.spawn(0, 1024)
    snap = take_snapshot(dev_roots=node.dev_roots)
    assert killer.send_signal(victim, node.entry(victim)['starttime'], signal.SIGKILL) == 'sent'
    h.wait_for(lambda: not node.alive(victim), what='the workload to die')
    result = run(node, pids=[victim], snapshot=snap)
    (entry,) = result['killed']
    assert entry['signals'] == [] and entry['reason'] == 'exited by itself before it was signalled'
    assert result['changed'] is False  # nothing was signalled
    assert result['freed_mib'] == {'0': 1024}


def test_process_that_exits_by_itself_while_waiting_counts_as_gone(node):
    # Ignores SIGTERM but ends on its own after its lifetime: gone, not failed, without force.
    node.gpusim('spawn', '--gpu', 0, '--mib', 512, '--ignore-term', '--lifetime', 1.5, '--', 'python', 'short.py')
    result = run(node, name='python', timeout=10)
    (entry,) = result['killed']
    assert entry['signals'] == ['SIGTERM'] and result['failed'] == []
    assert result['freed_mib'] == {'0': 512}


def test_pid_reused_since_discovery_is_skipped_not_signalled(node):
    victim = node.spawn(0, 1024)
    snap = take_snapshot(dev_roots=node.dev_roots)
    snap.process(victim).starttime -= 1  # discovery saw another process under this pid
    result = run(node, pids=[victim], snapshot=snap, force=True)
    (entry,) = result['skipped']
    assert entry['pid'] == victim and 'reused' in entry['reason'] and entry['signals'] == []
    assert result['killed'] == [] and result['changed'] is False
    assert node.alive(victim)


def test_pid_reused_between_plan_and_signal_is_skipped(node, monkeypatch):
    victim = node.spawn(0, 1024)
    real_plan = core_reclaim.plan

    def plan_then_reuse(*args, **kwargs):
        decided = real_plan(*args, **kwargs)
        for v in decided.victims:
            v.starttime -= 1  # the pid now names a process that started at another time
        return decided

    monkeypatch.setattr(core_reclaim, 'plan', plan_then_reuse)
    result = run(node, pids=[victim], force=True)
    (entry,) = result['skipped']
    assert 'reused by another process before the signal' in entry['reason'] and entry['signals'] == []
    assert result['changed'] is False and node.alive(victim)


def test_pid_in_another_pid_namespace_is_never_signalled(node, tmp_path):
    # The driver lists host pids; a process table that does not show them is another PID namespace.
    victim = node.spawn(0, 1024)
    container_proc = tmp_path / 'proc'
    container_proc.mkdir()
    inventory = ProcessInventory(dev_roots=node.dev_roots, proc_root=str(container_proc))
    snap = take_snapshot(inventory=inventory)
    assert snap.process(victim).status == 'not_found'
    result = run(node, gpus=['0'], all_on_gpus=True, snapshot=snap, force=True)
    (entry,) = result['skipped']
    assert entry['pid'] == victim and 'not visible here (another PID namespace' in entry['reason']
    assert 'run this on the host' in entry['reason']
    assert result['killed'] == [] and result['changed'] is False and node.alive(victim)


def test_local_pid_that_holds_no_gpu_device_is_a_namespace_collision(node, tmp_path):
    victim = node.spawn(0, 1024)
    other_dev = tmp_path / 'dev'
    other_dev.mkdir()
    snap = take_snapshot(dev_roots=[str(other_dev)])  # the local pid holds none of "our" device files
    assert snap.process(victim).holds_gpu_device is False
    result = run(node, pids=[victim], snapshot=snap)
    assert 'holds no GPU device file' in result['skipped'][0]['reason']
    assert node.alive(victim)


# ---------------------------------------------------------------------------- protection
def test_protected_names_are_never_signalled(node):
    hostengine = node.spawn(0, 300, argv=['nv-hostengine', '-n'])
    exporter = node.spawn(0, 300, argv=['/usr/bin/dcgm-exporter'])
    job = node.spawn(0, 300, argv=['python', 'job.py'])
    result = run(node, gpus=['0'], all_on_gpus=True, force=True)
    assert pids(result['killed']) == [job]
    reasons = dict((e['pid'], e['reason']) for e in result['skipped'])
    assert reasons == {hostengine: 'protected name nv-hostengine (protect_names)',
                       exporter: 'protected name dcgm-exporter (protect_names)'}
    assert node.alive(hostengine) and node.alive(exporter)
    custom = run(node, gpus=['0'], all_on_gpus=True, protect_names=['nv-hostengine'], check_mode=True)
    assert pids(custom['killed']) == [exporter]


@needs_root
def test_protected_users_are_never_signalled(node):
    theirs = node.spawn(0, 300, user='nobody')
    mine = node.spawn(0, 300)
    result = run(node, gpus=['0'], all_on_gpus=True, protect_users=['nobody'])
    assert pids(result['killed']) == [mine]
    assert result['skipped'][0]['reason'] == 'protected user nobody (protect_users)'
    assert node.alive(theirs)


def test_a_non_root_caller_may_only_signal_its_own_processes(node):
    victim = node.spawn(0, 300)
    snap = take_snapshot(dev_roots=node.dev_roots)
    options = ReclaimOptions()
    protection = killer.Protection(euid=os.geteuid() + 4242)  # as if an unprivileged user called
    decided = plan(snap, Selector(pids=[victim]), options, protection)
    assert decided.victims == []
    assert 'a non-root caller may only signal its own processes' in decided.skipped[0]['reason']
    assert node.alive(victim)


@needs_root
def test_run_as_nobody_signals_only_nobodys_processes(node):
    if h.python_for_user('nobody') is None:
        pytest.skip('no Python interpreter that nobody may run')
    root_job = node.spawn(0, 700)
    nobody_job = node.spawn(0, 300, user='nobody')
    result = h.run_reclaim_as('nobody', node.state, {'gpus': ['0'], 'all_on_gpus': True},
                              {'timeout': 5, 'release_timeout': 5, 'force': True}, node.dev_roots)
    assert pids(result['killed']) == [nobody_job]
    (skipped,) = result['skipped']
    assert skipped['pid'] == root_job and 'owned by root; a non-root caller may only signal its own processes' in skipped['reason']
    assert result['freed_mib'] == {'0': 300}
    assert node.alive(root_job) and not node.alive(nobody_job)


def test_the_callers_own_tree_is_protected():
    protection = killer.Protection()
    assert 'itself' in protection.reason(killer.read_proc(os.getpid()))
    assert protection.reason(killer.read_proc(os.getppid())) is not None
    assert 'never' in protection.reason(killer.ProcInfo(1, 'init', 'S', 0, 1, 0, 1, 0, None, ['init']))


# A selected parent (its own session) and its children, each told by its first argument what it is: 'plain', 'nobody'
# (drops to nobody: root only), 'sshd' (a root process that names itself sshd) or 'session' (a session of its own).
FAMILY = r'''
import ctypes, os, sys, time
kinds = sys.argv[1:]
for kind in kinds:
    pid = os.fork()
    if pid == 0:
        if kind == 'nobody':
            os.setgid(65534); os.setgroups([]); os.setuid(65534)
        elif kind == 'sshd':
            ctypes.CDLL(None).prctl(15, b'sshd', 0, 0, 0)
        elif kind == 'session':
            os.setsid()
        time.sleep(600)
        os._exit(0)
    sys.stdout.write('%s %d\n' % (kind, pid))
sys.stdout.write('ready\n')
sys.stdout.flush()
time.sleep(600)
'''


def _settled(kind, pid):
    """True once the FAMILY child ``pid`` has become what ``kind`` says."""
    info = killer.read_proc(pid)
    if info is None:
        return False
    return {'sshd': info.comm == 'sshd', 'nobody': info.uid == 65534, 'session': info.session == pid}.get(kind, True)


def test_a_protected_child_of_a_selected_process_is_never_taken_with_its_tree():
    """tree=true collects a selected process's children; a protected one among them (protect_users, a system
    service's trusted name, the caller's own session) is skipped with its reason, like a selected one (issue 34)."""
    kinds = ['plain', 'session'] + (['nobody', 'sshd'] if os.geteuid() == 0 else [])
    parent = subprocess.Popen([sys.executable, '-c', FAMILY] + kinds, stdout=subprocess.PIPE, start_new_session=True)
    kids = {}
    try:
        for _kind in kinds:
            kind, pid = parent.stdout.readline().decode().split()
            kids[kind] = int(pid)
        assert parent.stdout.readline() == b'ready\n'
        h.wait_for(lambda: all(_settled(kind, pid) for kind, pid in kids.items()), what='the children to settle')
        protection = killer.Protection(protect_names=['sshd'], protect_users=['nobody'])
        protection.self_session = kids['session']   # the caller's session, as seen from that child
        info = killer.read_proc(parent.pid)
        snap = fake.snapshot([fake.proc(parent.pid, 'root', {0: 1024}, uid=info.uid, starttime=info.starttime)])
        decided = plan(snap, Selector(pids=[parent.pid]), ReclaimOptions(tree=True), protection)
        assert sorted(v.pid for v in decided.victims) == sorted([parent.pid, kids['plain']])
        skipped = dict((entry['pid'], entry['reason']) for entry in decided.skipped)
        expected = {kids['session']: 'in the session of the reclaiming process'}
        if 'nobody' in kids:
            expected[kids['nobody']] = 'protected user nobody (protect_users)'
            if I.name_trusted(killer.read_proc(kids['sshd']).identity):   # root, and a root-owned python outside user dirs
                expected[kids['sshd']] = 'protected name sshd (protect_names)'
        assert dict((pid, skipped.get(pid)) for pid in expected) == expected
    finally:
        for pid in kids.values():   # the test's own grandchildren, while they are still children of the live parent
            info = killer.read_proc(pid)
            if info is not None and info.ppid == parent.pid:
                os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(10)


# ---------------------------------------------------------------------------- check mode
def test_check_mode_lists_exactly_what_would_be_killed_and_sends_nothing(node, tmp_path):
    audit = str(tmp_path / 'actions.jsonl')
    stubborn = node.spawn(0, 1024, ignore_term=True, children=1)
    plain = node.spawn(1, 1024)
    protected = node.spawn(1, 100, argv=['Xorg'])
    kid = node.child_pids(stubborn)[0]
    result = run(node, gpus=['0', '1'], all_on_gpus=True, force=True, audit_path=audit, check_mode=True)
    assert result['changed'] is True
    assert pids(result['killed']) == sorted([stubborn, plain, kid])
    assert all(e['signals'] == ['SIGTERM', 'SIGKILL'] and e['reason'] == 'would be signalled (check mode)'
               for e in result['killed'])
    assert pids(result['skipped']) == [protected]
    assert result['freed_mib'] == {} and result['msg'].startswith('would kill 3 process(es), skip 1')
    assert all(node.alive(p) for p in (stubborn, plain, protected)) and node.entry(stubborn)['children_alive'] == [kid]
    assert not os.path.exists(audit)
    # The real run kills exactly that list.
    real = run(node, gpus=['0', '1'], all_on_gpus=True, force=True, timeout=0.5, audit_path=audit)
    assert pids(real['killed']) == pids(result['killed'])


# ---------------------------------------------------------------------------- release verification
def test_release_delay_is_waited_for_and_reported(slow_node):
    victim = slow_node.spawn(0, 4096)
    result = run(slow_node, pids=[victim])
    release = result['release']['0']
    assert release['released'] is True and release['freed_mib'] == 4096
    # The shim keeps the memory used for 500 ms after the death: the release was not claimed before.
    assert release['seconds'] >= 0.4
    assert result['killed'][0]['seconds_to_release'] == release['seconds']
    assert slow_node.used_mib(0) == 0


def test_memory_the_driver_keeps_is_reported_as_a_leak_after_a_bounded_wait(tmp_path):
    with h.gpusim_node(gpus=1, release_delay_ms=120000) as sim:
        victim = sim.spawn(0, 2048)
        result = run(sim, pids=[victim], release_timeout=1)
        assert pids(result['killed']) == [victim]
        (unreleased,) = result['unreleased']
        assert unreleased['unreleased_mib'] == 2048 and 'leak' in unreleased['cause'] and 'gpu_reset' in unreleased['cause']
        assert result['release']['0']['released'] is False


class _UnreadableDriver(object):
    """select_backends for the release wait whose one backend cannot tell which processes a GPU lists: ``memory_view``
    raises (the driver stopped answering) or returns the memory with no process list (``None``)."""

    def __init__(self, raises):
        self.raises = raises

    def __call__(self, name):
        raises = self.raises

        class Backend(object):
            def __init__(self):
                self.name = name

            def memory_view(self, vendor_indexes=None):
                if raises:
                    raise RuntimeError('NVML_ERROR_GPU_IS_LOST')
                return dict((i, (0, None)) for i in vendor_indexes or ())

            def devices(self):
                raise RuntimeError('NVML_ERROR_GPU_IS_LOST')

        class Selection(object):
            backends = [Backend()]

            def close(self):
                pass

        return Selection()


@pytest.mark.parametrize('raises', [True, False], ids=['the driver read raises', 'no process list'])
def test_a_release_the_driver_cannot_show_is_never_reported(node, monkeypatch, raises):
    """The victim really exits and its memory really comes back, but the release wait cannot read the GPU's process
    list: reclaim() reports the GPU unreleased, not freed (issue 34)."""
    victim = node.spawn(0, 2048)
    monkeypatch.setattr(core_reclaim, 'select_backends', _UnreadableDriver(raises))
    result = run(node, pids=[victim], release_timeout=0.5)
    assert pids(result['killed']) == [victim] and not node.alive(victim)
    assert result['release']['0']['released'] is False and result['release']['0']['seconds'] is None
    assert [entry['gpu'] for entry in result['unreleased']] == [0]
    assert result['killed'][0]['seconds_to_release'] is None
    assert ('2048 MiB not released' if raises else 'release not confirmed on GPU 0') in result['msg']


# ---------------------------------------------------------------------------- audit, options
def test_each_action_is_appended_to_the_audit_log(node, tmp_path):
    audit = str(tmp_path / 'log' / 'actions.jsonl')
    first = node.spawn(0, 1024, argv=['python', 'a.py'])
    second = node.spawn(1, 1024, argv=['python', 'b.py'])
    run(node, pids=[first], audit_path=audit)
    run(node, pids=[first], audit_path=audit)                  # nothing to do: no line
    run(node, cmdline='b.py', audit_path=audit, force=True)
    with open(audit) as handle:
        records = [json.loads(line) for line in handle]
    # each run: what was signalled (written before the release check asks the driver again), then the run
    assert [line['event'] for line in records] == ['gpu_kill_signalled', 'gpu_kill'] * 2
    assert [e['pid'] for e in records[0]['signalled']] == [first] and records[0]['signalled'][0]['signals'] == ['SIGTERM']
    assert [e['pid'] for e in records[2]['signalled']] == [second]
    lines = [line for line in records if line['event'] == 'gpu_kill']
    assert lines[0]['selectors']['pids'] == [first] and lines[1]['selectors']['cmdline'] == 'b.py'
    assert pids(lines[0]['killed']) == [first] and pids(lines[1]['killed']) == [second]
    assert lines[1]['options']['force'] is True and lines[0]['actor']['uid'] == os.geteuid()
    assert lines[0]['ts'].endswith('Z') and lines[0]['freed_mib'] == {'0': 1024}
    assert audit_log.verify(audit) == {'valid': True, 'lines': 4, 'errors': []}


def test_an_unwritable_audit_log_is_a_warning_not_a_lost_result(node, tmp_path):
    victim = node.spawn(0, 100)
    blocker = tmp_path / 'file'
    blocker.write_text('')
    result = run(node, pids=[victim], audit_path=str(blocker / 'actions.jsonl'))
    assert pids(result['killed']) == [victim]
    assert any('audit log' in w for w in result['warnings'])


@pytest.mark.parametrize('options, field', [
    ({'timeout': -1}, 'timeout'), ({'release_timeout': -0.5}, 'release_timeout'), ({'timeout': 'soon'}, 'timeout'),
    ({'signal': 'STOP'}, 'signal'), ({'audit_path': 'relative/log'}, 'audit_log'),
    ({'history_path': 'util.json'}, 'utilization_history'),
])
def test_invalid_options_name_the_field(options, field):
    with pytest.raises(InvalidArgument) as err:
        ReclaimOptions(**options)
    assert err.value.field == field


@pytest.mark.parametrize('value', ['', 'none', 'None', None])
def test_audit_log_can_be_switched_off(value):
    assert ReclaimOptions(audit_path=value).audit_path is None


def test_unknown_gpu_fails_before_anything_is_signalled_or_recorded(node, tmp_path):
    victim = node.spawn(0, 100)
    history = tmp_path / 'util.json'
    with pytest.raises(InvalidArgument) as err:
        run(node, gpus=['0', '9'], idle_for='1s', history_path=str(history))
    assert err.value.field == 'gpus' and err.value.value == '9'
    assert node.alive(victim) and not history.exists()


def test_idle_for_without_a_history_file_is_an_error(node):
    with pytest.raises(InvalidArgument) as err:
        run(node, idle_for='10m', history_path=None)
    assert err.value.field == 'utilization_history'


def test_idle_processes_are_reclaimed_on_the_second_sample(node, tmp_path):
    history = str(tmp_path / 'util.json')
    idle = node.spawn(0, 2048, util=0)
    busy = node.spawn(0, 2048, util=90)
    first = run(node, idle_for='2s', history_path=history)
    assert first['changed'] is False and first['killed'] == []
    time.sleep(2.2)
    second = run(node, idle_for='2s', history_path=history)
    assert pids(second['killed']) == [idle]
    assert 'idle (<= 5% utilization)' in second['killed'][0]['selected_because'][0]
    assert second['freed_mib'] == {'0': 2048}
    assert node.alive(busy) and not node.alive(idle)


# ---------------------------------------------------------------------------- requests that lead nowhere
def test_each_request_that_leads_nowhere_is_reported_with_why(node):
    job = node.spawn(0, 300, argv=['python', 'job.py'])
    gone = h.unused_pid()
    result = run(node, pids=[job, gone, 1, os.getpid()], force=True)
    assert pids(result['killed']) == [job]
    assert not node.alive(job)
    reasons = dict((e['value'], e['reason']) for e in result['unmatched'] if e['request'] == 'pid')
    assert set(reasons) == {gone, 1, os.getpid()}
    assert reasons[gone] == 'no process with pid %d exists here (it has exited, or never existed)' % gone
    assert reasons[1].startswith('pid 1 is not a GPU process') and 'also protected (pid 1 is never signalled)' in reasons[1]
    assert 'this is the reclaiming process itself' in reasons[os.getpid()]
    assert set(result['warnings']) >= set(reasons.values())           # all three name something absent from the GPUs
    assert '3 request(s) led nowhere' in result['msg']


def test_unknown_users_warn_and_users_without_gpu_processes_are_only_reported(node):
    job = node.spawn(0, 300, argv=['python', 'job.py'])
    result = run(node, users=['nosuchuser-gpufleet', 'root', 'nobody'], name='^nomatch$', check_mode=True)
    assert result['killed'] == [] and not result['changed'] and node.alive(job)
    by_user = dict((e['value'], e['reason']) for e in result['unmatched'])
    assert by_user == {
        'nobody': 'user nobody has no GPU process here',
        'nosuchuser-gpufleet': 'no user nosuchuser-gpufleet exists on this node (checked with the system user database)',
        'root': 'user root has GPU processes here, but none matches the other selectors'}
    assert result['warnings'] == [by_user['nosuchuser-gpufleet']]


def test_a_selection_that_matches_nothing_says_so(node):
    node.spawn(0, 300, argv=['python', 'job.py'])
    result = run(node, name='^nomatch$')
    (entry,) = result['unmatched']
    assert entry['request'] == 'selection' and entry['reason'] == 'no GPU process here matches every selector given'
    assert entry['value']['name'] == '^nomatch$' and result['warnings'] == []
    assert 'led nowhere' in result['msg'] and not result['changed']


def test_a_requested_pid_that_matched_reports_nothing_extra(node):
    job = node.spawn(0, 300, argv=['python', 'job.py'])
    result = run(node, pids=[job], check_mode=True)
    assert pids(result['killed']) == [job] and result['unmatched'] == [] and 'led nowhere' not in result['msg']


@pytest.mark.parametrize('vendor, on_node, opened', [
    ('auto', ['nvidia', 'nvidia'], ['nvidia']),          # the other vendors are neither imported nor probed again
    ('auto', ['amd', 'nvidia'], ['nvidia', 'amd']),      # in host-wide index order
    ('nvidia', ['nvidia'], ['nvidia']),
    ('amd', ['nvidia'], []),                             # vendor still limits them
    ('auto', [], []),
])
def test_release_probe_opens_only_the_backends_of_the_snapshots_vendors(monkeypatch, vendor, on_node, opened):
    """The release wait (issue #21): its probe reads only the GPUs of the snapshot, so it opens only their vendors."""
    class Selection(object):
        def __init__(self, name):
            self.backends = []
            calls.append(name)

        def close(self):
            closed.append(self)

    calls, closed = [], []
    monkeypatch.setattr(core_reclaim, 'select_backends', Selection)
    devices = [type('Dev', (), {'vendor': name, 'vendor_index': i, 'index': i})() for i, name in enumerate(on_node)]
    probe = core_reclaim.DriverProbe(vendor, type('Snap', (), {'all_devices': devices})())
    assert calls == opened and probe() == {}
    probe.close()
    assert len(closed) == len(opened)


def test_release_probe_reads_only_the_gpus_it_waits_on(monkeypatch):
    """Each poll of the release wait reads the memory and processes of the GPUs whose release it waits for (issue #21)."""
    asked = []

    class Backend(object):
        name = 'nvidia'

        def memory_view(self, vendor_indexes=None):
            asked.append(vendor_indexes)
            return dict((i, (10 * i, set())) for i in range(4) if vendor_indexes is None or i in vendor_indexes)

        def close(self):
            pass

    class Selection(object):
        def __init__(self, name):
            self.backends = [Backend()]

        def close(self):
            pass

    monkeypatch.setattr(core_reclaim, 'select_backends', Selection)
    devices = [type('Dev', (), {'vendor': 'nvidia', 'vendor_index': i, 'index': i})() for i in range(4)]
    snapshot = type('Snap', (), {'all_devices': devices})()
    assert core_reclaim.DriverProbe('auto', snapshot, gpus={2})() == {2: (20, set())}
    assert core_reclaim.DriverProbe('auto', snapshot)() == dict((i, (10 * i, set())) for i in range(4))   # every GPU
    assert asked == [{2}, {0, 1, 2, 3}]
