# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Which Python runs the collection's modules on a node (issue #16).

The gpufleet.reclaim.prereqs role records the interpreter that imports everything the node needs
in ``/etc/gpufleet/python`` (one line, root:root 0644).  A module whose interpreter lacks a library
the node needs (psutil always; pynvml where NVIDIA device files exist; amdsmi where ``/dev/kfd``
exists) calls :func:`respawn_if_needed` right after building its AnsibleModule, and re-runs itself
under the recorded interpreter, once: ansible-core's own respawn payload (the module, its arguments
and the AnsiballZ zip it runs from), run by that interpreter in isolated mode.

The modules run as root, so the record and the interpreter are trusted only as root's own files:
the record is read with ``safe_files.read_file`` (no link followed, every directory root's and not
writable by others, the file not writable by group or others), and the interpreter's links are
followed one at a time under the same checks (``safe_files.resolve_checked``).  When the record is
missing or refused, the role's default virtual environment is tried under the same checks.  When
nothing passes, the module runs on where it is, and its backends' warning names the fix.

Every Python that root starts here runs isolated (``python -I``: ``-E`` and ``-s``, and neither the
working directory nor a script's directory on ``sys.path``), so nothing is imported from the working
directory (a user's, when Ansible runs from a directory she can write), ``PYTHONPATH`` (or any other
``PYTHON*`` variable) or a user site-packages (issue #28): the import probe runs that way from ``/``,
the respawned module that way in the module's own working directory, so that a relative path in its
options names the same file as before the respawn.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import subprocess
import sys

from ansible.module_utils.common.respawn import has_respawned

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
# Isolated mode: no working directory or script directory on sys.path, no PYTHON* variable, no user site.
ISOLATED = '-I'
PROBE_TIMEOUT = 60
# What the probe imports besides the node's libraries: the ansible-core the respawned module will run
# with, from the AnsiballZ zip of this run (the probe's first argument; empty outside AnsiballZ).
ANSIBLE_BASIC = 'ansible.module_utils.basic'
_PROBE = '''
import importlib, json, sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
missing = []
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
sys.stdout.write("\\n" + json.dumps(missing) + "\\n")
'''


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


def probe_missing(interpreter, names, modlib_path=None):
    """The names among ``names`` that ``interpreter`` cannot import, asked in one isolated run from
    ``/``; with an AnsiballZ zip (``modlib_path``, default this run's), ANSIBLE_BASIC from it too.
    An interpreter that does not answer (fails to start, times out, prints no list) lacks them all."""
    if modlib_path is None:
        modlib_path = getattr(sys.modules['__main__'], '_modlib_path', '')
    wanted = list(names) + ([ANSIBLE_BASIC] if modlib_path else [])
    try:
        proc = subprocess.run([interpreter, ISOLATED, '-c', _PROBE, modlib_path or ''] + wanted, cwd='/',
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=PROBE_TIMEOUT, check=False)
        lines = proc.stdout.decode('utf-8', 'replace').splitlines()
        missing = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except (OSError, ValueError, subprocess.SubprocessError):
        missing = None
    if not isinstance(missing, list):
        return wanted
    return [name for name in wanted if name in missing]


def respawn_payload():
    """ansible-core's own respawn payload: a script that puts this run's AnsiballZ zip first on
    sys.path and runs the module with its arguments (``_respawned`` set).  ansible-core 2.19 and
    later build it in ``_ansiballz._respawn``, 2.17 and 2.18 in ``common.respawn``.  Raises
    ImportError on an ansible-core that has neither."""
    # pylint: disable=import-outside-toplevel
    try:
        from ansible.module_utils._internal._ansiballz._respawn import create_payload
    except ImportError:
        from ansible.module_utils.common.respawn import _create_payload as create_payload
    return create_payload()


def respawn(interpreter, payload):
    """Run ``payload`` under ``interpreter`` in isolated mode, read from standard input, in this
    working directory, and exit with its status (ansible-core's respawn_module, with ISOLATED)."""
    code = subprocess.run([interpreter, ISOLATED, '-'], input=payload.encode('utf-8', 'surrogateescape'), check=False).returncode
    sys.exit(code)  # pylint: disable=ansible-bad-function


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
        lacking = probe_missing(interpreter, needed)
        required = [name for name in lacking if name not in OPTIONAL or name not in missing]
        if not required and set(missing) - set(lacking):
            try:
                respawn(interpreter, respawn_payload())
            except ImportError:
                notes.append('the module was not re-run under %s: this ansible-core has no respawn payload the collection knows'
                             % interpreter)
        if required:
            notes.append('the interpreter %s cannot import %s; run the gpufleet.reclaim.prereqs role again'
                         % (interpreter, ', '.join(required)))
    for note in notes:
        module.warn(printable(note))
