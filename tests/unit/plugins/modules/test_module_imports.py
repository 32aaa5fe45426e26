# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a module imports when it loads (issue #21): every file of ours it imports is compiled from source
on every call on a node (AnsiballZ's zipimport), so a file a call does not use costs each node CPU.

Each module loads at most the files listed here, and never the parts only some calls use (the usage
history, the rules-file loader, the vendor backends, psutil, PyYAML).  A new import at load shows here:
make it lazy (a module-level accessor, as core.backends and core.rogue do) or add it to the list with
the reason."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils import gpu_module

PREFIX = 'ansible_collections.gpufleet.reclaim.plugins.module_utils.'
# what every module loads: the snapshot and what it stands on (core.snapshot; core.fdwalk: the inventory's walk of
# open files, moved out of core.processes), the shared module code
SNAPSHOT = {'gpu_module', 'node_python', 'core', 'core.backends', 'core.backends.base', 'core.constants', 'core.errors',
            'core.fdwalk', 'core.identity', 'core.model', 'core.processes', 'core.safe_files', 'core.snapshot', 'core.text',
            'core.watchdog', 'core.xid'}
ROGUE = {'core.rogue', 'core.rogue.checks', 'core.rogue.config', 'core.rogue.detector', 'core.rogue.facts', 'core.rogue.procfs',
         'core.rogue.rules', 'core.exe_hash', 'core.notify', 'core.textmatch', 'core.units'}
AT_MOST = {
    # and what gpufleet did to the node lately (core.disruption: two small files; Slurm asked only where slurmd runs)
    'gpu_facts': SNAPSHOT | {'core.disruption'},
    # the selection, the killer and the audit log; the rogue detector (rogue=true is the fleet's common call)
    # and the one kill order of max_kills (core.blast: pure, the fleet limit's; issue #30)
    'gpu_kill': SNAPSHOT | ROGUE | {'core.reclaim', 'core.select', 'core.killer', 'core.audit_log', 'core.blast'},
    'gpu_audit': SNAPSHOT | ROGUE,
}
# imported only by the calls that use them
NEVER = {'core.history', 'core.idle', 'core.slurm', 'core.rogue.loader', 'core.rogue.audit', 'core.documents', 'core.validation',
         'core.policy', 'core.guard', 'core.reset', 'core.backends.nvidia', 'core.backends.amd', 'core.backends.intel',
         'core.backends.apple', 'core.drm_fdinfo'}
NEVER_LIBRARIES = {'psutil', 'sqlite3', 'yaml', 'pynvml'}


def loaded_at_import(name):
    """(our module_utils, the NEVER_LIBRARIES) that importing module ``name`` loads, in a fresh interpreter."""
    code = ('import sys; import ansible_collections.gpufleet.reclaim.plugins.modules.%s; '
            'print(" ".join(m for m in sys.modules if m.startswith("ansible_collections.gpufleet.") or m in %r))'
            % (name, sorted(NEVER_LIBRARIES)))
    # a fresh interpreter finds the collection as a plain package: under ansible-test its collection loader is not there,
    # so the directory above ansible_collections/ goes on the child's path
    here = os.path.abspath(gpu_module.__file__)
    root = here[:here.rindex(os.sep + 'ansible_collections' + os.sep)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in sys.path if p]))
    out = subprocess.run([sys.executable, '-c', code], check=True, stdout=subprocess.PIPE, universal_newlines=True, env=env).stdout.split()
    ours = set(m[len(PREFIX):] for m in out if m.startswith(PREFIX))
    return ours, set(m for m in out if m in NEVER_LIBRARIES)


@pytest.mark.parametrize('name', sorted(AT_MOST))
def test_a_module_loads_only_what_every_call_uses(name):
    ours, libraries = loaded_at_import(name)
    assert ours - AT_MOST[name] == set(), 'loaded at import, not listed: %s' % sorted(ours - AT_MOST[name])
    assert ours & NEVER == set() and libraries == set(), (sorted(ours & NEVER), sorted(libraries))
    assert {'core.snapshot', 'gpu_module'} <= ours   # the listing itself works


def test_psutil_is_looked_up_not_imported(monkeypatch):
    """run_module fails without psutil (a documented requirement) but does not import it to find out."""
    assert gpu_module.psutil_error() is None
    monkeypatch.setattr(gpu_module, 'missing_modules', list)
    error = gpu_module.psutil_error()
    assert error == (gpu_module.processes.PSUTIL_IMPORT_ERROR or 'psutil is not installed')
