# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""GPU health (issue #17): Xid events from the kernel log and NVML, the recovery action, hung drivers.

Everything runs through the real pynvml over the simulated NVML (gpusim xid / set --recovery-action / hang).
SAFETY: the only processes signalled are gpusim workloads of each test's own node (gpusim kill-all) and
the watchdog children the core forks itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard, metrics, model, watchdog, xid
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import MAX_XID_EVENTS, Device
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_facts, gpu_remediate
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

parser = pytest.importorskip('prometheus_client.parser')

TICK = r'''
import sys
sys.path.insert(0, sys.argv[1])
from core import cli
sys.exit(cli.main(sys.argv[2:]))
'''


@pytest.fixture
def node(monkeypatch):
    """A 3-GPU simulated node loaded in this process; the core reads its fake kernel log."""
    if h.sim_build() is None or h.gpusim_path() is None:
        pytest.skip('simulator not built: run `make sim`')
    with h.gpusim_node(gpus=3) as sim:
        monkeypatch.setenv(xid.KMSG_ENV, json.loads(sim.gpusim('show'))['kmsg_path'])
        yield sim


def devices(snapshot):
    return dict((d['index'], d) for d in snapshot.to_facts()['devices'])


# ---------------------------------------------------------------------------- the kernel log
@pytest.mark.parametrize('line, code, pid, name, pci', [
    ('NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.', 79, 1234, 'python', '0000:3b:00'),
    ("NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception", 13, None, None, '0000:3b:00'),
    ('NVRM: Xid (PCI:0000:01:00): 31, Ch 0000000b, engmask 00000120, intr 10000000', 31, None, None, '0000:01:00'),
    ('NVRM: Xid (PCI:0000:41:00 GPU-I:01 GPU-CI:00): 43, pid=77, name=train, Ch 00000008', 43, 77, 'train', '0000:41:00'),
    ('NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.',
     63, 1896, None, '0000:10:1c'),
])
def test_kernel_log_lines(line, code, pid, name, pci):
    event = xid.parse_line(line, 1.5)
    assert (event.code, event.pid, event.name, event.pci_bus_id, event.time, event.source) == (code, pid, name, pci, 1.5, 'kmsg')
    assert (event.fault, event.action) == xid.classify(code)[1:]
    assert xid.parse_line('NVRM: GPU at PCI:0000:01:00: GPU-bc0fa0b9') is None


def test_kernel_log_record_time_and_escaping(tmp_path):
    path = tmp_path / 'kmsg'
    path.write_bytes(b'6,1,5000000,-;usb 1-1: new device\n'
                     b'4,2,7000000,-;NVRM: Xid (PCI:0000:07:00): 13, pid=42, name=ev\x1b[2Jil, bad\x07 access\n'
                     b' SUBSYSTEM=pci\n')
    events, error = xid.read_kmsg(str(path), now=1000.0, monotonic=10.0)
    assert error is None and len(events) == 1
    assert events[0].time == 997.0                      # 990 (boot) + 7 s
    assert '\x1b' not in events[0].name and '\x07' not in events[0].message
    assert xid.read_kmsg(str(tmp_path / 'missing'))[0] is None


def test_an_events_stamp_is_the_kernels_and_stays_the_same_on_every_read(tmp_path):
    """The epoch time of a kmsg record is converted through each read's clocks and moves between reads (here
    by 4 ms, as a preempted read under load does); the kernel's stamp does not: it is what identifies the event."""
    path = tmp_path / 'kmsg'
    path.write_bytes(b'4,2,7000123,-;NVRM: Xid (PCI:0000:07:00): 48, pid=\'<unknown>\', name=<unknown>, DBE\n')
    first = xid.read_kmsg(str(path), now=1000.0, monotonic=10.0)[0][0]
    second = xid.read_kmsg(str(path), now=1000.004, monotonic=10.0)[0][0]
    assert first.time != second.time and first.stamp == second.stamp == 7000123
    assert 'stamp' not in first.to_dict()                 # not a field of the facts (docs/design/contracts.md)
    memo_item = xid.event_dict(first)
    assert xid.event_from_dict(memo_item).stamp == 7000123 and xid.valid_memo({'events': [memo_item]})
    old_item = dict(memo_item)
    del old_item['stamp']                                 # a memo written before the stamp was kept
    assert xid.valid_memo({'events': [old_item]}) and xid.event_from_dict(old_item).stamp is None
    assert not xid.valid_memo({'events': [dict(memo_item, stamp='7000123')]})
    assert xid.parse_record('4,2,7000123,-;NVRM: Xid (PCI:0000:07:00): 48, DBE', 990.0).stamp == 7000123
    assert xid.parse_record('4,2,x,-;NVRM: Xid (PCI:0000:07:00): 48, DBE', 990.0) is None   # not the kernel's header


def test_events_are_bounded_per_class_and_the_table_is_the_documented_one():
    dev = Device(vendor='nvidia', vendor_index=0, pci_bus_id='00000000:07:00.0')
    for i in range(MAX_XID_EVENTS + 8):
        xid.join_events([dev], [xid.make_event(13, 'kmsg', time_s=float(i), pid=100 + i, pci_bus_id='0000:07:00')])
    keep = model.XID_KEEP['kill_app']
    assert len(dev.xid_events) == keep and dev.xid_events[0].time == MAX_XID_EVENTS + 8.0 - keep   # the newest
    assert dev.xid_counts == {13: MAX_XID_EVENTS + 8} and dev.xid_code_counts() == {13: MAX_XID_EVENTS + 8}
    assert sum(model.XID_KEEP.values()) == MAX_XID_EVENTS
    doc = os.path.join(os.path.dirname(h.MODULE_UTILS_DIR), '..', 'docs', 'health.md')
    with open(doc) as handle:
        rows = re.findall(r'^\| (\d+) \| [^|]+ \| (\w+) \| (\w+) \|', handle.read(), re.M)
    assert dict((int(c), (f, a)) for c, f, a in rows) == dict((c, v[1:]) for c, v in xid.XID_TABLE.items())


@pytest.mark.parametrize('text, key', [
    ('0000:3b:00', (0, 0x3b, 0)), ('00000000:3B:00.0', (0, 0x3b, 0)), ('0001:3b:00', (1, 0x3b, 0)),
    ('00000001:3B:00.0', (1, 0x3b, 0)), ('3b:00.0', (0, 0x3b, 0)), ('10000:01:1f', (0x10000, 1, 0x1f)),
    ('', None), (None, None), ('0000:3b:00:00', None), ('zz:3b:00', None),
])
def test_pci_key_is_domain_bus_and_device(text, key):
    assert xid.pci_key(text) == key


@pytest.mark.parametrize('order', [(0, 1), (1, 0)])
def test_an_xid_counts_against_the_gpu_of_its_pci_domain_only_whatever_the_order(order):
    """Two GPUs on bus 3b of PCI domains 0 and 1 (issue 34): an Xid for 0001:3b:00 is the second one's only."""
    devs = [Device(vendor='nvidia', vendor_index=i, index=i, pci_bus_id=bus)
            for i, bus in enumerate(('00000000:3B:00.0', '00000001:3B:00.0'))]
    events = xid.XidEvents([xid.make_event(48, 'kmsg', time_s=1.0, pci_bus_id='0001:3b:00')])
    events.counts = {'0001:3b:00': {48: 3}}
    assert xid.join_events([devs[i] for i in order], events) == []
    assert devs[0].xid_events is None and [e.code for e in devs[1].xid_events] == [48]
    assert devs[1].xid_code_counts() == {48: 3} and devs[0].xid_code_counts() == {}
    assert xid.join_events(devs, [xid.make_event(79, 'kmsg', pci_bus_id='0002:3b:00')])[0].code == 79   # no GPU here
    assert devs[0].xid_events is None and [e.code for e in devs[1].xid_events] == [48]


def test_an_nvml_event_and_the_kernel_record_of_the_same_xid_are_one_event():
    """The driver's event (no pid, no stamp) and its kernel-log record: one event, the record's, counted once."""
    dev = Device(vendor='nvidia', vendor_index=0, pci_bus_id='00000000:07:00.0')
    dev.add_xid_event(xid.make_event(13, 'nvml', time_s=1000.0, pci_bus_id='0000:07:00'))
    record = xid.with_stamp(xid.make_event(13, 'kmsg', time_s=999.2, pid=42, name='python3', pci_bus_id='0000:07:00'), 5000)
    events = xid.XidEvents([record])
    events.counts = {'0000:07:00': {13: 1}}
    xid.join_events([dev], events)
    assert [(e.source, e.pid, e.stamp) for e in dev.xid_events] == [('kmsg', 42, 5000)] and dev.xid_code_counts() == {13: 1}
    assert dev.add_xid_event(xid.make_event(13, 'nvml', time_s=1001.0, pci_bus_id='0000:07:00')) == 'same'
    assert dev.add_xid_event(record) == 'same' and len(dev.xid_events) == 1   # the same record read again
    assert dev.add_xid_event(xid.make_event(13, 'nvml', time_s=1030.0, pci_bus_id='0000:07:00')) == 'kept'   # another one
    assert dev.xid_code_counts() == {13: 2}


# ---------------------------------------------------------------------------- through pynvml over the shim
def test_xid_79_recommends_a_reboot_and_xid_13_names_its_pid(node):
    pid = node.spawn(0, 2048, argv=['python', 'train.py'])
    node.gpusim('xid', '--gpu', '0', '--code', '13', '--pid', pid)
    node.gpusim('xid', '--gpu', '1', '--code', '79')
    snap = take_snapshot(vendor='nvidia', dev_roots=node.dev_roots, driver_timeout=30)
    gpu0, gpu1, gpu2 = (devices(snap)[i] for i in range(3))
    (event,) = gpu0['xid_events']
    assert (event['code'], event['pid'], event['name'], event['fault'], event['action']) == (13, pid, 'python', 'application', 'kill_app')
    assert gpu0['health']['status'] == 'ok' and gpu0['health_reasons'] == ['xid_13']
    assert gpu1['health']['status'] == 'lost' and gpu1['health']['recommended_action'] == 'reboot'
    assert gpu1['health_reasons'] == ['xid_79'] and gpu1['xid_events'][0]['pci_bus_id'] == '0000:0b:00'
    assert gpu2['xid_events'] == [] and gpu2['health_reasons'] == [] and gpu2['recovery_action'] is None
    assert snap.to_facts()['driver_hung'] is None
    # older than xid_since: listed, no longer driving the health
    later = take_snapshot(vendor='nvidia', gather_processes=False, xid_since=time.time() + 1)
    assert devices(later)[1]['health']['status'] == 'ok' and len(devices(later)[1]['xid_events']) == 1


@pytest.mark.parametrize('action, status, recommended', [('none', 'ok', 'none'), ('reset', 'degraded', 'reset'),
                                                         ('reboot', 'degraded', 'reboot'), ('drain_p2p', 'degraded', 'drain'),
                                                         ('drain_and_reset', 'degraded', 'drain')])
def test_recovery_action(node, action, status, recommended):
    node.gpusim('set', '--gpu', '2', '--recovery-action', action)
    gpu = devices(take_snapshot(vendor='nvidia', gather_processes=False, driver_timeout=30))[2]
    assert gpu['recovery_action'] == action
    assert (gpu['health']['status'], gpu['health']['recommended_action']) == (status, recommended)
    assert gpu['health_reasons'] == ([] if action == 'none' else ['recovery_action_%s' % action])


def test_nvml_events_arriving_while_the_snapshot_reads(node, monkeypatch):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import nvidia
    backend = nvidia.NvidiaBackend()
    backend.event_timeout_ms = 3000
    assert backend.probe().available
    injector = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; time.sleep(0.5); '
                                 'subprocess.run([sys.executable, sys.argv[1], "xid", "--gpu", "2", "--code", "48"], check=True)',
                                 h.gpusim_path()], env=node.env())
    try:
        devs = backend.devices()
    finally:
        backend.close()
        injector.wait(60)
    assert [(e.code, e.source, e.action) for e in devs[2].xid_events] == [(48, 'nvml', 'reset')]
    assert devs[0].xid_events == []


# ---------------------------------------------------------------------------- hung drivers
def test_a_hung_gpu_is_driver_hung_within_the_timeout(node):
    node.gpusim('hang', '--gpu', '1', '--seconds', '60')
    started = time.monotonic()
    with pytest.raises(watchdog.DriverHung) as caught:
        take_snapshot(vendor='nvidia', gather_processes=False, driver_timeout=1.5)
    assert time.monotonic() - started < 5
    details = caught.value.details
    assert (details['call'], details['vendor'], details['gpu'], details['timeout_s']) == ('nvmlDeviceGetUUID', 'nvidia', 1, 1.5)
    node.gpusim('hang', '--gpu', '1', '--seconds', '0')
    assert take_snapshot(vendor='nvidia', gather_processes=False, driver_timeout=5).devices


def test_gpu_facts_fails_cleanly_with_driver_hung(node, monkeypatch):
    h.patch_module_exits(monkeypatch)
    node.gpusim('hang', '--gpu', '2', '--seconds', '60')
    started = time.monotonic()
    result = h.run_main(gpu_facts.main, {'driver_timeout': 1, 'vendor': 'nvidia'})
    assert time.monotonic() - started < 5
    assert result['failed'] and result['driver_hung']['call'] == 'nvmlDeviceGetUUID' and result['driver_hung']['gpu'] == 2
    assert 'did not answer within 1s' in result['msg']
    result = h.run_main(gpu_facts.main, {'driver_timeout': 0, 'vendor': 'nvidia'})
    assert result['failed'] and 'driver_timeout' in result['msg']


def test_gpu_remediate_fails_cleanly_with_driver_hung_before_any_step(node, monkeypatch, tmp_path):
    h.patch_module_exits(monkeypatch)
    leaked = node.gpusim('leak', '--gpu', '0', '--mib', '4096')   # a ladder that would reset GPU 0
    node.gpusim('hang', '--gpu', '2', '--seconds', '60')
    args = {'driver_timeout': 1.5, 'vendor': 'nvidia', 'reboot_flag': str(tmp_path / 'flag'),
            'state_path': str(tmp_path / 'ladder.json'), 'audit_log': ''}
    started = time.monotonic()
    result = h.run_main(gpu_remediate.main, args)
    assert time.monotonic() - started < 6, leaked
    assert result['failed'] and result['driver_hung']['call'] == 'nvmlDeviceGetUUID' and result['driver_hung']['gpu'] == 2
    assert json.loads(node.gpusim('show'))['gpus'][0]['reset_count'] == 0 and not os.listdir(str(tmp_path))
    node.gpusim('hang', '--gpu', '2', '--seconds', '0')
    result = h.run_main(gpu_remediate.main, dict(args, _ansible_check_mode=True))
    assert not result.get('failed') and result['gpus'][0]['ladder'][0]['step'] == 'reset', result


def test_a_crashing_driver_read_is_an_error_not_a_dead_caller(node, monkeypatch):
    monkeypatch.setenv('GPUSIM_NVML_SEGFAULT', 'nvmlDeviceGetUUID')
    with pytest.raises(watchdog.DriverCrashed, match='nvmlDeviceGetUUID'):
        take_snapshot(vendor='nvidia', gather_processes=False, driver_timeout=10)


def _tick(node, root, now, timeout=60):
    argv = [sys.executable, '-c', TICK, h.MODULE_UTILS_DIR, 'tick', '--root', str(root), '--json', '--now', str(now),
            '--vendor', 'nvidia', '--dev-root', node.dev]
    env = h.shim_env(node.state)
    env[xid.KMSG_ENV] = os.environ[xid.KMSG_ENV]
    return subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, check=False)


def _metrics(path):
    with open(path) as handle:
        families = parser.text_string_to_metric_families(handle.read())
        return dict(((s.name, tuple(sorted(s.labels.items()))), s.value) for f in families for s in f.samples)


def test_a_tick_with_a_hung_driver_records_it_and_exits(node, tmp_path):
    root = tmp_path / 'guard'
    os.makedirs(str(root / 'etc' / 'gpufleet'))
    (root / 'etc' / 'gpufleet' / 'policy.yaml').write_text('mode: enforce\nusers: {nobody: {max_mem_gib_per_gpu: 8}}\n')
    (root / 'etc' / 'gpufleet' / 'guard.yaml').write_text('driver_timeout: 1.5\n')
    os.chmod(str(root / 'etc' / 'gpufleet' / 'guard.yaml'), 0o600)
    pid = node.spawn(0, 1024, argv=['python', 'train.py'])
    node.gpusim('xid', '--gpu', '0', '--code', '13', '--pid', pid)
    node.gpusim('xid', '--gpu', '1', '--code', '79')
    node.gpusim('set', '--gpu', '2', '--recovery-action', 'reset')
    ok = _tick(node, root, time.time())
    assert ok.returncode == 0, ok.stderr.decode(errors='replace')[-2000:]
    prom = str(root / 'var' / 'lib' / 'node_exporter' / 'textfile_collector' / 'gpufleet.prom')
    values = _metrics(prom)
    uuid = dict((g['index'], g['uuid']) for g in node.show()['gpus'])
    labels = dict((i, (('gpu', str(i)), ('name', 'NVIDIA A100-SXM4-80GB'), ('uuid', uuid[i]))) for i in range(3))
    assert values[('gpufleet_gpu_xid_errors', tuple(sorted(labels[0] + (('code', '13'), ('fault', 'application')))))] == 1
    assert values[('gpufleet_gpu_xid_errors', tuple(sorted(labels[1] + (('code', '79'), ('fault', 'gpu')))))] == 1
    assert values[('gpufleet_gpu_reboot_wanted', labels[1])] == 1 and values[('gpufleet_gpu_reboot_wanted', labels[0])] == 0
    assert values[('gpufleet_gpu_health_status', labels[1])] == 2
    assert values[('gpufleet_gpu_recovery_action', tuple(sorted(labels[2] + (('action', 'reset'),))))] == 1
    assert values[('gpufleet_gpu_recovery_action', tuple(sorted(labels[2] + (('action', 'reboot'),))))] == 0
    assert values[('gpufleet_guard_driver_hung', ())] == 0

    node.gpusim('hang', '--gpu', '2', '--seconds', '60')
    started = time.monotonic()
    hung = _tick(node, root, time.time())
    assert time.monotonic() - started < 10
    assert hung.returncode == 1
    summary = json.loads(hung.stdout.decode())
    assert summary['driver_hung']['call'] == 'nvmlDeviceGetUUID' and summary['driver_hung']['gpu'] == 2
    with open(str(root / 'var' / 'log' / 'gpufleet' / 'guard.jsonl')) as handle:
        events = [json.loads(line) for line in handle]
    assert events[-1]['event'] == 'guard_driver_hung' and events[-1]['call'] == 'nvmlDeviceGetUUID'
    values = _metrics(prom)
    assert values[('gpufleet_guard_driver_hung', (('call', 'nvmlDeviceGetUUID'),))] == 1
    assert values[('gpufleet_guard_ticks_total', ())] == 1      # the counters survive the hung tick
    assert node.alive(pid)


def test_a_later_tick_does_not_wait_for_a_stuck_one(tmp_path):
    """The tick lock is non-blocking: while one tick holds it (stuck in a driver read), the next returns at once."""
    paths = guard.Paths(root=str(tmp_path))
    holder = guard.TickLock(paths.lock).acquire()
    try:
        assert holder.acquired
        started = time.monotonic()
        summary = guard.run_tick(paths, guard.Settings(), take_snapshot=lambda **kw: pytest.fail('must not read'))
        assert time.monotonic() - started < 1
        assert summary['rc'] == 0 and 'another tick holds' in summary['skipped']
    finally:
        holder.release()


def test_a_stuck_child_does_not_keep_the_tick_lock(tmp_path):
    """The watchdog child closes what it inherited: a child stuck in the driver cannot hold the tick's lock."""
    paths = guard.Paths(root=str(tmp_path))
    lock = guard.TickLock(paths.lock).acquire()
    try:
        number = lock.fd
        inherited = watchdog.run(lambda: os.path.exists('/proc/self/fd/%d' % number), 10)
    finally:
        lock.release()
    assert inherited is False


def test_health_metrics_render_with_help_and_type():
    dev = Device(vendor='nvidia', vendor_index=0, index=0, uuid='GPU-1', name='A100', recovery_action='reboot')
    dev.add_xid_event(xid.make_event(79, 'kmsg', time_s=time.time()))
    dev.add_xid_event(xid.make_event(48, 'kmsg', time_s=time.time()))
    dev.add_xid_event(xid.make_event(48, 'nvml', time_s=time.time() - 60))   # another 48 (the same one: test_xid_trust)
    xid.apply_health(dev)

    class Snap(object):
        devices = [dev]
        processes = []

    text = metrics.guard_metrics(Snap(), tick={'driver_hung': {'call': 'nvmlDeviceGetName'}}).render()
    for name in ('gpufleet_gpu_xid_errors', 'gpufleet_gpu_recovery_action', 'gpufleet_gpu_reboot_wanted',
                 'gpufleet_guard_driver_hung'):
        assert '# HELP %s ' % name in text and '# TYPE %s gauge' % name in text
    families = dict((f.name, f) for f in parser.text_string_to_metric_families(text))
    xids = dict((s.labels['code'], s.value) for s in families['gpufleet_gpu_xid_errors'].samples)
    assert xids == {'48': 2, '79': 1}
    assert [s.value for s in families['gpufleet_gpu_reboot_wanted'].samples] == [1]


def test_guard_metrics_reboot_wanted_also_from_the_ladders_reboot_flag():
    """One figure: health says reboot, or the remediation ladder's flag of this boot names the GPU (a failed reset)."""
    devs = [Device(vendor='nvidia', vendor_index=i, index=i, uuid='GPU-%d' % i, name='A100') for i in range(3)]
    devs[0].add_xid_event(xid.make_event(79, 'kmsg', time_s=time.time()))
    for dev in devs:
        xid.apply_health(dev)

    class Snap(object):
        devices = devs
        processes = []

    text = metrics.guard_metrics(Snap(), counters={'remediation_steps': {'reset': 2}}, reboot_flagged=['GPU-1']).render()
    families = dict((f.name, f) for f in parser.text_string_to_metric_families(text))
    wanted = dict((s.labels['gpu'], s.value) for s in families['gpufleet_gpu_reboot_wanted'].samples)
    assert wanted == {'0': 1, '1': 1, '2': 0}
    assert [(s.labels, s.value) for s in families['gpufleet_guard_remediation_steps'].samples] == [({'step': 'reset'}, 2)]


JOURNALCTL = r"""#!%(python)s
# Fake journalctl of the kernel-log fallback test: records its argv, prints kernel messages as journalctl -o json does.
import json, sys
with open(%(log)r, 'a') as log:
    log.write(json.dumps(sys.argv[1:]) + '\n')
if %(rc)d:
    sys.stderr.write('No journal files were found.\n')
    sys.exit(%(rc)d)
for stamp, message in [('1700000000000000', 'NVRM: Xid (PCI:0000:07:00): 79, pid=\'<unknown>\', name=<unknown>, GPU has fallen off the bus.'),
                       ('1700000001500000', 'usb 1-1: new high-speed USB device'),
                       ('1700000002000000', list(b'NVRM: Xid (PCI:0000:0b:00): 13, pid=42, name=py\xff, Graphics Exception'))]:
    print(json.dumps({'__REALTIME_TIMESTAMP': stamp, 'MESSAGE': message, '_TRANSPORT': 'kernel'}))
"""


@pytest.mark.parametrize('rc', [0, 1])
def test_without_dev_kmsg_the_kernel_log_comes_from_the_journal(tmp_path, monkeypatch, rc):
    """The guard's unit keeps ProtectKernelLogs=yes (no /dev/kmsg): this boot's kernel messages come from journalctl -k."""
    bindir = tmp_path / 'bin'
    bindir.mkdir()
    fake = bindir / 'journalctl'
    fake.write_text(JOURNALCTL % {'python': sys.executable, 'log': str(tmp_path / 'argv.log'), 'rc': rc})
    fake.chmod(0o755)
    monkeypatch.setenv('PATH', '%s:%s' % (bindir, os.environ.get('PATH', '')))
    monkeypatch.delenv(xid.KMSG_ENV, raising=False)
    monkeypatch.setattr(xid, 'KMSG_PATH', str(tmp_path / 'no-kmsg'))
    events, error = xid.read_kmsg()
    argv = json.loads((tmp_path / 'argv.log').read_text())
    assert argv[:4] == ['-k', '-b', '-o', 'json'] and '-n' in argv
    if rc:
        assert events is None and 'no-kmsg' in error and 'rc 1' in error and 'No journal files' in error
        return
    assert error is None
    assert [(e.code, e.time, e.pid, e.pci_bus_id, e.source) for e in events] == [
        (79, 1700000000.0, None, '0000:07:00', 'kmsg'), (13, 1700000002.0, 42, '0000:0b:00', 'kmsg')]
    assert events[1].name == 'py\ufffd' or events[1].name.startswith('py')
    assert xid.read_kmsg(str(tmp_path / 'other-missing'))[0] is None   # an explicit path never falls back
