# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpufleet.reclaim.fleet_records: the node records the playbooks' summary plays build from each node's one result."""

from __future__ import annotations

import pytest

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter.fleet_records import FilterModule, fleet_records

UNREACHABLE = {'unreachable': True, 'changed': False, 'msg': 'ssh: connect to host 127.0.0.1 port 1: Connection refused'}
FINDING = {'pid': 7, 'user': 'eve', 'name': 'python', 'cmdline': ['python', 'x'], 'gpu_indexes': [1], 'used_mib': 4096,
           'score': 100, 'level': 'critical', 'listed': True, 'rules': [{'id': 'H-stratum'}], 'exe': '/usr/bin/python'}
KILLED = {'pid': 7, 'user': 'eve', 'cmdline': ['python', 'x'], 'gpu_indexes': [1], 'used_mib': 4096, 'signals': ['SIGTERM']}


def kill_result(**extra):
    result = {'changed': True, 'killed': [KILLED], 'failed_processes': [], 'skipped_processes': [], 'freed_mib': {'1': 4096},
              'unreleased': [], 'findings': [FINDING], 'rogue_summary': {'critical': 1, 'total': 1, 'evaluated': 2},
              'msg': 'killed 1 process(es)'}
    result.update(extra)
    return result


def test_rogue_cleanup_records_one_per_node_that_ran_sorted_and_trimmed():
    hostvars = {
        'node02': {'gpufleet_kill': kill_result()},
        'node01': {'gpufleet_kill': kill_result(killed=[], freed_mib={}, findings=[], changed=False, msg='would kill 0')},
        'node07': {'gpufleet_kill': UNREACHABLE},
        'node08': {'other': 1},                       # excluded by --limit: never ran the task
    }
    records = fleet_records(['node02', 'node01', 'node07', 'node08', 'nohost'], hostvars, 'gpufleet_kill', 'rogue_cleanup',
                            extra={'mode': 'kill'})
    assert [r['host'] for r in records] == ['node01', 'node02', 'node07']
    node01, node02, node07 = records
    assert (node01['status'], node01['msg'], node01['killed'], node01['freed_mib']) == ('ok', 'would kill 0', [], 0)
    assert node02['status'] == 'ok' and node02['freed_mib'] == 4096 and node02['killed'] == [KILLED]
    kept = ('pid', 'user', 'name', 'cmdline', 'gpu_indexes', 'used_mib', 'score', 'level')
    assert node02['findings'] == [dict((k, FINDING[k]) for k in kept)]
    assert node02['summary'] == {'critical': 1, 'total': 1, 'evaluated': 2} and node02['mode'] == 'kill'
    assert (node07['status'], node07['summary'], node07['findings']) == ('unreachable', {}, [])
    assert node07['msg'].startswith('ssh: connect')


def test_a_kill_that_failed_or_left_memory_behind_fails_its_node():
    survivor = dict(KILLED, reason='still running after SIGTERM')
    hostvars = {'a': {'k': kill_result(failed=True, failed_processes=[survivor], msg='failed 1')},
                'b': {'k': kill_result(unreleased=[{'gpu': 1, 'unreleased_mib': 4096, 'cause': 'leak'}])},
                'c': {'k': {'failed': True}}}
    a, b, c = fleet_records(['a', 'b', 'c'], hostvars, 'k', 'reclaim_idle')
    assert (a['status'], a['msg'], a['kill_failed']) == ('failed', 'failed 1', [survivor])
    assert b['status'] == 'failed' and b['msg'].startswith('GPU memory not released: ') and '4096' in b['msg']
    assert (c['status'], c['msg'], c['killed']) == ('failed', 'failed', [])
    assert 'findings' not in a   # reclaim_idle records have no audit part


def test_reset_unhealthy_halted_nodes_say_why():
    hostvars = {'node05': {'r': {'failed': True, 'msg': 'refused', 'resets': [{'index': 3, 'status': 'refused', 'extra': 1}]}},
                'node06': {'r': {'skipped': True, 'changed': False, 'false_condition': 'not (gpufleet_halt | bool)'}}}
    node05, node06 = fleet_records(['node05', 'node06'], hostvars, 'r', 'reset_unhealthy', max_fail_percentage=10)
    assert node05['status'] == 'failed' and node05['resets'] == [{'index': 3, 'status': 'refused'}]
    assert node06['status'] == 'halted'
    assert node06['msg'] == ('not attempted: 1 of 2 node(s) failed their reset (in the plan or an earlier batch), more than '
                             'reset_max_fail_percentage=10%')


def test_remediate_records_a_hung_driver():
    hung = {'failed': True, 'msg': 'nvmlDeviceGetHandleByIndex hung', 'driver_hung': {'call': 'nvmlInit', 'seconds': 30}}
    ok = {'changed': False, 'gpus': [{'index': 0, 'status': 'ok', 'ladder': [], 'noise': 1}], 'reboot_wanted': False}
    hung_rec, ok_rec = fleet_records(['a', 'b'], {'a': {'r': hung}, 'b': {'r': ok}}, 'r', 'remediate')
    assert (hung_rec['status'], hung_rec['driver_hung']) == ('driver_hung', hung['driver_hung'])
    assert ok_rec['status'] == 'ok' and ok_rec['driver_hung'] is None and ok_rec['gpus'] == [{'index': 0, 'status': 'ok', 'ladder': []}]


def test_inventory_report_redacts_before_the_record_exists():
    gpu = {'devices': [], 'processes': [{'pid': 1, 'cmdline': ['mysql', '--password=hunter2']}], 'holders': []}
    ok, down = fleet_records(['a', 'b'], {'a': {'s': {'ansible_facts': {'gpu': gpu}}}, 'b': {'s': UNREACHABLE}},
                             's', 'inventory_report')
    assert 'hunter2' not in repr(ok['gpu']) and ok['gpu']['processes'][0]['pid'] == 1
    assert (down['status'], down['gpu']) == ('unreachable', None)


def test_audit_records():
    result = {'findings': [FINDING], 'summary': {'critical': 1}, 'report': None, 'msg': 'examined 2 process(es)'}
    [record] = fleet_records(['a'], {'a': {'x': result}}, 'x', 'audit')
    assert record == {'host': 'a', 'status': 'ok', 'msg': 'examined 2 process(es)', 'findings': [FINDING],
                      'summary': {'critical': 1}, 'report': None}


def test_the_act_result_comes_before_the_plan_and_the_blast_decision_marks_the_held():
    """issue #30: the playbooks plan every node, act on some; a held node's record is its plan, with the reason."""
    plan = {'changed': False, 'gpus': [{'index': 0, 'status': 'needs_remediation', 'ladder': [{'step': 'reset', 'status': 'would_run'}]}]}
    done = {'changed': True, 'gpus': [{'index': 0, 'status': 'remediated', 'ladder': [{'step': 'reset', 'status': 'done'}]}]}
    hostvars = {'a': {'plan': plan, 'act': done}, 'b': {'plan': plan}}
    reason = 'held: blast-radius limit (1 of 2 nodes disrupted in the last 1h)'
    a, b = fleet_records(['a', 'b'], hostvars, ['act', 'plan'], 'remediate', blast={'act': ['a'], 'held': {'b': reason}})
    assert (a['gpus'][0]['status'], a['held']) == ('remediated', None)
    assert (b['gpus'][0]['status'], b['held'], b['status']) == ('needs_remediation', reason, 'ok')
    assert 'held' not in fleet_records(['a'], hostvars, 'plan', 'remediate')[0]   # without a decision: as before


def test_kills_held_by_the_limit_are_the_held_nodes_planned_kills_and_the_acting_nodes_held_ones():
    reason = 'held: blast-radius limit (1 of 3 processes in this run, reclaim_max_kills=1)'
    other = dict(KILLED, pid=8)
    node_held = dict(other, reason='held: blast-radius limit (max_kills=1 on this node in this run)')
    hostvars = {'a': {'plan': kill_result(killed=[KILLED, other]), 'kill': kill_result(held_processes=[node_held])},
                'b': {'plan': kill_result(changed=False)}}
    blast = {'act': ['a'], 'kills': {'a': 1}, 'held': {'b': reason}, 'reason': reason}
    a, b = fleet_records(['a', 'b'], hostvars, ['kill', 'plan'], 'rogue_cleanup', blast=blast)
    assert a['killed'] == [KILLED] and a['held_processes'] == [dict(other, reason=reason)] and a['held'] is None
    assert b['killed'] == [] and b['held_processes'] == [dict(KILLED, reason=reason)] and b['held'] == reason


@pytest.mark.parametrize('args, text', [
    ((['a'], {}, 'r', 'nosuch'), "invalid workflow 'nosuch'"),
    ((['a'], {}, '', 'audit'), "invalid register ''"),
    ((['a'], {}, [], 'audit'), "invalid register []"),
    ((['a'], {}, ['x', 3], 'audit'), "invalid register ['x', 3]"),
    (('node01', {}, 'r', 'audit'), "invalid hosts 'node01'"),
    ((['a'], {'a': {'r': 'text'}}, 'r', 'audit'), "r of a is 'text', not a task result"),
])
def test_bad_input_names_the_argument(args, text):
    with pytest.raises(AnsibleFilterError) as info:
        fleet_records(*args)
    assert text in str(info.value)


def test_filter_is_registered():
    assert FilterModule().filters()['fleet_records'] is fleet_records
