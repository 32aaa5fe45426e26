# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the node's users write (process names, command lines) on its way to people: escaped on every
human-facing output (core/text.py: terminal, tty warnings, syslog, the HTML report, the CSV file) and
redacted on every path that writes a command line (docs/security.md).  The end-to-end attacks through
the real CLI are in test_redteam_output.py; these are the unit-level checks of each writer."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sqlite3
import sys
import time

import jinja2
import pytest

from ansible_collections.gpufleet.reclaim.plugins.filter.printable import FilterModule as PrintableFilters
from ansible_collections.gpufleet.reclaim.plugins.filter.fleet_rows import fleet_csv, fleet_rows
from ansible_collections.gpufleet.reclaim.plugins.filter.redact_gpu_facts import redact_gpu_facts
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import cli, guard, history, notify, policy, reset, select, textmatch
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import printable, printable_lines
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_audit, gpu_kill
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, proc, snapshot

# Every character a terminal, a log viewer or a browser acts on, as users put them in their argv.
HOSTILE = ['\x1b]0;pwned\x07', '\x1b[2J', '\n1234  root  0  99999 MiB  fake-row', '\u202e', '\x9b31m', '\r', '\t', '\x00',
           '\x7f', '\x85', '\u2028', '\u2029', '\u2066', '\u200f', '\u061c', '\x08\x08\x08']
UNSAFE = re.compile('[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]')
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def unsafe_in(text, allow=''):
    return sorted(set(c for c in UNSAFE.findall(text) if c not in allow))


# ============================================================================ the escaping
@pytest.mark.parametrize('hostile', HOSTILE)
def test_printable_escapes_each_hostile_character_visibly(hostile):
    text = printable('python ' + hostile + ' x')
    assert not unsafe_in(text), text
    assert text.startswith('python ') and text.endswith(' x')
    first = UNSAFE.search(hostile).group(0)
    code = ord(first)
    assert (('\\x%02x' % code) if code < 0x100 else ('\\u%04x' % code)) in text


def test_printable_leaves_ordinary_text_alone_and_takes_anything():
    plain = 'python3 train.py --lr 0.001 --name \u00e9t\u00e9-\u4e2d\u6587-\U0001f680 C:\\path "q" <b>'
    assert printable(plain) == plain
    assert printable(None) is None and printable(42) == '42'
    assert printable(b'a\x1bb\xff') == 'a\\x1bb\ufffd'                     # bytes: invalid UTF-8 replaced
    assert printable('a\udc9bb') == 'a\ufffdb'                              # a lone surrogate cannot reach an encoder
    assert printable_lines('one\x1b[2J\ntwo\rthree') == 'one\\x1b[2J\ntwo\\x0dthree'


# ============================================================================ the redaction
SECRETS = [
    # (argv, the secret, text that stays)
    (['python', 'train.py', '--secret-key', 'S3cretKey9'], 'S3cretKey9', 'python train.py --secret-key <redacted>'),
    (['mysql', '-uroot', '-pPassW0rd', 'sales'], 'PassW0rd', '-uroot -p<redacted> sales'),
    (['/usr/bin/mysqldump', '-u', 'bk', '-pPassW0rd', 'db'], 'PassW0rd', '-p<redacted> db'),
    (['python', 'x.py', 'sk-proj-AbC123dEf456GhI789jKl0'], 'AbC123dEf456GhI789jKl0', 'x.py sk-proj-<redacted>'),
    (['python', 'x.py', '--api-key', 'sk-proj-AbC123dEf456GhI789jKl0'], 'AbC123dEf456', 'x.py --api-key <redacted>'),
    (['huggingface-cli', 'login', 'hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567'], 'AbCdEfGhIjKlMnOpQrStUvWxYz', 'login hf_<redacted>'),
    (['redis-cli', '-u', 'redis://:R3disPw@cache:6379/0'], 'R3disPw', 'redis://:<redacted>@cache:6379/0'),
    (['psql', 'postgres://app:Pg5ecret@db.internal/sales'], 'Pg5ecret', 'postgres://app:<redacted>@db.internal/sales'),
    (['app', '--config', '{"password": "hunter2", "lr": 0.1}'], 'hunter2', '{"password": "<redacted>", "lr": 0.1}'),
    (['app', "{'api_key': 'hunter2'}"], 'hunter2', "{'api_key': '<redacted>'}"),
    (['x', '--token=T0kenValue'], 'T0kenValue', 'x --token=<redacted>'),
    (['x', '--api-key', 'K3yValue'], 'K3yValue', 'x --api-key <redacted>'),
    (['x', '--password', 'hunter2', '--epochs', '3'], 'hunter2', 'x --password <redacted> --epochs 3'),
    (['x', '--db-password=pw1234', '--aws-secret-access-key', 'wJalrXUtnFEMI'], 'wJalrXUtnFEMI', '--db-password=<redacted>'),
    (['env', 'AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG', 'python'], 'wJalrXUtnFEMI', 'AWS_SECRET_ACCESS_KEY=<redacted> python'),
    (['x', 'ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123'], 'AbCdEfGhIjKlMnOpQrStUvWxYz', 'x ghp_<redacted>'),
    (['x', 'github_pat_11ABCDEFG0123456789_abcdefghijklmnop'], '11ABCDEFG0123456789', 'x github_pat_<redacted>'),
    (['x', 'xoxb-1234567890-0987654321-AbCdEfGhIj'], '1234567890-0987654321', 'x xoxb-<redacted>'),
    (['x', 'AKIAIOSFODNN7EXAMPLE'], 'IOSFODNN7EXAMPLE', 'x AKIA<redacted>'),
    (['curl', '-H', 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig', 'https://api'], 'eyJhbGciOiJIUzI1NiJ9',
     'Authorization: Bearer <redacted> https://api'),
    (['curl', '-H', 'Authorization: Basic dXNlcjpwYXNz', 'https://api'], 'dXNlcjpwYXNz', 'Authorization: Basic <redacted>'),
    (['curl', '-H', 'X-Api-Key: abcdef123456', 'https://api'], 'abcdef123456', 'X-Api-Key: <redacted> https://api'),
    (['git', 'clone', 'https://oauth2:glpat-AbCdEfGhIjKlMnOpQrSt@gitlab/x.git'], 'AbCdEfGhIjKlMnOpQrSt', 'git clone https://oauth2:'),
    (['python', 'train.py', '--hf-token', 'hf_xyz'], 'hf_xyz', 'train.py --hf-token <redacted>'),
    (['x', 'HF_TOKEN=hf_xyz', 'PGPASSWORD=pgpw'], 'pgpw', 'HF_TOKEN=<redacted> PGPASSWORD=<redacted>'),
]


@pytest.mark.parametrize('argv,secret,kept', SECRETS, ids=[' '.join(s[0])[:40] for s in SECRETS])
def test_default_redaction_removes_each_secret_form(argv, secret, kept):
    patterns = [select.compile_regex('notify.redact_patterns', p) for p in notify.DEFAULT_REDACT_PATTERNS]
    text = notify.redact(argv, patterns)
    assert secret not in text and kept in text, text
    listed = notify.redact_argv(argv, patterns)
    assert isinstance(listed, list) and all(isinstance(a, str) for a in listed)
    assert secret not in json.dumps(listed) and '<redacted>' in ' '.join(listed), listed


ORDINARY = [
    ['python3', 'train.py', '--lr', '0.001', '-p', '8080', '--epochs', '3'],
    ['python3', 'gen.py', '--max-tokens', '100', '--tokenizer', 'gpt2', '--author', 'me', '--passes', '3'],
    ['torchrun', '--nproc_per_node=8', 'train.py', '--config', 'configs/llama.yaml', '--output-dir', '/scratch/run-42'],
    ['mysql', '-p', 'sales'],                                                  # -p alone prompts for the password
    ['gcc', '-pthread', '-pedantic', '-o', 'x', 'x.c'],                         # -p glued to text, but not mysql
    ['python3', '-c', 'from sklearn.svm import SVC; import hf_hub'],
    ['curl', 'https://host:8443/v1/models', 'ssh://git@github.com/org/repo'],
    ['python3', 'task-runner.py', '--sk', '1', '--token-budget', '5', '--keyfile', '/etc/key.pem'],
]


@pytest.mark.parametrize('argv', ORDINARY, ids=[' '.join(a)[:40] for a in ORDINARY])
def test_default_redaction_keeps_ordinary_arguments(argv):
    patterns = notify.default_patterns()
    assert notify.redact(argv, patterns) == ' '.join(argv)
    assert notify.redact_argv(argv, patterns) == argv


def test_default_patterns_pass_the_user_regex_guards_and_stay_fast_on_hostile_text():
    """Each default goes through select.compile_regex (no nested quantifiers) and stays linear on 32 KiB
    texts shaped against it.  Measured in this process's CPU time, not wall-clock time (a loaded CI
    machine stretches the latter): quadratic backtracking on 32 KiB costs minutes of CPU, linear
    matching milliseconds, so the 2 s bound separates them by orders of magnitude either way."""
    patterns = [select.compile_regex('notify.redact_patterns', p) for p in notify.DEFAULT_REDACT_PATTERNS]
    n = select.MAX_MATCH_TEXT
    shapes = ['://' * (n // 3), '://:' * (n // 4), '-a' * (n // 2), '.-' * (n // 2), '"password": "' * (n // 14),
              "'token': '" * (n // 10), 'mysql' + ' -p' * (n // 3), 'mysql' + ' x' * (n // 2), '--' + 'a' * n,
              'Authorization:' * (n // 14), 'sk-' * (n // 3), 'x-api-key:' * (n // 10), '"' + 'a' * n, '=-a' * (n // 3),
              '-_' * (n // 2), 'bearer ' * (n // 7), 'hf_' * (n // 3), 'AKIA' * (n // 4)]
    worst = 0.0
    for shape in shapes:
        for pattern in patterns:
            started = time.process_time()
            pattern.sub('', shape[:n])
            worst = max(worst, time.process_time() - started)
    assert worst < 2.0, worst


def test_redact_argv_fails_closed_and_keeps_none():
    assert notify.redact_argv(None, notify.default_patterns()) is None
    slow = [select.compile_regex('r', '.*.*.*x')]
    old = textmatch.MATCH_TIMEOUT_S
    textmatch.MATCH_TIMEOUT_S = 0.05
    try:
        out = notify.redact_argv(['a' * 20000, '--password=hunter2'], slow + notify.default_patterns())
    finally:
        textmatch.MATCH_TIMEOUT_S = old
    assert out == [notify.REDACTED_SLOW, '--password=<redacted>']          # the slow argument whole, never as it was


def test_policy_defaults_are_the_notify_defaults():
    assert policy.DEFAULT_REDACT_PATTERNS is notify.DEFAULT_REDACT_PATTERNS
    loaded = policy.load_policy_text('notify: {tty: false}').notify.redact_patterns
    assert [p.pattern for p in loaded] == list(notify.DEFAULT_REDACT_PATTERNS)


# ============================================================================ tty warnings and syslog
def test_tty_warning_escapes_what_users_wrote(monkeypatch):
    """The text that would be written to alice's terminals (captured at notify.write_ttys)."""
    written = []
    monkeypatch.setattr(notify, 'write_ttys', lambda user, uid, text, *_a: written.append(text) or (1, []))
    policy_obj = policy.load_policy_text('notify: {tty: true, message: "line one\\nline two"}')
    notifier = notify.Notifier(policy_obj.notify, 'node7')
    items = [{'decision': 'warn', 'step': 1, 'pids': [4242], 'acts': True, 'act_in': 600,
              'message': 'process \x1b]0;pwned\x07\u202e named \n1234 root fake-row uses 12 GiB'}]
    notifier.send('alice', 1001, items, 'enforce')
    assert len(written) == 1
    text = written[0]
    assert not unsafe_in(text, allow='\n'), text
    lines = text.split('\n')
    assert lines[1:3] == ['line one', 'line two']                               # the admin's message keeps its lines
    assert len(lines) == 4 and '\\x1b]0;pwned\\x07\\u202e' in lines[3] and '\\x0a1234 root fake-row' in lines[3]


def test_syslog_line_has_no_raw_control_characters():
    """gpu_audit's syslog line is JSON with ensure_ascii: every control character, DEL and non-ASCII escaped."""
    finding = {'level': 'high', 'score': 80, 'pid': 7, 'user': 'alice', 'gpu_indexes': [0], 'used_mib': 1024,
               'exe': '/tmp/x\x1b[2J\x7f\u202e\n', 'rules': [{'id': 'H-pool'}], 'allowlisted': None}
    line = gpu_audit.syslog_message(finding)
    assert not unsafe_in(line), line
    assert line.startswith('gpufleet rogue finding: {') and '\\u001b[2J\\u007f\\u202e\\n' in line


# ============================================================================ gpufleet-guard output (in process)
class Out(io.StringIO):
    def isatty(self):
        return False


def test_list_table_escapes_names_and_keeps_one_row_per_process():
    snap = snapshot([proc(11, 'alice', {0: 12 * GIB}, cmdline=['python', '--token=abc'] + HOSTILE),
                     proc(12, 'bob', {1: GIB})])
    snap.devices[0].name = 'A100\x1b[31m'
    text = cli.render_list(snap, notify.default_patterns())
    assert not unsafe_in(text, allow='\n'), text
    rows = text.split('COMMAND\n', 1)[1].splitlines()
    assert len(rows) == 2 and rows[0].startswith('11 ') and rows[1].startswith('12 ')
    assert '--token=<redacted>' in rows[0] and 'A100\\x1b[31m' in text


def test_err_escapes_and_indents_continuation_lines(capsys):
    cli._err('bad value "x\x1b]0;t\x07"\nsecond line\r')
    err = capsys.readouterr().err
    assert err == 'gpufleet-guard: bad value "x\\x1b]0;t\\x07"\n  second line\\x0d\n'


def test_json_output_is_ascii_with_every_control_escaped():
    out = Out()
    cli._print_json({'cmdline': 'a\x7fb\x1b\u202e\x9b'}, out)
    assert not unsafe_in(out.getvalue(), allow='\n') and json.loads(out.getvalue()) == {'cmdline': 'a\x7fb\x1b\u202e\x9b'}


def test_tick_summary_violations_are_redacted():
    """``tick --json``, ``test --json`` and gpu_audit policy= print or return the violations: redacted."""
    snap = snapshot([proc(11, 'alice', {0: 12 * GIB}, cmdline=['python', 'train.py', '--api-key', 'sk-proj-AbC123dEf456GhI789jKl0'])])
    policy_obj = policy.load_policy_text('mode: warn\nusers: {alice: {max_mem_gib_per_gpu: 8}}\nnotify: {tty: false}\n')
    violations, _notes, _warnings = guard.dry_run(policy_obj, snap, guard.Paths(state='', history=''))
    assert violations and 'AbC123' not in json.dumps(violations)
    assert violations[0]['procs'][0]['cmdline'] == ['python train.py --api-key <redacted>']


def test_history_stores_redacted_command_lines(tmp_path):
    snap = snapshot([proc(11, 'alice', {0: GIB}, cmdline=['python', 'train.py', '--password', 'hunter2'])])
    path = str(tmp_path / 'history.db')
    history.record_samples(path, snap, now=1767225600.0)
    history.record_samples(path, snap, now=1767225660.0, patterns=[select.compile_regex('r', 'train')])
    conn = sqlite3.connect(path)
    try:
        stored = [row[0] for row in conn.execute('SELECT cmdline FROM samples ORDER BY ts')]
    finally:
        conn.close()
    assert stored == ['python train.py --password <redacted>', 'python <redacted>.py --password hunter2']


def test_reset_messages_escape_process_names_and_results_are_redacted():
    snap = snapshot([proc(11, 'alice', {0: GIB}, name='x\x1b[2J', cmdline=['x', '--token=abc'])])
    entry = reset._describe(snap.processes[0])
    assert entry['cmdline'] == ['x', '--token=<redacted>']
    assert reset._who(entry) == 'pid 11 x\\x1b[2J (alice)'


def test_gpu_kill_diff_lines_are_escaped():
    entry = {'pid': 5, 'user': 'alice', 'cmdline': ['x\x1b]0;t\x07', '\n9 root fake'], 'name': 'x'}
    assert gpu_kill._line(entry) == '5 alice x\\x1b]0;t\\x07 \\x0a9 root fake'


# ============================================================================ the fleet report (HTML and CSV)
def _report_env():
    from ansible.plugins.filter.core import FilterModule as CoreFilters  # pylint: disable=import-outside-toplevel
    # as ansible.builtin.template renders (trim_blocks), with the one Ansible filter the templates use
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(REPO, 'playbooks', 'templates')),
                             undefined=jinja2.StrictUndefined, trim_blocks=True)
    env.filters['dict2items'] = CoreFilters().filters()['dict2items']
    env.filters.update(('gpufleet.reclaim.' + name, fn) for name, fn in PrintableFilters().filters().items())
    return env


# the report shows the first 90 characters of a command line: the hostile parts are spread over a process and a holder
HOSTILE_CMD = ['python', '<script>alert(1)</script>', 'sk-proj-AbC123dEf456GhI789jKl0', '\x1b]0;pwned\x07', '\x1b[2J']
HOSTILE_HOLDER = ['\n1234  root  0  99999 MiB  fake-row', '\u202e', '\x9b31m', '--token=abc']


def _report_vars():
    facts = {'devices': [{'index': 0}], 'holders': [{'pid': 8, 'user': 'alice', 'cmdline': HOSTILE_HOLDER,
                                                    'devices': ['/dev/nvidia0']}],
             'processes': [{'pid': 7, 'user': 'alice\u202e', 'cmdline': HOSTILE_CMD}]}
    red = redact_gpu_facts(facts)
    proc_row = {'host': 'node1', 'pid': 7, 'user': red['processes'][0]['user'], 'name': 'python',
                'cmd': ' '.join(red['processes'][0]['cmdline']), 'used_mib': 4096, 'gpus': [0], 'gpu_util_pct': 0, 'idle': True}
    gpu_row = {'host': 'node1', 'index': 0, 'name': '=cmd|\' /C calc\'!A0\x1b[2J', 'uuid': 'GPU-0', 'pci_bus_id': '0000:01:00.0',
               'vendor': 'nvidia', 'memory_total_mib': 81920, 'memory_used_mib': 8192, 'memory_free_mib': 73728,
               'orphaned_mib': 1024, 'utilization_pct': 0, 'temperature_c': 40, 'power_w': 60, 'health': 'degraded',
               'recommended_action': 'reset\n,injected,row', 'reasons': ['@SUM(1+1)', 'x\ty'], 'processes': 1,
               'top_user': '-alice', 'top_pid': 7, 'top_used_mib': 4096, 'used_pct': 10.0, 'proc_pct': 8.75, 'orphan_pct': 1.25}
    holder = dict(red['holders'][0], host='node1', cmd=' '.join(red['holders'][0]['cmdline']))
    records = [{'host': 'node1', 'status': 'ok', 'msg': '', 'gpu': red},
               {'host': 'node2', 'status': 'unreachable', 'msg': '+ssh: \x1b]0;x\x07 timed out\r\nrow', 'gpu': None}]
    totals = {'nodes': 2, 'nodes_ok': 1, 'nodes_unreachable': 1, 'nodes_failed': 0, 'gpus': 1, 'memory_total_mib': 81920,
              'memory_used_mib': 8192, 'orphaned_mib': 1024, 'idle_mib': 4096, 'processes': 1, 'users': 1,
              'unhealthy_gpus': 1, 'idle_holders': 1, 'orphan_holders': 1}
    return {'gpufleet_records': records, 'gpufleet_nodes': fleet_rows(records)['nodes'], 'gpufleet_pages': [], 'gpufleet_index_rows': 100,
            'gpufleet_gpus': [gpu_row], 'gpufleet_procs': [proc_row], 'gpufleet_holders': [holder],
            'gpufleet_users': [{'user': proc_row['user'], 'used_mib': 4096, 'processes': 1, 'gpus': 1, 'nodes': 1, 'idle_mib': 4096}],
            'gpufleet_idle': [proc_row], 'gpufleet_orphaned': [gpu_row], 'gpufleet_unhealthy': [gpu_row],
            'gpufleet_totals': totals, 'gpufleet_generated': '2026-01-01T00:00:00Z', 'gpufleet_top': 10,
            'gpufleet_idle_util_pct': 5, 'gpufleet_idle_min_mib': 1024}


def test_report_facts_are_redacted_before_anything_is_written():
    red = redact_gpu_facts(_report_vars()['gpufleet_records'][0]['gpu'])
    assert 'AbC123' not in json.dumps(red) and '--token=<redacted>' in red['holders'][0]['cmdline']
    assert redact_gpu_facts(None) is None


def test_html_report_escapes_hostile_facts():
    html = _report_env().get_template('report.html.j2').render(**_report_vars())
    assert not unsafe_in(html, allow='\n'), unsafe_in(html, allow='\n')
    assert '<script' not in html and '&lt;script&gt;alert(1)&lt;/script&gt;' in html
    assert '\\x1b]0;pwned\\x07' in html and '\\u202e' in html and '\\x9b31m' in html and 'alice\\u202e' in html
    assert '\\x0a1234  root' in html and 'AbC123' not in html and 'sk-proj-&lt;redacted&gt;' in html


def test_csv_report_escapes_controls_and_defuses_formulas():
    report = _report_vars()
    text = fleet_csv(report['gpufleet_nodes'], report['gpufleet_gpus'])     # fleet.csv (gpufleet.reclaim.fleet_rows' csv)
    assert not unsafe_in(text, allow='\n'), unsafe_in(text, allow='\n')
    rows = list(csv.reader(io.StringIO(text)))
    assert len(rows) == 3 and all(len(row) == len(rows[0]) for row in rows), rows    # header, node1's GPU, node2
    gpu, down = rows[1], rows[2]
    header = rows[0]
    assert gpu[header.index('name')] == "'=cmd|' /C calc'!A0\\x1b[2J"
    assert gpu[header.index('health_reasons')] == "'@SUM(1+1); x\\x09y"
    assert gpu[header.index('top_user')] == "'-alice"
    assert gpu[header.index('recommended_action')] == 'reset\\x0a,injected,row'
    assert down[header.index('message')] == "'+ssh: \\x1b]0;x\\x07 timed out\\x0d\\x0arow"
    for row in rows[1:]:
        for cell in row:
            assert cell[:1] not in ('=', '+', '-', '@', '\t', '\r'), row


def test_every_filter_plugin_is_documented():
    """The two filters the report uses are real Ansible filter plugins with docs (ansible-doc -t filter)."""
    for name in ('printable', 'redact_gpu_facts'):
        module = sys.modules['ansible_collections.gpufleet.reclaim.plugins.filter.' + name]
        assert 'name: %s' % name in module.DOCUMENTATION and module.EXAMPLES and module.RETURN
