# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The safe killer against real processes that these tests start themselves (and nothing else)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import killer

IGNORE_TERM = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print("ready", flush=True); time.sleep(600)'
FORKER = 'import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        time.sleep(600); os._exit(0)\ntime.sleep(600)'


@pytest.fixture
def spawn():
    """Start processes in their own sessions; kill and reap every one of them afterwards."""
    started = []

    def _spawn(argv, **kwargs):
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)
        started.append(proc)
        deadline = time.monotonic() + 5
        while killer.read_proc(proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc

    yield _spawn
    for proc in started:
        # Only our own children, by the Popen handle: the kernel cannot hand us another process.
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=10)


def spawn_term_ignorer(spawn):
    """A process that ignores SIGTERM, returned once its handler is installed (it says so)."""
    proc = spawn([sys.executable, '-c', IGNORE_TERM], stdout=subprocess.PIPE, universal_newlines=True)
    assert proc.stdout.readline().strip() == 'ready'
    return proc


def victim_for(proc):
    info = killer.read_proc(proc.pid)
    return killer.Victim(proc.pid, info.starttime, record={'name': info.comm})


def wait_children(pid, count, timeout=5.0):
    deadline = time.monotonic() + timeout
    found = []
    while time.monotonic() < deadline:
        found = killer.children_of([pid])
        if len(found) >= count:
            return found
        time.sleep(0.02)
    return found


def test_read_proc_of_self():
    info = killer.read_proc(os.getpid())
    assert info.pid == os.getpid()
    assert info.uid == os.geteuid()
    assert info.starttime > 0
    assert killer.read_proc(2 ** 22 + 12345) is None


def test_term_honouring_process_is_killed(spawn):
    proc = spawn(['sleep', '600'])
    victims = killer.terminate([victim_for(proc)], timeout=5)
    assert victims[0].outcome == 'killed'
    assert victims[0].signals == ['SIGTERM']
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_term_ignoring_process_survives_without_force(spawn):
    proc = spawn_term_ignorer(spawn)
    victims = killer.terminate([victim_for(proc)], timeout=0.5)
    assert victims[0].outcome == 'failed'
    assert 'force=true' in victims[0].reason
    assert proc.poll() is None


def test_term_ignoring_process_is_killed_with_force(spawn):
    proc = spawn_term_ignorer(spawn)
    victims = killer.terminate([victim_for(proc)], timeout=0.5, force=True)
    assert victims[0].outcome == 'killed'
    assert victims[0].signals == ['SIGTERM', 'SIGKILL']
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_reused_pid_is_never_signalled(spawn):
    proc = spawn(['sleep', '600'])
    info = killer.read_proc(proc.pid)
    # Discovery recorded another process's start time under this pid: the pid was reused.
    stale = killer.Victim(proc.pid, info.starttime - 1)
    victims = killer.terminate([stale], timeout=0.5, force=True)
    assert victims[0].outcome == 'skipped'
    assert 'reused' in victims[0].reason
    assert victims[0].signals == []
    assert proc.poll() is None


def test_process_that_exits_by_itself_counts_as_gone(spawn):
    proc = spawn(['sleep', '600'])
    victim = victim_for(proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)
    victims = killer.terminate([victim], timeout=1)
    assert victims[0].outcome == 'killed'
    assert 'exited by itself' in victims[0].reason


def test_check_mode_sends_nothing(spawn):
    proc = spawn(['sleep', '600'])
    victims = killer.terminate([victim_for(proc)], timeout=1, force=True, check_mode=True)
    assert victims[0].outcome == 'killed'
    assert victims[0].signals == ['SIGTERM', 'SIGKILL']
    time.sleep(0.2)
    assert proc.poll() is None


class FakeClock(object):
    """A clock that advances only when the code under test sleeps, so tests count waits, not seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class RecordingClock(FakeClock):
    """A FakeClock whose sleeps also yield for a moment, so real child processes get to run."""

    def sleep(self, seconds):
        super(RecordingClock, self).sleep(seconds)
        time.sleep(0.001)


def test_parallel_signalling_takes_the_slowest_not_the_sum(spawn):
    procs = [spawn_term_ignorer(spawn) for _n in range(6)]
    clock = RecordingClock()
    victims = killer.terminate([victim_for(p) for p in procs], timeout=0.5, force=True, clock=clock, sleep=clock.sleep)
    assert [v.outcome for v in victims] == ['killed'] * 6
    assert all(v.signals == ['SIGTERM', 'SIGKILL'] for v in victims)
    # One shared TERM grace period for all six, not six grace periods back to back.
    # Sequential escalation would wait at least 6 x 0.5 s of (fake) time.
    assert 0.5 <= clock.now < 6 * 0.5


def test_tree_collects_children(spawn):
    proc = spawn([sys.executable, '-c', FORKER])
    kids = wait_children(proc.pid, 3)
    assert len(kids) == 3
    victims = [victim_for(proc)] + [killer.Victim(pid, killer.read_proc(pid).starttime, parent=proc.pid) for pid in kids]
    killer.terminate(victims, timeout=5)
    assert all(v.outcome == 'killed' for v in victims)
    assert all(killer.read_proc(pid) is None or killer.read_proc(pid).state == 'Z' for pid in kids)


def test_protection_rules(spawn):
    prot = killer.Protection(protect_names=['nv-hostengine'], protect_users=['root'] if os.geteuid() != 0 else ['nobody-at-all'])
    assert 'never' in prot.reason(killer.read_proc(1) or killer.ProcInfo(1, 'init', 'S', 0, 1, 0, 1, 0, None, ['init']))
    assert 'itself' in prot.reason(killer.read_proc(os.getpid()))
    parent = killer.read_proc(os.getppid())
    assert prot.reason(parent) is not None
    kthread = killer.ProcInfo(4242, 'kworker/0:1', 'I', 2, 0, killer.PF_KTHREAD, 100, 0, None, [])
    assert prot.reason(kthread) == 'a kernel thread'
    disguised = spawn(['bash', '-c', 'exec -a nv-hostengine sleep 600'])
    time.sleep(0.2)
    assert 'protect_names' in prot.reason(killer.read_proc(disguised.pid))
    same_session = subprocess.Popen(['sleep', '600'])
    try:
        if os.getsid(0) > 0:
            assert 'session' in prot.reason(killer.read_proc(same_session.pid))
        # In a container whose session leader is outside the PID namespace every sid reads 0;
        # that shared 0 must not protect (or expose) anything by itself.
        prot.self_session = 0
        zero_session = killer.ProcInfo(4343, 'python', 'S', 4000, 0, 0, 100, os.geteuid(), None, ['python'])
        assert prot.reason(zero_session) is None
    finally:
        same_session.kill()
        same_session.wait()
    plain = spawn(['sleep', '600'])
    assert prot.reason(killer.read_proc(plain.pid)) is None


def test_non_root_caller_may_only_signal_own_processes(spawn):
    prot = killer.Protection(protect_names=[])
    plain = spawn(['sleep', '600'])
    info = killer.read_proc(plain.pid)
    prot.euid = info.uid + 1  # pretend to be another, unprivileged user
    assert 'non-root caller' in prot.reason(info)


def test_protected_user():
    prot = killer.Protection(protect_names=[], protect_users=['svc'], user_of_uid=lambda uid: 'svc')
    info = killer.ProcInfo(4242, 'python', 'S', 4000, 4242, 0, 100, 1234, '/usr/bin/python3', ['python'])
    assert 'protect_users' in prot.reason(info)


def test_wait_release_sees_memory_come_back_after_a_delay():
    clock = FakeClock()

    def probe():
        if clock.now < 0.5:
            return {0: (9000, set())}   # pid gone from the list, memory not yet freed
        return {0: (1000, set())}

    result = killer.wait_release({0: {'pids': {11}, 'before_mib': 9000, 'held_mib': 8000}}, probe,
                                 timeout=5, clock=clock, sleep=clock.sleep, poll=0.1)
    assert result[0]['released'] is True
    assert result[0]['freed_mib'] == 8000
    assert 0.5 <= result[0]['seconds'] <= 0.7


def test_wait_release_reports_unreleased_memory_and_stops():
    clock = FakeClock()
    result = killer.wait_release({0: {'pids': {11}, 'before_mib': 9000, 'held_mib': 8000}}, lambda: {0: (5000, set())},
                                 timeout=2, clock=clock, sleep=clock.sleep, poll=0.25)
    assert result[0]['released'] is False
    assert result[0]['unreleased_mib'] == 4000
    assert result[0]['freed_mib'] == 4000
    assert clock.now <= 2.5


UNREAD_VIEWS = [
    ({0: (1000, None)}, 'the memory came back but the process list could not be read'),
    ({0: (None, None)}, 'nothing of the GPU could be read'),
    ({}, 'the GPU is missing from the view (its backend failed)'),
    ({1: (0, set())}, 'only another GPU was read'),
]


@pytest.mark.parametrize('view, _case', UNREAD_VIEWS, ids=[case for _view, case in UNREAD_VIEWS])
@pytest.mark.parametrize('want', [{'pids': {11}, 'before_mib': 9000, 'held_mib': 8000},
                                  {'pids': {11}, 'before_mib': None, 'held_mib': None}], ids=['sizes known', 'sizes unknown'])
def test_wait_release_never_calls_a_gpu_released_whose_process_list_was_not_read(view, _case, want):
    """No proof, no release: an unreadable or missing process list is not an empty one (issue 34), so the wait goes
    on until its deadline and reports the GPU unreleased, whatever the memory reads."""
    clock = FakeClock()
    polls = []

    def probe():
        polls.append(clock.now)
        return dict(view)

    result = killer.wait_release({0: dict(want)}, probe, timeout=2, clock=clock, sleep=clock.sleep, poll=0.25)
    assert result[0]['released'] is False and result[0]['seconds'] is None
    assert len(polls) > 1 and 2 <= clock.now <= 2.5   # it kept asking until the deadline, no longer
    if want['held_mib'] is not None and view.get(0, (None,))[0] is None:
        assert result[0]['unreleased_mib'] == 8000     # nothing read: all it held counts as unreleased


def test_children_from_the_kernels_children_files(tmp_path):
    """/proc/PID/task/TID/children (CONFIG_PROC_CHILDREN): only the asked-for trees are read."""
    def children(pid, tid, kids):
        path = tmp_path / str(pid) / 'task' / str(tid)
        path.mkdir(parents=True, exist_ok=True)
        (path / 'children').write_text(' '.join(map(str, kids)) + (' ' if kids else ''))

    children(os.getpid(), os.getpid(), [])      # the probe: this kernel has the files
    children(100, 100, [101, 102])
    children(100, 103, [104])                   # a second thread of 100 forked 104
    children(101, 101, [105])
    children(102, 102, [])
    children(104, 104, [])
    children(105, 105, [])
    children(200, 200, [201])                   # another tree: never visited
    assert sorted(killer.children_of([100], str(tmp_path))) == [101, 102, 104, 105]
    assert killer.children_of([999], str(tmp_path)) == []


def test_children_without_the_kernels_children_files(tmp_path):
    def stat(pid, ppid):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / 'stat').write_text('%d (x y) S %d %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n'
                                                  % (pid, ppid, pid, pid, 1000 + pid))
    for pid, ppid in ((100, 1), (101, 100), (102, 101), (200, 1)):
        stat(pid, ppid)
    assert killer.children_of([100], str(tmp_path)) == [101, 102]
    assert killer.ancestors(102, str(tmp_path)) == [101, 100, 1]
