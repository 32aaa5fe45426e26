# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Set up one simulated fleet node from INSIDE its fresh PID + mount + UTS namespace.

`tests/fleet/up` starts, per node::

    unshare --pid --fork --mount --mount-proc --uts --propagation private --kill-child=SIGKILL \\
        PYTHON -I -S node_setup.py NODEDIR/setup.json

so this script runs as pid 1 of the node's PID namespace.  It only uses the standard library
(started with -S, so it also works before the venv's site-packages would load) and:

1. makes every mount private (nothing can propagate back to the host mount table);
2. sets the node's hostname (private UTS namespace);
3. bind-mounts the node's private directories (DIR/nodes/nodeNN/priv/*) over the system paths
   (/etc/gpufleet, /var/lib/gpufleet, /run, /etc/systemd/system, ...) and private files (/etc/hosts);
4. builds a private /dev (tmpfs + bind-mounted null/zero/full/random/urandom/tty, a new devpts
   instance, /dev/shm, /dev/fd, and plain files standing for the GPU device nodes);
5. re-binds the repository and the controller venv read-only, so a role applied on a node cannot
   write into the controller's tree;
6. runs `gpusim init` with the node's environment;
7. starts the node's extra daemons (`--slurm`: gpusim's driver daemon and `slurmd -D`) as its children;
8. execs /bin/sh (dash) node_init.sh as the node's init: it starts `sshd -D` as its child, reaps
   every orphan reparented to it (simulated workloads are daemons), and exits when sshd exits.
   SIGTERM from the host makes it SIGTERM everything in the namespace and exit; the kernel then
   SIGKILLs the rest.

Everything it prints goes to DIR/nodes/nodeNN/node.log (up opened that file as stdout/stderr).
"""

import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18

HOST_DEVICES = ('null', 'zero', 'full', 'random', 'urandom', 'tty')

INIT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'node_init.sh')

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _b(value):
    return value.encode() if isinstance(value, str) else value


def mount(source, target, fstype, flags, data=None):
    """mount(2); raises OSError naming the target on failure."""
    if _LIBC.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, 'mount(%r -> %r, %r): %s' % (source, target, fstype, os.strerror(err)))


def log(msg):
    sys.stderr.write('gpufleet node setup: %s\n' % msg)
    sys.stderr.flush()


def touch(path, mode=0o666):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, mode)
    os.close(fd)
    os.chmod(path, mode)


def bind(source, target, readonly=False):
    mount(source, target, None, MS_BIND)
    if readonly:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def build_dev(stage, dev_files, dev_dirs, dev_char=None):
    """Populate a tmpfs at `stage`, then move it over /dev (the host /dev stays untouched)."""
    mount('gpufleet-dev', stage, 'tmpfs', MS_NOSUID, 'mode=0755,size=1m')
    for name in HOST_DEVICES:
        path = os.path.join(stage, name)
        touch(path, 0o666)
        bind('/dev/' + name, path)
    for name in ('pts', 'shm') + tuple(dev_dirs):
        os.makedirs(os.path.join(stage, name), 0o755, exist_ok=True)
    os.symlink('pts/ptmx', os.path.join(stage, 'ptmx'))
    os.symlink('/proc/self/fd', os.path.join(stage, 'fd'))
    for num, name in enumerate(('stdin', 'stdout', 'stderr')):
        os.symlink('/proc/self/fd/%d' % num, os.path.join(stage, name))
    # Plain files standing for the GPU device nodes: simulated workloads open them, so a
    # /proc/*/fd scan in the node finds holders exactly like on a real GPU node.
    # With --slurm they are character devices with the numbers of /dev/null (dev_char = [1, 3]): Slurm's GRES
    # takes nothing else, and opening one stays harmless on any machine.
    for name in dev_files:
        if dev_char:
            os.mknod(os.path.join(stage, name), 0o666 | stat.S_IFCHR, os.makedev(*dev_char))
            os.chmod(os.path.join(stage, name), 0o666)
        else:
            touch(os.path.join(stage, name), 0o666)
    mount(stage, '/dev', None, MS_MOVE)
    mount('devpts', '/dev/pts', 'devpts', MS_NOSUID | MS_NOEXEC, 'newinstance,ptmxmode=0666,mode=0620,gid=5')
    mount('shm', '/dev/shm', 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=1777')


def main():
    # As pid 1 of a PID namespace this process gets only the signals it handles (SIGKILL aside):
    # let tests/fleet/down's SIGTERM end a node that is still setting up.  The kernel then kills
    # whatever else runs in the namespace (gpusim init).  node_init.sh installs its own trap.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: os._exit(143))
    with open(sys.argv[1]) as handle:
        cfg = json.load(handle)
    if os.getpid() != 1:
        log('refusing to run: not pid 1 of a fresh PID namespace (pid %d)' % os.getpid())
        return 2
    os.umask(0o022)
    # 1. nothing we mount below may propagate to the host (unshare --propagation private did it
    #    already; repeat it so this script is safe on its own).
    mount(None, '/', None, MS_REC | MS_PRIVATE)
    # 2. hostname
    socket.sethostname(cfg['hostname'])
    # 3. private directories and files
    for target, source in cfg['private_dirs']:
        bind(source, target)
    for target, source in cfg['private_files']:
        bind(source, target)
    for path, mode in cfg.get('run_dirs', []):
        os.makedirs(path, mode, exist_ok=True)
        os.chmod(path, mode)
    # 4. /dev
    build_dev(cfg['dev_stage'], cfg['dev_files'], cfg['dev_dirs'], cfg.get('dev_char'))
    # (--slurm) the node's own cgroup bound over the freezer hierarchy, where slurmd makes its job cgroups
    for source, target in cfg.get('binds', []):
        bind(source, target)
    # 5. controller tree read-only inside the node
    for path in cfg['readonly']:
        if os.path.isdir(path):
            bind(path, path, readonly=True)
    # 6. simulated GPUs
    env = dict(cfg['env'])
    if cfg.get('gpusim_init'):
        proc = subprocess.run(cfg['gpusim_init'], env=env, stdin=subprocess.DEVNULL, timeout=120, check=False)
        if proc.returncode != 0:
            log('%s failed with status %d' % (' '.join(cfg['gpusim_init']), proc.returncode))
            return 3
    # 8. become the reaping init that runs sshd
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir('/')
    # 7. (--slurm) the node's daemons besides sshd: children of pid 1, so of node_init.sh once exec'd (it reaps them)
    for argv in cfg.get('daemons', []):
        subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, cwd='/')  # pylint: disable=consider-using-with
    os.execve('/bin/sh', ['/bin/sh', INIT_SCRIPT, cfg['sshd_config']], env)
    return 4


if __name__ == '__main__':
    try:
        sys.exit(main())
    except Exception as exc:  # pylint: disable=broad-except
        log('failed: %s' % exc)
        sys.exit(5)
