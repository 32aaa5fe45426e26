# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""The interface every vendor backend implements.

Life cycle, driven by the snapshot: ``probe()`` once (loads and initialises the vendor library,
never raises), then ``devices()`` if the probe said available (never raises either: one bad GPU
never hides the others, an error reading a GPU lands in that Device's health and errors), then
``close()`` (releases the library: a GPU reset needs our own NVML session gone).

Besides reading, a backend answers for its vendor everything the vendor-neutral core must not
decide by vendor name: which device files name a GPU, and how a GPU is reset (the tool and the
vendor's own preconditions, persistence mode, drain, the reset itself).  These hooks are class
methods: a reset runs after the snapshot closed every vendor library, so they take what they
need from the ``host`` they are given, never from a probed instance.  The core finds them with
``backends.vendor_backend(dev.vendor)``.  Adding a vendor means writing one backend file.

The reset hooks receive ``item`` (reset_plan.GpuReset: ``dev``, ``label``, ``target``, ``check(name,
status, detail)``, ``method``/``command``/``output``, ``persistence``, ``drain``, ``touched``,
``reboot_reason``, ``kernel_modules``) and ``host`` (reset.Host: ``tool(name)``, ``run(argv)``,
``sys_root``, ``euid``, and the library seams ``nvml`` and ``amdsmi``).
"""

from __future__ import annotations

import abc
import math
import os

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


# The statuses of a reset precondition (reset_plan.Check).
PASS, FAIL, WARN, NOT_EXPOSED, NOT_APPLICABLE = 'pass', 'fail', 'warn', 'not_exposed', 'not_applicable'
# The first DRM render node minor: /dev/dri/renderD<128 + card minor>.
DRM_RENDER_BASE = 128
# A driver's recovery actions (gpu_facts ``recovery_action``) after which a reset cannot help.
REBOOT_ACTIONS = ('reboot',)

# Hotter than any GPU runs (they throttle near 100 C and shut down well below this): no reading.
MAX_CELSIUS = 250


def to_reading(value, cast=int, low=0, high=2 ** 64 - 1):
    """to_number() for a counter or a measurement a vendor tool reports: None outside ``low``..``high``
    (the tools' fields are unsigned 64-bit; a negative or larger figure is a wrong one, not a reading)."""
    number = to_number(value, cast)
    if number is None or not low <= number <= high:
        return None
    return number


def last_line(text):
    """The last non-empty line of a tool's output, for a one-line message."""
    lines = [line.strip() for line in (text or '').strip().splitlines() if line.strip()]
    return lines[-1] if lines else '(no output)'


def recovery_action(dev):
    """The driver's recovery action for ``dev`` (gpu_facts ``recovery_action``: none, reset, reboot, drain_p2p,
    drain_and_reset), or None where the driver cannot tell."""
    value = getattr(dev, 'recovery_action', None)
    return value if isinstance(value, str) and value else None


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


DRAIN_UNAVAILABLE = 'drain is only available through NVML for NVIDIA GPUs with a known PCI bus id'


class Backend(object):
    """Base class of a vendor backend (``name`` is the vendor: nvidia, amd, intel, apple).

    The methods marked abstract are what every registered backend must provide (the unit test
    test_backend_hooks checks it).  Backend has no ABCMeta: the tests' fakes that only supply
    devices subclass it too.  The other hooks have the answer of a vendor without that feature.
    """

    name = 'base'
    # The vendor as people write it, in messages.
    label = 'base'
    # Why this vendor's GPUs cannot be reset and what to do instead; None when they can.  A vendor
    # that sets it is refused before any other reset hook is called.
    reset_refusal = None
    # The precondition names (reset_plan.CHECK_NAMES) that reset_checks() records besides ``tool``;
    # on other vendors' GPUs they are recorded not_applicable.
    reset_check_names = ()
    # Whether the kernel log's Xid lines (core/xid.py) describe this vendor's GPUs.
    xid_log = False
    # The commands the reset hooks run, looked up on the host before a reset (host.tool(name)).
    reset_tools = ()

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

    def memory_view(self, vendor_indexes=None):
        """``{vendor_index: (used MiB or None, set of listed pids or None)}`` from a fresh read of the GPUs
        ``vendor_indexes`` (None: every GPU).

        What the release check polls while processes exit; backends may read less than devices()
        does (only the GPUs asked for, only memory and processes).  ``None`` pids: the process list
        could not be read.
        """
        view = {}
        for dev in self.devices():
            if vendor_indexes is None or dev.vendor_index in vendor_indexes:
                view[dev.vendor_index] = (dev.memory_used_mib, set(dev.pids) if dev.processes_complete else None)
        return view

    def close(self):
        """Release the vendor library (idempotent, never raises)."""
        return None

    # ------------------------------------------------------------------ device files
    @classmethod
    @abc.abstractmethod
    def device_keys(cls, minor):
        """The processes.device_key() keys of the device files that name this vendor's GPU with
        device minor ``minor``, the node that compute clients open first (a tuple; empty when the
        vendor's GPUs have no device files)."""
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def shared_device_file(cls, path):
        """Whether ``path``, a device file that names no single GPU (nvidiactl, kfd, ...), belongs to
        this vendor's driver: a reset-blocking client holding it blocks every GPU of the vendor."""
        raise NotImplementedError

    # ------------------------------------------------------------------ reset
    @classmethod
    @abc.abstractmethod
    def reset_checks(cls, item, snapshot, host):
        """Record, read-only, the ``tool`` precondition (what would reset this GPU, or a FAIL that
        says what to install) and the vendor's own ones (reset_check_names) with ``item.check``.
        Called after the vendor and root checks, unless reset_refusal is set."""
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def reset_device(cls, item, host):
        """Reset the GPU; set ``item.method``, ``item.command`` and ``item.output``; return None on
        success, else an error text that says what to do.  The core verifies the GPU afterwards."""
        raise NotImplementedError

    @classmethod
    def persistence_mode(cls, dev):
        """The persistence mode of ``dev`` that a reset switches off and restores (True, False, or
        None when unknown or when the vendor has no such mode: the default)."""
        return None

    @classmethod
    def persistence_off(cls, item, host, warnings):
        """Switch persistence mode off before the reset (set ``item.persistence['switched_off']``,
        ``item.touched``); return an error text that stops the reset, or None.  Default: no such mode."""
        return None

    @classmethod
    def persistence_restore(cls, item, host):
        """Restore what persistence_off() switched off (``item.persistence['restored']``); return an
        error text or None.  Always called after the reset attempt."""
        return None

    @classmethod
    def drain_on(cls, item, host, warnings):
        """With ``drain: true``: keep new clients off the GPU until the reset is done (best effort:
        record ``item.drain['enabled']`` and ``['detail']``, warn, never stop the reset).  Default:
        the vendor cannot drain, which is said in the detail and in a warning."""
        item.drain['detail'] = DRAIN_UNAVAILABLE
        warnings.append('%s: %s; continuing without it' % (item.label, DRAIN_UNAVAILABLE))

    @classmethod
    def drain_off(cls, item, host):
        """Undo drain_on() when it drained (``item.drain['restored']``); return an error text or None."""
        return None

    @classmethod
    def session_blocks_reset(cls, host):
        """Why this process itself would block the reset now (a vendor library session it still
        holds), or None: the default."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


class DrmDevices(object):
    """The device-file hooks of a vendor whose GPUs are DRM devices (/dev/dri/renderD*, /dev/dri/card*)
    and whose compute clients may share /dev/kfd: mixed into AMD's and Intel's backends."""

    @classmethod
    def device_keys(cls, minor):
        return (('renderD', DRM_RENDER_BASE + minor), ('card', minor))

    @classmethod
    def shared_device_file(cls, path):
        return os.path.basename(path) == 'kfd' or '/dri/' in path
