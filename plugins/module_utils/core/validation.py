# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The one validator of every document the agent reads (the policy, the rogue rules file, the agent
settings).  A leaf: it imports only errors and the standard library.

Errors are path-addressed: ``(path, value, why, line)``, the field's path in the document
(``rules[0].match.cmdline``), the value found there, the reason, and its line where known (None
otherwise).  A check raises ``Invalid``; an ``Errors`` collects every failure of a document (each
field is checked, none stops the others) and raises them at once.  Each document turns the
collected items into its own exception (policy.PolicyError, which the settings use as well, and
rogue.RulesError), with its own rendering.

The common checks (``mapping``, ``sequence``, ``boolean``, ``text``, ``in_range``, ``only``) and the
limits on a document's shape (``check_nesting``) live here once.
"""

from __future__ import annotations

import json
import math
import re

from .errors import InvalidArgument

__all__ = ['MAX_NESTING', 'MAX_ALIAS_NODES', 'MAX_ERRORS', 'DocumentLimitError', 'check_nesting', 'too_deep',
           'Invalid', 'Errors', 'join', 'line_of', 'show', 'is_number', 'type_name', 'unknown_key', 'only',
           'mapping', 'sequence', 'boolean', 'text', 'in_range']

# Limits on the shape of any document the agent reads (policy, settings, rogue rules; YAML, JSON
# or TOML): mappings and lists nested at most MAX_NESTING deep, and YAML aliases adding at most
# MAX_ALIAS_NODES nodes in all by repeating what their anchors name.  Past them: a clean error.
MAX_NESTING = 32
MAX_ALIAS_NODES = 100000
# The most errors a message lists (the rest are counted).
MAX_ERRORS = 50


class DocumentLimitError(ValueError):
    """A document nests deeper than MAX_NESTING or its YAML aliases expand past MAX_ALIAS_NODES."""

    def __init__(self, why, line=None):
        super(DocumentLimitError, self).__init__(why if line is None else 'line %d: %s' % (line, why))
        self.why = why
        self.line = line


def too_deep():
    """The reason given for a document nested past MAX_NESTING."""
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
            raise DocumentLimitError(too_deep())
        pending.extend((child, level + 1) for child in children)


class Invalid(Exception):
    """A field that fails its check: ``path``, ``value``, ``why`` and ``line`` (None where unknown).
    ``items`` holds every error it stands for as ``(path, value, why, line)`` (itself, or all the
    errors an Errors collected).  Raised inside validators; a document's reader turns it into its
    own exception."""

    def __init__(self, path, value, why, items=None, line=None):
        super(Invalid, self).__init__(why)
        self.path = path
        self.value = value
        self.why = why
        self.line = line
        self.items = list(items) if items else [(path, value, why, line)]


class Errors(object):
    """Collects every failure of a document, as ``(path, value, why, line)`` items."""

    def __init__(self):
        self.items = []

    def __len__(self):
        return len(self.items)

    def add(self, path, value, why, line=None):
        self.items.append((path, value, why, line))

    def run(self, func, *args):
        """Call func(*args); an Invalid becomes collected error(s) and the result is None.  An
        InvalidArgument (a shared parser's error) is collected under the path passed last."""
        try:
            return func(*args)
        except Invalid as exc:
            self.items.extend(exc.items)
        except InvalidArgument as exc:
            self.add(args[-1] if args and isinstance(args[-1], str) else '', exc.value, exc.why)
        return None

    def check(self):
        """Raise the collected errors (an Invalid holding all of them), if any."""
        if self.items:
            first = self.items[0]
            raise Invalid(first[0], first[1], first[2], self.items, first[3])


def join(path, key):
    """The path of ``key`` inside ``path``: ``a.b``, or ``a["odd key"]`` for a key that is not a plain word."""
    key = str(key)
    if not path:
        return key
    if re.match(r'^[A-Za-z0-9_*@.-]+$', key) and '.' not in key:
        return '%s.%s' % (path, key)
    return '%s[%s]' % (path, json.dumps(key))


def line_of(lines, path):
    """The line of ``path`` in a {path: line} map, or of the nearest enclosing path; None if unknown."""
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind('.'), path.rfind('['))
        path = path[:cut] if cut > 0 else ''
    return None


def show(value):
    """repr(value), cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + '...'


def is_number(value):
    """True for an int or a float (a boolean is not a number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_name(value):
    """What ``value`` is, in words, for messages: null, a boolean, a number, text, a list, a mapping."""
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'a boolean'
    if is_number(value):
        return 'a number'
    if isinstance(value, str):
        return 'text'
    if isinstance(value, (list, tuple)):
        return 'a list'
    if isinstance(value, dict):
        return 'a mapping'
    return type(value).__name__


def unknown_key(key, keys, noun='key', named=False):
    """The reason for a key not in ``keys``: 'unknown key; expected one of a, b' (``named``: the key
    is quoted after ``noun``, for reports that do not show the value)."""
    return 'unknown %s%s; expected one of %s' % (noun, ' %r' % (key,) if named else '', ', '.join(sorted(keys)))


def only(value, path, keys, hint=None, noun='key', named=False):
    """Every key of the mapping ``value`` that is not in ``keys`` is an error (all of them, at once);
    ``hint`` gives the reason for some keys ({key: why})."""
    errors = Errors()
    for key in value:
        if key not in keys:
            why = hint[key] if hint and key in hint else unknown_key(key, keys, noun, named)
            errors.add(join(path, key), value[key], why)
    errors.check()


def mapping(value, path):
    """``value``, a mapping whose keys are text."""
    if not isinstance(value, dict):
        raise Invalid(path, value, 'expected a mapping, got %s' % type_name(value))
    for key in value:
        if not isinstance(key, str):
            raise Invalid(path, key, 'keys must be text, got %s' % type_name(key))
    return value


def sequence(value, path):
    """``value``, a list."""
    if not isinstance(value, (list, tuple)):
        raise Invalid(path, value, 'expected a list, got %s' % type_name(value))
    return value


def boolean(value, path):
    """``value``, true or false."""
    if not isinstance(value, bool):
        raise Invalid(path, value, 'expected true or false')
    return value


def text(value, path, why=None, blank=False):
    """``value``, text that is not blank (``blank``: may be blank; ``why``: the reason when it is not)."""
    if not isinstance(value, str) or not (blank or value.strip()):
        raise Invalid(path, value, why or 'expected a non-empty string, got %s' % type_name(value))
    return value


def in_range(value, path, low=None, high=None, whole=False, why=None, above=False):
    """``value``, a number (an int when ``whole``) from ``low`` to ``high`` (None: no bound; ``above``:
    greater than ``low``, not equal).  NaN is out of every range.  ``why`` is the reason for either
    failure; without it: 'expected a whole number from 1 to 9, got text' or '10 is out of range 1-9'."""
    if not is_number(value) or (whole and not isinstance(value, int)):
        raise Invalid(path, value, why or 'expected %s from %s to %s, got %s' % (
            'a whole number' if whole else 'a number', low, high, type_name(value)))
    if math.isnan(value) or (low is not None and not (value > low if above else value >= low)) or (high is not None and value > high):
        raise Invalid(path, value, why or '%s is out of range %s-%s' % (value, low, high))
    return value
