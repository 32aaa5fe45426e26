# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""``gpufleet-guard epilog`` and ``gpufleet-guard prolog``: job-scoped cleanup around a Slurm job (docs/slurm.md).

epilog: the processes left on the ending job's GPUs that are the job's (slurm.job_claims) get SIGTERM, then SIGKILL
after a grace (killer.terminate: pidfd, identity checked again); then the driver must show their memory free within
``release_timeout``, else the node is drained with ``gpufleet: GPU N holds X MiB after job J``.

prolog: on the starting job's GPUs, every process that is not the job's is either provably stale (slurm.stale_claims:
its root-owned cgroup names a job Slurm says has ended, or, without one, the lifetime rule proves it a leftover of an
ended job: killed, identity checked again, its memory checked, and the job proceeds) or blocking; blocking processes,
memory no process accounts for, or memory not released make the prolog drain the node (``gpufleet: GPU N holds X MiB
(pids ...) before job J``) and exit 1, so Slurm requeues the job.

Exit codes: 0 done (the epilog also when it drained the node itself); 1 Slurm should act (prolog refused; epilog
could not do its work or could not drain): a failing prolog or epilog makes slurmd drain the node, and a failing
prolog requeues the job (held); 2 usage (no SLURM_JOB_ID).
"""

from __future__ import annotations

import os
import signal
import time

from . import audit_log, killer, metrics as metrics_mod, safe_files
from .constants import DEFAULT_PROTECT_NAMES
from .model import CONTEXT_OVERHEAD_MIB
from .reclaim import DriverProbe
from .slurm import (SLURM_TIMEOUT_S, Candidate, Job, SlurmClient, SlurmError, boot_clock, host_gpus, job_claims, node_name,
                    parse_index_list, stale_claims, valid_job_id)
from .snapshot import take_snapshot
from .text import printable

DEFAULT_GRACE_S = 10.0
DEFAULT_KILL_WAIT_S = 5.0
# Simulated releases take milliseconds (docs/slurm.md, "Timings"); real drivers free large allocations in seconds,
# and operators report more than 30 s (NVIDIA/deepops#1317): 60 s, well inside the PrologEpilogTimeout we document.
DEFAULT_RELEASE_TIMEOUT_S = 60.0
DEFAULT_DRIVER_TIMEOUT_S = 20.0
MAX_REASON = 240
EXIT_OK, EXIT_ACT, EXIT_USAGE = 0, 1, 2
EVENTS = {'epilog': 'slurm_epilog', 'prolog': 'slurm_prolog'}


class ScriptOptions(object):
    """How an epilog or prolog runs: grace (s between SIGTERM and SIGKILL), kill_wait (s after SIGKILL),
    release_timeout (s for the memory to come back), slurm_timeout (s per Slurm command), driver_timeout (s per
    driver read), vendor, log (the guard's hash-chained log; None: none), metrics (the textfile; None: none),
    drain (drain the node when needed), dry_run (decide and report; signal and drain nothing)."""

    def __init__(self, grace=DEFAULT_GRACE_S, kill_wait=DEFAULT_KILL_WAIT_S, release_timeout=DEFAULT_RELEASE_TIMEOUT_S,
                 slurm_timeout=SLURM_TIMEOUT_S, driver_timeout=DEFAULT_DRIVER_TIMEOUT_S, vendor='auto', log=None, metrics=None,
                 drain=True, dry_run=False):
        for field, value in (('grace', grace), ('kill_wait', kill_wait), ('release_timeout', release_timeout),
                             ('slurm_timeout', slurm_timeout), ('driver_timeout', driver_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise SlurmError('%s: expected seconds, more than 0 and at most 3600, got %r' % (field, value))
        self.grace, self.kill_wait, self.release_timeout = float(grace), float(kill_wait), float(release_timeout)
        self.slurm_timeout, self.driver_timeout = float(slurm_timeout), float(driver_timeout)
        self.vendor, self.log, self.metrics, self.drain, self.dry_run = vendor, log, metrics, drain, dry_run

    def bound_s(self):
        """The longest a run can take: three Slurm commands, one driver read, the kill and the release wait."""
        return 3 * self.slurm_timeout + self.driver_timeout + self.grace + self.kill_wait + self.release_timeout + 5.0


def candidates(snapshot):
    """Every visible process on the node's GPUs (listed by the driver, or holding a GPU device file) as a Candidate."""
    started = boot_clock()   # /proc start time -> epoch seconds
    out = []
    for proc in list(snapshot.processes) + list(snapshot.holders):
        if proc.status in ('not_found', 'zombie', 'dead'):
            continue
        out.append(Candidate(proc.pid, starttime=proc.starttime, uid=proc.uid, user=proc.user, started=started(proc.starttime),
                             cgroup_job=proc.slurm_job, gpus=proc.gpu_indexes, name=proc.name, used_mib=getattr(proc, 'used_mib', None),
                             ppid=proc.ppid))
    return out


def ghosts(snapshot, gpus):
    """Pids the driver lists on ``gpus`` that are not visible here (exited, their memory still counted): {gpu: [(pid, MiB)]}."""
    out = {}
    for proc in snapshot.processes:
        if proc.status == 'not_found':
            for gpu in proc.gpu_indexes:
                if gpu in gpus:
                    out.setdefault(gpu, []).append((proc.pid, proc.used_mib_by_gpu.get(gpu)))
    return out


def _entry(cand, why):
    return {'pid': cand.pid, 'uid': cand.uid, 'user': cand.user, 'name': cand.name, 'gpus': sorted(cand.gpus),
            'used_mib': cand.used_mib, 'cgroup_job': cand.cgroup_job, 'why': why}


def _signal(claimed, run):
    """SIGTERM, SIGKILL after the grace, to each claimed (Candidate, why) still the same process (start time and uid
    read again) and not protected (killer.Protection).  Returns the victims; the refused (and, in a dry run, what
    would be killed) go into the run's result."""
    options = run.options
    protection = killer.Protection(protect_names=DEFAULT_PROTECT_NAMES)
    victims, refused = [], []
    for cand, why in claimed:
        info = killer.read_proc(cand.pid)
        if info is None or info.dead:
            continue
        if info.starttime != cand.starttime or info.uid != cand.uid:
            refused.append(dict(_entry(cand, why), refused='pid %d changed identity since it was examined' % cand.pid))
            continue
        reason = protection.reason(info)
        if reason is not None:
            refused.append(dict(_entry(cand, why), refused=reason))
            continue
        victims.append(killer.Victim(cand.pid, cand.starttime, record=_entry(cand, why)))
    if victims and not options.dry_run:
        killer.terminate(victims, signal.SIGTERM, timeout=options.grace, force=True, kill_timeout=options.kill_wait,
                         on_sent=run.journal)
    run.out['refused'] = refused
    if options.dry_run:
        run.out['would_kill'] = [v.record for v in victims]
    return victims


def _release(snapshot, gpus, victims, ghost_pids, run):
    """killer.wait_release over ``gpus``: the killed victims and the ghosts must leave the driver's lists, and the
    GPU's used memory must come down to what the processes still listed there hold (plus the driver's per-context
    allowance, model.CONTEXT_OVERHEAD_MIB).  Only GPUs where something was ended, a ghost is listed or memory no
    process accounts for (``orphaned_mib``) is held.  {gpu: wait_release entry}."""
    expected = {}
    for gpu in gpus:
        dev = snapshot.device(gpu)
        pids = set(v.pid for v in victims if v.outcome == 'killed' and gpu in v.record['gpus'])
        pids.update(pid for pid, _mib in ghost_pids.get(gpu, ()))
        if not pids and not (dev is not None and dev.orphaned_mib):
            continue
        others = [p for p in snapshot.processes if gpu in p.gpu_indexes and p.pid not in pids]
        kept = sum(p.used_mib_by_gpu.get(gpu) or 0 for p in others) + CONTEXT_OVERHEAD_MIB.get(dev.vendor if dev else None, 0) * len(others)
        before = dev.memory_used_mib if dev is not None else None
        expected[gpu] = {'pids': pids, 'before_mib': before, 'held_mib': None if before is None else max(0, before - kept)}
    release = {}
    if expected and not run.options.dry_run:
        probe = DriverProbe(run.options.vendor, snapshot, gpus=set(expected))
        try:
            release = killer.wait_release(expected, probe, timeout=run.options.release_timeout)
        finally:
            probe.close()
    run.out['release'] = dict((str(g), e) for g, e in sorted(release.items()))
    return release


def drain_reason(text):
    """The reason as scontrol gets it: printable, one line, bounded."""
    return printable(text).replace('"', "'")[:MAX_REASON]


class _Run(object):
    """One epilog or prolog: what it read, decided and did (``result()``), logged and measured."""

    def __init__(self, script, options, environ, client):
        self.script = script
        self.options = options
        self.environ = environ
        self.client = client
        self.started = time.monotonic()
        self.warnings = []
        self.out = {'script': script, 'killed': [], 'failed': [], 'spared': [], 'refused': [], 'blocking': [], 'release': {},
                    'unreleased': [], 'drained': None, 'dry_run': options.dry_run}
        self.node = node_name(environ)
        self.job_id = valid_job_id(environ.get('SLURM_JOB_ID'))

    def slurm(self, what, call):
        try:
            return call()
        except SlurmError as exc:
            self.warnings.append('%s: %s' % (what, exc))
            return None

    def job(self, jobs):
        """The Job from Slurm, its GPUs and uid completed from (or checked against) slurmd's environment."""
        env_gpus = parse_index_list(self.environ.get('SLURM_JOB_GPUS'))
        if env_gpus is None:
            env_gpus = parse_index_list(self.environ.get('CUDA_VISIBLE_DEVICES'))
        uid_text = str(self.environ.get('SLURM_JOB_UID') or '')
        env_uid = int(uid_text) if uid_text.isdigit() else None
        job = (jobs or {}).get(self.job_id)
        if job is None:
            job = Job(self.job_id, uid=env_uid, gpus=env_gpus)
            source = 'environment'
        else:
            source = 'squeue'
            if not job.gpus and env_gpus:
                job.gpus, source = env_gpus, 'squeue, GPUs from SLURM_JOB_GPUS'
            if env_uid is not None and job.uid is not None and env_uid != job.uid:
                self.warnings.append('SLURM_JOB_UID %d differs from squeue\'s uid %d for job %s; squeue\'s is used' % (
                    env_uid, job.uid, job.id))
            if job.uid is None:
                job.uid = env_uid
        self.out['job'] = dict(job.to_dict(), source=source)
        return job

    def drain(self, reason):
        reason = drain_reason(reason)
        self.out['drain_reason'] = reason
        if not self.options.drain or self.options.dry_run:
            return True
        try:
            self.client.drain(self.node, reason)
        except SlurmError as exc:
            self.warnings.append('could not drain %s: %s' % (self.node, exc))
            return False
        self.out['drained'] = reason
        return True

    def journal(self, victims):
        """The signals as soon as they went out (the run may be killed while it waits: PrologEpilogTimeout)."""
        if self.options.log:
            try:
                audit_log.append(self.options.log, {'event': EVENTS[self.script] + '_signalled', 'actor': audit_log.actor(),
                                                    'job': self.job_id, 'node': self.node,
                                                    'signalled': [dict(v.record, signals=list(v.signals)) for v in victims if v.signals]})
            except audit_log.AuditLogError as exc:
                self.warnings.append(str(exc))

    def finish(self, rc, victims=()):
        out = self.out
        out['killed'] = [v.as_result() for v in victims if v.outcome == 'killed' and v.signals]
        out['failed'] = [v.as_result() for v in victims if v.outcome == 'failed']
        out['rc'] = rc
        out['node'] = self.node
        out['seconds'] = round(time.monotonic() - self.started, 3)
        out['warnings'] = self.warnings
        if self.options.log and not self.options.dry_run:
            try:
                audit_log.append(self.options.log, dict(out, event=EVENTS[self.script], actor=audit_log.actor()))
            except audit_log.AuditLogError as exc:
                self.warnings.append(str(exc))
        if self.options.metrics:
            self.write_metrics()
        return out

    def write_metrics(self):
        out, prefix = self.out, 'gpufleet_slurm_%s_' % self.script
        found = metrics_mod.Metrics()
        seconds = [e['seconds'] for e in out['release'].values() if e.get('seconds') is not None]
        for name, text, value in (
                ('last_run_timestamp_seconds', 'When the last %s ran (epoch seconds)', time.time()),
                ('duration_seconds', 'How long the last %s took', out['seconds']),
                ('exit_code', 'Exit code of the last %s (0 ok; 1 Slurm drains the node, and requeues the job after a prolog)', out['rc']),
                ('processes_killed', 'Processes the last %s ended', len(out['killed'])),
                ('processes_spared', 'Processes on the job\'s GPUs the last %s left alone (not provably the job\'s)', len(out['spared'])),
                ('processes_blocking', 'Processes not of the job that made the last %s refuse', len(out['blocking'])),
                ('unreleased_mib', 'GPU memory (MiB) not released in time in the last %s', sum(u['mib'] or 0 for u in out['unreleased'])),
                ('release_seconds', 'Seconds until the memory of the processes the last %s ended was free', max(seconds) if seconds else 0),
                ('drained', '1 when the last %s drained the node', 1 if out['drained'] else 0),
                ('holders_unread', 'Processes whose open files the last %s did not read (the holder scan\'s bound)',
                 (out.get('holders_incomplete') or {}).get('processes', 0))):
            found.add(prefix + name, 'gauge', text % self.script, value, {'node': self.node})
        try:
            safe_files.write_atomic(self.options.metrics, found.render(), mode=0o644, dir_mode=0o755, strict=False)
        except OSError as exc:
            self.warnings.append('could not write the metrics %s: %s' % (self.options.metrics, exc.strerror or exc))


def _begin(script, options, environ, client, snapshot_fn):
    """The start of the epilog and the prolog: (run, jobs on this node or None, listpids or None, snapshot, the job
    of ``environ`` with host-wide GPU indexes)."""
    environ = os.environ if environ is None else environ
    run = _Run(script, options, environ, client or SlurmClient(timeout=options.slurm_timeout))
    jobs = run.slurm('squeue --json', lambda: run.client.jobs(run.node))
    listpids = run.slurm('scontrol listpids', run.client.listpids)
    snapshot = snapshot_fn(vendor=run.options.vendor, gather_processes=True, scan_holders=True,
                           driver_timeout=run.options.driver_timeout)
    run.warnings.extend(snapshot.errors)
    run.out['holders_incomplete'] = snapshot.holders_incomplete   # the holder scan's bound (fdwalk.py): never a drain by itself
    return run, jobs, listpids, snapshot, _on_host(run.job(jobs), snapshot)


def _on_host(job, snapshot):
    """A copy of ``job`` whose ``gpus`` are host-wide indexes (None stays None)."""
    return Job(job.id, job.uid, job.user, job.state, job.start, job.end, None if job.gpus is None else host_gpus(job.gpus, snapshot))


def epilog(options, environ=None, client=None, snapshot_fn=take_snapshot):
    """Run the epilog of the job in ``environ`` (slurmd's environment); returns the result (``rc``: the exit code)."""
    run, jobs, listpids, snapshot, job = _begin('epilog', options, environ, client, snapshot_fn)
    run.out['gpus'] = job.gpus
    if not job.gpus:
        run.warnings.append('job %s has no GPU on this node as far as Slurm and slurmd say: only its cgroup decides' % job.id)
    others = None if jobs is None else [_on_host(j, snapshot) for j in jobs.values() if j.id != job.id]
    claimed, spared = job_claims(job, candidates(snapshot), others, listpids)
    run.out['spared'] = [_entry(c, why) for c, why in spared if c.gpus & set(job.gpus or ())]
    victims = _signal(claimed, run)
    shared = set(g for other in others or () if other.active for g in other.gpus or ())
    ghost_pids = dict((g, v) for g, v in ghosts(snapshot, set(job.gpus or ())).items() if g not in shared)
    release = _release(snapshot, job.gpus or (), victims, ghost_pids, run)
    unreleased = [(g, e['unreleased_mib']) for g, e in sorted(release.items()) if not e['released']]
    run.out['unreleased'] = [{'gpu': g, 'mib': mib} for g, mib in unreleased]
    rc = EXIT_OK
    if unreleased and options.dry_run:
        run.out['would_drain'] = True
    elif unreleased:
        reason = 'gpufleet: %s after job %s' % (', '.join('GPU %d holds %s MiB' % (g, mib) for g, mib in unreleased), job.id)
        if not run.drain(reason):
            rc = EXIT_ACT
    if any(v.outcome == 'failed' for v in victims) and not run.out['drained']:
        if not run.drain('gpufleet: pids %s of job %s survived SIGKILL' % (
                ','.join(str(v.pid) for v in victims if v.outcome == 'failed'), job.id)):
            rc = EXIT_ACT
    return run.finish(rc, victims)


def prolog(options, environ=None, client=None, snapshot_fn=take_snapshot):
    """Run the prolog of the job in ``environ``; returns the result (``rc`` 1: refuse the job, the node drained)."""
    run, jobs, listpids, snapshot, job = _begin('prolog', options, environ, client, snapshot_fn)
    gpus = set(job.gpus or ())
    run.out['gpus'] = sorted(gpus)
    on_gpus = [c for c in candidates(snapshot) if c.gpus & gpus]
    _own, stale, blocking = stale_claims(job, on_gpus, jobs, listpids)
    run.out['blocking'] = [_entry(c, why) for c, why in blocking]
    victims = _signal(stale, run)
    ghost_pids = ghosts(snapshot, gpus)
    release = _release(snapshot, sorted(gpus), victims, ghost_pids, run)
    problems = []
    for gpu in sorted(gpus):
        dev = snapshot.device(gpu)
        entry = release.get(gpu)
        pids = [c.pid for c, _why in blocking if gpu in c.gpus] + [r['pid'] for r in run.out['refused'] if gpu in r['gpus']]
        pids += [v.pid for v in victims if v.outcome == 'failed' and gpu in v.record['gpus']]
        held = entry['unreleased_mib'] if entry is not None and not entry['released'] else 0
        if entry is None and ghost_pids.get(gpu):
            held = sum(mib or 0 for _pid, mib in ghost_pids[gpu])
            pids += [pid for pid, _mib in ghost_pids[gpu]]
        orphaned = dev.orphaned_mib if dev is not None and not victims else 0
        if pids or held or orphaned:
            used = dev.memory_used_mib if dev is not None and dev.memory_used_mib is not None else held + (orphaned or 0)
            problems.append((gpu, used, sorted(set(pids))))
    run.out['unreleased'] = [{'gpu': g, 'mib': mib, 'pids': pids} for g, mib, pids in problems]
    if not problems:
        return run.finish(EXIT_OK, victims)
    if options.dry_run:
        run.out['would_refuse'] = True
        return run.finish(EXIT_OK, victims)
    run.drain('gpufleet: %s before job %s' % ('; '.join('GPU %d holds %s MiB (pids %s)' % (
        g, mib, ','.join(str(p) for p in pids[:8]) or 'none') for g, mib, pids in problems), job.id))
    return run.finish(EXIT_ACT, victims)
