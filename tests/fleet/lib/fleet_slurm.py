# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""`tests/fleet/up --slurm`: a real Slurm (Debian's slurmctld, slurmd, munge) on the simulated fleet.

Layout (all under DIR/slurm, made fresh by every `up`):

* `munge/`: a key of this fleet (1024 random bytes, munge:munge 0400) and the socket of its own
  `munged -F` (run as the munge user, host process);
* `etc/slurm.conf`, `etc/gres.conf`, `etc/cgroup.conf`: the cluster (clients: `SLURM_CONF=DIR/slurm/etc/slurm.conf`,
  or source `DIR/slurm/env.sh`);
* `ctld/`: `slurmctld -D -f ...` (host process, 127.0.0.1:<its port>), its state and log;
* `node/<nodeNN>/`: that node's `slurmd` spool, log and pid file (the pid file is written inside the node's
  PID namespace and never read).

Every node's `slurmd -D -N nodeNN` is started by the node's init (lib/node_init.sh) INSIDE the node's PID and
mount namespace, so jobs live in the node's process table and see its private /dev.  The daemons are
LD_PRELOADed with lib/bind_loopback.c (built here), which turns their wildcard binds into 127.0.0.1.

Safety: munged and slurmctld are stopped by the (pid, start time) `up` recorded for them (host pids); a node's
slurmd by the host pid `up` found as its init's child.  Pid files are never read.
"""

import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import time

import fleet as fl

CONF_NAME = 'slurm.conf'
CLUSTER = 'gpufleet'
PARTITION = 'gpu'
CPUS_PER_NODE = 8            # what every node claims (SlurmdParameters=config_overrides): jobs do not compete for the host's CPUs
FREEZER = '/sys/fs/cgroup/freezer'
SHIM_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'bind_loopback.c')
# what `up --slurm` needs, and the Debian package that brings it
BINARIES = (('slurmctld', 'slurmctld'), ('slurmd', 'slurmd'), ('sinfo', 'slurm-client'), ('sbatch', 'slurm-client'),
            ('scontrol', 'slurm-client'), ('munged', 'munge'), ('cc', 'gcc'))
# the GPU device files Slurm's GRES points at are character devices (Slurm refuses anything else); they use the
# major:minor of /dev/null (1:3), so opening one is harmless on any machine, a real GPU machine included
DEV_CHAR = (1, 3)


def check_host():
    """FleetError naming the Debian packages when a binary `up --slurm` needs is missing."""
    missing = sorted({pkg for name, pkg in BINARIES if not shutil.which(name)})
    if missing:
        raise fl.FleetError('--slurm needs %s: apt-get install -y %s' % (', '.join(missing), ' '.join(missing)))
    try:
        pwd.getpwnam('munge')
    except KeyError as exc:
        raise fl.FleetError('--slurm runs munged as the user munge, which does not exist (install the Debian package munge)') from exc


def choose_proctrack(wanted=None):
    """(ProctrackType, why): proctrack/cgroup on a cgroup v1 freezer hierarchy this process may write, else linuxproc.
    ``wanted`` ('cgroup' or 'linuxproc', `up --slurm-proctrack`) forces one; 'cgroup' where it cannot work is a FleetError.

    Slurm 22.05's cgroup/v2 plugin wants a pure cgroup2 /sys/fs/cgroup whose subtree it owns (it moves slurmd
    into `<its cgroup>/system` and enables controllers there); several slurmd sharing one host cgroup tree do
    not get that, so on a cgroup v2 host the nodes track jobs with proctrack/linuxproc (the process tree).
    """
    if wanted == 'linuxproc':
        return 'proctrack/linuxproc', 'asked for (--slurm-proctrack linuxproc): a double-forked daemon escapes the job, as on many sites'
    if _is_v1_freezer(FREEZER) and os.access(FREEZER, os.W_OK):
        return 'proctrack/cgroup', 'cgroup v1 freezer hierarchy at %s (each node gets a cgroup of its own, bound over it)' % FREEZER
    if wanted == 'cgroup':
        raise fl.FleetError('--slurm-proctrack cgroup needs a writable cgroup v1 freezer hierarchy at %s' % FREEZER)
    return 'proctrack/linuxproc', 'no writable cgroup v1 freezer hierarchy at %s' % FREEZER


def _is_v1_freezer(path):
    try:
        with open('/proc/self/mountinfo') as handle:
            for line in handle:
                left, _sep, right = line.partition(' - ')
                fields, rest = left.split(), right.split()
                if len(fields) >= 5 and fields[4] == path and rest and rest[0] == 'cgroup' and 'freezer' in rest[-1].split(','):
                    return True
    except OSError:
        pass
    return False


def _own_cgroup(controller):
    with open('/proc/self/cgroup') as handle:
        for line in handle:
            parts = line.rstrip('\n').split(':', 2)
            if len(parts) == 3 and controller in parts[1].split(','):
                return parts[2]
    return '/'


def _ranges(prefix, numbers):
    """`/dev/nvidia[0-3]` (gres.conf File=, Slurm's host-list syntax) for consecutive numbers, else a comma list."""
    numbers = list(numbers)
    if len(numbers) == 1:
        return '%s%d' % (prefix, numbers[0])
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return '%s[%d-%d]' % (prefix, numbers[0], numbers[-1])
    return ','.join('%s%d' % (prefix, n) for n in numbers)


def gres_files(vendor, gpus):
    """The device files that stand for a node's GPUs (the GRES `gpu` File=)."""
    if vendor == 'nvidia':
        return _ranges('/dev/nvidia', range(gpus))
    return _ranges('/dev/dri/renderD', range(128, 128 + gpus))


class Cluster:
    """The Slurm of one fleet: prepared with the fleet, started before its nodes, stopped after them."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.root = os.path.join(fleet.dir, 'slurm')
        self.conf = os.path.join(self.root, 'etc', CONF_NAME)
        self.munge_dir = os.path.join(self.root, 'munge')
        self.socket = os.path.join(self.munge_dir, 'munge.socket')
        self.shim = os.path.join(self.root, 'bind_loopback.so')
        self.ctld_port = None
        self.proctrack, self.proctrack_why = choose_proctrack(fleet.slurm_proctrack)
        self.daemons = {}   # name -> {'pid', 'starttime', 'argv'}
        self.procs = {}

    # -- preparation -------------------------------------------------------------------------
    def prepare(self):
        """Fresh DIR/slurm: the loopback shim, the munge key, the configuration; per node its port and cgroup."""
        path = self.fleet.dir
        while path != os.path.dirname(path):  # munged (as munge) and the jobs (as their users) open files below DIR
            if not os.stat(path).st_mode & 0o001:
                raise fl.FleetError('--slurm: %s is not searchable by other users (munge, the job users); '
                                    'use a --dir whose parents are (chmod o+x, or a directory under /tmp)' % path)
            path = os.path.dirname(path)
        if os.path.lexists(self.root):
            if not os.path.exists(os.path.join(self.root, fl.MARKER)):
                raise fl.FleetError('%s exists but was not made by tests/fleet/up; refusing to delete it' % self.root)
            shutil.rmtree(self.root)
        for sub in ('etc', 'ctld/state', 'node'):
            os.makedirs(os.path.join(self.root, sub), 0o755)
        os.chmod(self.root, 0o755)
        fl._write(os.path.join(self.root, fl.MARKER), 'made by tests/fleet/up --slurm; removed by the next up\n')
        self._build_shim()
        self._munge_key()
        self.ctld_port = self.fleet.ports.pick()
        for node in self.fleet.nodes:
            node.slurmd_port = self.fleet.ports.pick()
            os.makedirs(os.path.join(self.root, 'node', node.name, 'spool'), 0o755)
            node.cgroups = [self._node_cgroup(node)] if self.proctrack == 'proctrack/cgroup' else []
        self._write_conf()
        fl._write(os.path.join(self.root, 'env.sh'), '# the test Slurm of this fleet (tests/fleet/up --slurm)\nexport SLURM_CONF=%s\n' % self.conf)

    def _build_shim(self):
        cmd = [os.environ.get('CC', 'cc'), '-O2', '-Wall', '-Wextra', '-shared', '-fPIC', '-o', self.shim, SHIM_SRC, '-ldl']
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, check=False)
        if proc.returncode != 0:
            raise fl.FleetError('building %s failed: %s' % (self.shim, proc.stdout.decode(errors='replace').strip()))

    def _munge_key(self):
        munge = pwd.getpwnam('munge')
        os.makedirs(self.munge_dir, 0o755)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        key = os.path.join(self.munge_dir, 'munge.key')
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        try:
            os.write(fd, os.urandom(1024))
            os.fchown(fd, munge.pw_uid, munge.pw_gid)
        finally:
            os.close(fd)

    def _node_cgroup(self, node):
        """A fresh freezer cgroup of this node (bound over /sys/fs/cgroup/freezer inside it): Slurm's job cgroups of
        different nodes and fleets never meet, and `down` removes the whole tree (fleet.remove_cgroups)."""
        path = os.path.join(FREEZER + _own_cgroup('freezer').rstrip('/'), fl.CGROUP_PREFIX + hashlib.sha1(node.dir.encode()).hexdigest()[:16])
        if fl.remove_cgroups([path]):
            raise fl.FleetError('%s still holds processes of an earlier run of this node; stop them (tests/fleet/down)' % path)
        os.mkdir(path, 0o755)
        return path

    def _write_conf(self):
        nodes = self.fleet.nodes
        lines = [
            '# generated by tests/fleet/up --slurm: do not edit (docs/slurm.md, "The test Slurm")',
            'ClusterName=%s' % CLUSTER,
            'SlurmctldHost=localhost(127.0.0.1)',
            'SlurmctldPort=%d' % self.ctld_port,
            'SlurmUser=root',
            'SlurmdUser=root',
            'AuthType=auth/munge',
            'CredType=cred/munge',
            'AuthInfo=socket=%s' % self.socket,
            'StateSaveLocation=%s' % os.path.join(self.root, 'ctld', 'state'),
            'SlurmctldPidFile=%s' % os.path.join(self.root, 'ctld', 'slurmctld.pid'),
            'SlurmctldLogFile=%s' % os.path.join(self.root, 'ctld', 'slurmctld.log'),
            'SlurmdSpoolDir=%s' % os.path.join(self.root, 'node', '%n', 'spool'),
            'SlurmdPidFile=%s' % os.path.join(self.root, 'node', '%n', 'slurmd.pid'),
            'SlurmdLogFile=%s' % os.path.join(self.root, 'node', '%n', 'slurmd.log'),
            'SlurmdDebug=verbose',
            'SlurmctldDebug=verbose',
            'ProctrackType=%s' % self.proctrack,
            'TaskPlugin=task/none',
            'JobAcctGatherType=jobacct_gather/none',
            'AccountingStorageType=accounting_storage/none',
            'SelectType=select/cons_tres',
            'SelectTypeParameters=CR_Core',
            'GresTypes=gpu',
            'SlurmdParameters=config_overrides',
            'ReturnToService=2',
            'MpiDefault=none',
            'MailProg=/bin/true',
            'SchedulerType=sched/backfill',
            'SchedulerParameters=sched_interval=1',
            'SlurmdTimeout=60',
            'MessageTimeout=10',
            'InactiveLimit=0',
            'KillWait=2',
            'MinJobAge=600',
        ]
        for node in nodes:
            lines.append('NodeName=%s NodeAddr=127.0.0.1 NodeHostname=%s Port=%d CPUs=%d Sockets=1 CoresPerSocket=%d ThreadsPerCore=1 '
                         'Gres=gpu:%d State=UNKNOWN' % (node.name, node.name, node.slurmd_port, CPUS_PER_NODE, CPUS_PER_NODE, self.fleet.gpus))
        lines.extend(self.fleet.slurm_conf)  # `up --slurm-conf LINE`: e.g. Epilog=, Prolog=, PrologEpilogTimeout=
        lines.append('PartitionName=%s Nodes=%s Default=YES MaxTime=INFINITE State=UP' % (PARTITION, ','.join(n.name for n in nodes)))
        fl._write(self.conf, '\n'.join(lines) + '\n')
        gres = ['# generated by tests/fleet/up --slurm: each node\'s GPU device files (character devices, see fleet_slurm.DEV_CHAR)',
                'AutoDetect=off']
        gres += ['NodeName=%s Name=gpu File=%s' % (n.name, gres_files(n.vendor, self.fleet.gpus)) for n in nodes]
        fl._write(os.path.join(self.root, 'etc', 'gres.conf'), '\n'.join(gres) + '\n')
        cgroup = ['# generated by tests/fleet/up --slurm: cgroups only track the processes of a job (proctrack/cgroup)',
                  'CgroupPlugin=cgroup/v1', 'CgroupAutomount=no', 'ConstrainCores=no', 'ConstrainRAMSpace=no', 'ConstrainDevices=no']
        fl._write(os.path.join(self.root, 'etc', 'cgroup.conf'), '\n'.join(cgroup) + '\n')

    def node_setup(self, node):
        """What node_setup.py needs for a Slurm node: slurmd's command line, character device files, its cgroup."""
        argv = ['/usr/bin/env', 'LD_PRELOAD=%s' % self.shim, 'SLURM_CONF=%s' % self.conf,
                shutil.which('slurmd'), '-D', '-N', node.name, '-f', self.conf]
        binds = [[path, FREEZER] for path in node.cgroups]
        # gpusim's driver daemon: a job's (non-root) `gpusim spawn` registers its workload through it
        driverd = [self.fleet.python, os.path.join(fl.SIM_DIR, 'gpusim_driverd.py'), '--state', fl.GPU_SIM_STATE]
        return {'daemons': [driverd, argv] if self.fleet.use_gpusim else [argv], 'dev_char': list(DEV_CHAR), 'binds': binds}

    # -- start -------------------------------------------------------------------------------
    def _spawn(self, name, argv, preexec=None, env=None):
        logf = open(os.path.join(self.root, name + '.out'), 'ab')  # pylint: disable=consider-using-with
        env = dict({'PATH': fl.STD_PATH, 'LANG': 'C.UTF-8'}, **(env or {}))
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, close_fds=True,
                                    start_new_session=True, env=env, cwd='/', preexec_fn=preexec)  # pylint: disable=subprocess-popen-preexec-fn
        finally:
            logf.close()
        stat = fl.proc_stat(proc.pid)
        self.procs[name] = proc
        self.daemons[name] = {'pid': proc.pid, 'starttime': stat[2] if stat else None, 'argv': argv}
        self.fleet.save_state('starting')

    def start_controller(self):
        """munged (as munge) and slurmctld (as root), host processes; returns when slurmctld listens on its port."""
        munge = pwd.getpwnam('munge')

        def as_munge():
            os.setgroups([])
            os.setgid(munge.pw_gid)
            os.setuid(munge.pw_uid)

        self._spawn('munged', [shutil.which('munged'), '-F', '--socket=%s' % self.socket,
                               '--key-file=%s' % os.path.join(self.munge_dir, 'munge.key'),
                               '--pid-file=%s' % os.path.join(self.munge_dir, 'munged.pid'),
                               '--seed-file=%s' % os.path.join(self.munge_dir, 'munged.seed'),
                               '--log-file=%s' % os.path.join(self.munge_dir, 'munged.log')], preexec=as_munge)
        self._wait('munged', lambda: os.path.exists(self.socket), 'to create %s' % self.socket)
        self._spawn('slurmctld', [shutil.which('slurmctld'), '-D', '-i', '-f', self.conf], env={'SLURM_CONF': self.conf, 'LD_PRELOAD': self.shim})
        pid = self.daemons['slurmctld']['pid']
        self._wait('slurmctld', lambda: fl.Fleet._owns_socket(pid, fl.Fleet._listening().get(self.ctld_port, set())),  # pylint: disable=protected-access
                   'to listen on 127.0.0.1:%d' % self.ctld_port)

    def _wait(self, name, ready, what, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not ready():
            if self.procs[name].poll() is not None:
                raise fl.FleetError('%s exited (status %s) during start; %s ends with:\n%s' % (
                    name, self.procs[name].returncode, self._out(name), self._tail(self._out(name))))
            if time.monotonic() > deadline:
                raise fl.FleetError('%s did not manage %s within %.0fs; see %s' % (name, what, timeout, self._out(name)))
            time.sleep(0.05)

    def _out(self, name):
        return os.path.join(self.root, name + '.out')

    @staticmethod
    def _tail(path, lines=15):
        try:
            with open(path, 'rb') as handle:
                return '\n'.join(handle.read().decode(errors='replace').splitlines()[-lines:]) or '(empty)'
        except OSError:
            return '(no log)'

    def sinfo(self):
        """{node: state} from `sinfo -N` (None when sinfo fails)."""
        env = {'PATH': fl.STD_PATH, 'LANG': 'C.UTF-8', 'SLURM_CONF': self.conf}
        try:
            proc = subprocess.run(['sinfo', '-h', '-N', '-o', '%N %T'], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0:
            return None
        return dict(line.split(None, 1) for line in proc.stdout.decode(errors='replace').splitlines() if ' ' in line)

    def wait_nodes(self, started, timeout):
        """Record each node's slurmd (its init's child, host view) and wait until `sinfo` shows every node idle."""
        deadline = started + timeout
        while True:
            kids = fl.children_map()
            for node in self.fleet.nodes:
                if node.slurmd_pid is None:
                    for pid in kids.get(node.init_pid, []):
                        if fl._comm(pid) == 'slurmd':  # pylint: disable=protected-access
                            node.slurmd_pid, node.slurmd_starttime = pid, fl.proc_stat(pid)[2]
            states = self.sinfo() or {}
            if all(states.get(n.name) == 'idle' for n in self.fleet.nodes):
                return
            if time.monotonic() > deadline:
                node = next(n for n in self.fleet.nodes if states.get(n.name) != 'idle')
                raise fl.FleetError('timed out after %.1fs waiting for the Slurm nodes to be idle (sinfo: %s); %s ends with:\n%s' % (
                    timeout, states or 'no answer', os.path.join(self.root, 'node', node.name, 'slurmd.log'),
                    self._tail(os.path.join(self.root, 'node', node.name, 'slurmd.log'))))
            time.sleep(0.1)

    def record(self):
        return {'root': self.root, 'conf': self.conf, 'ctld_port': self.ctld_port, 'proctrack': self.proctrack,
                'daemons': self.daemons, 'cgroups': [path for node in self.fleet.nodes for path in node.cgroups]}


def unrecorded_daemons(fleet_dir, known):
    """Host pids of munged/slurmctld started for DIR (their command line names DIR/slurm/) and not in `known`."""
    prefix = os.path.join(fleet_dir, 'slurm', '').encode()
    found = []
    for pid in fl.all_pids():
        if pid in known:
            continue
        argv = fl.argv_of(pid)
        if argv is None:
            continue
        if argv and os.path.basename(argv[0]) in (b'munged', b'slurmctld') and any(prefix in a for a in argv[1:]):
            stat = fl.proc_stat(pid)
            if stat is not None:
                found.append((pid, stat[2]))
    return found


def stop(fleet_dir, record, timeout=10.0):
    """Stop slurmctld (and its slurmscriptd), then munged, by their recorded (pid, start time); FleetError if one survives.

    Runs after the nodes are down (their slurmd went with their namespaces)."""
    daemons = (record or {}).get('daemons', {})
    known = {d.get('pid') for d in daemons.values()}
    order = [(daemons[name]['pid'], daemons[name]['starttime']) for name in ('slurmctld', 'munged')
             if name in daemons and daemons[name].get('starttime') is not None]
    order += unrecorded_daemons(fleet_dir, known)
    left = []
    for pid, start in order:
        kids = [(k, fl.proc_stat(k)[2]) for k in fl.children_map().get(pid, []) if fl.proc_stat(k)] if fl.alive(pid, start) else []
        fl.signal_verified(pid, start, signal.SIGTERM)
        if fl._wait_gone([(pid, start)], timeout):  # pylint: disable=protected-access
            fl.signal_verified(pid, start, signal.SIGKILL)
        for kid, kstart in kids:  # slurmctld's slurmscriptd ends with it; make sure
            if fl._wait_gone([(kid, kstart)], 2.0):  # pylint: disable=protected-access
                fl.signal_verified(kid, kstart, signal.SIGKILL)
        left += fl._wait_gone([(pid, start)] + kids, timeout)  # pylint: disable=protected-access
    # the nodes' freezer cgroups, also of nodes an `up` that failed early never started (rmdir only, once empty)
    cgroups_left = fl.remove_cgroups((record or {}).get('cgroups') or [])
    if cgroups_left:
        fl.say('fleet down: cgroups not empty, left in place: %s' % ', '.join(cgroups_left))
    if left:
        raise fl.FleetError('fleet down: Slurm daemons still alive: %s' % ', '.join(str(p) for p, _s in left))
    return len(order)
