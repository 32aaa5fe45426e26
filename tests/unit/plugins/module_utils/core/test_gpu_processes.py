# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.processes: cgroup parsing, /proc parsing, the fd scan and the inventory (no GPU needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import fdwalk, processes as P
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

CID = '3f4e1a9c0b2d4e6f8a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f'
POD = '6f1c3c2a-7d1e-4a53-9a3b-2f7c8d9e0a1b'

CGROUP_CASES = [
    # (name, /proc/PID/cgroup text, container id, runtime, pod uid, slurm job)
    ('docker-v1', '12:memory:/docker/%s\n11:cpu,cpuacct:/docker/%s\n1:name=systemd:/docker/%s\n' % (CID, CID, CID),
     CID, 'docker', None, None),
    ('docker-v2-systemd', '0::/system.slice/docker-%s.scope\n' % CID, CID, 'docker', None, None),
    ('k8s-containerd-v2-systemd',
     '0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod%s.slice/cri-containerd-%s.scope\n'
     % (POD.replace('-', '_'), CID), CID, 'containerd', POD, None),
    ('k8s-besteffort-crio-v2', '0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod%s.slice/crio-%s.scope\n'
     % (POD.replace('-', '_'), CID), CID, 'cri-o', POD, None),
    ('k8s-cgroupfs-v1', '11:devices:/kubepods/burstable/pod%s/%s\n4:memory:/kubepods/burstable/pod%s/%s\n'
     % (POD, CID, POD, CID), CID, None, POD, None),
    ('k8s-guaranteed-v1', '3:cpuset:/kubepods/pod%s/%s\n' % (POD, CID), CID, None, POD, None),
    # rootless podman: the user's own systemd manager made that cgroup, so it names nothing (issue #15)
    ('podman-rootless-v2', '0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-%s.scope/container\n' % CID,
     None, None, None, None),
    ('podman-v2', '0::/machine.slice/libpod-%s.scope/container\n' % CID, CID, 'podman', None, None),
    ('nerdctl-v2', '0::/system.slice/nerdctl-%s.scope\n' % CID, CID, 'containerd', None, None),
    ('slurm-v1', '10:devices:/slurm/uid_1000/job_4242/step_0/task_0\n4:memory:/slurm/uid_1000/job_4242/step_0\n',
     None, None, None, '4242'),
    ('slurm-v2', '0::/system.slice/slurmstepd.scope/job_777/step_batch/user/task_0\n', None, None, None, '777'),
    ('host-v2', '0::/user.slice/user-0.slice/session-3.scope\n', None, None, None, None),
    ('host-v1', '12:pids:/user.slice\n1:name=systemd:/init.scope\n', None, None, None, None),
    ('empty', '', None, None, None, None),
]


@pytest.mark.parametrize('name,text,cid,runtime,pod,job', CGROUP_CASES, ids=[c[0] for c in CGROUP_CASES])
def test_parse_cgroup(name, text, cid, runtime, pod, job):
    container, slurm = P.parse_cgroup(text)
    assert slurm == job, name
    if cid is None and pod is None:
        assert container is None
    else:
        assert container.to_dict() == {'id': cid, 'runtime': runtime, 'pod_uid': pod}


def test_parse_stat_with_odd_command_names():
    line = '4242 (my (evil) prog) S 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615'
    parsed = P.parse_stat(line)
    assert {k: parsed[k] for k in ('comm', 'state', 'ppid', 'starttime')} == {'comm': 'my (evil) prog', 'state': 'S', 'ppid': 17, 'starttime': 987654}
    with pytest.raises(ValueError):
        P.parse_stat('garbage')


def test_read_starttime_of_self_and_of_nothing():
    assert P.read_starttime(os.getpid()) == h.starttime(os.getpid())
    assert P.read_starttime(h.unused_pid()) is None


@pytest.mark.parametrize('target,expected', [
    ('/dev/nvidia0', True), ('/dev/nvidia15', True), ('/dev/nvidiactl', True), ('/dev/nvidia-uvm', True),
    ('/dev/nvidia-uvm-tools', True), ('/dev/nvidia-modeset', True), ('/dev/nvidia-caps/nvidia-cap1', True),
    ('/dev/dri/renderD128', True), ('/dev/dri/card0', True), ('/dev/kfd', True),
    ('/dev/null', False), ('/dev/nvidia0 (deleted)', False), ('/dev/dri/by-path/x', False), ('/tmp/dev/nvidia0', False),
    ('socket:[1234]', False), ('/dev/nvidiafoo', False), ('/dev/nvme0n1', False),
])
def test_match_device(target, expected):
    assert (P.match_device(target) is not None) is expected


def test_match_device_extra_roots_and_device_keys():
    roots = ['/dev', '/tmp/x/dev/']
    assert P.match_device('/tmp/x/dev/nvidia3', roots) == '/tmp/x/dev/nvidia3'
    assert P.device_key('/tmp/x/dev/nvidia3', roots) == ('nvidia', 3)
    assert P.device_key('/dev/dri/renderD130', roots) == ('renderD', 130)
    assert P.device_key('/dev/dri/card1', roots) == ('card', 1)
    assert P.device_key('/dev/nvidiactl', roots) is None
    assert P.device_key('/dev/kfd', roots) is None


@pytest.fixture
def fake_proc():
    """A fixture /proc tree: pids with stat, status, cmdline, cgroup and fd symlinks."""
    root = h.tempdir()
    proc = os.path.join(root, 'proc')

    def add(pid, comm='python', state='S', ppid=1, start=5000, uid=0, cmdline=('python', 'train.py'), cgroup='0::/\n',
            fds=None, fd_dir=True):
        base = os.path.join(proc, str(pid))
        os.makedirs(base)
        with open(os.path.join(base, 'stat'), 'w') as handle:
            handle.write('%d (%s) %s %d 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 100 10\n' % (pid, comm, state, ppid, start))
        with open(os.path.join(base, 'status'), 'w') as handle:
            handle.write('Name:\t%s\nUid:\t%d\t%d\t%d\t%d\n' % (comm, uid, uid, uid, uid))
        with open(os.path.join(base, 'cmdline'), 'w') as handle:
            handle.write('\0'.join(cmdline) + ('\0' if cmdline else ''))
        with open(os.path.join(base, 'cgroup'), 'w') as handle:
            handle.write(cgroup)
        if fd_dir:
            os.makedirs(os.path.join(base, 'fd'))
            for number, target in enumerate(fds or []):
                os.symlink(target, os.path.join(base, 'fd', str(number)))

    os.makedirs(proc)
    with open(os.path.join(proc, 'stat'), 'w') as handle:
        handle.write('cpu 1 2 3\nbtime 1700000000\n')
    add.proc = proc
    yield add
    shutil.rmtree(root, ignore_errors=True)


def test_inventory_from_a_fixture_proc_tree(fake_proc, tmp_path):
    fake_proc(100, fds=['/dev/nvidia0', '/dev/nvidiactl', '/dev/null', 'pipe:[1]'],
              cgroup='0::/system.slice/docker-%s.scope\n' % CID)
    fake_proc(101, comm='worker', ppid=100, fds=['/dev/nvidia0'], cgroup='0::/slurm/uid_0/job_99/step_0\n')
    fake_proc(102, comm='bash', fds=['/dev/pts/0'])
    fake_proc(103, comm='zombie', state='Z', fds=[], cmdline=())
    fake_proc(104, comm='nvidia-smi', fds=['/dev/nvidiactl'])
    # no cgroup file system there: only the structural rule applies (test_cgroup_trust.py tests the owners)
    inv = P.ProcessInventory(proc_root=fake_proc.proc, exclude_pids=[104], cgroup_root=str(tmp_path / 'none'))
    assert inv.use_psutil is False
    result = inv.scan([100, 103, 555])
    assert result.fd_holders == {100: ['/dev/nvidia0', '/dev/nvidiactl'], 101: ['/dev/nvidia0']}
    rec = result.record(100)
    assert (rec.name, rec.status, rec.ppid, rec.uid, rec.user, rec.starttime) == ('python', 'sleeping', 1, 0, 'root', 5000)
    assert rec.cmdline == ['python', 'train.py']
    assert rec.create_time == pytest.approx(1700000000 + 5000 / float(os.sysconf('SC_CLK_TCK')), abs=0.01)
    assert rec.container.to_dict() == {'id': CID, 'runtime': 'docker', 'pod_uid': None}
    assert rec.device_paths == ['/dev/nvidia0', '/dev/nvidiactl']
    assert result.record(103).status == 'zombie' and result.record(103).cmdline == []
    assert result.record(103).device_paths == []
    assert result.record(555).status == 'not_found' and not result.record(555).found
    holders = result.holders(listed_pids=[100])
    assert [x.pid for x in holders] == [101]
    assert holders[0].slurm_job == '99' and holders[0].name == 'worker' and holders[0].ppid == 100
    assert holders[0].to_dict() == {'pid': 101, 'user': 'root', 'name': 'worker', 'cmdline': ['python', 'train.py'],
                                    'devices': ['/dev/nvidia0']}


@pytest.mark.parametrize('counted', [None, False], ids=['as-detected', 'listing-only'])
def test_fd_walk_on_the_real_proc_finds_holders_with_and_without_gaps_in_fd_numbers(tmp_path, monkeypatch, counted):
    """The counted walk (Linux 6.2+: the fd directory's size is the number of open fds) reads fds
    0..N-1 without listing; a process with a gap in its fd numbers must still be read in full."""
    if not os.path.isdir('/proc/self/fd'):
        pytest.skip('no procfs')
    if counted is not None:
        monkeypatch.setattr(fdwalk, 'fd_dirs_report_counts', lambda proc_root='/proc': counted)
    dev = tmp_path / 'dev'
    (dev / 'dri').mkdir(parents=True)
    for name in ('nvidia0', 'dri/renderD128', 'kfd', 'other'):
        (dev / name).write_text('')
    children = []
    try:
        with open(str(dev / 'nvidia0')) as stdin:  # fds 0, 1 and 2 only: no gap
            children.append(subprocess.Popen(['sleep', '60'], stdin=stdin, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))
        # fds 0, 1, 2, 7 and 9: the walk cannot read 3 and must list the directory
        script = 'exec 7<"$1/dri/renderD128" 9<"$1/kfd" 5<"$1/other"; exec 5<&-; exec sleep 60'
        children.append(subprocess.Popen(['sh', '-c', script, 'sh', str(dev)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        first, second = children[0].pid, children[1].pid
        expected = {first: [str(dev / 'nvidia0')], second: sorted([str(dev / 'dri/renderD128'), str(dev / 'kfd')])}
        for _attempt in range(200):  # until sh has exec'd sleep with its fds in place
            holders, readable, _denied = P.scan_device_fds('/proc', [str(dev)], pids=[first, second])
            if holders == expected:
                break
            children[1].poll()
            subprocess.run(['sleep', '0.01'], check=False)
        assert holders == expected and {first, second} <= readable
        everyone = P.scan_device_fds('/proc', [str(dev)], exclude=[os.getpid()])[0]
        assert everyone.get(first) == expected[first] and everyone.get(second) == expected[second]
    finally:
        for child in children:  # only the processes this test started
            child.kill()
            child.wait()


def test_fd_walk_reads_past_a_few_gaps_without_listing(tmp_path, monkeypatch):
    """A GPU process's fds with a gap (0-3 and 5: a closed set-up fd) are read on past the gap, without
    listing the directory; an fd far past the last one (40) is found by the listing."""
    if not os.path.isdir('/proc/self/fd') or not fdwalk.fd_dirs_report_counts():
        pytest.skip('procfs without fd counts (Linux < 6.2)')
    dev = tmp_path / 'dev'
    dev.mkdir()
    for name in ('nvidia0', 'nvidia1', 'nvidiactl', 'other'):
        (dev / name).write_text('')
    listed, real_list = [], fdwalk._list_fds

    def list_fds(path, limit):
        listed.append(path)
        return real_list(path, limit)
    children = []
    try:
        # fds 0-3 and 5 (4 closed); fds 0-3 and 40 (sh has no two-digit fds: python's dup2, then sleep)
        far_code = ('import os, sys; os.set_inheritable(os.open(sys.argv[1] + "/nvidiactl", os.O_RDONLY), True); '
                    'os.dup2(os.open(sys.argv[1] + "/nvidia1", os.O_RDONLY), 40); os.execvp("sleep", ["sleep", "60"])')
        for argv in (['sh', '-c', 'exec 3<"$1/nvidiactl" 4<"$1/other" 5<"$1/nvidia0"; exec 4<&-; exec sleep 60', 'sh', str(dev)],
                     [sys.executable, '-c', far_code, str(dev)]):
            children.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        near, far = children[0].pid, children[1].pid
        expected = {near: sorted([str(dev / 'nvidiactl'), str(dev / 'nvidia0')]), far: sorted([str(dev / 'nvidiactl'), str(dev / 'nvidia1')])}
        deadline = time.monotonic() + 60   # bounded; a loaded machine can take seconds to start the interpreter
        while True:  # until both have exec'd sleep with their fds in place (before that, python's own fds are open)
            holders, readable, _denied = P.scan_device_fds('/proc', [str(dev)], pids=[near, far])
            execd = all(P.read_cmdline(pid) == ['sleep', '60'] for pid in (near, far))
            # the new command line shows a moment before exec has closed the close-on-exec fds (python's fd 4)
            execd = execd and sorted(os.listdir('/proc/%d/fd' % far), key=int) == ['0', '1', '2', '3', '40']
            if (holders == expected and execd) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert execd and holders == expected and {near, far} <= readable
        monkeypatch.setattr(fdwalk, '_list_fds', list_fds)
        walked = dict((pid, names) for pid, names, _targets, _complete in fdwalk.walk_fd_links('/proc', [near, far]))
        assert list(walked[near]) == ['0', '1', '2', '3', '5'] and sorted(walked[far], key=int) == ['0', '1', '2', '3', '40']
        assert listed == ['/proc/%d/fd' % far]
    finally:
        for child in children:  # only the processes this test started
            child.kill()
            child.wait()


def test_unreadable_fd_dirs_are_counted(fake_proc):
    fake_proc(200, fds=['/dev/nvidia0'])
    fake_proc(201, fd_dir=False)  # stands in for a process that vanished mid-scan
    os.makedirs(os.path.join(fake_proc.proc, 'self'))  # not a pid: ignored
    holders, readable, denied = P.scan_device_fds(fake_proc.proc)
    assert holders == {200: ['/dev/nvidia0']} and readable == {200} and denied == 0
    assert P.scan_device_fds(os.path.join(fake_proc.proc, 'nope')) == ({}, set(), 0)


def test_live_holders_in_a_temp_dev_root():
    root = h.tempdir()
    dev = h.make_dev_dir(os.path.join(root, 'dev'), minors=(0,))
    kids = h.Children()
    try:
        holder = kids.sleeper([os.path.join(dev, 'nvidia0'), os.path.join(dev, 'nvidia-uvm')])
        bystander = kids.sleeper()
        # this process also holds a device file: it must never report itself
        with open(os.path.join(dev, 'nvidiactl')):
            inv = P.ProcessInventory(dev_roots=[dev])
            result = inv.scan([bystander.pid, h.unused_pid()])
        assert os.getpid() not in result.fd_holders
        assert result.fd_holders[holder.pid] == sorted([os.path.join(dev, 'nvidia0'), os.path.join(dev, 'nvidia-uvm')])
        assert [x.pid for x in result.holders()] == [holder.pid]
        rec = result.record(bystander.pid)
        assert rec.name == 'sleep' and rec.cmdline == ['sleep', '600'] and rec.ppid == os.getpid()
        assert rec.device_paths == [] and rec.starttime == h.starttime(bystander.pid)
        assert result.record(h.unused_pid()).status == 'not_found'
        # the /proc reader and psutil agree on a live process
        if P.HAS_PSUTIL:
            via_proc = P.ProcessInventory(dev_roots=[dev], use_psutil=False).record(bystander.pid)
            via_psutil = P.ProcessInventory(dev_roots=[dev], use_psutil=True).record(bystander.pid)
            for name in ('pid', 'status', 'user', 'uid', 'name', 'cmdline', 'ppid', 'exe', 'starttime'):
                assert getattr(via_proc, name) == getattr(via_psutil, name), name
            assert via_proc.create_time == pytest.approx(via_psutil.create_time, abs=1.0)
        # a holder that exits after the scan is dropped, not reported with empty fields
        holder.kill()
        holder.wait()
        assert result.holders() != [] and P.ProcessInventory(dev_roots=[dev]).scan().holders() == []
    finally:
        kids.close()
        shutil.rmtree(root, ignore_errors=True)


def test_holder_that_exits_between_scan_and_record(monkeypatch):
    inv = P.ProcessInventory(dev_roots=['/nonexistent'])
    monkeypatch.setattr(P, 'scan_device_fds', lambda *a: ({h.unused_pid(): ['/dev/nvidia0']}, set(), 0))
    result = inv.scan()
    assert result.holders() == []
