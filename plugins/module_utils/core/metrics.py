# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Prometheus node_exporter textfile metrics of the guard, written atomically.

node_exporter's textfile collector reads ``*.prom`` files from its directory at every scrape, so
the file is written to a temporary name in the same directory and renamed over the old one: a
scrape never sees half a file (``safe_files.write_atomic``: no link followed, the temporary file
changed only through its descriptor).  The format is the Prometheus text exposition format 0.0.4.
"""

from __future__ import annotations

import math

from .constants import MODES, ROGUE_LEVELS
from .model import HEALTH_STATUSES, RECOVERY_ACTIONS
from .xid import classify

XID_HELP = ('Xid errors of the GPU the driver reported (kernel log and driver events: every one read), per Xid code and fault '
            'class (application, gpu, driver, system, unknown: core/xid.py)')
ROGUE_HELP = 'Processes the rogue detector found at each level in the last tick (allowlisted ones left out)'
UNTRUSTED_HELP = '1 when the last tick refused to act on untrusted input (a file or directory someone else could change)'


def _escape(value):
    return str(value).replace('\\', '\\\\').replace('\n', '\\n').replace('"', '\\"')


def _number(value):
    if value is None:
        return None
    if isinstance(value, bool):
        return '1' if value else '0'
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return 'NaN'
    if value in (float('inf'), float('-inf')):
        return '+Inf' if value > 0 else '-Inf'
    return repr(round(value, 6))


class Metrics(object):
    """Collects families (name, type, help, samples) and renders them in order."""

    def __init__(self):
        self.families = []
        self._by_name = {}

    def family(self, name, kind, text):
        if name not in self._by_name:
            entry = {'name': name, 'type': kind, 'help': text, 'samples': []}
            self._by_name[name] = entry
            self.families.append(entry)
        return self._by_name[name]

    def add(self, name, kind, text, value, labels=None):
        number = _number(value)
        if number is None:
            return
        family = self.family(name, kind, text)
        family['samples'].append((dict(labels or {}), number))

    def render(self):
        lines = []
        for family in self.families:
            # text format 0.0.4: the TYPE line names the samples, so a counter's is the _total name
            sample_name = family['name'] + ('_total' if family['type'] == 'counter' else '')
            lines.append('# HELP %s %s' % (sample_name, family['help'].replace('\\', '\\\\').replace('\n', ' ')))
            lines.append('# TYPE %s %s' % (sample_name, family['type']))
            for labels, number in family['samples']:
                if labels:
                    text = ','.join('%s="%s"' % (key, _escape(labels[key])) for key in sorted(labels))
                    lines.append('%s{%s} %s' % (sample_name, text, number))
                else:
                    lines.append('%s %s' % (sample_name, number))
        return '\n'.join(lines) + '\n'


def _health_metrics(out, dev, labels, reboot_flagged):
    """Health figures of one GPU: Xid errors by code, the driver's recovery action, whether a reboot is wanted
    (health says so, or the remediation ladder's reboot flag names the GPU: ``reboot_flagged``, GPU keys)."""
    if dev.xid_events is not None:
        out.family('gpufleet_gpu_xid_errors', 'gauge', XID_HELP)
    for code, number in sorted(dev.xid_code_counts().items()):
        out.add('gpufleet_gpu_xid_errors', 'gauge', XID_HELP, number, dict(labels, code=code, fault=classify(code)[1]))
    if dev.recovery_action is not None:
        for action in RECOVERY_ACTIONS:
            out.add('gpufleet_gpu_recovery_action', 'gauge', "The driver's GPU recovery action (1 for the current one)",
                    action == dev.recovery_action, dict(labels, action=action))
    out.add('gpufleet_gpu_reboot_wanted', 'gauge', '1 when only a reboot of the node can bring the GPU back (Xid 79, '
            'recovery action reboot, a reset that failed: the reboot flag names it)',
            dev.health.recommended_action == 'reboot' or dev.key in reboot_flagged, labels)
    out.add('gpufleet_gpu_health_status', 'gauge', 'GPU health: 0 ok, 1 degraded, 2 lost',
            HEALTH_STATUSES.index(dev.health.status), labels)


BUDGET_HELP = ('1 when the remediation ladder\'s budget (remediation.max_resets per GPU, one drain and one reboot flag per '
               'node per remediation.window, remediation.max_drained_pct of a Slurm partition) held a step in the last tick: '
               'a human decides')
HELD_HELP = 'The remediation steps the ladder\'s budget held in the last tick (1 each), per step and GPU (empty: the node\'s)'


def _budget_metrics(out, budget):
    """The ladder's budget of the last tick (the ladder's result ``budget``; None when the ladder did not run)."""
    if budget is None:
        return
    held = budget.get('exhausted') or []
    out.add('gpufleet_guard_remediation_budget_exhausted', 'gauge', BUDGET_HELP, bool(held))
    for entry in held:
        reason = 'partition' if str(entry.get('why', '')).startswith('partition_limit') else 'budget'
        out.add('gpufleet_guard_remediation_held', 'gauge', HELD_HELP, 1,
                {'step': entry.get('step') or '', 'gpu': '' if entry.get('gpu') is None else entry['gpu'], 'reason': reason})


def guard_metrics(snapshot=None, violations=(), counters=None, tick=None, mode=None, policy_valid=True,
                  enabled=True, host=None, reboot_flagged=(), untrusted=False, rogue_findings=None):
    """The Metrics of one tick: GPU and per-user memory, health, current violations, counters, tick info.
    ``reboot_flagged``: the keys of the GPUs the remediation ladder's reboot flag names (this boot's);
    ``untrusted``: the tick refused untrusted input; ``rogue_findings``: the rogue detector's findings (pid: finding)."""
    out = Metrics()
    counters = counters or {}
    if snapshot is not None:
        for dev in snapshot.devices:
            labels = {'gpu': dev.index, 'uuid': dev.uuid or '', 'name': dev.name or ''}
            out.add('gpufleet_gpu_memory_used_mib', 'gauge', 'GPU memory in use (MiB)', dev.memory_used_mib, labels)
            out.add('gpufleet_gpu_memory_total_mib', 'gauge', 'GPU memory in total (MiB)', dev.memory_total_mib, labels)
            out.add('gpufleet_gpu_utilization_percent', 'gauge', 'GPU utilization (percent)', dev.utilization_pct, labels)
            out.add('gpufleet_gpu_orphaned_memory_mib', 'gauge', 'GPU memory no listed process accounts for (MiB)',
                    dev.orphaned_mib, labels)
            _health_metrics(out, dev, labels, reboot_flagged)
        per_user = {}
        procs = {}
        for proc in snapshot.processes:
            user = proc.user if proc.user is not None else 'unknown'
            for gpu, used in (proc.used_mib_by_gpu or {}).items():
                key = (user, gpu)
                per_user[key] = per_user.get(key, 0) + (used or 0)
                procs[key] = procs.get(key, 0) + 1
        for (user, gpu) in sorted(per_user, key=lambda k: (k[0], k[1])):
            out.add('gpufleet_user_gpu_memory_mib', 'gauge', 'GPU memory used by a user on a GPU (MiB)',
                    per_user[(user, gpu)], {'user': user, 'gpu': gpu})
            out.add('gpufleet_user_gpu_processes', 'gauge', 'GPU processes of a user on a GPU', procs[(user, gpu)],
                    {'user': user, 'gpu': gpu})
    by_rule = {}
    for violation in violations:
        by_rule[violation.rule] = by_rule.get(violation.rule, 0) + 1
    out.family('gpufleet_guard_violations', 'gauge', 'Policy violations seen by the last tick, per rule')
    for rule in sorted(by_rule):
        out.add('gpufleet_guard_violations', 'gauge', 'Policy violations seen by the last tick, per rule', by_rule[rule],
                {'rule': rule})
    for name, key, text in (('gpufleet_guard_warnings', 'warnings', 'Warnings decided (sent, or logged in dry-run), per rule'),
                            ('gpufleet_guard_kills', 'kills', 'Processes the guard ended, per rule'),
                            ('gpufleet_guard_actions', 'actions', 'Actions decided (taken, or logged in dry-run/warn), per rule'),
                            ('gpufleet_guard_action_failures', 'failures', 'Processes an action could not end, per rule'),
                            ('gpufleet_guard_user_actions', 'user_actions', 'Actions decided (taken, or logged in dry-run/warn), per user'),
                            ('gpufleet_guard_notify_failures', 'notify_failures', 'Notifications that failed, per channel'),
                            ('gpufleet_guard_remediation_steps', 'remediation_steps',
                             'Remediation ladder steps carried out (kill, reset, drain, reboot flag, undrain), per step')):
        values = counters.get(key) or {}
        out.family(name, 'counter', text)
        label_name = {'notify_failures': 'channel', 'remediation_steps': 'step', 'user_actions': 'user'}.get(key, 'rule')
        for label in sorted(values):
            out.add(name, 'counter', text, values[label], {label_name: label})
    out.add('gpufleet_guard_ticks', 'counter', 'Guard ticks run since the state was created', counters.get('ticks', 0))
    out.add('gpufleet_guard_state_rebuilt', 'counter', 'Times the state file was missing or corrupt and rebuilt',
            counters.get('state_rebuilt', 0))
    tick = tick or {}
    out.add('gpufleet_guard_last_tick_timestamp_seconds', 'gauge', 'When the last tick ran (Unix time)', tick.get('time'))
    out.add('gpufleet_guard_tick_duration_seconds', 'gauge', 'Wall-clock duration of the last tick', tick.get('duration'))
    out.add('gpufleet_guard_tick_cpu_seconds', 'gauge', 'CPU time of the last tick', tick.get('cpu'))
    out.add('gpufleet_guard_unchecked_processes', 'gauge', 'Processes the last tick did not signal because the check of '
            'their open files ran out of its bound (more than one tick reads)', tick.get('unchecked') or 0)
    out.add('gpufleet_guard_policy_valid', 'gauge', '1 when the policy file was valid at the last tick', bool(policy_valid))
    out.add('gpufleet_guard_enabled', 'gauge', '1 when the policy is enabled', bool(enabled))
    out.add('gpufleet_guard_untrusted_input', 'gauge', UNTRUSTED_HELP, bool(untrusted))
    if rogue_findings is not None:
        levels = dict((level, 0) for level in ROGUE_LEVELS)
        for finding in rogue_findings.values():
            level = finding.get('level') if isinstance(finding, dict) else None
            if level in levels and not finding.get('allowlisted'):
                levels[level] += 1
        for level in ROGUE_LEVELS:
            out.add('gpufleet_guard_rogue_findings', 'gauge', ROGUE_HELP, levels[level], {'level': level})
    _budget_metrics(out, tick.get('ladder_budget'))
    hung = tick.get('driver_hung')
    out.add('gpufleet_guard_driver_hung', 'gauge', '1 when the last tick stopped a driver read that did not finish within '
            'driver_timeout', hung is not None, {'call': hung.get('call') or ''} if hung else None)
    out.add('gpufleet_guard_driver_crashed', 'gauge', '1 when the driver library crashed in the last tick',
            tick.get('driver_crashed') is not None)
    if mode:
        for name in MODES:
            out.add('gpufleet_guard_mode', 'gauge', 'The enforcement mode (1 for the active one)', name == mode, {'mode': name})
    return out
