# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpufleet-guard's Slurm epilog and prolog, and require_allocation, against a real Slurm (issue #18; docs/slurm.md).

Nothing of Slurm is mocked: tests/fleet/up --slurm runs Debian's slurmctld, slurmd and munge; the roles
gpufleet.reclaim.guard and gpufleet.reclaim.slurm install the agent and the scripts over SSH; jobs are real sbatch
jobs of alice and bob whose `python3 train.py` holds a simulated GPU.

1. proctrack/linuxproc (a double-forked daemon escapes the job, as on many sites): alice's job leaves its training
   process and its detached child on its GPU; the epilog ends them, the memory is confirmed free, bob's job on the
   same node is untouched.  With a release delay above the bound the epilog drains the node, naming the GPU and the
   MiB.  On a node without the epilog, the next job's prolog proves the ended job's process stale (it started inside
   that job, and its user runs nothing else there), ends it and lets the job run.
2. proctrack/cgroup: a guard tick with require_allocation flags the process of alice's job on a GPU Slurm did not give
   the job, with the job, its GPUs and the GPU used, and leaves her process on her own GPU alone.
3. issue 28, with proctrack/linuxproc and with proctrack/cgroup: job A's leftover also sits on a GPU of her running
   job B; the epilog ends it (or, without an epilog, the next prolog does, and the job runs), B is untouched, no node
   is drained for it.  What could be B's (it started after B did) is spared, and the prolog refuses for it while B
   runs, and ends it once B has ended.

SAFETY: every process signalled is one the test started (its jobs' workloads, and alice's workloads it started in a
node with gpusim spawn --user); the epilog and prolog act on their own, and the test checks they touched nothing else;
everything lives in the fleet's PID namespaces and goes with tests/fleet/down (in a finally), on 127.0.0.1.
"""

import json
import os
import pwd
import re
import shlex
import sqlite3
import sys
import time

import pytest

from test_fleet_scrape import PLAYBOOK
from test_fleet_slurm import BIN, DOWN, UP, ensure_users, pytestmark, run, shared_dir, wait_for  # noqa: F401 pylint: disable=unused-import

GUARD = '/opt/gpufleet/bin/gpufleet-guard'
EPILOG_D = '/opt/gpufleet/slurm/epilog.d'   # a private path of every node
PROLOG_D = '/opt/gpufleet/slurm/prolog.d'
BOUND_S = 3            # the release bound the test installs (the default is 60 s)

# The job: its workload (python3 train.py and one detached child) on the first GPU Slurm gave it, then (HOLD=0) the
# job ends at once, leaving them behind where proctrack/linuxproc does not see them, or (HOLD=1) waits like a job
# does, or (UNTIL=PATH) ends once the test creates PATH (at most 120 s).  OTHER=1 puts the workload on a GPU the job
# was not given.
JOB = '''#!/bin/sh
. /etc/profile.d/zz-gpusim.sh
PY=$(command -v python3); "$PY" -c '' 2>/dev/null || PY=/usr/bin/python3
gpu=${SLURM_JOB_GPUS%%%%,*}
[ "$OTHER" = 1 ] && gpu=$(( (gpu + 1) %% 4 ))
pid=$("$PY" "$(command -v gpusim)" spawn --gpu "$gpu" --mib %d --children 1 -- python3 train.py) || exit 1
echo "gpus=$SLURM_JOB_GPUS gpu=$gpu workload=$pid"
if [ "$HOLD" = 1 ]; then while kill -0 "$pid" 2>/dev/null; do sleep 1; done; fi
if [ -n "$UNTIL" ]; then n=0; while [ ! -e "$UNTIL" ] && [ $n -lt 600 ]; do sleep 0.2; n=$((n + 1)); done; fi
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

    def sbatch(self, user, node, gres, mib, hold=False, other=False, until=''):
        script = os.path.join(self.out, 'job-%d.sh' % mib)
        with open(script, 'w') as handle:
            handle.write(JOB % mib)
        os.chmod(script, 0o755)
        out = run(['sbatch', '--parsable', '-w', node, '--gres=gpu:%d' % gres, '-o', os.path.join(self.out, '%j.out'),
                   '--export=ALL,HOLD=%d,OTHER=%d,UNTIL=%s' % (hold, other, until), script], env=self.slurm_env, user=user)
        return out.strip().split(';')[0]

    def spawn(self, node, user, gpu, mib):
        """``user``'s python3 train.py (and a detached child) on ``gpu`` of ``node``, outside any job, as a login would
        start it: root's gpusim spawn --user in the node; its pid."""
        return int(self.on(node, 'gpusim', 'spawn', '--user', user, '--gpu', gpu, '--mib', mib, '--children', 1, '--',
                           'python3', 'train.py').strip())

    def site_epilog(self, node):
        """``node``'s epilog directory gets a site epilog that cleans nothing (Slurm 22.05 fails an epilog whose glob
        matches no file: "Unable to create list of paths", and drains the node)."""
        self.on(node, 'sh', '-c', 'mkdir -p %s && printf "#!/bin/sh\\nexit 0\\n" > %s/00-site && chmod 755 %s/00-site' % (
            EPILOG_D, EPILOG_D, EPILOG_D))

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
        fleet.site_epilog('node03')
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
        # 3. node03 has no epilog: the ended job's process stays on GPU 0; the next job's prolog proves it stale (it
        #    started inside that ended job, and alice runs nothing else there), ends it, and the job runs
        first = fleet.sbatch('alice', 'node03', 4, 2048)
        _gpus, busy_gpu, busy_pid = fleet.workload(first)
        wait_for('job %s to complete' % first, lambda: 'JobState=COMPLETED' in fleet.job(first), timeout=60)
        busy = fleet.entry('node03', busy_pid)
        assert busy['alive']
        second = fleet.sbatch('bob', 'node03', 4, 1024, hold=True)
        _gpus, _gpu, second_pid = fleet.workload(second)
        prolog = [r for r in fleet.log('node03', 'slurm_prolog') if r['job']['job'] == second]
        assert len(prolog) == 1 and prolog[0]['rc'] == 0 and prolog[0]['drained'] is None and prolog[0]['blocking'] == [], prolog
        assert sorted(k['pid'] for k in prolog[0]['killed']) == sorted([busy_pid] + busy['children']), prolog
        assert all(_why_is(k['why'], 'left over from job %s (COMPLETED)' % first) for k in prolog[0]['killed']), prolog
        assert fleet.ended('node03', busy_pid) and prolog[0]['release'][str(busy_gpu)]['released'], prolog
        assert fleet.drained('node03') is None and 'JobState=RUNNING' in fleet.job(second)
        run(['scancel', bob, second], env=fleet.slurm_env)
        sys.stderr.write('slurm scripts: epilog released %s MiB in %ss; the prolog ended the leftover in %ss\n' % (
            2048, release_s, prolog[0]['seconds']))
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


def _leftover_on_a_running_job(fleet, node, tag):
    """alice's job A holds a GPU; her leftover-to-be P starts on it (proctrack/linuxproc: A's own workload, which escapes
    the job; proctrack/cgroup: her process outside any job cgroup, as a login starts it); more than 2 s later her job B
    starts on another GPU, and P creates a context there too (gpusim attach).  A ends once ``release()`` is called.
    Returns a dict of the jobs, pids and GPUs."""
    until = os.path.join(fleet.out, 'release-%s' % tag)
    a = fleet.sbatch('alice', node, 1, 2048, until=until)
    (a_gpu,), _gpu, a_pid = fleet.workload(a)
    p = a_pid if fleet.proctrack == 'linuxproc' else fleet.spawn(node, 'alice', a_gpu, 2048)
    time.sleep(2.5)   # B starts (slurmctld's whole seconds) more than 2 s after P did: P cannot be one of B's processes
    b = fleet.sbatch('alice', node, 1, 1024, hold=True)
    (b_gpu,), _gpu, q = fleet.workload(b)
    assert b_gpu != a_gpu
    fleet.on(node, 'gpusim', 'attach', '--pid', p, '--gpu', b_gpu, '--mib', 1024)
    assert fleet.gpusim(node)['gpus'][b_gpu]['used_mib'] == 2048       # B's own 1024 and P's 1024
    return {'a': a, 'a_gpu': a_gpu, 'a_pid': a_pid, 'p': p, 'p_kids': fleet.entry(node, p)['children'], 'b': b, 'b_gpu': b_gpu,
            'q': q, 'release': lambda: open(until, 'w').close()}


def _why_is(why, text):
    """The decision's reason begins with ``text``, itself or as the reason of the family it was judged with."""
    return why.startswith(text) or re.match(r'in the family of pid \d+ \(\w+\): %s' % re.escape(text), why) is not None


def _ended_job(fleet, jobid):
    return wait_for('job %s to end' % jobid, lambda: re.search(r'JobState=(COMPLETED|CANCELLED)', fleet.job(jobid)), timeout=60).group(1)


@pytest.mark.parametrize('proctrack', ['linuxproc', 'cgroup'])
def test_a_leftover_on_a_gpu_of_its_users_running_job_is_ended_and_no_node_is_drained_for_it(tmp_path, shared_dir, proctrack):
    """Issue 28: job A's leftover also sits on a GPU of her running job B.  The epilog ends it (node02), or, where no
    epilog runs, the next job's prolog proves it stale, ends it and lets the job run (node03); B is untouched and no
    node is drained for it.  A process of hers that started after B started and also uses B's GPU could be B's: A's
    epilog spares it (and its worker, with it) and the next prolog on its GPU refuses (drains) while B runs; once B has
    ended, B's epilog ends it (it started inside B's lifetime, on B's GPU) with its worker (which holds its memory), and
    the next job starts with nothing to end."""
    if proctrack == 'cgroup' and not os.access('/sys/fs/cgroup/freezer', os.W_OK):
        pytest.skip('proctrack/cgroup needs a writable cgroup v1 freezer hierarchy (docs/slurm.md)')
    fleet = Fleet(tmp_path, shared_dir, proctrack)
    try:
        fleet.up(3)
        fleet.apply('node02,node03', {})
        fleet.site_epilog('node03')
        # node02, with the epilog
        case = _leftover_on_a_running_job(fleet, 'node02', 'node02')
        r = fleet.spawn('node02', 'alice', case['a_gpu'], 512)    # started while B runs, on B's GPU too: it could be B's
        fleet.on('node02', 'gpusim', 'attach', '--pid', r, '--gpu', case['b_gpu'], '--mib', 256)
        case['release']()
        assert _ended_job(fleet, case['a']) == 'COMPLETED'
        wait_for('the epilog to end the leftover', lambda: fleet.ended('node02', case['p']), timeout=30)
        epilog = wait_for('the epilog record', lambda: [x for x in fleet.log('node02', 'slurm_epilog') if x['job']['job'] == case['a']])
        assert len(epilog) == 1 and epilog[0]['rc'] == 0 and epilog[0]['drained'] is None, epilog
        killed = dict((k['pid'], k['why']) for k in epilog[0]['killed'])
        mine = sorted([case['p']] + case['p_kids'])
        if proctrack == 'cgroup':   # A's own workload sat in A's cgroup: Slurm ended it, or the epilog did by that cgroup
            killed = dict((pid, why) for pid, why in killed.items() if why != "in job %s's cgroup" % case['a'])
        alice = "uid %d's process started " % pwd.getpwnam('alice').pw_uid
        assert sorted(killed) == mine and all(_why_is(why, alice) for why in killed.values()), epilog
        spared = dict((s['pid'], s['why']) for s in epilog[0]['spared'])
        assert spared[r] == ("started after job %s of the same user started, which is still RUNNING here, so it could be that "
                             "job's" % case['b']), epilog
        shown = fleet.gpusim('node02')
        assert shown['gpus'][case['a_gpu']]['used_mib'] == 512 and shown['gpus'][case['b_gpu']]['used_mib'] == 1024 + 256, shown['gpus']
        assert fleet.entry('node02', case['q'])['alive'] and fleet.entry('node02', r)['alive'] and 'JobState=RUNNING' in fleet.job(case['b'])
        assert fleet.drained('node02') is None
        # bob's next job on that GPU: its prolog cannot prove r stale while B runs, so it refuses (drains) and kills nothing
        refused = fleet.sbatch('bob', 'node02', 3, 1024, hold=True)
        node = wait_for('node02 drained', lambda: fleet.drained('node02'), timeout=60)
        assert re.search(r'Reason=gpufleet: GPU %d holds 512 MiB \(pids [0-9,]*\b%d\b[0-9,]*\) before job %s' % (case['a_gpu'], r, refused), node), node
        prolog = wait_for('the prolog record', lambda: [x for x in fleet.log('node02', 'slurm_prolog') if x['job']['job'] == refused])
        blocking = dict((b['pid'], b['why']) for b in prolog[0]['blocking'])
        assert case['a_gpu'] in prolog[0]['gpus'] and prolog[0]['rc'] == 1 and prolog[0]['killed'] == [] and blocking[r] == (
            "not provably left over from job %s: started after job %s of the same user started, which is still RUNNING here, so it "
            "could be that job's" % (case['a'], case['b'])), prolog
        assert fleet.entry('node02', r)['alive']
        run(['scancel', refused], env=fleet.slurm_env)
        run(['scontrol', 'update', 'nodename=node02', 'state=resume'], env=fleet.slurm_env)
        r_kids = sorted(fleet.entry('node02', r)['children'])
        assert r_kids and all(spared[kid] == 'in the family of pid %d (spared): %s' % (r, spared[r]) for kid in r_kids), epilog
        # B ends: r started inside B's lifetime, on B's GPU, and no job left could own it, so B's epilog ends it, and its
        # worker (on r's other GPU, holding r's memory) with it, beside B's own workload
        run(['scancel', case['b']], env=fleet.slurm_env)
        _ended_job(fleet, case['b'])
        wait_for('B\'s workload to end', lambda: fleet.ended('node02', case['q']), timeout=30)
        wait_for('B\'s epilog to end r and its worker', lambda: fleet.ended('node02', r), timeout=30)
        b_epilog = wait_for('B\'s epilog record', lambda: [x for x in fleet.log('node02', 'slurm_epilog') if x['job']['job'] == case['b']])
        assert set([r] + r_kids) <= set(k['pid'] for k in b_epilog[0]['killed']) and b_epilog[0]['drained'] is None, b_epilog
        wait_for('node02 idle', lambda: 'State=IDLE' in fleet.node('node02'), timeout=60)
        later = fleet.sbatch('bob', 'node02', 3, 1024, hold=True)
        _gpus, _gpu, later_pid = fleet.workload(later)
        prolog = [x for x in fleet.log('node02', 'slurm_prolog') if x['job']['job'] == later]
        assert len(prolog) == 1 and prolog[0]['rc'] == 0 and prolog[0]['blocking'] == [] and prolog[0]['killed'] == [], prolog
        assert fleet.entry('node02', later_pid)['alive'] and fleet.drained('node02') is None
        run(['scancel', later], env=fleet.slurm_env)
        # node03, without an epilog: the next prolog ends the leftover and the job runs
        case3 = _leftover_on_a_running_job(fleet, 'node03', 'node03')
        case3['release']()
        assert _ended_job(fleet, case3['a']) == 'COMPLETED'
        assert fleet.entry('node03', case3['p'])['alive']                       # nothing ended it: no epilog here
        nxt = fleet.sbatch('bob', 'node03', 3, 1024, hold=True)
        _gpus, _gpu, nxt_pid = fleet.workload(nxt)
        prolog = [x for x in fleet.log('node03', 'slurm_prolog') if x['job']['job'] == nxt]
        assert len(prolog) == 1 and prolog[0]['rc'] == 0 and prolog[0]['drained'] is None and prolog[0]['blocking'] == [], prolog
        assert sorted(k['pid'] for k in prolog[0]['killed']) == sorted([case3['p']] + case3['p_kids']), prolog
        assert all(_why_is(k['why'], 'left over from job %s (COMPLETED)' % case3['a']) for k in prolog[0]['killed']), prolog
        assert prolog[0]['release'][str(case3['a_gpu'])]['released'], prolog
        shown = fleet.gpusim('node03')
        assert fleet.ended('node03', case3['p']) and shown['gpus'][case3['b_gpu']]['used_mib'] == 1024, shown['gpus']
        assert fleet.entry('node03', case3['q'])['alive'] and 'JobState=RUNNING' in fleet.job(case3['b'])
        assert fleet.entry('node03', nxt_pid)['alive'] and fleet.drained('node03') is None
        run(['scancel', nxt, case3['b']], env=fleet.slurm_env)
        sys.stderr.write('slurm provenance (%s): epilog %.2fs, refusing prolog %.2fs, prolog ending a leftover %.2fs\n' % (
            proctrack, epilog[0]['seconds'], [x for x in fleet.log('node02', 'slurm_prolog') if x['job']['job'] == refused][0]['seconds'],
            prolog[0]['seconds']))
    finally:
        fleet.down()
