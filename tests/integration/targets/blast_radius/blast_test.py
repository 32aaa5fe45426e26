# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Blast-radius limits on a simulated fleet (issue #30's acceptance).  Run by runme.sh: python blast_test.py, which starts
a fleet of 11 nodes with one GPU each (tests/fleet/up) and stops it (tests/fleet/down) when it ends.

1. node01..node10 (``gpu_nodes:!node11``) each log a genuine Xid 48 (``gpusim xid --code 48``).  Bad limit values fail
   before any node is touched; check mode and report-only show the plan with the limit applied (2 would act, 8 held);
   the first confirmed ``remediate`` resets 2 GPUs and names the other 8 as held; a second run within the window resets
   none (the 2 count as disrupted, read from the nodes' own state); ``inventory_report`` lists those 2 and why;
   ``-e reclaim_max_nodes_pct=100`` resets the other 8.
2. 150 miners (``gpusim spawn`` with a stratum URL), 50 on each of node01..node03: ``rogue_cleanup`` reports it would
   kill 100 and hold 50, then kills 100 (node01's and node02's) and reports node03's 50 held; the next run kills those.
3. node11: the guard's ladder (the guard role, policy ``remediation``, ticks run by hand) on a GPU that keeps failing
   (a new Xid 48 after every reset) resets it twice, then holds the reset by its budget: the tick says
   ``budget_exhausted``, the metric ``gpufleet_guard_remediation_budget_exhausted`` is 1 (promtool checks the file).

Ground truth comes from ``gpusim show`` on the nodes and the nodes' own files.  Only processes this test started
(``gpusim spawn``) are signalled, by the modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

# the collection under test (ansible-test puts its copy first on ANSIBLE_COLLECTIONS_PATH)
COLL = os.path.join(os.environ['ANSIBLE_COLLECTIONS_PATH'].split(':')[0], 'ansible_collections', 'gpufleet', 'reclaim')

NODES = ['node%02d' % i for i in range(1, 11)]
TARGET = 'gpu_nodes:!node11'
GUARD_NODE = 'node11'
WALLET = '44AFFq5kSiGBoZ4NMDwYtN18obc8AemS33DBLWs3H7otXft3XjrpDtQGv7SqSsaBYBb98uNbr2VBBEt7f2wfn3RVGQBEP3A'
MINER = ['python', 'train.py', '--url', 'stratum+tcp://pool.example.net:3333', '--user', WALLET, '-p', 'x']
HELD_2_OF_10 = 'held: blast-radius limit (2 of 10 nodes disrupted in the last 1h)'
GUARD = '/opt/gpufleet/bin/gpufleet-guard'
# the guard role on one node, mode enforce, ticks run by hand (no timer runs on a simulated node)
GUARD_PLAY = '''---
- name: The guard with its remediation ladder on
  hosts: %(node)s
  gather_facts: false
  roles:
    - role: gpufleet.reclaim.guard
      vars:
        gpu_guard_install_prereqs: false
        gpu_guard_mode: enforce
        gpu_guard_policy: %(policy)s
'''


class Fleet(object):
    """The simulated fleet in ``directory`` (tests/fleet/up); ``env``: the environment of the playbooks (the Slurm
    target adds SLURM_CONF), ``target``: their target_hosts.  The Slurm target imports it."""

    def __init__(self, directory, env=None, target=TARGET):
        self.dir = directory
        self.inventory = os.path.join(directory, 'inventory.ini')
        self.out = os.path.join(directory, 'out')
        os.makedirs(self.out, exist_ok=True)
        self.runs = 0
        self.env = env
        self.target = target

    def on(self, node, argv, check=True):
        """``argv`` on ``node`` over SSH; its standard output."""
        proc = subprocess.run(['ssh', '-F', os.path.join(self.dir, 'ssh_config'), node, ' '.join(shlex.quote(str(a)) for a in argv)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300, check=False)
        assert proc.returncode == 0 or not check, '%s on %s failed (%d): %s' % (argv, node, proc.returncode, proc.stderr)
        return proc.stdout

    def show(self, node):
        return json.loads(self.on(node, ['gpusim', 'show']))

    def resets(self):
        return dict((node, self.show(node)['gpus'][0]['reset_count']) for node in NODES)

    def playbook(self, name, extra_vars, check=False, expect_rc=0, playbook=None):
        """ansible-playbook gpufleet.reclaim.NAME (or the file ``playbook``); (stdout, the summary file or None)."""
        self.runs += 1
        summary = os.path.join(self.out, '%02d-%s.json' % (self.runs, name))
        evars = dict({'target_hosts': self.target, 'summary_file': summary}, **extra_vars)
        argv = ['ansible-playbook', '-i', self.inventory, playbook or 'gpufleet.reclaim.%s' % name, '-e', json.dumps(evars)]
        argv += ['--check'] if check else []
        print('\n### %s%s %s' % (name, ' --check' if check else '', json.dumps(extra_vars)), flush=True)
        begun = time.monotonic()
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, env=self.env,
                              check=False)
        sys.stdout.write(proc.stdout[-20000:])
        print('### %s: rc=%d in %.1f s' % (name, proc.returncode, time.monotonic() - begun), flush=True)
        assert proc.returncode == expect_rc, '%s exited %d, expected %d' % (name, proc.returncode, expect_rc)
        data = None
        if os.path.exists(summary):
            with open(summary) as handle:
                data = json.load(handle)
        return proc.stdout, data

    def guard(self, node, policy):
        """The guard role on ``node`` with ``policy`` (mode enforce)."""
        playbook = os.path.join(self.out, 'guard-%s.yml' % node)
        with open(playbook, 'w') as handle:
            handle.write(GUARD_PLAY % {'node': node, 'policy': json.dumps(policy)})
        self.playbook('guard', {}, playbook=playbook)

    def tick(self, node):
        """One guard tick on ``node``, run by hand the way its timer would: the tick's summary."""
        return json.loads(self.on(node, [GUARD, 'tick', '--json']))

    def node_file(self, node, *parts):
        """The text of one of ``node``'s private files, read from the host (nodes/NODE/fs/...), or None."""
        path = os.path.join(self.dir, 'nodes', node, 'fs', *parts)
        if not os.path.exists(path):
            return None
        with open(path) as handle:
            return handle.read()

    def metrics(self, node):
        return self.node_file(node, 'var', 'lib', 'node_exporter', 'textfile_collector', 'gpufleet.prom')


def touched(stdout):
    """The nodes the run's recap names (a node that ran no task is not in it)."""
    return sorted(set(re.findall(r'^(node\d+)\s+: ok=', stdout, re.M)))


def test_remediate_resets_at_most_a_fifth_of_the_fleet_per_window(fleet):
    for node in NODES:
        fleet.on(node, ['gpusim', 'xid', '--gpu', '0', '--code', '48'])
    for bad, text in ((-5, 'reclaim_max_nodes_pct: invalid value -5: negative: expected a percentage from 0 to 100'),
                      (150, 'reclaim_max_nodes_pct: invalid value 150: over 100'),
                      ('lots', "reclaim_max_nodes_pct: invalid value 'lots': not a number")):
        stdout, _summary = fleet.playbook('remediate', {'reclaim_max_nodes_pct': bad, 'reclaim_confirm': True}, expect_rc=2)
        assert text in stdout and touched(stdout) == [], 'a bad value must fail before any node is touched'
    stdout, _summary = fleet.playbook('remediate', {'reclaim_window': '8d', 'reclaim_confirm': True}, expect_rc=2)
    assert "reclaim_window: invalid value '8d': over 7d00h" in stdout and touched(stdout) == []

    for evars, check in (({'reclaim_confirm': True}, True), ({}, False)):   # check mode, then report only: the same plan
        stdout, summary = fleet.playbook('remediate', evars, check=check)
        assert summary['blast_radius']['act'] == NODES[:2] and summary['nodes_held'] == NODES[2:], summary['blast_radius']
        assert set(summary['blast_radius']['held'].values()) == {HELD_2_OF_10}
        rows = dict((g['host'], (g['status'], g['ladder'])) for g in summary['gpus'])
        assert rows['node01'] == ('would_remediate', ['reset: would_run']) and rows['node03'][0] == 'held', rows
        assert 'HELD NODE node10 | %s' % HELD_2_OF_10 in stdout
    assert set(fleet.resets().values()) == {0}, 'check mode and report only reset nothing'

    stdout, summary = fleet.playbook('remediate', {'reclaim_confirm': True})
    assert fleet.resets() == dict((node, 1 if node in NODES[:2] else 0) for node in NODES), fleet.resets()
    assert summary['nodes_held'] == NODES[2:] and summary['blast_radius']['disrupted'] == {}
    for node in NODES[2:]:
        assert 'HELD NODE %s | %s' % (node, HELD_2_OF_10) in stdout
    assert 'to act on more in one window, raise reclaim_max_nodes_pct (now 20)' in stdout

    # a second run within the window: node01 and node02 count as disrupted (their own state says so); nothing is reset
    stdout, summary = fleet.playbook('remediate', {'reclaim_confirm': True})
    assert set(fleet.resets().values()) == {0, 1} and sum(fleet.resets().values()) == 2, fleet.resets()
    assert sorted(summary['blast_radius']['disrupted']) == NODES[:2] and summary['nodes_held'] == NODES[2:]
    assert summary['blast_radius']['disrupted']['node01'][0].startswith('reset of GPU GPU-'), summary['blast_radius']
    assert 'node01: disrupted already: reset of GPU' in stdout

    # the fleet report shows the nodes gpufleet disrupted and why
    report_dir = os.path.join(fleet.out, 'report')
    stdout, _summary = fleet.playbook('inventory_report', {'report_dir': report_dir})
    with open(os.path.join(report_dir, 'fleet.json')) as handle:
        disrupted = json.load(handle)['offenders']['disrupted_nodes']
    assert [d['host'] for d in disrupted] == NODES[:2] and 'reset of GPU' in disrupted[0]['why'][0], disrupted
    with open(os.path.join(report_dir, 'index.html')) as handle:
        assert 'Nodes disrupted by gpufleet' in handle.read()
    assert 'disrupted by gpufleet (they count against the blast-radius limit): 2 node(s): node01 (reset of GPU' in stdout

    stdout, summary = fleet.playbook('remediate', {'reclaim_confirm': True, 'reclaim_max_nodes_pct': 100})
    assert set(fleet.resets().values()) == {1}, fleet.resets()
    assert summary['nodes_held'] == [] and summary['blast_radius']['act'] == NODES[2:], summary['blast_radius']


def spawn_miners(fleet, nodes, count):
    """``count`` miners on each of ``nodes`` (one SSH session per node, in parallel); {node: [pid, ...]}."""
    script = 'for i in $(seq %d); do gpusim spawn --gpu 0 --mib 64 --util 100 --user eve -- %s || exit 1; done' % (
        count, ' '.join(shlex.quote(a) for a in MINER))
    procs = dict((node, subprocess.Popen(['ssh', '-F', os.path.join(fleet.dir, 'ssh_config'), node, script], stdout=subprocess.PIPE,
                                         universal_newlines=True)) for node in nodes)
    pids = {}
    for node, proc in procs.items():
        out, _err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (node, out)
        pids[node] = [int(line.split()[0]) for line in out.splitlines() if line.strip()]
        assert len(pids[node]) == count, (node, out)
    return pids


def alive(fleet, pids):
    out = {}
    for node, mine in pids.items():
        state = dict((p['pid'], p['alive']) for p in fleet.show(node)['processes'])
        out[node] = len([pid for pid in mine if state.get(pid)])
    return out


def test_rogue_cleanup_kills_100_of_150_miners_and_reports_50_held(fleet):
    pids = spawn_miners(fleet, NODES[:3], 50)
    stdout, summary = fleet.playbook('rogue_cleanup', {})
    assert (summary['would_kill'], summary['held']) == (100, 50), summary
    reason = 'held: blast-radius limit (100 of 150 processes in this run, reclaim_max_kills=100)'
    stdout, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': True, 'kill_timeout': 2})
    assert (summary['killed'], summary['held'], summary['kill_failures']) == (100, 50, 0), summary
    assert alive(fleet, pids) == {'node01': 0, 'node02': 0, 'node03': 50}
    assert summary['nodes_held'] == ['node03'] and 'HELD NODE node03 | %s' % reason in stdout
    assert len([p for p in summary['processes'] if p['action'] == reason]) == 50
    assert 'raise reclaim_max_kills (now 100)' in stdout
    _stdout, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': True, 'kill_timeout': 2})
    assert (summary['killed'], summary['held']) == (50, 0) and alive(fleet, pids) == dict.fromkeys(NODES[:3], 0), summary


def test_the_guards_ladder_resets_a_failing_gpu_twice_then_its_budget_holds_it(fleet):
    fleet.guard(GUARD_NODE, {'notify': {'tty': False},
                             'remediation': {'enabled': True, 'drain_command': ['/bin/true'], 'max_resets': 2, 'window': '24h'}})
    for attempt in (1, 2, 3, 4):
        fleet.on(GUARD_NODE, ['gpusim', 'xid', '--gpu', '0', '--code', '48'])   # the GPU fails again
        summary = fleet.tick(GUARD_NODE)
        ladder = [(s['step'], s['status']) for s in summary['remediation']['gpus'][0]['ladder']]
        count = fleet.show(GUARD_NODE)['gpus'][0]['reset_count']
        text = fleet.metrics(GUARD_NODE)
        if attempt <= 2:
            assert ladder == [('reset', 'done')] and count == attempt, (attempt, ladder, count)
            assert 'gpufleet_guard_remediation_budget_exhausted 0' in text
        else:   # the third failure within 24 h: held, and the fourth too (the event stays unhandled until a human acts)
            assert ladder == [('reset', 'budget_exhausted')] and count == 2, (attempt, ladder, count)
            assert summary['remediation']['remediation_budget_exhausted'] is True
            why = summary['remediation']['gpus'][0]['ladder'][0]['detail']
            assert 'reset 2 time(s) in the last 1d00h (remediation.max_resets 2)' in why, why
            assert 'gpufleet_guard_remediation_budget_exhausted 1' in text
            assert 'gpufleet_guard_remediation_held{gpu="0",reason="budget",step="reset"} 1' in text
    assert 'gpufleet_guard_remediation_steps_total{step="reset"} 2' in text
    promtool = shutil.which('promtool')
    if promtool:
        checked = subprocess.run([promtool, 'check', 'metrics'], input=text.encode(), capture_output=True, timeout=60, check=False)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    log = fleet.node_file(GUARD_NODE, 'var', 'log', 'gpufleet', 'guard.jsonl')
    held = [json.loads(line) for line in log.splitlines() if '"budget_exhausted"' in line]
    assert held and all(r['event'] == 'guard_remediation' and r['step'] == 'reset' for r in held), held


@contextlib.contextmanager
def simulated_fleet(name, *up_options):
    """A fleet of this test's own (tests/fleet/up with ``up_options`` in a fresh directory, searchable by Slurm's and
    munge's users), always stopped by tests/fleet/down afterwards; yields the directory."""
    directory = tempfile.mkdtemp(prefix='gpufleet-it-%s.' % name)
    os.chmod(directory, 0o755)
    os.environ.update(ANSIBLE_HOST_KEY_CHECKING='True', ANSIBLE_SSH_CONTROL_PATH_DIR=os.path.join(directory, 'cp'), ANSIBLE_NOCOLOR='1')
    try:
        subprocess.run([os.path.join(COLL, 'tests', 'fleet', 'up'), '--dir', directory, '-q'] + list(up_options), check=True, timeout=600)
        yield directory
    finally:
        subprocess.run([os.path.join(COLL, 'tests', 'fleet', 'down'), '--dir', directory], check=False, timeout=300)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == '__main__':
    BEGUN = time.monotonic()
    with simulated_fleet('blast', '--nodes', '11', '--gpus', '1') as DIR:
        os.environ['ANSIBLE_FORKS'] = '11'
        FLEET = Fleet(DIR)
        for scenario in (test_remediate_resets_at_most_a_fifth_of_the_fleet_per_window,
                         test_rogue_cleanup_kills_100_of_150_miners_and_reports_50_held,
                         test_the_guards_ladder_resets_a_failing_gpu_twice_then_its_budget_holds_it):
            scenario(FLEET)
    print('\nblast_radius: %d ansible-playbook runs passed in %.0f s' % (FLEET.runs, time.monotonic() - BEGUN))
