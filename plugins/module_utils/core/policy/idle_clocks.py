# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The idle clocks (observe): how long each process has held GPU memory without using the GPU,
kept in the agent's state between ticks."""

from __future__ import annotations

import copy

from ..idle import process_utilization
from .context import Context
from .validation import _is_number
from .violations import proc_key


def observe(policy, snapshot, state, now, context=None):
    """A copy of ``state`` with the idle clocks advanced by ``snapshot``.

    A process's clock starts when it is first seen at or below its idle utilization while holding at
    least the idle memory; any sample above the threshold, below the memory, with unknown
    utilization, or a gap of more than ``idle_max_gap`` between samples restarts it.
    """
    context = context if context is not None else Context()
    new = copy.deepcopy(state) if isinstance(state, dict) else {}
    old = new.get('idle') if isinstance(new.get('idle'), dict) else {}
    last = new.get('idle_sampled_at')
    gap = not _is_number(last) or now - last > policy.idle_max_gap_s or now < last
    clocks = {}
    limits = {}
    for proc in snapshot.processes:
        if not proc.found or proc.user is None or proc.starttime is None:
            continue
        if proc.user not in limits:
            limits[proc.user] = policy.limits_for(proc.user, now, context)
        rule = limits[proc.user].idle
        if rule is None:
            continue
        util = process_utilization(proc, snapshot)
        used = proc.used_mib
        if util is None or util > rule.util_max_pct or used is None or used < rule.mem_min_mib:
            continue
        key = proc_key(proc)
        previous = old.get(key)
        since = previous.get('since') if isinstance(previous, dict) and not gap else None
        clocks[key] = {'since': since if _is_number(since) and since <= now else now}
    new['idle'] = clocks
    new['idle_sampled_at'] = now
    return new
