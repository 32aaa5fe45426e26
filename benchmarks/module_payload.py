#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Module payloads: what AnsiballZ ships for each gpu_* module, and what the node spends importing it.

    PATH=/tmp/venv/bin:$PATH benchmarks/module_payload.py [--reps 7] [--modules gpu_facts,gpu_kill]
        [--tree LABEL=COLLECTIONS_PATH ...] [--json out.json]

For each module and each collection tree (default: this checkout, through a private
``ANSIBLE_COLLECTIONS_PATH``; ``--tree`` compares others in the same run, e.g. a checkout of main),
``ansible localhost -m MODULE`` runs once with ``ANSIBLE_KEEP_REMOTE_FILES=1`` and pipelining off
and an argument every module rejects before it reads anything (``vendor=none-such``), so the
AnsiballZ wrapper stays on disk and nothing on this machine is touched.  From the wrapper: its size
(what goes over SSH per node and call), the zip's size, the number of Python files in it and of
ours (``ansible_collections/gpufleet/``) with their source bytes, and which of ours the module does
not import at load time (shipped for a code path the call may not take).

Node-side import cost: ``python -c 'import <the module>'`` with the zip as PYTHONPATH (zipimport
compiles every file from source, as on a node), CPU time (user + system, ``wait4``), minimum over
``--reps`` interleaved runs, against ``python -c 'import ansible.module_utils.basic'`` (what
``ansible.builtin.ping`` imports) from the same zip: the difference is what our module adds.
"""

from __future__ import annotations

import argparse
import base64
import glob
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

MODULES = ('gpu_facts', 'gpu_kill', 'gpu_audit', 'gpu_reset', 'gpu_remediate')
OURS = 'ansible_collections/gpufleet/'
BASELINE = 'ansible.module_utils.basic'
LIST_OURS = 'import sys, %s; print(" ".join(m for m in sys.modules if m.startswith("ansible_collections.gpufleet")))'


def ansible_bin():
    here = os.path.join(os.path.dirname(sys.executable), 'ansible')
    return here if os.access(here, os.X_OK) else shutil.which('ansible')


def build_payload(collections, module, work):
    """The AnsiballZ wrapper text and zip bytes that ``ansible`` sends for ``module``."""
    remote = tempfile.mkdtemp(prefix='remote-', dir=work)
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=collections, ANSIBLE_KEEP_REMOTE_FILES='1', ANSIBLE_REMOTE_TMP=remote,
               ANSIBLE_PIPELINING='False', ANSIBLE_LOCALHOST_WARNING='False', ANSIBLE_HOME=os.path.join(work, 'home'),
               ANSIBLE_LOCAL_TEMP=os.path.join(work, 'local'))
    subprocess.run([ansible_bin(), 'localhost', '-c', 'local', '-e', 'ansible_python_interpreter=%s' % sys.executable,
                    '-m', 'gpufleet.reclaim.%s' % module, '-a', 'vendor=none-such'], env=env, cwd=work,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=300)
    found = glob.glob(os.path.join(remote, '*', 'AnsiballZ_%s.py' % module))
    if not found:
        raise SystemExit('no AnsiballZ wrapper for %s under %s (is ansible-core installed?)' % (module, remote))
    with open(found[0], encoding='utf-8') as handle:
        wrapper = handle.read()
    shutil.rmtree(remote, ignore_errors=True)
    return wrapper, base64.b64decode(re.search(r"zip_data='([^']*)'", wrapper).group(1))


def measure(trees, modules, reps, log=print):
    """{tree: {module: figures}}."""
    work = tempfile.mkdtemp(prefix='gpufleet-bench-payload-')
    out = dict((label, {}) for label, _path in trees)
    commands = {}
    try:
        for label, collections in trees:
            for module in modules:
                wrapper, data = build_payload(collections, module, work)
                zpath = os.path.join(work, '%s-%s.zip' % (label, module))
                with open(zpath, 'wb') as handle:
                    handle.write(data)
                archive = zipfile.ZipFile(io.BytesIO(data))
                names = [n for n in archive.namelist() if n.endswith('.py')]
                ours = [n for n in names if n.startswith(OURS)]
                fqn = 'ansible_collections.gpufleet.reclaim.plugins.modules.%s' % module
                env = dict(os.environ, PYTHONPATH=zpath, PYTHONDONTWRITEBYTECODE='1')
                loaded = subprocess.run([sys.executable, '-c', LIST_OURS % fqn], env=env, stdout=subprocess.PIPE,
                                        universal_newlines=True, check=True).stdout.split()
                shipped = set(n[:-3].replace('/', '.').replace('.__init__', '') for n in ours)
                out[label][module] = {
                    'wrapper_bytes': len(wrapper), 'zip_bytes': len(data), 'py_files': len(names), 'our_files': len(ours),
                    'our_source_bytes': sum(archive.getinfo(n).file_size for n in ours), 'our_imported': len(loaded),
                    'shipped_not_imported': sorted(m.split('module_utils.', 1)[-1] for m in shipped - set(loaded)),
                }
                commands['%s/%s' % (label, module)] = ([sys.executable, '-c', 'import %s' % fqn], env)
                commands['%s/%s/basic' % (label, module)] = ([sys.executable, '-c', 'import %s' % BASELINE], env)
                log('%s %s: %d bytes over the wire, %d of our files shipped, %d imported'
                    % (label, module, len(wrapper), len(ours), len(loaded)))
        runs, notes = common.interleaved(commands, sorted(commands), reps)
        for name, entries in runs.items():
            if notes[name]:
                raise SystemExit('%s: %s' % (name, notes[name]))
        for label, _path in trees:
            for module in modules:
                key = '%s/%s' % (label, module)
                mine = [e['cpu_s'] for e in runs[key]]
                base = [e['cpu_s'] for e in runs[key + '/basic']]
                fig = out[label][module]
                fig['import_cpu_ms'] = round(min(mine) * 1000, 1)
                fig['basic_cpu_ms'] = round(min(base) * 1000, 1)
                fig['ours_cpu_ms'] = round((min(mine) - min(base)) * 1000, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def markdown(result, modules):
    lines = ['| module | tree | bytes sent per call | our files shipped (source KiB) | imported at load | '
             'import CPU ms (min) | of which ours | shipped, not imported at load |', '|---|---|---|---|---|---|---|---|']
    for module in modules:
        for label, figs in result.items():
            fig = figs[module]
            lines.append('| %s | %s | %d | %d (%.0f) | %d | %.0f | %.0f | %s |' % (
                module, label, fig['wrapper_bytes'], fig['our_files'], fig['our_source_bytes'] / 1024.0, fig['our_imported'],
                fig['import_cpu_ms'], fig['ours_cpu_ms'], ', '.join(fig['shipped_not_imported']) or '-'))
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=7)
    parser.add_argument('--modules', default=','.join(MODULES))
    parser.add_argument('--tree', action='append', default=[], metavar='LABEL=COLLECTIONS_PATH',
                        help='a collection tree to measure (default: this checkout as "this")')
    parser.add_argument('--json', help='write the figures here')
    args = parser.parse_args(argv)
    if ansible_bin() is None:
        sys.exit('ansible is not installed next to %s nor on PATH' % sys.executable)
    modules = [m for m in args.modules.split(',') if m]
    for module in modules:
        if module not in MODULES:
            sys.exit('--modules: invalid value %r: expected some of %s' % (module, ', '.join(MODULES)))
    trees, private = [], None
    for spec in args.tree:
        label, sep, path = spec.partition('=')
        if not sep or not os.path.isdir(os.path.join(path, 'ansible_collections', 'gpufleet', 'reclaim')):
            sys.exit('--tree: invalid value %r: expected LABEL=PATH, PATH holding ansible_collections/gpufleet/reclaim' % spec)
        trees.append((label, path))
    try:
        if not trees:
            private = tempfile.mkdtemp(prefix='gpufleet-bench-coll-')
            os.makedirs(os.path.join(private, 'ansible_collections', 'gpufleet'))
            os.symlink(common.ROOT, os.path.join(private, 'ansible_collections', 'gpufleet', 'reclaim'))
            trees.append(('this', private))
        result = measure(trees, modules, args.reps)
    finally:
        if private:
            shutil.rmtree(private, ignore_errors=True)
    print(markdown(result, modules))
    print('# load average after: %.2f %.2f %.2f' % os.getloadavg())
    common.write_json(args.json, {'trees': dict(trees), 'reps': args.reps, 'figures': result, 'load': os.getloadavg()})
    return 0


if __name__ == '__main__':
    sys.exit(main())
