# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.

"""A bytecode cache for the core when a module runs it from Ansible's AnsiballZ zip.

Python keeps the compiled code of an installed package in ``__pycache__``; a module's zip has no such
place, so every call on a node compiled each of the core's files it imported from source again (about
a third of a ``gpu_kill`` call's CPU, far more than its work).  ``install()``, called by the core's
package when it is imported from a zip, puts a finder in front of the zip's importer for the
collection's ``module_utils``: each file's code is looked up in BYTECODE_CACHE_PATH by the SHA-256 of
its source (with the interpreter's bytecode magic number and optimisation level), compiled and stored
on a miss, and executed as the zip's importer would have done.  A changed file has another key: the
cache is never stale.

Trust: the cache holds code that root executes, so it is used only by root (effective uid 0), in a
directory that root owns and nobody else may write, every directory above it too (core/safe_files.py:
no symlink followed, checked on the open descriptor; files written atomically, mode 0600).  Anything
unexpected (not root, a check that fails, a file that does not unmarshal to code, a full disk) falls
back to compiling from the source, as without the cache; nothing here fails a module.  It holds at
most MAX_ENTRIES files: older ones are removed when a new one is written.  ``GPUFLEET_BYTECODE_CACHE=0``
in the module's environment turns it off.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import types
from importlib.machinery import PathFinder
from importlib.util import MAGIC_NUMBER

from . import safe_files
from .constants import BYTECODE_CACHE_PATH

ENV = 'GPUFLEET_BYTECODE_CACHE'
MAX_CODE_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 512
SUFFIX = '.code'


def wanted(environ=None, euid=None):
    """Whether this process may use the cache: root, and not turned off in the environment."""
    environ = os.environ if environ is None else environ
    euid = os.geteuid() if euid is None else euid
    return euid == 0 and environ.get(ENV, '1') != '0'


def install(package, loader, directory=BYTECODE_CACHE_PATH):
    """Put the cache's finder first on ``sys.meta_path`` for ``package``'s parent (the collection's
    module_utils) when ``loader`` (the package's own) is a zip importer and ``wanted()``; returns the
    finder, or None when nothing was installed."""
    import zipimport  # pylint: disable=import-outside-toplevel
    if not isinstance(loader, zipimport.zipimporter) or not wanted():
        return None
    prefix = package.rpartition('.')[0] + '.'
    for finder in sys.meta_path:
        if isinstance(finder, CachedFinder) and finder.prefix == prefix:
            return finder
    finder = CachedFinder(prefix, Cache(directory))
    sys.meta_path.insert(0, finder)
    return finder


class Cache(object):
    """Compiled code by the key of its source, in one checked directory (opened once, on first use)."""

    def __init__(self, directory):
        self.directory = directory
        self.hits = 0
        self.misses = 0
        self.errors = []
        self._dir_fd = None

    @staticmethod
    def key(name, source):
        digest = hashlib.sha256()
        for part in (MAGIC_NUMBER, str(sys.flags.optimize).encode(), name.encode('utf-8'), b'\0', source.encode('utf-8')):
            digest.update(part)
        return digest.hexdigest()

    def _dir(self):
        """The cache directory's descriptor: every directory from / checked (safe_files.open_dir), and this one
        writable by root alone, even with a sticky bit; None (and an error noted) when that cannot be had."""
        if self._dir_fd is None:
            try:
                fd = safe_files.open_dir(self.directory, create_mode=0o700)
            except (OSError, safe_files.UnsafeFile) as exc:
                self.errors.append('%s: %s' % (self.directory, exc))
                self._dir_fd = False
                return None
            if os.fstat(fd).st_mode & 0o022:
                os.close(fd)
                self.errors.append('%s: writable by others than root' % self.directory)
                self._dir_fd = False
                return None
            self._dir_fd = fd
        return self._dir_fd or None

    def close(self):
        if self._dir_fd:
            os.close(self._dir_fd)
        self._dir_fd = None

    def code(self, name, source, filename):
        """The code object of ``source`` (module ``name``, reported as ``filename``)."""
        entry = self.key(name, source) + SUFFIX
        code = self._load(entry)
        if code is not None:
            self.hits += 1
            return code
        self.misses += 1
        code = compile(source, filename, 'exec', dont_inherit=True)
        self._store(entry, code)
        return code

    def _load(self, entry):
        dir_fd = self._dir()
        if dir_fd is None:
            return None
        try:
            fd = os.open(entry, safe_files.READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.errors.append('%s: %s' % (entry, exc))
            return None
        try:
            info = os.fstat(fd)
            safe_files.check_file_info(info, os.path.join(self.directory, entry), euid=0)
            if info.st_size > MAX_CODE_BYTES:
                return None
            data = safe_files.read_all(fd, MAX_CODE_BYTES)
        except (OSError, safe_files.UnsafeFile) as exc:
            self.errors.append('%s: %s' % (entry, exc))
            return None
        finally:
            os.close(fd)
        try:
            code = marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            return None
        return code if isinstance(code, types.CodeType) else None

    def _store(self, entry, code):
        if self._dir() is None:
            return
        try:
            data = marshal.dumps(code)
            if len(data) > MAX_CODE_BYTES:
                return
            safe_files.write_atomic(os.path.join(self.directory, entry), data, mode=0o600, dir_mode=0o700)
            self._prune()
        except (OSError, ValueError, safe_files.UnsafeFile) as exc:
            self.errors.append('%s: %s' % (entry, exc))

    def _prune(self):
        """Keep the newest MAX_ENTRIES files (by modification time) of this cache's own kind."""
        entries = []
        for name in os.listdir(self._dir_fd):
            if name.endswith(SUFFIX):
                try:
                    entries.append((os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_mtime, name))
                except OSError:
                    continue
        if len(entries) <= MAX_ENTRIES:
            return
        entries.sort()
        for _mtime, name in entries[:len(entries) - MAX_ENTRIES]:
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except OSError:
                pass


class CachedFinder(object):
    """A meta path finder for the modules under ``prefix``: the zip importer finds them, the cache compiles them."""

    def __init__(self, prefix, cache):
        self.prefix = prefix
        self.cache = cache

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.prefix):
            return None
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, 'get_source') or spec.origin is None:
            return spec
        spec.loader = CachedLoader(spec.loader, self.cache, spec.origin)
        return spec

    @staticmethod
    def invalidate_caches():
        return None


class CachedLoader(object):
    """Executes a module's cached code; everything else is the zip importer's."""

    def __init__(self, inner, cache, origin):
        self.inner = inner
        self.cache = cache
        self.origin = origin

    @staticmethod
    def create_module(spec):  # pylint: disable=unused-argument
        return None   # the default module object, as the zip importer makes

    def exec_module(self, module):
        name = module.__spec__.name
        source = self.inner.get_source(name)
        if source is None:   # no source (a compiled file in the zip): the zip importer's own way
            code = self.inner.get_code(name)
        else:
            code = self.cache.code(name, source, self.origin)
        exec(code, module.__dict__)  # pylint: disable=exec-used

    def is_package(self, name):
        return self.inner.is_package(name)

    def get_source(self, name):
        return self.inner.get_source(name)

    def get_code(self, name):
        return self.inner.get_code(name)

    def get_filename(self, name):
        return self.inner.get_filename(name)

    def get_data(self, path):
        return self.inner.get_data(path)
