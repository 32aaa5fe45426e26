# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a guard tick records and reads: Slurm's view before the usage history (proctrack/linuxproc accounting)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, Clock, proc, snapshot

FAKE_SLURM = r"""#!%(python)s
# Fake %(name)s: slurmd's answers for node n1, as Slurm 22.05 prints them.
import json, sys
if %(name)r == 'squeue':
    jobs = [{'job_id': int(job), 'user_id': 1000, 'user_name': 'alice', 'job_state': 'RUNNING', 'start_time': 1,
             'end_time': 0, 'job_resources': {'allocated_nodes': [{'nodename': 'n1'}]}, 'gres_detail': ['gpu:1(IDX:%%s)' %% gpu]}
            for job, gpu in (('7', 0), ('8', 1))]
    print(json.dumps({'jobs': jobs}))
else:
    print('PID      JOBID    STEPID   LOCALID GLOBALID')
    for pid, job in %(pids)r:
        print('%%-8d %%-8s 0        0       0' %% (pid, job))
"""


def fake_slurm(tmp_path, monkeypatch, pids):
    bindir = tmp_path / 'bin'
    bindir.mkdir()
    for name in ('squeue', 'scontrol'):
        script = bindir / name
        script.write_text(FAKE_SLURM % {'python': sys.executable, 'name': name, 'pids': sorted(pids.items())})
        script.chmod(0o755)
    monkeypatch.setenv('PATH', '%s:%s' % (bindir, os.environ.get('PATH', '')))
    monkeypatch.setenv('SLURMD_NODENAME', 'n1')
    # slurmd runs as root here (processes.scheduler_daemon vouches for that on a real node)
    monkeypatch.setattr(P, 'detect_scheduler', lambda proc_root='/proc': 'slurm')


def recorded_jobs(path):
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute('SELECT pid, slurm_job FROM samples'))
    finally:
        conn.close()


def tick(tmp_path, snap, policy='require_allocation: true\nnotify: {tty: false}\n'):
    paths = guard.Paths(root=str(tmp_path / 'root'))
    os.makedirs(os.path.dirname(paths.policy), exist_ok=True)
    with open(paths.policy, 'w') as handle:
        handle.write(policy)
    os.chmod(paths.policy, 0o644)
    summary = guard.run_tick(paths, guard.Settings(release_timeout=2.0, utmp_paths=()), now=Clock().now, snapshot=snap)
    return paths, summary


def test_linuxproc_samples_are_charged_to_the_job_slurmstepd_lists_and_a_cgroup_wins(tmp_path, monkeypatch):
    """proctrack/linuxproc: no job cgroup, so the tick's ``scontrol listpids`` (slurmd's answer) attributes the
    sample; a root-owned cgroup still wins over it; a process Slurm does not list stays unattributed; and a process
    whose argv and environment claim job 8 is charged nothing (only what root vouches for is read)."""
    env = dict(os.environ, SLURM_JOB_ID='8', SLURM_JOBID='8', CUDA_VISIBLE_DEVICES='1')
    hostile = subprocess.Popen(['/bin/sh', '-c', 'sleep 30; :', 'job_8', '--slurm-job', '8'], env=env)
    try:
        time.sleep(0.2)
        record = ProcessInventory(use_psutil=False, scan_fds=False).record(hostile.pid)
        assert record.slurm_job is None                  # its cgroup names no job; its environment says 8
        fake_slurm(tmp_path, monkeypatch, {101: '8', 102: '8', 103: '8'})
        snap = snapshot([proc(101, 'alice', {1: GIB}), proc(102, 'alice', {0: GIB}, job='7'), proc(104, 'alice', {2: GIB}),
                         proc(hostile.pid, 'alice', {1: GIB}, cmdline=['/bin/sh', '-c', 'sleep 30; :', 'job_8'])])
        paths, summary = tick(tmp_path, snap)
        assert summary['rc'] == 0, summary
        assert recorded_jobs(paths.history) == {101: '8', 102: '7', 104: None, hostile.pid: None}
    finally:
        hostile.kill()
        hostile.wait()


def test_without_slurms_view_only_cgroups_attribute(tmp_path, monkeypatch):
    """A policy that asks nothing of Slurm runs no Slurm command: the samples carry the cgroup's job only; and when
    Slurm cannot be asked, the tick records the cgroups' jobs and says why the rule was not evaluated."""
    fake_slurm(tmp_path, monkeypatch, {101: '8'})
    snap = snapshot([proc(101, 'alice', {1: GIB}), proc(102, 'alice', {0: GIB}, job='7')])
    paths, summary = tick(tmp_path / 'plain', snap, policy='notify: {tty: false}\n')
    assert summary['rc'] == 0 and recorded_jobs(paths.history) == {101: None, 102: '7'}
    (tmp_path / 'bin' / 'scontrol').write_text('#!/bin/sh\necho "slurm_load_ctl_conf error" >&2\nexit 1\n')
    paths, summary = tick(tmp_path / 'down', snap)
    assert recorded_jobs(paths.history) == {101: None, 102: '7'}
    assert any('Slurm could not be asked' in w for w in summary['warnings'])


def test_the_tick_asks_slurm_once(tmp_path, monkeypatch):
    """Slurm's view is read once per tick: the history and the require_allocation rule share it."""
    fake_slurm(tmp_path, monkeypatch, {101: '8'})
    log = tmp_path / 'calls.log'
    for name in ('squeue', 'scontrol'):
        script = tmp_path / 'bin' / name
        text = script.read_text().replace('import json, sys\n', 'import json, sys\nopen(%r, "a").write(%r)\n' % (str(log), name + '\n'))
        script.write_text(text)
    snap = snapshot([proc(101, 'alice', {0: GIB})])      # job 8 holds GPU 1, not 0
    paths, summary = tick(tmp_path, snap)
    assert sorted(log.read_text().split()) == ['scontrol', 'squeue']
    assert recorded_jobs(paths.history) == {101: '8'}
    assert [(v['rule'], v['pids']) for v in summary['violations']] == [('require_allocation', [101])]
    assert json.dumps(summary['violations']).count('job 8') >= 1


# ============================================================================ the kernel journal's cursor (#17)
BOOT = '0123456789abcdef0123456789abcdef'
JOURNALCTL = r"""#!%(python)s
# Fake journalctl -k -o json over a JSON-lines journal file: honours -n and --after-cursor (an unknown cursor: rc 1,
# as journalctl answers a cursor it cannot seek to); records its argv.
import json, sys
argv = sys.argv[1:]
with open(%(log)r, 'a') as log:
    log.write(json.dumps(argv) + '\n')
with open(%(journal)r) as handle:
    entries = [json.loads(line) for line in handle]
limit = int(argv[argv.index('-n') + 1])
if '--after-cursor' in argv:
    cursor = argv[argv.index('--after-cursor') + 1]
    found = [i for i, e in enumerate(entries) if e['__CURSOR'] == cursor]
    if not found:
        sys.stderr.write('Failed to seek to cursor: Invalid argument\n')
        sys.exit(1)
    shown = entries[found[0] + 1:][:limit]
else:
    shown = entries[-limit:]
for entry in shown:
    print(json.dumps(entry))
"""


def journal_line(n, boot=BOOT):
    message = ('NVRM: Xid (PCI:0000:%02x:00): %d, pid=%d, name=python, fault' % (n % 4, (79, 13, 31)[n % 3], 1000 + n)
               if n % 50 == 0 else 'usb 1-1: line %d' % n)
    return json.dumps({'__CURSOR': 's=ab;i=%x;b=%s;m=1;t=2;x=3' % (n, boot), '__REALTIME_TIMESTAMP': str(1700000000000000 + n),
                       'MESSAGE': message, '_TRANSPORT': 'kernel'}) + '\n'


def fake_journal(tmp_path, monkeypatch, lines):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import xid
    bindir = tmp_path / 'jbin'
    bindir.mkdir()
    journal = tmp_path / 'journal.jsonl'
    journal.write_text(''.join(journal_line(n) for n in range(lines)))
    fake = bindir / 'journalctl'
    fake.write_text(JOURNALCTL % {'python': sys.executable, 'log': str(tmp_path / 'argv.log'), 'journal': str(journal)})
    fake.chmod(0o755)
    monkeypatch.setenv('PATH', '%s:%s' % (bindir, os.environ.get('PATH', '')))
    monkeypatch.delenv(xid.KMSG_ENV, raising=False)
    monkeypatch.setattr(xid, 'KMSG_PATH', str(tmp_path / 'no-kmsg'))   # the hardened unit: no /dev/kmsg
    return xid, journal, tmp_path / 'argv.log'


def calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_journal_is_read_after_its_cursor_and_the_events_stay_known(tmp_path, monkeypatch):
    xid, journal, log = fake_journal(tmp_path, monkeypatch, 1000)
    monkeypatch.setattr(xid, 'current_boot_id', lambda path=None: BOOT)
    memo = {}
    first, error = xid.read_journal(memo=memo, boot_id=BOOT)
    assert error is None and len(first) == 20 and '--after-cursor' not in calls(log)[0]
    assert memo['boot'] == BOOT and memo['cursor'].startswith('s=ab;i=3e7;') and len(memo['events']) == 20
    with open(str(journal), 'a') as handle:
        handle.write(''.join(journal_line(n) for n in range(1000, 1101)))
    state = json.loads(json.dumps(memo))                       # through state.json
    second, error = xid.read_kmsg(memo=state)
    assert error is None
    argv = calls(log)[-1]
    assert argv[argv.index('--after-cursor') + 1] == memo['cursor']
    full, _error = xid.read_journal(boot_id=BOOT)
    assert [e.to_dict() for e in second] == [e.to_dict() for e in full] and len(second) == 23   # what a full read says
    assert [e.fault for e in second[:3]] == ['gpu', 'application', 'application']


def test_first_tick_other_boot_rejected_cursor_or_a_flood_read_everything(tmp_path, monkeypatch):
    xid, journal, log = fake_journal(tmp_path, monkeypatch, 300)
    memo = {'boot': 'f' * 32, 'cursor': 's=ab;i=5;b=%s' % ('f' * 32), 'events': []}      # another boot's
    events, _error = xid.read_journal(memo=memo, boot_id=BOOT)
    assert len(events) == 6 and '--after-cursor' not in calls(log)[-1] and memo['boot'] == BOOT
    memo['cursor'] = 's=ab;i=99999;b=%s;m=1;t=2;x=3' % BOOT                                   # rotated away: rc 1
    events, _error = xid.read_journal(memo=memo, boot_id=BOOT)
    assert len(events) == 6 and '--after-cursor' in calls(log)[-2] and '--after-cursor' not in calls(log)[-1]
    monkeypatch.setattr(xid, 'JOURNAL_ENTRIES', 50)       # as many new lines as one read takes: more may wait
    with open(str(journal), 'a') as handle:
        handle.write(''.join(journal_line(n) for n in range(300, 400)))
    events, _error = xid.read_journal(memo=memo, boot_id=BOOT)
    assert '--after-cursor' not in calls(log)[-1] and [e.pid for e in events] == [1350]        # the newest 50, as a full read
    journal.write_text('')
    xid.read_journal(memo=memo, boot_id=None)             # no boot id: never a cursor
    assert '--after-cursor' not in calls(log)[-1]


@pytest.mark.parametrize('memo', [
    'x', {'cursor': 's=1\n;evil'}, {'cursor': 'a' * 600}, {'boot': '../etc'}, {'extra': 1},
    {'events': [{'time': None, 'code': 79, 'pid': None, 'name': 'x\x1b[2J', 'pci_bus_id': '0000:07:00', 'message': None}]},
    {'events': [{'time': None, 'code': True, 'pid': None, 'name': None, 'pci_bus_id': '0000:07:00', 'message': None}]},
    {'events': [{'time': None, 'code': 79, 'pid': None, 'name': None, 'pci_bus_id': '0000:07:00', 'message': None}] * 513},
])
def test_a_malformed_journal_memo_is_dropped_and_the_rest_of_the_state_kept(tmp_path, memo):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard_state
    path = tmp_path / 'state.json'
    state = guard_state.new_state(100.0)
    state['violations'] = {'k': {'first_seen': 50.0, 'warnings': 1}}
    state['xid_journal'] = memo
    path.write_text(json.dumps(state))
    loaded, problem = guard_state.load_state(str(path), 100.0)
    assert problem is None and loaded['xid_journal'] == {} and loaded['violations'] == state['violations']


def test_a_tick_keeps_the_cursor_in_its_state(tmp_path, monkeypatch):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import snapshot as snapshot_mod
    xid, _journal, log = fake_journal(tmp_path, monkeypatch, 200)
    monkeypatch.setattr(xid, 'current_boot_id', lambda path=None: BOOT)
    snap = snapshot([proc(1, 'alice', {0: GIB})])

    def take(**kwargs):
        snapshot_mod._read_xid_log(snap.all_devices, None, kwargs['xid_memo'])   # pylint: disable=protected-access
        return snap
    paths = guard.Paths(root=str(tmp_path / 'root'))
    os.makedirs(os.path.dirname(paths.policy), exist_ok=True)
    with open(paths.policy, 'w') as handle:
        handle.write('notify: {tty: false}\n')
    os.chmod(paths.policy, 0o644)
    clock = Clock()
    for _tick in range(2):
        summary = guard.run_tick(paths, guard.Settings(release_timeout=2.0, utmp_paths=()), now=clock.now, take_snapshot=take)
        assert summary['rc'] == 0, summary
        clock.advance(60)
    with open(paths.state) as handle:
        kept = json.load(handle)['xid_journal']
    assert kept['boot'] == BOOT and len(kept['events']) == 4
    assert ['--after-cursor' in argv for argv in calls(log)] == [False, True]
