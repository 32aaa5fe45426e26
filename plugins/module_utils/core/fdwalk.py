# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""The one walk of the processes' open files (``/proc/PID/fd``), bounded whatever users hold.

Which file an fd is costs one readlink per descriptor, and any user can hold millions of them (of
/dev/null, say) without a GPU: 50 processes of 19,990 made an unbounded walk cost seconds.  So every
walk runs under an ``FdBudget`` (docs/security.md T69-T71):

* the pids that matter are walked first, by their own call (``pids=``: the driver's listed pids, the
  processes about to be signalled), and may use all of the budget, a table read in part if need be;
* every other process: procfs gives a process's number of open fds as the size of its fd directory
  (Linux 6.2+), one stat per process.  The ordinary tables are read as they come while the first half of
  the budget lasts (a busy node never gets further: one pass, as fast as an unbounded walk); every other
  table afterwards, smallest first, whole or not at all.  So what is left when the budget runs out is
  the largest tables, never the small ones of daemons and jobs;
* a table of more than ORDINARY_TABLE fds (the default soft RLIMIT_NOFILE: a process must raise its
  own limit to hold more) is read only while the large tables read stay within LARGE_FLOOR, or within
  what the ordinary tables cost if that is more: large tables at most double a walk's work;
* at most ``descriptors`` links read and fd names listed in all, and no process started after
  ``seconds``.

What a walk leaves is kept in ``FdBudget.unread`` (pid -> its number of fds) and reported by
``FdBudget.incomplete()`` (the snapshot's ``holders_incomplete``), never dropped in silence.
Before Linux 6.2 the sizes are unknown: processes are read in pid order, each listed first.
"""

from __future__ import annotations

import os
import time
from operator import itemgetter

DESCRIPTORS = 131072     # links read and names listed per walk: 4x a busy node (10,000 processes, ~30,000 fds)
SECONDS = 3.0            # no process is started after this much time in one walk
ORDINARY_TABLE = 1024    # fds: a larger table is a large one (its process raised RLIMIT_NOFILE)
LARGE_FLOOR = 16384      # descriptors the large tables may always use (a database's, a server's)
VICTIM_DESCRIPTORS = 1 << 20   # per run for the processes about to be signalled: one whole table of the kernel's default fs.nr_open
REPORTED = 10            # processes named in incomplete()
DEFAULT = object()       # FdBudget: the module's bound

_O_CLOEXEC = getattr(os, 'O_CLOEXEC', 0)
_FD_NAMES = tuple(str(fd) for fd in range(256))   # "0" .. "255": the names of a counted read
_FD_GAPS = 4             # absent fd numbers a counted read tries past before it lists the directory
_first = itemgetter(0)


class FdBudget(object):
    """The bound of one or more walks (the same object shares it), the work they did and what they left.

    ``descriptors``: links read plus fd names listed (None: no bound; default DESCRIPTORS); ``seconds``: no
    process is started after that much time from now (None: no deadline; default SECONDS); ``clock``: a test seam.
    Counted work: ``readlinks``, ``listed``, ``visited`` (processes whose fd directory was looked at).
    """

    def __init__(self, descriptors=DEFAULT, seconds=DEFAULT, clock=time.monotonic):
        self.limit = DESCRIPTORS if descriptors is DEFAULT else descriptors   # (the module's bounds, read now: a test seam)
        self.seconds = seconds = SECONDS if seconds is DEFAULT else seconds
        self.clock = clock
        self.deadline = None if seconds is None else clock() + seconds
        self.readlinks = 0
        self.listed = 0
        self.visited = 0
        self.ordinary = 0        # descriptors of tables of at most ORDINARY_TABLE (the priority pids' are not booked)
        self.large = 0           # descriptors of larger tables
        self.unread = {}         # pid -> number of fds (None: unknown) of a process not read, or read in part
        self.reason = None       # 'descriptors', 'large tables' or 'time': why the first process was left

    @property
    def used(self):
        return self.readlinks + self.listed

    def left(self):
        """Descriptors still allowed (None: no bound)."""
        return None if self.limit is None else max(0, self.limit - self.used)

    def leave(self, pid, count, reason):
        self.unread[pid] = count
        if self.reason is None:
            self.reason = reason

    def admit(self, count, priority):
        """How much one more process may cost (None: no bound), or False to leave it (``count``: its fds or None)."""
        if self.deadline is not None and self.clock() >= self.deadline:
            return self._no('time')
        left = self.left()
        if left is None:
            return None
        if left <= 0 or (not priority and count is not None and count > left):
            return self._no('descriptors')
        if not priority and count is not None and count > ORDINARY_TABLE and self.large + count > max(LARGE_FLOOR, self.ordinary):
            return self._no('large tables')
        return left

    def _no(self, reason):
        self.reason = self.reason or reason
        return False

    def spent(self, count, read, priority):
        """Book ``read`` descriptors of a table of ``count`` fds (None: unknown) as ordinary or large (a priority
        pid's as neither: its table is no measure of what the others may cost)."""
        if priority:
            return
        if count is None or count <= ORDINARY_TABLE:
            self.ordinary += read
        else:
            self.large += read

    def incomplete(self):
        """None when nothing was left; else what was: ``reason``, ``processes``, ``descriptors`` (the fds of the
        processes left, where known), ``largest`` (the REPORTED largest: pid and fds), ``read`` (links), and the
        bounds ``limit`` (descriptors) and ``seconds``."""
        if not self.unread:
            return None
        largest = sorted(self.unread, key=lambda pid: (-(self.unread[pid] or 0), pid))[:REPORTED]
        return {'reason': self.reason or 'descriptors', 'processes': len(self.unread),
                'descriptors': sum(count for count in self.unread.values() if count),
                'largest': [{'pid': pid, 'fds': self.unread[pid]} for pid in largest],
                'read': self.readlinks, 'limit': self.limit, 'seconds': self.seconds}


def incomplete_text(found):
    """One sentence on what a walk's bound left (FdBudget.incomplete(), ``user`` added where known)."""
    bound = {'descriptors': 'its bound of %s descriptors' % found['limit'], 'time': 'its time bound (%s s)' % found['seconds'],
             'large tables': 'its share for fd tables of more than %d (%d descriptors, or what the smaller ones cost)' % (
                 ORDINARY_TABLE, LARGE_FLOOR)}.get(found['reason'], found['reason'])
    largest = ', '.join('pid %d (%s, %s fds)' % (e['pid'], e.get('user') or 'user unknown', 'unknown' if e['fds'] is None else e['fds'])
                        for e in found['largest'][:3])
    return ('the open files of %d process(es) were not read (%s ran out; the largest fd tables are left first), so a GPU '
            'device file among them is not seen; largest: %s' % (found['processes'], bound, largest or 'unknown'))


def fd_dirs_report_counts(proc_root='/proc'):
    """True when ``stat()`` of ``<proc_root>/PID/fd`` gives the number of open fds as its size
    (procfs since Linux 6.2); checked on our own fd directory.  False for fixture trees and older
    kernels (their size is 0, or a directory's size)."""
    path = os.path.join(proc_root, 'self', 'fd')
    try:
        count = os.stat(path).st_size
        names = os.listdir(path)  # includes the fd listdir itself opens
    except OSError:
        return False
    return count > 0 and len(names) in (count, count + 1)


def walk_fd_links(proc_root='/proc', pids=None, exclude=(), ordered=False, budget=None, until=None):
    """Walk ``<proc_root>/*/fd`` once under ``budget`` (a default FdBudget when None): the one fd walk of the core.

    ``pids``: only these, first in the budget's claim (a table may be read in part); else every process
    but ``exclude``, the largest tables left first (see the module's doc).  ``until``: a test of a link
    target that ends the read of a process at the first target it accepts (whether it holds such a file).
    Yields ``(pid, names, targets, complete)``: the fd names and their link targets (parallel
    sequences); ``complete`` True when every link was read (or, with ``until``, reading stopped at the
    first target ``until`` accepts), False when some or all were denied (nothing read when the
    directory itself is), None when the budget cut the table (the pid is in ``budget.unread``).
    Processes that vanish mid-walk are skipped; ``ordered``: in ascending pid order.

    The hot loop of a full snapshot, nearly all of it kernel time, so it makes as few system calls as
    it can: links are read relative to one open ``proc_root``, and where procfs reports the number of
    open fds (Linux 6.2+) a process whose fds are 0..N-1, as most are, costs one stat and N readlinks.
    A few gaps in the numbers cost a failed readlink each; after _FD_GAPS of them, or when a link is
    denied, the directory is listed (at most what the budget allows) and only the fds not read yet are read.
    """
    budget = FdBudget() if budget is None else budget
    exclude = set(exclude)
    try:
        proc_fd = os.open(proc_root, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    except OSError:
        return
    try:
        if pids is not None:
            entries = [str(int(pid)) for pid in pids if int(pid) >= 0 and int(pid) not in exclude]
        else:
            try:
                entries = [e for e in os.listdir(proc_fd) if e.isdigit() and int(e) not in exclude]
            except OSError:
                return
        priority = pids is not None
        if fd_dirs_report_counts(proc_root):
            found = _counted_walk(proc_fd, proc_root, entries, budget, priority, until)
        else:
            found = (_walk_one(proc_fd, proc_root, entry, None, budget, priority, until) for entry in sorted(entries, key=int))
        found = (item for item in found if item is not None)
        yield from (sorted(found, key=_first) if ordered else found)
    finally:
        os.close(proc_fd)


def _counted_walk(proc_fd, proc_root, entries, budget, priority, until):
    """walk_fd_links's yields (None for a process left or gone) where procfs counts each process's fds: the ordinary
    tables as they come while the first half of the budget lasts (one pass, stat then links, while the kernel has
    the process at hand: a busy node never gets further), then every other table, smallest first."""
    stat, deferred = os.stat, []
    half = None if budget.limit is None else budget.limit // 2
    for index, entry in enumerate(entries):   # digits only (listed so, or made from numbers)
        if index & 63 == 63 and budget.deadline is not None and budget.clock() >= budget.deadline:
            for rest in entries[index:]:
                budget.leave(int(rest), None, 'time')
            break
        try:
            count = stat(entry + '/fd/', dir_fd=proc_fd).st_size
        except OSError:  # gone (or not a process)
            continue
        budget.visited += 1
        if count <= ORDINARY_TABLE and (half is None or budget.readlinks + budget.listed + count <= half):
            yield _walk_one(proc_fd, proc_root, entry, count, budget, priority, until)
        else:
            deferred.append((count, entry))
    deferred.sort(key=_first)   # stable: equal sizes stay in the given order (procfs lists pids in ascending order)
    for count, entry in deferred:
        yield _walk_one(proc_fd, proc_root, entry, count, budget, priority, until)


def _walk_one(proc_fd, proc_root, entry, count, budget, priority, until):
    """One process of walk_fd_links under ``budget``: its yield, or None (left, or gone)."""
    pid = int(entry)
    if (until is None and count is not None and count <= len(_FD_NAMES)
            and (budget.limit is None or budget.limit - budget.readlinks - budget.listed >= count)
            and (budget.deadline is None or budget.clock() < budget.deadline)):
        # the fast path of nearly every process (admitted: an ordinary table within the budget): fds 0..count-1,
        # no gap, no object and no call per fd
        targets, readlink, fd_dir = [], os.readlink, entry + '/fd/'
        try:
            for name in _FD_NAMES[:count]:
                targets.append(readlink(fd_dir + name, dir_fd=proc_fd))
        except OSError as exc:
            budget.readlinks += len(targets) + 1
            table = _Table(proc_fd, entry, budget, budget.left() + len(targets) + 1 if budget.limit is not None else None,
                           until, targets, len(targets) + 1)
            return table.finish(pid, proc_root, count, priority, exc)
        budget.readlinks += count
        if not priority:
            budget.ordinary += count
        return pid, _FD_NAMES[:count], targets, True
    cap = budget.admit(count, priority)
    if cap is False:
        budget.leave(pid, count, budget.reason)
        return None
    if count is None:
        budget.visited += 1
    table = _Table(proc_fd, entry, budget, cap, until)
    return table.finish(pid, proc_root, count, priority)


class _Table(object):
    """Reading one process's fd links: at most ``cap`` links read plus names listed (None: no bound), booked in
    ``budget``; ``until``: stop at the first target it accepts.  ``targets``: fds 0.. read already (the fast
    path), ``tried``: the readlinks that took (booked already)."""

    def __init__(self, proc_fd, entry, budget, cap, until, targets=None, tried=0):
        self.proc_fd, self.entry, self.fd_dir = proc_fd, entry, entry + '/fd/'
        self.budget, self.cap, self.until = budget, cap, until
        self.start = budget.used - tried
        self.targets = targets if targets is not None else []
        self.names = list(_FD_NAMES[:len(self.targets)])

    def used(self):
        return self.budget.used - self.start

    def full(self):
        return self.cap is not None and self.used() >= self.cap

    def finish(self, pid, proc_root, count, priority, failed=None):
        """The walk's yield for this process (None: gone), its work booked in the budget.  ``failed``: the error
        that ended the fast path."""
        found = self.read(proc_root, count, failed)
        if found is None:
            return None
        names, targets, complete = found
        self.budget.spent(count if count is not None else len(names), self.used(), priority)
        if complete is None:
            self.budget.leave(pid, count, 'descriptors')
        return pid, names, targets, complete

    def read(self, proc_root, count, failed=None):
        """(names, targets, complete as walk_fd_links yields it), or None when the process is gone."""
        if count is not None:
            want = count if self.cap is None else min(count, self.cap)
            if failed is None:
                stopped = self.numbered_from(0, 0, want)
            elif isinstance(failed, PermissionError):
                stopped = 'denied'
            else:
                stopped = self.numbered_from(len(self.targets) + 1, 1, want)
            if stopped == 'found' or (stopped is None and len(self.targets) == count):
                return self.names, self.targets, True
            if stopped in (None, 'cap'):   # the cap cut the table
                return self.names, self.targets, None
        return self.listed(os.path.join(proc_root, self.entry, 'fd'))

    def numbered_from(self, number, gaps, want):
        """numbered() from fd ``number`` on, ``gaps`` absent numbers met already."""
        readlink, fd_dir, proc_fd, budget = os.readlink, self.fd_dir, self.proc_fd, self.budget
        while len(self.targets) < want:
            if self.full():
                return 'cap'
            name = _FD_NAMES[number] if number < len(_FD_NAMES) else str(number)
            number += 1
            budget.readlinks += 1
            try:
                target = readlink(fd_dir + name, dir_fd=proc_fd)
            except PermissionError:
                return 'denied'
            except OSError:
                gaps += 1
                if gaps > _FD_GAPS:
                    return 'gaps'
                continue
            self.targets.append(target)
            self.names.append(name)
            if self.until is not None and self.until(target):
                return 'found'
        return None

    def listed(self, path):
        """List the fd directory (within the cap) and read the links not read yet."""
        room = None if self.cap is None else max(0, self.cap - self.used())
        try:
            listed = _list_fds(path, room)
        except PermissionError:
            return (), (), False
        except OSError:  # gone (FileNotFoundError, ProcessLookupError) or not a process
            return None
        cut = room is not None and len(listed) > room
        listed = listed[:room] if cut else listed
        self.budget.listed += len(listed)
        complete, done, readlink = True, frozenset(self.names), os.readlink
        for name in listed:
            if name in done:
                continue
            if self.full():
                return self.names, self.targets, None
            self.budget.readlinks += 1
            try:
                target = readlink(self.fd_dir + name, dir_fd=self.proc_fd)
            except PermissionError:
                complete = False
                continue
            except OSError:  # the fd was closed meanwhile
                continue
            self.names.append(name)
            self.targets.append(target)
            if self.until is not None and self.until(target):
                return self.names, self.targets, True
        return self.names, self.targets, None if cut else complete


def _list_fds(path, limit):
    """The fd names in ``path``, at most ``limit`` + 1 of them (None: all): one more than allowed says there were more."""
    names = []
    with os.scandir(path) as found:
        for item in found:
            names.append(item.name)
            if limit is not None and len(names) > limit:
                break
    return names
