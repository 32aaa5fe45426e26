# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""One enforcement tick of the node agent: snapshot -> policy + rogue -> escalation state -> killer.

``run_tick(paths, settings)`` is what the timer (or cron) runs every interval:

1. takes an exclusive, non-blocking lock, so two ticks never overlap (a second one returns at once);
2. loads the policy (an invalid one: nothing is decided, the error is logged, exit code 1);
3. loads the state (``state.json``: when each violation was first seen, which
   warnings went out, counters); a missing or corrupt file is rebuilt with a logged warning,
   which restarts every escalation from its first warning: never a kill without warnings;
4. takes one snapshot, asks Slurm when the policy requires allocations (so the history charges a process
   slurmstepd lists to its job), appends it to the SQLite usage history, derives the idle clocks from the
   history (idle.py: the one idleness rule; they are not kept in the state), evaluates the policy (and the rogue detector when the policy enables it);
5. escalates: first warning when a violation is first seen, more warnings on schedule, the
   action once the grace has passed and every warning went out in an earlier tick;
6. acts through core reclaim (identity checked again before every signal, SIGTERM then SIGKILL)
   in mode enforce only; dry-run decides and logs the same, and signals and notifies nobody;
7. appends every decision to the hash-chained log, saves the state atomically and writes the
   Prometheus textfile metrics atomically.
"""

from __future__ import annotations

import os
import time

from . import audit_log, metrics as metrics_mod, notify as notify_mod, policy as policy_mod, safe_files, watchdog
from .constants import DEFAULT_PROTECT_NAMES, REMEDIATION_STATE_PATH
from .errors import GpuFleetError, InvalidArgument  # pylint: disable=unused-import  # load_settings raises InvalidArgument (a PolicyError)
from .exe_hash import ExeHashes
# the settings, the lock and the state file live in guard_settings and guard_state; importable from here
from .guard_settings import DEFAULT_PATHS, SETTINGS_KEYS, Paths, Settings, load_settings  # pylint: disable=unused-import
from .guard_state import STATE_VERSION, TickLock, load_state, new_state, save_state  # pylint: disable=unused-import
from .processes import ProcessInventory, user_uid

MAX_TRACKED = 10000


# ============================================================================ escalation
class Decision(object):
    """What the tick decided about one violation: ``warn`` (step N), ``act`` or ``clear``."""

    def __init__(self, decision, violation=None, key=None, step=None, first_seen=None, act_in=None, entry=None):
        self.decision = decision
        self.violation = violation
        self.key = key or (violation.key if violation is not None else None)
        self.step = step
        self.first_seen = first_seen
        self.act_in = act_in
        self.entry = entry or {}
        self.outcome = {}

    def to_dict(self, patterns=()):
        out = {'decision': self.decision, 'key': self.key, 'step': self.step, 'first_seen': self.first_seen}
        if self.violation is not None:
            v = self.violation
            out.update({'rule': v.rule, 'kind': v.kind, 'subject': v.subject, 'user': v.user, 'gpu': v.gpu,
                        'measured': v.measured, 'limit': v.limit, 'unit': v.unit, 'action': v.action, 'pids': list(v.pids),
                        'message': v.message, 'procs': notify_mod.describe_procs(v.procs, patterns)})
        else:
            out.update({'rule': self.entry.get('rule'), 'subject': self.entry.get('subject'), 'user': self.entry.get('user')})
        if self.act_in is not None:
            out['act_in'] = round(self.act_in, 1)
        if self.outcome:
            out['outcome'] = self.outcome
        return out


def escalate(violations, state, now, policy):
    """Decide, for each violation, whether a warning or the action is due; record it in ``state``.

    Warnings go out at ``escalation.warn_at`` seconds after the violation was first seen; the action
    comes at ``act_at`` (a rogue violation uses the rogue grace) once every warning went out in an
    earlier tick (an ``act_at`` of 0 acts at once).  A rule whose action is ``warn`` only warns.
    A failed action is retried after ``retry_after``.  A violation that disappeared is ``clear``ed
    once it has stayed away for ``clear_after`` seconds, counted from the first tick that did not
    see it (so one tick under the limit never restarts the warnings and the grace); until then it
    keeps its escalation and, if it comes back, goes on from where it was.  It is cleared at once
    when it was acted on (the action ended it; a new one starts from its first warning) or when the
    policy is disabled; and a violation acted on whose processes are all new (none the action was
    taken on) starts over from its first warning even before a tick saw it gone.
    """
    tracked = state.setdefault('violations', {})
    esc = policy.escalation
    decisions = []
    seen = set()
    for violation in violations:
        if violation.key in seen:
            continue
        seen.add(violation.key)
        entry = tracked.get(violation.key)
        if entry is not None and entry.get('acted_at') is not None and violation.pids and not set(violation.pids) & set(entry.get('pids') or ()):
            # none of the processes the action was taken on is left: other processes of the same
            # subject (a restarted job, the same job after a reboot) seen before a tick cleared the
            # violation are a new violation, from its first warning (not a retry without warning)
            entry = None
        if entry is None:
            if len(tracked) >= MAX_TRACKED and violation.key not in tracked:
                continue
            entry = tracked[violation.key] = {'first_seen': now, 'warnings': 0, 'last_warning': None, 'acted_at': None,
                                              'acts': 0, 'rule': violation.rule, 'subject': violation.subject,
                                              'user': violation.user}
        entry['last_seen'] = now
        entry.pop('gone_since', None)
        entry['pids'] = list(violation.pids)[:64]
        if violation.grace is not None:
            act_at, warn_at = violation.grace, [0.0]
        else:
            act_at, warn_at = esc.act_at, esc.warn_at
        elapsed = max(0.0, now - entry['first_seen'])
        acts = violation.action in ('terminate', 'kill')
        due = len([t for t in warn_at if t <= elapsed])
        ready = acts and elapsed >= act_at and (act_at <= 0 or entry['warnings'] >= len(warn_at))
        if ready and violation.pids:
            if entry['acted_at'] is None or now - entry['acted_at'] >= esc.retry_after:
                entry['acted_at'] = now
                entry['acts'] = entry.get('acts', 0) + 1
                decisions.append(Decision('act', violation, step=entry['warnings'], first_seen=entry['first_seen'], entry=entry))
            continue
        if due > entry['warnings']:
            entry['warnings'] = due
            entry['last_warning'] = now
            act_in = max(0.0, act_at - elapsed) if acts else None
            decisions.append(Decision('warn', violation, step=due, first_seen=entry['first_seen'], act_in=act_in, entry=entry))
    for key in sorted(tracked):
        if key in seen:
            continue
        entry = tracked[key]
        gone_since = entry.setdefault('gone_since', now)
        if policy.enabled and entry.get('acted_at') is None and now - gone_since < esc.clear_after:
            continue  # away for less than clear_after: not cleared yet
        tracked.pop(key)
        decisions.append(Decision('clear', key=key, first_seen=entry.get('first_seen'), entry=entry))
    return decisions


# ============================================================================ actions
def decide(policy, snapshot, state, now, context, samples=None):
    """The decision step of a tick (and of ``dry_run``): derive the idle clocks from ``samples`` (the
    usage history, see history_samples), evaluate the policy, escalate.  Returns (new state,
    violations, notes, decisions); the escalation is recorded in the new state, which the caller
    saves or drops."""
    state = policy_mod.observe(policy, snapshot, state, now, context, samples)
    violations, notes = policy_mod.evaluate_detailed(policy, snapshot, state, now, context)
    return state, violations, notes, escalate(violations, state, now, policy)


def _reclaim_group(pids, signal_name, timeout, protect_names, protect_users, snapshot, settings, dev_roots=None,
                   on_signalled=None):
    """End ``pids`` through core reclaim (one implementation: identity check, TERM -> KILL, tree)."""
    from .reclaim import ReclaimOptions, reclaim  # pylint: disable=import-outside-toplevel
    from .select import Selector  # pylint: disable=import-outside-toplevel
    selector = Selector(pids=sorted(pids))
    options = ReclaimOptions(signal=signal_name, timeout=timeout, force=True, tree=True,
                             release_timeout=settings.release_timeout, protect_names=protect_names,
                             protect_users=protect_users, vendor=settings.vendor, kill_timeout=5.0)
    return reclaim(selector, options, check_mode=False, snapshot=snapshot, dev_roots=dev_roots, on_signalled=on_signalled)


def _outcomes(result):
    """{pid: {'outcome': killed|failed|skipped, 'reason', 'signals'}} from a reclaim result."""
    out = {}
    for kind in ('killed', 'failed', 'skipped'):
        for entry in result.get(kind) or ():
            pid = entry.get('pid')
            if entry.get('parent_pid') is not None:
                continue  # a child collected with its parent (tree)
            out[pid] = {'outcome': kind, 'reason': entry.get('reason'), 'signals': entry.get('signals') or []}
    return out


def execute(decisions, policy, mode, snapshot, settings, dev_roots=None, journal=None):
    """Carry out the act decisions (mode enforce) and fill each decision's ``outcome``; returns how many of the
    processes about to be signalled were left unsignalled because the check of their open files ran out of its
    bound (reclaim's ``unchecked``: they are ``skipped`` with the reason, and checked again by the next tick).

    ``journal(signal, entries)`` is called right after each group's signals, before the release
    check asks the driver again (see reclaim.reclaim: a crashing vendor library must not lose the
    record of the signals)."""
    acts = [d for d in decisions if d.decision == 'act']
    unchecked = 0
    if mode != 'enforce':
        for decision in acts:
            decision.outcome = {'result': 'not_enforced', 'why': 'mode %s: logged only, nothing was signalled' % mode,
                                'would': decision.violation.action, 'pids': list(decision.violation.pids)}
        return unchecked
    groups = {}
    for decision in acts:
        violation = decision.violation
        signal_name = 'KILL' if violation.action == 'kill' else 'TERM'
        rogue = violation.kind == 'rogue'
        groups.setdefault((signal_name, rogue), []).append(decision)
    esc = policy.escalation
    for (signal_name, rogue), items in sorted(groups.items()):
        pids = sorted(set(pid for d in items for pid in d.violation.pids))
        if rogue:
            # the policy's protect list does not shield from rogue rules; the killer's own rules
            # (pid 1, this process and its ancestors, kernel threads) always apply
            names, users = (), ()
        else:
            names, users = tuple(sorted(policy.protect.names)), tuple(sorted(policy.protect.users))
        try:
            hook = None if journal is None else (lambda entries, sig='SIG' + signal_name: journal(sig, entries))
            result = _reclaim_group(pids, signal_name, esc.sigkill_after, names, users, snapshot, settings, dev_roots, hook)
            per_pid = _outcomes(result)
            unchecked += (result.get('unchecked') or {}).get('processes', 0)
            error = None
        except GpuFleetError as exc:
            per_pid, error, result = {}, str(exc), {}
        for decision in items:
            entries = dict((pid, per_pid.get(pid, {'outcome': 'failed', 'reason': error or 'not reached'}))
                           for pid in decision.violation.pids)
            decision.outcome = {'result': 'done' if all(e['outcome'] == 'killed' for e in entries.values()) else 'partial',
                                'signal': 'SIG' + signal_name, 'pids': entries,
                                'freed_mib': result.get('freed_mib'), 'unreleased': result.get('unreleased') or []}
            if error:
                decision.outcome['error'] = error
    return unchecked


def notify_users(decisions, policy, mode, host, settings, patterns):
    """One message per user for the warn and act decisions (mode warn or enforce)."""
    if mode == 'dry-run':
        for decision in decisions:
            if decision.decision in ('warn', 'act'):
                decision.outcome.setdefault('notified', 'not sent (dry-run)')
        return {}
    notifier = notify_mod.Notifier(policy.notify, host, settings.dev_root, settings.utmp_paths,
                                   webhook_url=settings.webhook_url, webhook_timeout=settings.webhook_timeout)
    by_user = {}
    for decision in decisions:
        if decision.decision not in ('warn', 'act'):
            continue
        violation = decision.violation
        users = sorted(set(p.get('user') for p in violation.procs if p.get('user'))) or [violation.user]
        for user in users:
            by_user.setdefault(user, []).append(decision)
    failures = {}
    for user in sorted(by_user, key=lambda u: (u is None, u or '')):
        items = by_user[user]
        uid = None
        for decision in items:
            for proc in decision.violation.procs:
                if proc.get('user') == user and proc.get('uid') is not None:
                    uid = proc['uid']
        if uid is None and user is not None:
            uid = user_uid(user)
        payload = []
        for decision in items:
            entry = decision.to_dict(patterns)
            entry['acts'] = decision.violation.action in ('terminate', 'kill')
            payload.append(entry)
        result = notifier.send(user, uid, payload, mode)
        for decision in items:
            decision.outcome['notified'] = {'user': user, 'tty': result.get('tty', 0), 'webhook': result.get('webhook'),
                                            'command': result.get('command'), 'errors': result.get('errors')[:5]}
        for channel in ('webhook', 'command'):
            if result.get(channel) == 'failed':
                failures[channel] = failures.get(channel, 0) + 1
    return failures


# ============================================================================ the tick
def scheduler_view(policy, snapshot, paths, proc_root='/proc'):
    """(warnings, scheduler, Context keywords): the allocations when the policy requires them - Slurm's own view on
    its nodes (squeue --json and scontrol listpids, ``job_pids`` among them), else the allocations file."""
    warnings = []
    needs_allocation = policy.defaults.get('require_allocation') or any(
        u.get('require_allocation') for u in policy.users.values()) or any(
        g.limits.get('require_allocation') for g in policy.groups)
    scheduler = policy_mod.detect_scheduler(proc_root) if needs_allocation else None
    allocations = {'allocations': None}
    if needs_allocation:
        path = policy.allocations_file or paths.allocations
        if path:
            allocations['allocations'] = policy_mod.read_allocations(path)
        if scheduler == 'slurm':  # Slurm itself is the truth on its nodes (docs/slurm.md)
            allocations = policy_mod.slurm_allocations(snapshot=snapshot)
            if allocations.get('allocation_error'):
                warnings.append('require_allocation: %s; the rule is not evaluated' % allocations['allocation_error'])
    return warnings, scheduler, allocations


def build_context(policy, snapshot, paths, settings, proc_root='/proc', exe_hashes=None, view=None):
    """The evaluation Context of a live node: scheduler, allocations, rogue findings.  (warnings, context)

    ``exe_hashes``: the exe_hash.ExeHashes that both the exemptions and the rogue allowlist hash
    executables with (a tick's keeps its digests in the state); default: a new one.  ``view``: scheduler_view's
    answer when the caller already has it (the tick asks Slurm once, before it records the usage history)."""
    warnings, scheduler, allocations = scheduler_view(policy, snapshot, paths, proc_root) if view is None else view
    warnings = list(warnings)
    exe_hashes = exe_hashes if exe_hashes is not None else ExeHashes(proc_root=proc_root)
    findings = None
    if policy.rogue.enabled:
        try:
            from . import rogue  # pylint: disable=import-outside-toplevel
            config = rogue.load_config(rules_file=policy.rogue.rules_file, checked=True)
            warnings.extend(config.warnings)
            found, more, _count = rogue.detect_snapshot(snapshot, config=config, min_level=policy.rogue.act_min_level,
                                                        history_path=paths.history, exe_hashes=exe_hashes)
            warnings.extend(more)
            findings = dict((f['pid'], f) for f in found if f.get('listed'))
        except ImportError:
            warnings.append('the rogue detector is not available in this build; rogue rules were not evaluated')
        except GpuFleetError as exc:
            warnings.append('rogue detection failed: %s' % exc)
    return warnings, policy_mod.Context(scheduler=scheduler, rogue_findings=findings, proc_root=proc_root, exe_cache=exe_hashes,
                                        **allocations)


def violation_dict(violation, patterns):
    """``Violation.to_dict()`` with the processes' command lines redacted (notify.redact_argv): what
    the tick's summary (printed, returned by gpu_audit) says about a violation."""
    item = violation.to_dict()
    for proc in item['procs']:
        proc['cmdline'] = notify_mod.redact_argv(proc.get('cmdline'), patterns)
    return item


def history_samples(paths, snapshot, now, settings, patterns=None, write=True, job_pids=None):
    """The usage history the idleness rule reads the idle clocks from: with ``write``, the snapshot
    appended first, command lines redacted by ``patterns`` (the policy's; None: the defaults), each process's
    row charged to its job (history.job_of: its root-owned cgroup, else ``job_pids`` from slurmstepd) - a
    history.SampleStore; without, read only - a HistoryReader, or None when there is none.
    Returns (store or None, warning or None); never raises.  The caller closes the store."""
    if not paths.history:
        return None, None
    try:
        from . import history  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None, 'the usage history is not available in this build; no sample recorded'
    store = None
    try:
        if not write:
            return (history.HistoryReader(paths.history) if os.path.isfile(paths.history) else None), None
        store = history.SampleStore(paths.history)
        store.record(snapshot, now, patterns=patterns, job_pids=job_pids,
                     retention_days=settings.history_retention_days or history.DEFAULT_RETENTION_DAYS)
    except Exception as exc:  # pylint: disable=broad-except
        # an open store still gives the idle clocks its earlier samples
        return store, 'could not %s the usage history in %s: %s' % ('record' if write else 'read', paths.history, exc)
    return store, None


def _close_samples(samples, warnings):
    if samples is not None:
        warnings.extend(samples.problems)
        samples.close()


def _log(paths, record, warnings):
    """Append ``record`` to the decision log; False (and a warning) when it could not be written."""
    if not paths.log:
        return True
    try:
        audit_log.append(paths.log, record)
    except audit_log.AuditLogError as exc:
        warnings.append(str(exc))
        return False
    return True


def _count(counters, key, label, amount=1):
    bucket = counters.setdefault(key, {})
    bucket[label] = bucket.get(label, 0) + amount


def run_tick(paths, settings, now=None, snapshot=None, context=None, dev_roots=None, take_snapshot=None, write=True):
    """One enforcement pass.  Returns a summary dict (``rc``: 0 ok, 1 error; ``skipped`` when locked).

    ``write=False`` is the ``test`` command: nothing is written, signalled or sent.  Files that
    someone else could change or swap (``untrusted_inputs``): nothing is read or decided, rc 1.
    Seams for tests: now, snapshot / take_snapshot, context, dev_roots.
    """
    wall0, cpu0 = time.time(), time.process_time()
    now = wall0 if now is None else float(now)
    problems = untrusted_inputs(paths)
    if problems:
        return _refuse(paths, problems, now, write, wall0, cpu0)
    if write:
        lock = TickLock(paths.lock)
        try:
            lock.acquire()
        except safe_files.UnsafeFile as exc:   # changed since the check above
            return _refuse(paths, [_problem('lock', paths.lock, exc)], now, write, wall0, cpu0)
        try:
            if not lock.acquired:
                return {'rc': 0, 'skipped': 'another tick holds %s; this one did nothing' % paths.lock}
            return _tick(paths, settings, now, snapshot, context, dev_roots, take_snapshot, write, wall0, cpu0)
        finally:
            lock.release()
    return _tick(paths, settings, now, snapshot, context, dev_roots, take_snapshot, write, wall0, cpu0)


# (label, Paths attribute, strict): the files a tick reads or writes.  strict=False: written only, never
# read back to decide anything (see safe_files: the directories above the file's own may be group-writable)
CHECKED_FILES = (('policy', 'policy', True), ('settings', 'settings', True), ('state', 'state', True),
                 ('usage history', 'history', True), ('allocations', 'allocations', True),
                 ('log', 'log', False), ('metrics', 'metrics', False), ('lock', 'lock', False))


def _problem(label, path, exc):
    """The sentence for UnsafeFile ``exc`` found while checking the ``label`` file ``path``."""
    path = os.path.abspath(path)
    found = os.path.abspath(exc.filename) if exc.filename else path
    if found == path:
        return 'the %s file %s %s' % (label, path, exc.why)
    if found == os.path.dirname(path):
        return 'the %s directory %s %s' % (label, found, exc.why)
    return 'the directory %s (above the %s file %s) %s' % (found, label, path, exc.why)


def untrusted_inputs(paths, euid=None):
    """Why the agent must not trust its files: one of them, or a directory above it, could be
    changed or swapped by someone else than root or the agent's user (see safe_files for the
    checks: no symbolic link anywhere in the path, owners, group/other write unless sticky).  The
    policy, settings, state, usage history, allocations, log, metrics and lock files are checked;
    missing ones are fine (the guard creates them, through the same checks).  A list of problems
    (empty: trusted).  A root agent that read a policy anyone could swap would signal whatever
    that person wrote into it, and one that wrote through a link would overwrite or expose
    whatever file the link names."""
    euid = os.geteuid() if euid is None else euid
    problems = []
    seen = set()
    for label, attribute, strict in CHECKED_FILES:
        path = getattr(paths, attribute, None)
        if not path:
            continue
        try:
            safe_files.check(path, euid=euid, strict=strict)
        except safe_files.UnsafeFile as exc:
            if exc.filename not in seen:       # a shared directory is named once
                seen.add(exc.filename)
                problems.append(_problem(label, path, exc))
        except OSError as exc:
            problems.append('cannot check the %s file %s: %s' % (label, path, exc.strerror or exc))
    return problems


def _refuse(paths, problems, now, write, wall0, cpu0):
    """The tick refuses to act on files it cannot trust: logged (``guard_untrusted_input``, when
    the log itself can be written safely), ``gpufleet_guard_policy_valid 0`` in the metrics (when
    they can), exit code 1."""
    host = os.uname().nodename
    tick_id = os.urandom(8).hex()
    warnings = []
    summary = {'rc': 1, 'tick': tick_id, 'host': host, 'time': now, 'warnings': warnings,
               'error': 'refusing to act on untrusted input: %s' % '; '.join(problems)}
    if write:
        _log(paths, {'event': 'guard_untrusted_input', 'tick': tick_id, 'host': host, 'problems': problems}, warnings)
        _write_metrics(paths, None, [], {}, {'time': now, 'duration': time.time() - wall0, 'cpu': time.process_time() - cpu0},
                       None, False, False, warnings, untrusted=True)
    return summary


def _driver_failed(paths, summary, exc, write, wall0, cpu0, counters):
    """The driver read hung (or its library crashed): nothing is decided or signalled, the state stays as it
    was; the tick logs ``guard_driver_hung`` (or ``guard_driver_crashed``), writes the metrics and exits 1."""
    hung = isinstance(exc, watchdog.DriverHung)
    details = dict(exc.details) if hung else {'call': exc.call, 'message': str(exc)}
    summary.update(rc=1, error=str(exc))
    summary['driver_hung' if hung else 'driver_crashed'] = details
    if write:
        record = {'event': 'guard_driver_hung' if hung else 'guard_driver_crashed', 'tick': summary['tick'],
                  'host': summary['host']}
        record.update(details)
        _log(paths, record, summary['warnings'])
        tick = {'time': summary['time'], 'duration': time.time() - wall0, 'cpu': time.process_time() - cpu0,
                'driver_hung': details if hung else None, 'driver_crashed': None if hung else details}
        _write_metrics(paths, None, [], counters, tick, summary.get('mode'), True, True, summary['warnings'])
    summary['duration'] = round(time.time() - wall0, 3)
    return summary


def _tick(paths, settings, now, snapshot, context, dev_roots, take_snapshot, write, wall0, cpu0):
    host = os.uname().nodename
    tick_id = os.urandom(8).hex()
    warnings = []
    summary = {'rc': 0, 'tick': tick_id, 'host': host, 'time': now, 'warnings': warnings}
    state, problem = load_state(paths.state, now)
    if not isinstance(state.get('policy_cache'), dict):
        state['policy_cache'] = {}
    try:
        # the state caches the policy document by the file's SHA-256: most ticks skip YAML parsing
        policy = policy_mod.load_policy_cached(paths.policy, state['policy_cache'])
    except policy_mod.PolicyError as exc:
        summary.update(rc=1, error=str(exc))
        if write:
            _log(paths, {'event': 'guard_policy_invalid', 'tick': tick_id, 'host': host, 'policy': paths.policy,
                         'error': str(exc)[:4000]}, warnings)
            _write_metrics(paths, None, [], {}, {'time': now, 'duration': time.time() - wall0,
                                                 'cpu': time.process_time() - cpu0}, None, False, False, warnings)
        return summary
    mode = settings.mode or policy.mode
    summary.update(mode=mode, policy_sha256=policy.sha256)
    if problem:
        warnings.append(problem)
        if write:
            _log(paths, {'event': 'guard_state_rebuilt', 'tick': tick_id, 'host': host, 'why': problem}, warnings)
    if snapshot is None:
        if take_snapshot is None:
            from .snapshot import take_snapshot  # pylint: disable=import-outside-toplevel
        # /proc read directly (a fraction of psutil's cost per process; the agent needs no psutil), and
        # no scan of every process's open files: policies concern the processes the driver lists, and
        # the few that are about to be signalled get their files checked by reclaim.plan (processes.check_device_holding)
        inventory = ProcessInventory(dev_roots=dev_roots, use_psutil=False, scan_fds=False)
        try:
            snapshot = take_snapshot(vendor=settings.vendor, gather_processes=True, dev_roots=dev_roots, inventory=inventory,
                                     driver_timeout=getattr(settings, 'driver_timeout', watchdog.DEFAULT_TICK_TIMEOUT),
                                     xid_since=ladder_health_since(policy, paths, now),
                                     xid_memo=state.setdefault('xid_journal', {}))
        except (watchdog.DriverHung, watchdog.DriverCrashed) as exc:
            return _driver_failed(paths, summary, exc, write, wall0, cpu0, state.get('counters') or {})
    warnings.extend(snapshot.errors)
    # Slurm's view first: the history charges a sample to the job slurmstepd lists its process under when no
    # root-owned cgroup names one (proctrack/linuxproc)
    view = scheduler_view(policy, snapshot, paths) if context is None else None
    job_pids = view[2].get('job_pids') if view is not None else context.job_pids
    samples, problem = history_samples(paths, snapshot, now, settings, policy.notify.redact_patterns, write, job_pids=job_pids)
    if problem:
        warnings.append(problem)
    try:
        exe_hashes = None
        if context is None:
            # executables' digests are kept across ticks (exe_hash): most ticks read no executable
            exe_hashes = ExeHashes(state.get('exe_hashes'))
            more, context = build_context(policy, snapshot, paths, settings, exe_hashes=exe_hashes, view=view)
            warnings.extend(more)
        state, violations, notes, decisions = decide(policy, snapshot, state, now, context, samples)
    finally:
        _close_samples(samples, warnings)
    if exe_hashes is not None:
        state['exe_hashes'] = exe_hashes.entries
    patterns = policy.notify.redact_patterns
    counters = state.setdefault('counters', new_state(now)['counters'])
    if write:
        def journal(signal_name, entries):
            _log(paths, {'event': 'guard_signalled', 'tick': tick_id, 'host': host, 'mode': mode, 'signal': signal_name,
                         'policy_sha256': policy.sha256, 'signalled': entries}, warnings)
        unchecked = execute(decisions, policy, mode, snapshot, settings, dev_roots, journal)
        if unchecked:
            summary['unchecked_processes'] = unchecked
            warnings.append('%d process(es) about to be signalled hold more open files than one tick reads: not signalled '
                            'by this tick (docs/guard.md, "Bounded work")' % unchecked)
        failures = notify_users(decisions, policy, mode, host, settings, patterns)
        for channel, amount in failures.items():
            _count(counters, 'notify_failures', channel, amount)
    else:
        for decision in decisions:
            if decision.decision == 'act':
                decision.outcome = {'result': 'test', 'would': decision.violation.action if mode == 'enforce' else 'log only (mode %s)' % mode,
                                    'pids': list(decision.violation.pids)}
    if policy.remediation.enabled:
        summary['remediation'] = remediate_tick(paths, policy, mode, snapshot, write, tick_id, host, warnings,
                                                driver_timeout=getattr(settings, 'driver_timeout', watchdog.DEFAULT_TICK_TIMEOUT))
        _count_ladder(counters, summary['remediation'])
    records = []
    for decision in decisions:
        entry = decision.to_dict(patterns)
        rule = entry.get('rule') or 'unknown'
        if decision.decision == 'warn':
            _count(counters, 'warnings', rule)
        elif decision.decision == 'act':
            _count(counters, 'actions', rule)
            _count(counters, 'user_actions', decision.violation.user if decision.violation.user is not None else 'unknown')
            for pid_outcome in (decision.outcome.get('pids') or {}).values() if isinstance(decision.outcome.get('pids'), dict) else ():
                if pid_outcome.get('outcome') == 'killed':
                    _count(counters, 'kills', rule)
                elif pid_outcome.get('outcome') == 'failed':
                    _count(counters, 'failures', rule)
        record = {'event': 'guard_decision', 'tick': tick_id, 'host': host, 'mode': mode, 'dry_run': mode == 'dry-run',
                  'policy_sha256': policy.sha256}
        record.update(entry)
        records.append(record)
    duration = time.time() - wall0
    counters['ticks'] = counters.get('ticks', 0) + 1
    state['last_tick'] = now
    state['last_tick_duration'] = round(duration, 3)
    state['mode'] = mode
    summary.update(violations=[violation_dict(v, patterns) for v in violations], decisions=list(records), notes=notes[:100])
    if write:
        unlogged = sum(1 for record in records if not _log(paths, record, warnings))
        if unlogged:
            # the decisions were taken (and acted on) but not recorded: a failure the exit code must show
            summary['rc'] = 1
            summary['unlogged'] = unlogged
        try:
            save_state(paths.state, state)
        except OSError as exc:
            warnings.append('could not save the state %s: %s' % (paths.state, exc.strerror or exc))
            summary['rc'] = 1
        tick = {'time': now, 'duration': time.time() - wall0, 'cpu': time.process_time() - cpu0,
                'unchecked': summary.get('unchecked_processes', 0), 'ladder_budget': (summary.get('remediation') or {}).get('budget')}
        _write_metrics(paths, snapshot, violations, counters, tick, mode, True, policy.enabled, warnings,
                       reboot_flagged=_reboot_flagged(policy), rogue_findings=context.rogue_findings if policy.rogue.enabled else None)
    summary['duration'] = round(time.time() - wall0, 3)
    summary['cpu'] = round(time.process_time() - cpu0, 3)
    return summary


def remediation_options(policy, paths):
    """RemediateOptions from the policy's ``remediation`` section; the ladder's state lives next to the guard's."""
    # only when the remediation section is enabled
    from .budget import Budget  # pylint: disable=import-outside-toplevel
    from .remediate import RemediateOptions  # pylint: disable=import-outside-toplevel
    section = policy.remediation
    budget = Budget(section.max_resets, section.window, section.max_drained_pct,
                    fields=('remediation.max_resets', 'remediation.window', 'remediation.max_drained_pct'))
    return RemediateOptions(budget=budget, kill_application_xids=section.kill_application_xids, reset=section.reset,
                            kill_processes=section.kill_processes, stop_services=section.stop_services,
                            protect_names=tuple(sorted(set(DEFAULT_PROTECT_NAMES) | set(policy.protect.names))),
                            protect_users=tuple(sorted(policy.protect.users)), drain=section.drain,
                            drain_command=section.drain_command, node_name=section.node_name, reboot_flag=section.reboot_flag,
                            orphan_threshold_mib=section.orphan_threshold_mib, verify_timeout=section.verify_timeout,
                            state_path=os.path.join(os.path.dirname(paths.state), os.path.basename(REMEDIATION_STATE_PATH)) if paths.state else None,
                            audit_path=paths.audit_log or None)


def ladder_health_since(policy, paths, now):
    """The tick snapshot's ``xid_since`` when the ladder runs: the Xid lines from before a GPU's verified
    reset (they stay in the kernel log) change its health no more, so the node can return to service."""
    if not policy.remediation.enabled:
        return None
    from .remediate import health_since, load_ladder_state  # pylint: disable=import-outside-toplevel
    state, _problem = load_ladder_state(remediation_options(policy, paths))   # the ladder itself reports a problem
    return health_since(state, now)


def remediate_tick(paths, policy, mode, snapshot, write, tick_id, host, warnings, run=None, driver_timeout=None):
    """The remediation ladder of one tick (policy ``remediation``): acts in mode enforce only; in
    dry-run, warn and ``test`` it predicts (check mode).  Each GPU step and node step is logged
    (``guard_remediation``) with its evidence; GPUs with nothing to do are not.  The ladder's own driver
    reads (before a kill, around a reset) run under ``driver_timeout`` like the tick's.  ``run`` is a seam."""
    from .remediate import remediate  # pylint: disable=import-outside-toplevel
    from .reset import Host  # pylint: disable=import-outside-toplevel
    check_mode = mode != 'enforce' or not write
    try:
        result = (run or remediate)(remediation_options(policy, paths), Host(driver_timeout=driver_timeout),
                                    check_mode=check_mode, snapshot=snapshot)
    except (watchdog.DriverHung, watchdog.DriverCrashed) as exc:
        warnings.append('the remediation ladder stopped: %s' % exc)
        return {'error': str(exc), 'driver_hung': exc.details if isinstance(exc, watchdog.DriverHung) else None}
    except (GpuFleetError, OSError) as exc:
        warnings.append('the remediation ladder failed: %s' % exc)
        return {'error': str(exc)}
    warnings.extend(result.get('warnings') or [])
    warnings.extend(result.get('errors') or [])
    if write:
        base = {'event': 'guard_remediation', 'tick': tick_id, 'host': host, 'mode': mode, 'check_mode': check_mode}
        for gpu in result['gpus']:
            for step in gpu['ladder']:
                _log(paths, dict(base, gpu={'index': gpu['index'], 'key': gpu['key']}, findings=gpu['findings'], **step), warnings)
        for name in ('drain', 'undrain', 'reboot_flag'):
            outcome = result['node'].get(name)
            if outcome and outcome.get('status') not in ('already', 'present'):
                _log(paths, dict(base, step=name, node=True, **outcome), warnings)
    return result


def _count_ladder(counters, result):
    """Count the ladder steps this tick carried out (metrics ``gpufleet_guard_remediation_steps``)."""
    for gpu in result.get('gpus') or ():
        for step in gpu['ladder']:
            if step['status'] == 'done':
                _count(counters, 'remediation_steps', step['step'])
    for name, outcome in (result.get('node') or {}).items():
        if isinstance(outcome, dict) and outcome.get('status') in ('done', 'written'):
            _count(counters, 'remediation_steps', name)


def _reboot_flagged(policy):
    """The GPUs that the remediation ladder's reboot flag of this boot names (the guard's ladder or the
    gpufleet.reclaim.remediate playbook wrote it), for the metrics; nothing read when there is no flag."""
    path = policy.remediation.reboot_flag
    if not path or not os.path.lexists(path):
        return ()
    from .remediate import flagged_gpus  # pylint: disable=import-outside-toplevel
    return flagged_gpus(path)


def _write_metrics(paths, snapshot, violations, counters, tick, mode, valid, enabled, warnings, reboot_flagged=(),
                   untrusted=False, rogue_findings=None):
    if not paths.metrics:
        return
    try:
        text = metrics_mod.guard_metrics(snapshot, violations, counters, tick, mode, valid, enabled, reboot_flagged=reboot_flagged,
                                         untrusted=untrusted, rogue_findings=rogue_findings).render()
        safe_files.write_atomic(paths.metrics, text, mode=0o644, dir_mode=0o755, strict=False)
    except OSError as exc:
        warnings.append('could not write the metrics %s: %s' % (paths.metrics, exc.strerror or exc))


def preview(paths, settings, now=None, snapshot=None, context=None, dev_roots=None, take_snapshot=None):
    """The ``test`` command: what a tick would decide now, without writing, signalling or sending."""
    return run_tick(paths, settings, now=now, snapshot=snapshot, context=context, dev_roots=dev_roots,
                    take_snapshot=take_snapshot, write=False)


def dry_run(policy, snapshot, paths, settings=None, now=None):
    """What enforcement of ``policy`` would do about ``snapshot`` now, without writing anything.

    The guard's state (escalation progress) is read when ``paths.state`` exists, and the idle clocks
    are derived from the usage history when ``paths.history`` exists; neither is written.
    Returns (violations, notes, warnings): each violation is ``Violation.to_dict()`` plus
    ``enforcement`` = {mode, next (warn, act or wait), step, act_in, would}.  Used by gpu_audit policy=.
    """
    now = time.time() if now is None else float(now)
    settings = settings or Settings()
    warnings = []
    state, problem = load_state(paths.state, now) if paths.state else (new_state(now), None)
    if problem:
        warnings.append(problem)
    more, context = build_context(policy, snapshot, paths, settings, exe_hashes=ExeHashes(state.get('exe_hashes')))
    warnings.extend(more)
    samples, problem = history_samples(paths, snapshot, now, settings, write=False)
    if problem:
        warnings.append(problem)
    try:
        _state, violations, notes, decisions = decide(policy, snapshot, state, now, context, samples)
    finally:
        _close_samples(samples, warnings)
    decided = dict((d.key, d) for d in decisions if d.violation is not None)
    mode = settings.mode or policy.mode
    out = []
    for violation in violations:
        item = violation_dict(violation, policy.notify.redact_patterns)
        decision = decided.get(violation.key)
        acts = violation.action in ('terminate', 'kill')
        if not acts:
            would = 'warn only (the rule\'s action is %s)' % violation.action
        elif mode == 'enforce':
            would = '%s pid(s) %s' % (violation.action, ', '.join(str(p) for p in violation.pids))
        else:
            would = 'log only (mode %s)' % mode
        item['enforcement'] = {
            'mode': mode,
            'next': decision.decision if decision is not None else 'wait',
            'step': decision.step if decision is not None else None,
            'act_in': round(decision.act_in, 1) if decision is not None and decision.act_in is not None else None,
            'would': would,
        }
        out.append(item)
    return out, notes, warnings
