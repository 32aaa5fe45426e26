# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""GPU-hour accounting on the controller: the ``accounting`` of gpu_audit's usage reports (``history.report``, one per
node) as CSV (``accounting_csv``) and added up across a fleet (``merge``), for the filters of the same names and the
fleet report.  Nothing here reads a node: the input is the reports' plain data (docs/audit-schema.md).
"""

from __future__ import annotations

import time

from .errors import InvalidArgument
from .text import csv_row

HOURS = ('gpu_hours', 'busy_gpu_hours', 'idle_gpu_hours')
CSV_COLUMNS = ('host', 'section', 'user', 'job', 'gpu_index', 'gpu_uuid') + HOURS + ('first_seen', 'last_seen', 'message')


def by_host(reports):
    """``{host: report}`` of ``reports``: one report (host None) or a mapping of host names to reports."""
    if isinstance(reports, dict) and ('accounting' in reports or 'available' in reports):
        return {None: reports}
    if not isinstance(reports, dict):
        raise InvalidArgument('reports', type(reports).__name__, 'expected a gpu_audit report or a mapping of host names to reports')
    return reports


def _accounting(report):
    acc = report.get('accounting') if isinstance(report, dict) else None
    return acc if isinstance(acc, dict) else None


def _why(report):
    return (report.get('error') if isinstance(report, dict) else None) or 'no accounting in this report'


def _hosts(reports):
    return sorted(reports, key=lambda name: '' if name is None else str(name))


def accounting_csv(reports):
    """The accounting of ``reports`` (see ``by_host``) as CSV text: RFC 4180, CRLF, a header row, every cell
    ``text.csv_cell`` (escaped, formulas defused).  Per host one row per user (``section`` ``user``), job and GPU, then
    ``unattributed`` and ``total``; a host without a readable history is one ``unavailable`` row, the reason in
    ``message``."""
    reports = by_host(reports)
    lines = [','.join(CSV_COLUMNS)]
    for host in _hosts(reports):
        acc = _accounting(reports[host])
        if acc is None:
            lines.append(csv_row((host, 'unavailable') + (None,) * (len(CSV_COLUMNS) - 3) + (_why(reports[host]),)))
            continue
        sections = (('user', acc.get('users')), ('job', acc.get('jobs')), ('gpu', acc.get('gpus')),
                    ('unattributed', [acc.get('unattributed')]), ('total', [acc.get('totals')]))
        for section, rows in sections:
            for row in rows or ():
                row = row if isinstance(row, dict) else {}
                users = row.get('users') if section == 'job' else None
                user = ' '.join(str(u) for u in users) if isinstance(users, list) else row.get('user')
                lines.append(csv_row((host, section, user, row.get('job'), row.get('gpu_index'), row.get('gpu_uuid'))
                                     + tuple(row.get(field) for field in HOURS)
                                     + (_iso(row.get('first_seen')), _iso(row.get('last_seen')), None)))
    return '\r\n'.join(lines) + '\r\n'


def _iso(stamp):
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        return None
    return time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(stamp))


def merge(reports, top=None):
    """The accounting of a fleet: ``reports`` (``{host: report}``) added up.

    Returns ``{'nodes': hosts with an accounting, 'unavailable': [{host, error}], 'totals', 'unattributed', 'users'
    ({user, the GPU-hours, nodes}), 'jobs' ({job, users, the GPU-hours, nodes, first_seen, last_seen}: one job on
    several nodes is one row), 'gpus' ({host, gpu_index, gpu_uuid, the GPU-hours, users, jobs})}``, each list by
    GPU-hours, the first ``top`` (None: all); ``totals`` counts them all.  The sums agree as each node's do, as long as
    no node's report left rows out (gpu_audit ``top``)."""
    reports = by_host(reports)
    users, jobs, gpus, unavailable = {}, {}, [], []
    totals, unattributed = dict.fromkeys(HOURS, 0.0), dict.fromkeys(HOURS, 0.0)
    nodes = 0
    for host in _hosts(reports):
        acc = _accounting(reports[host])
        if acc is None:
            unavailable.append({'host': host, 'error': _why(reports[host])})
            continue
        nodes += 1
        _add(totals, acc.get('totals'))
        _add(unattributed, acc.get('unattributed'))
        for row in acc.get('users') or ():
            entry = users.setdefault(row.get('user'), dict({'user': row.get('user'), 'nodes': 0}, **dict.fromkeys(HOURS, 0.0)))
            _add(entry, row)
            entry['nodes'] += 1
        for row in acc.get('jobs') or ():
            entry = jobs.setdefault(row.get('job'), dict({'job': row.get('job'), 'users': [], 'nodes': 0, 'first_seen': None,
                                                          'last_seen': None}, **dict.fromkeys(HOURS, 0.0)))
            _add(entry, row)
            entry['nodes'] += 1
            entry['users'] = sorted(set(entry['users']) | set(row.get('users') or ()), key=str)
            entry['first_seen'] = _extreme(min, entry['first_seen'], row.get('first_seen'))
            entry['last_seen'] = _extreme(max, entry['last_seen'], row.get('last_seen'))
        for row in acc.get('gpus') or ():
            gpus.append(dict((key, row.get(key)) for key in ('gpu_index', 'gpu_uuid') + HOURS + ('users', 'jobs')))
            gpus[-1]['host'] = host
    counts = {'users': len(users), 'jobs': len(jobs), 'gpus': len(gpus)}
    return {
        'nodes': nodes,
        'unavailable': unavailable,
        'totals': dict(_rounded(totals), **counts),
        'unattributed': _rounded(unattributed),
        'users': _first(users.values(), 'user', top),
        'jobs': _first(jobs.values(), 'job', top),
        'gpus': _first(gpus, 'host', top),
    }


def _add(into, row):
    for field in HOURS:
        value = row.get(field) if isinstance(row, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            into[field] += value


def _extreme(pick, current, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return current
    return value if current is None else pick(current, value)


def _rounded(hours):
    return dict((field, round(hours[field], 4)) for field in HOURS)


def _first(rows, key, top):
    ordered = sorted(rows, key=lambda row: (-row['gpu_hours'], str(row[key]), str(row.get('gpu_index'))))
    return [dict(row, **_rounded(row)) for row in (ordered if top is None else ordered[:int(top)])]
