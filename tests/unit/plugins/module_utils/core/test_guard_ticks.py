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
