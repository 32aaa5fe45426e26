# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Rogue findings in the hash-chained audit log: one ``rogue_finding`` record per finding.

The one writer of these records, for gpu_audit and ``gpufleet-guard audit``
(docs/audit-schema.md describes a record).
"""

from __future__ import annotations

import socket
import uuid

from .. import audit_log

RECORD_SCHEMA = 1


def log_findings(path, findings, source=None, warnings=None):
    """Append one record per finding to the audit log at ``path``; returns how many were written.

    A record is the finding plus ``schema``, ``event`` (``rogue_finding``), ``run_id`` (a UUID the
    records of one call share), ``host`` and, when given, ``source`` (the writer, such as
    ``gpufleet-guard``); audit_log.append adds ``ts``, ``prev_hash`` and ``hash``.  Nothing is
    written when ``path`` or ``findings`` is empty.  A record that cannot be written raises
    audit_log.AuditLogError, unless ``warnings`` is a list: then the error's message is appended to
    it and the findings after it are not written.
    """
    if not path or not findings:
        return 0
    run_id = str(uuid.uuid4())
    host = socket.gethostname()
    logged = 0
    for finding in findings:
        record = {'schema': RECORD_SCHEMA, 'event': 'rogue_finding', 'run_id': run_id, 'host': host}
        if source is not None:
            record['source'] = source
        record.update(finding)
        try:
            audit_log.append(path, record)
        except audit_log.AuditLogError as exc:
            if warnings is None:
                raise
            warnings.append(str(exc))
            break
        logged += 1
    return logged
