# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpufleet-guard, the command line: every command, in-process and as a standalone ``python -m`` run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils import core as core_pkg
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, cli, guard
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import snapshot as snapshot_mod
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import (
    BOMB_LINE, DEEP_TOML, GIB, TOO_DEEP, TOO_MANY_ALIASED, billion_laughs, proc, snapshot)

MODULE_UTILS = os.path.dirname(os.path.dirname(os.path.abspath(core_pkg.__file__)))
GOOD = 'mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 8}}\nescalation: {act_after: 1h}\nnotify: {tty: false}\n'


class Out(io.StringIO):
    def __init__(self, tty=False):
        super(Out, self).__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def run(argv, tty=False):
    out = Out(tty)
    rc = cli.main(argv, out=out)
    return rc, out.getvalue()


@pytest.fixture
def fake_host(monkeypatch):
    """Every snapshot the CLI takes is this fake one (no GPUs are needed)."""
    snap = snapshot([proc(11, 'alice', {0: 12 * GIB}, cmdline=['python', 'train.py', '--token=abc']), proc(12, 'bob', {1: GIB})])

    def fake(**_kwargs):
        return snap
    monkeypatch.setattr(snapshot_mod, 'take_snapshot', fake)
    return snap


@pytest.fixture
def root(tmp_path):
    paths = guard.Paths(root=str(tmp_path))
    os.makedirs(os.path.dirname(paths.policy))
    with open(paths.policy, 'w') as handle:
        handle.write(GOOD)
    return tmp_path


def test_check_config_valid_and_invalid(tmp_path):
    good = tmp_path / 'good.yaml'
    good.write_text(GOOD)
    rc, out = run(['check-config', str(good)])
    assert rc == 0 and 'valid' in out and 'mode enforce' in out
    bad = tmp_path / 'bad.yaml'
    bad.write_text('users: {alice: {max_gpus: lots}}\n')
    rc, out = run(['check-config', str(bad), '--json'])
    report = json.loads(out)
    assert rc == 1 and not report['valid'] and report['errors'][0]['path'] == 'users.alice.max_gpus'
    assert report['errors'][0]['file'] == str(bad)


def check_config(path, text, capsys, *extra):
    path.write_text(text)
    rc, out = run(['check-config', str(path)] + list(extra))
    return rc, out, capsys.readouterr().err


def test_check_config_reports_every_error_of_a_mapping_with_its_line(tmp_path, capsys):
    path = tmp_path / 'policy.yaml'
    rc, _out, err = check_config(path, 'mode: warn\ndefaults: {max_mem_gib_total: -4, max_gpus: -1, max_procs: -3}\n', capsys)
    assert rc == 1 and err.splitlines() == [
        '%s:2: defaults.max_mem_gib_total: invalid value -4: a size must be a finite number, 0 or more' % path,
        '%s:2: defaults.max_gpus: invalid value -1: expected a whole number, 0 or more' % path,
        '%s:2: defaults.max_procs: invalid value -3: expected a whole number, 0 or more' % path]
    rc, _out, err = check_config(path, 'defaults:\n  max_gpus: -1\n  colour: red\nescalation:\n  act_after: soon\n'
                                       '  warnings: -2\n  sigkill_after: 90000d\n', capsys)
    lines = err.splitlines()
    assert rc == 1 and lines[0] == '%s:2: defaults.max_gpus: invalid value -1: expected a whole number, 0 or more' % path
    assert lines[1].startswith("%s:3: defaults.colour: invalid value 'red': unknown key; expected one of " % path)
    assert [line.split(': ')[1] for line in lines[2:]] == ['escalation.act_after', 'escalation.warnings']
    assert lines[2].startswith('%s:5: ' % path) and lines[3].startswith('%s:6: ' % path)
    rc, out, _err = check_config(path, 'defaults:\n  max_gpus: -1\n  colour: red\n', capsys, '--json')
    assert rc == 1 and json.loads(out)['errors'] == [
        {'file': str(path), 'line': 2, 'path': 'defaults.max_gpus', 'value': '-1', 'why': 'expected a whole number, 0 or more'},
        {'file': str(path), 'line': 3, 'path': 'defaults.colour', 'value': "'red'",
         'why': json.loads(out)['errors'][1]['why']}]


@pytest.mark.parametrize('name, text, message', [
    ('policy.yaml', 'mode: warn\nusers:\n  alice: max_gpus: 1\n',
     'line 3, column 18: YAML syntax error: mapping values are not allowed here'),
    ('policy.yml', 'users: {alice: {max_gpus: 1}}\nusers: {}\n',
     "line 2, column 1: YAML syntax error: duplicate key 'users' (also on line 1)"),
    ('policy.json', '{"max_gpus": 1,}', 'line 1, column 16: JSON syntax error: '),
    ('policy.json', '{"mode": "warn", "mode": "enforce"}', "invalid JSON: duplicate key 'mode'"),
    ('policy.json', 'mode: warn\n', 'line 1, column 1: JSON syntax error: Expecting value'),
    ('policy.toml', 'mode = "warn"\nmode = "enforce"\n', 'line 2, column 17: TOML syntax error: Cannot overwrite a value'),
    ('policy.toml', 'mode: warn\n', "line 1, column 5: TOML syntax error: Expected '=' after a key in a key/value pair"),
], ids=['yaml', 'yaml-duplicate', 'json-trailing-comma', 'json-duplicate', 'yaml-in-json', 'toml', 'yaml-in-toml'])
def test_check_config_syntax_errors_are_the_format_of_the_extension(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    rc, _out, err = check_config(path, text, capsys)
    assert rc == 1 and err.startswith('%s: %s' % (path, message)) and err.count('\n') == 1, err
    assert 'invalid value' not in err and 'neither' not in err


def test_check_config_sniffs_only_unnamed_input(monkeypatch, capsys):
    for text, rc in ((b'[global]\ndry_run = true\n', 0), (b'{"mode": "warn",}', 0), (b'mode = "warn"\n', 0),
                     (b'mode: warn\nusers:\n  alice: max_gpus: 1\n', 1)):
        monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(text)))
        assert run(['check-config', '-'])[0] == rc, text
    assert capsys.readouterr().err == '<stdin>: line 3, column 18: YAML syntax error: mapping values are not allowed here\n'


def test_check_config_json_names_the_syntax_it_read(monkeypatch, tmp_path):
    """The guard role names the policy file after this (policy.toml for a TOML text given as a string)."""
    for text, syntax in ((b'[global]\ndry_run = true\n', 'toml'), (b'mode: warn\n', 'yaml'), (b'{"mode": "warn"}', 'yaml')):
        monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(text)))
        rc, out = run(['check-config', '--json', '-'])
        assert rc == 0 and json.loads(out)['syntax'] == syntax, text
    path = tmp_path / 'p.json'
    path.write_text('{"mode": "warn"}')
    assert json.loads(run(['check-config', '--json', str(path)])[1])['syntax'] == 'json'


def test_check_config_missing_file_is_one_plain_line(tmp_path, capsys):
    path = tmp_path / 'etc' / 'policy.yaml'
    rc, _out = run(['check-config', str(path)])
    assert rc == 1 and capsys.readouterr().err == '%s: cannot read the policy: No such file or directory\n' % path
    rc, out = run(['check-config', str(path), '--json'])
    assert json.loads(out)['errors'] == [{'file': str(path), 'path': '', 'value': None,
                                          'why': 'cannot read the policy: No such file or directory'}]


def test_check_config_reports_expired_exemptions_and_notes(tmp_path):
    path = tmp_path / 'p.yaml'
    path.write_text('exemptions: [{match: {slurm_job: 1}, expires: 2001-01-01}]\n')
    rc, out = run(['check-config', str(path)])
    assert rc == 0 and 'expired on 2001-01-02' in out


def test_check_config_refuses_deep_nesting_and_alias_bombs_cleanly(tmp_path, capsys):
    deep = tmp_path / 'deep.toml'
    deep.write_text(DEEP_TOML)
    rc, _out = run(['check-config', str(deep)])
    assert rc == 1 and capsys.readouterr().err == '%s: %s\n' % (deep, TOO_DEEP)
    rc, out = run(['check-config', str(deep), '--json'])
    assert rc == 1 and json.loads(out)['errors'][0]['why'] == TOO_DEEP
    bomb = tmp_path / 'bomb.yaml'
    bomb.write_text(billion_laughs())
    rc, _out = run(['check-config', str(bomb)])
    assert rc == 1 and 'line %d: %s' % (BOMB_LINE, TOO_MANY_ALIASED) in capsys.readouterr().err


def test_check_config_reads_stdin(monkeypatch):
    monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(GOOD.encode())))
    assert run(['check-config', '-'])[0] == 0
    monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(b'mode: always\n')))
    assert run(['check-config', '-'])[0] == 1


def test_tick_and_test(root, fake_host):
    rc, out = run(['test', '--root', str(root)])
    assert rc == 0 and 'max_mem_per_gpu' in out and 'would end pid(s) 11' in out and 'warn' in out
    assert not os.path.exists(guard.Paths(root=str(root)).state)
    rc, out = run(['tick', '--root', str(root), '--json'])
    summary = json.loads(out)
    assert rc == 0 and [d['decision'] for d in summary['decisions']] == ['warn']
    rc, out = run(['tick', '--root', str(root), '--quiet'])
    assert rc == 0 and out == ''
    rc, out = run(['tick', '--root', str(root), '--dry-run'])
    assert rc == 0 and 'mode dry-run' in out
    rc, out = run(['verify-log', '--root', str(root)])
    assert rc == 0 and 'chain valid, 1 line(s)' in out


def test_verify_log_finds_tampering(root, fake_host):
    run(['tick', '--root', str(root)])
    log = guard.Paths(root=str(root)).log
    with open(log) as handle:
        text = handle.read()
    with open(log, 'w') as handle:
        handle.write(text.replace('"alice"', '"mallory"'))
    rc, out = run(['verify-log', log])
    assert rc == 1 and 'BROKEN' in out
    rc, out = run(['verify-log', log, '--json'])
    assert json.loads(out)['valid'] is False


def test_verify_log_accepts_actions_over_pids_9_and_10(tmp_path):
    """One action over pids whose numeric and text order differ (9/10, 999/1000) is not reported as edited."""
    log = str(tmp_path / 'guard.jsonl')
    for pids in ((9, 10), (999, 1000)):
        audit_log.append(log, {'event': 'guard_decision', 'decision': 'act', 'pids': list(pids), 'outcome': {
            'result': 'done', 'signal': 'SIGTERM', 'pids': dict((pid, {'outcome': 'killed', 'signals': ['SIGTERM']}) for pid in pids)}})
    rc, out = run(['verify-log', log])
    assert rc == 0 and out == '%s: chain valid, 2 line(s)\n' % log
    with open(log) as handle:
        text = handle.read()
    with open(log, 'w') as handle:
        handle.write(text.replace('"999":{"outcome":"killed"', '"999":{"outcome":"failed"'))
    rc, out = run(['verify-log', log])
    assert rc == 1 and 'line 2: line content does not match its hash (edited)' in out


def test_tick_with_an_invalid_policy_fails(root, fake_host, capsys):
    with open(guard.Paths(root=str(root)).policy, 'w') as handle:
        handle.write('mode: loud\n')
    rc, _out = run(['tick', '--root', str(root)])
    assert rc == 1 and 'mode' in capsys.readouterr().err


def test_list_table_and_json_redact_secrets(root, fake_host):
    rc, out = run(['list', '--root', str(root)])
    assert rc == 0 and 'alice' in out and 'train.py --token=<redacted>' in out and 'abc' not in out.split('COMMAND')[1]
    rc, out = run(['list', '--root', str(root), '--json'])
    data = json.loads(out)
    assert data['processes'][0]['cmdline'] == 'python train.py --token=<redacted>' and data['host']


def test_list_watch_is_bounded_without_a_terminal(root, fake_host, monkeypatch):
    monkeypatch.setattr(cli.time, 'sleep', lambda _s: None)
    rc, out = run(['list', '--root', str(root), '--watch', '--json'])
    assert rc == 0 and len(out.strip().splitlines()) == 3
    rc, out = run(['list', '--root', str(root), '--watch', '--count', '2'], tty=True)
    assert rc == 0 and out.count('\x1b[H\x1b[2J') == 2       # refreshed in place on a terminal
    assert run(['list', '--root', str(root), '--watch', '--interval', '0'])[0] == 2


def test_kill_dry_run_uses_the_core_reclaim(root, fake_host, monkeypatch):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import reclaim  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(reclaim, 'take_snapshot', lambda **_kw: fake_host)
    rc, out = run(['kill', '--root', str(root), '--user', 'nobody-here', '--dry-run'])
    assert rc == 0 and json.loads(out)['killed'] == []
    rc, _out = run(['kill', '--root', str(root)])
    assert rc == 1                                              # no selector: refused by the core


def test_reset_and_audit_say_when_they_are_not_in_this_build(root, monkeypatch, capsys):
    prefix = 'ansible_collections.gpufleet.reclaim.plugins.module_utils.core.'
    monkeypatch.setitem(sys.modules, prefix + 'reset', None)
    monkeypatch.setitem(sys.modules, prefix + 'rogue', None)
    assert run(['reset', '--root', str(root), '--gpu', '0'])[0] == 1
    assert 'not available in this build' in capsys.readouterr().err
    assert run(['audit', '--root', str(root)])[0] == 1
    assert 'not available in this build' in capsys.readouterr().err


def test_audit_appends_findings_to_the_audit_log(root, monkeypatch):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue  # pylint: disable=import-outside-toplevel
    snap = snapshot([proc(21, 'eve', {0: GIB}, name='xmrig', cmdline=['xmrig', '-o', 'stratum+tcp://pool.example:3333'])])
    monkeypatch.setattr(snapshot_mod, 'take_snapshot', lambda **_kw: snap)
    finding = {'pid': 21, 'level': 'critical', 'score': 90, 'user': 'eve', 'rules': [{'id': 'H-stratum', 'kind': 'hard'}],
               'listed': True}
    monkeypatch.setattr(rogue, 'detect_snapshot', lambda *a, **kw: ([finding], [], 1))
    rc, out = run(['audit', '--root', str(root)])
    assert rc == 0 and '1 finding(s) logged' in out
    paths = guard.Paths(root=str(root))
    with open(paths.audit_log) as handle:
        record = json.loads(handle.readline())
    assert record['event'] == 'rogue_finding' and record['pid'] == 21
    assert run(['verify-log', paths.audit_log])[0] == 0


def test_reset_dry_run_goes_to_the_core_reset(root, monkeypatch):
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import reset  # pylint: disable=import-outside-toplevel
    seen = {}

    def fake_reset(options, check_mode=False):
        seen.update(gpus=options.gpus, check_mode=check_mode)
        return {'changed': True, 'failed_gpus': [], 'reset_gpus': [0]}
    monkeypatch.setattr(reset, 'reset', fake_reset)
    rc, out = run(['reset', '--root', str(root), '--gpu', '0', '--dry-run'])
    assert rc == 0 and seen == {'gpus': ['0'], 'check_mode': True} and json.loads(out)['reset_gpus'] == [0]


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as info:
        cli.main(['frobnicate'])
    assert info.value.code == 2


def test_runs_standalone_without_ansible(tmp_path):
    """The agent on a node: the core package alone, run with python -m (no ansible importable)."""
    lib = tmp_path / 'lib'
    lib.mkdir()
    os.symlink(os.path.join(MODULE_UTILS, 'core'), str(lib / 'gpufleet_core'))
    policy = tmp_path / 'p.yaml'
    policy.write_text(GOOD)
    env = {'PATH': os.environ.get('PATH', '/usr/bin:/bin'), 'PYTHONPATH': str(lib)}
    check = ('import sys; sys.modules["ansible"] = None; sys.modules["ansible_collections"] = None; '
             'import runpy; sys.argv = ["gpufleet-guard"] + sys.argv[1:]; runpy.run_module("gpufleet_core.cli", run_name="__main__")')
    proc_ = subprocess.run([sys.executable, '-c', check, 'check-config', str(policy)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=60, check=False)
    assert proc_.returncode == 0, proc_.stderr.decode()
    assert b'valid' in proc_.stdout
    proc_ = subprocess.run([sys.executable, '-m', 'gpufleet_core.cli', '--version'], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=60, check=False)
    assert proc_.returncode == 0 and b'gpufleet-guard' in proc_.stdout
