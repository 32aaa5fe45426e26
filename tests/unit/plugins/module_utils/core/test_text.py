# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/text.py, character by character: what printable escapes and how, clean_text's decoding and bound, and
the CSV cells (the escaping every human-facing output goes through; mutation-tested, docs/testing.md)."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import text as T

# Every character printable escapes: C0, DEL, C1, the line and paragraph separators, the bidirectional controls.
UNSAFE = ([chr(c) for c in range(0x20)] + [chr(c) for c in range(0x7f, 0xa0)]
          + ['\u061c', '\u200e', '\u200f', '\u2028', '\u2029'] + [chr(c) for c in range(0x202a, 0x202f)]
          + [chr(c) for c in range(0x2066, 0x206a)])


def test_printable_escapes_exactly_the_unsafe_characters():
    for char in UNSAFE:
        code = ord(char)
        assert T.printable('a%sb' % char) == ('a\\x%02xb' % code if code < 0x100 else 'a\\u%04xb' % code), hex(code)
    # their neighbours stay as they are
    for char in (' ', '~', '\xa0', '\xff', '\u061b', '\u061d', '\u200d', '\u2010', '\u2027', '\u202f', '\u2065', '\u206a', '\\'):
        assert T.printable('a%sb' % char) == 'a%sb' % char, hex(ord(char))


def test_printable_escapes_with_two_or_four_hex_digits_at_the_byte_boundary():
    assert T.printable('\x9f') == '\\x9f'       # the last C1 control: two digits
    assert T.printable('\u061c') == '\\u061c'   # past U+00FF: four digits
    assert T.printable('\x00\x1b[2J') == '\\x00\\x1b[2J'


def test_printable_takes_anything_and_keeps_none():
    assert T.printable(None) is None
    assert T.printable('') == ''
    assert T.printable(b'caf\xc3\xa9 \xff\n') == 'caf\u00e9 \ufffd\\x0a'
    assert T.printable(42) == '42'
    assert T.printable('\ud800x') == '\ufffdx'


def test_printable_lines_keeps_the_programs_own_line_breaks_only():
    assert T.printable_lines(None) is None
    assert T.printable_lines('one\ntwo\x1b\r') == 'one\ntwo\\x1b\\x0d'
    assert T.printable_lines(7) == '7'
    assert T.printable_lines('') == ''


def test_clean_text_decodes_replaces_surrogates_and_bounds():
    assert T.clean_text(None) is None
    assert T.clean_text(None, limit=1) is None
    assert T.clean_text(b'a\xffb') == 'a\ufffdb'
    assert T.clean_text(3.5) == '3.5'
    assert T.clean_text('x\udfffy\ud800') == 'x\ufffdy\ufffd'
    assert T.clean_text('\x1b') == '\x1b'          # JSON-safe, not printable: controls stay
    assert T.clean_text('abcdef', limit=3) == 'abc...'
    assert T.clean_text('abc', limit=3) == 'abc'   # at the limit: whole, no ellipsis
    assert T.clean_text('abcd', limit=3) == 'abc...'
    assert T.clean_text('', limit=0) == ''
    assert T.clean_text('a', limit=0) == '...'


@pytest.mark.parametrize('value, cell', [
    (None, ''),
    (True, 'true'),
    (False, 'false'),
    (0, '0'),
    (-3, '-3'),
    (2.5, '2.5'),
    (0.1, '0.1'),
    ('', '""'),
    ('plain', '"plain"'),
    ('say "hi"', '"say ""hi"""'),
    ('=1+1', '"\'=1+1"'),
    ('+1', '"\'+1"'),
    ('-1', '"\'-1"'),
    ('@SUM(A1)', '"\'@SUM(A1)"'),
    ('a=b', '"a=b"'),
    ('\t=1', '"\\x09=1"'),        # a tab before the formula is escaped, so the cell no longer starts with it
    ('line\nbreak', '"line\\x0abreak"'),
    (b'bytes', '"bytes"'),
])
def test_csv_cells(value, cell):
    assert T.csv_cell(value) == cell


def test_csv_row_joins_cells_with_commas():
    assert T.csv_row([]) == ''
    assert T.csv_row(['a', None, 1, '=x']) == '"a",,1,"\'=x"'
