# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The one idleness rule: since when a process has held GPU memory without using the GPU.

No driver keeps a per-process utilization history long enough to say that a process has been
idle for half an hour, so the usage history (``history.py``, SQLite, written by every guard tick
and by every gpu_kill run with ``idle_for``) keeps the samples, and this module decides from them.
Three callers, one rule, their own parameters:

* gpu_kill ``idle_for``: ``IdleRule(idle_util_pct)`` (no memory floor, no gap limit: runs are minutes
  or hours apart);
* the guard's policy rule ``idle``: ``IdleRule(util_max_pct, mem_min_mib, idle_max_gap)``;
* the usage reports' idle GPU-hours (``history.report``): ``IdleRule(idle_util_pct, REPORT_MEM_MIN_MIB)``,
  one sample at a time (``IdleRule.sql``).

A sample is idle when its utilization is known and at or below ``util_max_pct`` and, where the rule
has a floor, the process holds at least ``mem_min_mib``.  A process is idle since the oldest sample
of the unbroken run of idle samples that ends with the newest one; a sample that is not idle, or a
gap longer than ``max_gap_s`` between two samples, ends the run.  Processes are keyed by
(pid, starttime), so a reused pid starts a new run.

The per-process figure is the driver's own per-process utilization (NVML process utilization
samples; AMD engine usage) when it has one; otherwise the device's utilization when the process
is the only one on every GPU it uses; otherwise unknown (``gpu_utilization``, ``process_utilization``).
"""

from __future__ import annotations

import itertools

from .units import is_number

REPORT_MEM_MIN_MIB = 1  # the reports: a GPU counts as held when a process holds any memory on it


def gpu_utilization(proc, dev):
    """Utilization (percent) of ``proc`` on the GPU ``dev``: the driver's own per-process figure,
    else the GPU's when the process is alone on it, else None."""
    value = getattr(proc, 'util_pct', None)
    if value is not None:
        return value
    if dev is None or dev.utilization_pct is None or len(dev.driver_processes) != 1:
        return None
    return dev.utilization_pct


def process_utilization(proc, snapshot):
    """The best per-process utilization figure (percent) for ``proc`` in ``snapshot``, or None:
    ``gpu_utilization`` on each of its GPUs, the highest; None when one of them is unknown."""
    value = getattr(proc, 'util_pct', None)
    if value is not None:
        return value
    figures = [gpu_utilization(proc, snapshot.device(index)) for index in proc.gpu_indexes or ()]
    return max(figures) if figures and None not in figures else None


class IdleRule(object):
    """One caller's parameters of the idleness rule (see the module's docstring)."""

    def __init__(self, util_max_pct, mem_min_mib=None, max_gap_s=None):
        self.util_max_pct = util_max_pct
        self.mem_min_mib = mem_min_mib
        self.max_gap_s = max_gap_s

    def is_idle(self, util_pct, used_mib):
        """Whether one sample is idle (None: unknown, never idle)."""
        if util_pct is None or util_pct > self.util_max_pct:
            return False
        return self.mem_min_mib is None or (used_mib is not None and used_mib >= self.mem_min_mib)

    def since(self, samples):
        """The time since which the samples are idle, or None.  ``samples``: ``(ts, util_pct, used_mib)``,
        newest first (it is read only as far back as the run goes)."""
        since = None
        for stamp, util, used in samples:
            if not is_number(stamp) or not self.is_idle(util, used):
                break
            if since is not None and (stamp > since or (self.max_gap_s is not None and since - stamp > self.max_gap_s)):
                break
            since = stamp
        return since

    def sql(self, util, used):
        """``is_idle`` as an SQL expression over the column expressions ``util`` and ``used`` (NULL:
        unknown), with its parameters, for the reports that classify samples in the database."""
        text = '(%s IS NOT NULL AND %s <= ?' % (util, util)
        params = [self.util_max_pct]
        if self.mem_min_mib is not None:
            text += ' AND %s IS NOT NULL AND %s >= ?' % (used, used)
            params.append(self.mem_min_mib)
        return text + ')', params


def idle_since(rule, proc, snapshot, now, samples=None):
    """When ``proc`` (in ``snapshot``, taken at ``now``) has been idle since under ``rule``, or None.

    The snapshot is the newest sample; ``samples`` (a history.SampleStore or HistoryReader, or None:
    the snapshot alone) gives the process's earlier ones."""
    current = ((now, process_utilization(proc, snapshot), proc.used_mib),)
    older = () if samples is None or proc.starttime is None else samples.process_samples(proc.pid, proc.starttime, now)
    return rule.since(itertools.chain(current, older))


def idle_pids(rule, snapshot, now, samples=None):
    """``{pid: since}``: ``idle_since`` for every process of ``snapshot`` with a known start time
    that is idle at all (gpu_kill's ``idle_for``: the selector then asks for how long)."""
    found = {}
    for proc in snapshot.processes:
        since = idle_since(rule, proc, snapshot, now, samples) if proc.starttime is not None else None
        if since is not None:
            found[proc.pid] = since
    return found
