# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpufleet-guard's Slurm epilog and prolog, and require_allocation, against a real Slurm (issue #18; docs/slurm.md).

Nothing of Slurm is mocked: tests/fleet/up --slurm runs Debian's slurmctld, slurmd and munge; the roles
gpufleet.reclaim.guard and gpufleet.reclaim.slurm install the agent and the scripts over SSH; jobs are real sbatch
jobs of alice and bob whose `python3 train.py` holds a simulated GPU.

1. proctrack/linuxproc (a double-forked daemon escapes the job, as on many sites): alice's job leaves its training
   process and its detached child on its GPU; the epilog ends them, the memory is confirmed free, bob's job on the
   same node is untouched.  With a release delay above the bound the epilog drains the node, naming the GPU and the
   MiB.  On a node without the epilog, the next job's prolog refuses the GPU the ended job's process still holds:
   the node is drained and the job requeued, the process left alone (nothing proves it stale).
2. proctrack/cgroup: a guard tick with require_allocation flags the process of alice's job on a GPU Slurm did not give
   the job, with the job, its GPUs and the GPU used, and leaves her process on her own GPU alone.

SAFETY: every process signalled is one the test's own jobs started (the epilog and prolog act on their own, and the
test checks they touched nothing else); everything lives in the fleet's PID namespaces and goes with
tests/fleet/down (in a finally), on 127.0.0.1.
"""

import json
import os
import re
import shlex
import sqlite3
import sys

import pytest

from test_fleet_scrape import PLAYBOOK
from test_fleet_slurm import BIN, DOWN, UP, ensure_users, pytestmark, run, shared_dir, wait_for  # noqa: F401 pylint: disable=unused-import

GUARD = '/opt/gpufleet/bin/gpufleet-guard'
EPILOG_D = '/opt/gpufleet/slurm/epilog.d'   # a private path of every node
PROLOG_D = '/opt/gpufleet/slurm/prolog.d'
BOUND_S = 3            # the release bound the test installs (the default is 60 s)

# The job: its workload (python3 train.py and one detached child) on the first GPU Slurm gave it, then (HOLD=0) the
# job ends at once, leaving them behind where proctrack/linuxproc does not see them, or (HOLD=1) waits like a job
# does.  OTHER=1 puts the workload on a GPU the job was not given.
JOB = '''#!/bin/sh
. /etc/profile.d/zz-gpusim.sh
PY=$(command -v python3); "$PY" -c '' 2>/dev/null || PY=/usr/bin/python3
gpu=${SLURM_JOB_GPUS%%%%,*}
[ "$OTHER" = 1 ] && gpu=$(( (gpu + 1) %% 4 ))
pid=$("$PY" "$(command -v gpusim)" spawn --gpu "$gpu" --mib %d --children 1 -- python3 train.py) || exit 1
echo "gpus=$SLURM_JOB_GPUS gpu=$gpu workload=$pid"
if [ "$HOLD" = 1 ]; then while kill -0 "$pid" 2>/dev/null; do sleep 1; done; fi
'''

APPLY = '''---
- name: The guard and the Slurm scripts
  hosts: %(hosts)s
  gather_facts: false
  roles:
    - role: gpufleet.reclaim.guard
      vars:
        gpu_guard_install_prereqs: false
        gpu_guard_mode: dry-run
        gpu_guard_policy: %(policy)s
    - role: gpufleet.reclaim.slurm
      vars:
        gpu_slurm_conf_path: %(conf)s
        gpu_slurm_grace: 2
        gpu_slurm_kill_wait: 2
        gpu_slurm_release_timeout: %(bound)d
        gpu_slurm_epilog: "{{ inventory_hostname != 'node03' }}"
        gpu_slurm_env: %(env)s
'''


class Fleet(object):
    def __init__(self, tmp_path, shared, proctrack):
        self.dir = os.path.join(shared, 'fleet')
        self.env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get('PATH', ''))
        self.conf = os.path.join(self.dir, 'slurm', 'etc', 'slurm.conf')
        self.slurm_env = dict(self.env, SLURM_CONF=self.conf)
        self.out = os.path.join(shared, 'out')
        os.mkdir(self.out)
        os.chmod(self.out, 0o1777)
        ensure_users(tmp_path)  # alice and bob; this checkout as the collection (test_fleet_scrape.collection)
        self.collections = str(tmp_path / 'collections')
        self.proctrack = proctrack

    def up(self, nodes):
        run([sys.executable, UP, '--nodes', str(nodes), '--slurm', '--slurm-proctrack', self.proctrack, '--dir', self.dir, '-q',
             '--slurm-conf', 'Epilog=%s/*' % EPILOG_D, '--slurm-conf', 'Prolog=%s/*' % PROLOG_D], env=self.env, timeout=300)

    def on(self, node, *argv):
        return run(['ssh', '-F', os.path.join(self.dir, 'ssh_config'), node, ' '.join(shlex.quote(str(a)) for a in argv)], timeout=120)

    def apply(self, hosts, policy):
        node_env = dict(line.split('=', 1) for line in self.on('node01', 'env').splitlines() if '=' in line)
        env = dict((k, node_env[k]) for k in ('GPU_SIM_STATE', 'LD_LIBRARY_PATH', 'PATH', 'SLURM_CONF') if k in node_env)
        playbook = os.path.join(self.out, 'apply.yml')
        with open(playbook, 'w') as handle:
            handle.write(APPLY % {'hosts': hosts, 'policy': json.dumps(policy), 'conf': self.conf, 'bound': BOUND_S, 'env': json.dumps(env)})
        run([PLAYBOOK, '-i', os.path.join(self.dir, 'inventory.ini'), playbook],
            env=dict(self.env, ANSIBLE_COLLECTIONS_PATH=self.collections, ANSIBLE_NOCOLOR='1'), timeout=600)

    def sbatch(self, user, node, gres, mib, hold=False, other=False):
        script = os.path.join(self.out, 'job-%d.sh' % mib)
        with open(script, 'w') as handle:
            handle.write(JOB % mib)
        os.chmod(script, 0o755)
        out = run(['sbatch', '--parsable', '-w', node, '--gres=gpu:%d' % gres, '-o', os.path.join(self.out, '%j.out'),
                   '--export=ALL,HOLD=%d,OTHER=%d' % (hold, other), script], env=self.slurm_env, user=user)
        return out.strip().split(';')[0]

    def workload(self, jobid):
        log = os.path.join(self.out, '%s.out' % jobid)
        text = wait_for('job %s\'s workload' % jobid, lambda: os.path.exists(log) and 'workload=' in open(log).read() and open(log).read())
        found = re.search(r'gpus=(\S+) gpu=(\d+) workload=(\d+)', text)
        return [int(g) for g in found.group(1).split(',')], int(found.group(2)), int(found.group(3))

    def job(self, jobid):
        return run(['scontrol', 'show', 'job', jobid], env=self.slurm_env)

    def node(self, name):
        return run(['scontrol', 'show', 'node', name], env=self.slurm_env)

    def gpusim(self, node):
        return json.loads(self.on(node, 'gpusim', 'show'))

    def entry(self, node, pid):
        return [p for p in self.gpusim(node)['processes'] if p['pid'] == pid][0]

    def drained(self, name):
        """``scontrol show node`` when the node is drained, else None."""
        text = self.node(name)
        return text if 'DRAIN' in re.search(r'State=(\S+)', text).group(1) else None

    def ended(self, node, pid):
        """The gpusim entry of ``pid`` once it and its children are gone, else None."""
        entry = self.entry(node, pid)
        return entry if not entry['alive'] and not entry['children_alive'] else None

    def log(self, node, event):
        path = os.path.join(self.dir, 'nodes', node, 'fs', 'var', 'log', 'gpufleet', 'guard.jsonl')
        return [json.loads(line) for line in open(path) if '"event":"%s"' % event in line] if os.path.exists(path) else []

    def down(self):
        run([sys.executable, DOWN, '--dir', self.dir], env=self.env)


def test_epilog_ends_the_jobs_leftovers_drains_on_a_slow_release_and_the_prolog_refuses_a_busy_gpu(tmp_path, shared_dir):
    fleet = Fleet(tmp_path, shared_dir, 'linuxproc')
    try:
        fleet.up(3)
        fleet.apply('node02,node03', {})
        # node03's epilog directory holds a site epilog of its own that cleans nothing (Slurm 22.05 fails an epilog whose
        # glob matches no file: "Unable to create list of paths", and drains the node)
        fleet.on('node03', 'sh', '-c', 'mkdir -p %s && printf "#!/bin/sh\\nexit 0\\n" > %s/00-site && chmod 755 %s/00-site' % (
            EPILOG_D, EPILOG_D, EPILOG_D))
        # the role found the globs in slurm.conf and put the scripts there (node03: the prolog only)
        assert fleet.on('node02', 'ls', EPILOG_D, PROLOG_D).split() == ['%s:' % EPILOG_D, '50-gpufleet', '%s:' % PROLOG_D, '50-gpufleet']
        assert fleet.on('node03', 'ls', EPILOG_D).split() == ['00-site'] and fleet.on('node03', 'ls', PROLOG_D).split() == ['50-gpufleet']
        # bob's job holds its GPU on node02 for the whole test
        bob = fleet.sbatch('bob', 'node02', 1, 1024, hold=True)
        _gpus, bob_gpu, bob_pid = fleet.workload(bob)
        # 1. alice's job ends at once, its python3 train.py and detached child still on its GPU (linuxproc lost them)
        alice = fleet.sbatch('alice', 'node02', 1, 2048)
        gpus, gpu, pid = fleet.workload(alice)
        assert gpus == [gpu] and gpu != bob_gpu
        wait_for('job %s to complete' % alice, lambda: 'JobState=COMPLETED' in fleet.job(alice), timeout=60)
        entry = wait_for('the epilog to end alice\'s processes', lambda: fleet.ended('node02', pid), timeout=30)
        shown = fleet.gpusim('node02')
        assert shown['gpus'][gpu]['used_mib'] == 0 and entry['user'] == 'alice'
        epilog = [r for r in fleet.log('node02', 'slurm_epilog') if r['job']['job'] == alice]
        assert len(epilog) == 1 and epilog[0]['rc'] == 0 and epilog[0]['drained'] is None, epilog
        killed = sorted(k['pid'] for k in epilog[0]['killed'])
        assert killed == sorted([pid] + entry['children']) and epilog[0]['release'][str(gpu)]['released'], epilog
        release_s = epilog[0]['release'][str(gpu)]['seconds']
        # bob's job and its process: untouched
        assert fleet.entry('node02', bob_pid)['alive'] and 'JobState=RUNNING' in fleet.job(bob)
        assert shown['gpus'][bob_gpu]['used_mib'] == 1024
        assert fleet.drained('node02') is None
        prom = open(os.path.join(fleet.dir, 'nodes', 'node02', 'fs', 'var', 'lib', 'node_exporter', 'textfile_collector',
                                 'gpufleet_slurm_epilog.prom')).read()
        assert 'gpufleet_slurm_epilog_processes_killed{node="node02"} 2' in prom, prom
        # 2. the driver keeps the memory longer than the bound: the epilog drains node02, naming the GPU and the MiB
        fleet.on('node02', 'gpusim', 'set', '--release-delay-ms', str((BOUND_S + 5) * 1000))
        slow = fleet.sbatch('alice', 'node02', 1, 2048)
        _gpus, slow_gpu, _pid = fleet.workload(slow)
        reason = 'gpufleet: GPU %d holds 2048 MiB after job %s' % (slow_gpu, slow)
        node = wait_for('node02 drained', lambda: fleet.drained('node02'), timeout=60)
        assert 'Reason=%s' % reason in node, node
        assert fleet.entry('node02', bob_pid)['alive'] and 'JobState=RUNNING' in fleet.job(bob)
        fleet.on('node02', 'gpusim', 'set', '--release-delay-ms', '0')
        # 3. node03 has no epilog: the ended job's process stays on GPU 0; the next job's prolog refuses all 4 GPUs
        first = fleet.sbatch('alice', 'node03', 4, 2048)
        _gpus, busy_gpu, busy_pid = fleet.workload(first)
        wait_for('job %s to complete' % first, lambda: 'JobState=COMPLETED' in fleet.job(first), timeout=60)
        assert fleet.entry('node03', busy_pid)['alive']
        second = fleet.sbatch('bob', 'node03', 4, 1024, hold=True)
        node = wait_for('node03 drained', lambda: fleet.drained('node03'), timeout=60)
        assert re.search(r'Reason=gpufleet: GPU %d holds 2048 MiB \(pids [0-9,]*%d[0-9,]*\) before job %s' % (busy_gpu, busy_pid, second), node), node
        wait_for('job %s requeued' % second, lambda: 'JobState=PENDING' in fleet.job(second), timeout=60)
        job = fleet.job(second)
        assert not os.path.exists(os.path.join(fleet.out, '%s.out' % second)) or 'workload=' not in open(os.path.join(fleet.out, '%s.out' % second)).read()
        prolog = [r for r in fleet.log('node03', 'slurm_prolog') if r['job']['job'] == second]
        assert prolog and prolog[0]['rc'] == 1 and prolog[0]['killed'] == [] and prolog[0]['blocking'], prolog
        assert fleet.entry('node03', busy_pid)['alive']   # not provably stale: left alone
        sys.stderr.write('slurm scripts: epilog released %s MiB in %ss; prolog refused in %ss; requeued: %s\n' % (
            2048, release_s, prolog[0]['seconds'], re.search(r'Reason=(\S+)', job).group(1)))
    finally:
        fleet.down()


def test_a_tick_with_require_allocation_flags_a_process_on_a_gpu_its_job_was_not_given(tmp_path, shared_dir):
    if not os.access('/sys/fs/cgroup/freezer', os.W_OK):
        pytest.skip('proctrack/cgroup needs a writable cgroup v1 freezer hierarchy (docs/slurm.md)')
    fleet = Fleet(tmp_path, shared_dir, 'cgroup')
    try:
        fleet.up(1)
        fleet.apply('node01', {'require_allocation': True})
        good = fleet.sbatch('alice', 'node01', 1, 1024, hold=True)
        _gpus, good_gpu, good_pid = fleet.workload(good)
        bad = fleet.sbatch('alice', 'node01', 1, 2048, hold=True, other=True)
        bad_gpus, bad_gpu, bad_pid = fleet.workload(bad)
        assert bad_gpu not in bad_gpus
        summary = json.loads(fleet.on('node01', GUARD, 'tick', '--dry-run', '--json'))
        found = [v for v in summary['violations'] if v['rule'] == 'require_allocation']
        assert [v['pids'] for v in found] == [[bad_pid]], (summary.get('warnings'), summary.get('notes'), summary['violations'])
        assert ('uses GPU %d, which Slurm did not give its job %s (allocated GPUs: %s)' % (
            bad_gpu, bad, ','.join(str(g) for g in bad_gpus))) in found[0]['message'], found
        assert good_pid not in [p for v in summary['violations'] for p in v['pids']] and good_gpu not in bad_gpus
        assert fleet.entry('node01', bad_pid)['alive']   # dry-run: flagged, nothing signalled
        # the tick's sample in the usage history charges each workload to its job (its root-owned cgroup), item 5
        history = os.path.join(fleet.dir, 'nodes', 'node01', 'fs', 'var', 'lib', 'gpufleet', 'history.db')
        conn = sqlite3.connect('file:%s?mode=ro' % history, uri=True)
        try:
            jobs = dict(conn.execute('SELECT DISTINCT pid, slurm_job FROM samples WHERE pid IN (?, ?)', (good_pid, bad_pid)))
        finally:
            conn.close()
        assert jobs == {good_pid: good, bad_pid: bad}, jobs
        run(['scancel', good, bad], env=fleet.slurm_env)
    finally:
        fleet.down()
