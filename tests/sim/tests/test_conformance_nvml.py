"""Every nvml* symbol the shim exports is a real NVML name (as nvidia-ml-py's pynvml.py knows it)."""

import importlib.util
import os
import re
import shutil
import struct
import subprocess

import pytest

from conftest import SHIM_SONAME

# Real libnvidia-ml exports these and nvml.h maps its unversioned names onto them
# (#define nvmlInit nvmlInit_v2), but pynvml.py never spells them out.
REAL_NVML_NAMES_PYNVML_LACKS = {'nvmlInit_v2', 'nvmlDeviceGetPciInfo_v2'}

REQUIRED = {
    'nvmlInit', 'nvmlInit_v2', 'nvmlInitWithFlags', 'nvmlShutdown', 'nvmlErrorString',
    'nvmlSystemGetDriverVersion', 'nvmlSystemGetNVMLVersion', 'nvmlSystemGetCudaDriverVersion', 'nvmlSystemGetCudaDriverVersion_v2',
    'nvmlDeviceGetCount', 'nvmlDeviceGetCount_v2', 'nvmlDeviceGetHandleByIndex', 'nvmlDeviceGetHandleByIndex_v2',
    'nvmlDeviceGetHandleByUUID', 'nvmlDeviceGetHandleByPciBusId', 'nvmlDeviceGetHandleByPciBusId_v2', 'nvmlDeviceGetIndex',
    'nvmlDeviceGetName', 'nvmlDeviceGetUUID', 'nvmlDeviceGetPciInfo', 'nvmlDeviceGetPciInfo_v2', 'nvmlDeviceGetPciInfo_v3',
    'nvmlDeviceGetMinorNumber', 'nvmlDeviceGetMemoryInfo', 'nvmlDeviceGetUtilizationRates', 'nvmlDeviceGetTemperature',
    'nvmlDeviceGetTemperatureV', 'nvmlDeviceGetPowerUsage', 'nvmlDeviceGetPowerManagementLimit', 'nvmlDeviceGetEnforcedPowerLimit',
    'nvmlDeviceGetFanSpeed', 'nvmlDeviceGetPersistenceMode', 'nvmlDeviceGetMigMode', 'nvmlDeviceIsMigDeviceHandle',
    'nvmlDeviceGetTotalEccErrors', 'nvmlDeviceGetRemappedRows', 'nvmlDeviceGetProcessUtilization',
    'nvmlDeviceGetComputeRunningProcesses', 'nvmlDeviceGetGraphicsRunningProcesses', 'nvmlDeviceGetMPSComputeRunningProcesses',
    'nvmlDeviceGetComputeRunningProcesses_v2', 'nvmlDeviceGetGraphicsRunningProcesses_v2', 'nvmlDeviceGetMPSComputeRunningProcesses_v2',
    'nvmlDeviceGetPerformanceState', 'nvmlDeviceGetDisplayActive', 'nvmlDeviceGetComputeMode', 'nvmlDeviceGetEncoderUtilization',
    'nvmlDeviceGetDecoderUtilization', 'nvmlDeviceGetDriverModel_v2', 'nvmlDeviceGetCudaComputeCapability',
    'nvmlDeviceGetClockInfo', 'nvmlDeviceGetMaxClockInfo', 'nvmlDeviceQueryDrainState', 'nvmlDeviceModifyDrainState',
}
ABSENT_IN_R470 = {
    'nvmlDeviceGetComputeRunningProcesses_v3', 'nvmlDeviceGetGraphicsRunningProcesses_v3',
    'nvmlDeviceGetMPSComputeRunningProcesses_v3', 'nvmlDeviceGetMemoryInfo_v2',
}


def exported_functions(path):
    """Names of the defined global/weak FUNC symbols in an ELF64 little-endian .so's .dynsym."""
    with open(path, 'rb') as f:
        data = f.read()
    assert data[:4] == b'\x7fELF' and data[4] == 2 and data[5] == 1, 'not an ELF64 little-endian file'
    shoff, = struct.unpack_from('<Q', data, 0x28)
    shentsize, shnum = struct.unpack_from('<HH', data, 0x3A)
    sections = [struct.unpack_from('<IIQQQQIIQQ', data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for sh_name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info, _other, st_shndx = struct.unpack_from('<IBBH', data, pos)
            if st_shndx == 0 or (st_info & 0xF) != 2 or (st_info >> 4) not in (1, 2):  # undefined / not FUNC / local
                continue
            end = data.index(b'\0', strtab_offset + st_name)
            names.add(data[strtab_offset + st_name:end].decode())
    return names


@pytest.fixture(scope='module')
def pynvml_source():
    spec = importlib.util.find_spec('pynvml')
    if spec is None or not spec.origin or not spec.origin.endswith('.py'):
        pytest.skip('nvidia-ml-py (pynvml.py) is not installed')
    with open(spec.origin) as f:
        return f.read()


@pytest.mark.parametrize('variant', ['full', 'r470'])
def test_exports_are_real_nvml_names(shim_dirs, pynvml_source, variant):
    symbols = exported_functions(os.path.join(shim_dirs[variant], SHIM_SONAME))
    nvml = {s for s in symbols if s.startswith('nvml')}
    assert symbols - nvml == set(), 'helpers must be static'
    known = set(re.findall(r'\bnvml[A-Za-z0-9_]+', pynvml_source)) | REAL_NVML_NAMES_PYNVML_LACKS
    assert sorted(nvml - known) == []
    assert sorted(REQUIRED - nvml) == []
    if variant == 'full':
        assert sorted(ABSENT_IN_R470 - nvml) == []
    else:
        assert sorted(ABSENT_IN_R470 & nvml) == []


@pytest.mark.parametrize('variant', ['full', 'r470'])
def test_conf_compute_symbols_both_or_neither(shim_dirs, variant):
    """nvitop assumes a 32-byte process entry when only the first of these exists (pitfall 3)."""
    symbols = exported_functions(os.path.join(shim_dirs[variant], SHIM_SONAME))
    pair = {'nvmlDeviceGetConfComputeMemSizeInfo', 'nvmlDeviceGetRunningProcessDetailList'}
    assert len(pair & symbols) in (0, 2)


def test_elf_reader_agrees_with_nm(shim_dirs):
    nm = shutil.which('nm')
    if not nm:
        pytest.skip('nm is not installed')
    path = os.path.join(shim_dirs['full'], SHIM_SONAME)
    out = subprocess.run([nm, '-D', '--defined-only', path], stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
    from_nm = {line.split()[-1] for line in out.splitlines() if line.split()[1:2] in (['T'], ['W'])}
    assert exported_functions(path) == from_nm
