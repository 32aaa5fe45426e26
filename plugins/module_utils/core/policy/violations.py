# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Violations, and the processes one names.

A violation of an over-limit rule (memory, GPU count, process count) names the FEWEST processes
whose termination brings the subject back under the limit: largest first, like the OOM killer,
ties broken by the newest process.  It never names every process of a user unless nothing less
brings the user under the limit.
"""

from __future__ import annotations

import itertools

from .sections import PER_PROCESS_RULES


class Violation(object):
    """One broken rule.  ``pids`` are the processes an action would end (``procs`` describes them,
    with the starttime that identifies each); ``measured`` and ``limit`` are in ``unit``."""

    def __init__(self, rule, subject, measured, limit, action, pids, user=None, gpu=None, unit='', message='',
                 procs=None, key=None, kind='quota', grace=None):
        self.rule = rule
        self.subject = subject
        self.measured = measured
        self.limit = limit
        self.action = action
        self.pids = list(pids)
        self.user = user
        self.gpu = gpu
        self.unit = unit
        self.message = message
        self.procs = list(procs or [])
        self.kind = kind
        self.grace = grace            # overrides the escalation's act_at (rogue)
        self.key = key or self._key()

    def _key(self):
        parts = [self.rule, self.subject]
        if self.gpu is not None:
            parts.append('gpu:%s' % self.gpu)
        if self.rule in PER_PROCESS_RULES and self.procs:
            parts.append('%s:%s' % (self.procs[0]['pid'], self.procs[0].get('starttime')))
        return '|'.join(str(p) for p in parts)

    def to_dict(self):
        return {'rule': self.rule, 'subject': self.subject, 'measured': self.measured, 'limit': self.limit,
                'unit': self.unit, 'action': self.action, 'pids': list(self.pids), 'user': self.user, 'gpu': self.gpu,
                'message': self.message, 'procs': [dict(p) for p in self.procs], 'key': self.key, 'kind': self.kind}

    def __repr__(self):
        return 'Violation(%s %s %s>%s pids=%s)' % (self.rule, self.subject, self.measured, self.limit, self.pids)


def proc_key(proc):
    return '%d:%s' % (proc.pid, proc.starttime)


def _describe(proc, gpu=None):
    used = proc.used_mib if gpu is None else proc.used_mib_by_gpu.get(gpu)
    return {'pid': proc.pid, 'starttime': proc.starttime, 'user': proc.user, 'uid': proc.uid, 'name': proc.name,
            'cmdline': list(proc.cmdline or [])[:64], 'used_mib': used, 'gpu_indexes': list(proc.gpu_indexes or []),
            'create_time': proc.create_time}


def _mib(proc, gpu=None):
    if gpu is None:
        known = [v for v in (proc.used_mib_by_gpu or {}).values() if v is not None]
        return sum(known) if known else (proc.used_mib or 0)
    return proc.used_mib_by_gpu.get(gpu) or 0


def _order(items):
    """Largest first (like the OOM killer); ties: the newest process first, then the higher pid."""
    return sorted(items, key=lambda item: (-item[1], -(item[0].create_time or 0.0), -item[0].pid))


def fewest_by_size(items, limit):
    """``items``: [(proc, size)].  The fewest processes whose removal brings the total to <= limit,
    largest first (ties: newest).  Taking the largest first is also the smallest such set."""
    total = sum(size for _proc, size in items)
    chosen = []
    for proc, size in _order(items):
        if total <= limit:
            break
        if size <= 0:
            break
        chosen.append(proc)
        total -= size
    return chosen


def fewest_by_count(items, limit):
    """Enough processes (largest first, ties newest) to leave at most ``limit`` of them."""
    excess = len(items) - limit
    return [proc for proc, _size in _order(items)[:max(0, excess)]]


def fewest_for_gpus(procs, gpus_of, limit, size_of):
    """The fewest processes whose end leaves the user on at most ``limit`` GPUs.

    A GPU is freed only when every process on it ends.  Exact for up to 16 GPUs (fewest processes,
    then the most memory freed, then the newest); greedy beyond.
    """
    held = sorted(set(g for p in procs for g in gpus_of(p)))
    excess = len(held) - limit
    if excess <= 0:
        return []
    # every process's size, creation time and GPUs once: the exact search below tries up to
    # C(16, 8) subsets of GPUs, and each subset only unites precomputed pid sets
    by_pid = dict((p.pid, p) for p in procs)
    size = dict((p.pid, size_of(p)) for p in procs)
    created = dict((p.pid, p.create_time or 0.0) for p in procs)
    gpus = dict((p.pid, gpus_of(p)) for p in procs)
    on = dict((g, frozenset(pid for pid in by_pid if g in gpus[pid])) for g in held)

    def cost(subset):
        pids = frozenset().union(*[on[gpu] for gpu in subset])
        freed = sum(size[pid] for pid in pids)
        newest = max([created[pid] for pid in pids] or [0.0])
        return (len(pids), -freed, -newest), pids

    best = None
    combos = itertools.combinations(held, excess)
    if len(held) <= 16:
        for subset in combos:
            score, pids = cost(subset)
            if best is None or score < best[0]:
                best = (score, pids)
    else:
        remaining = list(held)
        subset = []
        for _step in range(excess):
            remaining.sort(key=lambda g: (len(on[g]), -sum(size[pid] for pid in on[g])))
            subset.append(remaining.pop(0))
        best = cost(subset)
    return [proc for proc, _size in _order([(by_pid[pid], size[pid]) for pid in best[1]])]


def _gpus_of(proc):
    return list(proc.gpu_indexes or [])


def _fmt_mib(value, other=None):
    """A size for people; with ``other`` (the size it is compared with), precise enough to show that
    they differ (19.5 GiB against 19.5 GiB would hide it: then MiB, or MiB with decimals)."""
    if value is None:
        return 'unknown'
    text = '%.1f GiB' % (value / 1024.0) if value >= 1024 else '%d MiB' % value
    if other is None or value == other or text != _fmt_mib(other):
        return text
    for digits in (0, 3):
        text = '%.*f MiB' % (digits, value)
        if text != '%.*f MiB' % (digits, other):
            return text
    return text
