# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/safe_files.py: the guard's files, opened without following links and checked on descriptors.

The attacks themselves are in tests/unit/security/test_redteam_files.py; these are the helper's
plain behaviours.  Only files under the test's own tmp_path are created, changed or read.
"""

from __future__ import annotations

import os
import sqlite3

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import history, safe_files


def test_write_atomic_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / 'tc' / 'gpufleet.prom'
    safe_files.write_atomic(str(path), 'a 1\n')
    safe_files.write_atomic(str(path), b'a 2\n')
    assert path.read_text() == 'a 2\n'
    assert os.listdir(str(path.parent)) == ['gpufleet.prom']
    assert oct(os.stat(str(path)).st_mode & 0o777) == '0o644'


def test_write_atomic_removes_the_temp_files_a_killed_writer_left_only_when_asked(tmp_path):
    path = tmp_path / 'state.json'
    (tmp_path / '.state.json.dead01').write_text('half')
    safe_files.write_atomic(str(path), '{}', mode=0o600)
    assert sorted(os.listdir(str(tmp_path))) == ['.state.json.dead01', 'state.json']
    safe_files.write_atomic(str(path), '{}', mode=0o600, remove_stale=True)
    assert os.listdir(str(tmp_path)) == ['state.json'] and oct(os.stat(str(path)).st_mode & 0o777) == '0o600'


def test_read_file_reads_at_most_the_limit_from_the_checked_descriptor(tmp_path):
    path = tmp_path / 'policy.yaml'
    path.write_bytes(b'x' * 100)
    path.chmod(0o644)
    assert safe_files.read_file(str(path), 10) == b'x' * 10
    with pytest.raises(FileNotFoundError):
        safe_files.read_file(str(tmp_path / 'missing' / 'policy.yaml'), 10)
    path.chmod(0o664)
    with pytest.raises(safe_files.UnsafeFile, match='is writable by its group .mode 0664.; run chmod go-w on it'):
        safe_files.read_file(str(path), 10)


def test_a_fifo_or_a_directory_is_not_a_file(tmp_path):
    os.mkfifo(str(tmp_path / 'fifo'), 0o600)
    with pytest.raises(safe_files.UnsafeFile, match='is not a regular file'):
        safe_files.read_file(str(tmp_path / 'fifo'), 10)            # never blocks: opened O_NONBLOCK, then refused
    with pytest.raises(safe_files.UnsafeFile, match='is not a directory'):
        safe_files.open_dir(str(tmp_path / 'fifo'))


def test_a_link_anywhere_in_the_path_is_refused_with_the_component_named(tmp_path):
    real = tmp_path / 'real'
    real.mkdir(mode=0o755)
    (real / 'f').write_text('data')
    (tmp_path / 'alias').symlink_to(real)
    with pytest.raises(safe_files.UnsafeFile) as err:
        safe_files.read_file(str(tmp_path / 'alias' / 'f'), 10)
    assert err.value.is_dir and err.value.filename == str(tmp_path / 'alias') and 'is a symbolic link' in str(err.value)
    with pytest.raises(safe_files.UnsafeFile):
        safe_files.check(str(tmp_path / 'alias' / 'f'))
    with pytest.raises(safe_files.UnsafeFile):
        safe_files.write_atomic(str(tmp_path / 'alias' / 'g'), 'x')
    assert sorted(os.listdir(str(real))) == ['f']                   # nothing written through the link


def test_check_accepts_missing_paths_and_open_dir_creates_with_the_mode(tmp_path):
    safe_files.check(str(tmp_path / 'no' / 'such' / 'file'))
    old = os.umask(0)
    try:
        fd = safe_files.open_dir(str(tmp_path / 'a' / 'b'), create_mode=0o750)
    finally:
        os.umask(old)
    os.close(fd)
    assert oct(os.stat(str(tmp_path / 'a' / 'b')).st_mode & 0o777) == '0o750'
    os.chmod(str(tmp_path / 'a'), 0o777)
    with pytest.raises(safe_files.UnsafeFile, match='is writable by group and others'):
        safe_files.open_dir(str(tmp_path / 'a' / 'b'))
    os.chmod(str(tmp_path / 'a'), 0o1777)                              # sticky: accepted
    os.close(safe_files.open_dir(str(tmp_path / 'a' / 'b')))


def test_the_history_database_is_opened_only_through_the_checks(tmp_path):
    path = tmp_path / 'lib' / 'history.db'
    conn = history._connect_rw(str(path))
    conn.execute('CREATE TABLE t (x)')
    conn.close()
    assert oct(os.stat(str(path)).st_mode & 0o777) == '0o600'
    other = tmp_path / 'other.db'
    sqlite3.connect(str(other)).close()
    path.unlink()
    path.symlink_to(other)
    with pytest.raises(history.HistoryError, match='is a symbolic link'):
        history._connect_rw(str(path))


def test_is_open_here_finds_a_descriptor_of_the_file(tmp_path):
    path = tmp_path / 'f'
    path.write_text('x')
    info = os.stat(str(path))
    assert not safe_files.is_open_here(info)
    with open(str(path)) as _handle:
        assert safe_files.is_open_here(info)
