# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Text meant for people: the one escaping of characters a terminal, a log viewer or a browser acts on.

Process names, command lines, user names and messages built from them are written by the node's
users.  Before such text reaches a terminal, syslog, a tty warning, the HTML report or the CSV file,
``printable`` replaces every character that could move the cursor, change a window title, erase
the screen, start a new (forged) line or reorder what is shown with a visible escape:

* C0 controls U+0000-U+001F (tab and newline too: a table cell or a log line holds no line break),
  DEL U+007F and the C1 controls U+0080-U+009F (``\\x9b`` is a one-byte CSI on some terminals) as
  ``\\xNN``;
* the Unicode line and paragraph separators U+2028 and U+2029 and the bidirectional controls
  (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069: "Trojan Source") as ``\\uNNNN``;
and, like ``clean_text`` (JSON-safe text), bytes are decoded as UTF-8 and invalid bytes or lone
surrogates become U+FFFD, so that the text can always be encoded.

A backslash is left as it is: the escapes are for display, not a reversible encoding.
"""

from __future__ import annotations

import re

_UNSAFE_RE = re.compile('[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]')
_SURROGATES_RE = re.compile('[\ud800-\udfff]')


def clean_text(value, limit=None):
    """A JSON-safe str from str/bytes/anything (invalid UTF-8 and surrogates replaced; None stays None)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode('utf-8', 'replace')
    elif not isinstance(value, str):
        value = str(value)
    if _SURROGATES_RE.search(value):
        value = _SURROGATES_RE.sub('\ufffd', value)
    if limit is not None and len(value) > limit:
        value = value[:limit] + '...'
    return value


def _escape(match):
    code = ord(match.group(0))
    return ('\\x%02x' % code) if code < 0x100 else ('\\u%04x' % code)


def printable(value):
    """``value`` (str, bytes, anything; None stays None) as text with no character a terminal or a
    viewer acts on: see the module docstring.  Plain text is returned unchanged."""
    value = clean_text(value)
    return None if value is None else _UNSAFE_RE.sub(_escape, value)


def printable_lines(text):
    """Multi-line ``text`` that the program itself built: each line made ``printable``, the line
    breaks between them kept (the lines' own content never holds one after this)."""
    if text is None:
        return None
    return '\n'.join(printable(line) for line in str(text).split('\n'))


# what a spreadsheet takes for the start of a formula (OWASP, CSV injection); tab and CR are escaped by printable
CSV_FORMULA_STARTS = ('=', '+', '-', '@')


def csv_cell(value):
    """One CSV cell (RFC 4180): a number as it is, None as nothing, anything else as quoted ``printable`` text (no
    line break or control character survives), with a leading apostrophe when it starts with ``=``, ``+``, ``-`` or
    ``@`` so that a spreadsheet shows it as text instead of running it as a formula."""
    if value is None:
        return ''
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, (int, float)):
        return str(value)   # a float's str is its repr (the shortest text that reads back as it)
    text = printable(value)
    if text[:1] in CSV_FORMULA_STARTS:
        text = "'" + text
    return '"%s"' % text.replace('"', '""')


def csv_row(values):
    """One CSV line (without its CRLF) of ``csv_cell`` cells."""
    return ','.join(csv_cell(value) for value in values)
