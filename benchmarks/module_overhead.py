#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Module overhead: ``ansible localhost -m gpufleet.reclaim.gpu_facts`` against the bare core call.

On one simulated node (8 GPUs, ``--gpu-processes`` workloads), each repetition runs, in a rotating
order:

* ``ping``: ``ansible localhost -m ansible.builtin.ping``, Ansible's floor (controller start-up,
  inventory, a forked worker, AnsiballZ, the module process);
* ``probe``: a throw-away module (in a temp collection ``gpufleetbench.probe``) that imports exactly
  what gpu_facts imports from our module_utils and returns: Ansible's floor plus bundling our
  module_utils into AnsiballZ and importing them;
* ``facts``: ``ansible localhost -m gpufleet.reclaim.gpu_facts`` (the collection through a private
  ``ANSIBLE_COLLECTIONS_PATH`` that links to this tree: no ``make collection`` needed);
* ``core``: ``take_snapshot().to_facts()`` as JSON in a bare ``python`` (byte-compiled core);
* ``core_src``: the same from sources that have no byte code, as AnsiballZ runs module_utils
  (zipimport compiles every imported file on every run).

Both ansible commands use ``ansible_connection=local`` and the interpreter running this script
(``ansible_python_interpreter``), with the node's shim environment.  Reported: wall and CPU time
(children included) and peak RSS, median and spread; per-repetition differences facts - ping
(what our module adds to Ansible's floor) and ratios facts / ping, ping / facts (Ansible's share).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

ROWS = ('ping', 'probe', 'facts', 'core', 'core_src')
LABELS = {
    'ping': 'ansible localhost -m ansible.builtin.ping',
    'probe': 'ansible localhost -m (a module importing what gpu_facts imports, doing nothing)',
    'facts': 'ansible localhost -m gpufleet.reclaim.gpu_facts',
    'core': 'core take_snapshot() + facts JSON, bare python',
    'core_src': 'the same, compiled from source each run',
}
PROBE_MODULE = '''#!/usr/bin/python
from __future__ import annotations
DOCUMENTATION = "module: probe\\nshort_description: benchmark probe\\ndescription: [benchmark probe]\\nauthor: [benchmark]\\n"
from ansible.module_utils.basic import AnsibleModule
# what gpu_facts imports
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import watchdog
from ansible_collections.gpufleet.reclaim.plugins.module_utils.gpu_module import gpu_options, run_module


def main():
    module = AnsibleModule(argument_spec=dict(), supports_check_mode=True)
    module.exit_json(changed=False, imported=[take_snapshot is not None, watchdog is not None, gpu_options is not None, run_module is not None])


if __name__ == '__main__':
    main()
'''

CORE_CODE = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from core.snapshot import take_snapshot
facts = take_snapshot().to_facts()
print(json.dumps({'processes': len(facts['processes']), 'devices': len(facts['devices'])}))
'''


def _seen(row, text):
    """GPU processes a row's output reports (None when it cannot tell)."""
    try:
        if row in ('core', 'core_src'):
            return json.loads(text.strip().splitlines()[-1])['processes']
        if row == 'facts' or row.startswith('facts@'):  # the ad-hoc (minimal) callback: localhost | SUCCESS => {...}
            data = json.loads(text[text.index('{', text.index('SUCCESS =>')):text.rindex('}') + 1])
            return len(data['ansible_facts']['gpu']['processes'])
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return None


def tree_row(label):
    """The row of gpu_facts from another collection tree (``--tree LABEL=PATH``)."""
    return 'facts@' + label


def run(gpu_processes=10, reps=5, rows=ROWS, log=print, trees=()):
    """Returns a JSON-able dict: per row figures, and per-repetition differences and ratios.

    ``trees``: (label, collections path) pairs; each adds a row running gpu_facts from that tree, in the
    same rotation (e.g. main beside this change), with its own ratio to ping."""
    started = time.monotonic()
    ansible = common.ansible_bin()
    base = tempfile.mkdtemp(prefix='gpufleet-bench-mod-')
    node = None
    all_rows = ROWS + tuple(tree_row(label) for label, _path in trees)
    runs = dict((row, []) for row in all_rows)
    notes = dict((row, []) for row in all_rows)
    try:
        coll = os.path.join(base, 'collections', 'ansible_collections', 'gpufleet')
        os.makedirs(coll)
        os.symlink(common.ROOT, os.path.join(coll, 'reclaim'))
        probe = os.path.join(base, 'collections', 'ansible_collections', 'gpufleetbench', 'probe')
        os.makedirs(os.path.join(probe, 'plugins', 'modules'))
        with open(os.path.join(probe, 'galaxy.yml'), 'w') as handle:
            handle.write('namespace: gpufleetbench\nname: probe\nversion: 1.0.0\nreadme: README.md\nauthors: [bench]\n')
        with open(os.path.join(probe, 'plugins', 'modules', 'core_import.py'), 'w') as handle:
            handle.write(PROBE_MODULE)
        compiled = os.path.join(base, 'compiled')
        source = os.path.join(base, 'source')
        for where in (compiled, source):
            shutil.copytree(os.path.join(common.MODULE_UTILS, 'core'), os.path.join(where, 'core'),
                            ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
        subprocess.run([sys.executable, '-m', 'compileall', '-q', os.path.join(compiled, 'core')], stdout=subprocess.DEVNULL, check=True)
        inventory = os.path.join(base, 'inventory.ini')
        with open(inventory, 'w') as handle:
            handle.write('localhost ansible_connection=local ansible_python_interpreter=%s\n' % sys.executable)
        node = common.SimNode(gpus=8)
        if gpu_processes:
            node.spawn_many(gpu_processes)
        env = node.env()
        env.update({'ANSIBLE_COLLECTIONS_PATH': os.path.join(base, 'collections'), 'ANSIBLE_DEPRECATION_WARNINGS': 'False',
                    'ANSIBLE_LOCALHOST_WARNING': 'False', 'ANSIBLE_INVENTORY_UNPARSED_WARNING': 'False',
                    'ANSIBLE_LOCAL_TEMP': os.path.join(base, 'ansible-tmp'), 'ANSIBLE_HOME': os.path.join(base, 'ansible-home')})
        env_src = dict(env, PYTHONDONTWRITEBYTECODE='1')
        commands = {
            'ping': ([ansible, 'localhost', '-i', inventory, '-m', 'ansible.builtin.ping'], env),
            'probe': ([ansible, 'localhost', '-i', inventory, '-m', 'gpufleetbench.probe.core_import'], env),
            'facts': ([ansible, 'localhost', '-i', inventory, '-m', 'gpufleet.reclaim.gpu_facts'], env),
            'core': ([sys.executable, '-c', CORE_CODE, compiled], env),
            'core_src': ([sys.executable, '-c', CORE_CODE, source], env_src),
        }
        for label, path in trees:
            commands[tree_row(label)] = ([ansible, 'localhost', '-i', inventory, '-m', 'gpufleet.reclaim.gpu_facts'],
                                         dict(env, ANSIBLE_COLLECTIONS_PATH=path))
        if ansible is None:
            for row in ('ping', 'probe', 'facts') + tuple(tree_row(label) for label, _path in trees):
                notes[row].append('ansible is not installed next to %s nor on PATH' % sys.executable)
                commands[row] = (None, env)
        rows = [row for row in all_rows if row in rows or row.startswith('facts@')]
        got, more = common.interleaved(commands, rows, reps, lambda row, meas: {'seen': _seen(row, meas.text())})
        for row in rows:
            runs[row] = got[row]
            notes[row].extend(more[row])
    finally:
        common.cleanup(node=node, base=base)
    labels = dict(LABELS, **dict((tree_row(label), '%s, from %s (%s)' % (LABELS['facts'], label, path)) for label, path in trees))
    result = {'gpu_processes': gpu_processes, 'reps': reps, 'labels': labels, 'rows': {}, 'derived': {},
              'ansible': common.dist_version('ansible-core'), 'seconds': None}
    for row in all_rows:
        if not runs[row]:
            result['rows'][row] = {'notes': notes[row] or ['not selected']}
        else:
            result['rows'][row] = common.figures(runs[row], notes[row])
    derived = result['derived']
    if runs['ping'] and runs['facts']:
        for key in ('cpu_s', 'wall_s'):
            facts = [e[key] for e in runs['facts']]
            ping = [e[key] for e in runs['ping']]
            derived.setdefault('facts_minus_ping', {})[key] = common.stats([a - b for a, b in zip(facts, ping)])
            derived.setdefault('facts_over_ping', {})[key] = common.stats(common.ratios(facts, ping))
            if runs['core']:
                core = [e[key] for e in runs['core']]
                derived.setdefault('facts_over_core', {})[key] = common.stats(common.ratios(facts, core))
                derived.setdefault('facts_minus_ping_minus_core', {})[key] = common.stats(
                    [f - p - c for f, p, c in zip(facts, ping, core)])
    for label, _path in trees:
        if runs['ping'] and runs[tree_row(label)]:
            for key in ('cpu_s', 'wall_s'):
                derived.setdefault('facts@%s_over_ping' % label, {})[key] = common.stats(common.ratios(
                    [e[key] for e in runs[tree_row(label)]], [e[key] for e in runs['ping']]))
    if runs['ping'] and runs['probe'] and runs['facts']:
        for key in ('cpu_s', 'wall_s'):
            probe = [e[key] for e in runs['probe']]
            derived.setdefault('probe_minus_ping', {})[key] = common.stats([a - b for a, b in zip(probe, [e[key] for e in runs['ping']])])
            derived.setdefault('facts_minus_probe', {})[key] = common.stats([a - b for a, b in zip([e[key] for e in runs['facts']], probe)])
    if runs['core'] and runs['core_src']:
        derived['core_src_minus_core'] = {'cpu_s': common.stats(
            [s - c for s, c in zip([e['cpu_s'] for e in runs['core_src']], [e['cpu_s'] for e in runs['core']])])}
    result['seconds'] = time.monotonic() - started
    return result


def markdown(result):
    lines = ['| command | CPU ms | wall ms | peak RSS MiB | GPU processes reported |', '|---|---|---|---|---|']
    for row in result['rows']:
        fig = result['rows'].get(row, {})
        if 'cpu_s' not in fig:
            lines.append('| %s | not run: %s | | | |' % (result['labels'][row], '; '.join(fig.get('notes') or ['?'])))
            continue
        seen = '-' if fig['seen'] is None else fig['seen']
        cells = (result['labels'][row], common.fmt(fig['cpu_s'], 1000), common.fmt(fig['wall_s'], 1000), common.fmt(fig['maxrss_kib'], 1 / 1024.0, 1),
                 seen, result['gpu_processes'])
        lines.append('| %s | %s | %s | %s | %s of %d |' % cells)
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--gpu-processes', type=int, default=10)
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--tree', action='append', default=[], metavar='LABEL=COLLECTIONS_PATH',
                        help='also gpu_facts from this collection tree, in the same rotation (e.g. before=a checkout of main)')
    parser.add_argument('--json', help='write the figures here')
    args = parser.parse_args(argv)
    if not os.path.isfile(common.SHIM):
        sys.exit('the simulator is not built: run "make sim"')
    trees = common.parse_trees(args.tree)
    result = run(args.gpu_processes, args.reps, trees=trees)
    print(markdown(result))
    for name, figs in sorted(result['derived'].items()):
        for key, stat in sorted(figs.items()):
            ratio = '_over_' in name
            print('# %s %s: %s' % (name, key, common.fmt(stat, 1 if ratio else 1000, 2 if ratio else 0, '' if ratio else ' ms')))
    common.write_json(args.json, result)
    return 0


if __name__ == '__main__':
    sys.exit(main())
