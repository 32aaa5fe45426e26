# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Registry of vendor backends and ``select()``, which probes them without ever raising."""

from __future__ import annotations

import os
import sys
from collections import OrderedDict

from ..errors import InvalidArgument
from ..model import BackendStatus
from .amd import AmdBackend
from .apple import AppleBackend
from .base import Backend, error_text
from .intel import IntelBackend
from .nvidia import NvidiaBackend

# Vendor name -> backend class, in host-wide index order (NVIDIA first keeps nvidia-smi indexes).
REGISTRY = OrderedDict([
    ('nvidia', NvidiaBackend),
    ('amd', AmdBackend),
    ('intel', IntelBackend),
    ('apple', AppleBackend),
])
VENDORS = tuple(REGISTRY)
VENDOR_CHOICES = ('auto',) + VENDORS
# Device files whose presence says a vendor's GPUs are here, whatever its library says; and the
# library a backend needs, for the warning when the files exist but the backend cannot read them.
PRESENCE_FILES = OrderedDict([('nvidia', ('nvidiactl',)), ('amd', ('kfd',))])
LIBRARIES = {'nvidia': 'nvidia-ml-py (imported as pynvml)', 'amd': 'amdsmi (shipped with ROCm)'}


def vendor_backend(vendor):
    """The backend class of ``vendor`` (a Device's ``vendor``): its class-method hooks answer the
    vendor's device-file naming and reset steps (see base.Backend)."""
    try:
        return REGISTRY[vendor]
    except KeyError:
        raise InvalidArgument('vendor', vendor, 'no backend for this vendor; known: %s' % ', '.join(VENDORS)) from None


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
            present = [os.path.join(root, f) for root in dev_roots for f in files if os.path.exists(os.path.join(root, f))]
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
    for name, cls in REGISTRY.items():
        if vendor not in ('auto', name):
            statuses[name] = BackendStatus(name=name, available=False, error='not requested (vendor=%s)' % vendor)
            continue
        try:
            backend = factories.get(name, cls)()
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


__all__ = ['Backend', 'REGISTRY', 'VENDORS', 'PRESENCE_FILES', 'VENDOR_CHOICES', 'Selection', 'select', 'vendor_backend',
           'NvidiaBackend', 'AmdBackend', 'IntelBackend', 'AppleBackend']
