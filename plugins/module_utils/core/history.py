# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""GPU usage history in SQLite, the one sample store: one writer (``record_samples``, called by the
guard's ticks and by gpu_kill runs with ``idle_for``, through ``SampleStore``) and one reader
(``HistoryReader``: per-process series for the rogue detector, usage reports for gpu_audit).  The
idleness rule (``idle.py``) reads a process's samples from either (``process_samples``).

Each call of ``record_samples`` appends one row per (GPU process, GPU) and one row per GPU, all
with the same ``ts``.  ``interval_s`` says how many seconds the sample stands for: the caller's
tick interval, else the time since the previous sample (capped at ``max_gap_s``, so a guard that
was stopped for a day does not credit a day).  GPU-hours are sums of ``interval_s``.  Rows older
than ``retention_days`` are deleted by the writer (a writer that names none keeps the stored
one: a gpu_kill run never shortens the guard's retention); the reader opens the file read-only and never
creates or changes it.  docs/audit-schema.md documents the schema.
"""

from __future__ import annotations

import os
import sqlite3
import time
from urllib.parse import quote

from . import notify, safe_files
from .constants import HISTORY_PATH as DEFAULT_PATH
from .errors import HistoryError
from .idle import REPORT_MEM_MIN_MIB, IdleRule, gpu_utilization
from .slurm import SlurmError, valid_job_id

# 2: the covering index samples_idle (the idleness rule's reads) replaces samples_proc; 3: samples.slurm_job
SCHEMA_VERSION = 3
DEFAULT_RETENTION_DAYS = 30
MAX_RETENTION_DAYS = 3660
DEFAULT_INTERVAL_S = 60.0
DEFAULT_MAX_GAP_S = 600.0
MAX_CMDLINE = 4096
BUSY_TIMEOUT_S = 10.0
SQLITE_MAGIC = b'SQLite format 3\x00'

SCHEMA = (
    'CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)',
    'CREATE TABLE IF NOT EXISTS samples ('
    ' ts REAL NOT NULL, interval_s REAL NOT NULL, gpu_index INTEGER NOT NULL, gpu_uuid TEXT,'
    ' pid INTEGER NOT NULL, starttime INTEGER, user TEXT, name TEXT, cmdline TEXT,'
    ' used_mib INTEGER, util_pct REAL, slurm_job TEXT)',
    'CREATE INDEX IF NOT EXISTS samples_ts ON samples (ts)',
    'CREATE INDEX IF NOT EXISTS samples_idle ON samples (pid, starttime, ts, util_pct, used_mib)',
    'DROP INDEX IF EXISTS samples_proc',
    'CREATE TABLE IF NOT EXISTS gpu_samples ('
    ' ts REAL NOT NULL, interval_s REAL NOT NULL, gpu_index INTEGER NOT NULL, gpu_uuid TEXT,'
    ' util_pct REAL, memory_used_mib INTEGER, memory_total_mib INTEGER, process_count INTEGER)',
    'CREATE INDEX IF NOT EXISTS gpu_samples_ts ON gpu_samples (ts)',
)
# columns added to a table of an earlier schema (ALTER TABLE ... ADD COLUMN), as (table, column, type)
ADDED_COLUMNS = (('samples', 'slurm_job', 'TEXT'),)


def _connect_rw(path):
    """sqlite opens files by path: the file is first created (mode 0600: it holds every user's
    command lines) or opened without following a link, every directory above it checked, and
    checked on its descriptor; sqlite then opens it (``mode=rw``: never creates), and one of this
    process's descriptors must then refer to the very file that was checked."""
    try:
        fd = safe_files.open_checked(path, os.O_RDWR | os.O_CREAT, 0o600, dir_mode=0o750)
        try:
            checked = os.fstat(fd)
            head = os.pread(fd, len(SQLITE_MAGIC), 0)
        finally:
            os.close(fd)
        if head and head != SQLITE_MAGIC[:len(head)]:
            raise HistoryError('the usage history %s is not an SQLite database (a JSON utilization file of an earlier'
                               ' release? move it away: the history starts again)' % path)
        conn = sqlite3.connect('file:%s?mode=rw' % quote(os.path.abspath(path)), uri=True, timeout=BUSY_TIMEOUT_S,
                               isolation_level=None)
        try:
            conn.execute('PRAGMA schema_version').fetchone()    # sqlite opens the file lazily
            if not safe_files.is_open_here(checked):
                raise safe_files.UnsafeFile(path, 'was replaced between its check and sqlite\'s open')
        except BaseException:
            conn.close()
            raise
    except (OSError, sqlite3.Error) as exc:
        raise HistoryError('cannot open the usage history %s: %s' % (path, exc))
    return conn


def init_schema(conn):
    """Create the tables (idempotent) and check the stored schema version.  A database already at
    this schema version is left alone (every tick calls this: no CREATE statements then)."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.OperationalError:  # no meta table yet
        row = None
    if row is None or not str(row[0]).isdigit() or int(row[0]) < SCHEMA_VERSION:
        for statement in SCHEMA:
            conn.execute(statement)
        for table, column, kind in ADDED_COLUMNS:
            if column not in _columns(conn, table):
                conn.execute('ALTER TABLE %s ADD COLUMN %s %s' % (table, column, kind))
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None or (str(row[0]).isdigit() and int(row[0]) < SCHEMA_VERSION):
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif not str(row[0]).isdigit():
        raise HistoryError('the usage history is corrupt: schema version %r' % (row[0],))
    elif int(row[0]) > SCHEMA_VERSION:
        raise HistoryError('the usage history has schema version %s; this release understands up to %d' % (row[0], SCHEMA_VERSION))


def _columns(conn, table):
    return set(row[1] for row in conn.execute('PRAGMA table_info(%s)' % table).fetchall())


def job_of(proc, job_pids=None):
    """The Slurm job a sample of ``proc`` is charged to: the job its root-owned cgroup names (the inventory's
    ``slurm_job``: processes.parse_cgroup through CgroupTrust), else the job slurmstepd lists it under (``job_pids``:
    {pid: job id} from ``scontrol listpids``, the tick's view of Slurm; proctrack/linuxproc has no job cgroups),
    else None.  Never its argv or environment."""
    job = getattr(proc, 'slurm_job', None)
    if job is None and job_pids:
        job = job_pids.get(proc.pid)
    try:
        return valid_job_id(job) if job is not None else None
    except SlurmError:
        return None


def record_samples(db, snapshot, now=None, interval_s=None, retention_days=None, max_gap_s=DEFAULT_MAX_GAP_S,
                   host=None, patterns=None, job_pids=None):
    """Append one sample of ``snapshot`` to the history ``db`` (a path or an sqlite3 connection).

    Returns ``{'ts', 'interval_s', 'rows', 'pruned'}``.  Raises HistoryError when the database
    cannot be written.  ``retention_days`` None: the stored one, else DEFAULT_RETENTION_DAYS.
    ``host`` is recorded in meta (one database per node).  Command lines are
    stored redacted by ``patterns`` (the policy's ``notify.redact_patterns``; None: the defaults).
    ``job_pids``: {pid: job id} from slurmstepd when the caller asked Slurm (``job_of``); None: cgroups only.
    """
    now = time.time() if now is None else float(now)
    if retention_days is not None and (isinstance(retention_days, bool) or not 0 < retention_days <= MAX_RETENTION_DAYS):
        raise HistoryError('history_retention_days must be from 1 to %d, got %r' % (MAX_RETENTION_DAYS, retention_days))
    patterns = notify.default_patterns() if patterns is None else patterns
    # redacted before the write lock is taken; '...' marks a cut command line (MAX_CMDLINE in all)
    cmdlines = notify.redact_many([proc.cmdline for proc in snapshot.processes], patterns, MAX_CMDLINE - 3)
    own = not isinstance(db, sqlite3.Connection)
    conn = _connect_rw(db) if own else db
    try:
        conn.execute('BEGIN IMMEDIATE')
        try:
            init_schema(conn)
            if retention_days is None:
                retention_days = _stored_retention(conn)
            if interval_s is None:
                last = conn.execute('SELECT MAX(ts) FROM gpu_samples WHERE ts < ?', (now,)).fetchone()[0]
                interval_s = DEFAULT_INTERVAL_S if last is None else min(max(0.0, now - last), float(max_gap_s))
            interval_s = float(interval_s)
            rows = []
            by_index = dict((dev.index, dev) for dev in snapshot.all_devices)
            for proc, cmdline in zip(snapshot.processes, cmdlines):
                for index in proc.gpu_indexes:
                    dev = by_index.get(index)
                    rows.append((now, interval_s, index, dev.uuid if dev else None, proc.pid, proc.starttime, proc.user,
                                 proc.name, cmdline, proc.used_mib_by_gpu.get(index), gpu_utilization(proc, dev), job_of(proc, job_pids)))
            conn.executemany('INSERT INTO samples (ts, interval_s, gpu_index, gpu_uuid, pid, starttime, user, name, cmdline,'
                             ' used_mib, util_pct, slurm_job) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)', rows)
            gpu_rows = [(now, interval_s, dev.index, dev.uuid, dev.utilization_pct, dev.memory_used_mib, dev.memory_total_mib,
                         len(dev.driver_processes)) for dev in snapshot.devices]
            conn.executemany('INSERT INTO gpu_samples (ts, interval_s, gpu_index, gpu_uuid, util_pct, memory_used_mib,'
                             ' memory_total_mib, process_count) VALUES (?, ?, ?, ?, ?, ?, ?, ?)', gpu_rows)
            cutoff = now - retention_days * 86400.0
            pruned = conn.execute('DELETE FROM samples WHERE ts < ?', (cutoff,)).rowcount
            conn.execute('DELETE FROM gpu_samples WHERE ts < ?', (cutoff,))
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('retention_days', ?)", (str(retention_days),))
            if host:
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('host', ?)", (str(host),))
            conn.execute('COMMIT')
        except BaseException:
            conn.execute('ROLLBACK')
            raise
    except sqlite3.Error as exc:
        raise HistoryError('cannot write the usage history %s: %s' % (db if own else 'database', exc))
    finally:
        if own:
            conn.close()
    return {'ts': now, 'interval_s': interval_s, 'rows': len(rows), 'pruned': pruned}


def _stored_retention(conn):
    row = conn.execute("SELECT value FROM meta WHERE key = 'retention_days'").fetchone()
    try:
        days = int(float(row[0])) if row is not None else DEFAULT_RETENTION_DAYS
    except (TypeError, ValueError):
        days = DEFAULT_RETENTION_DAYS
    return days if 0 < days <= MAX_RETENTION_DAYS else DEFAULT_RETENTION_DAYS


def process_samples(conn, pid, starttime, before, problems=None):
    """The samples of one process (pid, starttime) taken before ``before``, newest first, as the
    idleness rule reads them: ``(ts, util_pct, used_mib)``, one per sample time over all its GPUs
    (the highest utilization; the memory summed; None when one GPU's figure is unknown).  Lazy: the
    rule reads only as far back as the idle run goes.  A read error ends the samples (the run is
    then shorter, never longer) and is appended to ``problems``."""
    try:
        yield from conn.execute(
            'SELECT ts, CASE WHEN COUNT(util_pct) = COUNT(*) THEN MAX(util_pct) END,'
            ' CASE WHEN COUNT(used_mib) = COUNT(*) THEN SUM(used_mib) END FROM samples'
            ' WHERE pid = ? AND starttime = ? AND ts < ? GROUP BY ts ORDER BY ts DESC', (pid, starttime, before))
    except sqlite3.Error as exc:
        if problems is not None and len(problems) < 5:
            problems.append('could not read the idle samples of process %s from the usage history: %s' % (pid, exc))


class SampleStore(object):
    """The history opened for writing (as ``record_samples`` opens it: created 0600, never through
    a link, checked on its descriptor): one sample recorded, then read back by the idleness rule
    over the same connection.  A context manager; ``close()`` closes it."""

    def __init__(self, path=DEFAULT_PATH):
        self.path = path
        self.problems = []
        self.conn = _connect_rw(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def record(self, snapshot, now, **kwargs):
        """``record_samples`` into this store (same keyword arguments)."""
        return record_samples(self.conn, snapshot, now, **kwargs)

    def process_samples(self, pid, starttime, before):
        return process_samples(self.conn, pid, starttime, before, self.problems)


class HistoryReader(object):
    """Read-only access to a history database (never creates or changes the file)."""

    def __init__(self, path=DEFAULT_PATH):
        self.path = path
        self.problems = []
        if not os.path.isfile(path):
            raise HistoryError('no usage history at %s (the guard writes it; see gpufleet.reclaim.guard)' % path)
        try:
            # readers only, not a tick
            self.conn = sqlite3.connect('file:%s?mode=ro' % quote(os.path.abspath(path)), uri=True, timeout=BUSY_TIMEOUT_S)
            self.meta = dict(self.conn.execute('SELECT key, value FROM meta').fetchall())
        except sqlite3.Error as exc:
            raise HistoryError('cannot read the usage history %s: %s' % (path, exc))
        try:
            version = int(self.meta.get('schema_version', 0) or 0)
        except (TypeError, ValueError):
            self.close()
            raise HistoryError('the usage history %s is corrupt: schema version %r' % (path, self.meta.get('schema_version')))
        if version > SCHEMA_VERSION:
            self.close()
            raise HistoryError('the usage history %s has schema version %d; this release understands up to %d' % (
                path, version, SCHEMA_VERSION))
        try:
            self.has_jobs = 'slurm_job' in _columns(self.conn, 'samples')   # schema 3; an older file not yet upgraded: none
        except sqlite3.Error as exc:
            self.close()
            raise HistoryError('cannot read the usage history %s: %s' % (path, exc))

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def process_samples(self, pid, starttime, before):
        return process_samples(self.conn, pid, starttime, before, self.problems)

    def series(self, pid, starttime, since):
        """([(ts, util_pct)], [(ts, used_mib)]) of one process since ``since``, one point per sample time."""
        rows = self.conn.execute(
            'SELECT ts, MAX(util_pct), SUM(used_mib), COUNT(util_pct), COUNT(used_mib), COUNT(*) FROM samples'
            ' WHERE pid = ? AND starttime = ? AND ts >= ? GROUP BY ts ORDER BY ts', (pid, starttime, since)).fetchall()
        util = [(ts, float(u)) for ts, u, _m, known_u, _known_m, count in rows if u is not None and known_u == count]
        mem = [(ts, float(m)) for ts, _u, m, _known_u, known_m, count in rows if m is not None and known_m == count]
        return util, mem

    def report(self, hours=24.0, now=None, idle_util_pct=5.0, top=10):
        """Usage over the last ``hours``: per user, top processes, per GPU (see docs/audit-schema.md)."""
        now = time.time() if now is None else float(now)
        since = now - float(hours) * 3600.0
        conn = self.conn
        # the idleness rule, one (sample time, user or process, GPU) at a time: known utilization at or
        # below idle_util_pct while memory is held (unknown memory counts as none)
        idle, idle_params = IdleRule(idle_util_pct, REPORT_MEM_MIN_MIB).sql('CASE WHEN known = n THEN maxu END', 'mib')
        try:
            samples = conn.execute('SELECT COUNT(DISTINCT ts), MIN(ts), MAX(ts) FROM gpu_samples WHERE ts > ? AND ts <= ?',
                                   (since, now)).fetchone()
            # One row per (sample time, user, GPU): a user holds a GPU once however many processes it runs there.
            per_user_gpu = (
                'SELECT ts, user, gpu_index, MAX(interval_s) AS iv, SUM(COALESCE(used_mib, 0)) AS mib,'
                ' MAX(util_pct) AS maxu, COUNT(util_pct) AS known, COUNT(*) AS n'
                ' FROM samples WHERE ts > ? AND ts <= ? GROUP BY ts, user, gpu_index')
            users = conn.execute(
                'SELECT user, SUM(iv) / 3600.0,'
                ' SUM(CASE WHEN %s THEN iv ELSE 0 END) / 3600.0,'
                ' COUNT(DISTINCT gpu_index) FROM (%s) GROUP BY user' % (idle, per_user_gpu), idle_params + [since, now]).fetchall()
            peaks = dict(conn.execute(
                'SELECT user, MAX(total) FROM (SELECT ts, user, SUM(COALESCE(used_mib, 0)) AS total FROM samples'
                ' WHERE ts > ? AND ts <= ? GROUP BY ts, user) GROUP BY user', (since, now)).fetchall())
            nprocs = dict(conn.execute(
                'SELECT user, COUNT(*) FROM (SELECT DISTINCT user, pid, starttime FROM samples WHERE ts > ? AND ts <= ?)'
                ' GROUP BY user', (since, now)).fetchall())
            per_proc = (
                'SELECT pid, starttime, ts, MAX(interval_s) AS iv, SUM(COALESCE(used_mib, 0)) AS mib, MAX(util_pct) AS maxu,'
                ' COUNT(util_pct) AS known, COUNT(*) AS n, COUNT(*) AS gpus'
                ' FROM samples WHERE ts > ? AND ts <= ? GROUP BY pid, starttime, ts')
            procs = conn.execute(
                'SELECT pid, starttime, SUM(iv * gpus) / 3600.0,'
                ' SUM(CASE WHEN %s THEN iv * gpus ELSE 0 END) / 3600.0,'
                ' MAX(mib), AVG(maxu), MIN(ts), MAX(ts) FROM (%s) GROUP BY pid, starttime'
                ' ORDER BY 3 DESC, 5 DESC, pid LIMIT ?' % (idle, per_proc), idle_params + [since, now, int(top)]).fetchall()
            top_processes = []
            for pid, starttime, gpu_hours, idle_hours, peak, mean_util, first, last in procs:
                row = conn.execute(
                    'SELECT user, name, cmdline FROM samples WHERE pid = ? AND starttime IS ? AND ts > ? AND ts <= ?'
                    ' ORDER BY ts DESC LIMIT 1', (pid, starttime, since, now)).fetchone()
                gpus = [r[0] for r in conn.execute(
                    'SELECT DISTINCT gpu_index FROM samples WHERE pid = ? AND starttime IS ? AND ts > ? AND ts <= ?'
                    ' ORDER BY gpu_index', (pid, starttime, since, now)).fetchall()]
                top_processes.append({
                    'pid': pid, 'starttime': starttime, 'user': row[0], 'name': row[1], 'cmdline': row[2], 'gpu_indexes': gpus,
                    'gpu_hours': _round(gpu_hours), 'idle_gpu_hours': _round(idle_hours), 'peak_mib': peak,
                    'mean_util_pct': None if mean_util is None else round(mean_util, 1), 'first_seen': first, 'last_seen': last})
            accounting = self._accounting(since, now, idle, idle_params, top)
            gpus = conn.execute(
                'SELECT gpu_index, MAX(gpu_uuid), SUM(CASE WHEN process_count > 0 THEN interval_s ELSE 0 END) / 3600.0,'
                ' AVG(util_pct), MAX(memory_used_mib), MAX(memory_total_mib) FROM gpu_samples WHERE ts > ? AND ts <= ?'
                ' GROUP BY gpu_index ORDER BY gpu_index', (since, now)).fetchall()
        except sqlite3.Error as exc:
            raise HistoryError('cannot read the usage history %s: %s' % (self.path, exc))
        user_rows = [{'user': user, 'gpu_hours': _round(gpu_hours), 'idle_gpu_hours': _round(idle_hours),
                      'peak_mib': peaks.get(user), 'gpus': ngpus, 'processes': nprocs.get(user, 0)}
                     for user, gpu_hours, idle_hours, ngpus in users]
        user_rows.sort(key=lambda r: (-r['gpu_hours'], str(r['user'])))
        retention = self.meta.get('retention_days')
        warnings = []
        if retention is not None and float(hours) > float(retention) * 24:
            warnings.append('asked for %s hours but the history keeps only %s days' % (hours, retention))
        if not samples[0]:
            warnings.append('the usage history has no samples in the last %s hours' % hours)
        return {
            'available': True,
            'path': self.path,
            'hours': float(hours),
            'since': since,
            'until': now,
            'samples': samples[0] or 0,
            'first_sample': samples[1],
            'last_sample': samples[2],
            'retention_days': None if retention is None else int(float(retention)),
            'idle_util_pct': idle_util_pct,
            'users': user_rows,
            'top_processes': top_processes,
            'gpus': [{'gpu_index': index, 'gpu_uuid': uuid, 'busy_hours': _round(busy),
                      'mean_util_pct': None if util is None else round(util, 1), 'peak_used_mib': peak, 'memory_total_mib': total}
                     for index, uuid, busy, util, peak, total in gpus],
            'accounting': accounting,
            'warnings': warnings,
        }

    def _accounting(self, since, now, idle, idle_params, top):
        """GPU-hours per user, per Slurm job and per GPU, busy and idle, that add up (docs/audit-schema.md).

        A holder is one user's processes of one job (or of no job) on one GPU at one sample time; the sample's interval
        on that GPU is split equally among its holders, so no GPU-hour is counted twice and every total is the same sum:
        over users == over GPUs == over jobs + unattributed.  A holder's share is idle by the reports' idleness rule
        (``idle``: IdleRule.sql), else busy (unknown utilization counts as busy).  Lists: the ``top`` by GPU-hours."""
        job = 'slurm_job' if self.has_jobs else 'NULL'
        holders = (
            'SELECT ts, gpu_index, MAX(gpu_uuid) AS uuid, user, %s AS job, MAX(interval_s) AS iv,'
            ' SUM(COALESCE(used_mib, 0)) AS mib, MAX(util_pct) AS maxu, COUNT(util_pct) AS known, COUNT(*) AS n'
            ' FROM samples WHERE ts > ? AND ts <= ? GROUP BY ts, gpu_index, user, job' % job)
        rows = self.conn.execute(
            'WITH h AS (%s), k AS (SELECT ts, gpu_index, COUNT(*) AS holders FROM h GROUP BY ts, gpu_index)'
            ' SELECT h.gpu_index, MAX(uuid), user, job, SUM(iv / holders) / 3600.0,'
            ' SUM(CASE WHEN %s THEN iv / holders ELSE 0 END) / 3600.0, MIN(h.ts), MAX(h.ts)'
            ' FROM h JOIN k ON h.ts = k.ts AND h.gpu_index = k.gpu_index'
            ' GROUP BY h.gpu_index, user, job' % (holders, idle), [since, now] + idle_params).fetchall()
        users, jobs, gpus = {}, {}, {}
        total, unattributed = _Hours(), _Hours()
        for index, uuid, user, job_id, held, idle_hours, first, last in rows:
            total.add(held, idle_hours, first, last, user, job_id, index)
            users.setdefault(user, _Hours()).add(held, idle_hours, first, last, user, job_id, index)
            gpus.setdefault(index, _Hours(uuid=uuid)).add(held, idle_hours, first, last, user, job_id, index)
            (jobs.setdefault(job_id, _Hours()) if job_id is not None else unattributed).add(
                held, idle_hours, first, last, user, job_id, index)
        return {
            'users': _top(users, 'user', top, lambda h: {'jobs': len(h.jobs), 'gpus': len(h.gpus)}),
            'jobs': _top(jobs, 'job', top, lambda h: {'users': sorted(h.users, key=str), 'gpu_indexes': sorted(h.gpus),
                                                      'first_seen': h.first, 'last_seen': h.last}),
            'gpus': _top(gpus, 'gpu_index', top, lambda h: {'gpu_uuid': h.uuid, 'users': len(h.users), 'jobs': len(h.jobs)}),
            'unattributed': unattributed.hours(),
            'totals': dict(total.hours(), users=len(users), jobs=len(jobs), gpus=len(gpus)),
        }


class _Hours(object):
    """GPU-hours (held and idle) of one row of the accounting, and who and what they cover."""

    def __init__(self, uuid=None):
        self.held = self.idle = 0.0
        self.first = self.last = None
        self.uuid = uuid
        self.users, self.jobs, self.gpus = set(), set(), set()

    def add(self, held, idle, first, last, user, job, gpu):
        self.held += held or 0.0
        self.idle += idle or 0.0
        self.first = first if self.first is None else min(self.first, first)
        self.last = last if self.last is None else max(self.last, last)
        self.users.add(user)
        if job is not None:
            self.jobs.add(job)
        self.gpus.add(gpu)

    def hours(self):
        return {'gpu_hours': _round(self.held), 'busy_gpu_hours': _round(self.held - self.idle), 'idle_gpu_hours': _round(self.idle)}


def _top(rows, key, top, extra):
    """The ``top`` rows of ``{key value: _Hours}`` by GPU-hours (ties by key), as dicts."""
    ordered = sorted(rows.items(), key=lambda item: (-item[1].held, str(item[0])))[:int(top)]
    return [dict({key: name}, **dict(hours.hours(), **extra(hours))) for name, hours in ordered]


def _round(value):
    return round(value or 0.0, 4)


def report(path=DEFAULT_PATH, hours=24.0, now=None, idle_util_pct=5.0, top=10):
    """The usage report of the history at ``path``; ``available: false`` with the reason when there is none."""
    try:
        reader = HistoryReader(path)
    except HistoryError as exc:
        return {'available': False, 'path': path, 'hours': float(hours), 'error': str(exc), 'users': [], 'top_processes': [],
                'gpus': [], 'accounting': None, 'warnings': [str(exc)]}
    try:
        return reader.report(hours=hours, now=now, idle_util_pct=idle_util_pct, top=top)
    finally:
        reader.close()
