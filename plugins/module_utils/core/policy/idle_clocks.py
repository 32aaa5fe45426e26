# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The idle clocks (observe): since when each process has held GPU memory without using the GPU,
derived at every tick by the idleness rule (``idle.py``) from the usage history's samples."""

from __future__ import annotations

import copy

from ..idle import IdleRule, idle_since
from .context import Context
from .violations import proc_key


def idle_rule(policy, limits):
    """The idleness rule of one user's ``idle`` limits (``util_max_pct``, ``mem_min_mib``) and the
    policy's ``idle_max_gap``."""
    return IdleRule(limits.util_max_pct, limits.mem_min_mib, policy.idle_max_gap_s)


def observe(policy, snapshot, state, now, context=None, samples=None):
    """A copy of ``state`` with ``state['idle']`` = ``{proc_key: {'since': t}}``, the idle clocks.

    ``snapshot`` (taken at ``now``) is the newest sample; ``samples`` (a history.SampleStore or
    HistoryReader; None: the snapshot alone) gives the earlier ones.  A process's clock runs from the
    oldest sample of its unbroken run of samples at or below its idle utilization while holding at
    least the idle memory; a sample above the threshold, below the memory, with unknown utilization,
    or a gap of more than ``idle_max_gap`` between samples restarts it.  The clocks are derived, not
    kept: the guard does not save them.
    """
    context = context if context is not None else Context()
    new = copy.deepcopy(state) if isinstance(state, dict) else {}
    new.pop('idle_sampled_at', None)  # kept by earlier releases
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
        since = idle_since(idle_rule(policy, rule), proc, snapshot, now, samples)
        if since is not None:
            clocks[proc_key(proc)] = {'since': since}
    new['idle'] = clocks
    return new
