# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The safe killer against real processes that these tests start themselves (and nothing else)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import identity as I
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import killer
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

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


# ---------------------------------------------------------------------------- exact answers (mutation testing)
# Each case below pins what a one-line change passed every test with before (`make mutants MODULE=killer`).
def _info(pid=4242, comm='python', state='S', ppid=4000, session=4242, flags=0, uid=1234, exe='/usr/bin/python3'):
    return killer.ProcInfo(pid, comm, state, ppid, session, flags, 100, uid, exe, [exe or comm])


TRUSTED = I.ExeIdentity('/usr/sbin/sshd', False, 2049, 77, 0, 0o100755, False)


def _protection(**kwargs):
    """A Protection whose view of the caller is fixed: pid 5000 in session 5000, under 4999 and 1, root."""
    prot = killer.Protection(protect_names=kwargs.pop('protect_names', []), **kwargs)
    prot.self_pid, prot.self_session, prot.self_ancestors = 5000, 5000, frozenset([4999, 1])
    return prot


@pytest.mark.parametrize('info, euid, why', [
    (_info(pid=1), 0, 'pid 1 is never signalled'),
    (_info(pid=0), 0, 'pid 0 is never signalled'),
    (_info(pid=2, ppid=0), 0, 'a kernel thread'),                # kthreadd: by its pid, not by "pid <= 1"
    (_info(pid=3, ppid=1, session=3), 0, None),                  # pid 3 (a PID namespace's second process) may be
    (_info(pid=5000), 0, 'this is the reclaiming process itself'),
    (_info(pid=4999), 0, 'an ancestor of the reclaiming process'),
    (_info(ppid=2), 0, 'a kernel thread'),
    (_info(flags=killer.PF_KTHREAD), 0, 'a kernel thread'),
    (_info(session=5000), 0, 'in the session of the reclaiming process'),
    (_info(uid=77), 0, 'protected user svc (protect_users)'),
    (_info(), 0, None),
    (_info(uid=1234), 1234, None),                               # a non-root caller: its own process
    (_info(uid=4321), 1234, 'owned by u4321; a non-root caller may only signal its own processes'),
    (_info(uid=None), 1234, 'owned by an unknown user; a non-root caller may only signal its own processes'),
])
def test_protection_reasons_word_for_word(info, euid, why):
    prot = _protection(protect_users=['svc'], user_of_uid=lambda uid: 'svc' if uid == 77 else 'u%d' % uid, euid=euid)
    assert prot.reason(info) == why


def test_protection_of_a_trusted_name_and_of_session_one():
    ident = I.Identity(4242, 100, 'S', 4000, 4242, 0, 'sshd', (0, 0, 0, 0), TRUSTED)
    assert _protection(protect_names=['sshd']).reason(killer.ProcInfo.of(ident, '/usr/sbin/sshd', ['sshd'])) == (
        'protected name sshd (protect_names)')
    prot = _protection()
    prot.self_session = 1   # a caller in session 1 (under a container's init): that session is still its own
    assert prot.reason(_info(session=1)) == 'in the session of the reclaiming process'
    prot.self_session = 0   # 0: the session leader is outside this PID namespace, which protects nothing
    assert prot.reason(_info(session=0)) is None


def test_protection_reads_the_callers_own_identity_from_its_proc_root(tmp_path):
    prot = killer.Protection()
    assert (prot.proc_root, prot.euid, prot.self_pid, prot.self_session) == ('/proc', os.geteuid(), os.getpid(), os.getsid(0))
    assert prot.self_ancestors == frozenset(killer.ancestors(os.getpid())) and os.getppid() in prot.self_ancestors
    assert killer.Protection(euid=1234).euid == 1234
    assert killer.Protection(proc_root=str(tmp_path)).self_ancestors == frozenset()   # this process is not in it


def test_proc_info_keeps_every_field():
    info = killer.ProcInfo(4242, 'train', 'R', 4000, 4100, 64, 1000, 1234, '/usr/bin/python3', ['python', 'train.py'])
    assert (info.pid, info.comm, info.state, info.ppid, info.session, info.flags, info.starttime, info.uid, info.exe,
            info.cmdline, info.argv0) == (4242, 'train', 'R', 4000, 4100, 64, 1000, 1234, '/usr/bin/python3',
                                          ['python', 'train.py'], 'python')
    assert info.identity.uids == (1234,) * 4 and info.names == {'train', 'python3', 'python'}
    assert killer.ProcInfo(1, 'x', 'S', 0, 1, 0, 1, None, None, None).identity.uids is None


@pytest.fixture
def zombie():
    """A child of this test that has exited and is not reaped yet."""
    child = subprocess.Popen(['true'])
    deadline = time.monotonic() + 10
    while (killer.read_proc(child.pid) or killer.ProcInfo(0, '', 'Z', 0, 0, 0, 0, 0, None, None)).state != 'Z':
        assert time.monotonic() < deadline, 'the child did not become a zombie'
        time.sleep(0.01)
    yield child
    child.wait(10)


def test_send_signal_answers_word_for_word(spawn, zombie, tmp_path, monkeypatch):
    proc = spawn(['sleep', '600'])
    info = killer.read_proc(proc.pid)
    assert killer.send_signal(proc.pid, info.starttime + 1, 0) == 'reused'
    assert killer.send_signal(zombie.pid, killer.read_proc(zombie.pid).starttime, signal.SIGKILL) == 'gone'   # no signal to a zombie
    assert killer.send_signal(h.unused_pid(), 1, 0) == 'gone'
    # the identity check reads the proc_root given: a tree where the pid has another start time
    tree = tmp_path / 'proc'
    (tree / str(proc.pid)).mkdir(parents=True)
    (tree / str(proc.pid) / 'stat').write_text('%d (sleep) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n'
                                               % (proc.pid, info.starttime + 7))
    (tree / str(proc.pid) / 'status').write_text('Name:\tsleep\nUid:\t0\t0\t0\t0\n')
    assert killer.send_signal(proc.pid, info.starttime, signal.SIGKILL, proc_root=str(tree)) == 'reused'
    assert killer.is_same(proc.pid, info.starttime) is True and killer.is_same(proc.pid, info.starttime, str(tree)) is False
    assert killer.read_proc(proc.pid, str(tree)).starttime == info.starttime + 7
    assert proc.poll() is None
    fds = len(os.listdir('/proc/self/fd'))
    if hasattr(signal, 'pidfd_send_signal'):
        used = []
        real = signal.pidfd_send_signal
        monkeypatch.setattr(signal, 'pidfd_send_signal', lambda fd, sig, *a: used.append(sig) or real(fd, sig, *a))
        assert killer.send_signal(proc.pid, info.starttime, 0) == 'sent' and used == [0]   # through the pidfd
        assert len(os.listdir('/proc/self/fd')) == fds                                    # which is closed again
        for error, answer in ((ProcessLookupError, 'gone'), (PermissionError, 'denied')):
            def refuse(_fd, _sig, *_args, error=error):
                raise error()
            monkeypatch.setattr(signal, 'pidfd_send_signal', refuse)
            assert killer.send_signal(proc.pid, info.starttime, 0) == answer
        monkeypatch.undo()


@pytest.mark.parametrize('without', ['pidfd_open', 'ENOSYS'])
def test_send_signal_without_a_pidfd_falls_back_to_kill(spawn, monkeypatch, without):
    proc = spawn(['sleep', '600'])
    info = killer.read_proc(proc.pid)
    if without == 'pidfd_open':
        monkeypatch.delattr(os, 'pidfd_open', raising=False)
    else:
        def no_pidfd(_pid, *_args):
            raise OSError(errno.ENOSYS, 'Function not implemented')
        monkeypatch.setattr(os, 'pidfd_open', no_pidfd, raising=False)
    killed = []
    real_kill = os.kill
    monkeypatch.setattr(os, 'kill', lambda pid, sig: killed.append((pid, sig)) or real_kill(pid, sig))
    assert killer.send_signal(proc.pid, info.starttime, signal.SIGTERM) == 'sent'
    assert killed == [(proc.pid, signal.SIGTERM)] and proc.wait(10) == -signal.SIGTERM


def test_read_proc_reads_its_proc_root_and_bounds_the_command_line(spawn, tmp_path):
    proc = spawn([sys.executable, '-c', 'import time; time.sleep(600)', 'x' * (killer.CMDLINE_LIMIT + 100)])
    h.wait_for(lambda: (killer.read_proc(proc.pid).cmdline or [''])[-1].startswith('x'), what='the exec')
    info = killer.read_proc(proc.pid)
    assert info.exe == os.path.realpath(sys.executable) and not info.dead
    assert sum(len(a) + 1 for a in info.cmdline) <= killer.CMDLINE_LIMIT + 1
    assert info.cmdline[:3] == [sys.executable, '-c', 'import time; time.sleep(600)']
    assert killer.read_proc(h.unused_pid()) is None


def test_ancestors_are_bounded_and_children_are_listed_once(tmp_path):
    def stat(pid, ppid):
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / 'stat').write_text('%d (x) S %d %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n'
                                                  % (pid, ppid, pid, pid, 1000 + pid))
    stat(10, 11)
    stat(11, 10)   # a corrupt table: a cycle
    assert len(killer.ancestors(10, str(tmp_path))) == 4096
    assert killer.ancestors(10, str(tmp_path), limit=3) == [11, 10, 11]
    assert os.getppid() in killer.ancestors(os.getpid())   # the default root is /proc
    kids = tmp_path / 'kids'

    def children(pid, tid, listed):
        path = kids / str(pid) / 'task' / str(tid)
        path.mkdir(parents=True, exist_ok=True)
        if listed is not None:
            (path / 'children').write_text(' '.join(map(str, listed)) + ' ')

    children(os.getpid(), os.getpid(), [])
    children(100, 99, None)          # threads that ended while the children were read: the others still count
    children(100, 100, [101, 102])
    children(100, 103, None)
    children(102, 102, [101])        # 101 is reached twice
    assert sorted(killer.children_of([100], str(kids))) == [101, 102]


def test_a_victims_result_and_the_rounding_of_its_seconds():
    victim = killer.Victim(4242, 100, record={'name': 'train'}, parent=4000)
    assert (victim.pid, victim.starttime, victim.parent, victim.signals, victim.outcome, victim.reason, victim.exit_seconds,
            victim.release_seconds) == (4242, 100, 4000, [], None, None, None, None)
    victim.signals, victim.outcome, victim.reason = ['SIGTERM'], 'killed', 'exited after SIGTERM'
    victim.exit_seconds, victim.release_seconds = 1.23456, 2.34567
    assert victim.as_result() == {'name': 'train', 'pid': 4242, 'signals': ['SIGTERM'], 'seconds_to_exit': 1.235,
                                  'seconds_to_release': 2.346, 'reason': 'exited after SIGTERM', 'parent_pid': 4000}
    victim.parent, victim.exit_seconds, victim.release_seconds = None, None, None
    assert victim.as_result()['seconds_to_exit'] is None and 'parent_pid' not in victim.as_result()


class _FakeTable(object):
    """A fake /proc whose processes exit only when a signal is 'sent' to them (no real signal goes anywhere):
    ``exits_on`` maps a pid to the signals it dies of; ``state`` to its stat state."""

    def __init__(self, root, exits_on, state=None):
        self.root, self.exits_on, self.sent = str(root), exits_on, []
        for pid in exits_on:
            os.makedirs(os.path.join(self.root, str(pid)))
            with open(os.path.join(self.root, str(pid), 'stat'), 'w') as handle:
                handle.write('%d (job) %s 1 %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n' % (
                    pid, (state or {}).get(pid, 'S'), pid, pid))

    def send(self, pid, starttime, signum, proc_root):
        assert proc_root == self.root and starttime == 100
        self.sent.append((pid, signum))
        if signum in self.exits_on[pid]:
            shutil.rmtree(os.path.join(self.root, str(pid)))
        return 'sent'


def test_terminate_reasons_and_timings_word_for_word(tmp_path, monkeypatch):
    base = h.unused_pid()
    table = _FakeTable(tmp_path, {base: (), base + 1: (signal.SIGKILL,), base + 2: (signal.SIGTERM,), base + 3: ()},
                       state={base + 3: 'D'})
    monkeypatch.setattr(killer, 'send_signal', table.send)
    clock = FakeClock()
    clock.now = 50.0   # not 0: a time measured from the wrong origin shows

    def run(pids, **kwargs):
        victims = [killer.Victim(pid, 100) for pid in pids]
        kwargs.setdefault('sleep', clock.sleep)
        killer.terminate(victims, proc_root=table.root, clock=clock, **kwargs)
        return victims

    started = clock.now
    (stubborn,) = run([base], timeout=0.3)
    assert (stubborn.outcome, stubborn.signals, stubborn.reason) == (
        'failed', ['SIGTERM'], 'still running 0.3 s after SIGTERM; use force=true to send SIGKILL')
    assert clock.now == pytest.approx(started + 0.3)   # the last wait ends at the deadline, not past it
    sleeps = []
    real_sleep = clock.sleep
    (stubborn,) = run([base], sleep=lambda seconds: sleeps.append(seconds) or real_sleep(seconds))
    assert stubborn.reason == 'still running 10.0 s after SIGTERM; use force=true to send SIGKILL' and max(sleeps) == 0.05
    (stubborn,) = run([base], force=True)
    assert stubborn.reason == 'still running 5.0 s after SIGKILL'
    (stubborn,) = run([base], timeout=0.3, force=True, kill_timeout=0.2)
    assert (stubborn.signals, stubborn.reason) == (['SIGTERM', 'SIGKILL'], 'still running 0.2 s after SIGKILL')
    (stubborn,) = run([base], signum=signal.SIGKILL, timeout=0.4, force=True)
    assert (stubborn.signals, stubborn.reason) == (['SIGKILL'], 'still running 0.4 s after SIGKILL')
    (stuck,) = run([base + 3], timeout=0.1)
    assert stuck.reason == ('still running in uninterruptible sleep (D state), probably inside the driver; '
                            'a GPU reset or a reboot may be needed')
    started = clock.now
    (escalated,) = run([base + 1], timeout=0.3, force=True)
    assert escalated.outcome == 'killed' and escalated.signals == ['SIGTERM', 'SIGKILL']
    assert 0.29 <= escalated.exit_seconds <= clock.now - started   # counted from the first signal, not from SIGKILL
    (quick,) = run([base + 2], timeout=5)
    assert quick.outcome == 'killed' and quick.exit_seconds == 0.0 and quick.signals == ['SIGTERM']
    (planned,) = [killer.Victim(base, 100)]
    killer.terminate([planned], force=True, check_mode=True)
    assert (planned.outcome, planned.signals, planned.reason) == ('killed', ['SIGTERM', 'SIGKILL'], 'would be signalled (check mode)')
    killer.terminate([killer.Victim(base, 100)], check_mode=True)
    assert [v.signals for v in killer.terminate([killer.Victim(base, 100)], check_mode=True)] == [['SIGTERM']]


@pytest.mark.parametrize('status, outcome, reason', [
    ('gone', 'killed', 'exited by itself before the signal'),
    ('denied', 'failed', "the kernel refused SIGTERM (operation not permitted): another user's process"),
    ('reused', 'skipped', 'pid 4242 was reused by another process before the signal; not signalled'),
])
def test_each_answer_of_the_signal_ends_the_victim_so(monkeypatch, status, outcome, reason):
    monkeypatch.setattr(killer, 'send_signal', lambda pid, starttime, signum, proc_root: status)
    clock = FakeClock()
    clock.now = 50.0
    (victim,) = killer.terminate([killer.Victim(4242, 100)], clock=clock, sleep=clock.sleep)
    assert (victim.outcome, victim.reason, victim.signals) == (outcome, reason, [])
    assert victim.exit_seconds == (0.0 if status == 'gone' else None)


def test_the_poll_intervals_start_short_and_double_up_to_the_poll():
    intervals = killer._intervals(0.05)   # pylint: disable=protected-access
    assert [next(intervals) for _step in range(8)] == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05]
    intervals = killer._intervals(0.0005)   # pylint: disable=protected-access
    assert [next(intervals) for _step in range(2)] == [0.0005, 0.0005]


def test_the_sigkill_round_reports_what_happened_to_each_victim(monkeypatch):
    """TERM is taken and ignored; by SIGKILL one pid has exited and one was reused: each is named so."""
    answers = {(4242, signal.SIGKILL): 'gone', (4243, signal.SIGKILL): 'reused'}
    monkeypatch.setattr(killer, 'send_signal', lambda pid, st, signum, root: answers.get((pid, signum), 'sent'))
    monkeypatch.setattr(killer, 'is_same', lambda pid, starttime, proc_root='/proc': True)
    clock = FakeClock()
    clock.now = 50.0
    recorded = []
    victims = killer.terminate([killer.Victim(4242, 100), killer.Victim(4243, 100)], timeout=0.3, force=True,
                               clock=clock, sleep=clock.sleep, on_sent=lambda sent: recorded.append([v.signals[:] for v in sent]))
    assert recorded == [[['SIGTERM'], ['SIGTERM']]]   # once, with the victims the first signals reached
    gone, reused = victims
    assert (gone.outcome, gone.reason, gone.signals) == ('killed', None, ['SIGTERM'])
    assert gone.exit_seconds == pytest.approx(0.3)
    assert (reused.outcome, reused.reason) == ('skipped', 'pid 4243 was reused by another process before SIGKILL; not signalled')


def _release(views, want=None, timeout=2, poll=0.25, start=100.0, **kwargs):
    """wait_release on GPU 0 over ``views`` (one probe answer each, the last repeated) with a fake clock."""
    clock = FakeClock()
    clock.now = start
    answers, probes, sleeps = list(views), [], []

    def probe():
        probes.append(clock.now)
        return dict(answers.pop(0) if len(answers) > 1 else answers[0])

    def sleep(seconds):
        sleeps.append(seconds)
        clock.sleep(seconds)

    want = want if want is not None else {0: {'pids': {11}, 'before_mib': 9000, 'held_mib': 8000}}
    if timeout is None:
        result = killer.wait_release(want, probe, clock=clock, sleep=sleep, **kwargs)
    else:
        result = killer.wait_release(want, probe, timeout=timeout, clock=clock, sleep=sleep, poll=poll, **kwargs)
    return result, clock.now - start, probes, sleeps


def test_wait_release_results_word_for_word():
    result, waited, probes, _sleeps = _release([{0: (9000, set())}, {0: (9000, set())}, {0: (1000, set())}])
    assert result == {0: {'released': True, 'seconds': 0.003, 'freed_mib': 8000, 'unreleased_mib': 0}}
    assert len(probes) == 3 and waited == pytest.approx(0.003)   # no poll after the release
    result, waited, probes, _sleeps = _release([{0: (1000, set())}])
    assert result[0]['released'] is True and probes == [100.0] and waited == 0
    result, waited, _probes, sleeps = _release([{0: (9000, {11})}])
    assert result == {0: {'released': False, 'seconds': None, 'freed_mib': 0, 'unreleased_mib': 8000}}
    assert waited == pytest.approx(2.0) and max(sleeps) == 0.25   # to the deadline, not past it
    _result, waited, _probes, sleeps = _release([{0: (9000, {11})}], timeout=None)
    assert waited == pytest.approx(15.0) and max(sleeps) == pytest.approx(0.1)   # the defaults: 15 s, polls of 0.1 s


def test_wait_release_rounds_its_seconds_and_counts_from_its_start():
    clock = iter([100.0, 100.12345, 100.12345])
    result = killer.wait_release({0: {'pids': {11}, 'before_mib': None, 'held_mib': None}}, lambda: {0: (None, set())},
                                 timeout=5, clock=lambda: next(clock), sleep=lambda _s: None)
    assert result[0]['seconds'] == 0.123


@pytest.mark.parametrize('used, listed, released, unreleased', [
    (1000.5, set(), True, 0),      # within half a MiB of what must remain: released
    (1001.0, set(), False, 1),
    (900, {11}, False, 0),         # the memory is down, but the pid is still listed
])
def test_wait_release_at_the_memory_target(used, listed, released, unreleased):
    result, _waited, _probes, _sleeps = _release([{0: (used, listed)}])
    assert (result[0]['released'], result[0]['unreleased_mib']) == (released, unreleased)


def test_wait_release_with_what_was_held_unknown_waits_for_the_list_only():
    result, _waited, _probes, _sleeps = _release([{0: (5000, set())}], want={0: {'pids': {11}, 'before_mib': 9000,
                                                                                 'held_mib': None}})
    assert result[0]['released'] is True and result[0]['freed_mib'] == 4000


def test_wait_release_keeps_watching_the_other_gpus_once_one_is_released():
    want = {0: {'pids': {11}, 'before_mib': 2000, 'held_mib': 1000}, 1: {'pids': {12}, 'before_mib': 2000, 'held_mib': 1000}}
    views = [{0: (1000, set()), 1: (2000, {12})}] * 4 + [{0: (1000, set()), 1: (1000, set())}]
    result, _waited, _probes, _sleeps = _release(views, want=want)
    assert result[0]['released'] is True and result[1]['released'] is True
    assert result[1]['seconds'] > result[0]['seconds']


def test_wait_release_with_nothing_known_reports_no_unreleased_size():
    result, _waited, _probes, _sleeps = _release([{0: (None, {11})}], want={0: {'pids': {11}, 'before_mib': None,
                                                                                'held_mib': None}})
    assert result == {0: {'released': False, 'seconds': None, 'freed_mib': None, 'unreleased_mib': 0}}
