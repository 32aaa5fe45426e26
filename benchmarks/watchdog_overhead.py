#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the driver watchdog (core/watchdog.py, issue #17) costs per snapshot.

One simulated node (8 GPUs, G GPU workloads from ``gpusim spawn``); in one Python process whose
libnvidia-ml.so.1 is the simulator's, ``take_snapshot(vendor='nvidia')`` runs ``reps`` times in
process (``driver_timeout=None``) and ``reps`` times through the watchdog child
(``driver_timeout=30``), interleaved.  Reported: wall time and CPU time (this process plus its
reaped children) per snapshot, median (min-max), and the per-run difference.  The only processes
signalled are the node's workloads (``gpusim kill-all``) and the watchdog's own children.

    python benchmarks/watchdog_overhead.py [--reps 30] [--gpu-procs 10 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

_MEASURE = r'''
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
from core.snapshot import take_snapshot
reps, dev, devices = int(sys.argv[2]), sys.argv[3] or None, int(sys.argv[4])
roots = [dev] if dev else None


def cpu():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


out = {'inproc': {'wall': [], 'cpu': []}, 'watchdog': {'wall': [], 'cpu': []}}
take_snapshot(vendor='nvidia', dev_roots=roots)          # warm: imports, first library load
for _ in range(reps):
    for name, timeout in (('inproc', None), ('watchdog', 30)):
        w, c = time.perf_counter(), cpu()
        snap = take_snapshot(vendor='nvidia', dev_roots=roots, driver_timeout=timeout)
        out[name]['wall'].append(time.perf_counter() - w)
        out[name]['cpu'].append(cpu() - c)
        assert (len(snap.devices) == devices) if devices else snap.devices, [d.errors for d in snap.devices]
print(json.dumps(out))
'''


def measure(node, reps):
    """The interleaved snapshots on a simulated node (its 8 GPUs, its device files)."""
    return measure_snapshots(reps, env=node.env(), dev_root=node.dev, devices=node.gpus)


def measure_snapshots(reps, env=None, dev_root=None, devices=0):
    """``reps`` snapshots in process and ``reps`` through the watchdog child, interleaved, in one fresh Python
    (``env``: its environment, default ours; ``dev_root``: where the device files are, default the system's;
    ``devices``: how many GPUs each snapshot must show, 0: at least one).  Returns
    ``{'inproc'|'watchdog': {'wall'|'cpu': [seconds per snapshot]}}``.  tests/device/run uses it on a real GPU."""
    proc = subprocess.run([sys.executable, '-c', _MEASURE, common.MODULE_UTILS, str(reps), dev_root or '', str(devices)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.decode('utf-8', 'replace'))
    return json.loads(proc.stdout.decode())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=30)
    parser.add_argument('--gpu-procs', type=int, nargs='+', default=[10, 100])
    parser.add_argument('--json')
    args = parser.parse_args(argv)
    rows = []
    with common.SimNode(gpus=8) as node:
        have = 0
        for count in sorted(args.gpu_procs):
            node.spawn_many(count - have)
            have = count
            data = measure(node, args.reps)
            row = {'gpu_procs': count}
            for name in ('inproc', 'watchdog'):
                row[name] = {key: common.stats(values) for key, values in data[name].items()}
            row['extra'] = {key: common.stats([b - a for a, b in zip(data['inproc'][key], data['watchdog'][key])])
                            for key in ('wall', 'cpu')}
            rows.append(row)
    print('| GPU procs | in process: wall ms | watchdog: wall ms | extra wall ms | in process: CPU ms | watchdog: CPU ms | extra CPU ms |')
    print('|---|---|---|---|---|---|---|')
    for row in rows:
        print('| %d | %s | %s | %s | %s | %s | %s |' % (
            row['gpu_procs'], common.fmt(row['inproc']['wall'], 1000, 1), common.fmt(row['watchdog']['wall'], 1000, 1),
            common.fmt(row['extra']['wall'], 1000, 1), common.fmt(row['inproc']['cpu'], 1000, 1),
            common.fmt(row['watchdog']['cpu'], 1000, 1), common.fmt(row['extra']['cpu'], 1000, 1)))
    if args.json:
        common.write_json(args.json, {'rows': rows, 'reps': args.reps, 'time': time.time(),
                                      'maxrss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    return 0


if __name__ == '__main__':
    sys.exit(main())
