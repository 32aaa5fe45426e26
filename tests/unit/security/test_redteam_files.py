# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: the files the guard reads and writes as root (docs/security.md, T7 and T8).

A hostile user who can write a directory somewhere in the path of one of the guard's files swaps
a component for a symbolic link, or plants a link where the guard will write.  The tick must then
refuse to act (``guard_untrusted_input``, exit 1), signal nobody, and never read, write, create or
chmod the file the link names.

SAFETY: the files a link points at are files these tests create in their own temporary
directories, never system files.  Processes: the harness tests (``redteam.run``) start their
workloads in a PID namespace of their own; the plain tests start none and run the tick on a fake
snapshot in ``dry-run`` or ``warn`` mode.
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard, safe_files
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_guard import POLICY, Node
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam

GIB = redteam.GIB
SECRET = b'root:$6$not-a-real-hash:19000:0:99999:7:::\n'
# the policy the attacker wants the tick to enforce: bob's job is over it, and it acts at once
HOSTILE_POLICY = ('mode: enforce\nusers: {bob: {max_mem_gib_per_gpu: 1}}\n'
                  'escalation: {warn_again_after: 1s, act_after: 1s, sigkill_after: 2s, retry_after: 1s}\nnotify: {tty: false}\n')


def _as_user(uid, *argv, data=None):
    """Run ``argv`` (coreutils) as ``uid`` with no groups: the hostile user's own move on the file system."""
    def drop():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    subprocess.run(list(argv), preexec_fn=drop, check=True, timeout=60, cwd='/',  # pylint: disable=subprocess-popen-preexec-fn
                   input=data, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _secret(directory, name='shadow'):
    """A root-only file the test owns, standing for /etc/shadow: (path, its mode and bytes)."""
    path = os.path.join(str(directory), name)
    with open(path, 'wb') as handle:
        handle.write(SECRET)
    os.chmod(path, 0o600)
    return path


def _untouched(path):
    info = os.lstat(path)
    with open(path, 'rb') as handle:
        data = handle.read()
    return stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and data == SECRET


# ============================================================================ policy swap (harness: a tick that must not act)
def _policy_swap(node, target_owner):
    """The legitimate policy decides nothing; /etc of the guard is alice's (the weakness); alice
    swaps /etc/gpufleet for a link to a directory that holds an enforce policy against bob's job."""
    uid = node.uids['alice']
    node.write_policy('mode: dry-run\nnotify: {tty: false}\n')
    etc = os.path.join(node.guard_root, 'etc')
    os.chown(etc, uid, -1)
    bob = node.spawn('bob', gpu=0, mib=10 * GIB, argv=['python3', 'train.py'])
    alice = node.spawn('alice', gpu=1, mib=4 * GIB, argv=['python3', 'hog.py'])
    if target_owner == 'root':
        # a directory of root's that holds an enforce policy (say, the package's examples)
        target = os.path.join(node.sim.root, 'examples', 'gpufleet')
        os.makedirs(target, mode=0o755)
        os.chmod(os.path.dirname(target), 0o755)
        with open(os.path.join(target, 'policy.yaml'), 'w') as handle:
            handle.write(HOSTILE_POLICY)
        os.chmod(os.path.join(target, 'policy.yaml'), 0o644)
    else:
        target = os.path.join(node.sim.root, 'alice-etc')
        os.mkdir(target, 0o755)
        os.chown(target, uid, -1)
        _as_user(uid, 'tee', os.path.join(target, 'policy.yaml'), data=HOSTILE_POLICY.encode())
    _as_user(uid, 'mv', '-T', os.path.join(etc, 'gpufleet'), os.path.join(etc, 'gpufleet.orig'))
    _as_user(uid, 'ln', '-s', '-T', target, os.path.join(etc, 'gpufleet'))
    ticks = []
    for step in range(4):                    # enough ticks for the hostile policy's warnings and its action
        rc, summary, signalled, err = node.tick('--now', str(1.8e9 + 2 * step))
        ticks.append({'rc': rc, 'error': summary.get('error') if isinstance(summary, dict) else summary,
                      'decisions': summary.get('decisions') if isinstance(summary, dict) else None,
                      'signalled': signalled, 'stderr': err[-600:]})
    return {'ticks': ticks, 'bob_alive': node.alive(bob), 'alice_alive': node.alive(alice), 'etc': etc,
            'events': [record.get('event') for record in node.guard_log()]}


def scenario_policy_swap_to_roots_directory(node):
    return _policy_swap(node, 'root')


def scenario_policy_swap_to_alices_directory(node):
    return _policy_swap(node, 'alice')


@redteam.needs_namespace
@pytest.mark.parametrize('scenario', [scenario_policy_swap_to_roots_directory, scenario_policy_swap_to_alices_directory])
def test_a_policy_swapped_through_a_writable_directory_above_it_is_refused(scenario):
    result = redteam.run(scenario)
    for tick in result['ticks']:
        assert tick['rc'] == 1 and 'refusing to act on untrusted input' in tick['error'], tick
        assert 'the directory %s (above the policy file' % result['etc'] in tick['error'], tick
        assert tick['decisions'] is None and tick['signalled'] == [], tick
    assert result['bob_alive'] and result['alice_alive']
    assert set(result['events']) == {'guard_untrusted_input'}


def scenario_log_directory_of_alices(node):
    """The log directory is alice's; she plants guard.jsonl as a link to a root-only file.  The
    policy is sound and alice's hog is over it: the tick still must not act without its log."""
    uid = node.uids['alice']
    node.write_policy('mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 1}}\n'
                      'escalation: {warn_again_after: 1s, act_after: 1s, sigkill_after: 2s}\nnotify: {tty: false}\n')
    secret = _secret(node.work)
    log_dir = os.path.join(node.guard_root, 'var', 'log', 'gpufleet')
    os.makedirs(log_dir, mode=0o750)
    os.chown(log_dir, uid, -1)
    _as_user(uid, 'ln', '-s', '-T', secret, os.path.join(log_dir, 'guard.jsonl'))
    hog = node.spawn('alice', gpu=0, mib=4 * GIB, argv=['python3', 'hog.py'])
    bob = node.spawn('bob', gpu=1, mib=2 * GIB, argv=['python3', 'train.py'])
    ticks = []
    for step in range(3):
        rc, summary, signalled, _err = node.tick('--now', str(1.8e9 + 2 * step))
        ticks.append({'rc': rc, 'error': summary.get('error') if isinstance(summary, dict) else summary,
                      'decisions': summary.get('decisions') if isinstance(summary, dict) else None, 'signalled': signalled})
    return {'ticks': ticks, 'secret_untouched': _untouched(secret), 'hog_alive': node.alive(hog), 'bob_alive': node.alive(bob),
            'log_dir': log_dir}


@redteam.needs_namespace
def test_a_log_directory_another_user_owns_stops_the_tick_and_its_link_is_never_followed():
    result = redteam.run(scenario_log_directory_of_alices)
    for tick in result['ticks']:
        assert tick['rc'] == 1 and 'the log directory %s is owned by uid' % result['log_dir'] in tick['error'], tick
        assert tick['decisions'] is None and tick['signalled'] == [], tick
    assert result['secret_untouched'] and result['hog_alive'] and result['bob_alive']


# ============================================================================ links the tick finds in its own directories
@pytest.fixture
def node(tmp_path):
    """A guard whose files live under tmp_path (root's or the test user's, 0700 under sticky /tmp),
    one tick already run: every directory exists, the files too."""
    node = Node(tmp_path, policy=POLICY % 'warn')
    assert node.tick()['rc'] == 0
    return node


def _plant(path, target):
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


@pytest.mark.parametrize('name', ['policy', 'state', 'log', 'metrics', 'lock', 'history'])
def test_a_link_in_place_of_a_file_of_the_guard_is_refused_and_its_target_untouched(node, tmp_path, name):
    secret = _secret(tmp_path)
    path = getattr(node.paths, name)
    _plant(path, secret)
    summary = node.tick(3600)
    assert summary['rc'] == 1 and 'the %s file %s is a symbolic link' % ({'history': 'usage history'}.get(name, name), path) \
        in summary['error'], summary
    assert 'decisions' not in summary
    assert _untouched(secret)
    if name != 'metrics':
        assert os.path.islink(path)                  # nothing was written there (the metrics say policy_valid 0: the
    if name != 'log':                                # rename replaces the link itself, never what it names)
        assert node.log()[-1]['event'] == 'guard_untrusted_input'


def test_a_dangling_lock_link_creates_nothing(node, tmp_path):
    target = str(tmp_path / 'created-by-root')
    _plant(node.paths.lock, target)
    summary = node.tick(60)
    assert summary['rc'] == 1 and 'the lock file %s is a symbolic link' % node.paths.lock in summary['error']
    assert not os.path.lexists(target)


def test_a_link_in_place_of_the_lock_that_appears_after_the_check_is_refused(node, tmp_path, monkeypatch):
    """The race: the lock becomes a link between the check and the open."""
    secret = _secret(tmp_path)
    check = guard.untrusted_inputs

    def check_then_swap(paths, euid=None):
        problems = check(paths, euid)
        _plant(paths.lock, secret)
        return problems
    monkeypatch.setattr(guard, 'untrusted_inputs', check_then_swap)
    summary = node.tick(60)
    assert summary['rc'] == 1 and 'the lock file %s is a symbolic link' % node.paths.lock in summary['error']
    assert _untouched(secret) and node.log()[-1]['event'] == 'guard_untrusted_input'


def test_a_policy_link_that_appears_after_the_check_is_never_read(node, tmp_path, monkeypatch):
    """The race the old check lost: checked by path, then opened again by path.  Now the policy is
    parsed from the bytes of the descriptor that was checked; a link found at the open is refused."""
    other = tmp_path / 'other'
    other.mkdir(mode=0o755)
    hostile = other / 'policy.yaml'
    hostile.write_text(HOSTILE_POLICY)
    hostile.chmod(0o644)
    check = guard.untrusted_inputs

    def check_then_swap(paths, euid=None):
        problems = check(paths, euid)
        _plant(paths.policy, str(hostile))
        return problems
    monkeypatch.setattr(guard, 'untrusted_inputs', check_then_swap)
    summary = node.tick(3600)
    assert summary['rc'] == 1 and 'is a symbolic link' in summary['error'] and 'decisions' not in summary
    assert node.log()[-1]['event'] == 'guard_policy_invalid'
    with open(node.paths.metrics) as handle:
        assert 'gpufleet_guard_policy_valid 0' in handle.read()


def test_the_metrics_temp_file_swapped_for_a_link_before_its_mode_is_set(node, tmp_path, monkeypatch):
    """The old write chmod-ed the temporary file by path after closing it: swapped for a link to a
    root-only file (by whoever can write the textfile directory), that file became world-readable.
    Now the mode is set on the descriptor, and the rename moves the link itself."""
    secret = _secret(tmp_path)
    directory = os.path.dirname(node.paths.metrics)
    prefix = '.%s.' % os.path.basename(node.paths.metrics)
    real_fsync = os.fsync
    swapped = []

    def fsync_then_swap(fd):
        real_fsync(fd)
        for name in os.listdir(directory):
            if name.startswith(prefix) and not swapped:
                _plant(os.path.join(directory, name), secret)
                swapped.append(name)
    monkeypatch.setattr(os, 'fsync', fsync_then_swap)
    node.tick(60)
    monkeypatch.undo()
    assert swapped and _untouched(secret)                      # neither chmod-ed nor written through the link


def test_a_metrics_file_that_is_a_link_is_replaced_not_followed(tmp_path):
    secret = _secret(tmp_path)
    directory = tmp_path / 'textfile'
    directory.mkdir(mode=0o755)
    _plant(str(directory / 'gpufleet.prom'), secret)
    safe_files.write_atomic(str(directory / 'gpufleet.prom'), 'a 1\n', mode=0o644, strict=False)
    assert _untouched(secret)
    assert not os.path.islink(str(directory / 'gpufleet.prom')) and (directory / 'gpufleet.prom').read_text() == 'a 1\n'


@pytest.mark.parametrize('name,mode', [('metrics', 0o777), ('log', 0o777), ('lock', 0o777), ('history', 0o775), ('allocations', 0o777)])
def test_a_directory_others_can_write_that_the_tick_uses_is_refused(node, name, mode):
    directory = os.path.dirname(getattr(node.paths, name))
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, mode)
    summary = node.tick(60)
    assert summary['rc'] == 1 and 'directory %s is writable by' % directory in summary['error'], summary


def test_directories_above_an_output_may_be_writable_by_their_group(node, tmp_path):
    """Ubuntu's /var/log is root:syslog 0775: accepted above the log's own directory (the log is
    only written, through descriptors), not as the log's directory, and never above an input."""
    above = tmp_path / 'varlog'
    (above / 'gpufleet').mkdir(parents=True)
    above.chmod(0o775)
    (above / 'gpufleet').chmod(0o750)
    node.paths.log = str(above / 'gpufleet' / 'guard.jsonl')
    assert node.tick(60)['rc'] == 0
    above.chmod(0o777)
    assert 'the directory %s (above the log file' % above in node.tick(60)['error']
    above.chmod(0o755)
    (above / 'gpufleet').chmod(0o770)
    assert 'the log directory %s is writable by its group' % (above / 'gpufleet') in node.tick(60)['error']
    (above / 'gpufleet').chmod(0o750)
    state_above = os.path.dirname(os.path.dirname(node.paths.state))
    os.chmod(state_above, 0o775)
    assert 'the directory %s (above the state file' % state_above in node.tick(60)['error']


def test_a_settings_file_that_is_a_link_is_not_read_and_the_tick_refuses(node, tmp_path):
    secret = _secret(tmp_path)
    _plant(node.paths.settings, secret)
    before = node.paths.to_dict()
    settings = guard.load_settings(node.paths.settings, node.paths)
    assert settings.refused.startswith('the settings were not read: the file %s is a symbolic link' % node.paths.settings)
    assert node.paths.to_dict() == before and settings.webhook_url is None          # the defaults
    summary = node.tick(60)
    assert summary['rc'] == 1 and 'the settings file %s is a symbolic link' % node.paths.settings in summary['error']
    assert _untouched(secret)


@h.needs_root
def test_a_file_another_user_owns_is_not_read(tmp_path):
    uid = redteam.ensure_users(('alice',))['alice']
    path = tmp_path / 'allocations.json'
    path.write_text('{"gpus": {"0": ["slurm:1"]}}')
    path.chmod(0o644)
    assert safe_files.read_file(str(path), 1024) == path.read_bytes()
    os.chown(str(path), uid, -1)
    with pytest.raises(safe_files.UnsafeFile, match='owned by uid %d, not by root' % uid):
        safe_files.read_file(str(path), 1024)
