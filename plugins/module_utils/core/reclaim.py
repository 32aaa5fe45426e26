# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""One reclaim: snapshot -> selection -> protection -> signals -> verified release -> audit.

This is the single implementation behind gpu_kill, the reset drain and the guard's actions.
"""

from __future__ import annotations

import os
import signal as signals
import time

from . import audit_log, killer
from .idle import UtilizationHistory
from .processes import device_key, scan_device_fds
from .snapshot import DRM_RENDER_BASE, take_snapshot

SIGNALS = ('TERM', 'INT', 'HUP', 'QUIT', 'KILL', 'USR1', 'USR2')


def signal_number(name):
    return getattr(signals, 'SIG' + name)


class ReclaimOptions(object):
    """How to signal, and what to protect.  Validated by the caller's argument spec."""

    def __init__(self, signal='TERM', timeout=10.0, force=False, tree=True, release_timeout=15.0,
                 protect_names=killer.DEFAULT_PROTECT_NAMES, protect_users=(), vendor='auto',
                 audit_path=None, history_path=None, kill_timeout=5.0):
        self.signal = signal
        self.timeout = timeout
        self.force = force
        self.tree = tree
        self.release_timeout = release_timeout
        self.protect_names = protect_names
        self.protect_users = protect_users
        self.vendor = vendor
        self.audit_path = audit_path
        self.history_path = history_path
        self.kill_timeout = kill_timeout


def _describe(proc):
    return {'pid': proc.pid, 'user': proc.user, 'name': proc.name, 'cmdline': list(proc.cmdline or []),
            'gpu_indexes': list(getattr(proc, 'gpu_indexes', None) or []), 'used_mib': getattr(proc, 'used_mib', None)}


def _skip(proc, reason, extra=None):
    entry = _describe(proc)
    entry.update({'signals': [], 'seconds_to_exit': None, 'seconds_to_release': None, 'reason': reason})
    if extra:
        entry.update(extra)
    return entry


def plan(snapshot, selector, options, protection, idle_since=None):
    """Decide, without signalling: returns (victims, skipped entries)."""
    victims = []
    skipped = []
    chosen = set()
    for match in selector.select(snapshot, idle_since=idle_since):
        proc = match.proc
        info = killer.read_proc(proc.pid)
        if not match.orphan and proc.status == 'not_found':
            skipped.append(_skip(proc, 'the driver lists pid %d but it is not visible here (another PID namespace, '
                                       'such as a container without --pid=host); run this on the host' % proc.pid))
            continue
        if info is None or info.state in ('Z', 'X', 'x'):
            continue  # exited since the snapshot: nothing to do, not an error
        if proc.starttime is not None and info.starttime != proc.starttime:
            skipped.append(_skip(proc, 'pid %d was reused by another process since discovery' % proc.pid))
            continue
        if not match.orphan and getattr(proc, 'holds_gpu_device', None) is False:
            skipped.append(_skip(proc, 'pid %d here holds no GPU device file, so the driver\'s pid %d is probably a process '
                                       'in another PID namespace' % (proc.pid, proc.pid)))
            continue
        why = protection.reason(info)
        if why is not None:
            skipped.append(_skip(proc, why))
            continue
        record = _describe(proc)
        record['selected_because'] = match.reasons
        victims.append(killer.Victim(proc.pid, info.starttime, record=record))
        chosen.add(proc.pid)
    if options.tree and victims:
        parents = dict((v.pid, v) for v in victims)
        for pid in killer.children_of(sorted(parents)):
            if pid in chosen:
                continue
            info = killer.read_proc(pid)
            if info is None:
                continue
            parent = _root_of(pid, parents)
            record = {'pid': pid, 'user': protection.user_of_uid(info.uid) if info.uid is not None else None, 'name': info.comm,
                      'cmdline': [info.argv0] if info.argv0 else [], 'gpu_indexes': [], 'used_mib': None,
                      'selected_because': ['child of selected pid %s (tree)' % parent]}
            why = protection.reason(info)
            if why is not None:
                record.update({'signals': [], 'seconds_to_exit': None, 'seconds_to_release': None, 'reason': why})
                skipped.append(record)
                continue
            victims.append(killer.Victim(pid, info.starttime, record=record, parent=parent))
            chosen.add(pid)
    return victims, skipped


def _root_of(pid, parents):
    """The selected ancestor of ``pid`` (bounded walk up the parent chain)."""
    for ancestor in killer.ancestors(pid)[:64]:
        if ancestor in parents:
            return ancestor
    return None


def _driver_view(vendor):
    snap = take_snapshot(vendor=vendor, gather_processes=False)
    return dict((dev.index, (dev.memory_used_mib, set(dev.pids))) for dev in snap.all_devices)


def _expected_release(snapshot, victims):
    expected = {}
    for victim in victims:
        if victim.outcome != 'killed':
            continue
        proc = snapshot.process(victim.pid)
        if proc is None:
            continue
        for index in proc.gpu_indexes:
            dev = snapshot.device(index)
            entry = expected.setdefault(index, {'pids': set(), 'before_mib': dev.memory_used_mib if dev else None, 'held_mib': 0})
            entry['pids'].add(victim.pid)
            used = proc.used_mib_by_gpu.get(index)
            entry['held_mib'] = None if used is None or entry['held_mib'] is None else entry['held_mib'] + used
    return expected


def _unreleased_cause(index, snapshot, victims):
    """The likely reason memory on GPU ``index`` did not come back."""
    dev = snapshot.device(index)
    holders = []
    if dev is not None and dev.minor is not None:
        wanted = ('nvidia', dev.minor) if dev.vendor == 'nvidia' else ('renderD', DRM_RENDER_BASE + dev.minor)
        fd_holders = scan_device_fds(exclude=[os.getpid()])[0]
        holders = sorted(pid for pid, paths in fd_holders.items() if any(device_key(p) == wanted for p in paths))
    if holders:
        return 'process(es) %s still hold the GPU device (a child or a process outside the selection); kill them, or use tree=true' % (
            ', '.join(str(p) for p in holders[:10]))
    stuck = []
    for victim in victims:
        info = killer.read_proc(victim.pid)
        if info is not None and info.state == 'D':
            stuck.append(str(victim.pid))
    if stuck:
        return 'process(es) %s are stuck in D state inside the driver' % ', '.join(stuck)
    return 'no process holds the device any more: the driver kept the memory (a leak); gpufleet.reclaim.gpu_reset clears it'


def reclaim(selector, options, check_mode=False, snapshot=None, now=None):
    """Run one reclaim and return the result dictionary that gpu_kill returns."""
    started = time.monotonic()
    now = time.time() if now is None else now
    warnings = []
    if snapshot is None:
        snapshot = take_snapshot(vendor=options.vendor, gather_processes=True)
    idle_since = None
    if selector.idle_for is not None and options.history_path:
        history = UtilizationHistory(options.history_path).load().record(snapshot, now)
        if history.warning:
            warnings.append(history.warning)
        error = history.save()
        if error:
            warnings.append(error)
        idle_since = history.idle_since(snapshot, selector.idle_util_pct)
    protection = killer.Protection(protect_names=options.protect_names, protect_users=options.protect_users)
    victims, skipped = plan(snapshot, selector, options, protection, idle_since=idle_since)
    killer.terminate(victims, signum=signal_number(options.signal), timeout=options.timeout, force=options.force,
                     kill_timeout=options.kill_timeout, check_mode=check_mode)
    release = {}
    unreleased = []
    if not check_mode:
        expected = _expected_release(snapshot, victims)
        if expected:
            release = killer.wait_release(expected, lambda: _driver_view(options.vendor), timeout=options.release_timeout)
        for index, entry in sorted(release.items()):
            for victim in victims:
                proc = snapshot.process(victim.pid)
                if proc is not None and index in proc.gpu_indexes and entry['seconds'] is not None:
                    victim.release_seconds = max(victim.release_seconds or 0.0, entry['seconds'])
            if not entry['released']:
                unreleased.append({'gpu': index, 'unreleased_mib': entry['unreleased_mib'],
                                   'cause': _unreleased_cause(index, snapshot, victims)})
    killed = [v.as_result() for v in victims if v.outcome == 'killed']
    failed = [v.as_result() for v in victims if v.outcome == 'failed']
    skipped.extend(v.as_result() for v in victims if v.outcome == 'skipped')
    signalled = any(v.signals for v in victims) and not check_mode
    freed = dict((str(index), entry['freed_mib']) for index, entry in sorted(release.items()))
    result = {
        'changed': bool(signalled) or (check_mode and bool(killed)),
        'killed': killed,
        'skipped': skipped,
        'failed': failed,
        'freed_mib': freed,
        'unreleased': unreleased,
        'unreleased_mib': sum(u['unreleased_mib'] for u in unreleased),
        'seconds': round(time.monotonic() - started, 3),
        'warnings': warnings + list(snapshot.errors),
    }
    verb = 'would kill' if check_mode else 'killed'
    result['msg'] = '%s %d process(es), skipped %d, failed %d; freed %s MiB%s' % (
        verb, len(killed), len(skipped), len(failed), sum(v or 0 for v in freed.values()),
        '; %d MiB not released' % result['unreleased_mib'] if unreleased else '')
    if options.audit_path and (killed or failed) and not check_mode:
        try:
            audit_log.append(options.audit_path, {'event': 'gpu_kill', 'actor': audit_log.actor(), 'selectors': selector_summary(selector),
                                                  'killed': killed, 'failed': failed, 'skipped': skipped, 'freed_mib': freed,
                                                  'unreleased': unreleased})
        except audit_log.AuditLogError as exc:
            result['warnings'].append(str(exc))
    return result


def selector_summary(selector):
    out = {}
    for name in ('gpus', 'exclude_users', 'min_used_mib', 'idle_for', 'idle_util_pct', 'older_than', 'orphans', 'rogue',
                 'rogue_min_level', 'all_on_gpus'):
        out[name] = getattr(selector, name)
    out['pids'] = sorted(selector.pids) if selector.pids else None
    out['users'] = sorted(selector.users) if selector.users else None
    out['exclude_users'] = sorted(selector.exclude_users)
    out['name'] = selector.name.pattern if selector.name else None
    out['cmdline'] = selector.cmdline.pattern if selector.cmdline else None
    return out
