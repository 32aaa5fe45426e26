# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The disruption history of a node and its reading for the fleet limit (core/disruption.py, issue #30): entries
validated and bounded, writers merged under the state's lock, the node's drain, this boot's flag and Slurm's view."""

from __future__ import annotations

import json
import os
import time

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import disruption as D
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import remediate as rem
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.slurm import SlurmClient
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.xid import read_boot_id
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_budget import fake_sinfo, partition

NOW = 1700000000.0


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as handle:
        json.dump(data, handle)


def test_entries_are_validated_bounded_and_kept_for_a_week():
    entries = [{'action': 'reset', 'gpu': 'GPU-a', 'time': NOW - 60, 'by': 'remediate'},
               {'action': 'reset', 'gpu': 'GPU-a', 'time': NOW - 60, 'by': 'remediate'},       # the same one twice
               {'action': 'reboot', 'time': NOW}, {'action': 'drain', 'time': 'yesterday'}, 'x', None,
               {'action': 'drain', 'time': NOW - 8 * 86400},                                    # older than a week
               {'action': 'stop_service', 'time': NOW - 10, 'detail': 'nvidia-dcgm\x1b[2J' + 'x' * 500, 'gpu': 7}]
    kept = D.prune(entries, NOW)
    assert [(e['action'], e['gpu']) for e in kept] == [('reset', 'GPU-a'), ('stop_service', None)]
    assert kept[1]['detail'].startswith('nvidia-dcgm\\x1b[2J') and len(kept[1]['detail']) == D.DETAIL_LEN
    many = [D.entry('reset', NOW - i, gpu='g') for i in range(D.MAX_ENTRIES + 50)]
    assert len(D.prune(many, NOW)) == D.MAX_ENTRIES and D.prune(many, NOW)[-1]['time'] == NOW
    assert [e['time'] for e in D.recent(many[:5], 'reset', 3.5, NOW)] == [NOW, NOW - 1, NOW - 2, NOW - 3]


def test_a_reset_recorded_while_the_ladder_runs_survives_the_ladders_save(tmp_path):
    """gpu_reset (a playbook) and the guard's ladder write the same state file: neither loses the other's record."""
    path, now = str(tmp_path / 'lib' / 'remediation.json'), time.time()   # the ladder saves by the real clock
    write(path, {'handled': {'k': 1.0}, 'drained': None})
    opts = rem.RemediateOptions(state_path=path, reboot_flag=None)
    state, problem = rem.load_ladder_state(opts)
    assert problem is None and state['disruptions'] == []
    assert D.note(path, [D.entry('reset', now, gpu='GPU-b', by='gpu_reset')], now=now) is None   # meanwhile
    with open(path) as handle:
        assert json.load(handle)['handled'] == {'k': 1.0}            # the rest of the state kept as it was
    state['disruptions'].append(D.entry('reset', now + 1, gpu='GPU-a', by='remediate'))
    rem._save_state(opts, state, rem.Run(opts, None, False))   # pylint: disable=protected-access
    with open(path) as handle:
        saved = json.load(handle)['disruptions']
    assert [(e['gpu'], e['by']) for e in saved] == [('GPU-b', 'gpu_reset'), ('GPU-a', 'remediate')]
    assert os.path.exists(path + '.lock')
    write(path, ['not', 'an', 'object'])
    assert 'does not hold a JSON object' in D.note(path, [D.entry('reset', now)], now=now)


def test_the_node_reading_has_the_drain_this_boots_flag_and_the_recent_actions_by_the_nodes_clock(tmp_path):
    state, flag = str(tmp_path / 'remediation.json'), str(tmp_path / 'reboot-wanted')
    quiet = {'drained': None, 'reboot_flag': None, 'scheduler': None, 'actions': [], 'errors': []}
    assert D.node_disruption(state, flag, now=NOW, scheduler=None) == quiet
    write(state, {'drained': {'reason': 'gpufleet: GPU 0: Xid 79', 'via': 'drain_command', 'time': NOW - 600},
                  'disruptions': [D.entry('reset', NOW - 300, gpu='GPU-a', by='gpu_reset'), D.entry('drain', NOW - 600, by='remediate')]})
    write(flag, {'boot_id': 'an-earlier-boot', 'time': '2026-01-01T00:00:00Z', 'gpus': {'GPU-a': 'Xid 79'}})
    got = D.node_disruption(state, flag, now=NOW, scheduler=None)
    assert got['drained'] == {'reason': 'gpufleet: GPU 0: Xid 79', 'via': 'drain_command', 'ago_s': 600.0}
    assert got['reboot_flag'] is None          # a flag of an earlier boot: rebooted since, no disruption any more
    assert [(a['action'], a['ago_s']) for a in got['actions']] == [('reset', 300.0), ('drain', 600.0)]   # newest first
    write(flag, {'boot_id': read_boot_id(), 'time': '2026-01-01T00:00:00Z', 'gpus': {'GPU-a': 'Xid 79'}})
    assert D.node_disruption(state, flag, now=NOW, scheduler=None)['reboot_flag'] == {'time': '2026-01-01T00:00:00Z',
                                                                                      'gpus': {'GPU-a': 'Xid 79'}}
    write(state, 'garbage')
    assert D.node_disruption(state, flag, now=NOW, scheduler=None)['errors'] == ['%s does not hold a JSON object' % state]


def test_slurms_view_counts_only_a_gpufleet_drain_of_this_node(tmp_path):
    nodes = partition(2)
    client, calls = fake_sinfo(tmp_path, nodes)
    view = D.node_disruption(None, None, now=NOW, scheduler='slurmd', node_name='node01', client=client)['scheduler']
    assert view == {'node': 'node01', 'state': 'drained', 'reason': 'gpufleet: GPU 0 (x): reboot wanted', 'since': None}
    assert calls() == ['--json']
    client, _calls = fake_sinfo(tmp_path / 'maintenance', partition(2, reason='maintenance'))
    assert D.node_disruption(None, None, now=NOW, scheduler='slurmd', node_name='node01', client=client)['scheduler'] is None
    client, calls = fake_sinfo(tmp_path / 'without-slurmd', nodes)
    assert D.node_disruption(None, None, now=NOW, scheduler=None, client=client)['scheduler'] is None and calls() == []
    broken = D.node_disruption(None, None, now=NOW, scheduler='slurmd', node_name='node01',
                               client=SlurmClient(which=lambda name: None))
    assert broken['scheduler'] is None and broken['errors'][0].startswith("cannot read the node's scheduler state: ")
