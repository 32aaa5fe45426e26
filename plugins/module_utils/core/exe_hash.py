# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""The SHA-256 of a process's executable: policy ``exe_sha256`` exemptions and rogue allowlist entries.

The one place that hashes executables.  The file is opened through /proc/PID/exe (the file the
process runs, wherever it lies now) and identified by ``fstat`` of that descriptor: device, inode,
size, modification and change times.  A digest is kept under that key across runs (the guard keeps
the entries in its state file), so an unchanged executable is read once, not on every tick; the
change time is part of the key because a file's owner can reset its modification time, not its
change time.  Executables larger than ``max_bytes`` (256 MiB) are not hashed: their digest is None,
so no hash-based exemption or allowlist entry matches them, and a note says so.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time

from .processes import read_starttime

MAX_EXE_HASH_BYTES = 256 * 1024 * 1024
MAX_CACHE_ENTRIES = 256
_BLOCK = 1024 * 1024
_FLAGS = os.O_RDONLY | getattr(os, 'O_CLOEXEC', 0) | getattr(os, 'O_NONBLOCK', 0) | getattr(os, 'O_NOCTTY', 0)
_DIGEST_RE = re.compile(r'^[0-9a-f]{64}$')


def _key(info):
    return '%d:%d:%d:%d:%d' % (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class ExeHashes(object):
    """Digests of executables, by file identity.

    ``entries``: the persisted cache, ``{key: [digest, last use]}`` (a dict the caller stores, such
    as a part of the guard's state; malformed entries are dropped); at most ``max_entries`` are
    kept, the least recently used go first.  ``proc_root`` is a test seam.  ``notes`` collects why
    an executable was not hashed.
    """

    def __init__(self, entries=None, proc_root='/proc', max_bytes=MAX_EXE_HASH_BYTES, max_entries=MAX_CACHE_ENTRIES):
        self.entries = entries if isinstance(entries, dict) else {}
        for key in list(self.entries):
            value = self.entries[key]
            if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and _DIGEST_RE.match(value[0])
                    and isinstance(value[1], (int, float)) and not isinstance(value[1], bool)):
                del self.entries[key]
        self.proc_root = proc_root
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.notes = []
        self.hashed = 0           # executables read in this run (cache misses)
        self._seen = {}           # (pid, starttime) -> digest or None, for this run

    def sha256(self, pid, starttime=None):
        """The hex SHA-256 of the executable ``pid`` runs, or None: gone, not readable, not a
        regular file, larger than ``max_bytes``, changed while read, or (with ``starttime``) the pid
        now belongs to another process."""
        memo = (int(pid), starttime)
        if memo not in self._seen:
            self._seen[memo] = self._digest(int(pid), starttime)
        return self._seen[memo]

    def _digest(self, pid, starttime):
        path = os.path.join(self.proc_root, str(pid), 'exe')
        try:
            fd = os.open(path, _FLAGS)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if starttime is not None and read_starttime(pid, self.proc_root) != starttime:
                return None  # the pid was reused: this is another process's executable
            if not stat.S_ISREG(info.st_mode):
                return None
            if info.st_size > self.max_bytes:
                self.notes.append('pid %d: its executable is larger than %d MiB and is not hashed; exe_sha256 exemptions and '
                                  'allowlist hashes do not match it' % (pid, self.max_bytes // (1024 * 1024)))
                return None
            key = _key(info)
            entry = self.entries.get(key)
            now = round(time.time(), 3)
            if entry is None:
                digest = self._read(fd)
                if digest is None or _key(os.fstat(fd)) != key:
                    return None  # larger than it said, or changed while it was read
                entry = self.entries[key] = [digest, now]
                self.hashed += 1
                self._prune()
            entry[1] = now
            return entry[0]
        except OSError:
            return None
        finally:
            os.close(fd)

    def _read(self, fd):
        digest = hashlib.sha256()
        size = 0
        while True:
            block = os.read(fd, _BLOCK)
            if not block:
                return digest.hexdigest()
            size += len(block)
            if size > self.max_bytes:
                return None
            digest.update(block)

    def _prune(self):
        if len(self.entries) > self.max_entries:
            for key in sorted(self.entries, key=lambda k: self.entries[k][1])[:len(self.entries) - self.max_entries]:
                del self.entries[key]
