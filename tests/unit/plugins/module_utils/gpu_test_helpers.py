# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Helpers shared by the core and gpu_facts unit tests: the simulator (fake NVML), state files,
fake device directories and child processes that the tests start (and always reap).

SAFETY: only processes started through ``Children`` are ever signalled, by their Popen object.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils import core as _core

MODULE_UTILS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(_core.__file__)))
SHIM_NAME = 'libnvidia-ml.so.1'
GIB = 1024


def _candidate_builds():
    env = os.environ.get('GPUFLEET_SIM_BUILD')
    if env:
        yield env
    # ansible-test does not pass GPUFLEET_SIM_BUILD through, and runs from a copy of the repo at
    # <repo>/build/collections/ansible_collections/gpufleet/reclaim: look above this file.
    here = os.path.dirname(os.path.abspath(__file__))
    while True:
        yield os.path.join(here, 'tests', 'sim', 'build')
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


def sim_build():
    """The simulator build directory holding libnvidia-ml.so.1, or None."""
    for path in _candidate_builds():
        if os.path.isfile(os.path.join(path, SHIM_NAME)):
            return os.path.abspath(path)
    return None


def sim_dir():
    build = sim_build()
    return os.path.dirname(build) if build else None


def shim_path(variant=''):
    """Absolute path of the shim (variant 'r470': built with -DSIM_R470), or None."""
    build = sim_build()
    if build is None:
        return None
    path = os.path.join(build, variant, SHIM_NAME) if variant else os.path.join(build, SHIM_NAME)
    return path if os.path.isfile(path) else None


def starttime(pid):
    """Field 22 of /proc/PID/stat."""
    with open('/proc/%d/stat' % pid) as handle:
        data = handle.read()
    return int(data[data.rindex(')') + 2:].split()[19])


def unused_pid():
    """A pid number above pid_max: never alive on this host."""
    try:
        with open('/proc/sys/kernel/pid_max') as handle:
            return int(handle.read()) + 4242
    except (OSError, ValueError):
        return 4194304 + 4242


# ---------------------------------------------------------------------------- state files
def make_gpu(index=0, **overrides):
    gpu = {
        'index': index, 'uuid': 'GPU-6f7c1a2b-0000-4000-8000-%012d' % index, 'name': 'NVIDIA A100-SXM4-80GB',
        'pci_bus_id': '00000000:%02X:00.0' % (7 + index), 'minor': index,
        'memory_total_mib': 81559, 'memory_reserved_mib': 0, 'util_pct': 0, 'mem_util_pct': 0, 'temp_c': 34,
        'power_w': 61.0, 'power_limit_w': 400.0, 'fan_pct': None, 'persistence': True, 'mig': False,
        'ecc_uncorrected': 0, 'ecc_corrected': 0,
        'remapped_rows': {'correctable': 0, 'uncorrectable': 0, 'pending': False, 'failure': False},
        'leaked_mib': 0, 'lost': False, 'no_permission': False, 'drain': False, 'reset_count': 0,
    }
    gpu.update(overrides)
    return gpu


def make_process(pid, gpu=0, used_mib=1024, ptype='compute', start=None, **overrides):
    entry = {
        'pid': pid, 'starttime': starttime(pid) if start is None else start, 'gpu': gpu, 'used_mib': used_mib,
        'type': ptype, 'util_pct': 0, 'children': [], 'user': 'root', 'argv': ['sleep'],
        'supervisor_pid': None, 'exited_at': None,
    }
    entry.update(overrides)
    return entry


def make_state(gpus=2, driver='r550', dev_dir='/dev', processes=None, **gpu_overrides):
    return {
        'schema': 1, 'vendor': 'nvidia', 'driver': driver,
        'driver_version': '550.54.15' if driver == 'r550' else '470.223.02',
        'nvml_version': '12.550.54.15' if driver == 'r550' else '11.470.223.02',
        'cuda_driver_version': 12040 if driver == 'r550' else 11040,
        'release_delay_ms': 0, 'dev_dir': dev_dir,
        'gpus': [make_gpu(i, **gpu_overrides) for i in range(gpus)],
        'processes': list(processes or []),
    }


def write_state(path, state):
    """Atomic replace, as gpusim does (the shim re-reads on inode/mtime/size change)."""
    tmp = '%s.tmp.%d' % (path, os.getpid())
    with open(tmp, 'w') as handle:
        json.dump(state, handle)
    os.rename(tmp, path)
    # make sure the (st_mtime, st_size) signature differs even within one clock tick
    time.sleep(0.01)


def make_dev_dir(root, minors=(0, 1), amd=False):
    """Plain files standing in for GPU device nodes under ``root``."""
    names = ['nvidiactl', 'nvidia-uvm'] + ['nvidia%d' % m for m in minors]
    if amd:
        names = ['kfd'] + ['dri/renderD%d' % (128 + m) for m in minors] + ['dri/card%d' % m for m in minors]
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(os.path.dirname(path)):
            os.makedirs(os.path.dirname(path))
        with open(path, 'w'):
            pass
    return root


# ---------------------------------------------------------------------------- children
class Children(object):
    """Processes this test starts; ``close()`` kills and reaps every one of them (by Popen object)."""

    def __init__(self):
        self.procs = []

    def start(self, argv, open_files=(), **kwargs):
        """Start ``argv`` holding ``open_files`` open (inherited fds)."""
        fds = [os.open(path, os.O_RDONLY) for path in open_files]
        try:
            proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, **kwargs)
        finally:
            for fd in fds:
                os.close(fd)
        self.procs.append(proc)
        wait_for(lambda: _exec_done(proc.pid, argv[0]), what='%s to start' % argv[0])
        return proc

    def sleeper(self, open_files=()):
        return self.start(['sleep', '600'], open_files=open_files)

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []


def _exec_done(pid, argv0):
    """True once the child has exec'd (its comm is no longer the forking Python)."""
    try:
        with open('/proc/%d/comm' % pid) as handle:
            comm = handle.read().strip()
    except OSError:
        return False
    return comm == os.path.basename(argv0)[:15]


def wait_for(predicate, timeout=10.0, what='a condition'):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError('timed out waiting for %s' % what)


# ---------------------------------------------------------------------------- the shim
_RUNNER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from core.snapshot import take_snapshot
from core.processes import ProcessInventory
kwargs = json.loads(sys.argv[2])
inv = kwargs.pop('inventory', None)
if inv is not None:
    kwargs['inventory'] = ProcessInventory(**inv)
snap = take_snapshot(**kwargs)
extra = {
    'devices': [dict(memory_api=d.memory_api, memory_reserved_mib=d.memory_reserved_mib, minor=d.minor,
                     errors=d.errors, persistence_mode=d.persistence_mode, mig_mode=d.mig_mode,
                     processes_complete=d.processes_complete,
                     types={str(p.pid): p.types for p in d.driver_processes}) for d in snap.devices],
    'processes': {str(p.pid): dict(device_paths=p.device_paths, types=p.types, starttime=p.starttime)
                  for p in snap.processes},
    'holders': {str(h.pid): dict(gpu_indexes=h.gpu_indexes) for h in snap.holders},
    'errors': snap.errors,
}
json.dump({'facts': snap.to_facts(), 'extra': extra}, sys.stdout)
'''


def shim_env(state_path, variant=''):
    lib = shim_path(variant)
    env = dict(os.environ)
    env['GPU_SIM_STATE'] = state_path
    env['LD_LIBRARY_PATH'] = os.path.dirname(lib)
    env.pop('PYTHONPATH', None)
    return env


def run_snapshot(state_path, variant='', prefix=(), extra_env=None, **kwargs):
    """take_snapshot(**kwargs) in a fresh Python whose libnvidia-ml.so.1 is the shim.

    The core is imported standalone (``core`` package on sys.path), as the node agent will.
    ``prefix`` wraps the command (for example ``unshare``).  Returns {'facts': ..., 'extra': ...}.
    """
    argv = list(prefix) + [sys.executable, '-c', _RUNNER, MODULE_UTILS_DIR, json.dumps(kwargs)]
    env = shim_env(state_path, variant)
    env.update(extra_env or {})
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=120, check=False)
    if proc.returncode != 0:
        raise AssertionError('snapshot runner failed (%d): %s' % (proc.returncode, proc.stderr.decode(errors='replace')))
    return json.loads(proc.stdout.decode())


@contextlib.contextmanager
def shim_in_process(state_path, variant=''):
    """Point the real pynvml of this process at the shim (by absolute path) for the duration."""
    import pynvml  # pylint: disable=import-outside-toplevel
    lib = shim_path(variant)
    saved_lib = pynvml.nvmlLib
    saved_env = os.environ.get('GPU_SIM_STATE')
    pynvml._nvmlGetFunctionPointer_cache.clear()  # pylint: disable=protected-access
    pynvml.nvmlLib = ctypes.CDLL(lib)
    os.environ['GPU_SIM_STATE'] = state_path
    try:
        yield pynvml
    finally:
        pynvml._nvmlGetFunctionPointer_cache.clear()  # pylint: disable=protected-access
        pynvml.nvmlLib = saved_lib
        pynvml._nvmlLib_refcount = 0  # pylint: disable=protected-access
        if saved_env is None:
            os.environ.pop('GPU_SIM_STATE', None)
        else:
            os.environ['GPU_SIM_STATE'] = saved_env


def tempdir(prefix='gpufleet-test-'):
    return tempfile.mkdtemp(prefix=prefix)


# ---------------------------------------------------------------------------- gpusim nodes
def gpusim_path():
    """tests/sim/gpusim, or None when the simulator is not there."""
    base = sim_dir()
    path = os.path.join(base, 'gpusim') if base else None
    return path if path and os.path.isfile(path) else None


needs_gpusim = pytest.mark.skipif(sim_build() is None or gpusim_path() is None,
                                  reason='simulator not built: run `make sim` (tests/sim/build/libnvidia-ml.so.1 missing)')
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='needs root (gpusim spawn --user, running as another user)')


class GpuSim(object):
    """A simulated node for one test: its own state file and fake device directory in a temp dir.

    Workloads are started with ``gpusim spawn`` (which prints their pids); ``close()`` runs
    ``gpusim kill-all`` on this state only, so a test never signals anything it did not start.
    The temp dir is 0755 so that a test may read the state as another user.
    """

    def __init__(self, gpus=2, release_delay_ms=0, init_args=()):
        self.root = tempdir()
        os.chmod(self.root, 0o755)
        self.state = os.path.join(self.root, 'state.json')
        self.dev = os.path.join(self.root, 'dev')
        self.pids = []
        self.gpusim('init', '--gpus', str(gpus), '--dev-dir', self.dev, '--create-dev-files',
                    '--release-delay-ms', str(release_delay_ms), *init_args)

    @property
    def dev_roots(self):
        return (self.dev,)

    def env(self):
        env = dict(os.environ)
        env['GPU_SIM_STATE'] = self.state
        return env

    def gpusim(self, *args):
        """Run ``gpusim ARGS`` on this state; returns stdout (raises AssertionError on failure)."""
        proc = subprocess.run([sys.executable, gpusim_path()] + [str(a) for a in args], env=self.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, check=False)
        if proc.returncode != 0:
            command = ' '.join(map(str, args))
            raise AssertionError('gpusim %s failed (%d): %s' % (command, proc.returncode, proc.stderr.decode(errors='replace')))
        return proc.stdout.decode()

    def spawn(self, gpu=0, mib=1024, argv=('python', 'train.py'), util=0, ignore_term=False, user=None, children=0):
        """``gpusim spawn``; returns the pid it printed."""
        args = ['spawn', '--gpu', gpu, '--mib', mib, '--util', util, '--children', children]
        if ignore_term:
            args.append('--ignore-term')
        if user:
            args += ['--user', user]
        pid = int(self.gpusim(*(args + ['--'] + list(argv))).strip())
        self.pids.append(pid)
        return pid

    def show(self):
        return json.loads(self.gpusim('show'))

    def entry(self, pid):
        for entry in self.show()['processes']:
            if entry['pid'] == pid:
                return entry
        raise AssertionError('pid %d is not in the simulator state' % pid)

    def alive(self, pid):
        """The simulator's liveness of a spawned pid (alive with its recorded starttime, no zombie)."""
        return self.entry(pid)['alive']

    def used_mib(self, gpu):
        return self.show()['gpus'][gpu]['used_mib']

    def children(self, pid):
        """[(child pid, its starttime or None)] as gpusim recorded them for the workload ``pid``."""
        entry = self.entry(pid)
        return list(zip(entry['children'], entry.get('children_starttime') or [None] * len(entry['children'])))

    def child_pids(self, pid):
        """The pids of the children gpusim recorded for the workload ``pid`` (spawn --children)."""
        return list(self.entry(pid)['children'])

    def kill_all(self):
        proc = subprocess.run([sys.executable, gpusim_path(), 'kill-all', '--timeout', '10'], env=self.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, check=False)
        return proc.stdout.decode()

    def close(self):
        try:
            self.kill_all()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def gpusim_node(**kwargs):
    """A GpuSim whose fake NVML is loaded in this process for the duration (see shim_in_process)."""
    node = GpuSim(**kwargs)
    try:
        with shim_in_process(node.state):
            yield node
    finally:
        node.close()


# ---------------------------------------------------------------------------- reclaim as another user
_RECLAIM_RUNNER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from core.reclaim import ReclaimOptions, reclaim
from core.select import Selector
args = json.loads(sys.argv[2])
result = reclaim(Selector(**args['selector']), ReclaimOptions(**args['options']), check_mode=args['check_mode'],
                 dev_roots=args['dev_roots'])
json.dump(result, sys.stdout)
'''


def _as_user(user):
    """subprocess keywords that drop to ``user``: its uid, its primary group and no other groups."""
    import pwd  # pylint: disable=import-outside-toplevel
    entry = pwd.getpwnam(user)
    return {'user': entry.pw_uid, 'group': entry.pw_gid, 'extra_groups': []}


def python_for_user(user, modules=('pynvml',)):
    """(interpreter, extra PYTHONPATH) that ``user`` can run with ``modules`` importable, or None.

    This interpreter first; else the system python3 with the directories these modules come from
    on its path (the venv's interpreter may live under a directory other users cannot enter).
    """
    import importlib  # pylint: disable=import-outside-toplevel
    dirs = []
    for name in modules:
        where = os.path.abspath(importlib.import_module(name).__file__)
        where = os.path.dirname(os.path.dirname(where) if os.path.basename(where) == '__init__.py' else where)
        if where not in dirs:
            dirs.append(where)
    path = os.pathsep.join(dirs)
    for exe, extra in ((sys.executable, ''), ('/usr/bin/python3', path), ('/bin/python3', path)):
        if not os.path.isfile(exe):
            continue
        env = {'PATH': '/usr/bin:/bin', 'PYTHONPATH': extra}
        try:
            proc = subprocess.run([exe, '-c', 'import %s' % ', '.join(modules)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=30, check=False, **_as_user(user))
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode == 0:
            return exe, extra
    return None


def run_reclaim_as(user, state_path, selector, options, dev_roots, check_mode=False):
    """core.reclaim.reclaim() run by ``user`` (needs root) in a fresh Python whose NVML is the shim.

    ``selector`` and ``options`` are keyword dictionaries for Selector and ReclaimOptions.
    Returns the result dictionary.
    """
    found = python_for_user(user)
    if found is None:
        raise AssertionError('no Python interpreter that %s can run with pynvml' % user)
    exe, path = found
    env = shim_env(state_path)
    env['PYTHONPATH'] = path
    args = {'selector': selector, 'options': options, 'dev_roots': list(dev_roots), 'check_mode': check_mode}
    proc = subprocess.run([exe, '-c', _RECLAIM_RUNNER, MODULE_UTILS_DIR, json.dumps(args)], env=env, cwd='/',
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, check=False, **_as_user(user))
    if proc.returncode != 0:
        raise AssertionError('reclaim runner failed (%d): %s' % (proc.returncode, proc.stderr.decode(errors='replace')))
    return json.loads(proc.stdout.decode())


# ---------------------------------------------------------------------------- modules in a separate process
COLLECTIONS_DIR = os.path.abspath(os.path.join(MODULE_UTILS_DIR, '..', '..', '..', '..', '..'))
# ``python -c MODULE_RUNNER COLLECTIONS_DIR DEV_ROOT TARGET ARGS...``: TARGET is a module name (ARGS: its
# arguments file, as Ansible runs it) or gpufleet-guard (ARGS: the command line); the device root is
# DEV_ROOT.  A Python audit hook records every /proc/PID/environ opened and every os.kill (and every
# signal sent through a pidfd, recorded as an os.kill of the pid the pidfd names); the list is
# written to stderr at exit (module_runner_events reads it back).
MODULE_RUNNER = r'''
import atexit, json, os, runpy, signal, sys
seen = []


def hook(event, args):
    if event == 'open' and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        if path.endswith('/environ'):
            seen.append(['environ', path])
    elif event in ('os.kill', 'os.killpg'):
        seen.append([event, int(args[0]), int(args[1])])


sys.addaudithook(hook)
# The killer signals through a pidfd where it can (signal.pidfd_send_signal has no audit event):
# remember which pid each pidfd names and record its signals as os.kill events.
if hasattr(os, 'pidfd_open') and hasattr(signal, 'pidfd_send_signal'):
    _pidfds, _open_pidfd, _send = {}, os.pidfd_open, signal.pidfd_send_signal

    def _pidfd_open(pid, *args):
        fd = _open_pidfd(pid, *args)
        _pidfds[fd] = pid
        return fd

    def _pidfd_send_signal(fd, sig, *args):
        seen.append(['os.kill', _pidfds.get(fd, -1), int(sig)])
        return _send(fd, sig, *args)

    os.pidfd_open, signal.pidfd_send_signal = _pidfd_open, _pidfd_send_signal
atexit.register(lambda: sys.stderr.write('\nAUDIT %s\n' % json.dumps(seen)))
sys.path.insert(0, sys.argv[1])
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes
processes.DEFAULT_DEV_ROOTS = (sys.argv[2],)
target, sys.argv = sys.argv[3], [sys.argv[3]] + sys.argv[4:]
if target == 'gpufleet-guard':
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import cli
    sys.exit(cli.main(sys.argv[1:]))
runpy.run_module('ansible_collections.gpufleet.reclaim.plugins.modules.' + target, run_name='__main__')
'''


def module_runner_events(stderr_text):
    """The events MODULE_RUNNER recorded, from its stderr (None when it wrote none)."""
    lines = [line for line in stderr_text.splitlines() if line.startswith('AUDIT ')]
    return json.loads(lines[-1][6:]) if lines else None


# ---------------------------------------------------------------------------- module main() runs
class ExitJson(Exception):
    """AnsibleModule.exit_json() was called; args[0] is the result."""


class FailJson(Exception):
    """AnsibleModule.fail_json() was called; args[0] is the result (with failed and msg)."""


def patch_module_exits(monkeypatch):
    """Make exit_json/fail_json raise ExitJson/FailJson instead of printing and exiting."""
    from ansible.module_utils import basic  # pylint: disable=import-outside-toplevel

    def exit_json(self, **kwargs):
        raise ExitJson(kwargs)

    def fail_json(self, msg, **kwargs):
        kwargs.update(failed=True, msg=msg)
        raise FailJson(kwargs)

    monkeypatch.setattr(basic.AnsibleModule, 'exit_json', exit_json)
    monkeypatch.setattr(basic.AnsibleModule, 'fail_json', fail_json)


def run_main(main, args, check_mode=False, diff=False):
    """A module's main() with ``args``; returns its result dict (``failed`` set when it failed)."""
    from ansible.module_utils.testing import patch_module_args  # pylint: disable=import-outside-toplevel
    args = dict(args)
    if check_mode:
        args['_ansible_check_mode'] = True
    if diff:
        args['_ansible_diff'] = True
    with patch_module_args(args):
        with pytest.raises((ExitJson, FailJson)) as exc:
            main()
    return exc.value.args[0]


# ---------------------------------------------------------------------------- a process table of the test's own
@contextlib.contextmanager
def a_user_named_slurmd(root):
    """A process named ``slurmd`` that a user started (nobody when the tests run as root: a copy of sleep in a
    directory of /tmp, which nothing vouches for either), and ``root``, a process root of the test's own that lists
    only it (a link to its /proc entry).  For code that scans the process table, such as the ladder's scheduler
    (processes.scheduler_daemon): a real slurmd elsewhere on the machine (the simulated Slurm fleet's) is not in it.
    Yields ``root``; the process, the test's own child, is killed by its Popen object at the end."""
    where = tempfile.mkdtemp(prefix='gpufleet-slurmd-')
    os.chmod(where, 0o755)   # nobody may run what is in it
    exe = os.path.join(where, 'slurmd')
    shutil.copy('/bin/sleep', exe)
    child = subprocess.Popen([exe, '600'], **(_as_user('nobody') if os.geteuid() == 0 else {}))
    try:
        os.makedirs(root)
        os.symlink('/proc/%d' % child.pid, os.path.join(root, str(child.pid)))

        def named():
            try:
                with open(os.path.join(root, str(child.pid), 'comm')) as handle:
                    return handle.read().strip() == 'slurmd'
            except OSError:
                return False

        wait_for(named, what='the slurmd-named process to start')
        yield root
    finally:
        child.kill()
        child.wait(10)
        shutil.rmtree(where)
