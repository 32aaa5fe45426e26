# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""AMD backend over the ``amdsmi`` Python library (ROCm's libamd_smi.so).  Minimal on purpose.

``import amdsmi`` raises KeyError or OSError (and prints to stdout) when libamd_smi.so cannot be
loaded, so the import is lazy, catches every exception and swallows what it prints: a module's
stdout must stay pure JSON.  amdsmi reports VRAM in "MB" computed as bytes / (1024 * 1024),
which are MiB: no conversion.  Health only looks at uncorrectable ECC counts.
"""

from __future__ import annotations

import contextlib
import io
import traceback

from ..model import BackendStatus, Device, bytes_to_mib
from .base import Backend, error_text

NOT_INSTALLED = 'amdsmi (the ROCm AMD SMI Python library) is not installed'

_AMDSMI = {}
# No GPU has a 100 kW power limit: a larger figure is in microwatts.
MICROWATT_THRESHOLD = 100000


def import_amdsmi():
    """Import amdsmi once; return (module or None, error text or None)."""
    if 'module' not in _AMDSMI:
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                import amdsmi  # pylint: disable=import-outside-toplevel
            _AMDSMI['module'], _AMDSMI['error'] = amdsmi, None
        except ImportError:
            _AMDSMI['module'], _AMDSMI['error'] = None, NOT_INSTALLED
        except Exception as exc:  # pylint: disable=broad-except
            printed = sink.getvalue().strip()
            detail = printed.splitlines()[-1] if printed else error_text(exc)
            _AMDSMI['module'] = None
            _AMDSMI['error'] = 'amdsmi is installed but libamd_smi.so could not be loaded (is ROCm installed?): %s' % detail
            _AMDSMI['traceback'] = traceback.format_exc()
    return _AMDSMI['module'], _AMDSMI['error']


def _na(value):
    """amdsmi says "N/A" (or a dict/str) for unsupported values."""
    if value is None or isinstance(value, str) and value.strip().upper() in ('N/A', 'NA', ''):
        return None
    return value


def _num(value, cast=int):
    value = _na(value)
    if isinstance(value, dict):
        value = _na(value.get('value'))
    if value is None:
        return None
    try:
        return cast(value)
    except (TypeError, ValueError):
        return None


def _watts(value):
    """amdsmi's power_limit is hwmon's power1_cap (microwatts) in many releases, watts in others."""
    if value is None:
        return None
    if value > MICROWATT_THRESHOLD:
        return round(value / 1000000.0, 3)
    return value


class AmdBackend(Backend):
    """amdsmi backend.  ``amdsmi`` injects the module (tests); default: lazy import."""

    name = 'amd'

    def __init__(self, amdsmi=None):
        super(AmdBackend, self).__init__()
        self.amdsmi = amdsmi
        self._initialized = False

    def probe(self):
        mod = self.amdsmi
        if mod is None:
            mod, error = import_amdsmi()
            if mod is None:
                self.status = BackendStatus(name=self.name, available=False, error=error)
                return self.status
            self.amdsmi = mod
        try:
            flags = getattr(getattr(mod, 'AmdSmiInitFlags', None), 'INIT_AMD_GPUS', None)
            if flags is None:
                mod.amdsmi_init()
            else:
                mod.amdsmi_init(flags)
            self._initialized = True
        except Exception as exc:  # pylint: disable=broad-except
            self.status = BackendStatus(name=self.name, available=False,
                                        error='amdsmi initialisation failed (is the amdgpu driver loaded?): %s' % error_text(exc))
            return self.status
        self.status = BackendStatus(name=self.name, available=True, version=self._version(), error=None)
        return self.status

    def _version(self):
        mod = self.amdsmi
        try:
            handles = mod.amdsmi_get_processor_handles()
            if handles:
                info = mod.amdsmi_get_gpu_driver_info(handles[0])
                if _na(info.get('driver_version')):
                    return str(info['driver_version'])
        except Exception:  # pylint: disable=broad-except
            pass
        try:
            ver = mod.amdsmi_get_lib_version()
            if isinstance(ver, dict):
                return '.'.join(str(ver[k]) for k in ('year', 'major', 'minor', 'release') if k in ver) or None
            return str(ver)
        except Exception:  # pylint: disable=broad-except
            return None

    def close(self):
        if self._initialized:
            self._initialized = False
            try:
                self.amdsmi.amdsmi_shut_down()
            except Exception:  # pylint: disable=broad-except
                pass

    def devices(self):
        if not self._initialized:
            return []
        mod = self.amdsmi
        result = []
        for i, handle in enumerate(mod.amdsmi_get_processor_handles()):
            dev = Device(vendor=self.name, vendor_index=i)
            try:
                self._read_device(dev, handle)
            except Exception as exc:  # pylint: disable=broad-except
                dev.processes_complete = False
                dev.reading_failed('the device', error_text(exc))
            result.append(dev)
        return result

    def _get(self, dev, what, func, *args):
        try:
            return func(*args)
        except Exception as exc:  # pylint: disable=broad-except
            if getattr(exc, 'err_code', None) == 2:  # AMDSMI_STATUS_NOT_SUPPORTED
                return None
            dev.reading_failed(what, error_text(exc))
            return None

    def _read_device(self, dev, handle):
        mod = self.amdsmi
        get = self._get
        dev.pci_bus_id = _na(get(dev, 'the PCI bus id', mod.amdsmi_get_gpu_device_bdf, handle))
        dev.uuid = _na(get(dev, 'the UUID', mod.amdsmi_get_gpu_device_uuid, handle))
        asic = get(dev, 'the ASIC info', mod.amdsmi_get_gpu_asic_info, handle) or {}
        dev.name = _na(asic.get('market_name'))
        if hasattr(mod, 'amdsmi_get_gpu_enumeration_info'):
            enum = self._quiet(mod.amdsmi_get_gpu_enumeration_info, handle) or {}
            dev.minor = _num(enum.get('drm_card'))
        vram = get(dev, 'the VRAM usage', mod.amdsmi_get_gpu_vram_usage, handle)
        if vram:
            dev.memory_total_mib = _num(vram.get('vram_total'))
            dev.memory_used_mib = _num(vram.get('vram_used'))
            if dev.memory_total_mib is not None and dev.memory_used_mib is not None:
                dev.memory_free_mib = max(0, dev.memory_total_mib - dev.memory_used_mib)
        activity = get(dev, 'the GPU activity', mod.amdsmi_get_gpu_activity, handle)
        if activity:
            dev.utilization_pct = _num(activity.get('gfx_activity'))
            dev.memory_utilization_pct = _num(activity.get('umc_activity'))
        dev.temperature_c = self._temperature(handle)
        power = get(dev, 'the power info', mod.amdsmi_get_power_info, handle)
        if power:
            for key in ('current_socket_power', 'socket_power', 'average_socket_power'):
                dev.power_w = _num(power.get(key), float)
                if dev.power_w is not None:
                    break
            dev.power_limit_w = _watts(_num(power.get('power_limit'), float))
        if hasattr(mod, 'amdsmi_get_gpu_total_ecc_count'):
            ecc = self._quiet(mod.amdsmi_get_gpu_total_ecc_count, handle) or {}
            unc = _num(ecc.get('uncorrectable_count'))
            dev.ecc_uncorrected_volatile = unc
            if unc:
                dev.health.degrade('%d uncorrectable ECC error(s): reset the GPU' % unc, action='reset')
        self._read_processes(dev, handle)

    def _quiet(self, func, *args):
        try:
            return func(*args)
        except Exception:  # pylint: disable=broad-except
            return None

    def _temperature(self, handle):
        mod = self.amdsmi
        types = getattr(mod, 'AmdSmiTemperatureType', None)
        metrics = getattr(mod, 'AmdSmiTemperatureMetric', None)
        if types is None or metrics is None:
            return None
        for sensor in ('EDGE', 'HOTSPOT', 'JUNCTION'):
            if hasattr(types, sensor):
                value = _num(self._quiet(mod.amdsmi_get_temp_metric, handle, getattr(types, sensor), metrics.CURRENT))
                if value is not None:
                    return value
        return None

    def _read_processes(self, dev, handle):
        mod = self.amdsmi
        try:
            procs = mod.amdsmi_get_gpu_process_list(handle)
        except Exception as exc:  # pylint: disable=broad-except
            dev.processes_complete = False
            dev.reading_failed('the process list', error_text(exc))
            return
        for item in procs or []:
            info = item
            if not isinstance(item, dict):  # older amdsmi: process handles
                try:
                    info = mod.amdsmi_get_gpu_process_info(handle, item)
                except Exception as exc:  # pylint: disable=broad-except
                    dev.processes_complete = False
                    dev.reading_failed('a process entry', error_text(exc))
                    continue
            pid = _num(info.get('pid'))
            if pid is None:
                continue
            usage = info.get('memory_usage') or {}
            vram = _num(usage.get('vram_mem')) if isinstance(usage, dict) else None
            if vram is None:
                vram = _num(info.get('mem'))
            dev.add_driver_process(pid, bytes_to_mib(vram), 'compute')
