# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vendor library crashes (SIGSEGV) in the middle of a query (issue #11).

The simulated NVML dies on the Nth call of a chosen function ($GPUSIM_NVML_SEGFAULT, see
tests/sim/README.md).  A crash ends the process that loaded the library - the core runs the
library in-process - so every run here is a fresh Python (or ``ansible``) that these tests start
and wait for.  Each test checks: which of the gpusim workloads were signalled (only the selected
one, and only when the crash came after the signals), that the audit log / decision log keep a
valid hash chain with a record of every signal sent, that the guard state is the previous one,
and that the same run without the fault finishes the work.

SAFETY: the only processes signalled are the workloads ``gpusim spawn`` started on each test's own
simulated node (by pid, with an identity check), and ``gpusim kill-all`` on that node's state at
the end.  No wall-clock time is asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

pytestmark = h.needs_gpusim

GIB = 1024
# The first process-list call of the snapshot: the crash comes before anything is selected.
IN_DISCOVERY = 'nvmlDeviceGetComputeRunningProcesses_v3'
# The snapshot counts the GPUs once; the next count is the release check after the signals.
IN_RELEASE_CHECK = 'nvmlDeviceGetCount_v2:2'
# A guard tick reads the drivers in a watchdog child (issue #17): the first count of the tick's own
# process (@main: not in a watchdog child) is the release check's.
TICK_RELEASE_CHECK = 'nvmlDeviceGetCount_v2:1@main'

RECLAIM = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from core.reclaim import ReclaimOptions, reclaim
from core.select import Selector
args = json.loads(sys.argv[2])
result = reclaim(Selector(**args['selector']), ReclaimOptions(**args['options']), dev_roots=args['dev_roots'])
json.dump(result, sys.stdout)
'''

TICK = r'''
import sys
sys.path.insert(0, sys.argv[1])
from core import cli
sys.exit(cli.main(sys.argv[2:]))
'''


def crash_env(node, fault=None):
    env = h.shim_env(node.state)
    env.pop('PYTHONFAULTHANDLER', None)
    if fault:
        env['GPUSIM_NVML_SEGFAULT'] = fault
    return env


def run_reclaim(node, audit, selector, fault=None):
    """core reclaim in a fresh Python on the node's simulated NVML; returns the CompletedProcess."""
    args = {'selector': selector, 'dev_roots': list(node.dev_roots),
            'options': {'audit_path': audit, 'timeout': 5, 'release_timeout': 5, 'force': True}}
    return subprocess.run([sys.executable, '-c', RECLAIM, h.MODULE_UTILS_DIR, json.dumps(args)], env=crash_env(node, fault),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, check=False)


def records(path):
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture
def node():
    sim = h.GpuSim(gpus=2)
    try:
        yield sim
    finally:
        sim.close()


# ---------------------------------------------------------------------------- gpu_kill's core
def test_a_crash_during_discovery_signals_nobody_and_the_rerun_finishes(node, tmp_path):
    audit = str(tmp_path / 'actions.jsonl')
    target = node.spawn(0, 4 * GIB, argv=['python', 'miner.py'], children=1)
    bystander = node.spawn(1, 2 * GIB, argv=['python', 'train.py'])
    crashed = run_reclaim(node, audit, {'cmdline': 'miner'}, fault=IN_DISCOVERY)
    assert crashed.returncode == -signal.SIGSEGV, crashed.stderr.decode(errors='replace')[-2000:]
    assert node.alive(target) and node.alive(bystander)                       # nobody was signalled
    assert all(h.starttime(kid) for kid in node.child_pids(target))
    assert not os.path.exists(audit)                                          # nothing was done, nothing logged
    rerun = run_reclaim(node, audit, {'cmdline': 'miner'})
    assert rerun.returncode == 0, rerun.stderr.decode(errors='replace')[-2000:]
    result = json.loads(rerun.stdout.decode())
    assert sorted(e['pid'] for e in result['killed']) == sorted([target] + node.child_pids(target))
    assert not node.alive(target) and node.alive(bystander)
    assert [r['event'] for r in records(audit)] == ['gpu_kill_signalled', 'gpu_kill']
    assert audit_log.verify(audit) == {'valid': True, 'lines': 2, 'errors': []}


def test_a_crash_in_the_release_check_keeps_the_record_of_the_signals(node, tmp_path):
    """The library dies after the signals, while the release is checked: the selected process is
    gone (it was meant to be), the bystander is untouched, and the audit log names what was signalled."""
    audit = str(tmp_path / 'actions.jsonl')
    target = node.spawn(0, 4 * GIB, argv=['python', 'miner.py'])
    bystander = node.spawn(0, 2 * GIB, argv=['python', 'train.py'])
    crashed = run_reclaim(node, audit, {'cmdline': 'miner'}, fault=IN_RELEASE_CHECK)
    assert crashed.returncode == -signal.SIGSEGV, crashed.stderr.decode(errors='replace')[-2000:]
    assert not node.alive(target) and node.alive(bystander)
    (record,) = records(audit)                                               # written before the crash
    assert record['event'] == 'gpu_kill_signalled' and record['selectors']['cmdline'] == 'miner'
    assert [(e['pid'], e['signals'], e['outcome']) for e in record['signalled']] == [(target, ['SIGTERM'], 'pending')]
    assert audit_log.verify(audit) == {'valid': True, 'lines': 1, 'errors': []}
    rerun = run_reclaim(node, audit, {'cmdline': 'miner'})                  # nothing left to do
    assert rerun.returncode == 0, rerun.stderr.decode(errors='replace')[-2000:]
    result = json.loads(rerun.stdout.decode())
    assert result['changed'] is False and result['killed'] == [] and node.alive(bystander)
    assert audit_log.verify(audit) == {'valid': True, 'lines': 1, 'errors': []}


# ---------------------------------------------------------------------------- the guard tick
POLICY = ('mode: enforce\nusers: {nobody: {max_mem_gib_per_gpu: 8}}\n'
          'escalation: {warn_again_after: 5m, act_after: 10m}\nnotify: {tty: false}\n')


@pytest.mark.parametrize('fault', [IN_DISCOVERY, TICK_RELEASE_CHECK])
def test_a_crash_during_a_guard_tick_keeps_the_state_and_the_chain(node, tmp_path, fault):
    if os.geteuid() != 0:
        pytest.skip('workloads of another user need root (gpusim spawn --user)')
    root = tmp_path / 'guard'
    os.makedirs(str(root / 'etc' / 'gpufleet'))
    (root / 'etc' / 'gpufleet' / 'policy.yaml').write_text(POLICY)
    offender = node.spawn(0, 12 * GIB, argv=['python', 'big.py'], user='nobody')
    bystander = node.spawn(1, 20 * GIB, argv=['python', 'other.py'])
    state = str(root / 'var' / 'lib' / 'gpufleet' / 'state.json')
    log = str(root / 'var' / 'log' / 'gpufleet' / 'guard.jsonl')
    start = 1.9e9

    def tick(now, crash=None):
        argv = [sys.executable, '-c', TICK, h.MODULE_UTILS_DIR, 'tick', '--root', str(root), '--json', '--now', str(now),
                '--vendor', 'nvidia', '--dev-root', node.dev]
        return subprocess.run(argv, env=crash_env(node, crash), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
                              check=False)

    for now in (start, start + 300):                                          # the two warnings
        warned = tick(now)
        assert warned.returncode == 0, warned.stdout.decode(errors='replace')[-2000:]
        assert [d['decision'] for d in json.loads(warned.stdout.decode())['decisions']] == ['warn']
    with open(state, 'rb') as handle:
        old_state = handle.read()
    old_log = records(log)
    crashed = tick(start + 600, crash=fault)                                  # the action is due
    if fault == IN_DISCOVERY:
        # issue #17: the discovery read runs in a watchdog child; its crash is the tick's error, not its death
        assert crashed.returncode == 1, crashed.stderr.decode(errors='replace')[-2000:]
        assert json.loads(crashed.stdout.decode())['driver_crashed']['call'] == 'nvmlDeviceGetComputeRunningProcesses'
    else:
        assert crashed.returncode == -signal.SIGSEGV, crashed.stderr.decode(errors='replace')[-2000:]
    with open(state, 'rb') as handle:
        assert handle.read() == old_state                                     # the previous state, whole
    assert audit_log.verify(log)['valid']
    assert node.alive(bystander)
    if fault == IN_DISCOVERY:
        assert node.alive(offender)                                           # nothing decided, nothing signalled
        assert [r['event'] for r in records(log)[len(old_log):]] == ['guard_driver_crashed']
    else:
        assert not node.alive(offender)                                       # acted on, then the crash
        signalled = records(log)[len(old_log):]
        assert [r['event'] for r in signalled] == ['guard_signalled']         # the signal is on record
        assert [(e['pid'], e['signals']) for e in signalled[0]['signalled']] == [(offender, ['SIGTERM'])]
        assert 'cmdline' not in json.dumps(signalled)                         # the guard's log stays redacted
    rerun = tick(start + 630)
    assert rerun.returncode == 0, rerun.stderr.decode(errors='replace')[-2000:]
    summary = json.loads(rerun.stdout.decode())
    if fault == IN_DISCOVERY:
        (act,) = summary['decisions']
        assert act['decision'] == 'act' and act['outcome']['pids'][str(offender)]['outcome'] == 'killed'
    else:
        # the crashed tick's action never reached the state: the violation that disappeared waits out
        # escalation.clear_after (default 60 s) like any other, then clears
        assert summary['decisions'] == []
        cleared = tick(start + 690)
        assert cleared.returncode == 0, cleared.stderr.decode(errors='replace')[-2000:]
        assert [d['decision'] for d in json.loads(cleared.stdout.decode())['decisions']] == ['clear']
    assert not node.alive(offender) and node.alive(bystander)
    assert audit_log.verify(log)['valid']


# ---------------------------------------------------------------------------- the module, through Ansible
def _ansible():
    exe = os.path.join(os.path.dirname(sys.executable), 'ansible')
    return exe if os.access(exe, os.X_OK) else shutil.which('ansible')


def test_gpu_kill_through_ansible_is_a_module_failure_with_the_signal(node, tmp_path):
    """What an operator sees: the host FAILED, the message names the crash (it happened in the module's
    watchdog child, before anything was selected); nothing was signalled and nothing logged."""
    ansible = _ansible()
    if ansible is None:
        pytest.skip('the ansible command is not installed')
    collections = os.path.abspath(os.path.join(h.MODULE_UTILS_DIR, '..', '..', '..', '..', '..'))
    audit = str(tmp_path / 'actions.jsonl')
    target = node.spawn(0, 4 * GIB, argv=['python', 'miner.py'])
    env = crash_env(node, IN_DISCOVERY)
    env.update(ANSIBLE_COLLECTIONS_PATH=collections, ANSIBLE_LOCAL_TEMP=str(tmp_path / 'tmp'),
               ANSIBLE_HOME=str(tmp_path / 'home'), ANSIBLE_NOCOLOR='1', ANSIBLE_FORCE_COLOR='0')
    argv = [ansible, 'localhost', '-c', 'local', '-i', 'localhost,', '-e', 'ansible_python_interpreter=%s' % sys.executable,
            '-m', 'gpufleet.reclaim.gpu_kill', '-a', json.dumps({'pids': [target], 'audit_log': audit, 'force': True})]
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300, check=False,
                          cwd=str(tmp_path))
    out = proc.stdout.decode(errors='replace') + proc.stderr.decode(errors='replace')
    assert proc.returncode != 0, out[-3000:]                                  # the host failed
    # issue #17: the module reads the driver in a watchdog child, so the crash is a clean module failure
    # naming the call (before, the module itself died: rc 139 and no JSON)
    assert 'FAILED!' in out and 'the GPU driver library crashed (signal 11) in nvmlDeviceGetComputeRunningProcesses' in out, \
        out[-3000:]
    assert node.alive(target) and not os.path.exists(audit)
