# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Rogue (crypto-miner) detection: indicators with weights, a score, a level, and the evidence.

Three parts, so that the rules can be tested without live processes:

* ``ProcessFacts``: a plain description of one GPU process (command line, executable, environment,
  mapped libraries, TCP connections, parent chain, container, utilization samples, ...).
  ``ProcessFacts.from_dict`` builds one from a fixture; ``FactsCollector`` builds them from a
  live snapshot by reading /proc.
* ``RogueConfig``: built-in rules plus the operator's pools, weights, custom rules and allowlist,
  loaded from a YAML rules file or an inline dictionary and validated against a schema
  (``load_config``).  Errors name the file, the line and the field.
* ``Detector``: evaluates every enabled rule against a ProcessFacts and returns a finding (a
  dictionary: who, which GPU, how much memory, the score, the level and each fired rule with its
  concrete evidence), or None when no rule fires.

Scoring (docs/rogue-detection.md): hard + soft + behavioural points, where behavioural points are
capped and lowered by suppressors; critical needs a hard indicator, high needs a hard indicator or
enough soft ones.  The data (names, lists, weights) lives in rogue_rules.py.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .. import notify, safe_files
from . import rules as R
from ..errors import GpuFleetError, InvalidArgument, MissingLibrary
from ..exe_hash import ExeHashes
from ..identity import kernel_lines
from ..processes import scheduler_daemon
from ..select import MAX_MATCH_TEXT, compile_regex
from ..select import _human  # one duration formatter for the core's messages
from ..text import clean_text

try:
    import yaml
    YAML_IMPORT_ERROR = None
except Exception:  # pylint: disable=broad-except
    yaml = None
    import traceback
    YAML_IMPORT_ERROR = traceback.format_exc()

LEVELS = R.LEVELS
SCHEMA_VERSION = 1
# Bounds on what one process can make us read or scan.
MAX_SCAN_CHARS = 2 * 1024 * 1024
MAX_ARGS = 65536
MAX_OPTION_ARGS = 4096
MAX_EVIDENCE = 8
MAX_EVIDENCE_TEXT = 256
MAX_ENV_BYTES = 1024 * 1024
MAX_MAPS_LINES = 65536
MAX_PARENTS = 16
MAX_RULES_FILE = 1024 * 1024
MAX_OUTPUT_ARGS = 64
MAX_OUTPUT_ARG = 1024
_ID_RE = re.compile(r'^[A-Za-z][A-Za-z0-9_.-]{0,63}$')
_HOST_RE = re.compile(r'^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)+$')
_SHA256_RE = re.compile(r'^[0-9a-f]{64}$')
_VERSION_SUFFIX_RE = re.compile(r'[-_.]?v?\d[0-9a-z._-]{0,30}$')
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in R.PRIVATE_NETWORKS)
TCP_STATES = {'01': 'ESTABLISHED', '02': 'SYN_SENT', '03': 'SYN_RECV', '04': 'FIN_WAIT1', '05': 'FIN_WAIT2',
              '06': 'TIME_WAIT', '07': 'CLOSE', '08': 'CLOSE_WAIT', '09': 'LAST_ACK', '0A': 'LISTEN', '0B': 'CLOSING'}
ACTIVE_STATES = ('ESTABLISHED', 'SYN_SENT')


class RulesError(GpuFleetError):
    """A rules file or inline rules that do not match the schema: names the source, line and field."""

    def __init__(self, source, line, field_name, why, errors=None):
        self.source = source
        self.line = line
        self.field = field_name or None
        self.why = why
        # every error of the document, (source, line, field, why), in the order of the file
        self.errors = list(errors) if errors else [(source, line, field_name or None, why)]
        super(RulesError, self).__init__('\n'.join('%s: %s: %s' % (src if ln is None else '%s:%d' % (src, ln), fld or '(document)', text)
                                                   for src, ln, fld, text in self.errors))

    @classmethod
    def combine(cls, errors):
        """One RulesError for all ``errors`` (tuples as in ``errors``), sorted by line."""
        errors = sorted(errors, key=lambda item: item[1] or 0)
        return cls(errors[0][0], errors[0][1], errors[0][2], errors[0][3], errors)


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


# ---------------------------------------------------------------------------- evaluation context
class _Option(object):
    __slots__ = ('index', 'flag', 'value', 'joined')

    def __init__(self, index, flag, value, joined=False):
        self.index = index
        self.flag = flag
        self.value = value
        self.joined = joined

    def text(self):
        """The option as written: ``--x=v`` or ``-x v``."""
        if self.value is None:
            return self.flag
        return '%s%s%s' % (self.flag, '=' if self.joined else ' ', self.value)


def parse_options(args):
    """(index, flag, value) for the options of ``args``: ``--x=v``, ``-x v``, ``--x v``, ``-x``."""
    options = []
    if not args:
        return options
    limit = min(len(args), MAX_OPTION_ARGS)
    i = 1
    while i < limit:
        arg = args[i]
        if len(arg) > 1 and arg[0] == '-' and arg != '--' and not _is_number(arg):
            if '=' in arg and len(arg) <= 4096:
                flag, _sep, value = arg.partition('=')
                options.append(_Option(i, flag, value, joined=True))
            elif i + 1 < len(args) and (not args[i + 1].startswith('-') or _is_number(args[i + 1])):
                options.append(_Option(i, arg, args[i + 1]))
                i += 1
            else:
                options.append(_Option(i, arg, None))
        i += 1
    return options


def _is_number(text):
    try:
        float(text)
    except (ValueError, OverflowError):
        return False
    return True


class _Context(object):
    """Lazily computed views of one ProcessFacts shared by the rules."""

    def __init__(self, facts, config):
        self.facts = facts
        self.config = config
        self.args = facts.cmdline or []
        self._options = None

    @property
    def options(self):
        if self._options is None:
            self._options = parse_options(self.args)
        return self._options

    def texts(self):
        """(source, text) for every argument and every environment value."""
        for i, arg in enumerate(self.args):
            yield 'argv[%d]' % i, arg
        for key, value in sorted((self.facts.env or {}).items()):
            yield 'env:%s' % key, value

    def argv0(self):
        return self.args[0] if self.args else None


def is_algorithm(value):
    if not value or len(value) > 40:
        return False
    text = value.strip().lower()
    return text in R.ALGORITHMS or text.startswith(R.ALGORITHM_PREFIXES)


def match_wallet(candidate):
    """The coin whose address pattern ``candidate`` matches exactly, or None."""
    if not candidate or len(candidate) > 120:
        return None
    for coin, pattern in R.WALLET_PATTERNS:
        if pattern.fullmatch(candidate):
            return coin
    return None


def wallet_candidate(value):
    """The address part of a wallet/user option value: ``ADDR.worker``, ``ADDR/worker``, ``ADDR:pass``."""
    text = (value or '').strip()[:300]
    if text.lower().startswith('kaspa:'):
        return re.split(r'[./+]', text, 1)[0]
    text = text.split(':', 1)[0]
    return re.split(r'[./+]', text, 1)[0]


# ---------------------------------------------------------------------------- built-in rules
def rule_stratum(ctx):
    found = []
    for source, text in ctx.texts():
        if not _maybe_stratum(text):
            continue
        for match in R.STRATUM_RE.finditer(text):
            found.append(_evidence(source, match.group(0)))
            if len(found) >= MAX_EVIDENCE:
                return found
    return found


def _maybe_stratum(text):
    lowered = text.lower()
    return 'stratum' in lowered or 'ethproxy+' in lowered or 'nicehash+' in lowered


def rule_miner_flags(ctx):
    found = []
    options = ctx.options
    for opt in options:
        if opt.flag in R.MINER_ONLY_FLAGS:
            found.append(_evidence('argv[%d]' % opt.index, opt.text(), 'an option only miners have'))
    pools = [o for o in options if o.flag in R.POOL_FLAGS and o.value and ('.' in o.value or ':' in o.value)]
    if pools:
        pool = pools[0]
        algos = [o for o in options if o.flag in R.ALGO_FLAGS and is_algorithm(o.value)]
        coins = [o for o in options if o.flag in R.COIN_FLAGS and o.value and
                 (o.value.strip().lower() in R.COINS or is_algorithm(o.value))]
        wallets = [o for o in options if o.flag in ('-wal', '-ewal', '-dwal', '-zwal', '--wallet') and o.value]
        for group, why in ((algos, 'a pool option with a mining algorithm'), (coins, 'a pool option with --coin'),
                           (wallets, 'a pool option with a wallet option')):
            if group:
                found.append(_evidence('argv[%d]' % pool.index, pool.text(), why))
                found.append(_evidence('argv[%d]' % group[0].index, group[0].text(), why))
    return _dedupe(found)


def rule_wallet(ctx):
    found = []
    for opt in ctx.options:
        if opt.flag in R.WALLET_FLAGS and opt.value:
            coin = match_wallet(wallet_candidate(opt.value))
            if coin:
                found.append(_evidence('argv[%d]' % opt.index, opt.text(), '%s address' % coin))
    for source, text in ctx.texts():
        if not _maybe_stratum(text) and '@' not in text:
            continue
        for match in R.STRATUM_RE.finditer(text):
            rest = match.group(0).split('://', 1)[1]
            if '@' in rest:
                coin = match_wallet(wallet_candidate(rest.split('@', 1)[0]))
                if coin:
                    found.append(_evidence(source, match.group(0), '%s address as the user of a pool URL' % coin))
        if len(found) >= MAX_EVIDENCE:
            break
    return _dedupe(found)[:MAX_EVIDENCE]


def rule_pool_host(ctx):
    domains = ctx.config.pool_domains
    found = []
    for source, text in ctx.texts():
        lowered = text.lower()
        if '.' not in lowered:
            continue
        for token in R.HOST_TOKEN_SPLIT_RE.split(lowered):
            if len(token) < 4 or len(token) > 253 or '.' not in token:
                continue
            token = token.strip('.-')
            labels = token.split('.')
            for k in range(len(labels) - 1):
                suffix = '.'.join(labels[k:])
                if suffix in domains:
                    found.append(_evidence(source, token, 'pool domain %s' % suffix))
                    break
            if len(found) >= MAX_EVIDENCE:
                return found
    return found


def rule_pool_conn(ctx):
    found = []
    networks = ctx.config.pool_networks
    if not networks:
        return found
    for conn in ctx.facts.connections or ():
        if conn.state not in ACTIVE_STATES:
            continue
        for net in networks:
            if conn.address.version == net.version and conn.address in net:
                found.append(_evidence('connection', conn.text(), 'pool list entry %s' % net))
                break
    return found[:MAX_EVIDENCE]


def rule_pool_port(ctx):
    found = []
    ports = ctx.config.pool_ports
    for conn in ctx.facts.connections or ():
        if conn.state in ACTIVE_STATES and conn.port in ports and is_public(conn.address):
            found.append(_evidence('connection', conn.text(), 'public address, mining pool port %d' % conn.port))
    return found[:MAX_EVIDENCE]


def rule_miner_name(ctx):
    names = ctx.config.miner_names
    found = []
    facts = ctx.facts
    for source, value in (('argv[0]', ctx.argv0()), ('name', facts.name), ('exe', facts.exe)):
        base = _basename(value or '').lower()
        if base.endswith('.exe'):
            base = base[:-4]
        if base and (base in names or _strip_version(base) in names):
            found.append(_evidence(source, value, 'known miner %s' % base))
    return found


def rule_algo(ctx):
    return [_evidence('argv[%d]' % o.index, o.text(), 'mining algorithm')
            for o in ctx.options if o.flag in R.ALGO_FLAGS and is_algorithm(o.value)][:MAX_EVIDENCE]


def rule_masquerade(ctx):
    facts = ctx.facts
    found = []
    exe_base = _basename(facts.exe or '').lower()
    argv0 = ctx.argv0()
    claimed = _basename(argv0 or '').lower()
    if facts.exe and exe_base and claimed:
        stem = _strip_version(claimed)
        for claims, backers in R.MASQUERADE_CLAIMS:
            if stem in claims or claimed in claims:
                if not exe_base.startswith(backers):
                    found.append(_evidence('argv[0]', argv0, 'claims to be %s but the executable is %s' % (claimed, facts.exe)))
                break
    for source, value in (('argv[0]', argv0), ('name', facts.name)):
        if value and value.startswith('[') and value.rstrip().endswith(']') and facts.exe:
            found.append(_evidence(source, value, 'looks like a kernel thread but runs %s' % facts.exe))
            break
    if facts.exe and exe_base:
        for source, value in (('argv[0]', argv0), ('name', facts.name)):
            base = _basename(value or '').lower().split('/')[0].strip('[]')
            daemon = base.split('/')[0]
            if daemon in R.SYSTEM_DAEMON_NAMES and not exe_base.startswith(daemon):
                found.append(_evidence(source, value, 'a system daemon name on %s' % facts.exe))
                break
    return _dedupe(found)


def rule_exe_location(ctx):
    exe = ctx.facts.exe
    if not exe:
        return []
    found = []
    path = exe
    if exe.endswith(' (deleted)'):
        found.append(_evidence('exe', exe, 'the executable was deleted after it started'))
        path = exe[:-len(' (deleted)')]
    if path.startswith('/memfd:'):
        found.append(_evidence('exe', exe, 'runs from an anonymous memory file (memfd)'))
        return found
    if path.startswith(R.TEMP_DIRS):
        found.append(_evidence('exe', exe, 'runs from a world-writable temporary directory'))
    hidden = _hidden_component(path)
    if hidden:
        found.append(_evidence('exe', exe, 'runs from the hidden path component %s' % hidden))
    return found


def _hidden_component(path):
    """The first hidden directory (or a hidden file name) of ``path`` that is no known toolchain home."""
    parts = [p for p in path.split('/') if p]
    if parts and parts[-1].startswith('.') and parts[-1] not in ('.', '..'):
        return parts[-1]
    for i, part in enumerate(parts[:-1]):
        if not part.startswith('.') or part in ('.', '..'):
            continue
        if part in R.BENIGN_DOT_SUBDIRS:
            nxt = parts[i + 1] if i + 1 < len(parts) - 1 else None
            if nxt in R.BENIGN_DOT_SUBDIRS[part]:
                continue
            return part
        if part in R.BENIGN_DOT_DIRS:
            continue
        return part
    return None


def rule_miner_env(ctx):
    env = ctx.facts.env
    if not env:
        return []
    found = []
    keys = ctx.config.miner_env_keys
    for key in sorted(env):
        value = env[key]
        if key in keys:
            found.append(_evidence('env:%s' % key, '%s=%s' % (key, value), 'set by mining scripts'))
        elif key in R.MINER_ENV_VALUES and (value or '').strip().lower() in R.MINER_ENV_VALUES[key]:
            found.append(_evidence('env:%s' % key, '%s=%s' % (key, value), 'set by mining scripts'))
    return found[:MAX_EVIDENCE]


def rule_no_allocation(ctx):
    facts = ctx.facts
    if not facts.allocation_expected or facts.container or facts.slurm_job:
        return []
    return [_evidence('allocation', 'none', 'in no Slurm job and no container, while %s' % (
        facts.allocation_reason or 'this host allocates GPUs through them'))]


def _window(series, window_s):
    if not series:
        return []
    end = series[-1][0]
    return [(t, v) for t, v in series if t >= end - window_s]


def _stats(values):
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, math.sqrt(var)


def _window_ok(points, window_s, min_samples):
    return len(points) >= min_samples and points[-1][0] - points[0][0] >= 0.8 * window_s


def rule_flat_util(ctx):
    cfg = ctx.config
    points = _window(ctx.facts.util_series, cfg.window_s)
    if not _window_ok(points, cfg.window_s, cfg.min_samples):
        return []
    mean, stdev = _stats([v for _t, v in points])
    if mean >= R.FLAT_UTIL_MIN_PCT and (mean == 0 or stdev / mean < R.FLAT_UTIL_MAX_COV):
        return [_evidence('utilization', 'mean %.1f%%, stdev %.2f' % (mean, stdev),
                          '%d samples over %s' % (len(points), _human(points[-1][0] - points[0][0])))]
    return []


def rule_flat_mem(ctx):
    cfg = ctx.config
    facts = ctx.facts
    points = _window(facts.mem_series, cfg.window_s)
    if not _window_ok(points, cfg.window_s, cfg.min_samples) or not facts.gpu_memory_total_mib:
        return []
    values = [v for _t, v in points]
    mean = sum(values) / len(values)
    spread = max(values) - min(values)
    if mean > 0 and spread <= max(64.0, 0.01 * mean) and mean < R.FLAT_MEM_MAX_FRACTION * facts.gpu_memory_total_mib:
        return [_evidence('memory', '%d MiB (+/- %d) of %d MiB' % (mean, spread, facts.gpu_memory_total_mib),
                          '%d samples over %s' % (len(points), _human(points[-1][0] - points[0][0])))]
    return []


def ml_libraries(maps):
    """The mapped libraries (basenames) that are ML libraries."""
    found = []
    for path in maps or ():
        base = _basename(path or '').lower()
        if any(marker in base for marker in R.ML_LIBRARIES) and base not in found:
            found.append(base)
    return found


def rule_no_ml_libs(ctx):
    maps = ctx.facts.maps
    if maps is None or ml_libraries(maps):
        return []
    cuda = [m for m in maps if 'libcuda.so' in (m or '') or 'libnvidia-ml' in (m or '') or 'libOpenCL' in (m or '')]
    note = '%d shared libraries mapped, none an ML library' % len(maps)
    if cuda:
        note += '; GPU driver library %s is mapped' % _basename(cuda[0])
    return [_evidence('maps', '%d libraries' % len(maps), note)]


def rule_lineage(ctx):
    found = []
    for depth, parent in enumerate(ctx.facts.parents[:MAX_PARENTS], 1):
        name = (parent.get('name') or '').lower()
        args = parent.get('cmdline') or []
        base = _basename(args[0]).lower() if args else ''
        exe_base = _basename(parent.get('exe') or '').lower()
        source = 'parent[%d]' % depth
        label = '%s (pid %s)' % (parent.get('name') or base or '?', parent.get('pid'))
        if name in R.WEB_SERVERS or base in R.WEB_SERVERS or exe_base in R.WEB_SERVERS:
            found.append(_evidence(source, label, 'started by a web server'))
        elif name in R.CRON_NAMES or base in R.CRON_NAMES or exe_base in R.CRON_NAMES:
            found.append(_evidence(source, label, 'started by cron/at'))
        text = ' '.join(args)[:MAX_MATCH_TEXT]
        if text and R.PIPE_TO_SHELL_RE.search(text):
            found.append(_evidence(source, text, 'started by a download piped into a shell'))
    return found[:MAX_EVIDENCE]


BUILTIN_CHECKS = {
    'H-stratum': rule_stratum,
    'H-miner-flags': rule_miner_flags,
    'H-wallet': rule_wallet,
    'H-pool-host': rule_pool_host,
    'H-pool-conn': rule_pool_conn,
    'H-pool-port': rule_pool_port,
    'S-miner-name': rule_miner_name,
    'S-algo': rule_algo,
    'S-masquerade': rule_masquerade,
    'S-exe-location': rule_exe_location,
    'S-miner-env': rule_miner_env,
    'S-no-allocation': rule_no_allocation,
    'B-flat-util': rule_flat_util,
    'B-flat-mem': rule_flat_mem,
    'B-no-ml-libs': rule_no_ml_libs,
    'B-lineage': rule_lineage,
}


def _dedupe(items):
    seen = set()
    out = []
    for item in items:
        key = (item['source'], item['value'], item['note'])
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


# ---------------------------------------------------------------------------- custom rules
class CustomRule(object):
    """A rule from the rules file: every given matcher must match."""

    MATCHERS = ('cmdline', 'argv0', 'name', 'exe', 'user', 'env', 'maps', 'parent', 'image', 'remote_port', 'remote_addr')

    def __init__(self, rule_id, kind, weight, description, match, source=None):
        self.id = rule_id
        self.kind = kind
        self.weight = weight
        self.description = description
        self.match = match      # matcher -> compiled regex, set of ports, or list of networks
        self.source = source

    def check(self, ctx):
        facts = ctx.facts
        evidence = []
        for key, matcher in self.match.items():
            hit = self._one(key, matcher, ctx, facts)
            if hit is None:
                return []
            evidence.append(hit)
        return evidence

    @staticmethod
    def _search(regex, values, source):
        for value in values:
            if value and regex.search(value[:MAX_MATCH_TEXT]):
                return _evidence(source, value, 'matches %s' % regex.pattern)
        return None

    def _one(self, key, matcher, ctx, facts):
        if key == 'cmdline':
            return self._search(matcher, [' '.join(ctx.args)], 'cmdline')
        if key == 'argv0':
            return self._search(matcher, [ctx.argv0()], 'argv[0]')
        if key == 'name':
            return self._search(matcher, [facts.name], 'name')
        if key == 'exe':
            return self._search(matcher, [facts.exe], 'exe')
        if key == 'user':
            return self._search(matcher, [facts.user], 'user')
        if key == 'env':
            return self._search(matcher, ['%s=%s' % kv for kv in sorted((facts.env or {}).items())], 'env')
        if key == 'maps':
            return self._search(matcher, list(facts.maps or ()), 'maps')
        if key == 'parent':
            values = []
            for parent in facts.parents:
                values.append(parent.get('name'))
                values.append(' '.join(parent.get('cmdline') or []))
            return self._search(matcher, values, 'parent')
        if key == 'image':
            container = facts.container or {}
            return self._search(matcher, [container.get('image'), container.get('image_digest')], 'container.image')
        if key in ('remote_port', 'remote_addr'):
            for conn in facts.connections or ():
                if conn.state not in ACTIVE_STATES:
                    continue
                if key == 'remote_port' and conn.port in matcher:
                    return _evidence('connection', conn.text(), 'port %d' % conn.port)
                if key == 'remote_addr' and any(conn.address.version == n.version and conn.address in n for n in matcher):
                    return _evidence('connection', conn.text(), 'address in the rule\'s list')
            return None
        return None


# ---------------------------------------------------------------------------- allowlist
class AllowEntry(object):
    """One allowlist entry: exe+sha256, user+cmdline regex, or container image (optionally with user)."""

    def __init__(self, index, source, exe=None, sha256=None, user=None, cmdline=None, image=None, expires=None, comment=None):
        self.index = index
        self.source = source
        self.exe = exe
        self.sha256 = sha256
        self.user = user
        self.cmdline = cmdline
        self.image = image
        self.expires = expires
        self.comment = comment

    def kind(self):
        if self.exe:
            return 'exe+sha256'
        if self.image:
            return 'image'
        return 'user+cmdline'

    def matches(self, facts, args):
        if self.user is not None and facts.user != self.user:
            return False
        if self.exe:
            return facts.exe == self.exe and (facts.sha256() or '').lower() == self.sha256
        if self.image:
            container = facts.container or {}
            if '@' in self.image or self.image.startswith('sha256:'):
                # A digest names the content: compare the digest only.
                wanted = self.image.split('@', 1)[-1]
                return container.get('image_digest') == wanted
            return container.get('image') == self.image
        return self.cmdline is not None and bool(self.cmdline.search(' '.join(args)[:MAX_MATCH_TEXT]))

    def describe(self):
        return {'entry': self.index, 'source': self.source, 'match': self.kind(),
                'expires': self.expires.isoformat() if self.expires else None, 'comment': self.comment}


# ---------------------------------------------------------------------------- configuration
class RogueConfig(object):
    """The effective rule set: built-ins (weights, enabled), lists, custom rules and the allowlist."""

    def __init__(self):
        self.weights = dict((rid, weight) for rid, _kind, weight, _desc in R.BUILTIN_RULES)
        self.kinds = dict((rid, kind) for rid, kind, _weight, _desc in R.BUILTIN_RULES)
        self.descriptions = dict((rid, desc) for rid, _kind, _weight, desc in R.BUILTIN_RULES)
        self.disabled = set()
        self.pool_networks = []
        self.pool_domains = set(R.POOL_DOMAINS)
        self.pool_ports = set(R.POOL_PORTS)
        self.miner_names = set(R.MINER_NAMES)
        self.miner_env_keys = set(R.MINER_ENV_KEYS)
        self.custom = []
        self.allowlist = []
        self.expired = []
        self.warnings = []
        self.window_s = R.WINDOW_S
        self.min_samples = R.MIN_SAMPLES
        self.sources = []

    def rules(self):
        """(id, kind, weight, description, check) of every enabled rule, in order."""
        out = []
        for rid, _kind, _weight, _desc in R.BUILTIN_RULES:
            if rid not in self.disabled:
                out.append((rid, self.kinds[rid], self.weights[rid], self.descriptions[rid], BUILTIN_CHECKS[rid]))
        for rule in self.custom:
            if rule.id not in self.disabled:
                out.append((rule.id, rule.kind, self.weights.get(rule.id, rule.weight), rule.description, rule.check))
        return out

    def rule_ids(self):
        return [rid for rid, _k, _w, _d in R.BUILTIN_RULES] + [r.id for r in self.custom]


class _Val(object):
    """A value of the rules document with its YAML node (line numbers) and its path."""

    def __init__(self, value, node, path, source, loader=None, errors=None):
        self.value = value
        self.node = node
        self.path = path
        self.source = source
        self.loader = loader
        self.errors = [] if errors is None else errors   # shared by the whole document: every error is collected

    def run(self, func, *args):
        """func(*args), or None with its RulesError collected (the other fields are checked as well)."""
        try:
            return func(*args)
        except RulesError as exc:
            self.errors.extend(exc.errors)
            return None

    @property
    def line(self):
        if self.node is None:
            return None
        return self.node.start_mark.line + 1

    def error(self, why, node=None):
        line = self.line if node is None else node.start_mark.line + 1
        return RulesError(self.source, line, self.path, why)

    def child(self, value, node, suffix):
        path = '%s%s' % (self.path, suffix) if self.path else suffix.lstrip('.')
        return _Val(value, node, path, self.source, self.loader, self.errors)

    def mapping(self, allowed):
        """{key: _Val} of a mapping, rejecting keys not in ``allowed``."""
        if self.node is not None:
            if not isinstance(self.node, yaml.MappingNode):
                raise self.error('expected a mapping')
            out = {}
            for knode, vnode in self.node.value:
                key = knode.value if isinstance(knode, yaml.ScalarNode) else None
                if not isinstance(key, str) or key not in allowed:
                    self.errors.append((self.source, knode.start_mark.line + 1, self._sub(str(key)),
                                        'unknown key %r (allowed: %s)' % (key, ', '.join(sorted(allowed)))))
                    continue
                if key in out:
                    raise RulesError(self.source, knode.start_mark.line + 1, self._sub(key), 'duplicate key')
                out[key] = self.child(_construct(self.loader, vnode, self.source), vnode, '.' + key)
            return out
        if not isinstance(self.value, dict):
            raise self.error('expected a mapping')
        out = {}
        for key, value in self.value.items():
            if not isinstance(key, str) or key not in allowed:
                self.errors.append((self.source, None, self._sub(str(key)),
                                    'unknown key %r (allowed: %s)' % (key, ', '.join(sorted(allowed)))))
                continue
            out[key] = self.child(value, None, '.' + key)
        return out

    def _sub(self, key):
        return '%s.%s' % (self.path, key) if self.path else key

    def sequence(self):
        if self.node is not None:
            if not isinstance(self.node, yaml.SequenceNode):
                raise self.error('expected a list')
            return [self.child(_construct(self.loader, n, self.source), n, '[%d]' % i) for i, n in enumerate(self.node.value)]
        if not isinstance(self.value, (list, tuple)):
            raise self.error('expected a list')
        return [self.child(v, None, '[%d]' % i) for i, v in enumerate(self.value)]

    def string(self, allow_empty=False):
        if not isinstance(self.value, str) or (not allow_empty and not self.value.strip()):
            raise self.error('expected a non-empty string, got %s' % _type_name(self.value))
        return self.value

    def integer(self, low, high):
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error('expected a whole number from %d to %d, got %s' % (low, high, _type_name(value)))
        if not low <= value <= high:
            raise self.error('%d is out of range %d-%d' % (value, low, high))
        return value

    def regex(self):
        pattern = self.string()
        try:
            return compile_regex(self.path, pattern)
        except InvalidArgument as exc:
            raise self.error('bad regular expression %r: %s' % (pattern, exc.why))


def _type_name(value):
    if value is None:
        return 'nothing (null)'
    return type(value).__name__


def _construct(loader, node, source):
    """The Python value of a scalar node (mappings and sequences are walked through their nodes)."""
    if not isinstance(node, yaml.ScalarNode):
        return None
    try:
        return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
        raise RulesError(source, node.start_mark.line + 1, None, 'cannot read the value %r: %s' % (
            clean_text(node.value, 80), clean_text(getattr(exc, 'problem', None) or exc, 200)))


def _parse_document(text, source):
    """Compose ``text`` (YAML) into a node tree; returns (root _Val, loader)."""
    if yaml is None:
        raise MissingLibrary('PyYAML', YAML_IMPORT_ERROR, 'read rogue rules files')
    if isinstance(text, bytes):
        try:
            text = text.decode('utf-8')
        except UnicodeDecodeError as exc:
            raise RulesError(source, None, None, 'not UTF-8 text: %s' % exc)
    if len(text) > MAX_RULES_FILE:
        raise RulesError(source, None, None, 'larger than %d bytes' % MAX_RULES_FILE)
    from ..policy import DocumentLimitError, yaml_loader  # pylint: disable=import-outside-toplevel
    try:
        loader = yaml_loader()(text)   # the policy's loader: the same nesting and alias limits
    except yaml.YAMLError as exc:
        raise RulesError(source, None, None, 'not valid YAML: %s' % clean_text(exc, 300))
    try:
        return loader.get_single_node(), loader
    except DocumentLimitError as exc:
        loader.dispose()
        raise RulesError(source, exc.line, None, exc.why)
    except yaml.MarkedYAMLError as exc:
        loader.dispose()
        mark = exc.problem_mark or exc.context_mark
        raise RulesError(source, mark.line + 1 if mark else None, None, 'not valid YAML: %s' % (exc.problem or exc))
    except yaml.YAMLError as exc:
        loader.dispose()
        raise RulesError(source, None, None, 'not valid YAML: %s' % clean_text(exc, 300))
    except RecursionError:
        loader.dispose()
        raise RulesError(source, None, None, 'nested too deeply')


TOP_KEYS = ('version', 'pools', 'pool_ports', 'miner_names', 'miner_env', 'disable', 'weights', 'allowlist', 'rules',
            'window', 'min_samples')
RULE_KEYS = ('id', 'kind', 'weight', 'description', 'match')
ALLOW_KEYS = ('exe', 'sha256', 'user', 'cmdline', 'image', 'expires', 'comment')


def load_config(rules_file=None, rules=None, text=None, now=None, checked=False):
    """The effective RogueConfig: built-ins, then ``rules_file`` (a path), ``text`` (YAML) and ``rules`` (a dict).

    Raises RulesError naming the source, the line (YAML only) and the field.  Expired allowlist
    entries are dropped and listed in ``config.warnings``.  ``checked`` (the guard agent): the
    rules file is read without following a link and checked on its descriptor (safe_files).
    """
    config = RogueConfig()
    now = now if now is not None else datetime.datetime.now(datetime.timezone.utc)
    documents = []
    if rules_file:
        try:
            if checked:
                data = safe_files.read_file(rules_file, MAX_RULES_FILE + 1)
            else:
                with open(rules_file, 'rb') as handle:
                    data = handle.read(MAX_RULES_FILE + 1)
        except OSError as exc:
            raise RulesError(rules_file, None, None, 'cannot read the rules file: %s' % (exc.strerror or exc))
        documents.append((data, rules_file))
    if text is not None:
        documents.append((text, '<rules text>'))
    for data, source in documents:
        if source == rules_file and _policy().document_format(source) in ('json', 'toml'):
            # JSON and TOML by their own parsers (no lines for the fields); YAML through its nodes, with lines
            try:
                doc = _policy().read_document(data, source)
            except _policy().PolicyError as exc:
                raise RulesError(source, None, None, exc.errors[0][2])  # a line it names is in the text, with the column
            if doc is not None:
                _apply_all(config, _Val(doc, None, '', source), now)
            continue
        node, loader = _parse_document(data, source)
        try:
            if node is None:
                continue
            _apply_all(config, _Val(None, node, '', source, loader), now)
        except RecursionError:
            raise RulesError(source, None, None, 'nested too deeply')
        finally:
            loader.dispose()
    if rules:
        _apply_all(config, _Val(rules, None, '', 'rules (inline)'), now)
    return config


def _policy():
    from .. import policy  # pylint: disable=import-outside-toplevel
    return policy


def _apply_all(config, root, now):
    """_apply, then every error of the document at once."""
    root.run(_apply, config, root, now)
    if root.errors:
        raise RulesError.combine(root.errors)


def _apply(config, root, now):
    config.sources.append(root.source)
    top = root.mapping(TOP_KEYS)
    run = root.run
    if 'version' in top and top['version'].value != SCHEMA_VERSION:
        raise top['version'].error('unsupported version %r (this release reads version %d)' % (top['version'].value, SCHEMA_VERSION))
    for item in run(top['pools'].sequence) or () if 'pools' in top else ():
        run(_pool, config, item)
    for item in run(top['pool_ports'].sequence) or () if 'pool_ports' in top else ():
        port = run(item.integer, 1, 65535)
        if port is not None:
            config.pool_ports.add(port)
    for item in run(top['miner_names'].sequence) or () if 'miner_names' in top else ():
        name = run(item.string)
        if name is not None:
            config.miner_names.add(name.strip().lower())
    for item in run(top['miner_env'].sequence) or () if 'miner_env' in top else ():
        key = run(item.string)
        if key is not None:
            config.miner_env_keys.add(key.strip())
    if 'window' in top:
        run(_window_setting, config, top['window'])
    if 'min_samples' in top:
        config.min_samples = run(top['min_samples'].integer, 2, 100000) or config.min_samples
    for item in run(top['rules'].sequence) or () if 'rules' in top else ():
        rule = run(_custom_rule, config, item)
        if rule is not None:
            config.custom.append(rule)
    known = set(config.rule_ids())
    for item in run(top['disable'].sequence) or () if 'disable' in top else ():
        rid = run(item.string)
        if rid is not None and rid not in known:
            run(_raise, item.error('unknown rule id %r (known: %s)' % (rid, ', '.join(sorted(known)))))
        elif rid is not None:
            config.disabled.add(rid)
    if 'weights' in top:
        for rid, item in (run(top['weights'].mapping, known) or {}).items():
            weight = run(item.integer, R.MIN_WEIGHT, R.MAX_WEIGHT)
            if weight is not None:
                config.weights[rid] = weight
    for item in run(top['allowlist'].sequence) or () if 'allowlist' in top else ():
        entry = run(_allow_entry, item, len(config.allowlist) + len(config.expired))
        if entry is None:
            continue
        if entry.expires is not None and entry.expires <= now:
            config.expired.append(entry)
            config.warnings.append('allowlist entry %s (%s) expired on %s and is ignored' % (
                item.path, entry.source, entry.expires.isoformat()))
        else:
            config.allowlist.append(entry)


def _raise(error):
    raise error


def _pool(config, item):
    text = item.string().strip().lower()
    try:
        config.pool_networks.append(ipaddress.ip_network(text, strict=False))
        return
    except ValueError:
        pass
    host = text.lstrip('*').lstrip('.')
    if not _HOST_RE.match(host):
        raise item.error('%r is neither an IP address, a network (CIDR) nor a host name' % text)
    config.pool_domains.add(host)


def _window_setting(config, item):
    from ..units import parse_duration  # pylint: disable=import-outside-toplevel
    try:
        window = parse_duration(item.value, 'window')
    except InvalidArgument as exc:
        raise item.error(exc.why)
    if not 60 <= window <= 7 * 86400:
        raise item.error('the window must be from 1m to 7d')
    config.window_s = window


def _custom_rule(config, item):
    before = len(item.errors)
    spec = item.mapping(RULE_KEYS)
    run = item.run
    missing = [key for key in ('id', 'kind', 'weight', 'description', 'match') if key not in spec]
    if missing:
        run(_raise, item.error('a rule needs %s' % ', '.join(missing)))
    rid = run(spec['id'].string) if 'id' in spec else None
    if rid is not None and not _ID_RE.match(rid):
        run(_raise, spec['id'].error('a rule id is a letter followed by up to 63 letters, digits, _ . or -'))
    elif rid is not None and rid in config.rule_ids():
        run(_raise, spec['id'].error('the rule id %r is already taken (built-in or earlier rule)' % rid))
    kind = run(spec['kind'].string) if 'kind' in spec else None
    if kind is not None and kind not in R.KINDS:
        run(_raise, spec['kind'].error('expected one of %s, got %r' % (', '.join(R.KINDS), kind)))
    weight = run(spec['weight'].integer, R.MIN_WEIGHT, R.MAX_WEIGHT) if 'weight' in spec else None
    description = run(spec['description'].string) if 'description' in spec else None
    match = run(_matchers, spec['match']) if 'match' in spec else None
    if len(item.errors) > before:
        return None  # its errors are collected
    source = item.source if item.line is None else '%s:%d' % (item.source, item.line)
    return CustomRule(rid, kind, weight, description, match, source=source)


def _matchers(value):
    """The ``match`` of a custom rule: each matcher checked."""
    matchers = value.mapping(CustomRule.MATCHERS)
    if not matchers:
        raise value.error('give at least one of %s' % ', '.join(CustomRule.MATCHERS))
    match = {}
    for key, item in matchers.items():
        if key == 'remote_port':
            match[key] = set(p for p in (item.run(v.integer, 1, 65535) for v in item.run(item.sequence) or ()) if p is not None)
        elif key == 'remote_addr':
            nets = []
            for v in item.run(item.sequence) or ():
                text = v.run(v.string)
                try:
                    if text is not None:
                        nets.append(ipaddress.ip_network(text.strip(), strict=False))
                except ValueError:
                    item.run(_raise, v.error('%r is not an IP address or network' % v.value))
            match[key] = nets
        else:
            match[key] = item.run(item.regex)
    return match


def _allow_entry(item, index):
    before = len(item.errors)
    spec = item.mapping(ALLOW_KEYS)
    if len(item.errors) > before:
        return None  # an unknown key: collected
    has = set(spec)
    source = item.source if item.line is None else '%s:%d' % (item.source, item.line)
    kwargs = {}
    if 'exe' in has or 'sha256' in has:
        if not {'exe', 'sha256'} <= has:
            raise item.error('an executable entry needs both exe (the path) and sha256: a path alone can be replaced')
        exe = spec['exe'].string()
        if not exe.startswith('/'):
            raise spec['exe'].error('exe must be an absolute path')
        digest = spec['sha256'].string().strip().lower()
        if not _SHA256_RE.match(digest):
            raise spec['sha256'].error('expected 64 hexadecimal digits')
        kwargs.update(exe=exe, sha256=digest)
        if 'cmdline' in has or 'image' in has:
            raise item.error('use one of exe+sha256, user+cmdline or image per entry')
    elif 'image' in has:
        kwargs['image'] = spec['image'].string().strip()
        if 'cmdline' in has:
            raise item.error('use one of exe+sha256, user+cmdline or image per entry')
    elif 'cmdline' in has:
        if 'user' not in has:
            raise item.error('a cmdline entry needs user as well: anyone can choose their command line')
        kwargs['cmdline'] = spec['cmdline'].regex()
    else:
        raise item.error('an allowlist entry matches by exe+sha256, by user+cmdline or by image; '
                         'never by a process name or a user alone')
    if 'user' in has:
        kwargs['user'] = spec['user'].string().strip()
    if 'expires' in has:
        kwargs['expires'] = _expiry(spec['expires'])
    if 'comment' in has:
        kwargs['comment'] = spec['comment'].string(allow_empty=True)
    return AllowEntry(index, source, **kwargs)


def _expiry(item):
    value = item.value
    if isinstance(value, datetime.datetime):
        parsed = value
    elif isinstance(value, datetime.date):
        parsed = datetime.datetime(value.year, value.month, value.day, tzinfo=datetime.timezone.utc) + datetime.timedelta(days=1)
    elif isinstance(value, str):
        text = value.strip()
        try:
            if len(text) == 10:
                day = datetime.date(int(text[:4]), int(text[5:7]), int(text[8:10]))
                if text[4] != '-' or text[7] != '-':
                    raise ValueError(text)
                parsed = datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc) + datetime.timedelta(days=1)
            else:
                parsed = datetime.datetime.fromisoformat(text.replace('Z', '+00:00'))
        except (ValueError, IndexError):
            raise item.error('expected a date (YYYY-MM-DD) or an ISO 8601 date and time, got %r' % value)
    else:
        raise item.error('expected a date (YYYY-MM-DD), got %s' % _type_name(value))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed


# ---------------------------------------------------------------------------- the detector
def level_index(level):
    return LEVELS.index(level)


def at_least(level, min_level):
    return level is not None and level_index(level) >= level_index(min_level)


def classify(hard, soft, behavioural):
    """(score, level) from the three families' points (behavioural already capped and suppressed)."""
    score = min(R.MAX_SCORE, hard + soft + behavioural)
    if score >= R.CRITICAL_AT and hard > 0:
        return score, 'critical'
    if score >= R.HIGH_AT and (hard > 0 or soft >= R.SOFT_HIGH_GATE):
        return score, 'high'
    if score >= R.MEDIUM_AT:
        return score, 'medium'
    return score, 'info'


class Detector(object):
    """Evaluates ProcessFacts against a RogueConfig."""

    def __init__(self, config=None):
        self.config = config if config is not None else RogueConfig()
        self._rules = self.config.rules()

    def evaluate(self, facts):
        """The finding for ``facts`` (a dict, see docs/audit-schema.md), or None when no rule fires."""
        ctx = _Context(facts, self.config)
        fired = []
        notes = list(facts.notes)
        points = {'hard': 0, 'soft': 0, 'behavioural': 0}
        for rid, kind, weight, description, check in self._rules:
            try:
                evidence = check(ctx)
            except Exception as exc:  # pylint: disable=broad-except
                notes.append('rule %s could not be evaluated: %s' % (rid, clean_text(exc, 200)))
                continue
            if evidence:
                fired.append({'id': rid, 'kind': kind, 'weight': weight, 'description': description,
                              'evidence': evidence[:MAX_EVIDENCE]})
                points[kind] += weight
        if not fired:
            return None
        suppressors = []
        libs = ml_libraries(facts.maps)
        if libs:
            for sid, weight, description in R.BUILTIN_SUPPRESSORS:
                suppressors.append({'id': sid, 'weight': weight, 'description': description,
                                    'evidence': [_evidence('maps', ', '.join(libs[:6]), '%d ML libraries mapped' % len(libs))]})
        behavioural = min(points['behavioural'], R.BEHAVIOURAL_CAP)
        behavioural = max(0, behavioural + sum(s['weight'] for s in suppressors))
        score, level = classify(points['hard'], points['soft'], behavioural)
        allowed = None
        for entry in self.config.allowlist:
            if entry.matches(facts, ctx.args):
                allowed = entry.describe()
                break
        if allowed is not None:
            level = 'info'
        if facts.truncated:
            notes.append('the command line was longer than %d characters or %d arguments; only its start and end were examined' % (
                MAX_SCAN_CHARS, MAX_ARGS))
        return finding_dict(facts, score, level, fired, suppressors, points, behavioural, allowed, notes)

    def detect(self, facts_list, min_level='info'):
        """Findings at or above ``min_level``, highest score first."""
        findings = []
        for facts in facts_list:
            finding = self.evaluate(facts)
            if finding is not None and at_least(finding['level'], min_level):
                findings.append(finding)
        findings.sort(key=lambda f: (-f['score'], -level_index(f['level']), f['pid']))
        return findings


def _output_cmdline(args):
    """The command line of a finding (returned, and appended to the audit log): bounded, and redacted
    with the default patterns (notify.redact_argv: a finding at level info is any GPU process)."""
    if args is None:
        return None
    return notify.redact_argv([clean_text(a, MAX_OUTPUT_ARG) for a in args[:MAX_OUTPUT_ARGS]], notify.default_patterns())


def finding_dict(facts, score, level, fired, suppressors, points, behavioural, allowed, notes):
    container = None
    if facts.container:
        container = dict((k, facts.container.get(k)) for k in ('id', 'runtime', 'pod_uid', 'image', 'image_digest'))
    return {
        'pid': facts.pid,
        'starttime': facts.starttime,
        'user': facts.user,
        'uid': facts.uid,
        'name': facts.name,
        'exe': clean_text(facts.exe, MAX_OUTPUT_ARG),
        'cmdline': _output_cmdline(facts.cmdline),
        'cmdline_truncated': bool(facts.truncated or (facts.cmdline is not None and (
            len(facts.cmdline) > MAX_OUTPUT_ARGS or any(len(a) > MAX_OUTPUT_ARG for a in facts.cmdline)))),
        'gpu_indexes': list(facts.gpu_indexes),
        'used_mib': facts.used_mib,
        'container': container,
        'slurm_job': facts.slurm_job,
        'listed': facts.listed,
        'score': score,
        'level': level,
        'points': {'hard': points['hard'], 'soft': points['soft'], 'behavioural': behavioural},
        'rules': fired,
        'suppressors': suppressors,
        'allowlisted': allowed,
        'notes': notes,
    }


def summarize(findings, evaluated=None):
    """Counts per level (and allowlisted, evaluated)."""
    summary = dict((level, 0) for level in LEVELS)
    allowlisted = 0
    for finding in findings:
        summary[finding['level']] += 1
        if finding.get('allowlisted'):
            allowlisted += 1
    summary['allowlisted'] = allowlisted
    summary['total'] = len(findings)
    if evaluated is not None:
        summary['evaluated'] = evaluated
    return summary


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


def _read_bytes(path, limit):
    with open(path, 'rb') as handle:
        return handle.read(limit)


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
        facts.parents = self._parents(proc.ppid if proc.ppid is not None else self._ppid(base))
        return facts

    def _sha256(self, proc, facts):
        known = len(self.exe_hashes.notes)
        digest = self.exe_hashes.sha256(proc.pid, proc.starttime)
        facts.notes.extend(self.exe_hashes.notes[known:])
        return digest

    def _same_process(self, base, starttime):
        if starttime is None:
            return os.path.isdir(base)
        from ..processes import read_starttime  # pylint: disable=import-outside-toplevel
        return read_starttime(os.path.basename(base), self.proc_root) == starttime

    def _ppid(self, base):
        from ..processes import parse_stat  # pylint: disable=import-outside-toplevel
        try:
            return parse_stat(_read_bytes(os.path.join(base, 'stat'), 4096).decode('utf-8', 'replace'))['ppid']
        except (OSError, ValueError, IndexError):
            return None

    def _connections(self, base, facts):
        inodes = set()
        try:
            fds = os.listdir(os.path.join(base, 'fd'))
        except OSError as exc:
            facts.notes.append('open files not readable: %s' % (exc.strerror or exc))
            return None
        for fd in fds[:65536]:
            try:
                target = os.readlink(os.path.join(base, 'fd', fd))
            except OSError:
                continue
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
        from ..processes import parse_stat  # pylint: disable=import-outside-toplevel
        parents = []
        seen = set()
        pid = ppid
        while pid and pid > 0 and pid not in seen and len(parents) < MAX_PARENTS:
            seen.add(pid)
            base = os.path.join(self.proc_root, str(pid))
            try:
                stat = parse_stat(_read_bytes(os.path.join(base, 'stat'), 4096).decode('utf-8', 'replace'))
            except (OSError, ValueError, IndexError):
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


# ---------------------------------------------------------------------------- entry points
def detector_argument_spec():
    """The module options that the detector is built from, in gpu_audit and in gpu_kill (rogue=true):
    one definition, so that both read the same usage history and decide allocations alike.  Their
    documentation is the doc fragment gpufleet.reclaim._attributes.ROGUE_DETECTOR."""
    from ..history import DEFAULT_PATH  # pylint: disable=import-outside-toplevel
    return dict(require_allocation=dict(type='str', default='auto', choices=['auto', 'always', 'never']),
                history_path=dict(type='path', default=DEFAULT_PATH))


def detector_options(params):
    """The keyword arguments of detect_snapshot and selector_detector that a module's parameters give."""
    return {'history_path': params['history_path'], 'allocation': params['require_allocation']}


def detect_snapshot(snapshot, config=None, min_level='info', history_path=None, allocation='auto', collector=None,
                    exe_hashes=None):
    """(findings, warnings, evaluated) for a live snapshot."""
    config = config if config is not None else RogueConfig()
    if collector is None:
        collector = FactsCollector(history_path=history_path, allocation=allocation, window_s=config.window_s,
                                   exe_hashes=exe_hashes)
    facts_list = collector.collect(snapshot)
    findings = Detector(config).detect(facts_list, min_level)
    return findings, list(config.warnings) + list(collector.warnings), len(facts_list)


def selector_detector(config=None, history_path=None, allocation='auto'):
    """A ``rogue_detector`` for select.Selector: ``(snapshot, min_level) -> {pid: finding}``.

    Only processes the driver lists are returned (the selector looks at those).
    """
    def detector(snapshot, min_level):
        findings, _warnings, _count = detect_snapshot(snapshot, config=config, min_level=min_level,
                                                      history_path=history_path, allocation=allocation)
        return dict((f['pid'], f) for f in findings if f['listed'])
    return detector
