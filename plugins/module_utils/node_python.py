# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Which Python runs the collection's modules on a node (issue #16).

The gpufleet.reclaim.prereqs role records the interpreter that imports everything the node needs
in ``/etc/gpufleet/python`` (one line, root:root 0644).  A module whose interpreter lacks a library
the node needs (psutil always; pynvml where NVIDIA device files exist; amdsmi where ``/dev/kfd``
exists) calls :func:`respawn_if_needed` right after building its AnsibleModule, and re-runs itself
under the recorded interpreter with ansible-core's own respawn mechanism, once.

The modules run as root, so the record and the interpreter are trusted only as root's own files:
the record is read with ``safe_files.read_file`` (no link followed, every directory root's and not
writable by others, the file not writable by group or others), and the interpreter's links are
followed one at a time under the same checks (``safe_files.resolve_checked``).  When the record is
missing or refused, the role's default virtual environment is tried under the same checks.  When
nothing passes, the module runs on where it is, and its backends' warning names the fix.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys

from ansible.module_utils.common.respawn import has_respawned, probe_interpreters_for_module, respawn_module

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import safe_files
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import PRESENCE_FILES
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import resolve_dev_roots
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import printable

RECORD = '/etc/gpufleet/python'
DEFAULT_INTERPRETER = '/opt/gpufleet/venv/bin/python'
RECORD_LIMIT = 4096
# The Python module each vendor's backend imports, for the vendors PRESENCE_FILES names.
VENDOR_MODULES = (('nvidia', 'pynvml'), ('amd', 'amdsmi'))
# Libraries a backend can do without: the AMD backend reads sysfs and DRM fdinfo when amdsmi (which
# the prereqs role never installs) is missing.  A module respawns for one only when the recorded
# interpreter has it, and an interpreter without it is no reason to warn.
OPTIONAL = ('amdsmi',)


def needed_modules(dev_roots=None):
    """psutil, plus the library of each vendor whose device files exist under ``dev_roots``."""
    roots = resolve_dev_roots(dev_roots)
    names = ['psutil']
    for vendor, module_name in VENDOR_MODULES:
        if any(os.path.exists(os.path.join(root, name)) for root in roots for name in PRESENCE_FILES[vendor]):
            names.append(module_name)
    return names


def missing_modules(names):
    """The names this interpreter cannot find (looked up, not imported)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def parse_record(data, record):
    """The interpreter path in the record's bytes: one absolute path of printable characters."""
    try:
        lines = data.decode('utf-8').splitlines()
    except UnicodeDecodeError:
        raise ValueError('%s is not UTF-8 text' % record) from None
    path = lines[0].strip() if len(lines) == 1 else ''
    if not path or not os.path.isabs(path) or printable(path) != path:
        raise ValueError('%s must hold one line, the absolute path of a Python interpreter, not %r' % (record, data[:200]))
    return path


def trusted_interpreter(path, euid=None):
    """``path`` when root may run it: its links, their directories and the file they end at pass
    safe_files' checks, and the file is executable.  Raises OSError (UnsafeFile) otherwise."""
    try:
        real = safe_files.resolve_checked(path, euid=euid)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, 'no such interpreter', path) from None
    if not os.access(real, os.X_OK):
        raise safe_files.UnsafeFile(real, 'is not executable')
    return path


def find_interpreter(record=RECORD, default=DEFAULT_INTERPRETER, euid=None):
    """(interpreter, notes): the interpreter named in ``record``, else ``default``, the first that
    passes the checks (None when none does); ``notes`` says why a record or an interpreter that
    exists was refused.  A missing record or default interpreter is no note: the role has not run."""
    notes = []
    candidates = []
    try:
        candidates.append((parse_record(safe_files.read_file(record, RECORD_LIMIT, euid=euid), record), True))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        notes.append('the interpreter record %s was not used: %s' % (record, getattr(exc, 'strerror', None) or exc))
    if default not in [path for path, _recorded in candidates]:
        candidates.append((default, False))
    for path, recorded in candidates:
        try:
            return trusted_interpreter(path, euid), notes
        except FileNotFoundError:
            if recorded:
                notes.append('the interpreter %s named in %s does not exist' % (path, record))
        except OSError as exc:
            notes.append('the interpreter %s%s was not used: %s'
                         % (path, ' named in %s' % record if recorded else '', exc.strerror or exc))
    return None, notes


def respawn_if_needed(module, record=RECORD, default=DEFAULT_INTERPRETER, dev_roots=None):
    """Call first in main(), once the AnsibleModule is built.  When this interpreter lacks a library
    the node needs and the recorded (or default) interpreter passes the checks, imports one of those
    and lacks none but the OPTIONAL ones this one lacks too, re-run the module under it (this process
    then exits with the new one's status).  Otherwise return, after warning why a record or an
    interpreter that exists was not used, or which required library it lacks.  Never
    respawns a module that has already respawned: a respawned module only repeats those warnings
    (the first process's warnings are lost with its output), so a refused record always shows."""
    if has_respawned():
        for note in find_interpreter(record, default)[1]:
            module.warn(printable(note))
        return
    needed = needed_modules(dev_roots)
    missing = missing_modules(needed)
    if not missing:
        return
    interpreter, notes = find_interpreter(record, default)
    if interpreter is not None and os.path.abspath(interpreter) != os.path.abspath(sys.executable):
        lacking = [name for name in needed if probe_interpreters_for_module([interpreter], name) is None]
        required = [name for name in lacking if name not in OPTIONAL or name not in missing]
        if not required and set(missing) - set(lacking):
            respawn_module(interpreter)
        if required:
            notes.append('the interpreter %s cannot import %s; run the gpufleet.reclaim.prereqs role again'
                         % (interpreter, ', '.join(required)))
    for note in notes:
        module.warn(printable(note))
