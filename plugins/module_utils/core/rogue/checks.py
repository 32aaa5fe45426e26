# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The built-in rules of the rogue detector: one function per rule id, over an evaluation context.

Each ``rule_*`` function takes a ``_Context`` (one ProcessFacts and the RogueConfig) and returns its
evidence (a list of ``facts._evidence`` items; empty when the rule does not fire).
``BUILTIN_CHECKS`` maps the rule ids of ``rules.BUILTIN_RULES`` to them.  The data they compare
against (names, lists, patterns, thresholds) lives in rules.py.
"""

from __future__ import annotations

import math
import re

from ..textmatch import MAX_MATCH_TEXT
from ..units import human_duration
from . import rules as R
from .facts import ACTIVE_STATES, MAX_EVIDENCE, MAX_PARENTS, _basename, _evidence, _strip_version, is_public

MAX_OPTION_ARGS = 4096


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
                          '%d samples over %s' % (len(points), human_duration(points[-1][0] - points[0][0])))]
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
                          '%d samples over %s' % (len(points), human_duration(points[-1][0] - points[0][0])))]
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
