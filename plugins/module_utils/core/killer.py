# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The safe killer: protection, identity checks, TERM then KILL, process trees, release checks.

Nothing here decides *what* to kill; ``select`` does that over a snapshot.  This module decides
what must never be signalled, makes sure a pid still names the process that was selected when
the signal goes out, and then watches the driver until the GPU memory really comes back.

Identity is the pair (pid, starttime): field 22 of ``/proc/PID/stat``, the process's start in
clock ticks since boot.  A reused pid has a later starttime.  Where Linux and Python offer
``pidfd_open`` (Linux 5.3, Python 3.9) the pid is pinned with a pidfd *before* the identity check,
so the process the check saw is the one that receives the signal.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from .constants import DEFAULT_PROTECT_NAMES
from .identity import Identity, name_trusted, read_ppid
from .processes import read_proc_files, user_name

PF_KTHREAD = 0x00200000
KTHREADD_PID = 2
DEAD_STATES = ('Z', 'X', 'x')
# Bytes of a command line read for results and name checks.
CMDLINE_LIMIT = 65536


class ProcInfo(object):
    """What /proc says about one pid at one moment: its ``identity`` (an identity.Identity, the one
    record of who a process is), plus the executable's path and the command line the killer names
    it by (None: unknown).  ``pid``, ``comm``, ``state``, ``ppid``, ``session``, ``flags``,
    ``starttime`` and ``uid`` (the real uid) are the identity's.

    Made by hand (``ProcInfo(pid, comm, state, ppid, session, flags, starttime, uid, exe, cmdline)``,
    tests), the identity has no examined executable, so its names protect nothing; read_proc makes
    one from the identity it read (``ProcInfo.of``).
    """

    __slots__ = ('identity', 'exe', 'cmdline')

    def __init__(self, pid, comm, state, ppid, session, flags, starttime, uid, exe, cmdline):
        uids = None if uid is None else (uid,) * 4
        self.identity = Identity(pid, starttime, state, ppid, session, flags, comm, uids)
        self.exe = exe
        self.cmdline = cmdline

    @classmethod
    def of(cls, identity, exe, cmdline):
        """The ProcInfo of an Identity read from /proc, with the executable's path and the command line."""
        info = cls.__new__(cls)
        info.identity = identity
        info.exe = exe
        info.cmdline = cmdline
        return info

    pid = property(lambda self: self.identity.pid)
    comm = property(lambda self: self.identity.comm)
    state = property(lambda self: self.identity.state)
    ppid = property(lambda self: self.identity.ppid)
    session = property(lambda self: self.identity.session)
    flags = property(lambda self: self.identity.flags)
    starttime = property(lambda self: self.identity.starttime)
    uid = property(lambda self: self.identity.uid)

    @property
    def argv0(self):
        return self.cmdline[0] if self.cmdline else None

    @property
    def kernel_thread(self):
        return self.pid == KTHREADD_PID or self.ppid == KTHREADD_PID or bool(self.flags & PF_KTHREAD)

    @property
    def dead(self):
        """A zombie (exited, not yet reaped) or dead task: it holds no GPU memory and takes no signal."""
        return self.state in DEAD_STATES

    @property
    def names(self):
        """Every name the process goes by: comm, the executable's basename and argv[0]'s basename."""
        found = {self.comm}
        if self.exe:
            found.add(os.path.basename(self.exe.replace(' (deleted)', '')))
        if self.argv0:
            found.add(os.path.basename(self.argv0))
        found.discard(None)
        found.discard('')
        return found


def read_proc(pid, proc_root='/proc'):
    """A ProcInfo for ``pid``, or None when no such process exists (or it is already reaped, or its pid
    named another process by the end of the read)."""
    files = read_proc_files(pid, proc_root, cmdline_limit=CMDLINE_LIMIT)
    if files is None:
        return None
    return ProcInfo.of(files['identity'], files['exe'], files['cmdline'])


def ancestors(pid, proc_root='/proc', limit=4096):
    """The pids above ``pid`` up to pid 1 (bounded, so a corrupt /proc cannot loop us)."""
    found = []
    ppid = read_ppid(pid, proc_root)
    while ppid and len(found) < limit:
        found.append(ppid)
        ppid = read_ppid(ppid, proc_root)
    return found


def children_of(pids, proc_root='/proc'):
    """Every descendant of ``pids``, parents before children.

    Uses /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN, most distribution kernels) to walk only
    the trees asked for; without it, one pass over the whole process table maps parents.
    """
    if _has_children_files(proc_root):
        def direct(pid):
            return _direct_children(pid, proc_root)
    else:
        by_parent = _parent_map(proc_root)

        def direct(pid):
            return by_parent.get(pid, ())
    found = []
    seen = set(pids)
    stack = list(pids)
    while stack:
        for child in sorted(direct(stack.pop())):
            if child not in seen:
                seen.add(child)
                found.append(child)
                stack.append(child)
    return found


_CHILDREN_FILES = {}


def _has_children_files(proc_root):
    if proc_root not in _CHILDREN_FILES:
        pid = os.getpid()
        _CHILDREN_FILES[proc_root] = os.path.exists('%s/%d/task/%d/children' % (proc_root, pid, pid))
    return _CHILDREN_FILES[proc_root]


def _direct_children(pid, proc_root):
    """The children of every thread of ``pid`` (empty when it is gone)."""
    base = '%s/%d/task' % (proc_root, pid)
    try:
        tids = os.listdir(base)
    except OSError:
        return []
    kids = []
    for tid in tids:
        try:
            with open('%s/%s/children' % (base, tid), 'rb') as handle:
                kids.extend(int(value) for value in handle.read().split())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return kids


def _parent_map(proc_root):
    by_parent = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return by_parent
    for name in names:
        if name.isdigit():
            ppid = read_ppid(int(name), proc_root)
            if ppid is not None:
                by_parent.setdefault(ppid, []).append(int(name))
    return by_parent


class Protection(object):
    """The rules that are never crossed, in check mode or not.

    A protected name (``protect_names``: comm, argv[0] or the executable's basename) protects only a
    process whose owner could not have chosen it (identity.Identity.name_trusted: real, effective
    and saved uid of a system account, a root-owned executable outside directories users may
    write).  An ordinary user's process named ``sshd`` is not protected.

    ``euid`` is the caller's effective uid (a test seam: another value makes a root caller behave
    like an unprivileged one).
    """

    def __init__(self, protect_names=DEFAULT_PROTECT_NAMES, protect_users=(), proc_root='/proc', user_of_uid=None, euid=None):
        self.protect_names = frozenset(protect_names or ())
        self.protect_users = frozenset(protect_users or ())
        self.proc_root = proc_root
        self.euid = os.geteuid() if euid is None else euid
        self.self_pid = os.getpid()
        self.self_session = os.getsid(0)
        self.self_ancestors = frozenset(ancestors(self.self_pid, proc_root))
        self.user_of_uid = user_of_uid or user_name

    def reason(self, info):
        """Why ``info`` must not be signalled, or None when it may be."""
        if info.pid <= 1:
            return 'pid %d is never signalled' % info.pid
        if info.pid == self.self_pid:
            return 'this is the reclaiming process itself'
        if info.pid in self.self_ancestors:
            return 'an ancestor of the reclaiming process'
        if info.kernel_thread:
            return 'a kernel thread'
        # Session 0 means "the session leader lives outside this PID namespace" (a container's
        # docker exec, CI runners): it groups unrelated processes, so it protects nothing.
        if self.self_session > 0 and info.session == self.self_session:
            return 'in the session of the reclaiming process'
        hit = sorted(info.names & self.protect_names)
        if hit and name_trusted(info.identity):
            return 'protected name %s (protect_names)' % hit[0]
        user = self.user_of_uid(info.uid) if info.uid is not None else None
        if user is not None and user in self.protect_users:
            return 'protected user %s (protect_users)' % user
        if self.euid != 0 and info.uid != self.euid:
            return 'owned by %s; a non-root caller may only signal its own processes' % (user or 'an unknown user')
        return None


def is_same(pid, starttime, proc_root='/proc'):
    """True while ``pid`` still names the process that started at ``starttime`` and is not a zombie."""
    info = read_proc(pid, proc_root)
    return info is not None and info.starttime == starttime and not info.dead


def send_signal(pid, starttime, signum, proc_root='/proc'):
    """Signal (pid, starttime) if and only if it is still that process.

    Returns 'sent', 'gone' (exited or reaped), 'reused' (the pid now names another process) or
    'denied' (the kernel refused: another user's process).
    """
    pidfd = None
    if hasattr(os, 'pidfd_open') and hasattr(signal, 'pidfd_send_signal'):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                return 'gone'
            pidfd = None  # kernel without pidfd (ENOSYS), or a seccomp filter: fall back below
    try:
        # With a pidfd the check below looks at the very process the pidfd pins: if the pid is
        # reused after this point, pidfd_send_signal fails with ESRCH instead of hitting the new one.
        info = read_proc(pid, proc_root)
        if info is None or info.dead:
            return 'gone'
        if info.starttime != starttime:
            return 'reused'
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            return 'gone'
        except PermissionError:
            return 'denied'
        return 'sent'
    finally:
        if pidfd is not None:
            os.close(pidfd)


class Victim(object):
    """One process to signal, with what was recorded at discovery and what happened to it."""

    def __init__(self, pid, starttime, record=None, parent=None):
        self.pid = pid
        self.starttime = starttime
        self.record = dict(record or {})
        self.parent = parent          # the selected pid this one was collected under (tree: true)
        self.signals = []
        self.outcome = None           # killed | failed | skipped
        self.reason = None
        self.exit_seconds = None
        self.release_seconds = None

    def as_result(self):
        out = dict(self.record)
        out.update({'pid': self.pid, 'signals': list(self.signals), 'seconds_to_exit': _round(self.exit_seconds),
                    'seconds_to_release': _round(self.release_seconds), 'reason': self.reason})
        if self.parent is not None:
            out['parent_pid'] = self.parent
        return out


def _round(value):
    return None if value is None else round(value, 3)


def signal_name(signum):
    return signal.Signals(signum).name


def terminate(victims, signum=signal.SIGTERM, timeout=10.0, force=False, kill_timeout=5.0, check_mode=False,
              proc_root='/proc', clock=time.monotonic, sleep=time.sleep, poll=0.05, on_sent=None):
    """Signal every victim at once, wait for all of them together, escalate survivors to SIGKILL.

    Victims are signalled back to back (not one wait after another), so 20 processes take about as
    long as the slowest.  Victims whose ``outcome`` is already set are left alone.  In check mode
    nothing is sent and every victim is reported with the signals a real run would send
    (SIGKILL listed only with ``force``, for a process that outlives ``timeout``).  Each victim
    ends as ``killed`` (exited, or exited by itself during the run), ``failed`` with the reason,
    or ``skipped`` (its pid was reused before the signal).  Returns the victims.

    ``on_sent(victims)`` is called once, right after the first signals went out and before any wait
    (when at least one was sent): the moment to record them, since the caller may be killed while
    it waits (a dropped SSH session, a crashing library).
    """
    todo = [victim for victim in victims if victim.outcome is None]
    escalate = force and signum != signal.SIGKILL
    if check_mode:
        for victim in todo:
            victim.outcome = 'killed'
            victim.signals = [signal_name(signum)] + (['SIGKILL'] if escalate else [])
            victim.reason = 'would be signalled (check mode)'
        return victims
    start = clock()
    pending = _signal_all(todo, signum, start, clock, proc_root, 'the signal')
    if on_sent is not None and any(victim.signals for victim in todo):
        on_sent(todo)
    pending = _wait_exit(pending, start, timeout, proc_root, clock, sleep, poll)
    if pending and escalate:
        killed_at = clock()
        pending = _signal_all(pending, signal.SIGKILL, start, clock, proc_root, 'SIGKILL')
        pending = _wait_exit(pending, killed_at, kill_timeout, proc_root, clock, sleep, poll, base=start)
    for victim in pending:
        info = read_proc(victim.pid, proc_root)
        victim.outcome = 'failed'
        if info is not None and info.state == 'D':
            victim.reason = ('still running in uninterruptible sleep (D state), probably inside the driver; '
                             'a GPU reset or a reboot may be needed')
        elif escalate or signum == signal.SIGKILL:
            victim.reason = 'still running %.1f s after SIGKILL' % (kill_timeout if escalate else timeout)
        else:
            victim.reason = 'still running %.1f s after %s; use force=true to send SIGKILL' % (timeout, signal_name(signum))
    return victims


def _signal_all(victims, signum, start, clock, proc_root, what):
    """Send ``signum`` to each victim back to back; returns those that received it."""
    sent = []
    for victim in victims:
        status = send_signal(victim.pid, victim.starttime, signum, proc_root)
        if status == 'sent':
            victim.signals.append(signal_name(signum))
            sent.append(victim)
        elif status == 'gone':
            victim.outcome, victim.exit_seconds = 'killed', clock() - start
            if not victim.signals:
                victim.reason = 'exited by itself before the signal'
        elif status == 'denied':
            victim.outcome = 'failed'
            victim.reason = 'the kernel refused %s (operation not permitted): another user\'s process' % signal_name(signum)
        else:
            victim.outcome = 'skipped'
            victim.reason = 'pid %d was reused by another process before %s; not signalled' % (victim.pid, what)
    return sent


def _intervals(poll):
    """Poll intervals: a few quick looks first (most processes exit within milliseconds), then ``poll``."""
    interval = min(0.001, poll)
    while True:
        yield interval
        interval = min(poll, interval * 2)


def _wait_exit(pending, since, timeout, proc_root, clock, sleep, poll, base=None):
    """Poll until every pending victim is gone or ``timeout`` passed; returns the survivors."""
    base = since if base is None else base
    deadline = since + timeout
    intervals = _intervals(poll)
    while pending:
        now = clock()
        still = []
        for victim in pending:
            if is_same(victim.pid, victim.starttime, proc_root):
                still.append(victim)
            else:
                victim.outcome = 'killed'
                victim.exit_seconds = now - base
        pending = still
        if not pending or now >= deadline:
            break
        sleep(min(next(intervals), max(0.0, deadline - now)))
    return pending


def wait_release(expected, probe, timeout=15.0, clock=time.monotonic, sleep=time.sleep, poll=0.1):
    """Wait until the driver shows the memory of exited processes as free.

    ``expected`` maps a GPU key to ``{'pids': set of pids that must leave the driver's lists,
    'before_mib': used MiB before the kill (or None), 'held_mib': MiB those pids held (or None)}``.
    ``probe()`` returns ``{gpu key: (used_mib or None, set of listed pids or None)}`` from a fresh
    driver read.  A GPU counts as released when its process list was read and lists none of its
    pids any more, and its used memory has dropped by what they held (when both are known).  A GPU
    missing from the view, or whose process list could not be read, is never called released.  Returns ``{gpu key: {'released': bool,
    'seconds': float or None, 'freed_mib': int or None, 'unreleased_mib': int}}``.
    """
    start = clock()
    deadline = start + timeout
    intervals = _intervals(poll)
    result = {key: {'released': False, 'seconds': None, 'freed_mib': None, 'unreleased_mib': 0} for key in expected}
    while True:
        view = probe()
        now = clock()  # after the read: the memory is confirmed free no earlier than this
        waiting = False
        for key, want in expected.items():
            entry = result[key]
            used, listed = view.get(key, (None, None))
            before, held = want.get('before_mib'), want.get('held_mib')
            if before is not None and used is not None:
                entry['freed_mib'] = max(0, int(round(before - used)))
            if entry['released']:
                continue
            target = None if before is None or held is None else before - held
            gone = listed is not None and not set(want['pids']) & set(listed)
            done = gone and (target is None or used is None or used <= target + 0.5)
            if done:
                entry['released'], entry['seconds'] = True, now - start
            else:
                waiting = True
                if target is not None and used is not None:
                    entry['unreleased_mib'] = max(0, int(round(used - target)))
                elif held is not None:
                    entry['unreleased_mib'] = int(held)
        if not waiting or now >= deadline:
            break
        sleep(min(next(intervals), max(0.0, deadline - now)))
    for entry in result.values():
        if entry['released']:
            entry['unreleased_mib'] = 0
        if entry['seconds'] is not None:
            entry['seconds'] = round(entry['seconds'], 3)
    return result
