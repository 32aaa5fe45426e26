# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: GPU-hours charged to a Slurm job the process only claims (issue #18, accounting).

alice runs a workload whose command line and environment claim Slurm job 4242 (``SLURM_JOB_ID``, ``SLURM_JOBID``,
an argv ``job_4242`` that looks like a cgroup path) so that her GPU-hours land on that job.  The real guard tick
records the sample; the usage history and gpu_audit's accounting charge nothing to any job: only a root-owned
cgroup names a job (processes.CgroupTrust).  The scenario runs in a PID namespace of its own (``redteam.run``).
"""

from __future__ import annotations

import os
import sqlite3

from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace

CLAIMS = ['SLURM_JOB_ID=4242', 'SLURM_JOBID=4242', 'SLURM_JOB_UID=0', 'SLURM_JOB_USER=root']


def scenario_a_job_claimed_in_argv_and_env(node):
    alice = node.spawn('alice', gpu=0, mib=2 * GIB, argv=['python3', 'train.py', '--slurm-job', '4242', '/slurm/uid_0/job_4242/step_0'],
                       env=CLAIMS)
    node.write_policy('mode: dry-run\n')
    out = {'pid': alice}
    for _tick in range(2):
        rc, _summary, signalled, err = node.tick()
        out.setdefault('ticks', []).append({'rc': rc, 'signalled': signalled, 'err': err})
    history = os.path.join(node.guard_root, 'var', 'lib', 'gpufleet', 'history.db')
    conn = sqlite3.connect(history)
    try:
        out['samples'] = conn.execute('SELECT pid, user, slurm_job FROM samples').fetchall()
    finally:
        conn.close()
    rc, result, _sig, err = node.module('gpu_audit', history=True, history_path=history, hours=1, require_allocation='never')
    out['audit'] = {'rc': rc, 'report': result.get('report') if isinstance(result, dict) else result, 'err': err}
    return out


def test_a_job_claimed_in_argv_and_environment_is_charged_nothing():
    out = redteam.run(scenario_a_job_claimed_in_argv_and_env)
    assert [t['rc'] for t in out['ticks']] == [0, 0] and not any(t['signalled'] for t in out['ticks']), out['ticks']
    assert out['samples'] and all(pid == out['pid'] and user == 'alice' and job is None for pid, user, job in out['samples']), out['samples']
    acc = out['audit']['report']['accounting']
    assert acc['jobs'] == [] and acc['totals']['jobs'] == 0, acc
    assert acc['unattributed']['gpu_hours'] == acc['totals']['gpu_hours'] > 0
    assert [u['user'] for u in acc['users']] == ['alice']
