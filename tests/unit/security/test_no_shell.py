# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""No value from a process or a policy may ever reach a shell: the tree has no shell at all.

Python: no call passes ``shell=True``, and nothing calls ``os.system``, ``os.popen``,
``subprocess.getoutput`` or ``subprocess.getstatusoutput`` (checked on the syntax tree, so strings
that merely mention them, such as fuzz inputs, do not count).  Ansible content: no ``shell`` or
``raw`` task, and no ``ansible.builtin.command`` given a templated free-form string.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
SKIP_DIRS = {'.git', '.venv', 'build', 'output', '__pycache__', 'node_modules'}
BANNED_CALLS = {('os', 'system'), ('os', 'popen'), ('subprocess', 'getoutput'), ('subprocess', 'getstatusoutput')}
SHELL_TASK = re.compile(r'^[ \t]*-?[ \t]*(ansible\.builtin\.shell|ansible\.legacy\.shell|shell|ansible\.builtin\.raw|raw)[ \t]*:', re.M)
# a free-form command is split by shlex (no shell), but a templated value could still become extra
# arguments: templated commands are given as argv lists
FREE_FORM_COMMAND = re.compile(r'^[ \t]*-?[ \t]*(ansible\.builtin\.command|command)[ \t]*:[ \t]*[^\s#][^\n]*\{\{', re.M)


def files(suffixes, top=('plugins', 'roles', 'playbooks', 'extras', 'tests', 'benchmarks', 'meta')):
    for name in top:
        base = os.path.join(ROOT, name)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith('.')]
            for filename in filenames:
                if filename.endswith(suffixes):
                    yield os.path.join(dirpath, filename)


def python_files():
    yield from files(('.py',))
    for path in files(('',), top=('tests/sim', 'tests/fleet', 'tests/demo', 'benchmarks', 'tests/device')):
        if '.' not in os.path.basename(path):
            with open(path, 'rb') as handle:
                if handle.readline().startswith(b'#!/usr/bin/env python'):
                    yield path


def shell_uses(source, path):
    tree = ast.parse(source, path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg == 'shell' and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is False):
                found.append('%s:%d: shell=%s' % (path, node.lineno, ast.dump(keyword.value)))
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and (func.value.id, func.attr) in BANNED_CALLS:
            found.append('%s:%d: %s.%s()' % (path, node.lineno, func.value.id, func.attr))
    return found


def test_the_checker_sees_what_it_bans():
    bad = 'import os, subprocess\nsubprocess.run("x", shell=True)\nos.system("x")\nsubprocess.getoutput("x")\n'
    assert len(shell_uses(bad, 'bad.py')) == 3
    assert shell_uses('subprocess.run(["x"], shell=False)\nprint("os.system(x)")\n', 'good.py') == []
    assert SHELL_TASK.search('- name: x\n  ansible.builtin.shell: rm -rf {{ x }}\n')
    assert FREE_FORM_COMMAND.search('  ansible.builtin.command: kill {{ pid }}\n')
    assert not FREE_FORM_COMMAND.search('  ansible.builtin.command: gpusim show\n')
    assert not FREE_FORM_COMMAND.search('  ansible.builtin.command:\n    argv: [kill, "{{ pid }}"]\n')


def test_no_python_code_uses_a_shell():
    found = []
    checked = 0
    for path in python_files():
        with open(path, encoding='utf-8') as handle:
            found.extend(shell_uses(handle.read(), os.path.relpath(path, ROOT)))
        checked += 1
    assert checked > 50, 'the tree was not found from %s' % ROOT
    assert found == []


@pytest.mark.parametrize('pattern', [SHELL_TASK, FREE_FORM_COMMAND], ids=['shell-or-raw-task', 'free-form-command'])
def test_no_ansible_task_uses_a_shell(pattern):
    found = []
    for path in files(('.yml', '.yaml')):
        with open(path, encoding='utf-8') as handle:
            text = handle.read()
        for match in pattern.finditer(text):
            found.append('%s:%d' % (os.path.relpath(path, ROOT), text.count('\n', 0, match.start()) + 1))
    assert found == []
