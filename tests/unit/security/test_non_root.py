# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A non-root user through every entry point (docs/security.md, T5 and T6).

Each test runs a module (gpu_facts, gpu_audit, gpu_kill, gpu_reset: their real main(), as Ansible
runs them, with an arguments file) or ``gpufleet-guard tick`` in a fresh Python that runs as
``nobody`` (uid 65534, no supplementary groups) against a simulated node where root and nobody
each run a GPU workload.  A Python audit hook in that process records every ``/proc/PID/environ``
it opens and every ``os.kill``; the test then checks that root's workload (and its child) was never
signalled, that its environment was never opened, and what the result says.

SAFETY: the workloads are the ones ``gpusim spawn`` starts on each test's own node (``close()`` runs
``gpusim kill-all`` on that state only).  The entry points run against the fake NVML and fake
nvidia-smi (tests/sim/bin first on PATH): no real GPU is touched.  Needs root to start workloads
as another user and to drop to nobody; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess

import pytest

from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

pytestmark = [h.needs_gpusim, h.needs_root]


class Node(object):
    """A simulated node with root's and nobody's GPU workloads on GPU 0, and a scratch dir nobody owns."""

    def __init__(self):
        found = h.python_for_user('nobody', modules=('pynvml', 'psutil', 'yaml', 'ansible'))
        if found is None:
            pytest.skip('no Python interpreter that nobody may run with ansible, pynvml, psutil and PyYAML')
        self.python, self.pythonpath = found
        self.sim = h.GpuSim(gpus=2)
        self.nobody = pwd.getpwnam('nobody')
        self.work = os.path.join(self.sim.root, 'nobody')
        os.mkdir(self.work, 0o700)
        os.chown(self.work, self.nobody.pw_uid, self.nobody.pw_gid)
        self.root_job = self.spawn(user=None, secret='root-secret-42')
        self.root_tree = [self.root_job] + self.sim.child_pids(self.root_job)
        self.nobody_job = self.spawn(user='nobody', secret='nobody-own-value')

    def spawn(self, user, secret):
        args = ['spawn', '--gpu', 0, '--mib', 2048, '--children', 1, '--env', 'GPUFLEET_TEST_SECRET=%s' % secret]
        if user:
            args += ['--user', user]
        pid = int(self.sim.gpusim(*(args + ['--', 'python', 'train.py'])).strip())
        self.sim.pids.append(pid)
        return pid

    def run(self, target, *args, **module_args):
        """Run ``target`` (a module name with ``module_args``, or gpufleet-guard with ``args``) as nobody."""
        argv = list(args)
        if target != 'gpufleet-guard':
            path = os.path.join(self.work, 'args.json')
            with open(path, 'w') as handle:
                json.dump({'ANSIBLE_MODULE_ARGS': module_args}, handle)
            os.chown(path, self.nobody.pw_uid, self.nobody.pw_gid)
            argv = [path]
        env = h.shim_env(self.sim.state)
        env.update(HOME=self.work, TMPDIR=self.work, PATH=os.path.join(h.sim_dir(), 'bin') + os.pathsep + env.get('PATH', ''),
                   PYTHONPATH=self.pythonpath)
        proc = subprocess.run([self.python, '-c', h.MODULE_RUNNER, h.COLLECTIONS_DIR, self.sim.dev, target] + argv, env=env, cwd='/',
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=180, check=False,
                              user=self.nobody.pw_uid, group=self.nobody.pw_gid, extra_groups=[])
        err = proc.stderr.decode(errors='replace')
        seen = h.module_runner_events(err)
        assert seen is not None, 'no audit record (rc %d): %s' % (proc.returncode, err[-3000:])
        out = proc.stdout.decode(errors='replace').strip()
        result = json.loads(out) if out.startswith('{') else out
        return proc.returncode, result, seen, err

    def check_root_untouched(self, seen):
        """Root's workload and its child: alive, never signalled, their environment never opened."""
        assert self.sim.alive(self.root_job) and all(h.starttime(kid) for kid in self.root_tree[1:])
        signalled = [entry[1] for entry in seen if entry[0] in ('os.kill', 'os.killpg')]
        assert not set(signalled) & set(self.root_tree), seen
        opened = [entry[1] for entry in seen if entry[0] == 'environ']
        assert not [p for p in opened if any(p.startswith('/proc/%d/' % pid) for pid in self.root_tree)], opened

    def close(self):
        self.sim.close()


@pytest.fixture
def node():
    made = Node()
    try:
        yield made
    finally:
        made.close()


def by_pid(entries):
    return dict((e['pid'], e) for e in entries)


def test_gpu_facts_as_nobody(node):
    rc, result, seen, err = node.run('gpu_facts', vendor='nvidia')
    assert rc == 0, err[-3000:]
    procs = by_pid(result['ansible_facts']['gpu']['processes'])
    assert {node.root_job, node.nobody_job} <= set(procs)                       # the driver lists both
    assert procs[node.root_job]['user'] == 'root' and procs[node.nobody_job]['user'] == 'nobody'
    assert 'root-secret-42' not in json.dumps(result)
    node.check_root_untouched(seen)


def test_gpu_audit_as_nobody(node):
    rc, result, seen, err = node.run('gpu_audit', vendor='nvidia', min_level='info', require_allocation='never')
    assert rc == 0, err[-3000:]
    assert 'root-secret-42' not in json.dumps(result)
    # the control: the hook sees the environment reads the detector does make (nobody's own process)
    assert ['environ', '/proc/%d/environ' % node.nobody_job] in seen, seen
    node.check_root_untouched(seen)


def test_gpu_kill_as_nobody(node):
    rc, result, seen, err = node.run('gpu_kill', gpus=['0'], all_on_gpus=True, force=True, timeout=5, release_timeout=5,
                                     audit_log='', utilization_history='', vendor='nvidia')
    assert rc == 0, err[-3000:]
    assert node.nobody_job in by_pid(result['killed']) and not node.sim.alive(node.nobody_job)
    skipped = by_pid(result['skipped_processes'])
    assert 'a non-root caller may only signal its own processes' in skipped[node.root_job]['reason']
    node.check_root_untouched(seen)


def test_gpu_reset_as_nobody(node):
    rc, result, seen, err = node.run('gpu_reset', gpus=['0'], kill_processes=True, kill_timeout=5, verify_timeout=5, audit_log='',
                                     vendor='nvidia')
    assert rc != 0 and result['failed'], err[-3000:]
    (gpu,) = result['resets']
    assert gpu['status'] == 'refused' and gpu['reset'] is False and gpu['killed'] == []     # refused before any signal
    assert 'a GPU reset needs root' in gpu['error']
    assert 'a non-root caller may only signal its own processes' in gpu['error'] and str(node.root_job) in gpu['error']
    assert node.root_job not in [e['pid'] for e in gpu['would_kill']]                      # only nobody's would be drained
    assert node.sim.alive(node.nobody_job) and node.sim.show()['gpus'][0].get('reset_count', 0) == 0
    node.check_root_untouched(seen)


def test_guard_tick_as_nobody(node):
    base = os.path.join(node.work, 'guard')
    policy_dir = os.path.join(base, 'etc', 'gpufleet')
    os.makedirs(policy_dir)
    with open(os.path.join(policy_dir, 'policy.yaml'), 'w') as handle:
        handle.write('mode: enforce\nusers: {root: {max_mem_gib_per_gpu: 1}, nobody: {max_mem_gib_per_gpu: 1}}\n'
                     'escalation: {act_after: 0s}\nnotify: {tty: false}\n')
    for parent, dirs, files in os.walk(base):
        for name in [parent] + [os.path.join(parent, n) for n in dirs + files]:
            os.chown(name, node.nobody.pw_uid, node.nobody.pw_gid)
    rc, summary, seen, err = node.run('gpufleet-guard', 'tick', '--root', base, '--json', '--vendor', 'nvidia', '--dev-root', node.sim.dev)
    assert rc == 0, err[-3000:]
    outcomes = {}
    for decision in summary['decisions']:
        if decision['decision'] == 'act':
            outcomes.update((int(pid), entry) for pid, entry in decision['outcome']['pids'].items())
    assert outcomes[node.nobody_job]['outcome'] == 'killed' and not node.sim.alive(node.nobody_job)
    assert outcomes[node.root_job]['outcome'] == 'skipped'
    assert 'non-root caller' in outcomes[node.root_job]['reason']
    with open(os.path.join(base, 'var', 'log', 'gpufleet', 'guard.jsonl')) as handle:
        assert 'root-secret-42' not in handle.read()
    node.check_root_untouched(seen)
