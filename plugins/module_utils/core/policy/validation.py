# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The bottom of the policy package: the error a document's reader raises (PolicyError, the agent
settings' error as well).  The validator the section parsers use is core/validation.py's, under the
names they know: a parser raises _Bad (validation.Invalid), and _Errors (validation.Errors) collects
every failure of a document so that none hides another."""

from __future__ import annotations

from ..errors import InvalidArgument
# the leaf's names, importable from here as before
from ..validation import (  # noqa: F401  pylint: disable=unused-import
    MAX_ALIAS_NODES, MAX_ERRORS, MAX_NESTING, DocumentLimitError, Errors, Invalid, check_nesting, is_number, join, line_of, only, show,
    too_deep, type_name,
)

# The names the policy's parsers use (core/validation.py holds each once).
_Bad = Invalid
_Errors = Errors
_join = join
_is_number = is_number
_type = type_name
_only = only
_show = show
_too_deep = too_deep


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
