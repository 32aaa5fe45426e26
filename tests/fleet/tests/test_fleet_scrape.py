# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The observability chain on a simulated fleet (issue #22): two nodes over real SSH, the guard installed by the
gpufleet.reclaim.guard role, GPU workloads (one over its user's limit) and Xids started on the nodes, ticks of
the installed agent run on the nodes; Debian's prometheus-node-exporter serves each node's textfile directory,
a real prometheus on 127.0.0.1 scrapes both, PromQL returns the guard's series from both nodes with their labels
and values, and every panel query of extras/grafana/gpufleet-dashboard.json returns data.

SAFETY: the policy is dry-run (nothing is signalled); the workloads are gpusim's, inside the nodes' PID
namespaces, and go with the fleet (tests/fleet/down, in a finally); the servers listen on 127.0.0.1 only and are
stopped by the pids this test started (prometheus_chain.serve).
"""

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FLEET = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(FLEET))
UP = os.path.join(FLEET, 'up')
DOWN = os.path.join(FLEET, 'down')
BIN = os.path.dirname(sys.executable)
PLAYBOOK = os.path.join(BIN, 'ansible-playbook') if os.path.exists(os.path.join(BIN, 'ansible-playbook')) else 'ansible-playbook'
GUARD = '/opt/gpufleet/bin/gpufleet-guard'
TEXTFILE_DIR = 'var/lib/node_exporter/textfile_collector'   # the role's default, a private path of every node
GIB = 1024

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which('unshare'), reason='the fleet needs root and util-linux unshare'),
    pytest.mark.skipif(not (shutil.which('prometheus') and (shutil.which('prometheus-node-exporter') or shutil.which('node_exporter'))),
                       reason='prometheus and prometheus-node-exporter are not installed (Debian packages; .ci/run installs them)'),
]

APPLY = '''---
- name: Install the guard with its metrics in node_exporter's textfile directory
  hosts: gpu_nodes
  gather_facts: false
  roles:
    - role: gpufleet.reclaim.guard
      vars:
        gpu_guard_mode: dry-run
        gpu_guard_metrics_path: /%s/gpufleet.prom
        gpu_guard_policy:
          users:
            alice: {max_mem_gib_per_gpu: 8}
          escalation: {warn_again_after: 2s, act_after: 4s, sigkill_after: 5s}
          rogue: {act_min_level: critical}
          notify: {tty: false}
''' % TEXTFILE_DIR


def run(cmd, env=None, timeout=180):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False,
                          universal_newlines=True)
    assert proc.returncode == 0, '%s failed (%d):\n%s' % (' '.join(cmd), proc.returncode, proc.stdout)
    return proc.stdout


def collection(tmp_path):
    """This checkout as the collection gpufleet.reclaim (for ansible-playbook and for importing the test helpers)."""
    root = tmp_path / 'collections'
    (root / 'ansible_collections' / 'gpufleet').mkdir(parents=True)
    os.symlink(REPO, str(root / 'ansible_collections' / 'gpufleet' / 'reclaim'))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return str(root)


def test_two_nodes_through_node_exporter_and_prometheus(tmp_path):
    fleet_dir = str(tmp_path / 'fleet')
    collections = collection(tmp_path)
    pc = importlib.import_module('ansible_collections.gpufleet.reclaim.tests.unit.extras.prometheus_chain')
    redteam = importlib.import_module('ansible_collections.gpufleet.reclaim.tests.unit.security.redteam')
    redteam.ensure_users(('alice', 'bob', 'carol'))
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get('PATH', ''), ANSIBLE_COLLECTIONS_PATH=collections,
               ANSIBLE_SSH_CONTROL_PATH_DIR=str(tmp_path / 'cp'), ANSIBLE_HOST_KEY_CHECKING='True', ANSIBLE_NOCOLOR='1')
    ssh_config = os.path.join(fleet_dir, 'ssh_config')

    def on(node, *argv):
        return run(['ssh', '-F', ssh_config, node, ' '.join(shlex.quote(str(a)) for a in argv)], timeout=60)

    begun = time.monotonic()
    try:
        run([sys.executable, UP, '--nodes', '2', '--gpus', '4', '--dir', fleet_dir, '-q'], env=env, timeout=300)
        playbook = tmp_path / 'apply.yml'
        playbook.write_text(APPLY)
        run([PLAYBOOK, '-i', os.path.join(fleet_dir, 'inventory.ini'), str(playbook)], env=env)
        # node01: alice 12 GiB on GPU 0 (over her 8 GiB per GPU), bob 6 GiB on GPU 1
        # node02: alice 4 GiB on GPU 0 (within), carol 20 GiB idle on GPU 2; Xid 13 of alice's process, Xid 79 on GPU 1
        on('node01', 'gpusim', 'spawn', '--gpu', 0, '--mib', 12 * GIB, '--util', 50, '--user', 'alice', '--', 'python', 'big.py')
        on('node01', 'gpusim', 'spawn', '--gpu', 1, '--mib', 6 * GIB, '--util', 30, '--user', 'bob', '--', 'python', 'bob.py')
        app = int(on('node02', 'gpusim', 'spawn', '--gpu', 0, '--mib', 4 * GIB, '--util', 40, '--user', 'alice', '--',
                     'python', 'train.py').split()[0])
        on('node02', 'gpusim', 'spawn', '--gpu', 2, '--mib', 20 * GIB, '--util', 0, '--user', 'carol', '--', 'python', 'nb.py')
        on('node02', 'gpusim', 'xid', '--gpu', 0, '--code', 13, '--pid', app)
        on('node02', 'gpusim', 'xid', '--gpu', 1, '--code', 79)
        # the installed agent's ticks, as its timer would run them, 5 s apart on the agent's clock, the last one now
        now = time.time()
        summaries = {}
        for node in ('node01', 'node02'):
            summaries[node] = [json.loads(on(node, GUARD, 'tick', '--json', '--now', '%.3f' % (now - back)))
                               for back in (15, 10, 5, 0)]
        decisions = [d['decision'] for s in summaries['node01'] for d in s['decisions'] if d.get('user') == 'alice']
        assert 'act' in decisions, summaries['node01']
        dirs = dict((node, os.path.join(fleet_dir, 'nodes', node, 'fs', TEXTFILE_DIR)) for node in ('node01', 'node02'))
        assert all(os.listdir(d) == ['gpufleet.prom'] for d in dirs.values()), dirs
        with pc.serve(tmp_path, dirs, rules=pc.RULES) as served:
            check_the_guard_series(pc, served, now, summaries)
            panels = pc.check_every_dashboard_panel_query_returns_data(served['port'])
            assert len(panels['Nodes with a ticking guard']) == 1 and float(panels['Nodes with a ticking guard'][0]['value'][1]) == 2
    finally:
        run([sys.executable, DOWN, '--dir', fleet_dir], env=env)
    assert time.monotonic() - begun < 120


def check_the_guard_series(pc, served, now, summaries):
    port, one, two = served['port'], served['targets']['node01'], served['targets']['node02']
    assert pc.by(pc.query(port, 'up{job="node"}'), 'instance', 'node') == {(one, 'node01'): 1.0, (two, 'node02'): 1.0}
    assert pc.by(pc.query(port, 'node_textfile_scrape_error'), 'instance') == {(one,): 0.0, (two,): 0.0}
    ticks = pc.by(pc.query(port, 'gpufleet_guard_last_tick_timestamp_seconds'), 'instance')
    assert set(ticks) == {(one,), (two,)} and all(abs(value - now) < 1 for value in ticks.values()), ticks
    assert pc.by(pc.query(port, 'gpufleet_guard_ticks_total'), 'instance') == {(one,): 4.0, (two,): 4.0}
    assert pc.by(pc.query(port, 'gpufleet_guard_mode == 1'), 'instance', 'mode') == {(one, 'dry-run'): 1.0, (two, 'dry-run'): 1.0}
    assert pc.by(pc.query(port, 'gpufleet_guard_policy_valid'), 'instance') == {(one,): 1.0, (two,): 1.0}
    memory = pc.by(pc.query(port, 'gpufleet_user_gpu_memory_mib'), 'instance', 'user', 'gpu')
    assert memory == {(one, 'alice', '0'): 12.0 * GIB, (one, 'bob', '1'): 6.0 * GIB,
                      (two, 'alice', '0'): 4.0 * GIB, (two, 'carol', '2'): 20.0 * GIB}, memory
    used = pc.by(pc.query(port, 'gpufleet_gpu_memory_used_mib'), 'instance', 'gpu')
    assert len(used) == 8 and used[(one, '0')] >= 12 * GIB and used[(two, '2')] >= 20 * GIB, used
    # alice over her limit on node01 only: acted on (logged: dry-run), per user and per rule
    actions = pc.by(pc.query(port, 'gpufleet_guard_user_actions_total'), 'instance', 'user')
    acted = sum(1 for s in summaries['node01'] for d in s['decisions'] if d.get('user') == 'alice' and d['decision'] == 'act')
    assert actions == {(one, 'alice'): float(acted)} and acted >= 1, (actions, summaries)
    assert pc.by(pc.query(port, 'gpufleet_guard_violations'), 'instance', 'rule') == {(one, 'max_mem_per_gpu'): 1.0}
    # node02's Xids by fault class, the lost GPU that wants a reboot
    xids = pc.by(pc.query(port, 'gpufleet_gpu_xid_errors'), 'instance', 'gpu', 'code', 'fault')
    assert xids == {(two, '0', '13', 'application'): 1.0, (two, '1', '79', 'gpu'): 1.0}, xids
    assert pc.by(pc.query(port, 'gpufleet_gpu_reboot_wanted == 1'), 'instance', 'gpu') == {(two, '1'): 1.0}
    assert pc.by(pc.query(port, 'gpufleet_gpu_health_status > 0'), 'instance', 'gpu') == {(two, '1'): 2.0}
