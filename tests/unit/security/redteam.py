# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The red-team harness: a hostile user's attack played inside a PID namespace the test makes.

``run(scenario)`` starts ``unshare --pid --fork --mount-proc`` and, inside it, a fresh Python (PID 1
of the new namespace) that calls ``scenario(node)`` with a :class:`HostileNode`: a simulated GPU node
(``gpusim``) whose workloads the scenario starts as alice, bob or carol with whatever names,
command lines and environments the attack needs.  The scenario then runs the real entry points
(``gpufleet-guard`` and the modules, each in its own process, as Ansible and the timer run them)
and returns a JSON-able dict of what it saw; the test asserts on that dict outside.

SAFETY: every process the scenario starts lives in that PID namespace.  The entry points see only
its /proc (``--mount-proc``), so nothing outside it can be selected or signalled, and when the
scenario's Python (the namespace's init) exits, the kernel ends whatever is left in it.  The
simulated driver is the fake NVML of ``tests/sim``: no real GPU is touched.

Needs root (workloads as other users, namespaces) and util-linux ``unshare``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import kmod, xid
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

USERS = ('alice', 'bob', 'carol')
GIB = 1024
_MARK = 'REDTEAM-RESULT '
_RUNNER = r'''
import importlib, json, sys
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
module = importlib.import_module(sys.argv[1])
node = redteam.HostileNode(**json.loads(sys.argv[3]))
try:
    result = getattr(module, sys.argv[2])(node)
finally:
    node.close()
sys.stdout.write('\n' + redteam._MARK + json.dumps(result) + '\n')
'''


def ensure_users(names=USERS):
    """Create the test users that do not exist yet (root only); returns {name: uid}.

    Plain login-less accounts without a home, as the integration targets make them, so that a
    fresh CI machine runs every test that needs them instead of skipping it.
    """
    uids = {}
    for name in names:
        try:
            uids[name] = pwd.getpwnam(name).pw_uid
            continue
        except KeyError:
            pass
        if os.geteuid() != 0:
            raise AssertionError('user %s does not exist and only root may create it' % name)
        subprocess.run(['useradd', '--no-create-home', '--shell', '/usr/sbin/nologin', name], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        uids[name] = pwd.getpwnam(name).pw_uid
    return uids


def _why_not():
    if os.geteuid() != 0:
        return 'the red-team suite needs root (workloads as other users, PID namespaces)'
    if shutil.which('unshare') is None:
        return 'util-linux unshare is missing'
    if h.sim_build() is None or h.gpusim_path() is None:
        return 'the simulator is not built (make sim)'
    return None


needs_namespace = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or 'ready')


def run(scenario, timeout=240, **node_args):
    """Run ``scenario(node)`` in a new PID and mount namespace; returns the dict it returned."""
    ensure_users()
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in sys.path if p)
    argv = ['unshare', '--pid', '--fork', '--mount-proc', '--propagation', 'private', sys.executable, '-c', _RUNNER,
            scenario.__module__, scenario.__name__, json.dumps(node_args)]
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout, check=False, cwd='/')
    out = proc.stdout.decode(errors='replace')
    lines = [line for line in out.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError('scenario %s failed (rc %d):\n%s\n%s' % (
            scenario.__name__, proc.returncode, out[-4000:], proc.stderr.decode(errors='replace')[-6000:]))
    return json.loads(lines[-1][len(_MARK):])


class HostileNode(object):
    """A simulated GPU node inside the scenario's namespace: workloads, the guard's files, entry points."""

    def __init__(self, gpus=2, mem_mib=None):
        init_args = ('--mem-mib', str(mem_mib)) if mem_mib else ()
        self.sim = h.GpuSim(gpus=gpus, init_args=init_args)
        self.guard_root = os.path.join(self.sim.root, 'guard')
        self.uids = dict((name, pwd.getpwnam(name).pw_uid) for name in USERS)
        self.work = os.path.join(self.sim.root, 'work')
        os.mkdir(self.work, 0o700)

    # ------------------------------------------------------------------ workloads
    def spawn(self, user, gpu=0, mib=GIB, argv=('python3', 'train.py'), env=(), children=0, ignore_term=False):
        """A gpusim workload of ``user`` holding ``mib`` on ``gpu``; its comm is basename(argv[0])."""
        args = ['spawn', '--gpu', gpu, '--mib', mib, '--children', children]
        if user != 'root':
            args += ['--user', user]
        if ignore_term:
            args.append('--ignore-term')
        for item in env:
            args += ['--env', item]
        pid = int(self.sim.gpusim(*(args + ['--'] + list(argv))).strip())
        self.sim.pids.append(pid)
        return pid

    def alive(self, pid):
        return self.sim.alive(pid)

    # ------------------------------------------------------------------ the node's fake kernel log
    def kmsg(self, message, facility='kern', level='info', seconds_ago=None, flags='-'):
        """A record in the simulator's kernel log (``gpusim kmsg``): what the kernel would print (facility kern), or
        what a process wrote to /dev/kmsg (facility user or another)."""
        args = ['kmsg', '--message', message, '--facility', facility, '--level', level, '--flags', flags]
        if seconds_ago is not None:
            args += ['--seconds-ago', seconds_ago]
        self.sim.gpusim(*args)

    def xid(self, gpu, code, pid=None, name=None, message=None):
        """A genuine Xid of the driver (``gpusim xid``): an NVML event and the driver's kernel-log record."""
        args = ['xid', '--gpu', gpu, '--code', code]
        for flag, value in (('--pid', pid), ('--name', name), ('--message', message)):
            if value is not None:
                args += [flag, value]
        self.sim.gpusim(*args)

    def bus(self, gpu):
        """The PCI address of GPU ``gpu`` as the driver's Xid records give it (``0000:07:00``)."""
        domain, bus, rest = self.sim.show()['gpus'][gpu]['pci_bus_id'].split(':')
        return '%04x:%s:%s' % (int(domain, 16), bus.lower(), rest.split('.')[0].lower())

    def comm(self, pid):
        with open('/proc/%d/comm' % pid, 'rb') as handle:
            return handle.read().decode('utf-8', 'replace').rstrip('\n')

    # ------------------------------------------------------------------ the guard's files
    def write_policy(self, text, name='policy.yaml'):
        """The policy as the role installs it: root-owned, 0644, in root-owned 0755 directories."""
        directory = os.path.join(self.guard_root, 'etc', 'gpufleet')
        os.makedirs(directory, mode=0o755, exist_ok=True)
        path = os.path.join(directory, name)
        with open(path, 'w') as handle:
            handle.write(text)
        os.chmod(path, 0o644)
        return path

    def guard_log(self):
        path = os.path.join(self.guard_root, 'var', 'log', 'gpufleet', 'guard.jsonl')
        if not os.path.exists(path):
            return []
        with open(path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    # ------------------------------------------------------------------ entry points, each in its own process
    def cli(self, *args):
        """``gpufleet-guard ARGS`` (root, this node's files and devices): (rc, parsed JSON or text, signals, stderr)."""
        argv = list(args)
        if argv and argv[0] in ('tick', 'test', 'check-config', 'kill', 'list', 'verify-log', 'audit'):
            argv[1:1] = ['--root', self.guard_root]
        return self._run('gpufleet-guard', argv)

    def tick(self, *extra):
        """One real ``gpufleet-guard tick --json`` on this node."""
        return self.cli('tick', '--json', '--vendor', 'nvidia', '--dev-root', self.sim.dev, *extra)

    def module(self, name, **module_args):
        """A module's real main(), run as Ansible runs it (an arguments file): (rc, result, signals, stderr)."""
        path = os.path.join(self.work, 'args-%s.json' % name)
        with open(path, 'w') as handle:
            json.dump({'ANSIBLE_MODULE_ARGS': module_args}, handle)
        return self._run(name, [path])

    def _run(self, target, argv):
        env = h.shim_env(self.sim.state)
        env.update(PATH=os.path.join(h.sim_dir(), 'bin') + os.pathsep + env.get('PATH', ''), HOME=self.work, TMPDIR=self.work)
        state = self.sim.show()   # the core's test seams for /dev/kmsg and /sys/module: this node's fake ones
        for name, key in ((xid.KMSG_ENV, 'kmsg_path'), (kmod.SYS_ROOT_ENV, 'sys_root')):
            if state.get(key):
                env[name] = state[key]
        proc = subprocess.run([sys.executable, '-c', h.MODULE_RUNNER, h.COLLECTIONS_DIR, self.sim.dev, target] + argv,
                              env=env, cwd='/', stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=180, check=False)
        err = proc.stderr.decode(errors='replace')
        seen = h.module_runner_events(err) or []
        out = proc.stdout.decode(errors='replace').strip()
        try:
            result = json.loads(out)
        except ValueError:
            result = out
        signalled = sorted(set(entry[1] for entry in seen if entry[0] in ('os.kill', 'os.killpg')))
        return proc.returncode, result, signalled, err[-4000:]

    def close(self):
        self.sim.close()


def acted_pids(summary):
    """{pid: outcome entry} over every ``act`` decision of a tick summary."""
    found = {}
    for decision in (summary or {}).get('decisions', []) if isinstance(summary, dict) else []:
        if decision.get('decision') == 'act' and decision.get('outcome'):
            found.update((int(pid), entry) for pid, entry in decision['outcome'].get('pids', {}).items())
    return found
