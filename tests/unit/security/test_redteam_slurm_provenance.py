# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: which job a process belongs to, for the Slurm epilog and prolog (issue 28, point 5).

Under proctrack/linuxproc no root-owned cgroup names a job, so the epilog and the prolog decide by provenance: the
process's real uid and start time (the kernel's) against the jobs' lifetimes (slurmctld's).  alice plays every trick a
user has over her own processes: her leftover of the ended job 7 names itself ``slurmstepd`` and claims her running
job 9 in its environment and argv, to be spared; a process she starts after job 9 began claims the ended job 7, to
look like a leftover; bob's process claims alice's ended job.  None of it counts: the leftover is the ended job's
whatever it says and wherever it sits (on the GPU of job 9 and of bob's job too), the later process could be job 9's
and is spared (the prolog refuses rather than kill it), and bob's process is never alice's job's.

The candidates come from a real snapshot of the simulated node (driver lists, /proc, ``slurm_scripts.candidates``),
as the epilog and prolog build them; Slurm's part is the jobs' times and owners as slurmctld reports them, placed
around the workloads' real start times.  The end-to-end run with a real Slurm, signals included, is
tests/fleet/tests/test_fleet_slurm_scripts.py.  The scenario runs in a PID namespace of its own (``redteam.run``);
nothing is signalled here.
"""

from __future__ import annotations

import time

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import slurm as S
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import slurm_scripts as scripts
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace


def _decide(node, pids):
    """Slurm's view around the workloads' real start times, and the epilog's and prolog's decisions over a real snapshot."""
    with h.shim_in_process(node.sim.state):
        snap = take_snapshot(vendor='nvidia', dev_roots=node.sim.dev_roots, gather_processes=True, scan_holders=True)
    found = dict((c.pid, c) for c in scripts.candidates(snap))
    alice, bob, carol = node.uids['alice'], node.uids['bob'], node.uids['carol']
    left, later = found[pids['leftover']].started, found[pids['later']].started
    ended = S.Job('7', uid=alice, state='COMPLETED', start=int(left) - 30, end=int(later) + 2, gpus=[0])
    running = S.Job('9', uid=alice, state='RUNNING', start=int(later), gpus=[0, 1])      # after the leftover, before `later`
    bobs = S.Job('12', uid=bob, state='RUNNING', start=int(left) - 60, gpus=[0, 1])
    starting = S.Job('5', uid=carol, state='RUNNING', start=int(later) + 3, gpus=[0])
    jobs = dict((j.id, j) for j in (ended, running, bobs, starting))
    candidates = [found[pid] for pid in sorted(pids.values())]
    claimed, spared = S.job_claims(ended, candidates, [running, bobs, starting], listpids={})
    _own, stale, blocking = S.stale_claims(starting, candidates, jobs, {})
    named = dict((pid, key) for key, pid in pids.items())
    return {'order_s': later - left,
            'facts': dict((named[c.pid], {'uid': c.uid, 'cgroup_job': c.cgroup_job, 'name': c.name, 'gpus': sorted(c.gpus)})
                          for c in candidates),
            'claimed': dict((named[c.pid], why) for c, why in claimed), 'spared': dict((named[c.pid], why) for c, why in spared),
            'stale': dict((named[c.pid], why) for c, why in stale), 'blocking': dict((named[c.pid], why) for c, why in blocking)}


def scenario_provenance_against_what_users_claim(node):
    pids = {}
    # the ended job 7's leftover, dressed as job 9's slurmstepd
    pids['leftover'] = node.spawn('alice', gpu=0, mib=2 * GIB, argv=['slurmstepd', '[9.batch]', '/slurm/uid_0/job_9/step_batch'],
                                  env=['SLURM_JOB_ID=9', 'SLURM_JOBID=9', 'SLURM_STEP_ID=batch', 'SLURM_JOB_UID=0'])
    time.sleep(2.5)   # bounded: job 9 starts between the two processes (its start is a whole second, like slurmctld's)
    # started while job 9 runs, claiming the ended job 7
    pids['later'] = node.spawn('alice', gpu=0, mib=GIB, argv=['python3', 'train.py', '--job', '7', '/slurm/uid_1001/job_7/step_0'],
                               env=['SLURM_JOB_ID=7', 'SLURM_JOBID=7'])
    # bob's process claiming alice's ended job, inside its lifetime
    pids['bobs'] = node.spawn('bob', gpu=0, mib=GIB, env=['SLURM_JOB_ID=7', 'SLURM_JOB_UID=%d' % node.uids['alice']])
    return _decide(node, pids)


def test_provenance_decides_what_a_job_left_and_nothing_a_user_claims_changes_it():
    out = redteam.run(scenario_provenance_against_what_users_claim)
    assert out['order_s'] > 2.0, out    # the kernel's start times order the processes as the scenario started them
    facts = out['facts']
    assert facts['leftover']['name'] == 'slurmstepd' and all(f['cgroup_job'] is None and f['gpus'] == [0] for f in facts.values()), facts
    assert facts['leftover']['uid'] == facts['later']['uid'] != facts['bobs']['uid']
    # the epilog of job 7: its leftover is ended although it sits on the GPU of job 9 and of bob's job 12
    assert list(out['claimed']) == ['leftover'] and out['claimed']['leftover'].startswith("uid %d's process started " % facts['leftover']['uid'])
    assert out['spared'] == {
        'later': "started after job 9 of the same user started, which is still RUNNING here, so it could be that job's",
        'bobs': "owned by uid %d, not the job's user (uid %d)" % (facts['bobs']['uid'], facts['leftover']['uid'])}, out['spared']
    # the prolog of carol's job 5: the same leftover is provably stale (ended, not refused); the other two block
    assert list(out['stale']) == ['leftover'] and out['stale']['leftover'].startswith('left over from job 7 (COMPLETED)'), out['stale']
    assert out['blocking']['later'] == ("not provably left over from job 7: started after job 9 of the same user started, which is "
                                        "still RUNNING here, so it could be that job's")
    assert out['blocking']['bobs'].startswith('no root-owned cgroup or slurmstepd names its job'), out['blocking']
