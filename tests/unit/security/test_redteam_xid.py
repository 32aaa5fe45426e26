# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: forged Xid errors, and a flood that hides a real one (docs/health.md, docs/security.md, issue 28).

alice makes the kernel print the driver's Xid text: as the name of a file she maps and jumps into (the
segfault and trap reports print its basename), as her process name (``NVRM: Xid (PCI:`` is exactly 15
bytes: segfault, OOM, drop_caches, page-allocation and stack-depth reports start with it), in a cgroup or
file name that the OOM and audit reports print, with a newline and a whole record in a file name, in a
continuation fragment; she writes the perfect text to /dev/kmsg (the kernel gives it facility LOG_USER or the
one she names), names a PCI address that is no GPU of the node (another bus, the same bus in PCI domain 1), and
sends journal entries with another transport.  Her forged Xid 13 and 43 name bob's job, a root-run inference
server and a root-run ``sshd``; her forged 95, 48 and 64 ask for resets and a drain, her forged 79 for a reboot.
None of it may change anything: no kill, no reset, no drain, no reboot flag, no health, no metric.  A genuine
driver Xid 13 still ends the process it names (listed on that GPU, its name, started before the record), never a
protected root service, another process with the number, a device-file holder or a process on another GPU; a
genuine Xid 48 still resets the GPU, also after 100 milder events.

The records are written only to the simulator's kernel log (``gpusim kmsg`` / ``gpusim xid``, the file the core
reads through ``$_GPUFLEET_KMSG``), in /dev/kmsg's exact format (facility and level in the PRIO field).  The
scenarios run in PID namespaces of their own (``redteam.run``, see redteam.py for the safety); the in-process
ladder tests signal only gpusim workloads of their own node and a holder they started (by its Popen handle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import remediate as rem
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import xid
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import MAX_XID_EVENTS, Device
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_remediate import SimHost
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

needs_sim = pytest.mark.skipif(h.sim_build() is None or h.gpusim_path() is None, reason='simulator not built: run `make sim`')
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='the fake nvidia-smi resets only as root, like the real one')
COMM = 'NVRM: Xid (PCI:'       # a process name of exactly 15 bytes, the kernel's limit
RECORDER = '#!%s\nimport json, sys\nwith open(%r, "a") as log:\n    log.write(json.dumps(sys.argv[1:]) + "\\n")\n'


def driver_text(bus, code, pid=None, name=None, message='Graphics SM Warp Exception'):
    """The driver's Xid text (krcReportXid): what every forgery carries somewhere."""
    who = "pid=%d, name=%s, " % (pid, name) if pid is not None else "pid='<unknown>', name=<unknown>, "
    return 'NVRM: Xid (PCI:%s): %d, %s%s' % (bus, code, who, message)


def forgeries(text, alice):
    """(vector, message, facility, flags): each way a user gets ``text`` into a kernel-log record."""
    return [
        ('segfault in a mapped file', '%s[%d]: segfault at 0 ip 00007f3a10001000 sp 00007ffc2e1f0000 error 15 in %s'
         '[7f3a10001000,7f3a10000000+1000]' % ('python3', alice, text), 'kern', '-'),
        ('segfault, older format', 'python3[%d]: segfault at 0 ip 00007f3a10001000 sp 00007ffc2e1f0000 error 15 in %s'
         '[7f3a10000000+1000]' % (alice, text), 'kern', '-'),
        ('trap in a mapped file', 'traps: python3[%d] general protection fault ip:7f3a10001000 sp:7ffc2e1f0000 error:0 in '
         '%s[7f3a10000000+1000]' % (alice, text), 'kern', '-'),
        ('the continuation fragment alone', ' in %s[7f3a10000000+1000]' % text, 'kern', 'c'),
        ('a newline and a whole record in a file name', 'python3[%d]: segfault at 0 ip 0 sp 0 error 15 in x\n4,9,1,-;%s'
         '[7f3a10000000+1000]' % (alice, text), 'kern', '-'),
        ('an OOM report with a cgroup name', 'oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,'
         'oom_memcg=/user.slice/%s,task_memcg=/user.slice/%s,task=python3,pid=%d,uid=1001' % (text, text, alice), 'kern', '-'),
        ('an audit report with a file name and the comm', 'audit: type=1400 audit(1767225600.123:42): apparmor="DENIED" '
         'operation="open" profile="alice" name="/home/alice/%s" pid=%d comm="%s" requested_mask="r"' % (text, alice, COMM),
         'kern', '-'),
        ('a write to /dev/kmsg (LOG_USER)', text, 'user', '-'),
        ('a write to /dev/kmsg naming facility daemon', text, 'daemon', '-'),
        ('a write to /dev/kmsg naming local7', text, 'local7', '-'),
    ]


def comm_reports(alice):
    """The kernel messages that start with a process name, for a process named ``NVRM: Xid (PCI:``."""
    return [
        ('segfault of the process so named', '%s[%d]: segfault at 0 ip 00007f3a10001000 sp 00007ffc2e1f0000 error 15 in '
         'a.out[400000+1000]' % (COMM, alice), 'kern', '-'),
        ('OOM killer invoked by it', '%s invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0' % COMM,
         'kern', '-'),
        ('drop_caches written by it', '%s (%d): drop_caches: 3' % (COMM, alice), 'kern', '-'),
        ('its page allocation failure', '%s: page allocation failure: order:0, mode:0x40cc0(GFP_KERNEL|__GFP_COMP), '
         'nodemask=(null)' % COMM, 'kern', '-'),
        ('its stack depth', '%s (%d) used greatest stack depth: 11944 bytes left' % (COMM, alice), 'kern', '-'),
        ('its lock report', '%s/%d is trying to acquire lock:' % (COMM, alice), 'kern', '-'),
    ]


def all_forgeries(buses, victims, alice):
    """Every vector for every forged Xid: ``victims`` [(gpu, code, pid, name)], plus the driver's exact text for PCI
    addresses that are no GPU of the node (another bus; GPU 0's bus in PCI domain 1)."""
    out = []
    for gpu, code, pid, name in victims:
        out.extend(forgeries(driver_text(buses[gpu], code, pid, name), alice))
    out.extend(comm_reports(alice))
    domain_one = '0001' + buses[0][4:]
    for bus in ('0000:99:00', domain_one):
        for code, pid, name in ((48, None, None), (79, None, None), (95, None, None), (13, victims[0][2], victims[0][3])):
            out.append(('the driver\'s text for %s, no GPU here' % bus, driver_text(bus, code, pid, name), 'kern', '-'))
    return out


def write(node_or_sim, records):
    """Append ``records`` to the simulator's kernel log (gpusim kmsg)."""
    for _vector, message, facility, flags in records:
        node_or_sim.gpusim('kmsg', '--message', message, '--facility', facility, '--level', 'warning', '--flags', flags)


def pci(gpu):
    domain, bus, rest = gpu['pci_bus_id'].split(':')
    return '%04x:%s:%s' % (int(domain, 16), bus.lower(), rest.split('.')[0].lower())


# ---------------------------------------------------------------------------- the reader: no forgery is an Xid
@needs_sim
def test_no_record_a_user_can_make_is_an_xid_and_the_drivers_own_still_are(monkeypatch):
    with h.gpusim_node(gpus=2) as sim:
        state = sim.show()
        monkeypatch.setenv(xid.KMSG_ENV, state['kmsg_path'])
        buses = [pci(gpu) for gpu in state['gpus']]
        victims = [(0, 13, 4321, 'python3'), (0, 43, 4322, 'tritonserver'), (1, 95, None, None), (1, 79, None, None)]
        records = all_forgeries(buses, victims, alice=4444)
        write(sim, records)
        with open(state['kmsg_path']) as handle:
            lines = handle.read().splitlines()
        assert len(lines) == len(records)      # a newline in a name is escaped: one record, one line
        for line, (vector, _message, _facility, _flags) in zip(lines, records):
            event = xid.parse_record(line, 0.0)
            assert event is None or xid.pci_key(event.pci_bus_id) not in [xid.pci_key(bus) for bus in buses], vector
        # the driver's text for an address that is no GPU here is read, and changes nothing of this node
        events, error = xid.read_kmsg(state['kmsg_path'])
        assert error is None and sorted(events.counts) == ['0000:99:00', '0001' + buses[0][4:]]
        snap = take_snapshot(vendor='nvidia', gather_processes=False)
        assert [(d.xid_events, d.xid_code_counts(), d.health.status) for d in snap.devices] == [([], {}, 'ok')] * 2
        sim.gpusim('xid', '--gpu', '0', '--code', '13', '--pid', '4321', '--name', 'python3')
        sim.gpusim('xid', '--gpu', '1', '--code', '48')
        snap = take_snapshot(vendor='nvidia', gather_processes=False)
        assert [[(e.code, e.pid, e.name, e.pci_bus_id) for e in d.xid_events] for d in snap.devices] == [
            [(13, 4321, 'python3', buses[0])], [(48, None, None, buses[1])]]
        assert [d.health.status for d in snap.devices] == ['ok', 'degraded']


@pytest.mark.parametrize('message', [
    ' NVRM: Xid (PCI:0000:07:00): 48, DBE',                       # not at the start of the message
    'kernel: NVRM: Xid (PCI:0000:07:00): 48, DBE',
    'NVRM: Xid (0000:07:00): 48, DBE',                            # the format of old drivers: not read
    'NVRM: Xid (PCI:0000:0B:00): 48, DBE',                        # %02x prints lower case
    'NVRM: Xid (PCI:0000:07:00.0): 48, DBE',                      # the driver prints no function
    'NVRM: Xid (PCI:0000:07:00): 48 DBE',                         # the code is followed by ", "
    'NVRM: Xid (PCI:0000:07:00): 048, DBE',                       # %d prints no leading zero
    'NVRM: Xid (PCI:0000:07:00): x48, DBE',
    'NVRM: Xid (PCI:00:07:00): 48, DBE',                          # %04x: at least four digits of domain
])
def test_only_the_drivers_exact_format_is_read(message):
    assert xid.parse_line(message) is None
    assert xid.parse_record('4,1,1000,-;' + message, 0.0) is None


@pytest.mark.parametrize('header, kept', [
    ('3', True), ('4', True), ('7', True),                       # facility 0: the kernel's own records
    ('8', False), ('12', False), ('14', False),                  # facility 1 (LOG_USER): what a write to /dev/kmsg gets
    ('28', False), ('190', False), ('x', False), (' 4', False), ('-4', False), ('', False),
])
def test_only_a_record_of_the_kernel_facility_is_read(header, kept):
    record = '%s,7,1000,-;NVRM: Xid (PCI:0000:07:00): 48, pid=\'<unknown>\', name=<unknown>, DBE' % header
    assert (xid.parse_record(record, 0.0) is not None) is kept
    assert xid.parse_record('NVRM: Xid (PCI:0000:07:00): 48, DBE', 0.0) is None   # no header: not a kmsg record


def test_pid_and_name_are_read_at_their_places_never_searched_for():
    event = xid.parse_line("NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, DBE pid=4321, name=python3, x")
    assert (event.pid, event.name) == (None, None) and event.message == 'DBE pid=4321, name=python3, x'
    event = xid.parse_line('NVRM: Xid (PCI:0000:07:00): 13, Graphics Exception, pid=4321, name=python3, x')
    assert (event.pid, event.name) == (None, None)
    event = xid.parse_line('NVRM: Xid (PCI:0000:07:00): 13, pid=0, name=<unknown>, x')
    assert event.pid is None
    # /dev/kmsg escapes control bytes, bytes from 0x7f and the backslash; the name is the kernel's text again
    event = xid.parse_record('4,1,5,-;NVRM: Xid (PCI:0000:07:00): 13, pid=42, name=py\\x5cx41\\xc3\\xa9, x', 0.0)
    assert event.name == 'py\\x41\u00e9'


# ---------------------------------------------------------------------------- the journal: only the kernel's transport
def journal_entry(message, transport='kernel', **fields):
    entry = {'__REALTIME_TIMESTAMP': str(int(time.time() * 1e6)), '_SOURCE_MONOTONIC_TIMESTAMP': str(int(time.monotonic() * 1e6)),
             'MESSAGE': message, '__CURSOR': 's=1;i=%x' % abs(hash(message))}
    if transport is not None:
        entry['_TRANSPORT'] = transport
    entry.update(fields)
    return entry


def fake_journalctl(tmp_path, monkeypatch, entries):
    """A journalctl on PATH that prints ``entries`` as ``journalctl -k -o json`` does; no /dev/kmsg."""
    bindir = tmp_path / 'jbin'
    bindir.mkdir(exist_ok=True)
    data = tmp_path / 'journal.json'
    data.write_text(json.dumps(entries))
    script = bindir / 'journalctl'
    script.write_text('#!%s\nimport json\nfor entry in json.load(open(%r)):\n    print(json.dumps(entry))\n' % (sys.executable, str(data)))
    script.chmod(0o755)
    monkeypatch.setenv('PATH', '%s:%s' % (bindir, os.environ.get('PATH', '')))
    monkeypatch.delenv(xid.KMSG_ENV, raising=False)
    monkeypatch.setattr(xid, 'KMSG_PATH', str(tmp_path / 'no-kmsg'))   # the hardened unit: no /dev/kmsg


def forged_journal(buses, bob):
    text = driver_text(buses[0], 13, bob, 'python3')
    entries = []
    for transport in ('syslog', 'journal', 'stdout', 'audit', 'driver', None):   # logger, systemd-cat, sd_journal_send, ...
        for message in (text, driver_text(buses[1], 95), driver_text(buses[2], 79)):
            entries.append(journal_entry(message, transport, SYSLOG_IDENTIFIER='kernel', TRANSPORT='kernel'))
    for facility in ('1', '3', '23'):     # a write to /dev/kmsg: the kernel transport, with its facility
        entries.append(journal_entry(driver_text(buses[1], 48), 'kernel', SYSLOG_FACILITY=facility))
    return entries


@needs_sim
@needs_root
def test_forged_journal_entries_change_nothing_in_the_ladder_and_a_kernel_one_still_resets(tmp_path, monkeypatch):
    hook = tmp_path / 'drain-hook'
    hook.write_text(RECORDER % (sys.executable, str(tmp_path / 'drain.log')))
    hook.chmod(0o755)
    with h.gpusim_node(gpus=3) as node:
        bob = node.spawn(gpu=0, mib=2048, argv=('python3', 'train.py'))
        buses = [pci(gpu) for gpu in node.show()['gpus']]
        fake_journalctl(tmp_path, monkeypatch, forged_journal(buses, bob))
        opts = rem.RemediateOptions(reboot_flag=str(tmp_path / 'lib' / 'reboot-wanted'), state_path=str(tmp_path / 'lib' / 'r.json'),
                                    drain_command=[str(hook)], node_name='n1', audit_path=None)
        result = rem.remediate(opts, SimHost(node), scheduler=None)
        assert not result['changed'] and all(gpu['ladder'] == [] and gpu['findings'] == [] for gpu in result['gpus']), result
        assert [gpu['health']['status'] for gpu in result['gpus']] == ['ok', 'ok', 'ok'] and not result['reboot_wanted']
        assert node.alive(bob) and [gpu['reset_count'] for gpu in node.show()['gpus']] == [0, 0, 0]
        assert not os.path.exists(opts.reboot_flag) and not (tmp_path / 'drain.log').exists()
        fake_journalctl(tmp_path, monkeypatch, forged_journal(buses, bob) + [journal_entry(driver_text(buses[1], 48))])
        result = rem.remediate(opts, SimHost(node), scheduler=None)
        assert [(s['step'], s['status']) for s in result['gpus'][1]['ladder']] == [('reset', 'done')], result
        assert [gpu['reset_count'] for gpu in node.show()['gpus']] == [0, 1, 0] and node.alive(bob)


# ---------------------------------------------------------------------------- a genuine Xid names a process
@needs_sim
@needs_root
def test_a_genuine_application_xid_ends_only_the_process_the_driver_lists_by_that_name_started_before_it(monkeypatch):
    with h.gpusim_node(gpus=3) as node:
        faulted = node.spawn(gpu=0, mib=1024, argv=('python3', 'train.py'))
        protected = node.spawn(gpu=0, mib=1024, argv=('sshd', '-D'))            # root, the simulator's root-owned binary
        renamed = node.spawn(gpu=0, mib=1024, argv=('python3', 'eval.py'))
        younger = node.spawn(gpu=1, mib=1024, argv=('python3', 'train.py'))
        elsewhere = node.spawn(gpu=2, mib=1024, argv=('python3', 'train.py'))
        unnamed = node.spawn(gpu=1, mib=1024, argv=('python3', 'train.py'))
        holder = subprocess.Popen([sys.executable, '-c', 'import sys, time; f = open(sys.argv[1]); time.sleep(120)',
                                   os.path.join(node.dev, 'nvidia1')])
        try:
            time.sleep(0.2)
            buses = [pci(gpu) for gpu in node.show()['gpus']]
            node.gpusim('xid', '--gpu', '0', '--code', '13', '--pid', faulted)                    # its comm: python3
            node.gpusim('xid', '--gpu', '0', '--code', '13', '--pid', protected)                  # sshd
            node.gpusim('xid', '--gpu', '0', '--code', '43', '--pid', renamed, '--name', 'tritonserver')
            node.gpusim('kmsg', '--facility', 'kern', '--seconds-ago', '600',                     # before it started
                        '--message', driver_text(buses[1], 31, younger, 'python3'))
            node.gpusim('xid', '--gpu', '1', '--code', '13', '--pid', elsewhere)                 # it runs on GPU 2
            node.gpusim('xid', '--gpu', '1', '--code', '13', '--pid', holder.pid)                # holds /dev/nvidia1 only
            node.gpusim('kmsg', '--facility', 'kern',                                             # an older driver: no name
                        '--message', 'NVRM: Xid (PCI:%s): 13, pid=%d, Graphics Exception' % (buses[1], unnamed))
            monkeypatch.setenv(xid.KMSG_ENV, node.show()['kmsg_path'])
            result = rem.remediate(rem.RemediateOptions(reboot_flag=None, state_path=None), SimHost(node), scheduler=None)
        finally:
            holder.kill()     # the holder this test started, by its Popen handle
            holder.wait(30)
        steps = dict((step['pid'], (step['status'], step['detail'])) for gpu in result['gpus'] for step in gpu['ladder'])
        assert steps[faulted][0] == 'done' and not node.alive(faulted), steps
        assert steps[protected][0] == 'skipped' and 'protected name sshd' in steps[protected][1] and node.alive(protected)
        assert 'the Xid names tritonserver' in steps[renamed][1] and node.alive(renamed)
        assert 'started after the Xid' in steps[younger][1] and node.alive(younger)
        assert 'does not list pid %d on GPU 1' % elsewhere in steps[elsewhere][1] and node.alive(elsewhere)
        assert 'does not list pid %d on GPU 1' % holder.pid in steps[holder.pid][1]
        assert 'names no process name' in steps[unnamed][1] and node.alive(unnamed)
        assert all(status == 'skipped' for pid, (status, _d) in steps.items() if pid != faulted)


class CountingHost(SimHost):
    """The simulator's host, counting the snapshots (each a full read of the drivers and /proc); GPU 1 gets
    ``xids`` as a snapshot gives them to it (by the keeping rule)."""

    reads = 0
    xids = ()

    def snapshot(self, vendor='auto', gather_processes=True, xid_since=None):
        self.reads += 1
        snap = SimHost.snapshot(self, vendor, gather_processes, xid_since)
        for event in self.xids:
            snap.all_devices[1].add_xid_event(event)
        return snap


@needs_sim
@needs_root
def test_application_xids_naming_pids_the_driver_does_not_list_cost_no_driver_reads(monkeypatch):
    """A user crashing her own kernels makes many genuine application Xids; only a pid the driver lists on that GPU
    costs a new read before its kill, so the tick's work is bounded by the processes really on the GPU."""
    with h.gpusim_node(gpus=2) as node:
        monkeypatch.setenv(xid.KMSG_ENV, node.show()['kmsg_path'])
        listed = node.spawn(gpu=1, mib=1024, argv=('python3', 'train.py'))
        bus = pci(node.show()['gpus'][1])
        events = [xid.make_event(13, 'kmsg', time_s=time.time(), pid=500000 + n, name='python3', pci_bus_id=bus) for n in range(40)]
        events.append(xid.make_event(43, 'kmsg', time_s=time.time(), pid=listed, name='python3', pci_bus_id=bus))
        host = CountingHost(node)
        host.xids = events
        result = rem.remediate(rem.RemediateOptions(reboot_flag=None, state_path=None), host, check_mode=True, scheduler=None)
        steps = [(step['pid'], step['status']) for step in result['gpus'][1]['ladder']]
        assert (listed, 'would_run') in steps and len(steps) == 12 and host.reads == 2, (steps, host.reads)
        assert all(status == 'done' for pid, status in steps if pid != listed) and node.alive(listed)


# ---------------------------------------------------------------------------- no flood hides a fault
MILD = [(45, None), (92, None), (43, 'pid'), (13, 'pid'), (31, 'pid'), (121, None), (9999, None)]


def append_records(path, bus, events):
    """The driver's kernel-log records of ``events`` ((code, pid or None)), appended to the simulator's kernel log."""
    with open(path, 'a') as handle:
        for n, (code, pid) in enumerate(events):
            handle.write('4,%d,%d,-;%s\n' % (100000 + n, int(time.monotonic() * 1e6), driver_text(bus, code, pid, 'python3' if pid else None, 'x')))


def flood(number, bus, first_pid=200000):
    """``number`` genuine milder Xid events for ``bus``: informational ones and application ones of many pids."""
    events = []
    for i in range(number):
        code, who = MILD[i % len(MILD)]
        events.append(xid.with_stamp(xid.make_event(code, 'kmsg', time_s=1000.0 + i, pid=first_pid + i if who else None,
                                                    name='python3' if who else None, pci_bus_id=bus), 10 ** 6 * (1000 + i)))
    return events


def test_a_genuine_xid_48_and_79_survive_any_flood_of_milder_events():
    dev = Device(vendor='nvidia', vendor_index=0, index=0, uuid='GPU-1', pci_bus_id='00000000:07:00.0')
    dev.add_xid_event(xid.with_stamp(xid.make_event(48, 'kmsg', time_s=999.0, pci_bus_id='0000:07:00'), 999 * 10 ** 6))
    dev.add_xid_event(xid.with_stamp(xid.make_event(79, 'kmsg', time_s=999.5, pci_bus_id='0000:07:00'), 9995 * 10 ** 5))
    for event in flood(5000, '0000:07:00'):
        dev.add_xid_event(event)
        assert len(dev.xid_events) <= MAX_XID_EVENTS
    assert [e.code for e in dev.xid_events if e.action in ('reset', 'reboot')] == [48, 79]
    counts = dev.xid_code_counts()
    assert counts[45] == 715 and counts[13] == 714 and counts[48] == 1 and sum(counts.values()) == 5002
    xid.apply_health(dev, now=2000.0, since=0.0)
    assert dev.health.status == 'lost' and {'xid_48', 'xid_79'} <= set(dev.health.codes)
    names = [s.name for s in rem.plan_remediation(_snapshot(dev), rem.RemediateOptions(reboot_flag=None, state_path=None),
                                                  boot='b')[0].steps]
    assert names[-2:] == ['drain', 'reboot_flag'] and 'kill_application' in names


def _snapshot(dev):
    class Snap(object):
        all_devices = [dev]
        devices = [dev]
        processes = []
    return Snap()


@needs_sim
def test_the_kernel_log_reader_keeps_the_48_after_a_flood_and_counts_every_event():
    with h.gpusim_node(gpus=2) as sim:
        state = sim.show()
        sim.gpusim('xid', '--gpu', '1', '--code', '48')
        bus = pci(state['gpus'][1])
        append_records(state['kmsg_path'], bus, [(event.code, event.pid) for event in flood(3000, bus)])
        events, error = xid.read_kmsg(state['kmsg_path'])
        assert error is None and 48 in [e.code for e in events] and len(events) <= MAX_XID_EVENTS
        assert events.counts[bus][48] == 1 and events.counts[bus][45] == 429 and sum(events.counts[bus].values()) == 3001


def test_the_journal_memo_keeps_the_48_through_a_flood_and_says_what_a_full_read_says(tmp_path, monkeypatch):
    bus = '0000:07:00'
    first = [journal_entry(driver_text(bus, 48))]
    later = [journal_entry(driver_text(bus, 45)) for _n in range(600)]
    for n, entry in enumerate(first + later):
        entry['__CURSOR'] = 's=ab;i=%x;b=%s;m=1;t=2;x=3' % (n, 'c' * 32)
        entry['__REALTIME_TIMESTAMP'] = str(1700000000000000 + n * 1000)
        entry['_SOURCE_MONOTONIC_TIMESTAMP'] = str(5000000 + n * 1000)
    fake_journalctl(tmp_path, monkeypatch, first)
    memo = {}
    events, _error = xid.read_journal(memo=memo, boot_id='c' * 32)
    assert [e.code for e in events] == [48] and xid.valid_memo(json.loads(json.dumps(memo)))
    fake_journalctl(tmp_path, monkeypatch, later)      # what journalctl --after-cursor prints now
    memo = json.loads(json.dumps(memo))
    events, _error = xid.read_journal(memo=memo, boot_id='c' * 32)
    assert 48 in [e.code for e in events] and events.counts[bus] == {48: 1, 45: 600}
    assert xid.valid_memo(json.loads(json.dumps(memo))) and len(memo['events']) <= MAX_XID_EVENTS
    fake_journalctl(tmp_path, monkeypatch, first + later)
    full, _error = xid.read_journal(boot_id='c' * 32)
    assert [e.to_dict() for e in full] == [e.to_dict() for e in events] and full.counts == events.counts


@pytest.mark.parametrize('counts', [
    {'0000:07:00': {'48': -1}}, {'0000:07:00': {'48': True}}, {'0000:07:00': {'x': 1}}, {'not-a-bus': {'48': 1}},
    {'0000:07:00': dict((str(code), 1) for code in range(300))}, dict(('0000:%02x:00' % n, {}) for n in range(65)), [],
])
def test_a_memo_with_forged_counts_or_too_many_events_of_one_gpu_is_dropped(counts):
    item = {'time': 1.0, 'code': 45, 'pid': None, 'name': None, 'pci_bus_id': '0000:07:00', 'message': None}
    assert xid.valid_memo({'events': [item], 'counts': {'0000:07:00': {'45': 1}}})
    assert xid.valid_memo({'events': [item], 'counts': counts}) == {}
    assert xid.valid_memo({'events': [item] * (MAX_XID_EVENTS + 1)}) == {}      # more than one GPU keeps


# ---------------------------------------------------------------------------- the guard's tick, as the timer runs it
POLICY = '''mode: enforce
notify: {tty: false}
remediation:
  enabled: true
  reboot_flag: %s
  drain_command: [%s]
'''


def _guard(node):
    """The policy with the ladder on, a drain hook that records its calls; returns (flag path, hook log)."""
    flag = os.path.join(node.guard_root, 'var', 'lib', 'gpufleet', 'reboot-wanted')
    hook, log = os.path.join(node.work, 'drain-hook'), os.path.join(node.work, 'drain.log')
    with open(hook, 'w') as handle:
        handle.write(RECORDER % (sys.executable, log))
    os.chmod(hook, 0o755)
    node.write_policy(POLICY % (flag, hook))
    return flag, log


def _outcome(node, flag, log, pids):
    metrics = os.path.join(node.guard_root, 'var', 'lib', 'node_exporter', 'textfile_collector', 'gpufleet.prom')
    with open(metrics) as handle:
        lines = [line for line in handle.read().splitlines() if line.startswith('gpufleet_gpu_')]
    with open(log) if os.path.exists(log) else open(os.devnull) as handle:
        drains = [json.loads(line) for line in handle]
    return {'alive': dict((str(pid), node.alive(pid)) for pid in pids), 'flag': os.path.exists(flag), 'drains': drains,
            'resets': [gpu['reset_count'] for gpu in node.sim.show()['gpus']], 'metrics': lines,
            'remediation': [r for r in node.guard_log() if r['event'] == 'guard_remediation']}


def scenario_forged(node):
    bob = node.spawn('bob', gpu=0, mib=2 * GIB)
    server = node.spawn('root', gpu=0, mib=2 * GIB, argv=('tritonserver', '--model-repository=/models'))
    sshd = node.spawn('root', gpu=0, mib=GIB, argv=('sshd', '-D'))
    alice = node.spawn('alice', gpu=2, mib=GIB)
    flag, log = _guard(node)
    buses = [node.bus(gpu) for gpu in range(3)]
    victims = [(0, 13, bob, node.comm(bob)), (0, 43, server, node.comm(server)), (0, 13, sshd, 'sshd'),
               (1, 95, None, None), (1, 48, None, None), (1, 64, None, None), (2, 79, None, None)]
    write(node.sim, all_forgeries(buses, victims, alice))
    rc, summary, signalled, err = node.tick()
    out = _outcome(node, flag, log, (bob, server, sshd, alice))
    out.update(rc=rc, summary=summary, signalled=signalled, err=err)
    return out


@redteam.needs_namespace
def test_a_tick_with_the_ladder_on_does_nothing_for_any_forged_xid():
    out = redteam.run(scenario_forged, gpus=3)
    assert out['rc'] == 0, out['err']
    assert out['signalled'] == [] and all(out['alive'].values()), (out['signalled'], out['alive'])
    assert out['resets'] == [0, 0, 0] and not out['flag'] and out['drains'] == [] and out['remediation'] == []
    ladder = out['summary']['remediation']
    assert not ladder['changed'] and not ladder['reboot_wanted'] and ladder['node']['drain'] is None
    assert all(gpu['findings'] == [] and gpu['ladder'] == [] and gpu['health']['status'] == 'ok' for gpu in ladder['gpus'])
    assert not [line for line in out['metrics'] if line.startswith('gpufleet_gpu_xid_errors{')], out['metrics']
    for name in ('gpufleet_gpu_reboot_wanted{', 'gpufleet_gpu_health_status{'):
        values = [line.split()[-1] for line in out['metrics'] if line.startswith(name)]
        assert values == ['0', '0', '0'], (name, out['metrics'])


def scenario_genuine(node):
    faulted = node.spawn('alice', gpu=0, mib=GIB)
    bob = node.spawn('bob', gpu=0, mib=GIB)
    sshd = node.spawn('root', gpu=0, mib=GIB, argv=('sshd', '-D'))
    flag, log = _guard(node)
    node.xid(0, 13, pid=faulted)                       # the driver's record: her pid and comm
    node.xid(0, 13, pid=sshd)                          # a protected root service that faulted
    node.xid(1, 48)                                    # a double-bit ECC error on the idle GPU 1 ...
    kmsg = node.sim.show()['kmsg_path']                # ... then 100 milder ones, hers and informational
    append_records(kmsg, node.bus(1), [(MILD[n % 4][0], 300000 + n if MILD[n % 4][1] else None) for n in range(100)])
    append_records(kmsg, node.bus(2), [(MILD[n % 2][0], None) for n in range(100)])   # GPU 2: only milder ones
    rc, summary, signalled, err = node.tick()
    out = _outcome(node, flag, log, (faulted, bob, sshd))
    out.update(rc=rc, summary=summary, signalled=signalled, err=err, faulted=faulted, bob=bob, sshd=sshd)
    return out


@redteam.needs_namespace
def test_a_genuine_xid_13_ends_its_process_and_a_genuine_48_resets_after_100_milder_events():
    out = redteam.run(scenario_genuine, gpus=3)
    assert out['rc'] == 0, out['err']
    assert out['signalled'] == [out['faulted']], (out['signalled'], out['remediation'])
    assert out['alive'] == {str(out['faulted']): False, str(out['bob']): True, str(out['sshd']): True}
    assert out['resets'] == [0, 1, 0] and not out['flag'], out['summary']['remediation']['gpus'][1]
    gpus = out['summary']['remediation']['gpus']
    assert ('reset', 'done') in [(s['step'], s['status']) for s in gpus[1]['ladder']]
    assert gpus[2]['ladder'] == [] and gpus[2]['health']['status'] == 'ok'
    sshd = [s for s in gpus[0]['ladder'] if s.get('pid') == out['sshd']]
    assert sshd and sshd[0]['status'] == 'skipped' and 'protected' in sshd[0]['detail']
    counted = dict((line.split('code="')[1].split('"')[0], line.split()[-1]) for line in out['metrics']
                   if line.startswith('gpufleet_gpu_xid_errors{') and 'gpu="1"' in line)
    assert counted == {'48': '1', '45': '25', '92': '25', '43': '25', '13': '25'}, out['metrics']
