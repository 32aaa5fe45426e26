# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The bottom of the policy package: the error a document's reader raises (PolicyError), the limits
on a document's shape (check_nesting), and the validator every section parser uses: a parser raises
_Bad, and _Errors collects every failure of a document so that none hides another."""

from __future__ import annotations

import json
import re

from ..errors import InvalidArgument


# Limits on the shape of any document the agent reads (policy, settings, rogue rules; YAML, JSON
# or TOML): mappings and lists nested at most MAX_NESTING deep, and YAML aliases adding at most
# MAX_ALIAS_NODES nodes in all by repeating what their anchors name.  Past them: a clean error.
MAX_NESTING = 32
MAX_ALIAS_NODES = 100000
MAX_ERRORS = 50


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


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def _only(value, path, keys, hint=None):
    errors = _Errors()
    for key in value:
        if key not in keys:
            why = 'unknown key; expected one of %s' % ', '.join(sorted(keys))
            if hint and key in hint:
                why = hint[key]
            errors.add(_join(path, key), value[key], why)
    errors.check()
