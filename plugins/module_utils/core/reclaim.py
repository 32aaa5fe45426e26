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

import math
import os
import signal as signals
import time

from . import audit_log, blast, fdwalk, killer, notify, watchdog
from .backends import VENDORS, select as select_backends, vendor_backend
from .errors import HistoryError, InvalidArgument
from .fdwalk import FdBudget, incomplete_text
from .processes import check_device_holding, device_key, resolve_dev_roots, scan_device_fds, user_uid
from .snapshot import device_gpus, take_snapshot

SIGNALS = ('TERM', 'INT', 'HUP', 'QUIT', 'KILL', 'USR1', 'USR2')
EVENT = 'gpu_kill'


def signal_number(name):
    return getattr(signals, 'SIG' + name)


def _seconds(field, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidArgument(field, value, 'expected a number of seconds')
    if value < 0:
        raise InvalidArgument(field, value, 'must not be negative')
    return float(value)


def _optional_path(field, value):
    """An absolute path, or None for '', 'none' or None (the file is then not used)."""
    if value is None or str(value).strip().lower() in ('', 'none', 'null'):
        return None
    if not os.path.isabs(value):
        raise InvalidArgument(field, value, 'expected an absolute path on the node (or an empty value to disable it)')
    return value


class ReclaimOptions(object):
    """How to signal, and what to protect.  Raises InvalidArgument naming the field for a bad value."""

    def __init__(self, signal='TERM', timeout=10.0, force=False, tree=True, release_timeout=15.0,
                 protect_names=killer.DEFAULT_PROTECT_NAMES, protect_users=(), vendor='auto',
                 audit_path=None, history_path=None, kill_timeout=5.0, audit_field='audit_log',
                 history_field='utilization_history', redact_patterns=None, driver_timeout=None, max_kills=None):
        if signal not in SIGNALS:
            raise InvalidArgument('signal', signal, 'expected one of %s' % ', '.join(SIGNALS))
        self.signal = signal
        self.timeout = _seconds('timeout', timeout)
        self.force = bool(force)
        self.tree = bool(tree)
        self.release_timeout = _seconds('release_timeout', release_timeout)
        self.kill_timeout = _seconds('kill_timeout', kill_timeout)
        self.protect_names = tuple(protect_names or ())
        self.protect_users = tuple(protect_users or ())
        self.vendor = vendor
        self.audit_path = _optional_path(audit_field, audit_path)
        self.history_path = _optional_path(history_field, history_path)
        # the snapshot's driver reads run in a watchdog child with this deadline (None: in this process)
        self.driver_timeout = watchdog.check_timeout('driver_timeout', driver_timeout)
        # the command lines in the result and the audit records (notify.redact_argv): the policy's, or the defaults
        self.redact_patterns = notify.default_patterns() if redact_patterns is None else list(redact_patterns)
        # at most this many processes signalled (the blast-radius limit's share of this node: core/blast.py)
        if max_kills is not None and (isinstance(max_kills, bool) or not isinstance(max_kills, int) or max_kills < 0):
            raise InvalidArgument('max_kills', max_kills, 'expected a whole number of processes, 0 or more')
        self.max_kills = max_kills

    def summary(self):
        return {'signal': self.signal, 'timeout': self.timeout, 'force': self.force, 'tree': self.tree,
                'release_timeout': self.release_timeout}


def _describe(proc):
    return {'pid': proc.pid, 'user': proc.user, 'name': proc.name, 'cmdline': list(proc.cmdline or []),
            'gpu_indexes': list(getattr(proc, 'gpu_indexes', None) or []), 'used_mib': getattr(proc, 'used_mib', None)}


def _skip(record, reason):
    entry = dict(record)
    entry.update({'signals': [], 'seconds_to_exit': None, 'seconds_to_release': None, 'reason': reason})
    return entry


class Plan(object):
    """What plan() decided: ``victims`` (killer.Victim, some already ``killed`` because they exited by
    themselves), ``skipped`` result entries, the children of the victims left alone (tree=false), and
    the requests that led nowhere (``unmatched``: see unmatched_requests)."""

    def __init__(self):
        self.victims = []
        self.skipped = []
        self.left_children = []
        self.unmatched = []
        self.unchecked = None   # the listed processes whose open files the check before signalling left (FdBudget.incomplete)

    @property
    def would_signal(self):
        return [victim for victim in self.victims if victim.outcome is None]


def plan(snapshot, selector, options, protection, idle_since=None, now=None, proc_root='/proc', dev_roots=None):
    """Decide, without signalling: selection, then identity and protection for each match."""
    result = Plan()
    chosen = {}
    fd_check = FdBudget(descriptors=fdwalk.VICTIM_DESCRIPTORS, seconds=None)   # the listed processes whose files the snapshot did not read
    matches = selector.select(snapshot, idle_since=idle_since, now=now)
    result.unmatched = unmatched_requests(snapshot, selector, matches, protection, proc_root)
    for match in matches:
        proc = match.proc
        record = _describe(proc)
        record['selected_because'] = match.reasons
        if not match.orphan and not proc.found:
            result.skipped.append(_skip(record, 'the driver lists pid %d but it is not visible here (another PID namespace, '
                                                'such as a container without --pid=host): not signalled; run this on the '
                                                'host' % proc.pid))
            continue
        info = killer.read_proc(proc.pid, proc_root)
        if info is None or info.dead:
            # Exited between the snapshot and now: gone, which is what was wanted; nothing is signalled.
            victim = killer.Victim(proc.pid, proc.starttime, record=record)
            victim.outcome, victim.exit_seconds = 'killed', 0.0
            victim.reason = 'exited by itself before it was signalled'
            result.victims.append(victim)
            continue
        if proc.starttime is not None and info.starttime != proc.starttime:
            result.skipped.append(_skip(record, 'pid %d was reused by another process since discovery: not signalled' % proc.pid))
            continue
        if getattr(proc, 'identity', None) is not None and proc.uid is not None and info.uid != proc.uid:
            # selected as one user's (users=, a quota) but another uid owns it now (setuid, or unreadable)
            result.skipped.append(_skip(record, 'pid %d was selected as uid %d\'s but is now owned by uid %s: not signalled' % (
                proc.pid, proc.uid, 'unknown' if info.uid is None else info.uid)))
            continue
        if not match.orphan and proc.device_paths is None and check_device_holding([proc], proc_root, dev_roots, fd_check):
            result.skipped.append(_skip(record, 'pid %d holds more open files than this run reads (%d in all, the first '
                                                'processes\' whole tables first): whether it holds a GPU device file here '
                                                '(and so is the driver\'s pid %d, not another PID namespace\'s) is not known: '
                                                'not signalled in this run' % (proc.pid, fd_check.limit, proc.pid)))
            continue
        if not match.orphan and getattr(proc, 'holds_gpu_device', None) is False:
            result.skipped.append(_skip(record, 'pid %d here holds no GPU device file, so the driver\'s pid %d is probably a '
                                                'process in another PID namespace: not signalled' % (proc.pid, proc.pid)))
            continue
        why = protection.reason(info)
        if why is not None:
            result.skipped.append(_skip(record, why))
            continue
        victim = killer.Victim(proc.pid, info.starttime, record=record)
        result.victims.append(victim)
        chosen[proc.pid] = victim
    result.unchecked = fd_check.incomplete()
    live = [pid for pid, victim in chosen.items() if victim.outcome is None]
    if not live:
        return result
    # Children are collected before the first signal: once a parent dies they are reparented.
    children = killer.children_of(sorted(live), proc_root)
    held = scan_device_fds(proc_root, dev_roots, pids=children)[0] if options.tree else {}
    for pid in children:
        if pid in chosen:
            continue
        info = killer.read_proc(pid, proc_root)
        if info is None or info.dead:
            continue
        if not options.tree:
            result.left_children.append(pid)
            continue
        parent = _selected_ancestor(pid, chosen, proc_root)
        known = snapshot.process(pid)
        if known is not None:
            record = _describe(known)
        else:
            user = protection.user_of_uid(info.uid) if info.uid is not None else None
            gpus = device_gpus(held.get(pid, ()), snapshot.all_devices, resolve_dev_roots(dev_roots))
            record = {'pid': pid, 'user': user, 'name': info.comm, 'cmdline': list(info.cmdline or []), 'gpu_indexes': gpus,
                      'used_mib': None}
        record['selected_because'] = ['child of selected pid %s (tree)' % parent]
        why = protection.reason(info)
        if why is None and record['user'] in selector.exclude_users:
            why = 'user %s is in exclude_users' % record['user']
        if why is not None:
            result.skipped.append(_skip(record, why))
            continue
        victim = killer.Victim(pid, info.starttime, record=record, parent=parent)
        result.victims.append(victim)
        chosen[pid] = victim
    return result


def unmatched_requests(snapshot, selector, matches, protection, proc_root='/proc'):
    """Each requested pid or user that selected nothing, with why; and the selection as a whole when
    it matched nothing at all.  Entries: ``{'request': 'pid'|'user'|'selection', 'value', 'reason',
    'warn'}``; ``warn`` is true for a request that names something absent from this node (a pid that
    does not exist, a user this node does not know), which the modules report as a warning.  A user
    who exists but has no GPU process here is no warning: across a fleet that is the common case."""
    out = []
    matched_pids = set(match.proc.pid for match in matches)
    listed = dict((proc.pid, proc) for proc in snapshot.processes)
    holders = set(holder.pid for holder in snapshot.holders)
    for pid in sorted(selector.pids or ()):
        if pid in matched_pids:
            continue
        info = killer.read_proc(pid, proc_root)
        if pid in listed:
            reason = 'pid %d is a GPU process here, but it does not match the other selectors' % pid
            warn = False
        elif info is None or info.dead:
            reason, warn = 'no process with pid %d exists here (it has exited, or never existed)' % pid, True
        else:
            why = protection.reason(info)
            if pid in holders:
                reason = ('pid %d holds a GPU device file that the driver does not list (an orphan): select it with '
                          'orphans=true' % pid)
            else:
                reason = 'pid %d is not a GPU process: the driver does not list it and it holds no GPU device file' % pid
            if why is not None:
                reason += '; it is also protected (%s)' % why
            warn = True
        out.append({'request': 'pid', 'value': pid, 'reason': reason, 'warn': warn})
    matched_users = set(match.proc.user for match in matches)
    for user in sorted(selector.users or ()):
        if user in matched_users:
            continue
        if user_uid(user) is None:
            out.append({'request': 'user', 'value': user, 'warn': True,
                        'reason': 'no user %s exists on this node (checked with the system user database)' % user})
        elif any(proc.user == user for proc in snapshot.processes):
            out.append({'request': 'user', 'value': user, 'warn': False,
                        'reason': 'user %s has GPU processes here, but none matches the other selectors' % user})
        else:
            out.append({'request': 'user', 'value': user, 'warn': False, 'reason': 'user %s has no GPU process here' % user})
    if not matches and not out:
        out.append({'request': 'selection', 'value': selector_summary(selector), 'warn': False,
                    'reason': 'no GPU process here matches every selector given'})
    return out


def _selected_ancestor(pid, chosen, proc_root):
    """The nearest selected ancestor of ``pid`` (bounded walk up the parent chain)."""
    for ancestor in killer.ancestors(pid, proc_root, limit=64):
        if ancestor in chosen:
            return ancestor
    return None


class DriverProbe(object):
    """``probe()`` for killer.wait_release: used MiB and listed pids per host-wide GPU index.

    One library session stays open for the whole wait (initialising NVML can take long on real
    hosts) and each read asks only for the memory and process lists of the GPUs ``gpus`` (host-wide
    indexes; None: every GPU of ``snapshot``).  Only the backends of those GPUs' vendors are opened
    (``vendor`` still limits them): with vendor=auto the others would be imported and probed again for
    nothing.
    """

    def __init__(self, vendor, snapshot, mig_instances=None, gpus=None):
        wanted = [dev for dev in snapshot.all_devices if gpus is None or dev.index in gpus]
        present = set(dev.vendor for dev in wanted)
        self.selections = [select_backends(name) for name in VENDORS if name in present and vendor in ('auto', name)]
        self.index = dict(((dev.vendor, dev.vendor_index), dev.index) for dev in wanted)
        # vendor -> the vendor indexes each poll reads
        self.vendor_indexes = {}
        for dev in wanted:
            self.vendor_indexes.setdefault(dev.vendor, set()).add(dev.vendor_index)
        # GPU index -> {(GPU instance id, compute instance id)}: boards whose reading is that of these MIG devices
        self.mig_instances = dict(mig_instances or {})
        # the backends with such a board: each poll reads their devices whole (the MIG devices' lists)
        self.whole = set(name for (name, _vi), index in self.index.items() if index in self.mig_instances)

    def __call__(self):
        view = {}
        for backend in [backend for selection in self.selections for backend in selection.backends]:
            try:
                if backend.name in self.whole:
                    readings = dict((dev.vendor_index, self._reading(dev)) for dev in backend.devices())
                else:
                    readings = backend.memory_view(self.vendor_indexes.get(backend.name, set()))
            except Exception:  # pylint: disable=broad-except
                continue  # unknown: wait_release keeps waiting for these GPUs
            for vendor_index, reading in readings.items():
                key = self.index.get((backend.name, vendor_index))
                if key is not None:
                    view[key] = reading
        return view

    def _reading(self, dev):
        """(used MiB, listed pids) of a board, or of its MIG devices in ``mig_instances`` (their sums: each MIG device's
        memory and process list are readable where the board's are not, as non-root)."""
        wanted = self.mig_instances.get(self.index.get((dev.vendor, dev.vendor_index)))
        if not wanted:
            return dev.memory_used_mib, set(dev.pids) if dev.processes_complete else None
        migs = [m for m in dev.mig_devices or () if (m.gpu_instance_id, m.compute_instance_id) in wanted]
        if len(migs) != len(wanted):
            return None, None  # an instance is gone or unreadable: nothing can be confirmed
        used = None if any(m.memory_used_mib is None for m in migs) else sum(m.memory_used_mib for m in migs)
        listed = None if not all(m.processes_complete for m in migs) else set(p for m in migs for p in m.pids)
        return used, listed

    def close(self):
        for selection in self.selections:
            selection.close()


def _expected_release(snapshot, victims):
    """Per GPU: the pids that must leave the driver's lists and the MiB that must come back.

    A listed process contributes its own figure.  Orphans (holders the driver does not list) are
    what the GPU's unattributed (orphaned) memory consists of, so killing them must bring that back.
    On a board in MIG mode whose killed processes all ran on known MIG devices, the entry waits on
    those MIG devices (``mig_instances``: {(GPU instance id, compute instance id)}; ``before_mib``
    their memory): a MIG device's memory is readable where the board's is not (non-root).
    """
    expected = {}

    def entry_for(index):
        dev = snapshot.device(index)
        return expected.setdefault(index, {'pids': set(), 'before_mib': dev.memory_used_mib if dev else None,
                                           'held_mib': 0, 'orphaned': False, 'mig_instances': set()})

    for victim in victims:
        if victim.outcome != 'killed':
            continue
        proc = snapshot.process(victim.pid)
        if proc is not None:
            for index in proc.gpu_indexes:
                entry = entry_for(index)
                entry['pids'].add(victim.pid)
                mig = (proc.mig_by_gpu or {}).get(index)
                if entry['mig_instances'] is not None:
                    entry['mig_instances'] = None if mig is None else entry['mig_instances'] | {
                        (mig.gpu_instance_id, mig.compute_instance_id)}
                used = proc.used_mib_by_gpu.get(index)
                entry['held_mib'] = None if used is None or entry['held_mib'] is None else entry['held_mib'] + used
            continue
        holder = snapshot.holder(victim.pid)
        if holder is None or victim.parent is not None:
            continue  # a tree child shares its parent's memory, which the parent's figure already counts
        for index in holder.gpu_indexes:
            entry = entry_for(index)
            entry['mig_instances'] = None  # a holder is on the board, on no MIG device: the board's figures tell
            if entry['orphaned']:
                continue
            entry['orphaned'] = True
            dev = snapshot.device(index)
            orphaned = dev.orphaned_mib if dev is not None else None
            entry['held_mib'] = None if orphaned is None or entry['held_mib'] is None else entry['held_mib'] + orphaned
    for index, entry in expected.items():
        entry.pop('orphaned')
        if not entry['mig_instances']:
            entry.pop('mig_instances')
            continue
        migs = [m for m in getattr(snapshot.device(index), 'mig_devices', None) or ()
                if (m.gpu_instance_id, m.compute_instance_id) in entry['mig_instances']]
        entry['before_mib'] = None if any(m.memory_used_mib is None for m in migs) else sum(m.memory_used_mib for m in migs)
    return expected


def _unreleased_cause(index, snapshot, victims, dev_roots, left_children, mig_instances=None):
    """The likely reason memory on GPU ``index`` did not come back (on the MIG devices ``mig_instances`` of it, when
    the wait read those: a process the driver listed on another MIG device of the board does not hold their memory)."""
    dev = snapshot.device(index)
    holders = []
    fds_denied = 0
    budget = FdBudget()
    if dev is not None and dev.minor is not None:
        wanted = vendor_backend(dev.vendor).device_keys(dev.minor)[:1]   # the node compute clients open
        fd_holders, _readable, fds_denied = scan_device_fds(dev_roots=dev_roots, exclude=[os.getpid()], budget=budget)
        others = [m for m in dev.mig_devices or () if mig_instances and (m.gpu_instance_id, m.compute_instance_id) not in mig_instances]
        elsewhere = set(pid for m in others for pid in m.pids)
        holders = sorted(pid for pid, paths in fd_holders.items()
                         if pid not in elsewhere and any(device_key(p, dev_roots) in wanted for p in paths))
    unread = budget.incomplete()
    if holders:
        children = [pid for pid in holders if pid in left_children]
        if children:
            return ('child process(es) %s of a killed process still hold the GPU device (tree=false left them running); '
                    'kill them too, or use tree=true' % ', '.join(str(p) for p in children[:10]))
        return ('process(es) %s still hold the GPU device (outside the selection, or started meanwhile); '
                'select them too' % ', '.join(str(p) for p in holders[:10]))
    stuck = []
    for victim in victims:
        info = killer.read_proc(victim.pid)
        if info is not None and info.state == 'D':
            stuck.append(str(victim.pid))
    if stuck:
        return 'process(es) %s are stuck in D state inside the driver; a GPU reset or a reboot may be needed' % ', '.join(stuck)
    if unread is not None:
        return ('no process whose open files were read holds the GPU device, but %s; otherwise the driver kept the memory '
                '(a leak), which gpufleet.reclaim.gpu_reset clears' % incomplete_text(unread))
    if fds_denied:
        return ('no process whose open files could be read holds the GPU device (%d process(es) could not be checked; '
                'run as root to check every one); otherwise the driver kept the memory (a leak), which '
                'gpufleet.reclaim.gpu_reset clears' % fds_denied)
    return ('no process holds the GPU device any more: the driver kept the memory (a leak, or a slow release); '
            'gpufleet.reclaim.gpu_reset clears it')


SIGNALLED_EVENT = 'gpu_kill_signalled'


def signalled_record(victims):
    """Who was signalled so far, without command lines (the guard's log is redacted).  ``outcome`` is
    ``pending`` for a process that had not exited yet (the run's own record says how it ended)."""
    out = []
    for victim in victims:
        if not victim.signals:
            continue
        entry = {'pid': victim.pid, 'starttime': victim.starttime, 'signals': list(victim.signals),
                 'outcome': victim.outcome or 'pending', 'user': victim.record.get('user'), 'name': victim.record.get('name'),
                 'gpu_indexes': list(victim.record.get('gpu_indexes') or [])}
        if victim.parent is not None:
            entry['parent_pid'] = victim.parent
        out.append(entry)
    return out


def _journal_signals(head, options, victims, on_signalled, warnings):
    """Record the first signals as soon as they are sent (killer.terminate's ``on_sent``).

    The run may end before its own record: killed while it waits for the processes to exit (a
    dropped SSH session hangs it up), or by a vendor library that crashes (SIGSEGV) during the
    release check; the signals already sent must be on record anyway.  ``head``: the record's fields
    that the signals do not change (event, actor, selectors, options), made before the first signal
    so that only the append is left between the signals and their record.
    """
    signalled = signalled_record(victims)
    if options.audit_path:
        try:
            audit_log.append(options.audit_path, dict(head, signalled=signalled))
        except audit_log.AuditLogError as exc:
            warnings.append(str(exc))
    if on_signalled is not None:
        on_signalled(signalled)


def _idle_since(selector, options, snapshot, now, warnings):
    """``{pid: since}`` for ``selector.idle_for``: one sample of ``snapshot`` recorded in the usage
    history (check mode included), then the idleness rule over each process's samples, with
    ``idle_util_pct`` and neither a memory floor (the selector's ``min_used_mib`` is one) nor a gap
    limit (runs may be hours apart).  A history that cannot be opened or written is a warning: the
    snapshot alone is then the only sample, and nothing has been idle for long.

    The usage history (sqlite3) and the idleness rule are imported here, for idle_for only: the
    other calls (most of them: rogue=true, pids, users) do not compile them."""
    from . import history  # pylint: disable=import-outside-toplevel
    from .idle import IdleRule, idle_pids  # pylint: disable=import-outside-toplevel
    rule = IdleRule(selector.idle_util_pct)
    store = None
    try:
        store = history.SampleStore(options.history_path)
        store.record(snapshot, now, patterns=options.redact_patterns)
    except HistoryError as exc:
        warnings.append('could not record a utilization sample in %s: %s' % (options.history_path, exc))
    try:
        return idle_pids(rule, snapshot, now, store)
    finally:
        if store is not None:
            warnings.extend(store.problems)
            store.close()


def reclaim(selector, options, check_mode=False, snapshot=None, now=None, dev_roots=None, on_signalled=None):
    """Run one reclaim and return the result dictionary that gpu_kill returns.

    Everything that can be invalid (GPUs named in the selector, options) is checked before any
    signal.  ``snapshot`` and ``dev_roots`` are test seams (device roots default to
    processes.DEFAULT_DEV_ROOTS, read at call time).  Right after the first signals (before waiting
    for the processes to exit and before the release check queries the driver again) a
    ``gpu_kill_signalled`` record goes to the audit log and ``on_signalled(entries)`` is called, so
    that a run that dies afterwards (hung up, or a vendor library crash) cannot lose the record of
    what was signalled.
    """
    started = time.monotonic()
    now = time.time() if now is None else now
    dev_roots = resolve_dev_roots(dev_roots)
    warnings = []
    if selector.idle_for is not None and not options.history_path:
        raise InvalidArgument('utilization_history', options.history_path, 'idle_for needs the usage history file')
    if snapshot is None:
        # Holders (every process's open files) are needed to find orphans, and for rogue=true to see
        # what gpu_audit sees (its findings include holders the driver does not list).
        snapshot = take_snapshot(vendor=options.vendor, gather_processes=True, dev_roots=dev_roots,
                                 scan_holders=selector.orphans or selector.rogue, driver_timeout=options.driver_timeout)
    selector.gpu_indexes(snapshot)  # an unknown GPU fails here, before anything is recorded or signalled
    idle_since = _idle_since(selector, options, snapshot, now, warnings) if selector.idle_for is not None else None
    protection = killer.Protection(protect_names=options.protect_names, protect_users=options.protect_users)
    decided = plan(snapshot, selector, options, protection, idle_since=idle_since, now=now, dev_roots=dev_roots)
    victims = decided.victims
    _hold_past(victims, options.max_kills)
    would_signal = len(decided.would_signal)
    head = {'event': SIGNALLED_EVENT, 'actor': audit_log.actor(), 'selectors': selector_summary(selector),
            'options': options.summary()} if options.audit_path else None
    killer.terminate(victims, signum=signal_number(options.signal), timeout=options.timeout, force=options.force,
                     kill_timeout=options.kill_timeout, check_mode=check_mode,
                     on_sent=lambda sent: _journal_signals(head, options, sent, on_signalled, warnings))
    release = {}
    unreleased = []
    if not check_mode:
        expected = _expected_release(snapshot, victims)
        if expected:
            probe = DriverProbe(options.vendor, snapshot, dict((index, entry['mig_instances']) for index, entry in expected.items()
                                                               if 'mig_instances' in entry), gpus=set(expected))
            try:
                release = killer.wait_release(expected, probe, timeout=options.release_timeout)
            finally:
                probe.close()
        for index, entry in sorted(release.items()):
            for victim in victims:
                proc = snapshot.process(victim.pid)
                on_gpu = proc is not None and index in proc.gpu_indexes
                on_gpu = on_gpu or index in victim.record.get('gpu_indexes', ())
                if on_gpu and entry['seconds'] is not None and victim.outcome == 'killed':
                    victim.release_seconds = max(victim.release_seconds or 0.0, entry['seconds'])
            if not entry['released']:
                entry['cause'] = _unreleased_cause(index, snapshot, victims, dev_roots, decided.left_children,
                                                   expected[index].get('mig_instances'))
                unreleased.append({'gpu': index, 'unreleased_mib': entry['unreleased_mib'], 'cause': entry['cause']})
    killed = [v.as_result() for v in victims if v.outcome == 'killed']
    failed = [v.as_result() for v in victims if v.outcome == 'failed']
    skipped = decided.skipped + [v.as_result() for v in victims if v.outcome == 'skipped']
    held = [v.as_result() for v in victims if v.outcome == 'held']
    for entry in killed + failed + skipped + held:  # the result goes to the audit log and to the caller's output
        entry['cmdline'] = notify.redact_argv(entry.get('cmdline'), options.redact_patterns)
    signalled = not check_mode and any(v.signals for v in victims)
    freed = dict((str(index), entry['freed_mib']) for index, entry in sorted(release.items()))
    result = {
        'changed': signalled or (check_mode and would_signal > 0),
        'killed': killed,
        'skipped': skipped,
        'failed': failed,
        'held': held,
        'freed_mib': freed,
        'release': dict((str(index), {'released': entry['released'], 'freed_mib': entry['freed_mib'],
                                      'seconds': entry['seconds'], 'unreleased_mib': entry['unreleased_mib']})
                        for index, entry in sorted(release.items())),
        'unreleased': unreleased,
        'unreleased_mib': sum(u['unreleased_mib'] for u in unreleased),
        'unmatched': [dict((k, v) for k, v in entry.items() if k != 'warn') for entry in decided.unmatched],
        'unchecked': decided.unchecked,
        'seconds': round(time.monotonic() - started, 3),
        'warnings': warnings + list(snapshot.errors) + [entry['reason'] for entry in decided.unmatched if entry['warn']],
    }
    result['msg'] = _message(check_mode, killed, skipped, failed, freed, unreleased, decided.unmatched)
    if held:
        result['msg'] += '; %d held by max_kills=%d (the blast-radius limit)' % (len(held), options.max_kills)
    if options.audit_path and signalled:
        try:
            audit_log.append(options.audit_path, dict(head, event=EVENT, killed=killed, failed=failed, skipped=skipped,
                                                      freed_mib=freed, unreleased=unreleased, msg=result['msg']))
        except audit_log.AuditLogError as exc:
            result['warnings'].append(str(exc))
    return result


def _hold_past(victims, max_kills):
    """Past ``max_kills`` processes to signal, the rest are held (outcome ``held``; terminate leaves them alone): whole
    families in the one kill order (core/blast.kill_families), the fleet limit's own order."""
    if max_kills is None:
        return
    pending = dict((v.pid, v) for v in victims if v.outcome is None)
    entries = [{'pid': v.pid, 'used_mib': v.record.get('used_mib'), 'parent_pid': v.parent} for v in pending.values()]
    _taken, held = blast.take_families(blast.kill_families(entries), max_kills)
    for entry in held:
        victim = pending[entry['pid']]
        victim.outcome = 'held'
        victim.reason = '%s (max_kills=%d on this node in this run)' % (blast.HELD, max_kills)


def _message(check_mode, killed, skipped, failed, freed, unreleased=(), unmatched=()):
    if check_mode:
        text = 'would kill %d process(es), skip %d; nothing was signalled (check mode)' % (len(killed), len(skipped))
    else:
        text = 'killed %d process(es), skipped %d, failed %d; freed %d MiB' % (
            len(killed), len(skipped), len(failed), sum(v or 0 for v in freed.values()))
    unreleased_mib = sum(u['unreleased_mib'] for u in unreleased)
    unconfirmed = [str(u['gpu']) for u in unreleased if not u['unreleased_mib']]
    if unreleased_mib and not check_mode:
        text += '; %d MiB not released' % unreleased_mib
    if unconfirmed and not check_mode:  # the memory reads free, but the driver's process list could not be read
        text += '; release not confirmed on GPU %s' % ','.join(unconfirmed)
    if unmatched:
        text += '; %d request(s) led nowhere: %s' % (len(unmatched), '; '.join(entry['reason'] for entry in unmatched[:3]))
        if len(unmatched) > 3:
            text += '; ...'
    return text


def selector_summary(selector):
    out = {}
    for name in ('gpus', 'min_used_mib', 'idle_for', 'idle_util_pct', 'older_than', 'orphans', 'rogue',
                 'rogue_min_level', 'all_on_gpus'):
        out[name] = getattr(selector, name)
    out['pids'] = sorted(selector.pids) if selector.pids else None
    out['users'] = sorted(selector.users) if selector.users else None
    out['exclude_users'] = sorted(selector.exclude_users)
    out['name'] = selector.name.pattern if selector.name else None
    out['cmdline'] = selector.cmdline.pattern if selector.cmdline else None
    return out
