# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The facts model of the rogue detector: what it knows about one process, bounded and cleaned.

``ProcessFacts`` is a plain description of one GPU process (command line, executable, environment,
mapped libraries, TCP connections, parent chain, container, utilization samples, ...);
``ProcessFacts.from_dict`` builds one from a fixture, ``procfs.FactsCollector`` from /proc.  The
bottom layer of the package: it imports only the data (rules.py) and the core's text helpers.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..text import clean_text
from . import rules as R

# Bounds on what one process can make us read or scan.
MAX_SCAN_CHARS = 2 * 1024 * 1024
MAX_ARGS = 65536
MAX_EVIDENCE = 8
MAX_EVIDENCE_TEXT = 256
MAX_PARENTS = 16
_VERSION_SUFFIX_RE = re.compile(r'[-_.]?v?\d[0-9a-z._-]{0,30}$')
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in R.PRIVATE_NETWORKS)
ACTIVE_STATES = ('ESTABLISHED', 'SYN_SENT')


# ---------------------------------------------------------------------------- text helpers
def _evidence(source, value, note=None):
    return {'source': source, 'value': clean_text(value, MAX_EVIDENCE_TEXT), 'note': note}


def _basename(path):
    if not path:
        return ''
    text = path[:-len(' (deleted)')] if path.endswith(' (deleted)') else path
    return text.rstrip('/').rsplit('/', 1)[-1]


def _strip_version(name):
    stripped = _VERSION_SUFFIX_RE.sub('', name)
    return stripped or name


def _split_cmdline_text(text):
    if '\x00' in text:
        parts = text.split('\x00')
        return parts[:-1] if parts and parts[-1] == '' else parts
    if len(text) > 65536:
        return text.split()
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _norm_args(value):
    """(bounded list of str, truncated) from a list/str/bytes command line (None stays None).

    At most MAX_SCAN_CHARS characters and MAX_ARGS arguments are kept: the first and the last
    half of each budget, so padding cannot push a marker out of sight at the end.  Dropped
    arguments in between become empty strings while the count allows, so argv indices stay right.
    """
    if value is None:
        return None, False
    if isinstance(value, (bytes, str)):
        value = _split_cmdline_text(clean_text(value))
    if not isinstance(value, (list, tuple)):
        raise ValueError('cmdline must be a list of strings or a string')
    half_chars = MAX_SCAN_CHARS // 2
    half_args = MAX_ARGS // 2
    head = _take(value, half_chars, half_args)
    if len(head) == len(value):
        return head, False
    tail = _take(value[len(head):][::-1], half_chars, half_args)[::-1]
    middle = len(value) - len(head) - len(tail)
    if middle == 0:
        return head + tail, False
    if len(value) <= MAX_ARGS:
        return head + [''] * middle + tail, True
    return head + tail, True


def _take(items, max_chars, max_count):
    out = []
    total = 0
    for item in items:
        text = clean_text(item) or ''
        if len(out) >= max_count or total + len(text) > max_chars:
            break
        out.append(text)
        total += len(text)
    return out


def _parse_ip(text):
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if addr.version == 6 and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def is_public(addr):
    """True unless ``addr`` is loopback, RFC 1918, link-local, CGNAT, unique-local or unspecified."""
    return not any(addr.version == net.version and addr in net for net in _PRIVATE_NETS)


# ---------------------------------------------------------------------------- facts
@dataclass
class Connection:
    """One TCP connection of a process: remote address (ip_address) and port, and its state."""

    address: Any
    port: int
    state: str = 'ESTABLISHED'

    def text(self):
        if self.address.version == 6:
            return '[%s]:%d' % (self.address, self.port)
        return '%s:%d' % (self.address, self.port)


@dataclass
class ProcessFacts:
    """Everything the detector looks at for one process.  ``None`` means "could not be read"."""

    pid: int = 0
    starttime: Optional[int] = None
    user: Optional[str] = None
    uid: Optional[int] = None
    name: Optional[str] = None
    cmdline: Optional[List[str]] = None
    exe: Optional[str] = None                    # the /proc/PID/exe link text (" (deleted)" kept)
    exe_sha256: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    maps: Optional[List[str]] = None              # mapped shared libraries (paths)
    connections: Optional[List[Connection]] = None
    parents: List[Dict[str, Any]] = field(default_factory=list)   # nearest first: pid, name, exe, cmdline
    container: Optional[Dict[str, Any]] = None    # id, runtime, pod_uid, image, image_digest
    slurm_job: Optional[str] = None
    gpu_indexes: List[int] = field(default_factory=list)
    used_mib: Optional[int] = None
    gpu_memory_total_mib: Optional[int] = None
    util_series: List[Any] = field(default_factory=list)     # [(ts, percent)] oldest first
    mem_series: List[Any] = field(default_factory=list)      # [(ts, MiB)] oldest first
    allocation_expected: Optional[bool] = None
    allocation_reason: Optional[str] = None
    listed: bool = True
    truncated: bool = False
    notes: List[str] = field(default_factory=list)
    sha256_fn: Optional[Callable[[], Optional[str]]] = None

    KEYS = ('pid', 'starttime', 'user', 'uid', 'name', 'cmdline', 'exe', 'exe_sha256', 'env', 'maps', 'connections',
            'parents', 'container', 'slurm_job', 'gpu_indexes', 'used_mib', 'gpu_memory_total_mib', 'util_series',
            'mem_series', 'allocation_expected', 'allocation_reason', 'listed', 'notes')

    @classmethod
    def from_dict(cls, data):
        """Build facts from a plain dictionary (fixtures, tests).  Unknown keys raise ValueError.

        ``cmdline`` is a list or a shell-like string; ``connections`` items are ``"ip:port"``,
        ``"[ip6]:port"`` or ``{address, port, state}``; ``util_series``/``mem_series`` are lists of
        numbers (one sample a minute, ending now) or of ``[ts, value]`` pairs.
        """
        if not isinstance(data, dict):
            raise ValueError('process facts must be a mapping')
        unknown = sorted(str(k) for k in data if k not in cls.KEYS)
        if unknown:
            raise ValueError('unknown process facts keys: %s' % ', '.join(unknown))
        facts = cls()
        facts.pid = int(data.get('pid') or 0)
        facts.starttime = _opt_int(data.get('starttime'))
        facts.user = clean_text(data.get('user'))
        facts.uid = _opt_int(data.get('uid'))
        facts.name = clean_text(data.get('name'))
        facts.cmdline, facts.truncated = _norm_args(data.get('cmdline'))
        facts.exe = clean_text(data.get('exe'))
        facts.exe_sha256 = clean_text(data.get('exe_sha256'))
        env = data.get('env')
        if env is not None:
            if isinstance(env, (list, tuple)):
                env = dict(_split_env_item(item) for item in env)
            if not isinstance(env, dict):
                raise ValueError('env must be a mapping or a list of KEY=VALUE')
            facts.env = dict((clean_text(k), clean_text(v) if v is not None else '') for k, v in env.items())
        maps = data.get('maps')
        facts.maps = None if maps is None else [clean_text(m) for m in maps]
        conns = data.get('connections')
        facts.connections = None if conns is None else [c for c in (_parse_connection(c) for c in conns) if c is not None]
        facts.parents = [_parent(p) for p in (data.get('parents') or [])]
        container = data.get('container')
        if container is not None:
            if not isinstance(container, dict):
                raise ValueError('container must be a mapping')
            facts.container = dict((str(k), clean_text(v)) for k, v in container.items())
        facts.slurm_job = clean_text(data.get('slurm_job'))
        facts.gpu_indexes = [int(i) for i in (data.get('gpu_indexes') or [])]
        facts.used_mib = _opt_int(data.get('used_mib'))
        facts.gpu_memory_total_mib = _opt_int(data.get('gpu_memory_total_mib'))
        facts.util_series = _series(data.get('util_series'))
        facts.mem_series = _series(data.get('mem_series'))
        if data.get('allocation_expected') is not None:
            facts.allocation_expected = bool(data.get('allocation_expected'))
        facts.allocation_reason = clean_text(data.get('allocation_reason'))
        facts.listed = bool(data.get('listed', True))
        facts.notes = [clean_text(n) for n in (data.get('notes') or [])]
        return facts

    def sha256(self):
        """The executable's SHA-256 (hex), computed once on demand for live processes."""
        if self.exe_sha256 is None and self.sha256_fn is not None:
            fn, self.sha256_fn = self.sha256_fn, None
            self.exe_sha256 = fn()
        return self.exe_sha256


def _opt_int(value):
    if value is None or isinstance(value, bool):
        return None
    return int(value)


def _split_env_item(item):
    text = clean_text(item) or ''
    key, _sep, value = text.partition('=')
    return key, value


def _parent(entry):
    if not isinstance(entry, dict):
        entry = {'name': entry}
    cmdline, _trunc = _norm_args(entry.get('cmdline'))
    return {'pid': _opt_int(entry.get('pid')), 'name': clean_text(entry.get('name')), 'exe': clean_text(entry.get('exe')),
            'cmdline': cmdline}


def _parse_connection(item):
    if isinstance(item, Connection):
        return item
    state = 'ESTABLISHED'
    if isinstance(item, dict):
        address, port, state = item.get('address'), item.get('port'), item.get('state') or state
    else:
        text = clean_text(item) or ''
        if text.startswith('['):
            address, _sep, port = text[1:].partition(']:')
        else:
            address, _sep, port = text.rpartition(':')
    addr = _parse_ip(clean_text(address) or '')
    try:
        port = int(port)
    except (TypeError, ValueError):
        return None
    if addr is None or not 0 < port < 65536:
        return None
    return Connection(addr, port, str(state).upper())


def _series(value):
    if not value:
        return []
    points = []
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        count = len(value)
        for i, v in enumerate(value):
            points.append((float(i - count + 1) * 60.0, float(v)))
        return points
    for item in value:
        ts, v = item
        if v is None:
            continue
        points.append((float(ts), float(v)))
    points.sort()
    return points
