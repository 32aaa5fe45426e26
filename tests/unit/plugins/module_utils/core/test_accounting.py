# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""GPU-hour accounting on the controller (core/accounting.py): the CSV, its escaping, and the fleet's sums."""

from __future__ import annotations

import csv
import io
import re

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import accounting, history
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_history import T0, fill, jobs_scenario, proc, snapshot

UNSAFE_CSV = re.compile('[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]')


HOSTILE_USERS = ['=HYPERLINK("http://x/?"&A1)', '+cmd|/c calc', '-2+3', '@SUM(A1)', 'a"b,c', 'x\r\ny', '\tz', 'eve\u202e']


def test_accounting_csv_escapes_every_cell_and_defuses_formulas(tmp_path):
    db = str(tmp_path / 'h.db')
    fill(db, snapshot([proc(10 + i, user, [i % 4], 100, util=50, job=str(i + 1)) for i, user in enumerate(HOSTILE_USERS)]),
         samples=3)
    report = history.report(db, hours=1, now=T0 + 180, top=100)
    text = accounting.accounting_csv({'=node01': report, 'node02': {'available': False, 'error': 'no usage history at /x\n=1+1'}})
    assert text.endswith('\r\n') and '\n' not in text.replace('\r\n', '')      # no cell breaks a row
    rows = list(csv.reader(io.StringIO(text, newline='')))
    assert rows[0] == list(accounting.CSV_COLUMNS)
    assert all(len(row) == len(rows[0]) for row in rows)
    assert [r[1] for r in rows[1:]].count('user') == len(HOSTILE_USERS) and rows[-1][:2] == ['node02', 'unavailable']
    assert rows[-1][-1] == 'no usage history at /x\\x0a=1+1'
    users = [r[2] for r in rows[1:] if r[1] == 'user']
    for cell in [r[0] for r in rows[1:]] + users + [r[2] for r in rows[1:] if r[1] == 'job']:
        assert cell[:1] not in ('=', '+', '-', '@', '\t', '\r') and not UNSAFE_CSV.search(cell), cell
    assert "'=HYPERLINK(\"http://x/?\"&A1)" in users and "'-2+3" in users and 'x\\x0d\\x0ay' in users and 'eve\\u202e' in users
    total = [r for r in rows if r[1] == 'total'][0]
    assert total[0] == "'=node01" and float(total[6]) == report['accounting']['totals']['gpu_hours']
    job = [r for r in rows if r[1] == 'job' and r[3] == '1'][0]
    assert job[2] == "'=HYPERLINK(\"http://x/?\"&A1)" and job[4] == '' and job[9] == '2026-01-01T00:00:00Z'
    # numbers stay numbers, unknown values empty
    assert accounting.accounting_csv(report).split('\r\n')[1].startswith(',"user",')
    with pytest.raises(InvalidArgument, match='expected a gpu_audit report'):
        accounting.accounting_csv(['not', 'a', 'report'])


def test_csv_cell():
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import csv_cell
    assert [csv_cell(v) for v in (None, 0, 2.5, True, 'a', '=1', '-x', '@x', '+x', ' =x', 'a"b')] == [
        '', '0', '2.5', 'true', '"a"', '"\'=1"', '"\'-x"', '"\'@x"', '"\'+x"', '" =x"', '"a""b"']


def _sum(rows, field='gpu_hours'):
    return round(sum(r[field] for r in rows), 4)


def test_the_fleet_adds_up_users_and_jobs_across_nodes_and_keeps_each_gpu(tmp_path):
    one, two = str(tmp_path / 'one.db'), str(tmp_path / 'two.db')
    fill(one, jobs_scenario())
    # node02: carol's job 9 again (a job on two nodes) and alice without a job
    fill(two, snapshot([proc(500, 'carol', [0], 800, util=70, job='9'), proc(501, 'alice', [1], 300, util=0)]), samples=30)
    reports = {'node01': history.report(one, hours=24, now=T0 + 3600, top=1000),
               'node02': history.report(two, hours=24, now=T0 + 3600, top=1000),
               'node03': history.report(str(tmp_path / 'none.db'))}
    fleet = accounting.merge(reports)
    assert fleet['nodes'] == 2 and [u['host'] for u in fleet['unavailable']] == ['node03']
    assert 'no usage history' in fleet['unavailable'][0]['error']
    assert fleet['totals'] == {'gpu_hours': 5.0, 'busy_gpu_hours': 3.0, 'idle_gpu_hours': 2.0, 'users': 4, 'jobs': 3, 'gpus': 6}
    assert fleet['unattributed'] == {'gpu_hours': 1.5, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 1.5}
    assert fleet['jobs'][0] == {'job': '9', 'users': ['carol'], 'nodes': 2, 'gpu_hours': 2.5, 'busy_gpu_hours': 2.5,
                                'idle_gpu_hours': 0.0, 'first_seen': T0, 'last_seen': T0 + 59 * 60}
    assert [(u['user'], u['gpu_hours'], u['nodes']) for u in fleet['users']] == [
        ('carol', 2.5, 2), ('alice', 1.0, 2), ('bob', 1.0, 1), ('dave', 0.5, 1)]
    assert [(g['host'], g['gpu_index']) for g in fleet['gpus'][:2]] == [('node01', 0), ('node01', 1)]
    for field in accounting.HOURS:
        assert _sum(fleet['users'], field) == _sum(fleet['gpus'], field) == round(_sum(fleet['jobs'], field) + fleet['unattributed'][field], 4) \
            == fleet['totals'][field]
    small = accounting.merge(reports, top=1)
    assert [len(small[k]) for k in ('users', 'jobs', 'gpus')] == [1, 1, 1] and small['totals'] == fleet['totals']
    assert accounting.merge(reports['node01'])['nodes'] == 1      # one report alone
    with pytest.raises(InvalidArgument):
        accounting.merge('node01')
