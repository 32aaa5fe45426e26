# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fake amd-smi: `amd-smi reset --gpureset -g ID`, with amd-smi's output shape."""

import os
import pwd

import pytest

from conftest import FAKE_AMD_SMI, pid_alive, run_as, wait_until


def amd_smi(node, *args, **kwargs):
    kwargs.setdefault('check', False)
    return node.tool(FAKE_AMD_SMI, *args, **kwargs)


@pytest.fixture
def node(gpusim_node):
    gpusim_node.init('--gpus', '2', '--vendor', 'amd')
    return gpusim_node


def test_reset_refused_while_a_process_lives_then_succeeds(node):
    pid = node.spawn('--gpu', '0', '--mib', '1000', '--children', '1')
    kid = node.entry(pid)['children'][0]
    proc = amd_smi(node, 'reset', '--gpureset', '-g', '0')
    assert proc.returncode == 0  # amd-smi reports a failed reset in its output, not its exit code
    assert proc.stdout.strip().splitlines() == ['GPU: 0', '    GPU_RESET: Failed to reset GPU']
    os.kill(pid, 9)
    wait_until(lambda: not pid_alive(pid))
    assert 'Failed to reset GPU' in amd_smi(node, 'reset', '-G', '-g', '0').stdout  # the child still holds it
    os.kill(kid, 9)
    wait_until(lambda: not pid_alive(kid))
    node.run('leak', '--gpu', '0', '--mib', '64')
    node.run('lose', '--gpu', '0')
    proc = amd_smi(node, 'reset', '--gpureset', '-g', '0')
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == ['GPU: 0', '    GPU_RESET: Successfully reset GPU']
    gpu = node.gpu(0)
    assert gpu['leaked_mib'] == 0 and gpu['lost'] is False and gpu['reset_count'] == 1


def test_reset_several_gpus_by_index_bdf_and_uuid(node):
    node.spawn('--gpu', '1', '--mib', '10')
    proc = amd_smi(node, 'reset', '-G', '-g', '0000:07:00.0', node.gpu(1)['uuid'])
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == ['GPU: 0', '    GPU_RESET: Successfully reset GPU', '',
                                                'GPU: 1', '    GPU_RESET: Failed to reset GPU']
    assert [g['reset_count'] for g in node.show()['gpus']] == [1, 0]


def test_unknown_gpu_and_unsupported_commands(node):
    proc = amd_smi(node, 'reset', '-G', '-g', '7')
    assert "Can not find a device: GPU '7'" in proc.stdout
    for args in ([], ['metric'], ['reset', '-g', '0'], ['static', '--asic']):
        proc = amd_smi(node, *args)
        assert proc.returncode == 2 and 'gpusim fake' in proc.stderr, args


def test_not_an_amd_node(gpusim_node):
    gpusim_node.init()
    proc = amd_smi(gpusim_node, 'reset', '-G', '-g', '0')
    assert proc.returncode == 1 and 'Unable to detect any GPU devices' in proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason='needs root to run the fake as another user')
def test_reset_needs_root(node):
    proc = run_as(pwd.getpwnam('nobody'), node, FAKE_AMD_SMI, 'reset', '--gpureset', '-g', '0')
    assert proc.returncode == 1
    assert 'PermissionError: Command requires elevation' in proc.stderr
    assert node.gpu(0)['reset_count'] == 0
