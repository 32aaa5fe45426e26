# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The fleet-level blast-radius limit (core/blast.py, issue #30): the limits, which nodes act and which are held, the
nodes already disrupted counting against the limit, the worst-first order, and the kill limit across the fleet."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import blast
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument


def node(host, actions=(), disruption=None, ok=True, work=None):
    disruptive = [dict({'action': a} if isinstance(a, str) else a) for a in actions]
    return {'host': host, 'ok': ok, 'work': bool(disruptive) if work is None else work, 'disruptive': disruptive,
            'disruption': disruption or {'drained': None, 'reboot_flag': None, 'scheduler': None, 'actions': []}}


def fleet(count=10, action='reset'):
    return [node('node%02d' % (i + 1), [action]) for i in range(count)]


def reset_ago(seconds, gpu='GPU-x'):
    return {'drained': None, 'reboot_flag': None, 'scheduler': None,
            'actions': [{'action': 'reset', 'gpu': gpu, 'time': 0, 'ago_s': seconds}]}


# ---------------------------------------------------------------------------- limits
@pytest.mark.parametrize('values, field, why', [
    ({'reclaim_max_nodes_pct': -5}, 'reclaim_max_nodes_pct', 'negative'),
    ({'reclaim_max_nodes_pct': 101}, 'reclaim_max_nodes_pct', 'over 100'),
    ({'reclaim_max_nodes_pct': 'lots'}, 'reclaim_max_nodes_pct', 'not a number'),
    ({'reclaim_max_nodes_pct': True}, 'reclaim_max_nodes_pct', 'not a number'),
    ({'reclaim_max_nodes_pct': 'nan'}, 'reclaim_max_nodes_pct', 'not a number'),
    ({'reclaim_max_nodes': -1}, 'reclaim_max_nodes', 'negative'),
    ({'reclaim_max_nodes': '2.5'}, 'reclaim_max_nodes', 'whole number'),
    ({'reclaim_max_nodes': 'two'}, 'reclaim_max_nodes', 'not a number'),
    ({'reclaim_window': '-1h'}, 'reclaim_window', 'duration'),
    ({'reclaim_window': 'soon'}, 'reclaim_window', 'duration'),
    ({'reclaim_window': '8d'}, 'reclaim_window', 'over 7d'),
    ({'reclaim_max_kills': -3}, 'reclaim_max_kills', 'negative'),
    ({'reclaim_max_kills': 'x'}, 'reclaim_max_kills', 'not a number'),
])
def test_a_bad_limit_names_the_variable_the_value_and_the_reason(values, field, why):
    with pytest.raises(InvalidArgument) as exc:
        blast.limits_from(values)
    assert exc.value.field == field and why in exc.value.why, str(exc.value)
    assert str(list(values.values())[0]) in str(exc.value)


def test_the_defaults_and_survey_text_are_read():
    limits = blast.limits_from({})
    assert limits.to_dict() == {'reclaim_max_nodes_pct': 20.0, 'reclaim_max_nodes': None, 'reclaim_window': '1h',
                                'reclaim_window_s': 3600.0, 'reclaim_max_kills': 100}
    # AWX surveys send text; an empty reclaim_max_nodes is no such limit; a bare window is seconds
    limits = blast.limits_from({'reclaim_max_nodes_pct': '50', 'reclaim_max_nodes': '', 'reclaim_window': '900',
                                'reclaim_max_kills': '10'})
    assert (limits.max_nodes_pct, limits.max_nodes, limits.window_s, limits.max_kills) == (50.0, None, 900.0, 10)


@pytest.mark.parametrize('targeted, pct, max_nodes, limit', [
    (10, 20, None, 2), (3, 20, None, 1), (1, 20, None, 1), (10, 0, None, 1), (10, 100, None, 10), (9, 50, None, 4),
    (10, 100, 3, 3), (10, 20, 0, 0), (1000, 20, 50, 50), (0, 20, None, 1)])
def test_the_node_limit_is_a_share_of_the_targeted_nodes_at_least_one_then_max_nodes(targeted, pct, max_nodes, limit):
    assert blast.Limits(max_nodes_pct=pct, max_nodes=max_nodes).node_limit(targeted) == limit


# ---------------------------------------------------------------------------- the fleet plan
def test_ten_nodes_wanting_a_reset_two_act_eight_are_held_then_none_then_the_rest():
    nodes = fleet(10)
    plan = blast.fleet_plan(nodes, blast.limits_from({}))
    assert plan['act'] == ['node01', 'node02'] and sorted(plan['held']) == ['node%02d' % i for i in range(3, 11)]
    assert set(plan['held'].values()) == {'held: blast-radius limit (2 of 10 nodes disrupted in the last 1h)'}
    assert plan['disrupted'] == {} and plan['disrupted_after'] == 2 and 'raise reclaim_max_nodes_pct (now 20)' in plan['hint']
    # the second run within the window: node01 and node02 were reset 5 minutes ago and want nothing more
    second = [node(n['host'], disruption=reset_ago(300)) if n['host'] in plan['act'] else n for n in nodes]
    plan = blast.fleet_plan(second, blast.limits_from({}))
    assert plan['act'] == [] and len(plan['held']) == 8 and sorted(plan['disrupted']) == ['node01', 'node02']
    assert plan['disrupted']['node01'] == ['reset of GPU GPU-x 5m00s ago']
    # raised to 100 %: the rest act
    plan = blast.fleet_plan(second, blast.limits_from({'reclaim_max_nodes_pct': 100}))
    assert plan['act'] == ['node%02d' % i for i in range(3, 11)] and plan['held'] == {} and plan['hint'] is None
    # after the window the two resets count no more
    assert blast.fleet_plan([node(n['host'], disruption=reset_ago(3700)) for n in nodes[:2]] + nodes[2:],
                            blast.limits_from({}))['act'] == ['node03', 'node04']


def test_still_drained_flagged_or_scheduler_drained_nodes_count_and_may_act_again():
    drained = {'drained': {'reason': 'gpufleet: GPU 0: Xid 79', 'via': 'slurm', 'ago_s': 90000}, 'reboot_flag': None,
               'scheduler': None, 'actions': []}
    flagged = {'drained': None, 'reboot_flag': {'time': 'x', 'gpus': {'GPU-a': 'Xid 79'}}, 'scheduler': None, 'actions': []}
    epilog = {'drained': None, 'reboot_flag': None, 'actions': [],
              'scheduler': {'state': 'drained', 'reason': 'gpufleet: GPU 1 holds 4096 MiB after job 7'}}
    nodes = [node('a', ['reset'], drained), node('b', [], flagged), node('c', [], epilog)] + fleet(7)
    plan = blast.fleet_plan(nodes, blast.limits_from({'reclaim_max_nodes_pct': 30}))
    # 3 of 10 disrupted already = the limit: node a acts again (counted once), every new node is held
    assert plan['act'] == ['a'] and len(plan['held']) == 7 and plan['disrupted_after'] == 3
    assert plan['disrupted'] == {'a': ['drained by the ladder (gpufleet: GPU 0: Xid 79)'],
                                 'b': ['flagged for a reboot (GPU-a: Xid 79)'],
                                 'c': ['drained in the scheduler (gpufleet: GPU 1 holds 4096 MiB after job 7)']}


def test_the_worst_go_first_reboot_then_drain_then_reset_then_severity_then_age_then_host():
    nodes = [node('z-reset-old', [{'action': 'reset', 'severity': 1, 'since': 100.0}]),
             node('y-reset-lost', [{'action': 'reset', 'severity': 2, 'since': 500.0}]),
             node('x-reset-new', [{'action': 'reset', 'severity': 1, 'since': 900.0}]),
             node('w-drain', [{'action': 'drain', 'severity': 0}]),
             node('v-service', [{'action': 'stop_service'}]),
             node('u-reboot', [{'action': 'reset'}, {'action': 'reboot_flag', 'since': 1000.0}]),
             node('t-reset-untimed', [{'action': 'reset', 'severity': 1}]),
             node('s-reset-old', [{'action': 'reset', 'severity': 1, 'since': 100.0}])]
    plan = blast.fleet_plan(nodes, blast.Limits(max_nodes_pct=100))
    assert plan['act'] == ['u-reboot', 'w-drain', 'y-reset-lost', 's-reset-old', 'z-reset-old', 'x-reset-new',
                           't-reset-untimed', 'v-service']
    assert blast.fleet_plan(nodes, blast.Limits(max_nodes_pct=100, max_nodes=2))['act'] == ['u-reboot', 'w-drain']


def test_nodes_without_a_disruptive_action_act_freely_and_failed_plans_never_act():
    nodes = [node('kill-only', [], work=True), node('idle', []), node('failed', ['reset'], ok=False)] + fleet(2)
    plan = blast.fleet_plan(nodes, blast.limits_from({}))
    assert plan['act'] == ['node01', 'kill-only'] and list(plan['held']) == ['node02']
    assert plan['targeted'] == 5 and plan['limit'] == 1


# ---------------------------------------------------------------------------- kills
def miners(host, count, mib=64, first=1000):
    return [{'pid': first + i, 'used_mib': mib} for i in range(count)]


def test_150_miners_on_three_nodes_100_are_killed_50_held():
    nodes = [{'host': 'node%02d' % n, 'ok': True, 'kills': miners('node%02d' % n, 50)} for n in (1, 2, 3)]
    plan = blast.kill_plan(nodes, blast.limits_from({}))
    assert plan['planned'] == 150 and plan['allowed'] == {'node01': 50, 'node02': 50} and plan['held'] == {'node03': 50}
    assert plan['reason'] == 'held: blast-radius limit (100 of 150 processes in this run, reclaim_max_kills=100)'
    assert 'raise reclaim_max_kills (now 100)' in plan['hint']


def test_the_kill_order_is_the_most_memory_first_with_families_whole_and_ties_by_host():
    family = [{'pid': 1, 'used_mib': 900}, {'pid': 2, 'used_mib': None, 'parent_pid': 1}, {'pid': 3, 'used_mib': 10}]
    nodes = [{'host': 'b', 'ok': True, 'kills': family},
             {'host': 'a', 'ok': True, 'kills': [{'pid': 7, 'used_mib': 900}, {'pid': 8, 'used_mib': 500}]},
             {'host': 'c', 'ok': False, 'kills': [{'pid': 9, 'used_mib': 9999}]}]
    assert blast.kill_plan(nodes, blast.Limits(max_kills=3))['allowed'] == {'a': 1, 'b': 2}
    plan = blast.kill_plan(nodes, blast.Limits(max_kills=2))     # b's family of 2 does not fit after a's: it and all after wait
    assert plan['allowed'] == {'a': 1} and plan['held'] == {'b': 3, 'a': 1}
    families = blast.kill_families(nodes[0]['kills'])
    assert [[e['pid'] for e in f] for f in families] == [[1, 2], [3]]
    assert blast.take_families(families, 2) == ([families[0][0], families[0][1]], [families[1][0]])
