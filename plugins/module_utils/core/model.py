# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""The data model of one read of a host: devices, GPU processes, device-file holders, health.

A value the driver or the OS cannot tell is ``None``, never ``0``.  Every ``to_dict()`` returns
exactly the keys of the ``ansible_facts.gpu`` contract (docs/design/contracts.md); the extra
attributes (types, ppid, exe, pod uid, ...) are for the core's own decisions.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional

MIB = 1024 * 1024

HEALTH_STATUSES = ('ok', 'degraded', 'lost')
# Recommended actions, mildest first: a combined health keeps the most severe one.
RECOMMENDED_ACTIONS = ('none', 'reset', 'reboot', 'drain')
PROCESS_TYPES = ('compute', 'graphics', 'mps')
NOT_FOUND = 'not_found'
# MiB per listed process that a vendor's driver uses for the context and charges to no process;
# unattributed memory up to this allowance is bookkeeping, not orphaned.  Measured on an NVIDIA H200
# (driver 580.159.04, tests/device/run): 8, 14 and 25 MiB with 1, 2 and 4 CUDA processes.
CONTEXT_OVERHEAD_MIB = {'nvidia': 16}


def bytes_to_mib(value):
    """Bytes -> whole MiB (rounded down), ``None`` stays ``None``."""
    if value is None:
        return None
    return int(value) // MIB


@dataclass
class BackendStatus:
    """Whether a vendor backend could be used on this host, and why not."""

    name: str
    available: bool = False
    version: Optional[str] = None
    error: Optional[str] = None

    def to_dict(self):
        return {'available': bool(self.available), 'version': self.version, 'error': self.error}


@dataclass
class Health:
    """Health of one GPU: ``status`` ok|degraded|lost and the ``recommended_action``."""

    status: str = 'ok'
    recommended_action: str = 'none'
    reasons: List[str] = field(default_factory=list)

    def _raise_action(self, action):
        if action not in RECOMMENDED_ACTIONS:
            raise ValueError('unknown recommended action %r' % (action,))
        if RECOMMENDED_ACTIONS.index(action) > RECOMMENDED_ACTIONS.index(self.recommended_action):
            self.recommended_action = action

    def degrade(self, reason, action='none'):
        """Record a problem that makes the GPU degraded (a lost GPU stays lost)."""
        if self.status == 'ok':
            self.status = 'degraded'
        self._raise_action(action)
        self.note(reason)

    def lose(self, reason, action='reset'):
        """The GPU stopped answering (NVML_ERROR_GPU_IS_LOST or equivalent)."""
        self.status = 'lost'
        self._raise_action(action)
        self.note(reason)

    def note(self, reason):
        """Record a reading that failed without changing the status."""
        if reason and reason not in self.reasons:
            self.reasons.append(reason)

    def to_dict(self):
        return {'status': self.status, 'recommended_action': self.recommended_action, 'reasons': list(self.reasons)}


@dataclass
class DriverProcess:
    """A process as the driver lists it on one GPU (compute, graphics and MPS lists merged per pid)."""

    pid: int
    used_mib: Optional[int] = None
    types: List[str] = field(default_factory=list)
    # SM utilization (percent) from the driver's per-process samples; None when the driver has
    # no per-process figure (call not supported, no permission, error).
    util_pct: Optional[int] = None
    # The process name as the driver reports it (amdsmi, ioreg); None when it reports none.
    name: Optional[str] = None
    # System memory (GTT) the process's GPU buffers use, MiB (amdgpu, xe, i915); None when unknown.
    system_mib: Optional[int] = None

    @property
    def type(self):
        """``compute``, ``graphics``, ``mps`` or several joined by ``+`` (listed in several lists)."""
        return '+'.join(self.types) if self.types else None

    def merge(self, used_mib, ptype):
        """Merge another list's entry for the same pid: keep the largest known memory figure."""
        if used_mib is not None and (self.used_mib is None or used_mib > self.used_mib):
            self.used_mib = used_mib
        if ptype and ptype not in self.types:
            self.types.append(ptype)


@dataclass
class Device:
    """One GPU as read from its vendor library.  ``index`` is assigned by the snapshot."""

    vendor: str
    vendor_index: int
    index: Optional[int] = None
    uuid: Optional[str] = None
    name: Optional[str] = None
    pci_bus_id: Optional[str] = None
    minor: Optional[int] = None
    memory_total_mib: Optional[int] = None
    memory_used_mib: Optional[int] = None
    memory_free_mib: Optional[int] = None
    # Memory the driver/firmware sets aside; known only from NVML MemoryInfo v2.  memory_used_mib
    # never includes it when it is known.
    memory_reserved_mib: Optional[int] = None
    memory_api: Optional[str] = None
    utilization_pct: Optional[int] = None
    memory_utilization_pct: Optional[int] = None
    temperature_c: Optional[int] = None
    power_w: Optional[float] = None
    power_limit_w: Optional[float] = None
    fan_pct: Optional[int] = None
    persistence_mode: Optional[bool] = None
    mig_mode: Optional[bool] = None
    ecc_uncorrected_volatile: Optional[int] = None
    orphaned_mib: Optional[int] = None
    health: Health = field(default_factory=Health)
    driver_processes: List[DriverProcess] = field(default_factory=list)
    # False when a process list could not be read (no permission, lost GPU, error): the pids in
    # driver_processes are then incomplete and orphaned memory cannot be computed.
    processes_complete: bool = True
    errors: List[str] = field(default_factory=list)

    def add_driver_process(self, pid, used_mib, ptype):
        for proc in self.driver_processes:
            if proc.pid == pid:
                proc.merge(used_mib, ptype)
                return proc
        proc = DriverProcess(pid=int(pid), used_mib=used_mib, types=[ptype] if ptype else [])
        self.driver_processes.append(proc)
        return proc

    def reading_failed(self, what, error):
        """Record a reading that failed (other than 'not supported'): an error and a health note."""
        text = 'could not read %s: %s' % (what, error)
        self.errors.append(text)
        self.health.note(text)

    @property
    def pids(self):
        return sorted(p.pid for p in self.driver_processes)

    def compute_orphaned(self):
        """Used memory that no listed process accounts for (MiB, clamped at 0) or ``None``.

        ``memory_used_mib`` excludes driver-reserved memory when the driver reports it separately
        (NVML MemoryInfo v2), so the reserve never shows up as orphaned.  What a driver uses per
        context and charges to no process (``CONTEXT_OVERHEAD_MIB`` per listed process) reads as 0;
        above that allowance the whole unattributed figure is reported.  Unknown whenever the used
        figure is unknown, a process list could not be read, or a listed process has no figure.
        """
        if self.memory_used_mib is None or not self.processes_complete or self.health.status == 'lost':
            self.orphaned_mib = None
            return None
        total = 0
        for proc in self.driver_processes:
            if proc.used_mib is None:
                self.orphaned_mib = None
                return None
            total += proc.used_mib
        unattributed = self.memory_used_mib - total
        allowance = CONTEXT_OVERHEAD_MIB.get(self.vendor, 0) * len(self.driver_processes)
        self.orphaned_mib = unattributed if unattributed > allowance else 0
        return self.orphaned_mib

    def to_dict(self):
        return {
            'index': self.index,
            'vendor': self.vendor,
            'vendor_index': self.vendor_index,
            'uuid': self.uuid,
            'name': self.name,
            'pci_bus_id': self.pci_bus_id,
            'memory_total_mib': self.memory_total_mib,
            'memory_used_mib': self.memory_used_mib,
            'memory_free_mib': self.memory_free_mib,
            'utilization_pct': self.utilization_pct,
            'temperature_c': self.temperature_c,
            'power_w': self.power_w,
            'power_limit_w': self.power_limit_w,
            'orphaned_mib': self.orphaned_mib,
            'health': self.health.to_dict(),
            'processes': self.pids,
        }


@dataclass
class ContainerInfo:
    """Container identity read from /proc/PID/cgroup."""

    id: Optional[str] = None
    runtime: Optional[str] = None
    pod_uid: Optional[str] = None

    def to_dict(self):
        return {'id': self.id, 'runtime': self.runtime, 'pod_uid': self.pod_uid}


@dataclass
class ProcessRecord:
    """What this host's process table says about one pid (``status`` ``not_found`` when absent)."""

    pid: int
    status: str = NOT_FOUND
    user: Optional[str] = None
    uid: Optional[int] = None
    name: Optional[str] = None
    cmdline: Optional[List[str]] = None
    create_time: Optional[float] = None
    starttime: Optional[int] = None
    ppid: Optional[int] = None
    exe: Optional[str] = None
    container: Optional[ContainerInfo] = None
    slurm_job: Optional[str] = None
    # GPU device files this pid holds open; None when its fds could not be read.
    device_paths: Optional[List[str]] = None

    @property
    def found(self):
        return self.status != NOT_FOUND


@dataclass
class GpuProcess:
    """A process the driver lists on one or more GPUs, joined with the host's process table."""

    pid: int
    gpu_indexes: List[int] = field(default_factory=list)
    used_mib: Optional[int] = None
    used_mib_by_gpu: Dict[int, Optional[int]] = field(default_factory=dict)
    types: List[str] = field(default_factory=list)
    # Highest per-process utilization over its GPUs; None as soon as one GPU cannot tell.
    util_pct: Optional[int] = None
    util_pct_by_gpu: Dict[int, Optional[int]] = field(default_factory=dict)
    user: Optional[str] = None
    uid: Optional[int] = None
    name: Optional[str] = None
    cmdline: Optional[List[str]] = None
    create_time: Optional[float] = None
    starttime: Optional[int] = None
    status: str = NOT_FOUND
    container: Optional[ContainerInfo] = None
    slurm_job: Optional[str] = None
    ppid: Optional[int] = None
    exe: Optional[str] = None
    device_paths: Optional[List[str]] = None

    @property
    def found(self):
        return self.status != NOT_FOUND

    @property
    def holds_gpu_device(self):
        """True/False when this pid's open files could be read, else None.

        False for a pid the driver lists is suspicious: the local pid may be another process
        with the same number (the driver reports pids of the host PID namespace).
        """
        if self.device_paths is None:
            return None
        return bool(self.device_paths)

    def add_gpu(self, gpu_index, used_mib, types, util_pct=None):
        if gpu_index not in self.gpu_indexes:
            self.gpu_indexes.append(gpu_index)
            self.gpu_indexes.sort()
        self.used_mib_by_gpu[gpu_index] = used_mib
        self.util_pct_by_gpu[gpu_index] = util_pct
        for ptype in types:
            if ptype not in self.types:
                self.types.append(ptype)
        values = list(self.used_mib_by_gpu.values())
        self.used_mib = None if any(v is None for v in values) else sum(values)
        utils = list(self.util_pct_by_gpu.values())
        self.util_pct = None if any(v is None for v in utils) else max(utils)

    def join(self, record):
        """Copy the host process table's view of this pid (a ProcessRecord)."""
        for name in ('status', 'user', 'uid', 'name', 'cmdline', 'create_time', 'starttime', 'ppid', 'exe',
                     'container', 'slurm_job', 'device_paths'):
            setattr(self, name, copy.copy(getattr(record, name)))

    def to_dict(self):
        return {
            'pid': self.pid,
            'gpu_indexes': list(self.gpu_indexes),
            'used_mib': self.used_mib,
            'user': self.user,
            'uid': self.uid,
            'name': self.name,
            'cmdline': list(self.cmdline) if self.cmdline is not None else None,
            'create_time': self.create_time,
            'status': self.status,
            'container': self.container.to_dict() if self.container is not None else None,
            'slurm_job': self.slurm_job,
        }


@dataclass
class Holder:
    """A process holding a GPU device file open that the driver does not list."""

    pid: int
    devices: List[str] = field(default_factory=list)
    gpu_indexes: List[int] = field(default_factory=list)
    user: Optional[str] = None
    uid: Optional[int] = None
    name: Optional[str] = None
    cmdline: Optional[List[str]] = None
    create_time: Optional[float] = None
    starttime: Optional[int] = None
    status: Optional[str] = None
    ppid: Optional[int] = None
    exe: Optional[str] = None
    container: Optional[ContainerInfo] = None
    slurm_job: Optional[str] = None

    @classmethod
    def from_record(cls, record, devices):
        return cls(pid=record.pid, devices=sorted(devices), user=record.user, uid=record.uid, name=record.name,
                   cmdline=copy.copy(record.cmdline), create_time=record.create_time, starttime=record.starttime,
                   status=record.status, ppid=record.ppid, exe=record.exe, container=copy.copy(record.container),
                   slurm_job=record.slurm_job)

    def to_dict(self):
        return {
            'pid': self.pid,
            'user': self.user,
            'name': self.name,
            'cmdline': list(self.cmdline) if self.cmdline is not None else None,
            'devices': list(self.devices),
        }
