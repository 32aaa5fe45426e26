# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The AMD backend: amdsmi readings and per-process data, the guarded import, the library-free path over
the amdgpu driver's sysfs and fdinfo, every failure mode, and a host with NVIDIA and AMD GPUs."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import amd
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.amd import AmdBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.nvidia import NvidiaBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.drm_test_helpers import (
    FakeClock, FakeProc, deny, fixture, make_card, write)

MIB = 1024 * 1024
GIB = 1024 * MIB


STATUS = {2: 'NOT_SUPPORTED - Feature not supported', 7: 'API_FAILED - API call failed', 10: 'NO_PERM - Permission Denied',
          12: 'IO - I/O Error', 31: 'NOT_FOUND - Device Not found', 34: 'DRIVER_NOT_LOADED - Driver not loaded',
          43: 'UNEXPECTED_DATA - The data read or provided was unexpected'}


class AmdSmiError(Exception):
    """Shaped like amdsmi.AmdSmiLibraryException: ``err_code`` is the amdsmi status, ``err_info`` its text."""

    def __init__(self, code):
        self.err_code = code
        self.err_info = 'AMDSMI_STATUS_%s' % STATUS[code]
        super(AmdSmiError, self).__init__(code)

    def __str__(self):
        return 'Error code:\n\t%d | %s' % (self.err_code, self.err_info)


class FakeAmdSmi(object):
    """Two MI300X-like GPUs in amdsmi's own units; ``fail`` maps (function name, handle) -> status code.

    Process 4242 on GPU 0 keeps the gfx engine 50 % busy as the fake clock advances.
    """

    class AmdSmiInitFlags(object):
        INIT_AMD_GPUS = 2

    class AmdSmiTemperatureType(object):
        EDGE, HOTSPOT, JUNCTION = 0, 1, 2

    class AmdSmiTemperatureMetric(object):
        CURRENT = 0

    def __init__(self, clock, fail=None, init_error=None):
        self.clock = clock
        self.fail = dict(fail or {})
        self.init_error = init_error
        self.shut = 0

    def _check(self, name, handle=None):
        code = self.fail.get((name, handle), self.fail.get((name, None)))
        if code is not None:
            raise AmdSmiError(code)

    def amdsmi_init(self, flags):
        if self.init_error:
            raise AmdSmiError(self.init_error)

    def amdsmi_shut_down(self):
        self.shut += 1

    def amdsmi_get_processor_handles(self):
        return ['h0', 'h1']

    def amdsmi_get_gpu_driver_info(self, handle):
        return {'driver_name': 'amdgpu', 'driver_version': '6.12.12'}

    def amdsmi_get_gpu_device_bdf(self, handle):
        return {'h0': '0000:0c:00.0', 'h1': '0000:22:00.0'}[handle]

    def amdsmi_get_gpu_device_uuid(self, handle):
        self._check('uuid', handle)
        return '73ff74a1-0000-1000-80e7-%012d' % int(handle[1])

    def amdsmi_get_gpu_asic_info(self, handle):
        self._check('asic', handle)
        return {'market_name': 'AMD Instinct MI300X', 'target_graphics_version': 'gfx942'}

    def amdsmi_get_gpu_enumeration_info(self, handle):
        return {'drm_card': int(handle[1]) + 1, 'drm_render': 129 + int(handle[1])}

    def amdsmi_get_gpu_vram_usage(self, handle):
        self._check('vram', handle)
        return {'vram_total': 196592, 'vram_used': 8300 if handle == 'h0' else 283}

    def amdsmi_get_gpu_activity(self, handle):
        return {'gfx_activity': 50 if handle == 'h0' else 0, 'umc_activity': 12, 'mm_activity': 'N/A'}

    def amdsmi_get_temp_metric(self, handle, sensor, metric):
        if sensor == self.AmdSmiTemperatureType.EDGE:
            raise AmdSmiError(2)  # MI300X has no edge sensor
        return 47

    def amdsmi_get_power_info(self, handle):
        return {'current_socket_power': 'N/A', 'socket_power': 212, 'average_socket_power': 'N/A',
                'power_limit': 750000000}

    def amdsmi_get_gpu_total_ecc_count(self, handle):
        if handle == 'h1':
            return {'correctable_count': 3, 'uncorrectable_count': 0, 'deferred_count': 2}
        return {'correctable_count': 0, 'uncorrectable_count': 0, 'deferred_count': 0}

    def amdsmi_get_gpu_process_list(self, handle):
        self._check('processes', handle)
        if handle == 'h1':
            return []
        busy = int((self.clock.now - 400.0) * 0.5 * 1e9)
        return [{'name': 'python3', 'pid': 4242, 'mem': 8192 * MIB, 'engine_usage': {'gfx': busy, 'enc': 0},
                 'memory_usage': {'gtt_mem': 6 * MIB, 'cpu_mem': 1 * MIB, 'vram_mem': 8192 * MIB}, 'cu_occupancy': 80},
                {'name': 'N/A', 'pid': 777, 'mem': 0, 'engine_usage': {'gfx': 'N/A', 'enc': 'N/A'},
                 'memory_usage': {'gtt_mem': 0, 'cpu_mem': 0, 'vram_mem': 0}, 'cu_occupancy': 'N/A'}]


def amdsmi_backend(clock, lib=None, **kwargs):
    return AmdBackend(amdsmi=lib or FakeAmdSmi(clock), root='/nonexistent', clock=clock, sleep=clock.sleep, cache={},
                      **kwargs)


def test_amdsmi_devices_processes_and_health():
    clock = FakeClock()
    lib = FakeAmdSmi(clock)
    backend = amdsmi_backend(clock, lib)
    assert backend.probe().to_dict() == {'available': True, 'version': '6.12.12', 'error': None}
    gpu0, gpu1 = backend.devices()
    assert (gpu0.pci_bus_id, gpu0.uuid, gpu0.name, gpu0.minor) == (
        '0000:0c:00.0', '73ff74a1-0000-1000-80e7-000000000000', 'AMD Instinct MI300X', 1)
    # amdsmi's "MB" are bytes / 2**20: MiB as they are
    assert (gpu0.memory_total_mib, gpu0.memory_used_mib, gpu0.memory_free_mib) == (196592, 8300, 196592 - 8300)
    assert (gpu0.utilization_pct, gpu0.memory_utilization_pct, gpu0.temperature_c) == (50, 12, 47)  # hotspot
    assert (gpu0.power_w, gpu0.power_limit_w) == (212.0, 750.0)  # power_limit in microwatts
    procs = dict((p.pid, p) for p in gpu0.driver_processes)
    assert (procs[4242].used_mib, procs[4242].system_mib, procs[4242].util_pct, procs[4242].name) == (8192, 6, 50, 'python3')
    assert (procs[777].used_mib, procs[777].util_pct, procs[777].name) == (0, None, None)  # another user's: "N/A"
    assert gpu0.compute_orphaned() == 8300 - 8192
    assert gpu1.health.status == 'degraded' and gpu1.health.recommended_action == 'reset'
    assert gpu1.health.reasons == ['2 deferred (poisoned) ECC error(s): reset the GPU']
    assert gpu1.driver_processes == [] and gpu1.compute_orphaned() == 283
    backend.close()
    backend.close()
    assert lib.shut == 1


def test_amdsmi_without_processes_does_not_wait():
    clock = FakeClock()
    lib = FakeAmdSmi(clock)
    lib.amdsmi_get_gpu_process_list = lambda handle: []
    backend = amdsmi_backend(clock, lib)
    backend.probe()
    assert [d.driver_processes for d in backend.devices()] == [[], []] and clock.now == 500.0


def test_import_guard_swallows_what_a_broken_amdsmi_prints(tmp_path, monkeypatch, capsys):
    """amdsmi's __init__ prints and raises KeyError (or OSError) when libamd_smi.so is missing."""
    for exc in ('KeyError("ROCM_HOME")', 'OSError("libamd_smi.so: cannot open shared object file")'):
        pkg = tmp_path / exc[:7] / 'amdsmi'
        pkg.mkdir(parents=True)
        (pkg / '__init__.py').write_text('print("Unable to find amdsmi library try installing amd-smi-lib from your package '
                                         'manager")\nraise %s\n' % exc)
        monkeypatch.setattr(amd, '_AMDSMI', {})
        monkeypatch.syspath_prepend(str(pkg.parent))
        for name in [m for m in sys.modules if m == 'amdsmi' or m.startswith('amdsmi.')]:
            monkeypatch.delitem(sys.modules, name)
        module, error = amd.import_amdsmi()
        assert module is None
        assert error == ('amdsmi is installed but libamd_smi.so could not be loaded (is ROCm installed?): '
                         'Unable to find amdsmi library try installing amd-smi-lib from your package manager')
        assert capsys.readouterr().out == ''  # a module's stdout stays pure JSON
        status = AmdBackend(root=str(tmp_path / 'no-gpu')).probe()
        assert status.to_dict() == {'available': False, 'version': None, 'error': error}


def test_library_missing_and_no_driver_is_unavailable(tmp_path):
    backend = AmdBackend(amdsmi=False, root=str(tmp_path))
    assert backend.probe().to_dict() == {'available': False, 'version': None, 'error': amd.NOT_INSTALLED}
    assert backend.devices() == []


def test_library_fails_at_init():
    clock = FakeClock()
    backend = amdsmi_backend(clock, FakeAmdSmi(clock, init_error=34))
    status = backend.probe()
    assert not status.available
    assert status.error == 'amdsmi initialisation failed (is the amdgpu driver loaded?): AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded'
    assert backend.devices() == []


def test_no_permission_for_the_process_list():
    clock = FakeClock()
    backend = amdsmi_backend(clock, FakeAmdSmi(clock, fail={('processes', 'h0'): 10}))
    backend.probe()
    gpu0, gpu1 = backend.devices()
    assert gpu0.driver_processes == [] and not gpu0.processes_complete and gpu0.compute_orphaned() is None
    assert gpu0.health.status == 'ok' and gpu0.health.reasons == [
        'could not read the process list: AMDSMI_STATUS_NO_PERM - Permission Denied (run as root to see every process)']
    assert gpu1.processes_complete


@pytest.mark.parametrize('code', [43, 31, 12])
def test_a_gpu_that_stops_answering_is_lost_and_the_other_survives(code):
    clock = FakeClock()
    gone = dict(((name, 'h1'), code) for name in ('vram', 'uuid', 'asic', 'processes'))
    backend = amdsmi_backend(clock, FakeAmdSmi(clock, fail=gone))
    backend.probe()
    gpu0, gpu1 = backend.devices()
    assert gpu1.health.status == 'lost' and gpu1.health.recommended_action == 'reset'
    assert gpu1.pci_bus_id == '0000:22:00.0' and gpu1.memory_used_mib is None and gpu1.compute_orphaned() is None
    assert gpu0.health.status == 'ok' and [p.pid for p in gpu0.driver_processes] == [4242, 777]


def test_other_reading_errors_are_notes_not_lost():
    clock = FakeClock()
    backend = amdsmi_backend(clock, FakeAmdSmi(clock, fail={('uuid', 'h0'): 7, ('vram', 'h0'): 2}))
    backend.probe()
    gpu0 = backend.devices()[0]
    assert gpu0.health.status == 'ok' and gpu0.uuid is None and gpu0.memory_used_mib is None
    assert gpu0.health.reasons == ['could not read the UUID: AMDSMI_STATUS_API_FAILED - API call failed']


# ---------------------------------------------------------------------------- without amdsmi: sysfs + fdinfo
AMD_BDF = '0000:c3:00.0'


class AmdgpuHost(object):
    """A fake root with one amdgpu card and two processes (a parent and a forked child sharing a client,
    and another client) whose engine counters advance with the fake clock."""

    def __init__(self, tmp_path):
        self.root = str(tmp_path / 'root')
        sys_root = os.path.join(self.root, 'sys')
        self.dev = make_card(sys_root, 1, AMD_BDF, vendor='0x1002', device='0x740c', driver='amdgpu',
                             attrs={'mem_info_vram_total': 64 * GIB, 'mem_info_vram_used': 4600 * MIB,
                                    'gpu_busy_percent': 63, 'mem_busy_percent': 9, 'product_name': 'Instinct MI250X'},
                             hwmon={'temp1_input': 44000, 'power1_average': 151000000, 'power1_cap': 500000000})
        write(os.path.join(self.root, 'proc', 'sys', 'kernel', 'osrelease'), '6.11.0\n')
        self.proc = FakeProc(os.path.join(self.root, 'proc'))
        self.clock = FakeClock()
        self.write()

    def write(self):
        seconds = self.clock.now - 500.0
        legacy = fixture('amdgpu-legacy.txt').replace('drm-engine-compute:\t88112306581 ns',
                                                      'drm-engine-compute:\t%d ns' % (88112306581 + seconds * 0.8e9))
        for pid, ppid in ((300, 1), (301, 300)):
            self.proc.add(pid, ppid=ppid, fds={5: ('/dev/dri/renderD129', legacy)})
        self.proc.add(400, fds={3: ('/dev/dri/renderD129', fixture('amdgpu-6.11.txt'))})

    def sleep(self, seconds):
        self.clock.sleep(seconds)
        self.write()

    def backend(self, library=False):
        return AmdBackend(amdsmi=library, root=self.root, clock=self.clock, sleep=self.sleep, cache={})


def test_library_free_path_reads_sysfs_and_fdinfo(tmp_path):
    host = AmdgpuHost(tmp_path)
    backend = host.backend()
    status = backend.probe()
    assert status.available and status.version == 'amdgpu (kernel 6.11.0)'
    assert status.error == (amd.NOT_INSTALLED + '; reading the amdgpu driver through sysfs and DRM fdinfo instead '
                            '(no UUID, no ECC counts)')
    (gpu,) = backend.devices()
    assert (gpu.vendor_index, gpu.pci_bus_id, gpu.minor, gpu.name, gpu.uuid) == (0, AMD_BDF, 1, 'Instinct MI250X', None)
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.memory_free_mib) == (65536, 4600, 65536 - 4600)
    assert (gpu.utilization_pct, gpu.memory_utilization_pct, gpu.temperature_c) == (63, 9, 44)
    assert (gpu.power_w, gpu.power_limit_w) == (151.0, 500.0)
    procs = [(p.pid, p.used_mib, p.system_mib, p.util_pct) for p in gpu.driver_processes]
    assert procs == [(300, 4096, 20, 80), (400, 279, 2, 0)]  # pid 301 shares 300's client: not counted twice
    assert gpu.compute_orphaned() == 4600 - 4096 - 279
    assert gpu.ecc_uncorrected_volatile is None


def test_library_failing_at_init_falls_back_to_the_driver(tmp_path):
    host = AmdgpuHost(tmp_path)
    clock = FakeClock()
    backend = AmdBackend(amdsmi=FakeAmdSmi(clock, init_error=34), root=host.root, clock=host.clock, sleep=host.sleep,
                         cache={})
    status = backend.probe()
    assert status.available and status.error.startswith('amdsmi initialisation failed')
    assert [d.pci_bus_id for d in backend.devices()] == [AMD_BDF]


def test_library_free_path_failure_modes(tmp_path, monkeypatch):
    host = AmdgpuHost(tmp_path)
    deny(monkeypatch, os.path.join(host.root, 'proc', '400', 'fd'))
    backend = host.backend()
    backend.probe()
    (gpu,) = backend.devices()
    assert [p.pid for p in gpu.driver_processes] == [300] and not gpu.processes_complete
    assert gpu.compute_orphaned() is None and 'run as root' in gpu.health.reasons[0]
    monkeypatch.undo()
    shutil.rmtree(host.dev)
    (gpu,) = backend.devices()
    assert gpu.health.status == 'lost' and 'disappeared from sysfs' in gpu.health.reasons[0]


# ---------------------------------------------------------------------------- NVIDIA and AMD in one host
def test_a_host_with_nvidia_and_amd_gpus_has_host_wide_indexes():
    nvidia_fake = pytest.importorskip(
        'ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.backends.test_gpu_nvidia_fake')
    clock = FakeClock()
    snap = take_snapshot(factories={'nvidia': lambda: NvidiaBackend(nvml=nvidia_fake.fake_nvml()),
                                    'amd': lambda: amdsmi_backend(clock)},
                         inventory=ProcessInventory(proc_root='/nonexistent', use_psutil=False))
    facts = snap.to_facts()
    assert facts['backends']['nvidia']['available'] and facts['backends']['amd']['available']
    assert [(d['index'], d['vendor'], d['vendor_index']) for d in facts['devices']] == [
        (0, 'nvidia', 0), (1, 'nvidia', 1), (2, 'amd', 0), (3, 'amd', 1)]
    assert len(set(tuple(sorted(d)) for d in facts['devices'])) == 1  # one schema for every vendor
    assert snap.device('2').pci_bus_id == '0000:0c:00.0' and snap.device('73ff74a1-0000-1000-80e7-000000000001').index == 3
    by_pid = dict((p['pid'], p) for p in facts['processes'])
    assert by_pid[4242]['gpu_indexes'] == [2] and by_pid[100]['gpu_indexes'] == [0]
    assert by_pid[4242]['name'] == 'python3'  # not visible here: the driver's name
    assert by_pid[777]['name'] is None and by_pid[4242]['status'] == 'not_found'
