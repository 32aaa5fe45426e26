# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A real Slurm on the simulated fleet (tests/fleet/up --slurm, issue #18): Debian's slurmctld, slurmd and munge.

Nothing of Slurm is mocked: alice submits a batch job with sbatch to node02; it runs `python3 train.py` through
gpusim on the GPU Slurm gave it, inside node02's PID namespace and the job's cgroup.

SAFETY: everything runs inside the fleet (its daemons and nodes go with tests/fleet/down, in a finally), on
127.0.0.1; the test signals nothing itself (scancel asks Slurm to end its own job).
"""

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from test_fleet_scrape import collection  # this checkout as gpufleet.reclaim, for the test helpers

HERE = os.path.dirname(os.path.abspath(__file__))
FLEET = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(FLEET))
UP = os.path.join(FLEET, 'up')
DOWN = os.path.join(FLEET, 'down')
BIN = os.path.dirname(sys.executable)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which('unshare'), reason='the fleet needs root and util-linux unshare'),
    pytest.mark.skipif(not (shutil.which('slurmctld') and shutil.which('slurmd') and shutil.which('sbatch') and shutil.which('munged')),
                       reason='slurmctld, slurmd, slurm-client and munge are not installed (Debian packages; .ci/run installs them)'),
]

# The job: the node's environment (its private profile), a python alice may run (this machine's venv python may
# live where she cannot reach), then the training workload on the GPU Slurm allocated, waited for like a job does.
JOB = '''#!/bin/sh
. /etc/profile.d/zz-gpusim.sh
PY=$(command -v python3); "$PY" -c '' 2>/dev/null || PY=/usr/bin/python3
echo "host=$(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_JOB_GPUS=$SLURM_JOB_GPUS"
pid=$("$PY" "$(command -v gpusim)" spawn --gpu "$SLURM_JOB_GPUS" --mib 2048 --children 1 -- python3 train.py) || exit 1
echo "workload=$pid"
while kill -0 "$pid" 2>/dev/null; do sleep 1; done
'''


def run(cmd, env=None, timeout=180, user=None):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False,
                          universal_newlines=True, user=user, group=user, extra_groups=[] if user else None, cwd='/')
    assert proc.returncode == 0, '%s failed (%d):\n%s' % (' '.join(cmd), proc.returncode, proc.stdout)
    return proc.stdout


def ensure_users(tmp_path):
    collection(tmp_path)
    importlib.import_module('ansible_collections.gpufleet.reclaim.tests.unit.security.redteam').ensure_users(('alice', 'bob'))


def daemons_of(fleet_dir):
    """Host pids whose command line names this fleet's Slurm or munge (DIR/slurm/), or that are its nodes' slurmd."""
    found = []
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/%s/cmdline' % name, 'rb') as handle:
                argv = handle.read().split(b'\0')
            with open('/proc/%s/stat' % name, 'rb') as handle:
                state = handle.read().rsplit(b')', 1)[1].split()[0]
        except OSError:
            continue
        if state != b'Z' and any((fleet_dir + '/slurm/').encode() in a for a in argv):
            found.append(int(name))
    return found


def listening_addresses(pids):
    """The TCP addresses (IPv4 and IPv6) the host processes `pids` listen on, from /proc/net/tcp{,6}."""
    sockets = set()
    for pid in pids:
        for fd in os.listdir('/proc/%d/fd' % pid):
            try:
                sockets.add(os.readlink('/proc/%d/fd/%s' % (pid, fd)))
            except OSError:
                pass
    found = []
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        with open(table) as handle:
            next(handle)
            for line in handle:
                fields = line.split()
                if fields[3] == '0A' and 'socket:[%s]' % fields[9] in sockets:
                    addr, port = fields[1].split(':')
                    text = '.'.join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else addr
                    found.append('%s:%d' % (text, int(port, 16)))
    return found


def wait_for(what, check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, 'timed out after %.0fs waiting for %s' % (timeout, what)
        time.sleep(0.1)


@pytest.fixture
def shared_dir():
    """A 0755 directory under /tmp (pytest's tmp_path is root-only): munged and alice's job reach the fleet's files."""
    path = tempfile.mkdtemp(prefix='gpufleet-slurm-', dir='/tmp')
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_real_slurm_job_on_node02_runs_train_py_on_its_gpu(tmp_path, shared_dir):
    fleet_dir = os.path.join(shared_dir, 'fleet')
    ensure_users(tmp_path)
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get('PATH', ''))
    slurm_env = dict(env, SLURM_CONF=os.path.join(fleet_dir, 'slurm', 'etc', 'slurm.conf'))
    ssh_config = os.path.join(fleet_dir, 'ssh_config')
    outdir = tmp_path.__class__(shared_dir) / 'out'
    outdir.mkdir()
    os.chmod(str(outdir), 0o1777)
    job = outdir / 'job.sh'
    job.write_text(JOB)
    os.chmod(str(job), 0o755)

    def on(node, *argv):
        return run(['ssh', '-F', ssh_config, node, ' '.join(shlex.quote(str(a)) for a in argv)], timeout=60)

    try:
        begun = time.monotonic()
        run([sys.executable, UP, '--nodes', '3', '--slurm', '--dir', fleet_dir, '-q'], env=env, timeout=300)
        up_s = time.monotonic() - begun
        sinfo = run(['sinfo', '-h', '-N', '-o', '%N %T %G'], env=slurm_env)
        assert sorted(sinfo.split('\n')[:-1]) == ['node01 idle gpu:4', 'node02 idle gpu:4', 'node03 idle gpu:4'], sinfo
        state = json.load(open(os.path.join(fleet_dir, 'nodes.json')))
        ctld = state['slurm']['daemons']['slurmctld']['pid']
        # every daemon listens on 127.0.0.1 only (its own port)
        addresses = listening_addresses([ctld] + [n['slurmd_pid'] for n in state['nodes']])
        assert len(addresses) == 4 and all(a.startswith('127.0.0.1:') for a in addresses), addresses

        submitted = time.monotonic()
        out = run(['sbatch', '--parsable', '-w', 'node02', '--gres=gpu:1', '-o', str(outdir / '%j.out'), str(job)],
                  env=slurm_env, user='alice')
        jobid = out.strip().split(';')[0]
        log = outdir / ('%s.out' % jobid)
        wait_for('the job\'s workload', lambda: log.exists() and 'workload=' in log.read_text())
        start_s = time.monotonic() - submitted
        text = log.read_text()
        gpu = int(re.search(r'SLURM_JOB_GPUS=(\d+)', text).group(1))
        assert 'host=node02 CUDA_VISIBLE_DEVICES=%d SLURM_JOB_GPUS=%d' % (gpu, gpu) in text, text
        pid = int(re.search(r'workload=(\d+)', text).group(1))
        # scontrol show job -d names the GPU index Slurm allocated
        detail = run(['scontrol', 'show', 'job', '-d', jobid], env=slurm_env)
        assert re.search(r'Nodes=node02 .*GRES=gpu:1\(IDX:%d\)' % gpu, detail), detail
        assert 'JobState=RUNNING' in detail and 'UserId=alice(' in detail, detail
        # node02's gpusim and NVML see alice's python3 train.py (and its detached child) holding 2048 MiB on that GPU
        shown = json.loads(on('node02', 'gpusim', 'show'))
        entry = [p for p in shown['processes'] if p['pid'] == pid]
        assert len(entry) == 1 and entry[0]['user'] == 'alice' and entry[0]['argv'] == ['python3', 'train.py'], shown['processes']
        assert entry[0]['gpu'] == gpu and entry[0]['counted_mib'] == 2048 and entry[0]['alive'] and len(entry[0]['children']) == 1
        nvml = on('node02', 'python', '-c', 'import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(%d); '
                  'print([(p.pid, p.usedGpuMemory >> 20) for p in n.nvmlDeviceGetComputeRunningProcesses(h)])' % gpu)
        assert nvml.strip() == '[(%d, 2048)]' % pid, nvml
        # the job's processes live in node02's process table (node pids), in the job's root-owned cgroup, and
        # the workload is the real interpreter
        inside = on('node02', 'sh', '-c', 'readlink /proc/%d/exe; stat -c %%U /proc/%d; cat /proc/%d/cgroup; ps -eo pid=,comm=' % (pid, pid, pid))
        exe = inside.splitlines()[0]
        assert re.match(r'python3(\.\d+)?$', os.path.basename(exe)), inside
        assert inside.splitlines()[1] == 'alice', inside
        assert re.search(r'/job_%s/step_batch$' % jobid, inside, re.M) or state['slurm']['proctrack'] == 'proctrack/linuxproc', inside
        assert re.search(r'^\s*%d python3$' % pid, inside, re.M) and re.search(r'^\s*\d+ slurmstepd$', inside, re.M), inside
        assert not any(re.search(r'^\s*%d python3$' % pid, on(n, 'ps', '-eo', 'pid=,comm='), re.M) for n in ('node01', 'node03'))
        # the job ends when Slurm ends it; its processes go with it
        run(['scancel', jobid], env=slurm_env)
        wait_for('the job\'s processes to go', lambda: not json.loads(on('node02', 'gpusim', 'show'))['gpus'][gpu]['used_mib'])
    finally:
        run([sys.executable, DOWN, '--dir', fleet_dir], env=env)
    assert not daemons_of(fleet_dir)  # down waited for them (by the pids it recorded); zombies do not count
    sys.stderr.write('slurm fleet: up --nodes 3 --slurm %.1fs, sbatch to workload running %.1fs\n' % (up_s, start_s))
