# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Slurm as the truth about who may hold which GPU (issue #18): reading Slurm, and which processes are a job's.

What Slurm says comes from three root-side sources, each through a subprocess with a deadline:

* ``squeue --json`` (Slurm 21.08+, its openapi plugin): every job slurmctld knows (until ``MinJobAge`` after its
  end), parsed as JSON.  Never the text of ``scontrol show job``: a job name is the user's and may hold a newline
  and ``UserId=root(0)``, which forges a line of that output (checked on Slurm 22.05.8).  22.05's ``squeue --json``
  ignores ``-j``/``-w``, so jobs are filtered here, by the node names in ``job_resources.allocated_nodes``.
* ``scontrol listpids`` run on the node: the pids slurmstepd tracks for each job here (numbers only).
* the process's cgroup (``processes.parse_cgroup`` through ``CgroupTrust``: only the root-owned part of the path
  names a job).

``job_claims`` (epilog) and ``stale_claims`` (prolog) are the decisions (pure, unit-tested): which processes on the
node's GPUs belong to a job, or were provably left by one that ended (``leftover_of``: the process's real uid and
start time against the jobs' owners and lifetimes, never what the process says about itself).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from .errors import GpuFleetError
from .safe_files import find_program

SLURM_TIMEOUT_S = 10.0
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
# job states in which a job may still have processes on its nodes (its processes are never another job's victims)
ACTIVE_STATES = frozenset(('RUNNING', 'SUSPENDED', 'COMPLETING', 'CONFIGURING', 'STOPPED', 'SIGNALING', 'STAGE_OUT',
                           'RESIZING', 'REQUEUED', 'REQUEUE_FED', 'REQUEUE_HOLD', 'SPECIAL_EXIT'))
# Slurm's times are whole seconds from slurmctld's clock: a process counts as started inside the job from this much
# before its start (controller/node clock skew) to this much after its end
START_SLACK_S = 1.0
END_SLACK_S = 1.0
_GRES_RE = re.compile(r'(?:^|,)gpu(?::[^(),]*)?\(IDX:([0-9,\-]*|N/A)\)')
_JOB_ID_RE = re.compile(r'^[1-9][0-9]{0,9}$')


class SlurmError(GpuFleetError):
    """Slurm could not be asked (command missing, timed out, failed, or answered something unreadable)."""


def parse_idx(text):
    """The GPU indexes of a GRES detail such as ``gpu:2(IDX:0-1)``, ``gpu:a100:3(IDX:0,2-3)`` (sorted list)."""
    found = set()
    for match in _GRES_RE.finditer(text or ''):
        spec = match.group(1)
        if spec in ('', 'N/A'):
            continue
        for part in spec.split(','):
            if not part:
                continue
            low, _sep, high = part.partition('-')
            if not low.isdigit() or (high and not high.isdigit()):
                raise SlurmError('unreadable GRES index list %r' % text)
            first, last = int(low), int(high or low)
            if last < first or last - first > 4096:
                raise SlurmError('unreadable GRES index range %r' % part)
            found.update(range(first, last + 1))
    return sorted(found)


def parse_index_list(text):
    """Indexes from SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES (``0,2``); None when absent or not all numbers (UUIDs)."""
    parts = [p.strip() for p in (text or '').split(',') if p.strip()]
    if not parts or not all(p.isdigit() and len(p) < 6 for p in parts):
        return None
    return sorted(set(int(p) for p in parts))


def valid_job_id(value):
    """A job id as text, or SlurmError naming the value."""
    text = str(value or '').strip()
    if not _JOB_ID_RE.match(text):
        raise SlurmError('SLURM_JOB_ID: expected a job number, got %r' % (value,))
    return text


class Job(object):
    """One Slurm job as this node sees it: id (text), uid, user, state, start and end (epoch seconds or None), and
    ``gpus``: the GRES gpu indexes it holds on this node (None when Slurm did not say)."""

    __slots__ = ('id', 'uid', 'user', 'state', 'start', 'end', 'gpus')

    def __init__(self, id, uid=None, user=None, state=None, start=None, end=None, gpus=None):  # pylint: disable=redefined-builtin
        self.id = str(id)
        self.uid = uid
        self.user = user
        self.state = state
        self.start = start
        self.end = end
        self.gpus = None if gpus is None else sorted(set(gpus))

    @property
    def active(self):
        return self.state in ACTIVE_STATES

    def to_dict(self):
        return {'job': self.id, 'uid': self.uid, 'user': self.user, 'state': self.state, 'start': self.start, 'end': self.end,
                'gpus': self.gpus}


def _epoch(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return float(value)


def jobs_from_json(data, node):
    """``{job id: Job}`` of the ``squeue --json`` answer ``data`` for the jobs allocated on ``node`` (their ``gpus``
    are those of this node); other jobs are left out.  SlurmError when the answer has no job list."""
    jobs = data.get('jobs') if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise SlurmError('squeue --json answered without a job list')
    out = {}
    for raw in jobs:
        if not isinstance(raw, dict) or isinstance(raw.get('job_id'), bool) or not isinstance(raw.get('job_id'), int):
            continue
        resources = raw.get('job_resources') if isinstance(raw.get('job_resources'), dict) else {}
        allocated = resources.get('allocated_nodes') if isinstance(resources.get('allocated_nodes'), list) else []
        names = [entry.get('nodename') for entry in allocated if isinstance(entry, dict)]
        if node not in names:
            continue
        detail = raw.get('gres_detail') if isinstance(raw.get('gres_detail'), list) else []
        position = names.index(node)
        gpus = None
        if position < len(detail) and isinstance(detail[position], str):
            gpus = parse_idx(detail[position]) if 'gpu' in detail[position] else []
        uid = raw.get('user_id')
        state = raw.get('job_state')
        out[str(raw['job_id'])] = Job(raw['job_id'], uid=uid if isinstance(uid, int) and not isinstance(uid, bool) else None,
                                      user=raw.get('user_name') if isinstance(raw.get('user_name'), str) else None,
                                      state=state.split()[0] if isinstance(state, str) and state else None,
                                      start=_epoch(raw.get('start_time')), end=_epoch(raw.get('end_time')), gpus=gpus)
    return out


def parse_listpids(text):
    """``{pid: job id}`` from ``scontrol listpids`` (columns PID JOBID STEPID ...; the header and odd lines skipped)."""
    out = {}
    for line in (text or '').split('\n'):
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit() and _JOB_ID_RE.match(fields[1]):
            out[int(fields[0])] = fields[1]
    return out


def boot_clock(proc_root='/proc', clock=time.time):
    """A function: a /proc start time (clock ticks since boot) -> epoch seconds, taken from /proc/uptime now rather
    than from the boot time in /proc/stat (whole seconds, and it drifts from the wall clock), None when unreadable."""
    try:
        with open(os.path.join(proc_root, 'uptime'), 'rb') as handle:
            uptime = float(handle.read(64).split()[0])
        ticks = float(os.sysconf('SC_CLK_TCK'))
    except (OSError, ValueError, IndexError, AttributeError):
        return lambda starttime: None
    boot = clock() - uptime
    return lambda starttime: None if starttime is None else boot + starttime / ticks


def host_gpus(indexes, snapshot):
    """Host-wide GPU indexes of Slurm's GRES indexes (gres.conf ``File=/dev/nvidia[0-N]`` in order: GRES index i is
    the device with minor i; a device without a minor is matched by its index)."""
    wanted = set(indexes or ())
    return sorted(dev.index for dev in snapshot.all_devices if (dev.minor if dev.minor is not None else dev.index) in wanted)


def node_name(environ=None):
    """This node's Slurm name: ``SLURMD_NODENAME`` (slurmd sets it for the prolog and epilog), else the short host name."""
    environ = os.environ if environ is None else environ
    name = environ.get('SLURMD_NODENAME') or os.uname().nodename.split('.')[0]
    return name


class SlurmNode(object):
    """One node as ``sinfo --json`` tells it: ``name``, ``partitions`` (names), ``drained`` (the DRAIN flag is set),
    ``reason`` (the drain reason, '' when none) and ``reason_time`` (epoch seconds or None)."""

    __slots__ = ('name', 'partitions', 'drained', 'reason', 'reason_time')

    def __init__(self, name, partitions=(), drained=False, reason='', reason_time=None):
        self.name = name
        self.partitions = tuple(partitions)
        self.drained = drained
        self.reason = reason
        self.reason_time = reason_time


def nodes_from_json(data):
    """[SlurmNode] of the ``sinfo --json`` answer ``data`` (Slurm 22.05: ``state`` text and ``state_flags``; 23.02 and
    later: ``state`` a list of words); SlurmError when it has no node list."""
    nodes = data.get('nodes') if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        raise SlurmError('sinfo --json answered without a node list')
    out = []
    for raw in nodes:
        if not isinstance(raw, dict) or not isinstance(raw.get('name'), str):
            continue
        words = raw.get('state') if isinstance(raw.get('state'), list) else [raw.get('state')]
        words = words + (raw.get('state_flags') if isinstance(raw.get('state_flags'), list) else [])
        flags = set(str(w).upper() for w in words if isinstance(w, str))
        parts = [p for p in raw.get('partitions') or () if isinstance(p, str)] if isinstance(raw.get('partitions'), list) else []
        reason = raw.get('reason') if isinstance(raw.get('reason'), str) else ''
        out.append(SlurmNode(raw['name'], parts, drained=bool(flags & {'DRAIN', 'DRAINED', 'DRAINING'}), reason=reason,
                             reason_time=_epoch(raw.get('reason_changed_at'))))
    return out


class SlurmClient(object):
    """Asks Slurm through its commands, each with a deadline; answers are cached for the life of the client (one
    tick, one prolog or epilog).  ``env``: the environment of the commands (default: this process's, which carries
    ``SLURM_CONF`` where a site sets it).  ``runner`` is subprocess.run (a seam for the argv, never a fake Slurm);
    ``which`` (name -> path or None) finds the commands (default safe_files.find_program: as root, never a planted one)."""

    def __init__(self, timeout=SLURM_TIMEOUT_S, env=None, runner=subprocess.run, which=None):
        self.timeout = timeout
        self.env = env
        self.runner = runner
        self.which = which
        self._cache = {}

    def run(self, argv):
        """The standard output of ``argv`` (text); SlurmError naming the command and why it failed."""
        refused = []
        path = self.which(argv[0]) if self.which is not None else find_program(argv[0], refused=refused)
        if path is None:
            raise SlurmError('; '.join(refused) or '%s is not installed (or not on PATH)' % argv[0])
        try:
            proc = self.runner([path] + list(argv[1:]), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=self.timeout, env=self.env, check=False, close_fds=True)
        except subprocess.TimeoutExpired:
            raise SlurmError('%s did not answer within %gs' % (' '.join(argv[:2]), self.timeout))
        except OSError as exc:
            raise SlurmError('%s could not run: %s' % (argv[0], exc.strerror or exc))
        if len(proc.stdout) > MAX_OUTPUT_BYTES:
            raise SlurmError('%s answered more than %d bytes' % (' '.join(argv[:2]), MAX_OUTPUT_BYTES))
        if proc.returncode != 0:
            why = proc.stderr.decode('utf-8', 'replace').strip().splitlines()
            raise SlurmError('%s failed (exit %d): %s' % (' '.join(argv[:2]), proc.returncode, why[-1][:300] if why else 'no message'))
        return proc.stdout.decode('utf-8', 'replace')

    def _cached(self, key, compute):
        if key not in self._cache:
            try:
                self._cache[key] = (compute(), None)
            except SlurmError as exc:
                self._cache[key] = (None, exc)
        value, error = self._cache[key]
        if error is not None:
            raise error
        return value

    def jobs(self, node):
        """``{job id: Job}`` of the jobs Slurm allocated on ``node`` (active or recently ended)."""
        def compute():
            try:
                data = json.loads(self.run(['squeue', '--json']))
            except ValueError as exc:
                raise SlurmError('squeue --json answered no JSON (%s); Slurm 21.08 or later with its openapi plugin is needed' % exc)
            return jobs_from_json(data, node)
        return self._cached(('jobs', node), compute)

    def listpids(self):
        """``{pid: job id}`` of the processes slurmstepd tracks on this node (``scontrol listpids``)."""
        def compute():
            try:
                return parse_listpids(self.run(['scontrol', 'listpids']))
            except SlurmError as exc:
                if 'No job steps exist' in str(exc):
                    return {}
                raise
        return self._cached(('listpids',), compute)

    def nodes(self):
        """[SlurmNode] of every node slurmctld knows (``sinfo --json``): partitions, drain flag and reason."""
        def compute():
            try:
                data = json.loads(self.run(['sinfo', '--json']))
            except ValueError as exc:
                raise SlurmError('sinfo --json answered no JSON (%s); Slurm 21.08 or later with its openapi plugin is needed' % exc)
            return nodes_from_json(data)
        return self._cached(('nodes',), compute)

    def drain(self, node, reason):
        """``scontrol update nodename=NODE state=drain reason=REASON`` (argv, no shell)."""
        self.run(['scontrol', 'update', 'nodename=%s' % node, 'state=drain', 'reason=%s' % reason])


# ---------------------------------------------------------------------------- which processes are a job's
class Candidate(object):
    """A process on the node's GPUs as the decision sees it: pid, starttime (identity), real uid, ``started`` (epoch
    seconds, from /proc's start time), ``cgroup_job`` (the job its root-owned cgroup names, or None), ``gpus`` (the
    host-wide GPU indexes it uses), name, the MiB the driver charges to it, and ``ppid`` (its parent, from /proc)."""

    __slots__ = ('pid', 'starttime', 'uid', 'user', 'started', 'cgroup_job', 'gpus', 'name', 'used_mib', 'ppid')

    def __init__(self, pid, starttime=None, uid=None, started=None, cgroup_job=None, gpus=(), name=None, used_mib=None, user=None,
                 ppid=None):
        self.pid = pid
        self.ppid = ppid
        self.starttime = starttime
        self.uid = uid
        self.user = user
        self.started = started
        self.cgroup_job = None if cgroup_job is None else str(cgroup_job)
        self.gpus = frozenset(gpus)
        self.name = name
        self.used_mib = used_mib


def job_claims(job, candidates, other_jobs, listpids=None, lifetime_rule=True):
    """Split ``candidates`` into (``claimed``, ``spared``): lists of ``(Candidate, why)``.

    ``job``: the ending Job (its ``gpus`` here: host-wide GPU indexes).  ``other_jobs``: the other jobs Slurm knows
    on this node (None when they could not be read).  ``listpids``: ``{pid: job id}`` from slurmstepd, or None when
    it could not be read.  A process is the job's when

    1. its root-owned cgroup names the job, or slurmstepd lists it under the job; else
    2. (``lifetime_rule``, and only when ``listpids`` and the other jobs could be read) it uses one of the job's
       GPUs and is provably the job's leftover (``leftover_of``: the user's, started inside the job's lifetime,
       and before every job still active here that could own it).  Which GPUs the other jobs hold does not
       matter: a leftover that also sits on a GPU of another job is still this job's.

    Never the job's: a process whose cgroup or slurmstepd names another job, another uid's or root's process, or one
    that started after another active job of its user started (it could be that job's).  Names, command lines and
    environments are never read: a process that claims ``SLURM_JOB_ID`` in its argv or environment is judged like
    any other.
    """
    verdicts = {}
    for cand in candidates:
        listed = listpids.get(cand.pid) if listpids else None
        why_not = None
        if cand.cgroup_job is not None and cand.cgroup_job != job.id:
            why_not = 'in job %s\'s cgroup' % cand.cgroup_job
        elif listed is not None and listed != job.id:
            why_not = 'slurmstepd lists it under job %s' % listed
        elif cand.cgroup_job == job.id:
            verdicts[cand.pid] = ('claimed', 'in job %s\'s cgroup' % job.id)
            continue
        elif listed == job.id:
            verdicts[cand.pid] = ('claimed', 'slurmstepd lists it under job %s' % job.id)
            continue
        if why_not is None:
            why_not = _lifetime_rule(job, cand, other_jobs, listpids, lifetime_rule)
            if why_not is None:
                verdicts[cand.pid] = ('claimed', 'uid %s\'s process started %s s into job %s, on its GPU %s' % (
                    cand.uid, int(cand.started - job.start), job.id, ','.join(str(g) for g in sorted(cand.gpus & set(job.gpus)))))
                continue
        verdicts[cand.pid] = ('spared', why_not)
    return _split(candidates, with_families(candidates, verdicts, listpids), ('claimed', 'spared'))


def with_families(candidates, verdicts, listpids):
    """``verdicts`` ({pid: (verdict, why)} of ``candidates``) with every process judged with its family: a process
    whose parent is a candidate of its uid takes the verdict of the process its family started from (walking up its
    parents), unless its own root-owned cgroup or slurmstepd names its job.  A worker holds its parent's GPU memory
    (an inherited device file), so a parent is never ended without its workers, nor a worker while its parent is
    spared or blocks.  Parents come from /proc (the kernel), never from the process."""
    by_pid = dict((cand.pid, cand) for cand in candidates)
    listed = listpids or {}
    out = {}
    for cand in candidates:
        root = cand
        for _step in range(len(by_pid)):
            parent = by_pid.get(root.ppid)
            if parent is None or parent.uid != root.uid or root.cgroup_job is not None or listed.get(root.pid) is not None:
                break
            root = parent
        verdict, why = verdicts[root.pid]
        out[cand.pid] = (verdict, why) if root is cand else (verdict, 'in the family of pid %d (%s): %s' % (root.pid, verdict, why))
    return out


def _split(candidates, verdicts, kinds):
    """Lists of (Candidate, why), one per verdict of ``kinds``, in the candidates' order."""
    return tuple([(cand, verdicts[cand.pid][1]) for cand in candidates if verdicts[cand.pid][0] == kind] for kind in kinds)


def _lifetime_rule(job, cand, other_jobs, listpids, enabled):
    """None when rule 2 of job_claims makes ``cand`` the job's, else why not."""
    if not enabled:
        return 'no root-owned cgroup or slurmstepd names it (the lifetime rule is off)'
    if listpids is None or other_jobs is None:
        return 'Slurm\'s view of this node could not be read, so only cgroups decide'
    why_not = leftover_of(job, cand, [other for other in other_jobs if other.active and other.id != job.id])
    if why_not is None and (not job.gpus or not cand.gpus & set(job.gpus)):
        why_not = 'uses none of the job\'s GPUs'
    return why_not


def leftover_of(job, cand, active):
    """None when ``cand`` is provably a leftover of ``job``, a job that has ended, else why not.

    The proof (every fact from the kernel or from slurmctld, none from the process): its real uid is the job's user's
    and not root's (root starts services that belong to no job); it started inside the job's lifetime
    (``_outside``); and none of the jobs still active on this node (``active``) could own it.  An active job of its
    uid, of root (who may start a process as anyone) or of an unknown user could own it, unless that job started
    after it (its start < that job's start - 1 s: a job's processes start after the job) or Slurm says which GPUs
    that job holds and the process is on none of them (it squats GPUs that are not that job's allocation).
    """
    if cand.uid == 0:
        return 'owned by root, whose processes only a cgroup or slurmstepd attributes to a job'
    if job.uid is None or cand.uid != job.uid:
        return 'owned by uid %s, not the job\'s user (uid %s)' % (cand.uid, job.uid)
    why_not = _outside(job, cand)
    for other in active if why_not is None else ():
        if other.uid not in (cand.uid, 0, None):
            continue
        if other.gpus is not None and not set(cand.gpus or ()) & set(other.gpus):
            continue
        whose = {cand.uid: 'the same user', 0: 'root'}.get(other.uid, 'an unknown user')
        if other.start is None:
            return 'job %s of %s is active here and its start is unknown, so it could be that job\'s' % (other.id, whose)
        if cand.started >= other.start - START_SLACK_S:
            return 'started after job %s of %s started, which is still %s here, so it could be that job\'s' % (
                other.id, whose, other.state or 'active')
    return why_not


def _outside(job, cand):
    """None when ``cand`` started inside ``job``'s lifetime (job start - 1 s <= its start <= job end + 1 s: Slurm's
    whole seconds and clock skew; no end known: no upper bound), else why not."""
    if job.start is None or cand.started is None:
        return 'the start time of the job or of the process is unknown'
    if cand.started < job.start - START_SLACK_S:
        return 'started before the job'
    if job.end is not None and job.end >= job.start and cand.started > job.end + END_SLACK_S:
        return 'started after the job ended'
    return None


def stale_claims(job, candidates, jobs, listpids):
    """For a prolog of ``job`` (the starting Job): split the processes on its GPUs into (``own``, ``stale``,
    ``blocking``), each a list of ``(Candidate, why)``.

    ``own``: the starting job's (its cgroup or slurmstepd names it).  ``stale``: provably left over from a job that
    ended, and slurmstepd lists it under no job: either its root-owned cgroup names a job that Slurm (``jobs``:
    every job slurmctld knows on this node, or None when it could not be read) lists as ended or no longer knows,
    or, without such a cgroup (proctrack/linuxproc), ``leftover_of`` proves it a leftover of an ended job Slurm
    still knows (``MinJobAge`` after its end), the starting job counted among the active ones whatever its state.  ``blocking``:
    everything else (another active job's, or nothing proves it stale).
    """
    verdicts = {}
    active = None if jobs is None else [other for other in jobs.values() if other.active and other.id != job.id] + [job]
    for cand in candidates:
        listed = listpids.get(cand.pid) if listpids else None
        if cand.cgroup_job == job.id or listed == job.id:
            verdicts[cand.pid] = ('own', 'job %s\'s own process' % job.id)
        elif listed is not None:
            verdicts[cand.pid] = ('blocking', 'slurmstepd lists it under job %s' % listed)
        elif jobs is None or listpids is None:
            verdicts[cand.pid] = ('blocking', ('in job %s\'s cgroup, and Slurm could not be asked whether that job ended'
                                               % cand.cgroup_job) if cand.cgroup_job is not None else
                                  'no root-owned cgroup names its job, and Slurm could not be asked which jobs ended')
        elif cand.cgroup_job is not None and cand.cgroup_job in jobs and jobs[cand.cgroup_job].active:
            verdicts[cand.pid] = ('blocking', 'in job %s\'s cgroup, which is %s' % (cand.cgroup_job, jobs[cand.cgroup_job].state))
        elif cand.cgroup_job is not None:
            state = jobs[cand.cgroup_job].state if cand.cgroup_job in jobs else 'no longer known to slurmctld'
            verdicts[cand.pid] = ('stale', 'left over from job %s (%s)' % (cand.cgroup_job, state))
        else:
            ended, why_not = _ended_owner(cand, jobs, active)
            verdicts[cand.pid] = ('blocking', why_not) if ended is None else (
                'stale', 'left over from job %s (%s): uid %s\'s process started %d s into it, before every job still active here '
                'that could own it' % (ended.id, ended.state, cand.uid, int(cand.started - ended.start)))
    return _split(candidates, with_families(candidates, verdicts, listpids), ('own', 'stale', 'blocking'))


def _ended_owner(cand, jobs, active):
    """(the ended Job ``cand`` is provably a leftover of, None) or (None, why not), for a process no cgroup names.
    Only an ended job with a known end can contain its start."""
    for ended in sorted(jobs.values(), key=lambda j: (j.start or 0, j.id), reverse=True):
        if ended.active or ended.end is None or ended.uid != cand.uid or _outside(ended, cand) is not None:
            continue
        why_not = leftover_of(ended, cand, active)
        if why_not is not None:
            return None, 'not provably left over from job %s: %s' % (ended.id, why_not)
        return ended, None
    return None, ('no root-owned cgroup or slurmstepd names its job, and it started inside no ended job of uid %s that '
                  'slurmctld still knows (it forgets a job MinJobAge after its end)' % cand.uid)
