# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""`gpusim spawn -- python3 train.py` runs the real interpreter (issue #18), and the driver daemon registers a
non-root user's own workload (a Slurm job's) and nothing else.

Tests only signal pids gpusim printed or recorded in their own state (the gpusim_node fixture), and the driver
daemon this test started (by its Popen pid)."""

import os
import pwd
import re
import subprocess
import sys

import pytest

from conftest import GPUSIM, pid_alive, run_as, wait_until

DRIVERD = os.path.join(os.path.dirname(GPUSIM), 'gpusim_driverd.py')


def test_python3_train_py_is_the_real_interpreter_holding_the_gpu(gpusim_node):
    gpusim_node.init('--gpus', '2')
    pid = gpusim_node.spawn('--gpu', '1', '--mib', '2048', '--children', '1', argv=['python3', 'train.py'])
    exe = os.path.realpath('/proc/%d/exe' % pid)
    assert re.match(r'python3(\.\d+)?$', os.path.basename(exe)) and not exe.endswith('gpusim-workload'), exe
    with open('/proc/%d/cmdline' % pid, 'rb') as handle:
        assert handle.read().split(b'\0')[:-1] == [b'python3', b'train.py']
    assert os.readlink('/proc/%d/cwd' % pid) == os.path.dirname(GPUSIM)  # train.py is the shipped script
    fds = [os.readlink('/proc/%d/fd/%s' % (pid, fd)) for fd in os.listdir('/proc/%d/fd' % pid)]
    assert os.path.join(gpusim_node.dev_dir, 'nvidia1') in fds and os.path.join(gpusim_node.dev_dir, 'nvidiactl') in fds
    entry = gpusim_node.entry(pid)
    assert entry['argv'] == ['python3', 'train.py'] and entry['counted_mib'] == 2048 and len(entry['children']) == 1
    kid = entry['children'][0]
    assert os.getsid(kid) == kid  # detached: a session of its own
    os.kill(pid, 9)  # the parent dies; the detached child keeps the memory
    wait_until(lambda: not pid_alive(pid, entry['starttime']), timeout=10)
    assert pid_alive(kid) and gpusim_node.gpu(1)['used_mib'] == 2048
    # another python command keeps the C workload
    other = gpusim_node.spawn('--gpu', '0', '--mib', '64', argv=['python3', 'serve.py'])
    assert os.path.realpath('/proc/%d/exe' % other).endswith('gpusim-workload')


def test_a_missing_interpreter_is_a_clear_error(gpusim_node):
    gpusim_node.init('--gpus', '1')
    proc = gpusim_node.run('spawn', '--gpu', '0', '--mib', '1', '--', '/nonexistent/python3', 'train.py', check=False)
    assert proc.returncode == 1 and '/nonexistent/python3: no such interpreter' in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason='the driver daemon and --user need root')
def test_driver_daemon_registers_a_users_own_workload_only(gpusim_node):
    try:
        nobody = pwd.getpwnam('nobody')
    except KeyError:
        pytest.skip('no user nobody here')
    gpusim_node.init('--gpus', '2')
    daemon = subprocess.Popen([sys.executable, DRIVERD, '--state', gpusim_node.state], stdin=subprocess.DEVNULL)
    try:
        sock = os.path.join(os.path.dirname(gpusim_node.state), 'driver.sock')
        wait_until(lambda: os.path.exists(sock), timeout=10)
        proc = run_as(nobody, gpusim_node, GPUSIM, 'spawn', '--gpu', '1', '--mib', '512', '--', 'python3', 'train.py')
        if proc.returncode != 0 and 'no such interpreter' in proc.stderr:
            pytest.skip('no python3 that nobody may execute on PATH')
        assert proc.returncode == 0, proc.stderr
        entry = gpusim_node.entry(int(proc.stdout))
        assert entry['user'] == 'nobody' and entry['counted_mib'] == 512 and os.stat('/proc/%d' % entry['pid']).st_uid == nobody.pw_uid
        # a forged request (someone else's process, here this test's own) is refused, and nothing is recorded
        me = os.getpid()
        with open('/proc/%d/stat' % me, 'rb') as handle:
            start = int(handle.read().rsplit(b')', 1)[1].split()[19])
        forged = ('import sys; sys.path.insert(0, %r); import gpusim_driverd as d\n'
                  'd.request(%r, {"op": "register", "entry": {"pid": %d, "starttime": %d, "gpu": 0, "used_mib": 1}})'
                  % (os.path.dirname(GPUSIM), gpusim_node.state, me, start))
        refused = run_as(nobody, gpusim_node, '-c', forged)
        assert refused.returncode != 0 and 'refused' in refused.stderr, refused.stderr
        assert [p['pid'] for p in gpusim_node.show()['processes']] == [entry['pid']]
    finally:
        daemon.kill()
        daemon.wait(timeout=10)
