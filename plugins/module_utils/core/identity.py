# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Who a process is: the one reader of a process's identity, fed only by what the kernel vouches for.

Every consumer (the inventory, the killer, the policy, the rogue detector, the history, the logs)
takes a process's owner and start time from here.  What each field trusts (docs/security.md):

``starttime``  field 22 of ``/proc/PID/stat`` (after the last ``)``: the comm before it is the
               user's text).  Read FIRST and checked again LAST: a record whose process vanished or
               whose pid names another process by the end of the read is discarded (``None``).
``uids``       real, effective, saved and filesystem uid from the one exact ``Uid:\\t`` line of
               ``/proc/PID/status``, parsed as bytes split at ``b'\\n'`` only.  The kernel escapes
               only ``\\n`` and ``\\`` in the ``Name:`` line above it: ``str.splitlines()`` would also
               split at ``\\r``, ``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028``..., so a
               process named ``"\\x1cUid:\\t0"`` could forge its owner.  The owner of the ``/proc/PID``
               directory is NOT used: a process that makes itself non-dumpable
               (``prctl(PR_SET_DUMPABLE, 0)``) turns it to root.
``exe``        the inode that ``/proc/PID/exe`` points to (``os.stat`` follows the kernel's link to the
               file actually executed, even when it was deleted or replaced): device, inode, owner,
               mode, and whether a directory on its path is writable by a user other than root.

User-chosen text (comm, argv, environment, cgroup paths a user may create, files in directories a
user may write) is read elsewhere and never decides an owner or a protection: a protected *name*
counts only for a process whose owner could not have chosen it (``name_trusted``).
"""

from __future__ import annotations

import os
import stat as stat_mod

_O_CLOEXEC = getattr(os, 'O_CLOEXEC', 0)
_O_NOFOLLOW = getattr(os, 'O_NOFOLLOW', 0)
# /proc/PID/status is about 1.5 KiB; the Name line is at most 64 escaped bytes.
STATUS_LIMIT = 64 * 1024
# The highest uid of a system account when /etc/login.defs does not say (Debian, Red Hat, SUSE: 999).
DEFAULT_SYS_UID_MAX = 999
LOGIN_DEFS = '/etc/login.defs'
# The owner the quota rules charge a process to when its uid cannot be read (never skipped).
UNKNOWN_OWNER = 'uid:unknown'
_SYS_UID_MAX = {}  # path -> boundary, read once per process


def kernel_lines(data):
    """The lines of a kernel-provided /proc file (bytes or text), split at the newline ONLY.

    The one way the core splits such files: ``splitlines()`` also breaks at characters the kernel
    leaves unescaped in user-chosen fields (a process name, a cgroup or file name), which would let
    a user forge lines.
    """
    return data.split(b'\n' if isinstance(data, bytes) else '\n')


def read_bytes(path, limit=None):
    """The whole file (at most ``limit`` bytes) through os.open/os.read: /proc files are small, and
    a buffered file object costs more than the read itself when thousands are read per snapshot."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        chunks = []
        size = 0
        while limit is None or size < limit:
            chunk = os.read(fd, 65536 if limit is None else min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return chunks[0] if len(chunks) == 1 else b''.join(chunks)
    finally:
        os.close(fd)


def parse_stat(text):
    """Parse /proc/PID/stat -> dict(comm, state, ppid, session, flags, starttime); fields after the last ')'."""
    end = text.rfind(')')
    start = text.find('(')
    if end < 0 or start < 0:
        raise ValueError('malformed stat line')
    rest = text[end + 2:].split()
    # rest[0] is field 3 (state), so field N is rest[N - 3].
    return {'comm': text[start + 1:end], 'state': rest[0], 'ppid': int(rest[1]), 'session': int(rest[3]),
            'flags': int(rest[6]), 'starttime': int(rest[19])}


def read_stat(pid, proc_root='/proc'):
    """parse_stat() of /proc/PID/stat, or None when the process is gone (or its stat is malformed)."""
    return _stat_at(os.path.join(proc_root, str(pid)))


def _stat_at(base):
    """read_stat of the process directory ``base`` (``/proc/PID``)."""
    try:
        return parse_stat(read_bytes(base + '/stat').decode('utf-8', 'replace'))
    except (OSError, ValueError, IndexError):
        return None


def read_starttime(pid, proc_root='/proc'):
    """Field 22 of /proc/PID/stat (clock ticks after boot): identifies a pid across reuse.  None if gone."""
    stat = read_stat(pid, proc_root)
    return None if stat is None else stat['starttime']


def read_ppid(pid, proc_root='/proc'):
    """The parent pid of ``pid`` (field 4 of /proc/PID/stat), or None when it is gone.  The one reader
    of a parent pid: the killer's process trees and the DRM client owner use it."""
    stat = read_stat(pid, proc_root)
    return None if stat is None else stat['ppid']


def parse_status_uids(data):
    """(real, effective, saved, filesystem) uids from /proc/PID/status bytes, or None.

    Only a line that starts with exactly ``Uid:\\t`` and holds four decimal numbers counts, and only
    when there is exactly one such line (the kernel writes one; two mean a forged one).
    """
    if not isinstance(data, bytes):
        raise TypeError('parse_status_uids() needs the bytes of /proc/PID/status, got %s' % type(data).__name__)
    # the lines (split at b'\n' only) that start with b'Uid:\t', found without splitting the whole file
    first = data.startswith(b'Uid:\t')
    if data.count(b'\nUid:\t') + first != 1:
        return None
    start = 0 if first else data.index(b'\nUid:\t') + 1
    end = data.find(b'\n', start)
    fields = data[start + 5:end if end >= 0 else len(data)].split(b'\t')
    if len(fields) != 4 or not all(field.isdigit() for field in fields):
        return None
    return tuple(int(field) for field in fields)


def system_uid_max(path=LOGIN_DEFS):
    """The highest uid of a system account: ``SYS_UID_MAX`` of /etc/login.defs (below its ``UID_MIN``),
    else 999.  The file counts only when it is a regular root-owned file nobody else may write
    (opened without following a symlink, checked on the open descriptor).  Read once per process."""
    if path in _SYS_UID_MAX:
        return _SYS_UID_MAX[path]
    values = {}
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    except OSError:
        fd = None
    if fd is not None:
        try:
            info = os.fstat(fd)
            if stat_mod.S_ISREG(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022:
                data = b''
                while len(data) < 1024 * 1024:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    data += chunk
                for line in kernel_lines(data):
                    parts = line.split()
                    if len(parts) >= 2 and parts[0] in (b'SYS_UID_MAX', b'UID_MIN') and parts[1].isdigit():
                        values[parts[0]] = int(parts[1])
        except OSError:
            values = {}
        finally:
            os.close(fd)
    boundary = values.get(b'SYS_UID_MAX', DEFAULT_SYS_UID_MAX)
    if b'UID_MIN' in values:
        boundary = min(boundary, values[b'UID_MIN'] - 1)
    _SYS_UID_MAX[path] = max(0, boundary)
    return _SYS_UID_MAX[path]


class _Value(object):
    """Equality over the ``__slots__`` (records are copied when a snapshot joins them)."""

    __slots__ = ()
    __hash__ = None

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)


class ExeIdentity(_Value):
    """The file a process executes: ``os.stat('/proc/PID/exe')`` and where it was executed from.

    ``dir_writable``: True when a directory on ``path`` (in the process's own root) is owned by a
    user other than root or is writable by group or others (sticky ones such as /tmp included:
    anyone may name a file there), None when one cannot be examined, else False.
    """

    __slots__ = ('path', 'deleted', 'dev', 'ino', 'uid', 'mode', 'dir_writable')

    def __init__(self, path, deleted, dev, ino, uid, mode, dir_writable):
        self.path = path
        self.deleted = deleted
        self.dev = dev
        self.ino = ino
        self.uid = uid
        self.mode = mode
        self.dir_writable = dir_writable

    @property
    def root_owned(self):
        """A root-owned file that neither its group nor others may write."""
        return self.uid == 0 and not self.mode & 0o022

    @property
    def trusted(self):
        """Root-owned, not writable by others, and executed from directories only root may write."""
        return self.root_owned and self.dir_writable is False

    def to_dict(self):
        return {'path': self.path, 'deleted': self.deleted, 'dev': self.dev, 'ino': self.ino, 'uid': self.uid,
                'mode': '%04o' % stat_mod.S_IMODE(self.mode), 'dir_writable': self.dir_writable}

    def __repr__(self):
        return 'ExeIdentity(%r, dev=%s, ino=%s, uid=%s, mode=%o, dir_writable=%s)' % (
            self.path, self.dev, self.ino, self.uid, self.mode, self.dir_writable)


def dirs_writable(path, cache=None, root=''):
    """Whether a user other than root may write a directory on the absolute ``path`` (True/False),
    None when a directory cannot be examined.  ``root``: where ``path`` is looked up, ``/proc/PID/root``
    for a process's own view (its mount namespace, its chroot), '' for ours.  ``cache``: a dict
    reused across calls of one scan."""
    if not path.startswith('/'):
        return None
    directory = os.path.dirname(path)
    chain = []
    while True:
        chain.append(directory)
        if directory == '/':
            break
        directory = os.path.dirname(directory)
    for directory in chain:
        where = root + directory  # '/proc/PID/root/' ends in a slash: the link to the process's root is followed
        if cache is not None and where in cache:
            verdict = cache[where]
        else:
            try:
                info = os.lstat(where)
            except OSError:
                verdict = None
            else:
                verdict = not stat_mod.S_ISDIR(info.st_mode) or info.st_uid != 0 or bool(info.st_mode & 0o022)
            if cache is not None:
                cache[where] = verdict
        if verdict is not False:
            return verdict
    return False


def read_exe_identity(pid, proc_root='/proc', dir_cache=None):
    """The ExeIdentity of ``pid``'s executable, or None (a kernel thread, a zombie, no permission).

    The directories of its path are examined in the process's own root (``/proc/PID/root``), so a
    process of another mount namespace or chroot is judged by the directories it ran from.
    """
    base = os.path.join(proc_root, str(pid))
    link = base + '/exe'
    try:
        path = os.readlink(link)
    except OSError:
        return None
    deleted = path.endswith(' (deleted)')
    try:
        info = os.stat(link)
    except OSError:  # the path is known, the file is not: nothing about it is vouched for
        return ExeIdentity(path, deleted, None, None, None, 0, None)
    # deleted: the package was upgraded while it runs; its directories are still what they were
    writable = dirs_writable(path[:-len(' (deleted)')] if deleted else path, dir_cache, base + '/root')
    return ExeIdentity(path, deleted, info.st_dev, info.st_ino, info.st_uid, info.st_mode, writable)


class Identity(_Value):
    """Who one process is, at one moment, from kernel-vouched fields only (None: unknown).

    ``uids``: (real, effective, saved, filesystem) or None; ``exe``: an ExeIdentity or None.
    ``comm`` is the process's own text and is kept only for display.
    """

    __slots__ = ('pid', 'starttime', 'state', 'ppid', 'session', 'flags', 'comm', 'uids', 'exe')

    def __init__(self, pid, starttime, state=None, ppid=None, session=None, flags=0, comm=None, uids=None, exe=None):
        self.pid = pid
        self.starttime = starttime
        self.state = state
        self.ppid = ppid
        self.session = session
        self.flags = flags
        self.comm = comm
        self.uids = uids
        self.exe = exe

    @property
    def uid(self):
        """The real uid: the owner every consumer charges and names.  None when unknown."""
        return self.uids[0] if self.uids else None

    def system_account(self, boundary=None):
        """True when the real, effective and saved uids are all system accounts (<= ``boundary``,
        default system_uid_max()): an ordinary user cannot start such a process herself."""
        if not self.uids:
            return False
        boundary = system_uid_max() if boundary is None else boundary
        return max(self.uids[:3]) <= boundary

    def name_trusted(self, boundary=None):
        """Whether this process's name may protect it: a system account runs it, from a root-owned
        executable outside directories that users may write."""
        return self.system_account(boundary) and self.exe is not None and self.exe.trusted

    def why_name_untrusted(self, boundary=None):
        """Why a protected name does not protect this process (None when it does)."""
        if self.name_trusted(boundary):
            return None
        if not self.uids:
            return 'its owner is unknown'
        if not self.system_account(boundary):
            return 'it runs as uid %d, not a system account' % max(self.uids[:3])
        if self.exe is None:
            return 'its executable cannot be examined'
        if not self.exe.root_owned:
            return 'its executable %s is not a root-owned file that only root may write' % self.exe.path
        return 'its executable %s sits in a directory that a user may write' % self.exe.path

    def __repr__(self):
        return 'Identity(pid=%s, starttime=%s, uids=%s, exe=%r)' % (self.pid, self.starttime, self.uids, self.exe)


def name_trusted(identity, boundary=None):
    """``identity.name_trusted()``, False for no identity (a record without one, a fixture)."""
    return identity is not None and identity.name_trusted(boundary)


def read_identity(pid, proc_root='/proc', during=None, exe=True, dir_cache=None):
    """Read who ``pid`` is, in the only safe order: the start time first, then the uids (and the
    executable's identity), then ``during()`` (the caller's reads of user-chosen text: command line,
    psutil fields...), then the start time again.

    Returns ``(Identity, during's result)``, or ``(None, None)`` when the process is gone or its pid
    named another process by the end (a record read across a pid reuse is discarded whole, so no
    field of one process is ever attributed to another).  Exceptions from ``during`` propagate.
    """
    base = os.path.join(proc_root, str(pid))   # joined once: the reads below are in its directory
    first = _stat_at(base)
    if first is None:
        return None, None
    uids = None
    for _attempt in range(2):  # an owner that cannot be read is read once more
        try:
            uids = parse_status_uids(read_bytes(base + '/status', STATUS_LIMIT))
        except OSError:
            uids = None
        if uids is not None:
            break
    exe_identity = read_exe_identity(pid, proc_root, dir_cache) if exe else None
    extra = during() if during is not None else None
    last = _stat_at(base)
    if last is None or last['starttime'] != first['starttime']:
        return None, None
    return Identity(pid, last['starttime'], last['state'], last['ppid'], last['session'], last['flags'], last['comm'],
                    uids, exe_identity), extra
