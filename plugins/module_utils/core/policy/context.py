# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Host lookups for evaluation (Context): Unix group membership (pwd/grp), executable hashes, the
node's scheduler and the GPU allocations file.  Tests pass plain data instead."""

from __future__ import annotations

import json
import re

from .. import safe_files
from ..exe_hash import ExeHashes
from ..processes import scheduler_daemon
from ..slurm import SlurmClient, SlurmError, host_gpus, node_name


class Context(object):
    """What evaluation needs besides the snapshot, as plain data or live lookups.

    groups: {user: [group names]} (None: the host's Unix groups).  scheduler: 'slurm', 'kubernetes'
    or None (the node allocates GPUs through them; 'auto' detects slurmd/kubelet).  allocations:
    {gpu index: set of owner ids ('slurm:<job>' or 'pod:<uid>')} or None when unknown.
    rogue_findings: {pid: finding} from core.rogue, or None.  exe_hashes: {pid: sha256} (None: hash
    /proc/PID/exe through ``exe_cache``, an exe_hash.ExeHashes, when an exemption asks for a hash).
    job_gpus: {'slurm:<job>': set of GPU indexes} of the jobs active on this node, from Slurm itself
    (``slurm_allocations``); job_pids: {pid: job id} from slurmstepd (``scontrol listpids``);
    allocation_error: why Slurm could not be asked (``require_allocation`` then does not fire).
    """

    def __init__(self, groups=None, scheduler=None, allocations=None, rogue_findings=None, exe_hashes=None,
                 proc_root='/proc', exe_cache=None, job_gpus=None, job_pids=None, allocation_error=None):
        self._groups = groups
        self._group_cache = {}
        self.scheduler = scheduler
        self.allocations = allocations
        self.rogue_findings = rogue_findings
        self._exe_hashes = exe_hashes
        self.exe_cache = exe_cache if exe_cache is not None else ExeHashes(proc_root=proc_root)
        self.proc_root = proc_root
        self.job_gpus = job_gpus
        self.job_pids = job_pids or {}
        self.allocation_error = allocation_error
        if scheduler == 'auto':
            self.scheduler = detect_scheduler(proc_root)

    def groups_of(self, user):
        if user is None:
            return ()
        if self._groups is not None:
            return tuple(self._groups.get(user, ()))
        if user not in self._group_cache:
            self._group_cache[user] = _unix_groups(user)
        return self._group_cache[user]

    def owner(self, proc):
        """'slurm:<job>' or 'pod:<uid>' that vouches for ``proc``: its root-owned cgroup, else slurmstepd's pid list."""
        if proc.slurm_job:
            return 'slurm:%s' % proc.slurm_job
        if proc.container is not None and proc.container.pod_uid:
            return 'pod:%s' % proc.container.pod_uid
        job = self.job_pids.get(proc.pid)
        return 'slurm:%s' % job if job is not None else None

    def exe_sha256(self, proc):
        if self._exe_hashes is not None:
            return self._exe_hashes.get(proc.pid)
        return self.exe_cache.sha256(proc.pid, proc.starttime)


_ALL_GROUPS = None


def _unix_groups(user):
    global _ALL_GROUPS  # pylint: disable=global-statement
    names = []
    try:
        import grp  # pylint: disable=import-outside-toplevel
        import pwd  # pylint: disable=import-outside-toplevel
    except ImportError:
        return ()
    try:
        gid = pwd.getpwnam(user).pw_gid
        names.append(grp.getgrgid(gid).gr_name)
    except (KeyError, OverflowError):
        pass
    if _ALL_GROUPS is None:
        try:
            _ALL_GROUPS = [(g.gr_name, frozenset(g.gr_mem)) for g in grp.getgrall()]
        except OSError:
            _ALL_GROUPS = []
    names.extend(name for name, members in _ALL_GROUPS if user in members and name not in names)
    return tuple(names)


def detect_scheduler(proc_root='/proc'):
    """'slurm' or 'kubernetes' when root runs slurmd or kubelet here (never a name alone: processes.scheduler_daemon), else None."""
    return {'slurmd': 'slurm', 'kubelet': 'kubernetes'}.get(scheduler_daemon(proc_root))


MAX_ALLOCATIONS_BYTES = 16 * 1024 * 1024


def read_allocations(path):
    """``{gpu index: set of owners}`` from an allocations file written by a Slurm prolog or a device
    plugin hook: ``{"gpus": {"0": ["slurm:123"], "1": ["pod:<uid>"]}}``.  None when absent, unreadable or
    unsafe (a link, or a file or directory someone else than root could change: safe_files)."""
    try:
        data = json.loads(safe_files.read_file(path, MAX_ALLOCATIONS_BYTES).decode('utf-8'))
        gpus = data.get('gpus') if isinstance(data, dict) else None
        if not isinstance(gpus, dict):
            return None
        out = {}
        for key, owners in gpus.items():
            if re.match(r'^\d+$', str(key)) and isinstance(owners, list):
                out[int(key)] = set(str(o) for o in owners)
        return out
    except (OSError, ValueError):
        return None


def slurm_allocations(client=None, node=None, snapshot=None):
    """What Slurm says about this node, as Context keywords: ``job_gpus`` ({'slurm:<job>': GPU indexes} of the jobs
    active here, GRES indexes as the snapshot's GPU indexes: slurm.host_gpus), ``job_pids`` (``scontrol listpids``) and ``allocations`` (the same per
    GPU); or ``allocation_error`` naming why Slurm could not be asked.  One squeue and one scontrol, each bounded
    (slurm.SlurmClient)."""
    client = client or SlurmClient()
    node = node or node_name()
    try:
        jobs = client.jobs(node)
        pids = client.listpids()
    except SlurmError as exc:
        return {'allocation_error': 'Slurm could not be asked about node %s: %s' % (node, exc)}
    job_gpus, allocations = {}, {}
    for job in jobs.values():
        if not job.active:
            continue
        owner = 'slurm:%s' % job.id
        gpus = host_gpus(job.gpus, snapshot) if snapshot is not None else list(job.gpus or ())
        job_gpus[owner] = set(gpus)
        for gpu in gpus:
            allocations.setdefault(gpu, set()).add(owner)
    return {'job_gpus': job_gpus, 'job_pids': pids, 'allocations': allocations}
