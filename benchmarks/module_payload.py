#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Module payloads: what AnsiballZ ships for each gpu_* module, and what the node spends importing it.

    PATH=/tmp/venv/bin:$PATH benchmarks/module_payload.py [--reps 7] [--modules gpu_facts,gpu_kill]
        [--tree LABEL=COLLECTIONS_PATH ...] [--calls] [--json out.json]

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

``--calls``: the node's CPU for whole calls, as a node runs them: the AnsiballZ wrappers of
``ansible.builtin.ping``, ``gpu_facts`` and ``gpu_kill rogue=true`` (check mode, and confirmed: it kills
the disguised miner, gpusim's own workload, respawned before the next call) run on one simulated node
of tests/fleet (``fleet_cleanup.fleet_up``), CPU from ``wait4`` (the watchdog child included),
interleaved over every tree, minimum and median of ``--reps``.
"""

from __future__ import annotations

import argparse
import base64
import glob
import io
import json
import os
import re
import shlex
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


def build_payload(collections, module, work, args='vendor=none-such', check=False, fqcn=None, inventory=None):
    """The AnsiballZ wrapper text and zip bytes that ``ansible`` sends for ``module`` (``fqcn``: default
    gpufleet.reclaim.MODULE) with the arguments ``args`` (default: one every module rejects), to localhost,
    or with ``inventory`` (a tests/fleet one) to its node01."""
    remote = tempfile.mkdtemp(prefix='remote-', dir=work)
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=collections, ANSIBLE_KEEP_REMOTE_FILES='1', ANSIBLE_REMOTE_TMP=remote,
               ANSIBLE_PIPELINING='False', ANSIBLE_LOCALHOST_WARNING='False', ANSIBLE_HOME=os.path.join(work, 'home'),
               ANSIBLE_LOCAL_TEMP=os.path.join(work, 'local'))
    target = ['node01', '-i', inventory, '-e', 'ansible_pipelining=false'] if inventory else [
        'localhost', '-c', 'local', '-e', 'ansible_python_interpreter=%s' % sys.executable]
    argv = [common.ansible_bin()] + target + ['-m', fqcn or 'gpufleet.reclaim.%s' % module, '-a', args] + (['--check'] if check else [])
    subprocess.run(argv, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=300)
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


# Whole calls on a simulated node (--calls): name, module, fqcn, arguments, check mode, whether it kills the miner
CALLS = (
    ('ping', 'ping', 'ansible.builtin.ping', '', False, False),
    ('gpu_facts', 'gpu_facts', None, '', False, False),
    ('gpu_kill rogue, check mode', 'gpu_kill', None, 'rogue=true force=true timeout=5', True, False),
    ('gpu_kill rogue, confirmed', 'gpu_kill', None, 'rogue=true force=true timeout=5', False, True),
)
# Runs on the node (argv: a JSON list of [key, wrapper path, kills] and the repetitions): one miner is up before
# each call (respawned after a call that killed it), each wrapper runs as the node runs it; prints {key: [CPU s]}.
NODE_RUNNER = r'''
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import common
wrappers, reps, miner = json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
cpu = dict((key, []) for key, _path, _kills in wrappers)
up = False
for rep in range(reps):
    shift = rep % len(wrappers)
    for key, path, kills in wrappers[shift:] + wrappers[:shift]:
        if not up:
            subprocess.run(['gpusim', 'spawn', '--gpu', '0', '--mib', '2048', '--util', '100', '--user', 'nobody', '--'] + miner,
                           check=True, stdout=subprocess.DEVNULL)
            up = True
        meas = common.run_child([sys.executable, path])
        result = json.loads(meas.text())
        if meas.returncode != 0 or result.get('failed') or (kills and not result.get('killed')):
            sys.exit('%s: exit %s: %s' % (key, meas.returncode, meas.text()[-500:]))
        up = up and not kills
        cpu[key].append(meas.cpu_s)
print(json.dumps(cpu))
'''


def measure_calls(trees, reps, log=print):
    """{tree: {call: CPU figures}}: each call of CALLS run whole on one simulated node of tests/fleet (its own
    PID and mount namespace, 2 GPUs, one disguised miner that the confirmed gpu_kill kills and that is
    respawned before the next call): the AnsiballZ wrapper as the node runs it (its zip written, imported
    from, the module's work, the watchdog child), CPU from ``wait4``, interleaved over every tree."""
    from fleet_cleanup import MINER, fleet_down, fleet_up  # pylint: disable=import-outside-toplevel
    work = tempfile.mkdtemp(prefix='gpufleet-bench-calls-')
    os.chmod(work, 0o755)
    fleet = os.path.join(work, 'fleet')
    try:
        fleet_up(fleet, 1)
        inventory = os.path.join(fleet, 'inventory.ini')
        wrappers = []
        for label, collections in trees:
            for name, module, fqcn, args, check, kills in CALLS:
                wrapper, _data = build_payload(collections, module, work, args=args, check=check, fqcn=fqcn, inventory=inventory)
                path = os.path.join(work, 'wrapper-%d.py' % len(wrappers))
                with open(path, 'w', encoding='utf-8') as handle:
                    handle.write(wrapper)
                wrappers.append(['%s/%s' % (label, name), path, kills])
        log('%d wrappers built; %d interleaved rounds on the node' % (len(wrappers), reps))
        remote = [sys.executable, '-c', NODE_RUNNER, HERE, json.dumps(wrappers), str(reps), json.dumps(MINER)]
        out = subprocess.run(['ssh', '-F', os.path.join(fleet, 'ssh_config'), 'node01', ' '.join(shlex.quote(a) for a in remote)],
                             stdout=subprocess.PIPE, universal_newlines=True, check=True, timeout=3600).stdout
        cpu = json.loads(out.strip().splitlines()[-1])
    finally:
        fleet_down(fleet)
        shutil.rmtree(work, ignore_errors=True)
    result = {}
    for label, _path in trees:
        for name, _module, _fqcn, _args, _check, _kills in CALLS:
            values = cpu['%s/%s' % (label, name)]
            result.setdefault(label, {})[name] = {'cpu_ms_min': round(min(values) * 1000, 1),
                                                  'cpu_ms_median': round(common.stats(values)['median'] * 1000, 1)}
    return result


def calls_markdown(result):
    lines = ['| call | tree | CPU ms (min) | CPU ms (median) | min / ping |', '|---|---|---|---|---|']
    for name, _module, _fqcn, _args, _check, _kills in CALLS:
        for label, figs in result.items():
            fig = figs[name]
            ratio = fig['cpu_ms_min'] / figs['ping']['cpu_ms_min']
            lines.append('| %s | %s | %.0f | %.0f | %.2f |' % (name, label, fig['cpu_ms_min'], fig['cpu_ms_median'], ratio))
    return '\n'.join(lines)


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
    parser.add_argument('--calls', action='store_true',
                        help='also time whole calls (ping, gpu_facts, gpu_kill rogue=true) on a simulated node (needs make sim)')
    parser.add_argument('--json', help='write the figures here')
    args = parser.parse_args(argv)
    if args.calls and not os.path.isfile(common.SHIM):
        sys.exit('--calls: the simulator is not built: run "make sim"')
    if common.ansible_bin() is None:
        sys.exit('ansible is not installed next to %s nor on PATH' % sys.executable)
    modules = [m for m in args.modules.split(',') if m]
    for module in modules:
        if module not in MODULES:
            sys.exit('--modules: invalid value %r: expected some of %s' % (module, ', '.join(MODULES)))
    trees, private, calls = common.parse_trees(args.tree), None, None
    try:
        if not trees:
            private = common.private_collections()
            trees.append(('this', private))
        result = measure(trees, modules, args.reps)
        calls = measure_calls(trees, args.reps) if args.calls else None
    finally:
        if private:
            shutil.rmtree(private, ignore_errors=True)
    print(markdown(result, modules))
    if calls is not None:
        print()
        print(calls_markdown(calls))
    print('# load average after: %.2f %.2f %.2f' % os.getloadavg())
    common.write_json(args.json, {'trees': dict(trees), 'reps': args.reps, 'figures': result, 'calls': calls, 'load': os.getloadavg()})
    return 0


if __name__ == '__main__':
    sys.exit(main())
