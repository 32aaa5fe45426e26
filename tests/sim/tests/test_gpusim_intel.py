"""gpusim on an Intel node: the fake sysfs and /proc/PID/fdinfo tree the Intel backend reads
($_GPUFLEET_DRM_ROOT), kept in line with the state; and the fake ioreg (Apple)."""

import os
import plistlib
import subprocess
import sys

import pytest

from conftest import SIM_DIR, wait_until

FAKE_IOREG = os.path.join(SIM_DIR, 'bin', 'ioreg')


def fdinfo_of(root, pid):
    base = os.path.join(root, 'proc', str(pid), 'fdinfo')
    names = os.listdir(base)
    assert len(names) == 1
    with open(os.path.join(base, names[0])) as f:
        return names[0], dict(line.split(':\t', 1) for line in f.read().splitlines())


def test_intel_init_lays_a_sysfs_tree_and_env_exports_its_root(gpusim_node):
    gpusim_node.init('--gpus', '2', '--vendor', 'intel')
    state = gpusim_node.show()
    root = state['drm_root']
    assert state['intel_driver'] == 'xe' and root == os.path.join(gpusim_node.root, 'state-drm')
    assert os.path.isfile(os.path.join(gpusim_node.dev_dir, 'dri', 'renderD129'))
    card = os.path.join(root, 'sys', 'class', 'drm', 'card1', 'device')
    assert os.path.basename(os.path.realpath(card)) == '0000:0b:00.0'
    with open(os.path.join(card, 'vendor')) as f:
        assert f.read() == '0x8086\n'
    assert os.path.basename(os.readlink(os.path.join(card, 'driver'))) == 'xe'
    sizes = []
    for tile in ('tile0', 'tile1'):
        with open(os.path.join(card, tile, 'physical_vram_size_bytes')) as f:
            sizes.append(int(f.read()))
    assert sum(sizes) == state['gpus'][1]['memory_total_mib'] * 1048576
    env = gpusim_node.run('env').stdout
    assert 'export _GPUFLEET_DRM_ROOT=%s' % root in env
    # a second init replaces the tree (fewer GPUs), and never touches a directory gpusim did not make
    gpusim_node.init('--gpus', '1', '--vendor', 'intel', '--intel-driver', 'i915')
    assert not os.path.exists(os.path.join(root, 'sys', 'class', 'drm', 'card1'))
    assert os.path.basename(os.readlink(os.path.join(root, 'sys', 'class', 'drm', 'card0', 'device', 'driver'))) == 'i915'
    foreign = os.path.join(gpusim_node.root, 'foreign')
    os.makedirs(os.path.join(foreign, 'keep'))
    proc = gpusim_node.run('init', '--vendor', 'intel', '--drm-root', foreign, check=False)
    assert proc.returncode == 1 and 'not made by gpusim' in proc.stderr and os.path.isdir(os.path.join(foreign, 'keep'))


def test_intel_fdinfo_follows_spawns_children_and_deaths(gpusim_node):
    gpusim_node.init('--gpus', '2', '--vendor', 'intel')
    root = gpusim_node.show()['drm_root']
    pid = gpusim_node.spawn('--gpu', '1', '--mib', '3000', '--util', '50', '--children', '1')
    child = gpusim_node.entry(pid)['children'][0]
    fd, info = fdinfo_of(root, pid)
    assert info['drm-driver'] == 'xe' and info['drm-pdev'] == '0000:0b:00.0' and info['drm-client-id'] == str(pid)
    assert info['drm-resident-vram0'] == '3000 MiB' and info['drm-engine-capacity-ccs'] == '4'
    assert os.readlink(os.path.join('/proc', str(pid), 'fd', fd)) == os.path.join(gpusim_node.dev_dir, 'dri', 'renderD129')
    assert os.readlink(os.path.join(root, 'proc', str(pid), 'fd')) == '/proc/%d/fd' % pid
    child_fd, child_info = fdinfo_of(root, child)
    assert (child_fd, child_info['drm-client-id']) == (fd, str(pid))  # the inherited fd: the same client
    null = gpusim_node.spawn('--gpu', '0', '--mib-null')
    assert 'drm-resident-vram0' not in fdinfo_of(root, null)[1]
    os.kill(pid, 9)
    wait_until(lambda: not gpusim_node.entry(pid)['alive'])
    gpusim_node.run('show')  # any gpusim command refreshes the tree
    assert not os.path.exists(os.path.join(root, 'proc', str(pid)))
    assert os.path.isdir(os.path.join(root, 'proc', str(child)))
    gpusim_node.run('kill-all')
    assert sorted(os.listdir(os.path.join(root, 'proc'))) == ['sys']


def test_i915_fdinfo_has_engine_time_and_local_memory(gpusim_node):
    gpusim_node.init('--gpus', '1', '--vendor', 'intel', '--intel-driver', 'i915', '--model', 'Intel(R) Arc(TM) A770 Graphics')
    root = gpusim_node.show()['drm_root']
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '512', '--util', '100')
    info = fdinfo_of(root, pid)[1]
    assert info['drm-driver'] == 'i915' and info['drm-resident-local0'] == '512 MiB'
    assert info['drm-engine-render'].endswith(' ns') and info['drm-engine-capacity-video'] == '2'
    with open(os.path.join(root, 'sys', 'class', 'drm', 'card0', 'device', 'device')) as f:
        assert f.read() == '0x56a0\n'
    with open(os.path.join(root, 'usr', 'share', 'misc', 'pci.ids')) as f:
        assert '\t56a0  Arc(TM) A770 Graphics\n' in f.read()


def test_other_vendors_have_no_drm_tree(gpusim_node):
    gpusim_node.init('--gpus', '1', '--vendor', 'amd')
    assert 'drm_root' not in gpusim_node.raw() and '_GPUFLEET_DRM_ROOT' not in gpusim_node.run('env').stdout


def run_ioreg(*args, **env):
    return subprocess.run([sys.executable, FAKE_IOREG] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(os.environ, **env), check=False)


def test_fake_ioreg_serves_the_recorded_plist():
    proc = run_ioreg('-r', '-d', '2', '-w', '0', '-c', 'IOAccelerator', '-a')
    assert proc.returncode == 0
    (acc,) = plistlib.loads(proc.stdout)
    assert acc['model'] == 'Apple M2 Max' and 'Device Utilization %' in acc['PerformanceStatistics']
    assert any('IOUserClientCreator' in c for c in acc['IORegistryEntryChildren'])
    (shallow,) = plistlib.loads(run_ioreg('-r', '-d', '1', '-c', 'IOAccelerator', '-a').stdout)
    assert 'IORegistryEntryChildren' not in shallow
    assert run_ioreg('-r', '-c', 'IOUSBDevice', '-a').stdout == b''
    assert run_ioreg('-l').returncode == 2
    failed = run_ioreg('-r', '-c', 'IOAccelerator', '-a', GPUSIM_IOREG_FAIL='ioreg: Operation not permitted')
    assert failed.returncode == 1 and failed.stderr == b'ioreg: Operation not permitted\n'


@pytest.mark.parametrize('path', [FAKE_IOREG])
def test_fake_ioreg_shebang(path):
    with open(path, 'rb') as f:
        assert f.readline() == b'#!/usr/bin/env python\n'
    assert os.access(path, os.X_OK)
