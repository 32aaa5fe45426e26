# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Parsing of the durations and sizes that users write in module options and policies, and the one
formatter of durations for people (``human_duration``)."""

from __future__ import annotations

import math
import re

from .errors import InvalidArgument

_DURATION_UNITS = {
    '': 1.0, 'ms': 0.001, 's': 1.0, 'sec': 1.0, 'secs': 1.0, 'second': 1.0, 'seconds': 1.0,
    'm': 60.0, 'min': 60.0, 'mins': 60.0, 'minute': 60.0, 'minutes': 60.0,
    'h': 3600.0, 'hr': 3600.0, 'hrs': 3600.0, 'hour': 3600.0, 'hours': 3600.0,
    'd': 86400.0, 'day': 86400.0, 'days': 86400.0, 'w': 604800.0, 'week': 604800.0, 'weeks': 604800.0,
}
_DURATION_PART = re.compile(r'(\d+(?:\.\d+)?)\s*([a-z]*)')

# Sizes are MiB in the core.  Decimal units follow the habits of GPU tools: nvidia-smi and
# gpu-kill write "GB" for GiB, so GB/G/GiB all mean 1024 MiB here.
_SIZE_UNITS = {
    '': 1.0, 'm': 1.0, 'mb': 1.0, 'mib': 1.0,
    'g': 1024.0, 'gb': 1024.0, 'gib': 1024.0,
    't': 1048576.0, 'tb': 1048576.0, 'tib': 1048576.0,
    'k': 1.0 / 1024, 'kb': 1.0 / 1024, 'kib': 1.0 / 1024,
}
_SIZE = re.compile(r'^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$')


def is_number(value):
    """An int or a float, not a bool (JSON and YAML numbers as read back)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_duration(value, field='duration'):
    """Seconds (float) from ``90``, ``'90s'``, ``'30m'``, ``'1h30m'`` or ``'2 hours'``.

    Raises InvalidArgument naming ``field`` and the value for anything else, including negative
    numbers and empty strings.
    """
    if isinstance(value, bool):
        raise InvalidArgument(field, _shown(value), 'expected a duration such as 90s, 30m or 2h')
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and math.isnan(value)):
            raise InvalidArgument(field, _shown(value), 'a duration must not be negative')
        return _finite(value, field, 'a duration')
    if not isinstance(value, str):
        raise InvalidArgument(field, _shown(value), 'expected a duration such as 90s, 30m or 2h')
    text = value.strip().lower()
    if not text or len(text) > 64:
        raise InvalidArgument(field, _shown(value), 'expected a duration such as 90s, 30m or 2h')
    total = 0.0
    pos = 0
    parts = list(_DURATION_PART.finditer(text))
    for match in parts:
        if text[pos:match.start()].strip():
            raise InvalidArgument(field, _shown(value), 'expected a duration such as 90s, 30m or 2h')
        unit = match.group(2)
        if not unit and len(parts) > 1:
            raise InvalidArgument(field, _shown(value), 'every part of a compound duration needs a unit, as in 1h30m')
        if unit not in _DURATION_UNITS:
            raise InvalidArgument(field, _shown(value), 'unknown duration unit %r (use ms, s, m, h, d or w)' % unit)
        total += float(match.group(1)) * _DURATION_UNITS[unit]
        pos = match.end()
    if pos == 0 or text[pos:].strip():
        raise InvalidArgument(field, _shown(value), 'expected a duration such as 90s, 30m or 2h')
    return _finite(total, field, 'a duration')


def parse_size_mib(value, field='size'):
    """MiB (float) from ``4096``, ``'8GB'``, ``'8 GiB'``, ``'512M'``.  A bare number is MiB."""
    if isinstance(value, bool):
        raise InvalidArgument(field, _shown(value), 'expected a size such as 512MiB or 8GiB')
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and math.isnan(value)):
            raise InvalidArgument(field, _shown(value), 'a size must not be negative')
        return _finite(value, field, 'a size')
    if not isinstance(value, str):
        raise InvalidArgument(field, _shown(value), 'expected a size such as 512MiB or 8GiB')
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise InvalidArgument(field, _shown(value), 'expected a size such as 512MiB or 8GiB')
    return _finite(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()], field, 'a size')


def _finite(value, field, what):
    """``value`` as a finite float; InvalidArgument for infinity and for integers too large for a float."""
    try:
        number = float(value)
    except OverflowError:
        number = float('inf')
    if math.isinf(number):
        raise InvalidArgument(field, _shown(value), '%s must be a finite number' % what)
    return number


def _shown(value):
    """``value`` for an error message: huge integers (whose repr can fail) and long texts shortened."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return 'an integer of %d bits' % value.bit_length()
    if isinstance(value, str) and len(value) > 64:
        return value[:64] + '...'
    return value


def human_duration(seconds):
    """A duration for people, two units at most: ``45s``, ``5m03s``, ``2h05m``, ``3d04h`` (rounded down,
    negative values as ``0s``).  The one formatter of the core's messages, reasons and tables."""
    seconds = max(0, int(seconds))
    if seconds >= 86400:
        return '%dd%02dh' % (seconds // 86400, seconds % 86400 // 3600)
    if seconds >= 3600:
        return '%dh%02dm' % (seconds // 3600, seconds % 3600 // 60)
    if seconds >= 60:
        return '%dm%02ds' % (seconds // 60, seconds % 60)
    return '%ds' % seconds
