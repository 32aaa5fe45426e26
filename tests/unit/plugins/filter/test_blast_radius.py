# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpufleet.reclaim.blast_limits and gpufleet.reclaim.blast_radius (issue #30): the limit variables checked before any
node is touched, and the decision taken from every node's registered plan (module results as the modules return them)."""

from __future__ import annotations

import pytest

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter import blast_limits as limits_filter
from ansible_collections.gpufleet.reclaim.plugins.filter import blast_radius as radius_filter
from ansible_collections.gpufleet.reclaim.plugins.filter.blast_limits import blast_limits
from ansible_collections.gpufleet.reclaim.plugins.filter.blast_radius import blast_radius

QUIET = {'drained': None, 'reboot_flag': None, 'scheduler': None, 'actions': [], 'errors': []}


def remediate_plan(action='reset', disruption=None, kill=False):
    """A gpu_remediate check-mode result: GPU 0 wants ``action`` (or only a kill of the application an Xid names)."""
    ladder = [{'step': 'kill_application', 'status': 'would_run'}] if kill else [{'step': action, 'status': 'would_run'}]
    return {'changed': False, 'gpus': [{'index': 0, 'ladder': ladder}], 'node': {'undrain': None},
            'disruptive': [] if kill else [{'action': action, 'gpu': 0, 'why': 'Xid 48', 'severity': 1, 'since': 100.0}],
            'disruption': disruption or QUIET}


def test_the_limits_are_checked_with_the_variable_the_value_and_the_reason():
    assert blast_limits({'reclaim_max_nodes_pct': '20', 'reclaim_max_nodes': '', 'reclaim_window': '1h'})['reclaim_max_nodes'] is None
    for values, text in (({'reclaim_max_nodes_pct': 150}, 'reclaim_max_nodes_pct: invalid value 150: over 100'),
                         ({'reclaim_max_nodes_pct': -1}, 'reclaim_max_nodes_pct: invalid value -1: negative'),
                         ({'reclaim_max_kills': 'many'}, "reclaim_max_kills: invalid value 'many': not a number"),
                         ({'reclaim_window': 'x'}, "reclaim_window: invalid value 'x'")):
        with pytest.raises(AnsibleFilterError) as exc:
            blast_limits(values)
        assert text in str(exc.value), str(exc.value)
    with pytest.raises(AnsibleFilterError):
        blast_limits('reclaim_max_nodes_pct=20')


def test_ten_nodes_two_act_eight_held_and_the_lines_say_so():
    hostvars = dict(('node%02d' % i, {'plan': remediate_plan()}) for i in range(1, 11))
    hostvars['node11'] = {'plan': {'unreachable': True, 'msg': 'down'}}
    hostvars['node12'] = {'plan': {'failed': True, 'msg': 'driver hung', 'disruptive': [{'action': 'reset'}]}}
    hostvars['node13'] = {'plan': remediate_plan(kill=True)}
    decision = blast_radius(sorted(hostvars) + ['elsewhere'], hostvars, 'plan', blast_limits({}))
    assert decision['targeted'] == 13 and decision['limit'] == 2
    assert decision['act'] == ['node01', 'node02', 'node13'] and len(decision['held']) == 8
    assert decision['held']['node10'] == 'held: blast-radius limit (2 of 13 nodes disrupted in the last 1h)'
    assert decision['lines'][0] == ('blast-radius limit: at most 2 of 13 targeted node(s) disrupted in the last 1h '
                                    '(reclaim_max_nodes_pct=20); 0 disrupted by gpufleet already')
    assert 'node03: held: blast-radius limit (2 of 13 nodes disrupted in the last 1h)' in decision['lines']
    assert decision['lines'][-1].startswith('8 node(s) held by the blast-radius limit; to act on more in one window, raise')


def test_a_node_disrupted_already_counts_and_its_reason_is_shown():
    reset = dict(QUIET, actions=[{'action': 'reset', 'gpu': 'GPU-a', 'time': 1.0, 'ago_s': 120.0, 'by': 'remediate'}])
    hostvars = {'a': {'plan': remediate_plan(action='reset', disruption=dict(QUIET, actions=[]))},
                'b': {'plan': dict(remediate_plan(), disruptive=[], disruption=reset)}}
    decision = blast_radius(['a', 'b'], hostvars, 'plan', blast_limits({'reclaim_max_nodes_pct': 50}))
    assert decision['act'] == [] and decision['held'] == {'a': 'held: blast-radius limit (1 of 2 nodes disrupted in the last 1h)'}
    assert 'b: disrupted already: reset of GPU GPU-a 2m00s ago' in decision['lines']


def test_kills_across_the_fleet_each_node_gets_its_share():
    killed = [{'pid': 100 + i, 'used_mib': 64} for i in range(5)]
    hostvars = dict(('n%d' % i, {'plan': {'changed': True, 'killed': killed, 'disruptive': []}}) for i in range(3))
    decision = blast_radius(['n0', 'n1', 'n2'], hostvars, 'plan', blast_limits({'reclaim_max_kills': 7}), kind='kills')
    assert decision['kills'] == {'n0': 5, 'n1': 2} and decision['held_kills'] == {'n1': 3, 'n2': 5}
    assert decision['act'] == ['n0', 'n1'] and decision['held'] == dict.fromkeys(('n1', 'n2'), decision['reason'])
    assert decision['reason'] == 'held: blast-radius limit (7 of 15 processes in this run, reclaim_max_kills=7)'
    assert 'n2: 5 held: ' + decision['reason'] in decision['lines']


@pytest.mark.parametrize('args, kwargs, text', [
    (('node01', {}, 'plan', {}), {}, "invalid hosts 'node01'"),
    ((['a'], {}, '', {}), {}, "invalid register ''"),
    ((['a'], {}, 'plan', {}), {'kind': 'gpus'}, "invalid kind 'gpus'"),
    ((['a'], {}, 'plan', {'reclaim_max_kills': -1}), {}, 'reclaim_max_kills: invalid value -1'),
])
def test_bad_input_names_the_argument(args, kwargs, text):
    with pytest.raises(AnsibleFilterError) as exc:
        blast_radius(*args, **kwargs)
    assert text in str(exc.value)


def test_the_filters_are_registered():
    assert radius_filter.FilterModule().filters() == {'blast_radius': blast_radius}
    assert limits_filter.FilterModule().filters() == {'blast_limits': blast_limits}
