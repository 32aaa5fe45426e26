# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""GPU usage policies: the schema, strict validation, and evaluation of a snapshot.

docs/policy.md documents the schema.  The API (also used by gpu_audit's policy dry-run):

``load_policy(path)`` / ``load_policy_text(text, source)`` / ``parse_policy(data, source)``
    -> Policy, or PolicyError whose ``errors`` each name the file, the path in the document and
    the value.  YAML (or JSON), our schema, gpu-kill's guard configuration (TOML, YAML or JSON)
    and the gpu-kill-style shorthand list (``[{user: "*", max_memory_gb: 12, action: kill}]``)
    are all accepted.
``observe(policy, snapshot, state, now, context=None)`` -> a new state dict with the idle clocks
    advanced (activity, unknown utilization or a gap in the samples resets a clock).
``evaluate(policy, snapshot, state, now, context=None)`` -> [Violation].  Pure: it reads the
    snapshot, the state (idle clocks) and the Context (group membership, Slurm/Kubernetes node,
    GPU allocations, rogue findings, executable hashes), and changes nothing.  Pass a Context
    built from plain data in tests; the default one looks at the live host.

A violation of an over-limit rule (memory, GPU count, process count) names the FEWEST processes
whose termination brings the subject back under the limit: largest first, like the OOM killer,
ties broken by the newest process.  It never names every process of a user unless nothing less
brings the user under the limit.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import itertools
import json
import math
import os
import re
import shlex

from .. import notify as notify_mod, safe_files
from ..errors import InvalidArgument
from ..exe_hash import ExeHashes
from ..identity import UNKNOWN_OWNER, name_trusted
from ..idle import process_utilization
from ..killer import DEFAULT_PROTECT_NAMES
from ..processes import scheduler_daemon
from ..units import parse_duration, parse_size_mib

# The yaml module (or None when PyYAML is missing), imported on first use: the agent's ticks
# usually read the policy from the state's cache and never pay for importing PyYAML.
_YAML = []


def yaml_module():
    """PyYAML, or None when it is not installed (imported on first use)."""
    if not _YAML:
        try:
            import yaml  # pylint: disable=import-outside-toplevel
        except ImportError:  # pragma: no cover - the agent then reads JSON (and TOML) only
            yaml = None
        _YAML.append(yaml)
    return _YAML[0]


SCHEMA_VERSION = 1
MODES = ('dry-run', 'warn', 'enforce')
ACTIONS = ('warn', 'terminate', 'kill')
ROGUE_LEVELS = ('info', 'medium', 'high', 'critical')
DEFAULT_PATH = '/etc/gpufleet/policy.yaml'
MAX_POLICY_BYTES = 4 * 1024 * 1024
# Limits on the shape of any document the agent reads (policy, settings, rogue rules; YAML, JSON
# or TOML): mappings and lists nested at most MAX_NESTING deep, and YAML aliases adding at most
# MAX_ALIAS_NODES nodes in all by repeating what their anchors name.  Past them: a clean error.
MAX_NESTING = 32
MAX_ALIAS_NODES = 100000
MAX_ERRORS = 50
GIB = 1024.0

# Rule ids (the ``rule`` of a Violation; names for exemptions' ``rules``).
USER_RULES = ('max_mem_per_gpu', 'max_mem_total', 'max_gpus', 'max_procs', 'max_procs_per_gpu', 'max_runtime', 'idle',
              'gpu_access', 'require_allocation')
GROUP_RULES = ('group_max_mem_total', 'group_max_gpus', 'group_max_procs')
GPU_RULES = ('gpu_reserved', 'gpu_blocked_user', 'gpu_max_mem_total', 'maintenance')
QUOTA_RULES = USER_RULES + GROUP_RULES + GPU_RULES
RULES = QUOTA_RULES + ('rogue',)
RULE_GROUPS = {
    'memory': ('max_mem_per_gpu', 'max_mem_total', 'group_max_mem_total', 'gpu_max_mem_total'),
    'gpus': ('max_gpus', 'group_max_gpus', 'gpu_access', 'gpu_reserved', 'gpu_blocked_user'),
    'procs': ('max_procs', 'max_procs_per_gpu', 'group_max_procs'),
    'runtime': ('max_runtime',),
    'quota': QUOTA_RULES,
    'all': QUOTA_RULES,
}
# Rules whose violations concern one process each (the escalation clock is per process).
PER_PROCESS_RULES = ('max_runtime', 'idle', 'gpu_access', 'require_allocation', 'rogue')

DAY_NAMES = ('mon', 'tue', 'wed', 'thu', 'fri', 'sat', 'sun')
_DAY_ALIASES = {'monday': 0, 'tuesday': 1, 'wednesday': 2, 'thursday': 3, 'friday': 4, 'saturday': 5, 'sunday': 6,
                'tues': 1, 'wednes': 2, 'thur': 3, 'thurs': 3}
_DAY_SETS = {'weekdays': (0, 1, 2, 3, 4), 'weekday': (0, 1, 2, 3, 4), 'weekends': (5, 6), 'weekend': (5, 6),
             'daily': tuple(range(7)), 'everyday': tuple(range(7)), 'all': tuple(range(7)), '*': tuple(range(7))}
_HHMM = re.compile(r'^([01]?\d|2[0-4]):([0-5]\d)$')
_OFFSET = re.compile(r'^(?:UTC|GMT)?\s*([+-])(\d{1,2})(?::?(\d{2}))?$', re.IGNORECASE)
_SHA256 = re.compile(r'^[0-9a-fA-F]{64}$')
_NAME = re.compile(r'^[A-Za-z0-9_.@*][A-Za-z0-9_.@$-]{0,127}$')

# The default redaction (docs/policy.md, "Redaction") lives with the redaction itself.
DEFAULT_REDACT_PATTERNS = notify_mod.DEFAULT_REDACT_PATTERNS


class PolicyError(InvalidArgument):
    """The policy (or another document the agent reads) is invalid.  ``errors`` is a list of
    ``(path, value, why)``; ``lines`` the line of each in ``source`` (None where unknown: JSON and
    TOML documents, or a cached document); ``source`` the file.  An error with no path and the value
    None concerns the whole document (cannot read it, a syntax error): it is printed as
    ``source: why``."""

    def __init__(self, errors, source='<policy>', lines=None, what='policy'):
        self.errors = [tuple(item[:3]) for item in errors]
        self.lines = [item[3] if len(item) > 3 else None for item in errors]
        self.source = source
        first = self.errors[0] if self.errors else ('', None, 'invalid %s' % what)
        super(PolicyError, self).__init__(first[0] or what, first[1], first[2])
        self.add_lines(lines)

    def add_lines(self, lines):
        """Fill in unknown lines from ``lines`` ({path: line}, as read_document_lines returns it)."""
        for index, (path, _value, _why) in enumerate(self.errors):
            if self.lines[index] is None and lines:
                self.lines[index] = line_of(lines, path)
        if lines:  # in the order of the file (errors without a line first: they concern the whole document)
            order = sorted(range(len(self.errors)), key=lambda i: self.lines[i] or 0)
            self.errors = [self.errors[i] for i in order]
            self.lines = [self.lines[i] for i in order]
        self._render()

    def problems(self):
        """Each error as a dict: file, line (when known), path, value, why."""
        out = []
        for (path, value, why), line in zip(self.errors, self.lines):
            item = {'file': self.source, 'path': path, 'value': None if _whole(path, value) else repr(value), 'why': why}
            if line is not None:
                item['line'] = line
            out.append(item)
        return out

    def _render(self):
        lines = []
        for (path, value, why), line in list(zip(self.errors, self.lines))[:MAX_ERRORS]:
            where = self.source if line is None else '%s:%d' % (self.source, line)
            if _whole(path, value):
                lines.append('%s: %s' % (self.source, why))  # a line it names is in ``why``, with the column
            else:
                lines.append('%s: %s: invalid value %s: %s' % (where, path or '(top)', _show(value), why))
        if len(self.errors) > MAX_ERRORS:
            lines.append('... and %d more error(s)' % (len(self.errors) - MAX_ERRORS))
        self.args = ('\n'.join(lines),)

    def __str__(self):
        return self.args[0]


def _whole(path, value):
    """True for an error about the whole document (no path, no value)."""
    return not path and value is None


def line_of(lines, path):
    """The line of ``path`` in a {path: line} map, or of the nearest enclosing path; None if unknown."""
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind('.'), path.rfind('['))
        path = path[:cut] if cut > 0 else ''
    return None


def _show(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + '...'


class DocumentLimitError(ValueError):
    """A document nests deeper than MAX_NESTING or its YAML aliases expand past MAX_ALIAS_NODES."""

    def __init__(self, why, line=None):
        super(DocumentLimitError, self).__init__(why if line is None else 'line %d: %s' % (line, why))
        self.why = why
        self.line = line


def _too_deep():
    return 'mappings and lists nested more than %d levels deep (the limit)' % MAX_NESTING


def check_nesting(data):
    """Raise DocumentLimitError when mappings and lists in ``data`` nest deeper than MAX_NESTING
    (``{a: 1}`` is one level, ``{a: {b: [1]}}`` three).  Iterative: any depth is refused, none recurses."""
    pending = [(data, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if level > MAX_NESTING:
            raise DocumentLimitError(_too_deep())
        pending.extend((child, level + 1) for child in children)


class _Bad(Exception):
    """Validation failures inside a parser (collected, not raised to callers): one, or ``items``."""

    def __init__(self, path, value, why, items=None):
        super(_Bad, self).__init__(why)
        self.path = path
        self.value = value
        self.why = why
        self.items = list(items) if items else [(path, value, why)]


class _Errors(object):
    """Collects every failure of a document: each field is checked, none stops the others."""

    def __init__(self):
        self.items = []

    def add(self, path, value, why):
        self.items.append((path, value, why))

    def run(self, func, *args):
        """Call func(*args); a _Bad becomes collected error(s) and the result is None."""
        try:
            return func(*args)
        except _Bad as exc:
            self.items.extend(exc.items)
        except InvalidArgument as exc:
            self.add(args[-1] if args and isinstance(args[-1], str) else '', exc.value, exc.why)
        return None

    def check(self):
        """Raise the collected errors (a _Bad holding all of them), if any."""
        if self.items:
            first = self.items[0]
            raise _Bad(first[0], first[1], first[2], self.items)


def _join(path, key):
    key = str(key)
    if not path:
        return key
    if re.match(r'^[A-Za-z0-9_*@.-]+$', key) and '.' not in key:
        return '%s.%s' % (path, key)
    return '%s[%s]' % (path, json.dumps(key))


# ============================================================================ value parsers
def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dict(value, path):
    if not isinstance(value, dict):
        raise _Bad(path, value, 'expected a mapping, got %s' % _type(value))
    for key in value:
        if not isinstance(key, str):
            raise _Bad(path, key, 'keys must be text, got %s' % _type(key))
    return value


def _type(value):
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'a boolean'
    if _is_number(value):
        return 'a number'
    if isinstance(value, str):
        return 'text'
    if isinstance(value, list):
        return 'a list'
    if isinstance(value, dict):
        return 'a mapping'
    return type(value).__name__


def _list(value, path):
    if value is None:
        return []
    if isinstance(value, (str, dict)) or not isinstance(value, list):
        raise _Bad(path, value, 'expected a list, got %s' % _type(value))
    return value


def _bool(value, path):
    if not isinstance(value, bool):
        raise _Bad(path, value, 'expected true or false')
    return value


def _count(value, path):
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
        raise _Bad(path, value, 'expected a whole number, 0 or more')
    if value < 0:
        raise _Bad(path, value, 'expected a whole number, 0 or more')
    return int(value)


def _pct(value, path):
    if not _is_number(value) or math.isnan(value) or not 0 <= value <= 100:
        raise _Bad(path, value, 'expected a percentage from 0 to 100')
    return float(value)


def _text(value, path, pattern=None, what='text'):
    if not isinstance(value, str) or not value.strip():
        raise _Bad(path, value, 'expected %s' % what)
    if pattern is not None and not pattern.match(value):
        raise _Bad(path, value, 'expected %s' % what)
    return value


def _name(value, path, what='a user or group name'):
    if _is_number(value) and not isinstance(value, float):
        value = str(value)
    return _text(value, path, _NAME, what)


def _size(value, path, unit='gib'):
    """MiB from a size: a bare number is in ``unit`` (GiB by default); text may carry a unit (8GB = 8 GiB)."""
    if isinstance(value, bool) or value is None:
        raise _Bad(path, value, 'expected a size such as 8 (GiB), "8GiB", "8GB" or "512MiB"')
    factor = GIB if unit == 'gib' else 1.0
    if _is_number(value):
        if math.isnan(value) or value < 0 or value == float('inf'):
            raise _Bad(path, value, 'a size must be a finite number, 0 or more')
        return float(value) * factor
    if isinstance(value, str):
        text = value.strip()
        if re.match(r'^\d+(?:\.\d+)?$', text):
            return float(text) * factor
        try:
            return parse_size_mib(text, path)
        except InvalidArgument:
            raise _Bad(path, value, 'expected a size such as 8 (GiB), "8GiB", "8GB" or "512MiB"')
    raise _Bad(path, value, 'expected a size such as 8 (GiB), "8GiB", "8GB" or "512MiB"')


def _duration(value, path, unit=None):
    """Seconds.  Numbers need a unit named in the key (``unit`` seconds each); text needs a unit."""
    if isinstance(value, bool) or value is None:
        raise _Bad(path, value, 'expected a duration such as 30s, 10m, 2h or 1d')
    if _is_number(value):
        if math.isnan(value) or value < 0 or value == float('inf'):
            raise _Bad(path, value, 'a duration must be a finite number, 0 or more')
        if unit is None and value != 0:
            raise _Bad(path, value, 'write a unit, as in "%ss" or "%sm" (a bare number is ambiguous here)' % (value, value))
        return float(value) * (unit or 1)
    if isinstance(value, str):
        text = value.strip()
        if unit is not None and re.match(r'^\d+(?:\.\d+)?$', text):
            return float(text) * unit
        if re.match(r'^\d+(?:\.\d+)?$', text) and float(text) != 0:
            raise _Bad(path, value, 'write a unit, as in "%ss" or "%sm" (a bare number is ambiguous here)' % (text, text))
        try:
            return parse_duration(text, path)
        except InvalidArgument as exc:
            raise _Bad(path, value, exc.why)
    raise _Bad(path, value, 'expected a duration such as 30s, 10m, 2h or 1d')


def _expires(value, path):
    """Epoch seconds at which something expires.  A date means the end of that day (UTC)."""
    if isinstance(value, datetime.datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
        return stamp.timestamp()
    if isinstance(value, datetime.date):
        end = datetime.datetime(value.year, value.month, value.day, tzinfo=datetime.timezone.utc)
        return (end + datetime.timedelta(days=1)).timestamp()
    if isinstance(value, str):
        text = value.strip()
        try:
            if re.match(r'^\d{4}-\d{2}-\d{2}$', text):
                return _expires(datetime.date(*[int(x) for x in text.split('-')]), path)
            stamp = datetime.datetime.fromisoformat(text.replace('Z', '+00:00').replace(' ', 'T', 1))
            return _expires(stamp, path)
        except ValueError:
            pass
    raise _Bad(path, value, 'expected a date (YYYY-MM-DD) or a date and time (YYYY-MM-DDTHH:MM[:SS][+HH:MM])')


def _regex(value, path):
    from ..select import compile_regex  # pylint: disable=import-outside-toplevel
    try:
        return compile_regex(path, value)
    except InvalidArgument as exc:
        raise _Bad(path, value, exc.why)


def _action(value, path):
    aliases = {'warn': 'warn', 'notify': 'warn', 'log': 'warn', 'alert': 'warn',
               'terminate': 'terminate', 'term': 'terminate', 'sigterm': 'terminate',
               'kill': 'kill', 'sigkill': 'kill'}
    if isinstance(value, str) and value.strip().lower() in aliases:
        return aliases[value.strip().lower()]
    raise _Bad(path, value, 'expected one of warn, terminate (SIGTERM, then SIGKILL) or kill (SIGKILL at once)')


def _mode(value, path):
    aliases = {'dry-run': 'dry-run', 'dry_run': 'dry-run', 'dryrun': 'dry-run', 'warn': 'warn', 'enforce': 'enforce'}
    if isinstance(value, str) and value.strip().lower() in aliases:
        return aliases[value.strip().lower()]
    raise _Bad(path, value, 'expected one of dry-run, warn or enforce')


# ---------------------------------------------------------------------------- GPUs
class GpuSet(object):
    """GPU indexes, ranges and UUIDs as written (``"0-3"``, ``"0,2"``, ``5``, ``"GPU-6f7c..."``, ``"*"``)."""

    def __init__(self, indexes=(), uuids=(), every=False, text=''):
        self.indexes = frozenset(indexes)
        self.uuids = frozenset(u.lower() for u in uuids)
        self.every = every
        self.text = text

    def contains(self, dev):
        if self.every:
            return True
        if dev.index in self.indexes:
            return True
        return dev.uuid is not None and dev.uuid.lower() in self.uuids

    def contains_index(self, index, snapshot=None):
        if self.every or index in self.indexes:
            return True
        if self.uuids and snapshot is not None:
            dev = snapshot.device(index)
            return dev is not None and self.contains(dev)
        return False

    def __repr__(self):
        return 'GpuSet(%s)' % self.text


def _gpu_set(value, path):
    items = value if isinstance(value, list) else [value]
    indexes, uuids, every = set(), set(), False
    if isinstance(value, list) and not value:
        return GpuSet(text='')
    for item in items:
        if isinstance(item, bool):
            raise _Bad(path, value, 'expected GPU indexes (0, "0-3", "0,2") or UUIDs')
        if isinstance(item, int):
            if item < 0:
                raise _Bad(path, value, 'a GPU index is 0 or more')
            indexes.add(item)
            continue
        if not isinstance(item, str) or not item.strip():
            raise _Bad(path, value, 'expected GPU indexes (0, "0-3", "0,2") or UUIDs')
        for part in item.split(','):
            part = part.strip()
            if part in ('*', 'all'):
                every = True
            elif re.match(r'^\d+$', part):
                indexes.add(int(part))
            elif re.match(r'^\d+\s*-\s*\d+$', part):
                low, high = [int(x) for x in part.split('-')]
                if low > high or high - low > 4096:
                    raise _Bad(path, value, 'a range goes from the lower index to the higher one, as in 0-3')
                indexes.update(range(low, high + 1))
            elif re.match(r'^[A-Za-z0-9][A-Za-z0-9:_.-]{7,95}$', part) and not re.match(r'^[\d-]+$', part):
                uuids.add(part)
            else:
                raise _Bad(path, value, 'expected GPU indexes (0, "0-3", "0,2") or UUIDs')
    text = ','.join(str(x) for x in (items if isinstance(value, list) else [value]))
    return GpuSet(indexes, uuids, every, text)


# ---------------------------------------------------------------------------- time windows
def _tz(value, path):
    if value is None:
        return datetime.timezone.utc
    if not isinstance(value, str) or not value.strip():
        raise _Bad(path, value, 'expected a time zone such as UTC, Europe/Berlin or +01:00')
    text = value.strip()
    if text.upper() in ('UTC', 'Z', 'GMT', 'ETC/UTC'):
        return datetime.timezone.utc
    match = _OFFSET.match(text)
    if match:
        hours, minutes = int(match.group(2)), int(match.group(3) or 0)
        if hours > 23 or minutes > 59:
            raise _Bad(path, value, 'a UTC offset is at most +/-23:59')
        delta = datetime.timedelta(hours=hours, minutes=minutes)
        return datetime.timezone(-delta if match.group(1) == '-' else delta, text)
    try:
        # Python >= 3.9; only for named zones
        import zoneinfo  # pylint: disable=import-outside-toplevel
    except ImportError:  # pragma: no cover - Python 3.8
        zoneinfo = None
    if zoneinfo is None:
        raise _Bad(path, value, 'time zone names need Python 3.9 or later (zoneinfo); write a fixed offset such as +01:00')
    if '..' in text or text.startswith('/') or not re.match(r'^[A-Za-z0-9_+/-]+$', text):
        raise _Bad(path, value, 'not a time zone name')
    try:
        return zoneinfo.ZoneInfo(text)
    except Exception:  # pylint: disable=broad-except
        raise _Bad(path, value, 'unknown time zone (expected a name such as Europe/Berlin, or an offset such as +01:00)')


def _day(item, path, value):
    if isinstance(item, bool):
        raise _Bad(path, value, 'expected day names (mon, tue, ..., mon-fri, weekdays)')
    if isinstance(item, int):
        # gpu-kill numbering: 0 = Sunday, 1 = Monday, ... (7 = Sunday too)
        if not 0 <= item <= 7:
            raise _Bad(path, value, 'a day number is 0 (Sunday) to 6 (Saturday), as in gpu-kill')
        return [(item - 1) % 7]
    if not isinstance(item, str):
        raise _Bad(path, value, 'expected day names (mon, tue, ..., mon-fri, weekdays)')
    text = item.strip().lower()
    if text in _DAY_SETS:
        return list(_DAY_SETS[text])
    if '-' in text:
        first, _sep, last = text.partition('-')
        start, end = _one_day(first.strip(), path, value), _one_day(last.strip(), path, value)
        days = [start]
        while days[-1] != end:
            days.append((days[-1] + 1) % 7)
        return days
    return [_one_day(text, path, value)]


def _one_day(text, path, value):
    if text[:3] in DAY_NAMES and (len(text) == 3 or text in _DAY_ALIASES):
        return DAY_NAMES.index(text[:3])
    if text in _DAY_ALIASES:
        return _DAY_ALIASES[text]
    raise _Bad(path, value, 'unknown day %r (expected mon, tue, wed, thu, fri, sat, sun, ranges such as mon-fri, '
                            'or weekdays/weekends/daily)' % text)


def _days(value, path):
    if value is None:
        return frozenset(range(7))
    items = value if isinstance(value, list) else [value]
    if isinstance(value, str) and ',' in value:
        items = value.split(',')
    days = set()
    for item in items:
        days.update(_day(item, path, value))
    if not days:
        raise _Bad(path, value, 'name at least one day (or leave days out for every day)')
    return frozenset(days)


def _minutes(value, path):
    if _is_number(value) and not isinstance(value, float) and 0 <= value <= 24:
        return int(value) * 60  # "start: 9" (YAML reads 09 as 9)
    if isinstance(value, int) and not isinstance(value, bool) and value > 24:
        # YAML 1.1 reads 09:30 as the sexagesimal number 570
        if value < 24 * 60 + 1:
            return value
    if isinstance(value, str):
        match = _HHMM.match(value.strip())
        if match:
            total = int(match.group(1)) * 60 + int(match.group(2))
            if total <= 24 * 60:
                return total
    raise _Bad(path, value, 'expected a time of day as "HH:MM" (00:00 to 24:00)')


class Window(object):
    """Days and a time of day in a time zone.  ``start > end`` spans midnight: the window belongs to
    the day it starts on.  ``start == end`` is the whole day.  Local wall-clock times are used, so a
    window follows daylight saving time; during the repeated hour of a DST change both passes count."""

    def __init__(self, days, start, end, tz, label=''):
        self.days = frozenset(days)
        self.start = start
        self.end = end
        self.tz = tz
        self.label = label

    def contains(self, now):
        local = datetime.datetime.fromtimestamp(now, self.tz)
        minute = local.hour * 60 + local.minute + local.second / 60.0
        day = local.weekday()
        if self.start == self.end:
            return day in self.days
        if self.start < self.end:
            return day in self.days and self.start <= minute < self.end
        return (day in self.days and minute >= self.start) or ((day - 1) % 7 in self.days and minute < self.end)

    def describe(self):
        days = ','.join(DAY_NAMES[d] for d in sorted(self.days)) if len(self.days) < 7 else 'daily'
        return '%s %02d:%02d-%02d:%02d %s' % (days, self.start // 60, self.start % 60, self.end // 60, self.end % 60,
                                              getattr(self.tz, 'key', None) or str(self.tz))


WINDOW_KEYS = ('days', 'start', 'end', 'tz', 'timezone', 'name', 'message', 'description')


def _window(value, path, keys=WINDOW_KEYS):
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, keys)
    if 'start' not in value or 'end' not in value:
        errors.add(path, value, 'a window needs start and end ("HH:MM")')
    if 'tz' in value and 'timezone' in value:
        errors.add(path, value, 'give tz or timezone, not both')
    tz = errors.run(_tz, value.get('tz', value.get('timezone')), _join(path, 'tz'))
    start = errors.run(_minutes, value['start'], _join(path, 'start')) if 'start' in value else None
    end = errors.run(_minutes, value['end'], _join(path, 'end')) if 'end' in value else None
    days = errors.run(_days, value.get('days'), _join(path, 'days'))
    label = value.get('name') or value.get('message') or ''
    if not isinstance(label, str):
        errors.add(_join(path, 'name'), label, 'expected text')
    errors.check()
    if start == 24 * 60:
        start = 0
    return Window(days, start, end, tz, label)


def _only(value, path, keys, hint=None):
    errors = _Errors()
    for key in value:
        if key not in keys:
            why = 'unknown key; expected one of %s' % ', '.join(sorted(keys))
            if hint and key in hint:
                why = hint[key]
            errors.add(_join(path, key), value[key], why)
    errors.check()


# ============================================================================ limits
# user-facing key -> (canonical key, converter kind, unit)
LIMIT_ALIASES = {
    'max_mem_gib_per_gpu': ('max_mem_mib_per_gpu', 'size', 'gib'),
    'max_mem_per_gpu': ('max_mem_mib_per_gpu', 'size', 'gib'),
    'max_mem_mib_per_gpu': ('max_mem_mib_per_gpu', 'size', 'mib'),
    'max_mem_gib_total': ('max_mem_mib_total', 'size', 'gib'),
    'max_mem_total': ('max_mem_mib_total', 'size', 'gib'),
    'max_mem_mib_total': ('max_mem_mib_total', 'size', 'mib'),
    'max_mem': ('max_mem_mib_total', 'size', 'gib'),
    'max_memory': ('max_mem_mib_total', 'size', 'gib'),
    'max_memory_gb': ('max_mem_mib_total', 'size', 'gib'),
    'max_memory_gib': ('max_mem_mib_total', 'size', 'gib'),
    'max_gpus': ('max_gpus', 'count', None),
    'max_procs': ('max_procs', 'count', None),
    'max_processes': ('max_procs', 'count', None),
    'max_concurrent_processes': ('max_procs', 'count', None),
    'max_procs_per_gpu': ('max_procs_per_gpu', 'count', None),
    'max_runtime': ('max_runtime_s', 'duration', None),
    'max_runtime_h': ('max_runtime_s', 'duration', 3600.0),
    'max_runtime_hours': ('max_runtime_s', 'duration', 3600.0),
    'idle': ('idle', 'idle', None),
    'require_allocation': ('require_allocation', 'bool', None),
    'allowed_gpus': ('allowed_gpus', 'gpus', None),
    'blocked_gpus': ('blocked_gpus', 'gpus', None),
    'action': ('action', 'action', None),
}
LIMIT_HINTS = {
    'max_mem_gib': 'ambiguous: write max_mem_gib_per_gpu (each GPU) or max_mem_gib_total (all GPUs together)',
    'memory_limit_gb': 'a gpu-kill key: it belongs in a gpu-kill configuration (user_policies); here write max_mem_gib_total',
    'max_util_pct': 'utilization is not limited: busy GPUs are what they are for; see idle for the opposite',
}
IDLE_KEYS = {
    'util_max_pct': ('util_max_pct', 'pct'), 'util_below_pct': ('util_max_pct', 'pct'), 'util_pct': ('util_max_pct', 'pct'),
    'mem_min_gib': ('mem_min_mib', 'size'), 'mem_above_gib': ('mem_min_mib', 'size'), 'holding_gib': ('mem_min_mib', 'size'),
    'mem_min': ('mem_min_mib', 'size'),
    'for': ('for_s', 'duration'), 'duration': ('for_s', 'duration'), 'for_min': ('for_s', 'minutes'),
}


class IdleRule(object):
    """util <= util_max_pct while holding >= mem_min_mib for for_s seconds (any activity resets the clock)."""

    def __init__(self, util_max_pct=1.0, mem_min_mib=1024.0, for_s=3600.0):
        self.util_max_pct = util_max_pct
        self.mem_min_mib = mem_min_mib
        self.for_s = for_s

    def to_dict(self):
        return {'util_max_pct': self.util_max_pct, 'mem_min_mib': self.mem_min_mib, 'for_s': self.for_s}


def _idle(value, path):
    if value is False or value is None:
        return False
    _dict(value, path)
    errors = _Errors()
    out = {}
    for key, item in value.items():
        sub = _join(path, key)
        if key not in IDLE_KEYS:
            errors.add(sub, item, 'unknown key; expected util_max_pct, mem_min_gib and for (as in 30m)')
            continue
        name, kind = IDLE_KEYS[key]
        if name in out:
            errors.add(sub, item, 'given twice (under another name)')
            continue
        if kind == 'pct':
            out[name] = errors.run(_pct, item, sub)
        elif kind == 'size':
            out[name] = errors.run(_size, item, sub)
        elif kind == 'minutes':
            out[name] = errors.run(_duration, item, sub, 60.0)
        else:
            out[name] = errors.run(_duration, item, sub)
    if 'for_s' not in out:
        errors.add(path, value, 'an idle rule needs "for" (how long, as in 30m)')
    errors.check()
    return IdleRule(out.get('util_max_pct', 1.0), out.get('mem_min_mib', 1024.0), out['for_s'])


def _limits(value, path, extra=()):
    """Parse a block of limits -> dict of canonical keys (only those given).  Every key is checked."""
    _dict(value, path)
    errors = _Errors()
    out = {}
    for key, item in value.items():
        if key in extra:
            continue
        sub = _join(path, key)
        if key not in LIMIT_ALIASES:
            why = LIMIT_HINTS.get(key, 'unknown key; expected one of %s' % ', '.join(sorted(set(LIMIT_ALIASES) | set(extra))))
            errors.add(sub, item, why)
            continue
        name, kind, unit = LIMIT_ALIASES[key]
        if name in out:
            errors.add(sub, item, 'this limit is given twice (under another name)')
            continue
        if item is None and kind not in ('idle',):
            out[name] = None  # explicitly "no limit" (overrides an inherited one)
            continue
        if kind == 'size':
            out[name] = errors.run(_size, item, sub, unit)
        elif kind == 'count':
            out[name] = errors.run(_count, item, sub)
        elif kind == 'duration':
            out[name] = errors.run(_duration, item, sub, unit)
        elif kind == 'idle':
            out[name] = errors.run(_idle, item, sub)
        elif kind == 'bool':
            out[name] = errors.run(_bool, item, sub)
        elif kind == 'gpus':
            out[name] = errors.run(_gpu_set, item, sub)
        elif kind == 'action':
            out[name] = errors.run(_action, item, sub)
    errors.check()
    return out


class Limits(object):
    """The limits that apply to one user at one moment (None = no limit)."""

    FIELDS = ('max_mem_mib_per_gpu', 'max_mem_mib_total', 'max_gpus', 'max_procs', 'max_procs_per_gpu', 'max_runtime_s',
              'idle', 'require_allocation', 'allowed_gpus', 'blocked_gpus', 'action')

    def __init__(self, values=None):
        values = values or {}
        for name in self.FIELDS:
            setattr(self, name, values.get(name))
        if self.action is None:
            self.action = 'terminate'
        if self.idle is False:
            self.idle = None

    def to_dict(self):
        out = {}
        for name in self.FIELDS:
            value = getattr(self, name)
            if isinstance(value, IdleRule):
                value = value.to_dict()
            elif isinstance(value, GpuSet):
                value = value.text
            out[name] = value
        return out


# ============================================================================ policy parts
class Principals(object):
    """Users, ``group:NAME`` (policy group or Unix group) and ``@LIST`` (a named list) references."""

    def __init__(self, users=(), groups=(), lists=()):
        self.users = frozenset(users)
        self.groups = tuple(groups)
        self.lists = tuple(lists)

    def __bool__(self):
        return bool(self.users or self.groups or self.lists)

    def contains(self, user, policy, context):
        if user is None:
            return False
        if user in self.users or '*' in self.users:
            return True
        for name in self.lists:
            if user in policy.lists.get(name, ()):
                return True
        for name in self.groups:
            if policy.in_group(user, name, context):
                return True
        return False

    def describe(self):
        return sorted(self.users) + ['group:%s' % g for g in self.groups] + ['@%s' % n for n in self.lists]


def _principals(value, path, lists=None):
    errors = _Errors()
    if isinstance(value, dict):
        errors.run(_only, value, path, ('users', 'groups', 'lists'))
        found = []
        for key, what in (('users', 'a user or group name'), ('groups', 'a user or group name'), ('lists', 'a user or group name')):
            sub = _join(path, key)
            found.append([errors.run(_name, item, sub, what) for item in errors.run(_list, value.get(key), sub) or []])
        errors.check()
        return Principals(*found)
    items = [value] if isinstance(value, str) else _list(value, path)
    users, groups, named = [], [], []
    for item in items:
        if not isinstance(item, str):
            errors.run(_name, item, path)
            continue
        text = item.strip()
        if text.startswith('group:') or text.startswith('%'):
            groups.append(errors.run(_name, text.split(':', 1)[1] if text.startswith('group:') else text[1:], path, 'a group name'))
        elif text.startswith('@'):
            name = errors.run(_name, text[1:], path, 'a list name')
            if name is not None and lists is not None and name not in lists:
                errors.add(path, '@' + name, 'no such list in lists')
            named.append(name)
        elif text.startswith('user:'):
            users.append(errors.run(_name, text[5:], path))
        else:
            users.append(errors.run(_name, text, path))
    errors.check()
    return Principals(users, groups, named)


class Group(object):
    """A policy group: ``members`` (a named list) or a Unix group; limits for each member and for the group."""

    def __init__(self, name, members=None, unix_group=None, limits=None, aggregate=None, expires=None, action=None):
        self.name = name
        self.members = members            # frozenset of users, or None for a Unix group
        self.unix_group = unix_group
        self.limits = limits or {}
        self.aggregate = aggregate or {}  # group_max_mem_mib_total, group_max_gpus, group_max_procs
        self.expires = expires
        self.action = action


GROUP_EXTRA = ('members', 'unix_group', 'group_max_mem_gib_total', 'group_max_mem_total', 'group_max_gpus',
               'group_max_procs', 'description', 'expires')


def _group(name, value, path, lists):
    _dict(value, path)
    errors = _Errors()
    members = None
    unix_group = None
    if 'members' in value and 'unix_group' in value:
        errors.add(path, value, 'give members (a named list) or unix_group, not both')
    if 'members' in value:
        members = set()
        for item in errors.run(_list, value['members'], _join(path, 'members')) or []:
            text = errors.run(_name, item, _join(path, 'members'))
            if text is None:
                continue
            if text.startswith('@'):
                if text[1:] not in lists:
                    errors.add(_join(path, 'members'), text, 'no such list in lists')
                    continue
                members.update(lists[text[1:]])
            else:
                members.add(text)
        members = frozenset(members)
    else:
        unix_group = errors.run(_name, value.get('unix_group', name), _join(path, 'unix_group'), 'a Unix group name')
    limits = errors.run(_limits, value, path, GROUP_EXTRA) or {}
    aggregate = {}
    for key, canonical, kind in (('group_max_mem_gib_total', 'group_max_mem_mib_total', 'size'),
                                 ('group_max_mem_total', 'group_max_mem_mib_total', 'size'),
                                 ('group_max_gpus', 'group_max_gpus', 'count'),
                                 ('group_max_procs', 'group_max_procs', 'count')):
        if key in value:
            if canonical in aggregate:
                errors.add(_join(path, key), value[key], 'given twice (under another name)')
                continue
            sub = _join(path, key)
            aggregate[canonical] = errors.run(_size, value[key], sub) if kind == 'size' else errors.run(_count, value[key], sub)
    if 'description' in value and not isinstance(value['description'], str):
        errors.add(_join(path, 'description'), value['description'], 'expected text')
    expires = errors.run(_expires, value['expires'], _join(path, 'expires')) if value.get('expires') is not None else None
    errors.check()
    return Group(name, members, unix_group, limits, aggregate, expires, limits.get('action'))


class GpuRule(object):
    def __init__(self, key, gpus, reserved_for=None, blocked_users=None, maintenance=(), max_mem_mib_total=None,
                 action=None, message=''):
        self.key = key
        self.gpus = gpus
        self.reserved_for = reserved_for
        self.blocked_users = blocked_users
        self.maintenance = list(maintenance)
        self.max_mem_mib_total = max_mem_mib_total
        self.action = action
        self.message = message


GPU_KEYS = ('reserved_for', 'allowed_users', 'blocked_users', 'maintenance', 'maintenance_window', 'max_mem_gib_total',
            'max_mem_total', 'action', 'message', 'description')


def _gpu_rule(key, value, path, lists):
    errors = _Errors()
    gpus = errors.run(_gpu_set, key, path)
    _dict(value, path)
    errors.run(_only, value, path, GPU_KEYS, {'max_memory_gb': 'a gpu-kill key: write max_mem_gib_total here'})
    if 'reserved_for' in value and 'allowed_users' in value:
        errors.add(path, value, 'give reserved_for or allowed_users (the same thing), not both')
    reserved = None
    for name in ('reserved_for', 'allowed_users'):
        if value.get(name):
            reserved = errors.run(_principals, value[name], _join(path, name), lists)
    blocked = errors.run(_principals, value['blocked_users'], _join(path, 'blocked_users'), lists) if value.get('blocked_users') else None
    windows = []
    for name in ('maintenance', 'maintenance_window'):
        if value.get(name) is None:
            continue
        items = value[name] if isinstance(value[name], list) else [value[name]]
        for index, item in enumerate(items):
            windows.append(errors.run(_window, item, '%s[%d]' % (_join(path, name), index) if isinstance(value[name], list)
                                      else _join(path, name)))
    limit = None
    for name in ('max_mem_gib_total', 'max_mem_total'):
        if name in value:
            if limit is not None:
                errors.add(_join(path, name), value[name], 'given twice (under another name)')
                continue
            limit = errors.run(_size, value[name], _join(path, name))
    action = errors.run(_action, value['action'], _join(path, 'action')) if 'action' in value else None
    message = value.get('message') or ''
    if not isinstance(message, str):
        errors.add(_join(path, 'message'), message, 'expected text')
    errors.check()
    return GpuRule(key, gpus, reserved, blocked, windows, limit, action, message)


class TimeWindow(object):
    def __init__(self, name, window, applies_to=None, limits=None, multipliers=None):
        self.name = name
        self.window = window
        self.applies_to = applies_to      # Principals or None (everyone)
        self.limits = limits or {}
        self.multipliers = multipliers or {}


TIME_WINDOW_KEYS = ('name', 'days', 'start', 'end', 'tz', 'timezone', 'applies_to', 'users', 'limits', 'override',
                    'overrides', 'multipliers', 'description')
MULTIPLIER_KEYS = ('mem', 'runtime', 'procs', 'gpus')


def _time_window(value, path, lists):
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, TIME_WINDOW_KEYS)
    window = errors.run(_window, dict((k, v) for k, v in value.items() if k in WINDOW_KEYS), path)
    applies = None
    if 'applies_to' in value and 'users' in value:
        errors.add(path, value, 'give applies_to or users, not both')
    for name in ('applies_to', 'users'):
        if value.get(name) is not None:
            applies = errors.run(_principals, value[name], _join(path, name), lists)
    given = [k for k in ('limits', 'override', 'overrides') if k in value]
    if len(given) > 1:
        errors.add(path, value, 'give limits once (override and overrides are other names for it)')
    limits = errors.run(_limits, value[given[0]], _join(path, given[0])) if given else {}
    multipliers = {}
    if value.get('multipliers') is not None:
        sub = _join(path, 'multipliers')
        if errors.run(_dict, value['multipliers'], sub) is not None:
            errors.run(_only, value['multipliers'], sub, MULTIPLIER_KEYS)
            for key, item in value['multipliers'].items():
                if not _is_number(item) or math.isnan(item) or item < 0 or item == float('inf'):
                    errors.add(_join(sub, key), item, 'expected a number, 0 or more')
                elif key in MULTIPLIER_KEYS:
                    multipliers[key] = float(item)
    if limits == {} and not multipliers and not value.get('multipliers'):
        errors.add(path, value, 'a time window changes limits: give limits (or multipliers)')
    name = value.get('name') or (window.describe() if window is not None else '')
    if not isinstance(name, str):
        errors.add(_join(path, 'name'), name, 'expected text')
    errors.check()
    return TimeWindow(name, window, applies, limits, multipliers)


class Exemption(object):
    """An identity-based exemption from some rules until ``expires`` (epoch seconds)."""

    def __init__(self, match, rules, expires, reason=''):
        self.match = match
        self.rules = frozenset(rules)
        self.expires = expires
        self.reason = reason

    def expired(self, now):
        return now >= self.expires

    def applies(self, proc, rule, context):
        if rule not in self.rules:
            return False
        match = self.match
        if 'user' in match and proc.user != match['user']:
            return False
        if 'cmdline' in match:
            text = ' '.join(proc.cmdline or ())[:32768]
            if not proc.cmdline or not match['cmdline'].search(text):
                return False
        if 'exe' in match and (proc.exe or '').replace(' (deleted)', '') != match['exe']:
            return False
        if 'container' in match:
            cid = proc.container.id if proc.container is not None else None
            if not cid or not (cid == match['container'] or (len(match['container']) >= 12 and cid.startswith(match['container']))):
                return False
        if 'pod' in match:
            pod = proc.container.pod_uid if proc.container is not None else None
            if pod != match['pod']:
                return False
        if 'slurm_job' in match and str(proc.slurm_job) != match['slurm_job']:
            return False
        if 'exe_sha256' in match:
            digest = context.exe_sha256(proc)
            if digest is None or digest.lower() != match['exe_sha256']:
                return False
        return True


EXEMPTION_MATCH_KEYS = ('user', 'cmdline', 'exe', 'exe_sha256', 'container', 'pod', 'slurm_job')


def _exemption(value, path):
    _dict(value, path)
    errors = _Errors()
    allowed = ('match', 'rules', 'expires', 'reason', 'comment') + EXEMPTION_MATCH_KEYS
    errors.run(_only, value, path, allowed)
    mpath = path
    raw = dict((k, v) for k, v in value.items() if k in EXEMPTION_MATCH_KEYS)
    if 'match' in value:
        mpath = _join(path, 'match')
        if raw:
            errors.add(path, value, 'put the identity either under match or beside it, not both')
        raw = errors.run(_dict, value['match'], mpath) or {}
        errors.run(_only, raw, mpath, EXEMPTION_MATCH_KEYS)
    match = {}
    for key, item in raw.items():
        sub = _join(mpath, key)
        if key == 'cmdline':
            match[key] = errors.run(_regex, item, sub)
        elif key == 'exe_sha256':
            match[key] = (errors.run(_text, item, sub, _SHA256, 'a SHA-256 hex digest (64 hex digits)') or '').lower()
        elif key == 'user':
            match[key] = errors.run(_name, item, sub)
        elif key == 'exe':
            match[key] = errors.run(_abs_path, item, sub)
        elif key in EXEMPTION_MATCH_KEYS:
            if _is_number(item) and not isinstance(item, float):
                item = str(item)
            match[key] = errors.run(_text, item, sub, None, 'an identifier')
    identity = ('exe_sha256' in match or 'container' in match or 'pod' in match or 'slurm_job' in match
                or ('user' in match and 'cmdline' in match))
    if not identity:
        errors.add(mpath, raw, 'an exemption needs an identity: exe_sha256, container, pod, slurm_job, or user together '
                               'with cmdline (a name or a user alone is not an identity)')
    expires = None
    if value.get('expires') is None:
        errors.add(_join(path, 'expires'), value.get('expires'), 'every exemption needs an expiry date (expires: YYYY-MM-DD)')
    else:
        expires = errors.run(_expires, value['expires'], _join(path, 'expires'))
    rules = set()
    names = value.get('rules', ['quota'])
    for name in ([names] if isinstance(names, str) else errors.run(_list, names, _join(path, 'rules')) or []):
        if name in RULE_GROUPS:
            rules.update(RULE_GROUPS[name])
        elif name in RULES:
            rules.add(name)
        else:
            errors.add(_join(path, 'rules'), name, 'unknown rule; expected rule ids (%s) or %s' % (
                ', '.join(RULES), ', '.join(sorted(RULE_GROUPS))))
    reason = value.get('reason') or value.get('comment') or ''
    if not isinstance(reason, str):
        errors.add(_join(path, 'reason'), reason, 'expected text')
    errors.check()
    return Exemption(match, rules, expires, reason)


class Protect(object):
    """Processes quota rules never touch (the rogue rule still applies to them).

    ``users``, ``groups``, ``lists`` and ``uid_below`` go by the real uid the kernel reports.  A
    ``name`` (comm, argv[0], the executable's basename, plus killer.DEFAULT_PROTECT_NAMES) or an
    ``exe`` path protects only a process whose owner could not have chosen it
    (identity.Identity.name_trusted: a system account runs it, from a root-owned executable outside
    directories users may write): an ordinary user's hog named ``sshd`` is charged like any other.
    """

    def __init__(self, users=(), groups=(), lists=(), uid_below=None, names=(), exe=()):
        self.users = frozenset(users)
        self.groups = tuple(groups)
        self.lists = tuple(lists)
        self.uid_below = uid_below
        self.names = frozenset(names) | frozenset(DEFAULT_PROTECT_NAMES)
        self.exe = frozenset(exe)

    def reason(self, proc, policy, context):
        if proc.user is not None and proc.user in self.users:
            return 'protected user %s' % proc.user
        if self.uid_below is not None and proc.uid is not None and proc.uid < self.uid_below:
            return 'protected: uid %d is below %d' % (proc.uid, self.uid_below)
        names = set()
        if proc.name:
            names.add(proc.name)
        if proc.cmdline:
            names.add(os.path.basename(proc.cmdline[0]))
        if proc.exe:
            names.add(os.path.basename(proc.exe.replace(' (deleted)', '')))
        trusted = name_trusted(getattr(proc, 'identity', None))
        hit = sorted(names & self.names)
        if hit and trusted:
            return 'protected name %s' % hit[0]
        if trusted and proc.exe and proc.exe.replace(' (deleted)', '') in self.exe:
            return 'protected executable %s' % proc.exe
        for name in self.lists:
            if proc.user in policy.lists.get(name, ()):
                return 'protected list @%s' % name
        for name in self.groups:
            if policy.in_group(proc.user, name, context):
                return 'protected group %s' % name
        return None


PROTECT_KEYS = ('users', 'groups', 'lists', 'uid_below', 'names', 'exe')


def _protect(value, path, lists):
    if value is None:
        return Protect()
    errors = _Errors()
    entries = []
    if isinstance(value, dict):
        errors.run(_only, value, path, PROTECT_KEYS)
        entries = [(k, v, _join(path, k)) for k, v in value.items() if k in PROTECT_KEYS]
    else:
        for index, item in enumerate(_list(value, path)):
            sub = '%s[%d]' % (path, index)
            if errors.run(_dict, item, sub) is None:
                continue
            if len(item) != 1:
                errors.add(sub, item, 'each protect entry has one key: user, group, list, name, exe or uid_below')
                continue
            key, val = list(item.items())[0]
            plural = {'user': 'users', 'group': 'groups', 'list': 'lists', 'name': 'names', 'exe': 'exe',
                      'uid_below': 'uid_below'}
            if key not in plural:
                errors.add(_join(sub, key), val, 'expected one of user, group, list, name, exe or uid_below')
                continue
            entries.append((plural[key], val if key == 'uid_below' or isinstance(val, list) else [val], _join(sub, key)))
    users, groups, named, names, exe, uid_below = [], [], [], [], [], None
    for key, val, sub in entries:
        if key == 'uid_below':
            uid_below = errors.run(_count, val, sub)
            continue
        for item in errors.run(_list, val, sub) or []:
            if key == 'users':
                users.append(errors.run(_name, item, sub))
            elif key == 'groups':
                groups.append(errors.run(_name, item, sub, 'a group name'))
            elif key == 'lists':
                text = (errors.run(_name, item, sub, 'a list name') or '').lstrip('@')
                if text and text not in lists:
                    errors.add(sub, item, 'no such list in lists')
                named.append(text)
            elif key == 'names':
                names.append(errors.run(_text, item, sub, None, 'a process name'))
            elif key == 'exe':
                exe.append(errors.run(_abs_path, item, sub))
    errors.check()
    return Protect(users, groups, named, uid_below, names, exe)


CLEAR_AFTER = 60.0   # a violation that disappears is cleared after this long away (escalation.clear_after)


class Escalation(object):
    """Warnings at ``warn_at`` seconds after a violation is first seen; the action at ``act_at``;
    SIGKILL ``sigkill_after`` seconds after SIGTERM; a failed action is retried after ``retry_after``;
    a violation that disappears is cleared once it has stayed away for ``clear_after`` seconds."""

    def __init__(self, warn_at=(0.0, 300.0), act_at=600.0, sigkill_after=30.0, retry_after=300.0, clear_after=CLEAR_AFTER):
        self.warn_at = sorted(float(x) for x in warn_at)
        self.act_at = float(act_at)
        self.sigkill_after = float(sigkill_after)
        self.retry_after = float(retry_after)
        self.clear_after = float(clear_after)

    def to_dict(self):
        return {'warn_at': self.warn_at, 'act_at': self.act_at, 'sigkill_after': self.sigkill_after,
                'retry_after': self.retry_after, 'clear_after': self.clear_after}


ESCALATION_KEYS = ('warn_again_after', 'act_after', 'grace', 'warnings', 'sigkill_after', 'kill_after', 'retry_after', 'steps',
                   'clear_after')


def _escalation(value, path):
    if value is None:
        return Escalation()
    if isinstance(value, list):
        value = {'steps': value}
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, ESCALATION_KEYS)
    sigkill = None
    for name in ('sigkill_after', 'kill_after'):
        if name in value:
            if sigkill is not None:
                errors.add(_join(path, name), value[name], 'given twice (kill_after is another name for sigkill_after)')
                continue
            sigkill = errors.run(_duration, value[name], _join(path, name))
    retry = errors.run(_duration, value['retry_after'], _join(path, 'retry_after')) if 'retry_after' in value else 300.0
    clear = errors.run(_duration, value['clear_after'], _join(path, 'clear_after')) if 'clear_after' in value else CLEAR_AFTER
    if 'steps' in value:
        if any(k in value for k in ('warn_again_after', 'act_after', 'grace', 'warnings')):
            errors.add(path, value, 'give steps, or warn_again_after/act_after, not both')
        warn_at, act_at = [], None
        steps = errors.run(_list, value['steps'], _join(path, 'steps'))
        for index, step in enumerate(steps or []):
            sub = '%s[%d]' % (_join(path, 'steps'), index)
            if errors.run(_dict, step, sub) is None:
                continue
            errors.run(_only, step, sub, ('after', 'after_min', 'action', 'sigkill_after'))
            if 'after' in step and 'after_min' in step:
                errors.add(sub, step, 'give after or after_min, not both')
            after = errors.run(_duration, step['after_min'], _join(sub, 'after_min'), 60.0) if 'after_min' in step else \
                errors.run(_duration, step.get('after', 0), _join(sub, 'after'))
            action = errors.run(_action, step.get('action', 'warn'), _join(sub, 'action'))
            if after is None or action is None:
                continue
            if action == 'warn':
                if act_at is not None:
                    errors.add(sub, step, 'warnings come before the action')
                warn_at.append(after)
            else:
                if act_at is not None:
                    errors.add(sub, step, 'only one step acts (terminate or kill)')
                act_at = after
                if 'sigkill_after' in step:
                    sigkill = errors.run(_duration, step['sigkill_after'], _join(sub, 'sigkill_after'))
        if steps is not None and act_at is None:
            errors.add(_join(path, 'steps'), steps, 'the last step acts: action terminate (or kill)')
        elif warn_at and act_at is not None and max(warn_at) > act_at:
            errors.add(_join(path, 'steps'), steps, 'warnings come before the action')
        errors.check()
        return Escalation(warn_at, act_at, 30.0 if sigkill is None else sigkill, retry, clear)
    if 'act_after' in value and 'grace' in value:
        errors.add(path, value, 'give act_after or grace (the same thing), not both')
    act_at = 600.0
    for name in ('act_after', 'grace'):
        if name in value:
            act_at = errors.run(_duration, value[name], _join(path, name))
    warn_at = []
    if 'warn_again_after' in value:
        if 'warnings' in value:
            errors.add(path, value, 'give warn_again_after or warnings, not both')
        again = errors.run(_duration, value['warn_again_after'], _join(path, 'warn_again_after'))
        if again is not None and act_at is not None and again > act_at:
            errors.add(_join(path, 'warn_again_after'), value['warn_again_after'], 'the second warning comes before the action (act_after)')
        warn_at = [0.0, again]
    else:
        count = errors.run(_count, value['warnings'], _join(path, 'warnings')) if 'warnings' in value else 2
        if count is not None and count > 100:
            errors.add(_join(path, 'warnings'), value['warnings'], 'at most 100 warnings')
        elif count and act_at is not None:
            warn_at = [act_at * i / count for i in range(count)]
    errors.check()
    return Escalation(warn_at, act_at, 30.0 if sigkill is None else sigkill, retry, clear)


class RoguePolicy(object):
    def __init__(self, enabled=False, act_min_level='critical', action='terminate', grace=0.0, rules_file=None):
        self.enabled = enabled
        self.act_min_level = act_min_level
        self.action = action
        self.grace = grace
        self.rules_file = rules_file


def _rogue(value, path):
    if value is None or value is False:
        return RoguePolicy()
    if value is True:
        return RoguePolicy(enabled=True)
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, ('enabled', 'act_min_level', 'min_level', 'action', 'grace', 'require_hard_indicator', 'rules_file'))
    if 'act_min_level' in value and 'min_level' in value:
        errors.add(path, value, 'give act_min_level or min_level, not both')
    level = value.get('act_min_level', value.get('min_level', 'critical'))
    if level not in ('medium', 'high', 'critical'):
        errors.add(_join(path, 'act_min_level'), level, 'expected medium, high or critical')
    if 'require_hard_indicator' in value and value['require_hard_indicator'] is not True:
        errors.add(_join(path, 'require_hard_indicator'), value['require_hard_indicator'],
                   'acting on a rogue finding always needs a hard indicator (content or network evidence); '
                   'behaviour alone never leads to an action')
    rules_file = value.get('rules_file')
    if rules_file is not None:
        errors.run(_abs_path, rules_file, _join(path, 'rules_file'))
    rogue = RoguePolicy(enabled=errors.run(_bool, value.get('enabled', True), _join(path, 'enabled')),
                        act_min_level=level,
                        action=errors.run(_action, value.get('action', 'terminate'), _join(path, 'action')),
                        grace=errors.run(_duration, value['grace'], _join(path, 'grace')) if 'grace' in value else 0.0,
                        rules_file=rules_file)
    errors.check()
    return rogue


class RemediationPolicy(object):
    """The guard's remediation ladder (core/remediate.py): off unless ``enabled``."""

    def __init__(self, enabled=False, kill_application_xids=True, reset=True, kill_processes=False, stop_services=(),
                 drain=True, drain_command=None, reboot_flag='/var/lib/gpufleet/reboot-wanted', orphan_threshold_mib=1024,
                 verify_timeout=60.0, node_name=None):
        self.enabled = enabled
        self.kill_application_xids = kill_application_xids
        self.reset = reset
        self.kill_processes = kill_processes
        self.stop_services = list(stop_services)
        self.drain = drain
        self.drain_command = drain_command
        self.reboot_flag = reboot_flag
        self.orphan_threshold_mib = orphan_threshold_mib
        self.verify_timeout = verify_timeout
        self.node_name = node_name


REMEDIATION_KEYS = ('enabled', 'kill_application_xids', 'reset', 'kill_processes', 'stop_services', 'drain', 'drain_command',
                    'reboot_flag', 'orphan_threshold_mib', 'verify_timeout', 'node_name')


def _remediation(value, path):
    if value is None or value is False:
        return RemediationPolicy()
    if value is True:
        return RemediationPolicy(enabled=True)
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, REMEDIATION_KEYS)
    out = RemediationPolicy(enabled=errors.run(_bool, value.get('enabled', True), _join(path, 'enabled')))
    for key in ('kill_application_xids', 'reset', 'kill_processes', 'drain'):
        if key in value:
            setattr(out, key, errors.run(_bool, value[key], _join(path, key)))
    services = value.get('stop_services')
    if services is not None:
        # only for this key: the tick stays light
        from ..reset import UNIT_RE  # pylint: disable=import-outside-toplevel
        services = [services] if services == 'auto' else errors.run(_list, services, _join(path, 'stop_services')) or []
        for unit in services:
            if not isinstance(unit, str) or not UNIT_RE.match(unit):
                errors.add(_join(path, 'stop_services'), unit, 'not a systemd unit name (or auto)')
        out.stop_services = list(services)
    if value.get('drain_command') is not None:
        out.drain_command = errors.run(_command, value['drain_command'], _join(path, 'drain_command'))
    if 'reboot_flag' in value:
        flag = value['reboot_flag']
        out.reboot_flag = None if flag is False else errors.run(_abs_path, flag, _join(path, 'reboot_flag'))
    if 'orphan_threshold_mib' in value:
        out.orphan_threshold_mib = errors.run(_count, value['orphan_threshold_mib'], _join(path, 'orphan_threshold_mib'))
    if 'verify_timeout' in value:
        out.verify_timeout = errors.run(_duration, value['verify_timeout'], _join(path, 'verify_timeout'))
    name = value.get('node_name')
    if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
        errors.add(_join(path, 'node_name'), name, 'expected a scheduler node name')
    out.node_name = name
    errors.check()
    return out


class Notify(object):
    def __init__(self, tty=True, webhook_url=None, webhook_timeout=5.0, command=None, redact_patterns=(), message=''):
        self.tty = tty
        self.webhook_url = webhook_url
        self.webhook_timeout = webhook_timeout
        self.command = command
        self.redact_patterns = list(redact_patterns)
        self.message = message


def _notify(value, path):
    defaults = [re.compile(p) for p in DEFAULT_REDACT_PATTERNS]
    if value is None:
        return Notify(redact_patterns=defaults)
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, ('tty', 'webhook', 'command', 'redact_patterns', 'redact_defaults', 'message'))
    url, timeout = None, 5.0
    hook = value.get('webhook')
    if isinstance(hook, str):
        hook = {'url': hook}
    if hook is not None and errors.run(_dict, hook, _join(path, 'webhook')) is not None:
        sub = _join(path, 'webhook')
        errors.run(_only, hook, sub, ('url', 'timeout', 'enabled', 'allow_http'))
        allow_http = errors.run(_bool, hook.get('allow_http', False), _join(sub, 'allow_http'))
        if hook.get('enabled', True):
            url = hook.get('url')
            why = None if url is None else notify_mod.webhook_url_problem(url, bool(allow_http), _join(sub, 'allow_http'))
            if why:
                errors.add(_join(sub, 'url'), (notify_mod.redact_url(url) or '<redacted>') if isinstance(url, str) else url, why)
        if 'timeout' in hook:
            timeout = errors.run(_duration, hook['timeout'], _join(sub, 'timeout'))
            if timeout is not None and not 0 < timeout <= 60:
                errors.add(_join(sub, 'timeout'), hook['timeout'], 'expected more than 0 and at most 60 seconds')
    command = None
    if value.get('command') is not None:
        command = errors.run(_command, value['command'], _join(path, 'command'))
    patterns = defaults if errors.run(_bool, value.get('redact_defaults', True), _join(path, 'redact_defaults')) is not False else []
    for item in errors.run(_list, value.get('redact_patterns'), _join(path, 'redact_patterns')) or []:
        patterns.append(errors.run(_regex, item, _join(path, 'redact_patterns')))
    message = value.get('message') or ''
    if not isinstance(message, str):
        errors.add(_join(path, 'message'), message, 'expected text')
    tty = errors.run(_bool, value.get('tty', True), _join(path, 'tty'))
    errors.check()
    return Notify(tty, url, timeout, command, patterns, message)


def _command(argv, sub):
    """The notify command hook: an argument list whose program is an absolute path."""
    if isinstance(argv, str):
        raise _Bad(sub, argv, 'the command hook is an argument list, never a shell line: write ["/usr/local/bin/notify", "--flag"]')
    argv = _list(argv, sub)
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise _Bad(sub, argv, 'expected a non-empty list of arguments (text)')
    if not argv[0].startswith('/'):
        raise _Bad(sub, argv[0], 'the program is an absolute path')
    return list(argv)


# ============================================================================ the policy
class Policy(object):
    """A validated policy.  ``notes`` hold warnings for check-config (ignored keys, expired exemptions)."""

    def __init__(self):
        self.version = SCHEMA_VERSION
        self.enabled = True
        self.mode = 'dry-run'
        self.interval_s = None
        self.lists = {}
        self.defaults = {}
        self.users = {}
        self.user_expires = {}
        self.groups = []          # Group, in the order written
        self.gpus = []            # GpuRule
        self.time_windows = []
        self.exemptions = []
        self.protect = Protect()
        self.escalation = Escalation()
        self.rogue = RoguePolicy()
        self.remediation = RemediationPolicy()
        self.notify = Notify(redact_patterns=[re.compile(p) for p in DEFAULT_REDACT_PATTERNS])
        self.allocations_file = None
        self.idle_max_gap_s = 600.0
        self.notes = []
        self.source = '<policy>'
        self.sha256 = None
        self.format = 'gpufleet'

    # ------------------------------------------------------------------ membership
    def group(self, name):
        for group in self.groups:
            if group.name == name:
                return group
        return None

    def in_group(self, user, name, context):
        if user is None:
            return False
        group = self.group(name)
        if group is not None:
            if group.members is not None:
                return user in group.members
            return group.unix_group in context.groups_of(user)
        return name in context.groups_of(user)

    def groups_of_user(self, user, context, now):
        """The policy groups (in the order written) whose members include ``user`` and that have not expired."""
        return [g for g in self.groups if (g.expires is None or now < g.expires) and self.in_group(user, g.name, context)]

    # ------------------------------------------------------------------ resolution
    def limits_for(self, user, now, context):
        """The Limits of ``user`` at ``now``: defaults, then each of the user's groups in the order written
        (a later group overrides an earlier one), then the user's own entry, then the active time
        windows that apply to the user, in the order written."""
        merged = dict(self.defaults)
        for group in self.groups_of_user(user, context, now):
            merged.update(group.limits)
        expires = self.user_expires.get(user)
        if user in self.users and (expires is None or now < expires):
            merged.update(self.users[user])
        for window in self.time_windows:
            if not window.window.contains(now):
                continue
            if window.applies_to is not None and not window.applies_to.contains(user, self, context):
                continue
            merged.update(window.limits)
            for key, factor in window.multipliers.items():
                for name in {'mem': ('max_mem_mib_per_gpu', 'max_mem_mib_total'), 'runtime': ('max_runtime_s',),
                             'procs': ('max_procs', 'max_procs_per_gpu'), 'gpus': ('max_gpus',)}[key]:
                    if merged.get(name) is not None:
                        value = merged[name] * factor
                        merged[name] = int(value) if name in ('max_procs', 'max_procs_per_gpu', 'max_gpus') else value
        return Limits(merged)

    def active_exemptions(self, now):
        return [e for e in self.exemptions if not e.expired(now)]

    def summary(self):
        """A short description for logs and check-config."""
        return {'mode': self.mode, 'enabled': self.enabled, 'format': self.format, 'users': sorted(self.users),
                'groups': [g.name for g in self.groups], 'gpus': [g.key for g in self.gpus],
                'time_windows': [w.name for w in self.time_windows], 'exemptions': len(self.exemptions),
                'rogue': self.rogue.enabled, 'escalation': self.escalation.to_dict(), 'sha256': self.sha256}


TOP_KEYS = ('version', 'enabled', 'mode', 'interval', 'description', 'metadata', 'lists', 'defaults', 'users', 'groups',
            'gpus', 'time_windows', 'exemptions', 'protect', 'escalation', 'rogue', 'require_allocation',
            'allocations_file', 'notify', 'rules', 'idle_max_gap', 'remediation')
GPUKILL_KEYS = ('global', 'user_policies', 'group_policies', 'gpu_policies', 'time_policies', 'enforcement')


def parse_policy(data, source='<policy>'):
    """Validate a loaded document (dict, or a shorthand list) -> Policy.  Raises PolicyError."""
    try:
        check_nesting(data)  # every format and caller (check-config, tick, gpu_audit's mapping) passes here
    except DocumentLimitError as exc:
        raise PolicyError([('', None, str(exc))], source)
    errors = _Errors()
    if data is None:
        data = {}
    if isinstance(data, list):
        data = {'rules': data}
    if not isinstance(data, dict):
        raise PolicyError([('', data, 'a policy is a mapping (or a list of shorthand rules), got %s' % _type(data))], source)
    for key in data:
        if not isinstance(key, str):
            raise PolicyError([('', key, 'keys must be text, got %s' % _type(key))], source)
    notes = []
    fmt = 'gpufleet'
    if any(key in data for key in GPUKILL_KEYS):
        mixed = [k for k in data if k not in GPUKILL_KEYS and k != 'metadata']
        if mixed:
            raise PolicyError([(mixed[0], data[mixed[0]], 'this looks like a gpu-kill guard configuration (%s); do not mix '
                                                          'it with gpufleet keys' % ', '.join(k for k in GPUKILL_KEYS if k in data))],
                              source)
        data = from_gpukill(data, errors, notes)
        fmt = 'gpu-kill'
        if errors.items:
            raise PolicyError(errors.items, source)
    policy = Policy()
    policy.source = source
    policy.format = fmt
    policy.notes = notes
    errors.run(_only, data, '', TOP_KEYS, dict((k, 'a gpu-kill key; a gpu-kill configuration uses only %s' % ', '.join(GPUKILL_KEYS))
                                               for k in ('dry_run', 'hard_enforcement')))
    _parse_top(policy, data, errors)
    if errors.items:
        raise PolicyError(errors.items, source)
    return policy


def _parse_top(policy, data, errors):
    version = data.get('version', SCHEMA_VERSION)
    if version != SCHEMA_VERSION and str(version) != str(SCHEMA_VERSION):
        errors.add('version', version, 'this agent reads policy version %d' % SCHEMA_VERSION)
    if 'enabled' in data:
        policy.enabled = errors.run(_bool, data['enabled'], 'enabled')
    if 'mode' in data:
        policy.mode = errors.run(_mode, data['mode'], 'mode') or 'dry-run'
    if data.get('interval') is not None:
        policy.interval_s = errors.run(_duration, data['interval'], 'interval')
    if data.get('idle_max_gap') is not None:
        gap = errors.run(_duration, data['idle_max_gap'], 'idle_max_gap')
        if gap is not None:
            policy.idle_max_gap_s = gap
    for key in ('description',):
        if key in data and not isinstance(data[key], str):
            errors.add(key, data[key], 'expected text')
    # lists first: everything else may refer to them
    lists = {}
    if data.get('lists') is not None:
        raw = errors.run(_dict, data['lists'], 'lists') or {}
        for name, members in raw.items():
            path = _join('lists', name)
            if errors.run(_name, name, path, 'a list name') is None:
                continue
            items = errors.run(_list, members, path)
            if items is None:
                continue
            users = [errors.run(_name, m, path) for m in items]
            lists[name] = frozenset(u for u in users if u is not None)
    policy.lists = lists
    rules = data.get('rules')
    shorthand = _shorthand(rules, errors) if rules is not None else {'defaults': {}, 'users': {}, 'groups': {}}
    if data.get('defaults') is not None:
        policy.defaults = errors.run(_limits, data['defaults'], 'defaults') or {}
    _merge_into(policy.defaults, shorthand['defaults'], 'rules', errors)
    if data.get('users') is not None:
        raw = errors.run(_dict, data['users'], 'users') or {}
        for name, block in raw.items():
            path = _join('users', name)
            if errors.run(_name, name, path) is None:
                continue
            if block is None:
                block = {}
            if not isinstance(block, dict):
                errors.add(path, block, 'expected a mapping of limits')
                continue
            limits = errors.run(_limits, block, path, ('expires',))
            if limits is None:
                continue
            if block.get('expires') is not None:
                policy.user_expires[name] = errors.run(_expires, block['expires'], _join(path, 'expires'))
            if name == '*':
                _merge_into(policy.defaults, limits, path, errors)
            else:
                policy.users[name] = limits
    for name, limits in shorthand['users'].items():
        if name == '*':
            _merge_into(policy.defaults, limits, 'rules', errors)
        else:
            _merge_into(policy.users.setdefault(name, {}), limits, 'rules', errors)
    if data.get('groups') is not None:
        raw = errors.run(_dict, data['groups'], 'groups') or {}
        for name, block in raw.items():
            path = _join('groups', name)
            if errors.run(_name, name, path, 'a group name') is None:
                continue
            group = errors.run(_group, name, block if block is not None else {}, path, lists)
            if group is not None:
                policy.groups.append(group)
    for name, limits in shorthand['groups'].items():
        group = policy.group(name)
        if group is None:
            group = Group(name, None, name, {}, {})
            policy.groups.append(group)
        _merge_into(group.limits, limits, 'rules', errors)
    if data.get('gpus') is not None:
        raw = data['gpus']
        if isinstance(raw, dict):
            raw = dict((str(k) if _is_number(k) and not isinstance(k, float) else k, v) for k, v in raw.items())
        raw = errors.run(_dict, raw, 'gpus') or {}
        for key, block in raw.items():
            path = _join('gpus', key)
            rule = errors.run(_gpu_rule, key, block if block is not None else {}, path, lists)
            if rule is not None:
                policy.gpus.append(rule)
    if data.get('time_windows') is not None:
        items = errors.run(_list, data['time_windows'], 'time_windows') or []
        for index, item in enumerate(items):
            window = errors.run(_time_window, item, 'time_windows[%d]' % index, lists)
            if window is not None:
                policy.time_windows.append(window)
    if data.get('exemptions') is not None:
        items = errors.run(_list, data['exemptions'], 'exemptions') or []
        for index, item in enumerate(items):
            exemption = errors.run(_exemption, item, 'exemptions[%d]' % index)
            if exemption is not None:
                policy.exemptions.append(exemption)
    protect = errors.run(_protect, data.get('protect'), 'protect', lists)
    if protect is not None:
        policy.protect = protect
    escalation = errors.run(_escalation, data.get('escalation'), 'escalation')
    if escalation is not None:
        policy.escalation = escalation
    rogue = errors.run(_rogue, data.get('rogue'), 'rogue')
    if rogue is not None:
        policy.rogue = rogue
    notify = errors.run(_notify, data.get('notify'), 'notify')
    if notify is not None:
        policy.notify = notify
    remediation = errors.run(_remediation, data.get('remediation'), 'remediation')
    if remediation is not None:
        policy.remediation = remediation
    alloc = data.get('require_allocation')
    if alloc is not None:
        if isinstance(alloc, dict):
            errors.run(_only, alloc, 'require_allocation', ('enabled', 'allocations_file'))
            enabled = errors.run(_bool, alloc.get('enabled', True), 'require_allocation.enabled')
            if alloc.get('allocations_file') is not None:
                policy.allocations_file = errors.run(_abs_path, alloc['allocations_file'], 'require_allocation.allocations_file')
            if enabled is not None:
                policy.defaults.setdefault('require_allocation', enabled)
        else:
            enabled = errors.run(_bool, alloc, 'require_allocation')
            if enabled is not None:
                policy.defaults.setdefault('require_allocation', enabled)
    if data.get('allocations_file') is not None:
        policy.allocations_file = errors.run(_abs_path, data['allocations_file'], 'allocations_file')


def _abs_path(value, path):
    if not isinstance(value, str) or not value.startswith('/'):
        raise _Bad(path, value, 'expected an absolute path')
    return value


def _merge_into(target, extra, path, errors):
    for key, value in extra.items():
        if key in target and target[key] != value and not (isinstance(value, (IdleRule, GpuSet))):
            errors.add(path, value, 'limit %s is given twice for the same users (%r and %r)' % (key, target[key], value))
            continue
        target[key] = value


# ---------------------------------------------------------------------------- shorthand rules
SHORTHAND_SCOPE = ('user', 'users', 'group', 'groups')
_FLAG_KEYS = {'--user': 'user', '--group': 'group', '--max-mem': 'max_mem', '--max-memory': 'max_mem',
              '--max-mem-total': 'max_mem_total', '--max-mem-per-gpu': 'max_mem_per_gpu', '--max-gpus': 'max_gpus',
              '--max-procs': 'max_procs', '--max-processes': 'max_procs', '--max-runtime': 'max_runtime',
              '--action': 'action'}


def _flags_entry(text, path):
    """``"--user alice --max-mem 8GB --action kill"`` -> the equivalent mapping."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise _Bad(path, text, 'cannot split this rule: %s' % exc)
    out = {}
    index = 0
    while index < len(words):
        word = words[index]
        flag, _eq, inline = word.partition('=')
        if flag not in _FLAG_KEYS:
            raise _Bad(path, text, 'unknown option %r; expected %s' % (flag, ', '.join(sorted(_FLAG_KEYS))))
        if _eq:
            value = inline
        else:
            index += 1
            if index >= len(words):
                raise _Bad(path, text, '%s needs a value' % flag)
            value = words[index]
        key = _FLAG_KEYS[flag]
        if key in out:
            raise _Bad(path, text, '%s is given twice' % flag)
        if key in ('max_gpus', 'max_procs'):
            if not re.match(r'^\d+$', value):
                raise _Bad(path, text, '%s needs a whole number' % flag)
            value = int(value)
        out[key] = value
        index += 1
    return out


def _shorthand(rules, errors):
    """``rules``: a list of shorthand entries -> {'defaults': {...}, 'users': {u: {...}}, 'groups': {g: {...}}}."""
    out = {'defaults': {}, 'users': {}, 'groups': {}}
    items = errors.run(_list, rules, 'rules') or []
    for index, entry in enumerate(items):
        path = 'rules[%d]' % index
        if isinstance(entry, str):
            entry = errors.run(_flags_entry, entry, path)
            if entry is None:
                continue
        if not isinstance(entry, dict):
            errors.add(path, entry, 'expected a mapping such as {user: "*", max_memory_gb: 12, action: kill}')
            continue
        scopes = [k for k in SHORTHAND_SCOPE if k in entry]
        if len(scopes) > 1:
            errors.add(path, entry, 'give one of user, users, group or groups')
            continue
        limits = errors.run(_limits, entry, path, SHORTHAND_SCOPE)
        if limits is None:
            continue
        if not limits:
            errors.add(path, entry, 'this rule sets no limit')
            continue
        targets = []
        if not scopes:
            targets = [('defaults', None)]
        else:
            value = entry[scopes[0]]
            names = value if isinstance(value, list) else [value]
            for name in names:
                checked = errors.run(_name, name, _join(path, scopes[0]))
                if checked is None:
                    continue
                if scopes[0].startswith('user'):
                    targets.append(('defaults', None) if checked in ('*', 'all') else ('users', checked))
                else:
                    targets.append(('groups', checked))
        for kind, name in targets:
            block = out['defaults'] if kind == 'defaults' else out[kind].setdefault(name, {})
            _merge_into(block, limits, path, errors)
    return out


# ---------------------------------------------------------------------------- gpu-kill
def from_gpukill(data, errors, notes):
    """Translate a gpu-kill guard configuration (guard_mode_config.toml, or its JSON/YAML form) into
    this schema.  Every field gpu-kill documents is accepted; the ones that have no meaning here are
    listed in ``notes``."""
    out = {'defaults': {}, 'users': {}, 'groups': {}, 'gpus': {}, 'time_windows': []}

    def note(text):
        if text not in notes:
            notes.append(text)

    def number(value, path, what='a number, 0 or more'):
        if not _is_number(value) or math.isnan(value) or value < 0:
            raise _Bad(path, value, 'expected %s' % what)
        return value

    def section(name):
        value = data.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            errors.add(name, value, 'expected a table (mapping)')
            return {}
        return value

    glob = section('global')
    enforcement = section('enforcement')
    errors.run(_only, glob, 'global', ('enabled', 'default_memory_limit_gb', 'default_utilization_limit_pct',
                                       'default_duration_limit_hours', 'check_interval_seconds', 'dry_run'))
    errors.run(_only, enforcement, 'enforcement', ('soft_enforcement', 'hard_enforcement', 'grace_period_seconds', 'max_warnings',
                                                   'notifications'))
    if 'enabled' in glob:
        out['enabled'] = errors.run(_bool, glob['enabled'], 'global.enabled')
    dry_run = errors.run(_bool, glob.get('dry_run', True), 'global.dry_run')
    hard = errors.run(_bool, enforcement.get('hard_enforcement', False), 'enforcement.hard_enforcement')
    soft = errors.run(_bool, enforcement.get('soft_enforcement', True), 'enforcement.soft_enforcement')
    out['mode'] = 'dry-run' if dry_run is not False else ('enforce' if hard else 'warn')
    if dry_run is False and not hard and soft is False:
        note('enforcement: soft and hard enforcement are both off: violations are only logged (mode warn sends warnings)')
    if glob:
        # gpu-kill gives users without a policy the global defaults and a cap of 5 processes
        if glob.get('default_memory_limit_gb') is not None:
            out['defaults']['max_mem_gib_total'] = errors.run(number, glob['default_memory_limit_gb'], 'global.default_memory_limit_gb')
        if glob.get('default_duration_limit_hours') is not None:
            out['defaults']['max_runtime_h'] = errors.run(number, glob['default_duration_limit_hours'], 'global.default_duration_limit_hours')
        out['defaults']['max_procs'] = 5
        if 'default_utilization_limit_pct' in glob:
            note('global.default_utilization_limit_pct is accepted but not enforced (gpu-kill computed it from memory, '
                 'which the memory limit covers)')
    if glob.get('check_interval_seconds') is not None:
        seconds = errors.run(number, glob['check_interval_seconds'], 'global.check_interval_seconds')
        if seconds:
            out['interval'] = '%ss' % seconds
    if 'grace_period_seconds' in enforcement or 'max_warnings' in enforcement:
        grace = errors.run(number, enforcement.get('grace_period_seconds', 300), 'enforcement.grace_period_seconds')
        warnings = errors.run(_count, enforcement.get('max_warnings', 3), 'enforcement.max_warnings')
        if grace is not None and warnings is not None:
            out['escalation'] = {'act_after': '%ss' % grace, 'warnings': min(warnings, 100)}
    notif = enforcement.get('notifications')
    if notif is not None:
        if errors.run(_dict, notif, 'enforcement.notifications') is None:
            notif = {}
        errors.run(_only, notif, 'enforcement.notifications', ('console', 'log_file', 'email', 'email_recipients', 'webhook', 'webhook_url'))
        hook = {}
        if notif.get('webhook') and notif.get('webhook_url'):
            hook = {'webhook': {'url': notif['webhook_url']}}
        out['notify'] = dict(hook, tty=errors.run(_bool, notif.get('console', True), 'enforcement.notifications.console') is not False)
        if notif.get('email'):
            note('enforcement.notifications.email is not supported: use the webhook or the command hook')
        if notif.get('log_file') is False:
            note('enforcement.notifications.log_file=false is ignored: every decision is always logged')

    def entries(name, keys, name_field):
        """The valid (key, table, path) of a gpu-kill section; the others become errors."""
        for key, block in section(name).items():
            path = _join(name, key)
            if not isinstance(block, dict):
                errors.add(path, block, 'expected a table (mapping)')
                continue
            errors.run(_only, block, path, keys + (name_field,))  # the other fields are checked as well
            if block.get(name_field) is not None and str(block[name_field]) != str(key):
                errors.add(_join(path, name_field), block[name_field], 'the %s must be the table name (%s)' % (name_field, key))
                continue
            yield key, block, path

    def copy_fields(block, path, fields, target):
        """gpu-kill field -> our key; numbers are checked here so that errors name the gpu-kill path."""
        for field, ours, is_number in fields:
            value = block.get(field)
            if value is None or (not is_number and value == []):
                continue
            target[ours] = errors.run(number, value, _join(path, field)) if is_number else value
        return target

    def ignored(block, fields, section_name):
        for field, why in fields:
            if field in block:
                note('%s.*.%s is accepted but %s' % (section_name, field, why))

    for name, block, path in entries('user_policies', ('memory_limit_gb', 'utilization_limit_pct', 'duration_limit_hours',
                                                       'max_concurrent_processes', 'priority', 'allowed_gpus', 'blocked_gpus',
                                                       'time_overrides'), 'username'):
        out['users'][name] = copy_fields(block, path, (('memory_limit_gb', 'max_mem_gib_total', True),
                                                       ('duration_limit_hours', 'max_runtime_h', True),
                                                       ('max_concurrent_processes', 'max_procs', False),
                                                       ('allowed_gpus', 'allowed_gpus', False),
                                                       ('blocked_gpus', 'blocked_gpus', False)), {})
        ignored(block, (('utilization_limit_pct', 'not enforced'), ('priority', 'has no effect')), 'user_policies')
        for index, item in enumerate(block.get('time_overrides') or []):
            sub = '%s[%d]' % (_join(path, 'time_overrides'), index)
            window = errors.run(_gk_window, item, sub, ('start_time', 'end_time', 'days_of_week', 'overrides'))
            if window is None:
                continue
            over = item.get('overrides') or {}
            if not isinstance(over, dict):
                errors.add(_join(sub, 'overrides'), over, 'expected a table (mapping)')
                continue
            window['users'] = [name]
            window['limits'] = errors.run(_gk_limits, over, _join(sub, 'overrides')) or {}
            if window['limits']:
                out['time_windows'].append(window)
    for name, block, path in entries('group_policies', ('total_memory_limit_gb', 'total_utilization_limit_pct',
                                                        'max_concurrent_processes', 'priority', 'allowed_gpus', 'blocked_gpus',
                                                        'members'), 'group_name'):
        out['groups'][name] = copy_fields(block, path, (('total_memory_limit_gb', 'group_max_mem_gib_total', True),
                                                        ('max_concurrent_processes', 'group_max_procs', False),
                                                        ('allowed_gpus', 'allowed_gpus', False),
                                                        ('blocked_gpus', 'blocked_gpus', False)),
                                          {'members': block.get('members') or []})
        ignored(block, (('total_utilization_limit_pct', 'not enforced'), ('priority', 'has no effect')), 'group_policies')
    for key, block, path in entries('gpu_policies', ('max_memory_gb', 'max_utilization_pct', 'reserved_memory_gb',
                                                     'allowed_users', 'blocked_users', 'maintenance_window'), 'gpu_index'):
        if not re.match(r'^\d+$', str(key)):
            errors.add(path, key, 'gpu-kill GPU policies are keyed by the GPU index')
            continue
        gpu = copy_fields(block, path, (('allowed_users', 'reserved_for', False), ('blocked_users', 'blocked_users', False)), {})
        if block.get('max_memory_gb') is not None:
            limit = errors.run(number, block['max_memory_gb'], _join(path, 'max_memory_gb'))
            reserved = errors.run(number, block.get('reserved_memory_gb') or 0, _join(path, 'reserved_memory_gb'))
            if limit is not None and reserved is not None:
                gpu['max_mem_gib_total'] = max(0.0, limit - reserved)
        if block.get('maintenance_window') is not None:
            window = errors.run(_gk_window, block['maintenance_window'], _join(path, 'maintenance_window'),
                                ('start_time', 'end_time', 'days_of_week', 'message'))
            if window is not None:
                gpu['maintenance'] = [window]
        ignored(block, (('max_utilization_pct', 'not enforced'),), 'gpu_policies')
        out['gpus'][str(key)] = gpu
    policies = data.get('time_policies')
    if policies is not None:
        if not isinstance(policies, list):
            errors.add('time_policies', policies, 'expected an array of tables')
            policies = []
        for index, item in enumerate(policies):
            sub = 'time_policies[%d]' % index
            keys = ('name', 'start_time', 'end_time', 'days_of_week', 'memory_multiplier', 'utilization_multiplier',
                    'duration_multiplier', 'memory_limit_gb', 'utilization_limit_pct', 'duration_limit_hours',
                    'max_concurrent_processes')
            window = errors.run(_gk_window, item, sub, keys)
            if window is None:
                continue
            if item.get('name') is not None:
                window['name'] = item['name']
            multipliers = {}
            if item.get('memory_multiplier') is not None:
                multipliers['mem'] = item['memory_multiplier']
            if item.get('duration_multiplier') is not None:
                multipliers['runtime'] = item['duration_multiplier']
            if item.get('utilization_multiplier') is not None or item.get('utilization_limit_pct') is not None:
                note('time_policies: utilization settings are accepted but not enforced')
            limits = errors.run(_gk_limits, item, sub) or {}
            if multipliers:
                window['multipliers'] = multipliers
            if limits:
                window['limits'] = limits
            if multipliers or limits:
                out['time_windows'].append(window)
    if not out['time_windows']:
        out.pop('time_windows')
    return out


def _gk_window(item, path, keys):
    _dict(item, path)
    errors = _Errors()
    errors.run(_only, item, path, keys)
    if 'start_time' not in item or 'end_time' not in item:
        errors.add(path, item, 'a gpu-kill window needs start_time and end_time ("HH:MM", UTC)')
    errors.check()
    days = item.get('days_of_week')
    window = {'start': item['start_time'], 'end': item['end_time'], 'tz': 'UTC'}
    if days:
        window['days'] = days
    if item.get('message'):
        window['name'] = item['message']
    # validate now, so that errors name the gpu-kill path
    _window(dict(window), path)
    return window


def _gk_limits(item, path):
    limits = {}
    if item.get('memory_limit_gb') is not None:
        limits['max_mem_gib_total'] = item['memory_limit_gb']
    if item.get('duration_limit_hours') is not None:
        limits['max_runtime_h'] = item['duration_limit_hours']
    if item.get('max_concurrent_processes') is not None:
        limits['max_procs'] = item['max_concurrent_processes']
    _limits(limits, path)
    return limits


# ---------------------------------------------------------------------------- loading
def _node_extent(node, extents):
    """(nesting, nodes) of a composed YAML node whose children are in ``extents`` ({id: (node, nesting, nodes)})."""
    if isinstance(node.value, list):
        children = [n for item in node.value for n in (item if isinstance(item, tuple) else (item,))]
        known = [extents.get(id(child)) for child in children]
        if any(extent is None for extent in known):
            return None
        return 1 + max([extent[1] for extent in known] or [0]), 1 + sum(extent[2] for extent in known)
    return 0, 1


def _strict_yaml_loader():
    """A SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one), nesting past
    MAX_NESTING and aliases that expand past MAX_ALIAS_NODES (a "billion laughs" document): it
    counts while it composes, before anything is built, so a small bomb costs a small effort."""
    yaml = yaml_module()

    class StrictLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
        def __init__(self, stream):
            yaml.SafeLoader.__init__(self, stream)
            self.open_nodes = 0        # the nodes being composed around the current one
            self.extents = {}          # id(node) -> (node, nesting, nodes once aliases are expanded)
            self.alias_nodes = 0       # nodes the aliases added so far

        def compose_node(self, parent, index):
            alias = self.check_event(yaml.AliasEvent)
            line = self.peek_event().start_mark.line + 1
            if self.open_nodes > MAX_NESTING:
                raise DocumentLimitError(_too_deep(), line)
            self.open_nodes += 1
            try:
                node = yaml.SafeLoader.compose_node(self, parent, index)
            finally:
                self.open_nodes -= 1
            known = self.extents.get(id(node))
            if known is None:
                extent = None if alias else _node_extent(node, self.extents)
                if extent is None:
                    raise DocumentLimitError('an alias refers to the node that contains it (a recursive alias)', line)
                known = self.extents[id(node)] = (node,) + extent
            elif alias:
                self.alias_nodes += known[2]
                if self.alias_nodes > MAX_ALIAS_NODES:
                    raise DocumentLimitError('aliases expand to more than %d nodes (the limit)' % MAX_ALIAS_NODES, line)
            if self.open_nodes + known[1] > MAX_NESTING:
                raise DocumentLimitError(_too_deep(), line)
            return node

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        seen = {}
        for key_node, _value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, 'a mapping key must be a plain value', key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, 'duplicate key %r (also on line %d)' % (
                    key, seen[key] + 1), key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


_LOADER = []


def yaml_loader():
    """The loader class for every YAML document the agent reads (policy, settings, rogue rules):
    strict and limited (see _strict_yaml_loader).  None without PyYAML."""
    if not _LOADER:
        _LOADER.append(_strict_yaml_loader() if yaml_module() is not None else None)
    return _LOADER[0]


def _read_document(text, source):
    """(data, lines) of ``text``: the parser the file's extension names (.yaml/.yml, .json, .toml);
    unnamed input (stdin, text) is sniffed: YAML (or JSON) first, TOML when that yields no mapping
    or list.  ``lines`` maps paths to lines (YAML only; {} otherwise)."""
    fmt = document_format(source)
    if fmt == 'json':
        return _read_json(text, source), {}
    if fmt == 'toml':
        return _read_toml(text, source), {}
    if fmt == 'yaml':
        if yaml_module() is None:  # JSON is YAML: read it without PyYAML
            try:
                return _read_json(text, source), {}
            except PolicyError as exc:
                if exc.lines[0] is None:
                    raise  # nested too deep
                why = ('reading YAML needs PyYAML (python3-yaml), and this is not JSON either (%s): '
                       'install PyYAML, or write the document in JSON' % exc.errors[0][2])
                raise PolicyError([('', None, why)], source)
        return _read_yaml(text, source)
    return _sniffed(text, source)[1:]


def _sniffed(text, source):
    """('yaml'|'json'|'toml', data, lines) of unnamed input: YAML (or, without PyYAML, JSON) first,
    TOML when that fails on a document that looks like TOML, or yields no mapping or list."""
    try:
        if yaml_module() is not None:
            data, lines = _read_yaml(text, source)
            syntax = 'yaml'
        else:
            data, lines, syntax = _read_json(text, source), {}, 'json'
    except PolicyError:
        if not _looks_like_toml(text):
            raise
        return 'toml', _read_toml(text, source), {}
    if data is None or isinstance(data, (dict, list)):
        return syntax, data, lines
    try:
        return 'toml', _read_toml(text, source), {}
    except PolicyError:
        raise PolicyError([('', _show(data), 'a policy is a mapping (or a list of shorthand rules), got %s' % _type(data))], source)


def document_syntax(text, source):
    """'yaml', 'json' or 'toml': the parser that reads ``text`` (the extension of ``source``, else the
    one that sniffing picks, as the loaders do).  Raises PolicyError when none reads it."""
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    return document_format(source) or _sniffed(text, source)[0]


def document_format(source):
    """'yaml', 'json' or 'toml' from the extension of ``source`` (a file name); None for unnamed input."""
    ext = os.path.splitext(source or '')[1].lower()
    return {'.yaml': 'yaml', '.yml': 'yaml', '.json': 'json', '.toml': 'toml'}.get(ext)


def _looks_like_toml(text):
    """True when the first line that says something is a TOML table header or a ``key = value``."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith('#'):
            return bool(re.match(r'^(\[\[?\s*[A-Za-z0-9_."\' -]+\]\]?\s*(#.*)?|[A-Za-z0-9_."\'-]+\s*=.*)$', line))
    return False


def _syntax_error(fmt, line, column, why):
    return 'line %d, column %d: %s syntax error: %s' % (line, column, fmt, why)


def _read_yaml(text, source):
    yaml = yaml_module()
    try:
        loader = yaml_loader()(text)  # a SafeLoader subclass
    except yaml.YAMLError as exc:  # pragma: no cover - the reader fails on bytes it cannot decode
        raise PolicyError([('', None, 'YAML error: %s' % str(exc).replace('\n', ' '))], source)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except DocumentLimitError as exc:
        raise PolicyError([('', None, str(exc), exc.line)], source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        why = exc.problem or exc.context or str(exc)
        if mark is None:
            raise PolicyError([('', None, 'YAML syntax error: %s' % why)], source)
        raise PolicyError([('', None, _syntax_error('YAML', mark.line + 1, mark.column + 1, why), mark.line + 1)], source)
    except yaml.YAMLError as exc:
        raise PolicyError([('', None, 'YAML error: %s' % str(exc).replace('\n', ' '))], source)
    except RecursionError:
        raise PolicyError([('', None, _too_deep())], source)
    except (ValueError, TypeError, OverflowError) as exc:
        raise PolicyError([('', None, 'cannot read the YAML document: %s' % exc)], source)
    finally:
        loader.dispose()
    return _plain(data), _node_lines(node)


def _node_lines(root):
    """{path: line} of every mapping key and list item in a composed YAML node tree (paths as the
    validators write them; a top-level list is the shorthand ``rules``).  Iterative, each node once."""
    lines = {}
    if root is None:
        return lines
    seen = set()
    pending = [(root, 'rules' if isinstance(root.value, list) and root.value and not isinstance(root.value[0], tuple) else '')]
    while pending:
        node, path = pending.pop()
        if id(node) in seen or not isinstance(node.value, list):
            continue
        seen.add(id(node))
        for index, item in enumerate(node.value):
            if isinstance(item, tuple):
                key, child = item
                if not isinstance(key.value, str):
                    continue
                sub = _join(path, key.value)
            else:
                key = child = item
                sub = '%s[%d]' % (path, index)
            lines.setdefault(sub, key.start_mark.line + 1)
            pending.append((child, sub))
    return lines


def _unique_pairs(pairs):
    """object_pairs_hook for JSON: a key given twice is an error (as in YAML), not silently the last."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError('duplicate key %r' % key)
        out[key] = value
    return out


def _read_json(text, source):
    if not text.strip():
        return None
    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise PolicyError([('', None, _too_deep())], source)
    except json.JSONDecodeError as exc:
        raise PolicyError([('', None, _syntax_error('JSON', exc.lineno, exc.colno, exc.msg), exc.lineno)], source)
    except ValueError as exc:
        raise PolicyError([('', None, 'invalid JSON: %s' % exc)], source)
    return data


_TOML = []
TOML_MISSING = ('reading TOML needs Python 3.11+ (tomllib) or the tomli package: install tomli, '
                'or write the policy in YAML')


def toml_module():
    """tomllib (Python 3.11+), else tomli (the same parser for older Pythons), else None."""
    if not _TOML:
        try:
            import tomllib as toml  # pylint: disable=import-outside-toplevel
        except ImportError:
            try:
                import tomli as toml  # pylint: disable=import-outside-toplevel
            except ImportError:
                toml = None
        _TOML.append(toml)
    return _TOML[0]


def _read_toml(text, source):
    toml = toml_module()
    if toml is None:
        raise PolicyError([('', None, TOML_MISSING)], source)
    try:
        return _plain(toml.loads(text))
    except toml.TOMLDecodeError as exc:
        message = str(exc)
        found = re.search(r'^(.*?)\s*\(at line (\d+), column (\d+)\)$', message)
        if found:
            line = int(found.group(2))
            why = found.group(1)
            if re.search(r'=\s*null\s*(#.*)?$', (text.splitlines()[line - 1:line] or [''])[0]):
                why += ' (TOML has no null: leave the key out)'
            raise PolicyError([('', None, _syntax_error('TOML', line, int(found.group(3)), why), line)], source)
        raise PolicyError([('', None, 'TOML syntax error: %s' % message)], source)
    except RecursionError:
        raise PolicyError([('', None, _too_deep())], source)


def _plain(data, depth=0):
    """Dates and times as ISO text (what every date field accepts), so a document survives JSON."""
    if depth > 200:
        return data
    if isinstance(data, dict):
        return dict((k, _plain(v, depth + 1)) for k, v in data.items())
    if isinstance(data, list):
        return [_plain(v, depth + 1) for v in data]
    if isinstance(data, (datetime.date, datetime.datetime, datetime.time)):
        return data.isoformat()
    return data


def read_document(text, source='<policy>'):
    """The document in ``text`` (YAML, JSON or TOML, by the extension of ``source``) as plain data,
    not yet validated.  Raises PolicyError."""
    return read_document_lines(text, source)[0]


def read_document_lines(text, source='<policy>', what='policy'):
    """(data, {path: line}) of ``text``: read_document, with the line of each path (YAML only).
    ``what`` the document is (policy, settings) names the field of its PolicyError."""
    try:
        return _read_document_lines(text, source)
    except PolicyError as exc:
        if what != 'policy' and exc.field == 'policy':
            exc.field = what
        raise


def _read_document_lines(text, source):
    if isinstance(text, bytes):
        try:
            text = text.decode('utf-8')
        except UnicodeDecodeError as exc:
            raise PolicyError([('', None, 'the file is not UTF-8 text: %s' % exc)], source)
    if not isinstance(text, str):
        raise PolicyError([('', None, 'expected text')], source)
    if len(text) > MAX_POLICY_BYTES:
        raise PolicyError([('', None, 'the document is larger than %d bytes' % MAX_POLICY_BYTES)], source)
    data, lines = _read_document(text, source)
    try:
        check_nesting(data)
    except DocumentLimitError as exc:
        raise PolicyError([('', None, str(exc))], source)
    return data, lines


def json_pure(data):
    """True when ``data`` comes back unchanged from JSON (so it may be cached as JSON)."""
    try:
        return json.loads(json.dumps(data, allow_nan=False)) == data
    except (TypeError, ValueError, RecursionError):
        return False


def _cannot_read(exc, path):
    return PolicyError([('', None, 'cannot read the policy: %s' % (exc.strerror or exc))], path)


def load_policy_cached(path, cache):
    """``load_policy(path)`` through ``cache`` (a dict kept by the caller, e.g. in the agent's state):
    when the file's SHA-256 matches the cached one, the cached document is validated again without
    reading YAML.  The cache is updated.  Raises PolicyError.  The agent's loader: the file is read
    without following a link, checked on its descriptor and parsed from those bytes (safe_files)."""
    try:
        raw = safe_files.read_file(path, MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise _cannot_read(exc, path)
    digest = hashlib.sha256(raw).hexdigest()
    lines = None
    if isinstance(cache, dict) and cache.get('sha256') == digest and 'document' in cache:
        data = cache['document']
    else:
        data, lines = read_document_lines(raw, path)
        if isinstance(cache, dict):
            cache.clear()
            if json_pure(data):
                cache.update(sha256=digest, document=data)
    try:
        policy = parse_policy(data, path)
    except PolicyError as exc:
        exc.add_lines(lines if lines is not None else read_document_lines(raw, path)[1])
        raise
    policy.sha256 = digest
    return policy


def load_policy_text(text, source='<policy>'):
    """Parse and validate a policy document -> Policy (``sha256`` of the text is recorded)."""
    data, lines = read_document_lines(text, source)
    try:
        policy = parse_policy(data, source)
    except PolicyError as exc:
        exc.add_lines(lines)
        raise
    policy.sha256 = hashlib.sha256(text.encode('utf-8') if isinstance(text, str) else text).hexdigest()
    return policy


def load_policy(path=DEFAULT_PATH):
    """Read and validate the policy file at ``path``.  Raises PolicyError (also for a missing file)."""
    try:
        with open(path, 'rb') as handle:
            raw = handle.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise _cannot_read(exc, path)
    return load_policy_text(raw, path)


# ============================================================================ context
class Context(object):
    """What evaluation needs besides the snapshot, as plain data or live lookups.

    groups: {user: [group names]} (None: the host's Unix groups).  scheduler: 'slurm', 'kubernetes'
    or None (the node allocates GPUs through them; 'auto' detects slurmd/kubelet).  allocations:
    {gpu index: set of owner ids ('slurm:<job>' or 'pod:<uid>')} or None when unknown.
    rogue_findings: {pid: finding} from core.rogue, or None.  exe_hashes: {pid: sha256} (None: hash
    /proc/PID/exe through ``exe_cache``, an exe_hash.ExeHashes, when an exemption asks for a hash).
    """

    def __init__(self, groups=None, scheduler=None, allocations=None, rogue_findings=None, exe_hashes=None,
                 proc_root='/proc', exe_cache=None):
        self._groups = groups
        self._group_cache = {}
        self.scheduler = scheduler
        self.allocations = allocations
        self.rogue_findings = rogue_findings
        self._exe_hashes = exe_hashes
        self.exe_cache = exe_cache if exe_cache is not None else ExeHashes(proc_root=proc_root)
        self.proc_root = proc_root
        if scheduler == 'auto':
            self.scheduler = detect_scheduler(proc_root)

    def groups_of(self, user):
        if user is None:
            return ()
        if self._groups is not None:
            return tuple(self._groups.get(user, ()))
        if user not in self._group_cache:
            self._group_cache[user] = _unix_groups(user)
        return self._group_cache[user]

    def exe_sha256(self, proc):
        if self._exe_hashes is not None:
            return self._exe_hashes.get(proc.pid)
        return self.exe_cache.sha256(proc.pid, proc.starttime)


_ALL_GROUPS = None


def _unix_groups(user):
    global _ALL_GROUPS  # pylint: disable=global-statement
    names = []
    try:
        import grp  # pylint: disable=import-outside-toplevel
        import pwd  # pylint: disable=import-outside-toplevel
    except ImportError:
        return ()
    try:
        gid = pwd.getpwnam(user).pw_gid
        names.append(grp.getgrgid(gid).gr_name)
    except (KeyError, OverflowError):
        pass
    if _ALL_GROUPS is None:
        try:
            _ALL_GROUPS = [(g.gr_name, frozenset(g.gr_mem)) for g in grp.getgrall()]
        except OSError:
            _ALL_GROUPS = []
    names.extend(name for name, members in _ALL_GROUPS if user in members and name not in names)
    return tuple(names)


def detect_scheduler(proc_root='/proc'):
    """'slurm' or 'kubernetes' when root runs slurmd or kubelet here (never a name alone: processes.scheduler_daemon), else None."""
    return {'slurmd': 'slurm', 'kubelet': 'kubernetes'}.get(scheduler_daemon(proc_root))


MAX_ALLOCATIONS_BYTES = 16 * 1024 * 1024


def read_allocations(path):
    """``{gpu index: set of owners}`` from an allocations file written by a Slurm prolog or a device
    plugin hook: ``{"gpus": {"0": ["slurm:123"], "1": ["pod:<uid>"]}}``.  None when absent, unreadable or
    unsafe (a link, or a file or directory someone else than root could change: safe_files)."""
    try:
        data = json.loads(safe_files.read_file(path, MAX_ALLOCATIONS_BYTES).decode('utf-8'))
        gpus = data.get('gpus') if isinstance(data, dict) else None
        if not isinstance(gpus, dict):
            return None
        out = {}
        for key, owners in gpus.items():
            if re.match(r'^\d+$', str(key)) and isinstance(owners, list):
                out[int(key)] = set(str(o) for o in owners)
        return out
    except (OSError, ValueError):
        return None


# ============================================================================ violations
class Violation(object):
    """One broken rule.  ``pids`` are the processes an action would end (``procs`` describes them,
    with the starttime that identifies each); ``measured`` and ``limit`` are in ``unit``."""

    def __init__(self, rule, subject, measured, limit, action, pids, user=None, gpu=None, unit='', message='',
                 procs=None, key=None, kind='quota', grace=None):
        self.rule = rule
        self.subject = subject
        self.measured = measured
        self.limit = limit
        self.action = action
        self.pids = list(pids)
        self.user = user
        self.gpu = gpu
        self.unit = unit
        self.message = message
        self.procs = list(procs or [])
        self.kind = kind
        self.grace = grace            # overrides the escalation's act_at (rogue)
        self.key = key or self._key()

    def _key(self):
        parts = [self.rule, self.subject]
        if self.gpu is not None:
            parts.append('gpu:%s' % self.gpu)
        if self.rule in PER_PROCESS_RULES and self.procs:
            parts.append('%s:%s' % (self.procs[0]['pid'], self.procs[0].get('starttime')))
        return '|'.join(str(p) for p in parts)

    def to_dict(self):
        return {'rule': self.rule, 'subject': self.subject, 'measured': self.measured, 'limit': self.limit,
                'unit': self.unit, 'action': self.action, 'pids': list(self.pids), 'user': self.user, 'gpu': self.gpu,
                'message': self.message, 'procs': [dict(p) for p in self.procs], 'key': self.key, 'kind': self.kind}

    def __repr__(self):
        return 'Violation(%s %s %s>%s pids=%s)' % (self.rule, self.subject, self.measured, self.limit, self.pids)


def proc_key(proc):
    return '%d:%s' % (proc.pid, proc.starttime)


def _describe(proc, gpu=None):
    used = proc.used_mib if gpu is None else proc.used_mib_by_gpu.get(gpu)
    return {'pid': proc.pid, 'starttime': proc.starttime, 'user': proc.user, 'uid': proc.uid, 'name': proc.name,
            'cmdline': list(proc.cmdline or [])[:64], 'used_mib': used, 'gpu_indexes': list(proc.gpu_indexes or []),
            'create_time': proc.create_time}


def _mib(proc, gpu=None):
    if gpu is None:
        known = [v for v in (proc.used_mib_by_gpu or {}).values() if v is not None]
        return sum(known) if known else (proc.used_mib or 0)
    return proc.used_mib_by_gpu.get(gpu) or 0


def _order(items):
    """Largest first (like the OOM killer); ties: the newest process first, then the higher pid."""
    return sorted(items, key=lambda item: (-item[1], -(item[0].create_time or 0.0), -item[0].pid))


def fewest_by_size(items, limit):
    """``items``: [(proc, size)].  The fewest processes whose removal brings the total to <= limit,
    largest first (ties: newest).  Taking the largest first is also the smallest such set."""
    total = sum(size for _proc, size in items)
    chosen = []
    for proc, size in _order(items):
        if total <= limit:
            break
        if size <= 0:
            break
        chosen.append(proc)
        total -= size
    return chosen


def fewest_by_count(items, limit):
    """Enough processes (largest first, ties newest) to leave at most ``limit`` of them."""
    excess = len(items) - limit
    return [proc for proc, _size in _order(items)[:max(0, excess)]]


def fewest_for_gpus(procs, gpus_of, limit, size_of):
    """The fewest processes whose end leaves the user on at most ``limit`` GPUs.

    A GPU is freed only when every process on it ends.  Exact for up to 16 GPUs (fewest processes,
    then the most memory freed, then the newest); greedy beyond.
    """
    held = sorted(set(g for p in procs for g in gpus_of(p)))
    excess = len(held) - limit
    if excess <= 0:
        return []
    # every process's size, creation time and GPUs once: the exact search below tries up to
    # C(16, 8) subsets of GPUs, and each subset only unites precomputed pid sets
    by_pid = dict((p.pid, p) for p in procs)
    size = dict((p.pid, size_of(p)) for p in procs)
    created = dict((p.pid, p.create_time or 0.0) for p in procs)
    gpus = dict((p.pid, gpus_of(p)) for p in procs)
    on = dict((g, frozenset(pid for pid in by_pid if g in gpus[pid])) for g in held)

    def cost(subset):
        pids = frozenset().union(*[on[gpu] for gpu in subset])
        freed = sum(size[pid] for pid in pids)
        newest = max([created[pid] for pid in pids] or [0.0])
        return (len(pids), -freed, -newest), pids

    best = None
    combos = itertools.combinations(held, excess)
    if len(held) <= 16:
        for subset in combos:
            score, pids = cost(subset)
            if best is None or score < best[0]:
                best = (score, pids)
    else:
        remaining = list(held)
        subset = []
        for _step in range(excess):
            remaining.sort(key=lambda g: (len(on[g]), -sum(size[pid] for pid in on[g])))
            subset.append(remaining.pop(0))
        best = cost(subset)
    return [proc for proc, _size in _order([(by_pid[pid], size[pid]) for pid in best[1]])]


def _gpus_of(proc):
    return list(proc.gpu_indexes or [])


def _fmt_mib(value, other=None):
    """A size for people; with ``other`` (the size it is compared with), precise enough to show that
    they differ (19.5 GiB against 19.5 GiB would hide it: then MiB, or MiB with decimals)."""
    if value is None:
        return 'unknown'
    text = '%.1f GiB' % (value / 1024.0) if value >= 1024 else '%d MiB' % value
    if other is None or value == other or text != _fmt_mib(other):
        return text
    for digits in (0, 3):
        text = '%.*f MiB' % (digits, value)
        if text != '%.*f MiB' % (digits, other):
            return text
    return text


def _human_s(seconds):
    seconds = int(seconds)
    if seconds >= 86400:
        return '%dd%02dh' % (seconds // 86400, seconds % 86400 // 3600)
    if seconds >= 3600:
        return '%dh%02dm' % (seconds // 3600, seconds % 3600 // 60)
    if seconds >= 60:
        return '%dm%02ds' % (seconds // 60, seconds % 60)
    return '%ds' % seconds


class _Eval(object):
    """The state of one evaluation (caches for limits and exemptions)."""

    def __init__(self, policy, snapshot, state, now, context):
        self.policy = policy
        self.snapshot = snapshot
        self.state = state or {}
        self.now = now
        self.context = context
        self.exemptions = policy.active_exemptions(now)
        self._limits = {}
        self.notes = []

    def limits(self, user):
        if user not in self._limits:
            self._limits[user] = self.policy.limits_for(user, self.now, self.context)
        return self._limits[user]

    def exempt(self, proc, rule):
        for exemption in self.exemptions:
            if exemption.applies(proc, rule, self.context):
                return True
        return False

    def eligible(self, procs, rule):
        return [p for p in procs if not self.exempt(p, rule)]


def evaluate(policy, snapshot, state, now, context=None):
    """The violations of ``policy`` in ``snapshot`` at ``now`` (a list of Violation).  Pure."""
    return evaluate_detailed(policy, snapshot, state, now, context)[0]


def evaluate_detailed(policy, snapshot, state, now, context=None):
    """(violations, notes): notes explain what was left out (protected, unknown owner, ...)."""
    context = context if context is not None else Context()
    run = _Eval(policy, snapshot, state, now, context)
    if not policy.enabled:
        return [], ['the policy is disabled (enabled: false)']
    quota = []
    for proc in snapshot.processes:
        if not proc.found:
            run.notes.append('pid %d: not visible here; quota rules skip it' % proc.pid)
            continue
        if proc.user is None:
            # Never skipped: an owner that cannot be read (read twice) is charged to a pseudo-owner.
            run.notes.append('pid %d: owner unknown; charged to %s' % (proc.pid, UNKNOWN_OWNER))
            proc = copy.copy(proc)
            proc.user = UNKNOWN_OWNER
        why = policy.protect.reason(proc, policy, context)
        if why is not None:
            run.notes.append('pid %d (%s): %s; quota rules skip it' % (proc.pid, proc.user, why))
            continue
        quota.append(proc)
    by_user = {}
    for proc in quota:
        by_user.setdefault(proc.user, []).append(proc)
    violations = []
    for user in sorted(by_user):
        violations.extend(_user_rules(run, user, by_user[user]))
    violations.extend(_group_rules(run, by_user))
    violations.extend(_gpu_rules(run, quota))
    violations.extend(_rogue_rule(run))
    return violations, run.notes + [note for note in context.exe_cache.notes if note not in run.notes]


def _user_rules(run, user, procs):
    lim = run.limits(user)
    out = []
    action = lim.action
    # memory per GPU
    if lim.max_mem_mib_per_gpu is not None:
        cand = run.eligible(procs, 'max_mem_per_gpu')
        for gpu in sorted(set(g for p in cand for g in _gpus_of(p))):
            items = [(p, _mib(p, gpu)) for p in cand if gpu in _gpus_of(p)]
            total = sum(size for _p, size in items)
            if total > lim.max_mem_mib_per_gpu:
                chosen = fewest_by_size(items, lim.max_mem_mib_per_gpu)
                out.append(Violation('max_mem_per_gpu', 'user:%s' % user, total, lim.max_mem_mib_per_gpu, action,
                                     [p.pid for p in chosen], user=user, gpu=gpu, unit='MiB',
                                     message='%s uses %s on GPU %d, more than the %s allowed per GPU' % (
                                         user, _fmt_mib(total, lim.max_mem_mib_per_gpu), gpu, _fmt_mib(lim.max_mem_mib_per_gpu, total)),
                                     procs=[_describe(p, gpu) for p in chosen]))
    if lim.max_mem_mib_total is not None:
        cand = run.eligible(procs, 'max_mem_total')
        items = [(p, _mib(p)) for p in cand]
        total = sum(size for _p, size in items)
        if total > lim.max_mem_mib_total:
            chosen = fewest_by_size(items, lim.max_mem_mib_total)
            out.append(Violation('max_mem_total', 'user:%s' % user, total, lim.max_mem_mib_total, action,
                                 [p.pid for p in chosen], user=user, unit='MiB',
                                 message='%s uses %s of GPU memory in total, more than the %s allowed' % (
                                     user, _fmt_mib(total, lim.max_mem_mib_total), _fmt_mib(lim.max_mem_mib_total, total)),
                                 procs=[_describe(p) for p in chosen]))
    if lim.max_gpus is not None:
        cand = run.eligible(procs, 'max_gpus')
        held = set(g for p in cand for g in _gpus_of(p))
        if len(held) > lim.max_gpus:
            chosen = fewest_for_gpus(cand, _gpus_of, lim.max_gpus, _mib)
            out.append(Violation('max_gpus', 'user:%s' % user, len(held), lim.max_gpus, action, [p.pid for p in chosen],
                                 user=user, unit='GPUs',
                                 message='%s uses %d GPUs (%s), more than the %d allowed' % (
                                     user, len(held), ','.join(str(g) for g in sorted(held)), lim.max_gpus),
                                 procs=[_describe(p) for p in chosen]))
    if lim.max_procs is not None:
        cand = run.eligible(procs, 'max_procs')
        if len(cand) > lim.max_procs:
            chosen = fewest_by_count([(p, _mib(p)) for p in cand], lim.max_procs)
            out.append(Violation('max_procs', 'user:%s' % user, len(cand), lim.max_procs, action, [p.pid for p in chosen],
                                 user=user, unit='processes',
                                 message='%s runs %d GPU processes, more than the %d allowed' % (user, len(cand), lim.max_procs),
                                 procs=[_describe(p) for p in chosen]))
    if lim.max_procs_per_gpu is not None:
        cand = run.eligible(procs, 'max_procs_per_gpu')
        for gpu in sorted(set(g for p in cand for g in _gpus_of(p))):
            on = [(p, _mib(p, gpu)) for p in cand if gpu in _gpus_of(p)]
            if len(on) > lim.max_procs_per_gpu:
                chosen = fewest_by_count(on, lim.max_procs_per_gpu)
                out.append(Violation('max_procs_per_gpu', 'user:%s' % user, len(on), lim.max_procs_per_gpu, action,
                                     [p.pid for p in chosen], user=user, gpu=gpu, unit='processes',
                                     message='%s runs %d processes on GPU %d, more than the %d allowed' % (
                                         user, len(on), gpu, lim.max_procs_per_gpu),
                                     procs=[_describe(p, gpu) for p in chosen]))
    if lim.max_runtime_s is not None:
        for proc in run.eligible(procs, 'max_runtime'):
            if proc.create_time is None:
                continue
            age = run.now - proc.create_time
            if age > lim.max_runtime_s:
                out.append(Violation('max_runtime', 'user:%s' % user, round(age, 1), lim.max_runtime_s, action, [proc.pid],
                                     user=user, unit='s',
                                     message='%s\'s process %d (%s) has run for %s, longer than the %s allowed' % (
                                         user, proc.pid, proc.name, _human_s(age), _human_s(lim.max_runtime_s)),
                                     procs=[_describe(proc)]))
    if lim.idle is not None:
        clocks = run.state.get('idle') or {}
        for proc in run.eligible(procs, 'idle'):
            clock = clocks.get(proc_key(proc))
            if not isinstance(clock, dict) or not _is_number(clock.get('since')):
                continue
            idle_for = run.now - clock['since']
            if idle_for < lim.idle.for_s:
                continue
            util = process_utilization(proc, run.snapshot)
            used = proc.used_mib
            if util is None or util > lim.idle.util_max_pct or used is None or used < lim.idle.mem_min_mib:
                continue  # the clock is stale: this snapshot shows activity
            out.append(Violation('idle', 'user:%s' % user, round(idle_for, 1), lim.idle.for_s, action, [proc.pid], user=user,
                                 unit='s', message='%s\'s process %d (%s) has held %s at <= %g%% utilization for %s '
                                                   '(idle limit %s)' % (user, proc.pid, proc.name, _fmt_mib(used),
                                                                        lim.idle.util_max_pct, _human_s(idle_for),
                                                                        _human_s(lim.idle.for_s)),
                                 procs=[_describe(proc)]))
    if lim.allowed_gpus is not None or lim.blocked_gpus is not None:
        for proc in run.eligible(procs, 'gpu_access'):
            bad = []
            for gpu in _gpus_of(proc):
                allowed = lim.allowed_gpus is None or lim.allowed_gpus.text == '' or lim.allowed_gpus.contains_index(gpu, run.snapshot)
                blocked = lim.blocked_gpus is not None and lim.blocked_gpus.text != '' and lim.blocked_gpus.contains_index(gpu, run.snapshot)
                if blocked or not allowed:
                    bad.append(gpu)
            if bad:
                out.append(Violation('gpu_access', 'user:%s' % user, bad, (lim.allowed_gpus.text if lim.allowed_gpus else '*'),
                                     action, [proc.pid], user=user, unit='GPUs',
                                     message='%s\'s process %d uses GPU %s, which %s may not use' % (
                                         user, proc.pid, ','.join(str(g) for g in bad), user),
                                     procs=[_describe(proc)]))
    if lim.require_allocation and run.context.scheduler in ('slurm', 'kubernetes'):
        for proc in run.eligible(procs, 'require_allocation'):
            owner = _owner(proc)
            allocations = run.context.allocations
            wrong = []
            if owner is not None and allocations is not None:
                wrong = [g for g in _gpus_of(proc) if g in allocations and owner not in allocations[g]]
            if owner is None or wrong:
                why = ('runs outside any %s' % ('Slurm job' if run.context.scheduler == 'slurm' else 'pod')) if owner is None \
                    else 'uses GPU %s, which is allocated to another job or pod' % ','.join(str(g) for g in wrong)
                out.append(Violation('require_allocation', 'user:%s' % user, owner or 'none', 'allocated', action, [proc.pid],
                                     user=user, unit='', message='%s\'s GPU process %d (%s) %s' % (user, proc.pid, proc.name, why),
                                     procs=[_describe(proc)]))
    return out


def _owner(proc):
    if proc.slurm_job:
        return 'slurm:%s' % proc.slurm_job
    if proc.container is not None and proc.container.pod_uid:
        return 'pod:%s' % proc.container.pod_uid
    return None


def _group_rules(run, by_user):
    out = []
    for group in run.policy.groups:
        if not group.aggregate or (group.expires is not None and run.now >= group.expires):
            continue
        members = [u for u in sorted(by_user) if run.policy.in_group(u, group.name, run.context)]
        procs = [p for u in members for p in by_user[u]]
        action = group.action or run.policy.defaults.get('action') or 'terminate'
        subject = 'group:%s' % group.name
        limit = group.aggregate.get('group_max_mem_mib_total')
        if limit is not None:
            items = [(p, _mib(p)) for p in run.eligible(procs, 'group_max_mem_total')]
            total = sum(s for _p, s in items)
            if total > limit:
                chosen = fewest_by_size(items, limit)
                out.append(Violation('group_max_mem_total', subject, total, limit, action, [p.pid for p in chosen], unit='MiB',
                                     message='group %s uses %s of GPU memory, more than the %s allowed' % (
                                         group.name, _fmt_mib(total, limit), _fmt_mib(limit, total)),
                                     procs=[_describe(p) for p in chosen]))
        limit = group.aggregate.get('group_max_gpus')
        if limit is not None:
            cand = run.eligible(procs, 'group_max_gpus')
            held = set(g for p in cand for g in _gpus_of(p))
            if len(held) > limit:
                chosen = fewest_for_gpus(cand, _gpus_of, limit, _mib)
                out.append(Violation('group_max_gpus', subject, len(held), limit, action, [p.pid for p in chosen], unit='GPUs',
                                     message='group %s uses %d GPUs, more than the %d allowed' % (group.name, len(held), limit),
                                     procs=[_describe(p) for p in chosen]))
        limit = group.aggregate.get('group_max_procs')
        if limit is not None:
            cand = run.eligible(procs, 'group_max_procs')
            if len(cand) > limit:
                chosen = fewest_by_count([(p, _mib(p)) for p in cand], limit)
                out.append(Violation('group_max_procs', subject, len(cand), limit, action, [p.pid for p in chosen],
                                     unit='processes', message='group %s runs %d GPU processes, more than the %d allowed' % (
                                         group.name, len(cand), limit), procs=[_describe(p) for p in chosen]))
    for violation in out:
        users = sorted(set(p['user'] for p in violation.procs))
        violation.user = users[0] if len(users) == 1 else None
    return out


def _gpu_rules(run, quota):
    out = []
    default_action = run.policy.defaults.get('action') or 'terminate'
    for rule in run.policy.gpus:
        devices = [dev for dev in run.snapshot.devices if rule.gpus.contains(dev)]
        action = rule.action or default_action
        for dev in devices:
            gpu = dev.index
            on = [p for p in quota if gpu in _gpus_of(p)]
            active = [w for w in rule.maintenance if w.contains(run.now)]
            if active:
                cand = run.eligible(on, 'maintenance')
                if cand:
                    label = active[0].label or active[0].describe()
                    out.append(Violation('maintenance', 'gpu:%d' % gpu, len(cand), 0, action, [p.pid for p in cand], gpu=gpu,
                                         unit='processes', message='GPU %d is in a maintenance window (%s)%s' % (
                                             gpu, label, ': ' + rule.message if rule.message else ''),
                                         procs=[_describe(p, gpu) for p in cand]))
            for rid, principals, reserved in (('gpu_reserved', rule.reserved_for, True),
                                              ('gpu_blocked_user', rule.blocked_users, False)):
                if principals is None:
                    continue
                by_user = {}
                for proc in run.eligible(on, rid):
                    member = principals.contains(proc.user, run.policy, run.context)
                    if member != reserved:
                        by_user.setdefault(proc.user, []).append(proc)
                for user in sorted(by_user):
                    cand = by_user[user]
                    why = ('reserved for %s' % ', '.join(principals.describe())) if reserved else 'blocked for %s' % user
                    out.append(Violation(rid, 'gpu:%d' % gpu, len(cand), 0, action, [p.pid for p in cand], user=user, gpu=gpu,
                                         unit='processes', message='GPU %d is %s; %s runs %d process(es) on it' % (
                                             gpu, why, user, len(cand)),
                                         procs=[_describe(p, gpu) for p in cand], key='%s|gpu:%d|user:%s' % (rid, gpu, user)))
            if rule.max_mem_mib_total is not None:
                listed = [p for p in run.snapshot.processes if gpu in _gpus_of(p)]
                total = sum(_mib(p, gpu) for p in listed)
                if total > rule.max_mem_mib_total:
                    cand = run.eligible(on, 'gpu_max_mem_total')
                    protected = total - sum(_mib(p, gpu) for p in cand)
                    chosen = fewest_by_size([(p, _mib(p, gpu)) for p in cand], max(0.0, rule.max_mem_mib_total - protected))
                    out.append(Violation('gpu_max_mem_total', 'gpu:%d' % gpu, total, rule.max_mem_mib_total, action,
                                         [p.pid for p in chosen], gpu=gpu, unit='MiB',
                                         message='GPU %d holds %s of process memory, more than the %s allowed on it' % (
                                             gpu, _fmt_mib(total, rule.max_mem_mib_total), _fmt_mib(rule.max_mem_mib_total, total)),
                                         procs=[_describe(p, gpu) for p in chosen]))
    return out


def has_hard_indicator(finding):
    """True when a rogue finding rests on content or network evidence (a 'hard' rule fired)."""
    if not isinstance(finding, dict):
        return False
    for rule in finding.get('rules') or ():
        if isinstance(rule, dict) and rule.get('kind') == 'hard':
            return True
    points = finding.get('points')
    return isinstance(points, dict) and _is_number(points.get('hard')) and points.get('hard') > 0


def _rogue_rule(run):
    rogue = run.policy.rogue
    findings = run.context.rogue_findings
    if not rogue.enabled or not findings:
        return []
    out = []
    want = ROGUE_LEVELS.index(rogue.act_min_level)
    for pid in sorted(findings):
        finding = findings[pid]
        level = finding.get('level') if isinstance(finding, dict) else None
        if level not in ROGUE_LEVELS or ROGUE_LEVELS.index(level) < want or finding.get('allowlisted'):
            continue
        if not has_hard_indicator(finding):
            run.notes.append('pid %s: rogue level %s without a hard indicator: reported, never acted on' % (pid, level))
            continue
        proc = run.snapshot.process(pid)
        if proc is None or not proc.found:
            continue
        if run.exempt(proc, 'rogue'):
            continue
        rules = [r.get('id') for r in finding.get('rules') or () if isinstance(r, dict)]
        out.append(Violation('rogue', 'pid:%d' % pid, finding.get('score'), rogue.act_min_level, rogue.action, [pid],
                             user=proc.user, unit='score', kind='rogue', grace=rogue.grace,
                             message='process %d (%s, user %s) looks like a crypto-miner: level %s, score %s (%s)' % (
                                 pid, proc.name, proc.user, level, finding.get('score'), ', '.join(str(r) for r in rules[:6])),
                             procs=[_describe(proc)]))
    return out


# ============================================================================ idle clocks
def observe(policy, snapshot, state, now, context=None):
    """A copy of ``state`` with the idle clocks advanced by ``snapshot``.

    A process's clock starts when it is first seen at or below its idle utilization while holding at
    least the idle memory; any sample above the threshold, below the memory, with unknown
    utilization, or a gap of more than ``idle_max_gap`` between samples restarts it.
    """
    context = context if context is not None else Context()
    new = copy.deepcopy(state) if isinstance(state, dict) else {}
    old = new.get('idle') if isinstance(new.get('idle'), dict) else {}
    last = new.get('idle_sampled_at')
    gap = not _is_number(last) or now - last > policy.idle_max_gap_s or now < last
    clocks = {}
    limits = {}
    for proc in snapshot.processes:
        if not proc.found or proc.user is None or proc.starttime is None:
            continue
        if proc.user not in limits:
            limits[proc.user] = policy.limits_for(proc.user, now, context)
        rule = limits[proc.user].idle
        if rule is None:
            continue
        util = process_utilization(proc, snapshot)
        used = proc.used_mib
        if util is None or util > rule.util_max_pct or used is None or used < rule.mem_min_mib:
            continue
        key = proc_key(proc)
        previous = old.get(key)
        since = previous.get('since') if isinstance(previous, dict) and not gap else None
        clocks[key] = {'since': since if _is_number(since) and since <= now else now}
    new['idle'] = clocks
    new['idle_sampled_at'] = now
    return new
