# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The remediation ladder: per GPU, classify -> kill the offending application -> verified reset
-> drain the node -> flag it for a reboot; return the node to service once health reads clean.

``plan_remediation(snapshot, options, ...)`` is the one planner (pure: a snapshot and the node's
remembered state in, the steps out); ``remediate(options, host, check_mode)`` runs it for the
gpu_remediate module and for the guard's ``remediation`` policy section.  Check mode predicts the
whole ladder: the planned steps, and for each reset the reset's own check (reset.reset in check
mode), so a reset that would be refused shows the drain and reboot flag that would follow.

Inputs per GPU (the snapshot's Devices, as gpu_facts reports them): ``xid_events`` (model.XidEvent
records, classified by core/xid.py's table: ``fault`` and ``action``), ``recovery_action`` (none, reset,
reboot, drain_p2p, drain_and_reset, or None), orphaned memory and health.  A handled event is remembered
in the ladder's state file (``state_path``) so that a rerun does not act on it again, and so is the time
of each verified reset: the Xid lines logged before it stay in the kernel log, but they change no health
of that GPU any more (``health_since``: the snapshots' ``xid_since``), so the node returns to service once
health reads clean.

Steps (``STEPS``):

* ``kill_application``: application Xids (13, 31, 43, ...) name the pid of the offending process; it
  is terminated through reclaim (identity checked before every signal, protected processes never),
  only when at that moment the driver lists it on that GPU, its name is the one the record gives and
  it started before the record (else another process has the number): otherwise reported, nothing done.
* ``reset``: GPU Xids, orphaned memory, health or a recovery action of reset: reset.reset on that
  GPU (preconditions, blockers, verification).  A refused or failed reset escalates.
* ``drain``: the node leaves the scheduler with a reason: Slurm's ``scontrol update nodename=N
  state=drain reason=...`` where a root-vouched slurmd runs, else the ``drain_command`` hook
  (argv + ``[drain, NODE, REASON]``), else reported as unavailable.  Only a drain this ladder set
  is ever undone (``undrain``: ``state=resume`` / argv + ``[resume, NODE, REASON]``), and only once
  every GPU reads clean and no reboot is pending.
* ``reboot_flag``: a reset cannot help (Xid 79, recovery action reboot, kernel references) or
  failed: the root-owned flag file (``reboot_flag``, JSON with the boot id, the GPUs and the
  reasons) is written; a flag from an earlier boot is removed.  A GPU named in the flag waits for
  the reboot: no other step touches it.
"""

from __future__ import annotations

import json
import os
import socket
import time

from . import audit_log, disruption, safe_files
from .budget import EXHAUSTED, PARTITION_LIMIT, Budget, disruptive_actions
from .constants import DEFAULT_PROTECT_NAMES, REBOOT_FLAG_PATH, REMEDIATION_STATE_PATH
from .errors import InvalidArgument
from .processes import scheduler_daemon
from .reclaim import ReclaimOptions, reclaim
from .reset import RELEASE_TIMEOUT, SIGKILL_WAIT, Host, ResetOptions, recovery_action, reset
from .select import Selector
from .text import printable
from .xid import DEFAULT_WINDOW_S, read_boot_id as boot_id

STEPS = ('kill_application', 'reset', 'drain', 'reboot_flag', 'undrain')
DEFAULT_REBOOT_FLAG = REBOOT_FLAG_PATH
DEFAULT_STATE_PATH = REMEDIATION_STATE_PATH
STATE_LIMIT = disruption.STATE_LIMIT
MAX_HANDLED = 2000
REASON_LEN = 200
# recovery action -> steps; drain_and_reset is a reset with the GPU in the NVML drain state (gpu_reset drain)
RECOVERY = {'reset': ('reset',), 'drain_and_reset': ('reset',), 'reboot': ('reboot',), 'drain_p2p': ('drain',)}


def xid_events(dev):
    """The GPU's recent Xid events (model.XidEvent, oldest first); none when no source could tell."""
    return list(dev.xid_events or ())


def event_key(dev, event, boot=None):
    """What identifies a handled event in the ladder's state: the GPU, the boot and the kernel's own stamp of the
    record (xid.with_stamp), the code and the pid.  Never the epoch ``time``: it is converted through each read's
    clocks and moves by milliseconds between reads, and a handled Xid must not come back as a new one."""
    stamp = getattr(event, 'stamp', None)
    if stamp is None:   # a source without the kernel's stamp (a log line without its header)
        return legacy_event_key(dev, event)
    return '%s|%s@%d|%s|%s' % (dev.key, boot or '', stamp, event.code, event.pid)


def legacy_event_key(dev, event):
    """The key states written before the kernel stamp was kept (epoch time based): still honoured."""
    return '%s|%s|%s|%s' % (dev.key, event.time, event.code, event.pid)


# ---------------------------------------------------------------------------- options
def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InvalidArgument(name, value, 'expected a number, 0 or more')
    return value


def _abs(name, value):
    if value and (not isinstance(value, str) or not value.startswith('/')):
        raise InvalidArgument(name, value, 'expected an absolute path (or empty to turn it off)')
    return value or None


class RemediateOptions(object):
    """What the ladder may do.  Validated here, before anything is read."""

    def __init__(self, gpus=None, kill_application_xids=True, reset=True, kill_processes=False, kill_timeout=10.0,
                 protect_names=DEFAULT_PROTECT_NAMES, protect_users=(), stop_services=(), orphan_threshold_mib=1024,
                 verify_timeout=60.0, drain=True, drain_command=None, node_name=None, reboot_flag=DEFAULT_REBOOT_FLAG,
                 state_path=DEFAULT_STATE_PATH, audit_path=None, vendor='auto', budget=None):
        self.gpus = [str(g) for g in gpus] if gpus else None
        self.kill_application_xids = bool(kill_application_xids)
        self.reset = bool(reset)
        self.kill_processes = bool(kill_processes)
        self.kill_timeout = float(_number('kill_timeout', kill_timeout))
        self.protect_names = tuple(protect_names or ())
        self.protect_users = tuple(protect_users or ())
        self.orphan_threshold_mib = _number('orphan_threshold_mib', orphan_threshold_mib)
        self.verify_timeout = float(_number('verify_timeout', verify_timeout))
        self.drain = bool(drain)
        if drain_command is not None:
            if isinstance(drain_command, str) or not isinstance(drain_command, (list, tuple)) or not drain_command or \
                    not all(isinstance(a, str) and a for a in drain_command):
                raise InvalidArgument('drain_command', drain_command, 'expected a non-empty argument list, never a shell line')
            if not drain_command[0].startswith('/'):
                raise InvalidArgument('drain_command', drain_command[0], 'the program is an absolute path')
        self.drain_command = list(drain_command) if drain_command else None
        if node_name is not None and (not isinstance(node_name, str) or not node_name or '=' in node_name or
                                      any(c.isspace() for c in node_name)):
            raise InvalidArgument('node_name', node_name, 'expected a scheduler node name (no spaces, no "=")')
        self.node_name = node_name
        self.reboot_flag = _abs('reboot_flag', reboot_flag)
        self.state_path = _abs('state_path', state_path)
        self.audit_path = _abs('audit_log', audit_path)
        self.vendor = vendor
        self.budget = budget if budget is not None else Budget()   # the node-local budget (core/budget.py)
        # the reset's own validation (stop_services names, auto)
        self.reset_options = ResetOptions(gpus=['0'], kill_processes=kill_processes, kill_timeout=kill_timeout,
                                          protect_names=protect_names, protect_users=protect_users,
                                          stop_services=stop_services, orphan_threshold_mib=orphan_threshold_mib,
                                          verify_timeout=verify_timeout, vendor=vendor, audit_path=audit_path)
        self.stop_services = list(stop_services or ())

    def reset_for(self, dev):
        return ResetOptions(gpus=[str(dev.index)], kill_processes=self.kill_processes, kill_timeout=self.kill_timeout,
                            protect_names=self.protect_names, protect_users=self.protect_users,
                            stop_services=self.stop_services, orphan_threshold_mib=self.orphan_threshold_mib,
                            verify_timeout=self.verify_timeout, vendor=dev.vendor, audit_path=self.audit_path,
                            drain=recovery_action(dev) == 'drain_and_reset')


# ---------------------------------------------------------------------------- remembered state
def load_ladder_state(options):
    state, problem = disruption.read_json(options.state_path, STATE_LIMIT)
    handled = state.get('handled') if isinstance(state.get('handled'), dict) else {}
    drained = state.get('drained') if isinstance(state.get('drained'), dict) else None
    reset_at = state.get('reset_at') if isinstance(state.get('reset_at'), dict) else {}
    reset_at = dict((key, value) for key, value in reset_at.items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool))
    return {'handled': handled, 'drained': drained, 'reset_at': reset_at,
            'disruptions': disruption.valid_entries(state.get('disruptions'))}, problem


def flagged_gpus(path):
    """The GPUs (their keys) that the reboot flag ``path`` of this boot names: they wait for a reboot."""
    flag, stale = disruption.load_reboot_flag(path, boot_id())
    return sorted((flag or {}).get('gpus') or {}) if flag and not stale else []


def health_since(ladder_state, now=None):
    """The snapshots' ``xid_since`` (a function of the Device): a GPU's Xid events from before its last
    verified reset change its health no more (they stay in the kernel log); else the default window."""
    reset_at = (ladder_state or {}).get('reset_at') or {}
    if not reset_at:
        return None
    window = (time.time() if now is None else now) - DEFAULT_WINDOW_S

    def since(dev):
        when = reset_at.get(dev.key)
        return max(window, when) if when is not None else None
    return since


# ---------------------------------------------------------------------------- the planner
class Step(object):
    def __init__(self, name, why, evidence=None, pid=None, event=None):
        self.name = name
        self.why = why
        self.evidence = evidence or {}
        self.pid = pid
        self.event = event
        self.status = 'planned'
        self.detail = None
        self.result = None

    def to_dict(self):
        out = {'step': self.name, 'why': printable(self.why), 'evidence': self.evidence, 'status': self.status,
               'detail': printable(self.detail)}
        if self.pid is not None:
            out['pid'] = self.pid
        if self.result is not None:
            out['result'] = self.result
        return out


class GpuLadder(object):
    """The findings and the steps for one GPU."""

    def __init__(self, dev):
        self.dev = dev
        self.findings = []
        self.steps = []
        self.handled = []           # event keys this ladder resolves once its steps ran
        self.awaiting_reboot = None
        self.reset_at = None        # when its verified reset ran (epoch seconds)
        self.status = 'ok'

    def add(self, step):
        if step.name in ('reset', 'drain', 'reboot_flag') and any(s.name == step.name for s in self.steps):
            return
        self.steps.append(step)

    def ordered(self):
        names = [s.name for s in self.steps]
        if 'reboot_flag' in names:  # a reset cannot help: drain and wait for the reboot
            self.steps = [s for s in self.steps if s.name != 'reset' or s.status != 'planned']
            if 'drain' not in names:
                self.steps.append(Step('drain', 'the GPU waits for a reboot'))
        self.steps.sort(key=lambda s: STEPS.index(s.name))
        return self.steps

    def to_dict(self):
        dev = self.dev
        return {'index': dev.index, 'key': dev.key, 'uuid': dev.uuid, 'pci_bus_id': dev.pci_bus_id, 'name': dev.name,
                'findings': list(self.findings), 'ladder': [s.to_dict() for s in self.steps], 'status': self.status,
                'awaiting_reboot': self.awaiting_reboot, 'recovery_action': recovery_action(dev),
                'health': dev.health.to_dict()}


def _selected(snapshot, options):
    devices = list(snapshot.all_devices)
    if options.gpus:
        wanted = set(options.gpus)
        devices = [d for d in devices if str(d.index) in wanted or (d.uuid and d.uuid in wanted)]
    return devices


def _classify(ladder, dev, options, handled, reset_at=None, boot=None):
    """Findings and steps from the Xid events, the recovery action, orphaned memory and health.

    An event is handled when the state remembers its key, or when a verified reset of this GPU ran after it
    (``reset_at``: that reset is what recovered the GPU; health_since leaves such events out of health too)."""
    for event in xid_events(dev):
        key = event_key(dev, event, boot)
        remediation = event.action if event.action != 'none' else None
        evidence = {'source': 'xid', 'code': event.code, 'time': event.time, 'pid': event.pid, 'name': event.name,
                    'log': event.source, 'fault': event.fault, 'remediation': remediation, 'message': event.message}
        when = handled.get(key, handled.get(legacy_event_key(dev, event)))
        if when is None and reset_at is not None and event.time is not None and event.time < reset_at:
            when = reset_at
        if when is not None:
            evidence['handled'] = when
            ladder.findings.append(evidence)
            if key not in handled:
                ladder.handled.append(key)   # remembered under its stable key from now on
            continue
        ladder.findings.append(evidence)
        what = 'Xid %d (%s fault)' % (event.code, event.fault)
        if remediation == 'kill_app':
            if event.pid and options.kill_application_xids:
                ladder.add(Step('kill_application', '%s names pid %s' % (what, event.pid), evidence, pid=event.pid, event=event))
            ladder.handled.append(key)
        elif remediation == 'reset':
            ladder.add(Step('reset', what, evidence))
            ladder.handled.append(key)
        elif remediation == 'reboot':
            ladder.add(Step('reboot_flag', '%s: a reset cannot recover the GPU' % what, evidence))
            ladder.handled.append(key)
        elif remediation == 'drain':
            ladder.add(Step('drain', '%s: the GPU should take no new work' % what, evidence))
            ladder.handled.append(key)
        else:
            ladder.handled.append(key)  # informational: recorded, nothing to do
    action = recovery_action(dev)
    if action in RECOVERY:
        evidence = {'source': 'recovery_action', 'recovery_action': action}
        ladder.findings.append(evidence)
        for name in RECOVERY[action]:
            ladder.add(Step('reboot_flag' if name == 'reboot' else name, 'the driver\'s recovery action is %s' % action, evidence))
    if dev.orphaned_mib is None and dev.memory_used_mib is not None:
        dev.compute_orphaned()
    if dev.orphaned_mib is not None and dev.orphaned_mib > options.orphan_threshold_mib:
        evidence = {'source': 'orphaned_memory', 'orphaned_mib': dev.orphaned_mib, 'threshold_mib': options.orphan_threshold_mib}
        ladder.findings.append(evidence)
        ladder.add(Step('reset', '%d MiB of GPU memory held by no process' % dev.orphaned_mib, evidence))
    health = dev.health
    if health.recommended_action in ('reset', 'reboot', 'drain'):
        evidence = {'source': 'health', 'status': health.status, 'recommended_action': health.recommended_action,
                    'reasons': list(health.reasons)}
        ladder.findings.append(evidence)
        name = {'reset': 'reset', 'reboot': 'reboot_flag', 'drain': 'drain'}[health.recommended_action]
        ladder.add(Step(name, 'health %s: %s' % (health.status, '; '.join(health.reasons) or health.recommended_action), evidence))
    if not options.reset:
        for step in ladder.steps:
            if step.name == 'reset':
                step.name, step.why = 'drain', '%s (reset is off: drained instead)' % step.why


def plan_remediation(snapshot, options, ladder_state=None, reboot_flag=None, boot=None):
    """One GpuLadder per selected GPU (the steps in ladder order) for ``snapshot``.

    ``ladder_state``: the remembered state (handled events); ``reboot_flag``: the current boot's flag
    (its GPUs wait for the reboot: their steps are left out); ``boot``: this boot's id (default: read).
    """
    handled = (ladder_state or {}).get('handled') or {}
    reset_at = (ladder_state or {}).get('reset_at') or {}
    waiting = ((reboot_flag or {}).get('gpus') or {})
    boot = boot_id() if boot is None else boot
    ladders = []
    for dev in _selected(snapshot, options):
        ladder = GpuLadder(dev)
        _classify(ladder, dev, options, handled, reset_at.get(dev.key), boot)
        if dev.key in waiting:
            ladder.awaiting_reboot = waiting[dev.key]
            ladder.steps = []
            ladder.status = 'awaiting_reboot'
        else:
            ladder.ordered()
            ladder.status = 'needs_remediation' if ladder.steps else 'ok'
        ladders.append(ladder)
    return ladders


# ---------------------------------------------------------------------------- running the steps
class Node(object):
    """Node-wide steps: the scheduler drain and the reboot flag."""

    def __init__(self, options, host, scheduler, slurm_client=None):
        self.options = options
        self.host = host
        self.scheduler = scheduler
        self.name = options.node_name or socket.gethostname().split('.')[0]
        self.slurm_client = slurm_client

    def slurm(self):
        """The Slurm client of the partition check (core/slurm.py: root-vouched commands, a deadline each)."""
        if self.slurm_client is None:
            from .slurm import SlurmClient  # pylint: disable=import-outside-toplevel  # only where Slurm drains
            self.slurm_client = SlurmClient()
        return self.slurm_client

    def drain_argv(self, verb, reason):
        """The command that drains (``drain``) or returns (``resume``) the node, or (None, why not)."""
        scontrol = self.host.tool('scontrol')
        if self.scheduler == 'slurmd' and scontrol:
            argv = [scontrol, 'update', 'nodename=%s' % self.name, 'state=%s' % verb]
            return argv + (['reason=%s' % reason] if verb == 'drain' else []), 'slurm'
        if self.options.drain_command:
            return self.options.drain_command + [verb, self.name, reason], 'drain_command'
        if self.scheduler == 'slurmd':
            return None, 'slurmd runs but scontrol was not found'
        return None, 'no root-vouched slurmd runs here and no drain_command is set'


def _reason(parts):
    text = 'gpufleet: ' + '; '.join(parts)
    text = printable(text).replace('\n', ' ')
    return text[:REASON_LEN]


def _started_before(proc, event):
    """True when ``proc`` (a GpuProcess of this moment) started before ``event``, False when not, None when it cannot
    be told.  In the kernel's own clocks when the record has its stamp: /proc/PID/stat's start (clock ticks since
    boot, CLOCK_BOOTTIME) against the record's microseconds since boot (a suspend can only make a process look
    younger); else that start as an epoch time (through CLOCK_BOOTTIME now: no rounding of the boot time) against
    the event's time."""
    ident = proc.identity
    if ident is None or ident.starttime is None:
        return None
    try:
        started = ident.starttime / float(os.sysconf('SC_CLK_TCK'))
    except (ValueError, OSError, AttributeError):
        return None
    stamp = getattr(event, 'stamp', None)
    if stamp is not None:
        return started < stamp / 1e6
    if event.time is None or not hasattr(time, 'CLOCK_BOOTTIME'):
        return None
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started) < event.time


def _kill_refusal(snapshot, proc, now_dev, event, pid, index):
    """(status, why) when the pid an application Xid names must not be ended now, or None when it may be (reclaim
    then checks protection and identity again before each signal)."""
    if now_dev is None:
        return 'done', 'GPU %s is not found any more: nothing to terminate' % index
    if proc is None or now_dev.index not in (proc.gpu_indexes or []):
        if proc is not None or snapshot.holder(pid) is not None:
            return 'skipped', ('the driver does not list pid %d on GPU %s (a process that only holds a GPU device file, or '
                               'runs on another GPU, is not the one the Xid names): not terminated' % (pid, index))
        return 'done', 'pid %d no longer runs on GPU %s: nothing to terminate' % (pid, index)
    if not proc.found or proc.identity is None:
        return 'skipped', 'pid %d is not visible in this PID namespace: not terminated' % pid
    if not event.name:
        return 'skipped', 'the Xid names no process name to check pid %d against: not terminated' % pid
    comm = printable(proc.identity.comm)
    if comm != event.name:
        return 'skipped', 'pid %d is %s now, the Xid names %s (another process): not terminated' % (pid, comm, event.name)
    started = _started_before(proc, event)
    if started is None:
        return 'skipped', 'the start of pid %d cannot be compared with the time of the Xid: not terminated' % pid
    if not started:
        return 'skipped', 'pid %d started after the Xid (the pid was reused): not terminated' % pid
    return None


def _kill(step, dev, options, host, check_mode, planned):
    """Terminate the pid an application Xid names, only when at this moment the driver lists that pid on that GPU,
    its name (comm) is the one the record gives and it started before the record (else another process has the
    number); through reclaim: protected processes never, identity checked again before each signal.  A pid the
    driver did not list on that GPU in the ladder's own snapshot (``planned``) is refused from it: only a listed
    one costs a new snapshot, so a flood of Xids naming other pids costs no driver reads."""
    pid = step.pid
    snapshot = planned if pid not in dev.pids else host.snapshot(vendor=options.vendor, gather_processes=True)
    proc = snapshot.process(pid)
    now_dev = next((d for d in snapshot.all_devices if d.uuid == dev.uuid), None)
    refused = _kill_refusal(snapshot, proc, now_dev, step.event, pid, dev.index)
    if refused is not None:
        step.status, step.detail = refused
        return False
    ropts = ReclaimOptions(signal='TERM', timeout=options.kill_timeout, force=True, tree=True, release_timeout=RELEASE_TIMEOUT,
                           protect_names=options.protect_names, protect_users=options.protect_users, vendor=dev.vendor,
                           audit_path=options.audit_path, kill_timeout=SIGKILL_WAIT)
    result = reclaim(Selector(pids=[pid], gpus=[str(now_dev.index)]), ropts, check_mode=check_mode, snapshot=snapshot,
                     dev_roots=host.dev_roots)
    step.result = {'killed': result['killed'], 'skipped': result['skipped'], 'failed': result['failed']}
    if result['killed']:
        step.status = 'would_run' if check_mode else 'done'
        step.detail = '%s pid %d (%s)' % ('would terminate' if check_mode else 'terminated', pid, proc.name)
        return not check_mode
    why = '; '.join(str(e.get('reason')) for e in result['skipped'] + result['failed']) or 'not selected'
    step.status, step.detail = ('would_fail' if check_mode else 'failed') if result['failed'] else 'skipped', \
        'pid %d was not terminated: %s' % (pid, why)
    return False


def _reset(step, dev, options, host, check_mode):
    """reset.reset on this GPU; returns (changed, escalate reason or None)."""
    result = reset(options.reset_for(dev), host, check_mode=check_mode)
    entry = result['resets'][0] if result['resets'] else None
    step.result = {'msg': result['msg'], 'services': result['services']}
    if entry is None:
        step.status, step.detail = 'done', 'the GPU is not selected any more'
        return False, None
    step.result.update(status=entry['status'], verified=entry['verified'], preconditions=entry['preconditions'],
                       blocking_clients=entry['blocking_clients'], kernel_modules=entry['kernel_modules'])
    changed = result['changed'] and not check_mode
    if entry['status'] in ('reset', 'would_reset'):
        step.status = 'would_run' if check_mode else 'done'
        step.detail = 'would reset' if check_mode else 'reset and verified'
        step.result['reset_at'] = entry['reset_at']
        return changed, None
    step.status = 'would_be_refused' if check_mode and entry['status'] == 'refused' else entry['status']
    step.detail = entry['error']
    if entry.get('reboot_recommended'):
        return changed, entry['reboot_reason']
    return changed, None


def _run_reset(step, ladder, options, host, run):
    """The reset step of ``ladder`` (escalating a refused or failed one); records a verified reset.  Returns changed."""
    changed, escalate = _reset(step, ladder.dev, options, host, run.check_mode)
    if step.status == 'done':
        ladder.reset_at = step.result.get('reset_at')
        run.record('reset', ladder.dev.key, step.why)
        for unit in (step.result.get('services') or {}).get('stopped') or ():
            run.record('stop_service', ladder.dev.key, str(unit))
    if step.status not in ('done', 'would_run'):
        if escalate is not None:
            ladder.add(Step('reboot_flag', escalate, {'source': 'reset', 'error': step.detail}))
        ladder.add(Step('drain', 'the reset did not recover the GPU', {'source': 'reset', 'error': step.detail}))
    return changed


class Run(object):
    """One pass of the ladder over the node: what changed, what was logged."""

    def __init__(self, options, host, check_mode):
        self.options = options
        self.host = host
        self.check_mode = check_mode
        self.changed = False
        self.warnings = []
        self.errors = []
        self.snapshot = None        # the snapshot the ladder was planned from
        self.state = None           # the ladder's state (its disruption history: the budget's counts)
        self.now = None
        self.exhausted = []         # the steps the budget held: {'step', 'gpu', 'why'}

    def record(self, action, gpu=None, detail=None):
        """A disruptive action taken (core/disruption.py): the budget's next counts, and the fleet limit's."""
        if not self.check_mode:
            self.state['disruptions'].append(disruption.entry(action, self.now, gpu=gpu, by='remediate', detail=detail))

    def audit(self, record):
        if self.check_mode or not self.options.audit_path:
            return
        record = dict(record, event='gpu_remediation', actor=audit_log.actor())
        try:
            audit_log.append(self.options.audit_path, record)
        except audit_log.AuditLogError as exc:
            self.warnings.append(str(exc))


def _write_flag(options, flag):
    safe_files.write_atomic(options.reboot_flag, json.dumps(flag, indent=1, sort_keys=True) + '\n', mode=0o644)


def _remove(path):
    directory, name = os.path.split(path)
    dir_fd = safe_files.open_dir(directory)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


def remediate(options, host=None, check_mode=False, snapshot=None, scheduler=None, now=None, slurm_client=None):
    """Run the ladder once and return the result (gpu_remediate's return values).

    ``snapshot``: the guard's tick (taken with ``xid_since=health_since(...)`` of this ladder's state);
    else the ladder reads the GPUs itself, through ``host`` (its ``driver_timeout``: a hung driver raises
    watchdog.DriverHung before anything is done).  ``scheduler`` ('slurmd', 'kubelet' or None; default
    read from /proc), ``now`` and ``slurm_client`` (the partition check's core.slurm.SlurmClient) are seams.  Nothing
    is changed in ``check_mode``.  The budget (``options.budget``, core/budget.py) holds the steps past it.
    """
    now = time.time() if now is None else now
    host = host or Host()
    run = Run(options, host, check_mode)
    run.warnings.extend(host.tool_notes)
    state, problem = load_ladder_state(options)
    if problem:
        run.warnings.append(problem)
    if snapshot is None:
        snapshot = host.snapshot(vendor=options.vendor, gather_processes=True, xid_since=health_since(state, now))
    run.warnings.extend(snapshot.errors)
    run.snapshot, run.state, run.now = snapshot, state, now
    current_boot = boot_id()
    flag, stale = disruption.load_reboot_flag(options.reboot_flag, current_boot)
    flag_removed = False
    if stale:
        if not check_mode:
            _remove(options.reboot_flag)
            run.changed = True
            run.audit({'step': 'reboot_flag', 'status': 'removed', 'why': 'written before the last boot', 'flag': flag})
        flag_removed = True
        flag = None
    ladders = plan_remediation(snapshot, options, state, flag, current_boot)
    node = Node(options, host, scheduler_daemon() if scheduler is None else scheduler, slurm_client)
    reboot_wanted = dict((flag or {}).get('gpus') or {})
    drain_reasons = []
    for ladder in ladders:
        _run_gpu(ladder, options, host, run, reboot_wanted, drain_reasons)
    node_steps = _node_steps(run, node, options, state, flag, reboot_wanted, drain_reasons, ladders, current_boot, now)
    for ladder in ladders:  # the GPU's node-wide steps carry the node's outcome
        for step in ladder.steps:
            outcome = node_steps.get('drain' if step.name == 'drain' else 'reboot_flag') if step.status == 'node' else None
            if outcome:
                step.status, step.detail = 'node_%s' % outcome['status'], outcome.get('detail') or outcome.get('reason')
        if not check_mode and not any(s.status.replace('node_', '', 1) in (EXHAUSTED, PARTITION_LIMIT) for s in ladder.steps):
            for key in ladder.handled:   # a step the budget held leaves its events unhandled: it comes back
                state['handled'][key] = now
        if not check_mode and ladder.reset_at is not None:
            state['reset_at'][ladder.dev.key] = ladder.reset_at
    if not check_mode and options.state_path:
        _save_state(options, state, run)
    return _result(run, ladders, node_steps, reboot_wanted, state, flag_removed)


def _run_gpu(ladder, options, host, run, reboot_wanted, drain_reasons):
    dev = ladder.dev
    label = 'GPU %s (%s)' % (dev.index, dev.pci_bus_id or dev.uuid or 'not answering')
    escalate = None
    for step in list(ladder.steps):
        if step.name == 'kill_application':
            run.changed |= _kill(step, dev, options, host, run.check_mode, run.snapshot)
        elif step.name == 'reset':
            why = options.budget.reset_refusal(run.state['disruptions'], dev.key, run.now)
            if why is not None:   # past the budget: not reset, no escalation; a human decides
                step.status, step.detail = EXHAUSTED, why
                run.exhausted.append({'step': 'reset', 'gpu': dev.index, 'why': why})
            else:
                run.changed |= _run_reset(step, ladder, options, host, run)
        if step.name in ('kill_application', 'reset'):
            run.audit({'step': step.name, 'status': step.status, 'why': step.why, 'detail': step.detail,
                       'evidence': step.evidence, 'gpu': {'index': dev.index, 'uuid': dev.uuid, 'pci_bus_id': dev.pci_bus_id},
                       'pid': step.pid, 'result': step.result})
    rebooting = any(step.name == 'reboot_flag' for step in ladder.steps)
    for step in ladder.steps:   # the node-wide steps: carried out once for the node (_node_steps)
        if step.name == 'drain':
            if not rebooting:   # the reboot's reason says it
                drain_reasons.append('%s: %s' % (label, step.why))
            step.status = 'node'
        elif step.name == 'reboot_flag':
            reboot_wanted[dev.key] = printable(step.why)
            drain_reasons.append('%s: reboot wanted (%s)' % (label, step.why))
            step.status = 'node'
    ladder.ordered()
    if any(s.name == 'reboot_flag' for s in ladder.steps):
        ladder.status = 'reboot_wanted'
    elif any(s.status in ('failed', 'refused', 'would_fail', 'would_be_refused') for s in ladder.steps):
        ladder.status = 'blocked'
    elif ladder.steps:
        ladder.status = 'would_remediate' if run.check_mode else 'remediated'


def _drain_budget(node, options, state, drain_reasons, now):
    """(argv, via, reason, held) of the node's drain: held is (status, why) when the budget holds it, else None."""
    if not (drain_reasons and options.drain) or state.get('drained'):
        return None, None, None, None
    reason = _reason(sorted(set(drain_reasons)))
    argv, via = node.drain_argv('drain', reason)
    why = options.budget.node_refusal(state['disruptions'], 'drain', now)
    if why is not None:
        return argv, via, reason, (EXHAUSTED, why)
    partition = options.budget.partition_refusal(node.name, node.slurm()) if via == 'slurm' else None
    return argv, via, reason, (PARTITION_LIMIT, partition) if partition else None


def _node_steps(run, node, options, state, flag, reboot_wanted, drain_reasons, ladders, current_boot, now):
    out = {'scheduler': node.scheduler, 'node_name': node.name, 'drain': None, 'undrain': None, 'reboot_flag': None}
    flag_gpus = dict((flag or {}).get('gpus') or {})
    argv, via, reason, drain_held = _drain_budget(node, options, state, drain_reasons, now)
    # a new flag (none of this boot yet) is within the budget, one per node per window (adding a GPU to it is not), and
    # goes with its drain: a flag without the drain would leave the GPU waiting for a reboot and the drain never retried
    held = None
    if reboot_wanted and not flag_gpus:
        why = options.budget.node_refusal(state['disruptions'], 'reboot_flag', now)
        held = (EXHAUSTED, why) if why else drain_held
    if options.reboot_flag and held is not None:
        out['reboot_flag'] = _held(run, 'reboot_flag', held[0], held[1], path=options.reboot_flag, gpus=reboot_wanted)
    elif options.reboot_flag and reboot_wanted and reboot_wanted != flag_gpus:
        new_flag = {'boot_id': current_boot, 'time': audit_log.now_iso(), 'gpus': reboot_wanted,
                    'reasons': sorted(set(reboot_wanted.values()))}
        step = {'path': options.reboot_flag, 'gpus': reboot_wanted, 'status': 'would_write' if run.check_mode else 'written'}
        if not run.check_mode:
            try:
                _write_flag(options, new_flag)
                run.changed = True
                if not flag_gpus:
                    run.record('reboot_flag', detail='; '.join(new_flag['reasons']))
            except OSError as exc:
                step['status'], step['error'] = 'failed', 'cannot write %s: %s' % (options.reboot_flag, exc)
                run.errors.append(step['error'])
        out['reboot_flag'] = step
        run.audit({'step': 'reboot_flag', 'status': step['status'], 'path': options.reboot_flag, 'gpus': reboot_wanted})
    elif reboot_wanted:
        out['reboot_flag'] = {'path': options.reboot_flag, 'gpus': reboot_wanted,
                              'status': 'present' if options.reboot_flag else 'off (reboot_flag is empty)'}
    drained = state.get('drained')
    if drain_reasons and options.drain and drained:
        out['drain'] = {'status': 'already', 'reason': drained.get('reason'), 'via': drained.get('via')}
    elif drain_held is not None:
        out['drain'] = _held(run, 'drain', drain_held[0], drain_held[1], reason=reason, via=via)
    elif reason is not None:
        out['drain'] = _node_command(run, argv, via, reason, 'drain')
        if out['drain']['status'] == 'done':
            state['drained'] = {'reason': reason, 'via': via, 'time': now}
            run.record('drain', detail=reason)
    elif drained and not reboot_wanted and all(_clean(ladder) for ladder in ladders):
        argv, via = node.drain_argv('resume', drained.get('reason') or 'gpufleet: health reads clean')
        out['undrain'] = _node_command(run, argv, via, 'health reads clean on every GPU', 'undrain')
        if out['undrain']['status'] == 'done':
            state['drained'] = None
    return out


def _held(run, name, status, why, **fields):
    """The node step ``name`` the budget holds (status budget_exhausted or partition_limit), recorded and audited."""
    run.exhausted.append({'step': name, 'gpu': None, 'why': why})
    step = dict(fields, status=status, detail=why)
    run.audit(dict(step, step=name))
    return step


def _clean(ladder):
    dev = ladder.dev
    return dev.health.status == 'ok' and not ladder.steps and (dev.orphaned_mib or 0) == 0


def _node_command(run, argv, via, reason, name):
    if argv is None:
        return {'status': 'unavailable', 'detail': via, 'reason': reason}
    if run.check_mode:
        return {'status': 'would_run', 'command': argv, 'via': via, 'reason': reason}
    rc, out, err = run.host.run(argv)
    step = {'status': 'done' if rc == 0 else 'failed', 'command': argv, 'via': via, 'reason': reason, 'rc': rc,
            'output': printable((out + err).strip()[-2000:])}
    if rc == 0:
        run.changed = True
    else:
        run.errors.append('%s failed (rc %d): %s' % (' '.join(argv[:3]), rc, step['output']))
    run.audit(dict(step, step=name))
    return step


def _save_state(options, state, run):
    handled = state['handled']
    if len(handled) > MAX_HANDLED:
        for key in sorted(handled, key=lambda k: handled[k])[:len(handled) - MAX_HANDLED]:
            del handled[key]
    window = time.time() - DEFAULT_WINDOW_S   # an older reset time changes no health (health_since)
    state['reset_at'] = dict((key, when) for key, when in state['reset_at'].items() if when > window)
    try:
        with disruption.locked(options.state_path):   # gpu_reset may have recorded a reset meanwhile: kept
            state['disruptions'] = disruption.merged(options.state_path, state['disruptions'], time.time())
            safe_files.write_atomic(options.state_path, json.dumps(state, sort_keys=True) + '\n', mode=0o600)
    except OSError as exc:
        run.errors.append('cannot save the ladder state %s: %s' % (options.state_path, exc))


def _result(run, ladders, node_steps, reboot_wanted, state, flag_removed):
    gpus = [ladder.to_dict() for ladder in ladders]
    acted = [g['index'] for g in gpus if g['ladder']]
    verb = 'would remediate' if run.check_mode else 'remediated'
    msg = '%s %d GPU(s)%s' % (verb, len(acted), (': %s' % ', '.join(str(i) for i in acted)) if acted else '')
    if not acted:
        msg = 'no GPU needs remediation'
    if reboot_wanted:
        msg += '; reboot wanted (%s)' % ', '.join(sorted(reboot_wanted))
    if run.exhausted:
        msg += '; held by the ladder\'s budget: %s' % ' | '.join(e['why'] for e in run.exhausted)
    if run.errors:
        msg += '; errors: %s' % ' | '.join(run.errors)
    return {'changed': run.changed, 'gpus': gpus, 'node': node_steps, 'reboot_wanted': bool(reboot_wanted),
            'reboot_reasons': sorted(set(reboot_wanted.values())), 'drained': bool(state.get('drained')),
            'stale_reboot_flag_removed': flag_removed, 'errors': list(run.errors), 'msg': printable(msg),
            'warnings': list(run.warnings), 'disruptive': disruptive_actions(gpus),
            'remediation_budget_exhausted': bool(run.exhausted),
            'budget': dict(run.options.budget.to_dict(), exhausted=list(run.exhausted))}
