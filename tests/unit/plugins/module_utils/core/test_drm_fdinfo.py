# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.drm_fdinfo: the DRM client usage stats parser (amdgpu, i915, xe fixtures), the /proc scan with
deduplication of dup()'d and inherited fds, utilization from two readings, and DRM cards in sysfs."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import drm_fdinfo as drm

from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.drm_test_helpers import FakeProc, deny, fixture, make_card

KIB = 1024
MIB = 1024 * 1024


# ---------------------------------------------------------------------------- parsing
def test_amdgpu_legacy_keys():
    client = drm.parse_fdinfo(fixture('amdgpu-legacy.txt'))
    assert (client.driver, client.pdev, client.client_id, client.key) == ('amdgpu', '0000:c3:00.0', 41, ('0000:c3:00.0', 41))
    # drm-memory-<region> is the legacy alias of drm-resident-<region>; "drm-memory-gtt: \t" has a space
    assert client.memory['resident'] == {'vram': 4194304 * KIB, 'gtt': 20480 * KIB, 'cpu': 0}
    assert client.memory['total'] == {}
    assert client.engines == {'gfx': 5113402155, 'compute': 88112306581, 'dma': 201332887}
    assert client.local_bytes() == 4 * 1024 * MIB and client.used_bytes() == 4 * 1024 * MIB
    assert client.system_bytes() == 20480 * KIB  # gtt + cpu
    assert client.parse_errors == 0  # amd-* and pasid are not DRM keys


def test_amdgpu_611_standard_keys_win_over_the_legacy_alias():
    client = drm.parse_fdinfo(fixture('amdgpu-6.11.txt'))
    assert client.client_id == 57 and client.pdev == '0000:c3:00.0'
    assert client.memory['total'] == {'cpu': 0, 'gtt': 2 * MIB, 'vram': 286604 * KIB}
    assert client.memory['shared']['vram'] == 19808 * KIB
    assert client.memory['resident']['vram'] == 286604 * KIB
    assert client.region_bytes('gtt') == 2 * MIB  # "2 MiB", and "0" is bare bytes
    assert client.used_bytes() == 286604 * KIB
    assert client.engines == {'gfx': 1744170937, 'compute': 0}


def test_i915_engines_and_capacity_without_memory():
    client = drm.parse_fdinfo(fixture('i915-engines.txt'))
    assert (client.driver, client.pdev, client.client_id) == ('i915', '0000:00:02.0', 7)
    assert client.engines == {'render': 9288864723, 'copy': 2035071108, 'video': 0, 'video-enhance': 0}
    assert client.capacity == {'video': 2}
    assert client.regions() == [] and client.used_bytes() is None  # no memory keys: unknown, not 0


def test_i915_discrete_regions_local_system_and_stolen():
    client = drm.parse_fdinfo(fixture('i915-dg2-memory.txt'))
    assert client.regions() == ['local0', 'stolen-local0', 'system0']
    assert client.memory['total']['system0'] == 232411136  # bare bytes
    assert client.local_bytes() == 1048576 * KIB  # resident local0, not total
    assert client.system_bytes() == 122638336  # stolen is neither local nor system
    assert client.capacity == {'video': 2, 'compute': 4}


def test_xe_cycles_are_not_memory_regions():
    client = drm.parse_fdinfo(fixture('xe-cycles.txt'))
    assert client.cycles == {'rcs': 28257900, 'bcs': 0, 'vcs': 0, 'vecs': 0, 'ccs': 0}
    assert client.total_cycles['rcs'] == 7655183225 and set(client.total_cycles) == set(client.cycles)
    assert client.capacity == {'vcs': 2, 'vecs': 2, 'ccs': 4}
    assert 'cycles-rcs' not in client.memory['total']  # drm-total-cycles-rcs is not region "cycles-rcs"
    assert client.memory['total'] == {'system': 0, 'gtt': 192 * KIB, 'vram0': 23992 * KIB, 'stolen': 0}
    assert client.memory['shared']['vram0'] == 16 * MIB
    assert client.used_bytes() == 23992 * KIB
    assert client.engine_names == ['bcs', 'ccs', 'rcs', 'vcs', 'vecs']
    assert client.pdev == '0000:03:00.0'


def test_maxfreq_units_and_no_pdev():
    client = drm.parse_fdinfo(fixture('panfrost-maxfreq.txt'))
    assert client.maxfreq == {'fragment': 799999987, 'vertex-tiler': 799999987}
    assert client.key == ('', 14)  # a platform device: no drm-pdev
    assert client.used_bytes() == 36496 * KIB  # region "memory" is system memory
    assert drm.parse_fdinfo('drm-driver: x\ndrm-maxfreq-a: 2 MHz\ndrm-maxfreq-b: 3 KHz\n').maxfreq == {'a': 2000000, 'b': 3000}


def test_not_a_drm_fd_and_malformed_values():
    assert drm.parse_fdinfo(fixture('not-drm.txt')) is None
    assert drm.parse_fdinfo('') is None
    client = drm.parse_fdinfo(fixture('malformed.txt'))
    assert client.driver == 'i915' and client.client_id is None and client.key is None
    assert client.capacity == {} and client.engines == {} and client.maxfreq == {}  # zero capacity is not allowed
    assert client.memory['total'] == {} and client.memory['resident'] == {'system0': 4 * MIB}
    assert client.parse_errors == 6  # id, capacity 0, ticks, rpm, KB, a negative size


def test_units():
    assert drm.parse_fdinfo('drm-driver: d\ndrm-total-vram: 3 GiB\n').memory['total'] == {'vram': 3 * 1024 * MIB}
    assert drm.parse_fdinfo('drm-driver: d\ndrm-engine-x: 5\n').engines == {'x': 5}  # unit-less ns


# ---------------------------------------------------------------------------- the /proc scan
def test_dup_and_forked_fds_are_counted_once_and_owned_by_the_parent(tmp_path):
    proc = FakeProc(tmp_path / 'proc')
    text = fixture('amdgpu-legacy.txt')
    # pid 100 opened the render node, dup()'d it (fd 5 and 9) and forked 101, which inherited both
    proc.add(100, ppid=1, fds={5: ('/dev/dri/renderD128', text), 9: ('/dev/dri/renderD128', text),
                               3: ('/tmp/log.txt', fixture('not-drm.txt'))})
    proc.add(101, ppid=100, fds={5: ('/dev/dri/renderD128', text), 9: ('/dev/dri/renderD128', text)})
    # an unrelated process with its own client on the same card, and a card fd of another driver
    proc.add(200, fds={4: ('/dev/dri/card0', fixture('amdgpu-6.11.txt')), 6: ('/dev/dri/renderD129', fixture('i915-engines.txt'))})
    scan = drm.scan_clients(str(tmp_path / 'proc'), drm.AMD_DRIVERS)
    assert scan.complete and sorted(scan.clients) == [('0000:c3:00.0', 41), ('0000:c3:00.0', 57)]
    shared = scan.clients[('0000:c3:00.0', 41)]
    assert shared.pids == {100, 101} and len(shared.fds) == 4
    assert drm.owner_pid(shared.pids, str(tmp_path / 'proc')) == 100
    assert sum(c.used_bytes() for c in scan.clients.values()) == (4194304 + 286604) * KIB  # not 4x the shared client
    everything = drm.scan_clients(str(tmp_path / 'proc'))
    assert len(everything.clients) == 3 and ('0000:00:02.0', 7) in everything.clients


def test_owner_pid_without_a_family_relation_is_the_lowest(tmp_path):
    proc = FakeProc(tmp_path / 'proc')
    proc.add(300, ppid=1)
    proc.add(250, ppid=1)
    assert drm.owner_pid({300, 250}, str(tmp_path / 'proc')) == 250
    assert drm.owner_pid({999}, str(tmp_path / 'proc')) == 999
    assert drm.owner_pid(set(), str(tmp_path / 'proc')) is None


def test_clients_without_an_id_are_not_merged(tmp_path):
    proc = FakeProc(tmp_path / 'proc')
    text = 'drm-driver:\ti915\ndrm-pdev:\t0000:00:02.0\ndrm-engine-render:\t5 ns\n'
    proc.add(10, fds={3: ('/dev/dri/renderD128', text), 4: ('/dev/dri/renderD128', text)})
    assert len(drm.scan_clients(str(tmp_path / 'proc')).clients) == 2


def test_unreadable_fds_are_counted_and_vanished_processes_skipped(tmp_path, monkeypatch):
    proc = FakeProc(tmp_path / 'proc')
    proc.add(10, fds={3: ('/dev/dri/renderD128', fixture('i915-engines.txt'))})
    proc.add(11, fds={3: ('/dev/dri/renderD128', fixture('xe-cycles.txt'))})
    proc.add(12, fds={3: ('/dev/dri/renderD128', fixture('xe-cycles.txt'))})
    os.symlink('/proc/nonexistent/fd', os.path.join(str(tmp_path / 'proc'), '13'))  # a pid that exited
    deny(monkeypatch, os.path.join(str(tmp_path / 'proc'), '11', 'fd'), os.path.join(str(tmp_path / 'proc'), '12', 'fdinfo', '3'))
    scan = drm.scan_clients(str(tmp_path / 'proc'))
    assert list(scan.clients) == [('0000:00:02.0', 7)]
    assert scan.fds_denied == 2 and not scan.complete
    assert drm.scan_clients(str(tmp_path / 'missing')).clients == {}


# ---------------------------------------------------------------------------- utilization
def client(text):
    return drm.parse_fdinfo('drm-driver:\tx\ndrm-client-id:\t1\n' + text)


def test_engine_ns_with_capacity():
    prev = client('drm-engine-render:\t1000000000 ns\ndrm-engine-video:\t0 ns\ndrm-engine-capacity-video:\t2\n')
    cur = client('drm-engine-render:\t1250000000 ns\ndrm-engine-video:\t500000000 ns\ndrm-engine-capacity-video:\t2\n')
    assert drm.engine_utilization(prev, cur, 0.5) == {'render': 50.0, 'video': 50.0}
    assert drm.client_utilization(prev, cur, 0.5) == 50
    assert drm.client_utilization(None, cur, 0.5) is None
    assert drm.client_utilization(prev, cur, 0) is None


def test_xe_cycles_over_total_cycles_and_capacity():
    prev = drm.parse_fdinfo(fixture('xe-cycles.txt'))
    cur = drm.parse_fdinfo(fixture('xe-cycles.txt').replace('drm-cycles-rcs:\t28257900', 'drm-cycles-rcs:\t78257900')
                           .replace('drm-cycles-ccs:\t0', 'drm-cycles-ccs:\t200000000')
                           .replace('7655183225', '7855183225'))
    engines = drm.engine_utilization(prev, cur, 99.0)  # the wall clock does not matter: GPU timestamps
    assert engines['rcs'] == pytest.approx(25.0) and engines['ccs'] == pytest.approx(25.0) and engines['bcs'] == 0
    assert drm.client_utilization(prev, cur, 0.25) == 25
    assert drm.client_utilization(prev, prev, 0.25) is None  # total cycles did not move: unknown, not 0


def test_maxfreq_counters_going_backwards_and_clamping():
    prev = client('drm-cycles-f:\t1000\ndrm-maxfreq-f:\t1000 Hz\n')
    cur = client('drm-cycles-f:\t1500\ndrm-maxfreq-f:\t1000 Hz\n')
    assert drm.engine_utilization(prev, cur, 1.0) == {'f': 50.0}
    assert drm.engine_utilization(cur, prev, 1.0) == {'f': 0.0}  # went backwards: no progress
    fast = client('drm-engine-r:\t9000000000 ns\n')
    assert drm.client_utilization(client('drm-engine-r:\t0 ns\n'), fast, 1.0) == 100


def test_device_utilization_sums_clients_per_engine():
    a0, a1 = client('drm-engine-render:\t0 ns\n'), client('drm-engine-render:\t300000000 ns\n')
    b0, b1 = client('drm-engine-render:\t0 ns\n'), client('drm-engine-render:\t200000000 ns\n')
    assert drm.device_utilization({1: a0, 2: b0}, {1: a1, 2: b1}, 1.0) == 50
    assert drm.device_utilization({}, {1: a1}, 1.0) is None  # nothing read twice
    assert drm.device_utilization({1: client('')}, {1: client('')}, 1.0) is None  # no engine counters


class Reading(object):
    def __init__(self, taken_at, n):
        self.taken_at = taken_at
        self.n = n


def test_sample_pair_waits_once_then_reuses_the_previous_reading():
    clock = [100.0]
    slept = []
    count = [0]

    def sample():
        count[0] += 1
        return Reading(clock[0], count[0])

    def sleep(seconds):
        slept.append(seconds)
        clock[0] += seconds
    cache = {}
    first, second = drm.sample_pair(sample, 'k', interval=0.25, clock=lambda: clock[0], sleep=sleep, cache=cache)
    assert (first.n, second.n, slept) == (1, 2, [0.25])
    clock[0] += 5.0
    first, second = drm.sample_pair(sample, 'k', interval=0.25, clock=lambda: clock[0], sleep=sleep, cache=cache)
    assert (first.n, second.n, slept) == (2, 3, [0.25])  # no wait: the last reading is the baseline
    clock[0] += 0.1
    first, second = drm.sample_pair(sample, 'k', interval=0.25, clock=lambda: clock[0], sleep=sleep, cache=cache)
    assert first.n == 3 and slept[-1] == pytest.approx(0.15)  # too recent: wait the rest
    clock[0] += 1000.0
    first, second = drm.sample_pair(sample, 'k', interval=0.25, clock=lambda: clock[0], sleep=sleep, cache=cache)
    assert (first.n, second.n) == (5, 6)  # too old: a fresh pair
    clock[0] += 1000.0
    first, second = drm.sample_pair(sample, 'k', interval=0.25, clock=lambda: clock[0], sleep=sleep, cache=cache,
                                    needed=lambda r: False)
    assert first is second and first.n == 7 and len(slept) == 3  # nothing to compare: no wait


# ---------------------------------------------------------------------------- sysfs
def test_list_drm_cards_filters_vendor_and_driver(tmp_path):
    sys_root = str(tmp_path / 'sys')
    make_card(sys_root, 1, '0000:03:00.0', hwmon={'temp1_input': 45500, 'power1_max': 225000000, 'energy1_input': 5})
    make_card(sys_root, 0, '0000:00:02.0', device='0x46a6')
    make_card(sys_root, 2, '0000:c3:00.0', vendor='0x1002', device='0x740c', driver='amdgpu')
    make_card(sys_root, 3, '0000:05:00.0', driver=None)  # no driver bound
    cards = drm.list_drm_cards(sys_root, '0x8086', drm.INTEL_DRIVERS)
    assert [(c.minor, c.bdf, c.driver, c.device_id) for c in cards] == [
        (0, '0000:00:02.0', 'i915', '0x46a6'), (1, '0000:03:00.0', 'i915', '0x56a0')]
    assert [c.bdf for c in drm.list_drm_cards(sys_root, '0x1002', drm.AMD_DRIVERS)] == ['0000:c3:00.0']
    assert len(drm.list_drm_cards(sys_root)) == 4
    assert drm.hwmon_readings(cards[1]) == {'temp_c': 46, 'power_w': None, 'power_cap_w': 225.0, 'energy_uj': 5}
    assert drm.hwmon_readings(cards[0])['temp_c'] is None
    assert drm.count_pci_display_devices(sys_root, '0x8086') == 3
    assert drm.list_drm_cards(str(tmp_path / 'nothing')) == []


def test_pci_device_name(tmp_path):
    ids = tmp_path / 'usr' / 'share' / 'misc'
    ids.mkdir(parents=True)
    (ids / 'pci.ids').write_text('# comment\n1002  Advanced Micro Devices, Inc. [AMD/ATI]\n\t740c  Aldebaran/MI200 [Instinct MI250X/MI250]\n'
                                 '8086  Intel Corporation\n\t56a0  DG2 [Arc A770]\n\t\t1028 0001  a subsystem\n')
    assert drm.pci_device_name('0x8086', '0x56a0', str(tmp_path)) == 'DG2 [Arc A770]'
    assert drm.pci_device_name('0x1002', '0x740c', str(tmp_path)) == 'Aldebaran/MI200 [Instinct MI250X/MI250]'
    assert drm.pci_device_name('0x8086', '0x0001', str(tmp_path)) is None
    assert drm.pci_device_name('0x8086', '0x56a0', str(tmp_path / 'none')) is None
    assert drm.pci_device_name(None, '0x56a0', str(tmp_path)) is None


def test_drm_root_seam(monkeypatch):
    monkeypatch.delenv(drm.ROOT_ENV, raising=False)
    assert drm.drm_root() == '/'
    monkeypatch.setenv(drm.ROOT_ENV, '/tmp/node-drm')
    assert drm.drm_root() == '/tmp/node-drm' and drm.drm_root('/x') == '/x'
