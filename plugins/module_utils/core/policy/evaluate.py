# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Evaluation: the violations of a policy in a snapshot (evaluate, evaluate_detailed).  Pure: it reads
the snapshot, the state's idle clocks and the Context, and changes nothing."""

from __future__ import annotations

import copy

from ..constants import ROGUE_LEVELS
from ..identity import UNKNOWN_OWNER
from ..idle import process_utilization
from ..model import gpu_units, unit_gpu
from ..units import human_duration
from .context import Context
from .idle_clocks import idle_rule
from .validation import _is_number
from .values import ACTION_TERMINATE
from .violations import (
    Violation, _describe, _fmt_mib, _gpus_of, _mib, fewest_by_count, fewest_by_size, fewest_for_gpus, proc_key)


class _Eval(object):
    """The state of one evaluation (caches for limits and exemptions)."""

    def __init__(self, policy, snapshot, state, now, context):
        self.policy = policy
        self.snapshot = snapshot
        self.state = state or {}
        self.now = now
        self.context = context
        self.exemptions = policy.active_exemptions(now)
        self._limits = {}
        self.notes = []

    def limits(self, user):
        if user not in self._limits:
            self._limits[user] = self.policy.limits_for(user, self.now, self.context)
        return self._limits[user]

    def exempt(self, proc, rule):
        for exemption in self.exemptions:
            if exemption.applies(proc, rule, self.context):
                return True
        return False

    def eligible(self, procs, rule):
        return [p for p in procs if not self.exempt(p, rule)]


def evaluate(policy, snapshot, state, now, context=None):
    """The violations of ``policy`` in ``snapshot`` at ``now`` (a list of Violation).  Pure."""
    return evaluate_detailed(policy, snapshot, state, now, context)[0]


def evaluate_detailed(policy, snapshot, state, now, context=None):
    """(violations, notes): notes explain what was left out (protected, unknown owner, ...)."""
    context = context if context is not None else Context()
    run = _Eval(policy, snapshot, state, now, context)
    if not policy.enabled:
        return [], ['the policy is disabled (enabled: false)']
    quota = []
    for proc in snapshot.processes:
        if not proc.found:
            run.notes.append('pid %d: not visible here; quota rules skip it' % proc.pid)
            continue
        if proc.user is None:
            # Never skipped: an owner that cannot be read (read twice) is charged to a pseudo-owner.
            run.notes.append('pid %d: owner unknown; charged to %s' % (proc.pid, UNKNOWN_OWNER))
            proc = copy.copy(proc)
            proc.user = UNKNOWN_OWNER
        why = policy.protect.reason(proc, policy, context)
        if why is not None:
            run.notes.append('pid %d (%s): %s; quota rules skip it' % (proc.pid, proc.user, why))
            continue
        quota.append(proc)
    by_user = {}
    for proc in quota:
        by_user.setdefault(proc.user, []).append(proc)
    violations = []
    for user in sorted(by_user):
        violations.extend(_user_rules(run, user, by_user[user]))
    violations.extend(_group_rules(run, by_user))
    violations.extend(_gpu_rules(run, quota))
    violations.extend(_rogue_rule(run))
    return violations, run.notes + [note for note in context.exe_cache.notes if note not in run.notes]


def _user_rules(run, user, procs):
    lim = run.limits(user)
    out = []
    action = lim.action
    # memory per GPU
    if lim.max_mem_mib_per_gpu is not None:   # per GPU, or per MIG device on a board in MIG mode (gpu_units)
        cand = run.eligible(procs, 'max_mem_per_gpu')
        for gpu in sorted(set(g for p in cand for g in gpu_units(p))):
            items = [(p, _mib(p, unit_gpu(gpu))) for p in cand if gpu in gpu_units(p)]
            total = sum(size for _p, size in items)
            if total > lim.max_mem_mib_per_gpu:
                chosen = fewest_by_size(items, lim.max_mem_mib_per_gpu)
                out.append(Violation('max_mem_per_gpu', 'user:%s' % user, total, lim.max_mem_mib_per_gpu, action,
                                     [p.pid for p in chosen], user=user, gpu=gpu, unit='MiB',
                                     message='%s uses %s on GPU %s, more than the %s allowed per GPU' % (
                                         user, _fmt_mib(total, lim.max_mem_mib_per_gpu), gpu, _fmt_mib(lim.max_mem_mib_per_gpu, total)),
                                     procs=[_describe(p, unit_gpu(gpu)) for p in chosen]))
    if lim.max_mem_mib_total is not None:
        cand = run.eligible(procs, 'max_mem_total')
        items = [(p, _mib(p)) for p in cand]
        total = sum(size for _p, size in items)
        if total > lim.max_mem_mib_total:
            chosen = fewest_by_size(items, lim.max_mem_mib_total)
            out.append(Violation('max_mem_total', 'user:%s' % user, total, lim.max_mem_mib_total, action,
                                 [p.pid for p in chosen], user=user, unit='MiB',
                                 message='%s uses %s of GPU memory in total, more than the %s allowed' % (
                                     user, _fmt_mib(total, lim.max_mem_mib_total), _fmt_mib(lim.max_mem_mib_total, total)),
                                 procs=[_describe(p) for p in chosen]))
    if lim.max_gpus is not None:
        cand = run.eligible(procs, 'max_gpus')
        held = set(g for p in cand for g in gpu_units(p))   # a MIG device counts as one GPU
        if len(held) > lim.max_gpus:
            chosen = fewest_for_gpus(cand, gpu_units, lim.max_gpus, _mib)
            out.append(Violation('max_gpus', 'user:%s' % user, len(held), lim.max_gpus, action, [p.pid for p in chosen],
                                 user=user, unit='GPUs',
                                 message='%s uses %d GPUs (%s), more than the %d allowed' % (
                                     user, len(held), ','.join(str(g) for g in sorted(held)), lim.max_gpus),
                                 procs=[_describe(p) for p in chosen]))
    if lim.max_procs is not None:
        cand = run.eligible(procs, 'max_procs')
        if len(cand) > lim.max_procs:
            chosen = fewest_by_count([(p, _mib(p)) for p in cand], lim.max_procs)
            out.append(Violation('max_procs', 'user:%s' % user, len(cand), lim.max_procs, action, [p.pid for p in chosen],
                                 user=user, unit='processes',
                                 message='%s runs %d GPU processes, more than the %d allowed' % (user, len(cand), lim.max_procs),
                                 procs=[_describe(p) for p in chosen]))
    if lim.max_procs_per_gpu is not None:
        cand = run.eligible(procs, 'max_procs_per_gpu')
        for gpu in sorted(set(g for p in cand for g in gpu_units(p))):
            on = [(p, _mib(p, unit_gpu(gpu))) for p in cand if gpu in gpu_units(p)]
            if len(on) > lim.max_procs_per_gpu:
                chosen = fewest_by_count(on, lim.max_procs_per_gpu)
                out.append(Violation('max_procs_per_gpu', 'user:%s' % user, len(on), lim.max_procs_per_gpu, action,
                                     [p.pid for p in chosen], user=user, gpu=gpu, unit='processes',
                                     message='%s runs %d processes on GPU %s, more than the %d allowed' % (
                                         user, len(on), gpu, lim.max_procs_per_gpu),
                                     procs=[_describe(p, unit_gpu(gpu)) for p in chosen]))
    if lim.max_runtime_s is not None:
        for proc in run.eligible(procs, 'max_runtime'):
            if proc.create_time is None:
                continue
            age = run.now - proc.create_time
            if age > lim.max_runtime_s:
                out.append(Violation('max_runtime', 'user:%s' % user, round(age, 1), lim.max_runtime_s, action, [proc.pid],
                                     user=user, unit='s',
                                     message='%s\'s process %d (%s) has run for %s, longer than the %s allowed' % (
                                         user, proc.pid, proc.name, human_duration(age), human_duration(lim.max_runtime_s)),
                                     procs=[_describe(proc)]))
    if lim.idle is not None:
        clocks = run.state.get('idle') or {}
        for proc in run.eligible(procs, 'idle'):
            clock = clocks.get(proc_key(proc))
            if not isinstance(clock, dict) or not _is_number(clock.get('since')):
                continue
            idle_for = run.now - clock['since']
            if idle_for < lim.idle.for_s:
                continue
            used = proc.used_mib
            if not idle_rule(run.policy, lim.idle).is_idle(process_utilization(proc, run.snapshot), used):
                continue  # the clock is stale: this snapshot shows activity
            out.append(Violation('idle', 'user:%s' % user, round(idle_for, 1), lim.idle.for_s, action, [proc.pid], user=user,
                                 unit='s', message='%s\'s process %d (%s) has held %s at <= %g%% utilization for %s '
                                                   '(idle limit %s)' % (user, proc.pid, proc.name, _fmt_mib(used),
                                                                        lim.idle.util_max_pct, human_duration(idle_for),
                                                                        human_duration(lim.idle.for_s)),
                                 procs=[_describe(proc)]))
    if lim.allowed_gpus is not None or lim.blocked_gpus is not None:
        for proc in run.eligible(procs, 'gpu_access'):
            bad = []
            for gpu, unit in zip(_gpus_of(proc), gpu_units(proc)):
                mig = (proc.mig_by_gpu or {}).get(gpu)  # on a MIG board: the board or that MIG device is named
                allowed = (lim.allowed_gpus is None or lim.allowed_gpus.text == ''
                           or lim.allowed_gpus.contains_index(gpu, run.snapshot, mig))
                blocked = (lim.blocked_gpus is not None and lim.blocked_gpus.text != ''
                           and lim.blocked_gpus.contains_index(gpu, run.snapshot, mig))
                if blocked or not allowed:
                    bad.append(unit)
            if bad:
                out.append(Violation('gpu_access', 'user:%s' % user, bad, (lim.allowed_gpus.text if lim.allowed_gpus else '*'),
                                     action, [proc.pid], user=user, unit='GPUs',
                                     message='%s\'s process %d uses GPU %s, which %s may not use' % (
                                         user, proc.pid, ','.join(str(g) for g in bad), user),
                                     procs=[_describe(proc)]))
    if lim.require_allocation and run.context.scheduler in ('slurm', 'kubernetes'):
        if run.context.scheduler == 'slurm' and run.context.allocation_error:
            note = 'require_allocation not evaluated: %s' % run.context.allocation_error
            if note not in run.notes:
                run.notes.append(note)
            return out
        for proc in run.eligible(procs, 'require_allocation'):
            owner = run.context.owner(proc)
            allocations = run.context.allocations
            job_gpus = run.context.job_gpus
            wrong = []
            if owner is not None and job_gpus is not None and owner.startswith('slurm:'):
                given = job_gpus.get(owner)
                wrong = sorted(_gpus_of(proc)) if given is None else [g for g in _gpus_of(proc) if g not in given]
            elif owner is not None and allocations is not None:
                wrong = [g for g in _gpus_of(proc) if g in allocations and owner not in allocations[g]]
            if owner is None or wrong:
                if owner is None:
                    why = 'runs outside any %s' % ('Slurm job' if run.context.scheduler == 'slurm' else 'pod')
                elif job_gpus is not None and owner.startswith('slurm:'):
                    given = job_gpus.get(owner)
                    why = 'uses GPU %s, which Slurm did not give its job %s (%s)' % (
                        ','.join(str(g) for g in wrong), owner[6:], 'the job is not active on this node' if given is None
                        else 'allocated GPUs: %s' % (','.join(str(g) for g in sorted(given)) or 'none'))
                else:
                    why = 'uses GPU %s, which is allocated to another job or pod' % ','.join(str(g) for g in wrong)
                out.append(Violation('require_allocation', 'user:%s' % user, owner or 'none', 'allocated', action, [proc.pid],
                                     user=user, unit='', message='%s\'s GPU process %d (%s) %s' % (user, proc.pid, proc.name, why),
                                     procs=[_describe(proc)]))
    return out


def _group_rules(run, by_user):
    out = []
    for group in run.policy.groups:
        if not group.aggregate or (group.expires is not None and run.now >= group.expires):
            continue
        members = [u for u in sorted(by_user) if run.policy.in_group(u, group.name, run.context)]
        procs = [p for u in members for p in by_user[u]]
        action = group.action or run.policy.defaults.get('action') or ACTION_TERMINATE
        subject = 'group:%s' % group.name
        limit = group.aggregate.get('group_max_mem_mib_total')
        if limit is not None:
            items = [(p, _mib(p)) for p in run.eligible(procs, 'group_max_mem_total')]
            total = sum(s for _p, s in items)
            if total > limit:
                chosen = fewest_by_size(items, limit)
                out.append(Violation('group_max_mem_total', subject, total, limit, action, [p.pid for p in chosen], unit='MiB',
                                     message='group %s uses %s of GPU memory, more than the %s allowed' % (
                                         group.name, _fmt_mib(total, limit), _fmt_mib(limit, total)),
                                     procs=[_describe(p) for p in chosen]))
        limit = group.aggregate.get('group_max_gpus')
        if limit is not None:
            cand = run.eligible(procs, 'group_max_gpus')
            held = set(g for p in cand for g in gpu_units(p))
            if len(held) > limit:
                chosen = fewest_for_gpus(cand, gpu_units, limit, _mib)
                out.append(Violation('group_max_gpus', subject, len(held), limit, action, [p.pid for p in chosen], unit='GPUs',
                                     message='group %s uses %d GPUs, more than the %d allowed' % (group.name, len(held), limit),
                                     procs=[_describe(p) for p in chosen]))
        limit = group.aggregate.get('group_max_procs')
        if limit is not None:
            cand = run.eligible(procs, 'group_max_procs')
            if len(cand) > limit:
                chosen = fewest_by_count([(p, _mib(p)) for p in cand], limit)
                out.append(Violation('group_max_procs', subject, len(cand), limit, action, [p.pid for p in chosen],
                                     unit='processes', message='group %s runs %d GPU processes, more than the %d allowed' % (
                                         group.name, len(cand), limit), procs=[_describe(p) for p in chosen]))
    for violation in out:
        users = sorted(set(p['user'] for p in violation.procs))
        violation.user = users[0] if len(users) == 1 else None
    return out


def _gpu_rules(run, quota):
    out = []
    default_action = run.policy.defaults.get('action') or ACTION_TERMINATE
    for rule in run.policy.gpus:
        action = rule.action or default_action
        for gpu, board in _rule_units(rule, run.snapshot):
            on = [p for p in quota if gpu in (_gpus_of(p) if gpu == board else gpu_units(p))]
            active = [w for w in rule.maintenance if w.contains(run.now)]
            if active:
                cand = run.eligible(on, 'maintenance')
                if cand:
                    label = active[0].label or active[0].describe()
                    out.append(Violation('maintenance', 'gpu:%s' % gpu, len(cand), 0, action, [p.pid for p in cand], gpu=gpu,
                                         unit='processes', message='GPU %s is in a maintenance window (%s)%s' % (
                                             gpu, label, ': ' + rule.message if rule.message else ''),
                                         procs=[_describe(p, board) for p in cand]))
            for rid, principals, reserved in (('gpu_reserved', rule.reserved_for, True),
                                              ('gpu_blocked_user', rule.blocked_users, False)):
                if principals is None:
                    continue
                by_user = {}
                for proc in run.eligible(on, rid):
                    member = principals.contains(proc.user, run.policy, run.context)
                    if member != reserved:
                        by_user.setdefault(proc.user, []).append(proc)
                for user in sorted(by_user):
                    cand = by_user[user]
                    why = ('reserved for %s' % ', '.join(principals.describe())) if reserved else 'blocked for %s' % user
                    out.append(Violation(rid, 'gpu:%s' % gpu, len(cand), 0, action, [p.pid for p in cand], user=user, gpu=gpu,
                                         unit='processes', message='GPU %s is %s; %s runs %d process(es) on it' % (
                                             gpu, why, user, len(cand)),
                                         procs=[_describe(p, board) for p in cand], key='%s|gpu:%s|user:%s' % (rid, gpu, user)))
            if rule.max_mem_mib_total is not None:
                listed = [p for p in run.snapshot.processes if gpu in (_gpus_of(p) if gpu == board else gpu_units(p))]
                total = sum(_mib(p, board) for p in listed)
                if total > rule.max_mem_mib_total:
                    cand = run.eligible(on, 'gpu_max_mem_total')
                    protected = total - sum(_mib(p, board) for p in cand)
                    chosen = fewest_by_size([(p, _mib(p, board)) for p in cand], max(0.0, rule.max_mem_mib_total - protected))
                    out.append(Violation('gpu_max_mem_total', 'gpu:%s' % gpu, total, rule.max_mem_mib_total, action,
                                         [p.pid for p in chosen], gpu=gpu, unit='MiB',
                                         message='GPU %s holds %s of process memory, more than the %s allowed on it' % (
                                             gpu, _fmt_mib(total, rule.max_mem_mib_total), _fmt_mib(rule.max_mem_mib_total, total)),
                                         procs=[_describe(p, board) for p in chosen]))
    return out


def _rule_units(rule, snapshot):
    """[(unit, GPU index)] a per-GPU rule covers: each GPU it names (all its processes, MIG devices included), and
    each MIG device it names by its ``MIG-`` UUID or ``GPU:GI[:CI]`` (the processes the driver lists on that MIG device)."""
    out = []
    for dev in snapshot.devices:
        if rule.gpus.contains(dev):
            out.append((dev.index, dev.index))
        for mig in rule.gpus.mig_devices(dev):
            out.append((mig.unit, dev.index))
    return out


def has_hard_indicator(finding):
    """True when a rogue finding rests on content or network evidence (a 'hard' rule fired)."""
    if not isinstance(finding, dict):
        return False
    for rule in finding.get('rules') or ():
        if isinstance(rule, dict) and rule.get('kind') == 'hard':
            return True
    points = finding.get('points')
    return isinstance(points, dict) and _is_number(points.get('hard')) and points.get('hard') > 0


def _rogue_rule(run):
    rogue = run.policy.rogue
    findings = run.context.rogue_findings
    if not rogue.enabled or not findings:
        return []
    out = []
    want = ROGUE_LEVELS.index(rogue.act_min_level)
    for pid in sorted(findings):
        finding = findings[pid]
        level = finding.get('level') if isinstance(finding, dict) else None
        if level not in ROGUE_LEVELS or ROGUE_LEVELS.index(level) < want or finding.get('allowlisted'):
            continue
        if not has_hard_indicator(finding):
            run.notes.append('pid %s: rogue level %s without a hard indicator: reported, never acted on' % (pid, level))
            continue
        proc = run.snapshot.process(pid)
        if proc is None or not proc.found:
            continue
        if run.exempt(proc, 'rogue'):
            continue
        rules = [r.get('id') for r in finding.get('rules') or () if isinstance(r, dict)]
        out.append(Violation('rogue', 'pid:%d' % pid, finding.get('score'), rogue.act_min_level, rogue.action, [pid],
                             user=proc.user, unit='score', kind='rogue', grace=rogue.grace,
                             message='process %d (%s, user %s) looks like a crypto-miner: level %s, score %s (%s)' % (
                                 pid, proc.name, proc.user, level, finding.get('score'), ', '.join(str(r) for r in rules[:6])),
                             procs=[_describe(proc)]))
    return out
