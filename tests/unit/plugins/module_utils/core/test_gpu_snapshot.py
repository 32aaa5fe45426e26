# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.model, core.backends (registry, select, AMD over a fake amdsmi) and core.snapshot with fake backends."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import backends as B
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import snapshot as S
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.amd import AmdBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.apple import AppleBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.base import Backend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.intel import IntelBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.nvidia import NvidiaBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import GpuFleetError, InvalidArgument, MissingLibrary
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import (
    BackendStatus, Device, GpuProcess, Health)
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h


# ---------------------------------------------------------------------------- model
def test_health_keeps_the_most_severe_action():
    health = Health()
    assert health.to_dict() == {'status': 'ok', 'recommended_action': 'none', 'reasons': []}
    health.note('could not read the fan speed: Unknown Error')
    assert health.status == 'ok' and health.reasons == ['could not read the fan speed: Unknown Error']
    health.degrade('row remapping failed', action='drain')
    health.degrade('ECC errors', action='reset')
    assert (health.status, health.recommended_action) == ('degraded', 'drain')
    health.lose('lost', action='reset')
    assert (health.status, health.recommended_action) == ('lost', 'drain')
    health.degrade('still lost')
    assert health.status == 'lost'
    with pytest.raises(ValueError):
        health.degrade('x', action='explode')


def test_orphaned_memory_rules():
    dev = Device(vendor='nvidia', vendor_index=0, memory_used_mib=5000)
    dev.add_driver_process(10, 1000, 'compute')
    dev.add_driver_process(10, 1000, 'graphics')
    dev.add_driver_process(11, 500, 'compute')
    assert dev.compute_orphaned() == 3500
    assert [p.type for p in dev.driver_processes] == ['compute+graphics', 'compute']
    dev.memory_used_mib = 1000
    assert dev.compute_orphaned() == 0  # clamped: processes can report more than the device
    dev.add_driver_process(12, None, 'compute')
    assert dev.compute_orphaned() is None  # one unknown process makes it unknown
    empty = Device(vendor='nvidia', vendor_index=1)
    assert empty.compute_orphaned() is None  # used memory unknown
    hidden = Device(vendor='nvidia', vendor_index=2, memory_used_mib=100, processes_complete=False)
    assert hidden.compute_orphaned() is None


@pytest.mark.parametrize('vendor, unattributed, expected', [
    ('nvidia', 25, 0),      # what an H200 with driver 580 showed with 4 CUDA processes: context bookkeeping
    ('nvidia', 64, 0),      # the allowance: 16 MiB per listed process
    ('nvidia', 65, 65),     # above it, the whole figure (a leak is never shrunk by the allowance)
    ('nvidia', 4096, 4096),
    ('amd', 25, 25),        # no allowance measured for other vendors: every MiB counts
])
def test_driver_context_overhead_reads_as_no_orphaned_memory(vendor, unattributed, expected):
    """Real drivers use a few MiB per context that they charge to no process (tests/device/run on an H200:
    8, 14 and 25 MiB with 1, 2 and 4 processes): that is not a leak, and must not start a holder scan."""
    dev = Device(vendor=vendor, vendor_index=0, memory_used_mib=4 * 1024 + unattributed)
    for pid in (10, 11, 12, 13):
        dev.add_driver_process(pid, 1024, 'compute')
    assert dev.compute_orphaned() == expected
    assert S.holder_scan_needed([dev]) is (expected > 0)
    assert S.holder_scan_needed([Device(vendor=vendor, vendor_index=1, memory_used_mib=0)]) is True  # unknown: None


def test_gpu_process_sums_memory_over_gpus():
    proc = GpuProcess(pid=5)
    proc.add_gpu(1, 100, ['compute'])
    proc.add_gpu(0, 50, ['graphics'])
    assert (proc.gpu_indexes, proc.used_mib, proc.types) == ([0, 1], 150, ['compute', 'graphics'])
    proc.add_gpu(2, None, ['compute'])
    assert proc.used_mib is None
    assert proc.to_dict()['status'] == 'not_found' and proc.holds_gpu_device is None


def test_errors():
    err = InvalidArgument('gpus', '9', 'no such GPU')
    assert isinstance(err, GpuFleetError) and (err.field, err.value, err.why) == ('gpus', '9', 'no such GPU')
    assert str(err) == "gpus: invalid value '9': no such GPU"
    missing = MissingLibrary('psutil', 'Traceback...\nModuleNotFoundError: No module named psutil', purpose='read processes')
    assert str(missing) == ('the Python package psutil is required to read processes '
                            '(import failed: ModuleNotFoundError: No module named psutil)')


# ---------------------------------------------------------------------------- backends
class FakeBackend(Backend):
    """Returns prepared devices; records its life cycle."""

    def __init__(self, name, devices=(), available=True, error=None, fail_devices=False, fail_probe=False):
        self.name = name
        super(FakeBackend, self).__init__()
        self._devices = list(devices)
        self.available = available
        self.error = error
        self.fail_devices = fail_devices
        self.fail_probe = fail_probe
        self.closed = 0

    def probe(self):
        if self.fail_probe:
            raise RuntimeError('library exploded')
        self.status = BackendStatus(self.name, self.available, '1.0' if self.available else None, self.error)
        return self.status

    def devices(self):
        if self.fail_devices:
            raise RuntimeError('count failed')
        return list(self._devices)

    def close(self):
        self.closed += 1


def nv(i, used=0, pids=(), uuid=None, minor=None):
    dev = Device(vendor='nvidia', vendor_index=i, uuid=uuid or 'GPU-%d' % i, memory_total_mib=1000,
                 memory_used_mib=used, minor=i if minor is None else minor)
    for pid, mib in pids:
        dev.add_driver_process(pid, mib, 'compute')
    return dev


def amd(i, used=0, pids=()):
    dev = Device(vendor='amd', vendor_index=i, uuid='amd-%d' % i, memory_used_mib=used, minor=i)
    for pid, mib in pids:
        dev.add_driver_process(pid, mib, 'compute')
    return dev


def fake_factories(**backends):
    return dict((name, (lambda b=b: b)) for name, b in backends.items())


def test_select_probes_every_backend_and_never_raises():
    good = FakeBackend('nvidia')
    missing = FakeBackend('amd', available=False, error='amdsmi is not installed')
    broken = FakeBackend('intel', fail_probe=True)
    sel = B.select('auto', fake_factories(nvidia=good, amd=missing, intel=broken))
    assert sel.backends == [good]
    assert sel.statuses['amd'].to_dict() == {'available': False, 'version': None, 'error': 'amdsmi is not installed'}
    assert sel.statuses['intel'].error == 'probe failed: library exploded' and not sel.statuses['intel'].available
    assert sel.statuses['apple'].available is False and sel.statuses['apple'].error
    assert missing.closed == 1
    assert list(sel.statuses) == ['nvidia', 'amd', 'intel', 'apple']


def test_select_one_vendor_reports_the_others_as_not_requested():
    sel = B.select('amd', fake_factories(amd=FakeBackend('amd')))
    assert [b.name for b in sel.backends] == ['amd']
    assert sel.statuses['nvidia'].error == 'not requested (vendor=amd)'
    with pytest.raises(InvalidArgument) as exc:
        B.select('matrox')
    assert exc.value.field == 'vendor'


def test_registry_and_absent_vendors_are_honest(tmp_path):
    assert B.VENDORS == ('nvidia', 'amd', 'intel', 'apple')
    assert B.REGISTRY['nvidia'] is NvidiaBackend
    status = IntelBackend(sys_root=str(tmp_path)).probe()
    assert not status.available and status.error.startswith('no DRM devices in ')
    pci = tmp_path / 'bus' / 'pci' / 'devices' / '0000:00:02.0'
    pci.mkdir(parents=True)
    (pci / 'vendor').write_text('0x8086\n')
    (pci / 'class').write_text('0x030000\n')
    assert '1 Intel display device(s) on the PCI bus' in IntelBackend(sys_root=str(tmp_path)).probe().error
    assert AppleBackend().probe().available is False  # (the Intel and Apple backends: test_backend_intel/apple.py)


def test_nvidia_without_pynvml_is_unavailable_not_fatal():
    backend = NvidiaBackend(nvml=None)
    backend.nvml = None
    status = backend.probe()
    assert status.to_dict() == {'available': False, 'version': None, 'error': 'nvidia-ml-py (pynvml) is not installed'}
    assert backend.devices() == []
    backend.close()


class FakeAmdSmiError(Exception):
    def __init__(self, code):
        super(FakeAmdSmiError, self).__init__('AMD SMI error %d' % code)
        self.err_code = code


class FakeAmdSmi(object):
    """The subset of the amdsmi API the backend uses (values in the library's own units)."""

    class AmdSmiInitFlags(object):
        INIT_AMD_GPUS = 2

    class AmdSmiTemperatureType(object):
        EDGE = 0
        HOTSPOT = 1

    class AmdSmiTemperatureMetric(object):
        CURRENT = 0

    def __init__(self, fail_init=False):
        self.fail_init = fail_init
        self.shut = False

    def amdsmi_init(self, flags):
        if self.fail_init:
            raise FakeAmdSmiError(8)

    def amdsmi_shut_down(self):
        self.shut = True

    def amdsmi_get_processor_handles(self):
        return ['h0', 'h1']

    def amdsmi_get_gpu_driver_info(self, handle):
        return {'driver_name': 'amdgpu', 'driver_version': '6.8.5'}

    def amdsmi_get_gpu_device_bdf(self, handle):
        return '0000:%s:00.0' % ('03' if handle == 'h0' else '83')

    def amdsmi_get_gpu_device_uuid(self, handle):
        return 'amd-uuid-' + handle

    def amdsmi_get_gpu_asic_info(self, handle):
        return {'market_name': 'AMD Instinct MI210'}

    def amdsmi_get_gpu_enumeration_info(self, handle):
        return {'drm_card': int(handle[1]), 'drm_render': 128 + int(handle[1])}

    def amdsmi_get_gpu_vram_usage(self, handle):
        return {'vram_total': 65520, 'vram_used': 4106}

    def amdsmi_get_gpu_activity(self, handle):
        return {'gfx_activity': 42, 'umc_activity': 'N/A', 'mm_activity': 'N/A'}

    def amdsmi_get_temp_metric(self, handle, sensor, metric):
        if sensor == self.AmdSmiTemperatureType.EDGE and handle == 'h1':
            raise FakeAmdSmiError(2)
        return 51

    def amdsmi_get_power_info(self, handle):
        return {'current_socket_power': 'N/A', 'average_socket_power': 88, 'power_limit': 300}

    def amdsmi_get_gpu_total_ecc_count(self, handle):
        return {'correctable_count': 0, 'uncorrectable_count': 1 if handle == 'h1' else 0}

    def amdsmi_get_gpu_process_list(self, handle):
        if handle == 'h1':
            raise FakeAmdSmiError(10)
        return [{'name': 'python', 'pid': 31337, 'mem': 4096 * 1048576,
                 'memory_usage': {'gtt_mem': 0, 'cpu_mem': 0, 'vram_mem': 4096 * 1048576}}]


def test_amd_backend_over_the_amdsmi_api():
    lib = FakeAmdSmi()
    backend = AmdBackend(amdsmi=lib)
    assert backend.probe().to_dict() == {'available': True, 'version': '6.8.5', 'error': None}
    dev0, dev1 = backend.devices()
    assert (dev0.pci_bus_id, dev0.uuid, dev0.name, dev0.minor) == ('0000:03:00.0', 'amd-uuid-h0', 'AMD Instinct MI210', 0)
    # amdsmi "MB" are bytes / 2**20: MiB already
    assert (dev0.memory_total_mib, dev0.memory_used_mib, dev0.memory_free_mib) == (65520, 4106, 65520 - 4106)
    assert (dev0.utilization_pct, dev0.memory_utilization_pct, dev0.temperature_c) == (42, None, 51)
    assert (dev0.power_w, dev0.power_limit_w) == (88.0, 300.0)
    assert [(p.pid, p.used_mib) for p in dev0.driver_processes] == [(31337, 4096)]
    assert dev0.compute_orphaned() == 10
    assert dev1.temperature_c == 51  # EDGE not supported: HOTSPOT
    assert dev1.health.status == 'degraded' and dev1.health.recommended_action == 'reset'
    assert dev1.processes_complete is False and dev1.compute_orphaned() is None
    assert any('process list' in r for r in dev1.health.reasons)
    backend.close()
    assert lib.shut


def test_amd_backend_init_failure_is_a_reason():
    status = AmdBackend(amdsmi=FakeAmdSmi(fail_init=True)).probe()
    assert status.available is False and 'amdsmi initialisation failed' in status.error


# ---------------------------------------------------------------------------- snapshot
def no_processes():
    return ProcessInventory(proc_root='/nonexistent-proc', use_psutil=False)


def test_host_wide_indexes_across_vendors_and_closing():
    nvidia = FakeBackend('nvidia', [nv(1, used=300, pids=[(7, 100)]), nv(0)])
    amdb = FakeBackend('amd', [amd(0, used=50)])
    snap = S.take_snapshot(factories=fake_factories(nvidia=nvidia, amd=amdb), inventory=no_processes())
    assert [(d.index, d.vendor, d.vendor_index) for d in snap.devices] == [(0, 'nvidia', 0), (1, 'nvidia', 1), (2, 'amd', 0)]
    assert [d.orphaned_mib for d in snap.devices] == [0, 200, 50]
    assert nvidia.closed == 1 and amdb.closed == 1
    facts = snap.to_facts()
    assert json.loads(json.dumps(facts)) == facts
    assert facts['processes'][0]['pid'] == 7 and facts['processes'][0]['status'] == 'not_found'
    assert facts['backends']['amd'] == {'available': True, 'version': '1.0', 'error': None}


def test_gpus_filter_by_index_and_uuid_and_unknown_values():
    def factories():
        return fake_factories(nvidia=FakeBackend('nvidia', [nv(0), nv(1, uuid='GPU-abc'), nv(2)]))
    snap = S.take_snapshot(gpus=['GPU-ABC', 2, '2'], factories=factories(), inventory=no_processes())
    assert [d.index for d in snap.devices] == [1, 2]
    assert len(snap.all_devices) == 3 and snap.device('0').index == 0 and snap.device('nope') is None
    for bad in (['7'], ['GPU-nope'], ['']):
        with pytest.raises(InvalidArgument) as exc:
            S.take_snapshot(gpus=bad, factories=factories(), inventory=no_processes())
        assert exc.value.field == 'gpus' and exc.value.value == bad[0]
    with pytest.raises(InvalidArgument) as exc:
        S.take_snapshot(gpus=['7'], factories=factories(), inventory=no_processes())
    assert 'GPUs here: 0 (GPU-0), 1 (GPU-abc), 2 (GPU-2)' in str(exc.value)


def test_backend_that_fails_to_read_is_reported_and_others_survive():
    snap = S.take_snapshot(factories=fake_factories(nvidia=FakeBackend('nvidia', fail_devices=True),
                                                    amd=FakeBackend('amd', [amd(0)])),
                           inventory=no_processes())
    assert [d.vendor for d in snap.devices] == ['amd']
    assert snap.backends['nvidia'].error == 'reading the GPUs failed: count failed'
    assert snap.errors == ['nvidia: reading the GPUs failed: count failed']


def test_no_gpu_host_is_empty_not_an_error():
    snap = S.take_snapshot(factories=fake_factories(nvidia=FakeBackend('nvidia', available=False, error='no driver'),
                                                    amd=FakeBackend('amd', available=False, error='no amdsmi')),
                           inventory=no_processes())
    facts = snap.to_facts()
    assert facts['devices'] == [] and facts['processes'] == [] and facts['holders'] == []
    assert facts['backends']['nvidia']['error'] == 'no driver'


def test_auto_holder_scan_runs_only_when_memory_is_unexplained():
    root = h.tempdir()
    dev = h.make_dev_dir(os.path.join(root, 'dev'), minors=(0, 1))
    kids = h.Children()
    try:
        holder = kids.sleeper([os.path.join(dev, 'nvidia1')])

        def snap_of(*devices):
            return S.take_snapshot(factories=fake_factories(nvidia=FakeBackend('nvidia', list(devices))), dev_roots=[dev],
                                   scan_holders='auto')
        explained = snap_of(nv(0), nv(1, minor=1))                      # nothing used, nothing listed
        assert explained.holders_scanned is False and explained.holders == []
        orphaned = snap_of(nv(0), nv(1, used=512, minor=1))             # 512 MiB that no listed process holds
        assert orphaned.holders_scanned is True and [x.pid for x in orphaned.holders] == [holder.pid]
        unknown = snap_of(nv(0, used=None), nv(1, minor=1))             # cannot tell: scan
        assert unknown.holders_scanned is True
        always = S.take_snapshot(factories=fake_factories(nvidia=FakeBackend('nvidia', [nv(0), nv(1, minor=1)])),
                                 dev_roots=[dev])
        assert always.holders_scanned is True and [x.pid for x in always.holders] == [holder.pid]
        assert S.holder_scan_needed([]) is False
    finally:
        kids.close()
        shutil.rmtree(root, ignore_errors=True)


def test_holders_map_to_gpus_by_minor_and_render_node():
    root = h.tempdir()
    dev = h.make_dev_dir(os.path.join(root, 'dev'), minors=(0, 1))
    h.make_dev_dir(dev, minors=(0,), amd=True)
    kids = h.Children()
    try:
        nv_holder = kids.sleeper([os.path.join(dev, 'nvidia1')])
        amd_holder = kids.sleeper([os.path.join(dev, 'dri', 'renderD128'), os.path.join(dev, 'kfd')])
        shared = kids.sleeper([os.path.join(dev, 'nvidiactl')])

        def factories():
            return fake_factories(nvidia=FakeBackend('nvidia', [nv(0), nv(1, minor=1)]), amd=FakeBackend('amd', [amd(0)]))
        snap = S.take_snapshot(factories=factories(), dev_roots=[dev])
        holders = dict((x.pid, x.gpu_indexes) for x in snap.holders)
        assert holders == {nv_holder.pid: [1], amd_holder.pid: [2], shared.pid: []}
        snap = S.take_snapshot(gpus=['0'], factories=factories(), dev_roots=[dev])
        assert sorted(x.pid for x in snap.holders) == [shared.pid]  # shared nodes can matter to any GPU
        snap = S.take_snapshot(gather_processes=False, factories=factories(), dev_roots=[dev])
        assert snap.holders == [] and snap.processes == []
    finally:
        kids.close()
        shutil.rmtree(root, ignore_errors=True)
