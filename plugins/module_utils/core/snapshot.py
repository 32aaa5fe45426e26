# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""One consistent read of a host: every selected backend once, then the process table once.

``take_snapshot()`` is the only entry point the modules and the agent use to look at GPUs.
Host-wide ``index`` is the position across vendors (NVIDIA first, then AMD, Intel, Apple), so on
an NVIDIA-only host it equals the NVML / nvidia-smi index; ``vendor_index`` is the vendor
library's own index.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict

from . import xid
from .backends import VENDOR_CHOICES, Selection, preload, select, vendor_backend
from .backends.base import DRM_RENDER_BASE, error_text  # noqa: F401 pylint: disable=unused-import
from .errors import InvalidArgument
from .fdwalk import incomplete_text
from .model import MIG_FORM, GpuProcess, mig_devices_named
from .processes import ProcessInventory, device_key, resolve_dev_roots


class Snapshot(object):
    """The result of take_snapshot().  ``devices`` are the selected GPUs in host-wide index order."""

    def __init__(self, backends, devices, all_devices, processes, holders, taken_at, errors=None,
                 fds_denied=0, gathered_processes=True, holders_scanned=None, unreadable=None, driver_hung=None,
                 xid_log_error=None, holders_incomplete=None):
        self.backends = backends              # OrderedDict vendor -> BackendStatus
        self.devices = devices                # selected Devices
        self.all_devices = all_devices        # every Device the backends returned
        self.processes = processes            # GpuProcess, by pid
        self.holders = holders                # Holder, by pid
        self.taken_at = taken_at
        self.errors = list(errors or [])
        self.unreadable = list(unreadable or [])  # GPUs whose device files exist but no backend reads (also in errors)
        self.fds_denied = fds_denied
        self.gathered_processes = gathered_processes
        self.holders_scanned = gathered_processes if holders_scanned is None else holders_scanned
        # None, or {call, vendor, gpu, pci_bus_id, timeout_s, message}: a driver call that did not return in time
        self.driver_hung = driver_hung
        self.xid_log_error = xid_log_error    # why the kernel log's Xid lines could not be read, or None
        # None, or the processes whose open files the holder scan's bound left unread (processes.InventoryResult)
        self.holders_incomplete = holders_incomplete

    def device(self, key):
        """The device with host-wide index or UUID ``key`` (among all devices), or None."""
        for dev in self.all_devices:
            if _matches(dev, key):
                return dev
        return None

    def process(self, pid):
        """The GpuProcess (listed by the driver) with this pid, or None."""
        for proc in self.processes:
            if proc.pid == pid:
                return proc
        return None

    def holder(self, pid):
        """The Holder (holds GPU device files, not listed by the driver) with this pid, or None."""
        for holder in self.holders:
            if holder.pid == pid:
                return holder
        return None

    def to_facts(self):
        """The ``ansible_facts.gpu`` dictionary (docs/design/contracts.md)."""
        return {
            'backends': OrderedDict((name, status.to_dict()) for name, status in self.backends.items()),
            'devices': [dev.to_dict() for dev in self.devices],
            'processes': [proc.to_dict() for proc in self.processes],
            'holders': [holder.to_dict() for holder in self.holders],
            'driver_hung': dict(self.driver_hung) if self.driver_hung is not None else None,
            'holders_incomplete': copy.deepcopy(self.holders_incomplete),
        }


def _mig_of(dev, dproc):
    """The MigDevice the driver lists ``dproc`` on (by its UUID, else its instance ids), or None."""
    ref = dproc.mig
    if ref is None:
        return None
    if ref.get('uuid'):
        return dev.mig_device(uuid=ref['uuid'])
    return dev.mig_device(gpu_instance_id=ref['gpu_instance_id'], compute_instance_id=ref['compute_instance_id'])


def _key_text(key):
    return str(key).strip()


def _matches(dev, key):
    text = _key_text(key)
    if text.isdigit() and text.isascii():  # '²'.isdigit() is true, but int('²') fails
        return dev.index == int(text)
    return dev.uuid is not None and dev.uuid.lower() == text.lower()


def resolve_gpu_targets(devices, gpus):
    """[(Device, MigDevices or None)] named by ``gpus``: host-wide indexes, board UUIDs (the whole board: None),
    MIG device UUIDs (``MIG-...``) and ``GPU:GI`` / ``GPU:GI:CI`` forms (only those MIG devices of the board).

    ``None`` selects every device.  Raises InvalidArgument naming the first value that matches no GPU.
    """
    if gpus is None:
        return [(dev, None) for dev in devices]
    wanted = OrderedDict()
    for key in gpus:
        if isinstance(key, int) and not isinstance(key, bool) and key.bit_length() > 64:
            raise InvalidArgument('gpus', 'an integer of %d bits' % key.bit_length(), 'no GPU has such an index')
        text = _key_text(key)
        if not text:
            raise InvalidArgument('gpus', key, 'an empty value is neither a GPU index nor a UUID')
        found = False
        for dev in devices:
            migs = mig_devices_named(dev, text)   # GPU:GI[:CI] or a MIG- UUID (policy rules name them so too)
            if migs is None and _matches(dev, text):
                wanted[dev.index] = (dev, None)
                found = True
            elif migs:
                found = True
                dev_, have = wanted.get(dev.index, (dev, []))
                if have is not None:
                    wanted[dev.index] = (dev_, have + [m for m in migs if m not in have])
        if not found:
            raise InvalidArgument('gpus', key, _unknown_gpu(devices, text))
    return [wanted[index] for index in sorted(wanted)]


def _unknown_gpu(devices, text):
    known = ', '.join('%s (%s)' % (dev.index, dev.uuid or 'no UUID') for dev in devices) or 'none'
    migs = ', '.join('%s (%s)' % (m.unit, m.uuid or 'no UUID') for dev in devices for m in getattr(dev, 'mig_devices', None) or ())
    if MIG_FORM.match(text) or text.lower().startswith('mig-'):
        return 'no MIG device on this host has this GPU:GPU-instance id or MIG UUID; MIG devices here: %s' % (migs or 'none')
    return 'no GPU on this host has this index or UUID; GPUs here: %s%s' % (known, '; MIG devices: %s' % migs if migs else '')


def resolve_gpus(devices, gpus):
    """Select ``devices`` by host-wide indexes or UUIDs (strings or ints); a MIG device (``MIG-`` UUID,
    ``GPU:GI``) selects its board (resolve_gpu_targets tells which instances).

    ``None`` selects every device.  Raises InvalidArgument naming the first value that matches no GPU.
    """
    return [dev for dev, _migs in resolve_gpu_targets(devices, gpus)]


def device_gpus(paths, devices, dev_roots):
    """Host-wide indexes of the GPUs that a holder's device files name (shared nodes name none)."""
    indexes = set()
    for path in paths:
        key = device_key(path, dev_roots)
        if key is None:
            continue
        for dev in devices:
            if dev.minor is not None and key in vendor_backend(dev.vendor).device_keys(dev.minor):
                indexes.add(dev.index)
    return sorted(indexes)


def _read_backends(vendor, factories):
    """Probe and read every selected backend once: (statuses, requested, devices, errors).  The vendor
    libraries are closed before it returns (a GPU reset needs our own library session gone)."""
    errors = []
    selection = select(vendor, factories)
    all_devices = []
    try:
        for backend in selection.backends:
            try:
                devs = list(backend.devices())
            except Exception as exc:  # pylint: disable=broad-except
                status = selection.statuses[backend.name]
                status.error = 'reading the GPUs failed: %s' % error_text(exc)
                errors.append('%s: %s' % (backend.name, status.error))
                devs = []
            devs.sort(key=lambda d: d.vendor_index)
            all_devices.extend(devs)
    finally:
        selection.close()
    return selection.statuses, selection.requested, all_devices, errors


def take_snapshot(vendor='auto', gpus=None, gather_processes=True, inventory=None, factories=None,
                  dev_roots=None, proc_root='/proc', scan_holders=True, driver_timeout=None, xid_since=None,
                  kmsg_path=None, xid_memo=None):
    """Read every selected backend and the process table once; return a Snapshot.

    vendor: ``auto`` (every backend whose library loads) or one of nvidia, amd, intel, apple.
    gpus: host-wide indexes or UUIDs to report (None = all); an unknown one raises InvalidArgument.
    gather_processes: join driver pids with the process table and scan fds for holders.
    scan_holders: with gather_processes, also walk every process's fds for holders the driver does
    not list (False: only the listed pids' fds are read and ``holders`` stays empty).  ``'auto'``:
    walk them only when some selected GPU's used memory is not explained by the processes its
    driver lists, or cannot be told (see ``holder_scan_needed``); ``Snapshot.holders_scanned`` says
    whether the walk ran.
    driver_timeout: seconds the driver reads may take; they then run in a watchdog child
    (core/watchdog.py) and a read that does not finish raises watchdog.DriverHung (None: in this
    process, no deadline).
    xid_since: Xid events older than this (epoch seconds) change no health (default: the last hour); or a
    function of the Device that returns it (None: the default), so that one GPU's reset leaves the others'
    health as it was (core/remediate.py ``health_since``).
    kmsg_path: the kernel log to read Xid lines from (default ``$_GPUFLEET_KMSG`` or /dev/kmsg).
    xid_memo: the journal memo the guard keeps between ticks (xid.read_journal), changed in place; None: none.
    inventory: a ProcessInventory (tests); else one is built from dev_roots / proc_root (test seams).
    factories: vendor -> callable returning a Backend (tests).
    """
    taken_at = time.time()
    if driver_timeout is None:
        statuses, requested, all_devices, errors = _read_backends(vendor, factories)
    else:
        if vendor not in VENDOR_CHOICES:   # checked here: the child's errors come back as text
            raise InvalidArgument('vendor', vendor, 'must be one of %s' % ', '.join(VENDOR_CHOICES))
        from . import watchdog  # pylint: disable=import-outside-toplevel
        if not factories:
            preload(vendor, resolve_dev_roots(dev_roots))   # compiled here once, not in the child and again here after it
        statuses, requested, all_devices, errors = watchdog.run(lambda: _read_backends(vendor, factories), driver_timeout)
    selection = Selection([], statuses, requested)
    xid_log_error = _read_xid_log(all_devices, kmsg_path, xid_memo)
    unreadable = selection.unreadable(resolve_dev_roots(dev_roots))
    errors.extend(unreadable)
    for index, dev in enumerate(all_devices):
        dev.index = index
        for mig in dev.mig_devices or ():
            mig.parent_index = index
        xid.apply_health(dev, taken_at, xid_since(dev) if callable(xid_since) else xid_since)

    selected = resolve_gpus(all_devices, gpus)
    for dev in selected:
        dev.compute_orphaned()

    processes = []
    holders = []
    fds_denied = 0
    holders_scanned = False
    incomplete = None
    if scan_holders == 'auto':
        scan_holders = holder_scan_needed(selected)
    if gather_processes:
        if inventory is None:
            inventory = ProcessInventory(dev_roots=dev_roots, proc_root=proc_root, scan_holders=scan_holders)
        holders_scanned = bool(inventory.scan_fds and inventory.scan_holders)
        by_pid = OrderedDict()
        driver_names = {}
        for dev in selected:
            for dproc in dev.driver_processes:
                proc = by_pid.get(dproc.pid)
                if proc is None:
                    proc = by_pid[dproc.pid] = GpuProcess(pid=dproc.pid)
                proc.add_gpu(dev.index, dproc.used_mib, dproc.types, dproc.util_pct, mig=_mig_of(dev, dproc))
                if dproc.name:
                    driver_names.setdefault(dproc.pid, dproc.name)
        listed_anywhere = set(p.pid for dev in all_devices for p in dev.driver_processes)
        result = inventory.scan(sorted(by_pid))
        errors.extend(result.errors)
        fds_denied = result.fds_denied
        incomplete = result.incomplete
        for pid in sorted(by_pid):
            proc = by_pid[pid]
            proc.join(result.record(pid))
            if proc.name is None:
                proc.name = driver_names.get(pid)  # a pid this namespace does not show: the driver's name
            processes.append(proc)
        selected_indexes = set(dev.index for dev in selected)
        for holder in result.holders(listed_anywhere):
            holder.gpu_indexes = device_gpus(holder.devices, all_devices, inventory.dev_roots)
            if gpus is not None and holder.gpu_indexes and not selected_indexes.intersection(holder.gpu_indexes):
                continue
            holders.append(holder)
        if fds_denied:
            errors.append('the open files of %d process(es) could not be read (run as root to see every holder)' % fds_denied)
        if incomplete is not None:
            errors.append(incomplete_text(incomplete))

    return Snapshot(backends=selection.statuses, devices=selected, all_devices=all_devices, processes=processes,
                    holders=holders, taken_at=taken_at, errors=errors, fds_denied=fds_denied,
                    gathered_processes=gather_processes, holders_scanned=holders_scanned, unreadable=unreadable,
                    xid_log_error=xid_log_error, holders_incomplete=incomplete)


def _read_xid_log(devices, kmsg_path=None, memo=None):
    """Add the kernel's Xid records (xid.read_kmsg: only what the driver wrote) to the devices they name (those of the
    vendors whose backend says ``xid_log``: NVIDIA; a record of another PCI address changes nothing); returns why the
    log could not be read (their ``xid_events`` then stay as the driver left them: None when it could not tell
    either).  ``memo``: xid.read_journal's, kept by the guard."""
    logged = [dev for dev in devices if vendor_backend(dev.vendor).xid_log]
    if not logged:
        return None
    events, error = xid.read_kmsg(kmsg_path, memo=memo)
    if events is None:
        return error
    for dev in logged:
        if dev.xid_events is None:
            dev.xid_events = []   # the log could be read: an empty list means none
    xid.join_events(logged, events)
    return None


def holder_scan_needed(devices):
    """Whether the walk of every process's fds can tell more than the drivers' process lists: some
    GPU's used memory is not accounted for by its listed processes (``orphaned_mib`` above 0), or
    cannot be told (``None``: an old driver without the reserved-memory split, an unknown figure)."""
    return any(dev.orphaned_mib is None or dev.orphaned_mib > 0 for dev in devices)
