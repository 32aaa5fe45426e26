"""The fake libnvidia-ml.so.1 seen through the real pynvml: every field of the state file."""

import os
import signal
import subprocess
import sys

import pytest

from conftest import MIB, make_gpu, make_process, probe, shim_env, write_state

pytest.importorskip('pynvml')

NOT_SUPPORTED = {'error': 'NVMLError_NotSupported', 'code': 3}
GPU_IS_LOST = {'error': 'NVMLError_GpuIsLost', 'code': 15}
NO_PERMISSION = {'error': 'NVMLError_NoPermission', 'code': 4}
NOT_FOUND = {'error': 'NVMLError_NotFound', 'code': 6}
VERSION_MISMATCH = {'error': 'NVMLError_ArgumentVersionMismatch', 'code': 25}
NO_MIG = 0xFFFFFFFF


def test_system_and_identity(shim_dirs, state_path):
    gpus = [
        make_gpu(0, uuid='GPU-aaaaaaaa-1111-2222-3333-444444444444', name='NVIDIA A100-SXM4-80GB', pci_bus_id='00000000:07:00.0', minor=0),
        make_gpu(1, uuid='GPU-bbbbbbbb-1111-2222-3333-444444444444', name='NVIDIA H100 80GB HBM3', pci_bus_id='00000000:0A:00.0', minor=3),
    ]
    write_state(state_path, gpus=gpus, driver_version='550.54.15', nvml_version='12.550.54.15', cuda_driver_version=12040)
    out = probe(state_path, shim_dirs['full'])
    assert out['init'] is None
    assert out['driver_version'] == '550.54.15'
    assert out['nvml_version'] == '12.550.54.15'
    assert out['cuda'] == 12040
    assert out['cuda_v2'] == 12040
    assert out['count'] == 2
    d0, d1 = out['devices']
    assert (d0['index'], d1['index']) == (0, 1)
    assert d0['name'] == 'NVIDIA A100-SXM4-80GB'
    assert d1['name'] == 'NVIDIA H100 80GB HBM3'
    assert d0['uuid'] == gpus[0]['uuid']
    assert d1['by_uuid_index'] == 1
    assert d1['pci']['busId'] == '00000000:0A:00.0'
    assert d1['pci']['legacy'] == '0000:0A:00.0'
    assert (d1['pci']['domain'], d1['pci']['bus'], d1['pci']['device']) == (0, 0x0A, 0)
    assert (d0['minor'], d1['minor']) == (0, 3)
    assert d0['is_mig'] == 0
    assert d0['mig'] == [0, 0]


def test_metrics(shim_dirs, state_path):
    gpu = make_gpu(0, util_pct=37, mem_util_pct=12, temp_c=41, power_w=61.5, power_limit_w=400.0, fan_pct=None,
                   persistence=True, mig=True, ecc_uncorrected=2, ecc_corrected=5,
                   remapped_rows={'correctable': 3, 'uncorrectable': 1, 'pending': True, 'failure': False})
    gpu2 = make_gpu(1, fan_pct=55, persistence=False, compute_capability='9.0', drain=True)
    write_state(state_path, gpus=[gpu, gpu2])
    d0, d1 = probe(state_path, shim_dirs['full'])['devices']
    assert d0['util'] == [37, 12]
    assert d0['temp'] == 41
    assert d0['tempv'] == 41
    assert d0['power'] == 61500
    assert d0['power_limit'] == 400000
    assert d0['enforced_limit'] == 400000
    assert d0['fan'] == NOT_SUPPORTED
    assert d1['fan'] == 55
    assert (d0['persistence'], d1['persistence']) == (1, 0)
    assert d0['mig'] == [1, 1]
    assert d0['ecc_unc'] == 2
    assert d0['ecc_corr'] == 5
    assert d0['remapped'] == [3, 1, 1, 0]
    assert d0['cc'] == [8, 0]
    assert d1['cc'] == [9, 0]
    assert d0['pstate'] == 0
    assert d0['compute_mode'] == 0
    assert d0['display_active'] == 0
    assert d0['encoder'][0] == 0
    assert d0['clock'] == NOT_SUPPORTED
    assert (d0['drain'], d1['drain']) == (0, 1)


def test_memory_v1_v2(shim_dirs, state_path, spawn):
    a, b = spawn(), spawn()
    procs = [make_process(a.pid, gpu=0, used_mib=1024), make_process(b.pid, gpu=0, used_mib=None)]
    write_state(state_path, gpus=[make_gpu(0, memory_total_mib=81559, memory_reserved_mib=512, leaked_mib=100)], processes=procs)
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    total = 81559 * MIB
    used = (512 + 100 + 1024) * MIB
    assert d0['mem_v1'] == {'total': total, 'used': used, 'free': total - used}
    assert d0['mem_v2'] == {'version': 0x02000028, 'total': total, 'reserved': 512 * MIB,
                            'used': used - 512 * MIB, 'free': total - used}
    assert d0['mem_bad_version'] == VERSION_MISMATCH


def test_process_lists_v3_and_v2(shim_dirs, state_path, spawn):
    c, g, m, other = spawn(), spawn(), spawn(), spawn()
    procs = [
        make_process(c.pid, gpu=0, used_mib=4096, type='compute', util_pct=55),
        make_process(g.pid, gpu=0, used_mib=2048, type='graphics', util_pct=7),
        make_process(m.pid, gpu=0, used_mib=None, type='mps'),
        make_process(other.pid, gpu=1, used_mib=300),
    ]
    write_state(state_path, gpus=2, processes=procs)
    d0, d1 = probe(state_path, shim_dirs['full'])['devices']
    compute = [{'pid': c.pid, 'used': 4096 * MIB, 'gi': NO_MIG, 'ci': NO_MIG}]
    assert d0['compute'] == compute
    assert d0['compute_v3'] == compute
    assert d0['compute_v2'] == compute
    assert d0['graphics'] == d0['graphics_v2'] == [{'pid': g.pid, 'used': 2048 * MIB, 'gi': NO_MIG, 'ci': NO_MIG}]
    # used_mib null reads as None (NVML_VALUE_NOT_AVAILABLE) and counts as 0.
    assert d0['mps'] == d0['mps_v2'] == [{'pid': m.pid, 'used': None, 'gi': NO_MIG, 'ci': NO_MIG}]
    assert d0['mem_v1']['used'] == (4096 + 2048) * MIB
    assert [p['pid'] for p in d1['compute']] == [other.pid]
    assert d1['graphics'] == [] and d1['mps'] == []
    # One process-utilization sample per listed process, none newer than a future timestamp.
    assert sorted((s['pid'], s['sm']) for s in d0['putil']) == sorted([(c.pid, 55), (g.pid, 7), (m.pid, 0)])
    assert d0['putil_future'] == NOT_FOUND


def test_no_processes(shim_dirs, state_path):
    write_state(state_path, gpus=1)
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    for key in ('compute', 'compute_v2', 'compute_v3', 'graphics', 'graphics_v2', 'mps', 'mps_v2'):
        assert d0[key] == [], key
    assert d0['putil'] == NOT_FOUND
    assert d0['mem_v1']['used'] == 0


def test_lost_gpu_does_not_hide_others(shim_dirs, state_path, spawn):
    a, b = spawn(), spawn()
    write_state(state_path, gpus=[make_gpu(0), make_gpu(1, lost=True), make_gpu(2)],
                processes=[make_process(a.pid, gpu=1), make_process(b.pid, gpu=2)])
    out = probe(state_path, shim_dirs['full'])
    assert out['count'] == 3
    d0, lost, d2 = out['devices']
    assert d0['name'] == d2['name'] == 'NVIDIA A100-SXM4-80GB'
    assert [p['pid'] for p in d2['compute']] == [b.pid]
    # Identity-free calls still answer; everything else is GPU_IS_LOST.
    assert lost['index'] == 1
    for key in ('name', 'uuid', 'pci', 'minor', 'mem_v1', 'mem_v2', 'util', 'temp', 'tempv', 'power', 'fan',
                'persistence', 'ecc_unc', 'remapped', 'compute', 'compute_v2', 'graphics', 'putil'):
        assert lost[key] == GPU_IS_LOST, key


def test_no_permission(shim_dirs, state_path, spawn):
    a = spawn()
    write_state(state_path, gpus=[make_gpu(0, no_permission=True)], processes=[make_process(a.pid, used_mib=700)])
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    for key in ('compute', 'compute_v2', 'compute_v3', 'graphics', 'graphics_v2', 'mps', 'mps_v2', 'putil'):
        assert d0[key] == NO_PERMISSION, key
    assert d0['mem_v1']['used'] == 700 * MIB


def test_missing_keys_get_defaults(shim_dirs, state_path):
    write_state(state_path, gpus=[{}, {'index': 1, 'fan_pct': 30}], driver_version=None)
    out = probe(state_path, shim_dirs['full'])
    assert out['count'] == 2
    d0, d1 = out['devices']
    assert d0['name'] == 'NVIDIA A100-SXM4-80GB'
    assert d0['uuid'].startswith('GPU-') and d0['uuid'] != d1['uuid']
    assert d0['pci']['busId'] != d1['pci']['busId']
    assert d0['mem_v1']['total'] == 81559 * MIB
    assert d0['fan'] == NOT_SUPPORTED
    assert d1['fan'] == 30
    assert out['driver_version'] == '550.54.15'


@pytest.mark.parametrize('case', ['unset', 'missing', 'bad_json', 'not_an_object', 'amd'])
def test_init_without_a_usable_state(shim_dirs, state_path, case):
    if case == 'unset':
        state_path = None
    elif case == 'bad_json':
        with open(state_path, 'w') as f:
            f.write('{"schema": 1, "gpus": [')
    elif case == 'not_an_object':
        with open(state_path, 'w') as f:
            f.write('[1, 2, 3]')
    elif case == 'amd':
        write_state(state_path, gpus=1, vendor='amd')
    out = probe(state_path, shim_dirs['full'])
    assert out['init'] == {'error': 'NVMLError_DriverNotLoaded', 'code': 9}


def test_state_is_private_to_the_env_var(shim_dirs, tmp_path):
    """Two state files, two processes: each sees its own (the shim keeps no global cache file)."""
    one, two = str(tmp_path / 'one.json'), str(tmp_path / 'two.json')
    write_state(one, gpus=1)
    write_state(two, gpus=4)
    assert probe(one, shim_dirs['full'])['count'] == 1
    assert probe(two, shim_dirs['full'])['count'] == 4
    assert os.path.exists(one) and os.path.exists(two)


SEGFAULT_PROBE = r'''
import sys
import pynvml as N
N.nvmlInit()
for i in range(3):
    sys.stdout.write('count %d\n' % N.nvmlDeviceGetCount())
    sys.stdout.flush()
sys.stdout.write('procs %d\n' % len(N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(0))))
sys.stdout.flush()
sys.stdout.write('done\n')
'''


@pytest.mark.parametrize('spec,lines', [('nvmlDeviceGetCount_v2', 0), ('nvmlDeviceGetCount_v2:3', 2), ('*:2', 0),
                                        ('nvmlInitWithFlags', 0), ('nvmlDeviceGetName', 5), ('nvmlDeviceGetCount_v2:x', 0),
                                        ('nvmlDeviceGetComputeRunningProcesses_v3', 3)])
def test_segfault_knob_kills_only_the_nth_matching_call(shim_dirs, state_path, spec, lines):
    """GPUSIM_NVML_SEGFAULT=FUNCTION[:N]: the Nth call of FUNCTION in this process dies of SIGSEGV
    (``*`` counts every call: init is the first); other functions and earlier calls answer normally."""
    write_state(state_path, gpus=2)
    env = shim_env(state_path, shim_dirs['full'], {'GPUSIM_NVML_SEGFAULT': spec, 'PYTHONFAULTHANDLER': ''})
    proc = subprocess.run([sys.executable, '-c', SEGFAULT_PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=60, check=False)
    out = proc.stdout.decode().splitlines()
    expected = ['count 2'] * 3 + ['procs 0', 'done']
    if lines == len(expected):                         # never called: no crash
        assert proc.returncode == 0 and out == expected
    else:
        assert proc.returncode == -signal.SIGSEGV and out == expected[:lines]
