# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Simulated GPU fleet over real SSH: the logic behind tests/fleet/up and tests/fleet/down.

Every node is a real sshd on 127.0.0.1:<port> running in its own PID, mount and UTS namespace,
with private /etc/gpufleet, /var/lib/gpufleet, /run, /dev, ... (see PRIVATE_DIRS and node_setup.py)
and its own simulated GPUs (tests/sim/gpusim, state in the node's private /var/lib/gpusim).

Safety rules this module keeps:
* processes are only ever signalled by the HOST pids that `up` got back when it started them
  (recorded in DIR/nodes.json with their start times), and only while /proc/PID/stat still shows
  the recorded start time, so a reused pid is never hit.  Pid files written inside a namespace are
  never read: there, sshd is pid 1 or small and would name some unrelated host process.
* after stopping, `down` checks that no process of any node's PID namespace remains.
* nothing is mounted in the host mount namespace; only missing mount points are created (mkdir).
* nodes listen on 127.0.0.1 only.
"""

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, '..', '..', '..'))
SIM_DIR = os.path.join(REPO, 'tests', 'sim')
GPUSIM = os.path.join(SIM_DIR, 'gpusim')
NODE_SETUP = os.path.join(HERE, 'node_setup.py')

SSHD = '/usr/sbin/sshd'
SSH_KEYGEN = 'ssh-keygen'
GPU_SIM_STATE = '/var/lib/gpusim/state.json'
STD_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'

# Paths every node gets a private, initially empty copy of (bind mounts of DIR/nodes/nodeNN/fs/<path>).
PRIVATE_DIRS = (
    '/etc/gpufleet',
    '/var/lib/gpufleet',
    '/var/log/gpufleet',
    '/run',
    '/etc/systemd/system',
    '/etc/cron.d',
    '/etc/logrotate.d',
    '/opt/gpufleet',
    '/var/lib/node_exporter',
    '/var/lib/gpusim',
    '/root/.ansible',
    '/etc/profile.d',  # starts as a copy of the host's, plus zz-gpusim.sh (env for login shells)
)
# Private files, bind-mounted over the host's files where those exist: /etc/hosts and
# /etc/hostname get the node's hostname; the login records keep sshd from writing into the host's
# /var/log; root's dotfiles are Debian's defaults, so sessions on a node neither depend on nor pay
# for the host's shell setup.
PRIVATE_FILES = ('/etc/hosts', '/etc/hostname', '/var/log/wtmp', '/var/log/btmp', '/var/log/lastlog', '/root/.bashrc', '/root/.profile')
ROOT_BASHRC = '# ~/.bashrc of root on a simulated fleet node (tests/fleet/up): Debian default, no host setup.\n'
ROOT_PROFILE = '''# ~/.profile of root on a simulated fleet node (tests/fleet/up): Debian default.
if [ "$BASH" ]; then
  if [ -f ~/.bashrc ]; then
    . ~/.bashrc
  fi
fi
mesg n 2> /dev/null || true
'''

VENDORS = ('nvidia', 'amd', 'intel')
PORT_RANGE = (20000, 32700)  # below the kernel's ephemeral range (32768-60999 by default)
MARKER = '.gpufleet-fleet'
SCHEMA = 1


class FleetError(Exception):
    """A clear, user-facing failure of up/down."""


def say(msg):
    sys.stderr.write(msg + '\n')
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# /proc helpers (host view)
# --------------------------------------------------------------------------------------------

def proc_stat(pid):
    """(state, ppid, starttime) of a host pid, or None when there is no such process."""
    try:
        with open('/proc/%d/stat' % pid, 'rb') as handle:
            data = handle.read()
    except (OSError, ValueError):
        return None
    fields = data[data.rindex(b')') + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


def alive(pid, starttime):
    """True when host pid `pid` is the process we recorded (same start time) and is not a zombie."""
    if not pid or pid <= 1 or pid == os.getpid():
        return False
    stat = proc_stat(pid)
    return stat is not None and stat[2] == starttime and stat[0] not in ('Z', 'X')


def all_pids():
    return [int(name) for name in os.listdir('/proc') if name.isdigit()]


def children_map():
    """ppid -> [pid] for every host process."""
    result = {}
    for pid in all_pids():
        stat = proc_stat(pid)
        if stat is not None:
            result.setdefault(stat[1], []).append(pid)
    return result


def ns_link(pid, kind):
    try:
        return os.readlink('/proc/%d/ns/%s' % (pid, kind))
    except OSError:
        return None


def hold_pidns(pid, starttime):
    """An fd on the PID namespace of our (verified) process `pid`, or None.

    Namespace inode numbers are reused once a namespace is gone, so a recorded "pid:[inode]" may
    name someone else's namespace later.  Holding the fd keeps the namespace (and its inode) alive
    while we look for its members, which makes the comparison exact.
    """
    if not alive(pid, starttime):
        return None
    try:
        fd = os.open('/proc/%d/ns/pid' % pid, os.O_RDONLY)
    except OSError:
        return None
    own = os.stat('/proc/self/ns/pid')
    held = os.fstat(fd)
    if not alive(pid, starttime) or (held.st_dev, held.st_ino) == (own.st_dev, own.st_ino):
        os.close(fd)
        return None
    return fd


def pids_in_held_pidns(fds):
    """Host pids (not zombies) whose PID namespace is one of the namespaces held by `fds`."""
    wanted = set()
    for fd in fds:
        held = os.fstat(fd)
        wanted.add((held.st_dev, held.st_ino))
    found = []
    if not wanted:
        return found
    for pid in all_pids():
        try:
            st = os.stat('/proc/%d/ns/pid' % pid)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            stat = proc_stat(pid)
            if stat is not None and stat[0] not in ('Z', 'X'):
                found.append(pid)
    return found


def unrecorded_unshares(fleet_dir, known):
    """Host pids of `unshare ... node_setup.py DIR/nodes/*/setup.json` for this DIR not in `known`."""
    prefix = os.path.join(fleet_dir, 'nodes', '').encode()
    found = []
    for pid in all_pids():
        if pid in known:
            continue
        try:
            with open('/proc/%d/cmdline' % pid, 'rb') as handle:
                argv = handle.read().split(b'\0')
        except OSError:
            continue
        if (argv and os.path.basename(argv[0]) == b'unshare' and NODE_SETUP.encode() in argv
                and any(a.startswith(prefix) and a.endswith(b'/setup.json') for a in argv)):
            found.append(pid)
    return found


def signal_verified(pid, starttime, sig):
    """Send `sig` to host pid `pid` only if it still is the process we started."""
    if not alive(pid, starttime):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# down
# --------------------------------------------------------------------------------------------

def _load_state(fleet_dir):
    path = os.path.join(fleet_dir, 'nodes.json')
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise FleetError('%s is not valid JSON (%s); inspect it and stop the processes by hand' % (path, exc)) from exc


def _wait_gone(targets, timeout):
    """Wait until no (pid, starttime) of `targets` is alive; return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [t for t in targets if alive(*t)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def down(fleet_dir, timeout=10.0, quiet=False):
    """Stop every process `up` started for the fleet in `fleet_dir`.  Idempotent."""
    fleet_dir = os.path.abspath(fleet_dir)
    state = _load_state(fleet_dir)
    nodes = state.get('nodes', []) if state else []
    # An `up` killed between starting an unshare and recording it leaves unrecorded nodes: find
    # them by their exact command line (host /proc: unshare ... node_setup.py DIR/nodes/*/setup.json).
    recorded = {n.get('unshare_pid') for n in nodes}
    extra = [{'unshare_pid': pid, 'unshare_starttime': proc_stat(pid)[2]}
             for pid in unrecorded_unshares(fleet_dir, recorded) if proc_stat(pid) is not None]
    if state is None and not extra:
        if not quiet:
            say('fleet down: no fleet recorded in %s (nothing to do)' % fleet_dir)
        return 0
    started = time.monotonic()
    kids = None
    inits, unshares = [], []
    for node in nodes + extra:
        upid, ustart = node.get('unshare_pid'), node.get('unshare_starttime')
        if upid and ustart is not None:
            unshares.append((upid, ustart))
        ipid, istart = node.get('init_pid'), node.get('init_starttime')
        if ipid and istart is not None:
            inits.append((ipid, istart))
        elif alive(upid, ustart):
            # up crashed before it recorded the namespace's init: it is the unshare's only child.
            if kids is None:
                kids = children_map()
            for pid in kids.get(upid, []):
                stat = proc_stat(pid)
                if stat is not None:
                    inits.append((pid, stat[2]))
    held = [fd for fd in (hold_pidns(pid, start) for pid, start in inits) if fd is not None]
    try:
        return _stop(fleet_dir, nodes + extra, inits, unshares, held, timeout, quiet, started)
    finally:
        for fd in held:
            os.close(fd)


def _stop(fleet_dir, nodes, inits, unshares, held, timeout, quiet, started):
    # Graceful: the node's init SIGTERMs everything in its namespace, then exits; when pid 1 of a
    # PID namespace exits the kernel SIGKILLs whatever is left in it.
    for pid, start in inits:
        signal_verified(pid, start, signal.SIGTERM)
    left = _wait_gone(inits, min(3.0, timeout))
    for pid, start in left:
        signal_verified(pid, start, signal.SIGKILL)
    left = _wait_gone(left, timeout)
    # unshare waits for its child and then exits by itself; SIGKILL it (its --kill-child then
    # SIGKILLs the init too) if it is still there.
    uleft = _wait_gone(unshares, 2.0)
    for pid, start in uleft:
        signal_verified(pid, start, signal.SIGKILL)
    uleft = _wait_gone(uleft, timeout)
    # Belt and braces: nothing may remain in any node's PID namespace.
    stray = pids_in_held_pidns(held)
    if stray:
        for pid in stray:
            stat = proc_stat(pid)
            if stat is not None:
                signal_verified(pid, stat[2], signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while stray and time.monotonic() < deadline:
            time.sleep(0.05)
            stray = pids_in_held_pidns(held)
    problems = []
    if left:
        problems.append('node inits still alive: %s' % ', '.join(str(p) for p, _start in left))
    if uleft:
        problems.append('unshare processes still alive: %s' % ', '.join(str(p) for p, _start in uleft))
    if stray:
        problems.append('processes left in node namespaces: %s' % ', '.join(str(p) for p in stray))
    if problems:
        raise FleetError('fleet down: %s' % '; '.join(problems))
    if os.path.exists(os.path.join(fleet_dir, 'nodes.json')):
        os.unlink(os.path.join(fleet_dir, 'nodes.json'))
    if not quiet:
        say('fleet down: stopped %d nodes in %.1fs' % (len(nodes), time.monotonic() - started))
    return len(nodes)


# --------------------------------------------------------------------------------------------
# up
# --------------------------------------------------------------------------------------------

def ensure_sshd():
    """Install openssh-server (Debian, as root) when /usr/sbin/sshd is missing."""
    if os.path.exists(SSHD) and shutil.which(SSH_KEYGEN):
        return
    if os.geteuid() != 0 or not shutil.which('apt-get'):
        raise FleetError('%s is missing; install openssh-server (needs root and apt-get)' % SSHD)
    say('fleet up: %s missing, installing openssh-server with apt-get' % SSHD)
    env = dict(os.environ, DEBIAN_FRONTEND='noninteractive')
    # Keep the package's maintainer scripts from starting a host sshd on port 22.
    policy = '/usr/sbin/policy-rc.d'
    made_policy = not os.path.exists(policy)
    if made_policy:
        with open(policy, 'w') as handle:
            handle.write('#!/bin/sh\nexit 101\n')
        os.chmod(policy, 0o755)
    try:
        cmd = ['apt-get', 'install', '-y', '-q', '--no-install-recommends', 'openssh-server']
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            subprocess.run(['apt-get', 'update', '-q'], env=env, check=False)
            subprocess.run(cmd, env=env, check=True)
    except subprocess.CalledProcessError as exc:
        raise FleetError('apt-get install openssh-server failed: %s' % exc) from exc
    finally:
        if made_policy:
            os.unlink(policy)
    if not os.path.exists(SSHD):
        raise FleetError('%s still missing after installing openssh-server' % SSHD)


def _has_modules(python):
    cmd = [python, '-c', 'import psutil, yaml, pynvml']
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False).returncode == 0
    except OSError:
        return False


def find_python(requested=None):
    """The interpreter nodes run modules with: it needs psutil, pyyaml and nvidia-ml-py.

    Nodes share the host filesystem (the venv is bind-mounted read-only into them), so the
    controller's venv python is used.  Not resolved through symlinks: a venv is found by its path.
    """
    if requested:
        if not _has_modules(requested):
            raise FleetError('--python %s cannot import psutil, yaml and pynvml' % requested)
        return os.path.abspath(requested)
    candidates = [sys.executable, os.path.join(REPO, '.venv', 'bin', 'python'), '/tmp/venv/bin/python']
    for cand in candidates:
        if cand and os.path.exists(cand) and _has_modules(cand):
            return os.path.abspath(cand)
    raise FleetError('no python with psutil, pyyaml and nvidia-ml-py found (tried %s); pass --python' % ', '.join(candidates))


def _venv_prefix(python):
    prefix = os.path.dirname(os.path.dirname(python))
    return prefix if os.path.exists(os.path.join(prefix, 'pyvenv.cfg')) else None


def node_env(python, gpusim_init, probe_dir):
    """The environment of every process on a node (SSH sessions, the node's init, gpusim init).

    `gpusim env` prints it, but needs an initialized state (the driver and vendor pick the library
    directory and PYTHONPATH), so `gpusim_init` is first run once on the host into `probe_dir`
    (which also checks the init arguments before any node starts).  Its exports are evaluated by a
    shell (they refer to $PATH) on top of a base with the interpreter's bin directory first;
    GPU_SIM_STATE is then pointed at the node's private state file.  Without gpusim
    (`gpusim_init` None) the documented layout is used.
    """
    base = {
        'PATH': '%s:%s' % (os.path.dirname(python), STD_PATH),
        'GPU_SIM_STATE': GPU_SIM_STATE,
        'HOME': '/root',
        'LANG': 'C.UTF-8',
    }
    if gpusim_init:
        os.makedirs(probe_dir, exist_ok=True)
        probe = dict(base, GPU_SIM_STATE=os.path.join(probe_dir, 'state.json'))
        proc = subprocess.run(gpusim_init, env=probe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, check=False)
        if proc.returncode != 0:
            raise FleetError('%s failed: %s' % (' '.join(gpusim_init), proc.stdout.decode(errors='replace').strip()))
        script = 'eval "$("$0" env)" && exec env -0'
        proc = subprocess.run(['/bin/sh', '-c', script, GPUSIM], env=probe, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, check=False)
        shutil.rmtree(probe_dir, ignore_errors=True)
        if proc.returncode != 0:
            raise FleetError('%s env failed: %s' % (GPUSIM, proc.stderr.decode(errors='replace').strip()))
        env = {}
        for item in proc.stdout.split(b'\0'):
            if b'=' in item:
                key, value = item.decode().split('=', 1)
                env[key] = value
        for key in ('PWD', 'OLDPWD', 'SHLVL', '_'):
            env.pop(key, None)
        # paths gpusim derived from the probe's state (an Intel node's fake DRM tree) -> the node's
        for key, value in list(env.items()):
            if value.startswith(probe_dir + os.sep):
                env[key] = os.path.join(os.path.dirname(GPU_SIM_STATE), value[len(probe_dir) + 1:])
        env['GPU_SIM_STATE'] = GPU_SIM_STATE  # the node's private state file
    else:
        env = dict(base)
        env['PATH'] = '%s:%s:%s' % (os.path.join(SIM_DIR, 'bin'), SIM_DIR, base['PATH'])
        env['LD_LIBRARY_PATH'] = os.path.join(SIM_DIR, 'build')
    for key, value in env.items():
        if '"' in value or '\n' in value or '\\' in value:
            raise FleetError('cannot pass %s=%r through sshd SetEnv' % (key, value))
    return env


def _port_free(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(('127.0.0.1', port))
        return True
    except OSError:
        return False
    finally:
        sock.close()


class PortPicker:
    """Free ports below the ephemeral range, bind-tested, never handed out twice by one `up`."""

    def __init__(self):
        self.used = set()
        self.next = random.randrange(*PORT_RANGE)

    def pick(self):
        for _attempt in range(PORT_RANGE[1] - PORT_RANGE[0]):
            port = self.next
            self.next = PORT_RANGE[0] if self.next + 1 >= PORT_RANGE[1] else self.next + 1
            if port not in self.used and _port_free(port):
                self.used.add(port)
                return port
        raise FleetError('no free TCP port on 127.0.0.1 in %d-%d' % PORT_RANGE)


def dev_layout(vendor, gpus):
    """(files, dirs) of the node's /dev standing for its GPU device nodes."""
    if vendor == 'nvidia':
        return ['nvidiactl', 'nvidia-uvm'] + ['nvidia%d' % i for i in range(gpus)], []
    return (['kfd'] if vendor == 'amd' else []) + ['dri/renderD%d' % (128 + i) for i in range(gpus)], ['dri']


def _write(path, text, mode=0o644):
    tmp = '%s.tmp.%d' % (path, os.getpid())
    with open(tmp, 'w') as handle:
        handle.write(text)
    os.chmod(tmp, mode)
    os.rename(tmp, path)


def _check_dir_name(fleet_dir):
    bad = set(' \t\n"\'\\%$`#,;=')
    if any(ch in bad for ch in fleet_dir):
        raise FleetError('--dir %r: use a path without whitespace, quotes or any of #$%%,;=`\\' % fleet_dir)


def _keygen(paths_and_comments):
    procs = []
    for path, comment in paths_and_comments:
        for suffix in ('', '.pub'):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)
        procs.append(subprocess.Popen([SSH_KEYGEN, '-q', '-t', 'ed25519', '-N', '', '-C', comment, '-f', path],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        err = proc.communicate()[1]
        if proc.returncode != 0:
            raise FleetError('ssh-keygen failed: %s' % err.decode(errors='replace').strip())


def _read_pub(path):
    with open(path) as handle:
        kind, key = handle.read().split()[:2]
    return kind, key


class Node:
    """One simulated node as `up` manages it."""

    def __init__(self, fleet_dir, index, width):
        self.name = 'node%0*d' % (width, index)
        self.dir = os.path.join(fleet_dir, 'nodes', self.name)
        self.fs = os.path.join(self.dir, 'fs')
        self.port = None
        self.proc = None
        self.unshare_pid = None
        self.unshare_starttime = None
        self.init_pid = None
        self.init_starttime = None
        self.pidns = None
        self.mntns = None
        self.attempts = 0
        self.log_offset = 0
        self.ready = False
        self.vendor = None       # this node's GPU vendor, its environment and gpusim init command
        self.env = None
        self.gpusim_init = None

    def record(self):
        return {
            'name': self.name, 'port': self.port, 'dir': self.dir,
            'unshare_pid': self.unshare_pid, 'unshare_starttime': self.unshare_starttime,
            'init_pid': self.init_pid, 'init_starttime': self.init_starttime,
            'pidns': self.pidns, 'mntns': self.mntns,
        }


class Fleet:
    """Brings up a fleet (see `up`)."""

    def __init__(self, fleet_dir, nodes, gpus=4, vendor='nvidia', init_args=(), python=None,
                 timeout=None, use_gpusim=True, quiet=False, vendors=None):
        self.dir = os.path.abspath(fleet_dir)
        self.count = nodes
        self.gpus = gpus
        self.vendor = vendor
        # per-node vendors (node i gets vendors[i % len]); None: every node is `vendor`
        self.vendors = list(vendors) if vendors else None
        self.init_args = list(init_args)
        self.python_req = python
        self.timeout = timeout if timeout else 30.0 + 1.5 * nodes
        self.use_gpusim = use_gpusim
        self.quiet = quiet
        self.nodes = []
        self.ports = PortPicker()
        self.python = None
        self.env = None
        self.gpusim_init = None

    def log(self, msg):
        if not self.quiet:
            say('fleet up: %s' % msg)

    # -- preparation -------------------------------------------------------------------------
    def prepare(self):
        if os.geteuid() != 0:
            raise FleetError('must run as root (namespaces, bind mounts)')
        if not 1 <= self.count <= 999:
            raise FleetError('--nodes must be 1..999')
        if not 1 <= self.gpus <= 64:
            raise FleetError('--gpus must be 1..64')
        _check_dir_name(self.dir)
        ensure_sshd()
        if self.use_gpusim and not os.access(GPUSIM, os.X_OK):
            raise FleetError('%s not found or not executable (build the simulator, or pass --no-gpusim)' % GPUSIM)
        if not shutil.which('unshare'):
            raise FleetError('unshare (util-linux) not found')
        self.python = find_python(self.python_req)
        if self.vendors and any(v not in VENDORS for v in self.vendors):
            raise FleetError('--vendors: each vendor must be one of %s, got %s' % (', '.join(VENDORS), ','.join(self.vendors)))
        if self.use_gpusim:
            self.gpusim_init = self._gpusim_init(self.vendor)
        os.makedirs(self.dir, exist_ok=True)
        # An old fleet in DIR goes down first (by its recorded host pids).
        down(self.dir, quiet=self.quiet)
        nodes_root = os.path.join(self.dir, 'nodes')
        if os.path.lexists(nodes_root):
            if not os.path.exists(os.path.join(nodes_root, MARKER)):
                raise FleetError('%s exists but was not made by tests/fleet/up; refusing to delete it' % nodes_root)
            shutil.rmtree(nodes_root)
        for name in ('inventory.ini', 'ssh_config', 'known_hosts', 'authorized_keys'):
            if os.path.lexists(os.path.join(self.dir, name)):
                os.unlink(os.path.join(self.dir, name))
        os.makedirs(nodes_root)
        _write(os.path.join(nodes_root, MARKER), 'made by tests/fleet/up; removed by the next up\n')
        self.env = node_env(self.python, self.gpusim_init, os.path.join(nodes_root, '.env-probe'))
        envs = {self.vendor: self.env}
        for vendor in self.vendors or ():
            if vendor not in envs:
                envs[vendor] = node_env(self.python, self._gpusim_init(vendor), os.path.join(nodes_root, '.env-probe'))
        # Mount points on the host: created only when absent, empty, never mounted on in the host ns.
        for path in PRIVATE_DIRS:
            if not os.path.isdir(path):
                os.makedirs(path, 0o755, exist_ok=True)
        width = max(2, len(str(self.count)))
        self.nodes = [Node(self.dir, i + 1, width) for i in range(self.count)]
        for i, node in enumerate(self.nodes):
            node.vendor = self.vendors[i % len(self.vendors)] if self.vendors else self.vendor
            node.env = envs[node.vendor]
            node.gpusim_init = self._gpusim_init(node.vendor) if self.use_gpusim else None
        keys = [(os.path.join(self.dir, 'id_ed25519'), 'gpufleet-controller')]
        for node in self.nodes:
            os.makedirs(node.dir)
            keys.append((os.path.join(node.dir, 'ssh_host_ed25519_key'), node.name))
        _keygen(keys)
        os.chmod(os.path.join(self.dir, 'id_ed25519'), 0o600)
        shutil.copyfile(os.path.join(self.dir, 'id_ed25519.pub'), os.path.join(self.dir, 'authorized_keys'))
        for node in self.nodes:
            self._prepare_node(node)

    def _gpusim_init(self, vendor):
        return [GPUSIM, 'init', '--gpus', str(self.gpus), '--vendor', vendor] + self.init_args if self.use_gpusim else None

    def _prepare_node(self, node):
        private_dirs = []
        for path in PRIVATE_DIRS:
            src = node.fs + path
            os.makedirs(src, 0o755)
            private_dirs.append((path, src))
        profile_d = node.fs + '/etc/profile.d'
        if os.path.isdir('/etc/profile.d'):
            for name in os.listdir('/etc/profile.d'):
                full = os.path.join('/etc/profile.d', name)
                if os.path.isfile(full):
                    shutil.copy2(full, profile_d)
        exports = ''.join('export %s=%s\n' % (k, shlex.quote(v)) for k, v in sorted(node.env.items()) if k not in ('HOME',))
        _write(os.path.join(profile_d, 'zz-gpusim.sh'), '# simulated GPUs of this fleet node (tests/fleet/up)\n' + exports)
        private_files = []
        for path in PRIVATE_FILES:
            if not os.path.isfile(path):
                continue
            src = node.fs + path
            os.makedirs(os.path.dirname(src), exist_ok=True)
            if path == '/etc/hosts':
                with open(path) as handle:
                    text = handle.read()
                _write(src, text.rstrip('\n') + '\n127.0.1.1 %s\n' % node.name)
            elif path == '/etc/hostname':
                _write(src, node.name + '\n')
            elif path == '/root/.bashrc':
                _write(src, ROOT_BASHRC)
            elif path == '/root/.profile':
                _write(src, ROOT_PROFILE)
            else:
                _write(src, '', 0o664)
            private_files.append((path, src))
        dev_files, dev_dirs = dev_layout(node.vendor, self.gpus)
        readonly = [REPO]
        prefix = _venv_prefix(self.python)
        if prefix:
            readonly.append(prefix)
        os.makedirs(os.path.join(node.dir, 'devstage'))
        setup = {
            'hostname': node.name,
            'private_dirs': private_dirs,
            'private_files': private_files,
            'run_dirs': [['/run/sshd', 0o755], ['/run/lock', 0o1777]],
            'dev_stage': os.path.join(node.dir, 'devstage'),
            'dev_files': dev_files,
            'dev_dirs': dev_dirs,
            'readonly': readonly,
            'env': node.env,
            'gpusim_init': node.gpusim_init,
            'sshd_config': os.path.join(node.dir, 'sshd_config'),
        }
        _write(os.path.join(node.dir, 'setup.json'), json.dumps(setup, indent=1) + '\n')

    def _write_sshd_config(self, node):
        setenv = ' '.join('"%s=%s"' % (k, v) for k, v in sorted(node.env.items()) if k != 'HOME')
        text = '\n'.join([
            '# generated by tests/fleet/up for %s: do not edit' % node.name,
            'ListenAddress 127.0.0.1:%d' % node.port,
            'AddressFamily inet',
            'HostKey %s' % os.path.join(node.dir, 'ssh_host_ed25519_key'),
            'PidFile /run/sshd.pid',
            'UsePAM no',
            'PermitRootLogin prohibit-password',
            'PubkeyAuthentication yes',
            'PasswordAuthentication no',
            'KbdInteractiveAuthentication no',
            'AuthorizedKeysFile %s' % os.path.join(self.dir, 'authorized_keys'),
            'StrictModes no',
            'PermitUserEnvironment no',
            'LogLevel ERROR',
            'MaxStartups 256:30:512',
            'MaxSessions 256',
            'LoginGraceTime 60',
            'UseDNS no',
            'PrintMotd no',
            'PrintLastLog no',
            'X11Forwarding no',
            'AcceptEnv LANG LC_*',
            'Subsystem sftp internal-sftp',
            'SetEnv %s' % setenv,
            '',
        ])
        _write(os.path.join(node.dir, 'sshd_config'), text)

    # -- start / wait ------------------------------------------------------------------------
    def _spawn(self, node):
        node.port = self.ports.pick()
        node.attempts += 1
        node.unshare_pid = node.unshare_starttime = node.init_pid = node.init_starttime = None
        node.pidns = node.mntns = None
        self._write_sshd_config(node)
        cmd = ['unshare', '--pid', '--fork', '--mount', '--mount-proc', '--uts', '--propagation', 'private',
               '--kill-child=SIGKILL', '--', self.python, '-I', '-S', NODE_SETUP, os.path.join(node.dir, 'setup.json')]
        with open(os.path.join(node.dir, 'node.log'), 'ab') as logf:
            node.log_offset = logf.tell()
            node.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         close_fds=True, start_new_session=True, env=node.env, cwd='/')
        node.unshare_pid = node.proc.pid
        stat = proc_stat(node.proc.pid)
        node.unshare_starttime = stat[2] if stat else None

    def save_state(self, status):
        state = {
            'schema': SCHEMA, 'status': status, 'dir': self.dir, 'gpus': self.gpus, 'vendor': self.vendor,
            'vendors': [n.vendor for n in self.nodes],
            'python': self.python, 'created': time.time(), 'nodes': [n.record() for n in self.nodes if n.unshare_pid],
        }
        _write(os.path.join(self.dir, 'nodes.json'), json.dumps(state, indent=1) + '\n')

    def _log_tail(self, node, lines=15):
        try:
            with open(os.path.join(node.dir, 'node.log'), 'rb') as handle:
                handle.seek(node.log_offset)  # this attempt's output only
                text = handle.read().decode(errors='replace')
            return '\n'.join(text.splitlines()[-lines:]) or '(empty)'
        except OSError:
            return '(no log)'

    @staticmethod
    def _listening():
        """port -> {"socket:[inode]"} of the TCP sockets listening on 127.0.0.1 (host net namespace)."""
        result = {}
        with open('/proc/net/tcp') as handle:
            next(handle)
            for line in handle:
                parts = line.split()
                if parts[3] == '0A' and parts[1].startswith('0100007F:'):  # LISTEN on 127.0.0.1
                    result.setdefault(int(parts[1].split(':')[1], 16), set()).add('socket:[%s]' % parts[9])
        return result

    @staticmethod
    def _owns_socket(pid, inodes):
        try:
            fds = os.listdir('/proc/%d/fd' % pid)
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink('/proc/%d/fd/%s' % (pid, fd)) in inodes:
                    return True
            except OSError:
                pass
        return False

    def _check_node(self, node, kids, listening):
        """Advance one node; returns True when it is ready (its own sshd listens on its port)."""
        if node.init_pid is None:
            for pid in kids.get(node.unshare_pid, []):
                stat = proc_stat(pid)
                link = ns_link(pid, 'pid')
                if stat is not None and link and link != ns_link(os.getpid(), 'pid'):
                    node.init_pid, node.init_starttime = pid, stat[2]
                    node.pidns, node.mntns = link, ns_link(pid, 'mnt')
            if node.init_pid is None:
                return False
        # sshd is the init's child (host view); the listening socket on our port must be its own
        # (a bare connect could reach some other process that grabbed the port meanwhile).
        inodes = listening.get(node.port)
        if not inodes:
            return False
        return any(self._owns_socket(pid, inodes) for pid in kids.get(node.init_pid, []))

    def start(self):
        started = time.monotonic()
        for node in self.nodes:
            self._spawn(node)
        self.save_state('starting')
        deadline = started + self.timeout
        pending = list(self.nodes)
        while pending:
            kids = children_map()
            listening = self._listening()
            for node in list(pending):
                rc = node.proc.poll()
                if rc is not None:
                    tail = self._log_tail(node)
                    port_clash = 'Address already in use' in tail or 'Cannot bind any address' in tail
                    if port_clash and node.attempts < 5:
                        self.log('%s: port %d was taken meanwhile, retrying on another' % (node.name, node.port))
                        self._spawn(node)
                        self.save_state('starting')
                        continue
                    raise FleetError('%s exited during start (status %s); %s/node.log ends with:\n%s' % (node.name, rc, node.dir, tail))
                if self._check_node(node, kids, listening):
                    node.ready = True
                    pending.remove(node)
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ', '.join(n.name for n in pending[:10]) + (' ...' if len(pending) > 10 else '')
                raise FleetError('timed out after %.1fs waiting for %d of %d nodes to accept SSH (%s); last log of %s:\n%s' % (
                    self.timeout, len(pending), len(self.nodes), names, pending[0].name, self._log_tail(pending[0])))
            time.sleep(0.05)
        self.save_state('up')
        return time.monotonic() - started

    # -- client side files -------------------------------------------------------------------
    def write_client_files(self):
        key = os.path.join(self.dir, 'id_ed25519')
        known = os.path.join(self.dir, 'known_hosts')
        ssh_config = os.path.join(self.dir, 'ssh_config')
        lines = []
        for node in self.nodes:
            kind, pub = _read_pub(os.path.join(node.dir, 'ssh_host_ed25519_key.pub'))
            lines.append('[127.0.0.1]:%d %s %s\n' % (node.port, kind, pub))
        _write(known, ''.join(lines))
        cfg = ['# generated by tests/fleet/up: ssh -F %s node01' % ssh_config]
        for node in self.nodes:
            cfg += ['Host %s' % node.name, '    HostName 127.0.0.1', '    Port %d' % node.port]
        cfg += [
            'Host *',
            '    User root',
            '    IdentityFile %s' % key,
            '    IdentitiesOnly yes',
            '    UserKnownHostsFile %s' % known,
            '    GlobalKnownHostsFile /dev/null',
            '    StrictHostKeyChecking yes',
            '    UpdateHostKeys no',
            '    CheckHostIP no',
            '    HashKnownHosts no',
            '    PasswordAuthentication no',
            '    KbdInteractiveAuthentication no',
            '    BatchMode yes',
            '    ConnectTimeout 30',
            '    LogLevel ERROR',
            '',
        ]
        _write(ssh_config, '\n'.join(cfg))
        common = '-F %s -o UserKnownHostsFile=%s -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes' % (ssh_config, known)
        inv = ['# generated by tests/fleet/up: %d simulated nodes (down: tests/fleet/down --dir %s)' % (len(self.nodes), self.dir),
               '[gpu_nodes]']
        for node in self.nodes:
            line = '%s ansible_host=127.0.0.1 ansible_port=%d ansible_user=root' % (node.name, node.port)
            if self.vendors:
                line += ' gpusim_vendor=%s' % node.vendor  # mixed fleets say which vendor each node has
            inv.append(line)
        inv += [
            '',
            '[gpu_nodes:vars]',
            'ansible_connection=ssh',
            'ansible_ssh_private_key_file=%s' % key,
            "ansible_ssh_common_args='%s'" % common,
            'ansible_python_interpreter=%s' % self.python,
            'ansible_pipelining=true',
            '',
        ]
        _write(os.path.join(self.dir, 'inventory.ini'), '\n'.join(inv))


def up(fleet_dir, nodes, **kwargs):
    """Start `nodes` simulated nodes under `fleet_dir`; returns the Fleet.  Cleans up on failure."""
    fleet = Fleet(fleet_dir, nodes, **kwargs)
    started = time.monotonic()
    fleet.prepare()
    try:
        fleet.start()
        fleet.write_client_files()
    except BaseException:
        say('fleet up: failed, stopping the nodes already started')
        try:
            if os.path.exists(os.path.join(fleet.dir, 'nodes.json')):
                down(fleet.dir, quiet=True)
        except FleetError as exc:
            say(str(exc))
        raise
    fleet.log('%d nodes up in %.1fs: ansible -i %s gpu_nodes ... | ssh -F %s %s' % (
        len(fleet.nodes), time.monotonic() - started, os.path.join(fleet.dir, 'inventory.ini'),
        os.path.join(fleet.dir, 'ssh_config'), fleet.nodes[0].name))
    return fleet


# --------------------------------------------------------------------------------------------
# command lines
# --------------------------------------------------------------------------------------------

def main_up(argv=None):
    import argparse  # pylint: disable=import-outside-toplevel
    parser = argparse.ArgumentParser(prog='tests/fleet/up', description='Start N simulated GPU nodes (sshd in PID+mount namespaces) on 127.0.0.1.')
    parser.add_argument('--nodes', type=int, required=True, help='number of nodes (node01, node02, ...)')
    parser.add_argument('--dir', required=True, help='fleet directory: inventory.ini, ssh_config, known_hosts, keys, nodes/')
    parser.add_argument('--gpus', type=int, default=4, help='simulated GPUs per node (default 4)')
    parser.add_argument('--vendor', choices=VENDORS, default='nvidia', help='passed to gpusim init; picks the /dev files')
    parser.add_argument('--vendors', type=lambda text: [v.strip() for v in text.split(',') if v.strip()], metavar='V1,V2,...',
                        help='per-node vendors, cycled over the nodes (node01 gets V1, node02 V2, ...); overrides --vendor')
    parser.add_argument('--init-arg', action='append', default=[], metavar='ARG', help='extra argument for gpusim init (repeatable)')
    parser.add_argument('--python', help='interpreter for ansible_python_interpreter (needs psutil, pyyaml, nvidia-ml-py)')
    parser.add_argument('--timeout', type=float, help='seconds to wait for all nodes (default 30 + 1.5 per node)')
    parser.add_argument('--no-gpusim', action='store_true', help='do not run gpusim (SSH/namespace testing only)')
    parser.add_argument('-q', '--quiet', action='store_true')
    args = parser.parse_args(argv)
    try:
        up(args.dir, args.nodes, gpus=args.gpus, vendor=args.vendor, init_args=args.init_arg, python=args.python,
           timeout=args.timeout, use_gpusim=not args.no_gpusim, quiet=args.quiet, vendors=args.vendors)
    except FleetError as exc:
        say('fleet up: error: %s' % exc)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main_down(argv=None):
    import argparse  # pylint: disable=import-outside-toplevel
    parser = argparse.ArgumentParser(prog='tests/fleet/down', description='Stop every process tests/fleet/up started for DIR.')
    parser.add_argument('--dir', required=True)
    parser.add_argument('--timeout', type=float, default=10.0, help='seconds to wait for processes to go (default 10)')
    parser.add_argument('-q', '--quiet', action='store_true')
    args = parser.parse_args(argv)
    try:
        down(args.dir, timeout=args.timeout, quiet=args.quiet)
    except FleetError as exc:
        say('fleet down: error: %s' % exc)
        return 1
    return 0
