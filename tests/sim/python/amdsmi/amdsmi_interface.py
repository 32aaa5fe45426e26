# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpusim fake of amdsmi.amdsmi_interface (amdsmi 7.0.2): no C library, driven by $GPU_SIM_STATE.

Same function names, parameter names, return shapes (dicts, MB for VRAM, bytes for process
memory, uW for power caps) and exceptions as the real package.  Simulation choices are
documented in tests/sim/README.md; the main ones:

* a GPU marked lost answers AmdSmiLibraryException(AMDSMI_STATUS_UNEXPECTED_DATA) to every
  call but amdsmi_get_processor_handles and amdsmi_get_gpu_device_bdf (the BDF is cached by
  the library at init);
* amdsmi_init fails with AMDSMI_STATUS_DRIVER_NOT_LOADED when there is no state or the
  simulated node is not AMD;
* amdsmi_reset_gpu needs root (AMDSMI_STATUS_NO_PERM) and no live process or live child of
  one on the GPU (AMDSMI_STATUS_BUSY).
"""

import importlib.util
import os
import re
import sys
import time
from enum import IntEnum

from . import amdsmi_wrapper
from .amdsmi_exception import AmdSmiBdfFormatException, AmdSmiLibraryException, AmdSmiParameterException


def _load_state_module():
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    spec = importlib.util.spec_from_file_location('_gpusim_state_for_amdsmi', os.path.join(here, 'gpusim_state.py'))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


_gs = _load_state_module()

MAX_NUM_PROCESSES = 1024
_HANDLE_BASE = 0x5A5A0000
_LOST_STATUS = amdsmi_wrapper.AMDSMI_STATUS_UNEXPECTED_DATA
_MIB = 1024 * 1024
_DRIVER_VERSION = '6.10.5'
_init_count = [0]


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = amdsmi_wrapper.AMDSMI_INIT_ALL_PROCESSORS
    INIT_AMD_CPUS = amdsmi_wrapper.AMDSMI_INIT_AMD_CPUS
    INIT_AMD_GPUS = amdsmi_wrapper.AMDSMI_INIT_AMD_GPUS
    INIT_AMD_APUS = amdsmi_wrapper.AMDSMI_INIT_AMD_APUS
    INIT_NON_AMD_CPUS = amdsmi_wrapper.AMDSMI_INIT_NON_AMD_CPUS
    INIT_NON_AMD_GPUS = amdsmi_wrapper.AMDSMI_INIT_NON_AMD_GPUS


class AmdSmiProcessorType(IntEnum):
    UNKNOWN = amdsmi_wrapper.AMDSMI_PROCESSOR_TYPE_UNKNOWN
    AMDSMI_PROCESSOR_TYPE_AMD_GPU = amdsmi_wrapper.AMDSMI_PROCESSOR_TYPE_AMD_GPU
    AMDSMI_PROCESSOR_TYPE_AMD_CPU = amdsmi_wrapper.AMDSMI_PROCESSOR_TYPE_AMD_CPU
    AMDSMI_PROCESSOR_TYPE_NON_AMD_GPU = amdsmi_wrapper.AMDSMI_PROCESSOR_TYPE_NON_AMD_GPU
    AMDSMI_PROCESSOR_TYPE_NON_AMD_CPU = amdsmi_wrapper.AMDSMI_PROCESSOR_TYPE_NON_AMD_CPU


class AmdSmiTemperatureType(IntEnum):
    EDGE = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_EDGE
    HOTSPOT = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_HOTSPOT
    JUNCTION = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_JUNCTION
    VRAM = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_VRAM
    HBM_0 = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_HBM_0
    HBM_1 = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_HBM_1
    HBM_2 = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_HBM_2
    HBM_3 = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_HBM_3
    PLX = amdsmi_wrapper.AMDSMI_TEMPERATURE_TYPE_PLX


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = amdsmi_wrapper.AMDSMI_TEMP_CURRENT
    MAX = amdsmi_wrapper.AMDSMI_TEMP_MAX
    MIN = amdsmi_wrapper.AMDSMI_TEMP_MIN
    MAX_HYST = amdsmi_wrapper.AMDSMI_TEMP_MAX_HYST
    MIN_HYST = amdsmi_wrapper.AMDSMI_TEMP_MIN_HYST
    CRITICAL = amdsmi_wrapper.AMDSMI_TEMP_CRITICAL
    CRITICAL_HYST = amdsmi_wrapper.AMDSMI_TEMP_CRITICAL_HYST
    EMERGENCY = amdsmi_wrapper.AMDSMI_TEMP_EMERGENCY
    EMERGENCY_HYST = amdsmi_wrapper.AMDSMI_TEMP_EMERGENCY_HYST
    CRIT_MIN = amdsmi_wrapper.AMDSMI_TEMP_CRIT_MIN
    CRIT_MIN_HYST = amdsmi_wrapper.AMDSMI_TEMP_CRIT_MIN_HYST
    OFFSET = amdsmi_wrapper.AMDSMI_TEMP_OFFSET
    LOWEST = amdsmi_wrapper.AMDSMI_TEMP_LOWEST
    HIGHEST = amdsmi_wrapper.AMDSMI_TEMP_HIGHEST


class AmdSmiGpuBlock(IntEnum):
    INVALID = amdsmi_wrapper.AMDSMI_GPU_BLOCK_INVALID
    UMC = amdsmi_wrapper.AMDSMI_GPU_BLOCK_UMC
    SDMA = amdsmi_wrapper.AMDSMI_GPU_BLOCK_SDMA
    GFX = amdsmi_wrapper.AMDSMI_GPU_BLOCK_GFX
    MMHUB = amdsmi_wrapper.AMDSMI_GPU_BLOCK_MMHUB
    ATHUB = amdsmi_wrapper.AMDSMI_GPU_BLOCK_ATHUB
    PCIE_BIF = amdsmi_wrapper.AMDSMI_GPU_BLOCK_PCIE_BIF
    HDP = amdsmi_wrapper.AMDSMI_GPU_BLOCK_HDP
    XGMI_WAFL = amdsmi_wrapper.AMDSMI_GPU_BLOCK_XGMI_WAFL
    DF = amdsmi_wrapper.AMDSMI_GPU_BLOCK_DF
    SMN = amdsmi_wrapper.AMDSMI_GPU_BLOCK_SMN
    SEM = amdsmi_wrapper.AMDSMI_GPU_BLOCK_SEM
    MP0 = amdsmi_wrapper.AMDSMI_GPU_BLOCK_MP0
    MP1 = amdsmi_wrapper.AMDSMI_GPU_BLOCK_MP1
    FUSE = amdsmi_wrapper.AMDSMI_GPU_BLOCK_FUSE
    MCA = amdsmi_wrapper.AMDSMI_GPU_BLOCK_MCA
    VCN = amdsmi_wrapper.AMDSMI_GPU_BLOCK_VCN
    JPEG = amdsmi_wrapper.AMDSMI_GPU_BLOCK_JPEG
    IH = amdsmi_wrapper.AMDSMI_GPU_BLOCK_IH
    MPIO = amdsmi_wrapper.AMDSMI_GPU_BLOCK_MPIO
    RESERVED = amdsmi_wrapper.AMDSMI_GPU_BLOCK_RESERVED


class AmdSmiRasErrState(IntEnum):
    NONE = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_NONE
    DISABLED = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_DISABLED
    PARITY = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_PARITY
    SING_C = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_SING_C
    MULT_UC = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_MULT_UC
    POISON = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_POISON
    ENABLED = amdsmi_wrapper.AMDSMI_RAS_ERR_STATE_ENABLED


class AmdSmiMemoryType(IntEnum):
    VRAM = amdsmi_wrapper.AMDSMI_MEM_TYPE_VRAM
    VIS_VRAM = amdsmi_wrapper.AMDSMI_MEM_TYPE_VIS_VRAM
    GTT = amdsmi_wrapper.AMDSMI_MEM_TYPE_GTT


class AmdSmiVramType(IntEnum):
    UNKNOWN = amdsmi_wrapper.AMDSMI_VRAM_TYPE_UNKNOWN
    HBM = amdsmi_wrapper.AMDSMI_VRAM_TYPE_HBM
    HBM2 = amdsmi_wrapper.AMDSMI_VRAM_TYPE_HBM2
    HBM2E = amdsmi_wrapper.AMDSMI_VRAM_TYPE_HBM2E
    HBM3 = amdsmi_wrapper.AMDSMI_VRAM_TYPE_HBM3


# ECC/RAS blocks a datacenter part reports as enabled
_RAS_ENABLED_BLOCKS = ('UMC', 'SDMA', 'GFX', 'MMHUB', 'PCIE_BIF', 'HDP', 'XGMI_WAFL')


# ---------------------------------------------------------------------------
# plumbing


def _fail(code):
    raise AmdSmiLibraryException(code)


def _check_handle(handle):
    if not isinstance(handle, amdsmi_wrapper.amdsmi_processor_handle):
        raise AmdSmiParameterException(handle, amdsmi_wrapper.amdsmi_processor_handle)


def _state():
    if _init_count[0] <= 0:
        _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_INIT)
    try:
        state = _gs.load()
    except _gs.StateError:
        _fail(amdsmi_wrapper.AMDSMI_STATUS_DRIVER_NOT_LOADED)
    if state.get('vendor') != 'amd':
        _fail(amdsmi_wrapper.AMDSMI_STATUS_DRIVER_NOT_LOADED)
    return state


def _gpu(handle, allow_lost=False):
    _check_handle(handle)
    state = _state()
    gpu = _gs.gpu_by_index(state, (handle.value or 0) - _HANDLE_BASE)
    if gpu is None:
        _fail(amdsmi_wrapper.AMDSMI_STATUS_INVAL)
    if gpu.get('lost') and not allow_lost:
        _fail(_LOST_STATUS)
    return state, gpu


def _handle(index):
    return amdsmi_wrapper.amdsmi_processor_handle(_HANDLE_BASE + index)


def _bdf_parts(gpu):
    return _gs._norm_bus_id(gpu.get('pci_bus_id', '0:0.0'))  # pylint: disable=protected-access


def _is_mi300(gpu):
    return 'MI300' in str(gpu.get('name', '')).upper()


def _parse_bdf(bdf):
    if not isinstance(bdf, str):
        return None
    match = re.match(r'^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])$', bdf)
    if match:
        return [int(x, 16) for x in match.groups()]
    match = re.match(r'^([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])$', bdf)
    if match:
        return [0] + [int(x, 16) for x in match.groups()]
    return None


def _boot_time():
    try:
        with open('/proc/stat') as handle:
            for line in handle:
                if line.startswith('btime '):
                    return float(line.split()[1])
    except (IOError, OSError):
        pass
    return 0.0


def _comm(pid):
    try:
        with open('/proc/%d/comm' % pid) as handle:
            return handle.read().strip()
    except (IOError, OSError):
        return ''


def _listed(state, index):
    return [e for e in state.get('processes', []) if e.get('gpu') == index and _gs.entry_listed(e)]


def _gfx_ns(entry, now):
    try:
        ticks = os.sysconf('SC_CLK_TCK')
    except (ValueError, OSError):
        ticks = 100
    started = _boot_time() + float(entry.get('starttime') or 0) / ticks
    return int(max(0.0, now - started) * 1e9 * (entry.get('util_pct') or 0) / 100.0)


# ---------------------------------------------------------------------------
# library setup and discovery


def amdsmi_init(flag=AmdSmiInitFlags.INIT_AMD_GPUS):
    if not isinstance(flag, AmdSmiInitFlags):
        raise AmdSmiParameterException(flag, AmdSmiInitFlags)
    try:
        state = _gs.load()
    except _gs.StateError:
        state = None
    if state is None or state.get('vendor') != 'amd':
        _fail(amdsmi_wrapper.AMDSMI_STATUS_DRIVER_NOT_LOADED)
    _init_count[0] += 1


def amdsmi_shut_down():
    if _init_count[0] > 0:
        _init_count[0] -= 1


def amdsmi_get_lib_version():
    return {'major': 25, 'minor': 5, 'release': 1, 'build': '7.0.2-gpusim'}


def amdsmi_get_processor_handles():
    return [_handle(g['index']) for g in _state().get('gpus', [])]


def amdsmi_get_processor_type(processor_handle):
    _gpu(processor_handle, allow_lost=True)
    return {'processor_type': AmdSmiProcessorType.AMDSMI_PROCESSOR_TYPE_AMD_GPU.name}


def amdsmi_get_processor_handle_from_bdf(bdf):
    parts = _parse_bdf(bdf)
    if parts is None:
        raise AmdSmiBdfFormatException(bdf)
    for gpu in _state().get('gpus', []):
        if list(_bdf_parts(gpu) or ()) == parts:
            return _handle(gpu['index'])
    return _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_FOUND)


def amdsmi_get_gpu_device_bdf(processor_handle):
    _state_unused, gpu = _gpu(processor_handle, allow_lost=True)
    dom, bus, dev, fn = _bdf_parts(gpu)
    return '%04x:%02x:%02x.%x' % (dom & 0xFFFF, bus, dev, fn)


def amdsmi_get_gpu_bdf_id(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    dom, bus, dev, fn = _bdf_parts(gpu)
    return (dom << 32) | (bus << 8) | (dev << 3) | fn


def amdsmi_get_gpu_device_uuid(processor_handle):
    return str(_gpu(processor_handle)[1]['uuid'])


def amdsmi_get_gpu_id(processor_handle):
    return 0x74A1 if _is_mi300(_gpu(processor_handle)[1]) else 0x740C


def amdsmi_get_gpu_enumeration_info(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    minor = gpu.get('minor', gpu['index'])
    return {
        'drm_render': 128 + minor,
        'drm_card': minor,
        'hsa_id': gpu['index'] + 1,
        'hip_id': gpu['index'],
        'hip_uuid': 'GPU-' + str(gpu['uuid']).replace('-', '')[:16],
    }


def amdsmi_get_gpu_asic_info(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    mi300 = _is_mi300(gpu)
    return {
        'market_name': gpu.get('name') or 'N/A',
        'vendor_id': '0x1002',
        'vendor_name': 'Advanced Micro Devices Inc. [AMD/ATI]',
        'subvendor_id': '0x1002',
        'device_id': '0x74a1' if mi300 else '0x740c',
        'rev_id': '0x00' if mi300 else '0x01',
        'asic_serial': '0x%016X' % int(str(gpu['uuid']).replace('-', '')[:16], 16),
        'oam_id': gpu['index'],
        'num_compute_units': 304 if mi300 else 220,
        'target_graphics_version': 'gfx942' if mi300 else 'gfx90a',
        'subsystem_id': '0x74a1' if mi300 else '0x0b0c',
    }


def amdsmi_get_gpu_kfd_info(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    return {'kfd_id': 0x1000 + gpu['index'], 'node_id': gpu['index'] + 1, 'current_partition_id': 0}


def amdsmi_get_gpu_driver_info(processor_handle):
    _gpu(processor_handle)
    return {'driver_name': 'amdgpu', 'driver_version': _DRIVER_VERSION, 'driver_date': '2015/01/01 00:00'}


# ---------------------------------------------------------------------------
# memory, activity, sensors


def amdsmi_get_gpu_vram_info(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    return {
        'vram_type': int(AmdSmiVramType.HBM3 if _is_mi300(gpu) else AmdSmiVramType.HBM2E),
        'vram_vendor': 'SAMSUNG',
        'vram_size': int(gpu.get('memory_total_mib') or 0),
        'vram_bit_width': 8192,
        'vram_max_bandwidth': 'N/A',
    }


def amdsmi_get_gpu_vram_usage(processor_handle):
    state, gpu = _gpu(processor_handle)
    return {'vram_total': int(gpu.get('memory_total_mib') or 0),
            'vram_used': int(_gs.gpu_used_mib(state, gpu['index']) or 0)}


def amdsmi_get_gpu_memory_total(processor_handle, mem_type):
    _check_handle(processor_handle)
    if not isinstance(mem_type, AmdSmiMemoryType):
        raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
    _state_unused, gpu = _gpu(processor_handle)
    if mem_type == AmdSmiMemoryType.GTT:
        return 512 * 1024 * _MIB
    return int(gpu.get('memory_total_mib') or 0) * _MIB


def amdsmi_get_gpu_memory_usage(processor_handle, mem_type):
    _check_handle(processor_handle)
    if not isinstance(mem_type, AmdSmiMemoryType):
        raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
    state, gpu = _gpu(processor_handle)
    if mem_type == AmdSmiMemoryType.GTT:
        return 0
    return int(_gs.gpu_used_mib(state, gpu['index']) or 0) * _MIB


def amdsmi_get_gpu_activity(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    return {'gfx_activity': int(gpu.get('util_pct') or 0), 'umc_activity': int(gpu.get('mem_util_pct') or 0),
            'mm_activity': 'N/A'}


_TEMP_OFFSETS = {
    AmdSmiTemperatureType.EDGE: 0, AmdSmiTemperatureType.HOTSPOT: 9, AmdSmiTemperatureType.VRAM: 4,
    AmdSmiTemperatureType.HBM_0: 4, AmdSmiTemperatureType.HBM_1: 5, AmdSmiTemperatureType.HBM_2: 4,
    AmdSmiTemperatureType.HBM_3: 5,
}
_TEMP_LIMITS = {AmdSmiTemperatureMetric.CRITICAL: 100, AmdSmiTemperatureMetric.EMERGENCY: 105}


def amdsmi_get_temp_metric(processor_handle, sensor_type, metric):
    _check_handle(processor_handle)
    if not isinstance(sensor_type, AmdSmiTemperatureType):
        raise AmdSmiParameterException(sensor_type, AmdSmiTemperatureType)
    if not isinstance(metric, AmdSmiTemperatureMetric):
        raise AmdSmiParameterException(metric, AmdSmiTemperatureMetric)
    _state_unused, gpu = _gpu(processor_handle)
    if sensor_type not in _TEMP_OFFSETS:
        return _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED)
    if metric == AmdSmiTemperatureMetric.CURRENT:
        return int(gpu.get('temp_c') or 0) + _TEMP_OFFSETS[sensor_type]
    if metric in _TEMP_LIMITS:
        return _TEMP_LIMITS[metric] + (10 if sensor_type == AmdSmiTemperatureType.HOTSPOT else 0)
    return _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED)


def amdsmi_get_power_info(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    watts = int(round(float(gpu.get('power_w') or 0)))
    return {
        'socket_power': watts,
        'current_socket_power': 'N/A',
        'average_socket_power': watts,
        'gfx_voltage': 'N/A',
        'soc_voltage': 'N/A',
        'mem_voltage': 'N/A',
        # amd_smi.cc copies hwmon power1_cap here: micro-watts
        'power_limit': int(round(float(gpu.get('power_limit_w') or 0) * 1000000)),
    }


def amdsmi_get_power_cap_info(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    cap = int(round(float(gpu.get('power_limit_w') or 0) * 1000000))
    return {'power_cap': cap, 'default_power_cap': cap, 'dpm_cap': 1700, 'min_power_cap': 0, 'max_power_cap': cap}


# ---------------------------------------------------------------------------
# processes


def amdsmi_get_gpu_process_list(processor_handle):
    state, gpu = _gpu(processor_handle)
    if gpu.get('no_permission'):
        _fail(amdsmi_wrapper.AMDSMI_STATUS_NO_PERM)
    now = time.time()
    me = os.geteuid()
    out = []
    for entry in _listed(state, gpu['index']):
        name = _comm(entry['pid']) or os.path.basename((entry.get('argv') or ['N/A'])[0])
        if me != 0:
            try:
                owner = os.stat('/proc/%d' % entry['pid']).st_uid
            except OSError:
                owner = -1
            if owner != me:
                name = 'N/A'
        vram = int(entry.get('used_mib') or 0) * _MIB
        out.append({
            'name': name or 'N/A',
            'pid': entry['pid'],
            'mem': vram,
            'engine_usage': {'gfx': _gfx_ns(entry, now), 'enc': 0},
            'memory_usage': {'gtt_mem': 0, 'cpu_mem': 0, 'vram_mem': vram},
            'cu_occupancy': int(entry.get('util_pct') or 0) * (3 if _is_mi300(gpu) else 2),
        })
    return out


def _compute_info(entry):
    return {'process_id': entry['pid'], 'vram_usage': int(entry.get('used_mib') or 0) * _MIB,
            'sdma_usage': 0, 'cu_occupancy': int(entry.get('util_pct') or 0)}


def _live_compute(state):
    return [e for e in state.get('processes', [])
            if e.get('type', 'compute') == 'compute' and _gs.entry_listed(e)
            and not (_gs.gpu_by_index(state, e.get('gpu')) or {}).get('lost')]


def amdsmi_get_gpu_compute_process_info():
    seen = {}
    for entry in _live_compute(_state()):
        seen.setdefault(entry['pid'], _compute_info(entry))
    return list(seen.values())


def amdsmi_get_gpu_compute_process_info_by_pid(pid):
    if not isinstance(pid, int):
        raise AmdSmiParameterException(pid, int)
    for entry in _live_compute(_state()):
        if entry['pid'] == pid:
            return _compute_info(entry)
    return _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_FOUND)


def amdsmi_get_gpu_compute_process_gpus(pid):
    if not isinstance(pid, int):
        raise AmdSmiParameterException(pid, int)
    gpus = sorted(set(e['gpu'] for e in _live_compute(_state()) if e['pid'] == pid))
    if not gpus:
        _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_FOUND)
    return gpus


# ---------------------------------------------------------------------------
# ECC / RAS


def amdsmi_get_gpu_total_ecc_count(processor_handle):
    _state_unused, gpu = _gpu(processor_handle)
    return {'correctable_count': int(gpu.get('ecc_corrected') or 0),
            'uncorrectable_count': int(gpu.get('ecc_uncorrected') or 0),
            'deferred_count': 0}


def amdsmi_get_gpu_ecc_count(processor_handle, block):
    _check_handle(processor_handle)
    if not isinstance(block, AmdSmiGpuBlock):
        raise AmdSmiParameterException(block, AmdSmiGpuBlock)
    _state_unused, gpu = _gpu(processor_handle)
    if block.name not in _RAS_ENABLED_BLOCKS:
        return _fail(amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED)
    if block != AmdSmiGpuBlock.UMC:
        return {'correctable_count': 0, 'uncorrectable_count': 0, 'deferred_count': 0}
    return amdsmi_get_gpu_total_ecc_count(processor_handle)


def amdsmi_get_gpu_ecc_enabled(processor_handle):
    _gpu(processor_handle)
    mask = 0
    for name in _RAS_ENABLED_BLOCKS:
        mask |= int(AmdSmiGpuBlock[name])
    return mask


def amdsmi_get_gpu_ras_block_features_enabled(processor_handle):
    _gpu(processor_handle)
    out = []
    for block in AmdSmiGpuBlock:
        if block.name in ('RESERVED', 'INVALID'):
            continue
        status = AmdSmiRasErrState.ENABLED if block.name in _RAS_ENABLED_BLOCKS else AmdSmiRasErrState.DISABLED
        out.append({'block': block.name, 'status': status.name})
    return out


# ---------------------------------------------------------------------------
# reset


def amdsmi_reset_gpu(processor_handle):
    _gpu(processor_handle, allow_lost=True)
    if os.geteuid() != 0:
        _fail(amdsmi_wrapper.AMDSMI_STATUS_NO_PERM)
    index = processor_handle.value - _HANDLE_BASE
    with _gs.locked() as state:
        gpu = _gs.gpu_by_index(state, index)
        if gpu is None:
            _fail(amdsmi_wrapper.AMDSMI_STATUS_INVAL)
        if _gs.busy_entries(state, index):
            _fail(amdsmi_wrapper.AMDSMI_STATUS_BUSY)
        _gs.apply_reset(state, gpu)
