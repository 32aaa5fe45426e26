# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""The host side of a snapshot: who the GPU pids are, and who else holds GPU device files.

One ``ProcessInventory.scan()`` walks the process table once: it reads the ``fd`` links of the pids
the driver listed, then of every other process (the ``fuser /dev/nvidia*`` scan; other users' fds need
root or CAP_SYS_PTRACE, and processes vanish mid-scan), under one bound whatever users hold
(core/fdwalk.py: what it left is the result's ``incomplete``), then reads owner, command line, state
and cgroup (container, Kubernetes pod, Slurm job) for the pids the driver listed and for the fd holders.
Records come from the /proc files directly, each read once (psutil read most of them a second time
and cost more than NVML itself; ``use_psutil=True`` still selects it).

The driver reports pids of the host PID namespace: a listed pid absent here gets status
``not_found`` (we may be inside a container), and a listed pid present here that holds no GPU
device file may be an unrelated local process with the same number (``holds_gpu_device``).
"""

from __future__ import annotations

import copy
import os
import re
import stat as stat_mod

try:
    import pwd
except ImportError:  # not a Unix: user names are shown as uids
    pwd = None

from .identity import kernel_lines, read_bytes as _read_bytes, read_identity
from .identity import parse_stat, read_starttime  # pylint: disable=unused-import  # importable from here too
from . import fdwalk
from .fdwalk import walk_fd_links
from .model import NOT_FOUND, ContainerInfo, Holder, ProcessRecord

# psutil is imported on first use, not at load: the guard agent reads /proc itself and never needs
# it (importing it costs about 25 ms of a tick).  ``psutil``, ``HAS_PSUTIL`` and
# ``PSUTIL_IMPORT_ERROR`` stay importable names of this module (module __getattr__, PEP 562).
_PSUTIL = []  # [module or None, import error text or None] once the import was tried


def load_psutil():
    """The psutil module, or None when it cannot be imported (the error is kept for PSUTIL_IMPORT_ERROR)."""
    if not _PSUTIL:
        try:
            import psutil  # pylint: disable=import-outside-toplevel
            _PSUTIL[:] = [psutil, None]
        except Exception:  # pylint: disable=broad-except
            import traceback  # pylint: disable=import-outside-toplevel
            _PSUTIL[:] = [None, traceback.format_exc()]
    return _PSUTIL[0]


def __getattr__(name):
    if name == 'psutil':
        return load_psutil()
    if name == 'HAS_PSUTIL':
        return load_psutil() is not None
    if name == 'PSUTIL_IMPORT_ERROR':
        load_psutil()
        return _PSUTIL[1]
    raise AttributeError('module %r has no attribute %r' % (__name__, name))


DEFAULT_DEV_ROOTS = ('/dev',)

# Device files, relative to a device root, that give access to a GPU.
DEVICE_RE = re.compile(
    r'^(?:nvidia(?:\d+|ctl|-uvm|-uvm-tools|-modeset|-nvswitchctl|-caps/.+|-caps-imex-channels/.+)'
    r'|dri/(?:renderD|card)\d+|kfd)$')
_NVIDIA_MINOR_RE = re.compile(r'^nvidia(\d+)$')
_DRI_RE = re.compile(r'^dri/(renderD|card)(\d+)$')

# /proc/PID/stat state letter -> psutil status name.
_STATES = {
    'R': 'running', 'S': 'sleeping', 'D': 'disk-sleep', 'T': 'stopped', 't': 'tracing-stop',
    'Z': 'zombie', 'X': 'dead', 'x': 'dead', 'K': 'wake-kill', 'W': 'waking', 'P': 'parked', 'I': 'idle',
}

# Container runtimes, most specific first.  Each matches one cgroup path (v1 or v2).
_CONTAINER_PATTERNS = (
    (re.compile(r'(?:^|/)docker-([0-9a-f]{64})\.scope(?:/|$)'), 'docker'),
    (re.compile(r'(?:^|/)cri-containerd-([0-9a-f]{64})\.scope(?:/|$)'), 'containerd'),
    (re.compile(r'(?:^|/)nerdctl-([0-9a-f]{64})\.scope(?:/|$)'), 'containerd'),
    (re.compile(r'(?:^|/)crio-(?:conmon-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)'), 'cri-o'),
    (re.compile(r'(?:^|/)libpod-(?:conmon-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)'), 'podman'),
    (re.compile(r'(?:^|/)docker/([0-9a-f]{64})(?:/|$)'), 'docker'),
    # kubelet with the cgroupfs driver: /kubepods/<qos>/pod<uid>/<id>; the runtime is not named.
    (re.compile(r'(?:^|/)kubepods(?:/[^/]+)*/pod[0-9a-f_-]{36}/([0-9a-f]{64})(?:/|$)'), None),
)
_POD_RE = re.compile(r'pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?(?:/|$)')
_SLURM_RE = re.compile(r'(?:^|/)job_(\d+)(?:/|$)')


# ---------------------------------------------------------------------------- parsing helpers
DEFAULT_CGROUP_ROOT = '/sys/fs/cgroup'

# Cgroup path components at and below which no name is an identity, whoever owns the directories:
# systemd's per-user slices, its user managers (user@UID.service, delegated to the user with
# Delegate=yes) and login session scopes.  Slurm, Docker and kubelet never put their cgroups there.
_USER_CGROUP_RE = re.compile(r'^(?:user\.slice|user-[^/]*\.slice|user@[^/]*\.service|session-[^/]*\.scope)$')


class CgroupTrust(object):
    """Which leading part of a cgroup path root vouches for (docs/security.md, "cgroup identity").

    A cgroup's name is chosen by whoever may create it, that is whoever may write the directory
    that holds it.  So the name of a path component is trusted only when every directory above it,
    from the hierarchy's mount point under ``cgroup_root`` down to its parent, is owned by root and
    writable by neither its group nor others.  (The component's own directory may belong to the
    job's user: Slurm's cgroup v1 plugin chowns ``job_N`` and ``step_M`` to the job's owner; what
    she creates inside them is not trusted.)  Whatever the owners, nothing at or below a
    ``user.slice``, ``user-UID.slice``, ``user@UID.service`` or ``session-N.scope`` component is
    trusted, nor anything after a ``.`` or ``..`` component.

    Fail closed: when a hierarchy's mount point cannot be found under ``cgroup_root`` (the guard
    runs where the cgroup file system is not visible), only that structural rule applies; a
    directory that cannot be examined (gone, denied) is not trusted, nor anything below it.
    ``cgroup_root`` is a test seam.  Directory verdicts are cached until ``clear()``.
    """

    def __init__(self, cgroup_root=DEFAULT_CGROUP_ROOT):
        self.cgroup_root = cgroup_root
        self._mounts = {}
        self._dirs = {}
        self._texts = {}

    def clear(self):
        self._mounts.clear()
        self._dirs.clear()
        self._texts.clear()

    def parse(self, text):
        """``parse_cgroup(text, self)``, once per distinct text until ``clear()``: the processes of one
        cgroup have the same file, and a verdict rests on the directory verdicts cached here anyway."""
        found = self._texts.get(text)
        if found is None:
            found = self._texts[text] = parse_cgroup(text, self)
        return found

    def mount_point(self, controllers):
        """The directory of the hierarchy of a /proc/PID/cgroup line (``''`` for cgroup v2), or None."""
        if controllers not in self._mounts:
            root = self.cgroup_root
            if not controllers:
                candidates = [(root, 'cgroup.controllers'), (os.path.join(root, 'unified'), 'cgroup.controllers')]
            else:
                names = [name[5:] if name.startswith('name=') else name for name in controllers.split(',')]
                candidates = [(os.path.join(root, name), '') for name in [','.join(names)] + names if name]
            found = None
            for directory, marker in candidates:
                if os.path.isdir(directory) and (not marker or os.path.isfile(os.path.join(directory, marker))):
                    found = directory
                    break
            self._mounts[controllers] = found
        return self._mounts[controllers]

    def _root_owned(self, path, follow=False):
        if path not in self._dirs:
            try:
                info = os.stat(path) if follow else os.lstat(path)
                self._dirs[path] = stat_mod.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022
            except OSError:
                self._dirs[path] = False
        return self._dirs[path]

    def trusted_parts(self, controllers, parts):
        """The leading components of ``parts`` (an already structurally cut path) whose names root chose."""
        mount = self.mount_point(controllers)
        if mount is None:
            return parts
        count = 0
        while count < len(parts) and self._root_owned(os.path.join(mount, *parts[:count]), follow=count == 0):
            count += 1
        return parts[:count]


def _structural_parts(path):
    parts = []
    for part in path.split('/'):
        if not part:
            continue
        if part in ('.', '..') or _USER_CGROUP_RE.match(part):
            break
        parts.append(part)
    return parts


# Every pattern above needs one of these words: a path without any names no container, pod or job
# (most paths of most processes; skipping the eight searches is a fifth of a GPU process's record).
_IDENTITY_WORDS = ('docker', 'containerd', 'nerdctl', 'crio-', 'libpod-', 'kubepods', 'job_')


def _cgroup_identity(path):
    """(container id, runtime, pod uid, Slurm job) that the text of one cgroup path names."""
    container_id = runtime = pod_uid = slurm_job = None
    if not any(word in path for word in _IDENTITY_WORDS):
        return container_id, runtime, pod_uid, slurm_job
    for pattern, name in _CONTAINER_PATTERNS:
        match = pattern.search(path)
        if match:
            container_id, runtime = match.group(1), name
            break
    if 'kubepods' in path:
        match = _POD_RE.search(path)
        if match:
            pod_uid = match.group(1).replace('_', '-')
    match = _SLURM_RE.search(path)
    if match:
        slurm_job = match.group(1)
    return container_id, runtime, pod_uid, slurm_job


def parse_cgroup(text, trust=None):
    """Parse /proc/PID/cgroup text (cgroup v1 or v2) -> (ContainerInfo or None, Slurm job id or None).

    Only the part of each path that root vouches for is read (``CgroupTrust``): names a user could
    create (a delegated subtree, anything under a user slice) are never a job, container or pod.
    ``trust``: a CgroupTrust that examines the directories' owners; None applies only the
    structural rule, as when the cgroup file system cannot be read.  Lines end at a newline only
    (the kernel refuses cgroup names with one; other line breaks may be part of a name).
    """
    entries = []
    for line in (text or '').split('\n'):
        parts = line.split(':', 2)
        if len(parts) == 3 and (parts[1], parts[2]) not in entries:
            entries.append((parts[1], parts[2]))
    found = [None, None, None, None]  # container id, runtime, pod uid, Slurm job
    for controllers, path in entries:
        parts = _structural_parts(path)
        if not any(_cgroup_identity('/' + '/'.join(parts))):
            continue
        if trust is not None:
            parts = trust.trusted_parts(controllers, parts)
        ident = _cgroup_identity('/' + '/'.join(parts))
        if found[0] is None and ident[0] is not None:
            found[0], found[1] = ident[0], ident[1]
        for index in (2, 3):
            if found[index] is None:
                found[index] = ident[index]
    container_id, runtime, pod_uid, slurm_job = found
    container = None
    if container_id is not None or pod_uid is not None:
        container = ContainerInfo(id=container_id, runtime=runtime, pod_uid=pod_uid)
    return container, slurm_job


def resolve_dev_roots(dev_roots):
    """``dev_roots`` or, when None, the module-level DEFAULT_DEV_ROOTS (read at call time: a test seam)."""
    return tuple(dev_roots) if dev_roots else DEFAULT_DEV_ROOTS


def match_device(target, dev_roots=None):
    """Return ``target`` (an fd link target) if it is a GPU device file under one of ``dev_roots``."""
    return target if _device_matcher(dev_roots)[1](target) else None


def device_key(path, dev_roots=None):
    """Which GPU a device file names: ('nvidia', minor), ('renderD', n), ('card', n), or None (shared)."""
    for root in resolve_dev_roots(dev_roots):
        prefix = root.rstrip('/') + '/'
        if path.startswith(prefix):
            rel = path[len(prefix):]
            match = _NVIDIA_MINOR_RE.match(rel)
            if match:
                return ('nvidia', int(match.group(1)))
            match = _DRI_RE.match(rel)
            if match:
                return (match.group(1), int(match.group(2)))
    return None


def scan_device_fds(proc_root='/proc', dev_roots=None, exclude=(), pids=None, budget=None):
    """The processes holding GPU device files: one ``fdwalk.walk_fd_links`` under ``budget`` (a default
    fdwalk.FdBudget when None; only the fds of ``pids`` when given, first in its claim).

    Returns (holders: {pid: sorted device paths}, readable: set of pids whose fds were read,
    denied: number of processes whose fds we may not read).  A process the budget cut or left is in
    neither set but in ``budget.unread`` (what a cut table showed is a holder's all the same).  Link
    targets are rejected on their first characters before any regular expression runs.
    """
    holders = {}
    readable = set()
    denied = 0
    prefixes, device_file = _device_matcher(dev_roots)
    for pid, _names, targets, complete in walk_fd_links(proc_root, pids, exclude, budget=budget):
        if complete:
            readable.add(pid)
        elif complete is False:
            denied += 1
        found = None
        for target in targets:
            if target.startswith(prefixes) and device_file(target):
                if found is None:
                    found = set()
                found.add(target)
        if found:
            holders[pid] = sorted(found)
    return holders, readable, denied


def _device_matcher(dev_roots):
    """(the prefixes of ``dev_roots``, a test of one link target: is it a GPU device file under them?); the test
    rejects on the first characters before any regular expression runs (the hot loop of the holder scan)."""
    prefixes = tuple(root.rstrip('/') + '/' for root in resolve_dev_roots(dev_roots))
    device_re_match = DEVICE_RE.match

    def device_file(target):
        if not target.startswith(prefixes) or target.endswith(' (deleted)'):
            return False
        for prefix in prefixes:
            if target.startswith(prefix) and device_re_match(target[len(prefix):]):
                return True
        return False
    return prefixes, device_file


def check_device_holding(procs, proc_root='/proc', dev_roots=None, budget=None):
    """Whether each listed process of ``procs`` whose open files were not read (``device_paths`` None) holds a GPU
    device file here: its fds are read now, up to the first one (fdwalk.walk_fd_links ``until``) under ``budget``
    (default: fdwalk.VICTIM_DESCRIPTORS, no deadline), and ``device_paths`` is set to that file ([] for none).
    It stays None when the fds may not be read, or when the budget ran out first: those pids are returned.

    The processes about to be signalled (T3: a listed pid that holds no GPU device file here may be another PID
    namespace's); the first one's whole table always fits (at most fs.nr_open fds by default)."""
    budget = fdwalk.FdBudget(descriptors=fdwalk.VICTIM_DESCRIPTORS, seconds=None) if budget is None else budget
    wanted = dict((proc.pid, proc) for proc in procs if proc.device_paths is None and proc.found)
    device_file = _device_matcher(dev_roots)[1]
    for pid, _names, targets, complete in walk_fd_links(proc_root, sorted(wanted), budget=budget, until=device_file):
        found = [target for target in targets if device_file(target)]
        if found or complete:
            wanted[pid].device_paths = found[:1]
    return sorted(pid for pid in budget.unread if pid in wanted and wanted[pid].device_paths is None)


SCHEDULER_DAEMONS = ('slurmd', 'kubelet')
# the executables a daemon may run as: Debian's /usr/sbin/slurmd is an alternatives link to slurmd-wlm
SCHEDULER_EXES = {'slurmd': ('slurmd', 'slurmd-wlm'), 'kubelet': ('kubelet',)}


def root_daemon_name(pid, proc_root='/proc'):
    """The basename of ``pid``'s executable when root vouches for the process, else None.

    Vouched means (identity.read_identity, the one reader of these kernel facts): the real,
    effective and saved uids are 0; the running executable is a root-owned file that neither group
    nor others may write; and every directory above it, in the process's own root, is owned by root
    and writable by neither group nor others, so no user could have put or renamed a file there.
    A pid reused during the read is not vouched for.
    """
    ident, _extra = read_identity(int(pid), proc_root)
    if ident is None or not ident.uids or ident.uids[:3] != (0, 0, 0) or ident.exe is None or not ident.exe.trusted:
        return None
    path = ident.exe.path
    return os.path.basename(path[:-len(' (deleted)')] if ident.exe.deleted else path)


def scheduler_daemon(proc_root='/proc'):
    """'slurmd' or 'kubelet' when root runs one here, else None.

    Any user can name a process ``slurmd``: the comm files only pick the candidates, and a
    candidate counts only when ``root_daemon_name`` vouches for it and its executable has that name
    (``SCHEDULER_EXES``: Debian's slurmd runs as ``slurmd-wlm``).
    """
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open('%s/%s/comm' % (proc_root, entry), 'rb') as handle:
                comm = handle.read(64).decode('utf-8', 'replace').rstrip('\n')
        except OSError:
            continue
        if comm in SCHEDULER_DAEMONS and root_daemon_name(entry, proc_root) in SCHEDULER_EXES[comm]:
            return comm
    return None


def _read_text(path):
    return _read_bytes(path).decode('utf-8', 'replace')


def _boot_time(proc_root):
    try:
        for line in kernel_lines(_read_text(os.path.join(proc_root, 'stat'))):
            if line.startswith('btime '):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def user_name(uid):
    """The login name of ``uid``, or the number as text when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name if pwd is not None else str(uid)
    except KeyError:
        return str(uid)


def user_uid(name):
    """The uid of login name ``name``, or None when this node does not know it."""
    try:
        return pwd.getpwnam(name).pw_uid if pwd is not None else None
    except KeyError:
        return None


def read_cmdline(pid, proc_root='/proc', limit=None):
    """The command line of ``pid`` as a list of texts (at most ``limit`` bytes read), None when unreadable."""
    try:
        raw = _read_bytes(os.path.join(proc_root, str(pid), 'cmdline'), limit or None)
    except OSError:
        return None
    parts = raw.decode('utf-8', 'replace').split('\x00')
    if parts and parts[-1] == '':
        parts = parts[:-1]
    return parts


def full_name(comm, cmdline):
    """The process name: ``comm``, or when the kernel cut it at 15 bytes and ``argv[0]``'s basename
    starts with it, that basename (what psutil's ``name()`` gives: ``gnome-keyring-daemon``, not
    ``gnome-keyring-d``).  Display only: protection and identity never rest on it."""
    if comm is not None and len(comm) >= 15 and cmdline:
        extended = os.path.basename(cmdline[0])
        if extended.startswith(comm):
            return extended
    return comm


def read_proc_files(pid, proc_root='/proc', cmdline_limit=None, dir_cache=None):
    """Read /proc/PID directly: ``{'stat': {comm, state, ppid, session, flags, starttime}, 'uid': real uid,
    'cmdline': [...], 'exe': path, 'identity': identity.Identity}``.

    None when the process does not exist, its stat cannot be parsed, or its pid named another
    process by the end of the read (``identity.read_identity``: the start time is read first and
    checked last).  ``uid``, ``cmdline`` and ``exe`` are None when they cannot be read (``exe``
    needs ptrace access to other users' processes).  ``cmdline_limit`` bounds the bytes read from
    the command line.
    """
    ident, cmdline = read_identity(pid, proc_root, during=lambda: read_cmdline(pid, proc_root, cmdline_limit),
                                   dir_cache=dir_cache)
    if ident is None:
        return None
    stat = {'comm': ident.comm, 'state': ident.state, 'ppid': ident.ppid, 'session': ident.session, 'flags': ident.flags,
            'starttime': ident.starttime}
    return {'stat': stat, 'uid': ident.uid, 'cmdline': cmdline, 'exe': ident.exe.path if ident.exe is not None else None,
            'identity': ident}


# ---------------------------------------------------------------------------- the inventory
class InventoryResult(object):
    """The outcome of one scan: records for the wanted pids and every fd holder."""

    def __init__(self, records, fd_holders, readable, fds_denied, errors=None, incomplete=None):
        self.records = records            # pid -> ProcessRecord
        self.fd_holders = fd_holders      # pid -> sorted device paths
        self.readable = readable          # pids whose fds were fully read
        self.fds_denied = fds_denied      # processes whose fds we could not read
        self.errors = list(errors or [])
        self.incomplete = incomplete      # None, or what the fd walk's budget left (fdwalk.FdBudget.incomplete, with users)

    def record(self, pid):
        """The ProcessRecord of ``pid`` (status ``not_found`` if this host does not see it)."""
        rec = self.records.get(pid)
        return rec if rec is not None else ProcessRecord(pid=pid)

    def holders(self, listed_pids=()):
        """Holders of GPU device files that the driver did not list (and that still exist)."""
        listed = set(listed_pids)
        result = []
        for pid in sorted(self.fd_holders):
            if pid in listed:
                continue
            rec = self.record(pid)
            if not rec.found:
                continue  # exited since the fd scan: it holds nothing any more
            result.append(Holder.from_record(rec, self.fd_holders[pid]))
        return result


class ProcessInventory(object):
    """Reads the process table.  ``dev_roots``, ``proc_root`` and ``cgroup_root`` are test seams, not user options.

    ``use_psutil``: True = psutil's fields (when importable); None or False = the /proc files, read once.
    ``exclude_pids``: never reported as holders (default: this process).
    ``scan_holders``: walk every process's fds to find holders the driver does not list; when
    False only the wanted pids' fds are read (their ``device_paths``), which is much cheaper.
    ``fd_budget``: makes the fdwalk.FdBudget of one scan (a test seam; default: fdwalk's bounds).
    """

    # No 'uids' or 'username': the owner comes from identity.read_identity (psutil's status parser
    # splits at '\r' too, which a process name may hold).
    PSUTIL_ATTRS = ('pid', 'ppid', 'name', 'exe', 'cmdline', 'create_time', 'status')

    def __init__(self, dev_roots=None, proc_root='/proc', use_psutil=None, exclude_pids=None, scan_fds=True,
                 scan_holders=True, cgroup_root=DEFAULT_CGROUP_ROOT, fd_budget=None):
        self.dev_roots = resolve_dev_roots(dev_roots)
        self.proc_root = proc_root
        self.cgroup_trust = CgroupTrust(cgroup_root)
        if use_psutil and load_psutil() is None:
            use_psutil = False
        self.use_psutil = bool(use_psutil)
        self.exclude_pids = set(exclude_pids) if exclude_pids is not None else {os.getpid()}
        self.scan_fds = scan_fds
        self.scan_holders = scan_holders
        self.fd_budget = fd_budget or fdwalk.FdBudget
        self._btime = None
        self._ticks = 100.0
        self._users = {}          # uid -> login name: one passwd lookup per user, not per process
        self._dirs = {}           # directory -> writable by a user (identity.dirs_writable), per inventory

    def scan(self, pids=()):
        """One pass: the fds of ``pids`` (the driver's) first, then of every other process, under one budget
        (``self.fd_budget()``: fdwalk.FdBudget), then records for ``pids`` and every holder."""
        errors = []
        self.cgroup_trust.clear()
        fd_holders, readable, denied, budget = {}, set(), 0, None
        if self.scan_fds:
            budget = self.fd_budget()
            listed = sorted(set(int(p) for p in pids))
            fd_holders, readable, denied = scan_device_fds(self.proc_root, self.dev_roots, self.exclude_pids, listed, budget)
            if self.scan_holders:
                more, more_readable, more_denied = scan_device_fds(self.proc_root, self.dev_roots,
                                                                   self.exclude_pids | set(listed), None, budget)
                fd_holders.update(more)
                readable |= more_readable
                denied += more_denied
        wanted = set(int(p) for p in pids) | set(fd_holders)
        records = {}
        for pid in sorted(wanted):
            try:
                rec = self.record(pid)
            except Exception as exc:  # pylint: disable=broad-except
                errors.append('could not read process %d: %s' % (pid, exc))
                rec = ProcessRecord(pid=pid)
            if self.scan_fds and rec.found:
                if pid in readable:
                    rec.device_paths = list(fd_holders.get(pid, []))
                elif pid in fd_holders:
                    rec.device_paths = list(fd_holders[pid])
            records[pid] = rec
        return InventoryResult(records, fd_holders, readable, denied, errors, self._incomplete(budget))

    def _incomplete(self, budget):
        """budget.incomplete() with the owner of each process it names (None when the walk read everything)."""
        found = budget.incomplete() if budget is not None else None
        for entry in (found or {}).get('largest', ()):
            ident, _extra = read_identity(entry['pid'], self.proc_root)
            entry['user'] = self._user(ident.uid) if ident is not None else None
        return found

    # ------------------------------------------------------------------ one record
    def record(self, pid):
        """A ProcessRecord for ``pid`` (status ``not_found`` when this host does not see it, or when its
        pid named another process by the end of the read: nothing of one process is charged to another)."""
        return self._record_psutil(pid) if self.use_psutil else self._record_proc(pid)

    def _cgroup(self, pid):
        """parse_cgroup of the pid's cgroup file (CgroupTrust.parse: once per distinct text and scan)."""
        try:
            text = _read_text(os.path.join(self.proc_root, str(pid), 'cgroup'))
        except OSError:
            return None, None
        container, slurm_job = self.cgroup_trust.parse(text)
        return (copy.copy(container) if container is not None else None), slurm_job

    def _user(self, uid):
        """The login name of ``uid`` (one passwd lookup per user, not per process); None for None."""
        if uid is None:
            return None
        name = self._users.get(uid)
        if name is None:
            name = self._users[uid] = user_name(uid)
        return name

    def _record_psutil(self, pid):
        """psutil's fields, read between the identity's two start-time reads (identity.read_identity);
        the owner comes from the identity (/proc/PID/status), never from psutil's own parsing."""
        psutil = load_psutil()

        def details():
            try:
                info = psutil.Process(pid).as_dict(attrs=list(self.PSUTIL_ATTRS), ad_value=None)
            except psutil.AccessDenied:
                info = {}
            return info, self._cgroup(pid)

        try:
            ident, found = read_identity(pid, self.proc_root, during=details, dir_cache=self._dirs)
        except psutil.NoSuchProcess:
            return ProcessRecord(pid=pid)
        if ident is None:
            return ProcessRecord(pid=pid)
        info, (container, slurm_job) = found
        cmdline = info.get('cmdline')
        return ProcessRecord(
            pid=pid,
            status=info.get('status') or _STATES.get(ident.state, 'unknown'),
            user=self._user(ident.uid),
            uid=ident.uid,
            name=info.get('name') or ident.comm,
            cmdline=list(cmdline) if cmdline is not None else None,
            create_time=info.get('create_time'),
            starttime=ident.starttime,
            ppid=info.get('ppid') if info.get('ppid') is not None else ident.ppid,
            exe=info.get('exe') or None,
            container=container,
            slurm_job=slurm_job,
            identity=ident,
        )

    def _record_proc(self, pid):
        ident, found = read_identity(pid, self.proc_root, during=lambda: (read_cmdline(pid, self.proc_root), self._cgroup(pid)),
                                     dir_cache=self._dirs)
        if ident is None:
            return ProcessRecord(pid=pid)
        cmdline, (container, slurm_job) = found
        rec = ProcessRecord(pid=pid, status=_STATES.get(ident.state, ident.state), name=full_name(ident.comm, cmdline),
                            ppid=ident.ppid,
                            starttime=ident.starttime, uid=ident.uid, user=self._user(ident.uid), cmdline=cmdline,
                            exe=ident.exe.path if ident.exe is not None else None, container=container,
                            slurm_job=slurm_job, identity=ident)
        if self._btime is None:
            self._btime = _boot_time(self.proc_root)
            try:
                self._ticks = float(os.sysconf('SC_CLK_TCK'))
            except (ValueError, OSError, AttributeError):
                self._ticks = 100.0
        if self._btime is not None:
            rec.create_time = round(self._btime + ident.starttime / self._ticks, 2)
        if rec.status == NOT_FOUND:
            rec.status = 'unknown'
        return rec
