# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The Apple Silicon backend: ioreg plist parsing, per-process GPU time as utilization, no invented
memory, every failure mode, and the simulator's fake ioreg on PATH."""

from __future__ import annotations

import os
import plistlib
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import apple
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.apple import AppleBackend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.drm_test_helpers import FakeClock, IOREG_FIXTURES

FIXTURE = os.path.join(IOREG_FIXTURES, 'm2-max-ioaccelerator.plist')


def recorded():
    with open(FIXTURE, 'rb') as handle:
        return plistlib.load(handle)


def later(entries, seconds, shares):
    """The same registry ``seconds`` later: each pid's first client accumulated ``share`` of the time."""
    entries = plistlib.loads(plistlib.dumps(entries))
    done = set()
    for client in entries[0]['IORegistryEntryChildren']:
        pid, _name = apple.parse_creator(client.get('IOUserClientCreator'))
        if pid in shares and pid not in done and client.get('AppUsage'):
            client['AppUsage'][0]['accumulatedGPUTime'] += int(shares[pid] * seconds * 1e9)
            done.add(pid)
    return entries


class Ioreg(object):
    """A fake ioreg runner serving a list of readings (plist objects, or (rc, stderr) failures); the last repeats."""

    def __init__(self, *readings):
        self.readings = list(readings)
        self.argvs = []

    def __call__(self, argv, timeout):
        self.argvs.append(argv)
        reading = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        if isinstance(reading, tuple):
            return reading[0], b'', reading[1]
        if isinstance(reading, bytes):
            return 0, reading, ''
        return 0, plistlib.dumps(reading, fmt=plistlib.FMT_XML), ''


def backend_for(runner, clock=None, platform='darwin', which=lambda name: '/usr/sbin/ioreg'):
    clock = clock or FakeClock()
    return AppleBackend(platform=platform, runner=runner, which=which, clock=clock, sleep=clock.sleep, cache={},
                        interval=0.5)


def test_creator_parsing():
    assert apple.parse_creator('pid 391, WindowServer') == (391, 'WindowServer')
    assert apple.parse_creator('pid 12') == (12, None)
    assert apple.parse_creator('kernel') == (None, None) and apple.parse_creator(None) == (None, None)


def test_device_and_process_readings():
    first = recorded()
    runner = Ioreg(first, first, later(first, 0.5, {2231: 0.6, 391: 0.1}))
    backend = backend_for(runner)
    status = backend.probe()
    assert status.available and status.error is None
    (gpu,) = backend.devices()
    assert runner.argvs[0] == ['/usr/sbin/ioreg', '-r', '-d', '2', '-w', '0', '-c', 'IOAccelerator', '-a']
    assert (gpu.vendor, gpu.vendor_index, gpu.name, gpu.uuid, gpu.pci_bus_id) == ('apple', 0, 'Apple M2 Max', None, None)
    assert (gpu.utilization_pct, gpu.memory_used_mib) == (37, 1207140352 // (1024 * 1024))
    # unified memory: no GPU memory total, so no free or orphaned figure; no temperature or power without root
    assert (gpu.memory_total_mib, gpu.memory_free_mib, gpu.temperature_c, gpu.power_w) == (None, None, None, None)
    assert gpu.compute_orphaned() is None and apple.NO_PROCESS_MEMORY in gpu.errors
    procs = dict((p.pid, p) for p in gpu.driver_processes)
    assert sorted(procs) == [391, 614, 1876, 2231]  # two clients of a process are one entry
    assert (procs[2231].util_pct, procs[391].util_pct, procs[1876].util_pct) == (60, 10, 0)
    assert procs[614].util_pct is None  # its client reports no AppUsage: unknown, not 0
    assert all(p.used_mib is None for p in procs.values()) and procs[391].name == 'WindowServer'
    assert gpu.health.to_dict() == {'status': 'ok', 'recommended_action': 'none', 'reasons': []}


def test_recoveries_are_a_health_note():
    entries = recorded()
    entries[0]['PerformanceStatistics']['recoveryCount'] = 2
    backend = backend_for(Ioreg(entries))
    backend.probe()
    (gpu,) = backend.devices()
    assert gpu.health.status == 'ok' and gpu.health.reasons == ['the GPU driver recovered from 2 GPU hang(s) since boot']


def test_snapshot_schema_matches_the_other_vendors():
    snap = take_snapshot(vendor='apple', factories={'apple': lambda: backend_for(Ioreg(recorded()))},
                         inventory=ProcessInventory(proc_root='/nonexistent', use_psutil=False))
    facts = snap.to_facts()
    assert facts['backends']['apple']['available'] and facts['devices'][0]['index'] == 0
    assert facts['devices'][0]['processes'] == [391, 614, 1876, 2231]
    assert dict((p['pid'], p['name']) for p in facts['processes'])[1876] == 'Google Chrome He'
    assert all(p['used_mib'] is None for p in facts['processes'])


@pytest.mark.parametrize('platform, which, runner, error', [
    ('linux', lambda n: '/usr/sbin/ioreg', None, 'Apple GPUs exist only on macOS hosts (this host is linux)'),
    ('darwin', lambda n: None, None, 'the ioreg command was not found (macOS ships it as /usr/sbin/ioreg)'),
    ('darwin', None, Ioreg((1, 'ioreg: could not open the registry: (ipc/send) invalid destination port\n')),
     'ioreg failed (rc 1): ioreg: could not open the registry: (ipc/send) invalid destination port'),
    ('darwin', None, Ioreg((1, 'sandbox-exec: Operation not permitted\n')),
     'ioreg failed (rc 1): sandbox-exec: Operation not permitted'),
    ('darwin', None, Ioreg(b'<plist><array><dict><key>x</key>'), None),
    ('darwin', None, Ioreg([]), 'the I/O Registry lists no IOAccelerator (no GPU)'),
])
def test_unavailable_with_the_reason(platform, which, runner, error):
    backend = backend_for(runner or Ioreg(recorded()), platform=platform, which=which or (lambda n: '/usr/sbin/ioreg'))
    status = backend.probe()
    assert not status.available and backend.devices() == []
    if error is None:
        assert status.error.startswith('ioreg printed no readable plist')
    else:
        assert status.error == error


def test_the_registry_stops_answering_or_the_gpu_disappears():
    first = recorded()
    backend = backend_for(Ioreg(first, first, (1, 'ioreg: timed out\n')))
    backend.probe()
    (gpu,) = backend.devices()
    assert gpu.health.status == 'lost' and gpu.health.recommended_action == 'reboot'
    assert 'ioreg failed (rc 1): ioreg: timed out' in gpu.health.reasons[0]
    backend = backend_for(Ioreg(first, first, []))
    backend.probe()
    (gpu,) = backend.devices()
    assert gpu.health.status == 'lost' and 'no longer in the I/O Registry' in gpu.health.reasons[0]


def test_reset_is_refused_with_the_reason():
    assert apple.RESET_UNSUPPORTED.startswith('Apple GPUs cannot be reset')


@pytest.mark.skipif(h.sim_dir() is None, reason='the simulator (tests/sim) is not there')
def test_the_simulators_fake_ioreg_on_path(monkeypatch):
    fake_bin = os.path.join(h.sim_dir(), 'bin')
    monkeypatch.setenv('PATH', os.pathsep.join([fake_bin, os.path.dirname(sys.executable), os.environ.get('PATH', '')]))
    monkeypatch.setenv('GPUSIM_IOREG_FIXTURE', FIXTURE)
    clock = FakeClock()
    backend = AppleBackend(platform='darwin', clock=clock, sleep=clock.sleep, cache={}, interval=0.01)
    assert backend.probe().available and backend.ioreg == os.path.join(fake_bin, 'ioreg')
    (gpu,) = backend.devices()
    assert gpu.name == 'Apple M2 Max' and [p.pid for p in gpu.driver_processes] == [391, 614, 1876, 2231]
    assert [p.util_pct for p in gpu.driver_processes] == [0, None, 0, 0]  # a recording does not advance
    monkeypatch.setenv('GPUSIM_IOREG_FAIL', 'ioreg: Operation not permitted')
    status = AppleBackend(platform='darwin').probe()
    assert status.error == 'ioreg failed (rc 1): ioreg: Operation not permitted'
