# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The remediation ladder's node-local budget (core/budget.py, issue #30): resets per GPU, one drain and one reboot
flag per node per window, and no Slurm drain while too much of the node's partition is drained by gpufleet.

The ladder runs against the GPU simulator (a GPU that keeps failing: a new Xid 48 after every reset); Slurm's
answer comes from a program standing for sinfo (``fake_sinfo``: it prints the JSON it was given, through
core/slurm.py's client and its own checks), never a real cluster: tests/integration/targets/blast_radius_slurm
runs the same check against a real Slurm."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import budget as B
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import disruption as D
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import remediate as rem
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import slurm, xid
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_remediate import SimHost, options, recorder, statuses
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_remediate import node  # noqa: F401 pylint: disable=unused-import

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='the simulator node and the reset need root')
NOW = 1700000000.0

SINFO = r'''#!%(python)s
# Stands for sinfo in the budget tests: prints the JSON in %(data)s for `sinfo --json`, records the call.
import sys
with open(%(log)r, 'a') as log:
    log.write(' '.join(sys.argv[1:]) + '\n')
if sys.argv[1:] != ['--json']:
    sys.exit(2)
sys.stdout.write(open(%(data)r).read())
'''


def fake_sinfo(tmp_path, nodes):
    """A slurm.SlurmClient whose sinfo prints ``nodes`` (dicts: name, partitions, state_flags, reason) as Slurm
    22.05's ``sinfo --json`` does; returns (client, calls)."""
    bindir = tmp_path / 'sinfo-bin'
    bindir.mkdir(parents=True, exist_ok=True)
    data, log, path = bindir / 'nodes.json', bindir / 'calls.log', bindir / 'sinfo'
    blank = {'state': 'idle', 'state_flags': [], 'reason': '', 'reason_changed_at': 0}
    data.write_text(json.dumps({'meta': {}, 'errors': [], 'nodes': [dict(blank, **n) for n in nodes]}))
    path.write_text(SINFO % {'python': sys.executable, 'data': str(data), 'log': str(log)})
    path.chmod(0o755)
    client = slurm.SlurmClient(which=lambda name: str(path) if name == 'sinfo' else None)
    return client, (lambda: log.read_text().splitlines() if log.exists() else [])


def partition(drained, total=4, reason='gpufleet: GPU 0 (x): reboot wanted', name='gpu'):
    return [{'name': 'node%02d' % (i + 1), 'partitions': [name], 'state_flags': ['DRAIN'] if i < drained else [],
             'reason': reason if i < drained else ''} for i in range(total)]


# ---------------------------------------------------------------------------- the budget itself
@pytest.mark.parametrize('kwargs, field, why', [
    ({'max_resets': -1}, 'max_resets', 'from 0 to 100'),
    ({'max_resets': 101}, 'max_resets', 'from 0 to 100'),
    ({'max_resets': 1.5}, 'max_resets', 'whole number'),
    ({'max_resets': 'two'}, 'max_resets', 'whole number'),
    ({'window': '0s'}, 'budget_window', 'more than 0'),
    ({'window': '8d'}, 'budget_window', 'at most 7d'),
    ({'window': 'soon'}, 'budget_window', 'duration'),
    ({'max_drained_pct': 101}, 'max_drained_pct', 'percentage'),
    ({'max_drained_pct': -5}, 'max_drained_pct', 'percentage'),
    ({'max_drained_pct': '50'}, 'max_drained_pct', 'percentage'),
])
def test_a_bad_budget_names_the_option_and_the_value(kwargs, field, why):
    with pytest.raises(InvalidArgument) as exc:
        B.Budget(**kwargs)
    assert exc.value.field == field and why in exc.value.why and str(list(kwargs.values())[0]) in str(exc.value)


def test_resets_are_counted_per_gpu_within_the_window():
    budget = B.Budget(max_resets=2, window='24h')
    history = [D.entry('reset', NOW - 90000, gpu='GPU-a'), D.entry('reset', NOW - 3600, gpu='GPU-a'),
               D.entry('reset', NOW - 60, gpu='GPU-b')]
    assert budget.reset_refusal(history, 'GPU-a', NOW) is None       # one within 24 h: the older is outside
    assert budget.reset_refusal(history, 'GPU-b', NOW) is None
    history.append(D.entry('reset', NOW - 30, gpu='GPU-a'))
    why = budget.reset_refusal(history, 'GPU-a', NOW)
    assert why.startswith('budget_exhausted: this GPU was reset 2 time(s) in the last 1d00h (max_resets 2)'), why
    assert 'a human decides' in why and budget.reset_refusal(history, 'GPU-a', NOW + 86400) is None
    assert B.Budget(max_resets=0).reset_refusal([], 'GPU-a', NOW).startswith('budget_exhausted')


def test_one_drain_and_one_reboot_flag_per_node_per_window():
    budget = B.Budget(window='24h')
    assert budget.node_refusal([], 'drain', NOW) is None
    history = [D.entry('drain', NOW - 7200), D.entry('reset', NOW - 60, gpu='GPU-a')]
    assert 'the node was drained 2h00m ago' in budget.node_refusal(history, 'drain', NOW)
    assert budget.node_refusal(history, 'reboot_flag', NOW) is None
    assert budget.node_refusal(history, 'drain', NOW + 86400) is None


def test_the_partition_check_counts_the_other_nodes_drained_for_a_gpufleet_reason(tmp_path):
    budget = B.Budget(max_drained_pct=50)
    client, calls = fake_sinfo(tmp_path, partition(3))
    why = budget.partition_refusal('node04', client)
    assert why == ('partition_limit: 3 of 4 nodes of partition gpu are drained by gpufleet already (75%, more than '
                   'max_drained_pct 50): not drained; a human decides'), why
    assert calls() == ['--json']
    assert budget.partition_refusal('node04', fake_sinfo(tmp_path, partition(2))[0]) is None          # 50% is not more
    # drained by someone else (maintenance) does not count; nor does the node itself
    assert budget.partition_refusal('node04', fake_sinfo(tmp_path, partition(3, reason='maintenance'))[0]) is None
    assert budget.partition_refusal('node01', fake_sinfo(tmp_path, partition(3, total=5))[0]) is None  # 2 others of 5
    assert B.Budget(max_drained_pct=100).partition_refusal('node04', None) is None                   # off: nothing asked


def test_the_partition_check_refuses_when_slurm_cannot_be_read(tmp_path):
    client = slurm.SlurmClient(which=lambda name: None)
    why = B.Budget().partition_refusal('node04', client)
    assert why.startswith('partition_limit: the drained share of the node\'s partitions cannot be read') and 'sinfo' in why


def test_sinfo_json_of_slurm_22_and_23_both_read():
    nodes = slurm.nodes_from_json({'nodes': [
        {'name': 'a', 'state': 'idle', 'state_flags': ['DRAIN'], 'partitions': ['gpu', 'all'], 'reason': 'gpufleet: x',
         'reason_changed_at': NOW},
        {'name': 'b', 'state': ['IDLE', 'DRAIN'], 'partitions': ['gpu'], 'reason': 'maint'},
        {'name': 'c', 'state': 'mixed', 'partitions': 'gpu', 'reason': None},
        {'bogus': 1}]})
    assert [(n.name, n.partitions, n.drained, n.reason, n.reason_time) for n in nodes] == [
        ('a', ('gpu', 'all'), True, 'gpufleet: x', NOW), ('b', ('gpu',), True, 'maint', None), ('c', (), False, '', None)]
    with pytest.raises(slurm.SlurmError):
        slurm.nodes_from_json({'jobs': []})


# ---------------------------------------------------------------------------- the ladder within its budget
@needs_root
def test_a_gpu_that_keeps_failing_is_reset_twice_per_window_then_the_budget_holds_it(node, tmp_path, monkeypatch):
    monkeypatch.setenv(xid.KMSG_ENV, json.loads(node.gpusim('show'))['kmsg_path'])
    opts = options(tmp_path, node_name='n1', drain_command=['/bin/true'])
    host = SimHost(node)
    for attempt in (1, 2):
        node.gpusim('xid', '--gpu', '1', '--code', '48')
        done = rem.remediate(opts, host, scheduler=None)
        assert statuses(done)[1] == [('reset', 'done')], (attempt, statuses(done))
        assert done['remediation_budget_exhausted'] is False and done['disruptive'][0]['action'] == 'reset'
    node.gpusim('xid', '--gpu', '1', '--code', '48')
    plan = rem.remediate(opts, host, check_mode=True, scheduler=None)   # check mode predicts the same
    assert statuses(plan)[1] == [('reset', 'budget_exhausted')] and plan['disruptive'] == []
    held = rem.remediate(opts, host, scheduler=None)
    assert statuses(held)[1] == [('reset', 'budget_exhausted')] and held['remediation_budget_exhausted'] is True
    assert held['budget']['exhausted'] == [{'step': 'reset', 'gpu': 1, 'why': held['gpus'][1]['ladder'][0]['detail']}]
    assert 'reset 2 time(s) in the last 1d00h (max_resets 2)' in held['msg'] and held['changed'] is False
    assert json.loads(node.gpusim('show'))['gpus'][1]['reset_count'] == 2
    # the event stays unhandled: the next run holds it again (the metric stays up), and a larger budget resets it
    assert statuses(rem.remediate(opts, host, scheduler=None))[1] == [('reset', 'budget_exhausted')]
    more = options(tmp_path, node_name='n1', drain_command=['/bin/true'], budget=B.Budget(max_resets=3))
    assert statuses(rem.remediate(more, host, scheduler=None))[1] == [('reset', 'done')]
    with open(opts.state_path) as handle:
        history = json.load(handle)['disruptions']
    assert [(e['action'], e['by']) for e in history] == [('reset', 'remediate')] * 3


@needs_root
def test_a_second_drain_within_the_window_is_held_and_a_gpufleet_drained_partition_refuses_one(node, tmp_path):
    hook, calls = recorder(tmp_path, 'drain-hook')
    opts = options(tmp_path, drain_command=[hook], node_name='node04')
    os.makedirs(os.path.dirname(opts.state_path))

    def earlier_drain(ago):   # drained, and returned to service, that long ago
        with open(opts.state_path, 'w') as handle:
            json.dump({'handled': {}, 'drained': None, 'disruptions': [D.entry('drain', time.time() - ago)]}, handle)
    earlier_drain(3600)
    host = SimHost(node, events={1: [xid.make_event(79, 'kmsg', time_s=time.time(), pci_bus_id=None)]})
    done = rem.remediate(opts, host, scheduler=None)
    assert done['node']['drain']['status'] == 'budget_exhausted' and calls() == []
    # the flag goes with its drain (a flag alone would leave the GPU waiting for a reboot and the drain never retried)
    assert statuses(done)[1] == [('drain', 'node_budget_exhausted'), ('reboot_flag', 'node_budget_exhausted')]
    assert done['remediation_budget_exhausted'] and done['drained'] is False and not os.path.exists(opts.reboot_flag)
    assert sorted(e['step'] for e in done['budget']['exhausted']) == ['drain', 'reboot_flag']
    earlier_drain(25 * 3600)   # the window has room again: the event that stayed unhandled drains and flags the node
    done = rem.remediate(opts, host, scheduler=None)
    assert statuses(done)[1] == [('drain', 'node_done'), ('reboot_flag', 'node_written')] and len(calls()) == 1
    # with Slurm: 3 of the partition's 4 nodes drained by gpufleet, the 4th is not drained (no scontrol call)
    os.unlink(opts.state_path)
    os.unlink(opts.reboot_flag)
    scontrol, scalls = recorder(tmp_path, 'scontrol')
    host = SimHost(node, events={1: [xid.make_event(79, 'kmsg', time_s=time.time(), pci_bus_id=None)]}, scontrol=scontrol)
    client, sinfo_calls = fake_sinfo(tmp_path, partition(3))
    done = rem.remediate(opts, host, scheduler='slurmd', slurm_client=client)
    assert done['node']['drain']['status'] == 'partition_limit' and scalls() == [] and sinfo_calls() == ['--json']
    assert '3 of 4 nodes of partition gpu are drained by gpufleet already' in done['node']['drain']['detail']
    assert done['node']['reboot_flag']['status'] == 'partition_limit' and not os.path.exists(opts.reboot_flag)
