# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""MIG in the simulator (issue #19): `gpusim init --mig`, `gpusim spawn --mig-instance`, the MIG device and
GPU-instance calls of the NVML shim through the real pynvml (every function), and nvitop's API run
unmodified on the shim against `gpusim show`."""

import json
import os
import pwd
import shutil
import subprocess
import sys

import pytest

from conftest import SIM_DIR, SHIM_SONAME, _demote, interpreter_for, run_python, shim_env

sys.path.insert(0, SIM_DIR)
import gpusim_state as gs  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order

LAYOUT = '0:3g.71gb,2g.35gb,1g.18gb'
MIB = 1 << 20
NO_INSTANCE = 0xFFFFFFFF


def mig_node(node, *extra):
    node.init('--gpus', '2', '--mig', LAYOUT, *extra)
    return node


def instances(node, gpu=0):
    return node.gpu(gpu)['mig_instances']


# ---------------------------------------------------------------------------------------------- gpusim


def test_init_mig_lays_out_h200_instances(gpusim_node):
    node = mig_node(gpusim_node)
    gpu0, gpu1 = node.show()['gpus']
    assert gpu0['name'] == gpu1['name'] == 'NVIDIA H200' and gpu0['memory_total_mib'] == 143771
    assert gpu0['mig'] is True and gpu1['mig'] is False and 'mig_instances' not in gpu1
    got = [(i['gi'], i['ci'], i['profile'], i['placement'], i['memory_mib']) for i in gpu0['mig_instances']]
    assert got == [(1, 0, '3g.71gb', 0, 71680), (2, 0, '2g.35gb', 4, 35840), (3, 0, '1g.18gb', 6, 17920)]
    uuids = [i['uuid'] for i in gpu0['mig_instances']]
    assert all(u.startswith('MIG-') and len(u) == 40 for u in uuids) and len(set(uuids)) == 3
    # the cap files of every instance exist in the scratch dev dir (never under /dev)
    for inst in gpu0['mig_instances']:
        for path in gs.device_paths(node.raw(), gpu0, inst)[3:]:
            assert os.path.isfile(path) and path.startswith(node.dev_dir + '/nvidia-caps/nvidia-cap')


@pytest.mark.parametrize('layout, starts', [
    ('0:4g.71gb,3g.71gb', [0, 4]),
    ('0:1g.18gb,4g.71gb', [4, 0]),           # first fit would block the 4g: the placement search moves the 1g
    ('0:7g.141gb', [0]),
    ('0:' + ','.join(['1g.18gb'] * 7), [0, 1, 2, 3, 4, 5, 6]),
    ('0:1g.35gb,1g.35gb,1g.35gb,1g.35gb', [0, 2, 4, 6]),
    ('0:2g.35gb,2g.35gb,2g.35gb,1g.18gb', [0, 2, 4, 6]),
    ('0:2g.35gb,3g.71gb,2g.35gb', [0, 4, 2]),
])
def test_init_mig_accepts_real_placements(gpusim_node, layout, starts):
    gpusim_node.init('--gpus', '1', '--mig', layout)
    assert [i['placement'] for i in instances(gpusim_node)] == starts


@pytest.mark.parametrize('spec, needle', [
    ('0:5g.50gb', "unknown MIG profile '5g.50gb'"),
    ('0:3g.71gb,3g.71gb,3g.71gb', 'at most 2 instance(s) of 3g.71gb'),
    ('0:4g.71gb,4g.71gb', 'at most 1 instance(s) of 4g.71gb'),
    ('0:4g.71gb,3g.71gb,1g.18gb', 'need 8 compute slices, an H200 has 7'),
    ('0:1g.35gb,1g.35gb,1g.35gb,1g.35gb,1g.18gb', 'no placement fits'),
    ('0:3g.71gb,1g.35gb,1g.35gb,1g.35gb', 'no placement fits'),
    ('5:1g.18gb', 'unknown GPU index 5'),
    ('zero:1g.18gb', 'expects GPU:PROFILE'),
    ('0:', 'names no profile'),
])
def test_init_mig_refuses_bad_layouts_naming_the_value(gpusim_node, spec, needle):
    proc = gpusim_node.run('init', '--gpus', '2', '--mig', spec, check=False)
    assert proc.returncode == 2 and needle in proc.stderr and spec in proc.stderr, proc.stderr
    assert not os.path.exists(gpusim_node.state)


def test_init_mig_refuses_a_gpu_twice_and_other_boards(gpusim_node):
    proc = gpusim_node.run('init', '--mig', '0:1g.18gb', '--mig', '0:2g.35gb', check=False)
    assert proc.returncode == 2 and 'GPU 0 is given twice' in proc.stderr
    proc = gpusim_node.run('init', '--model', 'NVIDIA A100-SXM4-80GB', '--mig', '0:1g.18gb', check=False)
    assert proc.returncode == 2 and "'NVIDIA A100-SXM4-80GB'" in proc.stderr
    assert not os.path.exists(gpusim_node.state)


def test_init_without_mig_is_unchanged(gpusim_node):
    gpusim_node.init('--gpus', '1')
    gpu = gpusim_node.raw()['gpus'][0]
    assert gpu['name'] == 'NVIDIA A100-SXM4-80GB' and gpu['mig'] is False
    assert not [k for k in gpu if k.startswith('mig_') or k == 'compute_capability']


def test_spawn_on_mig_instance_records_ids_opens_caps_and_counts_memory_once(gpusim_node):
    node = mig_node(gpusim_node)
    a = node.spawn('--gpu', '0', '--mig-instance', '1', '--mib', '4096', '--children', '1')
    b = node.spawn('--gpu', '0', '--mig-instance', '2:0', '--mib', '1000')
    entry = node.entry(a)
    assert (entry['mig_gi'], entry['mig_ci']) == (1, 0) and node.entry(b)['mig_gi'] == 2
    links = set(os.readlink('/proc/%d/fd/%s' % (a, fd)) for fd in os.listdir('/proc/%d/fd' % a))
    gi_minor, ci_minor = gs.mig_cap_minors(0, 1, 0)
    assert (gi_minor, ci_minor) == (12, 13)
    assert {os.path.join(node.dev_dir, 'nvidia-caps', 'nvidia-cap12'), os.path.join(node.dev_dir, 'nvidia-caps', 'nvidia-cap13'),
            os.path.join(node.dev_dir, 'nvidia0')} <= links
    gpu0 = node.gpu(0)
    per = dict((i['gi'], (i['used_mib'], i['free_mib'], i['processes'])) for i in gpu0['mig_instances'])
    assert per == {1: (4096, 71680 - 4096, [a]), 2: (1000, 35840 - 1000, [b]), 3: (0, 17920, [])}
    assert gpu0['used_mib'] == 5096  # the board: the sum of its instances, never twice


def test_spawn_mig_errors_name_the_value(gpusim_node):
    node = mig_node(gpusim_node)
    proc = node.run('spawn', '--gpu', '0', '--mib', '10', '--', 'python', check=False)
    assert proc.returncode == 1 and 'give --mig-instance GI[:CI]' in proc.stderr and '1:0 3g.71gb' in proc.stderr
    proc = node.run('spawn', '--gpu', '0', '--mig-instance', '7:1', '--mib', '10', '--', 'python', check=False)
    assert proc.returncode == 1 and '--mig-instance 7:1' in proc.stderr
    proc = node.run('spawn', '--gpu', '1', '--mig-instance', '1', '--mib', '10', '--', 'python', check=False)
    assert proc.returncode == 1 and 'GPU 1 is not in MIG mode' in proc.stderr
    proc = node.run('spawn', '--gpu', '0', '--mig-instance', '1:x', '--mib', '10', '--', 'python', check=False)
    assert proc.returncode == 2 and "'1:x'" in proc.stderr
    assert node.raw()['processes'] == []


def test_spawn_beyond_the_instance_memory_fails_like_an_oom(gpusim_node):
    node = mig_node(gpusim_node)
    node.spawn('--gpu', '0', '--mig-instance', '3', '--mib', '17000')
    proc = node.run('spawn', '--gpu', '0', '--mig-instance', '3', '--mib', '1000', '--', 'python', check=False)
    assert proc.returncode == 1 and 'out of memory on MIG instance 3:0 (1g.18gb)' in proc.stderr and '920 MiB free' in proc.stderr
    assert len(node.raw()['processes']) == 1
    node.spawn('--gpu', '0', '--mig-instance', '3', '--mib', '920')  # exactly what is left still fits


def test_reset_destroys_the_instances_and_keeps_mig_mode(gpusim_node):
    node = mig_node(gpusim_node)
    state = node.raw()
    gs.apply_reset(state, state['gpus'][0])
    assert state['gpus'][0]['mig'] is True and state['gpus'][0]['mig_instances'] == []


# ---------------------------------------------------------------------------------------------- pynvml

PYNVML_MIG = r'''
import ctypes, json
import pynvml as N


def call(fn, *args):
    try:
        return fn(*args)
    except N.NVMLError as e:
        return {'error': e.value}


def text(v):
    return v.decode() if isinstance(v, bytes) else v


def procs(fn, h):
    res = call(fn, h)
    return res if isinstance(res, dict) else sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in res)


N.nvmlInit()
out = {'boards': []}
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    board = {'mig_mode': call(N.nvmlDeviceGetMigMode, h), 'max': call(N.nvmlDeviceGetMaxMigDeviceCount, h),
             'is_mig': int(N.nvmlDeviceIsMigDeviceHandle(h).value), 'gi_id': call(N.nvmlDeviceGetGpuInstanceId, h),
             'parent_of_board': call(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, h),
             'mem': call(lambda: N.nvmlDeviceGetMemoryInfo(h).used), 'util': call(lambda: N.nvmlDeviceGetUtilizationRates(h).gpu),
             'compute_v3': procs(N.nvmlDeviceGetComputeRunningProcesses_v3, h),
             'compute_v2': procs(N.nvmlDeviceGetComputeRunningProcesses_v2, h),
             'profiles': {}, 'migs': []}
    for profile in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT + 1):
        for version in (1, 2):
            info = call(N.nvmlDeviceGetGpuInstanceProfileInfo, h, profile, version)
            if not isinstance(info, dict):
                info = dict((f[0], text(getattr(info, f[0]))) for f in info._fields_ if f[0] != 'version')
            board['profiles']['%d/v%d' % (profile, version)] = info
    index = 0
    while True:
        m = call(N.nvmlDeviceGetMigDeviceHandleByIndex, h, index)
        if isinstance(m, dict):
            board['after_last_mig'] = m
            break
        parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        uuid = text(N.nvmlDeviceGetUUID(m))
        mv2 = N.nvmlDeviceGetMemoryInfo(m, version=N.nvmlMemory_v2)
        board['migs'].append({
            'is_mig': int(N.nvmlDeviceIsMigDeviceHandle(m).value), 'parent_index': N.nvmlDeviceGetIndex(parent),
            'gi': N.nvmlDeviceGetGpuInstanceId(m), 'ci': N.nvmlDeviceGetComputeInstanceId(m),
            'name': text(N.nvmlDeviceGetName(m)), 'uuid': uuid,
            'by_uuid_gi': N.nvmlDeviceGetGpuInstanceId(N.nvmlDeviceGetHandleByUUID(uuid)),
            'mem': [N.nvmlDeviceGetMemoryInfo(m).total, N.nvmlDeviceGetMemoryInfo(m).used],
            'mem_v2': [mv2.total, mv2.used, mv2.reserved],
            'compute_v3': procs(N.nvmlDeviceGetComputeRunningProcesses_v3, m),
            'compute_v1': sorted([p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses_v2(m)),
            'cc': list(N.nvmlDeviceGetCudaComputeCapability(m)),
            'temp_on_mig': call(N.nvmlDeviceGetTemperature, m, N.NVML_TEMPERATURE_GPU),
            'mig_mode_on_mig': call(N.nvmlDeviceGetMigMode, m),
        })
        index += 1
    if board['mig_mode'] == [1, 1]:
        gis = []
        for profile_enum in (N.NVML_GPU_INSTANCE_PROFILE_1_SLICE, N.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
                             N.NVML_GPU_INSTANCE_PROFILE_3_SLICE, N.NVML_GPU_INSTANCE_PROFILE_4_SLICE,
                             N.NVML_GPU_INSTANCE_PROFILE_7_SLICE, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2):
            pid_ = N.nvmlDeviceGetGpuInstanceProfileInfo(h, profile_enum).id
            count = ctypes.c_uint(0)
            N.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid_, None, ctypes.byref(count))
            places = (N.c_nvmlGpuInstancePlacement_t * count.value)()
            N.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid_, places, ctypes.byref(count))
            handles = (N.c_nvmlGpuInstance_t * 8)()
            n = ctypes.c_uint(0)
            N.nvmlDeviceGetGpuInstances(h, pid_, handles, ctypes.byref(n))
            for k in range(n.value):
                info = N.nvmlGpuInstanceGetInfo(handles[k])
                cis = (N.c_nvmlComputeInstance_t * 8)()
                nci = ctypes.c_uint(0)
                found = []
                for ci_profile in range(N.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                    N.nvmlGpuInstanceGetComputeInstances(handles[k], ci_profile, cis, ctypes.byref(nci))
                    for c in range(nci.value):
                        ci = N.nvmlComputeInstanceGetInfo_v2(cis[c])
                        found.append([ci_profile, ci.id, ci.profileId, ci.placement.start, ci.placement.size,
                                      N.nvmlGpuInstanceGetInfo(ci.gpuInstance).id, N.nvmlDeviceGetIndex(ci.device)])
                byid = N.nvmlGpuInstanceGetInfo(N.nvmlDeviceGetGpuInstanceById(h, info.id))
                gis.append({'profile_id': pid_, 'gi': info.id, 'info_profile': info.profileId, 'start': info.placement.start,
                            'size': info.placement.size, 'by_id': byid.id, 'cis': found,
                            'ci0_by_id': N.nvmlComputeInstanceGetInfo_v2(N.nvmlGpuInstanceGetComputeInstanceById(handles[k], 0)).id})
            board.setdefault('placements', {})[pid_] = [[p.start, p.size] for p in places]
            board.setdefault('remaining', {})[pid_] = N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, pid_)
        board['gis'] = sorted(gis, key=lambda g: g['gi'])
        board['gi_by_bad_id'] = call(N.nvmlDeviceGetGpuInstanceById, h, 42)
    out['boards'].append(board)
N.nvmlShutdown()
print(json.dumps(out))
'''


def test_pynvml_mig_functions(gpusim_node, shim_dirs):
    pytest.importorskip('pynvml')
    node = mig_node(gpusim_node)
    a = node.spawn('--gpu', '0', '--mig-instance', '1', '--mib', '4096')
    b = node.spawn('--gpu', '0', '--mig-instance', '2', '--mib', '1000')
    c = node.spawn('--gpu', '1', '--mib', '2000')
    out = run_python(PYNVML_MIG, node.state, shim_dirs['full'])
    show = node.show()
    mig, plain = out['boards']
    # the board in MIG mode
    assert mig['mig_mode'] == [1, 1] and mig['max'] == 7 and mig['is_mig'] == 0
    assert mig['gi_id'] == {'error': 3} and mig['parent_of_board'] == {'error': 3}
    assert mig['mem'] == 5096 * MIB and mig['util'] == {'error': 3}  # NVML has no device utilization in MIG mode
    assert mig['compute_v3'] == mig['compute_v2'] == sorted([[a, 4096 * MIB, 1, 0], [b, 1000 * MIB, 2, 0]])
    assert mig['after_last_mig'] == {'error': 6}  # NOT_FOUND past the last MIG device
    assert len(mig['migs']) == 3
    for got, inst in zip(mig['migs'], show['gpus'][0]['mig_instances']):
        assert got['is_mig'] == 1 and got['parent_index'] == 0
        assert (got['gi'], got['ci'], got['uuid'], got['by_uuid_gi']) == (inst['gi'], inst['ci'], inst['uuid'], inst['gi'])
        assert got['name'] == 'NVIDIA H200 MIG ' + inst['profile']
        assert got['mem'] == [inst['memory_mib'] * MIB, inst['used_mib'] * MIB]
        assert got['mem_v2'] == [inst['memory_mib'] * MIB, inst['used_mib'] * MIB, 0]
        want = sorted([[e['pid'], e['used_mib'] * MIB, e['mig_gi'], e['mig_ci']] for e in show['processes'] if e.get('mig_gi') == inst['gi']])
        assert got['compute_v3'] == want and got['compute_v1'] == [w[:2] for w in want]
        assert got['cc'] == [9, 0] and got['temp_on_mig'] == {'error': 3} and got['mig_mode_on_mig'] == {'error': 3}
    # the GPU-instance profiles of the H200 (enum -> id, slices, instances, SMs, memory), v1 and v2 alike
    prof = mig['profiles']
    table = {0: (19, 1, 7, 16, 17920), 9: (15, 1, 4, 26, 35840), 1: (14, 2, 3, 32, 35840), 2: (9, 3, 2, 60, 71680),
             3: (5, 4, 1, 64, 71680), 4: (0, 7, 1, 132, 143360)}
    for enum, (pid_, slices, count, sms, mib) in table.items():
        for version in (1, 2):
            p = prof['%d/v%d' % (enum, version)]
            assert (p['id'], p['sliceCount'], p['instanceCount'], p['multiprocessorCount'], p['memorySizeMB']) == (pid_, slices, count, sms, mib)
        assert prof['%d/v2' % enum]['name'] == 'MIG ' + [n for n, v in gs.MIG_PROFILES.items() if v['enum'] == enum][0]
    for enum in (5, 6, 7, 8, 10):
        assert prof['%d/v1' % enum] == {'error': 3}  # profiles the board lacks: NOT_SUPPORTED
    assert prof['18/v1'] == prof['18/v2'] == {'error': 2}  # past NVML_GPU_INSTANCE_PROFILE_COUNT: INVALID_ARGUMENT
    assert mig['placements'] == {'19': [[s, 1] for s in range(7)], '15': [[0, 2], [2, 2], [4, 2], [6, 2]],
                                 '14': [[0, 2], [2, 2], [4, 2]], '9': [[0, 4], [4, 4]], '5': [[0, 4]], '0': [[0, 8]]}
    # 3g at 0-3, 2g at 4-5, 1g at 6: a 7th compute slice is left, but memory slice 7 is no 1g placement
    assert mig['remaining'] == {'19': 0, '15': 0, '14': 0, '9': 0, '5': 0, '0': 0}
    assert [(g['gi'], g['profile_id'], g['info_profile'], g['start'], g['size'], g['by_id']) for g in mig['gis']] == [
        (1, 9, 9, 0, 4, 1), (2, 14, 14, 4, 2, 2), (3, 19, 19, 6, 1, 3)]
    assert [g['cis'] for g in mig['gis']] == [[[2, 0, 2, 0, 3, 1, 0]], [[1, 0, 1, 0, 2, 2, 0]], [[0, 0, 0, 0, 1, 3, 0]]]
    assert all(g['ci0_by_id'] == 0 for g in mig['gis']) and mig['gi_by_bad_id'] == {'error': 6}
    # the board without MIG: exactly as before (no MIG devices, no profiles, plain process entries)
    assert plain['mig_mode'] == [0, 0] and plain['max'] == {'error': 3} and plain['migs'] == []
    assert plain['after_last_mig'] == {'error': 3} and plain['util'] == 0
    assert plain['compute_v3'] == [[c, 2000 * MIB, NO_INSTANCE, NO_INSTANCE]]
    assert all(v == {'error': 3} for k, v in plain['profiles'].items() if not k.startswith('18/'))


CTYPES_NONROOT = r'''
import ctypes, json
lib = ctypes.CDLL('libnvidia-ml.so.1')
out = {'init': lib.nvmlInit_v2()}
board, mig = ctypes.c_void_p(), ctypes.c_void_p()
lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(board))
out['mig_handle'] = lib.nvmlDeviceGetMigDeviceHandleByIndex(board, 0, ctypes.byref(mig))
mem = (ctypes.c_ulonglong * 3)()
out['board_mem'] = lib.nvmlDeviceGetMemoryInfo(board, mem)
out['mig_mem'] = [lib.nvmlDeviceGetMemoryInfo(mig, mem), mem[0] >> 20, mem[2] >> 20]
count = ctypes.c_uint(0)
out['board_procs'] = lib.nvmlDeviceGetComputeRunningProcesses_v3(board, ctypes.byref(count), None)
out['mig_procs'] = [lib.nvmlDeviceGetComputeRunningProcesses_v3(mig, ctypes.byref(count), None), count.value]
print(json.dumps(out))
'''


def test_non_root_gets_mig_devices_but_no_board_aggregate(gpusim_node, shim_dirs):
    if os.geteuid() != 0:
        pytest.skip('needs root to run the probe as nobody')
    try:
        nobody = pwd.getpwnam('nobody')
    except KeyError:
        pytest.skip('no user nobody here')
    python = interpreter_for(nobody)
    if python is None:
        pytest.skip('no Python interpreter that nobody may execute')
    node = mig_node(gpusim_node)
    node.spawn('--gpu', '0', '--mig-instance', '1', '--mib', '4096')
    lib = os.path.join(node.root, 'lib')
    os.mkdir(lib)
    shutil.copy(os.path.join(shim_dirs['full'], SHIM_SONAME), lib)
    script = os.path.join(node.root, 'probe.py')
    with open(script, 'w') as f:
        f.write(CTYPES_NONROOT)
    proc = subprocess.run([python, script], env=shim_env(node.state, lib), preexec_fn=_demote(nobody),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out['init'] == 0 and out['mig_handle'] == 0
    assert out['board_mem'] == 4 and out['board_procs'] == 4  # NO_PERMISSION: aggregate figures need privileges
    assert out['mig_mem'] == [0, 71680, 4096] and out['mig_procs'] == [7, 1]  # the instance's own figures


# ---------------------------------------------------------------------------------------------- nvitop

NVITOP_PROBE = r'''
import json
from nvitop import Device

out = []
for device in Device.all():
    migs = []
    for mig in device.mig_devices():
        procs = sorted([pid, p.gpu_memory(), p.gpu_instance_id(), p.compute_instance_id()] for pid, p in mig.processes().items())
        migs.append({'index': list(mig.index), 'name': mig.name(), 'uuid': mig.uuid(), 'gi': mig.gpu_instance_id(),
                     'ci': mig.compute_instance_id(), 'total': mig.memory_total(), 'used': mig.memory_used(), 'procs': procs})
    procs = sorted([pid, p.gpu_memory(), p.gpu_instance_id(), p.compute_instance_id()] for pid, p in device.processes().items())
    out.append({'index': device.index, 'name': device.name(), 'mig': device.is_mig_mode_enabled(),
                'used': device.memory_used(), 'migs': migs, 'procs': procs})
print(json.dumps(out, default=str))
'''


def test_nvitop_shows_the_same_instances_as_gpusim_show(gpusim_node, shim_dirs):
    pytest.importorskip('nvitop')
    node = mig_node(gpusim_node)
    a = node.spawn('--gpu', '0', '--mig-instance', '1', '--mib', '4096')
    b = node.spawn('--gpu', '0', '--mig-instance', '3:0', '--mib', '512')
    c = node.spawn('--gpu', '1', '--mib', '2000')
    out = run_python(NVITOP_PROBE, node.state, shim_dirs['full'])
    show = node.show()
    board = show['gpus'][0]
    assert [d['mig'] for d in out] == [True, False]
    assert out[0]['used'] == board['used_mib'] * MIB == (4096 + 512) * MIB
    assert len(out[0]['migs']) == len(board['mig_instances']) == 3
    for k, (got, inst) in enumerate(zip(out[0]['migs'], board['mig_instances'])):
        assert got['index'] == [0, k] and got['uuid'] == inst['uuid'] and (got['gi'], got['ci']) == (inst['gi'], inst['ci'])
        assert got['name'] == 'NVIDIA H200 MIG ' + inst['profile']
        assert (got['total'], got['used']) == (inst['memory_mib'] * MIB, inst['used_mib'] * MIB)
        assert [p[0] for p in got['procs']] == inst['processes']
        assert all(p[2:] == [inst['gi'], inst['ci']] for p in got['procs'])
    assert out[0]['procs'] == sorted([[a, 4096 * MIB, 1, 0], [b, 512 * MIB, 3, 0]])
    assert out[1]['migs'] == [] and out[1]['procs'] == [[c, 2000 * MIB, 'N/A', 'N/A']]
