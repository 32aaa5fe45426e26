"""An R470 driver: no *_v3 process lists and no nvmlDeviceGetMemoryInfo_v2; callers fall back."""

import json

import pytest

from conftest import MIB, make_process, probe, run_python, write_raw_state, write_state

pytest.importorskip('pynvml')

MISMATCH = {'error': 'NVMLLibraryMismatchError', 'code': None}
FUNCTION_NOT_FOUND = {'error': 'NVMLError_FunctionNotFound', 'code': 13}

FALLBACK = r'''
import json
import pynvml as N
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
try:
    procs = N.nvmlDeviceGetComputeRunningProcesses(h)
    how = 'v3'
except N.NVMLLibraryMismatchError:
    procs = N.nvmlDeviceGetComputeRunningProcesses_v2(h)
    how = 'v2'
try:
    mem = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    mem_how = 'v2'
except N.NVMLError_FunctionNotFound:
    mem = N.nvmlDeviceGetMemoryInfo(h)
    mem_how = 'v1'
print(json.dumps([how, [[p.pid, p.usedGpuMemory] for p in procs], mem_how, mem.used]))
'''


@pytest.mark.parametrize('variant, driver', [('r470', 'r470'), ('r470', 'r550'), ('full', 'r470')])
def test_r470_has_no_v3_and_no_memory_v2(shim_dirs, state_path, spawn, variant, driver):
    """The -DSIM_R470 build lacks the symbols; the full build answers FUNCTION_NOT_FOUND for r470 states."""
    a, b = spawn(), spawn()
    write_state(state_path, gpus=1, driver=driver,
                processes=[make_process(a.pid, used_mib=256), make_process(b.pid, used_mib=128, type='graphics')])
    d0 = probe(state_path, shim_dirs[variant])['devices'][0]
    for key in ('compute', 'graphics', 'mps'):
        assert d0[key] == MISMATCH, key        # the unversioned pynvml wrappers call *_v3
    assert d0['compute_v3'] == FUNCTION_NOT_FOUND
    assert d0['mem_v2'] == FUNCTION_NOT_FOUND
    assert [(p['pid'], p['used']) for p in d0['compute_v2']] == [(a.pid, 256 * MIB)]
    assert [p['pid'] for p in d0['graphics_v2']] == [b.pid]
    assert d0['mps_v2'] == []
    assert d0['mem_v1']['used'] == 384 * MIB
    assert run_python(FALLBACK, state_path, shim_dirs[variant]) == ['v2', [[a.pid, 256 * MIB]], 'v1', 384 * MIB]


def test_full_build_with_r550_state_uses_v3(shim_dirs, state_path, spawn):
    a = spawn()
    write_state(state_path, gpus=1, processes=[make_process(a.pid, used_mib=256)])
    assert run_python(FALLBACK, state_path, shim_dirs['full']) == ['v3', [[a.pid, 256 * MIB]], 'v2', 256 * MIB]


def test_r470_default_versions(shim_dirs, state_path):
    state = write_state(state_path, gpus=1, driver='r470')
    for key in ('driver_version', 'nvml_version', 'cuda_driver_version'):
        del state[key]
    write_raw_state(state_path, json.dumps(state))
    out = probe(state_path, shim_dirs['r470'])
    assert out['driver_version'].startswith('470.')
    assert out['cuda'] == 11040
