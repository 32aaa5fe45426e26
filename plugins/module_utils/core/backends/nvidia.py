# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""NVIDIA backend over NVML through nvidia-ml-py (the ``pynvml`` module).

Version differences handled here:

* Memory: ``nvmlDeviceGetMemoryInfo_v2`` (driver >= 510) reports the driver/firmware reserve
  separately and its ``used`` excludes it; older drivers only have v1 (FunctionNotFound), whose
  ``used`` is what the driver counted as allocated.  ``memory_used_mib`` is v2 ``used`` when
  available, else v1 ``used``.
* Processes: the ``_v3`` arrays are read through ctypes (nvml_arrays: no Python object per entry); without
  that symbol, the unversioned ``nvmlDeviceGet*RunningProcesses`` wrappers call ``_v3`` and raise
  ``NVMLLibraryMismatchError`` (not an NVMLError) when the driver lacks it; we then use ``_v2``.
* ``usedGpuMemory`` is ``None`` when NVML says NVML_VALUE_NOT_AVAILABLE (WDDM, MIG without
  privilege); it stays ``None``.
* Per-process utilization: ``nvmlDeviceGetProcessUtilization(handle, lastSeenTimeStamp)`` returns
  the samples newer than ``lastSeenTimeStamp`` (microseconds); we ask for the last
  ``PROCESS_UTIL_WINDOW_S`` seconds and keep each pid's highest SM figure.  The driver only keeps
  samples of processes that did something, so NVML_ERROR_NOT_FOUND ("no sample newer than that")
  and a listed pid without a sample both mean 0 %.  Not supported, no permission or any other
  error leaves every listed process's figure unknown (``None``).
"""

from __future__ import annotations

import ctypes
import os
import time
from .. import kmod, watchdog, xid as xid_mod
from . import nvidia_mig, nvml_arrays
from .nvidia_mig import nvml_text as _text
from ..model import RECOVERY_ACTIONS, BackendStatus, Device, bytes_to_mib
from .base import FAIL, NOT_EXPOSED, PASS, REBOOT_ACTIONS, WARN, Backend, error_text, last_line, recovery_action

try:
    import pynvml
    PYNVML_IMPORT_ERROR = None
except Exception:  # pylint: disable=broad-except
    # only on this failure: not at every load
    import traceback  # pylint: disable=import-outside-toplevel
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()

NOT_INSTALLED = 'nvidia-ml-py (pynvml) is not installed'

# How far back the per-process utilization samples are read (seconds).
PROCESS_UTIL_WINDOW_S = 10.0

_PROCESS_LISTS = (
    ('compute', 'nvmlDeviceGetComputeRunningProcesses'),
    ('graphics', 'nvmlDeviceGetGraphicsRunningProcesses'),
    ('mps', 'nvmlDeviceGetMPSComputeRunningProcesses'),
)

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values -> (our recommended action, why); the names are model.RECOVERY_ACTIONS.
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
_RECOVERY_ACTIONS = {
    1: ('reset', 'the driver asks for a GPU reset'),
    2: ('reboot', 'the driver asks for a node reboot'),
    3: ('drain', 'the driver asks to drain the GPU (P2P)'),
    4: ('drain', 'the driver asks to drain and then reset the GPU'),
    5: ('none', 'the driver asks to recover the IMEX domain'),
    6: ('reset', 'the driver asks for a bus reset'),
    7: ('reboot', 'the driver asks for a system reboot'),
}
# Events a snapshot listens for: critical Xid errors and double-bit ECC errors (pynvml's values).
EVENT_XID = 0x8
EVENT_DBE = 0x2
# nvmlClocksEventReasons bits worth a health note (the others are normal: idle, applications clocks, power cap)
_THROTTLE_REASONS = ((0x8, 'hw_slowdown'), (0x40, 'hw_thermal_slowdown'), (0x80, 'hw_power_brake'),
                     (0x20, 'sw_thermal_slowdown'))


# Readings that older drivers do not have (their absence is no failed reading): see _call().
_OPTIONAL_CALLS = ('nvmlDeviceGetRetiredPagesPendingStatus', 'nvmlDeviceGetCurrentClocksEventReasons',
                   'nvmlDeviceGetCurrentClocksThrottleReasons')


class _Never(Exception):
    """Stand-in for an exception class the loaded pynvml does not define (never raised)."""


class _GpuLost(Exception):
    """Internal: the GPU answered GPU_IS_LOST; stop reading it."""


class NvidiaBackend(Backend):
    """NVML backend.  ``nvml`` injects the pynvml module (tests); default: the imported pynvml."""

    name = 'nvidia'
    label = 'NVIDIA'
    reset_check_names = ('mig', 'nvlink', 'fabric_manager', 'persistence_mode', 'nvml_session', 'recovery_action',
                         'kernel_modules')
    xid_log = True
    reset_tools = ('nvidia-smi',)

    def __init__(self, nvml=None, import_error=None):
        super(NvidiaBackend, self).__init__()
        if nvml is None:
            nvml = pynvml
            import_error = PYNVML_IMPORT_ERROR
        self.nvml = watchdog.traced(nvml)   # in a watchdog child, each call reports itself first
        self.import_error = import_error
        self._initialized = False
        self.event_timeout_ms = 0    # how long devices() waits for Xid events (0: what is pending)
        self._mem_v2 = None          # None: not tried yet, True/False once known
        self._proc_v2 = {}           # list kind -> True once the unversioned (_v3) call is missing
        self._arrays = {}            # NVML function -> its nvml_arrays.ArrayReader, or False: pynvml's wrapper
        if nvml is not None:
            self.NVMLError = getattr(nvml, 'NVMLError', _Never)
            self.GpuIsLost = getattr(nvml, 'NVMLError_GpuIsLost', _Never)
            self.NotSupported = getattr(nvml, 'NVMLError_NotSupported', _Never)
            self.NoPermission = getattr(nvml, 'NVMLError_NoPermission', _Never)
            self.FunctionNotFound = getattr(nvml, 'NVMLError_FunctionNotFound', _Never)
            self.ResetRequired = getattr(nvml, 'NVMLError_ResetRequired', _Never)
            self.LibraryMismatch = getattr(nvml, 'NVMLLibraryMismatchError', _Never)
            self.ArgumentVersionMismatch = getattr(nvml, 'NVMLError_ArgumentVersionMismatch', _Never)
            self.NotFound = getattr(nvml, 'NVMLError_NotFound', _Never)

    # ------------------------------------------------------------------ life cycle
    def probe(self):
        if self.nvml is None:
            self.status = BackendStatus(name=self.name, available=False, error=NOT_INSTALLED)
            return self.status
        nvml = self.nvml
        try:
            nvml.nvmlInit()
            self._initialized = True
        except Exception as exc:  # pylint: disable=broad-except
            return self._unavailable(self._init_failure(exc))
        version = None
        try:
            version = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # pylint: disable=broad-except
            version = None
        self.status = BackendStatus(name=self.name, available=True, version=version, error=None)
        return self.status

    def _init_failure(self, exc):
        """Why nvmlInit() failed, in words."""
        known = (
            ('NVMLError_LibraryNotFound', 'the NVIDIA driver library libnvidia-ml.so.1 was not found (no NVIDIA driver installed)'),
            ('NVMLError_DriverNotLoaded', 'the NVIDIA kernel driver is not loaded'),
            ('NVMLError_LibRmVersionMismatch',
             'NVML and the loaded NVIDIA kernel driver have different versions (reboot or reload the driver)'),
            ('NVMLError_NoPermission', 'no permission to open the NVIDIA devices'),
        )
        classes = set(cls.__name__ for cls in type(exc).__mro__)
        for name, reason in known:
            if name in classes:
                return reason
        return 'NVML initialisation failed: %s' % error_text(exc)

    def _unavailable(self, reason):
        self.status = BackendStatus(name=self.name, available=False, error=reason)
        return self.status

    def close(self):
        if self._initialized:
            self._initialized = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # pylint: disable=broad-except
                pass

    # ------------------------------------------------------------------ reading
    def devices(self):
        if not self._initialized:
            return []
        nvml = self.nvml
        count = nvml.nvmlDeviceGetCount()
        result = []
        handles = {}
        for i in range(count):
            dev = Device(vendor=self.name, vendor_index=i)
            watchdog.where(self.name, i)
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except self.GpuIsLost as exc:
                self._mark_lost(dev, exc)
                result.append(dev)
                continue
            except Exception as exc:  # pylint: disable=broad-except
                dev.processes_complete = False
                dev.errors.append('could not open the device: %s' % error_text(exc))
                dev.health.degrade('NVML cannot open GPU %d: %s' % (i, error_text(exc)))
                result.append(dev)
                continue
            try:
                self._read_device(dev, handle)
                handles[i] = (dev, handle)
            except _GpuLost as lost:
                self._mark_lost(dev, lost.args[0])
            except Exception as exc:  # pylint: disable=broad-except
                dev.processes_complete = False
                dev.reading_failed('the device', error_text(exc))
            result.append(dev)
        watchdog.where(self.name)
        self.read_events(handles, self.event_timeout_ms)
        return result

    def _mark_lost(self, dev, exc):
        dev.processes_complete = False
        dev.driver_processes = []
        for name in ('memory_used_mib', 'memory_free_mib', 'memory_reserved_mib', 'utilization_pct', 'memory_utilization_pct',
                     'temperature_c', 'power_w', 'power_limit_w', 'fan_pct', 'orphaned_mib'):
            setattr(dev, name, None)
        dev.health.lose('the GPU is lost (NVML: %s): it fell off the bus or stopped responding; reset it, '
                        'and reboot the node if the reset fails' % error_text(exc), action='reset')

    def _call(self, dev, what, func, *args, **kwargs):
        """Call one NVML reading: lost -> _GpuLost, not supported -> None, other errors -> noted, None."""
        try:
            return func(*args, **kwargs)
        except self.GpuIsLost as exc:
            raise _GpuLost(exc)
        except self.NotSupported:
            return None
        except self.FunctionNotFound as exc:
            if getattr(func, '__name__', None) in _OPTIONAL_CALLS:
                return None  # older drivers lack it: no failed reading
            dev.reading_failed(what, error_text(exc))
            return None
        except self.ResetRequired as exc:
            dev.health.degrade('the GPU requires a reset (%s)' % error_text(exc), action='reset', code='reset_required')
            return None
        except self.NoPermission as exc:
            if dev.mig_mode:
                dev.health.note(nvidia_mig.AGGREGATE_NOTE)   # the board's aggregates are root's only in MIG mode
            else:
                dev.reading_failed(what, error_text(exc))
            return None
        except self.NVMLError as exc:
            dev.reading_failed(what, error_text(exc))
            return None

    def _read_device(self, dev, handle):
        nvml = self.nvml
        call = self._call
        dev.uuid = _text(call(dev, 'the UUID', nvml.nvmlDeviceGetUUID, handle))
        dev.name = _text(call(dev, 'the name', nvml.nvmlDeviceGetName, handle))
        pci = call(dev, 'the PCI info', nvml.nvmlDeviceGetPciInfo, handle)
        if pci is not None:
            dev.pci_bus_id = _text(getattr(pci, 'busId', None))
        dev.minor = call(dev, 'the minor number', nvml.nvmlDeviceGetMinorNumber, handle)
        mig = call(dev, 'the MIG mode', nvml.nvmlDeviceGetMigMode, handle) if hasattr(nvml, 'nvmlDeviceGetMigMode') else None
        dev.mig_mode = None if not mig else mig[0] == getattr(nvml, 'NVML_DEVICE_MIG_ENABLE', 1)

        self._read_memory(dev, handle)

        util = call(dev, 'the utilization', nvml.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            dev.utilization_pct = int(util.gpu)
            dev.memory_utilization_pct = int(util.memory)
        temp = call(dev, 'the temperature', nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, 'NVML_TEMPERATURE_GPU', 0))
        dev.temperature_c = int(temp) if temp is not None else None
        power = call(dev, 'the power draw', nvml.nvmlDeviceGetPowerUsage, handle)
        dev.power_w = round(power / 1000.0, 3) if power is not None else None
        limit = call(dev, 'the power limit', nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        dev.power_limit_w = round(limit / 1000.0, 3) if limit is not None else None
        fan = call(dev, 'the fan speed', nvml.nvmlDeviceGetFanSpeed, handle) if hasattr(nvml, 'nvmlDeviceGetFanSpeed') else None
        dev.fan_pct = int(fan) if fan is not None else None
        pers = call(dev, 'the persistence mode', nvml.nvmlDeviceGetPersistenceMode, handle)
        dev.persistence_mode = None if pers is None else pers == getattr(nvml, 'NVML_FEATURE_ENABLED', 1)

        self._read_health(dev, handle)
        self._read_processes(dev, handle)
        self._read_process_utilization(dev, handle)
        nvidia_mig.read_mig_devices(self, dev, handle)

    def _read_memory(self, dev, handle):
        nvml = self.nvml
        mem = None
        version = getattr(nvml, 'nvmlMemory_v2', None)
        if self._mem_v2 is not False and version is not None:
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                self._mem_v2 = True
                dev.memory_api = 'v2'
            except (self.FunctionNotFound, self.LibraryMismatch, self.ArgumentVersionMismatch, TypeError):
                self._mem_v2 = False
                mem = None
            except self.GpuIsLost as exc:
                raise _GpuLost(exc)
            except self.NVMLError:
                mem = None  # retry with v1 below, which reports the error if it also fails
        if mem is None:
            mem = self._call(dev, 'the memory usage', nvml.nvmlDeviceGetMemoryInfo, handle)
            if mem is None:
                return
            dev.memory_api = 'v1'
        dev.memory_total_mib = bytes_to_mib(mem.total)
        dev.memory_free_mib = bytes_to_mib(mem.free)
        dev.memory_used_mib = bytes_to_mib(mem.used)
        if dev.memory_api == 'v2':
            dev.memory_reserved_mib = bytes_to_mib(getattr(mem, 'reserved', None))

    def _read_health(self, dev, handle):
        nvml = self.nvml
        ecc = self._call(dev, 'the ECC error counters', nvml.nvmlDeviceGetTotalEccErrors, handle,
                         getattr(nvml, 'NVML_MEMORY_ERROR_TYPE_UNCORRECTED', 1), getattr(nvml, 'NVML_VOLATILE_ECC', 0))
        dev.ecc_uncorrected_volatile = ecc
        if ecc:
            dev.health.degrade('%d uncorrected volatile ECC error(s) since the last driver load: reset the GPU' % ecc,
                               action='reset', code='ecc_uncorrected')
        rows = None
        if hasattr(nvml, 'nvmlDeviceGetRemappedRows'):
            rows = self._call(dev, 'the remapped rows', nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            _corr, unc, pending, failure = rows
            if failure:
                dev.health.degrade('row remapping failed (%d uncorrectable rows remapped): drain the GPU and replace it' % unc,
                                   action='drain', code='remapped_rows_failure')
            elif pending:
                dev.health.degrade('row remapping is pending (%d uncorrectable rows): reset the GPU to apply it' % unc,
                                   action='reset', code='remapped_rows_pending')
        self._read_recovery_action(dev, handle)
        if hasattr(nvml, 'nvmlDeviceGetRetiredPagesPendingStatus') and rows is None:
            # before Ampere: dynamic page retirement instead of row remapping
            pending = self._call(dev, 'the retired pages', nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            if pending:
                dev.health.degrade('retired pages are pending: reset the GPU (or reload the driver) to retire them',
                                   action='reset', code='retired_pages_pending')
        reasons_func = getattr(nvml, 'nvmlDeviceGetCurrentClocksEventReasons', None) or \
            getattr(nvml, 'nvmlDeviceGetCurrentClocksThrottleReasons', None)
        if reasons_func is not None:
            bits = self._call(dev, 'the clock event reasons', reasons_func, handle)
            for bit, name in _THROTTLE_REASONS:
                if bits and int(bits) & bit:
                    dev.health.note('the GPU clocks are held down (%s)' % name.replace('_', ' '), 'throttle_%s' % name)

    def _read_recovery_action(self, dev, handle):
        """``dev.recovery_action`` from the driver's field (R550+); None where the driver cannot tell."""
        nvml = self.nvml
        if not hasattr(nvml, 'nvmlDeviceGetFieldValues'):
            return
        field_id = getattr(nvml, 'NVML_FI_DEV_GET_GPU_RECOVERY_ACTION', NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
        try:
            value = nvml.nvmlDeviceGetFieldValues(handle, [field_id])[0]
        except self.GpuIsLost as exc:
            raise _GpuLost(exc)
        except Exception:  # pylint: disable=broad-except
            return  # an optional field: older drivers do not know it
        if int(value.nvmlReturn) != 0:
            return
        number = int(value.value.uiVal)
        if not 0 <= number < len(RECOVERY_ACTIONS):
            dev.health.note('the driver reports an unknown recovery action (%d)' % number, 'recovery_action_unknown')
            return
        dev.recovery_action = RECOVERY_ACTIONS[number]
        action = _RECOVERY_ACTIONS.get(number)
        if action is None:
            return
        code = 'recovery_action_%s' % dev.recovery_action
        if action[0] == 'none':
            dev.health.note(action[1], code)
        else:
            dev.health.degrade(action[1], action=action[0], code=code)

    def read_events(self, handles, timeout_ms=0):
        """Xid (and double-bit ECC) events that the driver delivers to an event set within ``timeout_ms``.

        ``handles``: {vendor_index: (Device, handle)}.  The driver delivers only events that occur while the
        set is registered, so a snapshot (timeout 0) sees what arrives while it reads; the kernel log is the
        history.  A device whose registration worked gets ``xid_events`` [] (the source could tell).
        """
        nvml = self.nvml
        if not hasattr(nvml, 'nvmlEventSetCreate') or not handles:
            return
        try:
            event_set = nvml.nvmlEventSetCreate()
        except Exception:  # pylint: disable=broad-except
            return
        by_handle = {}
        try:
            for _index, (dev, handle) in sorted(handles.items()):
                try:
                    supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                    wanted = int(supported) & (EVENT_XID | EVENT_DBE)
                    if not wanted:
                        continue
                    nvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
                except Exception:  # pylint: disable=broad-except
                    continue  # not supported (or lost): this source cannot tell for this GPU
                by_handle[ctypes.addressof(handle.contents) if hasattr(handle, 'contents') else id(handle)] = dev
                if dev.xid_events is None:
                    dev.xid_events = []
            deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
            for _n in range(1024):  # bounded: a storm of events cannot keep a snapshot here
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, left_ms)
                except Exception:  # pylint: disable=broad-except
                    break  # NVML_ERROR_TIMEOUT: nothing (more) pending
                handle = data.device
                key = ctypes.addressof(handle.contents) if hasattr(handle, 'contents') and handle else id(handle)
                dev = by_handle.get(key)
                if dev is None:
                    continue
                code = int(data.eventData) if int(data.eventType) & EVENT_XID else 48  # a DBE is what Xid 48 reports
                dev.add_xid_event(xid_mod.make_event(code, 'nvml', time_s=round(time.time(), 3), pci_bus_id=dev.pci_bus_id,
                                                     message='NVML event 0x%x' % int(data.eventType)))
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:  # pylint: disable=broad-except
                pass

    def _array(self, function, type_name, fields, call=None):
        """The ctypes reader of ``function`` (nvml_arrays), or False when this binding or driver lacks it.  A
        watchdog child reports ``call`` (default ``function``): the name of pynvml's call it stands for."""
        reader = self._arrays.get(function)
        if reader is None:
            reader = self._arrays[function] = nvml_arrays.ArrayReader.of(self.nvml, function, type_name, fields) or False
        if reader:
            watchdog.progress(call or function)
        return reader

    def _list(self, kind, base_name, handle):
        """One process list as nvml_arrays rows: the _v3 array through ctypes, else pynvml's unversioned (_v3)
        wrapper, falling back to _v2 once it is missing."""
        if not self._proc_v2.get(kind):
            reader = self._array(base_name + '_v3', nvml_arrays.PROCESS_TYPE, nvml_arrays.PROCESS_FIELDS, base_name)
            try:   # a driver may have the _v3 symbol and answer FUNCTION_NOT_FOUND (pynvml's wrapper: LibraryMismatch)
                return (nvml_arrays.running_processes(reader, handle) if reader else
                        nvml_arrays.process_rows(getattr(self.nvml, base_name)(handle)))
            except (self.LibraryMismatch, self.FunctionNotFound, AttributeError):
                self._proc_v2[kind] = True
        return nvml_arrays.process_rows(getattr(self.nvml, base_name + '_v2')(handle))

    def _read_processes(self, dev, handle):
        self.read_process_lists(dev, handle)

    def read_process_lists(self, dev, handle, into=None, what=''):
        """The compute, graphics and MPS lists of ``handle`` into ``into`` (the Device ``dev``, or one of its
        MigDevices: ``what`` then names it in the errors, which go to ``dev``)."""
        into = dev if into is None else into
        suffix = ' %s' % what if what else ''
        for kind, base_name in _PROCESS_LISTS:
            try:
                procs = self._list(kind, base_name, handle)
            except self.GpuIsLost as exc:
                raise _GpuLost(exc)
            except (self.NotSupported, AttributeError):
                continue
            except self.FunctionNotFound:
                if kind == 'mps':
                    continue  # old drivers have no MPS list at all
                into.processes_complete = False
                dev.reading_failed('the %s process list%s' % (kind, suffix), 'not provided by this driver')
                continue
            except self.NoPermission as exc:
                into.processes_complete = False
                if dev.mig_mode and into is dev:
                    dev.health.note(nvidia_mig.AGGREGATE_NOTE)   # read from the MIG devices instead
                else:
                    dev.reading_failed('the %s process list%s' % (kind, suffix), '%s (run as root to see processes)' % error_text(exc))
                continue
            except self.NVMLError as exc:
                into.processes_complete = False
                dev.reading_failed('the %s process list%s' % (kind, suffix), error_text(exc))
                continue
            for pid, used, gpu_instance, compute_instance in procs:
                entry = into.add_driver_process(pid, bytes_to_mib(used), kind)
                if gpu_instance is not None and gpu_instance != nvidia_mig.NO_INSTANCE and entry.mig is None:
                    entry.mig = nvidia_mig.instance_ref(gpu_instance, compute_instance)

    def _read_process_utilization(self, dev, handle):
        """Fill ``util_pct`` of the listed processes from the driver's per-process samples."""
        func = getattr(self.nvml, 'nvmlDeviceGetProcessUtilization', None)
        if func is None or not dev.driver_processes:
            return
        since_us = int(max(0.0, time.time() - PROCESS_UTIL_WINDOW_S) * 1e6)
        reader = self._array('nvmlDeviceGetProcessUtilization', nvml_arrays.SAMPLE_TYPE, nvml_arrays.SAMPLE_FIELDS)
        try:
            samples = (nvml_arrays.utilization_samples(reader, handle, since_us) if reader else
                       [(int(sample.pid), int(sample.smUtil)) for sample in func(handle, since_us) or []])
        except self.GpuIsLost as exc:
            raise _GpuLost(exc)
        except self.NotFound:
            samples = []  # no process did anything since since_us: every listed one is at 0 %
        except (self.NotSupported, self.FunctionNotFound, self.NoPermission):
            return
        except self.NVMLError as exc:
            dev.errors.append('could not read the per-process utilization: %s' % error_text(exc))
            return
        best = {}
        for pid, sm_util in samples:
            best[pid] = max(best.get(pid, 0), sm_util)
        for proc in dev.driver_processes:
            proc.util_pct = best.get(proc.pid, 0)

    def memory_view(self, vendor_indexes=None):
        """Used memory and listed pids only, of the GPUs asked for, for polling (see Backend.memory_view)."""
        if not self._initialized:
            return {}
        view = {}
        for i in [i for i in range(self.nvml.nvmlDeviceGetCount()) if vendor_indexes is None or i in vendor_indexes]:
            dev = Device(vendor=self.name, vendor_index=i)
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
                self._read_memory(dev, handle)
                self._read_processes(dev, handle)
            except Exception:  # pylint: disable=broad-except
                view[i] = (None, None)  # lost or unreadable: nothing can be confirmed
                continue
            view[i] = (dev.memory_used_mib, set(dev.pids) if dev.processes_complete else None)
        return view

    # ------------------------------------------------------------------ device files and reset (see base.Backend)
    @classmethod
    def device_keys(cls, minor):
        return (('nvidia', minor),)

    @classmethod
    def shared_device_file(cls, path):
        return os.path.basename(path).startswith('nvidia')

    @classmethod
    def reset_checks(cls, item, snapshot, host):
        path = host.tool('nvidia-smi')
        if path:
            item.check('tool', PASS, 'nvidia-smi --gpu-reset (%s)' % path)
        else:
            item.check('tool', FAIL, 'nvidia-smi was not found on PATH or in the sbin directories: install the NVIDIA driver '
                                     'utilities (for example the nvidia-utils package of the installed driver) or add its '
                                     'directory to PATH')
        _check_mig_and_fabric(item, host)
        _check_persistence_and_session(item, host)
        _check_recovery(item)
        _check_kernel_modules(item, snapshot, host)

    @classmethod
    def reset_device(cls, item, host):
        """``nvidia-smi --gpu-reset -i <bus id>``.  "In use by another client" names the kernel references
        left at that moment (kmod) when there are any."""
        rc, text, argv = _nvidia_smi(host, item, '--gpu-reset')
        item.method, item.command, item.output = 'nvidia-smi', argv, text
        if rc == 0:
            return nvidia_mig.recreate_after_reset(item, cls(nvml=host.nvml))
        hint = ''
        low = text.lower()
        if 'in use by another client' in low or 'being used' in low:
            refs = kmod.blocking(kmod.module_refs(host.sys_root))
            if refs:
                hint = ': kernel references keep the driver in use (%s); unload the module or reboot the node' % \
                    '; '.join(r.describe() for r in refs)
            else:
                hint = ': processes or NVML clients still use the GPU; set kill_processes: true, and stop monitoring agents ' \
                       '(stop_services: [nvidia-dcgm, dcgm-exporter, nvidia-persistenced], or auto)'
        elif 'persistence mode' in low:
            hint = ': switch persistence mode off first (nvidia-smi -pm 0 -i %s)' % item.target
        elif 'permission' in low:
            hint = ': run the task with become: true'
        return 'nvidia-smi --gpu-reset failed (rc %d): %s%s' % (rc, last_line(text), hint)

    @classmethod
    def persistence_mode(cls, dev):
        return dev.persistence_mode

    @classmethod
    def persistence_off(cls, item, host, warnings):
        before = item.persistence['before']
        if before is False:
            return None
        rc, text, _argv = _nvidia_smi(host, item, '-pm', '0')
        item.touched = True
        if rc == 0:
            item.persistence['switched_off'] = True
            return None
        if before is None:
            warnings.append('%s: nvidia-smi -pm 0 failed (rc %d: %s); trying the reset anyway' % (item.label, rc, last_line(text)))
            return None
        return 'nvidia-smi -pm 0 failed (rc %d): %s; the reset needs persistence mode off' % (rc, last_line(text))

    @classmethod
    def persistence_restore(cls, item, host):
        if not (item.persistence['switched_off'] and item.persistence['before']):
            return None
        rc, text, _argv = _nvidia_smi(host, item, '-pm', '1')
        item.persistence['restored'] = rc == 0
        if rc == 0 and item.after is not None:
            item.after['persistence_mode'] = True  # read before the restore; nvidia-smi -pm 1 succeeded since
        if rc != 0:
            return 'persistence mode could not be restored (rc %d: %s): run nvidia-smi -pm 1 -i %s' % (rc, last_line(text), item.target)
        return None

    @classmethod
    def drain_on(cls, item, host, warnings):
        if not item.dev.pci_bus_id:
            return super(NvidiaBackend, cls).drain_on(item, host, warnings)
        state, error = drain(item.dev.pci_bus_id, nvml=host.nvml)
        if error is None and state:
            item.drain['detail'] = 'already drained before the reset; left as it was'
            return None
        if error is None:
            item.touched = True
            state, error = drain(item.dev.pci_bus_id, True, nvml=host.nvml)
        if error is not None or not state:
            item.drain['detail'] = 'the driver refused to drain the GPU: %s' % (error or 'the state did not change')
            warnings.append('%s: %s; continuing without it (drain is best effort)' % (item.label, item.drain['detail']))
            return None
        item.drain['enabled'] = True
        item.drain['detail'] = 'drained: new clients cannot open the GPU until the reset is done'
        return None

    @classmethod
    def drain_off(cls, item, host):
        if not item.drain['enabled']:
            return None
        state, error = drain(item.dev.pci_bus_id, False, nvml=host.nvml)
        item.drain['restored'] = error is None and state is False
        if not item.drain['restored']:
            return 'the drain could not be undone (%s): run nvidia-smi drain -p %s -m 0' % (error or 'still drained', item.dev.pci_bus_id)
        return None

    @classmethod
    def session_blocks_reset(cls, host):
        if open_sessions(host.nvml):
            return 'this process holds an NVML session, which would block the reset (a bug: please report it)'
        return None


# ---------------------------------------------------------------------------- reset support
# Used by the reset hooks above.  Each call opens and closes its own short NVML session, because a GPU
# reset needs this process's NVML session gone (open_sessions() must be 0 when nvidia-smi runs).
_FABRIC_STATES = {0: 'not_supported', 1: 'not_started', 2: 'in_progress', 3: 'completed'}


def open_sessions(nvml=None):
    """nvmlInit() calls of this process that no nvmlShutdown() matched yet (pynvml's own count)."""
    nvml = pynvml if nvml is None else nvml
    return int(getattr(nvml, '_nvmlLib_refcount', 0) or 0) if nvml is not None else 0


def _pci_info(nvml, bus_id):
    """An nvmlPciInfo_t naming ``bus_id`` (DDDDDDDD:BB:DD.F), built without opening the device."""
    domain, bus, rest = bus_id.split(':')
    info = nvml.nvmlPciInfo_t()
    info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split('.')[0], 16)
    info.busId = bus_id.encode('ascii')
    return info


def _nvml_reason(backend, exc):
    if isinstance(exc, (backend.FunctionNotFound, AttributeError)):
        return 'not exposed by this driver'
    if isinstance(exc, backend.NotSupported):
        return 'not supported by this GPU or driver'
    if isinstance(exc, backend.NoPermission):
        return 'no permission (needs root)'
    return error_text(exc)


def drain(bus_id, enable=None, nvml=None):
    """Query (``enable`` None) or set the NVML drain state of the GPU at PCI ``bus_id``.

    Returns (state, error): the drain state (True/False) after the call, or None and the reason.
    """
    backend = NvidiaBackend(nvml=nvml)
    if not backend.probe().available:
        return None, backend.status.error
    try:
        info = _pci_info(backend.nvml, bus_id)
        if enable is not None:
            feature = getattr(backend.nvml, 'NVML_FEATURE_ENABLED' if enable else 'NVML_FEATURE_DISABLED', int(bool(enable)))
            backend.nvml.nvmlDeviceModifyDrainState(info, feature)
        return bool(backend.nvml.nvmlDeviceQueryDrainState(info)), None
    except Exception as exc:  # pylint: disable=broad-except
        return None, _nvml_reason(backend, exc)
    finally:
        backend.close()


def reset_constraints(bus_id, nvml=None):
    """What the driver says about NVLink and the NVSwitch fabric of the GPU at ``bus_id``.

    Returns {'nvlink_active': number of active links or None, 'nvlink_error': why unknown,
    'fabric_state': not_supported|not_started|in_progress|completed or None, 'fabric_error'}.
    """
    out = {'nvlink_active': None, 'nvlink_error': None, 'fabric_state': None, 'fabric_error': None}
    backend = NvidiaBackend(nvml=nvml)
    if not backend.probe().available:
        out['nvlink_error'] = out['fabric_error'] = backend.status.error
        return out
    nvml = backend.nvml
    try:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception as exc:  # pylint: disable=broad-except
        out['nvlink_error'] = out['fabric_error'] = 'cannot open the GPU: %s' % _nvml_reason(backend, exc)
        backend.close()
        return out
    try:
        active = 0
        for link in range(int(getattr(nvml, 'NVML_NVLINK_MAX_LINKS', 18))):
            try:
                active += 1 if nvml.nvmlDeviceGetNvLinkState(handle, link) else 0
            except (backend.NotSupported, getattr(nvml, 'NVMLError_InvalidArgument', _Never)):
                break  # no such link: the links are numbered from 0
        out['nvlink_active'] = active
    except Exception as exc:  # pylint: disable=broad-except
        out['nvlink_error'] = _nvml_reason(backend, exc)
    try:
        info = nvml.c_nvmlGpuFabricInfo_t()
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        out['fabric_state'] = _FABRIC_STATES.get(int(info.state), 'unknown (%d)' % int(info.state))
    except Exception as exc:  # pylint: disable=broad-except
        if isinstance(exc, backend.NotSupported):
            out['fabric_state'] = 'not_supported'
        else:
            out['fabric_error'] = _nvml_reason(backend, exc)
    backend.close()
    return out


def _nvidia_smi(host, item, *args):
    argv = [host.tool('nvidia-smi')] + list(args) + ['-i', item.target]
    rc, out, err = host.run(argv)
    return rc, (out + err).strip(), argv


def _check_mig_and_fabric(item, host):
    dev = item.dev
    nvidia_mig.check_mig(item)
    if dev.pci_bus_id:
        facts = reset_constraints(dev.pci_bus_id, nvml=host.nvml)
    else:
        facts = {'nvlink_active': None, 'nvlink_error': 'no PCI bus id (the GPU does not answer)', 'fabric_state': None,
                 'fabric_error': 'no PCI bus id (the GPU does not answer)'}
    active = facts['nvlink_active']
    if active is None:
        item.check('nvlink', NOT_EXPOSED, 'NVLink state: %s' % facts['nvlink_error'])
    elif active:
        item.check('nvlink', WARN, '%d NVLink link(s) active: on NVLink/NVSwitch systems the driver may only reset all '
                                   'connected GPUs together; if the reset is refused, reset every GPU of the node '
                                   '(all: true) with the fabric manager running' % active)
    else:
        item.check('nvlink', PASS, 'no active NVLink link')
    state = facts['fabric_state']
    if state is None:
        item.check('fabric_manager', NOT_EXPOSED, 'NVSwitch fabric state: %s' % facts['fabric_error'])
    elif state in ('not_supported', 'completed'):
        item.check('fabric_manager', PASS, 'no NVSwitch fabric' if state == 'not_supported' else
                   'the fabric manager has registered the GPU')
    else:
        item.check('fabric_manager', FAIL, 'the NVSwitch fabric manager has not finished registering this GPU (state %s): '
                                           'start it (systemctl start nvidia-fabricmanager) and wait until the fabric '
                                           'state is Completed (nvidia-smi -q -i %s)' % (state, item.target))


def _check_persistence_and_session(item, host):
    mode = item.dev.persistence_mode
    if mode:
        item.check('persistence_mode', PASS, 'on: switched off (nvidia-smi -pm 0) for the reset and restored afterwards')
    elif mode is None:
        item.check('persistence_mode', WARN, 'unknown (the driver does not say, the GPU may be lost): nvidia-smi -pm 0 is '
                                             'tried before the reset, and the mode is not restored')
    else:
        item.check('persistence_mode', PASS, 'off')
    sessions = open_sessions(host.nvml)
    if sessions:
        item.check('nvml_session', FAIL, 'this process still holds %d NVML session(s), which blocks the reset; this is a bug '
                                         'in gpufleet.reclaim: please report it' % sessions)
    else:
        item.check('nvml_session', PASS, 'this process holds no NVML session')


def _check_recovery(item):
    action = recovery_action(item.dev)
    if action is None:
        item.check('recovery_action', NOT_EXPOSED, 'the driver does not report a recovery action for this GPU')
    elif action in REBOOT_ACTIONS:
        item.reboot_reason = 'the driver\'s recovery action is %s: a reset cannot recover this GPU' % action
        item.check('recovery_action', FAIL, '%s; reboot the node' % item.reboot_reason)
    else:
        item.check('recovery_action', PASS, 'the driver\'s recovery action is %s' % action)


def _check_kernel_modules(item, snapshot, host):
    refs, blocking = kmod.kernel_blockers(snapshot, host.sys_root)
    item.kernel_modules = refs
    unreadable = [r for r in refs if r.error]
    if blocking:
        item.reboot_reason = 'kernel references keep the driver in use (%s); a reboot clears them' % \
            '; '.join(r.describe() for r in blocking)
        why = ('%s: a kernel client (the DRM console or a display server for nvidia_drm and nvidia_modeset) holds the '
               'driver; stop it and unload the module (modprobe -r %s), or reboot the node'
               % ('; '.join(r.describe() for r in blocking), ' '.join(r.name for r in blocking)))
        item.check('kernel_modules', FAIL, why)
    elif unreadable:
        item.check('kernel_modules', WARN, '; '.join('%s: %s' % (r.name, r.error) for r in unreadable))
    elif not any(r.loaded for r in refs):
        item.check('kernel_modules', PASS, 'none of %s is loaded' % ', '.join(kmod.BLOCKING_MODULES))
    else:
        item.check('kernel_modules', PASS, 'no kernel reference beyond holder modules and processes (%s)'
                   % ', '.join('%s refcnt %s' % (r.name, r.refcnt) for r in refs if r.loaded))
