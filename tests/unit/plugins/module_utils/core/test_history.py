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


def proc(pid, user, gpus, mib, util=None, start=None, name='python', cmdline=('python', 'train.py')):
    entry = GpuProcess(pid=pid)
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
        assert meta == {'schema_version': '2', 'retention_days': '30'}   # 2: the idleness rule's covering index
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
