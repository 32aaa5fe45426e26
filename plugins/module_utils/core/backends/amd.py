# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""AMD backend: the ``amdsmi`` Python library (ROCm's libamd_smi.so), else the amdgpu driver's sysfs and fdinfo.

``import amdsmi`` raises KeyError or OSError (and prints to stdout) when libamd_smi.so cannot be
loaded, so the import is lazy, catches every exception and swallows what it prints: a module's
stdout must stay pure JSON.

With amdsmi: BDF, UUID, market name, VRAM total/used (amdsmi's "MB" are bytes / 2**20, i.e.
MiB: no conversion), gfx activity, edge (else hotspot/junction) temperature, socket power and the
power limit (micro-watts in many releases), ECC counts for health; per process
(``amdsmi_get_gpu_process_list``): pid, name, VRAM and GTT bytes, and engine busy time in ns,
turned into a utilization between two readings ``SAMPLE_INTERVAL_S`` apart.  A GPU whose VRAM
query answers a "gone" status (UNEXPECTED_DATA, NOT_FOUND, IO, ...) is reported lost.

Without a usable amdsmi but with the amdgpu driver loaded: ``/sys/class/drm/card*/device``
(``mem_info_vram_total``/``_used`` in bytes, ``gpu_busy_percent``, ``product_name``, hwmon
temperature and power) and per-process VRAM/GTT and engine time from DRM fdinfo (drm_fdinfo.py).
No UUID and no ECC counts on that path: ``None``.
"""

from __future__ import annotations

import contextlib
import io
import os
import time

from .. import drm_fdinfo as drm
from ..model import BackendStatus, Device, bytes_to_mib
from .base import FAIL, MAX_CELSIUS, PASS, Backend, DrmDevices, error_text, last_line, pci_bdf, read_device, to_reading

NOT_INSTALLED = 'amdsmi (the ROCm AMD SMI Python library) is not installed'
AMD_PCI_VENDOR = '0x1002'

_AMDSMI = {}
# No GPU has a 100 kW power limit: a larger figure is in microwatts.
MICROWATT_THRESHOLD = 100000
# amdsmi statuses that mean the GPU stopped answering (AMD has no "GPU is lost" code): DRM_ERROR,
# IO, FILE_ERROR, NOT_FOUND, NO_DATA, UNEXPECTED_DATA.
LOST_STATUSES = (6, 12, 14, 31, 40, 43)
_NOT_SUPPORTED = 2
_NO_PERM = 10


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
            # only on this failure: not at every load
            import traceback  # pylint: disable=import-outside-toplevel
            _AMDSMI['traceback'] = traceback.format_exc()
    return _AMDSMI['module'], _AMDSMI['error']


def _na(value):
    """amdsmi says "N/A" (or a dict/str) for unsupported values."""
    if value is None or isinstance(value, str) and value.strip().upper() in ('N/A', 'NA', ''):
        return None
    return value


def _num(value, cast=int):
    """A reading (amdsmi's values are unsigned 64-bit) or None: "N/A", ``{'value': ...}`` unwrapped,
    and booleans, negative, infinite or larger figures refused (base.to_reading)."""
    value = _na(value)
    if isinstance(value, dict):
        value = _na(value.get('value'))
    if value is None:
        return None
    return to_reading(value, cast)


def _pct(value):
    """A percentage reading (0-100) or None."""
    return to_reading(value, int, 0, 100)


def _celsius(value):
    """A temperature reading in degrees Celsius, or None when absurd for a GPU."""
    return to_reading(value, int, 0, MAX_CELSIUS)


def _mapping(value):
    """amdsmi answers a dict; anything else (a library bug, a changed API) reads as nothing."""
    return value if isinstance(value, dict) else {}


def _watts(value):
    """amdsmi's power_limit is hwmon's power1_cap (microwatts) in many releases, watts in others."""
    if value is None:
        return None
    if value > MICROWATT_THRESHOLD:
        return round(value / 1000000.0, 3)
    return value


class _GpuLost(Exception):
    """Internal: the GPU answered a "gone" status; stop reading it."""


class _ProcessSample(object):
    """One reading of every GPU's amdsmi process list: ``lists`` {handle position: list or exception}."""

    def __init__(self, lists, taken_at):
        self.lists = lists
        self.taken_at = taken_at


def amd_error_text(exc):
    """An amdsmi exception in words: its ``err_info`` ("AMDSMI_STATUS_NO_PERM - Permission Denied") when it has one."""
    info = getattr(exc, 'err_info', None)
    if info:
        return str(info).strip()
    return error_text(exc).strip()


def _code(exc):
    code = getattr(exc, 'err_code', None)
    try:
        return abs(int(code)) if code is not None else None
    except (TypeError, ValueError):
        return None


def _engine_ns(info):
    """{engine: busy ns} from a process entry's ``engine_usage`` (values "N/A" are left out)."""
    usage = info.get('engine_usage') if isinstance(info, dict) else None
    result = {}
    if isinstance(usage, dict):
        for name, value in usage.items():
            number = _num(value)
            if number is not None:
                result[name] = number
    return result


def _busy_pct(prev, cur, elapsed_s):
    """Busiest engine between two ``engine_usage`` readings, in percent (int); None when unknown."""
    if prev is None or not elapsed_s or elapsed_s <= 0:
        return None
    best = None
    for name, value in cur.items():
        if name not in prev:
            continue
        delta = value - prev[name] if value >= prev[name] else 0
        pct = max(0.0, min(100.0, delta / (elapsed_s * 1e9) * 100.0))
        best = pct if best is None else max(best, pct)
    return None if best is None else int(round(best))


class AmdBackend(DrmDevices, Backend):
    """AMD GPUs.  ``amdsmi`` injects the module (tests; ``False``: not installed); default: lazy import.

    Test seams (never user options): ``root``/``sys_root``/``proc_root`` for the library-free path
    (default ``$_GPUFLEET_DRM_ROOT`` or ``/``), ``clock``, ``sleep``, ``interval`` and ``cache`` for
    the two readings that make per-process utilization.
    """

    name = 'amd'
    label = 'AMD'
    reset_tools = ('amd-smi',)

    def __init__(self, amdsmi=None, root=None, sys_root=None, proc_root=None, clock=time.monotonic, sleep=time.sleep,
                 interval=None, cache=None):
        super(AmdBackend, self).__init__()
        self.amdsmi = amdsmi
        self.root = drm.drm_root(root)
        self.sys_root = sys_root or os.path.join(self.root, 'sys')
        self.proc_root = proc_root or os.path.join(self.root, 'proc')
        self.readings = drm.TwoReadings(clock, sleep, interval, cache)
        self.mode = None          # 'amdsmi' or 'sysfs' once probed
        self.cards = []
        self._initialized = False

    # ------------------------------------------------------------------ life cycle
    def probe(self):
        mod = self.amdsmi
        if mod is None:
            mod, error = import_amdsmi()
        elif mod is False:
            mod, error = None, NOT_INSTALLED
        else:
            error = None
        if mod is not None:
            self.amdsmi = mod
            try:
                flags = getattr(getattr(mod, 'AmdSmiInitFlags', None), 'INIT_AMD_GPUS', None)
                if flags is None:
                    mod.amdsmi_init()
                else:
                    mod.amdsmi_init(flags)
                self._initialized = True
            except Exception as exc:  # pylint: disable=broad-except
                error = 'amdsmi initialisation failed (is the amdgpu driver loaded?): %s' % amd_error_text(exc)
            else:
                self.mode = 'amdsmi'
                self.status = BackendStatus(name=self.name, available=True, version=self._version(), error=None)
                return self.status
        return self._probe_sysfs(error)

    def _probe_sysfs(self, library_error):
        """No usable amdsmi: read the amdgpu driver directly when it drives a GPU here."""
        self.cards = sorted(drm.list_drm_cards(self.sys_root, AMD_PCI_VENDOR, drm.AMD_DRIVERS), key=lambda c: c.bdf)
        if not self.cards:
            self.status = BackendStatus(name=self.name, available=False, error=library_error)
            return self.status
        self.mode = 'sysfs'
        version = drm.read_sysfs(os.path.join(self.sys_root, 'module', 'amdgpu', 'version'))
        if version is None:
            kernel = drm.read_sysfs(os.path.join(self.proc_root, 'sys', 'kernel', 'osrelease'))
            version = 'amdgpu (kernel %s)' % kernel if kernel else None
        self.status = BackendStatus(
            name=self.name, available=True, version=version,
            error='%s; reading the amdgpu driver through sysfs and DRM fdinfo instead (no UUID, no ECC counts)' % library_error)
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

    # ------------------------------------------------------------------ reading
    # ------------------------------------------------------------------ reset (see base.Backend)
    @classmethod
    def reset_checks(cls, item, snapshot, host):
        lib, why = _amdsmi_usable(host)
        cli = host.tool('amd-smi')
        if lib:
            item.check('tool', PASS, 'amdsmi_reset_gpu (amdsmi library)%s' % (', falling back to %s' % cli if cli else ''))
        elif cli:
            item.check('tool', PASS, 'amd-smi reset --gpureset (%s); the amdsmi library is not usable: %s' % (cli, why))
        else:
            item.check('tool', FAIL, 'neither the amdsmi Python library (%s) nor the amd-smi command was found: install '
                                     'amd-smi (package amd-smi-lib of ROCm) or add its directory to PATH' % why)

    @classmethod
    def reset_device(cls, item, host):
        """amdsmi_reset_gpu through the library, falling back to ``amd-smi reset --gpureset -g <bdf>``."""
        target = item.target
        if host.amdsmi is False:
            outcome, detail = 'unavailable', 'amdsmi is not installed'
        else:
            outcome, detail = reset_gpu(target, amdsmi=host.amdsmi)
        item.method, item.command, item.output = 'amdsmi', ['amdsmi_reset_gpu', target], detail
        if outcome == 'reset':
            return None
        if outcome == 'failed':
            return detail
        cli = host.tool('amd-smi')
        if not cli:
            return 'the amdsmi library cannot reset (%s) and amd-smi was not found' % detail
        argv = [cli, 'reset', '--gpureset', '-g', target]
        rc, out, err = host.run(argv)
        text = (out + err).strip()
        item.method, item.command, item.output = 'amd-smi', argv, text
        # amd-smi prints "Failed to reset GPU" or "Can not find a device" and still exits 0.
        if rc == 0 and 'successfully reset' in text.lower() and 'failed' not in text.lower():
            return None
        return 'amd-smi reset --gpureset failed (rc %d): %s' % (rc, last_line(text))

    def devices(self):
        if self.mode == 'sysfs':
            return self._sysfs_devices()
        if not self._initialized:
            return []
        mod = self.amdsmi
        handles = list(mod.amdsmi_get_processor_handles())
        first, second = self.readings.pair(lambda: self._sample_processes(handles), ('amdsmi', id(mod)),
                                           needed=lambda s: any(isinstance(v, list) and v for v in s.lists.values()))
        result = []
        for i, handle in enumerate(handles):
            dev = Device(vendor=self.name, vendor_index=i)
            try:
                self._read_device(dev, handle, first.lists.get(i), second.lists.get(i), second.taken_at - first.taken_at)
            except _GpuLost as lost:
                self._mark_lost(dev, lost.args[0])
            except Exception as exc:  # pylint: disable=broad-except
                dev.processes_complete = False
                dev.reading_failed('the device', amd_error_text(exc))
            result.append(dev)
        return result

    def _sample_processes(self, handles):
        lists = {}
        for i, handle in enumerate(handles):
            try:
                lists[i] = self._process_entries(handle)
            except Exception as exc:  # pylint: disable=broad-except
                lists[i] = exc
        return _ProcessSample(lists, self.readings.clock())

    def _process_entries(self, handle):
        """The process list as dicts (older amdsmi returns process handles: resolved one by one)."""
        mod = self.amdsmi
        entries = []
        for item in mod.amdsmi_get_gpu_process_list(handle) or []:
            if not isinstance(item, dict):
                try:
                    item = mod.amdsmi_get_gpu_process_info(handle, item)
                except Exception as exc:  # pylint: disable=broad-except
                    item = {'error': amd_error_text(exc)}
            entries.append(item)
        return entries

    def _mark_lost(self, dev, exc):
        dev.processes_complete = False
        dev.driver_processes = []
        for name in ('memory_used_mib', 'memory_free_mib', 'utilization_pct', 'memory_utilization_pct', 'temperature_c',
                     'power_w', 'power_limit_w', 'orphaned_mib'):
            setattr(dev, name, None)
        dev.health.lose('the GPU stopped answering (amdsmi: %s): it fell off the bus or hung; reset it, and reboot the '
                        'node if the reset fails' % amd_error_text(exc), action='reset')

    def _get(self, dev, what, func, *args):
        try:
            return func(*args)
        except Exception as exc:  # pylint: disable=broad-except
            if _code(exc) == _NOT_SUPPORTED:
                return None
            dev.reading_failed(what, amd_error_text(exc))
            return None

    def _read_device(self, dev, handle, first_procs, procs, elapsed):
        mod = self.amdsmi
        get = self._get
        dev.pci_bus_id = _na(get(dev, 'the PCI bus id', mod.amdsmi_get_gpu_device_bdf, handle))
        try:
            vram = mod.amdsmi_get_gpu_vram_usage(handle)
        except Exception as exc:  # pylint: disable=broad-except
            if _code(exc) in LOST_STATUSES:
                raise _GpuLost(exc)
            if _code(exc) != _NOT_SUPPORTED:
                dev.reading_failed('the VRAM usage', amd_error_text(exc))
            vram = None
        dev.uuid = _na(get(dev, 'the UUID', mod.amdsmi_get_gpu_device_uuid, handle))
        asic = _mapping(get(dev, 'the ASIC info', mod.amdsmi_get_gpu_asic_info, handle))
        name = _na(asic.get('market_name'))
        dev.name = name if isinstance(name, str) else None
        if hasattr(mod, 'amdsmi_get_gpu_enumeration_info'):
            enum = _mapping(self._quiet(mod.amdsmi_get_gpu_enumeration_info, handle))
            dev.minor = _num(enum.get('drm_card'))
        vram = _mapping(vram)
        if vram:
            dev.memory_total_mib = _num(vram.get('vram_total'))
            dev.memory_used_mib = _num(vram.get('vram_used'))
            if dev.memory_total_mib is not None and dev.memory_used_mib is not None:
                dev.memory_free_mib = max(0, dev.memory_total_mib - dev.memory_used_mib)
        activity = _mapping(get(dev, 'the GPU activity', mod.amdsmi_get_gpu_activity, handle))
        if activity:
            dev.utilization_pct = _pct(_num(activity.get('gfx_activity')))
            dev.memory_utilization_pct = _pct(_num(activity.get('umc_activity')))
        dev.temperature_c = self._temperature(handle)
        power = _mapping(get(dev, 'the power info', mod.amdsmi_get_power_info, handle))
        if power:
            for key in ('current_socket_power', 'socket_power', 'average_socket_power'):
                dev.power_w = _num(power.get(key), float)
                if dev.power_w is not None:
                    break
            dev.power_limit_w = _watts(_num(power.get('power_limit'), float))
        self._read_health(dev, handle)
        self._add_processes(dev, first_procs, procs, elapsed)

    def _read_health(self, dev, handle):
        mod = self.amdsmi
        if not hasattr(mod, 'amdsmi_get_gpu_total_ecc_count'):
            return
        ecc = _mapping(self._quiet(mod.amdsmi_get_gpu_total_ecc_count, handle))
        unc = _num(ecc.get('uncorrectable_count'))
        dev.ecc_uncorrected_volatile = unc
        if unc:
            dev.health.degrade('%d uncorrectable ECC error(s): reset the GPU' % unc, action='reset')
        deferred = _num(ecc.get('deferred_count'))
        if deferred:
            dev.health.degrade('%d deferred (poisoned) ECC error(s): reset the GPU' % deferred, action='reset')

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
                value = _celsius(_num(self._quiet(mod.amdsmi_get_temp_metric, handle, getattr(types, sensor), metrics.CURRENT)))
                if value is not None:
                    return value
        return None

    def _add_processes(self, dev, first_procs, procs, elapsed):
        if isinstance(procs, Exception):
            if _code(procs) in LOST_STATUSES and dev.memory_used_mib is None:
                raise _GpuLost(procs)
            dev.processes_complete = False
            detail = amd_error_text(procs)
            if _code(procs) == _NO_PERM:
                detail += ' (run as root to see every process)'
            dev.reading_failed('the process list', detail)
            return
        before = {}
        for info in first_procs if isinstance(first_procs, list) else []:
            pid = _num(_mapping(info).get('pid'))
            if pid is not None:
                before[pid] = _engine_ns(info)
        for info in procs or []:
            if not isinstance(info, dict):
                dev.processes_complete = False
                dev.reading_failed('a process entry', 'amdsmi answered %s, not a process record' % type(info).__name__)
                continue
            if 'error' in info and 'pid' not in info:
                dev.processes_complete = False
                dev.reading_failed('a process entry', str(info['error'])[:200])
                continue
            pid = _num(info.get('pid'))
            if not pid:
                continue
            usage = info.get('memory_usage') or {}
            vram = _num(usage.get('vram_mem')) if isinstance(usage, dict) else None
            if vram is None:
                vram = _num(info.get('mem'))
            proc = dev.add_driver_process(pid, bytes_to_mib(vram), 'compute')
            proc.util_pct = _busy_pct(before.get(pid), _engine_ns(info), elapsed)
            gtt = _num(usage.get('gtt_mem')) if isinstance(usage, dict) else None
            if gtt is not None:
                proc.system_mib = bytes_to_mib(gtt)
            name = _na(info.get('name'))
            if name is not None:
                proc.name = str(name)

    # ------------------------------------------------------------------ without amdsmi
    def _drm_sample(self):
        return drm.scan_clients(self.proc_root, drm.AMD_DRIVERS, clock=self.readings.clock)

    def _sysfs_devices(self):
        first, second = self.readings.pair(self._drm_sample, ('amdgpu', self.proc_root), needed=lambda s: bool(s.clients))
        return [read_device(Device(vendor=self.name, vendor_index=i, minor=card.minor, pci_bus_id=card.bdf),
                            self._read_card, card, first, second) for i, card in enumerate(self.cards)]

    def _read_card(self, dev, card, first, second):
        if drm.card_lost(dev, card):
            return
        name = card.attr('product_name') or drm.pci_device_name(card.vendor_id, card.device_id, self.root)
        if not name and card.device_id:
            name = 'AMD GPU [1002:%s]' % card.device_id.replace('0x', '')
        dev.name = name
        total = drm.read_int(os.path.join(card.device_path, 'mem_info_vram_total'))
        used = drm.read_int(os.path.join(card.device_path, 'mem_info_vram_used'))
        dev.memory_total_mib = bytes_to_mib(total)
        dev.memory_used_mib = bytes_to_mib(used)
        if total is not None and used is not None:
            dev.memory_free_mib = bytes_to_mib(max(0, total - used))
        busy = drm.read_int(os.path.join(card.device_path, 'gpu_busy_percent'))
        dev.utilization_pct = busy
        busy = drm.read_int(os.path.join(card.device_path, 'mem_busy_percent'))
        dev.memory_utilization_pct = busy
        hw = drm.hwmon_readings(card)
        dev.temperature_c = hw['temp_c']
        dev.power_w = hw['power_w']
        dev.power_limit_w = hw['power_cap_w']
        drm.add_client_processes(dev, first, second, card.bdf, self.proc_root)
        drm.note_incomplete(dev, second)


# ---------------------------------------------------------------------------- reset support
_BUSY = 30


def reset_gpu(bdf, amdsmi=None):
    """Reset the AMD GPU at PCI ``bdf`` with ``amdsmi_reset_gpu`` in a library session of its own.

    Returns (outcome, detail): ``reset``; ``unavailable`` (no library, or the call is not
    supported: the caller may fall back to the amd-smi CLI); or ``failed`` with the reason.
    """
    backend = AmdBackend(amdsmi=amdsmi)
    status = backend.probe()
    mod = backend.amdsmi
    if not status.available or mod is None:
        backend.close()
        return 'unavailable', status.error or NOT_INSTALLED
    try:
        wanted = pci_bdf(bdf)
        for handle in mod.amdsmi_get_processor_handles():
            if pci_bdf(mod.amdsmi_get_gpu_device_bdf(handle)) == wanted:
                break
        else:
            return 'failed', 'amdsmi does not know a GPU at %s' % bdf
        if not hasattr(mod, 'amdsmi_reset_gpu'):
            return 'unavailable', 'this amdsmi has no amdsmi_reset_gpu'
        mod.amdsmi_reset_gpu(handle)
        return 'reset', 'amdsmi_reset_gpu(%s) succeeded' % bdf
    except Exception as exc:  # pylint: disable=broad-except
        code = _code(exc)
        if code == _NOT_SUPPORTED:
            return 'unavailable', 'amdsmi_reset_gpu is not supported here (%s)' % error_text(exc)
        if code == _NO_PERM:
            return 'failed', 'amdsmi_reset_gpu needs root (%s)' % error_text(exc)
        if code == _BUSY:
            return 'failed', 'the GPU is in use: stop every process using it first (%s)' % error_text(exc)
        return 'failed', 'amdsmi_reset_gpu failed: %s' % error_text(exc)
    finally:
        backend.close()


def _amdsmi_usable(host):
    """(whether the amdsmi library can be used, why not) for ``host`` (its ``amdsmi`` seam: the module,
    False for "not installed", None to import it)."""
    if host.amdsmi is False:
        return False, 'amdsmi is not installed'
    if host.amdsmi is not None:
        return True, None
    module, error = import_amdsmi()
    return module is not None, error
