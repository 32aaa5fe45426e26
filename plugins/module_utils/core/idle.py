# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Sampled GPU utilization per process, kept between runs, for "idle for 30 minutes" decisions.

No driver keeps a per-process utilization history long enough to say that a process has been
idle for half an hour, so we keep one.  Every gpu_kill run with ``idle_for`` (check mode
included) appends one sample per GPU process to a small JSON file.  A process is idle since the oldest sample of the unbroken run of samples, ending
with the newest, whose utilization is at or below the threshold.  A process with no known
utilization, or whose history does not reach back far enough, is never called idle.

The per-process figure is the driver's own per-process utilization (NVML process utilization
samples; AMD engine usage) when it has one; otherwise the device's utilization when the process
is the only one on every GPU it uses; otherwise unknown.  Processes are keyed by (pid, starttime),
so a reused pid starts a new history.
"""

from __future__ import annotations

import fcntl
import json
import os

from . import safe_files
from .constants import UTILIZATION_PATH as DEFAULT_PATH

MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_SAMPLES = 720
MAX_AGE = 7 * 86400


def process_utilization(proc, snapshot):
    """The best per-process utilization figure (percent) for ``proc`` in ``snapshot``, or None."""
    value = getattr(proc, 'util_pct', None)
    if value is not None:
        return value
    figures = []
    for index in proc.gpu_indexes or ():
        dev = snapshot.device(index)
        if dev is None or dev.utilization_pct is None or len(dev.driver_processes) != 1:
            return None
        figures.append(dev.utilization_pct)
    return max(figures) if figures else None


def _valid_sample(sample):
    """A stored sample is ``[epoch seconds, percent or null]``; anything else is dropped on load."""
    if not isinstance(sample, list) or len(sample) != 2:
        return False
    stamp, util = sample
    number = (int, float)
    return (isinstance(stamp, number) and not isinstance(stamp, bool)
            and (util is None or (isinstance(util, number) and not isinstance(util, bool))))


class UtilizationHistory(object):
    """The sample file: ``{"version": 1, "processes": {"pid:starttime": [[ts, util], ...]}}``."""

    def __init__(self, path=DEFAULT_PATH):
        self.path = path
        self.samples = {}
        self.warning = None

    def load(self):
        try:
            data = json.loads(safe_files.read_file(self.path, MAX_FILE_BYTES).decode('utf-8'))
            procs = data.get('processes') if isinstance(data, dict) else None
            if not isinstance(procs, dict):
                raise ValueError('no "processes" object')
            self.samples = dict((k, [s for s in v if _valid_sample(s)]) for k, v in procs.items() if isinstance(v, list))
        except FileNotFoundError:
            self.samples = {}
        except (OSError, ValueError) as exc:
            self.samples = {}
            self.warning = 'utilization history %s was unreadable and has been restarted: %s' % (self.path, exc)
        return self

    def record(self, snapshot, now):
        """Add one sample per GPU process in ``snapshot``; forget processes that are gone."""
        live = {}
        for proc in snapshot.processes:
            if proc.starttime is None:
                continue
            key = '%d:%d' % (proc.pid, proc.starttime)
            series = [s for s in self.samples.get(key, []) if now - s[0] <= MAX_AGE]
            series.append([now, process_utilization(proc, snapshot)])
            live[key] = series[-MAX_SAMPLES:]
        self.samples = live
        return self

    def idle_since(self, snapshot, threshold_pct):
        """``{pid: time since which it has been at or below threshold_pct}`` for processes in ``snapshot``."""
        found = {}
        for proc in snapshot.processes:
            if proc.starttime is None:
                continue
            since = None
            for stamp, util in reversed(self.samples.get('%d:%d' % (proc.pid, proc.starttime), [])):
                if util is None or util > threshold_pct:
                    break
                since = stamp
            if since is not None:
                found[proc.pid] = since
        return found

    def update(self, snapshot, now):
        """Load, add one sample per GPU process, save: under an exclusive lock of ``<path>.lock``, so
        that two concurrent writers (two gpu_kill runs) never drop each other's samples.
        Returns a list of warnings (unreadable history, failed save)."""
        warnings = []
        lock = None
        try:
            lock = safe_files.open_lock(self.path + '.lock', dir_mode=0o750)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            warnings.append('could not lock utilization history %s: %s' % (self.path, exc))
        try:
            self.load().record(snapshot, now)
            if self.warning:
                warnings.append(self.warning)
            error = self.save()
            if error:
                warnings.append(error)
        finally:
            if lock is not None:
                os.close(lock)  # closing the descriptor releases the lock
        return warnings

    def save(self):
        """Write atomically (temp file and rename) with mode 0600; returns an error text or None."""
        try:
            safe_files.write_atomic(self.path, json.dumps({'version': 1, 'processes': self.samples}, separators=(',', ':')),
                                    mode=0o600, dir_mode=0o750)
        except (OSError, ValueError) as exc:
            return 'could not save utilization history %s: %s' % (self.path, exc)
        return None
