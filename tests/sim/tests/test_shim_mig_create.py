# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Creating and destroying MIG instances through the shim (issue #19): nvmlDeviceCreateGpuInstance[WithPlacement],
nvmlGpuInstanceCreateComputeInstance, nvmlComputeInstanceDestroy, nvmlGpuInstanceDestroy run `gpusim _mig`, and
`gpusim show` and the MIG device handles follow."""

import os

import pytest

from conftest import SIM_BUILD, SHIM_SONAME, run_python

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(SIM_BUILD, SHIM_SONAME)), reason='run make sim')

CYCLE = r'''
import ctypes, json
import pynvml as N


def code(fn, *args):
    try:
        fn(*args)
        return 0
    except N.NVMLError as exc:
        return exc.value


N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
out = {}
gi = N.nvmlDeviceGetGpuInstanceById(h, 3)
ci = N.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
out['destroy_gi_with_ci'] = code(N.nvmlGpuInstanceDestroy, gi)
out['destroy_busy_ci'] = code(N.nvmlComputeInstanceDestroy, N.nvmlGpuInstanceGetComputeInstanceById(
    N.nvmlDeviceGetGpuInstanceById(h, 1), 0))
out['destroy_ci'] = code(N.nvmlComputeInstanceDestroy, ci)
out['mig_devices_after_ci'] = [N.nvmlDeviceGetGpuInstanceId(N.nvmlDeviceGetMigDeviceHandleByIndex(h, i)) for i in range(2)]
out['third_mig_device'] = code(N.nvmlDeviceGetMigDeviceHandleByIndex, h, 2)
out['gi2_handle_still_valid'] = N.nvmlGpuInstanceGetInfo(N.nvmlDeviceGetGpuInstanceById(h, 2)).id
out['destroy_gi'] = code(N.nvmlGpuInstanceDestroy, gi)
out['no_room_7g'] = code(N.nvmlDeviceCreateGpuInstance, h, 0)
bad = N.c_nvmlGpuInstancePlacement_t(); bad.start, bad.size = 5, 1
out['bad_size'] = code(N.nvmlDeviceCreateGpuInstanceWithPlacement, h, 15, ctypes.byref(bad))
pl = N.c_nvmlGpuInstancePlacement_t(); pl.start, pl.size = 6, 1
new = N.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(pl))
info = N.nvmlGpuInstanceGetInfo(new)
out['new_gi'] = [info.id, info.profileId, info.placement.start, info.placement.size]
out['wrong_ci_profile'] = code(N.nvmlGpuInstanceCreateComputeInstance, new, 2)
ci = N.nvmlGpuInstanceCreateComputeInstance(new, 0)
out['new_ci'] = N.nvmlComputeInstanceGetInfo_v2(ci).id
out['second_ci'] = code(N.nvmlGpuInstanceCreateComputeInstance, new, 0)
m = N.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
out['mig_uuid'] = N.nvmlDeviceGetUUID(m)
out['board_without_mig'] = code(N.nvmlDeviceCreateGpuInstance, N.nvmlDeviceGetHandleByIndex(1), 19)
N.nvmlShutdown()
print(json.dumps(out))
'''


def test_create_destroy_cycle(gpusim_node):
    node = gpusim_node
    node.init('--gpus', '2', '--mig', '0:3g.71gb,2g.35gb,1g.18gb')
    before = node.show()['gpus'][0]['mig_instances']
    node.spawn('--gpu', '0', '--mig-instance', '1', '--mib', '1024')
    out = run_python(CYCLE, node.state, SIM_BUILD)
    assert out['destroy_gi_with_ci'] == 19 and out['destroy_busy_ci'] == 19   # IN_USE
    assert out['destroy_ci'] == 0 and out['mig_devices_after_ci'] == [1, 2] and out['third_mig_device'] == 6
    assert out['gi2_handle_still_valid'] == 2 and out['destroy_gi'] == 0
    assert out['no_room_7g'] == 23 and out['bad_size'] == 2                  # INSUFFICIENT_RESOURCES, INVALID_ARGUMENT
    assert out['new_gi'] == [3, 19, 6, 1]
    assert out['wrong_ci_profile'] == 3 and out['new_ci'] == 0 and out['second_ci'] == 23
    assert out['mig_uuid'] == before[2]['uuid']                                # derived from the board's UUID and GI/CI
    assert out['board_without_mig'] == 3
    after = node.show()['gpus'][0]['mig_instances']
    assert [(i['gi'], i['ci'], i['profile'], i['placement']) for i in after] == \
        [(i['gi'], i['ci'], i['profile'], i['placement']) for i in before]
