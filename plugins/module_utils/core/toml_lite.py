# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""A small TOML reader for gpu-kill guard configurations (``guard_mode_config.toml``).

Python before 3.11 has no TOML parser, and gpu-kill's own documented example writes
``maintenance_window = null``, which no strict TOML parser accepts.  This reader covers what such
files use: comments, ``[table]``, ``[a."b c"]``, ``[[array.of.tables]]``, dotted and quoted keys,
basic/literal/multi-line strings, integers (``_``, hex/octal/binary), floats (``inf``, ``nan``),
booleans, arrays (multi-line, trailing comma), inline tables, dates/times (kept as text) and the
bare word ``null`` (None).  Errors raise TomlError with the line number.
"""

from __future__ import annotations

import re

MAX_TEXT = 4 * 1024 * 1024
MAX_DEPTH = 64


class TomlError(ValueError):
    """The text is not TOML this reader understands; ``line`` is 1-based."""

    def __init__(self, line, why):
        self.line = line
        self.why = why
        super(TomlError, self).__init__('line %d: %s' % (line, why))


_BARE_KEY = re.compile(r'[A-Za-z0-9_-]+')
_NUMBER = re.compile(r'[+-]?(?:0x[0-9A-Fa-f_]+|0o[0-7_]+|0b[01_]+|inf|nan|'
                     r'(?:\d[\d_]*)(?:\.\d[\d_]*)?(?:[eE][+-]?\d[\d_]*)?)')
_DATETIME = re.compile(r'\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:\d{2})?)?'
                       r'|\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?')
_ESCAPES = {'b': '\b', 't': '\t', 'n': '\n', 'f': '\f', 'r': '\r', '"': '"', '\\': '\\', 'e': '\x1b'}


class _Parser(object):
    def __init__(self, text):
        self.text = text
        self.pos = 0
        self.root = {}
        self.defined = set()      # ids of tables defined by a [header] (may not be defined twice)
        self.inline = set()       # ids of inline tables and their arrays (closed to further keys)

    # -------------------------------------------------------------- low level
    @property
    def line(self):
        return self.text.count('\n', 0, self.pos) + 1

    def error(self, why):
        raise TomlError(self.line, why)

    def peek(self, count=1):
        return self.text[self.pos:self.pos + count]

    def skip_ws(self):
        while self.pos < len(self.text) and self.text[self.pos] in ' \t':
            self.pos += 1

    def skip_comment(self):
        if self.peek() == '#':
            end = self.text.find('\n', self.pos)
            self.pos = len(self.text) if end < 0 else end

    def skip_ws_nl(self):
        """Whitespace, newlines and comments (inside arrays)."""
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char in ' \t\r\n':
                self.pos += 1
            elif char == '#':
                self.skip_comment()
            else:
                break

    def end_of_line(self):
        self.skip_ws()
        self.skip_comment()
        if self.pos < len(self.text):
            if self.text.startswith('\r\n', self.pos):
                self.pos += 2
            elif self.text[self.pos] == '\n':
                self.pos += 1
            else:
                self.error('unexpected text %r after a value' % self.text[self.pos:self.pos + 20])

    # -------------------------------------------------------------- document
    def parse(self):
        current = self.root
        while True:
            self.skip_ws_nl()
            if self.pos >= len(self.text):
                return self.root
            if self.peek(2) == '[[':
                self.pos += 2
                keys = self.key_path(']]')
                current = self.array_table(keys)
            elif self.peek() == '[':
                self.pos += 1
                keys = self.key_path(']')
                current = self.table(keys)
            else:
                keys = self.key_path('=')
                self.skip_ws()
                value = self.value(0)
                self.assign(current, keys, value)
            self.end_of_line()

    def key_path(self, terminator):
        keys = []
        while True:
            self.skip_ws()
            keys.append(self.key())
            self.skip_ws()
            if self.peek() == '.':
                self.pos += 1
                continue
            if self.text.startswith(terminator, self.pos):
                self.pos += len(terminator)
                return keys
            self.error('expected %r after a key, found %r' % (terminator, self.text[self.pos:self.pos + 20]))

    def key(self):
        char = self.peek()
        if char == '"':
            return self.basic_string()
        if char == "'":
            return self.literal_string()
        match = _BARE_KEY.match(self.text, self.pos)
        if not match:
            self.error('expected a key, found %r' % self.text[self.pos:self.pos + 20])
        self.pos = match.end()
        return match.group(0)

    def walk(self, keys, create_from):
        """The table at ``keys`` below the root, creating implicit tables."""
        table = self.root
        for key in keys:
            if key not in table:
                table[key] = {}
            node = table[key]
            if isinstance(node, list):
                if not node or not isinstance(node[-1], dict) or id(node) in self.inline:
                    self.error('%s is not a table' % '.'.join(keys))
                node = node[-1]
            elif not isinstance(node, dict):
                self.error('%s is already a value, not a table' % '.'.join(keys))
            if id(node) in self.inline:
                self.error('%s is an inline table and cannot be extended' % '.'.join(keys))
            table = node
        return table

    def table(self, keys):
        parent = self.walk(keys[:-1], None)
        last = keys[-1]
        node = parent.get(last)
        if node is None:
            node = parent[last] = {}
        elif not isinstance(node, dict) or id(node) in self.inline:
            self.error('[%s] is already defined as a value' % '.'.join(keys))
        if id(node) in self.defined:
            self.error('table [%s] is defined twice' % '.'.join(keys))
        self.defined.add(id(node))
        return node

    def array_table(self, keys):
        parent = self.walk(keys[:-1], None)
        last = keys[-1]
        array = parent.get(last)
        if array is None:
            array = parent[last] = []
        elif not isinstance(array, list) or id(array) in self.inline:
            self.error('[[%s]] is already defined as a value' % '.'.join(keys))
        node = {}
        array.append(node)
        return node

    def assign(self, table, keys, value):
        for key in keys[:-1]:
            node = table.get(key)
            if node is None:
                node = table[key] = {}
            if not isinstance(node, dict) or id(node) in self.inline:
                self.error('key %s is already a value' % '.'.join(keys))
            table = node
        if keys[-1] in table:
            self.error('key %s is defined twice' % '.'.join(keys))
        table[keys[-1]] = value

    # -------------------------------------------------------------- values
    def value(self, depth):
        if depth > MAX_DEPTH:
            self.error('values nested deeper than %d levels' % MAX_DEPTH)
        char = self.peek()
        if self.peek(3) == '"""':
            return self.multiline_basic()
        if self.peek(3) == "'''":
            return self.multiline_literal()
        if char == '"':
            return self.basic_string()
        if char == "'":
            return self.literal_string()
        if char == '[':
            return self.array(depth)
        if char == '{':
            return self.inline_table(depth)
        for word, result in (('true', True), ('false', False), ('null', None)):
            if self.text.startswith(word, self.pos) and not _BARE_KEY.match(self.text, self.pos + len(word)):
                self.pos += len(word)
                return result
        match = _DATETIME.match(self.text, self.pos)
        if match and (len(match.group(0)) >= 8):
            self.pos = match.end()
            return match.group(0)
        match = _NUMBER.match(self.text, self.pos)
        if match and match.group(0) and not _BARE_KEY.match(self.text, match.end()):
            self.pos = match.end()
            return self.number(match.group(0))
        self.error('expected a value, found %r' % self.text[self.pos:self.pos + 20])
        return None

    def number(self, text):
        clean = text.replace('_', '')
        sign = -1 if clean.startswith('-') else 1
        body = clean.lstrip('+-')
        try:
            if body in ('inf', 'nan'):
                return sign * float(body)
            if body[:2] in ('0x', '0o', '0b'):
                return sign * int(body[2:], {'0x': 16, '0o': 8, '0b': 2}[body[:2]])
            if any(c in body for c in '.eE'):
                return float(clean)
            return int(clean)
        except ValueError:
            self.error('not a number: %r' % text)
        return None

    def basic_string(self):
        self.pos += 1
        out = []
        while True:
            if self.pos >= len(self.text):
                self.error('unterminated string')
            char = self.text[self.pos]
            if char == '"':
                self.pos += 1
                return ''.join(out)
            if char == '\n':
                self.error('newline inside a one-line string')
            if char == '\\':
                out.append(self.escape())
                continue
            out.append(char)
            self.pos += 1

    def escape(self):
        code = self.text[self.pos + 1:self.pos + 2]
        if code in _ESCAPES:
            self.pos += 2
            return _ESCAPES[code]
        if code in ('u', 'U'):
            width = 4 if code == 'u' else 8
            digits = self.text[self.pos + 2:self.pos + 2 + width]
            try:
                value = int(digits, 16)
                if len(digits) != width or 0xD800 <= value <= 0xDFFF or value > 0x10FFFF:
                    raise ValueError()
            except ValueError:
                self.error('bad unicode escape \\%s%s' % (code, digits))
            self.pos += 2 + width
            return chr(value)
        self.error('unknown escape \\%s' % code)
        return ''

    def literal_string(self):
        end = self.text.find("'", self.pos + 1)
        newline = self.text.find('\n', self.pos + 1)
        if end < 0 or (0 <= newline < end):
            self.error('unterminated literal string')
        value = self.text[self.pos + 1:end]
        self.pos = end + 1
        return value

    def multiline_basic(self):
        self.pos += 3
        if self.text.startswith('\r\n', self.pos):
            self.pos += 2
        elif self.peek() == '\n':
            self.pos += 1
        out = []
        while True:
            if self.pos >= len(self.text):
                self.error('unterminated multi-line string')
            if self.text.startswith('"""', self.pos):
                # up to two quotes right before the closing delimiter belong to the string
                extra = 0
                while extra < 2 and self.text.startswith('"', self.pos + 3 + extra):
                    extra += 1
                out.append('"' * extra)
                self.pos += 3 + extra
                return ''.join(out)
            char = self.text[self.pos]
            if char == '\\':
                rest = self.text[self.pos + 1:]
                stripped = rest.lstrip(' \t')
                if stripped.startswith('\n') or stripped.startswith('\r\n'):
                    # line-ending backslash: trim the newline and following whitespace
                    self.pos += 1
                    while self.pos < len(self.text) and self.text[self.pos] in ' \t\r\n':
                        self.pos += 1
                    continue
                out.append(self.escape())
                continue
            out.append(char)
            self.pos += 1

    def multiline_literal(self):
        self.pos += 3
        if self.text.startswith('\r\n', self.pos):
            self.pos += 2
        elif self.peek() == '\n':
            self.pos += 1
        end = self.text.find("'''", self.pos)
        if end < 0:
            self.error('unterminated multi-line literal string')
        extra = 0
        while extra < 2 and self.text.startswith("'", end + 3 + extra):
            extra += 1
        value = self.text[self.pos:end + extra]
        self.pos = end + 3 + extra
        return value

    def array(self, depth):
        self.pos += 1
        items = []
        while True:
            self.skip_ws_nl()
            if self.peek() == ']':
                self.pos += 1
                return items
            if self.pos >= len(self.text):
                self.error('unterminated array')
            items.append(self.value(depth + 1))
            self.skip_ws_nl()
            if self.peek() == ',':
                self.pos += 1
            elif self.peek() != ']':
                self.error('expected , or ] in an array, found %r' % self.text[self.pos:self.pos + 20])

    def inline_table(self, depth):
        self.pos += 1
        table = {}
        self.skip_ws()
        if self.peek() == '}':
            self.pos += 1
            self.inline.add(id(table))
            return table
        while True:
            self.skip_ws()
            keys = self.key_path('=')
            self.skip_ws()
            value = self.value(depth + 1)
            node = table
            for key in keys[:-1]:
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    self.error('key %s is already a value' % '.'.join(keys))
            if keys[-1] in node:
                self.error('key %s is defined twice' % '.'.join(keys))
            node[keys[-1]] = value
            self.skip_ws()
            if self.peek() == ',':
                self.pos += 1
                continue
            if self.peek() == '}':
                self.pos += 1
                self.inline.add(id(table))
                return table
            self.error('expected , or } in an inline table, found %r' % self.text[self.pos:self.pos + 20])


def loads(text):
    """Parse TOML ``text`` into dicts, lists and scalars.  Raises TomlError."""
    if not isinstance(text, str):
        raise TomlError(0, 'expected text')
    if len(text) > MAX_TEXT:
        raise TomlError(0, 'the document is larger than %d bytes' % MAX_TEXT)
    if text.startswith('\ufeff'):
        text = text[1:]
    return _Parser(text).parse()
