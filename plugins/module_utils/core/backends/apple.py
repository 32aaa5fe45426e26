# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Apple Silicon backend (macOS): the IOAccelerator entries of the I/O Registry, read with ``ioreg``, no sudo.

``ioreg -r -d 2 -w 0 -c IOAccelerator -a`` prints an XML plist: one dict per accelerator (the
AGX GPU) and, as its ``IORegistryEntryChildren``, one ``AGXDeviceUserClient`` per open GPU
client.  Read with plistlib:

* Device: ``model`` (e.g. "Apple M2 Max"), ``PerformanceStatistics``: ``Device Utilization %``
  and ``In use system memory`` (bytes).  The GPU shares the system's unified memory: there is no
  GPU memory total, so total, free and orphaned memory are ``None``.  Temperature and power need
  ``powermetrics`` (root): ``None``.  ``recoveryCount`` > 0 (GPU hangs the driver recovered from)
  becomes a health note.
* Processes: ``IOUserClientCreator`` ("pid 533, WindowServer") and the sum of
  ``AppUsage[].accumulatedGPUTime`` (ns of GPU time); utilization = its increase between two
  readings ``SAMPLE_INTERVAL_S`` apart.  macOS reports no per-process GPU memory: ``None``.
* Reset: macOS has no GPU reset (core/reset.py refuses it); only the GPU's clients can be stopped.
"""

from __future__ import annotations

import re
import sys
import time

from .. import drm_fdinfo as drm
from ..model import BackendStatus, Device, bytes_to_mib
from ..safe_files import find_program
from .base import Backend, error_text, read_device, run_command, to_number

IOREG = 'ioreg'
IOREG_ARGS = ('-r', '-d', '2', '-w', '0', '-c', 'IOAccelerator', '-a')
IOREG_TIMEOUT_S = 20
NO_PROCESS_MEMORY = 'macOS reports no per-process GPU memory (the GPU uses unified system memory)'
RESET_UNSUPPORTED = 'Apple GPUs cannot be reset: macOS offers no GPU reset; stop the processes that use the GPU instead'
_CREATOR_RE = re.compile(r'^\s*pid\s+(\d+)\s*(?:,\s*(.*?))?\s*$')


def parse_creator(text):
    """``"pid 533, WindowServer"`` -> (533, 'WindowServer'); (None, None) when it does not parse."""
    match = _CREATOR_RE.match(str(text or ''))
    if not match:
        return None, None
    return int(match.group(1)), (match.group(2) or None)


def gpu_time_ns(client):
    """Sum of ``AppUsage[].accumulatedGPUTime`` of one user client (ns); None when it reports none."""
    direct = to_number(client.get('accumulatedGPUTime'))
    if direct is not None:
        return direct
    usage = client.get('AppUsage')
    if not isinstance(usage, list):
        return None
    values = [to_number(item.get('accumulatedGPUTime')) for item in usage if isinstance(item, dict)]
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def _walk_clients(entry):
    """Every descendant of an accelerator entry that names its creating process."""
    children = entry.get('IORegistryEntryChildren')
    for child in children if isinstance(children, list) else []:
        if not isinstance(child, dict):
            continue
        if 'IOUserClientCreator' in child:
            yield child
        yield from _walk_clients(child)


def _text(value):
    """A registry name as text (ioreg gives some as data); None for anything else."""
    if isinstance(value, bytes):
        value = value.split(b'\0', 1)[0].decode('utf-8', 'replace')
    return value if isinstance(value, str) and value else None


class Accelerator(object):
    """One IOAccelerator entry: ``key`` (registry id), the entry, and {pid: [name, GPU ns or None]}."""

    def __init__(self, entry, position):
        self.entry = entry
        self.key = to_number(entry.get('IORegistryEntryID'))
        if self.key is None:
            self.key = 'position %d' % position
        self.clients = {}
        for client in _walk_clients(entry):
            pid, name = parse_creator(client.get('IOUserClientCreator'))
            if pid is None:
                continue
            spent = gpu_time_ns(client)
            slot = self.clients.setdefault(pid, [name, 0])
            slot[1] = None if slot[1] is None or spent is None else slot[1] + spent

    @property
    def stats(self):
        stats = self.entry.get('PerformanceStatistics')
        return stats if isinstance(stats, dict) else {}


class IoregReading(object):
    """One ``ioreg`` run: ``accelerators`` (list of Accelerator), or ``error``; ``taken_at`` clock seconds."""

    def __init__(self, accelerators, error, taken_at):
        self.accelerators = accelerators
        self.error = error
        self.taken_at = taken_at

    def find(self, key):
        for acc in self.accelerators:
            if acc.key == key:
                return acc
        return None


class AppleBackend(Backend):
    """Apple GPUs.  Test seams (never user options): ``platform`` (sys.platform), ``runner`` and
    ``which`` for ioreg, ``clock``, ``sleep``, ``interval`` and ``cache`` for the two readings (drm_fdinfo.TwoReadings)."""

    name = 'apple'
    label = 'Apple'
    reset_refusal = ('Apple GPUs cannot be reset: macOS offers no GPU reset. Stop the processes that use the GPU '
                     '(gpufleet.reclaim.gpu_kill) or restart the Mac.')

    def __init__(self, platform=None, runner=None, which=None, clock=time.monotonic, sleep=time.sleep, interval=None,
                 cache=None):
        super(AppleBackend, self).__init__()
        self.platform = platform or sys.platform
        self.runner = runner or run_command
        self.which = which or find_program
        self.readings = drm.TwoReadings(clock, sleep, interval, cache)
        self.ioreg = None
        self.known = []          # accelerator keys seen by probe(), in order

    def probe(self):
        if self.platform != 'darwin':
            return self._unavailable('Apple GPUs exist only on macOS hosts (this host is %s)' % self.platform)
        self.ioreg = self.which(IOREG)
        if not self.ioreg:
            return self._unavailable('the ioreg command was not found (macOS ships it as /usr/sbin/ioreg)')
        reading = self._sample()
        if reading.error:
            return self._unavailable(reading.error)
        if not reading.accelerators:
            return self._unavailable('the I/O Registry lists no IOAccelerator (no GPU)')
        self.known = [acc.key for acc in reading.accelerators]
        version = None
        if self.platform == sys.platform:
            import platform as platform_module  # pylint: disable=import-outside-toplevel
            version = platform_module.mac_ver()[0]
        self.status = BackendStatus(name=self.name, available=True, version=('macOS %s' % version) if version else None,
                                    error=None)
        return self.status

    def _unavailable(self, reason):
        self.status = BackendStatus(name=self.name, available=False, error=reason)
        return self.status

    def _sample(self):
        rc, out, err = self.runner([self.ioreg] + list(IOREG_ARGS), IOREG_TIMEOUT_S)
        taken_at = self.readings.clock()
        if rc != 0:
            detail = (err or '').strip().splitlines()
            return IoregReading([], 'ioreg failed (%s): %s' % ('rc %s' % rc, detail[-1] if detail else 'no message'), taken_at)
        try:
            # only on macOS: not at load on Linux
            import plistlib  # pylint: disable=import-outside-toplevel
            data = plistlib.loads(out) if out.strip() else []
        except Exception as exc:  # pylint: disable=broad-except
            return IoregReading([], 'ioreg printed no readable plist: %s' % error_text(exc), taken_at)
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            return IoregReading([], 'ioreg printed an unexpected plist (%s)' % type(data).__name__, taken_at)
        return IoregReading([Accelerator(e, i) for i, e in enumerate(x for x in data if isinstance(x, dict))], None, taken_at)

    # ------------------------------------------------------------------ device files (see base.Backend)
    @classmethod
    def device_keys(cls, minor):
        return ()   # macOS has no per-GPU device file: the clients are read from the IORegistry

    @classmethod
    def shared_device_file(cls, path):
        return False

    def devices(self):
        if not self.status.available:
            return []
        first, second = self.readings.pair(self._sample, ('ioreg', self.ioreg),
                                           needed=lambda r: any(acc.clients for acc in r.accelerators))
        elapsed = second.taken_at - first.taken_at
        result = []
        keys = list(self.known) + [acc.key for acc in second.accelerators if acc.key not in self.known]
        for position, key in enumerate(keys):
            dev = Device(vendor=self.name, vendor_index=position)
            acc = second.find(key)
            if acc is None:
                dev.processes_complete = False
                why = second.error or 'it is no longer in the I/O Registry'
                dev.health.lose('the GPU stopped answering (%s); reboot the Mac' % why, action='reboot')
            else:
                read_device(dev, self._read, acc, first.find(key), elapsed)
            result.append(dev)
        return result

    def _read(self, dev, acc, before, elapsed):
        entry = acc.entry
        dev.name = _text(entry.get('model')) or _text(entry.get('IOClass')) or _text(entry.get('IORegistryEntryName'))
        stats = acc.stats
        util = to_number(stats.get('Device Utilization %'))
        dev.utilization_pct = max(0, min(100, util)) if util is not None else None
        dev.memory_used_mib = bytes_to_mib(to_number(stats.get('In use system memory')))
        recoveries = to_number(stats.get('recoveryCount'))
        if recoveries:
            dev.health.note('the GPU driver recovered from %d GPU hang(s) since boot' % recoveries)
        dev.errors.append(NO_PROCESS_MEMORY)
        for pid in sorted(acc.clients):
            name, spent = acc.clients[pid]
            proc = dev.add_driver_process(pid, None, 'graphics')
            previous = before.clients.get(pid, [None, None])[1] if before is not None else None
            if spent is None or previous is None or not elapsed or elapsed <= 0:
                proc.util_pct = None
            else:
                delta = spent - previous if spent >= previous else 0
                proc.util_pct = int(round(max(0.0, min(100.0, delta / (elapsed * 1e9) * 100.0))))
            if name:
                proc.name = name
