#!/usr/bin/env python
# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Fleet-scale timings of the playbooks on simulated fleets (tests/fleet), default vs tuned Ansible.

    PATH=/tmp/venv/bin:$PATH python benchmarks/fleet_cleanup.py [--nodes 10,50] [--report-nodes 10,25]
        [--repeat 1] [--json out.json] [--settings]

For each fleet size: `ansible gpu_nodes -m ansible.builtin.ping` (the floor: Ansible's own cost of
reaching every node once), then gpufleet.reclaim.rogue_cleanup with reclaim_confirm=true against
one disguised miner per node (every node audits, kills one process and verifies the memory), each
with Ansible's defaults and with extras/ansible.cfg. With --report-nodes, also
gpufleet.reclaim.inventory_report; with --settings, the effect of each tuned setting alone.

"default" is Ansible as installed: no ansible.cfg, forks 5, linear strategy, pipelining off
(forced with -e ansible_pipelining=false, since the simulated inventory turns it on), ssh_args with
compression and ControlPersist=60s. "tuned" is extras/ansible.cfg. Every run gets a fresh
ControlPath directory (cold SSH connections) unless the setting says warm. Only loopback SSH to the
simulated nodes; only processes gpusim started on them are signalled.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position
FLEET = os.path.join(REPO, 'tests', 'fleet')
TUNED = os.path.join(REPO, 'extras', 'ansible.cfg')
WALLET = '44AFFq5kSiGBoZ4NMDwYtN18obc8AemS33DBLWs3H7otXft3XjrpDtQGv7SqSsaBYBb98uNbr2VBBEt7f2wfn3RVGQBEP3A'
MINER = ['python', 'train.py', '--url', 'stratum+tcp://pool.example.net:3333', '--user', WALLET]


def collections_path():
    for path in (os.environ.get('ANSIBLE_COLLECTIONS_PATH', '').split(':')[0], os.path.join(REPO, 'build', 'collections')):
        if path and os.path.isdir(os.path.join(path, 'ansible_collections', 'gpufleet', 'reclaim')):
            return path
    sys.exit('no collection tree: run `make collection` (or set ANSIBLE_COLLECTIONS_PATH)')


class Bench(object):
    def __init__(self, work, collections):
        self.work = work
        self.collections = collections
        self.empty_cfg = os.path.join(work, 'empty.cfg')
        with open(self.empty_cfg, 'w', encoding='utf-8') as handle:
            handle.write('[defaults]\n')
        self.results = []

    def env(self, config, control_dir, extra=None):
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=self.collections, ANSIBLE_NOCOLOR='1',
                   ANSIBLE_CONFIG=TUNED if config == 'tuned' else self.empty_cfg,
                   ANSIBLE_SSH_CONTROL_PATH_DIR=control_dir, ANSIBLE_HOST_KEY_CHECKING='True')
        env.update(extra or {})
        return env

    def timed(self, label, nodes, config, argv, extra_env=None, warm=False, name=None):
        control_dir = os.path.join(self.work, 'cp-%s-%d-%s' % (config, nodes, label.replace(' ', '_')))
        if not warm:
            shutil.rmtree(control_dir, ignore_errors=True)
        os.makedirs(control_dir, exist_ok=True)
        if config == 'default':
            argv = argv + ['-e', 'ansible_pipelining=false']
        # the controller's CPU (ansible and every fork it waited for) and its memory with the forks
        busy0 = common.machine_busy_s()
        meas = common.run_child(argv, env=self.env(config, control_dir, extra_env), cwd=self.work, timeout=3600,
                                sample_pss=True)
        nodes_cpu = max(0.0, common.machine_busy_s() - busy0 - meas.cpu_s)
        seconds = meas.wall_s
        if meas.returncode != 0:
            sys.stdout.write(meas.text()[-4000:])
            raise SystemExit('%s on %d nodes (%s) exited %d' % (label, nodes, config, meas.returncode))
        row = {'what': label, 'nodes': nodes, 'config': name or config, 'seconds': round(seconds, 2),
               'per_node_s': round(seconds / nodes, 3), 'load1': round(os.getloadavg()[0], 2),
               'controller_cpu_s': round(meas.cpu_s, 2), 'controller_cpu_per_node_s': round(meas.cpu_s / nodes, 4),
               'controller_peak_rss_mib': round(meas.maxrss_kib / 1024.0, 1),
               'controller_peak_pss_mib': round(meas.peak_pss_kib / 1024.0, 1),
               'controller_pss_per_node_mib': round(meas.peak_pss_kib / 1024.0 / nodes, 2),
               # the rest of the machine's busy time: the simulated nodes' sshd and modules (and any other load)
               'nodes_cpu_s': round(nodes_cpu, 2), 'nodes_cpu_per_node_s': round(nodes_cpu / nodes, 4)}
        self.results.append(row)
        print('%-34s %3d nodes  %-22s %7.2f s  (%.3f s/node, load %.1f; controller %.1f CPU-s, %.3f per node, peak %.0f MiB PSS;'
              ' nodes %.1f CPU-s, %.3f per node)'
              % (label, nodes, row['config'], seconds, seconds / nodes, row['load1'], meas.cpu_s, meas.cpu_s / nodes,
                 row['controller_peak_pss_mib'], nodes_cpu, nodes_cpu / nodes), flush=True)
        return seconds


def spawn_miners(fleet_dir, nodes, control_dir):
    """One disguised miner on each of the first ``nodes`` nodes.  These ssh connections share one
    master connection per node (``control_dir``, apart from Ansible's): a node's later spawns skip
    the key exchange, and every timed Ansible run still starts cold."""
    ssh_config = os.path.join(fleet_dir, 'ssh_config')
    names = node_names(fleet_dir)  # node01.. or node001.. (up widens the numbers past 99 nodes)
    mux = ['-o', 'ControlMaster=auto', '-o', 'ControlPath=%s/%%n' % control_dir, '-o', 'ControlPersist=1800']

    def one(index):
        remote = ['gpusim', 'spawn', '--gpu', '0', '--mib', '2048', '--util', '100', '--user', 'nobody', '--'] + MINER
        subprocess.run(['ssh', '-F', ssh_config] + mux + [names[index - 1], ' '.join(shlex.quote(a) for a in remote)],
                       check=True, stdout=subprocess.DEVNULL)
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, range(1, nodes + 1)))


def stop_masters(fleet_dir, control_dir):
    """End the spawn connections' master processes (ours: started by spawn_miners)."""
    ssh_config = os.path.join(fleet_dir, 'ssh_config')
    for name in sorted(os.listdir(control_dir)) if os.path.isdir(control_dir) else ():
        subprocess.run(['ssh', '-F', ssh_config, '-o', 'ControlPath=%s/%%n' % control_dir, '-O', 'exit', name],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=30)


def fleet_up(fleet_dir, nodes):
    subprocess.run([sys.executable, os.path.join(FLEET, 'up'), '--nodes', str(nodes), '--dir', fleet_dir, '--gpus', '2', '-q'],
                   check=True)


def node_names(fleet_dir):
    """The host names of the fleet's ``gpu_nodes`` group, in inventory order."""
    names, section = [], None
    with open(os.path.join(fleet_dir, 'inventory.ini'), encoding='utf-8') as handle:
        for line in handle.read().splitlines():
            if line.startswith('['):
                section = line
            elif section == '[gpu_nodes]' and line.strip() and not line.startswith('#'):
                names.append(line.split()[0])
    return names


def sub_inventory(fleet_dir, nodes, path):
    """An inventory of the fleet's first ``nodes`` nodes (what ``up --nodes N`` writes for N nodes, and
    the same group vars), so that one fleet of the largest size serves every size."""
    with open(os.path.join(fleet_dir, 'inventory.ini'), encoding='utf-8') as handle:
        lines = handle.read().splitlines()
    out, hosts, section = [], 0, None
    for line in lines:
        if line.startswith('['):
            section = line
        elif section == '[gpu_nodes]' and line.strip() and not line.startswith('#'):
            hosts += 1
            if hosts > nodes:
                continue
        out.append(line)
    if hosts < nodes:
        raise SystemExit('the fleet has %d nodes, not %d' % (hosts, nodes))
    with open(path, 'w', encoding='utf-8') as handle:
        handle.write('\n'.join(out) + '\n')
    return path


def fleet_down(fleet_dir):
    subprocess.run([sys.executable, os.path.join(FLEET, 'down'), '--dir', fleet_dir], check=False, stdout=subprocess.DEVNULL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n', maxsplit=1)[0])
    parser.add_argument('--nodes', default='10,50', help='fleet sizes for rogue_cleanup (comma-separated)')
    parser.add_argument('--report-nodes', default='', help='fleet sizes for inventory_report, e.g. 10,25')
    parser.add_argument('--settings', action='store_true', help='also time each tuned setting alone (on the largest report size)')
    parser.add_argument('--repeat', type=int, default=1)
    parser.add_argument('--configs', default='default,tuned', help='ansible.cfg variants to time: default, tuned or both')
    parser.add_argument('--json', help='write the results here')
    args = parser.parse_args()
    configs = [c for c in args.configs.split(',') if c]
    for config in configs:
        if config not in ('default', 'tuned'):
            parser.error('--configs: invalid value %r: expected default, tuned or both, comma-separated' % config)
    collections = collections_path()
    work = tempfile.mkdtemp(prefix='gpufleet-bench-fleet-')
    bench = Bench(work, collections)
    sizes = sorted(set(int(n) for n in (args.nodes + ',' + args.report_nodes).split(',') if n))
    print('controller: %d CPUs, load %.1f; collection %s' % (os.cpu_count(), os.getloadavg()[0], collections))
    # one fleet of the largest size for every size: each size runs on an inventory of the first N
    # nodes (the others' sshd sit idle), instead of bringing a fleet up and down per size
    try:
        fleet_dir = os.path.join(work, 'fleet')
        mux_dir = os.path.join(work, 'mux')
        os.makedirs(mux_dir)
        try:
            fleet_up(fleet_dir, sizes[-1])
            for nodes in sizes:
                inventory = sub_inventory(fleet_dir, nodes, os.path.join(work, 'inventory-%d.ini' % nodes))
                for _round in range(args.repeat):
                    for config in configs:
                        bench.timed('ping (floor)', nodes, config,
                                    ['ansible', 'gpu_nodes', '-i', inventory, '-m', 'ansible.builtin.ping'])
                        if str(nodes) in args.report_nodes.split(','):
                            bench.timed('inventory_report', nodes, config,
                                        ['ansible-playbook', '-i', inventory, 'gpufleet.reclaim.inventory_report',
                                         '-e', 'report_dir=%s' % os.path.join(work, 'report')])
                        if str(nodes) in args.nodes.split(','):
                            spawn_miners(fleet_dir, nodes, mux_dir)
                            bench.timed('rogue_cleanup confirm', nodes, config,
                                        ['ansible-playbook', '-i', inventory, 'gpufleet.reclaim.rogue_cleanup',
                                         '-e', 'reclaim_confirm=true', '-e', 'kill_timeout=5'])
                if args.settings and args.report_nodes and nodes == max(int(n) for n in args.report_nodes.split(',')):
                    playbook = ['ansible-playbook', '-i', inventory, 'gpufleet.reclaim.inventory_report',
                                '-e', 'report_dir=%s' % os.path.join(work, 'report')]
                    single = [('default + pipelining', {}, ['-e', 'ansible_pipelining=true']),
                              ('default + forks=50', {'ANSIBLE_FORKS': '50'}, []),
                              ('default + strategy=free', {'ANSIBLE_STRATEGY': 'free'}, []),
                              ('default + ssh_args without -C', {'ANSIBLE_SSH_ARGS': '-o ControlMaster=auto -o ControlPersist=60s'}, [])]
                    for label, extra_env, extra_args in single:
                        bench.timed('inventory_report', nodes, 'default', playbook + extra_args, extra_env=extra_env, name=label)
                    bench.timed('inventory_report', nodes, 'tuned', playbook)
                    bench.timed('inventory_report', nodes, 'tuned', playbook, warm=True, name='tuned, warm ControlPersist')
        finally:
            stop_masters(fleet_dir, mux_dir)
            fleet_down(fleet_dir)
    finally:
        if args.json:
            with open(args.json, 'w', encoding='utf-8') as handle:
                json.dump(bench.results, handle, indent=1)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
