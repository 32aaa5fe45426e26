#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Hostile load (issue #28): a guard tick, a Slurm prolog and gpu_facts while a user holds millions of descriptors.

One simulated node (8 GPUs, ``--gpu-procs`` workloads holding its fake device files) and, in turn, each load:

* ``unloaded``: nothing else (measured first and again last: the ratios' denominator is both);
* ``N descriptors``: processes of a user holding ``--per-process`` descriptors of /dev/null each (the
  shape of the issue: 50 x 19,990 for 1 M), as many as make N (``--descriptors``, default 1 M and 5 M);
* ``N idle processes``: ``--idle`` processes doing nothing (three descriptors each).

Measured per load, commands interleaved, ``--reps`` times: ``gpufleet-guard tick --dry-run`` (the agent
as the guard role installs it, a dry-run policy with a rule every tick finds violated), ``gpufleet-guard
prolog --dry-run --no-drain`` (a job on GPU 0; ``squeue`` and ``scontrol`` are two-line scripts that answer
no job and no pids) and the gpu_facts module as Ansible's module process runs it (an arguments file, no
controller).  Each: wall and CPU time (wait4, children included), and from its output the holder scan's
``holders_incomplete`` (processes left unread, descriptors read): the counted work.  Ratios: the median
of a load over the median of the unloaded runs, per command.  Goals (issue #28): at most 2x with 1 M
descriptors, and a prolog under 5 s at 5 M.

``--checkout LABEL=DIR`` measures another checkout too (its core and modules; e.g. the main branch before
the bound), side by side.  Run as root: the script runs itself in a PID namespace of its own
(``unshare --pid --fork --mount-proc``), so /proc holds exactly the node's processes and the loads.
Only processes this script started are signalled: the loads through their forker (common.Sleepers,
which SIGKILLs and reaps its own children), the GPU workloads through ``gpusim kill-all`` (which checks
their recorded start times).  RLIMIT_NOFILE: the loads raise their soft limit to the hard one, and root
with CAP_SYS_RESOURCE raises the hard one as far as ``fs.nr_open``; ``--per-process`` is cut to what fits.

Usage: benchmarks/hostile_load.py [--reps N] [--descriptors 1000000,5000000] [--idle 20000] [--per-process 19990]
                                  [--gpu-procs 16] [--loads LIST] [--checkout LABEL=DIR] [--json PATH] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import stat
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

SECTION = 'hostile_load results'
TITLE = '## Hostile load: what users hold against the tick, the prolog and gpu_facts (issue #28, `benchmarks/hostile_load.py`)'
GOAL_RATIO = 2.0          # at most 2x the unloaded run with 1 M descriptors
GOAL_PROLOG_S = 5.0       # a prolog under 5 s at 5 M descriptors
COMMANDS = ('tick', 'prolog', 'gpu_facts')
POLICY = '''\
mode: dry-run
defaults:
  max_gpus: 1
escalation: {warn_again_after: 5m, act_after: 10m, sigkill_after: 30s}
notify: {tty: false}
'''
SQUEUE = '#!/bin/sh\nprintf \'{"jobs": []}\\n\'\n'
SCONTROL = '#!/bin/sh\n[ "$1" = listpids ] && echo "PID      JOBID    STEPID   LOCALID GLOBALID"\nexit 0\n'
# the agent's commands with the simulated node's device root (the prolog has no --dev-root: it reads /dev)
AGENT_CODE = ('import gc, sys\ngc.disable()\nsys.path.insert(0, sys.argv[1])\nimport gpufleet_core.processes as p\n'
              'p.DEFAULT_DEV_ROOTS = (sys.argv[2],)\nfrom gpufleet_core.cli import main\nsys.exit(main(sys.argv[3:]))\n')
MODULE_CODE = ('import runpy, sys\nsys.path.insert(0, sys.argv[1])\n'
               'from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes\n'
               'processes.DEFAULT_DEV_ROOTS = (sys.argv[2],)\nsys.argv = ["gpu_facts", sys.argv[3]]\n'
               'runpy.run_module("ansible_collections.gpufleet.reclaim.plugins.modules.gpu_facts", run_name="__main__")\n')


def log(text):
    sys.stdout.write(text + '\n')
    sys.stdout.flush()


class Checkout(object):
    """One tree measured: the agent installed from its core, its modules through a private collection path."""

    def __init__(self, label, root, base, node):
        self.label, self.root = label, root
        self.agent = common.Agent(os.path.join(base, label), policy=POLICY, core=os.path.join(root, 'plugins', 'module_utils', 'core'))
        self.collections = common.private_collections(root)
        self.args = os.path.join(base, label, 'gpu_facts-args.json')
        with open(self.args, 'w') as handle:
            json.dump({'ANSIBLE_MODULE_ARGS': {'vendor': 'nvidia'}}, handle)
        self.node = node

    def argv(self, command):
        if command == 'tick':
            return self.agent.code(AGENT_CODE, self.node.dev, 'tick', '--json', '--dry-run', '--root', self.agent.root,
                                   '--vendor', 'nvidia', '--dev-root', self.node.dev)
        if command == 'prolog':
            return self.agent.code(AGENT_CODE, self.node.dev, 'prolog', '--json', '--dry-run', '--no-drain', '--root',
                                   self.agent.root, '--vendor', 'nvidia')
        return [sys.executable, '-c', MODULE_CODE, self.collections, self.node.dev, self.args]

    def close(self):
        shutil.rmtree(self.collections, ignore_errors=True)


def fake_slurm(base):
    """A directory with ``squeue`` and ``scontrol`` scripts (no job, no pids) to put first on PATH."""
    directory = os.path.join(base, 'slurm-bin')
    os.makedirs(directory)
    for name, text in (('squeue', SQUEUE), ('scontrol', SCONTROL)):
        path = os.path.join(directory, name)
        with open(path, 'w') as handle:
            handle.write(text)
        os.chmod(path, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    return directory


def scan_figures(command, text):
    """From a command's output: {'unread': processes the holder scan left, 'read': descriptors it read} (None: none
    reported), and the prolog's own ``seconds``."""
    start = text.find('{')
    if start < 0:
        return {}
    try:
        data, _end = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return {}
    found = data.get('holders_incomplete')
    if command == 'gpu_facts':
        found = ((data.get('ansible_facts') or {}).get('gpu') or {}).get('holders_incomplete')
    out = {'unread': found.get('processes') if found else 0, 'read': found.get('read') if found else None}
    if command == 'prolog':
        out['seconds'] = data.get('seconds')
    return out


def mem_available_gib():
    with open('/proc/meminfo') as handle:
        for line in handle:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) / 1024.0 / 1024.0
    return None


def per_process_fds(wanted):
    """What one load process can hold: ``wanted``, cut to the hard RLIMIT_NOFILE (root may raise it to fs.nr_open)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        with open('/proc/sys/fs/nr_open') as handle:
            nr_open = int(handle.read())
    except (OSError, ValueError):
        nr_open = hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nr_open, nr_open))
        hard = nr_open
    except (ValueError, OSError):
        pass
    return max(1, min(wanted, (hard if hard != resource.RLIM_INFINITY else wanted + 3) - 3))


def start_load(kind, amount, per):
    """(Sleepers holding the load, what it is): ``descriptors`` in processes of ``per``, or ``idle`` processes."""
    load = common.Sleepers()
    if kind == 'descriptors':
        processes = -(-amount // per)
        load.resize(processes, per)
        deadline = time.monotonic() + 600   # the children dup2 their descriptors after the fork: wait until they hold them
        held = load.descriptors()
        while held < processes * (per + 3) and time.monotonic() < deadline:
            time.sleep(0.2)
            held = load.descriptors()
        return load, {'processes': processes, 'descriptors': held}
    load.resize(amount)
    return load, {'processes': amount, 'descriptors': load.descriptors()}


def measure(args):
    info = common.machine_info()
    info['mem_available_gib'] = mem_available_gib()
    base = tempfile.mkdtemp(prefix='gpufleet-bench-hostile-')
    node = load = None
    checkouts = []
    try:
        node = common.SimNode(gpus=8)
        node.spawn_many(args.gpu_procs, mib=1024, argv=('python', 'train.py'))
        checkouts = [Checkout(label, root, base, node) for label, root in [('this', common.ROOT)] + args.checkouts]
        env = node.env()
        env.update(PATH=fake_slurm(base) + ':' + env['PATH'], SLURM_JOB_ID='4242', SLURM_JOB_GPUS='0', SLURM_JOB_UID='0',
                   SLURMD_NODENAME='bench')
        for checkout in checkouts:   # the first tick creates the state and the history
            warm = common.run_child(checkout.argv('tick'), env=env, timeout=300)
            if warm.returncode not in (0, 1):
                raise RuntimeError('%s: the warm-up tick failed: %s' % (checkout.label, warm.text()[-2000:]))
        per = per_process_fds(args.per_process)
        plan = [('unloaded', None, 0)] + [('%s descriptors' % _amount(n), 'descriptors', n) for n in args.descriptors]
        plan += [('%s idle processes' % _amount(args.idle), 'idle', args.idle)] if args.idle else []
        plan.append(('unloaded again', None, 0))
        rows = []
        for name, kind, amount in plan:
            if kind is not None and kind not in args.loads:
                continue
            load, what = start_load(kind, amount, per) if kind else (None, {'processes': 0, 'descriptors': 0})
            try:
                what.update(name=name, kind=kind or 'unloaded', amount=amount, per_process=per if kind == 'descriptors' else None,
                            host_processes=common.process_count(), mem_available_gib=mem_available_gib(), load1=os.getloadavg()[0])
                log('# %s: %d processes, %d descriptors held (%d processes in /proc, %.1f GiB available)' % (
                    name, what['processes'], what['descriptors'], what['host_processes'], what['mem_available_gib'] or 0))
                rows.append(dict(what, cells=measure_load(checkouts, env, args.reps)))
            finally:
                if load is not None:
                    load.stop()
        return {'machine': info, 'gpu_procs': args.gpu_procs, 'reps': args.reps, 'per_process': per, 'rows': rows,
                'nofile_hard': resource.getrlimit(resource.RLIMIT_NOFILE)[1],
                'checkouts': [c.label for c in checkouts], 'isolated': common.isolated(), 'load_end': os.getloadavg()}
    finally:
        for checkout in checkouts:
            checkout.close()
        common.cleanup(load, node, base)


def measure_load(checkouts, env, reps):
    """{checkout: {command: figures}} for the node as it is now; the commands interleaved (common.interleaved)."""
    commands, names = {}, []
    for checkout in checkouts:
        for command in COMMANDS:
            key = '%s %s' % (checkout.label, command)
            commands[key] = (checkout.argv(command), env)
            names.append(key)

    def inspect(key, meas):
        return scan_figures(key.split(' ', 1)[1], meas.text())

    runs, notes = common.interleaved(commands, names, reps, inspect=inspect, ok=lambda key, meas: meas.returncode in (0, 1),
                                     timeout=900)
    cells = {}
    for key in names:
        label, command = key.split(' ', 1)
        fig = common.figures(runs[key], notes[key])
        fig['unread'] = max([e.get('unread') or 0 for e in runs[key]] or [0])
        reads = [e['read'] for e in runs[key] if e.get('read') is not None]
        fig['read'] = max(reads) if reads else None
        cells.setdefault(label, {})[command] = fig
        log('  %-28s wall %s s, CPU %s s, left unread: %s process(es)' % (
            key, common.fmt(fig['wall_s'], digits=2), common.fmt(fig['cpu_s'], digits=2), fig['unread']))
    return cells


def finish(result):
    """Ratios of each load to the unloaded runs (both), per checkout and command; and the goals."""
    base = [r for r in result['rows'] if r['kind'] == 'unloaded']
    for row in result['rows']:
        for label, by_command in row['cells'].items():
            for command, fig in by_command.items():
                walls = [b['cells'][label][command]['wall_s']['median'] for b in base if label in b['cells']]
                cpus = [b['cells'][label][command]['cpu_s']['median'] for b in base if label in b['cells']]
                fig['ratio_wall'] = fig['wall_s']['median'] / (sum(walls) / len(walls)) if walls and sum(walls) else None
                fig['ratio_cpu'] = fig['cpu_s']['median'] / (sum(cpus) / len(cpus)) if cpus and sum(cpus) else None
    result['goals'] = goals(result)
    return result


def goals(result):
    out = []
    for row in result['rows']:
        cells = row['cells'].get('this') or {}
        if row['kind'] == 'descriptors' and row['amount'] == 1000000:
            for command in COMMANDS:
                ratio = (cells.get(command) or {}).get('ratio_wall')
                out.append({'goal': '%s at 1 M descriptors: at most %gx the unloaded wall time' % (command, GOAL_RATIO),
                            'met': None if ratio is None else ratio <= GOAL_RATIO, 'figure': '%.2fx' % ratio if ratio else '-'})
        if row['kind'] == 'descriptors' and row['amount'] == 5000000 and 'prolog' in cells:
            wall = cells['prolog']['wall_s']['max']
            out.append({'goal': 'prolog at 5 M descriptors: under %g s (slowest run)' % GOAL_PROLOG_S, 'met': wall < GOAL_PROLOG_S,
                        'figure': '%.2f s' % wall})
    return out


def markdown(result):
    machine = result['machine']
    lines = ['Run of %s: %s, %s CPUs, %s GiB RAM (%.1f GiB available at the start), %s, Linux %s, Python %s; load average '
             '(1 min) %.1f at the start and %.1f at the end (the machine was shared with other jobs; the end follows the '
             'teardown of the idle processes)%s. %d GPU workloads on '
             '8 simulated GPUs; %d repetition(s) per command and load, commands interleaved; a load process holds %d '
             'descriptors of /dev/null (the hard RLIMIT_NOFILE here: %s).' % (
                 machine['date'], machine['cpu'], machine['cores'], machine['mem_gib'], machine.get('mem_available_gib') or 0,
                 machine['os'], machine['kernel'], machine['python'], machine['loadavg'][0], result['load_end'][0],
                 ', in a PID namespace of its own' if result['isolated'] else '', result['gpu_procs'], result['reps'],
                 result['per_process'], result['nofile_hard']), '']
    head = ('load', 'held (processes / descriptors)', 'tree', 'command', 'wall s', 'ratio to unloaded', 'CPU s', 'ratio (CPU)',
            'left unread (processes)', 'descriptors read', 'machine load (1 min)')
    rows = []
    for row in result['rows']:
        for label in result['checkouts']:
            for command in COMMANDS:
                fig = row['cells'].get(label, {}).get(command)
                if not fig:
                    continue
                rows.append((row['name'], '%d / %d' % (row['processes'], row['descriptors']), label, command,
                             common.fmt(fig['wall_s'], digits=2), _ratio(fig.get('ratio_wall')), common.fmt(fig['cpu_s'], digits=2),
                             _ratio(fig.get('ratio_cpu')), fig['unread'], fig['read'] if fig['read'] is not None else 'all',
                             '%.1f' % row['load1'] if row.get('load1') is not None else '-'))
    lines.append(common.md_table(head, rows))
    lines.append('')
    lines.append('"left unread": the processes whose open files the holder scan did not read (it reports them in '
                 '`holders_incomplete`); "descriptors read": the links it read when it left some ("all": it left none). '
                 'The tick reads no process\'s open files but those it is about to signal, so no load moves it.')
    lines.append('')
    if result.get('goals'):
        met = {True: 'yes', False: '**no**', None: 'n/a'}
        lines.append(common.md_table(('goal', 'met', 'figure'), [(g['goal'], met[g['met']], g['figure']) for g in result['goals']]))
        lines.append('')
    return '\n'.join(lines)


def _amount(number):
    """1 M, 5 M, 20,000: a load's size as the docs write it."""
    return '%g M' % (number / 1e6) if number >= 1000000 and number % 100000 == 0 else '{:,}'.format(number)


def _ratio(value):
    return '-' if value is None else '%.2f' % value


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--descriptors', default='1000000,5000000', help='comma list: descriptors a user holds, per load')
    parser.add_argument('--idle', type=int, default=20000, help='idle processes of the last load (0: none)')
    parser.add_argument('--per-process', type=int, default=19990, help='descriptors per load process (the issue: 19,990)')
    parser.add_argument('--gpu-procs', type=int, default=16)
    parser.add_argument('--loads', default='descriptors,idle', help='which loads besides the unloaded runs')
    parser.add_argument('--checkout', action='append', default=[], metavar='LABEL=DIR', help='another checkout to measure too')
    parser.add_argument('--json', help='also write the raw figures here')
    parser.add_argument('--no-docs', action='store_true', help='do not update docs/benchmarks.md')
    parser.add_argument('--quick', action='store_true', help='tiny sizes, one repetition')
    parser.add_argument('--no-isolate', action='store_true', help='measure in this PID namespace')
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.descriptors, args.idle, args.gpu_procs = 1, '100000', 500, 4
    args.descriptors = [int(v) for v in args.descriptors.split(',') if v.strip()]
    args.loads = set(v.strip() for v in args.loads.split(',') if v.strip())
    args.checkouts = []
    for spec in args.checkout:
        label, sep, root = spec.partition('=')
        if not sep or not label or label == 'this' or not os.path.isdir(os.path.join(root, 'plugins', 'module_utils', 'core')):
            parser.error('--checkout: %r is not LABEL=DIR with DIR a checkout of the collection (and LABEL not "this")' % spec)
        args.checkouts.append((label, os.path.abspath(root)))
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.no_isolate:
        code = common.run_isolated(__file__, argv)
        if code is not None:
            return code
    if not os.path.isfile(common.SHIM):
        sys.exit('the simulator is not built: run "make sim"')
    result = finish(measure(args))
    text = markdown(result)
    log('')
    log(text)
    common.write_json(args.json, result)
    if not args.no_docs and not args.quick:
        common.rewrite_section(text, SECTION, title=TITLE)
        log('# rewrote the %s section of %s' % (SECTION, common.DOCS))
    return 0 if all(g['met'] is not False for g in result['goals']) else 1


if __name__ == '__main__':
    sys.exit(main())
