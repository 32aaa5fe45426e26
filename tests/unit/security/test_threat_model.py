# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""docs/security.md: no threat is listed as mitigated without a test, and every test it names exists.

Each row of the threats table names its proof as ``file.py::test_name`` (a later ``::test_other``
in the same cell belongs to the file named before it), or a whole ``file.py`` of tests.  This test finds each named file under
tests/ and each named test function in it, so a renamed or deleted test cannot leave a row that
claims a proof it no longer has.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
DOC = os.path.join(ROOT, 'docs', 'security.md')
_REF = re.compile(r'([\w./-]+\.py)?(?:::(test_\w+))?')


def _rows():
    with open(DOC) as handle:
        for line in handle:
            if re.match(r'^\| T\d+ \|', line):
                cells = [cell.strip() for cell in line.strip().strip('|').split(' | ')]
                yield cells[0], cells[-1]


def _find(name):
    """Paths of test files under tests/ whose path ends with ``name``."""
    found = []
    for parent, _dirs, files in os.walk(os.path.join(ROOT, 'tests')):
        for base in files:
            path = os.path.join(parent, base)
            if base.endswith('.py') and path.endswith('/' + name.split('/')[-1]) and ('/' + name) in '/' + os.path.relpath(path, ROOT):
                found.append(path)
    return found


def test_every_threat_names_tests_that_exist():
    rows = list(_rows())
    assert len(rows) >= 28
    missing = []
    for threat, proof in rows:
        refs = []
        current = None
        for match in _REF.finditer(proof):
            if not match.group(0):
                continue
            current = match.group(1) or current
            refs.append((current, match.group(2)))   # a file alone (test None) must hold some test
        assert refs, '%s names no test' % threat
        for name, test in refs:
            assert name is not None, '%s: ::%s follows no file name' % (threat, test)
            paths = _find(name)
            if not paths:
                missing.append('%s: no test file %s' % (threat, name))
                continue
            text = ''.join(open(path).read() for path in paths)
            wanted = r'^def %s\(' % re.escape(test) if test else r'^def test_\w*\('
            if not re.search(wanted, text, re.M):
                missing.append('%s: %s has no %s' % (threat, name, test or 'test'))
    assert not missing, '\n'.join(missing)


def test_threat_numbers_are_unique():
    numbers = [threat for threat, _proof in _rows()]
    assert len(numbers) == len(set(numbers)), numbers
