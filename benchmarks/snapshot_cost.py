#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Snapshot cost: our core against gpustat, nvitop and fuser, side by side on one simulated node.

The benchmark builds a simulated node (tests/sim) with 8 GPUs, starts G GPU workloads
(``gpusim spawn``, real processes holding the node's fake device files) and enough idle host
processes (``pause()`` sleepers) to reach H processes in /proc, and for every (G, H) runs each
tool ``reps`` times, interleaved (the order rotates every repetition):

* ``ours``: the agent, ``gpufleet-guard list --json`` (launcher as the guard role installs it,
  core from plugins/module_utils/core): NVML read, process records, and the holder scan of every
  fd only when some GPU's used memory is not explained by its listed processes (``--holders
  auto``, the default; the simulated node's memory is fully explained, so it is skipped);
* ``ours_holders``: the same with ``--holders always``: the holder scan of every fd too;
* ``gpustat``: ``gpustat --json`` and ``nvitop``: ``nvitop --once``, unmodified, from a virtual
  environment this benchmark creates (pip, pinned versions), on the same shim;
* ``fuser``: ``fuser -v DEV/nvidia*`` (psmisc), the holder scan operators use, against the node's
  fake device dir; ``fdscan``: our holder scan alone (core ``scan_device_fds`` with that dir as
  device root, a test seam), as a process, also reporting the scan's own CPU time;
* ``tick``: ``gpufleet-guard tick --dry-run`` with a dry-run policy (one agent pass; signals nobody);
* ``base`` and ``base_holders`` (with ``--baseline CHECKOUT``): ``ours`` and ``ours_holders`` of another
  checkout's core (main, for a before/after in one run), interleaved with the rest.

Every figure is the median over the repetitions with its spread (min-max); CPU time includes the
children (wait4), RSS is the peak of the biggest process.  Ratios are per repetition, same run.
Only processes this script started are signalled: the sleepers (by their forker), and the GPU
workloads (through ``gpusim kill-all``, which checks their recorded start times).
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

GPUS = 8
GPU_COUNTS = (10, 100, 1000)
HOST_COUNTS = (2000, 6000, 10000)
PEER_REQUIREMENTS = ('gpustat==1.1.1', 'nvitop==1.7.2')
TOOLS = ('ours', 'ours_holders', 'gpustat', 'nvitop', 'fuser', 'fdscan', 'tick')
BASELINE_TOOLS = ('base', 'base_holders')   # only with a baseline checkout
LABELS = {
    'ours': 'gpufleet-guard list --json',
    'ours_holders': 'gpufleet-guard list --json --holders always',
    'gpustat': 'gpustat --json',
    'nvitop': 'nvitop --once',
    'fuser': 'fuser -v DEV/nvidia*',
    'fdscan': 'core fd scan (process)',
    'tick': 'gpufleet-guard tick --dry-run',
    'base': 'gpufleet-guard list --json (baseline)',
    'base_holders': 'gpufleet-guard list --json --holders always (baseline)',
}
POLICY = '''mode: dry-run
users:
  root: {max_gpus: 1}
escalation: {warn_again_after: 5m, act_after: 10m, sigkill_after: 2s, retry_after: 5m}
notify: {tty: false}
'''

# Our holder scan alone, in a process like fuser: prints its own scan time as JSON.
FDSCAN_CODE = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from gpufleet_core.processes import scan_device_fds
wall0, cpu0 = time.monotonic(), time.process_time()
holders, readable, denied = scan_device_fds('/proc', [sys.argv[2]], exclude=(os.getpid(),))
cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
print(json.dumps({'holders': len(holders), 'readable': len(readable), 'denied': denied, 'scan_cpu_s': cpu, 'scan_wall_s': wall}))
'''

# Where a `list` spends its CPU: start-up, imports, then the snapshot's phases: NVML only, NVML and
# the listed processes' records, the full snapshot with the holder scan (each the mean of two passes).
PHASES_CODE = r'''
import json, sys, time
startup = time.process_time()
sys.path.insert(0, sys.argv[1])
import gpufleet_core.cli
from gpufleet_core.snapshot import take_snapshot
imports = time.process_time() - startup
dev = sys.argv[2]


def cpu(fn):
    cpu0 = time.process_time()
    value = fn()
    return value, time.process_time() - cpu0


passes = {'nvml': [], 'listed': [], 'full': [], 'json': []}
# each pass twice, in opposite orders: a later pass finds warmer caches, so no phase always goes first
for name in ('nvml', 'listed', 'full', 'full', 'listed', 'nvml'):
    if name == 'nvml':
        passes[name].append(cpu(lambda: take_snapshot(gather_processes=False, dev_roots=[dev]))[1])
    elif name == 'listed':
        passes[name].append(cpu(lambda: take_snapshot(scan_holders=False, dev_roots=[dev]))[1])
    else:
        snap, seconds = cpu(lambda: take_snapshot(dev_roots=[dev]))
        passes[name].append(seconds)
        passes['json'].append(cpu(lambda: json.dumps(snap.to_facts(), default=str))[1])
nvml, listed, full, facts = [sum(passes[k]) / 2.0 for k in ('nvml', 'listed', 'full', 'json')]
print(json.dumps({'startup': startup, 'imports': imports, 'nvml': nvml, 'records': max(listed - nvml, 0.0),
                  'holder_scan': max(full - listed, 0.0), 'json': facts, 'processes': len(snap.processes)}))
'''
PHASES = ('startup', 'imports', 'nvml', 'records', 'holder_scan', 'json')

# The snapshot in-process, profiled: what a `list` spends its time on.
PROFILE_CODE = r'''
import cProfile, io, json, pstats, sys, time
sys.path.insert(0, sys.argv[1])
from gpufleet_core.snapshot import take_snapshot
prof = cProfile.Profile()
cpu0 = time.process_time()
prof.enable()
snap = take_snapshot(dev_roots=[sys.argv[2]])
facts = json.dumps(snap.to_facts(), default=str)
prof.disable()
cpu = time.process_time() - cpu0
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats(sys.argv[3]).print_stats(int(sys.argv[4]))
print(json.dumps({'cpu_s': cpu, 'processes': len(snap.processes), 'holders': len(snap.holders), 'profile': out.getvalue()}))
'''


# ---------------------------------------------------------------------------- peers
def peers_venv(path=None, log=print):
    """A virtual environment with the pinned peers (created once, reused while the pins match).

    Returns ``{'dir', 'python', 'versions', 'error'}``; ``error`` says why the peers cannot run.
    """
    path = path or os.path.join(common.BENCH_BUILD, 'peers-venv')
    stamp = os.path.join(path, '.gpufleet-peers')
    wanted = '\n'.join(PEER_REQUIREMENTS)
    python = os.path.join(path, 'bin', 'python')
    result = {'dir': path, 'python': python, 'versions': {}, 'error': None}
    current = None
    if os.path.exists(stamp):
        with open(stamp) as handle:
            current = handle.read()
    if current != wanted or not os.access(python, os.X_OK):
        log('# creating the peers venv %s (%s)' % (path, ', '.join(PEER_REQUIREMENTS)))
        shutil.rmtree(path, ignore_errors=True)
        steps = ([sys.executable, '-m', 'venv', path],
                 [python, '-m', 'pip', 'install', '-q', '--disable-pip-version-check'] + list(PEER_REQUIREMENTS))
        for step in steps:
            proc = subprocess.run(step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600, check=False)
            if proc.returncode != 0:
                tail = proc.stdout.decode('utf-8', 'replace').strip().splitlines()[-3:]
                result['error'] = 'could not create the peers venv (%s): %s' % (' '.join(step[:4]), ' / '.join(tail))
                return result
        with open(stamp, 'w') as handle:
            handle.write(wanted)
    for name in ('gpustat', 'nvitop', 'nvidia-ml-py', 'psutil'):
        result['versions'][name] = common.dist_version(name, python)
    return result


# ---------------------------------------------------------------------------- checks of each tool's output
def _seen(tool, text, gpu_pids):
    """How many of the GPU workloads a tool's output shows (None when it cannot tell)."""
    pids = set(gpu_pids)
    try:
        if tool in ('ours', 'ours_holders', 'base', 'base_holders'):
            return len(set(p['pid'] for p in json.loads(text)['processes']) & pids)
        if tool == 'gpustat':
            return len(set(p['pid'] for g in json.loads(text)['gpus'] for p in (g['processes'] or ())) & pids)
        if tool == 'fdscan':
            return json.loads(text.strip().splitlines()[-1])['holders']
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if tool in ('fuser', 'nvitop'):
        found = set()
        for word in text.replace('\u2502', ' ').replace('|', ' ').split():
            word = word.strip('cfremFmso:')
            if word.isdigit() and int(word) in pids:
                found.add(int(word))
        return len(found)
    return None


# ---------------------------------------------------------------------------- one cell
def measure_cell(node, agent, peers, tools, reps, gpu_pids, log, baseline=None):
    """``reps`` interleaved repetitions of every tool; returns {tool: {...figures...}}.  ``baseline``: the
    Agent of another checkout (tools ``base``, ``base_holders``)."""
    env_ours = node.env()
    env_peer = node.env()
    if peers and peers.get('python'):
        env_peer['PATH'] = os.path.join(peers['dir'], 'bin') + ':' + env_peer['PATH']
    dev_files = [os.path.join(node.dev, name) for name in sorted(os.listdir(node.dev))]
    commands = {
        'ours': (agent.command('list', '--json', '--root', agent.root, '--dev-root', node.dev), env_ours),
        'ours_holders': (agent.command('list', '--json', '--holders', 'always', '--root', agent.root, '--dev-root', node.dev),
                         env_ours),
        'tick': (agent.command('tick', '--dry-run', '--json', '--root', agent.root, '--dev-root', node.dev), env_ours),
        'base': (baseline.command('list', '--json', '--root', baseline.root, '--dev-root', node.dev) if baseline else None, env_ours),
        'base_holders': (baseline.command('list', '--json', '--holders', 'always', '--root', baseline.root, '--dev-root', node.dev)
                         if baseline else None, env_ours),
        'fdscan': (agent.code(FDSCAN_CODE, node.dev), env_ours),
        'phases': (agent.code(PHASES_CODE, node.dev), env_ours),
        'fuser': (['fuser', '-v'] + dev_files, env_ours),
        'gpustat': ([os.path.join(peers['dir'], 'bin', 'gpustat'), '--json'] if peers else None, env_peer),
        'nvitop': ([os.path.join(peers['dir'], 'bin', 'nvitop'), '--once'] if peers else None, env_peer),
    }

    def inspect(tool, meas):
        entry = {'seen': _seen(tool, meas.text(), gpu_pids), 'procs': common.process_count()}
        if tool in ('fdscan', 'phases'):
            try:
                entry.update(json.loads(meas.text().strip().splitlines()[-1]))
            except (ValueError, IndexError):
                pass
        return entry

    def ok(tool, meas):
        return meas.returncode == 0 or (tool == 'fuser' and meas.returncode == 1 and not gpu_pids)

    # one tick first, as on a node where the guard's timer runs: it leaves the policy document cached
    # in the agent's state, which `list` reads instead of parsing the YAML again
    common.run_child(commands['tick'][0], env=env_ours)
    if baseline:
        common.run_child(baseline.command('tick', '--dry-run', '--json', '--root', baseline.root, '--dev-root', node.dev), env=env_ours)

    runs, notes = common.interleaved(commands, tools, reps, inspect, ok)
    result = {}
    for tool in tools:
        if not runs[tool]:
            continue
        fig = result[tool] = common.figures(runs[tool], notes[tool])
        entries = runs[tool]
        if tool == 'fdscan' and all('scan_cpu_s' in e for e in entries):
            fig['scan_cpu_s'] = common.stats([e['scan_cpu_s'] for e in entries])
            fig['scan_wall_s'] = common.stats([e['scan_wall_s'] for e in entries])
        if tool == 'phases' and all('holder_scan' in e for e in entries):
            fig['phases'] = dict((name, common.stats([e[name] for e in entries])) for name in PHASES)
    # per-repetition ratios (same repetition, same node state)
    for mine, peer in RATIO_PAIRS + (('fdscan', 'fuser'), ('tick', 'gpustat')):
        if mine in result and peer in result:
            for key in ('cpu_s', 'wall_s', 'maxrss_kib'):
                values = common.ratios([e[key] for e in runs[mine]], [e[key] for e in runs[peer]])
                if values:
                    result[mine].setdefault('ratio', {}).setdefault(peer, {})[key] = common.stats(values)
    return result


def profile(agent, node, sort='tottime', top=15):
    """cProfile of one in-process snapshot (take_snapshot + facts) on the node as it is now."""
    proc = subprocess.run(agent.code(PROFILE_CODE, node.dev, sort, top),
                          env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300, check=False)
    if proc.returncode != 0:
        return {'error': proc.stderr.decode('utf-8', 'replace').strip()[-500:]}
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    result['profile'] = result['profile'].replace(os.path.join(agent.lib, 'gpufleet_core') + '/', 'core/')
    for prefix in sorted(set(p for p in sys.path if p.endswith('site-packages')), key=len, reverse=True):
        result['profile'] = result['profile'].replace(prefix + '/', '')
    return result


def baseline_fast_exit(checkout):
    """Whether the launcher of ``checkout``'s guard role skips the interpreter's teardown after a ``list``."""
    try:
        with open(os.path.join(checkout, 'roles', 'guard', 'templates', 'gpufleet-guard.j2')) as handle:
            return 'os._exit' in handle.read()
    except OSError:
        return False


# ---------------------------------------------------------------------------- the whole grid
def plan(gpu_counts, host_counts, full_grid=False):
    """The cells, in the order they run: [(G, H)].

    Every host size for the smallest GPU count (growth with host processes), then only the
    smallest and largest host size for the others (growth with GPU processes at both ends),
    unless ``full_grid``.  Host sizes go back and forth, so fewer sleepers are forked.
    """
    gpu_counts, host_counts = sorted(set(gpu_counts)), sorted(set(host_counts))
    cells = []
    for gi, gpu_count in enumerate(gpu_counts):
        hosts = host_counts if (gi == 0 or full_grid or len(host_counts) < 3) else [host_counts[0], host_counts[-1]]
        if gi % 2:
            hosts = list(reversed(hosts))
        cells.extend((gpu_count, host) for host in hosts)
    return cells


def run(gpu_counts=GPU_COUNTS, host_counts=HOST_COUNTS, reps=3, tools=TOOLS, use_peers=True, peers_dir=None,
        profile_top=15, full_grid=False, log=print, baseline=None):
    """The grid; returns a JSON-able dict (cells, fits, goals, profile, versions).  ``baseline``: another
    checkout whose core runs as ``base`` and ``base_holders`` (added to ``tools``)."""
    started = time.monotonic()
    tools = list(tools)
    peers = None
    peer_error = None
    if use_peers:
        peers = peers_venv(peers_dir, log=log)
        if peers['error']:
            peer_error, peers = peers['error'], None
    else:
        peer_error = 'skipped (--no-peers)'
    if peers is None:
        tools = [t for t in tools if t not in ('gpustat', 'nvitop')]
    if shutil.which('fuser') is None:
        tools = [t for t in tools if t != 'fuser']
    tools = [t for t in tools if t not in BASELINE_TOOLS] + (list(BASELINE_TOOLS) if baseline else [])
    base = tempfile.mkdtemp(prefix='gpufleet-bench-snap-')
    cells = []
    prof = None
    node = sleepers = None
    order = plan(gpu_counts, host_counts, full_grid)
    corners = set([order[0], order[-1]])
    try:
        agent = common.Agent(base, POLICY)
        base_agent = common.Agent(os.path.join(base, 'baseline'), POLICY, core=os.path.join(baseline, 'plugins', 'module_utils', 'core'),
                                  fast_exit=baseline_fast_exit(baseline)) if baseline else None
        node = common.SimNode(gpus=GPUS)
        sleepers = common.Sleepers()
        for gpu_count, host in order:
            need = gpu_count - len(node.pids)
            if need > 0:
                t0 = time.monotonic()
                node.spawn_many(need)
                log('# %d GPU workloads running (%.1f s to spawn %d)' % (len(node.pids), time.monotonic() - t0, need))
            sleepers.to_total(host)
            actual = common.process_count()
            cell_tools = tools + (['phases'] if (gpu_count, host) in corners and 'ours' in tools else [])
            load = [os.getloadavg()[0]]
            figures = measure_cell(node, agent, peers, cell_tools, reps, node.pids, log, base_agent)
            load.append(os.getloadavg()[0])
            cell = {'gpu_processes': gpu_count, 'host_target': host, 'host_processes': actual,
                    'sleepers': sleepers.count, 'tools': figures, 'loadavg': load}
            cells.append(cell)
            log(cell_line(cell))
        if profile_top:
            prof = {'gpu_processes': len(node.pids), 'host_processes': common.process_count(),
                    'tottime': profile(agent, node, 'tottime', profile_top)}
    finally:
        common.cleanup(sleepers, node, base)
    result = {'gpus': GPUS, 'reps': reps, 'tools': tools, 'labels': LABELS, 'cells': cells, 'profile': prof,
              'peers': {'requirements': list(PEER_REQUIREMENTS), 'versions': (peers or {}).get('versions'),
                        'error': peer_error},
              'fuser': common.tool_version(['fuser', '--version']) if shutil.which('fuser') else 'not installed (apt-get install psmisc)',
              'seconds': time.monotonic() - started, 'baseline': baseline}
    return finish(result)


def fits(cells, tools):
    """Linear fits of median CPU time: against host processes (per GPU count) and against GPU processes (largest host)."""
    out = {'per_host': {}, 'per_gpu': {}}
    for tool in tools:
        for key in ('cpu_s', 'scan_cpu_s'):
            by_gpu = {}
            for cell in cells:
                fig = cell['tools'].get(tool)
                if fig and key in fig:
                    by_gpu.setdefault(cell['gpu_processes'], []).append((cell['host_processes'], fig[key]['median']))
            for gpu_count, points in sorted(by_gpu.items()):
                if len(points) >= 2:
                    points.sort()
                    fit = common.linear_fit([p[0] for p in points], [p[1] for p in points])
                    fit['points'] = points
                    out['per_host'].setdefault('%s.%s' % (tool, key), {})[str(gpu_count)] = fit
            largest = max((c['host_target'] for c in cells), default=None)
            points = [(c['gpu_processes'], c['tools'][tool][key]['median']) for c in cells
                      if c['host_target'] == largest and tool in c['tools'] and key in c['tools'][tool]]
            if len(points) >= 2:
                points.sort()
                fit = common.linear_fit([p[0] for p in points], [p[1] for p in points])
                fit['points'] = points
                out['per_gpu']['%s.%s' % (tool, key)] = fit
    return out


SUPERLINEAR = 1.5  # a last interval this much steeper than the fit counts as faster-than-linear growth


FLAT_SLOPE = 5e-6  # seconds of CPU per process: under 5 ms per 1,000 is flat (noise), no growth to speak of


def is_flat(fit):
    """A cost that does not grow with the size (a flat line is linear: it cannot grow faster than linear)."""
    return fit['slope'] is not None and fit['slope'] < FLAT_SLOPE


def growth_ok(fit):
    return is_flat(fit) or acceleration(fit) <= SUPERLINEAR


def growth_text(fit):
    if is_flat(fit):
        return 'flat: %.1f ms per 1,000 (R^2 %s)' % (fit['slope'] * 1e6, '-' if fit['r2'] is None else '%.3f' % fit['r2'])
    return '%.2f x (R^2 %s)' % (acceleration(fit), '-' if fit['r2'] is None else '%.3f' % fit['r2'])


def acceleration(fit):
    """Slope of the last interval over the least-squares slope (> 1: the cost grows faster at the end)."""
    (x0, y0), (x1, y1) = fit['points'][-2], fit['points'][-1]
    if not fit['slope'] or fit['slope'] <= 0 or x1 == x0:
        return 0.0 if (y1 - y0) <= 0 else float('inf')
    return ((y1 - y0) / float(x1 - x0)) / fit['slope']


def finish(result):
    """(Re)compute the fits and the goals from the cells (also for a saved run)."""
    result['fits'] = fits(result['cells'], result['tools'])
    result['goals'] = goals(result)
    return result


def goals(result):
    """The issue's goals, each with the figure that decides it."""
    cells = result['cells']
    out = []
    # issue #21: list at most half of each peer's CPU; with the holder scan forced, at most gpustat's
    for tool, peer, limit in (('ours', 'gpustat', 0.5), ('ours', 'nvitop', 0.5), ('ours_holders', 'gpustat', 1.0)):
        ratios = [(c['gpu_processes'], c['host_processes'], c['tools'][tool]['ratio'][peer]['cpu_s']) for c in cells
                  if peer in c['tools'].get(tool, {}).get('ratio', {})]
        if ratios:
            worst = max(ratios, key=lambda r: r[2]['median'])
            out.append({'goal': "CPU time at most %.1f x %s's at every size (%s / %s <= %.1f)" % (limit, peer, LABELS[tool], peer, limit),
                        'met': all(r[2]['median'] <= limit for r in ratios),
                        'figure': 'worst ratio %s at %d GPU / %d host processes' % (common.fmt(worst[2], digits=2), worst[0], worst[1])})
        elif tool == 'ours' and peer == 'gpustat':
            out.append({'goal': "CPU time under gpustat's at every size", 'met': None,
                        'figure': 'not measured: %s' % (result['peers']['error'] or 'no gpustat figures')})
    for name, label in (('ours.cpu_s', LABELS['ours']), ('fdscan.scan_cpu_s', 'fd scan, in-process')):
        fits_ = [(gpu, f) for gpu, f in sorted(result['fits']['per_host'].get(name, {}).items()) if f['n'] >= 3]
        if fits_:
            worst = max(fits_, key=lambda gf: 0.0 if is_flat(gf[1]) else acceleration(gf[1]))
            out.append({'goal': 'linear growth with host processes (%s): flat, or the last interval\'s slope at most %.1f x '
                                'the least-squares slope' % (label, SUPERLINEAR),
                        'met': all(growth_ok(f) for _gpu, f in fits_),
                        'figure': 'worst %s at %s GPU processes' % (growth_text(worst[1]), worst[0])})
    per_gpu = result['fits']['per_gpu'].get('ours.cpu_s')
    if per_gpu and per_gpu['n'] >= 3:
        out.append({'goal': 'linear growth with GPU processes (%s): the last interval\'s slope at most %.1f x the least-squares '
                            'slope' % (LABELS['ours'], SUPERLINEAR),
                    'met': acceleration(per_gpu) <= SUPERLINEAR,
                    'figure': '%.2f x; %.0f ms CPU per 1,000 GPU processes (R^2 %.3f)' % (
                        acceleration(per_gpu), per_gpu['slope'] * 1e6, per_gpu['r2'])})
    scans = [c for c in cells if 'fdscan' in c['tools'] and 'scan_cpu_s' in c['tools']['fdscan']]
    big = [c for c in scans if c['host_processes'] >= 9500]
    if big:
        figs = ['%s ms at %d GPU / %d host processes' % (common.fmt(c['tools']['fdscan']['scan_cpu_s'], 1000),
                                                         c['gpu_processes'], c['host_processes']) for c in big]
        out.append({'goal': 'fd scan of 10,000 processes under 300 ms of CPU (the scan alone, in-process)',
                    'met': all(c['tools']['fdscan']['scan_cpu_s']['median'] < 0.3 for c in big), 'figure': '; '.join(figs)})
    elif scans:
        out.append({'goal': 'fd scan of 10,000 processes under 300 ms of CPU', 'met': None,
                    'figure': 'no cell had 10,000 processes (largest: %d)' % max(c['host_processes'] for c in scans)})
    return out


# ---------------------------------------------------------------------------- text
def cell_line(cell):
    parts = ['G=%-4d H=%-5d' % (cell['gpu_processes'], cell['host_processes'])]
    for tool, fig in cell['tools'].items():
        text = '%s cpu %s ms' % (tool, common.fmt(fig['cpu_s'], 1000))
        if fig.get('ratio', {}).get('gpustat'):
            text += ' (x%s gpustat)' % common.fmt(fig['ratio']['gpustat']['cpu_s'], digits=2)
        parts.append(text)
    return '  '.join(parts)


RATIO_PAIRS = (('ours', 'gpustat'), ('ours', 'nvitop'), ('ours_holders', 'gpustat'), ('base', 'gpustat'), ('base', 'nvitop'),
               ('base_holders', 'gpustat'), ('ours', 'base'), ('ours_holders', 'base_holders'))


def ratio_table(result):
    """CPU-time ratios per cell (medians of the per-repetition ratios, with their spread) and the load average."""
    pairs = [(mine, peer) for mine, peer in RATIO_PAIRS
             if any(peer in c['tools'].get(mine, {}).get('ratio', {}) for c in result['cells'])]
    if not pairs:
        return []
    lines = ['', 'CPU time ratios (per repetition, same run; median and spread), load average at the start and end of the cell:', '',
             '| GPU procs | host procs | ' + ' | '.join('%s / %s' % (mine, peer) for mine, peer in pairs) + ' | load |',
             '|---' * (3 + len(pairs)) + '|']
    for cell in result['cells']:
        row = ['%d' % cell['gpu_processes'], '%d' % cell['host_processes']]
        row.extend(common.fmt(cell['tools'][mine]['ratio'][peer]['cpu_s'], digits=2)
                   if peer in cell['tools'].get(mine, {}).get('ratio', {}) else '-' for mine, peer in pairs)
        row.append('-'.join('%.1f' % x for x in cell.get('loadavg', ())) or '-')
        lines.append('| ' + ' | '.join(row) + ' |')
    return lines


def markdown(result):
    """The results as markdown tables (used by benchmarks/run for docs/benchmarks.md)."""
    tools = [t for t in result['tools'] if any(t in c['tools'] for c in result['cells'])]
    lines = []
    for title, key, scale, digits in ((None, 'cpu_s', 1000, 0), ('Wall time, ms (same runs):', 'wall_s', 1000, 0),
                                      ('Peak RSS, MiB (largest process of the command):', 'maxrss_kib', 1 / 1024.0, 1)):
        if title:
            lines.extend(['', title, ''])
        lines.append('| GPU procs | host procs | ' + ' | '.join(LABELS[t] for t in tools) + ' |')
        lines.append('|---' * (2 + len(tools)) + '|')
        for cell in result['cells']:
            row = ['%d' % cell['gpu_processes'], '%d' % cell['host_processes']]
            row.extend(common.fmt(cell['tools'][t][key], scale, digits) if t in cell['tools'] else '-' for t in tools)
            lines.append('| ' + ' | '.join(row) + ' |')
    lines.extend(ratio_table(result))
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--gpu-counts', default=','.join(map(str, GPU_COUNTS)), help='GPU workloads per cell (comma list)')
    parser.add_argument('--host-counts', default=','.join(map(str, HOST_COUNTS)), help='processes in /proc per cell (comma list)')
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--full-grid', action='store_true', help='every host size for every GPU count')
    parser.add_argument('--tools', default=','.join(TOOLS))
    parser.add_argument('--no-peers', action='store_true', help='skip gpustat and nvitop (no venv is created)')
    parser.add_argument('--peers-venv', help='where the peers venv lives (default build/bench/peers-venv)')
    parser.add_argument('--json', help='write the figures here')
    parser.add_argument('--baseline', metavar='CHECKOUT',
                        help='another checkout (e.g. a worktree of main) whose core also runs, interleaved: base, base_holders')
    args = parser.parse_args(argv)
    if not os.path.isfile(common.SHIM):
        sys.exit('the simulator is not built: run "make sim"')
    result = run([int(x) for x in args.gpu_counts.split(',')], [int(x) for x in args.host_counts.split(',')], args.reps,
                 args.tools.split(','), not args.no_peers, args.peers_venv, full_grid=args.full_grid,
                 baseline=os.path.abspath(args.baseline) if args.baseline else None)
    print(markdown(result))
    for goal in result['goals']:
        print('# goal: %s: %s (%s)' % (goal['goal'], {True: 'met', False: 'NOT met', None: 'n/a'}[goal['met']], goal['figure']))
    common.write_json(args.json, result)
    return 0


if __name__ == '__main__':
    sys.exit(main())
