# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fake nvidia-smi: reset preconditions, messages and effects; persistence mode."""

import os
import pwd

import pytest

from conftest import FAKE_NVIDIA_SMI, pid_alive, run_as, wait_until

IN_USE_TAIL = 'Please first kill all processes using this device and all compute applications running in the system.'


def smi(node, *args, **kwargs):
    kwargs.setdefault('check', False)
    return node.tool(FAKE_NVIDIA_SMI, *args, **kwargs)


@pytest.fixture
def node(gpusim_node):
    gpusim_node.init('--gpus', '2')
    smi(gpusim_node, '-pm', '0', '-i', '0', check=True)
    return gpusim_node


def test_reset_refused_while_a_process_lives(node):
    pid = node.spawn('--gpu', '0', '--mib', '1000')
    proc = smi(node, '--gpu-reset', '-i', '0')
    assert proc.returncode == 255
    lines = proc.stdout.splitlines()
    assert lines[0] == 'GPU 00000000:07:00.0: In use by another client'
    assert lines[1].startswith('00000000:07:00.0 is currently being used by one or more other processes')
    assert lines[1].endswith(IN_USE_TAIL)
    assert node.gpu(0)['reset_count'] == 0
    os.kill(pid, 9)
    wait_until(lambda: not pid_alive(pid))
    node.run('leak', '--gpu', '0', '--mib', '512')
    node.run('lose', '--gpu', '0')
    node.run('set', '--gpu', '0', '--ecc-uncorrected', '2')
    proc = smi(node, '-r', '-i', '0')
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.splitlines() == ['GPU 00000000:07:00.0 was successfully reset.', 'All done.']
    gpu = node.gpu(0)
    assert gpu['leaked_mib'] == 0 and gpu['lost'] is False and gpu['ecc_uncorrected'] == 0
    assert gpu['reset_count'] == 1 and gpu['used_mib'] == 0
    assert node.show()['processes'] == []  # a reset forgets the GPU's (dead) entries
    assert smi(node, '-r', '-i', '0').returncode == 0
    assert node.gpu(0)['reset_count'] == 2
    assert node.gpu(1)['reset_count'] == 0


def test_reset_refused_while_only_a_child_lives(node):
    pid = node.spawn('--gpu', '0', '--mib', '100', '--children', '1')
    kid = node.entry(pid)['children'][0]
    os.kill(pid, 9)
    wait_until(lambda: not pid_alive(pid))
    proc = smi(node, '-r', '-i', '0')
    assert proc.returncode == 255 and 'In use by another client' in proc.stdout
    os.kill(kid, 9)
    wait_until(lambda: not pid_alive(kid))
    assert smi(node, '-r', '-i', '0').returncode == 0


def test_reset_of_another_gpu_is_not_blocked(node):
    node.spawn('--gpu', '1', '--mib', '100')
    assert smi(node, '-r', '-i', '0').returncode == 0


@pytest.mark.parametrize('ident', ['GPU-UUID', '00000000:07:00.0', '0000:07:00.0', '07:00.0'])
def test_reset_by_uuid_or_bus_id(node, ident):
    if ident == 'GPU-UUID':
        ident = node.gpu(0)['uuid']
    proc = smi(node, '--gpu-reset', '--id=%s' % ident)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert node.gpu(0)['reset_count'] == 1


def test_reset_refused_with_persistence_mode_on(node):
    proc = smi(node, '-r', '-i', '1')
    assert proc.returncode == 255
    assert 'Unable to reset GPU 00000000:0B:00.0' in proc.stdout and 'persistence mode enabled' in proc.stdout
    assert node.gpu(1)['reset_count'] == 0
    proc = smi(node, '-pm', '0', '-i', '1')
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == ['Disabled persistence mode for GPU 00000000:0B:00.0.', 'All done.']
    assert node.gpu(1)['persistence'] is False
    assert smi(node, '-r', '-i', '1').returncode == 0
    proc = smi(node, '--persistence-mode=1', '-i', '1')
    assert proc.returncode == 0 and 'Enabled Legacy persistence mode for GPU 00000000:0B:00.0.' in proc.stdout
    assert node.gpu(1)['persistence'] is True


def test_persistence_mode_all_gpus(node):
    proc = smi(node, '-pm', '1')
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == ['Enabled Legacy persistence mode for GPU 00000000:07:00.0.',
                                        'Persistence mode is already Enabled for GPU 00000000:0B:00.0.', 'All done.']


def test_unknown_device_and_other_invocations(node):
    proc = smi(node, '-r', '-i', '5')
    assert proc.returncode == 6 and 'No devices were found' in proc.stdout
    for args in ([], ['-L'], ['--query-gpu=index', '--format=csv'], ['-r']):
        proc = smi(node, *args)
        assert proc.returncode == 2, args
        assert 'gpusim fake' in proc.stderr


def test_no_driver_when_the_node_is_not_nvidia(gpusim_node):
    gpusim_node.init('--vendor', 'amd')
    proc = smi(gpusim_node, '-r', '-i', '0')
    assert proc.returncode == 9 and "couldn't communicate with the NVIDIA driver" in proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason='needs root to run the fake as another user')
def test_reset_needs_root(node):
    nobody = pwd.getpwnam('nobody')
    proc = run_as(nobody, node, FAKE_NVIDIA_SMI, '-r', '-i', '0')
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert 'GPU 00000000:07:00.0: Insufficient Permissions' in proc.stdout
    proc = run_as(nobody, node, FAKE_NVIDIA_SMI, '-pm', '1', '-i', '0')
    assert proc.returncode == 4 and 'Insufficient Permissions' in proc.stdout
    assert node.gpu(0)['reset_count'] == 0 and node.gpu(0)['persistence'] is False
