# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Kernel references that keep an NVIDIA GPU from being reset: ``/sys/module/<m>/refcnt``.

The driver refuses a reset ("In use by another client") while its companion modules are in use:
``nvidia_drm`` (a DRM console, a display server's modesetting), ``nvidia_modeset`` and
``nvidia_uvm`` (CUDA's unified memory).  The kernel counts each module's users in
``/sys/module/<m>/refcnt``; every module that depends on it (``/sys/module/<m>/holders/``) is one
of those references, so the references that block are ``refcnt - len(holders)``.  For
``nvidia_uvm`` the open files of processes that hold ``/dev/nvidia-uvm`` are references too: those
processes are the GPU's (they are named and terminated as processes), so ``explained`` of them
are not counted again.  The kernel writes these files; no user can.

``sys_root`` is the directory that holds ``module`` (``/sys``).  ``$_GPUFLEET_SYS_ROOT`` is a test
seam, never a user option: the simulator (tests/sim/gpusim, NVIDIA nodes) points it at a fake tree.
"""

from __future__ import annotations

import os

BLOCKING_MODULES = ('nvidia_drm', 'nvidia_modeset', 'nvidia_uvm')
SYS_ROOT_ENV = '_GPUFLEET_SYS_ROOT'
REFCNT_LIMIT = 64
HOLDERS_LIMIT = 256


def sys_root(root=None):
    """The directory that holds ``module`` (``/sys`` on a real host)."""
    if root:
        return root
    return os.environ.get(SYS_ROOT_ENV) or '/sys'


def _read_refcnt(path):
    """The integer in ``path``; None when the file is missing; ValueError when it is not a count."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_CLOEXEC', 0))
    except OSError:
        return None
    try:
        data = os.read(fd, REFCNT_LIMIT)
    finally:
        os.close(fd)
    text = data.decode('ascii', 'replace').strip()
    if not text.isdigit():
        raise ValueError('%s holds %r, not a reference count' % (path, text[:20]))
    return int(text)


class ModuleRefs(object):
    """One module: ``loaded``, ``refcnt``, ``holders`` (module names) and the ``references`` that block."""

    def __init__(self, name, loaded, refcnt=None, holders=(), explained=0, error=None):
        self.name = name
        self.loaded = loaded
        self.refcnt = refcnt
        self.holders = sorted(holders)
        self.explained = explained
        self.error = error
        if refcnt is None:
            self.references = 0
        else:
            self.references = max(0, refcnt - len(self.holders) - explained)

    def describe(self):
        """``nvidia_drm: 1 reference (refcnt 1, holders none)`` for messages."""
        extra = ', %d open file(s) of the GPU\'s processes' % self.explained if self.explained else ''
        return '%s: %d reference(s) (refcnt %s, holder modules %s%s)' % (
            self.name, self.references, self.refcnt, ', '.join(self.holders) or 'none', extra)

    def to_dict(self):
        return {'module': self.name, 'loaded': self.loaded, 'refcnt': self.refcnt, 'holders': list(self.holders),
                'explained': self.explained, 'references': self.references, 'error': self.error}


def module_refs(root=None, names=BLOCKING_MODULES, uvm_files=0):
    """ModuleRefs for each of ``names`` under ``<sys_root>/module``.

    ``uvm_files``: how many processes hold /dev/nvidia-uvm (their references are theirs).
    A module that is not loaded has no directory: ``loaded`` False, no references.
    """
    base = os.path.join(sys_root(root), 'module')
    out = []
    for name in names:
        directory = os.path.join(base, name)
        if not os.path.isdir(directory):
            out.append(ModuleRefs(name, False))
            continue
        try:
            refcnt = _read_refcnt(os.path.join(directory, 'refcnt'))
        except (OSError, ValueError) as exc:
            out.append(ModuleRefs(name, True, error=str(exc)))
            continue
        try:
            holders = sorted(os.listdir(os.path.join(directory, 'holders')))[:HOLDERS_LIMIT]
        except OSError:
            holders = []
        explained = min(uvm_files, max(0, (refcnt or 0) - len(holders))) if name == 'nvidia_uvm' else 0
        out.append(ModuleRefs(name, True, refcnt, holders, explained))
    return out


def blocking(refs):
    """The ModuleRefs of ``refs`` that hold references beyond their holders and the GPU's processes."""
    return [ref for ref in refs if ref.references > 0]


def uvm_files(snapshot):
    """How many processes of a snapshot hold /dev/nvidia-uvm open (their nvidia_uvm references are theirs)."""
    count = 0
    for proc in list(snapshot.processes) + list(snapshot.holders):
        paths = getattr(proc, 'device_paths', None) or getattr(proc, 'devices', None) or ()
        if any(os.path.basename(p) == 'nvidia-uvm' for p in paths):
            count += 1
    return count


def kernel_blockers(snapshot, root=None):
    """(all ModuleRefs, the blocking ones) of BLOCKING_MODULES under ``root``, read now; the
    nvidia-uvm files that ``snapshot``'s processes hold are theirs."""
    refs = module_refs(root, uvm_files=uvm_files(snapshot))
    return refs, blocking(refs)
