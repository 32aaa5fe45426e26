# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpu_audit main(): findings on live processes this test starts, check mode, JSON Lines log, syslog,
rules errors (file, line, field), the history report, and the gpu_kill rogue hook.

The GPU side is a hand-built snapshot (the simulator is not needed: gpu_audit reads the driver only
through take_snapshot, which is replaced here).  SAFETY: only processes started here are signalled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, history
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import Device, GpuProcess
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import Snapshot
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_audit, gpu_kill
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.modules.module_docs import documented_options
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import DEEP_TOML, TOO_DEEP, TOO_MANY_ALIASED, billion_laughs

XMR = '45ASi45ub7Qe4ZE36UT5G6cU4ud8Fhhe4deS4F3cw9KTAb8dLcukC7edhDQ7cn5d4gEYkbUrMWeWQLGsCmrG6dLaYyNoVKf'
SLEEP = 'import sys, time\nsys.stdout.write("ok\\n"); sys.stdout.flush()\ntime.sleep(120)\n'


@pytest.fixture(autouse=True)
def module_exits(monkeypatch):
    h.patch_module_exits(monkeypatch)


def run_module(args, check_mode=False):
    return h.run_main(gpu_audit.main, args, check_mode=check_mode)


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A miner and a legitimate job (real processes) listed on GPU 0 of a hand-built snapshot."""
    procs = []
    for args in (['-o', 'stratum+tcp://pool.example.net:3333', '-u', XMR], ['train.py', '--epochs', '3']):
        proc = subprocess.Popen([sys.executable, '-c', SLEEP] + args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(proc)
        assert proc.stdout.readline().strip() == b'ok'
    pids = [p.pid for p in procs]
    dev = Device(vendor='nvidia', vendor_index=0, index=0, uuid='GPU-audit-0', memory_total_mib=81559, memory_used_mib=3072,
                 utilization_pct=100, minor=0)
    result = ProcessInventory(scan_fds=False).scan(pids)
    gpu_procs = []
    for pid, mib in zip(pids, (2048, 1024)):
        dev.add_driver_process(pid, mib, 'compute')
        gp = GpuProcess(pid=pid)
        gp.add_gpu(0, mib, ['compute'])
        gp.join(result.record(pid))
        gpu_procs.append(gp)

    def fake_snapshot(**_kwargs):
        return Snapshot(backends={}, devices=[dev], all_devices=[dev], processes=list(gpu_procs), holders=[], taken_at=time.time())

    monkeypatch.setattr(gpu_audit, 'take_snapshot', fake_snapshot)
    yield {'miner': pids[0], 'legit': pids[1], 'snapshot': fake_snapshot, 'tmp': tmp_path,
           'history': str(tmp_path / 'none.db')}
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(timeout=10)
        proc.stdout.close()


def base(node, **extra):
    args = {'history_path': node['history'], 'require_allocation': 'never'}
    args.update(extra)
    return args


def test_findings_on_a_live_node(node):
    result = run_module(base(node))
    assert not result.get('failed'), result
    assert result['changed'] is False
    assert result['violations'] == []
    assert result['report'] is None
    findings = dict((f['pid'], f) for f in result['findings'])
    miner = findings[node['miner']]
    assert miner['level'] == 'critical' and miner['score'] == 100
    assert miner['gpu_indexes'] == [0] and miner['used_mib'] == 2048 and miner['user']
    rules = dict((r['id'], r) for r in miner['rules'])
    assert rules['H-stratum']['evidence'][0] == {'source': 'argv[4]', 'value': 'stratum+tcp://pool.example.net:3333', 'note': None}
    assert rules['H-wallet']['evidence'][0]['note'] == 'monero address'
    legit = findings.get(node['legit'])
    assert legit is None or legit['level'] in ('info', 'medium')
    assert result['summary']['critical'] == 1 and result['summary']['evaluated'] == 2
    assert result['logged'] == {'log_path': 0, 'syslog': 0}
    assert result['msg'].startswith('examined 2 process(es): 1 critical')


def test_min_level(node):
    result = run_module(base(node, min_level='critical'))
    assert [f['pid'] for f in result['findings']] == [node['miner']]


def test_log_path_json_lines(node):
    log = str(node['tmp'] / 'log' / 'audit.jsonl')
    result = run_module(base(node, log_path=log))
    assert result['logged']['log_path'] == len(result['findings']) >= 1
    with open(log) as handle:
        records = [json.loads(line) for line in handle]
    assert len(records) == len(result['findings'])
    assert len(set(r['run_id'] for r in records)) == 1
    first = records[0]
    assert first['schema'] == 1 and first['event'] == 'rogue_finding' and first['host']
    assert first['ts'].endswith('Z') and len(first['hash']) == 64 and first['prev_hash'] == '0' * 64
    for key in ('pid', 'starttime', 'user', 'uid', 'name', 'exe', 'cmdline', 'gpu_indexes', 'used_mib', 'score', 'level', 'rules',
                'points', 'suppressors', 'allowlisted', 'notes', 'container', 'slurm_job', 'listed', 'cmdline_truncated'):
        assert key in first, key
    assert audit_log.verify(log)['valid']
    run_module(base(node, log_path=log))
    assert audit_log.verify(log) == {'valid': True, 'lines': 2 * len(records), 'errors': []}


def test_check_mode_writes_nothing(node, monkeypatch):
    log = str(node['tmp'] / 'audit.jsonl')
    sent = []
    monkeypatch.setattr(gpu_audit, 'send_syslog', lambda findings, facility: sent.append(findings) or len(findings))
    result = run_module(base(node, log_path=log, syslog=True), check_mode=True)
    assert result['findings'] and result['changed'] is False
    assert not os.path.exists(log) and sent == []
    assert result['logged'] == {'log_path': 0, 'syslog': 0}


def test_syslog(node, monkeypatch):
    calls = []

    class FakeSyslog(object):
        LOG_PID = 1
        LOG_CRIT, LOG_ERR, LOG_WARNING, LOG_INFO = 2, 3, 4, 6
        LOG_DAEMON = 24

        @staticmethod
        def openlog(ident, option, facility):
            calls.append(('open', ident, option, facility))

        @staticmethod
        def syslog(priority, message):
            calls.append(('msg', priority, message))

        @staticmethod
        def closelog():
            calls.append(('close',))

    monkeypatch.setitem(sys.modules, 'syslog', FakeSyslog)
    result = run_module(base(node, syslog=True, facility='daemon', min_level='critical'))
    assert result['logged']['syslog'] == 1
    assert calls[0] == ('open', 'gpufleet-audit', 1, 24) and calls[-1] == ('close',)
    _kind, priority, message = calls[1]
    assert priority == FakeSyslog.LOG_CRIT
    brief = json.loads(message.split(': ', 1)[1])
    assert brief['pid'] == node['miner'] and 'H-stratum' in brief['rules'] and brief['level'] == 'critical'


def test_rules_file_error_names_file_line_field(node):
    path = node['tmp'] / 'rogue.yml'
    path.write_text('version: 1\nallowlist:\n  - user: bob\n    cmdline: "(unclosed"\n')
    result = run_module(base(node, rules_file=str(path)))
    assert result['failed']
    assert (result['file'], result['line'], result['field']) == (str(path), 4, 'allowlist[0].cmdline')
    assert result['msg'].startswith('invalid rogue rules: %s:4: allowlist[0].cmdline: bad regular expression' % path)
    path.write_text('rules:\n  - id: x\n    kind: hard\n    weight: 101\n    description: d\n    match: {cmdline: a}\n')
    result = run_module(base(node, rules_file=str(path)))
    assert (result['line'], result['field']) == (4, 'rules[0].weight') and 'out of range' in result['msg']
    path.write_text('allow: []\n')
    assert run_module(base(node, rules_file=str(path)))['field'] == 'allow'


def test_inline_allowlist_and_expired_warning(node):
    rules = {'allowlist': [{'user': pwd_name(node['miner']), 'cmdline': 'stratum', 'comment': 'lab'},
                           {'user': 'x', 'cmdline': 'y', 'expires': '2020-01-01'}]}
    result = run_module(base(node, rules=rules))
    miner = [f for f in result['findings'] if f['pid'] == node['miner']][0]
    assert miner['level'] == 'info' and miner['allowlisted']['comment'] == 'lab'
    assert result['summary']['allowlisted'] == 1 and result['summary']['critical'] == 0


def pwd_name(pid):
    import pwd  # pylint: disable=import-outside-toplevel
    return pwd.getpwuid(os.stat('/proc/%d' % pid).st_uid).pw_name


def test_history_report(node):
    missing = run_module(base(node, history=True))
    assert missing['report']['available'] is False
    db = str(node['tmp'] / 'history.db')
    snap = node['snapshot']()
    now = time.time()
    for minute in range(10, -1, -1):
        history.record_samples(db, snap, now=now - 60 * minute, interval_s=60)
    result = run_module(base(node, history=True, history_path=db, hours=1))
    report = result['report']
    assert report['available'] is True and report['samples'] == 11 and report['hours'] == 1.0
    users = dict((u['user'], u) for u in report['users'])
    user = pwd_name(node['miner'])
    assert users[user]['gpu_hours'] == round(11 / 60.0, 4)       # both processes share GPU 0
    assert users[user]['peak_mib'] == 3072
    assert [p['pid'] for p in report['top_processes']] == sorted([node['miner'], node['legit']])
    assert report['gpus'][0]['gpu_index'] == 0
    # the accounting: the two processes of one user (no Slurm job) are one holder of GPU 0, all of it unattributed
    acc = report['accounting']
    assert [(u['user'], u['gpu_hours'], u['jobs']) for u in acc['users']] == [(user, round(11 / 60.0, 4), 0)]
    assert acc['jobs'] == [] and acc['unattributed']['gpu_hours'] == acc['totals']['gpu_hours'] == round(11 / 60.0, 4)
    assert missing['report']['accounting'] is None


@pytest.mark.parametrize('args,field', [({'hours': 0}, 'hours'), ({'top': 0}, 'top'), ({'idle_util_pct': 101}, 'idle_util_pct')])
def test_invalid_options(node, args, field):
    result = run_module(base(node, **args))
    assert result['failed'] and result['field'] == field


def test_documentation_matches_the_argument_spec():
    options = documented_options(gpu_audit)
    spec = gpu_audit.argument_spec()
    assert set(options) == set(spec)
    for name, option in options.items():
        assert option.get('default') == spec[name].get('default'), name
        assert option['type'] == spec[name]['type'], name
    assert spec['policy']['type'] == 'raw'
    returned = yaml.safe_load(gpu_audit.RETURN)
    assert {'findings', 'violations', 'policy', 'summary', 'report', 'logged', 'msg'} <= set(returned)


def test_gpu_kill_rogue_has_a_detector():
    module_args = dict((name, spec.get('default')) for name, spec in gpu_kill.argument_spec().items())
    module_args['rogue'] = True
    selector, _options = gpu_kill.build(module_args)
    assert selector.rogue and callable(selector.rogue_detector)


def test_policy_dry_run_names_the_violation_and_signals_nothing(node):
    user = pwd_name(node['miner'])
    policy = {'mode': 'enforce', 'users': {user: {'max_mem_gib_per_gpu': '2.5GiB'}},
              'escalation': {'warn_again_after': '1m', 'act_after': '5m'}}
    result = run_module(base(node, policy=policy, state_path=str(node['tmp'] / 'state.json')))
    assert not result.get('failed'), result
    assert result['changed'] is False
    [violation] = result['violations']
    assert violation['rule'] == 'max_mem_per_gpu' and violation['user'] == user and violation['gpu'] == 0
    assert (violation['measured'], violation['limit'], violation['unit']) == (3072, 2560, 'MiB')
    assert violation['action'] == 'terminate'
    assert violation['pids'] == [node['miner']]       # the fewest processes that bring the user back under: the largest
    assert violation['enforcement']['mode'] == 'enforce' and violation['enforcement']['next'] == 'warn'
    assert violation['enforcement']['would'] == 'terminate pid(s) %d' % node['miner']
    assert result['policy']['source'] == 'policy' and result['policy']['format'] == 'gpufleet'
    assert result['msg'].endswith('; 1 policy violation(s)')
    for pid in (node['miner'], node['legit']):
        os.kill(pid, 0)                                # both still alive: a dry run signals nothing
    assert not (node['tmp'] / 'state.json').exists()   # and writes no state


def test_policy_dry_run_reads_the_guard_state(node):
    user = pwd_name(node['miner'])
    path = node['tmp'] / 'policy.yaml'
    path.write_text('mode: enforce\nusers:\n  %s: {max_mem_gib_per_gpu: 2.5}\nescalation: {act_after: 60s, warnings: 1}\n' % user)
    first = run_module(base(node, policy=str(path), state_path=str(node['tmp'] / 'state.json')))
    [violation] = first['violations']
    assert first['policy']['source'] == str(path) and len(first['policy']['sha256']) == 64
    # a state in which the guard first saw this violation two minutes ago and already warned once
    state = {'version': 1, 'last_tick': time.time() - 30, 'counters': {}, 'idle': {},
             'violations': {violation['key']: {'first_seen': time.time() - 120, 'warnings': 1, 'last_warning': time.time() - 120,
                                               'acted_at': None, 'acts': 0, 'rule': violation['rule'],
                                               'subject': violation['subject'], 'user': user}}}
    (node['tmp'] / 'state.json').write_text(json.dumps(state))
    second = run_module(base(node, policy=str(path), state_path=str(node['tmp'] / 'state.json')))
    assert not second.get('failed'), second
    assert not any('rebuilt' in w for w in second.get('warnings', [])), second['warnings']
    assert second['violations'][0]['enforcement']['next'] == 'act'
    os.kill(node['miner'], 0)
    assert json.loads((node['tmp'] / 'state.json').read_text()) == state   # read, never written


def test_policy_dry_run_gpukill_shorthand(node):
    result = run_module(base(node, policy=[{'user': '*', 'max_memory_gb': 2, 'action': 'kill'}]))
    assert not result.get('failed'), result
    [violation] = result['violations']
    assert violation['rule'] == 'max_mem_total' and violation['action'] == 'kill' and violation['pids'] == [node['miner']]
    assert violation['enforcement']['would'].startswith('log only')   # the shorthand keeps the default mode: dry-run


@pytest.mark.parametrize('policy,field', [
    ({'defaults': {'max_mem_gib': 8}}, 'defaults.max_mem_gib'),
    ({'mode': 'nuke'}, 'mode'),
    ({'users': {'alice': {'max_gpus': -1}}}, 'users.alice.max_gpus'),
])
def test_bad_policy_fails_with_field_and_examines_nothing(node, monkeypatch, policy, field):
    def no_snapshot(**_kwargs):
        raise AssertionError('a bad policy must fail before the node is examined')
    monkeypatch.setattr(gpu_audit, 'take_snapshot', no_snapshot)
    result = run_module(base(node, policy=policy))
    assert result['failed'] and result['field'] == field, result
    assert result['msg'].startswith('invalid policy: policy: %s: invalid value' % field)


def _deep(levels):
    data = 1
    for _level in range(levels):
        data = {'metadata': data}
    return data


@pytest.mark.parametrize('kind', ['toml-file', 'alias-bomb-file', 'mapping'])
def test_policy_past_the_document_limits_fails_like_check_config(node, monkeypatch, kind):
    """policy= goes through the same loaders as check-config and the tick: the same limits, the same clean error."""
    def no_snapshot(**_kwargs):
        raise AssertionError('a bad policy must fail before the node is examined')
    monkeypatch.setattr(gpu_audit, 'take_snapshot', no_snapshot)
    path = node['tmp'] / ('policy.toml' if kind == 'toml-file' else 'policy.yaml')
    if kind == 'toml-file':
        path.write_text(DEEP_TOML)
    elif kind == 'alias-bomb-file':
        path.write_text(billion_laughs())
    result = run_module(base(node, policy=_deep(200) if kind == 'mapping' else str(path)))
    why = TOO_MANY_ALIASED if kind == 'alias-bomb-file' else TOO_DEEP
    assert result['failed'] and result['msg'].startswith('invalid policy: ') and why in result['msg'], result


@pytest.mark.parametrize('name, text, expected', [
    ('policy.yaml', 'defaults:\n  max_mem_gib_total: -4\n  max_gpus: -1\n  max_procs: -3\n',
     ['{0}:2: defaults.max_mem_gib_total: invalid value -4: ', '{0}:3: defaults.max_gpus: invalid value -1: ',
      '{0}:4: defaults.max_procs: invalid value -3: ']),
    ('policy.json', '{"max_gpus": 1,}', ['{0}: line 1, column 16: JSON syntax error: ']),
])
def test_policy_errors_are_all_reported_like_check_config(node, monkeypatch, name, text, expected):
    monkeypatch.setattr(gpu_audit, 'take_snapshot', lambda **_kwargs: pytest.fail('a bad policy fails before the node is examined'))
    path = node['tmp'] / name
    path.write_text(text)
    result = run_module(base(node, policy=str(path)))
    lines = result['msg'][len('invalid policy: '):].splitlines()
    assert result['failed'] and len(lines) == len(expected), result
    assert all(line.startswith(want.format(path)) for line, want in zip(lines, expected)), lines


def test_policy_mapping_errors_are_all_reported(node):
    result = run_module(base(node, policy={'defaults': {'max_gpus': -1, 'colour': 'red'}}))
    assert result['failed'] and result['msg'].count('\n') == 1 and 'policy: defaults.max_gpus: invalid value -1' in result['msg']
    assert "policy: defaults.colour: invalid value 'red': unknown key" in result['msg']


def test_missing_policy_file(node):
    result = run_module(base(node, policy=str(node['tmp'] / 'nope.yaml')))
    assert result['failed'] and 'cannot read the policy' in result['msg'] and str(node['tmp'] / 'nope.yaml') in result['msg']


def kill_args(**extra):
    args = dict((name, spec.get('default')) for name, spec in gpu_kill.argument_spec().items())
    args.update(extra)
    return args


def test_gpu_kill_rogue_takes_the_audit_rules_and_allowlist(node, tmp_path):
    snap = node['snapshot']()
    plain, _options = gpu_kill.build(kill_args(rogue=True))
    assert list(plain.rogue_detector(snap, 'critical')) == [node['miner']]
    rules = tmp_path / 'rogue.yml'
    rules.write_text('allowlist:\n  - user: %s\n    cmdline: "stratum"\n    comment: the pool test rig\n' % pwd_name(node['miner']))
    allowed, _options = gpu_kill.build(kill_args(rogue=True, rules_file=str(rules)))
    assert allowed.rogue_detector(snap, 'critical') == {}        # an allowlisted process is never selected
    allowlist = [{'user': pwd_name(node['miner']), 'cmdline': 'stratum'}]
    inline, _options = gpu_kill.build(kill_args(rogue=True, rules={'allowlist': allowlist}))
    assert inline.rogue_detector(snap, 'critical') == {}


def test_gpu_kill_builds_the_detector_as_gpu_audit_does():
    """Both take the detector's options from one spec (rogue.detector_argument_spec), with the same defaults."""
    audit_spec, kill_spec = gpu_audit.argument_spec(), gpu_kill.argument_spec()
    for name in ('history_path', 'require_allocation'):
        assert kill_spec[name] == audit_spec[name], name
    assert audit_spec['history_path']['default'] == history.DEFAULT_PATH
    kill_options = documented_options(gpu_kill)
    assert set(kill_options) == set(kill_spec)
    for name in ('history_path', 'require_allocation'):
        assert kill_options[name].get('default') == kill_spec[name]['default'], name


def test_gpu_kill_and_gpu_audit_agree_on_a_finding_that_needs_the_history(node):
    """The legitimate job reaches medium only with its flat memory from the usage history (B-flat-mem)
    and the missing allocation: audit and kill must see the same."""
    db = str(node['tmp'] / 'history.db')
    snap = node['snapshot']()
    now = time.time()
    for minute in range(40, -1, -1):
        history.record_samples(db, snap, now=now - 60 * minute, interval_s=60)
    snap.taken_at = now
    args = {'history_path': db, 'require_allocation': 'always', 'min_level': 'medium'}
    audit = dict((f['pid'], f) for f in run_module(args)['findings'])
    finding = audit[node['legit']]
    assert finding['level'] == 'medium'
    assert 'B-flat-mem' in [r['id'] for r in finding['rules']]      # from the history: without it, 5 points short
    selector, _options = gpu_kill.build(kill_args(rogue=True, rogue_min_level='medium', history_path=db,
                                                  require_allocation='always'))
    selected = selector.rogue_detector(snap, 'medium')
    assert sorted(selected) == sorted(audit) and node['legit'] in selected
    assert selected[node['legit']]['level'] == finding['level'] and selected[node['legit']]['score'] == finding['score']
    # without the history, neither selects it
    args['history_path'] = str(node['tmp'] / 'none.db')
    assert node['legit'] not in [f['pid'] for f in run_module(args)['findings']]
    selector, _options = gpu_kill.build(kill_args(rogue=True, rogue_min_level='medium', history_path=args['history_path'],
                                                  require_allocation='always'))
    assert node['legit'] not in selector.rogue_detector(snap, 'medium')


def test_gpu_kill_rules_need_rogue_and_a_valid_file(tmp_path):
    with pytest.raises(gpu_kill.InvalidArgument) as info:
        gpu_kill.build(kill_args(pids=[4242], rules={'allowlist': []}))
    assert info.value.field == 'rules'
    bad = tmp_path / 'bad.yml'
    bad.write_text('rules:\n  - id: x\n    kind: hard\n    weight: 101\n    description: d\n    match: {cmdline: a}\n')
    with pytest.raises(gpu_kill.rogue.RulesError) as info:
        gpu_kill.build(kill_args(rogue=True, rules_file=str(bad)))
    assert (info.value.source, info.value.line, info.value.field) == (str(bad), 4, 'rules[0].weight')
