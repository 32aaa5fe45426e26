# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Intel backend (i915 and xe kernel drivers) over sysfs and DRM fdinfo; xpu-smi JSON where installed.

What it reads, and what stays ``None``:

* Devices: ``/sys/class/drm/card<N>`` whose PCI device has vendor ``0x8086`` and whose ``driver``
  link names ``i915`` or ``xe``.  Name from the pci.ids database (``Intel GPU [8086:xxxx]``
  without it), PCI address from the device link.  Device-local memory total where the driver
  exposes it: xe ``device/tile*/physical_vram_size_bytes``; Intel's out-of-tree i915
  ``lmem_total_bytes`` and ``lmem_avail_bytes`` (then used = total - available).  Mainline i915
  and xe publish no used-memory figure in sysfs: used memory is ``None`` (and so is orphaned
  memory) unless xpu-smi is installed.  Integrated GPUs have no memory of their own: ``None``.
* hwmon (discrete cards): temperature, the power limit, and the power draw from two readings of
  the energy counter.
* Processes: DRM fdinfo of ``/dev/dri`` fds (drm_fdinfo.py), counted once per
  ``(drm-pdev, drm-client-id)`` and attributed to the process that opened the device (forked
  children sharing the fd show as holders).  Memory = the client's resident local memory (system
  memory on integrated GPUs); utilization = the busiest engine between two readings
  ``SAMPLE_INTERVAL_S`` apart (``drm-engine-*`` ns on i915, ``drm-cycles-*`` over
  ``drm-total-cycles-*`` on xe).  Other users' fdinfo needs root: without it the list is marked
  incomplete.
* Device utilization: xpu-smi's figure, else the sum of every client's engine time, which is
  only known when every process's fdinfo could be read (root).
* xpu-smi (``discovery -j``, ``stats -d N -j``): product name, UUID, memory used (MiB), GPU
  utilization, core temperature and power.  It fails or is absent: sysfs figures stay.
"""

from __future__ import annotations

import errno
import json
import os
import time

from .. import drm_fdinfo as drm
from ..model import BackendStatus, Device, bytes_to_mib
from ..safe_files import find_program
from .base import FAIL, MAX_CELSIUS, PASS, Backend, DrmDevices, last_line, pci_bdf, read_device, run_command, to_reading

INTEL_PCI_VENDOR = '0x8086'
# PCI class 0x03xxxx: display controllers (integrated and discrete GPUs).
DISPLAY_CLASS_PREFIX = drm.DISPLAY_CLASS_PREFIX
XPU_SMI = 'xpu-smi'
XPU_SMI_TIMEOUT_S = 20
# xpu-smi device ids are small indexes.
MAX_XPU_ID = 4096


def _parse_json(text):
    """The JSON document ``text`` holds, or None (not JSON, or nested too deep for the parser)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def count_intel_gpus(sys_root='/sys'):
    """Intel display devices under /sys/bus/pci/devices, bound to a driver or not (0 when unreadable)."""
    return drm.count_pci_display_devices(sys_root, INTEL_PCI_VENDOR)


def device_name(card, root):
    """A card's product name: pci.ids, else ``Intel GPU [8086:DEVICE]``."""
    name = drm.pci_device_name(card.vendor_id, card.device_id, root)
    if name:
        return name if name.lower().startswith('intel') else 'Intel %s' % name
    if card.device_id:
        return 'Intel GPU [8086:%s]' % card.device_id.replace('0x', '')
    return None


class IntelBackend(DrmDevices, Backend):
    """Intel GPUs (i915/xe).

    Test seams (never user options): ``root`` (reads ``<root>/sys``, ``<root>/proc`` and pci.ids
    under ``<root>/usr/share``; default ``$_GPUFLEET_DRM_ROOT`` or ``/``), ``sys_root`` and
    ``proc_root`` overriding those, ``runner`` and ``which`` for xpu-smi, ``clock``, ``sleep``,
    ``interval`` and ``cache`` for the two readings.
    """

    name = 'intel'
    label = 'Intel'
    reset_tools = ('xpu-smi',)

    def __init__(self, root=None, sys_root=None, proc_root=None, runner=None, which=None, clock=time.monotonic,
                 sleep=time.sleep, interval=None, cache=None):
        super(IntelBackend, self).__init__()
        self.root = drm.drm_root(root)
        self.sys_root = sys_root or os.path.join(self.root, 'sys')
        self.proc_root = proc_root or os.path.join(self.root, 'proc')
        self.runner = runner or run_command
        self.which = which or find_program
        self.readings = drm.TwoReadings(clock, sleep, interval, cache)
        self.cards = []
        self.xpu = None          # BDF -> xpu-smi device dict
        self.xpu_path = None
        self.notes = []

    # ------------------------------------------------------------------ life cycle
    def probe(self):
        self.cards = drm.list_drm_cards(self.sys_root, INTEL_PCI_VENDOR, drm.INTEL_DRIVERS)
        if not self.cards:
            self.status = BackendStatus(name=self.name, available=False, error=self._absent_reason())
            return self.status
        self._probe_xpu_smi()
        self.status = BackendStatus(name=self.name, available=True, version=self._version(), error=None)
        return self.status

    def _absent_reason(self):
        found = count_intel_gpus(self.sys_root)
        if found:
            return ('%d Intel display device(s) on the PCI bus, but none is driven by the i915 or xe kernel driver '
                    '(is the driver loaded?)' % found)
        if not os.path.isdir(os.path.join(self.sys_root, 'class', 'drm')):
            return 'no DRM devices in %s (no GPU driver loaded, or sysfs is not mounted)' % os.path.join(self.sys_root, 'class', 'drm')
        return 'no Intel GPU driven by the i915 or xe kernel driver was found'

    def _version(self):
        drivers = sorted(set(card.driver for card in self.cards))
        versions = [drm.read_sysfs(os.path.join(self.sys_root, 'module', d, 'version')) for d in drivers]
        kernel = drm.read_sysfs(os.path.join(self.proc_root, 'sys', 'kernel', 'osrelease'))
        parts = []
        for driver, version in zip(drivers, versions):
            parts.append('%s %s' % (driver, version or kernel or '(version unknown)'))
        return ', '.join(parts) or None

    def _probe_xpu_smi(self):
        self.xpu = None
        self.xpu_path = self.which(XPU_SMI)
        if not self.xpu_path:
            return
        rc, out, err = self._xpu_smi('discovery', '-j')
        data = self._json(rc, out, err, 'xpu-smi discovery -j')
        if data is None:
            return
        devices = data.get('device_list') if isinstance(data, dict) else None
        if not isinstance(devices, list):
            self.notes.append('xpu-smi discovery -j printed no device_list: using sysfs only')
            return
        self.xpu = {}
        for item in devices:
            if isinstance(item, dict) and isinstance(item.get('pci_bdf_address'), str) and item['pci_bdf_address']:
                self.xpu[item['pci_bdf_address'].lower()] = item

    def _xpu_smi(self, *args):
        rc, out, err = self.runner([self.xpu_path] + list(args), XPU_SMI_TIMEOUT_S)
        return rc, out.decode('utf-8', 'replace') if isinstance(out, bytes) else out, err

    def _json(self, rc, out, err, what):
        if rc != 0:
            lines = (err or out or '').strip().splitlines()
            self.notes.append('%s failed (%s): using sysfs only' % (what, lines[-1] if lines else 'rc %s' % rc))
            return None
        data = _parse_json(out)
        if data is None:
            self.notes.append('%s printed no JSON: using sysfs only' % what)
        return data

    # ------------------------------------------------------------------ reading
    def _sample(self):
        scan = drm.scan_clients(self.proc_root, drm.INTEL_DRIVERS, clock=self.readings.clock)
        scan.extra['energy'] = dict((card.minor, drm.hwmon_readings(card)['energy_uj']) for card in self.cards)
        return scan

    # ------------------------------------------------------------------ reset (see base.Backend)
    @classmethod
    def reset_checks(cls, item, snapshot, host):
        xpu = host.tool('xpu-smi')
        sysfs = _reset_file(host, item.dev)
        if xpu:
            item.check('tool', PASS, 'xpu-smi config --reset (%s)' % xpu)
        elif sysfs and os.path.exists(sysfs):
            item.check('tool', PASS, 'PCI function reset through %s' % sysfs)
        else:
            item.check('tool', FAIL, 'xpu-smi was not found and the kernel offers no PCI reset for this GPU (%s is missing): '
                                     'install xpu-smi, or reboot the node' % (sysfs or 'no PCI address known'))

    @classmethod
    def reset_device(cls, item, host):
        """``xpu-smi config -d N --reset`` where xpu-smi exists, else a PCI reset through sysfs."""
        dev = item.dev
        xpu = host.tool('xpu-smi')
        if xpu:
            # -d takes a device id or a PCI address; the address cannot name another GPU.
            argv = [xpu, 'config', '-d', pci_bdf(dev.pci_bus_id) if dev.pci_bus_id else str(dev.vendor_index), '--reset']
            rc, out, err = host.run(argv)
            item.method, item.command, item.output = 'xpu-smi', argv, (out + err).strip()
            return None if rc == 0 else 'xpu-smi config --reset failed (rc %d): %s' % (rc, last_line(out + err))
        path = _reset_file(host, dev)
        item.method, item.command = 'sysfs', ['write', '1', path]
        if path is None:
            return 'the PCI address of this GPU is unknown, so it cannot be reset through sysfs'
        method_file = os.path.join(os.path.dirname(path), 'reset_method')
        try:
            with open(method_file) as handle:
                item.output = 'reset methods: %s' % handle.read().strip()
        except OSError:
            item.output = None
        try:
            fd = os.open(path, os.O_WRONLY | getattr(os, 'O_CLOEXEC', 0))
            try:
                os.write(fd, b'1')
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return 'the kernel offers no reset for %s (%s is missing): reboot the node' % (dev.pci_bus_id, path)
            if exc.errno in (errno.EACCES, errno.EPERM):
                return 'writing %s needs root: run the task with become: true' % path
            return 'the PCI reset through %s failed: %s' % (path, exc.strerror or exc)
        return None

    def devices(self):
        if not self.status.available:
            return []
        first, second = self.readings.pair(self._sample, ('intel', self.proc_root, self.sys_root),
                                           needed=lambda s: bool(s.clients) or any(v is not None for v in s.extra['energy'].values()))
        ordered = sorted(self.cards, key=lambda c: c.bdf)
        ids = [self._xpu_id(card) for card in ordered]
        use_xpu_ids = all(i is not None for i in ids) and len(set(ids)) == len(ids)
        result = []
        for position, card in enumerate(ordered):
            dev = Device(vendor=self.name, vendor_index=ids[position] if use_xpu_ids else position,
                         minor=card.minor, pci_bus_id=card.bdf)
            result.append(read_device(dev, self._read_card, card, first, second))
        return result

    def _xpu_id(self, card):
        item = (self.xpu or {}).get(card.bdf)
        if item is None or isinstance(item.get('device_id'), float):
            return None
        return to_reading(item.get('device_id'), int, 0, MAX_XPU_ID)

    def _read_card(self, dev, card, first, second):
        if drm.card_lost(dev, card):
            return
        dev.name = device_name(card, self.root)
        for note in self.notes:
            dev.errors.append(note)
        self._read_memory(dev, card)
        hw = drm.hwmon_readings(card)
        dev.temperature_c = hw['temp_c']
        dev.power_limit_w = hw['power_cap_w']
        dev.power_w = hw['power_w']
        energy = (first.extra.get('energy', {}).get(card.minor), second.extra.get('energy', {}).get(card.minor))
        elapsed = second.taken_at - first.taken_at
        # a counter that did not move in the interval is not updating: no figure rather than 0 W
        if dev.power_w is None and None not in energy and energy[1] > energy[0] and elapsed > 0:
            dev.power_w = round((energy[1] - energy[0]) / 1e6 / elapsed, 3)
        drm.add_client_processes(dev, first, second, card.bdf, self.proc_root)
        if first.complete and second.complete:
            dev.utilization_pct = drm.pdev_utilization(first, second, card.bdf)
        else:
            drm.note_incomplete(dev, second)
        self._overlay_xpu_smi(dev, card)

    def _read_memory(self, dev, card):
        tiles = []
        try:
            names = sorted(os.listdir(card.device_path))
        except OSError:
            names = []
        for name in names:
            if name.startswith('tile'):
                value = drm.read_int(os.path.join(card.device_path, name, 'physical_vram_size_bytes'))
                if value is not None:
                    tiles.append(value)
        total = sum(tiles) if tiles else None
        avail = None
        if total is None:
            for base in (card.path, card.device_path):
                total = drm.read_int(os.path.join(base, 'lmem_total_bytes'))
                if total is not None:
                    avail = drm.read_int(os.path.join(base, 'lmem_avail_bytes'))
                    break
        dev.memory_total_mib = bytes_to_mib(total)
        if total is not None and avail is not None:
            dev.memory_used_mib = bytes_to_mib(max(0, total - avail))
            dev.memory_free_mib = bytes_to_mib(avail)

    def _overlay_xpu_smi(self, dev, card):
        item = (self.xpu or {}).get(card.bdf)
        if item is None:
            return
        if isinstance(item.get('device_name'), str) and item['device_name']:
            dev.name = item['device_name']
        if isinstance(item.get('uuid'), str) and item['uuid']:
            dev.uuid = item['uuid']
        size = to_reading(item.get('memory_physical_size_byte'), float)
        if size and dev.memory_total_mib is None:
            dev.memory_total_mib = bytes_to_mib(int(size))
        device_id = self._xpu_id(card)
        if device_id is None:
            return
        rc, out, err = self._xpu_smi('stats', '-d', str(device_id), '-j')
        if rc != 0:
            dev.errors.append('xpu-smi stats -d %d -j failed: %s' % (device_id, (err or out).strip() or 'rc %s' % rc))
            return
        data = _parse_json(out)
        if data is None:
            dev.errors.append('xpu-smi stats -d %d -j printed no JSON' % device_id)
            return
        level = data.get('device_level') if isinstance(data, dict) else None
        metrics = {}
        for entry in level if isinstance(level, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get('metrics_type'), str):
                metrics[entry['metrics_type']] = entry.get('value')
        # a figure out of range is a wrong one: the sysfs reading (or None) stays
        used = to_reading(metrics.get('XPUM_STATS_MEMORY_USED'), float)  # MiB
        if used is not None:
            dev.memory_used_mib = int(used)
            if dev.memory_total_mib is not None:
                dev.memory_free_mib = max(0, dev.memory_total_mib - dev.memory_used_mib)
        util = to_reading(metrics.get('XPUM_STATS_GPU_UTILIZATION'), float, 0, 100)
        if util is not None:
            dev.utilization_pct = int(round(util))
        temp = to_reading(metrics.get('XPUM_STATS_GPU_CORE_TEMPERATURE'), float, 0, MAX_CELSIUS)
        if temp is not None:
            dev.temperature_c = int(round(temp))
        power = to_reading(metrics.get('XPUM_STATS_POWER'), float)
        if power is not None:
            dev.power_w = round(power, 3)


def _reset_file(host, dev):
    """The sysfs file whose write resets the PCI function of ``dev`` (under ``host.sys_root``), or None."""
    if not dev.pci_bus_id:
        return None
    return os.path.join(host.sys_root, 'bus', 'pci', 'devices', pci_bdf(dev.pci_bus_id), 'reset')
