# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Registry of vendor backends and ``select()``, which probes them without ever raising."""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import MutableMapping

from ..errors import InvalidArgument
from ..model import BackendStatus
from .base import Backend, error_text

# The class each vendor's backend module defines, by vendor name.
CLASS_NAMES = OrderedDict([('nvidia', 'NvidiaBackend'), ('amd', 'AmdBackend'), ('intel', 'IntelBackend'), ('apple', 'AppleBackend')])


def _backend_module(vendor):
    """Import ``vendor``'s backend module, on first use only: a node imports (compiles) just the vendors it
    asks for.  The imports are written out so that AnsiballZ still ships every backend with a module."""
    # pylint: disable=import-outside-toplevel
    if vendor == 'nvidia':
        from . import nvidia as module
    elif vendor == 'amd':
        from . import amd as module
    elif vendor == 'intel':
        from . import intel as module
    elif vendor == 'apple':
        from . import apple as module
    else:
        raise KeyError(vendor)
    return module


class Registry(MutableMapping):
    """Vendor name -> backend class, in host-wide index order (NVIDIA first keeps nvidia-smi indexes).

    A built-in vendor's backend module is imported when its class is first looked up; iterating the
    names (``VENDORS``, ``select()`` for vendors not requested) imports nothing.  Tests may add or
    replace entries with classes."""

    def __init__(self, names):
        self._entries = OrderedDict((vendor, None) for vendor in names)

    def __getitem__(self, vendor):
        cls = self._entries[vendor]
        if cls is None:
            cls = self._entries[vendor] = getattr(_backend_module(vendor), CLASS_NAMES[vendor])
        return cls

    def __setitem__(self, vendor, cls):
        self._entries[vendor] = cls

    def __delitem__(self, vendor):
        del self._entries[vendor]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)

    def loaded(self):
        """The vendors whose backend class is loaded (imported) so far."""
        return tuple(vendor for vendor, cls in self._entries.items() if cls is not None)


REGISTRY = Registry(CLASS_NAMES)
VENDORS = tuple(REGISTRY)
VENDOR_CHOICES = ('auto',) + VENDORS
# Device files whose presence says a vendor's GPUs are here, whatever its library says; and the
# library a backend needs, for the warning when the files exist but the backend cannot read them.
PRESENCE_FILES = OrderedDict([('nvidia', ('nvidiactl',)), ('amd', ('kfd',))])
LIBRARIES = {'nvidia': 'nvidia-ml-py (imported as pynvml)', 'amd': 'amdsmi (shipped with ROCm)'}


def present_files(vendor, dev_roots):
    """The device files of ``vendor`` (PRESENCE_FILES) that exist under ``dev_roots``."""
    return [os.path.join(root, f) for root in dev_roots for f in PRESENCE_FILES.get(vendor, ()) if os.path.exists(os.path.join(root, f))]


def vendor_backend(vendor):
    """The backend class of ``vendor`` (a Device's ``vendor``): its class-method hooks answer the
    vendor's device-file naming and reset steps (see base.Backend)."""
    try:
        return REGISTRY[vendor]
    except KeyError:
        raise InvalidArgument('vendor', vendor, 'no backend for this vendor; known: %s' % ', '.join(VENDORS)) from None


def preload(vendor, dev_roots):
    """Import the backend modules that a read of ``vendor`` will use: that vendor's, or with ``auto`` those of
    the vendors whose device files (PRESENCE_FILES) exist under ``dev_roots``.  Returns their names.

    A snapshot reads the drivers in a forked watchdog child, and the process that forked it then looks its
    devices' vendors up too (``vendor_backend``): imported once before the fork, a backend (and its library's
    Python binding, not the library) is compiled once instead of in both processes.  A failed import is left
    to the read, which reports it."""
    names = [vendor] if vendor in REGISTRY else [
        name for name in PRESENCE_FILES if vendor == 'auto' and name in REGISTRY and present_files(name, dev_roots)]
    loaded = []
    for name in names:
        try:
            REGISTRY[name]  # pylint: disable=pointless-statement
        except Exception:  # pylint: disable=broad-except
            continue
        loaded.append(name)
    return loaded


class Selection(object):
    """The outcome of select(): ``backends`` (probed, available, in vendor order) and ``statuses``."""

    def __init__(self, backends, statuses, requested=VENDORS):
        self.backends = backends
        self.statuses = statuses
        self.requested = tuple(requested)

    def unreadable(self, dev_roots):
        """A warning for each requested vendor whose device files exist in ``dev_roots`` but whose
        backend could not be used: such a node has GPUs that this run cannot see, which must never
        read as a node without GPUs."""
        found = []
        for name, files in PRESENCE_FILES.items():
            status = self.statuses.get(name)
            if name not in self.requested or status is None or status.available:
                continue
            present = present_files(name, dev_roots)
            if present:
                found.append('%s GPU device files exist (%s) but the %s backend cannot read them: %s. This node\'s GPUs are '
                             'missing from the result. Fix: install %s for %s, or run the gpufleet.reclaim.prereqs role '
                             '(the modules then re-run under the interpreter it records in /etc/gpufleet/python)'
                             % (name, ', '.join(present), name, status.error, LIBRARIES[name], sys.executable))
        return found

    def close(self):
        for backend in self.backends:
            backend.close()


def _probe(backend):
    try:
        status = backend.probe()
    except Exception as exc:  # pylint: disable=broad-except
        status = BackendStatus(name=backend.name, available=False, error='probe failed: %s' % error_text(exc))
    if status is None:
        status = BackendStatus(name=backend.name, available=False, error='probe returned nothing')
    return status


def select(vendor='auto', factories=None):
    """Probe the requested vendor's backend, or every backend for ``auto``; never raises for a backend.

    ``factories`` maps vendor -> zero-argument callable returning a Backend (tests inject fakes);
    missing vendors use REGISTRY.  Vendors not requested are reported unavailable with a reason.
    Raises InvalidArgument only for an unknown ``vendor``.
    """
    if vendor not in VENDOR_CHOICES:
        raise InvalidArgument('vendor', vendor, 'must be one of %s' % ', '.join(VENDOR_CHOICES))
    factories = dict(factories or {})
    backends = []
    statuses = OrderedDict()
    for name in REGISTRY:
        if vendor not in ('auto', name):
            statuses[name] = BackendStatus(name=name, available=False, error='not requested (vendor=%s)' % vendor)
            continue
        try:
            backend = (factories[name] if name in factories else REGISTRY[name])()
        except Exception as exc:  # pylint: disable=broad-except
            statuses[name] = BackendStatus(name=name, available=False, error='could not create the backend: %s' % error_text(exc))
            continue
        status = _probe(backend)
        statuses[name] = status
        if status.available:
            backends.append(backend)
        else:
            backend.close()
    return Selection(backends, statuses, VENDORS if vendor == 'auto' else (vendor,))


def __getattr__(name):
    """``backends.NvidiaBackend`` and the other classes, loaded on first use (PEP 562)."""
    for vendor, class_name in CLASS_NAMES.items():
        if name == class_name:
            return REGISTRY[vendor]
    raise AttributeError('module %r has no attribute %r' % (__name__, name))


# The backend classes (NvidiaBackend, AmdBackend, IntelBackend, AppleBackend) are attributes loaded on first use
# (__getattr__), not listed here: ``import *`` would load every backend.
__all__ = ['Backend', 'CLASS_NAMES', 'REGISTRY', 'Registry', 'VENDORS', 'PRESENCE_FILES', 'VENDOR_CHOICES', 'Selection', 'select',
           'vendor_backend', 'preload']
