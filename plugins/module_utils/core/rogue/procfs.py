# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The rogue detector's readers of the host: /proc parsers, container images and ``FactsCollector``.

``FactsCollector`` builds ProcessFacts for the processes of a snapshot from /proc (environment,
mapped libraries, TCP connections, parent chain) and from the usage history.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re

from ..errors import InvalidArgument
from ..exe_hash import ExeHashes
from ..fdwalk import FdBudget, walk_fd_links
from ..identity import kernel_lines, read_bytes as _read_bytes, read_ppid, read_starttime, read_stat
from ..processes import scheduler_daemon
from . import rules as R
from .facts import MAX_PARENTS, Connection, ProcessFacts, _norm_args

MAX_ENV_BYTES = 1024 * 1024
MAX_MAPS_LINES = 65536
TCP_STATES = {'01': 'ESTABLISHED', '02': 'SYN_SENT', '03': 'SYN_RECV', '04': 'FIN_WAIT1', '05': 'FIN_WAIT2',
              '06': 'TIME_WAIT', '07': 'CLOSE', '08': 'CLOSE_WAIT', '09': 'LAST_ACK', '0A': 'LISTEN', '0B': 'CLOSING'}


# ---------------------------------------------------------------------------- live collection
def parse_proc_net_tcp(text, ipv6=False):
    """{inode: Connection} from /proc/PID/net/tcp or tcp6 text (remote side, any state)."""
    conns = {}
    for line in kernel_lines(text)[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        try:
            remote_hex, port_hex = parts[2].split(':')
            state = TCP_STATES.get(parts[3].upper(), parts[3])
            inode = int(parts[9])
            raw = bytes.fromhex(remote_hex)
            if ipv6:
                raw = b''.join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = ipaddress.IPv6Address(raw)
                if addr.ipv4_mapped is not None:
                    addr = addr.ipv4_mapped
            else:
                addr = ipaddress.IPv4Address(raw[::-1])
            port = int(port_hex, 16)
        except (ValueError, IndexError):
            continue
        if inode and port:
            conns[inode] = Connection(addr, port, state)
    return conns


def parse_environ(data):
    env = {}
    for item in data[:MAX_ENV_BYTES].split(b'\0'):
        if not item or b'=' not in item:
            continue
        key, _sep, value = item.partition(b'=')
        env[key.decode('utf-8', 'replace')] = value.decode('utf-8', 'replace')
    return env


def parse_maps(text):
    libs = []
    seen = set()
    for count, line in enumerate(kernel_lines(text)):  # file names are users' text: the kernel escapes only '\n'
        if count >= MAX_MAPS_LINES:
            break
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(' (deleted)'):
            path = path[:-len(' (deleted)')]
        base = path.rsplit('/', 1)[-1]
        if ('.so' in base) and path not in seen:
            seen.add(path)
            libs.append(path)
    return libs


CONTAINER_CONFIGS = (
    ('docker', '/var/lib/docker/containers/{id}/config.v2.json'),
    ('containerd', '/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json'),
    ('cri-o', '/run/containers/storage/overlay-containers/{id}/userdata/config.json'),
    ('cri-o', '/var/lib/containers/storage/overlay-containers/{id}/userdata/config.json'),
)


def container_image(container_id, root='/'):
    """(image reference, image digest or id) of a container from its runtime's files, best effort."""
    if not container_id or not re.match(r'^[0-9a-f]{64}$', container_id):
        return None, None
    for _runtime, pattern in CONTAINER_CONFIGS:
        path = os.path.join(root, pattern.format(id=container_id).lstrip('/'))
        try:
            data = json.loads(_read_bytes(path, 4 * 1024 * 1024).decode('utf-8', 'replace'))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        config = data.get('Config') if isinstance(data.get('Config'), dict) else {}
        if config.get('Image'):
            return config.get('Image'), data.get('Image')
        notes = data.get('annotations') if isinstance(data.get('annotations'), dict) else {}
        name = notes.get('io.kubernetes.cri.image-name') or notes.get('io.kubernetes.cri-o.ImageName')
        ref = notes.get('io.kubernetes.cri-o.ImageRef') or notes.get('io.kubernetes.cri.image-ref')
        if name or ref:
            return name, ref
    return None, None


class FactsCollector(object):
    """Builds ProcessFacts for the processes of a snapshot from /proc (and the usage history).

    ``proc_root`` and ``root`` are test seams.  The environment of a process is read only when we
    are root or it is our own user's process; other users' maps, fds and exe need root as well,
    and what could not be read is None (a note in the finding says so).  ``exe_hashes``: the
    exe_hash.ExeHashes that hashes executables for allowlist entries (the guard's keeps its
    digests across ticks); default: a new one.
    """

    def __init__(self, proc_root='/proc', root='/', history_path=None, allocation='auto', window_s=R.WINDOW_S,
                 exe_hashes=None):
        if allocation not in ('auto', 'always', 'never'):
            raise InvalidArgument('require_allocation', allocation, 'expected auto, always or never')
        self.proc_root = proc_root
        self.exe_hashes = exe_hashes if exe_hashes is not None else ExeHashes(proc_root=proc_root)
        self.root = root
        self.history_path = history_path
        self.allocation = allocation
        self.window_s = window_s
        self.euid = os.geteuid()
        self.warnings = []
        self.fd_budget = FdBudget(seconds=None)   # the open files of every process examined, together

    def collect(self, snapshot, include_holders=True):
        expected, reason = self._allocation(snapshot)
        reader = self._history_reader(snapshot)
        facts_list = []
        try:
            items = [(proc, True) for proc in snapshot.processes]
            if include_holders:
                items += [(holder, False) for holder in snapshot.holders]
            for proc, listed in items:
                facts = self.facts_for(proc, snapshot, listed)
                facts.allocation_expected = expected
                facts.allocation_reason = reason
                if reader is not None and facts.starttime is not None:
                    since = snapshot.taken_at - self.window_s - 60
                    try:
                        util, mem = reader.series(facts.pid, facts.starttime, since)
                    except Exception as exc:  # pylint: disable=broad-except
                        self.warnings.append('could not read the usage history: %s' % exc)
                        reader.close()
                        reader = None
                    else:
                        facts.util_series, facts.mem_series = util, mem
                facts_list.append(facts)
        finally:
            if reader is not None:
                reader.close()
        return facts_list

    def _history_reader(self, snapshot):
        if not self.history_path or not os.path.exists(self.history_path) or not snapshot.processes:
            return None
        from .. import history  # pylint: disable=import-outside-toplevel
        try:
            return history.HistoryReader(self.history_path)
        except history.HistoryError as exc:
            self.warnings.append(str(exc))
            return None

    def _allocation(self, snapshot):
        if self.allocation == 'never':
            return False, None
        if self.allocation == 'always':
            return True, 'require_allocation=always'
        allocated = [p for p in snapshot.processes if p.container is not None or p.slurm_job]
        if allocated:
            return True, 'other GPU processes on this host run in Slurm jobs or containers'
        daemon = self._allocating_daemon()
        if daemon:
            return True, '%s runs on this host' % daemon
        return False, None

    def _allocating_daemon(self):
        return scheduler_daemon(self.proc_root)

    def facts_for(self, proc, snapshot, listed=True):
        """ProcessFacts of one snapshot entry (GpuProcess or Holder)."""
        facts = ProcessFacts(pid=proc.pid, starttime=proc.starttime, user=proc.user, uid=proc.uid, name=proc.name,
                             listed=listed)
        facts.cmdline, facts.truncated = _norm_args(proc.cmdline)
        facts.exe = proc.exe
        facts.slurm_job = proc.slurm_job
        facts.gpu_indexes = list(getattr(proc, 'gpu_indexes', None) or [])
        facts.used_mib = getattr(proc, 'used_mib', None)
        totals = [snapshot.device(i).memory_total_mib for i in facts.gpu_indexes if snapshot.device(i) is not None]
        facts.gpu_memory_total_mib = sum(totals) if totals and None not in totals else None
        if proc.container is not None:
            facts.container = {'id': proc.container.id, 'runtime': proc.container.runtime, 'pod_uid': proc.container.pod_uid,
                               'image': None, 'image_digest': None}
            facts.container['image'], facts.container['image_digest'] = container_image(proc.container.id, self.root)
        if getattr(proc, 'status', None) == 'not_found':
            facts.notes.append('the driver lists pid %d but it is not visible here; only driver data was examined' % proc.pid)
            return facts
        base = os.path.join(self.proc_root, str(proc.pid))
        if not self._same_process(base, proc.starttime):
            facts.notes.append('pid %d exited or was reused while it was examined' % proc.pid)
            return facts
        try:
            facts.exe = os.readlink(os.path.join(base, 'exe'))
        except OSError:
            pass
        facts.sha256_fn = lambda: self._sha256(proc, facts)
        if self.euid == 0 or (proc.uid is not None and proc.uid == self.euid):
            try:
                facts.env = parse_environ(_read_bytes(os.path.join(base, 'environ'), MAX_ENV_BYTES))
            except OSError as exc:
                facts.notes.append('environment not readable: %s' % (exc.strerror or exc))
        else:
            facts.notes.append('environment not read (needs root for other users\' processes)')
        try:
            facts.maps = parse_maps(_read_bytes(os.path.join(base, 'maps'), 32 * 1024 * 1024).decode('utf-8', 'replace'))
        except OSError as exc:
            facts.notes.append('mapped libraries not readable: %s' % (exc.strerror or exc))
        facts.connections = self._connections(base, facts)
        facts.parents = self._parents(proc.ppid if proc.ppid is not None else read_ppid(os.path.basename(base), self.proc_root))
        return facts

    def _sha256(self, proc, facts):
        known = len(self.exe_hashes.notes)
        digest = self.exe_hashes.sha256(proc.pid, proc.starttime)
        facts.notes.extend(self.exe_hashes.notes[known:])
        return digest

    def _same_process(self, base, starttime):
        if starttime is None:
            return os.path.isdir(base)
        return read_starttime(os.path.basename(base), self.proc_root) == starttime

    def _connections(self, base, facts):
        """The TCP connections of the process at ``base``: its socket fds (the core's one bounded fd walk, at most
        fdwalk.DESCRIPTORS per collector: a user's huge fd tables cannot make a scan run on) in its net namespace."""
        inodes = set()
        found = list(walk_fd_links(self.proc_root, [int(os.path.basename(base))], budget=self.fd_budget))
        if not found or found[0][3] is False:
            facts.notes.append('open files not readable')
            return None
        if found[0][3] is None:
            facts.notes.append('open files read in part (%d of %s): the scan\'s bound' % (
                len(found[0][2]), self.fd_budget.unread.get(found[0][0]) or 'more'))
        for target in found[0][2]:
            if target.startswith('socket:['):
                try:
                    inodes.add(int(target[8:-1]))
                except ValueError:
                    pass
        if not inodes:
            return []
        table = {}
        for name, ipv6 in (('tcp', False), ('tcp6', True)):
            try:
                table.update(parse_proc_net_tcp(_read_bytes(os.path.join(base, 'net', name), 64 * 1024 * 1024).decode('ascii', 'replace'), ipv6))
            except OSError:
                continue
        return [table[i] for i in sorted(inodes) if i in table]

    def _parents(self, ppid):
        parents = []
        seen = set()
        pid = ppid
        while pid and pid > 0 and pid not in seen and len(parents) < MAX_PARENTS:
            seen.add(pid)
            base = os.path.join(self.proc_root, str(pid))
            stat = read_stat(pid, self.proc_root)
            if stat is None:
                break
            entry = {'pid': pid, 'name': stat['comm'], 'exe': None, 'cmdline': None}
            try:
                raw = _read_bytes(os.path.join(base, 'cmdline'), 64 * 1024)
                entry['cmdline'] = _norm_args(raw.rstrip(b'\0').split(b'\0') if raw else [])[0]
            except OSError:
                pass
            try:
                entry['exe'] = os.readlink(os.path.join(base, 'exe'))
            except OSError:
                pass
            parents.append(entry)
            pid = stat['ppid']
        return parents
