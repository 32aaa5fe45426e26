# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Parsers of single values in a policy (sizes, durations, dates, names, actions, modes, regular
expressions, GPU sets, days and time windows).  Each takes ``(value, path)`` and returns the value,
or raises validation._Bad naming the path, the value and the reason."""

from __future__ import annotations

import datetime
import math
import re

from ..constants import ACTIONS, MODES
from ..errors import InvalidArgument
from ..model import MIG_FORM, mig_devices_named
from .. import validation
from ..units import parse_duration, parse_size_mib
from .validation import _Bad, _Errors, _is_number, _join, _only

GIB = 1024.0

DAY_NAMES = ('mon', 'tue', 'wed', 'thu', 'fri', 'sat', 'sun')
_DAY_ALIASES = {'monday': 0, 'tuesday': 1, 'wednesday': 2, 'thursday': 3, 'friday': 4, 'saturday': 5, 'sunday': 6,
                'tues': 1, 'wednes': 2, 'thur': 3, 'thurs': 3}
_DAY_SETS = {'weekdays': (0, 1, 2, 3, 4), 'weekday': (0, 1, 2, 3, 4), 'weekends': (5, 6), 'weekend': (5, 6),
             'daily': tuple(range(7)), 'everyday': tuple(range(7)), 'all': tuple(range(7)), '*': tuple(range(7))}
_HHMM = re.compile(r'^([01]?\d|2[0-4]):([0-5]\d)$')
_OFFSET = re.compile(r'^(?:UTC|GMT)?\s*([+-])(\d{1,2})(?::?(\d{2}))?$', re.IGNORECASE)
_NAME = re.compile(r'^[A-Za-z0-9_.@*][A-Za-z0-9_.@$-]{0,127}$')

# The modes and the actions by name (constants.MODES and constants.ACTIONS, mildest first), and the
# other names a document may give them.
MODE_DRY_RUN, MODE_WARN, MODE_ENFORCE = MODES
ACTION_WARN, ACTION_TERMINATE, ACTION_KILL = ACTIONS
_MODE_NAMES = dict([(name, name) for name in MODES], dry_run=MODE_DRY_RUN, dryrun=MODE_DRY_RUN)
_ACTION_NAMES = dict([(name, name) for name in ACTIONS], notify=ACTION_WARN, log=ACTION_WARN, alert=ACTION_WARN,
                     term=ACTION_TERMINATE, sigterm=ACTION_TERMINATE, sigkill=ACTION_KILL)


_dict = validation.mapping
_bool = validation.boolean


def _section(value, path, keys):
    """The start of a section's parser: ``value`` must be a mapping (else _Bad at once); the returned
    _Errors holds its keys that are not in ``keys``, and collects the section's other failures."""
    _dict(value, path)
    errors = _Errors()
    errors.run(_only, value, path, keys)
    return errors


def _list(value, path):
    if value is None:
        return []
    return validation.sequence(value, path)


def _count(value, path):
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return validation.in_range(value, path, 0, None, True, 'expected a whole number, 0 or more')


def _pct(value, path):
    return float(validation.in_range(value, path, 0, 100, False, 'expected a percentage from 0 to 100'))


def _text(value, path, pattern=None, what='text'):
    validation.text(value, path, 'expected %s' % what)
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
    if isinstance(value, str) and value.strip().lower() in _ACTION_NAMES:
        return _ACTION_NAMES[value.strip().lower()]
    raise _Bad(path, value, 'expected one of warn, terminate (SIGTERM, then SIGKILL) or kill (SIGKILL at once)')


def _mode(value, path):
    if isinstance(value, str) and value.strip().lower() in _MODE_NAMES:
        return _MODE_NAMES[value.strip().lower()]
    raise _Bad(path, value, 'expected one of dry-run, warn or enforce')


def _abs_path(value, path):
    if not isinstance(value, str) or not value.startswith('/'):
        raise _Bad(path, value, 'expected an absolute path')
    return value


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


# ---------------------------------------------------------------------------- GPUs
class GpuSet(object):
    """GPU indexes, ranges and UUIDs as written (``"0-3"``, ``"0,2"``, ``5``, ``"GPU-6f7c..."``, ``"*"``), and MIG devices
    named as the gpu_kill selector names them (``"MIG-..."`` UUIDs, ``"0:1"`` for every compute instance of GPU
    instance 1 of GPU 0, ``"0:1:0"`` for one compute instance: model.mig_devices_named)."""

    def __init__(self, indexes=(), uuids=(), every=False, text='', mig_names=()):
        self.indexes = frozenset(indexes)
        self.uuids = frozenset(u.lower() for u in uuids)
        self.every = every
        self.text = text
        self.mig_names = tuple(mig_names) + tuple(sorted(u for u in self.uuids if u.startswith('mig-')))

    def contains(self, dev):
        if self.every:
            return True
        if dev.index in self.indexes:
            return True
        return dev.uuid is not None and dev.uuid.lower() in self.uuids

    def contains_index(self, index, snapshot=None, mig=None):
        """Whether it names GPU ``index`` (by index, or by UUID given ``snapshot``), or ``mig``, the MigDevice on that GPU
        a process runs on (by its MIG UUID or ``GPU:GI[:CI]``)."""
        if self.every or index in self.indexes:
            return True
        if (self.uuids or self.mig_names) and snapshot is not None:
            dev = snapshot.device(index)
            if dev is None:
                return False
            return self.contains(dev) or (mig is not None and mig in self.mig_devices(dev))
        return False

    def mig_devices(self, dev):
        """The MigDevices of board ``dev`` it names by MIG UUID or ``GPU:GI[:CI]`` (not by naming the board)."""
        out = []
        for name in self.mig_names:
            for mig in mig_devices_named(dev, name) or ():
                if mig not in out:
                    out.append(mig)
        return out

    def __repr__(self):
        return 'GpuSet(%s)' % self.text


_GPU_SET_EXPECTED = 'expected GPU indexes (0, "0-3", "0,2"), UUIDs or MIG devices ("0:1", "0:1:0", "MIG-...")'


def _gpu_set(value, path):
    items = value if isinstance(value, list) else [value]
    indexes, uuids, mig_names, every = set(), set(), [], False
    if isinstance(value, list) and not value:
        return GpuSet(text='')
    for item in items:
        if isinstance(item, bool):
            raise _Bad(path, value, _GPU_SET_EXPECTED)
        if isinstance(item, int):
            if item < 0:
                raise _Bad(path, value, 'a GPU index is 0 or more')
            indexes.add(item)
            continue
        if not isinstance(item, str) or not item.strip():
            raise _Bad(path, value, _GPU_SET_EXPECTED)
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
            elif MIG_FORM.match(part):
                if part not in mig_names:
                    mig_names.append(part)
            elif ':' in part and re.match(r'^[\d\s:]+$', part):
                raise _Bad(path, part, 'a MIG device is GPU:GI or GPU:GI:CI in whole numbers (0:1 is GPU instance 1 of GPU 0, '
                                       '0:1:0 its compute instance 0), or its MIG- UUID')
            elif re.match(r'^MIG-[A-Za-z0-9][A-Za-z0-9_./-]{6,95}$', part, re.IGNORECASE):
                uuids.add(part)  # a MIG device UUID (R470+ ``MIG-<uuid>``; before: ``MIG-GPU-<uuid>/GI/CI``)
            elif re.match(r'^[A-Za-z0-9][A-Za-z0-9:_.-]{7,95}$', part) and not re.match(r'^[\d-]+$', part):
                uuids.add(part)
            else:
                raise _Bad(path, value, _GPU_SET_EXPECTED)
    text = ','.join(str(x) for x in (items if isinstance(value, list) else [value]))
    return GpuSet(indexes, uuids, every, text, mig_names)


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
    errors = _section(value, path, keys)
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
