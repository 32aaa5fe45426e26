# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The shape docs/design/architecture.md claims for the core, checked on the source: no Ansible
import and relative imports only, no file over 800 lines, leaves that import only leaves, and an
import graph without cycles."""

from __future__ import annotations

import ast
import inspect
import os

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import constants

CORE = os.path.dirname(inspect.getfile(constants))
PLUGINS = os.path.dirname(os.path.dirname(CORE))
MAX_LINES = 800
LEAVES = ('constants', 'errors', 'text', 'textmatch', 'units', 'validation', 'documents', 'safe_files', 'model')


def core_files():
    """{dotted name relative to core: path} of every .py file under core/."""
    found = {}
    for directory, dirs, files in os.walk(CORE):
        dirs[:] = sorted(d for d in dirs if d != '__pycache__')
        for name in sorted(f for f in files if f.endswith('.py')):
            rel = os.path.relpath(os.path.join(directory, name), CORE)[:-3].replace(os.sep, '.')
            found[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = os.path.join(directory, name)
    return found


def imports_of(name, path, known):
    """The core modules ``name`` imports (relative imports resolved), and any absolute import of a
    name that is not the standard library's or a third-party package's but the collection's."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    package = name.split('.') if path.endswith('__init__.py') else name.split('.')[:-1]
    if name == '__init__':
        package = []
    found, absolute = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                absolute.append(node.module or '')
                continue
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else list(package)
            target = base + (node.module.split('.') if node.module else [])
            for alias in node.names:
                candidate = '.'.join(target + [alias.name])
                dotted = '.'.join(target)
                found.add(candidate if candidate in known else dotted)
        elif isinstance(node, ast.Import):
            absolute.extend(alias.name for alias in node.names)
    return set(f for f in found if f in known and f != name), absolute


def test_the_core_imports_no_ansible_and_the_collection_only_relatively():
    files = core_files()
    bad = []
    for name, path in files.items():
        for module in imports_of(name, path, files)[1]:
            if module.split('.')[0] in ('ansible', 'ansible_collections'):
                bad.append('%s imports %s' % (name, module))
    assert bad == []


def test_no_production_file_is_over_800_lines():
    long_files = []
    for directory, dirs, files in os.walk(PLUGINS):
        dirs[:] = [d for d in dirs if d != '__pycache__']
        for name in files:
            if name.endswith('.py'):
                with open(os.path.join(directory, name)) as handle:
                    count = sum(1 for _line in handle)
                if count > MAX_LINES:
                    long_files.append('%s: %d' % (os.path.relpath(os.path.join(directory, name), PLUGINS), count))
    assert long_files == []


def test_the_leaves_import_only_leaves():
    files = core_files()
    for leaf in LEAVES:
        assert leaf in files, leaf
        assert imports_of(leaf, files[leaf], files)[0] <= set(LEAVES), leaf


def test_the_core_import_graph_has_no_cycle():
    files = core_files()
    graph = dict((name, imports_of(name, path, files)[0]) for name, path in files.items())
    # a package face (__init__) re-exports its submodules: an edge into the package from one of its own
    # submodules is an import of a sibling through the face, not a cycle of layers
    for name in graph:
        graph[name] = set(d for d in graph[name] if not name.startswith(d + '.') and d != '__init__')
    state, cycle = {}, []

    def visit(node, path):
        state[node] = 'open'
        for dep in sorted(graph[node]):
            if state.get(dep) == 'open':
                cycle.append(path + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 'done'

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycle == []
