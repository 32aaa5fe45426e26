#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The idle sample store's share of a guard tick: SQLite usage history or JSON sample file.

Issue #20 asked for one idleness rule over one sample store, and for the guard tick to decide the
store.  This measures, in one process and interleaved (same machine, same moment), three ticks on
a node of 8 GPUs and ``--gpu-procs`` GPU processes (model objects, no driver: the store is what
differs), of which half have been idle for the whole history and half busy:

* baseline: the tick's decision step without a sample store - the idle clocks from the snapshot
  alone, the policy evaluated, state.json saved;
* sqlite: the same plus the snapshot appended to the SQLite usage history (``history.SampleStore``:
  checked open, one transaction) and the idle clocks derived from it;
* sqlite-write: the baseline plus the SQLite append only (what every tick paid before this store
  was also read: the history behind the usage reports);
* json: the baseline plus the snapshot appended to a JSON sample file (load, append, atomic save, at
  most 720 samples a process: the file format gpu_kill used before) and the clocks derived from it.

The history is filled first with ``--hours`` of samples at one a minute, so the idle runs the rule
walks back over are that long.  Printed: CPU and wall time per tick (median, min-max) and each
store's ratio to the baseline of the same run (median of the per-tick ratios).
Usage: benchmarks/idle_store.py [--ticks 20] [--gpu-procs 200] [--hours 12] [--json PATH] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

if common.MODULE_UTILS not in sys.path:
    sys.path.insert(0, common.MODULE_UTILS)

from core import guard_state, history, policy as policy_mod, safe_files  # noqa: E402 pylint: disable=wrong-import-position
from core.idle import process_utilization  # noqa: E402 pylint: disable=wrong-import-position
from core.model import Device, GpuProcess  # noqa: E402 pylint: disable=wrong-import-position
from core.snapshot import Snapshot  # noqa: E402 pylint: disable=wrong-import-position

POLICY = '''\
mode: dry-run
defaults:
  max_mem_gib_per_gpu: 8
  max_gpus: 6
  idle: {util_max_pct: 5, mem_min_gib: 1, for: 30m}
notify: {tty: false}
'''
STEP_S = 60.0
KINDS = ('baseline', 'sqlite-write', 'sqlite', 'json')
JSON_MAX_SAMPLES = 720


def node_snapshot(count, now):
    procs = []
    for pid in range(1000, 1000 + count):
        proc = GpuProcess(pid=pid)
        proc.add_gpu(pid % 8, 2048, ['compute'])
        proc.user, proc.name, proc.cmdline = 'user%d' % (pid % 10), 'python', ['python', 'train.py', '--rank', str(pid)]
        proc.starttime, proc.status, proc.create_time = pid * 10, 'running', now - 86400
        proc.util_pct = 0 if pid % 2 else 80
        procs.append(proc)
    devices = []
    for index in range(8):
        dev = Device(vendor='nvidia', vendor_index=index, index=index, uuid='GPU-%d' % index, memory_total_mib=81559,
                     memory_used_mib=0, utilization_pct=40, minor=index)
        for proc in procs:
            if index in proc.gpu_indexes:
                dev.add_driver_process(proc.pid, proc.used_mib_by_gpu[index], 'compute')
                dev.memory_used_mib += proc.used_mib_by_gpu[index]
        devices.append(dev)
    return Snapshot(backends={}, devices=devices, all_devices=devices, processes=procs, holders=[], taken_at=now)


class JsonSamples(object):
    """The JSON alternative: ``{"version": 1, "processes": {"pid:starttime": [[ts, util, mib], ...]}}``."""

    def __init__(self, path):
        self.path = path
        try:
            data = json.loads(safe_files.read_file(path, 256 * 1024 * 1024).decode('utf-8'))
            self.samples = data['processes']
        except FileNotFoundError:
            self.samples = {}

    def record(self, snapshot, now, save=True):
        live = {}
        for proc in snapshot.processes:
            key = '%d:%d' % (proc.pid, proc.starttime)
            series = self.samples.get(key, [])
            series.append([now, process_utilization(proc, snapshot), proc.used_mib])
            live[key] = series[-JSON_MAX_SAMPLES:]
        self.samples = live
        if save:
            self.save()

    def save(self):
        safe_files.write_atomic(self.path, json.dumps({'version': 1, 'processes': self.samples}, separators=(',', ':')),
                                mode=0o600, dir_mode=0o750)

    def process_samples(self, pid, starttime, before):
        return (tuple(s) for s in reversed(self.samples.get('%d:%d' % (pid, starttime), [])) if s[0] < before)


def tick(kind, policy, snapshot, now, base):
    """One decision step with the store ``kind`` (None: the baseline); (cpu s, wall s, idle clocks)."""
    cpu, wall = time.process_time(), time.perf_counter()
    store = None
    if kind in ('sqlite', 'sqlite-write'):
        store = history.SampleStore(os.path.join(base, 'history.db'))
        store.record(snapshot, now)
        if kind == 'sqlite-write':
            store.close()
            store = None
    elif kind == 'json':
        store = JsonSamples(os.path.join(base, 'utilization.json'))
        store.record(snapshot, now)
    context = policy_mod.Context(groups={})
    state = policy_mod.observe(policy, snapshot, {}, now, context, store)
    policy_mod.evaluate(policy, snapshot, state, now, context)
    guard_state.save_state(os.path.join(base, 'state-%s.json' % (kind or 'baseline')), state)
    if kind == 'sqlite':
        store.close()
    return time.process_time() - cpu, time.perf_counter() - wall, len(state['idle'])


def measure(args):
    base = tempfile.mkdtemp(prefix='gpufleet-bench-idle-')
    try:
        policy = policy_mod.load_policy_text(POLICY, 'policy.yaml')
        start = time.time() - args.hours * 3600
        fill = int(args.hours * 3600 / STEP_S)
        snap = node_snapshot(args.gpu_procs, start)
        with history.SampleStore(os.path.join(base, 'history.db')) as store:
            for step in range(fill):
                store.record(snap, start + step * STEP_S)
        json_store = JsonSamples(os.path.join(base, 'utilization.json'))
        for step in range(max(0, fill - JSON_MAX_SAMPLES), fill):
            json_store.record(snap, start + step * STEP_S, save=False)
        json_store.save()
        results = dict((kind, []) for kind in KINDS)
        clocks = {}
        for run in range(args.ticks):
            now = start + (fill + run) * STEP_S
            for kind in KINDS:
                cpu, wall, idle = tick(None if kind == 'baseline' else kind, policy, snap, now, base)
                results[kind].append((cpu, wall))
                clocks[kind] = idle
        sizes = {'history.db': os.path.getsize(os.path.join(base, 'history.db')),
                 'utilization.json': os.path.getsize(os.path.join(base, 'utilization.json'))}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {'ticks': args.ticks, 'gpu_procs': args.gpu_procs, 'hours': args.hours, 'sizes': sizes, 'idle_clocks': clocks,
           'machine': common.machine_info()}
    for kind, values in results.items():
        out[kind] = {'cpu': common.stats([c for c, _w in values]), 'wall': common.stats([w for _c, w in values])}
        if kind != 'baseline':
            out[kind]['ratio_cpu'] = common.stats(common.ratios([c for c, _w in values], [c for c, _w in results['baseline']]))
    return out


def table(out):
    lines = ['| tick | CPU ms | wall ms | CPU ratio to the baseline |', '|---|---|---|---|']
    for kind in KINDS:
        row = out[kind]
        ratio = common.fmt(row.get('ratio_cpu'), 1, 2, 'x') if kind != 'baseline' else '1'
        lines.append('| %s | %s | %s | %s |' % (kind, common.fmt(row['cpu'], 1000, 1), common.fmt(row['wall'], 1000, 1), ratio))
    lines.append('')
    lines.append('%d ticks, %d GPU processes (half idle for the whole %g h history), idle clocks found: %s; '
                 'history.db %.1f MB, utilization.json %.1f MB.' % (
                     out['ticks'], out['gpu_procs'], out['hours'], out['idle_clocks'],
                     out['sizes']['history.db'] / 1e6, out['sizes']['utilization.json'] / 1e6))
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--ticks', type=int, default=20)
    parser.add_argument('--gpu-procs', type=int, default=200)
    parser.add_argument('--hours', type=float, default=12.0)
    parser.add_argument('--json')
    args = parser.parse_args(argv)
    out = measure(args)
    print(table(out))
    if args.json:
        common.write_json(args.json, out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
