# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fault injection against the core (issue #11): disk full while logging or saving, a tick killed in
the middle of its state write, corrupt logs and history, a clock stepping back, a process stuck in D
state, a process that forks while it is being killed.  docs/reliability.md lists every fault with
its test.

Each test checks three things: no wrong process is signalled, no data is lost (the logs and the
history stay readable; the hash chain stays valid or the break is reported), and the result says
what happened.

SAFETY: the only processes signalled are the ones these tests start (tracked by Popen object, in
process groups of their own that the cleanup kills), and forked copies of the test process that
end themselves.  Time comes from fake clocks; no test asserts a wall-clock duration.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import sqlite3
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, history, killer
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, proc, snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_guard import Node, decisions
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_killer import FakeClock


# ---------------------------------------------------------------------------- helpers
def log_lines(path):
    with open(path, 'rb') as handle:
        return handle.read().splitlines()


def failing_on(path, errnum, after=0):
    """An os.write replacement that writes ``after`` bytes of the first write to ``path``'s inode
    and then fails with ``errnum`` (a full disk: the kernel wrote part of the buffer)."""
    real_write = os.write
    inode = os.stat(path).st_ino

    def write(fd, data):
        if os.fstat(fd).st_ino == inode:
            if after:
                real_write(fd, bytes(data[:after]))
            raise OSError(errnum, os.strerror(errnum))
        return real_write(fd, data)
    return write


def in_child(action, fsize_limit=None):
    """Run ``action()`` in a forked copy of this process and return its exit status (the child
    never returns into pytest).  With ``fsize_limit`` the child may not grow files beyond that
    many bytes (RLIMIT_FSIZE: the kernel cuts writes short and then fails them with EFBIG, like a
    full disk; no root and no mount needed)."""
    pid = os.fork()
    if pid == 0:  # the child: always ends through os._exit
        code = 70
        try:
            if fsize_limit is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
            code = action()
        except BaseException:  # pylint: disable=broad-except
            code = 71
        finally:
            os._exit(code if isinstance(code, int) else 72)
    _pid, status = os.waitpid(pid, 0)
    return status


class Group(h.Children):
    """Children started in process groups of their own; ``close()`` also kills what they forked
    (by the group id, which is the pid of a child this test started)."""

    def start(self, argv, open_files=(), **kwargs):
        kwargs['start_new_session'] = True
        return super(Group, self).start(argv, open_files=open_files, **kwargs)

    def close(self):
        for child in self.procs:
            # Once the leader is reaped its pid may be reused; the group id is still ours only while
            # members of the group live (the kernel does not reuse a pid that names a live group).
            if child.poll() is not None and not group_alive(child.pid):
                continue
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
        super(Group, self).close()


def group_alive(pgid):
    """Whether any process is in process group ``pgid`` (from /proc/PID/stat)."""
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open('/proc/%s/stat' % entry, 'rb') as handle:
                fields = handle.read().rsplit(b')', 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            return True
    return False


@pytest.fixture
def group():
    started = Group()
    yield started
    started.close()


def victim(pid, parent=None):
    return killer.Victim(pid, killer.read_proc(pid).starttime, record={'pid': pid}, parent=parent)


# ---------------------------------------------------------------------------- disk full while logging
@pytest.mark.parametrize('errnum,words', [(errno.ENOSPC, 'disk full'), (errno.EDQUOT, 'disk full'), (errno.EIO, 'error')])
@pytest.mark.parametrize('after', [0, 1, 40])
def test_a_full_disk_mid_line_leaves_the_chain_intact(tmp_path, monkeypatch, errnum, words, after):
    path = str(tmp_path / 'guard.jsonl')
    for i in range(3):
        audit_log.append(path, {'event': 'kill', 'i': i})
    before = log_lines(path)
    monkeypatch.setattr(os, 'write', failing_on(path, errnum, after))
    with pytest.raises(audit_log.AuditLogError) as err:
        audit_log.append(path, {'event': 'kill', 'i': 3, 'pad': 'x' * 200})
    monkeypatch.undo()
    assert words in str(err.value) and path in str(err.value)        # the caller is told why
    assert log_lines(path) == before                                  # the partial line was cut away again
    assert audit_log.verify(path) == {'valid': True, 'lines': 3, 'errors': []}
    audit_log.append(path, {'event': 'kill', 'i': 4})                 # space again: the chain goes on
    assert audit_log.verify(path) == {'valid': True, 'lines': 4, 'errors': []}


@pytest.mark.parametrize('pad', [10, 300, 20000])
def test_a_file_size_limit_while_logging_is_an_audit_error_and_no_torn_line(tmp_path, pad):
    """The kernel, not a mock, cuts the write short (RLIMIT_FSIZE) - small lines used to stay half
    written behind a buffered flush and escape as a bare OSError."""
    path = str(tmp_path / 'guard.jsonl')
    for i in range(3):
        audit_log.append(path, {'event': 'kill', 'i': i})
    before = log_lines(path)

    def action():
        try:
            audit_log.append(path, {'event': 'kill', 'pad': 'x' * pad})
        except audit_log.AuditLogError:
            return 3
        return 0

    status = in_child(action, fsize_limit=os.path.getsize(path) + 64)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3
    assert log_lines(path) == before
    assert audit_log.verify(path)['valid']
    audit_log.append(path, {'event': 'after'})
    assert audit_log.verify(path) == {'valid': True, 'lines': 4, 'errors': []}


def test_a_line_after_a_torn_one_is_not_glued_to_it(tmp_path):
    """A crash (power loss) can leave half a line; the next record must stay a record of its own."""
    path = str(tmp_path / 'guard.jsonl')
    audit_log.append(path, {'event': 'kill', 'i': 0})
    with open(path, 'ab') as handle:
        handle.write(b'{"event": "kill", "i": 1, "pa')
    written = audit_log.append(path, {'event': 'kill', 'i': 2})
    report = audit_log.verify(path)
    assert report['lines'] == 3 and not report['valid']
    assert [e['line'] for e in report['errors']] == [2]               # the torn line is named, nothing else
    lines = log_lines(path)
    assert json.loads(lines[2]) == written                             # the new record is whole and chained
    assert written['prev_hash'] == audit_log._line_hash(lines[1])


def test_a_guard_tick_on_a_full_disk_reports_it_and_keeps_the_old_state(tmp_path, monkeypatch):
    node = Node(tmp_path)
    assert decisions(node.tick()) == [('warn', 'max_mem_per_gpu', 1)]
    with open(node.paths.state, 'rb') as handle:
        old_state = handle.read()
    old_log = log_lines(node.paths.log)
    real_fsync = os.fsync

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, 'fsync', fsync)
    summary = node.tick(300)                                          # 5 min: the second warning is due
    monkeypatch.setattr(os, 'fsync', real_fsync)
    assert decisions(summary) == [('warn', 'max_mem_per_gpu', 2)]
    assert summary['rc'] == 1 and summary['unlogged'] == 1
    text = ' '.join(summary['warnings'])
    assert 'disk full' in text and 'could not save the state' in text and 'could not write the metrics' in text
    with open(node.paths.state, 'rb') as handle:
        assert handle.read() == old_state                             # the old state, whole
    assert log_lines(node.paths.log) == old_log and audit_log.verify(node.paths.log)['valid']
    assert [n for n in os.listdir(os.path.dirname(node.paths.state)) if n.startswith('.')] == []
    # space again: the next tick continues from the old state (the lost warning goes out again)
    summary = node.tick(1)
    assert summary['rc'] == 0 and decisions(summary) == [('warn', 'max_mem_per_gpu', 2)]
    assert audit_log.verify(node.paths.log) == {'valid': True, 'lines': 2, 'errors': []}


def test_a_full_disk_under_the_usage_history_is_a_warning(tmp_path):
    db = str(tmp_path / 'history.db')
    snap = snapshot([proc(1, 'alice', {0: 12 * GIB}), proc(2, 'bob', {1: GIB})])
    for i in range(3):
        history.record_samples(db, snap, now=1000.0 + 60 * i)
    big = snapshot([proc(pid, 'alice', {pid % 4: GIB}, cmdline=['python', 'x' * 4000]) for pid in range(10, 400)])

    def action():
        try:
            history.record_samples(db, big, now=2000.0)
        except history.HistoryError:
            return 3
        return 0

    status = in_child(action, fsize_limit=os.path.getsize(db))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3
    conn = sqlite3.connect(db)
    try:
        assert conn.execute('PRAGMA integrity_check').fetchone()[0] == 'ok'
        assert conn.execute('SELECT COUNT(DISTINCT ts) FROM gpu_samples').fetchone()[0] == 3   # nothing half-written
    finally:
        conn.close()
    assert history.report(db, hours=1, now=1200.0)['available'] is True


# ---------------------------------------------------------------------------- a tick killed mid-write
@pytest.mark.parametrize('where', ['fsync', 'rename'])
def test_a_tick_killed_during_the_state_write_leaves_the_old_state(tmp_path, where):
    node = Node(tmp_path)
    node.tick()
    with open(node.paths.state, 'rb') as handle:
        old_state = handle.read()
    state_dir = os.path.dirname(node.paths.state)

    def action():
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)   # this forked copy ends itself, nothing else
        real = getattr(os, where)

        def hook(*args, **kwargs):     # the rename is relative to the directory's descriptor (dir_fd keywords)
            first = args[0]
            if (where == 'rename' and os.path.basename(str(first)).startswith('.state.json.')) or \
                    (where == 'fsync' and os.path.basename(os.readlink('/proc/self/fd/%d' % first)).startswith('.state.json.')):
                die()
            return real(*args, **kwargs)
        setattr(os, where, hook)
        node.tick(300)
        return 0

    status = in_child(action)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with open(node.paths.state, 'rb') as handle:
        assert handle.read() == old_state                              # old state, never a torn one
    assert [n for n in os.listdir(state_dir) if n.startswith('.state.json.')] != []   # the dead tick's temp file
    assert audit_log.verify(node.paths.log)['valid']                  # its decision was logged before it died
    summary = node.tick(300)                                          # the next tick: same moment, old state
    assert summary['rc'] == 0 and not any('rebuilt' in w for w in summary['warnings'])
    assert decisions(summary) == [('warn', 'max_mem_per_gpu', 2)]      # the lost step is repeated, never skipped
    assert [n for n in os.listdir(state_dir) if n.startswith('.state.json.')] == []   # and the leftover is gone
    assert node.state()['violations'] and audit_log.verify(node.paths.log)['valid']


def test_a_state_torn_by_a_non_atomic_writer_is_rebuilt_never_acted_on(tmp_path):
    node = Node(tmp_path, policy='mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 8}}\n'
                                 'escalation: {warn_again_after: 5m, act_after: 10m}\nnotify: {tty: false}\n')
    node.tick()
    node.tick(300)
    with open(node.paths.state, 'rb') as handle:
        data = handle.read()
    for cut in (1, len(data) // 3, len(data) // 2, len(data) - 1):
        with open(node.paths.state, 'wb') as handle:
            handle.write(data[:cut])
        summary = node.tick(0)
        assert any('rebuilt' in w for w in summary['warnings'])
        assert decisions(summary) == [('warn', 'max_mem_per_gpu', 1)]   # never an act after a lost state
    assert [r['event'] for r in node.log()].count('guard_state_rebuilt') == 4
    assert audit_log.verify(node.paths.log)['valid']


# ---------------------------------------------------------------------------- corrupt logs and history
def test_a_corrupt_decision_log_is_reported_and_new_decisions_still_chain(tmp_path):
    node = Node(tmp_path)
    node.tick()
    node.tick(300)
    lines = log_lines(node.paths.log)
    with open(node.paths.log, 'wb') as handle:
        handle.write(lines[0] + b'\n' + b'\x00\xff garbage\n' + lines[1][:20] + b'\n')
    summary = node.tick(300)
    assert summary['rc'] == 0 and decisions(summary) == [('act', 'max_mem_per_gpu', 2)]
    report = audit_log.verify(node.paths.log)
    assert not report['valid'] and report['lines'] == 4
    assert sorted(set(e['line'] for e in report['errors'])) == [2, 3]  # the damage, and only the damage
    assert json.loads(log_lines(node.paths.log)[3])['decision'] == 'act'


@pytest.mark.parametrize('damage', ['truncate', 'header', 'schema'])
def test_a_damaged_usage_history_is_reported_not_a_crash(tmp_path, damage):
    db = str(tmp_path / 'history.db')
    snap = snapshot([proc(pid, 'alice', {pid % 4: GIB}, cmdline=['python', 'y' * 2000]) for pid in range(1, 60)])
    for i in range(5):
        history.record_samples(db, snap, now=1000.0 + 60 * i)
    if damage == 'schema':
        conn = sqlite3.connect(db)
        conn.execute("UPDATE meta SET value = 'garbage' WHERE key = 'schema_version'")
        conn.commit()
        conn.close()
    else:
        with open(db, 'r+b') as handle:
            if damage == 'truncate':
                handle.truncate(os.path.getsize(db) // 3)
            else:
                handle.write(b'\xde\xad' * 50)
    report = history.report(db, hours=1, now=1300.0)                   # gpu_audit's reader
    assert report['available'] is False and report['error']
    with pytest.raises(history.HistoryError):
        history.record_samples(db, snap, now=1400.0)
    # the guard: a warning, and the tick goes on deciding and logging
    node = Node(tmp_path / 'node')
    node.paths.history = db
    summary = node.tick()
    assert summary['rc'] == 0 and decisions(summary) == [('warn', 'max_mem_per_gpu', 1)]
    assert any('usage history' in w for w in summary['warnings'])
    assert audit_log.verify(node.paths.log)['valid']


# ---------------------------------------------------------------------------- the clock steps back
def test_a_small_clock_step_back_never_acts_early(tmp_path):
    node = Node(tmp_path)
    node.paths.history = str(tmp_path / 'history.db')
    first_seen = node.clock.now
    seen = [(node.clock.now, decisions(node.tick())), (node.clock.now + 300, decisions(node.tick(300)))]
    node.clock.advance(-240)                                          # NTP steps back 4 min (under the 5 min tolerance)
    for _tick in range(19):                                           # 30 s ticks up to first_seen + 10.5 min
        summary = node.tick(30)
        assert summary['rc'] == 0 and not any('rebuilt' in w for w in summary['warnings'])
        seen.append((node.clock.now, decisions(summary)))
    assert [d for _now, d in seen[:2]] == [[('warn', 'max_mem_per_gpu', 1)], [('warn', 'max_mem_per_gpu', 2)]]
    acts = [now for now, d in seen if d and d[0][0] == 'act']
    # the grace counts on the clock as it reads now: the action comes at first_seen + 10 min, not earlier
    assert acts == [first_seen + 600]
    conn = sqlite3.connect(node.paths.history)
    try:
        assert conn.execute('SELECT MIN(interval_s) FROM gpu_samples').fetchone()[0] >= 0   # no negative GPU time
    finally:
        conn.close()
    assert audit_log.verify(node.paths.log) == {'valid': True, 'lines': 3, 'errors': []}


# ---------------------------------------------------------------------------- processes that do not die
def test_a_process_stuck_in_d_state_fails_after_a_bounded_wait(group, monkeypatch):
    """Simulated D state: /proc keeps showing the process in state D after the signals (the real
    child, which these tests started, does die)."""
    child = group.sleeper()
    info = killer.read_proc(child.pid)
    stuck = killer.ProcInfo(info.pid, info.comm, 'D', info.ppid, info.session, info.flags, info.starttime, info.uid,
                            info.exe, info.cmdline)
    real_read = killer.read_proc
    monkeypatch.setattr(killer, 'read_proc', lambda pid, proc_root='/proc': stuck if pid == child.pid else real_read(pid, proc_root))
    clock = FakeClock()
    looks = []
    real_is_same = killer.is_same
    monkeypatch.setattr(killer, 'is_same', lambda *args: looks.append(1) or real_is_same(*args))
    (result,) = killer.terminate([victim(child.pid)], timeout=10, force=True, kill_timeout=5, clock=clock,
                                 sleep=clock.sleep, poll=0.5)
    assert result.outcome == 'failed' and 'D state' in result.reason
    assert result.signals == ['SIGTERM', 'SIGKILL']                    # escalated once, then gave up
    assert clock.now <= 15.5 and len(looks) < 100                      # bounded: no endless retry
    monkeypatch.undo()
    child.wait(timeout=10)                                            # the real child did get them


def test_children_forked_while_the_parent_is_killed(group, tmp_path):
    """tree=true collects the children that exist before the first signal and signals exactly
    those; a child forked afterwards (here: by the SIGTERM handler) is not collected and so never
    signalled - it outlives the kill, and reclaim reports its memory as unreleased."""
    witness = str(tmp_path / 'late-child-signals')
    script = ('import os, signal, sys, time\n'
              'def late(signum, frame):\n'
              '    pid = os.fork()\n'
              '    if pid == 0:\n'
              '        signal.signal(signal.SIGTERM, lambda s, f: open(sys.argv[1], "a").write("TERM\\n"))\n'
              '        time.sleep(600); os._exit(0)\n'
              '    open(sys.argv[1] + ".pid", "w").write(str(pid)); os._exit(0)\n'
              'for _ in range(2):\n'
              '    if os.fork() == 0:\n'
              '        time.sleep(600); os._exit(0)\n'
              'signal.signal(signal.SIGTERM, late)\n'
              'open(sys.argv[1] + ".ready", "w").close()\n'
              'time.sleep(600)\n')
    parent = group.start([sys.executable, '-c', script, witness])
    # the handler is installed after the children are forked: a SIGTERM before it would end the parent plainly
    h.wait_for(lambda: os.path.exists(witness + '.ready'), what='the parent\'s SIGTERM handler')
    h.wait_for(lambda: len(killer.children_of([parent.pid])) == 2, what='the two children')
    kids = killer.children_of([parent.pid])
    victims = [victim(parent.pid)] + [victim(pid, parent=parent.pid) for pid in kids]
    killer.terminate(victims, timeout=10)
    h.wait_for(lambda: os.path.exists(witness + '.pid'), what='the late child')
    with open(witness + '.pid') as handle:
        late = int(handle.read())
    assert [v.outcome for v in victims] == ['killed'] * 3
    assert all(v.signals == ['SIGTERM'] for v in victims)
    assert late not in [v.pid for v in victims]                        # not collected ...
    info = killer.read_proc(late)
    assert info is not None and not info.dead                          # ... still running ...
    assert os.getpgid(late) == parent.pid                              # ... in the test's own group (cleanup kills it)
    time.sleep(0.1)  # not a duration assertion: gives a stray signal time to be noticed
    assert not os.path.exists(witness)                                 # ... and never signalled
