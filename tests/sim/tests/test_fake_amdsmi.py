# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fake amdsmi package: return shapes, units, exceptions and codes, driven by the state file."""

import ctypes
import importlib
import os
import sys

import pytest

from conftest import FAKE_AMDSMI_DIR, pid_alive, wait_until

MIB = 1 << 20


@pytest.fixture
def fake_amdsmi(gpusim_node, monkeypatch):
    """The fake package imported fresh from tests/sim/python (any other amdsmi is put aside)."""
    monkeypatch.setenv('GPU_SIM_STATE', gpusim_node.state)
    saved = dict((k, v) for k, v in sys.modules.items() if k == 'amdsmi' or k.startswith('amdsmi.'))
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, FAKE_AMDSMI_DIR)
    try:
        module = importlib.import_module('amdsmi')
        assert os.path.dirname(module.__file__) == os.path.join(FAKE_AMDSMI_DIR, 'amdsmi')
        yield module
    finally:
        sys.path.remove(FAKE_AMDSMI_DIR)
        for name in [k for k in sys.modules if k == 'amdsmi' or k.startswith('amdsmi.')]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture
def amd(gpusim_node, fake_amdsmi):
    gpusim_node.init('--gpus', '2', '--vendor', 'amd')
    fake_amdsmi.amdsmi_init(fake_amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    yield fake_amdsmi
    fake_amdsmi.amdsmi_shut_down()


def code_of(excinfo):
    return excinfo.value.err_code


def test_init_required_and_init_errors(gpusim_node, fake_amdsmi):
    lib = fake_amdsmi
    w = lib.amdsmi_wrapper
    with pytest.raises(lib.AmdSmiLibraryException) as exc:
        lib.amdsmi_init()  # no state yet: no driver
    assert code_of(exc) == w.AMDSMI_STATUS_DRIVER_NOT_LOADED
    gpusim_node.init()  # an NVIDIA node
    with pytest.raises(lib.AmdSmiLibraryException) as exc:
        lib.amdsmi_init()
    assert code_of(exc) == w.AMDSMI_STATUS_DRIVER_NOT_LOADED
    gpusim_node.init('--vendor', 'amd')
    with pytest.raises(lib.AmdSmiLibraryException) as exc:
        lib.amdsmi_get_processor_handles()
    assert code_of(exc) == w.AMDSMI_STATUS_NOT_INIT
    with pytest.raises(lib.AmdSmiParameterException):
        lib.amdsmi_init(2)
    lib.amdsmi_init()
    assert len(lib.amdsmi_get_processor_handles()) == 4
    lib.amdsmi_shut_down()
    with pytest.raises(lib.AmdSmiLibraryException):
        lib.amdsmi_get_processor_handles()


def test_identity(amd, gpusim_node):
    state = gpusim_node.show()
    handles = amd.amdsmi_get_processor_handles()
    assert len(handles) == 2 and all(isinstance(h, ctypes.c_void_p) for h in handles)
    assert [amd.amdsmi_get_gpu_device_bdf(h) for h in handles] == ['0000:07:00.0', '0000:0b:00.0']
    assert [amd.amdsmi_get_gpu_device_uuid(h) for h in handles] == [g['uuid'] for g in state['gpus']]
    again = amd.amdsmi_get_processor_handle_from_bdf('0000:0b:00.0')
    assert again.value == handles[1].value
    assert amd.amdsmi_get_processor_handle_from_bdf('0b:00.0').value == handles[1].value
    with pytest.raises(amd.AmdSmiBdfFormatException):
        amd.amdsmi_get_processor_handle_from_bdf('nonsense')
    assert amd.amdsmi_get_processor_type(handles[0]) == {'processor_type': 'AMDSMI_PROCESSOR_TYPE_AMD_GPU'}
    asic = amd.amdsmi_get_gpu_asic_info(handles[0])
    assert set(asic) == {'market_name', 'vendor_id', 'vendor_name', 'subvendor_id', 'device_id', 'rev_id', 'asic_serial',
                         'oam_id', 'num_compute_units', 'target_graphics_version', 'subsystem_id'}
    assert asic['market_name'] == 'AMD Instinct MI250X' and asic['vendor_id'] == '0x1002'
    assert asic['target_graphics_version'] == 'gfx90a'
    enum = amd.amdsmi_get_gpu_enumeration_info(handles[1])
    assert enum['drm_render'] == 129 and enum['drm_card'] == 1
    assert amd.amdsmi_get_gpu_driver_info(handles[0])['driver_name'] == 'amdgpu'
    with pytest.raises(amd.AmdSmiParameterException):
        amd.amdsmi_get_gpu_device_bdf(0)


def test_memory_activity_sensors(amd, gpusim_node):
    h = amd.amdsmi_get_processor_handles()[0]
    assert amd.amdsmi_get_gpu_vram_usage(h) == {'vram_total': 65520, 'vram_used': 0}
    gpusim_node.spawn('--gpu', '0', '--mib', '2048')
    gpusim_node.run('leak', '--gpu', '0', '--mib', '100')
    gpusim_node.run('set', '--gpu', '0', '--util', '88', '--mem-util', '30', '--temp', '51', '--power', '412.4')
    assert amd.amdsmi_get_gpu_vram_usage(h) == {'vram_total': 65520, 'vram_used': 2148}
    assert amd.amdsmi_get_gpu_memory_usage(h, amd.AmdSmiMemoryType.VRAM) == 2148 * MIB
    assert amd.amdsmi_get_gpu_memory_total(h, amd.AmdSmiMemoryType.VRAM) == 65520 * MIB
    assert amd.amdsmi_get_gpu_vram_info(h)['vram_size'] == 65520
    assert amd.amdsmi_get_gpu_activity(h) == {'gfx_activity': 88, 'umc_activity': 30, 'mm_activity': 'N/A'}
    assert amd.amdsmi_get_temp_metric(h, amd.AmdSmiTemperatureType.EDGE, amd.AmdSmiTemperatureMetric.CURRENT) == 51
    assert amd.amdsmi_get_temp_metric(h, amd.AmdSmiTemperatureType.HOTSPOT, amd.AmdSmiTemperatureMetric.CURRENT) > 51
    with pytest.raises(amd.AmdSmiLibraryException) as exc:
        amd.amdsmi_get_temp_metric(h, amd.AmdSmiTemperatureType.PLX, amd.AmdSmiTemperatureMetric.CURRENT)
    assert code_of(exc) == amd.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED
    with pytest.raises(amd.AmdSmiParameterException):
        amd.amdsmi_get_temp_metric(h, 0, amd.AmdSmiTemperatureMetric.CURRENT)
    power = amd.amdsmi_get_power_info(h)
    assert set(power) == {'socket_power', 'current_socket_power', 'average_socket_power', 'gfx_voltage', 'soc_voltage',
                          'mem_voltage', 'power_limit'}
    assert power['socket_power'] == 412 and power['power_limit'] == 560 * 1000000
    assert amd.amdsmi_get_power_cap_info(h)['power_cap'] == 560 * 1000000


def test_process_list(amd, gpusim_node):
    h0, h1 = amd.amdsmi_get_processor_handles()
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '1500', '--util', '50', argv=['python3', 'train.py'])
    gone = gpusim_node.spawn('--gpu', '0', '--mib', '10')
    os.kill(gone, 9)
    wait_until(lambda: not pid_alive(gone))
    procs = amd.amdsmi_get_gpu_process_list(h0)
    assert [p['pid'] for p in procs] == [pid]
    proc = procs[0]
    assert set(proc) == {'name', 'pid', 'mem', 'engine_usage', 'memory_usage', 'cu_occupancy'}
    assert proc['name'] == 'python3'
    assert proc['mem'] == 1500 * MIB and proc['memory_usage']['vram_mem'] == 1500 * MIB
    assert set(proc['engine_usage']) == {'gfx', 'enc'} and proc['engine_usage']['gfx'] >= 0
    assert set(proc['memory_usage']) == {'gtt_mem', 'cpu_mem', 'vram_mem'}
    assert amd.amdsmi_get_gpu_process_list(h1) == []
    assert amd.amdsmi_get_gpu_compute_process_info() == [
        {'process_id': pid, 'vram_usage': 1500 * MIB, 'sdma_usage': 0, 'cu_occupancy': 50}]
    assert amd.amdsmi_get_gpu_compute_process_gpus(pid) == [0]
    gpusim_node.run('set', '--gpu', '0', '--no-permission', 'on')
    with pytest.raises(amd.AmdSmiLibraryException) as exc:
        amd.amdsmi_get_gpu_process_list(h0)
    assert code_of(exc) == amd.amdsmi_wrapper.AMDSMI_STATUS_NO_PERM


def test_ecc_and_ras(amd, gpusim_node):
    h = amd.amdsmi_get_processor_handles()[0]
    gpusim_node.run('set', '--gpu', '0', '--ecc-uncorrected', '4', '--ecc-corrected', '9')
    assert amd.amdsmi_get_gpu_total_ecc_count(h) == {'correctable_count': 9, 'uncorrectable_count': 4,
                                                     'deferred_count': 0}
    assert amd.amdsmi_get_gpu_ecc_count(h, amd.AmdSmiGpuBlock.UMC)['uncorrectable_count'] == 4
    blocks = amd.amdsmi_get_gpu_ras_block_features_enabled(h)
    assert {'block': 'UMC', 'status': 'ENABLED'} in blocks
    assert all(set(b) == {'block', 'status'} for b in blocks)
    assert amd.amdsmi_get_gpu_ecc_enabled(h) & int(amd.AmdSmiGpuBlock.UMC)


def test_lost_gpu(amd, gpusim_node):
    gpusim_node.run('lose', '--gpu', '1')
    handles = amd.amdsmi_get_processor_handles()
    assert len(handles) == 2
    assert amd.amdsmi_get_gpu_device_bdf(handles[1]) == '0000:0b:00.0'
    for call in (amd.amdsmi_get_gpu_vram_usage, amd.amdsmi_get_gpu_device_uuid, amd.amdsmi_get_gpu_process_list,
                 amd.amdsmi_get_gpu_activity, amd.amdsmi_get_power_info):
        with pytest.raises(amd.AmdSmiLibraryException) as exc:
            call(handles[1])
        assert code_of(exc) == amd.amdsmi_wrapper.AMDSMI_STATUS_UNEXPECTED_DATA
    assert amd.amdsmi_get_gpu_vram_usage(handles[0])['vram_total'] == 65520


@pytest.mark.skipif(os.geteuid() != 0, reason='amdsmi_reset_gpu needs root')
def test_reset_gpu(amd, gpusim_node):
    h = amd.amdsmi_get_processor_handles()[0]
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '100')
    with pytest.raises(amd.AmdSmiLibraryException) as exc:
        amd.amdsmi_reset_gpu(h)
    assert code_of(exc) == amd.amdsmi_wrapper.AMDSMI_STATUS_BUSY
    assert gpusim_node.gpu(0)['reset_count'] == 0
    os.kill(pid, 9)
    wait_until(lambda: not pid_alive(pid))
    gpusim_node.run('leak', '--gpu', '0', '--mib', '77')
    gpusim_node.run('lose', '--gpu', '0')
    assert amd.amdsmi_reset_gpu(h) is None
    gpu = gpusim_node.gpu(0)
    assert gpu['reset_count'] == 1 and gpu['leaked_mib'] == 0 and gpu['lost'] is False
    assert amd.amdsmi_get_gpu_vram_usage(h)['vram_used'] == 0


def test_exceptions_match_the_real_ones(fake_amdsmi):
    lib = fake_amdsmi
    exc = lib.AmdSmiLibraryException(-30)
    assert exc.err_code == 30 and exc.get_error_code() == 30
    assert str(exc) == 'Error code:\n\t30 | AMDSMI_STATUS_BUSY - Device busy'
    assert exc.get_error_info(detailed=False) == 'AMDSMI_STATUS_BUSY'
    assert isinstance(exc, lib.AmdSmiException)
    assert lib.AmdSmiRetryException().err_code == lib.amdsmi_wrapper.AMDSMI_STATUS_RETRY
    assert lib.AmdSmiTimeoutException().err_code == lib.amdsmi_wrapper.AMDSMI_STATUS_TIMEOUT
    assert issubclass(lib.AmdSmiRetryException, lib.AmdSmiLibraryException)
    assert issubclass(lib.AmdSmiTimeoutException, lib.AmdSmiLibraryException)
    param = lib.AmdSmiParameterException(1, str)
    assert param.err_code is None and 'Expected type' in str(param)
    assert not issubclass(lib.AmdSmiParameterException, lib.AmdSmiLibraryException)
    assert str(lib.AmdSmiLibraryException(12345)).endswith('AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred')
