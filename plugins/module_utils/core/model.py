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
import re

MIB = 1024 * 1024

HEALTH_STATUSES = ('ok', 'degraded', 'lost')
# Recommended actions, mildest first: a combined health keeps the most severe one.
RECOMMENDED_ACTIONS = ('none', 'reset', 'reboot', 'drain')
# What the driver's NVML_FI_DEV_GET_GPU_RECOVERY_ACTION field asks for (``recovery_action`` of a device), by the
# NVML_GPU_RECOVERY_ACTION_* value of nvml.h (0..4 since R550; 5..7 in newer headers).
RECOVERY_ACTIONS = ('none', 'reset', 'reboot', 'drain_p2p', 'drain_and_reset', 'recover_imex_domain', 'bus_reset',
                    'system_reboot')
# Xid events a device keeps, per class of the step the Xid table calls for (an application Xid that names no pid
# calls for nothing): the newest of each class, and no class makes room for another, so a flood of milder events
# never pushes out a reset, drain or reboot (docs/health.md, "Inputs").  ``xid_counts`` counts every event read.
XID_KEEP = {'reboot': 4, 'drain': 4, 'reset': 8, 'kill_app': 12, 'none': 4}
MAX_XID_EVENTS = sum(XID_KEEP.values())
MAX_XID_CODES = 256          # distinct Xid codes counted per device (the driver's catalogue has fewer)
# An NVML event and a kernel-log record of the same Xid code on one GPU this close in time are one event.
XID_SAME_EVENT_S = 10.0
NOT_FOUND = 'not_found'
# MiB per listed process that a vendor's driver uses for the context and charges to no process;
# unattributed memory up to this allowance is bookkeeping, not orphaned.  Measured on an NVIDIA H200
# (driver 580.159.04, tests/device/run): 8, 14 and 25 MiB with 1, 2 and 4 CUDA processes.
CONTEXT_OVERHEAD_MIB = {'nvidia': 16}


def unattributed_mib(vendor, used_mib, processes, complete):
    """Used memory that none of ``processes`` (DriverProcess) accounts for, MiB clamped at 0, or None.

    What a driver uses per context and charges to no process (``CONTEXT_OVERHEAD_MIB`` per listed process)
    reads as 0; above that allowance the whole unattributed figure is reported.  Unknown when the used figure
    is unknown, the process list is incomplete (``complete`` False) or a listed process has no figure.
    """
    if used_mib is None or not complete:
        return None
    total = 0
    for proc in processes:
        if proc.used_mib is None:
            return None
        total += proc.used_mib
    unattributed = used_mib - total
    allowance = CONTEXT_OVERHEAD_MIB.get(vendor, 0) * len(processes)
    return unattributed if unattributed > allowance else 0


class _Record(object):
    """Plain value classes, built like dataclasses: ``Class(field, ..., name=value)``.

    ``_fields`` lists the fields in order; ``_required`` names those without a default,
    ``_factories`` gives some a fresh value per instance (``list``, ``dict``, a class),
    ``_defaults`` gives others a constant, and every other field defaults to ``None``.  Equality
    and repr are over the fields, in order.  (Not dataclasses: importing ``dataclasses`` pulls in
    ``inspect`` and ``typing``, and generating the classes cost about 30 ms, a fifth of a guard
    tick's import time.)  No ``__slots__``: like a dataclass instance, one can carry other attributes.
    """

    _fields = ()
    _required = ()
    _defaults = {}
    _factories = {}
    _plan = ()
    __hash__ = None  # mutable values, compared by content

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # (name, factory, required, default) per field, worked out once per class
        cls._plan = tuple((name, cls._factories.get(name), name in cls._required, cls._defaults.get(name))
                          for name in cls._fields)

    def __init__(self, *args, **kwargs):
        if args:
            if len(args) > len(self._fields):
                raise TypeError('%s() takes at most %d positional arguments (%d given)' % (
                    self.__class__.__name__, len(self._fields), len(args)))
            for name, value in zip(self._fields, args):
                if name in kwargs:
                    raise TypeError('%s() got multiple values for argument %r' % (self.__class__.__name__, name))
                kwargs[name] = value
        values = self.__dict__
        for name, factory, required, default in self._plan:
            if name in kwargs:
                values[name] = kwargs.pop(name)
            elif factory is not None:
                values[name] = factory()
            elif required:
                raise TypeError('%s() missing required argument %r' % (self.__class__.__name__, name))
            else:
                values[name] = default
        if kwargs:
            raise TypeError('%s() got unexpected keyword argument(s) %s' % (
                self.__class__.__name__, ', '.join(sorted(kwargs))))

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self._fields)

    def __repr__(self):
        fields = ', '.join('%s=%r' % (name, getattr(self, name)) for name in self._fields)
        return '%s(%s)' % (self.__class__.__name__, fields)


def bytes_to_mib(value):
    """Bytes -> whole MiB (rounded down), ``None`` stays ``None``."""
    if value is None:
        return None
    return int(value) // MIB


class BackendStatus(_Record):
    """Whether a vendor backend could be used on this host, and why not."""

    _fields = ('name', 'available', 'version', 'error')
    _required = ('name',)
    _defaults = {'available': False}

    def to_dict(self):
        return {'available': bool(self.available), 'version': self.version, 'error': self.error}


class Health(_Record):
    """Health of one GPU: ``status`` ok|degraded|lost and the ``recommended_action``.

    ``reasons``: sentences for people.  ``codes``: the same findings as stable tokens for programs (the
    device's ``health_reasons`` fact): ``xid_<code>``, ``recovery_action_<action>``, ``gpu_lost``,
    ``reset_required``, ``ecc_uncorrected``, ``remapped_rows_pending``, ``remapped_rows_failure``,
    ``retired_pages_pending``, ``throttle_<reason>``, ``reading_failed``.
    """

    _fields = ('status', 'recommended_action', 'reasons', 'codes')
    _defaults = {'status': 'ok', 'recommended_action': 'none'}
    _factories = {'reasons': list, 'codes': list}

    def _raise_action(self, action):
        if action not in RECOMMENDED_ACTIONS:
            raise ValueError('unknown recommended action %r' % (action,))
        if RECOMMENDED_ACTIONS.index(action) > RECOMMENDED_ACTIONS.index(self.recommended_action):
            self.recommended_action = action

    def degrade(self, reason, action='none', code=None):
        """Record a problem that makes the GPU degraded (a lost GPU stays lost)."""
        if self.status == 'ok':
            self.status = 'degraded'
        self._raise_action(action)
        self.note(reason, code)

    def lose(self, reason, action='reset', code='gpu_lost'):
        """The GPU stopped answering (NVML_ERROR_GPU_IS_LOST or equivalent)."""
        self.status = 'lost'
        self._raise_action(action)
        self.note(reason, code)

    def note(self, reason, code=None):
        """Record a finding (or a reading that failed) without changing the status."""
        if reason and reason not in self.reasons:
            self.reasons.append(reason)
        if code and code not in self.codes:
            self.codes.append(code)

    def to_dict(self):
        return {'status': self.status, 'recommended_action': self.recommended_action, 'reasons': list(self.reasons)}


class XidEvent(_Record):
    """One Xid error the driver reported for a GPU (kernel log or NVML event), classified by core/xid.py.

    ``time``: epoch seconds (None when unknown); ``code``: the Xid number; ``pid`` and ``name``: the process
    the kernel line names (None when it names none: NVML events never do); ``pci_bus_id``: as the line gives
    it (``0000:3b:00``); ``message``: the rest of the line (control characters escaped); ``source``: ``kmsg``
    or ``nvml``; ``fault``: ``application``, ``gpu``, ``driver``, ``system`` or ``unknown``; ``action``: the
    remediation step the Xid table calls for (``none``, ``kill_app``, ``reset``, ``drain``, ``reboot``).
    """

    _fields = ('time', 'code', 'pid', 'name', 'pci_bus_id', 'message', 'source', 'fault', 'action')
    _required = ('code',)

    def to_dict(self):
        return dict((name, getattr(self, name)) for name in self._fields)


def xid_class(event):
    """The class an XidEvent is kept in (XID_KEEP): the action of its code; an application Xid without a pid: none."""
    action = event.action if event.action in XID_KEEP else 'none'
    return 'none' if action == 'kill_app' and event.pid is None else action


def _xid_order(event):
    return (event.time is None, event.time or 0)


def _same_xid(events, event):
    """The kept event that ``event`` reports again, or None: the same kernel record (source, stamp, code, pid), or an
    NVML event and a kernel-log record of the same code at most XID_SAME_EVENT_S apart."""
    stamp = getattr(event, 'stamp', None)
    for kept in events:
        if kept.code != event.code:
            continue
        if stamp is not None and (kept.source, getattr(kept, 'stamp', None), kept.pid) == (event.source, stamp, event.pid):
            return kept
        if {kept.source, event.source} == {'nvml', 'kmsg'} and kept.time is not None and event.time is not None \
                and abs(kept.time - event.time) <= XID_SAME_EVENT_S:
            return kept
    return None


def keep_xid_event(events, counts, event):
    """Add ``event`` to ``events`` (one GPU's kept XidEvents, oldest first) by the rule of XID_KEEP, and count it in
    ``counts`` ({code: n}; None: not counted).  Returns ``same`` when it reports a kept event again (one event: the
    kernel-log record stays, as it names the pid and carries the kernel's stamp), ``kept``, or ``dropped`` (counted,
    but the newer events of its class keep their places).  At most MAX_XID_EVENTS + 1 events are looked at."""
    same = _same_xid(events, event)
    if same is not None:
        if same.source != 'nvml' or event.source == 'nvml':
            return 'same'
        del events[[id(kept) for kept in events].index(id(same))]
    elif counts is not None and (event.code in counts or len(counts) < MAX_XID_CODES):
        counts[event.code] = counts.get(event.code, 0) + 1
    order = _xid_order(event)
    at = len(events)
    while at and _xid_order(events[at - 1]) > order:
        at -= 1
    events.insert(at, event)
    cls = xid_class(event)
    mine = [i for i, kept in enumerate(events) if xid_class(kept) == cls]
    if len(mine) > XID_KEEP[cls] and events.pop(mine[0]) is event and same is None:
        return 'dropped'
    return 'same' if same is not None else 'kept'


class DriverProcess(_Record):
    """A process as the driver lists it on one GPU (compute, graphics and MPS lists merged per pid).

    ``util_pct``: SM utilization (percent) from the driver's per-process samples; None when the
    driver has no per-process figure (call not supported, no permission, error). ``name``: the
    process name as the driver reports it (amdsmi, ioreg); None when it reports none.
    ``system_mib``: system memory (GTT) the process's GPU buffers use, MiB (amdgpu, xe, i915); None
    when unknown.  ``mig``: the MIG device the driver lists it on, as MigDevice.ref() gives it (from NVML's
    per-process GPU and compute instance ids, or a MIG device handle's process list); None when it runs
    on no MIG device.
    """

    _fields = ('pid', 'used_mib', 'types', 'util_pct', 'name', 'system_mib', 'mig')
    _required = ('pid',)
    _factories = {'types': list}

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


def add_driver_process(processes, pid, used_mib, ptype):
    """Add a driver's list entry to ``processes`` (DriverProcess), merged with an entry of the same pid."""
    for proc in processes:
        if proc.pid == pid:
            proc.merge(used_mib, ptype)
            return proc
    proc = DriverProcess(pid=int(pid), used_mib=used_mib, types=[ptype] if ptype else [])
    processes.append(proc)
    return proc


class MigDevice(_Record):
    """One MIG device of a board in MIG mode: a GPU instance and one of its compute instances.

    ``index``: the MIG device index on its board (nvmlDeviceGetMigDeviceHandleByIndex); ``profile``: the
    GPU instance profile as the device name gives it (``3g.71gb``); memory in MiB from the MIG device's own
    memory info (never added to the board's: the board's figure already holds it); ``driver_processes``:
    its process list (DriverProcess); ``processes_complete``: False when that list could not be read.
    ``placement`` ({start, size} in memory slices), ``gi_profile_id`` and ``ci_profile_id`` describe the
    layout a MIG-aware reset recreates; None when the driver does not tell.
    """

    _fields = ('index', 'gpu_instance_id', 'compute_instance_id', 'profile', 'uuid', 'memory_total_mib',
               'memory_used_mib', 'memory_free_mib', 'orphaned_mib', 'driver_processes', 'processes_complete',
               'placement', 'gi_profile_id', 'ci_profile_id', 'parent_index')
    _required = ('index',)
    _defaults = {'processes_complete': True}
    _factories = {'driver_processes': list}

    @property
    def pids(self):
        return sorted(p.pid for p in self.driver_processes)

    def add_driver_process(self, pid, used_mib, ptype):
        return add_driver_process(self.driver_processes, pid, used_mib, ptype)

    @property
    def unit(self):
        """How policy rules and selectors name it: ``GPU:GI`` (``GPU:GI:CI`` for a compute instance other than 0)."""
        return MigUnit.of(self.parent_index, self.gpu_instance_id, self.compute_instance_id)

    def ref(self):
        """What a process on it carries as ``mig``."""
        return {'gpu_instance_id': self.gpu_instance_id, 'compute_instance_id': self.compute_instance_id, 'uuid': self.uuid}

    def to_dict(self):
        return {
            'index': self.index,
            'gpu_instance_id': self.gpu_instance_id,
            'compute_instance_id': self.compute_instance_id,
            'profile': self.profile,
            'uuid': self.uuid,
            'placement': dict(self.placement) if self.placement is not None else None,
            'memory_total_mib': self.memory_total_mib,
            'memory_used_mib': self.memory_used_mib,
            'memory_free_mib': self.memory_free_mib,
            'orphaned_mib': self.orphaned_mib,
            'processes': self.pids,
        }


# A MIG device named by its board's host-wide index and its GPU instance id (and compute instance id): 0:1, 0:1:0
MIG_FORM = re.compile(r'^([0-9]+):([0-9]+)(?::([0-9]+))?$')


def mig_devices_named(dev, text):
    """The MigDevices of board ``dev`` that ``text`` names (a ``MIG-`` UUID or ``GPU:GI[:CI]``; ``GPU:GI`` names every
    compute instance of the GPU instance), or None when it names no MIG device (an index or a board UUID), or [] when
    it names one this board lacks.  The gpu_kill selector and the policy's ``gpus`` keys both mean this."""
    form = MIG_FORM.match(text)
    if form:
        if dev.index != int(form.group(1)):
            return []
        gi, ci = int(form.group(2)), form.group(3)
        return [m for m in getattr(dev, 'mig_devices', None) or ()
                if m.gpu_instance_id == gi and (ci is None or m.compute_instance_id == int(ci))]
    if text.lower().startswith('mig-'):
        return [m for m in getattr(dev, 'mig_devices', None) or () if m.uuid is not None and m.uuid.lower() == text.lower()]
    return None


def gpu_units(proc):
    """What a GpuProcess holds as policy rules count GPUs (docs/policy.md, MIG): each GPU index, except that on a
    board in MIG mode it holds the MIG device the driver lists it on (a MigUnit, ``GPU:GI``) instead."""
    mig = getattr(proc, 'mig_by_gpu', None) or {}
    return [mig[g].unit if g in mig else g for g in proc.gpu_indexes or ()]


def unit_gpu(unit):
    """The host-wide GPU index of a unit of gpu_units()."""
    return unit.gpu if isinstance(unit, MigUnit) else unit


class MigUnit(str):
    """A MIG device as a policy unit: the text ``GPU:GI`` (or ``GPU:GI:CI``), ordered among plain GPU indexes
    (ints) by (GPU, GI, CI), a board before its instances.  A str, so violations serialise as they did."""

    @classmethod
    def of(cls, gpu, gi, ci):
        unit = cls('%s:%s' % (gpu, gi) if not ci else '%s:%s:%s' % (gpu, gi, ci))
        unit.order = (int(gpu) if gpu is not None else -1, int(gi or 0), int(ci or 0))
        unit.gpu = gpu
        return unit

    @staticmethod
    def _key(value):
        return value.order if isinstance(value, MigUnit) else (int(value), -1, -1)

    def __lt__(self, other):
        return self._key(self) < self._key(other)

    def __gt__(self, other):
        return self._key(self) > self._key(other)

    def __le__(self, other):
        return self._key(self) <= self._key(other)

    def __ge__(self, other):
        return self._key(self) >= self._key(other)

    __hash__ = str.__hash__


class Device(_Record):
    """One GPU as read from its vendor library.  ``index`` is assigned by the snapshot.

    ``memory_reserved_mib``: memory the driver/firmware sets aside; known only from NVML MemoryInfo
    v2.  memory_used_mib never includes it when it is known. ``processes_complete``: False when a
    process list could not be read (no permission, lost GPU, error): the pids in driver_processes
    are then incomplete and orphaned memory cannot be computed.  ``mig_mode``: True/False, None when
    the driver cannot tell.  ``mig_devices``: the MigDevices of a board in MIG mode ([] when it has
    none), None when MIG is off or unknown.  ``xid_events``: the Xid events kept by the rule of XID_KEEP
    (add_xid_event); ``xid_counts``: {code: n} of every Xid event read, kept or not (not a fact).
    """

    _fields = ('vendor', 'vendor_index', 'index', 'uuid', 'name', 'pci_bus_id', 'minor',
               'memory_total_mib', 'memory_used_mib', 'memory_free_mib', 'memory_reserved_mib',
               'memory_api', 'utilization_pct', 'memory_utilization_pct', 'temperature_c',
               'power_w', 'power_limit_w', 'fan_pct', 'persistence_mode', 'mig_mode',
               'ecc_uncorrected_volatile', 'orphaned_mib', 'health', 'driver_processes',
               'processes_complete', 'errors', 'xid_events', 'recovery_action', 'mig_devices', 'xid_counts')
    _required = ('vendor', 'vendor_index')
    _defaults = {'processes_complete': True}
    _factories = {'health': Health, 'driver_processes': list, 'errors': list}

    @property
    def key(self):
        """How files kept across reads name the GPU (the remediation ladder's state and reboot flag, the metrics):
        its UUID, else its PCI bus id, else ``index:N`` (a lost GPU answers neither)."""
        return self.uuid or self.pci_bus_id or 'index:%s' % self.index

    def add_xid_event(self, event):
        """Keep ``event`` (an XidEvent) by the rule of XID_KEEP (``xid_events``, oldest first) and count it
        (``xid_counts``).  ``xid_events`` stays None until some source could tell (None: nothing could be read)."""
        if self.xid_events is None:
            self.xid_events = []
        if self.xid_counts is None:
            self.xid_counts = {}
        return keep_xid_event(self.xid_events, self.xid_counts, event)

    def add_xid_events(self, events, counts):
        """Add what one read of the kernel log kept for this GPU: its events (each by add_xid_event's rule) and
        ``counts`` ({code: n}: every event read, kept or not; one that reports a kept event again counts once)."""
        if self.xid_events is None:
            self.xid_events = []
        if self.xid_counts is None:
            self.xid_counts = {}
        counts = dict(counts)
        for event in events:
            if keep_xid_event(self.xid_events, None, event) == 'same':
                counts[event.code] = counts.get(event.code, 1) - 1
        for code, number in counts.items():
            if number > 0 and (code in self.xid_counts or len(self.xid_counts) < MAX_XID_CODES):
                self.xid_counts[code] = self.xid_counts.get(code, 0) + number

    def xid_code_counts(self):
        """{code: n}: the Xid events of each code read for this GPU (``xid_counts``), and at least as many as
        ``xid_events`` keeps of it (a list set without counts); {} when no source could tell."""
        counts = dict(self.xid_counts or {})
        kept = {}
        for event in self.xid_events or ():
            kept[event.code] = kept.get(event.code, 0) + 1
        for code, number in kept.items():
            counts[code] = max(counts.get(code, 0), number)
        return counts

    def add_driver_process(self, pid, used_mib, ptype):
        return add_driver_process(self.driver_processes, pid, used_mib, ptype)

    def reading_failed(self, what, error):
        """Record a reading that failed (other than 'not supported'): an error and a health note."""
        text = 'could not read %s: %s' % (what, error)
        self.errors.append(text)
        self.health.note(text, 'reading_failed')

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
        On a board in MIG mode each MIG device's orphaned memory is computed the same way from its own figures.
        """
        lost = self.health.status == 'lost'
        for mig in self.mig_devices or ():
            mig.orphaned_mib = None if lost else unattributed_mib(self.vendor, mig.memory_used_mib, mig.driver_processes,
                                                                  mig.processes_complete)
        self.orphaned_mib = None if lost else unattributed_mib(self.vendor, self.memory_used_mib, self.driver_processes,
                                                               self.processes_complete)
        return self.orphaned_mib

    def mig_device(self, uuid=None, gpu_instance_id=None, compute_instance_id=None):
        """This board's MigDevice with this UUID, or with these GPU (and compute, when given) instance ids; or None."""
        for mig in self.mig_devices or ():
            if uuid is not None:
                if mig.uuid is not None and mig.uuid.lower() == str(uuid).lower():
                    return mig
            elif mig.gpu_instance_id == gpu_instance_id and compute_instance_id in (None, mig.compute_instance_id):
                return mig
        return None

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
            'xid_events': [event.to_dict() for event in self.xid_events] if self.xid_events is not None else None,
            'recovery_action': self.recovery_action,
            'health_reasons': list(self.health.codes),
            'mig_mode': self.mig_mode,
            'mig_devices': [mig.to_dict() for mig in self.mig_devices] if self.mig_devices is not None else None,
        }


class ContainerInfo(_Record):
    """Container identity read from /proc/PID/cgroup."""

    _fields = ('id', 'runtime', 'pod_uid')

    def to_dict(self):
        return {'id': self.id, 'runtime': self.runtime, 'pod_uid': self.pod_uid}


class ProcessRecord(_Record):
    """What this host's process table says about one pid (``status`` ``not_found`` when absent).

    ``device_paths``: GPU device files this pid holds open; None when its fds could not be read.
    ``identity``: the kernel-vouched identity.Identity it was read with (``uid`` and ``starttime``
    come from it); None when unknown.
    """

    _fields = ('pid', 'status', 'user', 'uid', 'name', 'cmdline', 'create_time', 'starttime',
               'ppid', 'exe', 'container', 'slurm_job', 'device_paths', 'identity')
    _required = ('pid',)
    _defaults = {'status': NOT_FOUND}

    @property
    def found(self):
        return self.status != NOT_FOUND


class GpuProcess(_Record):
    """A process the driver lists on one or more GPUs, joined with the host's process table.

    ``util_pct``: highest per-process utilization over its GPUs; None as soon as one GPU cannot
    tell.  ``mig_by_gpu``: GPU index -> the MigDevice it runs on there (only boards in MIG mode).
    """

    _fields = ('pid', 'gpu_indexes', 'used_mib', 'used_mib_by_gpu', 'types', 'util_pct',
               'util_pct_by_gpu', 'user', 'uid', 'name', 'cmdline', 'create_time', 'starttime',
               'status', 'container', 'slurm_job', 'ppid', 'exe', 'device_paths', 'identity', 'mig_by_gpu')
    _required = ('pid',)
    _defaults = {'status': NOT_FOUND}
    _factories = {'gpu_indexes': list, 'used_mib_by_gpu': dict, 'types': list, 'util_pct_by_gpu': dict, 'mig_by_gpu': dict}

    @property
    def mig(self):
        """The MigDevice it runs on (the first by GPU index when several), or None."""
        for index in sorted(self.mig_by_gpu):
            return self.mig_by_gpu[index]
        return None

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

    def add_gpu(self, gpu_index, used_mib, types, util_pct=None, mig=None):
        if mig is not None:
            self.mig_by_gpu[gpu_index] = mig
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
                     'container', 'slurm_job', 'device_paths', 'identity'):
            value = getattr(record, name)   # copy.copy of None, a number or a text is that value: skip its machinery
            setattr(self, name, value if value is None or value.__class__ in (int, str, float) else copy.copy(value))

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
            'mig': self.mig.ref() if self.mig is not None else None,
        }


class Holder(_Record):
    """A process holding a GPU device file open that the driver does not list."""

    _fields = ('pid', 'devices', 'gpu_indexes', 'user', 'uid', 'name', 'cmdline', 'create_time',
               'starttime', 'status', 'ppid', 'exe', 'container', 'slurm_job', 'identity')
    _required = ('pid',)
    _factories = {'devices': list, 'gpu_indexes': list}

    @classmethod
    def from_record(cls, record, devices):
        return cls(pid=record.pid, devices=sorted(devices), user=record.user, uid=record.uid, name=record.name,
                   cmdline=copy.copy(record.cmdline), create_time=record.create_time, starttime=record.starttime,
                   status=record.status, ppid=record.ppid, exe=record.exe, container=copy.copy(record.container),
                   slurm_job=record.slurm_job, identity=record.identity)

    def to_dict(self):
        return {
            'pid': self.pid,
            'user': self.user,
            'name': self.name,
            'cmdline': list(self.cmdline) if self.cmdline is not None else None,
            'devices': list(self.devices),
        }
