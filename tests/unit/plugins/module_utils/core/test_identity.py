# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/identity.py: who a process is, from kernel-vouched fields only (issue 15)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import identity as I
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import killer, processes
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.reclaim import ReclaimOptions, plan
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import proc, snapshot

ALICE, BOB = 1001, 1002
# Every character str.splitlines() breaks at besides '\n', as the bytes a process name holds them.
SEPARATORS = (b'\r', b'\x0b', b'\x0c', b'\x1c', b'\x1d', b'\x1e', b'\xc2\x85', b'\xe2\x80\xa8', b'\xe2\x80\xa9')


def status(name=b'python', uids=(ALICE,) * 4, extra=b''):
    """/proc/PID/status bytes as the kernel writes them (Name: holds any byte but '\\n' and '\\\\')."""
    uid_line = b'Uid:\t%s\n' % b'\t'.join(b'%d' % uid for uid in uids) if uids is not None else b''
    return (b'Name:\t' + name + b'\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nPid:\t4242\nPPid:\t1\n'
            + uid_line + b'Gid:\t1001\t1001\t1001\t1001\n' + extra + b'VmRSS:\t  1024 kB\n')


class ProcTree(object):
    """A fake /proc: ``add(pid, ...)`` (re)writes a process's stat, status, cmdline and cgroup."""

    def __init__(self, root):
        self.root = str(root)

    def add(self, pid, uid=ALICE, starttime=1000, comm=b'train', state=b'S', cmdline=b'python\0train.py\0', uids=None):
        """``uids``: the Uid: line's real, effective, saved and filesystem uids (default: ``uid`` four times)."""
        base = os.path.join(self.root, str(pid))
        os.makedirs(base, exist_ok=True)
        files = {'stat': b'%d (%s) %s 1 %d %d 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0' % (pid, comm, state, pid, pid, starttime),
                 'status': status(comm, uids or (uid,) * 4), 'cmdline': cmdline, 'cgroup': b'0::/user.slice\n'}
        for name, data in files.items():
            with open(os.path.join(base, name), 'wb') as handle:
                handle.write(data)

    def remove(self, pid):
        shutil.rmtree(os.path.join(self.root, str(pid)))


# ---------------------------------------------------------------------------- parsing
def test_kernel_lines_split_at_the_newline_only():
    for sep in SEPARATORS:
        assert I.kernel_lines(b'Name:\t' + sep + b'Uid:\t0\nUid:\t1') == [b'Name:\t' + sep + b'Uid:\t0', b'Uid:\t1']
        text = sep.decode('utf-8')
        assert I.kernel_lines('0::/a' + text + '1::/b\n') == ['0::/a' + text + '1::/b', '']


@pytest.mark.parametrize('sep', SEPARATORS, ids=lambda sep: sep.hex())
def test_a_name_cannot_forge_the_uid_line(sep):
    for forged in (b'Uid:\t%d' % BOB, b'Uid:\t0\t0\t0\t0', b'Uid:\tx'):
        data = status(name=sep + forged)
        assert data.decode('utf-8').splitlines()[1].startswith('Uid:')  # what the old reader fell for
        assert I.parse_status_uids(data) == (ALICE,) * 4


def test_a_name_holding_a_whole_uid_line_without_separator_is_just_a_name():
    # psutil matches r'Uid:\t(\d+)\t(\d+)\t(\d+)' anywhere in the file, the Name: line included
    assert I.parse_status_uids(status(name=b'Uid:\t0\t0\t0')) == (ALICE,) * 4


@pytest.mark.parametrize('data, why', [
    (status(uids=None), 'no Uid line'),
    (status(extra=b'Uid:\t0\t0\t0\t0\n'), 'two Uid lines'),
    (status(uids=(ALICE, ALICE, ALICE)), 'three fields'),
    (status(uids=(ALICE,) * 5), 'five fields'),
    (status().replace(b'Uid:\t1001', b'Uid:\t-1'), 'a sign'),
    (status().replace(b'Uid:\t1001', b'Uid:\t 1001'), 'a space'),
    (status().replace(b'Uid:\t', b'Uid: '), 'not the exact "Uid:\\t" prefix'),
    (status().replace(b'\nUid:', b'\n Uid:'), 'an indented line'),
    (b'', 'an empty file'),
])
def test_an_owner_that_does_not_read_exactly_is_unknown(data, why):
    assert I.parse_status_uids(data) is None, why


def test_the_status_parser_takes_bytes_only():
    with pytest.raises(TypeError, match='bytes of /proc/PID/status'):
        I.parse_status_uids(status().decode())


# ---------------------------------------------------------------------------- live processes
def test_the_identity_of_this_process():
    ident, extra = I.read_identity(os.getpid(), during=lambda: 'read between')
    assert extra == 'read between'
    assert ident.uids[:3] == os.getresuid() and ident.uid == os.getuid()
    assert ident.starttime == I.read_starttime(os.getpid()) == h.starttime(os.getpid())
    here = os.stat(sys.executable)
    assert (ident.exe.dev, ident.exe.ino, ident.exe.uid) == (here.st_dev, here.st_ino, here.st_uid)
    assert ident.exe.path == os.path.realpath(sys.executable) and not ident.exe.deleted


def _wait_state(pid, wanted, what):
    h.wait_for(lambda: (I.read_stat(pid) or {}).get('state') == wanted, what=what)


def test_a_zombie_keeps_its_owner_and_has_no_executable():
    child = subprocess.Popen([sys.executable, '-c', 'pass'])
    try:
        _wait_state(child.pid, 'Z', 'the child to exit (not reaped)')
        ident, _extra = I.read_identity(child.pid)
        assert ident.state == 'Z' and ident.uid == os.getuid() and ident.exe is None
        assert killer.read_proc(child.pid).dead
    finally:
        child.wait(10)
    assert I.read_identity(child.pid) == (None, None)  # reaped: gone


def test_the_executable_of_a_deleted_file(tmp_path):
    exe = str(tmp_path / 'tool')
    shutil.copyfile(shutil.which('sleep'), exe)
    os.chmod(exe, 0o755)
    child = subprocess.Popen([exe, '600'])
    try:
        h.wait_for(lambda: I.read_exe_identity(child.pid) is not None and I.read_exe_identity(child.pid).path == exe,
                   what='the copy of sleep to run')
        before = os.stat(exe)
        os.unlink(exe)
        found = I.read_exe_identity(child.pid)
        assert found.deleted and found.path == exe + ' (deleted)'
        assert (found.dev, found.ino, found.uid, found.mode) == (before.st_dev, before.st_ino, before.st_uid, before.st_mode)
        assert found.dir_writable is True  # under the sticky, world-writable /tmp: anyone may name a file there
        assert not found.trusted
    finally:
        child.kill()
        child.wait(10)


def test_directories_users_may_write(tmp_path):
    cache = {}
    assert I.dirs_writable('/usr/bin/env', cache) is False
    assert cache['/usr/bin'] is False and cache['/'] is False
    assert I.dirs_writable(str(tmp_path / 'tool'), cache) is True           # /tmp is 1777
    assert I.dirs_writable('relative/tool') is None
    assert I.dirs_writable('/no-such-directory-here/tool') is None
    cache['/usr/bin'] = True                                                  # the cache answers for the scan
    assert I.dirs_writable('/usr/bin/env', cache) is True


def test_directories_are_examined_in_the_processs_own_root(tmp_path):
    """A chroot's /usr/bin is the jail's directory, and the jail is its /: what lies above it (our
    /tmp) is not on the process's path."""
    jail = tmp_path / 'jail'
    (jail / 'usr' / 'bin').mkdir(parents=True)
    for path in (jail, jail / 'usr', jail / 'usr' / 'bin'):
        os.chmod(str(path), 0o755)
    assert I.dirs_writable('/usr/bin/sleep', root=str(jail)) is (os.geteuid() != 0)  # root-owned 0755 when root made it
    os.chmod(str(jail / 'usr' / 'bin'), 0o777)
    cache = {}
    assert I.dirs_writable('/usr/bin/sleep', cache, root=str(jail)) is True
    assert cache[str(jail) + '/usr/bin'] is True and '/usr/bin' not in cache


def _login_defs(directory, name, data, mode=0o644):
    """A login.defs candidate ``directory/name`` holding ``data`` (text or bytes), with ``mode``."""
    path = str(directory / name)
    with open(path, 'wb') as handle:
        handle.write(data if isinstance(data, bytes) else data.encode())
    os.chmod(path, mode)
    return path


def test_the_system_uid_boundary(tmp_path):
    def defs(name, text, mode=0o644):
        return _login_defs(tmp_path, name, text, mode)

    trusted = os.geteuid() == 0  # only a root-owned file counts
    assert I.system_uid_max(defs('plain', '# comment\nSYS_UID_MAX\t\t499\n')) == (499 if trusted else 999)
    assert I.system_uid_max(defs('capped', 'UID_MIN 500\nSYS_UID_MAX 999\n')) == (499 if trusted else 999)
    assert I.system_uid_max(defs('writable', 'SYS_UID_MAX 60000\n', mode=0o666)) == 999
    link = str(tmp_path / 'link')
    os.symlink(defs('target', 'SYS_UID_MAX 60000\n'), link)
    assert I.system_uid_max(link) == 999
    assert I.system_uid_max(str(tmp_path / 'missing')) == 999
    assert I.system_uid_max(defs('garbage', 'SYS_UID_MAX many\n\x1cSYS_UID_MAX 5\n')) == 999


# ---------------------------------------------------------------------------- who a name may protect
TRUSTED_EXE = I.ExeIdentity('/usr/sbin/sshd', False, 2049, 77, 0, 0o100755, False)


@pytest.mark.parametrize('uids, exe, trusted, why', [
    ((0, 0, 0, 0), TRUSTED_EXE, True, None),
    ((120, 120, 120, 120), TRUSTED_EXE, True, None),
    ((500, 500, 500, 500), TRUSTED_EXE, True, None),                  # at the boundary: a system account
    ((0, 0, 0, 5000), TRUSTED_EXE, True, None),                       # the filesystem uid does not count
    ((501, 501, 501, 501), TRUSTED_EXE, False, 'it runs as uid 501, not a system account'),
    ((ALICE,) * 4, TRUSTED_EXE, False, 'it runs as uid 1001, not a system account'),
    ((0, 0, ALICE, 0), TRUSTED_EXE, False, 'it runs as uid 1001, not a system account'),
    ((ALICE, 0, 0, 7000), TRUSTED_EXE, False, 'it runs as uid 1001, not a system account'),
    (None, TRUSTED_EXE, False, 'its owner is unknown'),
    ((0,) * 4, None, False, 'its executable cannot be examined'),
    ((0,) * 4, I.ExeIdentity('/usr/sbin/sshd', False, 2049, 77, ALICE, 0o100755, False), False,
     'its executable /usr/sbin/sshd is not a root-owned file that only root may write'),
    ((0,) * 4, I.ExeIdentity('/usr/sbin/sshd', False, 2049, 77, 0, 0o100775, False), False,
     'its executable /usr/sbin/sshd is not a root-owned file that only root may write'),
    ((0,) * 4, I.ExeIdentity('/tmp/sshd', False, 2049, 77, 0, 0o100755, True), False,
     'its executable /tmp/sshd sits in a directory that a user may write'),
    ((0,) * 4, I.ExeIdentity('/x/sshd', False, 2049, 77, 0, 0o100755, None), False,
     'its executable /x/sshd sits in a directory that a user may write'),
    ((0,) * 4, I.ExeIdentity('/x/sshd', False, None, None, None, 0, None), False,
     'its executable /x/sshd is not a root-owned file that only root may write'),
])
def test_a_name_is_trusted_only_for_a_system_account_and_a_root_owned_executable(uids, exe, trusted, why):
    """With the boundary given (500 here, not login.defs' 999): uids 501-999 are ordinary accounts then."""
    ident = I.Identity(4242, 1000, 'S', 1, 4242, 0, 'sshd', uids, exe)
    assert ident.name_trusted(boundary=500) is trusted and I.name_trusted(ident, 500) is trusted
    assert ident.system_account(500) is (uids is not None and max(uids[:3]) <= 500)
    assert ident.why_name_untrusted(boundary=500) == why
    assert not I.name_trusted(None)


def _named(name, user=None):
    """A child that names itself ``name`` (comm) and sleeps; run as ``user`` when given (root only)."""
    code = ('import ctypes, sys, time\nctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n'
            'sys.stdout.write("ok\\n"); sys.stdout.flush(); time.sleep(600)\n')
    exe, kwargs = sys.executable, {}
    if user is not None:
        found = h.python_for_user(user, ('ctypes',))
        if found is None:
            pytest.skip('no Python interpreter that %s may run' % user)
        exe, extra = found
        kwargs = dict(h._as_user(user), env={'PATH': '/usr/bin:/bin', 'PYTHONPATH': extra})  # pylint: disable=protected-access
    child = subprocess.Popen([exe, '-c', code, name], stdout=subprocess.PIPE, **kwargs)
    assert child.stdout.readline() == b'ok\n'
    return child


def test_a_protected_name_protects_only_a_system_accounts_process():
    prot = killer.Protection(protect_names=['sshd'])
    prot.self_session = 0  # the children share this test's session: keep that rule out of the way
    mine = _named('sshd')
    others = [_named('sshd', user='nobody')] if os.geteuid() == 0 else []
    try:
        info = killer.read_proc(mine.pid)
        assert info.comm == 'sshd'
        expected = 'protected name sshd (protect_names)' if I.name_trusted(info.identity) else None
        assert prot.reason(info) == expected
        assert (expected is not None) == (os.geteuid() <= I.system_uid_max() and info.identity.exe.trusted)
        for child in others:  # nobody (65534) is no system account: the name protects nothing
            info = killer.read_proc(child.pid)
            assert info.uid == pwd.getpwnam('nobody').pw_uid and prot.reason(info) is None
            assert 'not a system account' in info.identity.why_name_untrusted()
    finally:
        for child in [mine] + others:
            child.kill()
            child.wait(10)


def test_the_inventory_takes_the_owner_from_the_identity_not_from_psutil():
    """psutil's uids() matches 'Uid:\\t0\\t0\\t0' inside the Name: line; the inventory reads the exact line."""
    user = 'nobody' if os.geteuid() == 0 else None
    child = _named('Uid:\t0\t0\t0', user=user)
    try:
        expected = pwd.getpwnam(user).pw_uid if user is not None else os.getuid()
        for use_psutil in ((False, True) if processes.load_psutil() is not None else (False,)):
            rec = processes.ProcessInventory(use_psutil=use_psutil, scan_fds=False).record(child.pid)
            assert rec.uid == expected and rec.identity.uid == expected, use_psutil
            assert rec.user == processes.user_name(expected) and rec.name == 'Uid:\t0\t0\t0'
    finally:
        child.kill()
        child.wait(10)


# ---------------------------------------------------------------------------- setuid: the real uid is charged
NOBODY = pwd.getpwnam('nobody').pw_uid
SETUID = (NOBODY, 0, 0, 0)   # Uid: real, effective, saved, filesystem: nobody running a setuid-root helper
MEMORY_LIMIT = 'users: {nobody: {max_mem_mib_total: 1024}}'


def _setuid_record(tree, use_psutil, monkeypatch):
    """The inventory's record of pid 4242 in ``tree``, a setuid-root helper that nobody started."""
    tree.add(4242, comm=b'helper', cmdline=b'helper\0', uids=SETUID)
    if use_psutil:
        fake = FakePsutil(lambda: None, {'pid': 4242, 'name': 'helper', 'cmdline': ['helper'], 'status': 'sleeping',
                                         'ppid': 1, 'create_time': 1.0, 'exe': None})
        monkeypatch.setattr(processes, '_PSUTIL', [fake, None])
    inventory = processes.ProcessInventory(proc_root=tree.root, use_psutil=use_psutil, scan_fds=False)
    assert inventory.use_psutil is use_psutil
    return inventory.record(4242)


@pytest.mark.parametrize('use_psutil', [False, True], ids=['proc', 'psutil'])
def test_a_setuid_process_is_charged_to_its_real_uid(tmp_path, monkeypatch, use_psutil):
    """``Uid:\t65534\t0\t0\t0``: the one who started it owns it, on both inventory paths (issue 34); the
    effective uid (root) is kept in the identity, where protection reads it."""
    rec = _setuid_record(ProcTree(tmp_path), use_psutil, monkeypatch)
    assert rec.found and (rec.uid, rec.user) == (NOBODY, 'nobody')
    assert rec.identity.uid == NOBODY and rec.identity.uids == SETUID


@pytest.mark.parametrize('use_psutil', [False, True], ids=['proc', 'psutil'])
def test_the_memory_of_a_setuid_process_counts_against_its_real_users_limit(tmp_path, monkeypatch, use_psutil):
    """The policy charges the helper's 4 GiB to nobody (over its 1 GiB), not to root."""
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
    snap = snapshot([proc(4242, 'alice', {0: 4096})])
    snap.processes[0].join(_setuid_record(ProcTree(tmp_path), use_psutil, monkeypatch))
    found = P.evaluate(P.load_policy_text(MEMORY_LIMIT, 'policy.yaml'), snap, {}, snap.taken_at, P.Context(groups={}))
    assert [(v.rule, v.user, v.pids, v.measured) for v in found] == [('max_mem_total', 'nobody', [4242], 4096)]


@pytest.mark.skipif(os.geteuid() != 0, reason='runs a setuid-root executable as nobody (root)')
def test_a_real_setuid_process_is_its_real_users():
    """The same with the kernel's own Uid: line: nobody runs a setuid-root copy of sleep (real 65534, effective 0)."""
    where = tempfile.mkdtemp(prefix='gpufleet-setuid-')   # root's, 0755: nobody may run what is in it
    os.chmod(where, 0o755)
    helper = os.path.join(where, 'helper')
    shutil.copy('/bin/sleep', helper)
    os.chmod(helper, 0o4755)
    child = subprocess.Popen([helper, '600'], **h._as_user('nobody'))  # pylint: disable=protected-access
    try:
        h.wait_for(lambda: (I.read_identity(child.pid)[0] or I.Identity(0, 0, '', 0, 0, 0, '', ())).comm == 'helper',
                   what='the helper to start')
        ident, _extra = I.read_identity(child.pid)
        if ident.uids[1] != 0:
            pytest.skip('%s is mounted nosuid: the helper did not gain root' % where)
        assert ident.uids[:3] == (NOBODY, 0, 0)
        for use_psutil in ((False, True) if processes.load_psutil() is not None else (False,)):
            rec = processes.ProcessInventory(use_psutil=use_psutil, scan_fds=False).record(child.pid)
            assert (rec.uid, rec.user) == (NOBODY, 'nobody'), use_psutil
    finally:
        child.kill()
        child.wait(10)
        shutil.rmtree(where)


# ---------------------------------------------------------------------------- reads across a pid reuse
class FakePsutil(object):
    """Just enough of psutil for ProcessInventory; ``on_read`` runs while psutil reads the process."""

    class NoSuchProcess(Exception):
        pass

    class AccessDenied(Exception):
        pass

    def __init__(self, on_read, info):
        self.on_read = on_read
        self.info = info
        fake = self

        class Process(object):
            def __init__(self, pid):
                self.pid = pid

            def as_dict(self, attrs, ad_value=None):
                fake.on_read()
                return dict(fake.info)

        self.Process = Process


def _no_signals(monkeypatch):
    sent = []
    monkeypatch.setattr(os, 'kill', lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(os, 'killpg', lambda pid, sig: sent.append((pid, sig)))
    if hasattr(signal, 'pidfd_send_signal'):
        monkeypatch.setattr(signal, 'pidfd_send_signal', lambda fd, sig, *args: sent.append((fd, sig)))
    return sent


def _kill_alices(rec, tree, monkeypatch):
    """gpu_kill users=[alice] (then pids=[4242]) over a snapshot that joined ``rec``: what is signalled."""
    snap = snapshot([proc(4242, 'alice', {0: 4096})])
    snap.processes[0].join(rec)
    sent = _no_signals(monkeypatch)
    for selector in (Selector(users=['alice']), Selector(pids=[4242])):
        decided = plan(snap, selector, ReclaimOptions(), killer.Protection(protect_names=[], proc_root=tree.root),
                       proc_root=tree.root)
        killer.terminate(decided.victims, timeout=0.1, proc_root=tree.root)
        assert decided.would_signal == [] and all(v.signals == [] for v in decided.victims)
    return sent


def test_a_psutil_record_read_across_a_pid_reuse_is_discarded(tmp_path, monkeypatch):
    """alice's process exits while psutil reads it and bob's takes the pid: the start time read first
    and checked last differ, so the record is dropped whole, and gpu_kill users=[alice] signals nothing
    (the old order read alice's name and user, then bob's start time, and signalled bob's process)."""
    tree = ProcTree(tmp_path)
    tree.add(4242, uid=ALICE, starttime=1000, comm=b'train')

    def reuse():
        tree.add(4242, uid=BOB, starttime=2000, comm=b'serve', cmdline=b'serve\0')

    fake = FakePsutil(reuse, {'pid': 4242, 'name': 'train', 'cmdline': ['python', 'train.py'], 'status': 'sleeping',
                              'ppid': 1, 'create_time': 1.0, 'exe': None})
    monkeypatch.setattr(processes, '_PSUTIL', [fake, None])
    inventory = processes.ProcessInventory(proc_root=tree.root, use_psutil=True, scan_fds=False)
    assert inventory.use_psutil
    rec = inventory.record(4242)
    assert not rec.found and rec.user is None and rec.uid is None
    assert _kill_alices(rec, tree, monkeypatch) == []
    # the same read with no reuse is a whole, consistent record
    fake.on_read = lambda: None
    rec = inventory.record(4242)
    assert rec.found and (rec.uid, rec.starttime, rec.identity.uids) == (BOB, 2000, (BOB,) * 4)


def test_a_psutil_record_of_a_process_that_exits_meanwhile_is_discarded(tmp_path, monkeypatch):
    tree = ProcTree(tmp_path)
    tree.add(4242)
    fake = FakePsutil(lambda: tree.remove(4242), {'name': 'train'})
    monkeypatch.setattr(processes, '_PSUTIL', [fake, None])
    assert not processes.ProcessInventory(proc_root=tree.root, use_psutil=True, scan_fds=False).record(4242).found

    def gone():
        raise fake.NoSuchProcess(4242)

    tree.add(4242)
    fake.on_read = gone
    assert not processes.ProcessInventory(proc_root=tree.root, use_psutil=True, scan_fds=False).record(4242).found


@pytest.mark.parametrize('step', ['read_exe_identity', 'read_cmdline'])
def test_a_proc_record_read_across_a_pid_reuse_is_discarded(tmp_path, monkeypatch, step):
    """The same on the /proc path (the guard's), with the pid reused between the uid read and the
    executable, or while the command line is read."""
    tree = ProcTree(tmp_path)
    tree.add(4242, uid=ALICE, starttime=1000)
    module = I if step == 'read_exe_identity' else processes
    real = getattr(module, step)

    def reused(*args, **kwargs):
        tree.add(4242, uid=BOB, starttime=2000)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, step, reused)
    rec = processes.ProcessInventory(proc_root=tree.root, use_psutil=False, scan_fds=False).record(4242)
    assert not rec.found
    for read in (processes.read_proc_files, killer.read_proc):
        tree.add(4242, uid=ALICE, starttime=1000)
        assert read(4242, tree.root) is None, read
    monkeypatch.setattr(module, step, real)
    assert _kill_alices(rec, tree, monkeypatch) == []


def test_an_owner_that_cannot_be_read_is_read_once_more(tmp_path, monkeypatch):
    tree = ProcTree(tmp_path)
    tree.add(4242, uid=ALICE)
    real = I.read_bytes
    failures = []

    def flaky(path, limit=None):
        if path.endswith('/status') and not failures:
            failures.append(path)
            raise OSError(5, 'Input/output error')
        return real(path, limit)

    monkeypatch.setattr(I, 'read_bytes', flaky)
    ident, _extra = I.read_identity(4242, tree.root)
    assert failures and ident.uids == (ALICE,) * 4


def test_a_process_gone_before_the_read_has_no_identity(tmp_path):
    assert I.read_identity(4242, str(tmp_path)) == (None, None)
    assert I.read_identity(h.unused_pid()) == (None, None)


def test_a_pid_whose_owner_changed_since_the_snapshot_is_not_signalled(monkeypatch):
    """Selected as alice's (users=[alice], a quota), owned by another uid when the killer looks: skipped."""
    child = subprocess.Popen(['sleep', '600'])
    try:
        h.wait_for(lambda: (I.read_stat(child.pid) or {}).get('comm') == 'sleep', what='sleep to start')
        ident, _extra = I.read_identity(child.pid)
        snap = snapshot([proc(child.pid, 'alice', {0: 4096}, uid=ALICE, starttime=ident.starttime)])
        snap.processes[0].identity = I.Identity(child.pid, ident.starttime, 'S', 1, 1, 0, 'sleep', (ALICE,) * 4, ident.exe)
        sent = _no_signals(monkeypatch)
        decided = plan(snap, Selector(pids=[child.pid]), ReclaimOptions(), killer.Protection(protect_names=[]))
        monkeypatch.undo()  # os.kill again, for the cleanup below
        assert decided.victims == [] and sent == []
        (skipped,) = decided.skipped
        assert skipped['reason'] == 'pid %d was selected as uid %d\'s but is now owned by uid %d: not signalled' % (
            child.pid, ALICE, os.getuid())
    finally:
        child.kill()
        child.wait(10)


# ---------------------------------------------------------------------------- exact readings (mutation testing)
# Each field, bound and message below is pinned because a one-line change to it passed every test before
# (`make mutants MODULE=identity`, docs/testing.md).
STAT_REST = ['S', '7', '88', '99', '5', '-1', '4194560'] + [str(100 + i) for i in range(12)] + ['123456', '0', '0']


def test_parse_stat_reads_the_name_from_the_first_open_to_the_last_close_parenthesis():
    """Field N after the name is rest[N - 3]: every field around the ones read holds another number."""
    parsed = I.parse_stat('4242 (a) (b) %s' % ' '.join(STAT_REST))
    assert parsed == {'comm': 'a) (b', 'state': 'S', 'ppid': 7, 'session': 99, 'flags': 4194560, 'starttime': 123456}
    for text in ('4242 (a S 7 88', '4242 a) S 7 88', '4242 a S 7'):
        with pytest.raises(ValueError, match='^malformed stat line$'):
            I.parse_stat(text)


def test_the_stat_readers_on_a_fixture_tree_and_on_this_process(tmp_path):
    tree = ProcTree(tmp_path)
    pid = h.unused_pid()   # no process of this host has it, so a reader that looks in the real /proc finds nothing
    tree.add(pid, comm=b'\xff\xfe', starttime=4321)
    assert I.read_stat(pid, tree.root)['comm'] == '\ufffd\ufffd'   # invalid UTF-8 in the name is replaced, not fatal
    assert I.read_starttime(pid, tree.root) == 4321 and I.read_ppid(pid, tree.root) == 1
    assert I.read_starttime(pid + 1, tree.root) is None and I.read_ppid(pid + 1, tree.root) is None
    assert I.read_ppid(os.getpid()) == os.getppid()                 # the default root is /proc
    assert I.read_starttime(os.getpid()) == I.read_stat(os.getpid())['starttime']


@pytest.mark.parametrize('data, uids', [
    (b'Uid:\t1\t2\t3\t4\nGid:\t0\t0\t0\t0\n', (1, 2, 3, 4)),          # the first line
    (b'Name:\tx\nUid:\t1\t2\t3\t4', (1, 2, 3, 4)),                        # the last line, no newline after it
    (b'Name:\tx\nUid:\t1\t2\t3\t4\n', (1, 2, 3, 4)),
    (b'Uid:\t1\t2\t3\t4\nUid:\t5\t5\t5\t5\n', None),                    # two lines: one is forged
    (b'Name:\tx\nUid:\t1\t2\t3\n', None),
])
def test_parse_status_uids_reads_exactly_one_uid_line(data, uids):
    assert I.parse_status_uids(data) == uids


def test_parse_status_uids_names_what_it_got_instead_of_bytes():
    with pytest.raises(TypeError, match=r'^parse_status_uids\(\) needs the bytes of /proc/PID/status, got str$'):
        I.parse_status_uids('Uid:\t0\t0\t0\t0\n')


def _record_open_flags(monkeypatch):
    """The flags of every os.open from now on (a list that fills as the code under test opens files)."""
    flags = []
    real_open = os.open

    def recording_open(name, mode, *args):
        flags.append(mode)
        return real_open(name, mode, *args)

    monkeypatch.setattr(os, 'open', recording_open)
    return flags


def test_read_bytes_reads_the_whole_file_or_exactly_its_limit(tmp_path, monkeypatch):
    data = bytes(range(256)) * 800   # 204,800 bytes: four reads of 64 KiB
    path = str(tmp_path / 'data')
    with open(path, 'wb') as handle:
        handle.write(data)
    empty = str(tmp_path / 'empty')
    open(empty, 'wb').close()
    assert I.read_bytes(path) == data
    assert I.read_bytes(empty) == b''
    for limit in (10, 65536, 70000, 140000, 204800, 300000):
        assert I.read_bytes(path, limit) == data[:limit], limit
    flags = _record_open_flags(monkeypatch)
    I.read_bytes(path, 10)
    assert flags and flags[0] & os.O_CLOEXEC   # a descriptor root holds is never inherited by a child it starts


def test_identity_defaults_and_fields():
    ident = I.Identity(1, 2, ppid=3, session=4)
    assert (ident.pid, ident.starttime, ident.state, ident.ppid, ident.session, ident.flags, ident.comm, ident.uids,
            ident.exe, ident.uid) == (1, 2, None, 3, 4, 0, None, None, None, None)
    assert repr(I.Identity(1, 2, uids=(0, 0, 0, 0), exe=TRUSTED_EXE)) == (
        "Identity(pid=1, starttime=2, uids=(0, 0, 0, 0), exe=ExeIdentity('/usr/sbin/sshd', dev=2049, ino=77, uid=0, "
        "mode=100755, dir_writable=False))")


def test_exe_identities_compare_by_every_field_and_describe_themselves():
    same = I.ExeIdentity('/usr/sbin/sshd', False, 2049, 77, 0, 0o100755, False)
    assert same == TRUSTED_EXE and same is not TRUSTED_EXE and (same != TRUSTED_EXE) is False
    for index in range(7):
        fields = ['/usr/sbin/sshd', False, 2049, 77, 0, 0o100755, False]
        fields[index] = {0: '/x', 1: True, 2: 1, 3: 1, 4: 1, 5: 0o100700, 6: None}[index]
        assert I.ExeIdentity(*fields) != TRUSTED_EXE, index
    assert TRUSTED_EXE.__eq__('/usr/sbin/sshd') is NotImplemented and TRUSTED_EXE != '/usr/sbin/sshd'
    assert I.Identity(1, 2) == I.Identity(1, 2) and I.Identity(1, 2) != I.Identity(1, 3)
    assert TRUSTED_EXE.to_dict() == {'path': '/usr/sbin/sshd', 'deleted': False, 'dev': 2049, 'ino': 77, 'uid': 0,
                                     'mode': '0755', 'dir_writable': False}


def test_an_executable_that_cannot_be_examined_is_vouched_for_in_nothing(tmp_path):
    """/proc/PID/exe names a file that stat cannot reach: the path is known, nothing else."""
    tree = ProcTree(tmp_path)
    pid = h.unused_pid()
    tree.add(pid)
    os.symlink('/nonexistent-gpufleet/tool (deleted)', os.path.join(tree.root, str(pid), 'exe'))
    assert I.read_exe_identity(pid, tree.root) == I.ExeIdentity('/nonexistent-gpufleet/tool (deleted)', True, None, None,
                                                                None, 0, None)
    ident, _extra = I.read_identity(pid, tree.root)
    assert (ident.ppid, ident.session, ident.exe.path) == (1, pid, '/nonexistent-gpufleet/tool (deleted)')
    ident, _extra = I.read_identity(pid, tree.root, exe=False)
    assert ident.exe is None


@pytest.mark.skipif(os.geteuid() != 0, reason='the directories must be root-owned (root)')
@pytest.mark.parametrize('name, writable, verdict', [
    ('tool', False, False),             # in the process's root every directory is root's 0755 (ours: /tmp is 1777)
    ('tool', True, True),               # the directory it runs from is 0777 in its root
    ('tool (deleted)', True, True),     # upgraded while it runs: the directory of the path without the suffix
])
def test_the_executables_directories_are_those_of_its_own_root(tmp_path, name, writable, verdict):
    """/proc/PID/root names the process's root: the directories of its executable are looked up there."""
    target = tmp_path / 'host' / 'lib' / 'gpufleet' / name
    target.parent.mkdir(parents=True)
    shutil.copy('/bin/true', str(target))
    jail = tmp_path / 'jail'
    inside = str(jail) + str(target.parent)          # the same directories, inside the process's root
    os.makedirs(inside)
    for path in [str(jail)] + [str(jail) + str(p) for p in target.parent.parents if str(p) != '/'] + [inside]:
        os.chmod(path, 0o755)
    if writable:
        os.chmod(inside, 0o777)
    tree = ProcTree(tmp_path / 'proc')
    pid = h.unused_pid()
    tree.add(pid)
    os.symlink(str(target), os.path.join(tree.root, str(pid), 'exe'))
    os.symlink(str(jail), os.path.join(tree.root, str(pid), 'root'))
    exe = I.read_exe_identity(pid, tree.root)
    assert (exe.path, exe.deleted, exe.uid, exe.dir_writable) == (str(target), name.endswith(' (deleted)'), 0, verdict)


def test_an_owner_that_cannot_be_read_twice_is_unknown_and_read_no_more(tmp_path, monkeypatch):
    tree = ProcTree(tmp_path)
    tree.add(4242)
    real = I.read_bytes
    reads = []

    def failing(path, limit=None):
        if path.endswith('/status'):
            reads.append(limit)
            raise OSError(5, 'Input/output error')
        return real(path, limit)

    monkeypatch.setattr(I, 'read_bytes', failing)
    ident, _extra = I.read_identity(4242, tree.root)
    assert ident.uids is None and reads == [I.STATUS_LIMIT, I.STATUS_LIMIT]


def test_a_status_is_read_only_up_to_its_bound(tmp_path):
    """A Uid: line past the first 64 KiB of /proc/PID/status is not read (the kernel's is a few hundred bytes)."""
    tree = ProcTree(tmp_path)
    tree.add(4242)
    with open(os.path.join(tree.root, '4242', 'status'), 'wb') as handle:
        handle.write(b'Name:\ttrain\n' + b'X' * I.STATUS_LIMIT + b'\nUid:\t1001\t1001\t1001\t1001\n')
    assert I.read_identity(4242, tree.root)[0].uids is None


@pytest.mark.skipif(os.geteuid() != 0, reason='only a root-owned login.defs counts (root)')
def test_the_system_uid_boundary_file_is_read_as_far_as_its_bound_and_no_further(tmp_path, monkeypatch):
    def defs(name, data, mode=0o644):
        return _login_defs(tmp_path, name, data, mode)

    pad = b'#' * 99 + b'\n'
    limit = 1024 * 1024
    # past the first 64 KiB read, and with more after it: every read is kept
    assert I.system_uid_max(defs('late', pad * 700 + b'SYS_UID_MAX 500\n' + pad * 1000)) == 500
    # a line that starts 4 bytes before the 1 MiB bound is cut there: not read
    head = pad * ((limit - 4) // 100) + b'#' * ((limit - 4) % 100 - 1) + b'\n'
    assert len(head) == limit - 4
    assert I.system_uid_max(defs('past', head + b'SYS_UID_MAX 500\n' + pad)) == 999
    assert I.system_uid_max(defs('zero', b'SYS_UID_MAX 0\n')) == 0
    assert I.system_uid_max(defs('others-x', b'SYS_UID_MAX 300\n', mode=0o645)) == 300   # others may run it, not write it
    flags = _record_open_flags(monkeypatch)
    assert I.system_uid_max(defs('flags', b'SYS_UID_MAX 400\n')) == 400
    assert flags[0] & os.O_CLOEXEC and flags[0] & os.O_NOFOLLOW
    monkeypatch.undo()

    def broken_read(_fd, _size):
        raise OSError(5, 'Input/output error')

    path = defs('unreadable', b'SYS_UID_MAX 400\n')
    monkeypatch.setattr(os, 'read', broken_read)
    assert I.system_uid_max(path) == 999   # a read error: the default


@pytest.mark.skipif(os.geteuid() != 0, reason='chowns a directory to nobody (root)')
def test_a_directory_a_user_owns_or_a_file_on_the_path_is_writable(tmp_path):
    """Owned by nobody, even at 0755, or not a directory at all (root's file where a directory should be): either
    way root does not vouch for what is below it."""
    jail = tmp_path / 'jail'
    (jail / 'usr' / 'bin').mkdir(parents=True)
    for path in (jail, jail / 'usr', jail / 'usr' / 'bin'):
        os.chmod(str(path), 0o755)
    assert I.dirs_writable('/usr/bin/tool', root=str(jail)) is False
    os.chown(str(jail / 'usr'), NOBODY, -1)
    assert I.dirs_writable('/usr/bin/tool', root=str(jail)) is True
    os.chown(str(jail / 'usr'), 0, -1)
    (jail / 'opt').write_text('a file')
    os.chmod(str(jail / 'opt'), 0o644)
    assert I.dirs_writable('/opt/tool', root=str(jail)) is True
