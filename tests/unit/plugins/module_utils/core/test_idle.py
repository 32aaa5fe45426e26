# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The one idleness rule (core/idle.py) over the one sample store (the SQLite usage history).

Moved here from test_select.py and adapted to the SQLite store: the identity/busy/unknown run test
(was UtilizationHistory over a JSON file) and the unreadable-file test (a JSON file of an earlier
release is now refused, not restarted)."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import history, idle
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import HistoryError
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.history import SampleStore
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.idle import IdleRule, idle_pids
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_history import T0, proc, snapshot


def one(pid, util, start=500, mib=1024):
    return snapshot([proc(pid, 'alice', [0], mib, util=util, start=start)], gpu_util=(None,))


# ---------------------------------------------------------------------------- the rule
def test_the_run_ends_at_a_busy_or_unknown_sample_a_gap_or_too_little_memory():
    rule = IdleRule(5)
    assert rule.since([(400.0, 0, 10), (300.0, 5, 10), (200.0, 6, 10), (100.0, 0, 10)]) == 300.0
    assert rule.since([(400.0, 0, 10), (300.0, None, 10), (200.0, 0, 10)]) == 400.0
    assert rule.since([(400.0, 9, 10)]) is None and rule.since([]) is None
    assert rule.since([(400.0, 0, None)]) == 400.0                       # no floor: memory not asked
    assert IdleRule(5, max_gap_s=60).since([(400.0, 0, 1), (300.0, 0, 1)]) == 400.0
    assert IdleRule(5, max_gap_s=100).since([(400.0, 0, 1), (300.0, 0, 1)]) == 300.0
    floor = IdleRule(1, mem_min_mib=1024)
    assert floor.since([(400.0, 0, 1024), (300.0, 0, 1023), (200.0, 0, 4096)]) == 400.0
    assert floor.since([(400.0, 0, None)]) is None                       # unknown memory is not held memory
    assert rule.since([(400.0, 0, 1), (500.0, 0, 1)]) == 400.0           # out of order: the run ends


def test_the_sql_form_classifies_as_is_idle_does():
    import sqlite3
    conn = sqlite3.connect(':memory:')
    for rule in (IdleRule(5), IdleRule(5, 1024)):
        text, params = rule.sql('u', 'm')
        for util, used in [(0, 2048), (5, 1024), (5.5, 2048), (None, 2048), (0, None), (0, 1000), (3, 0)]:
            got = conn.execute('SELECT %s FROM (SELECT ? AS u, ? AS m)' % text, params + [util, used]).fetchone()[0]
            assert bool(got) == rule.is_idle(util, used), (rule.mem_min_mib, util, used)


def test_process_utilization_falls_back_on_the_gpu_only_for_a_lone_process():
    alone = proc(1, 'alice', [0], 100)
    snap = snapshot([alone, proc(2, 'bob', [1], 100), proc(3, 'bob', [1], 100)], gpu_util=(40, 70))
    assert idle.process_utilization(alone, snap) == 40
    assert idle.process_utilization(snap.processes[1], snap) is None     # two on GPU 1: unknown
    both = proc(4, 'carol', [0, 1], 100)
    assert idle.process_utilization(both, snapshot([both], gpu_util=(10, 30))) == 30
    assert idle.process_utilization(both, snapshot([both], gpu_util=(10, None))) is None


# ---------------------------------------------------------------------------- over the store
def test_samples_key_on_identity_and_the_run_breaks_on_a_busy_or_unknown_sample(tmp_path):
    db = str(tmp_path / 'history.db')

    def run(snap, now):
        with SampleStore(db) as store:
            store.record(snap, now)
            return idle_pids(IdleRule(5), snap, now, store)

    run(one(10, 0), 1000.0)
    run(one(10, 90), 1100.0)
    run(one(10, 0), 1200.0)
    assert run(one(10, None), 1300.0) == {}                             # unknown breaks the run
    assert run(one(10, 1), 1400.0) == {10: 1400.0}                      # only since the unknown sample
    assert run(one(10, 0, start=777), 1500.0) == {10: 1500.0}           # pid reused: a new run
    assert run(one(10, 0, start=777), 1600.0) == {10: 1500.0}
    reader = history.HistoryReader(db)                                   # the read-only side gives the same samples
    try:
        assert idle_pids(IdleRule(5), one(10, 0, start=777), 1700.0, reader) == {10: 1500.0}
        assert list(reader.process_samples(10, 500, 1450.0)) == [(1400.0, 1.0, 1024), (1300.0, None, 1024),
                                                                 (1200.0, 0.0, 1024), (1100.0, 90.0, 1024), (1000.0, 0.0, 1024)]
    finally:
        reader.close()


def test_a_json_file_of_an_earlier_release_is_refused_not_overwritten(tmp_path):
    path = tmp_path / 'utilization.json'
    path.write_text('{"version": 1, "processes": {"1:2": [[5.0, 0]]}}')
    with pytest.raises(HistoryError, match='not an SQLite database'):
        SampleStore(str(path))
    assert path.read_text().startswith('{"version": 1')


def test_gpu_kill_keeps_the_guard_s_retention(tmp_path):
    db = str(tmp_path / 'history.db')
    history.record_samples(db, one(1, 0), now=T0 - 80 * 86400, retention_days=90)   # the guard's setting
    history.record_samples(db, one(1, 0), now=T0)                                    # a gpu_kill run names none
    with SampleStore(db) as store:
        assert len(list(store.process_samples(1, 500, T0 + 1))) == 2


def _writer(db, pid, count):
    for step in range(count):
        with SampleStore(db) as store:
            store.record(one(pid, 0, start=pid), T0 + pid + step * 10.0)


def test_concurrent_writers_lose_no_sample(tmp_path):
    """Two gpu_kill runs and a guard tick write the same store: each sample is a transaction."""
    db = str(tmp_path / 'history.db')
    workers = [multiprocessing.Process(target=_writer, args=(db, pid, 25)) for pid in (1, 2, 3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    with SampleStore(db) as store:
        assert [len(list(store.process_samples(pid, pid, T0 + 1000))) for pid in (1, 2, 3)] == [25, 25, 25]
    assert oct(os.stat(db).st_mode & 0o777) == '0o600'


def test_a_schema_1_history_gets_the_covering_index_and_keeps_its_rows(tmp_path):
    import sqlite3
    db = str(tmp_path / 'history.db')
    history.record_samples(db, one(1, 0), now=T0 - 60)
    conn = sqlite3.connect(db)
    conn.execute('DROP INDEX samples_idle')
    conn.execute('CREATE INDEX samples_proc ON samples (pid, starttime, ts)')
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with SampleStore(db) as store:
        store.record(one(1, 0), T0)
        assert idle_pids(IdleRule(5), one(1, 0), T0, store) == {1: T0 - 60}
        indexes = [r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'samples'")]
        assert sorted(indexes) == ['samples_idle', 'samples_ts']
        assert store.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(history.SCHEMA_VERSION)
