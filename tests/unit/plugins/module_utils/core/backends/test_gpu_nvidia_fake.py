# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""NvidiaBackend paths the simulator cannot produce, over a stand-in for the pynvml module that
raises pynvml's own exception classes (driver recovery actions, init failures, odd errors)."""

from __future__ import annotations

import time
import types

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.nvidia import NvidiaBackend

pynvml = pytest.importorskip('pynvml')

MIB = 1024 * 1024


def fake_nvml(**overrides):
    """A pynvml-shaped namespace: two healthy GPUs, every call overridable by name."""
    def memory(handle, version=None):
        if version is None:
            return types.SimpleNamespace(total=1000 * MIB, free=900 * MIB, used=100 * MIB)
        return types.SimpleNamespace(total=1000 * MIB, free=880 * MIB, used=100 * MIB, reserved=20 * MIB)

    def field_values(handle, ids):
        return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=0))]

    calls = dict(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b'555.42.06',
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: 'GPU-%d' % h,
        nvmlDeviceGetName=lambda h: 'NVIDIA H100',
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=b'00000000:0%d:00.0' % h),
        nvmlDeviceGetMinorNumber=lambda h: h,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=5, memory=1),
        nvmlDeviceGetTemperature=lambda h, s: 40,
        nvmlDeviceGetPowerUsage=lambda h: 70500,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700000,
        nvmlDeviceGetFanSpeed=lambda h: raise_(pynvml.NVMLError_NotSupported()),
        nvmlDeviceGetPersistenceMode=lambda h: 1,
        nvmlDeviceGetMigMode=lambda h: [0, 0],
        nvmlDeviceGetTotalEccErrors=lambda h, t, c: 0,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, 0, 0),
        nvmlDeviceGetFieldValues=field_values,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=100 + h, usedGpuMemory=60 * MIB)],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
        nvmlDeviceGetMPSComputeRunningProcesses=lambda h: [],
    )
    calls.update(overrides)
    namespace = types.SimpleNamespace(**calls)
    for name in dir(pynvml):
        if name.startswith(('NVMLError', 'NVML_')) or name in ('NVMLLibraryMismatchError', 'nvmlMemory_v2'):
            setattr(namespace, name, getattr(pynvml, name))
    return namespace


def raise_(exc):
    raise exc


def read(nvml):
    backend = NvidiaBackend(nvml=nvml)
    status = backend.probe()
    devices = backend.devices() if status.available else []
    backend.close()
    return status, devices


def test_healthy_readings_and_units():
    status, (dev0, dev1) = read(fake_nvml())
    assert status.to_dict() == {'available': True, 'version': '555.42.06', 'error': None}
    assert (dev0.uuid, dev0.pci_bus_id, dev0.minor, dev1.minor) == ('GPU-0', '00000000:00:00.0', 0, 1)
    assert (dev0.memory_api, dev0.memory_used_mib, dev0.memory_free_mib, dev0.memory_reserved_mib) == ('v2', 100, 880, 20)
    assert (dev0.power_w, dev0.power_limit_w, dev0.fan_pct) == (70.5, 700.0, None)
    assert dev0.health.reasons == [] and dev0.errors == []
    assert dev0.compute_orphaned() == 40


@pytest.mark.parametrize('exc,expected', [
    (pynvml.NVMLError_LibraryNotFound(), 'libnvidia-ml.so.1 was not found'),
    (pynvml.NVMLError_DriverNotLoaded(), 'kernel driver is not loaded'),
    (pynvml.NVMLError_Unknown(), 'NVML initialisation failed: Unknown Error'),
    (OSError('bad ELF header'), 'NVML initialisation failed: bad ELF header'),
])
def test_init_failures_are_reasons(exc, expected):
    status, devices = read(fake_nvml(nvmlInit=lambda: raise_(exc)))
    assert status.available is False and expected in status.error and devices == []


@pytest.mark.parametrize('code,action', [(1, 'reset'), (2, 'reboot'), (3, 'drain'), (4, 'drain'), (0, 'none')])
def test_driver_recovery_action_field(code, action):
    def field_values(handle, ids):
        return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=code if handle == 1 else 0))]
    _status, (dev0, dev1) = read(fake_nvml(nvmlDeviceGetFieldValues=field_values))
    assert dev0.health.status == 'ok'
    assert dev1.health.recommended_action == action
    assert dev1.health.status == ('ok' if code == 0 else 'degraded')


def test_one_unopenable_gpu_does_not_hide_the_other():
    def handle(i):
        if i == 0:
            raise pynvml.NVMLError_NoPermission()
        return i
    _status, (dev0, dev1) = read(fake_nvml(nvmlDeviceGetHandleByIndex=handle))
    assert dev0.health.status == 'degraded' and 'Insufficient Permissions' in dev0.health.reasons[0]
    assert dev0.compute_orphaned() is None and dev0.uuid is None
    assert dev1.uuid == 'GPU-1' and dev1.health.status == 'ok'


def test_gpu_lost_mid_read_and_reset_required():
    def temperature(handle, sensor):
        if handle == 0:
            raise pynvml.NVMLError_GpuIsLost()
        raise pynvml.NVMLError_ResetRequired()
    _status, (dev0, dev1) = read(fake_nvml(nvmlDeviceGetTemperature=temperature))
    assert dev0.health.status == 'lost' and dev0.memory_used_mib is None and dev0.driver_processes == []
    assert dev1.health.status == 'degraded' and dev1.health.recommended_action == 'reset'
    assert dev1.driver_processes[0].pid == 101  # the rest of GPU 1 was still read


def test_failed_readings_become_notes_and_v1_memory_fallback():
    def memory(handle, version=None):
        if version is not None:
            raise pynvml.NVMLError_FunctionNotFound()
        return types.SimpleNamespace(total=1000 * MIB, free=700 * MIB, used=300 * MIB)
    _status, (dev0, _dev1) = read(fake_nvml(nvmlDeviceGetMemoryInfo=memory,
                                            nvmlDeviceGetPowerUsage=lambda h: raise_(pynvml.NVMLError_Unknown())))
    assert (dev0.memory_api, dev0.memory_used_mib, dev0.memory_reserved_mib) == ('v1', 300, None)
    assert dev0.power_w is None and dev0.health.status == 'ok'
    assert dev0.health.reasons == ['could not read the power draw: Unknown Error']


def test_unversioned_process_list_missing_falls_back_to_v2_once():
    calls = []

    def v3(handle):
        calls.append('v3')
        raise pynvml.NVMLLibraryMismatchError('no _v3')

    def v2(handle):
        calls.append('v2')
        return [types.SimpleNamespace(pid=7, usedGpuMemory=None)]
    nvml = fake_nvml(nvmlDeviceGetComputeRunningProcesses=v3, nvmlDeviceGetComputeRunningProcesses_v2=v2,
                     nvmlDeviceGetMPSComputeRunningProcesses=lambda h: raise_(pynvml.NVMLError_FunctionNotFound()))
    _status, (dev0, dev1) = read(nvml)
    assert calls == ['v3', 'v2', 'v2']  # the fallback is remembered for the next GPU
    assert [(p.pid, p.used_mib) for p in dev0.driver_processes] == [(7, None)]
    assert dev0.processes_complete and dev1.processes_complete  # no MPS list at all is not an error
    assert dev0.compute_orphaned() is None


def _sample(pid, sm):
    return types.SimpleNamespace(pid=pid, timeStamp=1, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)


@pytest.mark.parametrize('util_call, expected', [
    (lambda h, since: [_sample(100 + h, 40), _sample(100 + h, 75), _sample(999, 99)], 75),  # highest sample of the pid
    (lambda h, since: [_sample(999, 50)], 0),                                              # listed, no sample: idle
    (lambda h, since: raise_(pynvml.NVMLError_NotFound()), 0),                             # no sample newer than since
    (lambda h, since: raise_(pynvml.NVMLError_NotSupported()), None),
    (lambda h, since: raise_(pynvml.NVMLError_NoPermission()), None),
    (lambda h, since: raise_(pynvml.NVMLError_Unknown()), None),
    (None, None),                                                                          # pynvml without the call
])
def test_per_process_utilization(util_call, expected):
    overrides = {} if util_call is None else {'nvmlDeviceGetProcessUtilization': util_call}
    _status, (dev0, _dev1) = read(fake_nvml(**overrides))
    assert dev0.driver_processes[0].util_pct == expected
    assert dev0.health.status == 'ok'  # a missing per-process figure is no health problem


def test_per_process_utilization_asks_for_recent_samples_only():
    seen = []

    def util(handle, since):
        seen.append(since)
        return []
    read(fake_nvml(nvmlDeviceGetProcessUtilization=util))
    assert seen and all(0 < (time.time() * 1e6 - since) / 1e6 < 60 for since in seen)


def test_memory_view_reads_only_the_gpus_asked_for():
    """The release wait's poll (issue #21): memory and processes of the GPUs it waits on, not of every GPU."""
    handles = []
    backend = NvidiaBackend(nvml=fake_nvml(nvmlDeviceGetCount=lambda: 3, nvmlDeviceGetHandleByIndex=lambda i: handles.append(i) or i))
    assert backend.probe().available
    del handles[:]
    assert backend.memory_view({1}) == {1: (100, {101})}
    assert handles == [1]
    assert sorted(backend.memory_view()) == [0, 1, 2]
    backend.close()
