# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpufleet.reclaim.abspath: controller paths resolve against the directory the run started in."""

from __future__ import annotations

import os

import pytest

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter.abspath import FilterModule, abspath


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize('given, expected', [
    ('gpu-report', 'gpu-report'),
    ('./gpu-report', 'gpu-report'),
    ('./gpu-report/', 'gpu-report'),
    ('a/../b/./c', 'b/c'),
    ('reports/gpu report', 'reports/gpu report'),
])
def test_relative_paths_resolve_against_the_current_directory(run_dir, given, expected):
    assert abspath(given) == os.path.join(run_dir, expected)


def test_absolute_paths_are_only_normalised(run_dir):
    assert abspath('/var/tmp/x/../gpu-report/') == '/var/tmp/gpu-report'
    assert abspath('/srv/gpu-report') == '/srv/gpu-report'


def test_tilde_is_the_controller_users_home(run_dir, monkeypatch):
    monkeypatch.setenv('HOME', '/home/operator')
    assert abspath('~/gpu-report') == '/home/operator/gpu-report'


def test_symlinks_are_kept_and_the_path_need_not_exist(run_dir):
    os.mkdir(os.path.join(run_dir, 'real'))
    os.symlink('real', os.path.join(run_dir, 'link'))
    assert abspath('link/new/dir') == os.path.join(run_dir, 'link', 'new', 'dir')


@pytest.mark.parametrize('bad, reason', [
    ('', 'the path is empty'),
    ('   ', 'the path is empty'),
    (None, 'a path must be a string, not NoneType'),
    (3, 'a path must be a string, not int'),
    (['gpu-report'], 'a path must be a string, not list'),
    ('gpu\0report', 'a path cannot contain a NUL character'),
])
def test_bad_values_name_the_value_and_the_reason(bad, reason):
    with pytest.raises(AnsibleFilterError) as err:
        abspath(bad)
    assert str(err.value) == 'gpufleet.reclaim.abspath: invalid value %r: %s' % (bad, reason)


def test_a_vanished_current_directory_is_a_clear_error(tmp_path, monkeypatch):
    gone = tmp_path / 'gone'
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(AnsibleFilterError, match="cannot resolve 'gpu-report': the current directory is gone"):
        abspath('gpu-report')


def test_the_filter_is_registered_under_its_documented_name():
    assert FilterModule().filters() == {'abspath': abspath}
