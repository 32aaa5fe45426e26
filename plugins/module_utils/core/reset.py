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
   undone, persistence mode restored, one audit log line.
5. The stopped services are started again, whatever happened.

Commands always run as argument lists.  Tools are passed in (``Host.tools``); the default finds
them with shutil.which.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time

from . import audit_log, kmod, notify, watchdog
from .backends import amd as amd_backend
from .backends import nvidia as nvidia_backend
from .backends.base import error_text, pci_bdf
from .errors import InvalidArgument
from .identity import name_trusted
from .killer import DEFAULT_PROTECT_NAMES
from .reclaim import ReclaimOptions, reclaim
from .select import Selector
from .snapshot import resolve_gpus, take_snapshot
from .text import printable

PASS, FAIL, WARN, NOT_EXPOSED, NOT_APPLICABLE = 'pass', 'fail', 'warn', 'not_exposed', 'not_applicable'
CHECK_NAMES = ('vendor', 'root', 'tool', 'mig', 'nvlink', 'fabric_manager', 'persistence_mode', 'nvml_session',
               'recovery_action', 'kernel_modules', 'services', 'blocking_clients', 'processes')
TOOLS = ('nvidia-smi', 'amd-smi', 'xpu-smi', 'systemctl', 'scontrol')

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
AUTO = 'auto'
# The driver's recovery actions (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) after which a reset cannot help.
REBOOT_ACTIONS = ('reboot',)
COMM_LEN = 15                                     # the kernel keeps 15 characters of a process name
UNIT_RE = re.compile(r'^[A-Za-z0-9][A-Za-z0-9:_.@\\-]*$')
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


class ResetOptions(object):
    """What to reset and how.  Validated here, before anything is read."""

    def __init__(self, gpus=None, all_gpus=False, when_needed=False, orphan_threshold_mib=1024, kill_processes=False,
                 kill_timeout=10.0, protect_names=DEFAULT_PROTECT_NAMES, protect_users=(), stop_services=(), drain=False,
                 verify_timeout=60.0, vendor='auto', audit_path=None):
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

    tools: name -> absolute path or None (default: shutil.which of TOOLS).  runner(argv) -> (rc, out, err).
    sys_root: where sysfs is (Intel PCI reset, kernel-module references; default kmod.sys_root()).
    dev_roots, factories: passed to take_snapshot.
    nvml: the pynvml module for drain and NVLink queries.  amdsmi: the amdsmi module, or False for "not installed".
    driver_timeout: the snapshots' driver reads run in a watchdog child with this deadline (None: in this process).
    """

    def __init__(self, tools=None, runner=None, sys_root=None, dev_roots=None, factories=None, nvml=None, amdsmi=None,
                 euid=None, clock=time.monotonic, sleep=time.sleep, poll=0.5, driver_timeout=None):
        self.tools = dict((name, shutil.which(name)) for name in TOOLS) if tools is None else dict(tools)
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

    def amdsmi_available(self):
        if self.amdsmi is False:
            return False, 'amdsmi is not installed'
        if self.amdsmi is not None:
            return True, None
        module, error = amd_backend.import_amdsmi()
        return module is not None, error


def module_host(module):
    """The real host of an Ansible module: tools found by ``module.get_bin_path``, commands run by
    ``module.run_command`` (argument lists)."""
    def runner(argv):
        try:
            return module.run_command(argv, handle_exceptions=False)
        except OSError as exc:  # never fail_json half-way: the undo steps (persistence mode, drain, services) must run
            return 127, '', '%s: %s' % (argv[0], exc)

    return Host(tools=dict((name, module.get_bin_path(name)) for name in TOOLS), runner=runner,
                driver_timeout=watchdog.check_timeout('driver_timeout', module.params.get('driver_timeout')))


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
        self.persistence = {'before': dev.persistence_mode if dev.vendor == 'nvidia' else None,
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
        }


# ---------------------------------------------------------------------------- selection
def needs_reset(dev, threshold):
    """Why ``dev`` needs a reset (health recommends one, or orphaned memory above ``threshold``): a list, empty if not."""
    reasons = []
    if dev.health.recommended_action == 'reset':
        reasons.extend(dev.health.reasons or ['the health check recommends a reset'])
    if dev.orphaned_mib is not None and dev.orphaned_mib > threshold:
        reasons.append('%d MiB of GPU memory held by no process (orphan_threshold_mib %d)' % (dev.orphaned_mib, threshold))
    return reasons


def choose(snapshot, options):
    """The GpuReset items for the GPUs ``options`` selects (raises InvalidArgument for an unknown GPU)."""
    devices = resolve_gpus(snapshot.all_devices, options.gpus)
    items = []
    for dev in devices:
        if dev.orphaned_mib is None:
            dev.compute_orphaned()
        if options.when_needed:
            reasons = needs_reset(dev, options.orphan_threshold_mib)
            if reasons:
                items.append(GpuReset(dev, reasons))
        else:
            items.append(GpuReset(dev, ['requested (%s)' % ('all' if options.all_gpus else 'gpus')]))
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


def _same_family(dev, path):
    base = os.path.basename(path)
    if dev.vendor == 'nvidia':
        return base.startswith('nvidia')
    return base == 'kfd' or '/dri/' in path


def users_of(snapshot, dev):
    """(processes, blockers) on ``dev``: listed by the driver or holding its device file.

    Blockers are known NVML/driver clients (BLOCKING_CLIENTS) that hold the GPU's device file or
    the vendor's shared control file; each carries ``client`` and ``unit``.
    """
    procs, blockers = [], []
    for proc in snapshot.processes:
        if dev.index in proc.gpu_indexes:
            _sort_user(proc, None, procs, blockers)
    for holder in snapshot.holders:
        mine = dev.index in holder.gpu_indexes
        shared = not holder.gpu_indexes and any(_same_family(dev, p) for p in holder.devices)
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
def _check_vendor_and_tool(item, host):
    dev = item.dev
    if dev.vendor == 'apple':
        item.check('vendor', FAIL, 'Apple GPUs cannot be reset: macOS offers no GPU reset. Stop the processes that use the GPU '
                                   '(gpufleet.reclaim.gpu_kill) or restart the Mac.')
        return
    item.check('vendor', PASS, '%s GPU' % dev.vendor)
    if host.euid == 0:
        item.check('root', PASS, 'running as root')
    else:
        item.check('root', FAIL, 'a GPU reset needs root: run the task with become: true')
    if dev.vendor == 'nvidia':
        path = host.tool('nvidia-smi')
        if path:
            item.check('tool', PASS, 'nvidia-smi --gpu-reset (%s)' % path)
        else:
            item.check('tool', FAIL, 'nvidia-smi was not found on PATH or in the sbin directories: install the NVIDIA driver '
                                     'utilities (for example the nvidia-utils package of the installed driver) or add its '
                                     'directory to PATH')
    elif dev.vendor == 'amd':
        lib, why = host.amdsmi_available()
        cli = host.tool('amd-smi')
        if lib:
            item.check('tool', PASS, 'amdsmi_reset_gpu (amdsmi library)%s' % (', falling back to %s' % cli if cli else ''))
        elif cli:
            item.check('tool', PASS, 'amd-smi reset --gpureset (%s); the amdsmi library is not usable: %s' % (cli, why))
        else:
            item.check('tool', FAIL, 'neither the amdsmi Python library (%s) nor the amd-smi command was found: install '
                                     'amd-smi (package amd-smi-lib of ROCm) or add its directory to PATH' % why)
    elif dev.vendor == 'intel':
        xpu = host.tool('xpu-smi')
        sysfs = _intel_reset_file(host, dev)
        if xpu:
            item.check('tool', PASS, 'xpu-smi config --reset (%s)' % xpu)
        elif sysfs and os.path.exists(sysfs):
            item.check('tool', PASS, 'PCI function reset through %s' % sysfs)
        else:
            item.check('tool', FAIL, 'xpu-smi was not found and the kernel offers no PCI reset for this GPU (%s is missing): '
                                     'install xpu-smi, or reboot the node' % (sysfs or 'no PCI address known'))


def _check_nvidia(item, host):
    dev = item.dev
    if dev.mig_mode:
        item.check('mig', FAIL, 'MIG mode is enabled: destroy the compute and GPU instances (nvidia-smi mig -dci -i {i}; '
                                'nvidia-smi mig -dgi -i {i}), disable MIG (nvidia-smi -i {i} -mig 0), then reset'.format(i=dev.vendor_index))
    elif dev.mig_mode is None:
        item.check('mig', NOT_EXPOSED, 'the driver does not report the MIG mode of this GPU')
    else:
        item.check('mig', PASS, 'MIG mode is off')
    if dev.pci_bus_id:
        facts = nvidia_backend.reset_constraints(dev.pci_bus_id, nvml=host.nvml)
    else:
        facts = {'nvlink_active': None, 'nvlink_error': 'no PCI bus id (the GPU does not answer)', 'fabric_state': None,
                 'fabric_error': 'no PCI bus id (the GPU does not answer)'}
    active = facts['nvlink_active']
    if active is None:
        item.check('nvlink', NOT_EXPOSED, 'NVLink state: %s' % facts['nvlink_error'])
    elif active:
        item.check('nvlink', WARN, '%d NVLink link(s) active: on NVLink/NVSwitch systems the driver may only reset all '
                                   'connected GPUs together; if the reset is refused, reset every GPU of the node '
                                   '(all: true) with the fabric manager running' % active)
    else:
        item.check('nvlink', PASS, 'no active NVLink link')
    state = facts['fabric_state']
    if state is None:
        item.check('fabric_manager', NOT_EXPOSED, 'NVSwitch fabric state: %s' % facts['fabric_error'])
    elif state in ('not_supported', 'completed'):
        item.check('fabric_manager', PASS, 'no NVSwitch fabric' if state == 'not_supported' else
                   'the fabric manager has registered the GPU')
    else:
        item.check('fabric_manager', FAIL, 'the NVSwitch fabric manager has not finished registering this GPU (state %s): '
                                           'start it (systemctl start nvidia-fabricmanager) and wait until the fabric '
                                           'state is Completed (nvidia-smi -q -i %s)' % (state, item.target))
    if dev.persistence_mode:
        item.check('persistence_mode', PASS, 'on: switched off (nvidia-smi -pm 0) for the reset and restored afterwards')
    elif dev.persistence_mode is None:
        item.check('persistence_mode', WARN, 'unknown (the driver does not say, the GPU may be lost): nvidia-smi -pm 0 is '
                                             'tried before the reset, and the mode is not restored')
    else:
        item.check('persistence_mode', PASS, 'off')
    _check_session(item, host)


def _check_session(item, host):
    sessions = nvidia_backend.open_sessions(host.nvml)
    if sessions:
        item.check('nvml_session', FAIL, 'this process still holds %d NVML session(s), which blocks the reset; this is a bug '
                                         'in gpufleet.reclaim: please report it' % sessions)
    else:
        item.check('nvml_session', PASS, 'this process holds no NVML session')


def recovery_action(dev):
    """The driver's recovery action for ``dev`` (gpu_facts ``recovery_action``: none, reset, reboot, drain_p2p,
    drain_and_reset), or None where the driver cannot tell."""
    value = getattr(dev, 'recovery_action', None)
    return value if isinstance(value, str) and value else None


def _check_recovery(item):
    action = recovery_action(item.dev)
    if action is None:
        item.check('recovery_action', NOT_EXPOSED, 'the driver does not report a recovery action for this GPU')
    elif action in REBOOT_ACTIONS:
        item.reboot_reason = 'the driver\'s recovery action is %s: a reset cannot recover this GPU' % action
        item.check('recovery_action', FAIL, '%s; reboot the node' % item.reboot_reason)
    else:
        item.check('recovery_action', PASS, 'the driver\'s recovery action is %s' % action)


def uvm_files(snapshot):
    """How many processes hold /dev/nvidia-uvm open (their nvidia_uvm references are theirs)."""
    count = 0
    for proc in list(snapshot.processes) + list(snapshot.holders):
        paths = getattr(proc, 'device_paths', None) or getattr(proc, 'devices', None) or ()
        if any(os.path.basename(p) == 'nvidia-uvm' for p in paths):
            count += 1
    return count


def kernel_blockers(snapshot, host):
    """(all ModuleRefs, the blocking ones) of the NVIDIA companion modules, read now."""
    refs = kmod.module_refs(host.sys_root, uvm_files=uvm_files(snapshot))
    return refs, kmod.blocking(refs)


def _check_kernel_modules(item, snapshot, host):
    refs, blocking = kernel_blockers(snapshot, host)
    item.kernel_modules = refs
    unreadable = [r for r in refs if r.error]
    if blocking:
        item.reboot_reason = 'kernel references keep the driver in use (%s); a reboot clears them' % \
            '; '.join(r.describe() for r in blocking)
        why = ('%s: a kernel client (the DRM console or a display server for nvidia_drm and nvidia_modeset) holds the '
               'driver; stop it and unload the module (modprobe -r %s), or reboot the node'
               % ('; '.join(r.describe() for r in blocking), ' '.join(r.name for r in blocking)))
        item.check('kernel_modules', FAIL, why)
    elif unreadable:
        item.check('kernel_modules', WARN, '; '.join('%s: %s' % (r.name, r.error) for r in unreadable))
    elif not any(r.loaded for r in refs):
        item.check('kernel_modules', PASS, 'none of %s is loaded' % ', '.join(kmod.BLOCKING_MODULES))
    else:
        item.check('kernel_modules', PASS, 'no kernel reference beyond holder modules and processes (%s)'
                   % ', '.join('%s refcnt %s' % (r.name, r.refcnt) for r in refs if r.loaded))


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
        item.check('blocking_clients', PASS, 'no %s holds the GPU%s' % ('/'.join(c for c, _u in BLOCKING_CLIENTS), note))
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


def evaluate(items, snapshot, options, host):
    """Every precondition of every GPU, read-only."""
    for item in items:
        _check_vendor_and_tool(item, host)
        if item.dev.vendor == 'nvidia':
            _check_nvidia(item, host)
            _check_recovery(item)
            _check_kernel_modules(item, snapshot, host)
        elif item.dev.vendor in ('amd', 'intel'):
            for name in ('mig', 'nvlink', 'fabric_manager', 'persistence_mode', 'nvml_session', 'recovery_action', 'kernel_modules'):
                item.check(name, NOT_APPLICABLE, 'NVIDIA only')
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
        if item.dev.vendor != 'apple':
            _check_users(item, snapshot, options, host)


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


def _last_line(text):
    lines = [line.strip() for line in (text or '').strip().splitlines() if line.strip()]
    return lines[-1] if lines else '(no output)'


# ---------------------------------------------------------------------------- vendor resets
def _nvidia_smi(host, item, *args):
    argv = [host.tool('nvidia-smi')] + list(args) + ['-i', item.target]
    rc, out, err = host.run(argv)
    return rc, (out + err).strip(), argv


def reset_nvidia(item, host):
    """``nvidia-smi --gpu-reset -i <bus id>``; returns an error text or None.

    "In use by another client" names the kernel references left at that moment (kmod) when there are any.
    """
    rc, text, argv = _nvidia_smi(host, item, '--gpu-reset')
    item.method, item.command, item.output = 'nvidia-smi', argv, text
    if rc == 0:
        return None
    hint = ''
    low = text.lower()
    if 'in use by another client' in low or 'being used' in low:
        refs = kmod.blocking(kmod.module_refs(host.sys_root))
        if refs:
            hint = ': kernel references keep the driver in use (%s); unload the module or reboot the node' % \
                '; '.join(r.describe() for r in refs)
        else:
            hint = ': processes or NVML clients still use the GPU; set kill_processes: true, and stop monitoring agents ' \
                   '(stop_services: [nvidia-dcgm, dcgm-exporter, nvidia-persistenced], or auto)'
    elif 'persistence mode' in low:
        hint = ': switch persistence mode off first (nvidia-smi -pm 0 -i %s)' % item.target
    elif 'permission' in low:
        hint = ': run the task with become: true'
    return 'nvidia-smi --gpu-reset failed (rc %d): %s%s' % (rc, _last_line(text), hint)


def reset_amd(item, host):
    """amdsmi_reset_gpu through the library, falling back to ``amd-smi reset --gpureset -g <bdf>``."""
    target = item.target
    if host.amdsmi is False:
        outcome, detail = 'unavailable', 'amdsmi is not installed'
    else:
        outcome, detail = amd_backend.reset_gpu(target, amdsmi=host.amdsmi)
    item.method, item.command, item.output = 'amdsmi', ['amdsmi_reset_gpu', target], detail
    if outcome == 'reset':
        return None
    if outcome == 'failed':
        return detail
    cli = host.tool('amd-smi')
    if not cli:
        return 'the amdsmi library cannot reset (%s) and amd-smi was not found' % detail
    argv = [cli, 'reset', '--gpureset', '-g', target]
    rc, out, err = host.run(argv)
    text = (out + err).strip()
    item.method, item.command, item.output = 'amd-smi', argv, text
    # amd-smi prints "Failed to reset GPU" or "Can not find a device" and still exits 0.
    if rc == 0 and 'successfully reset' in text.lower() and 'failed' not in text.lower():
        return None
    return 'amd-smi reset --gpureset failed (rc %d): %s' % (rc, _last_line(text))


def _intel_reset_file(host, dev):
    if not dev.pci_bus_id:
        return None
    return os.path.join(host.sys_root, 'bus', 'pci', 'devices', pci_bdf(dev.pci_bus_id), 'reset')


def reset_intel(item, host):
    """``xpu-smi config -d N --reset`` where xpu-smi exists, else a PCI reset through sysfs."""
    dev = item.dev
    xpu = host.tool('xpu-smi')
    if xpu:
        # -d takes a device id or a PCI address; the address cannot name another GPU.
        argv = [xpu, 'config', '-d', pci_bdf(dev.pci_bus_id) if dev.pci_bus_id else str(dev.vendor_index), '--reset']
        rc, out, err = host.run(argv)
        item.method, item.command, item.output = 'xpu-smi', argv, (out + err).strip()
        return None if rc == 0 else 'xpu-smi config --reset failed (rc %d): %s' % (rc, _last_line(out + err))
    path = _intel_reset_file(host, dev)
    item.method, item.command = 'sysfs', ['write', '1', path]
    if path is None:
        return 'the PCI address of this GPU is unknown, so it cannot be reset through sysfs'
    method_file = os.path.join(os.path.dirname(path), 'reset_method')
    try:
        with open(method_file) as handle:
            item.output = 'reset methods: %s' % handle.read().strip()
    except OSError:
        item.output = None
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, 'O_CLOEXEC', 0))
        try:
            os.write(fd, b'1')
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return 'the kernel offers no reset for %s (%s is missing): reboot the node' % (dev.pci_bus_id, path)
        if exc.errno in (errno.EACCES, errno.EPERM):
            return 'writing %s needs root: run the task with become: true' % path
        return 'the PCI reset through %s failed: %s' % (path, exc.strerror or exc)
    return None


VENDOR_RESETS = {'nvidia': reset_nvidia, 'amd': reset_amd, 'intel': reset_intel}


# ---------------------------------------------------------------------------- verification
def _same_device(old, new):
    if old.vendor != new.vendor:
        return False
    if old.pci_bus_id and new.pci_bus_id:
        return pci_bdf(old.pci_bus_id) == pci_bdf(new.pci_bus_id)
    if old.uuid and new.uuid:
        return old.uuid.lower() == new.uuid.lower()
    return old.vendor_index == new.vendor_index


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


# ---------------------------------------------------------------------------- the actions for one GPU
def _persistence_off(item, host, warnings):
    before = item.persistence['before']
    if item.dev.vendor != 'nvidia' or before is False:
        return None
    rc, text, _argv = _nvidia_smi(host, item, '-pm', '0')
    item.touched = True
    if rc == 0:
        item.persistence['switched_off'] = True
        return None
    if before is None:
        warnings.append('%s: nvidia-smi -pm 0 failed (rc %d: %s); trying the reset anyway' % (_label(item.dev), rc, _last_line(text)))
        return None
    return 'nvidia-smi -pm 0 failed (rc %d): %s; the reset needs persistence mode off' % (rc, _last_line(text))


def _persistence_restore(item, host):
    if not (item.persistence['switched_off'] and item.persistence['before']):
        return None
    rc, text, _argv = _nvidia_smi(host, item, '-pm', '1')
    item.persistence['restored'] = rc == 0
    if rc == 0 and item.after is not None:
        item.after['persistence_mode'] = True  # read before the restore; nvidia-smi -pm 1 succeeded since
    if rc != 0:
        return 'persistence mode could not be restored (rc %d: %s): run nvidia-smi -pm 1 -i %s' % (rc, _last_line(text), item.target)
    return None


def _drain_on(item, options, host, warnings):
    if not options.drain:
        return
    item.drain['requested'] = True
    if item.dev.vendor != 'nvidia' or not item.dev.pci_bus_id:
        item.drain['detail'] = 'drain is only available through NVML for NVIDIA GPUs with a known PCI bus id'
        warnings.append('%s: %s; continuing without it' % (_label(item.dev), item.drain['detail']))
        return
    state, error = nvidia_backend.drain(item.dev.pci_bus_id, nvml=host.nvml)
    if error is None and state:
        item.drain['detail'] = 'already drained before the reset; left as it was'
        return
    if error is None:
        item.touched = True
        state, error = nvidia_backend.drain(item.dev.pci_bus_id, True, nvml=host.nvml)
    if error is not None or not state:
        item.drain['detail'] = 'the driver refused to drain the GPU: %s' % (error or 'the state did not change')
        warnings.append('%s: %s; continuing without it (drain is best effort)' % (_label(item.dev), item.drain['detail']))
        return
    item.drain['enabled'] = True
    item.drain['detail'] = 'drained: new clients cannot open the GPU until the reset is done'


def _drain_off(item, host):
    if not item.drain['enabled']:
        return None
    state, error = nvidia_backend.drain(item.dev.pci_bus_id, False, nvml=host.nvml)
    item.drain['restored'] = error is None and state is False
    if not item.drain['restored']:
        return 'the drain could not be undone (%s): run nvidia-smi drain -p %s -m 0' % (error or 'still drained', item.dev.pci_bus_id)
    return None


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
    error = _persistence_off(item, host, warnings)
    try:
        if error is None:
            _drain_on(item, options, host, warnings)
            error = _empty(item, options, host)
        if error is None and item.dev.vendor == 'nvidia' and nvidia_backend.open_sessions(host.nvml):
            error = 'this process holds an NVML session, which would block the reset (a bug: please report it)'
        if error is None:
            item.touched = True
            item.reset_at = round(time.time(), 3)
            error = VENDOR_RESETS[item.dev.vendor](item, host)
            if error is None:
                why = verify(item, options, host)
                item.verified = why is None
                if why is not None:
                    error = 'the reset ran but the GPU did not come back healthy within %g s: %s' % (options.verify_timeout, why)
    finally:
        undo = [e for e in (_drain_off(item, host), _persistence_restore(item, host)) if e]
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
              'drain': item.drain, 'before': item.before, 'after': item.after}
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
    warnings = []
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
