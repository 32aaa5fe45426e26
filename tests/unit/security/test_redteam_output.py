# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: a command line aimed at the admin's terminal, and secrets in command lines (docs/security.md).

alice puts terminal escapes (OSC window title, erase screen, one-byte CSI), a newline followed by a
forged table row, and Unicode bidi and line separators in her argv; the admin runs the real
``gpufleet-guard list``, ``test`` and ``tick`` as root on the node.  Then alice puts secrets in her
argv and the admin runs ``gpufleet-guard kill --user alice`` and a tick: the log, the usage history
and the printed summaries hold none of them.  Each scenario runs in a PID namespace of its own
(``redteam.run``); see redteam.py for the safety.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3

from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace

# What a terminal acts on; the table's own line breaks are the only control characters allowed.
UNSAFE = re.compile('[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]')
ESCAPES = ['\x1b]0;pwned\x07', '\x1b[2J', '\n1234  root  0  99999 MiB  fake-row', '\u202e', '\x9b31m', '\u2028', '\r\x1b[1A']
SECRETS = {'--api-key': 'sk-proj-AbC123dEf456GhI789jKl0mN', 'db': 'postgres://app:Pg5ecretPw@db/x', 'mysql': 'MyPassW0rd9',
           'hf': 'hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567', 'pw': 'Hunter2Hunter2'}
WARN_ONLY = ('mode: enforce\nusers: {alice: {max_mem_gib_total: 1}}\nescalation: {act_after: 1h}\nnotify: {tty: false}\n')


def _vendor(node):
    return ('--vendor', 'nvidia', '--dev-root', node.sim.dev)


def _text(result):
    return result if isinstance(result, str) else json.dumps(result)


def scenario_escapes_in_argv(node):
    alice = node.spawn('alice', gpu=0, mib=2 * GIB, argv=['python3', 'train.py'] + ESCAPES)
    named = node.spawn('alice', gpu=1, mib=GIB, argv=['\x1b]2;x\x07\u202eevil'] + ESCAPES[:3])
    bob = node.spawn('bob', gpu=1, mib=GIB)
    node.write_policy(WARN_ONLY)
    out = {'pids': [alice, named, bob], 'comm': node.comm(named)}
    rc, text, _sig, err = node.cli('list', *_vendor(node))
    out['list'] = {'rc': rc, 'out': text, 'err': err}
    rc, text, _sig, err = node.cli('test', *_vendor(node))
    out['test'] = {'rc': rc, 'out': text, 'err': err}
    rc, text, signalled, err = node.cli('tick', *_vendor(node))
    out['tick'] = {'rc': rc, 'out': text, 'err': err, 'signalled': signalled}
    out['alive'] = [node.alive(pid) for pid in (alice, named, bob)]
    return out


def test_list_test_and_tick_output_carry_no_terminal_escapes_and_no_forged_rows():
    out = redteam.run(scenario_escapes_in_argv)
    alice, named, bob = out['pids']
    assert out['comm'].startswith('\x1b]2;x\x07')                                    # the kernel kept the escape
    listed = out['list']
    assert listed['rc'] == 0, listed['err']
    assert not UNSAFE.findall(listed['out']), sorted(set(UNSAFE.findall(listed['out'])))
    rows = listed['out'].split('COMMAND\n', 1)[1].splitlines()
    assert sorted(int(row.split()[0]) for row in rows) == sorted(out['pids']), rows    # one row per process, none forged
    assert not any(row.startswith('1234') for row in rows)
    row = [r for r in rows if r.startswith('%d ' % alice)][0]
    assert '\\x1b]0;pwned\\x07 \\x1b[2J \\x0a1234  root' in row and '\\u202e' in row and '\\x9b31m' in row
    for name in ('test', 'tick'):
        result = out[name]
        assert result['rc'] == 0, result['err']
        assert not UNSAFE.findall(result['out'] + result['err']), (name, result)
    assert 'alice' in out['test']['out'] and 'warn' in out['tick']['out']
    assert out['alive'] == [True, True, True] and not out['tick']['signalled']


def scenario_secrets_in_argv(node):
    argv = ['python3', 'train.py', '--api-key', SECRETS['--api-key'], '--db', SECRETS['db'], 'HF_TOKEN=' + SECRETS['hf'],
            '--password', SECRETS['pw']]
    alice = node.spawn('alice', gpu=0, mib=2 * GIB, argv=argv)
    dumper = node.spawn('alice', gpu=1, mib=GIB, argv=['mysqldump', '-uroot', '-p' + SECRETS['mysql'], 'sales'])
    bob = node.spawn('bob', gpu=1, mib=GIB, argv=['python3', 'serve.py', '--port', '8080'])
    node.write_policy(WARN_ONLY)
    out = {'pids': [alice, dumper, bob]}
    rc, summary, signalled, err = node.tick()                      # tick --json: decisions, violations, the history
    out['tick'] = {'rc': rc, 'summary': summary, 'signalled': signalled, 'err': err}
    rc, text, _sig, err = node.cli('test', '--json', *_vendor(node))
    out['test'] = {'rc': rc, 'out': text, 'err': err}
    rc, result, signalled, err = node.cli('kill', '--user', 'alice', '--timeout', '5', '--force', *_vendor(node))
    out['kill'] = {'rc': rc, 'result': result, 'signalled': signalled, 'err': err}
    out['log'] = node.guard_log()
    history = os.path.join(node.guard_root, 'var', 'lib', 'gpufleet', 'history.db')
    conn = sqlite3.connect(history)
    try:
        out['history'] = [row[0] for row in conn.execute('SELECT DISTINCT cmdline FROM samples')]
    finally:
        conn.close()
    out['alive'] = [node.alive(pid) for pid in (alice, dumper, bob)]
    return out


def test_kill_tick_and_history_never_write_a_secret_from_a_command_line():
    out = redteam.run(scenario_secrets_in_argv)
    alice, dumper, bob = out['pids']
    assert out['tick']['rc'] == 0, out['tick']['err']
    assert out['kill']['rc'] == 0, out['kill']
    # (signals sent through a pidfd do not show in the runner's os.kill record: the result and /proc say who ended)
    assert bob not in out['kill']['signalled'] and out['alive'] == [False, False, True]
    assert sorted(entry['pid'] for entry in out['kill']['result']['killed']) == sorted([alice, dumper])
    kill_events = [r for r in out['log'] if r.get('event') in ('gpu_kill', 'gpu_kill_signalled')]
    assert [r['event'] for r in kill_events] == ['gpu_kill_signalled', 'gpu_kill']
    assert len(out['history']) >= 3 and any('--api-key <redacted>' in (c or '') for c in out['history'])
    written = {'guard.jsonl': json.dumps(out['log']), 'history.db': json.dumps(out['history']),
               'tick --json': _text(out['tick']['summary']), 'test --json': _text(out['test']['out']),
               'kill (stdout)': _text(out['kill']['result'])}
    for where, text in written.items():
        for key, secret in SECRETS.items():
            assert secret not in text, (where, key)
            assert secret[-8:] not in text, (where, key)
    killed = dict((entry['pid'], entry) for entry in kill_events[-1]['killed'])
    assert killed[alice]['cmdline'] == ['python3 train.py --api-key <redacted> --db postgres://app:<redacted>@db/x '
                                        'HF_TOKEN=<redacted> --password <redacted>']
    assert killed[dumper]['cmdline'] == ['mysqldump -uroot -p<redacted> sales']
