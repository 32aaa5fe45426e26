# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Durations, sizes and the hash-chained audit log."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.units import parse_duration, parse_size_mib


@pytest.mark.parametrize('text, seconds', [
    (90, 90.0), ('90', 90.0), ('90s', 90.0), ('30m', 1800.0), ('2h', 7200.0), ('1h30m', 5400.0),
    ('2 hours', 7200.0), ('1d', 86400.0), ('500ms', 0.5), (0, 0.0),
])
def test_durations(text, seconds):
    assert parse_duration(text, 'idle_for') == seconds


@pytest.mark.parametrize('text', ['', 'soon', '-5', -5, '5 parsecs', '1h junk', True, None, [], '5m5', 'm5'])
def test_bad_durations_name_the_field(text):
    with pytest.raises(InvalidArgument) as err:
        parse_duration(text, 'older_than')
    assert 'older_than' in str(err.value)


@pytest.mark.parametrize('text, mib', [(512, 512.0), ('512', 512.0), ('8GB', 8192.0), ('8 GiB', 8192.0), ('12g', 12288.0), ('256MiB', 256.0)])
def test_sizes(text, mib):
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize('text', ['', 'lots', '-1GB', -1, '8 XB', True])
def test_bad_sizes(text):
    with pytest.raises(InvalidArgument):
        parse_size_mib(text, 'max_mem')


def test_chain_appends_and_verifies(tmp_path):
    path = str(tmp_path / 'log' / 'actions.jsonl')
    for i in range(5):
        audit_log.append(path, {'event': 'kill', 'n': i})
    report = audit_log.verify(path)
    assert report == {'valid': True, 'lines': 5, 'errors': []}
    lines = open(path).read().splitlines()
    assert json.loads(lines[0])['prev_hash'] == audit_log.GENESIS


def test_edit_is_detected(tmp_path):
    path = str(tmp_path / 'a.jsonl')
    for i in range(3):
        audit_log.append(path, {'event': 'kill', 'n': i})
    lines = open(path).read().splitlines()
    lines[1] = lines[1].replace('"n":1', '"n":7')
    open(path, 'w').write('\n'.join(lines) + '\n')
    report = audit_log.verify(path)
    assert not report['valid']
    assert report['errors'][0]['line'] == 2


PID_PAIRS = ((9, 10), (999, 1000), (99, 100, 1000, 20))


def _action(pids):
    """A record shaped like the guard's act decision: one outcome per pid, keyed by the pid (an int)."""
    return {'event': 'guard_decision', 'decision': 'act', 'pids': list(pids),
            'outcome': {'result': 'done', 'pids': dict((pid, {'outcome': 'killed', 'signals': ['SIGTERM']}) for pid in pids)}}


def test_pids_whose_numeric_and_text_order_differ_verify(tmp_path):
    path = str(tmp_path / 'a.jsonl')
    for pids in PID_PAIRS:
        written = audit_log.append(path, _action(pids))
        assert sorted(written['outcome']['pids']) == sorted(str(pid) for pid in pids)  # keys as JSON gives them back
    audit_log.append(path, {'event': 'mixed', 'keys': {3: 'int', 'b': 'text'}})  # int and text keys in one object
    assert audit_log.verify(path) == {'valid': True, 'lines': 4, 'errors': []}
    lines = open(path).read().splitlines()
    lines[1] = lines[1].replace('"1000":{"outcome":"killed"', '"1000":{"outcome":"failed"')
    assert lines[1] != open(path).read().splitlines()[1]
    open(path, 'w').write('\n'.join(lines) + '\n')
    report = audit_log.verify(path)
    assert not report['valid'] and report['errors'][0] == {'line': 2, 'error': 'line content does not match its hash (edited)'}


def _old_writer(path, records):
    """The writer before the fix: the hash over integer keys sorted as numbers (logs already on disk)."""
    prev = audit_log.GENESIS
    with open(path, 'w') as handle:
        for record in records:
            entry = dict(record, ts='2026-01-01T00:00:00.000Z', prev_hash=prev)
            entry['hash'] = hashlib.sha256(audit_log._canonical(entry).encode('ascii')).hexdigest()
            line = audit_log._canonical(entry)
            handle.write(line + '\n')
            prev = hashlib.sha256(line.encode('ascii')).hexdigest()


def test_logs_written_before_the_fix_still_verify(tmp_path):
    path = str(tmp_path / 'old.jsonl')
    _old_writer(path, [_action(pids) for pids in PID_PAIRS] + [{'event': 'gpu_kill', 'freed_mib': {'10': 5, '2': 7}}])
    assert '"9":{' in open(path).read().split('"10":{')[0]        # the old order: 9 before 10
    assert audit_log.verify(path) == {'valid': True, 'lines': 4, 'errors': []}
    audit_log.append(path, _action((9, 10)))                       # a new record chains onto an old one
    assert audit_log.verify(path)['valid']
    lines = open(path).read().splitlines()
    edited = list(lines)
    edited[0] = edited[0].replace('"10":{"outcome":"killed"', '"10":{"outcome":"skipped"')
    open(path, 'w').write('\n'.join(edited) + '\n')
    assert audit_log.verify(path)['errors'][0] == {'line': 1, 'error': 'line content does not match its hash (edited)'}


def test_an_order_no_writer_produced_is_not_accepted(tmp_path):
    """The old-order fallback accepts only the orders the old writer wrote, not any self-consistent line."""
    path = str(tmp_path / 'odd.jsonl')
    entry = {'prev_hash': audit_log.GENESIS, 'event': 'x', 'b': 1, 'a': 2}
    entry['hash'] = hashlib.sha256(json.dumps(entry, separators=(',', ':')).encode('ascii')).hexdigest()
    open(path, 'w').write(json.dumps(entry, separators=(',', ':')) + '\n')
    assert not audit_log.verify(path)['valid']


def test_deleted_line_is_detected(tmp_path):
    path = str(tmp_path / 'a.jsonl')
    for i in range(3):
        audit_log.append(path, {'event': 'kill', 'n': i})
    lines = open(path).read().splitlines()
    open(path, 'w').write('\n'.join([lines[0], lines[2]]) + '\n')
    report = audit_log.verify(path)
    assert not report['valid'] and report['errors'][0]['line'] == 2


def test_torn_last_line_is_reported_and_chain_continues(tmp_path):
    path = str(tmp_path / 'a.jsonl')
    audit_log.append(path, {'event': 'kill'})
    with open(path, 'a') as handle:
        handle.write('{"event": "tor')
    report = audit_log.verify(path)
    assert not report['valid']
    assert 'torn' in report['errors'][0]['error']


def test_concurrent_writers_keep_one_chain(tmp_path):
    path = str(tmp_path / 'a.jsonl')
    threads = [threading.Thread(target=lambda k=k: [audit_log.append(path, {'w': k, 'i': i}) for i in range(20)]) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert audit_log.verify(path) == {'valid': True, 'lines': 80, 'errors': []}


def test_unwritable_log_is_a_clear_error(tmp_path):
    target = tmp_path / 'dir-not-file'
    target.mkdir()
    with pytest.raises(audit_log.AuditLogError) as err:
        audit_log.append(str(target), {'event': 'x'})
    assert str(target) in str(err.value)
