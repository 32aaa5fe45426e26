# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: the programs root runs (docs/security.md, T74: scontrol, squeue, sinfo,
nvidia-smi, amd-smi, xpu-smi, ioreg, systemctl, journalctl).

A user who can write a directory on root's PATH (a PATH entry of hers, a group-writable bin directory, the
working directory through an empty or relative PATH entry) plants a program of the same name, so that root runs
her code, or reads her forged answers (``squeue`` saying the job ended, ``nvidia-smi`` saying the reset worked).
``safe_files.find_program`` is the one lookup of every command the core runs: as root it passes over every
candidate that it cannot vouch for, and says why.

SAFETY: the planted programs only write a marker file under the test's own temporary directory; nothing is
signalled.  Needs root (the files are chowned to alice).
"""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import reset, safe_files, slurm
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason='planting files as another user needs root')


def _program(directory, name, marker, mode=0o755, uid=0):
    """An executable ``name`` in ``directory`` that records its run in ``marker`` and answers like the real one."""
    path = os.path.join(str(directory), name)
    with open(path, 'w') as handle:
        handle.write('#!/bin/sh\necho ran >> %s\necho \'{"jobs": []}\'\n' % marker)
    os.chmod(path, mode)
    os.chown(path, uid, 0)
    return path


def _dir(path, mode=0o755, uid=0):
    os.mkdir(str(path))
    os.chmod(str(path), mode)
    os.chown(str(path), uid, 0)
    return str(path)


@pytest.fixture()
def alice():
    return redteam.ensure_users(('alice',))['alice']


def test_a_program_in_a_directory_of_hers_is_passed_over_for_roots(tmp_path, alice):
    os.chmod(str(tmp_path), 0o755)
    marker = str(tmp_path / 'ran')
    hers = _dir(tmp_path / 'alice-bin', uid=alice)
    writable = _dir(tmp_path / 'shared-bin', mode=0o777)
    root_bin = _dir(tmp_path / 'root-bin')
    for directory in (hers, writable):
        _program(directory, 'squeue', marker, uid=alice)
    genuine = _program(root_bin, 'squeue', marker)
    refused = []
    found = safe_files.find_program('squeue', os.pathsep.join([hers, writable, root_bin]), euid=0, refused=refused)
    assert found == genuine
    assert len(refused) == 2
    assert refused[0].startswith(os.path.join(hers, 'squeue') + ' was not run as root: ') and 'owned by uid %d' % alice in refused[0]
    assert refused[1].startswith(os.path.join(writable, 'squeue') + ' was not run as root: ') and 'writable by group and others' in refused[1]


def test_her_file_in_roots_directory_and_a_link_to_her_file_are_passed_over(tmp_path, alice):
    os.chmod(str(tmp_path), 0o755)
    marker = str(tmp_path / 'ran')
    hers = _dir(tmp_path / 'alice-bin', uid=alice)
    target = _program(hers, 'nvidia-smi', marker, uid=alice)
    root_bin = _dir(tmp_path / 'root-bin')
    _program(root_bin, 'scontrol', marker, uid=alice)             # her file in root's directory
    os.symlink(target, os.path.join(root_bin, 'nvidia-smi'))     # root's link to her file
    os.lchown(os.path.join(root_bin, 'nvidia-smi'), 0, 0)
    _program(root_bin, 'sinfo', marker, mode=0o775)              # root's file her group may write
    why = {'scontrol': 'owned by uid %d' % alice, 'nvidia-smi': 'alice-bin is owned by uid %d' % alice,
           'sinfo': 'writable by its group'}
    for name, reason in why.items():
        refused = []
        assert safe_files.find_program(name, root_bin, euid=0, refused=refused) is None, name
        assert len(refused) == 1 and reason in refused[0], refused
    assert not os.path.exists(marker)


def test_the_working_directory_is_never_searched_through_an_empty_or_relative_entry(tmp_path, monkeypatch):
    os.chmod(str(tmp_path), 0o755)
    marker = str(tmp_path / 'ran')
    _dir(tmp_path / 'bin')
    _program(tmp_path, 'journalctl', marker)
    _program(tmp_path / 'bin', 'journalctl', marker)
    monkeypatch.chdir(str(tmp_path))
    for search in ('', ':', '.', 'bin', './bin', ':bin:'):
        assert safe_files.find_program('journalctl', search, euid=0) is None, search
        assert safe_files.find_program('journalctl', search, euid=1000) is None, search
    assert safe_files.find_program('../journalctl', str(tmp_path / 'bin'), euid=0) is None
    assert not os.path.exists(marker)


def test_another_user_gets_the_first_program_on_her_own_path(tmp_path, alice):
    os.chmod(str(tmp_path), 0o755)
    hers = _dir(tmp_path / 'alice-bin', uid=alice)
    planted = _program(hers, 'squeue', str(tmp_path / 'ran'), uid=alice)
    assert safe_files.find_program('squeue', hers, euid=alice) == planted   # her own privileges are all it gets


def test_slurm_never_asks_a_planted_squeue_and_says_why(tmp_path, alice, monkeypatch):
    os.chmod(str(tmp_path), 0o755)
    marker = str(tmp_path / 'ran')
    hers = _dir(tmp_path / 'alice-bin', uid=alice)
    _program(hers, 'squeue', marker, uid=alice)
    monkeypatch.setenv('PATH', hers)
    monkeypatch.setattr(safe_files, 'SBIN_DIRS', ())
    with pytest.raises(slurm.SlurmError, match=r'alice-bin/squeue was not run as root: .*owned by uid %d' % alice):
        slurm.SlurmClient().jobs('node01')
    assert not os.path.exists(marker)


def test_a_reset_host_finds_no_planted_tool_and_warns(tmp_path, alice, monkeypatch):
    os.chmod(str(tmp_path), 0o755)
    marker = str(tmp_path / 'ran')
    hers = _dir(tmp_path / 'alice-bin', uid=alice)
    for name in ('nvidia-smi', 'systemctl', 'scontrol'):
        _program(hers, name, marker, uid=alice)
    monkeypatch.setenv('PATH', hers)
    monkeypatch.setattr(safe_files, 'SBIN_DIRS', ())
    host = reset.Host()
    assert host.tool('nvidia-smi') is None and host.tool('systemctl') is None and host.tool('scontrol') is None
    assert sorted(note.split(' ')[0] for note in host.tool_notes) == sorted(os.path.join(hers, name) for name in
                                                                            ('nvidia-smi', 'systemctl', 'scontrol'))
    assert not os.path.exists(marker)


def test_a_directory_link_is_followed_only_where_nobody_else_can_swap_it(tmp_path, alice):
    os.chmod(str(tmp_path), 0o755)
    root_bin = _dir(tmp_path / 'usr-bin')
    genuine = _program(root_bin, 'systemctl', str(tmp_path / 'ran'))
    os.symlink('usr-bin', str(tmp_path / 'bin'))                 # root's /bin -> usr/bin, in root's directory
    assert safe_files.find_program('systemctl', str(tmp_path / 'bin'), euid=0) == str(tmp_path / 'bin' / 'systemctl')
    assert safe_files.resolve_checked(str(tmp_path / 'bin' / 'systemctl'), euid=0) == genuine
    hers = _dir(tmp_path / 'alice-home', uid=alice)
    os.symlink(root_bin, os.path.join(hers, 'bin'))              # root's link, but in her directory: she can swap it
    os.lchown(os.path.join(hers, 'bin'), 0, 0)
    refused = []
    assert safe_files.find_program('systemctl', os.path.join(hers, 'bin'), euid=0, refused=refused) is None
    assert len(refused) == 1 and 'alice-home is owned by uid %d' % alice in refused[0], refused
    os.symlink(root_bin, str(tmp_path / 'her-link'))             # her own link in root's directory
    os.lchown(str(tmp_path / 'her-link'), alice, 0)
    refused = []
    assert safe_files.find_program('systemctl', str(tmp_path / 'her-link'), euid=0, refused=refused) is None
    assert 'her-link is a symbolic link that is owned by uid %d' % alice in refused[0], refused
