# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""The interface every vendor backend implements.

Life cycle, driven by the snapshot: ``probe()`` once (loads and initialises the vendor library,
never raises), then ``devices()`` if the probe said available (never raises either: one bad GPU
never hides the others, an error reading a GPU lands in that Device's health and errors), then
``close()`` (releases the library: a GPU reset needs our own NVML session gone).
"""

from __future__ import annotations

from ..model import BackendStatus


def error_text(exc):
    """A one-line description of an exception for facts and messages."""
    text = str(exc).strip()
    name = type(exc).__name__
    if not text:
        return name
    return text.splitlines()[-1] if '\n' in text else text


class Backend(object):
    """Base class of a vendor backend (``name`` is the vendor: nvidia, amd, intel, apple)."""

    name = 'base'

    def __init__(self):
        self.status = BackendStatus(name=self.name)

    def probe(self):
        """Load the vendor library; return a BackendStatus(available, version, error).  Never raises."""
        self.status = BackendStatus(name=self.name, available=False, error='not implemented')
        return self.status

    def devices(self):
        """Read every GPU of this vendor: a list of model.Device with driver_processes filled.

        ``vendor_index`` is the vendor library's own index.  Never raises for a per-device problem.
        """
        return []

    def close(self):
        """Release the vendor library (idempotent, never raises)."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


class UnavailableBackend(Backend):
    """A backend that honestly reports itself unavailable with a fixed reason."""

    reason = 'not implemented yet'

    def probe(self):
        self.status = BackendStatus(name=self.name, available=False, version=None, error=self.reason_text())
        return self.status

    def reason_text(self):
        return self.reason
