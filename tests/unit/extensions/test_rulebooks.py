# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The rulebooks of extensions/eda/rulebooks (issue #33): valid for ansible-rulebook's own schema and parser,
the alert names those of extras/prometheus/gpufleet-rules.yml, each alert mapped to its playbook on its node
with the confirmation from the rulebook's vars, one run per (node, fingerprint) within a window, and the EDA
Controller rulebook the same rules launching the job templates of extras/awx/job_templates.yml.

The rules running for real: tests/integration/targets/eda_loop.
"""

from __future__ import annotations

import os
import re

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.tests.unit.extensions.eda_source import ROOT, RULEBOOKS, load_source

MAPPING = {'GpuXidFault': 'remediate', 'GpuRebootWanted': 'remediate', 'GpuOrphanedMemory': 'remediate',
           'GpuRogueProcess': 'rogue_cleanup', 'GpuIdleMemoryHeld': 'reclaim_idle'}


def load(*parts):
    with open(os.path.join(*parts)) as handle:
        return yaml.safe_load(handle)


LOCAL = load(RULEBOOKS, 'remediate_on_alert.yml')
CONTROLLER = load(RULEBOOKS, 'remediate_on_alert_controller.yml')


def acting_rules(rulebook):
    """{alert name: (rule, the action's name, its arguments)} of the rules that run something."""
    out = {}
    for rule in rulebook[0]['rules']:
        (kind, args), = rule['action'].items()
        if kind in ('run_playbook', 'run_job_template'):
            names = re.findall(r'"(Gpu\w+)"', rule['condition'])
            assert names, rule['name']
            for name in names:
                out[name] = (rule, kind, args)
    return out


def test_alert_names_are_those_of_the_shipped_prometheus_rules():
    shipped = set(r['alert'] for g in load(ROOT, 'extras', 'prometheus', 'gpufleet-rules.yml')['groups'] for r in g['rules'])
    assert set(MAPPING) <= shipped
    assert set(acting_rules(LOCAL)) == set(MAPPING)
    assert set(MAPPING) == set(load_source().ALERTNAMES)     # the source's default alert names


def test_each_alert_runs_its_playbook_on_its_node_with_its_confirmation():
    for name, (rule, kind, args) in acting_rules(LOCAL).items():
        playbook = MAPPING[name]
        assert kind == 'run_playbook' and args['name'] == 'gpufleet.reclaim.%s' % playbook, name
        assert os.path.exists(os.path.join(ROOT, 'playbooks', playbook + '.yml'))
        assert args['extra_vars'] == {'target_hosts': '{{ event.node }}',
                                      'reclaim_confirm': '{{ gpufleet_eda_confirm_%s | default(true) }}' % playbook}, name
        assert 'event.alert.status == "firing"' in rule['condition'], name
        assert rule['throttle'] == {'once_within': '10 minutes', 'group_by_attributes': ['event.node', 'event.alert.fingerprint']}
    assert LOCAL[0]['execution_strategy'] == 'sequential'
    (source_name, source_args), = [(k, v) for k, v in LOCAL[0]['sources'][0].items() if k != 'name']
    assert source_name == 'gpufleet.reclaim.alertmanager'
    assert "gpufleet_eda_host | default('127.0.0.1')" in source_args['host'] and 'gpufleet_eda_port' in source_args['port']
    storm = [r for r in LOCAL[0]['rules'] if 'gpufleet_storm' in r['condition']]
    assert len(storm) == 1 and 'debug' in storm[0]['action']


def test_the_controller_rulebook_is_the_same_rules_launching_the_job_templates():
    awx = load(ROOT, 'extras', 'awx', 'job_templates.yml')['controller_templates']
    templates = dict((t['name'], t) for t in awx)
    local, controller = LOCAL[0], CONTROLLER[0]
    assert [r['name'] for r in local['rules']] == [r['name'] for r in controller['rules']]
    for mine, theirs in zip(local['rules'], controller['rules']):
        assert (mine['condition'], mine.get('throttle')) == (theirs['condition'], theirs.get('throttle'))
    assert local['sources'][0]['gpufleet.reclaim.alertmanager'].keys() == controller['sources'][0]['gpufleet.reclaim.alertmanager'].keys()
    mine, theirs = acting_rules(LOCAL), acting_rules(CONTROLLER)
    for name, (_rule, kind, args) in theirs.items():
        assert kind == 'run_job_template', name
        template = templates[args['name']]
        assert template['playbook'] == MAPPING[name] + '.yml', (name, template['playbook'])
        assert template['ask_variables_on_launch'] is True and template['ask_limit_on_launch'] is True, args['name']
        assert args['job_args']['extra_vars'] == mine[name][2]['extra_vars']
        assert 'gpufleet_eda_organization' in args['organization']


@pytest.mark.parametrize('name', ['remediate_on_alert.yml', 'remediate_on_alert_controller.yml'])
def test_ansible_rulebook_accepts_the_rulebook(name):
    validators = pytest.importorskip('ansible_rulebook.validators', reason='ansible-rulebook is in tests/requirements-dev.txt')
    condition_parser = pytest.importorskip('ansible_rulebook.condition_parser')
    data = load(RULEBOOKS, name)
    validators.Validate.rulebook(data)                 # its JSON schema
    for rule in data[0]['rules']:                      # its condition grammar (the rules engine gets what this makes)
        assert condition_parser.parse_condition(rule['condition']), rule['name']
    assert len(data[0]['rules']) == 4
