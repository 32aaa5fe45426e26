# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Selectors over a snapshot: which GPU processes a reclaim is about.

A process is selected when it matches *every* selector given.  ``gpus`` and ``exclude_users``
only narrow a selection; at least one of the other selectors must be given, so that no call ever
means "everything".  To empty whole GPUs, say so with ``all_on_gpus: true``.

Validation happens in ``Selector.__init__`` before anything is looked at, and raises
InvalidArgument naming the field and the value.
"""

from __future__ import annotations

import time

from .constants import ROGUE_LEVELS
from .errors import InvalidArgument, MissingArgument
from .snapshot import resolve_gpu_targets
from .textmatch import MAX_MATCH_TEXT, bounded_search, compile_regex
# the bounded-regex helpers and the duration formatter live in textmatch and units; importable from here too
# (a test that shortens the match time bound sets textmatch.MATCH_TIMEOUT_S: the copy here is not read)
from .textmatch import MATCH_TIMEOUT_S, MAX_PATTERN, bounded_sub  # pylint: disable=unused-import
from .units import human_duration, parse_duration

PRIMARY = ('pids', 'users', 'name', 'cmdline', 'min_used_mib', 'idle_for', 'older_than', 'orphans', 'rogue', 'all_on_gpus')


def _given(value):
    """A selector counts as given unless it is None, False or empty (0 MiB is a given minimum)."""
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple, set, dict, str)) and not value:
        return False
    return True


class Match(object):
    """A selected process: the snapshot's GpuProcess or Holder, and why it was selected."""

    def __init__(self, proc, reasons, orphan=False):
        self.proc = proc
        self.reasons = reasons
        self.orphan = orphan


class Selector(object):
    """Validated selection criteria (the gpu_kill selectors)."""

    def __init__(self, pids=None, gpus=None, users=None, exclude_users=None, name=None, cmdline=None,
                 min_used_mib=None, idle_for=None, idle_util_pct=5, older_than=None, orphans=False,
                 rogue=False, rogue_min_level='critical', all_on_gpus=False, rogue_detector=None):
        given = dict(pids=pids, users=users, name=name, cmdline=cmdline, min_used_mib=min_used_mib, idle_for=idle_for,
                     older_than=older_than, orphans=orphans, rogue=rogue, all_on_gpus=all_on_gpus)
        if not any(_given(value) for value in given.values()):
            raise MissingArgument('selectors', 'no process is selected: give at least one of %s; gpus and exclude_users only narrow '
                                  'a selection, and all_on_gpus=true empties whole GPUs' % ', '.join(PRIMARY))
        self.pids = None
        if pids:
            self.pids = set()
            for pid in pids:
                try:
                    number = int(pid)
                except (TypeError, ValueError):
                    raise InvalidArgument('pids', pid, 'a pid is a positive whole number')
                if number <= 0 or isinstance(pid, bool):
                    raise InvalidArgument('pids', pid, 'a pid is a positive whole number')
                self.pids.add(number)
        self.gpus = list(gpus) if gpus else None
        if all_on_gpus and not self.gpus:
            raise InvalidArgument('all_on_gpus', all_on_gpus, 'name the GPUs to empty with gpus')
        self.all_on_gpus = bool(all_on_gpus)
        self.users = set(users) if users else None
        self.exclude_users = set(exclude_users or ())
        self.name = compile_regex('name', name) if name else None
        self.cmdline = compile_regex('cmdline', cmdline) if cmdline else None
        if min_used_mib is not None and (isinstance(min_used_mib, bool) or not isinstance(min_used_mib, (int, float)) or min_used_mib < 0):
            raise InvalidArgument('min_used_mib', min_used_mib, 'expected a number of MiB, 0 or more')
        self.min_used_mib = min_used_mib
        self.idle_for = parse_duration(idle_for, 'idle_for') if idle_for not in (None, '') else None
        if isinstance(idle_util_pct, bool) or not isinstance(idle_util_pct, (int, float)) or not 0 <= idle_util_pct <= 100:
            raise InvalidArgument('idle_util_pct', idle_util_pct, 'expected a percentage from 0 to 100')
        self.idle_util_pct = idle_util_pct
        self.older_than = parse_duration(older_than, 'older_than') if older_than not in (None, '') else None
        self.orphans = bool(orphans)
        if rogue_min_level not in ROGUE_LEVELS:
            raise InvalidArgument('rogue_min_level', rogue_min_level, 'expected one of %s' % ', '.join(ROGUE_LEVELS))
        self.rogue_min_level = rogue_min_level
        self.rogue = bool(rogue)
        if self.rogue and rogue_detector is None:
            raise InvalidArgument('rogue', rogue, 'the rogue detector is not available in this version; '
                                  'select by name, cmdline, users or pids instead')
        self.rogue_detector = rogue_detector

    def gpu_indexes(self, snapshot):
        """Host-wide indexes of the GPUs named in ``gpus`` (None when not given); a MIG device names its board.

        Raises InvalidArgument naming the first value that matches no GPU of ``snapshot``.
        """
        targets = self.gpu_targets(snapshot)
        return None if targets is None else set(targets)

    def gpu_targets(self, snapshot):
        """{host-wide index: None (the whole GPU) or the units (``GPU:GI``) of the MIG devices named on it}, None when ``gpus``
        is not given.  Raises InvalidArgument naming the first value that matches no GPU of ``snapshot``."""
        if not self.gpus:
            return None
        return dict((dev.index, None if migs is None else set(m.unit for m in migs))
                    for dev, migs in resolve_gpu_targets(snapshot.all_devices, self.gpus))

    def select(self, snapshot, idle_since=None, now=None):
        """The Matches in ``snapshot`` (GpuProcess entries, or Holders when orphans=true).

        ``idle_since`` maps a pid to the time since which it has been idle (see idle.py), or is None.
        """
        now = time.time() if now is None else now
        gpu_indexes = self.gpu_targets(snapshot)
        rogue_findings = {}
        if self.rogue:
            rogue_findings = self.rogue_detector(snapshot, self.rogue_min_level)
        matches = []
        # orphans=true is a property like any other selector: only holders the driver does not list have it.
        if self.orphans:
            candidates = [(holder, True) for holder in snapshot.holders]
        else:
            candidates = [(proc, False) for proc in snapshot.processes]
        for proc, is_holder in candidates:
            reasons = self._match(proc, is_holder, gpu_indexes, idle_since, now, rogue_findings)
            if reasons is not None:
                matches.append(Match(proc, reasons, orphan=is_holder))
        return matches

    def _match(self, proc, is_holder, gpu_indexes, idle_since, now, rogue_findings):
        reasons = []
        if is_holder:
            reasons.append('holds %s but the driver does not list it (orphan)' % ', '.join(proc.devices))
        if self.pids is not None:
            if proc.pid not in self.pids:
                return None
            reasons.append('pid %d requested' % proc.pid)
        if gpu_indexes is not None:
            on = _on_targets(proc, gpu_indexes)
            if not on:
                return None
            if self.all_on_gpus:
                reasons.append('on GPU %s (all_on_gpus)' % ','.join(str(i) for i in sorted(on)))
        if self.users is not None:
            if proc.user not in self.users:
                return None
            reasons.append('user %s' % proc.user)
        if proc.user in self.exclude_users:
            return None
        if self.name is not None:
            if proc.name is None or not bounded_search(self.name, proc.name, 'name'):
                return None
            reasons.append('name %s matches %s' % (proc.name, self.name.pattern))
        if self.cmdline is not None:
            text = ' '.join(proc.cmdline or ())[:MAX_MATCH_TEXT]
            if not proc.cmdline or not bounded_search(self.cmdline, text, 'cmdline'):
                return None
            reasons.append('command line matches %s' % self.cmdline.pattern)
        used = getattr(proc, 'used_mib', None)
        if self.min_used_mib is not None:
            if used is None or used < self.min_used_mib:
                return None
            reasons.append('uses %s MiB (>= %s)' % (used, self.min_used_mib))
        if self.older_than is not None:
            if proc.create_time is None or now - proc.create_time < self.older_than:
                return None
            reasons.append('running for %s' % human_duration(now - proc.create_time))
        if self.idle_for is not None:
            since = (idle_since or {}).get(proc.pid)
            if since is None or now - since < self.idle_for or not used:
                return None
            reasons.append('idle (<= %s%% utilization) for %s holding %s MiB' % (self.idle_util_pct, human_duration(now - since), used))
        if self.rogue:
            finding = rogue_findings.get(proc.pid)
            if finding is None:
                return None
            reasons.append('rogue: %s (score %s)' % (finding.get('level'), finding.get('score')))
        return reasons


def _on_targets(proc, targets):
    """Where ``proc`` is among ``targets`` (see Selector.gpu_targets): GPU indexes, or the MIG units of the named MIG
    devices it runs on.  A process on a board whose MIG devices were named counts only when the driver lists it on
    one of them (a holder has no MIG device: it never matches a MIG device)."""
    on = []
    mig_by_gpu = getattr(proc, 'mig_by_gpu', None) or {}
    for index in proc.gpu_indexes or ():
        if index not in targets:
            continue
        if targets[index] is None:
            on.append(index)
            continue
        mig = mig_by_gpu.get(index)
        if mig is not None and mig.unit in targets[index]:
            on.append(mig.unit)
    return on


_human = human_duration  # the name rogue imports
