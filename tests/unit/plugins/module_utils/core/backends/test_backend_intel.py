# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The Intel backend (i915/xe): sysfs devices, fdinfo processes and utilization over a fake root, xpu-smi JSON,
every failure mode, and an Intel node of the simulator (gpusim init --vendor intel) end to end."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.intel import IntelBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.drm_test_helpers import (
    FakeProc, deny, make_card, write)

GIB = 1024 * 1024 * 1024
XE_BDF = '0000:03:00.0'
IGPU_BDF = '0000:00:02.0'


def xe_text(cycles_rcs=0, total=1000000, vram_mib=2048):
    return ('pos:\t0\nflags:\t02100002\ndrm-driver:\txe\ndrm-client-id:\t42\ndrm-pdev:\t%s\n'
            'drm-total-gtt:\t192 KiB\ndrm-resident-gtt:\t192 KiB\ndrm-total-vram0:\t%d MiB\ndrm-resident-vram0:\t%d MiB\n'
            'drm-cycles-rcs:\t%d\ndrm-total-cycles-rcs:\t%d\ndrm-cycles-ccs:\t0\ndrm-total-cycles-ccs:\t%d\n'
            'drm-engine-capacity-ccs:\t4\n' % (XE_BDF, vram_mib, vram_mib, cycles_rcs, total, total))


def igpu_text(render_ns=0):
    return ('drm-driver:\ti915\ndrm-pdev:\t%s\ndrm-client-id:\t7\ndrm-total-system0:\t64 MiB\n'
            'drm-resident-system0:\t48 MiB\ndrm-engine-render:\t%d ns\ndrm-engine-video:\t0 ns\n'
            'drm-engine-capacity-video:\t2\n' % (IGPU_BDF, render_ns))


class IntelHost(object):
    """A fake root (sys, proc, usr/share/misc/pci.ids) with an integrated i915 GPU and a discrete xe card.

    pid 100 opened the xe card and forked pid 101 (same client); pid 200 renders on the iGPU.  The
    fake ``sleep`` advances the clock and the kernel's counters, as time passing would.
    """

    def __init__(self, tmp_path):
        self.root = str(tmp_path / 'root')
        self.sys = os.path.join(self.root, 'sys')
        self.proc = FakeProc(os.path.join(self.root, 'proc'))
        self.xe_dev = make_card(self.sys, 1, XE_BDF, device='0x56a0', driver='xe',
                                attrs={'tile0/physical_vram_size_bytes': 16 * GIB},
                                hwmon={'temp2_input': 51000, 'power1_max': 190000000, 'energy1_input': 1000000})
        make_card(self.sys, 0, IGPU_BDF, device='0x46a6', driver='i915')
        write(os.path.join(self.root, 'proc', 'sys', 'kernel', 'osrelease'), '6.8.0-45-generic\n')
        write(os.path.join(self.root, 'usr', 'share', 'misc', 'pci.ids'),
              '8086  Intel Corporation\n\t46a6  Alder Lake-P GT2 [Iris Xe Graphics]\n\t56a0  DG2 [Arc A770]\n')
        self.proc.add(100, ppid=1, fds={7: ('/dev/dri/renderD129', xe_text())})
        self.proc.add(101, ppid=100, fds={7: ('/dev/dri/renderD129', xe_text())})
        self.proc.add(200, ppid=1, fds={4: ('/dev/dri/renderD128', igpu_text())})
        self.clock = [1000.0]
        self.ticks = 0

    def sleep(self, seconds):
        """Time passes: xe rcs busy 25 % of the GPU timestamp, iGPU render 40 %, 30 W drawn."""
        self.clock[0] += seconds
        self.ticks += 1
        total = 1000000 + self.ticks * 400000
        for pid in (100, 101):
            self.proc.fd(pid, 7, '/dev/dri/renderD129', xe_text(cycles_rcs=self.ticks * 100000, total=total))
        self.proc.fd(200, 4, '/dev/dri/renderD128', igpu_text(render_ns=int(self.ticks * seconds * 0.4 * 1e9)))
        if os.path.isdir(self.xe_dev):
            write(os.path.join(self.xe_dev, 'hwmon', 'hwmon1', 'energy1_input'), '%d\n' % (1000000 + 30e6 * (self.clock[0] - 1000.0)))

    def backend(self, **kwargs):
        kwargs.setdefault('clock', lambda: self.clock[0])
        kwargs.setdefault('sleep', self.sleep)
        kwargs.setdefault('cache', {})
        kwargs.setdefault('which', lambda name: None)
        return IntelBackend(root=self.root, **kwargs)


@pytest.fixture
def host(tmp_path):
    return IntelHost(tmp_path)


def test_devices_processes_and_utilization_from_sysfs_and_fdinfo(host):
    backend = host.backend()
    status = backend.probe()
    assert status.to_dict() == {'available': True, 'version': 'i915 6.8.0-45-generic, xe 6.8.0-45-generic', 'error': None}
    igpu, xe = backend.devices()
    assert (igpu.vendor_index, igpu.pci_bus_id, igpu.minor, igpu.name) == (0, IGPU_BDF, 0, 'Intel Alder Lake-P GT2 [Iris Xe Graphics]')
    assert (xe.vendor_index, xe.pci_bus_id, xe.minor, xe.name) == (1, XE_BDF, 1, 'Intel DG2 [Arc A770]')
    # memory: xe publishes the tile's VRAM size but no used figure; an iGPU has no memory of its own
    assert (xe.memory_total_mib, xe.memory_used_mib, xe.memory_free_mib) == (16384, None, None)
    assert (igpu.memory_total_mib, igpu.memory_used_mib) == (None, None)
    assert xe.compute_orphaned() is None
    assert (xe.temperature_c, xe.power_limit_w, xe.power_w) == (51, 190.0, 30.0)
    assert (igpu.temperature_c, igpu.power_w) == (None, None)
    # the forked child shares its parent's client: listed once, under the parent
    assert [(p.pid, p.used_mib, p.util_pct, p.types, p.system_mib) for p in xe.driver_processes] == [
        (100, 2048, 25, ['graphics'], 0)]
    assert [(p.pid, p.used_mib, p.util_pct) for p in igpu.driver_processes] == [(200, 48, 40)]
    assert (xe.utilization_pct, igpu.utilization_pct) == (25, 40)
    assert xe.processes_complete and xe.health.to_dict() == {'status': 'ok', 'recommended_action': 'none', 'reasons': []}
    # a second read in the same process compares with the previous reading instead of waiting again
    slept = host.ticks
    host.clock[0] += 5.0
    backend.devices()
    assert host.ticks == slept


def test_snapshot_joins_intel_devices_with_the_rest(host):
    snap = take_snapshot(vendor='intel', factories={'intel': host.backend},
                         inventory=ProcessInventory(proc_root='/nonexistent', use_psutil=False))
    facts = snap.to_facts()
    assert facts['backends']['intel']['available'] is True
    assert [(d['index'], d['vendor'], d['processes']) for d in facts['devices']] == [(0, 'intel', [200]), (1, 'intel', [100])]
    assert sorted(facts['devices'][1]) == sorted(facts['devices'][0])


def test_no_intel_gpu_is_unavailable_with_the_reason(tmp_path, host):
    empty = IntelBackend(root=str(tmp_path / 'empty'))
    assert empty.probe().to_dict() == {
        'available': False, 'version': None,
        'error': 'no DRM devices in %s (no GPU driver loaded, or sysfs is not mounted)' % os.path.join(str(tmp_path), 'empty', 'sys', 'class', 'drm')}
    assert empty.devices() == []
    # Intel display devices on the bus, but the driver is not bound ("library missing" of a kernel driver)
    for card in ('card0', 'card1'):
        os.unlink(os.path.join(host.sys, 'class', 'drm', card, 'device', 'driver'))
    status = host.backend().probe()
    assert not status.available and status.error.startswith('2 Intel display device(s) on the PCI bus, but none is driven')
    # only another vendor's card
    other = str(tmp_path / 'amd')
    make_card(os.path.join(other, 'sys'), 0, '0000:c3:00.0', vendor='0x1002', driver='amdgpu')
    assert IntelBackend(root=other).probe().error == 'no Intel GPU driven by the i915 or xe kernel driver was found'


def test_unreadable_fdinfo_marks_the_process_list_incomplete(host, monkeypatch):
    deny(monkeypatch, os.path.join(host.root, 'proc', '200', 'fd'))
    backend = host.backend()
    backend.probe()
    igpu, xe = backend.devices()
    assert igpu.driver_processes == [] and not igpu.processes_complete
    assert igpu.utilization_pct is None and xe.utilization_pct is None  # another process may be using it
    assert [p.pid for p in xe.driver_processes] == [100]
    assert xe.health.status == 'ok' and any('run as root' in r for r in xe.health.reasons)


def test_a_device_that_disappears_is_lost(host):
    backend = host.backend()
    assert backend.probe().available
    shutil.rmtree(host.xe_dev)  # the PCI device went away (hot unplug, fell off the bus)
    igpu, xe = backend.devices()
    assert xe.health.status == 'lost' and xe.health.recommended_action == 'reset'
    assert 'disappeared from sysfs' in xe.health.reasons[0] and xe.driver_processes == []
    assert igpu.health.status == 'ok' and [p.pid for p in igpu.driver_processes] == [200]


class XpuSmi(object):
    """A fake xpu-smi runner: discovery -j and stats -d N -j, or failures."""

    def __init__(self, discovery=None, stats=None, rc=0, text=None):
        self.discovery = discovery
        self.stats = stats or {}
        self.rc = rc
        self.text = text
        self.calls = []

    def __call__(self, argv, timeout):
        self.calls.append(argv[1:])
        if self.rc:
            return self.rc, '', 'Error: Level Zero Initialization Error\n'
        if self.text is not None:
            return 0, self.text, ''
        if argv[1] == 'discovery':
            return 0, json.dumps(self.discovery), ''
        device = int(argv[3])
        if device not in self.stats:
            return 1, '', 'device %d not found\n' % device
        return 0, json.dumps(self.stats[device]), ''


DISCOVERY = {'device_list': [
    {'device_id': 0, 'device_name': 'Intel(R) Arc(TM) A770 Graphics', 'device_type': 'GPU', 'pci_bdf_address': XE_BDF,
     'pci_device_id': '0x56a0', 'uuid': '00000000-0000-0003-0000-000856a08086', 'vendor_name': 'Intel(R) Corporation'}]}
STATS = {0: {'device_id': 0, 'device_level': [
    {'metrics_type': 'XPUM_STATS_GPU_UTILIZATION', 'value': 61.2}, {'metrics_type': 'XPUM_STATS_MEMORY_USED', 'value': 3100},
    {'metrics_type': 'XPUM_STATS_POWER', 'value': 95.5}, {'metrics_type': 'XPUM_STATS_GPU_CORE_TEMPERATURE', 'value': 55}]}}


def test_xpu_smi_adds_name_uuid_and_memory_used(host):
    runner = XpuSmi(DISCOVERY, STATS)
    backend = host.backend(which=lambda name: '/opt/xpum/bin/xpu-smi', runner=runner)
    assert backend.probe().available
    igpu, xe = backend.devices()
    assert (xe.name, xe.uuid) == ('Intel(R) Arc(TM) A770 Graphics', '00000000-0000-0003-0000-000856a08086')
    assert (xe.memory_total_mib, xe.memory_used_mib, xe.memory_free_mib) == (16384, 3100, 16384 - 3100)
    assert xe.compute_orphaned() == 3100 - 2048
    assert (xe.utilization_pct, xe.temperature_c, xe.power_w) == (61, 55, 95.5)
    assert igpu.uuid is None and igpu.memory_used_mib is None  # xpu-smi does not manage the iGPU
    # not every card is known to xpu-smi: indexes stay positional (reset addresses GPUs by PCI address)
    assert [d.vendor_index for d in (igpu, xe)] == [0, 1]
    assert runner.calls == [['discovery', '-j'], ['stats', '-d', '0', '-j']]


def test_xpu_smi_device_ids_become_vendor_indexes_when_it_knows_every_card(host):
    shutil.rmtree(os.path.join(host.sys, 'class', 'drm', 'card0'))
    discovery = {'device_list': [dict(DISCOVERY['device_list'][0], device_id=3)]}
    backend = host.backend(which=lambda name: '/usr/bin/xpu-smi', runner=XpuSmi(discovery, {}))
    backend.probe()
    (xe,) = backend.devices()
    assert xe.vendor_index == 3 and any('stats -d 3' in e for e in xe.errors)
    assert xe.memory_used_mib is None  # stats failed: the sysfs figures stay


@pytest.mark.parametrize('runner, note', [
    (XpuSmi(rc=1), 'xpu-smi discovery -j failed (Error: Level Zero Initialization Error): using sysfs only'),
    (XpuSmi(text='not json'), 'xpu-smi discovery -j printed no JSON: using sysfs only'),
    (XpuSmi(text='{"error": "no daemon"}'), 'xpu-smi discovery -j printed no device_list: using sysfs only'),
])
def test_a_failing_xpu_smi_leaves_the_sysfs_figures(host, runner, note):
    backend = host.backend(which=lambda name: '/usr/bin/xpu-smi', runner=runner)
    assert backend.probe().available  # the tool failing at init is no reason to lose the GPUs
    igpu, xe = backend.devices()
    assert note in xe.errors and xe.name == 'Intel DG2 [Arc A770]' and xe.uuid is None
    assert [p.pid for p in xe.driver_processes] == [100]


def test_without_pci_ids_the_name_says_the_device_id(host):
    os.unlink(os.path.join(host.root, 'usr', 'share', 'misc', 'pci.ids'))
    backend = host.backend()
    backend.probe()
    assert [d.name for d in backend.devices()] == ['Intel GPU [8086:46a6]', 'Intel GPU [8086:56a0]']


# ---------------------------------------------------------------------------- the simulator's Intel node
@h.needs_gpusim
def test_simulated_intel_node_end_to_end():
    node = h.GpuSim(gpus=2, init_args=('--vendor', 'intel'))
    try:
        state = node.show()
        root = state['drm_root']
        assert state['vendor'] == 'intel' and os.path.isdir(os.path.join(root, 'sys', 'class', 'drm', 'card1'))
        pid = node.spawn(gpu=1, mib=3000, util=50, children=1)
        child = node.children(pid)[0][0]
        snap = take_snapshot(factories={'intel': lambda: IntelBackend(root=root, cache={})},
                             inventory=ProcessInventory(dev_roots=node.dev_roots), vendor='intel')
        gpu0, gpu1 = snap.devices
        assert (gpu1.pci_bus_id, gpu1.name, gpu1.memory_total_mib) == ('0000:0b:00.0', 'Intel Data Center GPU Max 1550', 131072)
        assert gpu1.pids == [pid] and gpu0.pids == []
        assert snap.process(pid).used_mib == 3000 and snap.process(pid).name == 'python'
        assert snap.holder(child).gpu_indexes == [1]  # the forked child holds the render node, not listed
        assert (gpu1.temperature_c, gpu1.power_limit_w) == (state['gpus'][1]['temp_c'], state['gpus'][1]['power_limit_w'])
        node.kill_all()
        node.gpusim('kill-all', '--prune')
        snap = take_snapshot(factories={'intel': lambda: IntelBackend(root=root, cache={})},
                             inventory=ProcessInventory(dev_roots=node.dev_roots), vendor='intel')
        assert [d.pids for d in snap.devices] == [[], []] and snap.processes == []
    finally:
        node.close()
