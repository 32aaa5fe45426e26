# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The SSH session drops while gpu_kill runs on the node (issue #11).

What the module process sees then depends on the session: with a terminal (``ssh -tt``, Ansible's
``usetty``) it is hung up (SIGHUP) and dies wherever it is; without one (Ansible's default) it keeps
running and only its answer is lost (stdout is a broken pipe).  Both are reproduced on the module's
real main(), run in a separate process as Ansible runs it (an arguments file), against the test's
own simulated node: the victim ignores SIGTERM, so the run is still waiting (``timeout``) before its
SIGKILL when the session goes.  Then the same task runs again, as an operator would, and must
finish the work.

SAFETY: the processes signalled are the gpusim workloads of the test's node and the module process
the test started (SIGHUP, by its Popen object).  Every wait is bounded.  No wall-clock assertion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

pytestmark = h.needs_gpusim


@pytest.fixture
def node(tmp_path):
    sim = h.GpuSim(gpus=2)
    sim.audit = str(tmp_path / 'actions.jsonl')
    sim.args = str(tmp_path / 'args.json')
    try:
        yield sim
    finally:
        sim.close()


def start_module(node, stdout, **args):
    args.setdefault('audit_log', node.audit)
    args.setdefault('utilization_history', '')
    with open(node.args, 'w') as handle:
        json.dump({'ANSIBLE_MODULE_ARGS': args}, handle)
    return subprocess.Popen([sys.executable, '-c', h.MODULE_RUNNER, h.COLLECTIONS_DIR, node.dev, 'gpu_kill', node.args],
                            env=h.shim_env(node.state), stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def records(path):
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def finish(proc):
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return out, err.decode(errors='replace')


def test_a_hangup_while_waiting_for_sigkill_and_the_rerun_finishes(node):
    stubborn = node.spawn(0, 2048, argv=['python', 'stubborn.py'], ignore_term=True, children=1)
    bystander = node.spawn(0, 1024, argv=['python', 'train.py'])
    run = start_module(node, subprocess.PIPE, cmdline='stubborn', force=True, timeout=60, release_timeout=5)
    h.wait_for(lambda: records(node.audit) or run.poll() is not None, timeout=60, what='the signals on record')
    assert run.poll() is None, finish(run)[1][-3000:]                      # still waiting for the 60 s to pass
    run.send_signal(signal.SIGHUP)                                         # the session is gone
    _out, err = finish(run)
    assert run.returncode == -signal.SIGHUP, err[-3000:]
    (signalled,) = records(node.audit)                                     # the SIGTERMs sent are on record
    assert signalled['event'] == 'gpu_kill_signalled'
    assert sorted(e['pid'] for e in signalled['signalled']) == sorted([stubborn] + node.child_pids(stubborn))
    assert all(e['signals'] == ['SIGTERM'] and e['outcome'] == 'pending' for e in signalled['signalled'])
    assert node.alive(stubborn) and node.alive(bystander)                  # SIGTERM ignored; SIGKILL never came
    rerun = start_module(node, subprocess.PIPE, cmdline='stubborn', force=True, timeout=1, release_timeout=5)
    out, err = finish(rerun)
    assert rerun.returncode == 0, err[-3000:]
    result = json.loads(out.decode())
    killed = dict((e['pid'], e['signals']) for e in result['killed'])
    assert killed[stubborn] == ['SIGTERM', 'SIGKILL'] and result['changed'] is True
    assert not node.alive(stubborn) and node.alive(bystander)
    assert [r['event'] for r in records(node.audit)] == ['gpu_kill_signalled', 'gpu_kill_signalled', 'gpu_kill']
    assert audit_log.verify(node.audit) == {'valid': True, 'lines': 3, 'errors': []}


def test_a_lost_answer_leaves_the_work_done_and_the_rerun_changes_nothing(node):
    """No terminal: the module is not hung up; it finishes and fails only to print its answer."""
    victim = node.spawn(0, 2048, argv=['python', 'miner.py'], children=1)
    bystander = node.spawn(1, 1024, argv=['python', 'train.py'])
    read_end, write_end = os.pipe()
    os.close(read_end)                                                     # nobody will read the answer
    try:
        run = start_module(node, write_end, cmdline='miner', force=True, timeout=5, release_timeout=5)
    finally:
        os.close(write_end)
    _out, err = finish(run)
    assert run.returncode != 0 and 'BrokenPipeError' in err, err[-3000:]  # the answer could not be written
    assert not node.alive(victim) and node.alive(bystander)
    assert [r['event'] for r in records(node.audit)] == ['gpu_kill_signalled', 'gpu_kill']   # the run is complete on record
    assert records(node.audit)[1]['freed_mib'] == {'0': 2048}
    rerun = start_module(node, subprocess.PIPE, cmdline='miner', force=True, timeout=5, release_timeout=5)
    out, err = finish(rerun)
    assert rerun.returncode == 0, err[-3000:]
    result = json.loads(out.decode())
    assert result['changed'] is False and result['killed'] == [] and node.alive(bystander)
    assert audit_log.verify(node.audit) == {'valid': True, 'lines': 2, 'errors': []}
