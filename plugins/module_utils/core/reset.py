# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""GPU reset: which GPUs, every precondition checked by name, the vendor reset, and proof.

``reset()`` runs in this order:

1. One snapshot of the host.  It closes every vendor library session on its way out, and the
   ``nvml_session`` check asserts that this process holds no NVML session (a reset needs that).
2. The GPUs: ``gpus`` (indexes or UUIDs), ``all_gpus``, or ``when_needed`` (health recommends a
   reset, or more than ``orphan_threshold_mib`` MiB are held by no process).
3. Per GPU, every precondition is evaluated read-only and recorded as a Check (pass, fail, warn,
   not_exposed, not_applicable) with a message that says what to do.  The processes that
   ``kill_processes`` would terminate come from the gpu_kill machinery (``reclaim`` in check mode).
   Check mode stops here.  A GPU with a failed check is never touched; the others go on.
4. ``stop_services`` are stopped once (only units that were active), and the blocking clients
   are checked again.  Then per GPU: persistence mode off (NVIDIA), drain (NVIDIA, best effort),
   terminate its processes (reclaim: TERM, then KILL), assert no NVML session, the vendor reset,
   verification (the device answers, health ok, orphaned memory at most the threshold), drain
   undone, persistence mode restored, one audit log line.  Each vendor step is a hook of the
   vendor's backend (backends/base.py: reset_checks, persistence_off, drain_on, session_blocks_reset,
   reset_device, drain_off, persistence_restore); this file and reset_plan.py never name a vendor.
5. The stopped services are started again, whatever happened.

Selection, preconditions and verification are in reset_plan.py (re-exported here).  Commands
always run as argument lists.  Tools are passed in (``Host.tools``); the default finds
them with safe_files.find_program (as root, never one that a user could have planted).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from . import audit_log, kmod, watchdog
from .safe_files import find_program
from .backends import REGISTRY, vendor_backend
from .backends.base import (FAIL, NOT_APPLICABLE, NOT_EXPOSED, PASS, REBOOT_ACTIONS, WARN,  # noqa: F401 pylint: disable=unused-import
                            error_text, last_line as _last_line, recovery_action)
from .errors import InvalidArgument
from .constants import DEFAULT_PROTECT_NAMES
from .kmod import uvm_files  # noqa: F401 pylint: disable=unused-import
from .reset_plan import (BLOCKING_CLIENTS, CHECK_NAMES, COMM_LEN, RELEASE_TIMEOUT, SIGKILL_WAIT,  # noqa: F401 pylint: disable=unused-import
                         STOPPABLE_UNITS, Check, GpuReset, _describe, _kill_plan, _label, _stoppable, _who, blocking_client,
                         choose, evaluate, find_again, healthy, needs_reset, users_of, verify)
from .snapshot import take_snapshot

# The commands a reset may run: each vendor's reset tools, then the vendor-neutral ones.
TOOLS = tuple(tool for cls in REGISTRY.values() for tool in cls.reset_tools) + ('systemctl', 'scontrol')
AUTO = 'auto'
UNIT_RE = re.compile(r'^[A-Za-z0-9][A-Za-z0-9:_.@\\-]*$')


class ResetOptions(object):
    """What to reset and how.  Validated here, before anything is read."""

    def __init__(self, gpus=None, all_gpus=False, when_needed=False, orphan_threshold_mib=1024, kill_processes=False,
                 kill_timeout=10.0, protect_names=DEFAULT_PROTECT_NAMES, protect_users=(), stop_services=(), drain=False,
                 verify_timeout=60.0, vendor='auto', audit_path=None, mig_reset=None):
        if not (gpus or all_gpus or when_needed):
            raise InvalidArgument('gpus', gpus, 'say which GPUs to reset: gpus (indexes or UUIDs), all: true, or when_needed: true')
        if gpus and all_gpus:
            raise InvalidArgument('all', all_gpus, 'all and gpus are mutually exclusive')
        for name, value in (('orphan_threshold_mib', orphan_threshold_mib), ('kill_timeout', kill_timeout),
                            ('verify_timeout', verify_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidArgument(name, value, 'expected a number, 0 or more')
        for unit in stop_services or ():
            if not isinstance(unit, str) or not UNIT_RE.match(unit):
                raise InvalidArgument('stop_services', unit, 'not a systemd unit name (or auto)')
        self.gpus = [str(g) for g in gpus] if gpus else None
        self.all_gpus = bool(all_gpus)
        self.when_needed = bool(when_needed)
        self.orphan_threshold_mib = orphan_threshold_mib
        self.kill_processes = bool(kill_processes)
        self.kill_timeout = float(kill_timeout)
        self.protect_names = tuple(protect_names or ())
        self.protect_users = tuple(protect_users or ())
        self.stop_services = [u for u in stop_services or () if u != AUTO]
        self.auto_services = AUTO in (stop_services or ())
        self.drain = bool(drain)
        self.verify_timeout = float(verify_timeout)
        self.vendor = vendor
        self.audit_path = audit_path or None
        if mig_reset not in (None, '', 'refuse', 'recreate'):
            raise InvalidArgument('mig_reset', mig_reset, 'expected refuse (the default) or recreate')
        self.mig_reset = 'recreate' if mig_reset == 'recreate' else None  # MIG on: refuse, or recreate the instances


def run_command(argv, timeout=600):
    """Run ``argv`` (a list, never a shell); returns (rc, stdout, stderr) as text."""
    try:
        proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, check=False)
    except OSError as exc:
        return 127, '', '%s: %s' % (argv[0], exc.strerror or exc)
    except subprocess.TimeoutExpired:
        return 124, '', '%s did not finish within %d s' % (argv[0], timeout)
    return proc.returncode, proc.stdout.decode('utf-8', 'replace'), proc.stderr.decode('utf-8', 'replace')


class Host(object):
    """Everything outside Python that a reset uses.  The defaults are the real host; tests pass seams.

    tools: name -> absolute path or None (default: find_program of TOOLS; why a planted candidate was passed
    over goes into ``tool_notes``, and from there into the result's warnings).  runner(argv) -> (rc, out, err).
    sys_root: where sysfs is (Intel PCI reset, kernel-module references; default kmod.sys_root()).
    dev_roots, factories: passed to take_snapshot.
    nvml: the pynvml module for drain and NVLink queries.  amdsmi: the amdsmi module, or False for "not installed".
    driver_timeout: the snapshots' driver reads run in a watchdog child with this deadline (None: in this process).
    """

    def __init__(self, tools=None, runner=None, sys_root=None, dev_roots=None, factories=None, nvml=None, amdsmi=None,
                 euid=None, clock=time.monotonic, sleep=time.sleep, poll=0.5, driver_timeout=None):
        self.tool_notes = []
        self.tools = find_tools(self.tool_notes) if tools is None else dict(tools)
        self.runner = runner or run_command
        self.sys_root = kmod.sys_root(sys_root)
        self.dev_roots = dev_roots
        self.factories = factories
        self.nvml = nvml
        self.amdsmi = amdsmi
        self.euid = os.geteuid() if euid is None else euid
        self.clock = clock
        self.sleep = sleep
        self.poll = poll
        self.driver_timeout = driver_timeout

    def tool(self, name):
        return self.tools.get(name)

    def run(self, argv):
        rc, out, err = self.runner(list(argv))
        return rc, out or '', err or ''

    def snapshot(self, vendor='auto', gather_processes=True, xid_since=None):
        return take_snapshot(vendor=vendor, gather_processes=gather_processes, dev_roots=self.dev_roots,
                             factories=self.factories, driver_timeout=self.driver_timeout, xid_since=xid_since)


def find_tools(notes):
    """{name: path or None} of TOOLS (safe_files.find_program; ``notes`` gets why a candidate was passed over)."""
    return dict((name, find_program(name, refused=notes)) for name in TOOLS)


def module_host(module):
    """The real host of an Ansible module: tools found by safe_files.find_program (as ``module.get_bin_path``
    would find them, but never one a user could have planted), commands run by ``module.run_command`` (argument
    lists)."""
    def runner(argv):
        try:
            return module.run_command(argv, handle_exceptions=False)
        except OSError as exc:  # never fail_json half-way: the undo steps (persistence mode, drain, services) must run
            return 127, '', '%s: %s' % (argv[0], exc)

    return Host(runner=runner, driver_timeout=watchdog.check_timeout('driver_timeout', module.params.get('driver_timeout')))


# ---------------------------------------------------------------------------- services
class Services(object):
    """stop_services: stop the active ones once, start them again at the end."""

    def __init__(self, units, host):
        self.units = list(units)
        self.host = host
        self.stopped = []       # every unit this run stopped
        self.down = []          # stopped and not started again yet
        self.not_active = []
        self.started = []
        self.errors = []

    def stop(self):
        """Stop every active unit; returns an error text (after starting the stopped ones again) or None."""
        systemctl = self.host.tool('systemctl')
        for unit in self.units:
            rc, _out, _err = self.host.run([systemctl, 'is-active', '--quiet', unit])
            if rc != 0:
                self.not_active.append(unit)
                continue
            rc, out, err = self.host.run([systemctl, 'stop', unit])
            if rc != 0:
                self.start()
                return 'systemctl stop %s failed (rc %d): %s' % (unit, rc, _last_line(err or out))
            self.stopped.append(unit)
            self.down.append(unit)
        return None

    def start(self):
        systemctl = self.host.tool('systemctl')
        while self.down:
            unit = self.down.pop()
            rc, out, err = self.host.run([systemctl, 'start', unit])
            if rc == 0:
                self.started.append(unit)
            else:
                self.errors.append('systemctl start %s failed (rc %d): %s; start it by hand' % (unit, rc, _last_line(err or out)))

    def to_dict(self):
        return {'requested': list(self.units), 'stopped': list(self.stopped), 'not_active': list(self.not_active),
                'started': list(self.started), 'errors': list(self.errors)}


# ---------------------------------------------------------------------------- the actions for one GPU
def _empty(item, options, host):
    """Terminate the GPU's processes (kill_processes) from a fresh read; returns an error or None."""
    if not options.kill_processes:
        return None
    snapshot = host.snapshot(vendor=options.vendor, gather_processes=True)
    now = find_again(snapshot, item.dev)
    if now is None:
        return None
    procs, blockers = users_of(snapshot, now)
    if not procs:
        return None
    item.touched = True
    killed, refused = _kill_plan(snapshot, now, options, host, check_mode=False, blockers=blockers)
    item.killed = killed
    chosen = set(e['pid'] for e in killed)
    refused = [e for e in refused if e['pid'] not in chosen]
    if refused:
        return 'process(es) still on the GPU: %s' % '; '.join('%s: %s' % (_who(e), e.get('reason')) for e in refused)
    return None


def _act(item, options, host, warnings):
    """Everything that touches one GPU, in order, with the undo steps always run."""
    backend = vendor_backend(item.dev.vendor)
    error = backend.persistence_off(item, host, warnings)
    try:
        if error is None:
            if options.drain:
                item.drain['requested'] = True
                backend.drain_on(item, host, warnings)
            error = _empty(item, options, host)
        if error is None:
            error = backend.session_blocks_reset(host)
        if error is None:
            item.touched = True
            item.reset_at = round(time.time(), 3)
            error = backend.reset_device(item, host)
            if error is None:
                why = verify(item, options, host)
                item.verified = why is None
                if why is not None:
                    error = 'the reset ran but the GPU did not come back healthy within %g s: %s' % (options.verify_timeout, why)
    finally:
        undo = [e for e in (backend.drain_off(item, host), backend.persistence_restore(item, host)) if e]
    if error is None and undo:
        error = '; '.join(undo)
    elif undo:
        error = '%s; also: %s' % (error, '; '.join(undo))
    if error is None:
        item.status = 'reset'
    else:
        item.fail(error)
        if item.method is not None and item.reboot_reason is None:
            item.reboot_reason = 'the reset failed or did not verify: %s' % error


def _audit(item, options, warnings):
    if not options.audit_path or not item.touched:
        return
    dev = item.dev
    record = {'event': 'gpu_reset', 'actor': audit_log.actor(),
              'gpu': {'index': dev.index, 'uuid': dev.uuid, 'pci_bus_id': dev.pci_bus_id, 'vendor': dev.vendor, 'name': dev.name},
              'selected_because': item.reasons, 'status': item.status, 'verified': item.verified, 'error': item.error,
              'method': item.method, 'command': item.command, 'killed': item.killed, 'persistence_mode': item.persistence,
              'drain': item.drain, 'before': item.before, 'after': item.after, 'mig': item.mig}
    try:
        audit_log.append(options.audit_path, record)
    except audit_log.AuditLogError as exc:
        warnings.append(str(exc))


def _recheck_blockers(items, host, options, units):
    """After stop_services: fail the GPUs that blocking clients still hold."""
    snapshot = host.snapshot(vendor=options.vendor, gather_processes=True)
    for item in items:
        now = find_again(snapshot, item.dev)
        if now is None:
            continue
        _procs, blockers = users_of(snapshot, now)
        if blockers:
            names = ', '.join('%s (pid %s)' % (b['client'], b['pid']) for b in blockers)
            item.check('blocking_clients', FAIL, 'still running after stopping %s: %s; stop the service that runs it and add '
                                                 'it to stop_services' % (', '.join(units), names))
            item.blockers = blockers
            item.fail('blocking_clients: %s' % item.checks[-1].detail)
        else:
            item.check('blocking_clients', PASS, 'no blocking client left after stopping %s' % ', '.join(units))


# ---------------------------------------------------------------------------- the entry point
def reset(options, host=None, check_mode=False):
    """Run one gpu_reset and return the module's result dictionary (``failed_gpus`` non-empty = failure)."""
    host = host or Host()
    started = host.clock()
    warnings = list(host.tool_notes)
    snapshot = host.snapshot(vendor=options.vendor, gather_processes=True)
    warnings.extend(snapshot.errors)
    items = choose(snapshot, options)
    evaluate(items, snapshot, options, host)
    for item in items:
        bad = item.failed_checks()
        if bad:
            item.status = 'refused'
            item.error = '; '.join('%s: %s' % (c.name, c.detail) for c in bad)
        else:
            item.status = 'would_reset' if check_mode else None
    ready = [item for item in items if item.status is None]
    services = Services(_units_to_stop(ready, options), host)
    if ready and services.units:
        error = services.stop()
        if error is not None:
            for item in ready:
                item.fail('stop_services: %s; nothing was reset' % error)
            ready = []
        elif services.stopped:
            _recheck_blockers(ready, host, options, services.units)
            ready = [item for item in ready if item.status is None]
    try:
        for item in ready:
            begun = host.clock()
            try:
                _act(item, options, host, warnings)
            except Exception as exc:  # pylint: disable=broad-except
                item.fail('unexpected error: %s' % error_text(exc))  # one GPU's failure never stops the others
            item.seconds = round(host.clock() - begun, 3)
            warnings.extend(item.notes)
            _audit(item, options, warnings)
    finally:
        services.start()
    return _result(items, options, services, warnings, check_mode, host.clock() - started)


def _units_to_stop(items, options):
    """stop_services, plus with ``auto`` the stoppable units of the blocking clients of ``items``."""
    units = list(options.stop_services)
    if options.auto_services:
        for item in items:
            for blocker in item.blockers:
                if blocker.get('unit') in STOPPABLE_UNITS and blocker['unit'] not in units:
                    units.append(blocker['unit'])
    return units


def _result(items, options, services, warnings, check_mode, seconds):
    ok = [item.dev.index for item in items if item.status in ('reset', 'would_reset')]
    bad = [item.dev.index for item in items if item.status in ('failed', 'refused')]
    if check_mode:
        changed = bool(ok)
    else:
        changed = any(item.touched for item in items) or bool(services.stopped)
    warnings = list(warnings) + list(services.errors)
    parts = []
    for item in items:
        if item.status in ('failed', 'refused'):
            parts.append('%s: %s' % (_label(item.dev), item.error))
    verb = 'would reset' if check_mode else 'reset'
    if not items:
        msg = 'no GPU needs a reset' if options.when_needed else 'no GPU selected'
    else:
        msg = '%s %d GPU(s)%s' % (verb, len(ok), (': %s' % ', '.join(str(i) for i in ok)) if ok else '')
        if ok and not check_mode:
            msg += ' (verified)'
    if bad:
        verdict = 'would fail' if check_mode else 'failed'
        tail = '; %s' % msg if ok else ''
        msg = 'gpu_reset %s on GPU(s) %s: %s%s' % (verdict, ', '.join(str(i) for i in bad), ' | '.join(parts), tail)
    return {
        'changed': changed,
        'resets': [item.to_dict() for item in items],
        'reset_gpus': ok,
        'failed_gpus': bad,
        'services': services.to_dict(),
        'seconds': round(seconds, 3),
        'msg': msg,
        'warnings': warnings,
    }


# The vendor resets under their former names (callers and tests that go straight to a vendor's reset).
reset_nvidia, reset_amd, reset_intel = (vendor_backend(name).reset_device for name in ('nvidia', 'amd', 'intel'))
