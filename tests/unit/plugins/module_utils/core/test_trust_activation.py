# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What switches rules on and names jobs (issue #15): root-vouched scheduler daemons, the root-owned
part of cgroup paths, and the cached executable hashes that exemptions and allowlists compare.

Needs root (directories and processes of the test users alice and bob, made by redteam.ensure_users).
SAFETY: only the ``sleep`` processes these tests start are signalled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import exe_hash, guard
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes as PR
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, proc, snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam

CID = '3f4e1a9c0b2d4e6f8a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f'
POD = '6f1c3c2a-7d1e-4a53-9a3b-2f7c8d9e0a1b'
SLEEP = shutil.which('sleep')
USER = '/user.slice/user-1001.slice/user@1001.service'


@pytest.fixture(scope='module')
def uids():
    return redteam.ensure_users()


@pytest.fixture
def started():
    """Start ``argv`` (optionally as another uid); every process is killed and reaped at the end."""
    procs = []

    def start(argv, preexec=None):
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 preexec_fn=preexec)
        procs.append(child)
        return child
    yield start
    for child in procs:
        child.kill()
        child.wait(timeout=10)


def comm(pid):
    try:
        with open('/proc/%d/comm' % pid) as handle:
            return handle.read().rstrip('\n')
    except OSError:
        return None


def as_user(uid, real=None):
    def drop():
        os.setgroups([])
        os.setresuid(uid if real is None else real, uid, uid)
    return drop


# ============================================================================ cgroup identity
def cgroup_tree(root, v1=None, owned=None, writable=()):
    """A cgroup file system under ``root``: cgroup v2 at the top (``cgroup.controllers``), or with
    ``v1`` a controller directory; every directory root-owned 0755 unless ``owned`` {path: uid} or
    ``writable`` (group-writable) say otherwise.  Returns a function that makes paths."""
    base = os.path.join(str(root), v1) if v1 else str(root)
    os.makedirs(base, mode=0o755, exist_ok=True)
    if not v1:
        open(os.path.join(base, 'cgroup.controllers'), 'w').close()

    def make(path):
        os.makedirs(base + path, mode=0o755, exist_ok=True)
        for parent, uid in (owned or {}).items():
            if os.path.isdir(base + parent):
                os.chown(base + parent, uid, uid)
        for parent in writable:
            os.chmod(base + parent, 0o775)
        return path
    return make


def parse(root, line):
    return PR.parse_cgroup(line + '\n', PR.CgroupTrust(str(root)))


def ids(parsed):
    container, job = parsed
    return (container.id if container else None, container.pod_uid if container else None, job)


def test_root_owned_cgroups_still_name_jobs_containers_and_pods(tmp_path):
    make = cgroup_tree(tmp_path)
    path = make('/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0')
    assert ids(parse(tmp_path, '0::' + path)) == (None, None, '4242')
    path = make('/system.slice/docker-%s.scope' % CID)
    assert ids(parse(tmp_path, '0::' + path)) == (CID, None, None)
    pod = POD.replace('-', '_')
    path = make('/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod%s.slice/cri-containerd-%s.scope' % (pod, CID))
    assert ids(parse(tmp_path, '0::' + path)) == (CID, POD, None)


@pytest.mark.parametrize('path', [
    USER + '/app.slice/job_4242',
    USER + '/app.slice/docker-%s.scope' % CID,
    USER + '/kubepods/pod%s/%s' % (POD, CID),
    '/user.slice/user-1001.slice/session-3.scope/job_4242',
    '/user.slice/user-1001.slice/job_4242',
], ids=['user-manager-job', 'user-manager-docker', 'user-manager-kubepods', 'session-scope-job', 'user-slice-job'])
def test_nothing_under_a_user_slice_is_an_identity_even_with_root_owners(tmp_path, path):
    cgroup_tree(tmp_path)(path)
    assert ids(parse(tmp_path, '0::' + path)) == (None, None, None)
    assert ids(PR.parse_cgroup('0::%s\n' % path)) == (None, None, None)     # and without a cgroup file system


def test_a_delegated_system_service_names_nothing_below_it(tmp_path, uids):
    """``Delegate=yes`` with ``User=alice`` on a system service: its cgroup belongs to alice."""
    path = '/system.slice/alice-lab.service/job_4242/docker-%s.scope/kubepods/pod%s/%s' % (CID, POD, CID)
    cgroup_tree(tmp_path, owned={'/system.slice/alice-lab.service': uids['alice']})(path)
    assert ids(parse(tmp_path, '0::' + path)) == (None, None, None)
    cgroup_tree(tmp_path, owned={'/system.slice/alice-lab.service': 0})(path)   # root's: the names hold
    assert ids(parse(tmp_path, '0::' + path)) == (CID, POD, '4242')


def test_a_group_writable_or_missing_directory_is_not_trusted(tmp_path):
    make = cgroup_tree(tmp_path, writable=['/system.slice'])
    path = make('/system.slice/slurmstepd.scope/job_1/step_0')
    assert ids(parse(tmp_path, '0::' + path)) == (None, None, None)
    assert ids(parse(tmp_path, '0::/machine.slice/gone.scope/job_2/step_0')) == (None, None, None)


def test_slurm_cgroup_v1_chowns_the_job_to_its_user_and_only_her_own_cgroups_are_hers(tmp_path, uids):
    # Slurm's cgroup v1 plugin makes /slurm/uid_U root's and chowns job_N and step_M to the job's user
    alice = uids['alice']
    make = cgroup_tree(tmp_path, v1='memory', owned={'/slurm/uid_%d/job_1' % alice: alice,
                                                     '/slurm/uid_%d/job_1/step_0' % alice: alice})
    path = make('/slurm/uid_%d/job_1/step_0' % alice)
    assert ids(parse(tmp_path, '4:memory:' + path)) == (None, None, '1')
    # she may create cgroups inside her job: they name nothing
    path = make('/slurm/uid_%d/job_1/job_999/docker-%s.scope' % (alice, CID))
    assert ids(parse(tmp_path, '4:memory:' + path)) == (None, None, '1')
    # a uid_U directory of hers (a delegated or misconfigured tree) names no job at all
    make = cgroup_tree(tmp_path, v1='devices', owned={'/slurm/uid_%d' % alice: alice})
    path = make('/slurm/uid_%d/job_1' % alice)
    assert ids(parse(tmp_path, '10:devices:' + path)) == (None, None, None)
    # a controller list names its directory ("cpu,cpuacct")
    path = cgroup_tree(tmp_path, v1='cpu,cpuacct')('/slurm/uid_%d/job_5/step_0' % alice)
    assert ids(parse(tmp_path, '3:cpu,cpuacct:' + path)) == (None, None, '5')


def test_without_a_cgroup_file_system_only_the_structural_rule_applies(tmp_path):
    trust = PR.CgroupTrust(str(tmp_path / 'not-mounted'))
    assert PR.parse_cgroup('0::/system.slice/slurmstepd.scope/job_7/step_0\n', trust)[1] == '7'
    assert PR.parse_cgroup('0::%s/app.slice/job_7\n' % USER, trust)[1] is None


def test_a_name_with_another_line_break_does_not_make_a_line():
    """Cgroup names may hold \\x1c, \\x85 or \\u2028 (not \\n): they must not start a new line."""
    for sep in ('\x1c', '\x1d', '\x85', '\u2028', '\r', '\v', '\f'):
        text = '0::%s/app.slice/x%s1::/system.slice/docker-%s.scope%s2::/slurm/job_42\n' % (USER, sep, CID, sep)
        assert ids(PR.parse_cgroup(text)) == (None, None, None), repr(sep)


def test_dot_dot_components_end_the_trusted_path(tmp_path):
    cgroup_tree(tmp_path)('/system.slice/docker-%s.scope' % CID)
    assert ids(parse(tmp_path, '0::/../system.slice/docker-%s.scope' % CID)) == (None, None, None)
    assert ids(parse(tmp_path, '0::/system.slice/../system.slice/docker-%s.scope' % CID)) == (None, None, None)


def test_the_inventory_reads_identity_through_the_owners(tmp_path, uids):
    """ProcessInventory (every consumer's source of container and slurm_job) applies the trust."""
    proc_root = tmp_path / 'proc'
    make = cgroup_tree(tmp_path / 'cgroup', owned={USER: uids['alice'], '/system.slice/lab.service': uids['alice']})
    paths = {200: make(USER + '/app.slice/job_4242'), 201: make('/system.slice/lab.service/job_4242'),
             202: make('/system.slice/slurmstepd.scope/job_77/step_0')}
    for pid, path in paths.items():
        base = proc_root / str(pid)
        base.mkdir(parents=True)
        (base / 'stat').write_text('%d (python) S 1 %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5000 1 1\n' % (pid, pid, pid))
        (base / 'status').write_text('Name:\tpython\nUid:\t1001\t1001\t1001\t1001\n')
        (base / 'cmdline').write_bytes(b'python\0train.py\0')
        (base / 'cgroup').write_text('0::%s\n' % path)
    inventory = PR.ProcessInventory(proc_root=str(proc_root), scan_fds=False, cgroup_root=str(tmp_path / 'cgroup'))
    result = inventory.scan(sorted(paths))
    assert [result.record(pid).slurm_job for pid in sorted(paths)] == [None, None, '77']


# ============================================================================ scheduler daemons
@pytest.fixture
def alices_dir(uids):
    """A directory of alice's in /tmp (where she can run what she copies), removed at the end."""
    path = tempfile.mkdtemp(prefix='gpufleet-alice-', dir='/tmp')
    os.chown(path, uids['alice'], uids['alice'])
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_process_named_slurmd_or_kubelet_is_not_a_scheduler(alices_dir, uids, started, tmp_path):
    # a process table of the test's own processes only (links to their /proc entries): a real slurmd elsewhere on the
    # machine (the simulated Slurm fleet starts one) is not in it
    table = tmp_path / 'proc'
    table.mkdir()
    for name in ('slurmd', 'kubelet'):
        fake = os.path.join(alices_dir, name)
        shutil.copy(SLEEP, fake)
        os.chmod(fake, 0o755)
        for preexec in (as_user(uids['alice']), None):                   # alice's, and root's from her directory
            child = started([fake, '60'], preexec)
            h.wait_for(lambda: comm(child.pid) == name, timeout=10)
            assert PR.root_daemon_name(child.pid) is None
            os.symlink('/proc/%d' % child.pid, str(table / str(child.pid)))
        assert PR.scheduler_daemon(str(table)) is None
        assert P.detect_scheduler(str(table)) is None
    root_sleep = started([SLEEP, '60'])   # the control: the same table does vouch for a root daemon
    os.symlink('/proc/%d' % root_sleep.pid, str(table / str(root_sleep.pid)))
    assert PR.root_daemon_name(root_sleep.pid, str(table)) == 'sleep'


def test_root_daemon_name_needs_root_uids_and_a_root_owned_executable_in_root_owned_directories(tmp_path, uids, started):
    assert PR.root_daemon_name(started([SLEEP, '60']).pid) == 'sleep'                      # root, /usr/bin/sleep
    assert PR.root_daemon_name(started([SLEEP, '60'], as_user(uids['alice'])).pid) is None
    assert PR.root_daemon_name(started([SLEEP, '60'], as_user(uids['alice'], real=0)).pid) is None   # real uid 0 only
    # a root-owned directory inside one that alice owns: she could rename it
    outer = tmp_path / 'alice'
    inner = outer / 'bin'
    inner.mkdir(parents=True)
    shutil.copy(SLEEP, str(inner / 'sleep'))
    os.chmod(str(inner / 'sleep'), 0o755)
    for path in (tmp_path, outer, inner):
        os.chmod(str(path), 0o755)
    os.chown(str(outer), uids['alice'], uids['alice'])
    assert PR.root_daemon_name(started([str(inner / 'sleep'), '60']).pid) is None
    assert PR.root_daemon_name(h.unused_pid()) is None


# ============================================================================ executable hashes
@pytest.fixture
def copied_sleep(tmp_path, started):
    path = tmp_path / 'bin' / 'worker'
    path.parent.mkdir()
    shutil.copy(SLEEP, str(path))
    os.chmod(str(path), 0o755)
    child = started([str(path), '60'])
    h.wait_for(lambda: comm(child.pid) == 'worker', timeout=10)
    with open(str(path), 'rb') as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    return {'path': str(path), 'pid': child.pid, 'starttime': h.starttime(child.pid), 'sha256': digest}


def test_exe_hashes_are_cached_across_runs_by_file_identity(copied_sleep):
    pid, start = copied_sleep['pid'], copied_sleep['starttime']
    first = exe_hash.ExeHashes()
    assert first.sha256(pid, start) == copied_sleep['sha256'] and first.hashed == 1
    assert first.sha256(pid, start) == copied_sleep['sha256'] and first.hashed == 1      # once per run
    second = exe_hash.ExeHashes(first.entries)                                          # the next tick
    assert second.sha256(pid, start) == copied_sleep['sha256'] and second.hashed == 0
    # the owner can put the modification time back, not the change time: the file is read again
    info = os.stat(copied_sleep['path'])
    os.utime(copied_sleep['path'], ns=(info.st_atime_ns, info.st_mtime_ns))
    third = exe_hash.ExeHashes(second.entries)
    assert third.sha256(pid, start) == copied_sleep['sha256'] and third.hashed == 1
    assert exe_hash.ExeHashes().sha256(pid, start + 1) is None                         # the pid was reused


def test_exe_hashes_have_a_size_bound_and_a_bounded_cache(copied_sleep):
    small = exe_hash.ExeHashes(max_bytes=1024)
    assert small.sha256(copied_sleep['pid']) is None and small.hashed == 0
    assert small.notes and 'pid %d' % copied_sleep['pid'] in small.notes[0] and 'not hashed' in small.notes[0]
    cache = exe_hash.ExeHashes({'1:2:3:4:5': ['a' * 64, 1.0], '6:7:8:9:10': ['b' * 64, 2.0], 'bad': ['zz', 1],
                                'worse': 'x', 'bool': ['c' * 64, True]}, max_entries=2)
    assert sorted(cache.entries) == ['1:2:3:4:5', '6:7:8:9:10']
    assert cache.sha256(os.getpid()) is not None
    assert len(cache.entries) == 2 and '1:2:3:4:5' not in cache.entries                # the least recently used went


def test_a_too_large_executable_matches_no_exe_sha256_exemption_and_says_so(copied_sleep):
    policy = P.load_policy_text('users: {alice: {max_mem_gib_total: 1}}\nexemptions:\n'
                                '  - {match: {exe_sha256: "%s"}, rules: [memory], expires: 2099-01-01}\n'
                                % copied_sleep['sha256'], 'policy.yaml')
    snap = snapshot([proc(copied_sleep['pid'], 'alice', {0: 2 * GIB}, starttime=copied_sleep['starttime'])])
    found, _notes = P.evaluate_detailed(policy, snap, {}, 1.9e9, P.Context(groups={}))
    assert found == []                                                                  # the exemption holds
    found, notes = P.evaluate_detailed(policy, snap, {}, 1.9e9, P.Context(groups={}, exe_cache=exe_hash.ExeHashes(max_bytes=1024)))
    assert [v.pids for v in found] == [[copied_sleep['pid']]]
    assert any('not hashed' in note for note in notes)


def test_the_tick_keeps_exe_hashes_in_its_state(tmp_path, copied_sleep, monkeypatch):
    paths = guard.Paths(root=str(tmp_path / 'guard'))
    os.makedirs(os.path.dirname(paths.policy))
    with open(paths.policy, 'w') as handle:
        handle.write('mode: dry-run\nusers: {alice: {max_mem_gib_total: 1}}\nnotify: {tty: false}\nexemptions:\n'
                     '  - {match: {exe_sha256: "%s"}, rules: [memory], expires: 2099-01-01}\n' % copied_sleep['sha256'])
    os.chmod(paths.policy, 0o644)
    settings = guard.Settings(utmp_paths=())
    snap = snapshot([proc(copied_sleep['pid'], 'alice', {0: 2 * GIB}, starttime=copied_sleep['starttime'])])
    first = guard.run_tick(paths, settings, snapshot=snap)
    assert first['rc'] == 0 and first['decisions'] == [], first
    with open(paths.state) as handle:
        cached = json.load(handle)['exe_hashes']
    assert [entry[0] for entry in cached.values()] == [copied_sleep['sha256']]

    def no_read(_self, _fd):
        raise AssertionError('an unchanged executable is not read again')
    monkeypatch.setattr(exe_hash.ExeHashes, '_read', no_read)
    second = guard.run_tick(paths, settings, snapshot=snap)
    assert second['rc'] == 0 and second['decisions'] == [], second
