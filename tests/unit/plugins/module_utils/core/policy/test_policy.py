# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The policy engine: schema validation and every rule type, on fake snapshots with a fake clock."""

from __future__ import annotations

import datetime
import json

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import documents
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import identity as I
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.history import SampleStore
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import (
    BOMB_LINE, DEEP_TOML, GIB, MONDAY_NOON, TOO_DEEP, TOO_MANY_ALIASED, billion_laughs, pids, proc, rules, snapshot)

NO_GROUPS = P.Context(groups={})


def load(text, source='policy.yaml'):
    return P.load_policy_text(text, source)


def evaluate(policy, snap, state=None, now=MONDAY_NOON, context=NO_GROUPS):
    if isinstance(policy, str):
        policy = load(policy)
    return P.evaluate(policy, snap, state or {}, now, context)


def errors_of(text, source='policy.yaml'):
    with pytest.raises(P.PolicyError) as info:
        load(text, source)
    return info.value


def utc(*args):
    return datetime.datetime(*args, tzinfo=datetime.timezone.utc).timestamp()


# ============================================================================ loading and validation
def test_empty_policy_is_dry_run_and_finds_nothing():
    policy = load('')
    assert policy.mode == 'dry-run' and policy.enabled
    assert evaluate(policy, snapshot([proc(1, 'alice', {0: 70000})])) == []


def test_errors_name_the_file_the_path_and_the_value():
    exc = errors_of('users:\n  alice:\n    max_gpus: -1\nmode: sometimes\n', '/etc/gpufleet/policy.yaml')
    text = str(exc)
    assert "/etc/gpufleet/policy.yaml:3: users.alice.max_gpus: invalid value -1" in text          # the line of the key
    assert "/etc/gpufleet/policy.yaml:4: mode: invalid value 'sometimes': expected one of dry-run, warn or enforce" in text
    assert text.index('policy.yaml:3:') < text.index('policy.yaml:4:')                            # in the order of the file
    assert ('users.alice.max_gpus', -1) in [(p, v) for p, v, _w in exc.errors]


@pytest.mark.parametrize('text, path, fragment', [
    ('colour: blue', 'colour', 'unknown key'),
    ('defaults: {max_mem_gib: 8}', 'defaults.max_mem_gib', 'ambiguous'),
    ('defaults: {max_runtime: 72}', 'defaults.max_runtime', 'write a unit'),
    ('defaults: {max_runtime: 3 fortnights}', 'defaults.max_runtime', 'unit'),
    ('defaults: {max_mem_gib_total: lots}', 'defaults.max_mem_gib_total', 'expected a size'),
    ('defaults: {max_gpus: 1.5}', 'defaults.max_gpus', 'whole number'),
    ('defaults: {action: explode}', 'defaults.action', 'expected one of warn, terminate'),
    ('defaults: {idle: {util_max_pct: 5}}', 'defaults.idle', 'needs "for"'),
    ('defaults: {idle: {for: 10m, util_max_pct: 150}}', 'defaults.idle.util_max_pct', 'percentage'),
    ('users: {alice: [1, 2]}', 'users.alice', 'mapping'),
    ('time_windows: [{start: "25:00", end: "06:00", limits: {max_gpus: 1}}]', 'time_windows[0].start', 'HH:MM'),
    ('time_windows: [{days: [funday], start: "09:00", end: "17:00", limits: {max_gpus: 1}}]', 'time_windows[0].days', 'unknown day'),
    ('time_windows: [{start: "09:00", end: "17:00", tz: Mars/Olympus, limits: {max_gpus: 1}}]', 'time_windows[0].tz', 'time zone'),
    ('time_windows: [{start: "09:00", end: "17:00"}]', 'time_windows[0]', 'changes limits'),
    ('exemptions: [{match: {user: alice}, expires: 2030-01-01}]', 'exemptions[0].match', 'identity'),
    ('exemptions: [{match: {exe_sha256: "' + 'a' * 64 + '"}}]', 'exemptions[0].expires', 'expiry date'),
    ('exemptions: [{match: {exe_sha256: "abc"}, expires: 2030-01-01}]', 'exemptions[0].match.exe_sha256', 'SHA-256'),
    ('exemptions: [{match: {slurm_job: 12}, rules: [nap], expires: 2030-01-01}]', 'exemptions[0].rules', 'unknown rule'),
    ('rogue: {act_min_level: critical, require_hard_indicator: false}', 'rogue.require_hard_indicator', 'hard indicator'),
    ('rogue: {act_min_level: info}', 'rogue.act_min_level', 'medium, high or critical'),
    ('notify: {command: "/usr/bin/logger hi"}', 'notify.command', 'never a shell'),
    ('notify: {command: [logger]}', 'notify.command', 'absolute path'),
    ('notify: {webhook: {url: "ftp://x"}}', 'notify.webhook.url', 'http'),
    ('escalation: {warn_again_after: 20m, act_after: 10m}', 'escalation.warn_again_after', 'before the action'),
    ('escalation: [{after: 0, action: warn}]', 'escalation.steps', 'the last step acts'),
    ('escalation: {clear_after: 90}', 'escalation.clear_after', 'write a unit'),
    ('escalation: {clear_after: soon}', 'escalation.clear_after', 'expected a duration'),
    ('escalation: {clear_after: -1m}', 'escalation.clear_after', 'expected a duration'),
    ('gpus: {"7-3": {reserved_for: [alice]}}', 'gpus.7-3', 'range'),
    ('gpus: {"0": {reserved_for: ["@nobody"]}}', 'gpus.0.reserved_for', 'no such list'),
    ('groups: {phd: {members: [a], unix_group: phd}}', 'groups.phd', 'not both'),
    ('protect: [{user: root, name: x}]', 'protect[0]', 'one key'),
    ('version: 2', 'version', 'version 1'),
    ('rules: [{user: alice}]', 'rules[0]', 'sets no limit'),
    ('rules: ["--user alice --max-mem"]', 'rules[0]', 'needs a value'),
    ('rules: ["--colour red"]', 'rules[0]', 'unknown option'),
])
def test_invalid_values_are_named(text, path, fragment):
    exc = errors_of(text)
    assert any(p == path and fragment in why for p, _v, why in exc.errors), exc.errors


@pytest.mark.parametrize('key', ['0:1:2:3', '0::1', '0:', ':1'])
def test_a_malformed_mig_device_key_is_named(key):
    exc = errors_of('gpus: {"%s": {reserved_for: [alice]}}' % key)
    assert [(p, v, 'GPU:GI or GPU:GI:CI' in why) for p, v, why in exc.errors] == [('gpus["%s"]' % key, key, True)], exc.errors
    exc = errors_of('users: {alice: {allowed_gpus: ["1", "%s"]}}' % key)
    assert any(p == 'users.alice.allowed_gpus' and v == key for p, v, _w in exc.errors), exc.errors


def test_mig_device_keys_parse_as_the_selector_writes_them():
    policy = load('gpus:\n  "0:1": {reserved_for: [alice]}\n  "2:3:1, MIG-GPU-1234abcd/3/1": {blocked_users: [bob]}\n'
                  'users: {alice: {allowed_gpus: "1, 0:2"}}\n')
    assert [(r.gpus.mig_names, sorted(r.gpus.indexes)) for r in policy.gpus] == [
        (('0:1',), []), (('2:3:1', 'mig-gpu-1234abcd/3/1'), [])]
    assert policy.limits_for('alice', MONDAY_NOON, NO_GROUPS).allowed_gpus.mig_names == ('0:2',)


def test_duplicate_yaml_keys_are_an_error():
    exc = errors_of('users:\n  alice: {max_gpus: 1}\n  alice: {max_gpus: 2}\n')
    assert 'duplicate key' in str(exc) and 'alice' in str(exc)


# ---------------------------------------------------------------------------- document limits (nesting, alias bombs)
def nested_yaml(levels):
    """A block mapping ``levels`` deep: a:\n  a:\n ... a: 1 (``{a: 1}`` is one level)."""
    return ''.join('  ' * i + 'a:\n' for i in range(levels - 1)) + '  ' * (levels - 1) + 'a: 1\n'


@pytest.mark.parametrize('text, source', [
    (DEEP_TOML, 'policy.toml'),
    (DEEP_TOML, '<stdin>'),                                       # unnamed: sniffed as TOML
    ('[%s]\nx = 1\n' % '.'.join(['t'] * 40), 'policy.toml'),   # a TOML table header
    ('x = ' + '[' * 40 + ']' * 40 + '\n', 'policy.toml'),        # TOML arrays
    ('x = ' + '{a = ' * 2000 + '1' + '}' * 2000 + '\n', 'policy.toml'),  # TOML inline tables (the parser recurses)
    (nested_yaml(P.MAX_NESTING + 1), 'policy.yaml'),
    ('[' * 5000 + ']' * 5000, 'policy.yaml'),                     # YAML flow (and JSON) sequences
    ('{"a": ' * 5000 + '1' + '}' * 5000, 'policy.yaml'),
    ('{"a": ' * 5000 + '1' + '}' * 5000, 'policy.json'),
], ids=['toml-dotted-keys', 'toml-sniffed', 'toml-table', 'toml-arrays', 'toml-inline-tables', 'yaml-block', 'yaml-flow',
        'json-as-yaml', 'json'])
def test_nesting_past_the_limit_is_a_clean_policy_error(text, source):
    exc = errors_of(text, source)
    assert exc.errors == [('', None, exc.errors[0][2])] and TOO_DEEP in exc.errors[0][2]
    assert TOO_DEEP in str(exc) and str(exc).startswith(source + ': ')


def test_nesting_past_the_limit_without_pyyaml(monkeypatch):
    monkeypatch.setattr(documents, 'yaml_module', lambda: None)            # JSON only
    for text in ('{"a": ' * 5000 + '1' + '}' * 5000, '[' * 100000 + ']' * 100000):
        assert TOO_DEEP in str(errors_of(text))


def test_nesting_up_to_the_limit_is_read():
    assert load('metadata:\n' + ''.join('  ' * (i + 1) + 'a:\n' for i in range(P.MAX_NESTING - 2))
                + '  ' * P.MAX_NESTING + 'a: 1\n').mode == 'dry-run'                  # 32 levels, metadata included
    assert P.read_document(nested_yaml(P.MAX_NESTING)) is not None
    with pytest.raises(P.PolicyError):
        P.read_document(nested_yaml(P.MAX_NESTING + 1))


def test_a_deep_mapping_from_gpu_audit_is_refused_too():
    """gpu_audit's policy= may be a mapping: it is validated by the same parse_policy."""
    data = 1
    for _level in range(3000):
        data = {'metadata': data}
    with pytest.raises(P.PolicyError) as info:
        P.parse_policy(data, 'policy')
    assert TOO_DEEP in str(info.value)


def test_yaml_alias_bomb_is_refused_while_composing():
    assert TOO_DEEP == 'mappings and lists nested more than %d levels deep (the limit)' % P.MAX_NESTING
    assert TOO_MANY_ALIASED == 'aliases expand to more than %d nodes (the limit)' % P.MAX_ALIAS_NODES
    exc = errors_of(billion_laughs())
    assert 'line %d: %s' % (BOMB_LINE, TOO_MANY_ALIASED) in str(exc)
    loader = P.yaml_loader()(billion_laughs())
    try:
        with pytest.raises(P.DocumentLimitError) as info:
            loader.get_single_node()
        assert info.value.line == BOMB_LINE and len(loader.extents) < 100     # refused after ~60 composed nodes, not 9**9
        assert loader.alias_nodes <= P.MAX_ALIAS_NODES + 9 ** 6
    finally:
        loader.dispose()


def test_aliases_that_nest_past_the_limit_are_refused():
    inner = '[' * 10 + '%s' + ']' * 10
    text = 'a: &a %s\nb: &b %s\nc: &c %s\nd: %s\n' % (inner % 1, inner % '*a', inner % '*b', inner % '*c')
    assert 'line 4: ' + TOO_DEEP in str(errors_of(text))
    assert 'recursive alias' in str(errors_of('metadata: &m [1, *m]\n'))


def test_ordinary_anchors_and_merge_keys_still_work():
    policy = load('lists: {team: &team [alice, bob]}\n'
                  'defaults: &base {max_gpus: 2, max_procs: 4}\n'
                  'groups: {phd: {members: *team, max_gpus: 3}}\n'
                  'users: {carol: {<<: *base, max_mem_gib_total: 8}}\n')
    assert policy.users['carol']['max_gpus'] == 2 and policy.users['carol']['max_procs'] == 4
    assert policy.defaults['max_gpus'] == 2


def test_clear_after_default_and_both_escalation_forms():
    assert load('mode: warn').escalation.clear_after == P.CLEAR_AFTER == 60.0
    assert load('escalation: {act_after: 10m, clear_after: 15m}').escalation.to_dict()['clear_after'] == 900.0
    steps = load('escalation: {steps: [{after: 0}, {after: 5m, action: terminate}], clear_after: 0s}').escalation
    assert steps.clear_after == 0.0 and steps.act_at == 300.0


def test_every_error_is_reported_not_only_the_first():
    exc = errors_of('mode: x\nusers: {alice: {max_gpus: -1}}\ngroups: {phd: {max_procs: nope}}\n')
    assert len(exc.errors) == 3


def test_not_a_policy_at_all():
    exc = errors_of('just some words')
    assert 'policy.yaml' in str(exc)
    exc = errors_of('[unclosed')
    assert str(exc) == "policy.yaml: line 1, column 10: YAML syntax error: expected ',' or ']', but got '<stream end>'"
    assert exc.lines == [1] and exc.errors == [('', None, str(exc)[len('policy.yaml: '):])]


def test_sizes_accept_units_and_gpukill_style_strings():
    policy = load('defaults: {max_mem_gib_per_gpu: "8GB", max_mem_gib_total: 8}\n'
                  'users: {bob: {max_mem_per_gpu: "512MiB"}, carol: {max_mem_mib_per_gpu: 4096}}')
    assert policy.defaults['max_mem_mib_per_gpu'] == 8 * GIB
    assert policy.defaults['max_mem_mib_total'] == 8 * GIB
    assert policy.users['bob']['max_mem_mib_per_gpu'] == 512
    assert policy.users['carol']['max_mem_mib_per_gpu'] == 4096


def test_the_policy_records_its_hash_and_summary():
    policy = load('mode: enforce\n')
    assert len(policy.sha256) == 64
    assert policy.summary()['mode'] == 'enforce'


def test_load_policy_reads_a_file_and_names_a_missing_one(tmp_path):
    path = tmp_path / 'p.yaml'
    path.write_text('mode: warn\n')
    assert P.load_policy(str(path)).mode == 'warn'
    with pytest.raises(P.PolicyError) as info:
        P.load_policy(str(tmp_path / 'missing.yaml'))
    assert 'missing.yaml' in str(info.value) and 'cannot read' in str(info.value)


def test_json_policy():
    assert load(json.dumps({'mode': 'enforce', 'users': {'alice': {'max_gpus': 1}}})).users['alice'] == {'max_gpus': 1}


# ============================================================================ shorthand and gpu-kill
def test_gpukill_shorthand_list_entry():
    policy = load('[{user: "*", max_memory_gb: 12, action: kill}]')
    assert policy.defaults == {'max_mem_mib_total': 12 * GIB, 'action': 'kill'}
    found = evaluate(policy, snapshot([proc(1, 'alice', {0: 10 * GIB}), proc(2, 'alice', {1: 4 * GIB}),
                                       proc(3, 'bob', {2: 6 * GIB})]))
    assert [(v.rule, v.user, v.pids, v.action) for v in found] == [('max_mem_total', 'alice', [1], 'kill')]


def test_shorthand_cli_style_strings_and_scopes():
    policy = load('rules:\n  - "--user alice --max-mem 8GB --action kill"\n  - {group: phd, max_gpus: 2}\n'
                  '  - {users: [bob, carol], max_procs: 1}\n  - {max_runtime: 2d}\n')
    assert policy.users['alice'] == {'max_mem_mib_total': 8 * GIB, 'action': 'kill'}
    assert policy.group('phd').limits == {'max_gpus': 2}
    assert policy.users['bob'] == {'max_procs': 1} and policy.users['carol'] == {'max_procs': 1}
    assert policy.defaults == {'max_runtime_s': 2 * 86400}


def test_shorthand_conflicts_are_errors():
    exc = errors_of('rules: [{user: alice, max_gpus: 1}, {user: alice, max_gpus: 2}]')
    assert 'given twice' in str(exc)


GPUKILL_DOC_EXAMPLE = '''
[user_policies.developer]
username = "developer"
memory_limit_gb = 8.0
utilization_limit_pct = 70.0
duration_limit_hours = 12.0
max_concurrent_processes = 3
priority = 5
allowed_gpus = []
blocked_gpus = []
time_overrides = []

[group_policies.researchers]
group_name = "researchers"
total_memory_limit_gb = 32.0
total_utilization_limit_pct = 80.0
max_concurrent_processes = 10
priority = 3
allowed_gpus = [0, 1]
blocked_gpus = []
members = ["alice", "bob", "charlie"]

[gpu_policies."0"]
gpu_index = 0
max_memory_gb = 24.0
max_utilization_pct = 90.0
reserved_memory_gb = 2.0
allowed_users = ["alice", "bob"]
blocked_users = []
maintenance_window = null

[[time_policies]]
name = "business_hours"
start_time = "09:00"
end_time = "17:00"
days_of_week = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
memory_limit_gb = 16.0
utilization_limit_pct = 80.0
max_concurrent_processes = 5
'''


def test_gpukill_documented_example_works_without_its_null():
    # gpu-kill's documented example writes maintenance_window = null, which TOML does not have: the
    # standard parser refuses it, with the line and what to do
    exc = errors_of(GPUKILL_DOC_EXAMPLE, 'guard_mode_config.toml')
    assert str(exc) == ('guard_mode_config.toml: line 30, column 22: TOML syntax error: Invalid value '
                        '(TOML has no null: leave the key out)')
    policy = load(GPUKILL_DOC_EXAMPLE.replace('maintenance_window = null\n', ''), 'guard_mode_config.toml')
    assert policy.format == 'gpu-kill' and policy.mode == 'dry-run'
    assert policy.users['developer'] == {'max_mem_mib_total': 8 * GIB, 'max_runtime_s': 12 * 3600.0, 'max_procs': 3}
    group = policy.group('researchers')
    assert group.members == frozenset(['alice', 'bob', 'charlie'])
    assert group.aggregate == {'group_max_mem_mib_total': 32 * GIB, 'group_max_procs': 10}
    assert policy.gpus[0].max_mem_mib_total == 22 * GIB
    assert any('utilization' in note for note in policy.notes)
    saturday = utc(2026, 3, 7, 12, 0)
    snap = snapshot([
        proc(1, 'developer', {1: 6 * GIB}, ct=saturday - 13 * 3600), proc(2, 'developer', {2: 4 * GIB}, ct=saturday - 60),
        proc(3, 'alice', {2: 1 * GIB}), proc(4, 'dave', {0: 1 * GIB}),
        proc(5, 'bob', {0: 18 * GIB}), proc(6, 'charlie', {1: 16 * GIB}),
    ])
    found = evaluate(policy, snap, now=saturday)
    by_rule = dict((v.rule, v) for v in found if v.rule != 'gpu_reserved')
    assert by_rule['max_mem_total'].user == 'developer' and by_rule['max_mem_total'].pids == [1]
    assert by_rule['max_runtime'].pids == [1]
    assert by_rule['gpu_access'].user == 'alice' and by_rule['gpu_access'].pids == [3]  # researchers: GPUs 0 and 1 only
    assert by_rule['group_max_mem_total'].pids == [5]                                    # 35 GiB > 32 GiB: bob's 18 GiB
    assert [(v.user, v.pids) for v in found if v.rule == 'gpu_reserved'] == [('dave', [4])]
    # business hours (Monday 12:00 UTC): 16 GB and 5 processes for everyone
    monday = utc(2026, 3, 2, 12, 0)
    busy = snapshot([proc(10 + i, 'erin', {1 + i % 3: 4 * GIB}, ct=monday - 60) for i in range(6)])
    assert rules(evaluate(policy, busy, now=monday)) == ['max_mem_total', 'max_procs']
    assert evaluate(policy, busy, now=saturday) == []


def test_gpukill_json_api_form_and_enforcement_settings():
    doc = {'global': {'enabled': True, 'dry_run': False, 'default_memory_limit_gb': 16.0, 'default_utilization_limit_pct': 80.0},
           'user_policies': {'developer': {'username': 'developer', 'memory_limit_gb': 8.0, 'utilization_limit_pct': 70.0,
                                           'max_concurrent_processes': 3}},
           'enforcement': {'soft_enforcement': True, 'hard_enforcement': True, 'grace_period_seconds': 300, 'max_warnings': 3,
                           'notifications': {'console': True, 'log_file': True, 'email': False, 'email_recipients': [],
                                             'webhook': True, 'webhook_url': 'https://hooks.example/x'}}}
    policy = load(json.dumps(doc), 'guard_config.json')
    assert policy.mode == 'enforce'
    assert policy.defaults == {'max_mem_mib_total': 16 * GIB, 'max_procs': 5}   # gpu-kill: defaults plus 5 processes
    assert policy.escalation.act_at == 300 and policy.escalation.warn_at == [0, 100, 200]
    assert policy.notify.webhook_url == 'https://hooks.example/x'
    doc['enforcement']['hard_enforcement'] = False
    assert load(json.dumps(doc)).mode == 'warn'
    doc['global']['enabled'] = False
    disabled = load(json.dumps(doc))
    assert not disabled.enabled and evaluate(disabled, snapshot([proc(1, 'x', {0: 70 * GIB})])) == []


def test_gpukill_yaml_form_days_as_numbers_and_time_overrides():
    text = '''
user_policies:
  night_owl:
    memory_limit_gb: 4
    time_overrides:
      - {start_time: "22:00", end_time: "06:00", days_of_week: [5], overrides: {memory_limit_gb: 40}}
time_policies:
  - {name: weekend, start_time: "00:00", end_time: "00:00", days_of_week: [0, 6], memory_multiplier: 2.0}
'''
    policy = load(text)
    snap = snapshot([proc(1, 'night_owl', {0: 20 * GIB})])
    friday_night = utc(2026, 3, 6, 23, 0)        # Friday (5) 23:00 UTC: override active
    saturday_morning = utc(2026, 3, 7, 5, 0)     # still Friday's window (across midnight)
    saturday_noon = utc(2026, 3, 7, 12, 0)       # weekend multiplier only: 8 GiB
    assert evaluate(policy, snap, now=friday_night) == []
    assert evaluate(policy, snap, now=saturday_morning) == []
    assert [v.limit for v in evaluate(policy, snap, now=saturday_noon)] == [8 * GIB]


def test_gpukill_mixed_with_gpufleet_keys_is_an_error():
    assert 'do not mix' in str(errors_of('user_policies: {a: {memory_limit_gb: 1}}\nmode: enforce\n'))


def test_gpukill_unknown_field_and_wrong_username():
    assert 'unknown key' in str(errors_of('[user_policies.a]\nmemory_limit = 1\n', 'policy.toml'))
    assert 'table name' in str(errors_of('[user_policies.a]\nusername = "b"\n', '<stdin>'))


def test_toml_is_read_by_tomllib_or_tomli():
    data = P.read_document('a = 1\n"b c" = \'lit\'\n[t.u]\nx = [1, 2,\n # c\n 3,]\ny = {z = true}\n[[arr]]\nn = 1\n[[arr]]\nn = 2\n'
                           's = """\nmulti\\\n  line"""\nf = -1_000.5e0\nh = 0x1F\nd = 2026-03-02T10:00:00Z\n', 'policy.toml')
    assert data['a'] == 1 and data['b c'] == 'lit' and data['t']['u']['x'] == [1, 2, 3] and data['t']['u']['y'] == {'z': True}
    assert [a['n'] for a in data['arr']] == [1, 2]
    assert data['arr'][1]['s'] == 'multiline' and data['arr'][1]['f'] == -1000.5 and data['arr'][1]['h'] == 31
    assert data['arr'][1]['d'] == '2026-03-02T10:00:00+00:00'
    for bad, line in (('a = 1\na = 2\n', 2), ('[t]\n[t]\n', 2), ('a = "open\n', 1), ('x = @\n', 1)):
        with pytest.raises(P.PolicyError) as info:
            P.read_document(bad, 'policy.toml')
        assert info.value.lines == [line] and str(info.value).startswith('policy.toml: line %d, column ' % line), bad
        assert 'TOML syntax error: ' in str(info.value) and 'invalid value' not in str(info.value)


def test_toml_without_tomllib_or_tomli_names_the_package(monkeypatch):
    monkeypatch.setattr(documents, '_TOML', [None])
    with pytest.raises(P.PolicyError) as info:
        P.load_policy_text('mode = "warn"\n', 'policy.toml')
    assert str(info.value) == 'policy.toml: ' + P.TOML_MISSING and 'install tomli' in P.TOML_MISSING


# ============================================================================ memory, GPUs, processes
def test_memory_messages_show_the_difference_rounding_would_hide():
    found = evaluate('users: {alice: {max_mem_gib_total: 19.5}}', snapshot([proc(1, 'alice', {0: 19.5 * GIB + 1})]))
    assert found[0].message == 'alice uses 19969 MiB of GPU memory in total, more than the 19968 MiB allowed'
    found = evaluate('users: {alice: {max_mem_mib_total: 100}}', snapshot([proc(1, 'alice', {0: 100.25})]))
    assert 'uses 100.250 MiB of GPU memory in total, more than the 100.000 MiB allowed' in found[0].message
    found = evaluate('users: {alice: {max_mem_gib_total: 19.5}}', snapshot([proc(1, 'alice', {0: 24 * GIB})]))
    assert 'uses 24.0 GiB of GPU memory in total, more than the 19.5 GiB allowed' in found[0].message


def test_max_mem_per_gpu_names_only_the_offending_process():
    policy = 'users: {alice: {max_mem_gib_per_gpu: 8}}'
    snap = snapshot([proc(1, 'alice', {0: 12 * GIB}), proc(2, 'alice', {1: 6 * GIB}), proc(3, 'bob', {0: 40 * GIB})])
    found = evaluate(policy, snap)
    assert [(v.rule, v.gpu, v.pids, v.measured, v.limit) for v in found] == [('max_mem_per_gpu', 0, [1], 12 * GIB, 8 * GIB)]


def test_fewest_processes_largest_first_never_all():
    policy = 'users: {alice: {max_mem_gib_per_gpu: 8}}'
    snap = snapshot([proc(1, 'alice', {0: 12 * GIB}), proc(2, 'alice', {0: 6 * GIB})])
    assert pids(evaluate(policy, snap)) == [1]          # ending the 12 GiB one is enough: the 6 GiB one stays
    snap = snapshot([proc(1, 'alice', {0: 3 * GIB}), proc(2, 'alice', {0: 4 * GIB}), proc(3, 'alice', {0: 5 * GIB})])
    assert pids(evaluate(policy, snap)) == [3]          # 12 -> 7 GiB with one process, the largest


def test_ties_are_broken_by_the_newest_process():
    policy = 'users: {alice: {max_mem_gib_total: 10}}'
    snap = snapshot([proc(1, 'alice', {0: 4 * GIB}, ct=100), proc(2, 'alice', {1: 4 * GIB}, ct=300),
                     proc(3, 'alice', {2: 4 * GIB}, ct=200)])
    assert pids(evaluate(policy, snap)) == [2]


def test_max_mem_total_counts_every_gpu_of_a_process():
    policy = 'users: {alice: {max_mem_gib_total: 10}}'
    snap = snapshot([proc(1, 'alice', {0: 4 * GIB, 1: 4 * GIB}), proc(2, 'alice', {2: 3 * GIB})])
    found = evaluate(policy, snap)
    assert found[0].measured == 11 * GIB and found[0].pids == [1]


def test_unknown_memory_counts_as_zero_and_is_never_picked_first():
    policy = 'users: {alice: {max_mem_gib_total: 4}}'
    snap = snapshot([proc(1, 'alice', {0: None}), proc(2, 'alice', {1: 6 * GIB})])
    assert pids(evaluate(policy, snap)) == [2]


def test_max_gpus_frees_gpus_with_the_fewest_processes():
    policy = 'users: {alice: {max_gpus: 2}}'
    snap = snapshot([proc(1, 'alice', {0: 1 * GIB, 1: 1 * GIB}), proc(2, 'alice', {2: 20 * GIB}), proc(3, 'alice', {2: 1 * GIB})])
    found = evaluate(policy, snap)
    assert [(v.rule, v.measured, v.limit, v.pids) for v in found] == [('max_gpus', 3, 2, [1])]
    snap = snapshot([proc(1, 'alice', {0: 1 * GIB}), proc(2, 'alice', {1: 9 * GIB}), proc(3, 'alice', {2: 5 * GIB}),
                     proc(4, 'alice', {3: 5 * GIB})])
    assert pids(evaluate('users: {alice: {max_gpus: 2}}', snap)) == [2, 3]   # one process per GPU: free the two fullest


def test_max_procs_and_max_procs_per_gpu():
    snap = snapshot([proc(i, 'alice', {i % 2: i * GIB}) for i in range(1, 6)])
    found = evaluate('users: {alice: {max_procs: 3}}', snap)
    assert [(v.measured, v.limit, sorted(v.pids)) for v in found] == [(5, 3, [4, 5])]
    found = evaluate('users: {alice: {max_procs_per_gpu: 2}}', snap)
    assert [(v.gpu, v.pids) for v in found] == [(1, [5])]   # GPU 1 holds 1, 3, 5; GPU 0 holds 2 and 4


def test_max_runtime_per_process():
    now = MONDAY_NOON
    snap = snapshot([proc(1, 'alice', {0: GIB}, ct=now - 3 * 3600), proc(2, 'alice', {1: GIB}, ct=now - 600),
                     proc(3, 'alice', {2: GIB}, ct=None)])
    found = evaluate('users: {alice: {max_runtime: 2h}}', snap, now=now)
    assert [(v.rule, v.pids) for v in found] == [('max_runtime', [1])]
    assert evaluate('users: {alice: {max_runtime_h: 4}}', snap, now=now) == []


def _alice_at(rule, measured):
    """A snapshot whose alice measures ``measured`` on ``rule`` (MiB, GPUs, processes or seconds), and the state."""
    now, state = MONDAY_NOON, {}
    if rule in ('max_mem_total', 'max_mem_per_gpu', 'group_max_mem_total', 'gpu_max_mem_total'):
        procs = [proc(1, 'alice', {0: measured - 1024}), proc(2, 'alice', {0: 1024})]
    elif rule in ('max_gpus', 'group_max_gpus'):
        procs = [proc(1, 'alice', dict((g, 100) for g in range(measured)))]
    elif rule in ('max_procs', 'max_procs_per_gpu', 'group_max_procs'):
        procs = [proc(pid, 'alice', {0: 100}) for pid in range(1, measured + 1)]
    elif rule == 'max_runtime':
        procs = [proc(1, 'alice', {0: 100}, ct=now - measured)]
    else:  # idle: a process idle (0 %, holding more than mem_min) since ``measured`` seconds
        procs = [proc(1, 'alice', {0: 4 * GIB}, util=0)]
        state = {'idle': {'1:10': {'since': now - measured}}}
    return snapshot(procs, gpus=8), state


BOUNDARIES = [   # rule, policy, the limit as measured, the unit step; every one but idle fires only *over* its limit
    ('max_mem_total', 'users: {alice: {max_mem_mib_total: 8192}}', 8192, 1),
    ('max_mem_per_gpu', 'users: {alice: {max_mem_mib_per_gpu: 8192}}', 8192, 1),
    ('max_gpus', 'users: {alice: {max_gpus: 2}}', 2, 1),
    ('max_procs', 'users: {alice: {max_procs: 3}}', 3, 1),
    ('max_procs_per_gpu', 'users: {alice: {max_procs_per_gpu: 3}}', 3, 1),
    ('max_runtime', 'users: {alice: {max_runtime: 2h}}', 7200, 1),
    ('group_max_mem_total', 'groups: {lab: {members: [alice], group_max_mem_gib_total: 8}}', 8192, 1),
    ('group_max_gpus', 'groups: {lab: {members: [alice], group_max_gpus: 2}}', 2, 1),
    ('group_max_procs', 'groups: {lab: {members: [alice], group_max_procs: 3}}', 3, 1),
    ('gpu_max_mem_total', 'gpus: {"0": {max_mem_gib_total: 8}}', 8192, 1),
]


@pytest.mark.parametrize('rule, text, limit, step', BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_a_limit_holds_at_its_boundary_and_fires_just_over_it(rule, text, limit, step):
    """Exactly at the limit is allowed (the messages say "more than"); one unit over is a violation, measured as such."""
    policy = load(text)
    for measured, fires in ((limit - step, False), (limit, False), (limit + step, True)):
        snap, state = _alice_at(rule, measured)
        found = evaluate(policy, snap, state)
        assert [v.rule for v in found] == ([rule] if fires else []), (rule, measured)
        if fires:
            assert (found[0].measured, found[0].limit) == (measured, limit)


def test_the_idle_limit_fires_once_the_process_has_been_idle_for_its_duration():
    """``idle: {for: 10m}``: idle for 10 minutes is enough (the clock has run its duration); 1 s short is not."""
    policy = load(IDLE)
    for idle_for, fires in ((599, False), (600, True), (601, True)):
        snap, state = _alice_at('idle', idle_for)
        found = evaluate(policy, snap, state)
        assert [(v.rule, v.measured, v.limit) for v in found] == ([('idle', idle_for, 600)] if fires else []), idle_for


def test_gpu_access_allowed_and_blocked():
    snap = snapshot([proc(1, 'alice', {0: GIB}), proc(2, 'alice', {3: GIB}), proc(3, 'alice', {1: GIB, 2: GIB})])
    found = evaluate('users: {alice: {allowed_gpus: "0-1"}}', snap)
    assert [(v.rule, v.pids, v.measured) for v in found] == [('gpu_access', [2], [3]), ('gpu_access', [3], [2])]
    found = evaluate('users: {alice: {blocked_gpus: [0]}}', snap)
    assert pids(found) == [1]


def test_users_override_groups_which_override_defaults_in_order():
    policy = load('defaults: {max_gpus: 1}\ngroups:\n  phd: {members: [alice, bob], max_gpus: 2}\n'
                  '  lab: {max_gpus: 3}\nusers: {bob: {max_gpus: 4}}\n')
    context = P.Context(groups={'alice': ['lab'], 'carol': []})
    assert policy.limits_for('carol', MONDAY_NOON, context).max_gpus == 1
    assert policy.limits_for('alice', MONDAY_NOON, context).max_gpus == 3   # phd, then lab (written later)
    assert policy.limits_for('bob', MONDAY_NOON, context).max_gpus == 4
    assert policy.limits_for('dave', MONDAY_NOON, context).max_gpus == 1


def test_explicit_null_removes_an_inherited_limit():
    policy = load('defaults: {max_gpus: 1}\nusers: {boss: {max_gpus: null}}\n')
    snap = snapshot([proc(1, 'boss', {0: GIB}), proc(2, 'boss', {1: GIB})])
    assert evaluate(policy, snap) == []


def test_user_entry_expires():
    policy = load('defaults: {max_gpus: 1}\nusers: {alice: {max_gpus: 4, expires: 2026-03-01}}\n')
    snap = snapshot([proc(1, 'alice', {0: GIB}), proc(2, 'alice', {1: GIB})])
    assert evaluate(policy, snap, now=utc(2026, 3, 1, 23, 0)) == []
    assert rules(evaluate(policy, snap, now=utc(2026, 3, 2, 0, 1))) == ['max_gpus']


def test_group_aggregates_unix_groups_and_named_lists():
    policy = load('lists: {interns: [ivan, ida]}\ngroups:\n  vision: {group_max_mem_gib_total: 20, group_max_gpus: 2, group_max_procs: 3}\n'
                  '  interns_grp: {members: ["@interns"], group_max_procs: 1}\n')
    context = P.Context(groups={'alice': ['vision'], 'bob': ['vision', 'other']})
    snap = snapshot([proc(1, 'alice', {0: 12 * GIB}), proc(2, 'bob', {1: 10 * GIB}), proc(3, 'bob', {2: 1 * GIB}),
                     proc(4, 'ivan', {3: GIB}), proc(5, 'ida', {3: 2 * GIB}), proc(6, 'carol', {3: 50 * GIB})])
    found = evaluate(policy, snap, context=context)
    by = dict((v.rule, v) for v in found)
    assert by['group_max_mem_total'].subject == 'group:vision' and by['group_max_mem_total'].pids == [1]
    assert by['group_max_gpus'].pids == [1]      # one process per GPU: free the fullest GPU (alice's 12 GiB)
    assert 'group_max_procs' in by and [v.pids for v in found if v.subject == 'group:interns_grp'] == [[5]]


def test_real_unix_group_lookup_does_not_crash():
    context = P.Context()
    assert isinstance(context.groups_of('root'), tuple)
    assert context.groups_of('no-such-user-gpufleet') == ()


# ============================================================================ GPUs: reservations, maintenance
def test_reserved_gpus_and_blocked_users():
    policy = load('lists: {core: [carol]}\ngpus:\n  "0": {reserved_for: [alice, "group:ops", "@core"]}\n'
                  '  "1,2": {blocked_users: [bob]}\n')
    context = P.Context(groups={'dave': ['ops']})
    snap = snapshot([proc(1, 'alice', {0: GIB}), proc(2, 'bob', {0: GIB}), proc(3, 'dave', {0: GIB}), proc(4, 'carol', {0: GIB}),
                     proc(5, 'bob', {2: GIB}), proc(6, 'alice', {1: GIB})])
    found = evaluate(policy, snap, context=context)
    assert [(v.rule, v.gpu, v.user, v.pids) for v in found] == [('gpu_reserved', 0, 'bob', [2]),
                                                                ('gpu_blocked_user', 2, 'bob', [5])]


def test_gpu_selected_by_uuid_and_total_memory_limit():
    uuid = 'GPU-abcdef01-2345-6789-abcd-ef0123456789'
    policy = load('gpus:\n  "%s": {max_mem_gib_total: 20}\nprotect: {users: [svc]}\n' % uuid)
    snap = snapshot([proc(1, 'svc', {0: 15 * GIB}), proc(2, 'alice', {0: 4 * GIB}), proc(3, 'bob', {0: 3 * GIB})],
                    uuids={0: uuid})
    found = evaluate(policy, snap)
    # 22 GiB on the GPU; the protected 15 GiB stay, so 7 GiB of the rest must go down to 5: alice's 4 GiB
    assert [(v.rule, v.measured, v.pids) for v in found] == [('gpu_max_mem_total', 22 * GIB, [2])]


def test_maintenance_window():
    policy = load('gpus:\n  "1":\n    maintenance: [{days: [mon], start: "11:00", end: "13:00", tz: UTC, name: firmware}]\n')
    snap = snapshot([proc(1, 'alice', {1: GIB}), proc(2, 'bob', {1: GIB}), proc(3, 'carol', {0: GIB})])
    found = evaluate(policy, snap, now=MONDAY_NOON)
    assert [(v.rule, v.gpu, v.pids) for v in found] == [('maintenance', 1, [1, 2])]
    assert 'firmware' in found[0].message
    assert evaluate(policy, snap, now=MONDAY_NOON + 2 * 3600) == []


# ============================================================================ time windows
def test_window_across_midnight_belongs_to_the_day_it_starts():
    window = P.Window(days=[4], start=22 * 60, end=6 * 60, tz=datetime.timezone.utc)   # Friday 22:00 -> Saturday 06:00
    assert not window.contains(utc(2026, 3, 6, 21, 59))
    assert window.contains(utc(2026, 3, 6, 22, 0))
    assert window.contains(utc(2026, 3, 7, 5, 59))
    assert not window.contains(utc(2026, 3, 7, 6, 0))
    assert not window.contains(utc(2026, 3, 7, 23, 0))      # Saturday night is not in the window
    assert not window.contains(utc(2026, 3, 6, 1, 0))       # Friday early morning belongs to Thursday's window


def test_time_window_limits_with_fixed_offset():
    policy = load('defaults: {max_gpus: 4}\ntime_windows:\n  - {days: mon-fri, start: "09:00", end: "18:00", tz: "+05:30", '
                  'limits: {max_gpus: 1}, applies_to: ["group:students"]}\n')
    context = P.Context(groups={'sam': ['students']})
    snap = snapshot([proc(1, 'sam', {0: GIB}), proc(2, 'sam', {1: GIB}), proc(3, 'tom', {0: GIB}), proc(4, 'tom', {1: GIB})])
    monday_1000_ist = utc(2026, 3, 2, 4, 30)
    monday_1900_ist = utc(2026, 3, 2, 13, 30)
    assert [(v.user, v.rule) for v in evaluate(policy, snap, now=monday_1000_ist, context=context)] == [('sam', 'max_gpus')]
    assert evaluate(policy, snap, now=monday_1900_ist, context=context) == []


def test_time_window_follows_daylight_saving_time():
    zoneinfo = pytest.importorskip('zoneinfo', reason='zoneinfo needs Python 3.9')
    try:
        zoneinfo.ZoneInfo('America/New_York')
    except Exception:  # pylint: disable=broad-except
        pytest.skip('no time zone database on this host')
    window = P._window({'days': 'mon-fri', 'start': '09:00', 'end': '17:00', 'tz': 'America/New_York'}, 'w')
    # 13:30 UTC is 08:30 EST in winter (outside) but 09:30 EDT after the March change (inside)
    assert not window.contains(utc(2026, 3, 6, 13, 30))
    assert window.contains(utc(2026, 3, 9, 13, 30))
    # the night of the change in Berlin (2026-03-29, 02:00 -> 03:00 local): a 01:30-03:30 window
    berlin = P._window({'start': '01:30', 'end': '03:30', 'tz': 'Europe/Berlin'}, 'w')
    assert berlin.contains(utc(2026, 3, 29, 0, 45))      # 01:45 CET
    assert berlin.contains(utc(2026, 3, 29, 1, 15))      # 03:15 CEST (02:00-03:00 never happened)
    assert not berlin.contains(utc(2026, 3, 29, 1, 45))  # 03:45 CEST
    # the autumn change repeats 02:00-03:00: both passes are inside a 02:00-02:59 window
    autumn = P._window({'start': '02:00', 'end': '03:00', 'tz': 'Europe/Berlin'}, 'w')
    assert autumn.contains(utc(2026, 10, 25, 0, 30)) and autumn.contains(utc(2026, 10, 25, 1, 30))
    assert not autumn.contains(utc(2026, 10, 25, 2, 30))


def test_window_days_and_times_in_many_spellings():
    assert P._days(['monday', 'Tue', 'thu-sat'], 'd') == frozenset([0, 1, 3, 4, 5])
    assert P._days('weekends', 'd') == frozenset([5, 6])
    assert P._days('fri-mon', 'd') == frozenset([4, 5, 6, 0])
    assert P._days([0, 7, 1], 'd') == frozenset([6, 0])            # gpu-kill numbering: 0 and 7 are Sunday
    assert P._minutes('24:00', 't') == 1440 and P._minutes(570, 't') == 570 and P._minutes(9, 't') == 540


def test_time_window_multipliers():
    policy = load('defaults: {max_mem_gib_total: 10}\ntime_windows: [{start: "00:00", end: "00:00", multipliers: {mem: 0.5}}]\n')
    found = evaluate(policy, snapshot([proc(1, 'alice', {0: 6 * GIB})]))
    assert [v.limit for v in found] == [5 * GIB]


# ============================================================================ idle clocks
IDLE = 'users: {alice: {idle: {util_max_pct: 5, mem_min_gib: 1, for: 10m}}}\n'


@pytest.fixture
def samples(tmp_path):
    """The usage history the idle clocks are derived from (the guard records each tick's snapshot first)."""
    with SampleStore(str(tmp_path / 'history.db')) as store:
        yield store


def observe(policy, snap, state, now, store):
    store.record(snap, now)
    return P.observe(policy, snap, state, now, NO_GROUPS, store)


def test_idle_clock_fires_after_the_duration_and_activity_resets_it(samples):
    policy = load(IDLE)
    t = MONDAY_NOON
    idle = snapshot([proc(1, 'alice', {0: 4 * GIB}, util=2), proc(2, 'alice', {1: 512}, util=0)])
    busy = snapshot([proc(1, 'alice', {0: 4 * GIB}, util=60), proc(2, 'alice', {1: 512}, util=0)])
    state = {}
    for step in range(0, 11):                       # one sample a minute, idle the whole time
        state = observe(policy, idle, state, t + 60 * step, samples)
    assert state['idle'] == {'1:10': {'since': t}}  # the 512 MiB process holds less than mem_min: no clock
    assert [(v.rule, v.pids) for v in evaluate(policy, idle, state, t + 600)] == [('idle', [1])]
    assert evaluate(policy, idle, state, t + 540) == []
    state = observe(policy, busy, state, t + 660, samples)   # activity: the clock stops
    assert state['idle'] == {}
    state = observe(policy, idle, state, t + 720, samples)   # and starts again from here
    assert state['idle']['1:10']['since'] == t + 720
    assert evaluate(policy, idle, state, t + 1200) == []


def test_idle_clock_restarts_after_a_gap_or_unknown_utilization(samples):
    policy = load(IDLE)
    t = MONDAY_NOON
    idle = snapshot([proc(1, 'alice', {0: 4 * GIB}, util=0)])
    state = observe(policy, idle, {}, t, samples)
    state = observe(policy, idle, state, t + 3600, samples)      # no sample for an hour: do not trust it
    assert state['idle']['1:10']['since'] == t + 3600
    unknown = snapshot([proc(1, 'alice', {0: 4 * GIB}, util=None)])
    unknown.devices[0].utilization_pct = None
    state = observe(policy, unknown, state, t + 3660, samples)
    assert state['idle'] == {}


def test_a_stale_idle_clock_never_fires_on_a_busy_process():
    policy = load(IDLE)
    busy = snapshot([proc(1, 'alice', {0: 4 * GIB}, util=90)])
    state = {'idle': {'1:10': {'since': MONDAY_NOON - 86400}}}
    assert evaluate(policy, busy, state, MONDAY_NOON) == []


def test_idle_uses_device_utilization_for_a_lone_process():
    policy = load(IDLE)
    snap = snapshot([proc(1, 'alice', {0: 4 * GIB}, util=None)], device_util={0: 1})
    state = P.observe(policy, snap, {}, MONDAY_NOON, NO_GROUPS)
    assert '1:10' in state['idle']


# ============================================================================ exemptions and protection
def test_exemptions_by_identity_and_expiry():
    digest = 'b' * 64
    text = ('users: {alice: {max_mem_gib_per_gpu: 8}, bob: {max_mem_gib_per_gpu: 8}}\nexemptions:\n'
            '  - {match: {exe_sha256: "%s"}, rules: [memory], expires: 2026-12-31, reason: benchmark}\n'
            '  - {user: bob, cmdline: "serve\\\\.py", expires: "2026-03-01T00:00:00Z"}\n'
            '  - {match: {slurm_job: 42}, expires: 2027-01-01}\n'
            '  - {match: {container: abcdef012345}, rules: [max_mem_per_gpu], expires: 2027-01-01}\n' % digest)
    policy = load(text)
    snap = snapshot([proc(1, 'alice', {0: 12 * GIB}), proc(2, 'alice', {1: 12 * GIB}),
                     proc(3, 'bob', {2: 12 * GIB}, cmdline=['python', 'serve.py']),
                     proc(4, 'alice', {3: 12 * GIB}, job='42'),
                     proc(5, 'bob', {3: 12 * GIB}, container='abcdef0123456789' * 4)])
    context = P.Context(groups={}, exe_hashes={1: digest, 2: 'c' * 64})
    found = evaluate(policy, snap, context=context, now=MONDAY_NOON)
    assert pids(found) == [2, 3]          # bob's exemption expired on 2026-03-01; the others hold
    after = utc(2027, 1, 2, 0, 0)
    assert pids(evaluate(policy, snap, context=context, now=after)) == [1, 2, 3, 4, 5]


def test_exemption_limited_to_some_rules():
    policy = load('users: {alice: {max_mem_gib_total: 1, max_procs: 0}}\n'
                  'exemptions: [{match: {slurm_job: "7"}, rules: [max_procs], expires: 2030-01-01}]\n')
    found = evaluate(policy, snapshot([proc(1, 'alice', {0: 2 * GIB}, job='7')]))
    assert rules(found) == ['max_mem_total']


def kernel_identity(pid, uid, exe_uid=0, exe_mode=0o100755, dir_writable=False):
    """An identity.Identity as the kernel would report it: ``uid`` for all four uids, the executable's owner and mode."""
    exe = I.ExeIdentity('/usr/sbin/daemon', False, 2049, 1000 + pid, exe_uid, exe_mode, dir_writable)
    return I.Identity(pid, pid * 10, 'S', 1, pid, 0, 'daemon', (uid,) * 4, exe)


def test_protected_processes_are_not_counted_or_named():
    # Names protect only what a system account runs from a root-owned executable (issue 15): eve's
    # processes named my-daemon and Xorg are charged even with a trusted executable; the daemon's are not.
    policy = load('defaults: {max_mem_gib_total: 1}\nprotect:\n  - {user: svc}\n  - {uid_below: 100}\n  - {name: my-daemon}\n')
    snap = snapshot([proc(1, 'svc', {0: 9 * GIB}), proc(2, 'sysd', {0: 9 * GIB}, uid=50),
                     proc(3, 'daemon', {0: 9 * GIB}, name='my-daemon', uid=120), proc(4, 'daemon', {1: 9 * GIB}, name='Xorg', uid=120),
                     proc(5, 'eve', {2: 9 * GIB}), proc(6, 'eve', {3: 9 * GIB}, name='my-daemon', uid=1001),
                     proc(7, 'eve', {3: 9 * GIB}, name='Xorg', uid=1001)])
    for entry in snap.processes:
        entry.identity = kernel_identity(entry.pid, entry.uid)
    found, notes = P.evaluate_detailed(policy, snap, {}, MONDAY_NOON, NO_GROUPS)
    assert [(v.user, v.pids) for v in found] == [('eve', [7, 6, 5])]
    assert 'pid 3 (daemon): protected name my-daemon; quota rules skip it' in notes
    assert 'pid 4 (daemon): protected name Xorg; quota rules skip it' in notes


@pytest.mark.parametrize('identity, why', [
    (None, 'no kernel-read identity (a record made by hand)'),
    (kernel_identity(3, 120, exe_uid=1001), 'an executable the user owns'),
    (kernel_identity(3, 120, exe_mode=0o100777), 'an executable others may write'),
    (kernel_identity(3, 120, dir_writable=True), 'an executable in a directory users may write'),
    (kernel_identity(3, 120, dir_writable=None), 'an executable whose directories cannot be examined'),
    (I.Identity(3, 30, 'S', 1, 3, 0, 'Xorg', (120, 0, 1001, 120), kernel_identity(3, 120).exe), 'a saved uid of a user'),
    (I.Identity(3, 30, 'S', 1, 3, 0, 'Xorg', None, kernel_identity(3, 120).exe), 'an unknown owner'),
])
def test_a_protected_name_needs_a_system_account_and_a_root_owned_executable(identity, why):
    policy = load('defaults: {max_mem_gib_total: 1}\nprotect: [{exe: /usr/sbin/daemon}]\n')
    snap = snapshot([proc(3, 'daemon', {0: 9 * GIB}, name='Xorg', uid=120, exe='/usr/sbin/daemon')])
    snap.processes[0].identity = identity
    assert [v.pids for v in P.evaluate(policy, snap, {}, MONDAY_NOON, NO_GROUPS)] == [[3]], why


def test_a_process_whose_owner_is_unknown_is_charged_to_a_pseudo_owner():
    policy = load('defaults: {max_mem_gib_total: 12}\n')
    snap = snapshot([proc(1, 'bob', {0: 10 * GIB}), proc(2, 'alice', {1: 4 * GIB}), proc(3, 'carol', {2: 13 * GIB})])
    snap.processes[2].user = snap.processes[2].uid = None
    found, notes = P.evaluate_detailed(policy, snap, {}, MONDAY_NOON, NO_GROUPS)
    assert [(v.user, v.pids, v.procs[0]['user']) for v in found] == [(I.UNKNOWN_OWNER, [3], I.UNKNOWN_OWNER)]
    assert 'pid 3: owner unknown; charged to uid:unknown' in notes
    assert snap.processes[2].user is None  # the snapshot itself is not rewritten


# ============================================================================ allocation and rogue
def test_require_allocation_on_slurm_nodes_only():
    policy = load('require_allocation: true\n')
    snap = snapshot([proc(1, 'alice', {0: GIB}, job='100'), proc(2, 'alice', {1: GIB}), proc(3, 'bob', {2: GIB}, job='101')])
    assert evaluate(policy, snap, context=P.Context(groups={})) == []
    slurm = P.Context(groups={}, scheduler='slurm', allocations={0: {'slurm:100'}, 2: {'slurm:999'}})
    found = evaluate(policy, snap, context=slurm)
    assert [(v.rule, v.pids) for v in found] == [('require_allocation', [2]), ('require_allocation', [3])]
    assert 'outside any Slurm job' in found[0].message and 'allocated to another' in found[1].message
    k8s = P.Context(groups={}, scheduler='kubernetes')
    pods = snapshot([proc(1, 'alice', {0: GIB}, pod='1234abcd-0000-0000-0000-000000000000'), proc(2, 'alice', {1: GIB})])
    assert pids(evaluate(policy, pods, context=k8s)) == [2]


def test_require_allocation_from_slurm_names_the_job_its_gpus_and_the_gpu_used():
    """Slurm's truth (policy.slurm_allocations: squeue --json GRES, scontrol listpids): a process on a GPU its job was
    not given is a violation with the evidence; slurmstepd's pid list places a process without a job cgroup; and when
    Slurm cannot be asked the rule does not fire and the notes say why."""
    policy = load('require_allocation: true\n')
    snap = snapshot([proc(1, 'alice', {0: GIB}, job='100'), proc(2, 'alice', {1: GIB}, job='100'), proc(3, 'bob', {2: GIB}),
                     proc(4, 'bob', {3: GIB}, job='7')])
    slurm = P.Context(groups={}, scheduler='slurm', job_gpus={'slurm:100': {0}, 'slurm:101': {2}}, job_pids={3: '101'})
    found = evaluate(policy, snap, context=slurm)
    assert [(v.rule, v.pids) for v in found] == [('require_allocation', [2]), ('require_allocation', [4])]
    assert found[0].message == "alice's GPU process 2 (python) uses GPU 1, which Slurm did not give its job 100 (allocated GPUs: 0)"
    assert found[1].message.endswith('uses GPU 3, which Slurm did not give its job 7 (the job is not active on this node)')
    down = P.Context(groups={}, scheduler='slurm', allocation_error='Slurm could not be asked about node n1: squeue is not installed')
    found, notes = P.evaluate_detailed(policy, snap, {}, 0, down)
    assert found == [] and 'require_allocation not evaluated: Slurm could not be asked about node n1: squeue is not installed' in notes


def test_read_allocations_file(tmp_path):
    path = tmp_path / 'alloc.json'
    path.write_text(json.dumps({'gpus': {'0': ['slurm:1'], 'x': ['y'], '1': 'bad'}}))
    assert P.read_allocations(str(path)) == {0: {'slurm:1'}}
    assert P.read_allocations(str(tmp_path / 'none.json')) is None


def finding(level, kinds=('hard',), allowlisted=False):
    return {'level': level, 'score': 90, 'rules': [{'id': 'H-stratum' if k == 'hard' else 'B-flat-util', 'kind': k} for k in kinds],
            'allowlisted': allowlisted}


def test_rogue_acts_only_at_the_level_and_with_a_hard_indicator():
    policy = load('rogue: {act_min_level: high, action: kill}\nprotect: {users: [svc]}\n')
    snap = snapshot([proc(1, 'svc', {0: GIB}, name='xmrig'), proc(2, 'eve', {1: GIB}), proc(3, 'eve', {2: GIB}),
                     proc(4, 'eve', {3: GIB}), proc(5, 'eve', {3: GIB})])
    findings = {1: finding('critical'), 2: finding('high', kinds=('behavioural',)), 3: finding('medium'),
                4: finding('critical', allowlisted=True), 5: finding('high', kinds=('soft', 'hard'))}
    found, notes = P.evaluate_detailed(policy, snap, {}, MONDAY_NOON, P.Context(groups={}, rogue_findings=findings))
    assert [(v.rule, v.pids, v.action, v.kind) for v in found] == [('rogue', [1], 'kill', 'rogue'), ('rogue', [5], 'kill', 'rogue')]
    assert any('without a hard indicator' in n for n in notes)     # protect does not shield from rogue rules
    assert P.evaluate(load('rogue: {enabled: false}'), snap, {}, MONDAY_NOON, P.Context(groups={}, rogue_findings=findings)) == []


def test_processes_of_unknown_owners_are_skipped():
    snap = snapshot([proc(1, None, {0: 60 * GIB})])
    snap.processes[0].status = 'not_found'
    found, notes = P.evaluate_detailed(load('defaults: {max_mem_gib_total: 1}'), snap, {}, MONDAY_NOON, NO_GROUPS)
    assert found == [] and 'not visible' in notes[0]


def test_violation_keys_are_stable_and_serialisable():
    policy = load('users: {alice: {max_mem_gib_per_gpu: 1, max_runtime: 1h}}')
    snap = snapshot([proc(1, 'alice', {0: 2 * GIB}, ct=MONDAY_NOON - 7200)])
    first = evaluate(policy, snap)
    second = evaluate(policy, snap)
    assert [v.key for v in first] == [v.key for v in second] == ['max_mem_per_gpu|user:alice|gpu:0', 'max_runtime|user:alice|1:10']
    json.dumps([v.to_dict() for v in first])


def test_policy_cache_skips_parsing_until_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / 'policy.yaml'
    path.write_text('mode: enforce\nexemptions: [{match: {slurm_job: 1}, expires: 2030-01-01}]\nusers: {alice: {max_gpus: 1}}\n')
    cache = {}
    first = P.load_policy_cached(str(path), cache)
    assert cache['sha256'] == first.sha256 and cache['document']['exemptions'][0]['expires'] == '2030-01-01'

    def no_parsing(*_args):
        raise AssertionError('the cached document should have been used')
    monkeypatch.setattr(documents, '_read_document', no_parsing)
    second = P.load_policy_cached(str(path), cache)
    assert second.mode == 'enforce' and second.users == first.users
    assert second.exemptions[0].expires == first.exemptions[0].expires
    monkeypatch.undo()
    path.write_text('mode: warn\n')
    assert P.load_policy_cached(str(path), cache).mode == 'warn' and cache['document'] == {'mode': 'warn'}
    path.write_text('gpus: {0: {max_mem_gib_total: 1}}\n')               # int keys do not survive JSON: not cached
    assert P.load_policy_cached(str(path), cache).gpus[0].key == '0' and cache == {}
    path.write_text('mode: nope\n')
    with pytest.raises(P.PolicyError):
        P.load_policy_cached(str(path), cache)
