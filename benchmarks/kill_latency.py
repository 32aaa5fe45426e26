#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Kill latency of gpu_kill against a plain ``kill -9``, on the simulated driver (tests/sim).

For each scenario (1 or 20 processes; TERM-honouring, or TERM-ignoring with force=true;
release_delay_ms 0 or 500) and each run, two batches of identical workloads (round robin over 4
GPUs, 1024 MiB each) are spawned at once (gpusim's spawn, batched: common.SimNode.spawn_many):

* module: the time of one core ``reclaim()`` call (what gpu_kill runs: snapshot, selection,
  protection, signals, wait, then polling the driver until the memory is confirmed free);
* floor: SIGKILL to the same number of pids back to back, then polling NVML (pynvml on the shim,
  one session kept open) until the GPUs' used memory has dropped by what they held.

The two are run alternately in the same run, and each run's ratio module/floor is reported:
median and spread (min-max) over the runs.  One extra measurement runs the real module through
``ansible localhost -m gpufleet.reclaim.gpu_kill`` on a one-node simulated fleet (a node has
the fake device files under /dev), including Ansible's own start-up.

Only processes this script spawned are signalled (their pids come from gpusim, and each signal
is identity-checked against the start time gpusim recorded).  Run as root for the Ansible part.
Usage: benchmarks/kill_latency.py [--runs N] [--runs-many N] [--timeout S] [--no-ansible] [--json PATH]
"""

import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, 'tests', 'sim')
BUILD = os.environ.get('GPUFLEET_SIM_BUILD') or os.path.join(SIM, 'build')
GPUSIM = os.path.join(SIM, 'gpusim')
SHIM = os.path.join(BUILD, 'libnvidia-ml.so.1')
GPUS = 4

sys.path.insert(0, os.path.join(ROOT, 'plugins', 'module_utils'))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))

import common  # noqa: E402 pylint: disable=wrong-import-position
import pynvml  # noqa: E402 pylint: disable=wrong-import-position

from core import killer  # noqa: E402 pylint: disable=wrong-import-position
from core.reclaim import ReclaimOptions, reclaim  # noqa: E402 pylint: disable=wrong-import-position
from core.select import Selector  # noqa: E402 pylint: disable=wrong-import-position


class Node(common.SimNode):
    """One simulated node (state file and fake device dir, GPUS GPUs) in a temp dir."""

    def __init__(self, release_delay_ms):
        super(Node, self).__init__(gpus=GPUS, release_delay_ms=release_delay_ms)

    def spawn(self, count, ignore_term, mib=1024):
        """``count`` workloads spread over the GPUs (round robin); returns [(pid, gpu, starttime)] in spawn order.

        One batch spawn (common.SimNode.spawn_many: gpusim's own spawn, run in a loop by two helper
        interpreters) instead of one ``gpusim spawn`` process per workload: the same workloads and
        state entries, without ~500 interpreter starts per benchmark run."""
        pids = set(self.spawn_many(count, mib=mib, argv=('python', 'bench.py'),
                                   options=('--ignore-term',) if ignore_term else ()))
        entries = [e for e in self.show()['processes'] if e['pid'] in pids]
        entries.sort(key=lambda e: int(e['argv'][-1]))  # workload N is on GPU N % GPUS
        if len(entries) != count:
            raise RuntimeError('gpusim registered %d of %d workloads' % (len(entries), count))
        return [(e['pid'], e['gpu'], e['starttime']) for e in entries]

    def clean(self):
        """Kill anything left of this node's workloads and drop dead entries from the state."""
        self.kill_all()


def load_shim(state):
    """Point pynvml at the shim by absolute path (LD_LIBRARY_PATH is read only at process start)."""
    os.environ['GPU_SIM_STATE'] = state
    pynvml._nvmlGetFunctionPointer_cache.clear()  # pylint: disable=protected-access
    pynvml.nvmlLib = ctypes.CDLL(SHIM)


def used_mib(handles):
    return [pynvml.nvmlDeviceGetMemoryInfo(h).used // (1024 * 1024) for h in handles]


def measure_module(node, procs, ignore_term, timeout):
    options = ReclaimOptions(timeout=timeout, force=ignore_term, release_timeout=30, audit_path=None)
    selector = Selector(pids=[pid for pid, _gpu, _start in procs])
    started = time.monotonic()
    result = reclaim(selector, options, dev_roots=[node.dev])
    elapsed = time.monotonic() - started
    if len(result['killed']) != len(procs) or result['unreleased'] or not all(r['released'] for r in result['release'].values()):
        raise RuntimeError('the module did not confirm the release: %s' % result['msg'])
    return elapsed


def measure_floor(procs, handles, mib=1024):
    """kill -9 every pid, then poll NVML until the memory they held is free."""
    before = used_mib(handles)
    target = list(before)
    for _pid, gpu, _start in procs:
        target[gpu] -= mib
    started = time.monotonic()
    for pid, _gpu, start in procs:
        if killer.send_signal(pid, start, signal.SIGKILL) != 'sent':
            raise RuntimeError('pid %d is not the workload gpusim started' % pid)
    while True:
        if all(used <= want for used, want in zip(used_mib(handles), target)):
            return time.monotonic() - started
        if time.monotonic() - started > 30:
            raise RuntimeError('the floor never saw the memory come back')
        time.sleep(0.001)


def scenario(node, count, ignore_term, runs, timeout, handles):
    """``runs`` paired runs: one spawn of 2 x ``count`` workloads, half for the module, half for the floor."""
    ratios, module_s, floor_s = [], [], []
    for run in range(runs):
        procs = node.spawn(2 * count, ignore_term)
        batches = {'module': procs[:count], 'floor': procs[count:]}
        time.sleep(0.05)  # let the workloads settle (reset their signal handlers)
        times = {}
        for what in (('module', 'floor') if run % 2 == 0 else ('floor', 'module')):
            if what == 'module':
                times[what] = measure_module(node, batches[what], ignore_term, timeout)
            else:
                times[what] = measure_floor(batches[what], handles)
        node.clean()
        module_s.append(times['module'])
        floor_s.append(times['floor'])
        ratios.append(times['module'] / times['floor'])
    return {'module_s': module_s, 'floor_s': floor_s, 'ratios': ratios}


def summary(values, scale=1.0):
    return {'median': statistics.median(values) * scale, 'min': min(values) * scale, 'max': max(values) * scale}


def via_ansible(timeout):
    """One ``ansible localhost -m gpufleet.reclaim.gpu_kill`` on a one-node fleet (root only)."""
    fleet_dir = tempfile.mkdtemp(prefix='gpufleet-bench-fleet-')
    coll = common.private_collections()
    up = [sys.executable, os.path.join(ROOT, 'tests', 'fleet', 'up'), '--nodes', '1', '--dir', fleet_dir, '-q']
    down = [sys.executable, os.path.join(ROOT, 'tests', 'fleet', 'down'), '--dir', fleet_dir]
    try:
        subprocess.run(up, check=True, stdout=subprocess.DEVNULL, timeout=120)
        ssh = ['ssh', '-F', os.path.join(fleet_dir, 'ssh_config'), 'node01']
        spawn = 'for i in $(seq 0 19); do gpusim spawn --gpu $((i %% %d)) --mib 1024 -- python bench.py $i; done' % GPUS
        out = subprocess.run(ssh + [spawn], stdout=subprocess.PIPE, check=True, timeout=120)
        pids = [int(line) for line in out.stdout.decode().split()]
        script = ('export ANSIBLE_COLLECTIONS_PATH=%s ANSIBLE_LOCALHOST_WARNING=False ANSIBLE_INVENTORY_UNPARSED_WARNING=False; '
                  's=$(date +%%s%%N); ansible localhost -o -m gpufleet.reclaim.gpu_kill -a %s; e=$(date +%%s%%N); '
                  'echo "WALL_MS $(( (e - s) / 1000000 ))"'
                  % (shlex.quote(coll), shlex.quote('pids=%s timeout=%s audit_log=' % (','.join(map(str, pids)), timeout))))
        out = subprocess.run(ssh + [script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)
        text = out.stdout.decode(errors='replace')
        wall = int(text.split('WALL_MS ')[1].split()[0]) / 1000.0
        result = json.loads(text[text.index('{'):text.rindex('}') + 1])
        return {'processes': len(pids), 'wall_s': wall, 'module_s': result['seconds'], 'killed': len(result['killed']),
                'freed_mib': result['freed_mib']}
    finally:
        subprocess.run(down, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)
        shutil.rmtree(fleet_dir, ignore_errors=True)
        shutil.rmtree(coll, ignore_errors=True)


def versions():
    """The run's header: common.machine_info() plus the versions that matter here."""
    info = common.machine_info()
    try:
        import ansible.release  # pylint: disable=import-outside-toplevel
        ansible_version = ansible.release.__version__
    except ImportError:
        ansible_version = None
    return {'date': info['date'], 'machine': '%s, %d CPUs, Linux %s' % (info['cpu'], info['cores'], info['kernel']),
            'python': info['python'], 'ansible-core': ansible_version,
            'nvidia-ml-py': getattr(pynvml, '__version__', None) or common.dist_version('nvidia-ml-py')}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=5, help='paired runs per 1-process scenario (default 5)')
    parser.add_argument('--runs-many', type=int, default=3, help='paired runs per 20-process scenario (default 3)')
    parser.add_argument('--timeout', type=float, default=0.5,
                        help='gpu_kill timeout before SIGKILL for the TERM-ignoring scenarios (default 0.5 s)')
    parser.add_argument('--no-ansible', action='store_true', help='skip the ansible localhost measurement')
    parser.add_argument('--json', help='also write the figures to this file')
    args = parser.parse_args()
    if not os.path.isfile(SHIM):
        sys.exit('the simulator is not built: run "make sim"')
    info = versions()
    print('# kill latency, %s; %s; Python %s, ansible-core %s, nvidia-ml-py %s' % (
        info['date'], info['machine'], info['python'], info['ansible-core'], info['nvidia-ml-py']))
    print('# %d (1 process) / %d (20 processes) paired runs per scenario; TERM-ignoring scenarios use force=true timeout=%ss'
          % (args.runs, args.runs_many, args.timeout))
    columns = ('processes', 'workload', 'delay_ms', 'module ms (min-max)', 'floor ms (min-max)', 'ratio (min-max)')
    header = '%-9s %-14s %-8s %-22s %-22s %-20s' % columns
    print(header)
    rows = []
    started = time.monotonic()
    for delay in (0, 500):
        node = Node(delay)
        try:
            load_shim(node.state)
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(GPUS)]
            for count in (1, 20):
                for ignore_term in (False, True):
                    runs = args.runs if count == 1 else args.runs_many
                    figures = scenario(node, count, ignore_term, runs, args.timeout, handles)
                    row = {'processes': count, 'workload': 'TERM-ignoring' if ignore_term else 'TERM-honouring',
                           'release_delay_ms': delay, 'runs': runs, 'module_ms': summary(figures['module_s'], 1000.0),
                           'floor_ms': summary(figures['floor_s'], 1000.0), 'ratio': summary(figures['ratios'])}
                    rows.append(row)
                    print('%-9d %-14s %-8d %-22s %-22s %-20s' % (
                        count, row['workload'], delay,
                        '%.0f (%.0f-%.0f)' % (row['module_ms']['median'], row['module_ms']['min'], row['module_ms']['max']),
                        '%.0f (%.0f-%.0f)' % (row['floor_ms']['median'], row['floor_ms']['min'], row['floor_ms']['max']),
                        '%.2f (%.2f-%.2f)' % (row['ratio']['median'], row['ratio']['min'], row['ratio']['max'])))
                    sys.stdout.flush()
            pynvml.nvmlShutdown()
        finally:
            node.close()
    ansible_run = None
    if not args.no_ansible:
        if os.geteuid() != 0:
            print('# ansible localhost measurement skipped: the simulated fleet needs root')
        else:
            ansible_run = via_ansible(args.timeout)
            print('# ansible localhost -m gpufleet.reclaim.gpu_kill, %d TERM-honouring processes on a fleet node: '
                  '%.2f s wall (Ansible start-up included), module %.3f s, killed %d, freed %s MiB' % (
                      ansible_run['processes'], ansible_run['wall_s'], ansible_run['module_s'], ansible_run['killed'],
                      sum(ansible_run['freed_mib'].values())))
    print('# total %.0f s' % (time.monotonic() - started))
    if args.json:
        with open(args.json, 'w') as handle:
            json.dump({'info': info, 'timeout': args.timeout, 'rows': rows, 'ansible': ansible_run},
                      handle, indent=1)


if __name__ == '__main__':
    main()
