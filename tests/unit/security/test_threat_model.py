# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""docs/security.md: no threat is listed as mitigated without a test, no input root reads is left out of the
inputs table, and every test either table names exists.

Each row of the threats table (``T<n>``) and of the inputs table (``I<n>``) names its proof as
``file.py::test_name`` (a later ``::test_other`` in the same cell belongs to the file named before it), or a
whole ``file.py`` of tests.  This test finds each named file under tests/ and each named test function in it, so
a renamed or deleted test cannot leave a row that claims a proof it no longer has.  The inputs table must also
name every environment variable the core reads and every program it runs (found in the core's source), so that
new code cannot add an input without its row.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
DOC = os.path.join(ROOT, 'docs', 'security.md')
CORE = os.path.join(ROOT, 'plugins', 'module_utils', 'core')
_REF = re.compile(r'([\w./-]+\.py)?(?:::(test_\w+))?')
# what the core reads from the environment, and the programs it looks up or runs
_ENV_READS = (re.compile(r"""environ(?:\.get\('([A-Z_][A-Z0-9_]*)'|\['([A-Z_][A-Z0-9_]*)'\](?!\s*=[^=]))"""),
              re.compile(r"""^[A-Z_]*ENV = '([A-Z_][A-Z0-9_]*)'""", re.M))
_PROGRAMS = (re.compile(r"""find_program\('([\w-]+)'"""), re.compile(r"""\.tool\('([\w-]+)'\)"""),
             re.compile(r"""(?:self\.run|client\.run|_run)\(\['([\w-]+)'"""), re.compile(r"""^[A-Z_]+ = '([\w-]+-smi|ioreg)'$""", re.M))


def _rows(kind='T'):
    with open(DOC) as handle:
        for line in handle:
            if re.match(r'^\| %s\d+ \|' % kind, line):
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


def _missing_tests(rows):
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
    return missing


def test_every_threat_names_tests_that_exist():
    rows = list(_rows())
    assert len(rows) >= 28
    missing = _missing_tests(rows)
    assert not missing, '\n'.join(missing)


def test_every_input_names_tests_that_exist():
    rows = list(_rows('I'))
    assert len(rows) >= 20
    missing = _missing_tests(rows)
    assert not missing, '\n'.join(missing)


def _core_sources():
    for path in sorted(glob.glob(os.path.join(CORE, '**', '*.py'), recursive=True)):
        with open(path) as handle:
            yield os.path.relpath(path, ROOT), handle.read()


def _inputs_text():
    with open(DOC) as handle:
        return ''.join(line for line in handle if re.match(r'^\| I\d+ \|', line))


def test_every_environment_variable_and_program_of_the_core_has_its_input_row():
    table = _inputs_text()
    found = {}
    for path, text in _core_sources():
        for pattern in _ENV_READS + _PROGRAMS:
            for match in pattern.findall(text):
                for name in (match if isinstance(match, tuple) else (match,)):
                    if name:
                        found.setdefault(name, path)
    assert {'PATH', 'SLURM_JOB_ID', '_GPUFLEET_KMSG', 'journalctl', 'squeue', 'scontrol', 'nvidia-smi'} <= set(found), found
    unlisted = sorted('%s (read in %s)' % (name, path) for name, path in found.items() if '`%s`' % name not in table)
    assert not unlisted, 'inputs with no row in docs/security.md "Inputs root reads": %s' % ', '.join(unlisted)


def test_threat_and_input_numbers_are_unique():
    for kind in ('T', 'I'):
        numbers = [row for row, _proof in _rows(kind)]
        assert len(numbers) == len(set(numbers)), numbers
