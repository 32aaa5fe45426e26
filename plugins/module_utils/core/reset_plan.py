# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The plan and the proof of a GPU reset: which GPUs, who uses them, every precondition, verification.

Vendor-neutral: what differs by vendor (the reset tool and the vendor's own preconditions, the
device files a GPU's driver shares) is asked of the vendor's backend hooks (backends/base.py).
reset.py runs the plan.
"""

from __future__ import annotations

import os

from . import notify
from .backends import REGISTRY, vendor_backend
from .backends.base import FAIL, NOT_APPLICABLE, PASS, WARN, pci_bdf
from .fdwalk import incomplete_text
from .identity import name_trusted
from .reclaim import ReclaimOptions, reclaim
from .select import Selector
from .snapshot import resolve_gpus
from .text import printable

CHECK_NAMES = ('vendor', 'root', 'tool', 'mig', 'nvlink', 'fabric_manager', 'persistence_mode', 'nvml_session',
               'recovery_action', 'kernel_modules', 'services', 'blocking_clients', 'processes')
# Clients that keep a GPU from being reset, with the systemd unit that usually runs each one.
# They are never terminated (they are in the default protect_names): they are stopped as services.
BLOCKING_CLIENTS = (
    ('nvidia-persistenced', 'nvidia-persistenced'),
    ('nv-hostengine', 'nvidia-dcgm'),
    ('dcgm-exporter', 'dcgm-exporter'),
    ('dcgmi', None),
    ('Xorg', 'display-manager'),
    ('X', 'display-manager'),
    ('Xwayland', 'display-manager'),
    ('nvidia-smi', None),
    ('nv-fabricmanager', 'nvidia-fabricmanager'),
    ('nvidia-imex', 'nvidia-imex'),
)
# The units ``stop_services: [auto]`` may stop: those of the blocking clients found, when listed here.
# A display manager is never stopped on its own: people work on it.
STOPPABLE_UNITS = ('nvidia-persistenced', 'nvidia-dcgm', 'dcgm-exporter', 'nvidia-fabricmanager', 'nvidia-imex')
COMM_LEN = 15                                     # the kernel keeps 15 characters of a process name
RELEASE_TIMEOUT = 10.0                            # seconds for the driver to drop killed processes
SIGKILL_WAIT = 5.0


class Check(object):
    """One precondition: ``name`` (CHECK_NAMES), ``status`` and a ``detail`` that says what to do."""

    def __init__(self, name, status, detail):
        self.name = name
        self.status = status
        self.detail = detail

    def to_dict(self):
        return {'name': self.name, 'status': self.status, 'detail': self.detail}


# ---------------------------------------------------------------------------- one GPU
def _state_view(dev):
    """What ``before`` and ``after`` report about a GPU."""
    if dev is None:
        return None
    return {'memory_used_mib': dev.memory_used_mib, 'orphaned_mib': dev.orphaned_mib, 'health': dev.health.to_dict(),
            'processes': dev.pids, 'persistence_mode': dev.persistence_mode}


def _label(dev):
    return 'GPU %s (%s)' % (dev.index, dev.pci_bus_id or dev.uuid or '%s index %s' % (dev.vendor, dev.vendor_index))


def _who(entry):
    """A process in a message (the process's name is its user's text: escaped)."""
    return printable('pid %s %s (%s)' % (entry.get('pid'), entry.get('name') or '?', entry.get('user') or '?'))


def _describe(proc, devices=None):
    out = {'pid': proc.pid, 'name': proc.name, 'user': proc.user,
           'cmdline': notify.redact_argv(list(proc.cmdline or []), notify.default_patterns())}
    if devices is not None:
        out['devices'] = list(devices)
    return out


class GpuReset(object):
    """The plan and the outcome for one GPU."""

    def __init__(self, dev, reasons):
        self.dev = dev
        self.reasons = list(reasons)
        self.checks = []
        self.processes = []
        self.blockers = []
        self.would_kill = []
        self.killed = []
        self.status = None
        self.error = None
        self.method = None
        self.command = None
        self.output = None
        self.persistence = {'before': vendor_backend(dev.vendor).persistence_mode(dev),
                            'switched_off': False, 'restored': None}
        self.drain = {'requested': False, 'enabled': False, 'restored': None, 'detail': None}
        self.before = _state_view(dev)
        self.after = None
        self.verified = False
        self.seconds = None
        self.reset_at = None
        self.touched = False
        self.notes = []
        self.kernel_modules = []
        self.reboot_reason = None
        self.mig_reset = None     # ResetOptions.mig_reset: 'recreate' lets a board in MIG mode be reset
        self.mig = None           # MIG on: {mode, destroys, layout, recreated, error} (backends/nvidia_mig.py)

    @property
    def label(self):
        """How messages name this GPU."""
        return _label(self.dev)

    @property
    def target(self):
        """How vendor tools name this GPU: the PCI bus id, else the vendor's own index."""
        return self.dev.pci_bus_id or str(self.dev.vendor_index)

    def check(self, name, status, detail):
        self.checks = [c for c in self.checks if c.name != name]
        self.checks.append(Check(name, status, detail))

    def failed_checks(self):
        return [c for c in self.checks if c.status == FAIL]

    def fail(self, error):
        if self.error is None:
            self.error = error
        self.status = 'failed'

    def to_dict(self):
        dev = self.dev
        return {
            'index': dev.index, 'uuid': dev.uuid, 'pci_bus_id': dev.pci_bus_id, 'vendor': dev.vendor, 'name': dev.name,
            'selected_because': list(self.reasons), 'status': self.status,
            'would_reset': not self.failed_checks(), 'reset': self.status == 'reset',
            'preconditions': [c.to_dict() for c in self.checks],
            'processes': list(self.processes), 'blocking_clients': list(self.blockers),
            'would_kill': list(self.would_kill), 'killed': list(self.killed),
            'method': self.method, 'command': self.command, 'output': self.output,
            'persistence_mode': dict(self.persistence), 'drain': dict(self.drain),
            'before': self.before, 'after': self.after, 'verified': self.verified, 'seconds': self.seconds,
            'reset_at': self.reset_at,
            'error': self.error, 'kernel_modules': [r.to_dict() for r in self.kernel_modules],
            'reboot_recommended': self.reboot_reason is not None, 'reboot_reason': self.reboot_reason,
            'mig': self.mig,
        }


# ---------------------------------------------------------------------------- selection
def needs_reset(dev, threshold):
    """Why ``dev`` needs a reset (health recommends one, or orphaned memory above ``threshold``): a list, empty if not.

    On a board in MIG mode with MIG devices the orphaned memory is each MIG device's own (``orphaned_mib`` per instance,
    readable without root): the board is needed when one instance holds more than ``threshold`` that none of its processes
    accounts for; the board's figure (the instances' sum, unknown to non-root) is not used then."""
    reasons = []
    if dev.health.recommended_action == 'reset':
        reasons.extend(dev.health.reasons or ['the health check recommends a reset'])
    if dev.mig_devices:
        for mig in dev.mig_devices:
            if mig.orphaned_mib is not None and mig.orphaned_mib > threshold:
                reasons.append('%d MiB of GPU memory on MIG device %s (%s) held by no process (orphan_threshold_mib %d)' % (
                    mig.orphaned_mib, mig.unit, mig.profile or 'unknown profile', threshold))
    elif dev.orphaned_mib is not None and dev.orphaned_mib > threshold:
        reasons.append('%d MiB of GPU memory held by no process (orphan_threshold_mib %d)' % (dev.orphaned_mib, threshold))
    return reasons


def choose(snapshot, options):
    """The GpuReset items for the GPUs ``options`` selects (raises InvalidArgument for an unknown GPU)."""
    devices = resolve_gpus(snapshot.all_devices, options.gpus)   # a MIG device names its board: a reset is per board
    items = []
    for dev in devices:
        if dev.orphaned_mib is None or any(m.orphaned_mib is None for m in dev.mig_devices or ()):
            dev.compute_orphaned()
        if options.when_needed:
            reasons = needs_reset(dev, options.orphan_threshold_mib)
            if reasons:
                items.append(GpuReset(dev, reasons))
        else:
            items.append(GpuReset(dev, ['requested (%s)' % ('all' if options.all_gpus else 'gpus')]))
    for item in items:
        item.mig_reset = getattr(options, 'mig_reset', None)
    return items


# ---------------------------------------------------------------------------- who uses a GPU
def _names(proc):
    names = set()
    for value in (proc.name, proc.exe, (proc.cmdline or [None])[0]):
        if value:
            names.add(os.path.basename(value.replace(' (deleted)', '')))
    return names


def blocking_client(proc):
    """(client name, suggested unit) when ``proc`` is a known reset-blocking client, else None.

    Only a process that a user could not have named so counts (identity.name_trusted): a user's
    process named nv-hostengine is one of the GPU's processes, not a service to stop.
    """
    if not name_trusted(getattr(proc, 'identity', None)):
        return None
    for name in _names(proc):
        for client, unit in BLOCKING_CLIENTS:
            if name == client or (len(name) == COMM_LEN and client.startswith(name)):
                return client, unit
    return None


def users_of(snapshot, dev):
    """(processes, blockers) on ``dev``: listed by the driver or holding its device file.

    Blockers are known NVML/driver clients (BLOCKING_CLIENTS) that hold the GPU's device file or
    a shared device file of its vendor's driver (the backend's shared_device_file); each carries
    ``client`` and ``unit``.
    """
    procs, blockers = [], []
    for proc in snapshot.processes:
        if dev.index in proc.gpu_indexes:
            _sort_user(proc, None, procs, blockers)
    for holder in snapshot.holders:
        mine = dev.index in holder.gpu_indexes
        shared = not holder.gpu_indexes and any(vendor_backend(dev.vendor).shared_device_file(p) for p in holder.devices)
        if mine or (shared and blocking_client(holder)):
            _sort_user(holder, holder.devices, procs, blockers)
    return procs, blockers


def _sort_user(proc, devices, procs, blockers):
    client = blocking_client(proc)
    entry = _describe(proc, devices)
    if client is None:
        procs.append(entry)
    else:
        entry['client'], entry['unit'] = client
        blockers.append(entry)


# ---------------------------------------------------------------------------- preconditions
def _stoppable(blocker, options):
    """Whether the caller lets this run stop ``blocker``'s unit."""
    unit = blocker.get('unit')
    return bool(options.stop_services) or (options.auto_services and unit in STOPPABLE_UNITS)


def _check_users(item, snapshot, options, host):
    dev = item.dev
    procs, blockers = users_of(snapshot, dev)
    item.processes, item.blockers = procs, blockers
    if blockers:
        names = '; '.join('%s (pid %s) holds %s' % (b['client'], b['pid'], ', '.join(b.get('devices') or ['the GPU']))
                          for b in blockers)
        units = sorted(set(b['unit'] for b in blockers if b['unit']))
        stuck = [b for b in blockers if not _stoppable(b, options)]
        if options.stop_services:
            item.check('blocking_clients', WARN, '%s; checked again after stopping %s' % (names, ', '.join(options.stop_services)))
        elif options.auto_services and not stuck:
            item.check('blocking_clients', WARN, '%s; stop_services auto stops %s, checks again, and starts them afterwards'
                       % (names, ', '.join(units)))
        elif options.auto_services:
            item.check('blocking_clients', FAIL, '%s: stop_services auto stops only %s; stop %s yourself' % (
                names, ', '.join(STOPPABLE_UNITS), ', '.join('%s (pid %s, unit %s)' % (b['client'], b['pid'], b['unit'] or 'none')
                                                             for b in stuck)))
        else:
            hint = 'for example with stop_services: [%s]' % ', '.join(units) if units else 'stop it'
            item.check('blocking_clients', FAIL, '%s: these clients block a reset; stop them first, %s' % (names, hint))
    else:
        note = ''
        if snapshot.fds_denied:
            note = ' (the open files of %d process(es) could not be read%s)' % (snapshot.fds_denied, '' if host.euid == 0 else ': run as root')
        clients = '/'.join(c for c, _u in BLOCKING_CLIENTS)
        if getattr(snapshot, 'holders_incomplete', None) is not None:
            # a warning, not a refusal: a user who opens enough descriptors must not be able to block every reset;
            # a holder left unseen makes the driver refuse the reset (the device is in use), which is reported
            item.check('blocking_clients', WARN, 'no %s holds the GPU among the processes read%s, but %s; if one of them '
                                                 'holds it, the reset fails' % (clients, note, incomplete_text(snapshot.holders_incomplete)))
        else:
            item.check('blocking_clients', PASS, 'no %s holds the GPU%s' % (clients, note))
    if not procs:
        item.check('processes', PASS, 'no process uses the GPU')
        return
    listed = ', '.join(_who(p) for p in procs[:10]) + (' and %d more' % (len(procs) - 10) if len(procs) > 10 else '')
    if not options.kill_processes:
        item.check('processes', FAIL, '%d process(es) use the GPU: %s; stop them, or set kill_processes: true to terminate '
                                      'them first (SIGTERM, then SIGKILL)' % (len(procs), listed))
        return
    would, refused = _kill_plan(snapshot, dev, options, host, check_mode=True, blockers=blockers)
    item.would_kill = would
    chosen = set(e['pid'] for e in would)
    refused = [e for e in refused if e['pid'] not in chosen]
    if refused:
        item.check('processes', FAIL, '; '.join('%s cannot be terminated: %s' % (_who(e), e.get('reason')) for e in refused) +
                   '; stop it yourself (or change protect_names / protect_users), then run the reset again')
    else:
        item.check('processes', PASS, '%d process(es) will be terminated first (SIGTERM, SIGKILL after %g s): %s'
                   % (len(would), options.kill_timeout, ', '.join(_who(e) for e in would)))


def _kill_plan(snapshot, dev, options, host, check_mode, blockers=()):
    """Terminate (or in check mode, plan to terminate) the processes on ``dev`` with gpu_kill's reclaim.

    Returns (killed, refused) entries, blocking clients left out (they are stopped as services).
    """
    skip = set(b['pid'] for b in blockers)
    ropts = ReclaimOptions(signal='TERM', timeout=options.kill_timeout, force=True, tree=True, release_timeout=RELEASE_TIMEOUT,
                           protect_names=options.protect_names, protect_users=options.protect_users, vendor=dev.vendor,
                           audit_path=None, kill_timeout=SIGKILL_WAIT)
    killed, refused, seen = [], [], set()
    for selector in (Selector(gpus=[str(dev.index)], all_on_gpus=True), Selector(gpus=[str(dev.index)], orphans=True)):
        result = reclaim(selector, ropts, check_mode=check_mode, snapshot=snapshot, dev_roots=host.dev_roots)
        for entry in result['killed']:
            if entry['pid'] not in seen and entry['pid'] not in skip:
                seen.add(entry['pid'])
                killed.append(entry)
        for entry in result['skipped'] + result['failed']:
            if entry['pid'] not in skip:
                refused.append(entry)
    return killed, refused


def _check_vendor(item, snapshot, host):
    """The vendor, root and tool checks and the vendor's own (its backend's reset_checks); the checks that
    other vendors record are not_applicable here.  False when the vendor's GPUs cannot be reset at all."""
    backend = vendor_backend(item.dev.vendor)
    if backend.reset_refusal:
        item.check('vendor', FAIL, backend.reset_refusal)
        return False
    item.check('vendor', PASS, '%s GPU' % item.dev.vendor)
    if host.euid == 0:
        item.check('root', PASS, 'running as root')
    else:
        item.check('root', FAIL, 'a GPU reset needs root: run the task with become: true')
    backend.reset_checks(item, snapshot, host)
    for other in REGISTRY.values():
        for name in other.reset_check_names:
            if name not in backend.reset_check_names and not any(c.name == name for c in item.checks):
                item.check(name, NOT_APPLICABLE, '%s only' % other.label)
    return True


def evaluate(items, snapshot, options, host):
    """Every precondition of every GPU, read-only."""
    for item in items:
        resettable = _check_vendor(item, snapshot, host)
        if options.auto_services and not options.stop_services:
            if host.tool('systemctl'):
                item.check('services', PASS, 'stop_services auto: stops the units of the blocking clients found (of %s) before '
                                             'the reset and starts them again afterwards' % ', '.join(STOPPABLE_UNITS))
            else:
                item.check('services', FAIL, 'stop_services auto needs systemctl, which was not found: stop the services '
                                             'yourself and leave stop_services empty')
        if options.stop_services:
            if host.tool('systemctl'):
                item.check('services', PASS, 'stops %s (those active) before the reset and starts them again afterwards'
                           % ', '.join(options.stop_services))
            else:
                item.check('services', FAIL, 'stop_services needs systemctl, which was not found: stop the services yourself '
                                             'and leave stop_services empty')
        if resettable:
            _check_users(item, snapshot, options, host)


# ---------------------------------------------------------------------------- verification
def _key(dev, other):
    """What tells ``dev`` apart, compared with ``other``: the PCI address when both have one, else the UUID, else
    the vendor's index."""
    if dev.pci_bus_id and other.pci_bus_id:
        return pci_bdf(dev.pci_bus_id)
    if dev.uuid and other.uuid:
        return dev.uuid.lower()
    return dev.vendor_index


def _same_device(old, new):
    return (old.vendor, _key(old, new)) == (new.vendor, _key(new, old))


def find_again(snapshot, dev):
    """The device of ``snapshot`` that is ``dev`` (same PCI address, else UUID, else vendor index), or None."""
    for other in snapshot.all_devices:
        if _same_device(dev, other):
            return other
    return None


def healthy(dev, threshold):
    """None when ``dev`` counts as reset (answers, health ok, orphaned memory <= threshold), else why not."""
    if dev is None:
        return 'the GPU is not enumerated any more'
    if dev.health.status == 'lost':
        return 'the GPU does not answer (lost)'
    if dev.health.status != 'ok':
        return 'health is %s: %s' % (dev.health.status, '; '.join(dev.health.reasons))
    if dev.orphaned_mib is None and dev.memory_used_mib is None:
        return None  # the driver reports no used memory at all (mainline i915/xe): nothing to check; verify() warns
    if dev.orphaned_mib is None:
        return 'the orphaned memory cannot be computed (%s)' % ('; '.join(dev.errors) or 'a process has no memory figure')
    if dev.orphaned_mib > threshold:
        return '%d MiB are still held by no process' % dev.orphaned_mib
    return None


def verify(item, options, host):
    """Re-read the GPU until it passes healthy() or verify_timeout passes; fills ``after``.  The Xid lines
    logged before the reset stay in the kernel log: they change no health of the re-read GPU."""
    start = host.clock()
    why = 'not checked'
    while True:
        found = find_again(host.snapshot(vendor=item.dev.vendor, gather_processes=False, xid_since=item.reset_at), item.dev)
        if found is not None and found.orphaned_mib is None:
            found.compute_orphaned()
        why = healthy(found, options.orphan_threshold_mib)
        item.after = _state_view(found)
        if why is None or host.clock() - start >= options.verify_timeout:
            break
        host.sleep(host.poll)
    if why is None and found.memory_used_mib is None:
        item.notes.append('%s: the driver reports no used memory, so orphaned memory could not be checked after the reset '
                          '(only that the GPU answers with health ok)' % _label(item.dev))
    return why
