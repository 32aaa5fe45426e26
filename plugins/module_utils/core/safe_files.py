# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Files the guard reads or writes as root: no symbolic link followed, every check on a descriptor.

A path is walked from ``/``: each directory is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative
to its parent's descriptor, so no symbolic link anywhere in the path is followed, and checked with
``fstat`` on that descriptor:

- every directory belongs to root or to the agent's user (its effective uid);
- a directory must not be writable by group or others unless it is sticky (like ``/tmp``: there
  only the owner of an entry may rename or remove it, and every entry below it is checked for its
  owner in turn).  ``strict=False`` (files the guard only writes: log, metrics, lock) lets the
  directories *above* the file's own directory be writable by their group (Ubuntu's ``/var/log``
  is root:syslog 0775): whoever can rename entries there can only put another directory of root's
  in place, and every write goes through descriptors;
- the file itself is opened with ``O_NOFOLLOW`` in its directory's descriptor and checked with
  ``fstat``: a regular file, owned by root or the agent's user, not writable by group or others.

Reads return the bytes read from that descriptor (never opened again by path).  Writes create a
temporary file with ``O_CREAT | O_EXCL | O_NOFOLLOW`` in the checked directory, change its mode
through the descriptor, fsync it and rename it relative to the directory's descriptor.

Anything else raises :class:`UnsafeFile` (an ``OSError``: callers that handle an unreadable file
handle an unsafe one the same way, and never act on it).
"""

from __future__ import annotations

import errno
import os
import stat

_CLOEXEC = getattr(os, 'O_CLOEXEC', 0)
_NOFOLLOW = getattr(os, 'O_NOFOLLOW', 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, 'O_DIRECTORY', 0) | _NOFOLLOW | _CLOEXEC
# how the guard opens a file to read: no link followed, no blocking on a FIFO, never a controlling tty
READ_FLAGS = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, 'O_NONBLOCK', 0) | getattr(os, 'O_NOCTTY', 0)
_MAX_TEMP_ATTEMPTS = 100


class UnsafeFile(OSError):
    """``path`` (a directory when ``is_dir``) fails a check; ``why`` says how (and what to do).

    ``str()`` is the whole sentence; ``strerror`` is too, so ``exc.strerror or exc`` reads well."""

    def __init__(self, path, why, is_dir=False):
        self.why = why
        self.is_dir = is_dir
        self.sentence = 'the %s %s %s' % ('directory' if is_dir else 'file', path, why)
        super(UnsafeFile, self).__init__(errno.EPERM, self.sentence, path)

    def __str__(self):
        return self.sentence


def _writable_by(mode):
    bits = mode & 0o022
    if not bits:
        return None
    return 'group and others' if bits == 0o022 else ('others' if bits & 0o002 else 'its group')


def _owner_problem(info, euid):
    if info.st_uid in (0, euid):
        return None
    return 'is owned by uid %d, not by root or the agent (uid %d)' % (info.st_uid, euid)


def _check_dir(info, path, euid, group_ok):
    """Raise UnsafeFile when the directory ``info`` describes may be changed by someone else."""
    problems = [_owner_problem(info, euid)]
    who = _writable_by(info.st_mode)
    if who and not info.st_mode & stat.S_ISVTX and not (group_ok and who == 'its group'):
        problems.append('is writable by %s (mode %04o); run chmod go-w on it' % (who, stat.S_IMODE(info.st_mode)))
    problems = [p for p in problems if p]
    if problems:
        raise UnsafeFile(path, ' and '.join(problems), is_dir=True)


def check_file_info(info, path, euid=None):
    """Raise UnsafeFile unless ``info`` (an fstat/lstat result) is a regular file that only root or
    the agent's user can change."""
    euid = os.geteuid() if euid is None else euid
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFile(path, 'is a symbolic link; the guard follows no links to its files (configure the real path)')
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(path, 'is not a regular file')
    problems = [_owner_problem(info, euid)]
    who = _writable_by(info.st_mode)
    if who:
        problems.append('is writable by %s (mode %04o); run chmod go-w on it' % (who, stat.S_IMODE(info.st_mode)))
    problems = [p for p in problems if p]
    if problems:
        raise UnsafeFile(path, ' and '.join(problems))


def _open_child_dir(parent_fd, name, path, create_mode):
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if create_mode is None:
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                raise UnsafeFile(path, 'is a symbolic link; the guard follows no links in the paths of its files '
                                 '(configure the real path)', is_dir=True)
            raise UnsafeFile(path, 'is not a directory', is_dir=True)
        raise
    try:
        os.mkdir(name, create_mode, dir_fd=parent_fd)
    except FileExistsError:
        pass
    return _open_child_dir(parent_fd, name, path, None)


def open_dir(path, create_mode=None, euid=None, strict=True):
    """A descriptor of the directory ``path``, walked from ``/`` without following a link, every
    directory checked on its descriptor.  ``create_mode``: create missing directories with it
    (else FileNotFoundError).  Raises UnsafeFile.  The caller closes the descriptor."""
    euid = os.geteuid() if euid is None else euid
    path = os.path.abspath(path)
    names = [name for name in path.split('/') if name]
    fd = os.open('/', _DIR_FLAGS)
    current = '/'
    try:
        _check_dir(os.fstat(fd), current, euid, group_ok=not strict and bool(names))
        for index, name in enumerate(names):
            current = os.path.join(current, name)
            child = _open_child_dir(fd, name, current, create_mode)
            os.close(fd)
            fd = child
            _check_dir(os.fstat(fd), current, euid, group_ok=not strict and index < len(names) - 1)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _split(path):
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    if not name:
        raise UnsafeFile(path, 'names no file', is_dir=True)
    return path, directory, name


def check(path, euid=None, strict=True):
    """Raise UnsafeFile when ``path`` or any directory above it fails the checks; a missing
    directory or file is fine (the guard creates it, and checks it when it does).  Nothing is
    opened but directories: the file is looked at with lstat through its directory's descriptor."""
    path, directory, name = _split(path)
    try:
        dir_fd = open_dir(directory, euid=euid, strict=strict)
    except FileNotFoundError:
        return
    try:
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        check_file_info(info, path, euid)
    finally:
        os.close(dir_fd)


def _follow_dir_links(path, euid, max_links):
    """``path`` with each symbolic link among its directories replaced by its target (``/bin`` -> ``usr/bin``):
    a link is followed only when it is root's (or the agent's) and sits in a directory open_dir accepts, so
    nobody else can swap it.  UnsafeFile otherwise; FileNotFoundError when a component is missing."""
    parts = [part for part in os.path.abspath(path).split('/') if part]
    done = '/'
    hops = 0
    while parts:
        name = parts.pop(0)
        if name in ('', '.'):
            continue
        if name == '..':
            done = os.path.dirname(done)
            continue
        candidate = os.path.join(done, name)
        info = os.lstat(candidate)
        if not stat.S_ISLNK(info.st_mode):
            done = candidate
            continue
        hops += 1
        owner = _owner_problem(info, euid)
        if owner or hops > max_links:
            raise UnsafeFile(candidate, 'is a symbolic link that ' + (owner or 'starts more than %d links' % max_links),
                             is_dir=True)
        os.close(open_dir(done, euid=euid))   # the link's directory: only root may replace the link
        target = os.readlink(candidate)
        if target.startswith('/'):
            done = '/'
        parts = [part for part in target.split('/') if part] + parts
    return done


def resolve_checked(path, euid=None, max_links=8):
    """The regular file ``path`` names, its symbolic links followed one at a time under the checks
    (for a program root will run, such as a virtual environment's ``bin/python``, a link to
    ``/usr/bin/python3.X``, or ``/bin/systemctl`` where ``/bin`` links to ``usr/bin``): every link
    owned by root or the agent's user in a directory walked and checked as open_dir does (strict),
    the directory of every hop likewise, the file checked as check_file_info does.
    Returns the file's path.  FileNotFoundError when something is missing; UnsafeFile otherwise."""
    euid = os.geteuid() if euid is None else euid
    path = os.path.abspath(path)
    for _hop in range(max_links + 1):
        path, directory, name = _split(path)
        directory = _follow_dir_links(directory, euid, max_links)
        path = os.path.join(directory, name)
        dir_fd = open_dir(directory, euid=euid)
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISLNK(info.st_mode):
                check_file_info(info, path, euid)
                return path
            owner = _owner_problem(info, euid)
            if owner:
                raise UnsafeFile(path, 'is a symbolic link that ' + owner)
            path = os.path.normpath(os.path.join(directory, os.readlink(name, dir_fd=dir_fd)))
        finally:
            os.close(dir_fd)
    raise UnsafeFile(path, 'is reached through more than %d symbolic links' % max_links)


# Searched after $PATH, as ansible-core's get_bin_path does: root's tools live there, and cron's PATH lacks them.
SBIN_DIRS = ('/usr/local/sbin', '/usr/sbin', '/sbin')


def find_program(name, search_path=None, euid=None, refused=None):
    """The absolute path of the program ``name`` that this process may run, or None: the one lookup of every
    command the core runs (scontrol, squeue, sinfo, nvidia-smi, amd-smi, xpu-smi, ioreg, systemctl, journalctl).

    ``search_path`` (default ``$PATH``, then SBIN_DIRS): only absolute entries are searched, never an empty or
    relative one (POSIX reads those as the working directory).  As root, a candidate must pass resolve_checked:
    every link, directory and the file root's and not writable by group or others, so that a program planted in a
    directory a user can write (a PATH entry of hers, a group-writable bin directory) is never run as root; it is
    skipped, and why goes into the list ``refused`` when one is given.  Other users run what their PATH names, as
    shutil.which would find it (their own privileges are all it gets)."""
    if not name or '/' in name:
        return None
    euid = os.geteuid() if euid is None else euid
    entries = (os.environ.get('PATH', os.defpath) if search_path is None else search_path).split(os.pathsep)
    seen = set()
    for directory in entries + list(SBIN_DIRS if search_path is None else ()):
        if not directory.startswith('/') or directory in seen:
            continue
        seen.add(directory)
        candidate = os.path.join(directory, name)
        if not os.path.isfile(candidate) or not os.access(candidate, os.X_OK):
            continue
        if euid != 0:
            return candidate
        try:
            resolve_checked(candidate, euid=euid)
        except OSError as exc:
            if refused is not None:
                refused.append('%s was not run as root: %s' % (candidate, getattr(exc, 'sentence', None) or exc))
            continue
        return candidate
    return None


def open_checked(path, flags, mode=0o600, dir_mode=None, euid=None, strict=True):
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)`` in a checked directory (created with
    ``dir_mode`` when given), the file then checked on its descriptor.  Returns the descriptor."""
    euid = os.geteuid() if euid is None else euid
    path, directory, name = _split(path)
    dir_fd = open_dir(directory, create_mode=dir_mode, euid=euid, strict=strict)
    try:
        try:
            fd = os.open(name, flags | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise UnsafeFile(path, 'is a symbolic link; the guard follows no links to its files (configure the real path)')
    finally:
        os.close(dir_fd)
    try:
        check_file_info(os.fstat(fd), path, euid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path, limit, euid=None):
    """At most ``limit`` bytes of ``path``, read from the checked descriptor.  FileNotFoundError
    when it (or a directory above it) is missing; UnsafeFile when a check fails."""
    fd = open_checked(path, READ_FLAGS, euid=euid)
    try:
        return read_all(fd, limit)
    finally:
        os.close(fd)


def read_all(fd, limit):
    """At most ``limit`` bytes from the open descriptor ``fd``, up to its end."""
    chunks = []
    left = limit
    while left > 0:
        block = os.read(fd, min(left, 1024 * 1024))
        if not block:
            break
        chunks.append(block)
        left -= len(block)
    return b''.join(chunks)


def open_append(path, mode=0o640, dir_mode=0o750):
    """A descriptor for appending to ``path`` (created with ``mode``; read and write, O_APPEND)."""
    return open_checked(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, mode, dir_mode=dir_mode, strict=False)


def open_lock(path, dir_mode=0o755):
    """A descriptor of the lock file ``path`` (created 0600 when missing), for flock."""
    return open_checked(path, os.O_RDWR | os.O_CREAT, 0o600, dir_mode=dir_mode, strict=False)


def write_all(fd, data):
    """os.write until every byte is written (a short write is retried; an error raises OSError)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if not written:
            raise OSError(errno.EIO, 'the write made no progress')
        view = view[written:]


def write_atomic(path, text, mode=0o644, dir_mode=0o755, strict=True, remove_stale=False):
    """Write ``text`` (str or bytes) to ``path`` through a temporary file in the same (checked)
    directory: created with O_EXCL | O_NOFOLLOW, mode set on its descriptor, fsync, renamed
    relative to the directory's descriptor.  A reader sees the old file or the new one, never half
    of one.  ``remove_stale``: first remove the temporary files (``.NAME.*``) that a writer killed
    halfway left behind (only when one writer at a time holds a lock)."""
    data = text.encode('utf-8') if isinstance(text, str) else text
    path, directory, name = _split(path)
    dir_fd = open_dir(directory, create_mode=dir_mode, strict=strict)
    try:
        prefix = '.%s.' % name
        if remove_stale:
            for entry in os.listdir(dir_fd):
                if entry.startswith(prefix):
                    try:
                        os.unlink(entry, dir_fd=dir_fd)
                    except OSError:
                        pass
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        for _attempt in range(_MAX_TEMP_ATTEMPTS):
            temp = prefix + os.urandom(6).hex()
            try:
                fd = os.open(temp, flags, 0o600, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, 'no unused temporary file name in %s' % directory)
        try:
            try:
                write_all(fd, data)
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(temp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)


def is_open_here(info, fd_dir='/proc/self/fd'):
    """True when one of this process's descriptors refers to the file ``info`` (a stat result)
    describes: for libraries that open files by path (sqlite), checked after they did."""
    for name in os.listdir(fd_dir):
        try:
            other = os.stat(os.path.join(fd_dir, name))
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (info.st_dev, info.st_ino):
            return True
    return False
