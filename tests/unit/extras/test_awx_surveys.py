# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The AWX / Automation Controller content in extras/awx/ against the playbooks it drives.

* every survey spec is well formed for the controller's survey_spec endpoint;
* every survey variable is used by its playbook (or, for gpu_guard_*, is a variable of the guard
  role the playbook applies), with the same default the playbook falls back to;
* confirmation variables default to "false" and the playbooks read them through | bool, so the
  survey's string "false" never confirms;
* the job templates and the schedule point at existing wrappers and surveys, and the scheduled
  rogue_cleanup runs in report-only mode.
"""

from __future__ import annotations

import os
import re

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
AWX = os.path.join(ROOT, 'extras', 'awx')
PLAYBOOKS = ['inventory_report', 'rogue_cleanup', 'reclaim_idle', 'reset_unhealthy', 'remediate', 'guard_deploy', 'audit']
TYPES = ('text', 'textarea', 'password', 'integer', 'float', 'multiplechoice', 'multiselect')
VARIABLE_RE = re.compile(r'^[a-z_][a-z0-9_]*$')


def load(*parts):
    with open(os.path.join(*parts), encoding='utf-8') as handle:
        return yaml.safe_load(handle)


def read(*parts):
    with open(os.path.join(*parts), encoding='utf-8') as handle:
        return handle.read()


def survey(name):
    return load(AWX, 'surveys', name + '.yml')


def playbook_text(name):
    """The playbook without comments and task names (they mention variables in prose)."""
    lines = read(ROOT, 'playbooks', name + '.yml').splitlines()
    return '\n'.join(line for line in lines if not re.match(r'\s*(#|- name:|name:)', line))


def guard_role_variables():
    specs = load(ROOT, 'roles', 'guard', 'meta', 'argument_specs.yml')
    return specs['argument_specs']['main']['options']


def playbook_default(text, variable):
    """The literal in ``variable | default(...)`` in a playbook, or None when it has none."""
    found = re.findall(r'\b%s\s*\|\s*default\(([^()]*)\)' % re.escape(variable), text)
    return found[0].strip() if found else None


def normalise(literal):
    """A Jinja literal from default(...) as the survey would spell it (text)."""
    literal = literal.split(',')[0].strip()  # default(x, true): the value is the first argument
    if literal[:1] in ('"', "'"):
        return literal[1:-1]
    return literal


@pytest.mark.parametrize('name', PLAYBOOKS)
def test_survey_is_well_formed(name):
    spec = survey(name)
    assert set(spec) == {'name', 'description', 'spec'}
    assert spec['name'] and spec['description']
    seen = set()
    for question in spec['spec']:
        where = '%s: %s' % (name, question.get('variable'))
        assert {'question_name', 'question_description', 'variable', 'type', 'required', 'default'} <= set(question), where
        assert VARIABLE_RE.match(question['variable']), '%s: flat variable names only' % where
        assert question['variable'] not in seen, '%s: asked twice' % where
        seen.add(question['variable'])
        assert question['type'] in TYPES, where
        assert isinstance(question['required'], bool), where
        default = question['default']
        if question['type'] == 'integer':
            assert isinstance(default, int) and not isinstance(default, bool), where
            assert question['min'] <= default <= question['max'], where
        elif question['type'] in ('multiplechoice', 'multiselect'):
            choices = question['choices']
            assert isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices), where
            assert len(set(choices)) == len(choices), where
            assert default in choices, where
        else:
            assert isinstance(default, str), where
            assert question['min'] <= len(default) <= question['max'], where
            if question['required']:
                assert default, '%s: a required text question needs a default' % where
    assert 'target_hosts' in seen
    assert spec['spec'][0]['variable'] == 'target_hosts'


@pytest.mark.parametrize('name', PLAYBOOKS)
def test_every_survey_variable_is_used_with_the_same_default(name):
    text = playbook_text(name)
    role = guard_role_variables() if name == 'guard_deploy' else {}
    for question in survey(name)['spec']:
        variable, default = question['variable'], question['default']
        if variable in role:
            assert 'name: gpufleet.reclaim.guard\n' in read(ROOT, 'playbooks', name + '.yml'), '%s: the guard role is not applied' % name
            assert str(role[variable].get('default')) == str(default), '%s: %s default differs from the role' % (name, variable)
            if 'choices' in role[variable]:
                assert set(question['choices']) <= set(str(c) for c in role[variable]['choices']), variable
            continue
        assert re.search(r'\b%s\b' % re.escape(variable), text), \
            '%s: survey variable %s is not used by the playbook' % (name, variable)
        literal = playbook_default(text, variable)
        if literal is None:
            assert not question['required'] or variable == 'guard_policy', '%s: %s has no default in the playbook' % (name, variable)
            continue
        assert normalise(literal) == str(default) or (normalise(literal) in ('[]', '', 'omit') and default == ''), \
            '%s: %s defaults to %s in the playbook but %r in the survey' % (name, variable, literal, default)


@pytest.mark.parametrize('name', PLAYBOOKS)
def test_confirmations_default_to_false_and_are_read_as_booleans(name):
    text = playbook_text(name)
    for question in survey(name)['spec']:
        variable = question['variable']
        if question['type'] == 'multiplechoice' and set(question['choices']) == {'true', 'false'}:
            # every use goes through | bool, so the survey's string "false" is false (a module option of the same
            # name, `kill_application_xids: "{{ ... }}"`, is no use of the variable)
            uses = re.findall(r'\b%s\b(?![=:])[^}\n]*' % re.escape(variable), text)
            assert uses, variable
            for use in uses:
                assert re.match(r'%s\s*\|\s*default\([^)]*\)\s*\|\s*bool' % re.escape(variable), use), \
                    '%s: %s must be read as "%s | default(...) | bool", not %r' % (name, variable, variable, use)
        if 'confirm' in variable:
            assert question['default'] == 'false' and question['type'] == 'multiplechoice', variable
            assert playbook_default(text, variable) == 'false', variable


def test_destructive_playbooks_ask_for_confirmation():
    for name in ('rogue_cleanup', 'reclaim_idle', 'reset_unhealthy', 'remediate'):
        variables = [q['variable'] for q in survey(name)['spec']]
        assert 'reclaim_confirm' in variables, name
        assert 'check_mode: "{{ ansible_check_mode or not gpufleet_confirmed }}"' in playbook_text(name), name


def test_job_templates_and_schedule():
    config = load(AWX, 'job_templates.yml')
    templates = config['controller_templates']
    names = [t['name'] for t in templates]
    assert len(names) == len(set(names))
    assert sorted(os.path.splitext(t['playbook'])[0] for t in templates) == sorted(PLAYBOOKS)
    project = config['controller_projects'][0]['name']
    for template in templates:
        assert template['project'] == project
        assert os.path.exists(os.path.join(AWX, 'project', template['playbook'])), template['playbook']
        assert template['survey_enabled'] is True
        stem = os.path.splitext(template['playbook'])[0]
        assert template['survey_spec'] == "{{ lookup('ansible.builtin.file', 'surveys/%s.yml') | from_yaml }}" % stem
        assert template['job_type'] == 'run'
        assert template.get('ask_job_type_on_launch') is True, 'job_type check must be selectable at launch'
        wrapper = load(AWX, 'project', template['playbook'])
        assert wrapper[0]['ansible.builtin.import_playbook'] == 'gpufleet.reclaim.%s' % stem
    schedules = config['controller_schedules']
    rogue = [s for s in schedules if s['unified_job_template'] == [t['name'] for t in templates
                                                                   if t['playbook'] == 'rogue_cleanup.yml'][0]]
    assert len(rogue) == 1
    assert rogue[0]['extra_data']['reclaim_confirm'] in (False, 'false')
    assert rogue[0]['rrule'].startswith('DTSTART') and 'FREQ=' in rogue[0]['rrule']
    requirements = load(AWX, 'project', 'collections', 'requirements.yml')
    assert [c['name'] for c in requirements['collections']] == ['gpufleet.reclaim']
