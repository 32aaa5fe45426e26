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

import math

from ..model import BackendStatus


def error_text(exc):
    """A one-line description of an exception for facts and messages."""
    text = str(exc).strip()
    name = type(exc).__name__
    if not text:
        return name
    return text.splitlines()[-1] if '\n' in text else text


def pci_bdf(text):
    """A PCI address as sysfs writes it (``0000:07:00.0``) from NVML's ``00000000:07:00.0`` or ``07:00.0``."""
    text = str(text or '').strip().lower()
    domain, _sep, function = text.rpartition(':')
    domain, _sep, bus = domain.rpartition(':')
    try:
        return '%04x:%s:%s' % (int(domain or '0', 16), bus, function)
    except ValueError:
        return text


def to_number(value, cast=int):
    """``cast(value)``, or None for None, booleans, what does not convert (a tool's "N/A") and
    infinite or NaN results (``float('inf')``, JSON's ``Infinity``)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = cast(value)
    except (TypeError, ValueError, OverflowError):  # int(float('inf')) overflows
        return None
    if isinstance(number, float) and not math.isfinite(number):
        return None
    return number


# Hotter than any GPU runs (they throttle near 100 C and shut down well below this): no reading.
MAX_CELSIUS = 250


def to_reading(value, cast=int, low=0, high=2 ** 64 - 1):
    """to_number() for a counter or a measurement a vendor tool reports: None outside ``low``..``high``
    (the tools' fields are unsigned 64-bit; a negative or larger figure is a wrong one, not a reading)."""
    number = to_number(value, cast)
    if number is None or not low <= number <= high:
        return None
    return number


def find_command(name):
    """``shutil.which(name)`` (shutil and subprocess are imported on first use: a tick on a host without
    these vendors' tools never pays for them)."""
    import shutil  # pylint: disable=import-outside-toplevel
    return shutil.which(name)


def run_command(argv, timeout):
    """Run a vendor tool: (rc, stdout bytes, stderr text); rc None when it could not start or timed out."""
    import subprocess  # pylint: disable=import-outside-toplevel
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, b'', 'timed out after %ss' % timeout
    except OSError as exc:
        return None, b'', error_text(exc)
    return proc.returncode, proc.stdout, proc.stderr.decode('utf-8', 'replace')


def read_device(dev, read, *args, **kwargs):
    """``read(dev, *args)``; an unexpected error becomes the device's failed reading (one GPU never hides
    the others).  ``describe`` (default error_text) words the exception.  Returns ``dev``."""
    describe = kwargs.pop('describe', error_text)
    try:
        read(dev, *args)
    except Exception as exc:  # pylint: disable=broad-except
        dev.processes_complete = False
        dev.reading_failed('the device', describe(exc))
    return dev


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

    def memory_view(self):
        """``{vendor_index: (used MiB or None, set of listed pids or None)}`` from a fresh read.

        What the release check polls while processes exit; backends may read less than devices()
        does.  ``None`` pids: the process list could not be read.
        """
        view = {}
        for dev in self.devices():
            view[dev.vendor_index] = (dev.memory_used_mib, set(dev.pids) if dev.processes_complete else None)
        return view

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
