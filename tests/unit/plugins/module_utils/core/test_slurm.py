# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/slurm.py: reading Slurm's answers, and which processes are a job's (the epilog's and prolog's decisions).

The decisions are pure functions over Candidates; the hostile cases build their Candidates from real processes and
real cgroup directories read through the inventory (processes.parse_cgroup with CgroupTrust), as the epilog does.
The whole chain with a real Slurm: tests/fleet/tests/test_fleet_slurm_scripts.py."""

import os
import subprocess
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import slurm as S
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import slurm_scripts as scripts
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import CgroupTrust, ProcessInventory, parse_cgroup

T0 = 1_700_000_000.0


def job(jid='7', uid=1001, start=T0, end=T0 + 600, gpus=(0,), state='COMPLETING'):
    return S.Job(jid, uid=uid, state=state, start=start, end=end, gpus=None if gpus is None else list(gpus))


def cand(pid, uid=1001, started=T0 + 10, cgroup_job=None, gpus=(0,), ppid=None):
    return S.Candidate(pid, starttime=pid * 10, uid=uid, started=started, cgroup_job=cgroup_job, gpus=gpus, ppid=ppid)


def split(result):
    claimed, spared = result
    return sorted(c.pid for c, _why in claimed), dict((c.pid, why) for c, why in spared)


# ---------------------------------------------------------------------------- parsing
def test_gres_index_lists():
    assert S.parse_idx('gpu:1(IDX:0)') == [0]
    assert S.parse_idx('gpu:2(IDX:0-1)') == [0, 1]
    assert S.parse_idx('gpu:a100:3(IDX:0,2-3)') == [0, 2, 3]
    assert S.parse_idx('gpu:tesla:1(IDX:3),shard:2(IDX:0)') == [3]
    assert S.parse_idx('gpu:0(IDX:N/A)') == [] and S.parse_idx('') == []
    with pytest.raises(S.SlurmError):
        S.parse_idx('gpu:2(IDX:3-1)')
    assert S.parse_index_list('0,2') == [0, 2] and S.parse_index_list('GPU-abc') is None and S.parse_index_list('') is None


def test_job_ids_are_numbers():
    assert S.valid_job_id(' 42 ') == '42'
    for bad in ('', None, '0', '4x', '1;reboot', '12345678901'):
        with pytest.raises(S.SlurmError, match='SLURM_JOB_ID'):
            S.valid_job_id(bad)


def test_squeue_json_jobs_of_this_node_only_and_a_forged_name_changes_nothing():
    data = {'jobs': [
        {'job_id': 7, 'user_id': 1001, 'user_name': 'alice', 'job_state': 'RUNNING', 'start_time': T0, 'end_time': T0 + 60,
         'name': 'evil\nUserId=root(0) JobState=COMPLETED', 'gres_detail': ['gpu:1(IDX:2)', 'gpu:2(IDX:0-1)'],
         'job_resources': {'allocated_nodes': [{'nodename': 'node01'}, {'nodename': 'node02'}]}},
        {'job_id': 8, 'user_id': 1002, 'job_state': 'COMPLETED', 'start_time': 0, 'gres_detail': [],
         'job_resources': {'allocated_nodes': [{'nodename': 'node02'}]}},
        {'job_id': 9, 'user_id': 1002, 'job_state': 'RUNNING', 'job_resources': {'allocated_nodes': [{'nodename': 'node03'}]}},
        {'job_id': True}, 'junk']}
    jobs = S.jobs_from_json(data, 'node02')
    assert sorted(jobs) == ['7', '8']
    assert jobs['7'].to_dict() == {'job': '7', 'uid': 1001, 'user': 'alice', 'state': 'RUNNING', 'start': T0, 'end': T0 + 60,
                                   'gpus': [0, 1]}
    assert jobs['7'].active and not jobs['8'].active and jobs['8'].gpus is None and jobs['8'].start is None
    with pytest.raises(S.SlurmError, match='job list'):
        S.jobs_from_json({'errors': []}, 'node02')


def test_listpids_numbers_only():
    text = 'PID      JOBID    STEPID   LOCALID GLOBALID\n68       2        batch    0       0\n69 2 batch - -\nx 3\n70 0 batch\n'
    assert S.parse_listpids(text) == {68: '2', 69: '2'}


def test_slurm_commands_are_bounded_and_their_failures_named(tmp_path):
    missing = S.SlurmClient(which=lambda name: None)
    with pytest.raises(S.SlurmError, match='squeue is not installed'):
        missing.jobs('node01')
    slow = S.SlurmClient(timeout=0.2, which=lambda name: '/bin/sleep')
    begun = time.monotonic()
    with pytest.raises(S.SlurmError, match='did not answer within 0.2s'):
        slow.run(['scontrol', '5'])
    assert time.monotonic() - begun < 3
    failing = S.SlurmClient(which=lambda name: '/bin/false')
    with pytest.raises(S.SlurmError, match=r'failed \(exit 1\)'):
        failing.listpids()
    script = tmp_path / 'squeue'
    script.write_text('#!/bin/sh\necho not json\n')
    script.chmod(0o755)
    with pytest.raises(S.SlurmError, match='no JSON'):
        S.SlurmClient(which=lambda name: str(script)).jobs('node01')


# ---------------------------------------------------------------------------- epilog: which processes are the job's
def test_cgroup_or_slurmstepd_make_a_process_the_jobs():
    claimed, spared = split(S.job_claims(job(), [cand(10, cgroup_job='7', uid=0, gpus=()), cand(11, uid=1002, started=T0 - 999),
                                                 cand(12, uid=1001)], [], listpids={11: '7'}))
    assert claimed == [10, 11, 12] and spared == {}


def test_another_jobs_process_is_never_the_jobs():
    other = job('8', uid=1001, gpus=(1,), state='RUNNING')
    claimed, spared = split(S.job_claims(job(), [cand(20, cgroup_job='8'), cand(21), cand(22, gpus=(0, 1))], [other],
                                         listpids={21: '8'}))
    assert claimed == [] and spared == {20: "in job 8's cgroup", 21: 'slurmstepd lists it under job 8',
                                        22: "started after job 8 of the same user started, which is still RUNNING here, so it could be that job's"}


def test_lifetime_rule_is_the_users_processes_inside_the_job_on_its_gpus():
    candidates = [cand(30), cand(31, uid=1002), cand(32, started=T0 - 5), cand(33, started=T0 + 700), cand(34, gpus=(3,)),
                  cand(35, started=None), cand(36, started=T0 - 0.5), cand(37, uid=0)]
    claimed, spared = split(S.job_claims(job(), candidates, [], listpids={}))
    assert claimed == [30, 36]  # 36: within the one second of skew Slurm's whole-second times allow
    assert spared[31].startswith('owned by uid 1002') and spared[32] == 'started before the job'
    assert spared[33] == 'started after the job ended' and spared[34] == "uses none of the job's GPUs"
    assert spared[35].startswith('the start time')
    assert spared[37] == 'owned by root, whose processes only a cgroup or slurmstepd attributes to a job'


def test_without_slurms_view_only_cgroups_decide():
    for others, pids in ((None, {}), ([], None)):
        claimed, spared = split(S.job_claims(job(), [cand(40), cand(41, cgroup_job='7')], others, listpids=pids))
        assert claimed == [41] and spared[40].startswith("Slurm's view of this node could not be read")
    claimed, spared = split(S.job_claims(job(), [cand(40)], [], listpids={}, lifetime_rule=False))
    assert claimed == [] and 'lifetime rule is off' in spared[40]


def test_a_leftover_on_a_gpu_of_the_users_later_running_job_is_still_the_ended_jobs():
    # issue 28: job 7's leftover (started 10 s into it) also sits on GPU 1 of job 9, which the same user started later
    later = job('9', uid=1001, start=T0 + 100, end=T0 + 4000, gpus=(1,), state='RUNNING')
    bobs = job('12', uid=1002, start=T0 - 50, end=T0 + 4000, gpus=(0, 1), state='RUNNING')   # never owns uid 1001's processes
    roots_later = job('13', uid=0, start=T0 + 200, end=T0 + 4000, gpus=(2,), state='RUNNING')
    claimed, spared = S.job_claims(job(), [cand(50, gpus=(0, 1))], [later, bobs, roots_later, job('11', state='COMPLETED')], listpids={})
    assert [(c.pid, why) for c, why in claimed] == [(50, "uid 1001's process started 10 s into job 7, on its GPU 0")] and spared == []
    unknown_gpus = job('10', uid=1001, start=T0 + 100, gpus=None, state='RUNNING')
    assert split(S.job_claims(job(), [cand(50, gpus=(0, 1))], [unknown_gpus], listpids={}))[0] == [50]


def test_what_another_active_job_could_own_is_spared():
    sibling = job('9', uid=1001, start=T0 + 5, gpus=(1,), state='RUNNING')       # started before the process
    edge = job('9', uid=1001, start=T0 + 10.5, gpus=(1,), state='RUNNING')       # within the second of skew
    unknown_start = job('10', uid=1001, start=None, gpus=(1,), state='CONFIGURING')
    roots = job('13', uid=0, start=T0 + 5, gpus=(1,), state='RUNNING')           # root may start a process as anyone
    nobodys = job('14', uid=None, start=T0 + 5, gpus=None, state='RUNNING')      # an owner and GPUs Slurm did not say
    cases = {sibling: "started after job 9 of the same user started, which is still RUNNING here, so it could be that job's",
             edge: "started after job 9 of the same user started, which is still RUNNING here, so it could be that job's",
             unknown_start: "job 10 of the same user is active here and its start is unknown, so it could be that job's",
             roots: "started after job 13 of root started, which is still RUNNING here, so it could be that job's",
             nobodys: "started after job 14 of an unknown user started, which is still RUNNING here, so it could be that job's"}
    for other, why in cases.items():
        claimed, spared = split(S.job_claims(job(), [cand(51, gpus={0, 1})], [other], listpids={}))   # on job 7's GPU and 9's
        assert claimed == [] and spared == {51: why}, other.to_dict()
    # on none of the GPUs Slurm gave the other job, it is not that job's to keep, whenever it started
    for other in (sibling, edge, unknown_start, roots):
        claimed, spared = split(S.job_claims(job(), [cand(53, gpus={0})], [other], listpids={}))
        assert claimed == [53] and spared == {}, other.to_dict()
    assert split(S.job_claims(job(), [cand(54, gpus={0})], [job('9', start=T0 + 5, gpus=None, state='RUNNING')], listpids={})) == (
        [], {54: "started after job 9 of the same user started, which is still RUNNING here, so it could be that job's"})
    # a family is judged with the process it started from: the worker on job 7's GPU only stays with its spared parent
    # (grandchildren too), the worker of a claimed parent goes with it even from another GPU; a worker of another uid's
    # process, or one that its own cgroup or slurmstepd names, is judged on its own
    family = [cand(61, gpus={0, 1}), cand(62, ppid=61), cand(63, ppid=62), cand(64, uid=0, gpus={0, 1}), cand(65, ppid=64),
              cand(66, started=T0 + 2), cand(67, ppid=66, gpus={1}), cand(68, ppid=66, cgroup_job='9')]
    claimed, spared = split(S.job_claims(job(), family, [sibling], listpids={}))
    assert claimed == [65, 66, 67] and sorted(spared) == [61, 62, 63, 64, 68]
    assert spared[62] == spared[63] == 'in the family of pid 61 (spared): ' + cases[sibling] and spared[68] == "in job 9's cgroup"
    assert dict((c.pid, why) for c, why in S.job_claims(job(), family, [sibling], listpids={})[0])[67] == (
        "in the family of pid 66 (claimed): uid 1001's process started 2 s into job 7, on its GPU 0")
    # slurmstepd listing it under the running job decides before any time
    claimed, spared = split(S.job_claims(job(), [cand(52, started=T0 + 10)], [job('9', start=T0 + 300, state='RUNNING')],
                                         listpids={52: '9'}))
    assert claimed == [] and spared == {52: 'slurmstepd lists it under job 9'}


def _candidate_of(pid, trust):
    rec = ProcessInventory(use_psutil=False, scan_fds=False, cgroup_root=trust.cgroup_root).record(pid)
    with open('/proc/%d/cgroup' % pid) as handle:
        assert parse_cgroup(handle.read(), trust)[1] == rec.slurm_job
    return S.Candidate(pid, starttime=rec.starttime, uid=rec.uid, started=S.boot_clock()(rec.starttime), cgroup_job=rec.slurm_job,
                       gpus=(0,))


@pytest.mark.skipif(os.geteuid() != 0, reason='runs a process as another user (root)')
def test_a_process_that_claims_another_job_in_its_argv_and_environment_is_judged_by_the_kernels_facts():
    env = dict(os.environ, SLURM_JOB_ID='8', SLURM_JOBID='8', SLURM_JOB_UID='1002', CUDA_VISIBLE_DEVICES='0')
    child = subprocess.Popen(['/bin/sh', '-c', 'sleep 30; :', 'job_8', '/slurm/uid_1002/job_8/step_0'],
                             env=env, user=65534, group=65534)
    try:
        time.sleep(0.2)
        found = _candidate_of(child.pid, CgroupTrust('/nonexistent'))
        assert found.cgroup_job is None and found.uid == 65534
        bobs = job('8', uid=1002, start=time.time() - 60, end=time.time() + 60)
        claimed, spared = split(S.job_claims(bobs, [found], [], listpids={}))
        assert claimed == [] and spared[child.pid].startswith('owned by uid 65534')   # not bob's job's, whatever it says
        _own, stale, blocking = S.stale_claims(S.Job('8', uid=1002), [found], {}, {})
        assert stale == [] and [c.pid for c, _w in blocking] == [child.pid]           # nor provably stale
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason='chowns cgroup-looking directories (root)')
def test_a_cgroup_looking_path_a_user_created_names_no_job(tmp_path):
    root = tmp_path / 'cgroup'
    (root / 'freezer' / 'slurm' / 'uid_1001' / 'job_7').mkdir(parents=True)
    for path in (root, root / 'freezer', root / 'freezer' / 'slurm'):
        os.chmod(str(path), 0o755)
    os.chown(str(root / 'freezer' / 'slurm' / 'uid_1001'), 1001, 1001)  # her own directory: job_7 below it is her name
    trust = CgroupTrust(str(root))
    assert parse_cgroup('6:freezer:/slurm/uid_1001/job_7/step_0\n', trust)[1] is None
    os.chown(str(root / 'freezer' / 'slurm' / 'uid_1001'), 0, 0)
    trust.clear()
    assert parse_cgroup('6:freezer:/slurm/uid_1001/job_7/step_0\n', trust)[1] == '7'
    assert parse_cgroup('0::/user.slice/user-1001.slice/user@1001.service/job_7\n', None)[1] is None


# ---------------------------------------------------------------------------- prolog: stale, own or blocking
def test_prolog_kills_only_what_is_provably_stale():
    jobs = {'3': job('3', state='COMPLETED'), '4': job('4', state='RUNNING')}
    candidates = [cand(60, cgroup_job='3'), cand(61, cgroup_job='2'), cand(62, cgroup_job='4'), cand(63), cand(64, cgroup_job='5'),
                  cand(65), cand(66, uid=0)]
    own, stale, blocking = S.stale_claims(job('5', uid=1002, start=T0 + 700, state='RUNNING'), candidates, jobs, {65: '4'})
    assert [c.pid for c, _w in own] == [64]
    assert dict((c.pid, w) for c, w in stale) == {60: 'left over from job 3 (COMPLETED)', 61: 'left over from job 2 (no longer known to slurmctld)'}
    assert dict((c.pid, w) for c, w in blocking) == {
        62: "in job 4's cgroup, which is RUNNING",
        63: "not provably left over from job 3: started after job 4 of the same user started, which is still RUNNING here, so it could be that job's",
        65: 'slurmstepd lists it under job 4',
        66: 'no root-owned cgroup or slurmstepd names its job, and it started inside no ended job of uid 0 that slurmctld still knows '
            '(it forgets a job MinJobAge after its end)'}
    _own, stale, blocking = S.stale_claims(job('5'), [cand(60, cgroup_job='3'), cand(63)], None, {})
    assert stale == [] and [w for _c, w in blocking] == ["in job 3's cgroup, and Slurm could not be asked whether that job ended",
                                                         'no root-owned cgroup names its job, and Slurm could not be asked which jobs ended']
    _own, stale, blocking = S.stale_claims(job('5'), [cand(63)], {'3': job('3', state='COMPLETED')}, None)
    assert stale == [] and blocking[0][1].endswith('Slurm could not be asked which jobs ended')


def test_the_prolog_proves_a_leftover_stale_without_a_cgroup_by_the_ended_jobs_lifetime():
    # proctrack/linuxproc: job 7 (uid 1001) ended, its leftover started 10 s into it and also sits on a GPU of job 9, which
    # the same user started later and still runs; bob's job 5 starts on job 7's old GPU
    ended, later = job('7', state='COMPLETED'), job('9', uid=1001, start=T0 + 100, end=T0 + 4000, gpus=(1,), state='RUNNING')
    starting = job('5', uid=1002, start=T0 + 700, state='RUNNING')
    jobs = {'7': ended, '9': later, '5': starting, '6': job('6', uid=1001, start=T0 - 900, end=T0 - 800, state='COMPLETED')}
    _own, stale, blocking = S.stale_claims(starting, [cand(70, gpus=(0, 1))], jobs, {})
    assert [(c.pid, w) for c, w in stale] == [(70, "left over from job 7 (COMPLETED): uid 1001's process started 10 s into it, "
                                                   "before every job still active here that could own it")] and blocking == []
    # the starting job is the user's own: the leftover started before it, so it is not its process either
    alices = job('5', uid=1001, start=T0 + 700, state='RUNNING')
    assert [c.pid for c, _w in S.stale_claims(alices, [cand(70)], dict(jobs, **{'5': alices}), {})[1]] == [70]


def test_the_prolog_never_proves_stale_what_it_cannot():
    ended = job('7', state='COMPLETED')
    later = job('9', uid=1001, start=T0 + 100, end=T0 + 4000, gpus=(1,), state='RUNNING')
    starting = job('5', uid=1002, start=T0 + 700, state='RUNNING')
    no_end = job('8', start=T0, end=None, state='COMPLETED')
    cases = [
        ({'7': ended, '9': later, '5': starting}, cand(71, started=T0 + 150, gpus={0, 1}),   # after job 9 started, on its GPU too
         "not provably left over from job 7: started after job 9 of the same user started, which is still RUNNING here, "
         "so it could be that job's"),
        ({'7': ended, '5': starting}, cand(72, uid=1002), None),                # bob's process inside alice's job
        ({'7': ended, '5': starting}, cand(73, started=T0 - 60), None),         # before any ended job
        ({'7': ended, '5': starting}, cand(74, started=T0 + 650), None),        # after it ended
        ({'5': starting}, cand(75), None),                                      # slurmctld forgot job 7 (MinJobAge)
        ({'8': no_end, '5': starting}, cand(76), None),                         # an ended job without an end bounds nothing
        ({'7': job('7', state='COMPLETING'), '5': starting}, cand(77),          # still completing: active, and it owns it
         None),
    ]
    for jobs, candidate, why in cases:
        _own, stale, blocking = S.stale_claims(starting, [candidate], jobs, {})
        assert stale == [] and len(blocking) == 1, (candidate.pid, stale)
        expected = why or ('no root-owned cgroup or slurmstepd names its job, and it started inside no ended job of uid %d that '
                           'slurmctld still knows (it forgets a job MinJobAge after its end)' % candidate.uid)
        assert blocking[0][1] == expected, candidate.pid
    # ... unless its parent could be job 9's: then it blocks with its parent
    _own, stale, blocking = S.stale_claims(starting, [cand(68, started=T0 + 150, gpus={0, 1}), cand(69, started=T0 + 151, ppid=68)],
                                           {'7': ended, '9': later, '5': starting}, {})
    assert stale == [] and [(c.pid, why.startswith('in the family of pid 68 (blocking): not provably')) for c, why in blocking] == [
        (68, False), (69, True)]
    # on none of job 9's GPUs, it is no process of job 9's: stale
    _own, stale, blocking = S.stale_claims(starting, [cand(70, started=T0 + 150)], {'7': ended, '9': later, '5': starting}, {})
    assert [c.pid for c, _why in stale] == [70] and blocking == []
    # the starting job of the same user, whose start slurmctld did not say (built from slurmd's environment)
    from_env = S.Job('5', uid=1001, gpus=[0])
    _own, stale, blocking = S.stale_claims(from_env, [cand(78)], {'7': ended}, {})
    assert stale == [] and blocking[0][1] == ("not provably left over from job 7: job 5 of the same user is active here and its start "
                                              "is unknown, so it could be that job's")
    # a process slurmstepd lists, under any job, is that job's
    _own, stale, blocking = S.stale_claims(starting, [cand(79)], {'7': ended, '5': starting}, {79: '7'})
    assert stale == [] and blocking[0][1] == 'slurmstepd lists it under job 7'


def test_script_options_and_drain_reasons():
    with pytest.raises(S.SlurmError, match='release_timeout'):
        scripts.ScriptOptions(release_timeout=0)
    with pytest.raises(S.SlurmError, match='grace'):
        scripts.ScriptOptions(grace=True)
    assert scripts.ScriptOptions().bound_s() == 3 * 10 + 20 + 10 + 5 + 60 + 5
    reason = scripts.drain_reason('gpufleet: GPU 0 holds 2048 MiB (pids 5) before job 7 \x1b[2J"\n' + 'x' * 400)
    assert '\x1b' not in reason and '\n' not in reason and '"' not in reason and len(reason) == scripts.MAX_REASON


def test_the_epilog_refuses_a_job_id_that_is_not_a_number(capsys):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import cli
    old = dict(os.environ)
    try:
        os.environ['SLURM_JOB_ID'] = '7;reboot'
        assert cli.main(['epilog', '--root', '/nonexistent-gpufleet', '--json']) == scripts.EXIT_USAGE
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert "SLURM_JOB_ID: expected a job number, got '7;reboot'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the epilog's release check
class _Slurm(object):
    """The Slurm commands the epilog calls: no other job on the node, no listpids, and a drain that is recorded."""

    def __init__(self):
        self.drained = []

    def jobs(self, _node):
        return {}

    def listpids(self):
        return {}

    def drain(self, node, reason):
        self.drained.append((node, reason))


def _driver(listed):
    """select_backends for the release wait: memory_view gives ``listed(vendor_indexes)``, or raises when it is None."""
    def select(name):
        class Backend(object):
            def __init__(self):
                self.name = name

            def memory_view(self, vendor_indexes=None):
                if listed is None:
                    raise RuntimeError('NVML_ERROR_GPU_IS_LOST')
                return listed(vendor_indexes)

        class Selection(object):
            backends = [Backend()]

            def close(self):
                pass

        return Selection()
    return select


@pytest.mark.parametrize('listed, drains', [
    (None, True),                                                       # the driver read raises
    (lambda asked: dict((i, (0, None)) for i in asked), True),          # memory free, process list unreadable
    (lambda asked: dict((i, (0, set())) for i in asked), False),        # read, and the ghost is gone: released
], ids=['read raises', 'no process list', 'released'])
def test_the_epilog_drains_when_the_release_cannot_be_read(monkeypatch, listed, drains):
    """Job 7's exited process is still listed on GPU 0 (a ghost, 2 GiB): the epilog waits for the driver to drop it.
    When the driver's process list cannot be read, nothing proves the GPU free, so the node is drained (issue 34)."""
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import reclaim as core_reclaim
    from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import proc, snapshot
    snap = snapshot([proc(4242, 'alice', {0: 2048}, uid=1001)])
    snap.processes[0].status = 'not_found'   # exited: only the driver still lists it
    monkeypatch.setattr(core_reclaim, 'select_backends', _driver(listed))
    client = _Slurm()
    environ = {'SLURM_JOB_ID': '7', 'SLURMD_NODENAME': 'node01', 'SLURM_JOB_GPUS': '0', 'SLURM_JOB_UID': '1001'}
    out = scripts.epilog(scripts.ScriptOptions(release_timeout=0.3), environ=environ, client=client,
                         snapshot_fn=lambda **_kwargs: snap)
    assert out['killed'] == [] and out['rc'] == scripts.EXIT_OK
    assert out['release']['0']['released'] is (not drains)
    if drains:
        assert out['unreleased'] == [{'gpu': 0, 'mib': 2048 if listed is None else 0}]
        assert client.drained == [('node01', 'gpufleet: GPU 0 holds %d MiB after job 7' % out['unreleased'][0]['mib'])]
        assert out['drained'] == client.drained[0][1]
    else:
        assert out['unreleased'] == [] and client.drained == [] and out['drained'] is None
