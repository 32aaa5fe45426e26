# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""rogue.log_findings: the one writer of rogue findings into the hash-chained audit log (gpu_audit
and ``gpufleet-guard audit``), and the package face that replaced core/rogue.py."""

from __future__ import annotations

import json
import socket
import uuid

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, constants, rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue_rules
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.rogue import detector, rules

XMR = '45ASi45ub7Qe4ZE36UT5G6cU4ud8Fhhe4deS4F3cw9KTAb8dLcukC7edhDQ7cn5d4gEYkbUrMWeWQLGsCmrG6dLaYyNoVKf'


def findings(count=2):
    """Real findings of the detector (highest score first), one per miner process."""
    items = [rogue.ProcessFacts.from_dict({'pid': 100 + i, 'user': 'eve', 'cmdline': ['xmrig', '-o', 'stratum+tcp://pool.example:3333',
                                                                                      '-u', XMR], 'gpu_indexes': [0]})
             for i in range(count)]
    return rogue.Detector().detect(items)


def read(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def test_one_record_per_finding_sharing_a_run_id(tmp_path):
    path = str(tmp_path / 'log' / 'audit.jsonl')
    found = findings()
    assert rogue.log_findings(path, found, source='gpufleet-guard') == 2
    records = read(path)
    assert [r['pid'] for r in records] == [f['pid'] for f in found]
    assert len(set(r['run_id'] for r in records)) == 1
    uuid.UUID(records[0]['run_id'])                                 # a UUID, as docs/audit-schema.md says
    for record, finding in zip(records, found):
        assert record['schema'] == rogue.RECORD_SCHEMA == 1 and record['event'] == 'rogue_finding'
        assert record['host'] == socket.gethostname() and record['source'] == 'gpufleet-guard'
        assert dict((k, record[k]) for k in finding) == json.loads(json.dumps(finding))
    assert audit_log.verify(path) == {'valid': True, 'lines': 2, 'errors': []}
    assert rogue.log_findings(path, findings(1)) == 1                # a second run chains on and has its own run_id
    records = read(path)
    assert 'source' not in records[2] and records[2]['run_id'] != records[0]['run_id']
    assert audit_log.verify(path)['valid']


def test_nothing_to_log_writes_nothing(tmp_path):
    path = tmp_path / 'audit.jsonl'
    assert rogue.log_findings(str(path), []) == 0
    assert rogue.log_findings(None, findings()) == 0
    assert rogue.log_findings('', findings()) == 0
    assert not path.exists()


def test_a_write_that_fails_raises_or_becomes_a_warning(tmp_path):
    blocker = tmp_path / 'not-a-dir'
    blocker.write_text('x')
    path = str(blocker / 'audit.jsonl')
    with pytest.raises(audit_log.AuditLogError):
        rogue.log_findings(path, findings())
    warnings = ['earlier']
    assert rogue.log_findings(path, findings(), warnings=warnings) == 0
    assert warnings[0] == 'earlier' and len(warnings) == 2 and 'audit.jsonl' in warnings[1]


def test_the_findings_after_a_failed_write_are_not_written(tmp_path, monkeypatch):
    path = str(tmp_path / 'audit.jsonl')
    real = audit_log.append
    calls = []

    def append(target, record):
        calls.append(record['pid'])
        if len(calls) == 2:
            raise audit_log.AuditLogError('disk full')
        return real(target, record)
    monkeypatch.setattr(audit_log, 'append', append)
    warnings = []
    assert rogue.log_findings(path, findings(3), warnings=warnings) == 1
    assert warnings == ['disk full'] and len(calls) == 2 and len(read(path)) == 1


def test_the_old_names_stay_importable():
    """core.rogue (now a package) and core.rogue_rules offer the names they offered as files."""
    missing = [name for name in rogue.__all__ if not hasattr(rogue, name)]
    assert missing == []
    assert rogue.R is rules and rogue.LEVELS is rules.LEVELS is constants.ROGUE_LEVELS
    assert [name for name in rogue_rules.__all__ if getattr(rogue_rules, name) is not getattr(rules, name)] == []
    assert rogue.detect_snapshot is detector.detect_snapshot
    assert sorted(rogue.BUILTIN_CHECKS) == sorted(rid for rid, _kind, _weight, _desc in rules.BUILTIN_RULES)
