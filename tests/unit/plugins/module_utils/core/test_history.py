# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The SQLite usage history: the writer (record_samples), retention, and the reader's reports."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import history
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import Device, GpuProcess
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import Snapshot

T0 = 1767225600.0   # 2026-01-01T00:00:00Z


def proc(pid, user, gpus, mib, util=None, start=None, name='python', cmdline=('python', 'train.py'), job=None):
    entry = GpuProcess(pid=pid)
    entry.slurm_job = job
    for index in gpus:
        entry.add_gpu(index, mib, ['compute'])
    entry.user = user
    entry.name = name
    entry.cmdline = list(cmdline)
    entry.starttime = start if start is not None else pid * 10
    entry.status = 'running'
    if util is not None:
        entry.util_pct = util
    return entry


def snapshot(procs, gpu_util=(90, 10, None, None)):
    devices = []
    for index, util in enumerate(gpu_util):
        dev = Device(vendor='nvidia', vendor_index=index, index=index, uuid='GPU-%d' % index, memory_total_mib=81559,
                     memory_used_mib=0, utilization_pct=util, minor=index)
        for p in procs:
            if index in p.gpu_indexes:
                dev.add_driver_process(p.pid, p.used_mib_by_gpu[index], 'compute')
                dev.memory_used_mib += p.used_mib_by_gpu[index] or 0
        devices.append(dev)
    return Snapshot(backends={}, devices=devices, all_devices=devices, processes=list(procs), holders=[], taken_at=T0)


def scenario():
    """alice alone on GPU 0 (GPU util 90), bob twice on GPU 1 (util 0 per process), carol on GPUs 2+3 (util unknown)."""
    return snapshot([proc(100, 'alice', [0], 4000), proc(200, 'bob', [1], 1000, util=0), proc(201, 'bob', [1], 1000, util=0),
                     proc(300, 'carol', [2, 3], 500, name='blender', cmdline=['blender', '-b', 'x.blend'])])


def fill(db, snap, samples=60, start=T0, step=60.0):
    for i in range(samples):
        history.record_samples(db, snap, now=start + i * step, interval_s=step)


def test_record_creates_a_private_database(tmp_path):
    db = str(tmp_path / 'lib' / 'history.db')
    result = history.record_samples(db, scenario(), now=T0)
    assert result == {'ts': T0, 'interval_s': history.DEFAULT_INTERVAL_S, 'rows': 5, 'pruned': 0}
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    conn = sqlite3.connect(db)
    try:
        meta = dict(conn.execute('SELECT key, value FROM meta'))
        assert meta == {'schema_version': '3', 'retention_days': '30'}   # 3: samples.slurm_job
        rows = conn.execute('SELECT gpu_index, gpu_uuid, pid, starttime, user, name, cmdline, used_mib, util_pct FROM samples'
                            ' ORDER BY pid, gpu_index').fetchall()
        assert rows == [(0, 'GPU-0', 100, 1000, 'alice', 'python', 'python train.py', 4000, 90.0),
                        (1, 'GPU-1', 200, 2000, 'bob', 'python', 'python train.py', 1000, 0.0),
                        (1, 'GPU-1', 201, 2010, 'bob', 'python', 'python train.py', 1000, 0.0),
                        (2, 'GPU-2', 300, 3000, 'carol', 'blender', 'blender -b x.blend', 500, None),
                        (3, 'GPU-3', 300, 3000, 'carol', 'blender', 'blender -b x.blend', 500, None)]
        assert conn.execute('SELECT COUNT(*) FROM gpu_samples').fetchone()[0] == 4
    finally:
        conn.close()


def test_interval_is_the_gap_capped(tmp_path):
    db = str(tmp_path / 'h.db')
    snap = scenario()
    assert history.record_samples(db, snap, now=T0)['interval_s'] == 60.0
    assert history.record_samples(db, snap, now=T0 + 30)['interval_s'] == 30.0
    assert history.record_samples(db, snap, now=T0 + 7230)['interval_s'] == history.DEFAULT_MAX_GAP_S
    assert history.record_samples(db, snap, now=T0 + 7240, interval_s=15)['interval_s'] == 15.0
    assert history.record_samples(db, snap, now=T0 + 7300, max_gap_s=20)['interval_s'] == 20.0


def test_retention_prunes_old_rows(tmp_path):
    db = str(tmp_path / 'h.db')
    snap = scenario()
    history.record_samples(db, snap, now=T0 - 40 * 86400)
    history.record_samples(db, snap, now=T0 - 10 * 86400)
    result = history.record_samples(db, snap, now=T0, retention_days=30)
    assert result['pruned'] == 5
    result = history.record_samples(db, snap, now=T0 + 1, retention_days=7)
    assert result['pruned'] == 5
    conn = sqlite3.connect(db)
    try:
        assert conn.execute('SELECT MIN(ts) FROM samples').fetchone()[0] == T0
        assert conn.execute('SELECT MIN(ts) FROM gpu_samples').fetchone()[0] == T0
        assert conn.execute("SELECT value FROM meta WHERE key = 'retention_days'").fetchone()[0] == '7'
    finally:
        conn.close()
    for bad in (0, -1, 5000, True):
        with pytest.raises(history.HistoryError):
            history.record_samples(db, snap, now=T0 + 2, retention_days=bad)


def test_report_per_user_top_processes_and_gpus(tmp_path):
    db = str(tmp_path / 'h.db')
    fill(db, scenario())
    report = history.report(db, hours=24, now=T0 + 3600, idle_util_pct=5)
    assert report['available'] is True and report['samples'] == 60 and report['retention_days'] == 30
    assert report['users'] == [
        {'user': 'carol', 'gpu_hours': 2.0, 'idle_gpu_hours': 0.0, 'peak_mib': 1000, 'gpus': 2, 'processes': 1},
        {'user': 'alice', 'gpu_hours': 1.0, 'idle_gpu_hours': 0.0, 'peak_mib': 4000, 'gpus': 1, 'processes': 1},
        # two processes on one GPU hold it once: 1 GPU-hour, all of it idle (memory held at 0% utilization)
        {'user': 'bob', 'gpu_hours': 1.0, 'idle_gpu_hours': 1.0, 'peak_mib': 2000, 'gpus': 1, 'processes': 2},
    ]
    top = report['top_processes']
    assert [(p['pid'], p['gpu_hours']) for p in top] == [(300, 2.0), (100, 1.0), (200, 1.0), (201, 1.0)]
    assert top[0]['gpu_indexes'] == [2, 3] and top[0]['peak_mib'] == 1000 and top[0]['mean_util_pct'] is None
    assert top[0]['cmdline'] == 'blender -b x.blend' and top[0]['first_seen'] == T0 and top[0]['last_seen'] == T0 + 59 * 60
    assert top[1]['mean_util_pct'] == 90.0 and top[2]['idle_gpu_hours'] == 1.0
    assert [(g['gpu_index'], g['busy_hours'], g['mean_util_pct']) for g in report['gpus']] == [
        (0, 1.0, 90.0), (1, 1.0, 10.0), (2, 1.0, None), (3, 1.0, None)]
    assert report['warnings'] == []
    assert len(history.report(db, hours=24, now=T0 + 3600, top=2)['top_processes']) == 2


def test_report_window(tmp_path):
    db = str(tmp_path / 'h.db')
    fill(db, scenario())
    half = history.report(db, hours=0.5, now=T0 + 59 * 60)
    assert half['samples'] == 30
    assert dict((u['user'], u['gpu_hours']) for u in half['users']) == {'alice': 0.5, 'bob': 0.5, 'carol': 1.0}
    empty = history.report(db, hours=1, now=T0 + 86400 * 2)
    assert empty['users'] == [] and empty['top_processes'] == []
    assert 'no samples' in empty['warnings'][0]
    assert 'keeps only 30 days' in history.report(db, hours=24 * 40, now=T0 + 3600)['warnings'][0]


def test_reader_never_creates_or_changes_the_file(tmp_path):
    missing = str(tmp_path / 'none' / 'history.db')
    report = history.report(missing)
    assert report['available'] is False and 'no usage history' in report['error']
    assert not os.path.exists(os.path.dirname(missing))
    db = str(tmp_path / 'h.db')
    fill(db, scenario(), samples=3)
    before = os.stat(db)
    history.report(db, now=T0 + 600)
    reader = history.HistoryReader(db)
    try:
        assert reader.series(100, 1000, T0) == ([(T0, 90.0), (T0 + 60, 90.0), (T0 + 120, 90.0)],
                                                [(T0, 4000.0), (T0 + 60, 4000.0), (T0 + 120, 4000.0)])
        assert reader.series(300, 3000, T0 + 60)[0] == []            # utilization unknown: no points
        assert reader.series(300, 3000, T0 + 60)[1] == [(T0 + 60, 1000.0), (T0 + 120, 1000.0)]
        with pytest.raises(sqlite3.OperationalError):
            reader.conn.execute('DELETE FROM samples')
    finally:
        reader.close()
    after = os.stat(db)
    assert (before.st_mtime_ns, before.st_size) == (after.st_mtime_ns, after.st_size)


def test_newer_schema_and_garbage_are_refused(tmp_path):
    db = str(tmp_path / 'h.db')
    fill(db, scenario(), samples=1)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(history.HistoryError, match='schema version 99'):
        history.HistoryReader(db)
    with pytest.raises(history.HistoryError, match='schema version 99'):
        history.record_samples(db, scenario(), now=T0 + 60)
    garbage = tmp_path / 'garbage.db'
    garbage.write_bytes(b'x' * 4096)
    assert history.report(str(garbage))['available'] is False
    with pytest.raises(history.HistoryError):
        history.record_samples(str(garbage), scenario(), now=T0)
    with pytest.raises(history.HistoryError):
        history.record_samples(str(tmp_path), scenario(), now=T0)     # a directory


def test_record_into_an_open_connection():
    conn = sqlite3.connect(':memory:', isolation_level=None)
    try:
        history.record_samples(conn, scenario(), now=T0, host='node01')
        assert conn.execute('SELECT COUNT(*) FROM samples').fetchone()[0] == 5
        assert conn.execute("SELECT value FROM meta WHERE key = 'host'").fetchone()[0] == 'node01'
    finally:
        conn.close()


# ---------------------------------------------------------------------------- GPU-hour accounting (issue #18, item 5)
def jobs_scenario():
    """GPU 0: alice's job 7 (busy) shares it with dave's idle process of no job; GPU 1: bob's idle job 8 and his idle
    process of no job; GPUs 2 and 3: carol's job 9, utilization unknown (busy)."""
    return snapshot([proc(100, 'alice', [0], 4000, util=90, job='7'), proc(110, 'dave', [0], 500, util=2),
                     proc(200, 'bob', [1], 1000, util=0, job='8'), proc(201, 'bob', [1], 1000, util=0),
                     proc(300, 'carol', [2, 3], 500, job='9')], gpu_util=(92, 0, None, None))


def _sum(rows, field='gpu_hours'):
    return round(sum(r[field] for r in rows), 4)


def test_accounting_splits_each_gpu_among_its_holders_and_the_sums_reconcile(tmp_path):
    db = str(tmp_path / 'h.db')
    fill(db, jobs_scenario())
    acc = history.report(db, hours=24, now=T0 + 3600, idle_util_pct=5, top=100)['accounting']
    assert acc['users'] == [
        {'user': 'carol', 'gpu_hours': 2.0, 'busy_gpu_hours': 2.0, 'idle_gpu_hours': 0.0, 'jobs': 1, 'gpus': 2},
        {'user': 'bob', 'gpu_hours': 1.0, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 1.0, 'jobs': 1, 'gpus': 1},
        {'user': 'alice', 'gpu_hours': 0.5, 'busy_gpu_hours': 0.5, 'idle_gpu_hours': 0.0, 'jobs': 1, 'gpus': 1},
        {'user': 'dave', 'gpu_hours': 0.5, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 0.5, 'jobs': 0, 'gpus': 1}]
    assert acc['jobs'] == [
        {'job': '9', 'gpu_hours': 2.0, 'busy_gpu_hours': 2.0, 'idle_gpu_hours': 0.0, 'users': ['carol'], 'gpu_indexes': [2, 3],
         'first_seen': T0, 'last_seen': T0 + 59 * 60},
        {'job': '7', 'gpu_hours': 0.5, 'busy_gpu_hours': 0.5, 'idle_gpu_hours': 0.0, 'users': ['alice'], 'gpu_indexes': [0],
         'first_seen': T0, 'last_seen': T0 + 59 * 60},
        {'job': '8', 'gpu_hours': 0.5, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 0.5, 'users': ['bob'], 'gpu_indexes': [1],
         'first_seen': T0, 'last_seen': T0 + 59 * 60}]
    assert [(g['gpu_index'], g['gpu_uuid'], g['gpu_hours'], g['idle_gpu_hours'], g['users'], g['jobs']) for g in acc['gpus']] == [
        (0, 'GPU-0', 1.0, 0.5, 2, 1), (1, 'GPU-1', 1.0, 1.0, 1, 1), (2, 'GPU-2', 1.0, 0.0, 1, 1), (3, 'GPU-3', 1.0, 0.0, 1, 1)]
    assert acc['unattributed'] == {'gpu_hours': 1.0, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 1.0}
    assert acc['totals'] == {'gpu_hours': 4.0, 'busy_gpu_hours': 2.5, 'idle_gpu_hours': 1.5, 'users': 4, 'jobs': 3, 'gpus': 4}
    # the totals reconcile: over users == over GPUs == over jobs + unattributed, busy + idle == held
    for field in ('gpu_hours', 'busy_gpu_hours', 'idle_gpu_hours'):
        assert _sum(acc['users'], field) == _sum(acc['gpus'], field) == round(_sum(acc['jobs'], field) + acc['unattributed'][field], 4) \
            == acc['totals'][field]
    for row in acc['users'] + acc['jobs'] + acc['gpus']:
        assert round(row['busy_gpu_hours'] + row['idle_gpu_hours'], 4) == row['gpu_hours']


def test_accounting_reconciles_on_irregular_samples_and_is_bounded(tmp_path):
    db = str(tmp_path / 'h.db')
    users = ['u%d' % i for i in range(7)]
    for i in range(40):
        procs = [proc(1000 + k, users[(i + k) % 7], [k % 3], 100 + k, util=(i * k) % 11, job=str(k % 4 + 1) if k % 5 else None)
                 for k in range(i % 6 + 1)]
        history.record_samples(db, snapshot(procs, gpu_util=(50, 50, 50)), now=T0 + i * 37.0, interval_s=13 + i % 9)
    acc = history.report(db, hours=24, now=T0 + 3600, idle_util_pct=5, top=1000)['accounting']
    for field in ('gpu_hours', 'busy_gpu_hours', 'idle_gpu_hours'):
        by_user, by_gpu = _sum(acc['users'], field), _sum(acc['gpus'], field)
        by_job = _sum(acc['jobs'], field) + acc['unattributed'][field]
        assert abs(by_user - by_gpu) < 1e-3 and abs(by_gpu - by_job) < 1e-3 and abs(by_user - acc['totals'][field]) < 1e-3
    # every GPU counts its sample time once, however many holders share it
    conn = sqlite3.connect(db)
    try:
        held = conn.execute('SELECT SUM(iv) / 3600.0 FROM (SELECT MAX(interval_s) AS iv FROM samples GROUP BY ts, gpu_index)').fetchone()[0]
    finally:
        conn.close()
    assert abs(acc['totals']['gpu_hours'] - held) < 1e-3 and acc['totals']['users'] == 7 and acc['totals']['jobs'] == 4
    small = history.report(db, hours=24, now=T0 + 3600, top=2)['accounting']
    assert len(small['users']) == 2 and len(small['jobs']) == 2 and len(small['gpus']) == 2
    assert small['totals'] == acc['totals'] and small['users'] == acc['users'][:2]


def test_only_a_job_the_inventory_read_from_a_root_owned_cgroup_is_recorded(tmp_path):
    """``slurm_job`` is what processes.parse_cgroup read through CgroupTrust; anything that is not a job number is
    recorded as none (a process's argv and environment are never read for it)."""
    db = str(tmp_path / 'h.db')
    procs = [proc(1, 'alice', [0], 100, job='42'), proc(2, 'alice', [0], 100, job=None, cmdline=['python', '--job', '43']),
             proc(3, 'bob', [1], 100, job='0042'), proc(4, 'bob', [1], 100, job='4\n2'), proc(5, 'bob', [1], 100, job=44)]
    history.record_samples(db, snapshot(procs), now=T0)
    conn = sqlite3.connect(db)
    try:
        assert dict(conn.execute('SELECT pid, slurm_job FROM samples')) == {1: '42', 2: None, 3: None, 4: None, 5: '44'}
    finally:
        conn.close()


def _schema_2(db):
    """A usage history as a release of schema 2 wrote it (0600, no slurm_job column), with one sample."""
    os.close(os.open(db, os.O_CREAT | os.O_WRONLY, 0o600))
    conn = sqlite3.connect(db)
    try:
        for statement in history.SCHEMA:
            conn.execute(statement.replace(', slurm_job TEXT', ''))
        conn.execute("INSERT INTO meta VALUES ('schema_version', '2')")
        conn.execute("INSERT INTO samples (ts, interval_s, gpu_index, pid, starttime, user, used_mib, util_pct)"
                     " VALUES (?, 60, 0, 100, 1000, 'alice', 4000, 90)", (T0 - 60,))
        conn.commit()
    finally:
        conn.close()


def test_a_schema_2_history_is_read_as_is_and_upgraded_in_place_by_the_writer(tmp_path):
    db = str(tmp_path / 'h.db')
    _schema_2(db)
    acc = history.report(db, hours=1, now=T0)['accounting']      # the reader never changes it: all unattributed
    assert acc['jobs'] == [] and acc['unattributed']['gpu_hours'] == acc['totals']['gpu_hours'] > 0
    history.record_samples(db, jobs_scenario(), now=T0, interval_s=60)
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == '3'
        assert conn.execute('SELECT slurm_job FROM samples WHERE ts = ?', (T0 - 60,)).fetchall() == [(None,)]
        assert sorted(r[0] for r in conn.execute('SELECT DISTINCT slurm_job FROM samples WHERE ts = ? AND slurm_job IS NOT NULL',
                                                 (T0,))) == ['7', '8', '9']
    finally:
        conn.close()
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    history.record_samples(db, jobs_scenario(), now=T0 + 60, interval_s=60)   # once upgraded, no second ALTER
    assert [j['job'] for j in history.report(db, hours=1, now=T0 + 60)['accounting']['jobs']] == ['9', '7', '8']
