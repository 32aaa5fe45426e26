# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpu_facts main(): arguments, results, check mode and failures (the simulator where needed)."""

from __future__ import annotations

import os
import shutil

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils import gpu_module
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_facts
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

needs_sim = pytest.mark.skipif(h.sim_build() is None,
                               reason='simulator not built: run `make sim` (tests/sim/build/libnvidia-ml.so.1 missing)')


@pytest.fixture(autouse=True)
def module_exits(monkeypatch):
    h.patch_module_exits(monkeypatch)
    monkeypatch.delenv('GPU_SIM_STATE', raising=False)


def run_module(args, check_mode=False):
    """main() with ``args``; returns the result dict (``failed`` set when it failed)."""
    return h.run_main(gpu_facts.main, args, check_mode=check_mode)


@pytest.fixture
def sim():
    """A simulated 2-GPU node with one job on GPU 0 and leaked memory on GPU 1, loaded in-process."""
    root = h.tempdir()
    kids = h.Children()
    dev = h.make_dev_dir(os.path.join(root, 'dev'))
    job = kids.sleeper([os.path.join(dev, 'nvidia0')])
    state = h.make_state(gpus=2, dev_dir=dev, processes=[h.make_process(job.pid, 0, 2048)])
    state['gpus'][1]['leaked_mib'] = 512
    path = os.path.join(root, 'state.json')
    h.write_state(path, state)
    try:
        with h.shim_in_process(path):
            yield job
    finally:
        kids.close()
        shutil.rmtree(root, ignore_errors=True)


def test_host_without_gpus_succeeds_with_reasons():
    result = run_module({})
    assert result['changed'] is False and not result.get('failed')
    gpu = result['ansible_facts']['gpu']
    assert gpu['devices'] == [] and gpu['processes'] == []
    assert set(gpu['backends']) == {'nvidia', 'amd', 'intel', 'apple'}
    for status in gpu['backends'].values():
        assert status['available'] is False and status['error']


def test_fail_on_no_gpu_names_each_backend():
    result = run_module({'fail_on_no_gpu': True, 'vendor': 'nvidia'})
    assert result['failed'] is True
    assert result['msg'].startswith('No GPU found on this host (nvidia: ')
    assert 'amd: not requested (vendor=nvidia)' in result['msg']
    assert result['ansible_facts']['gpu']['devices'] == []


def test_missing_psutil_fails_with_missing_required_lib(monkeypatch):
    monkeypatch.setattr(gpu_module, 'psutil_error', lambda: 'Traceback: No module named psutil')
    result = run_module({})
    assert result['failed'] is True and 'psutil' in result['msg'] and 'Failed to import' in result['msg']
    assert result['exception'] == 'Traceback: No module named psutil'


def test_invalid_vendor_is_rejected_by_the_argument_spec():
    result = run_module({'vendor': 'matrox'})
    assert result['failed'] is True and 'vendor' in result['msg']


def test_argument_spec_matches_the_documented_options():
    spec = gpu_facts.argument_spec()
    assert spec['vendor']['choices'] == ['auto', 'nvidia', 'amd', 'intel', 'apple']
    assert set(spec) == {'vendor', 'gather_processes', 'gpus', 'fail_on_no_gpu', 'driver_timeout'}  # driver_timeout: issue #17


@needs_sim
def test_facts_from_the_simulator(sim):
    result = run_module({})
    assert result['changed'] is False
    gpu = result['ansible_facts']['gpu']
    assert gpu['backends']['nvidia'] == {'available': True, 'version': '550.54.15', 'error': None}
    gpu0, gpu1 = gpu['devices']
    assert (gpu0['memory_used_mib'], gpu0['orphaned_mib'], gpu0['processes']) == (2048, 0, [sim.pid])
    assert (gpu1['memory_used_mib'], gpu1['orphaned_mib'], gpu1['processes']) == (512, 512, [])
    proc = gpu['processes'][0]
    assert (proc['pid'], proc['name'], proc['gpu_indexes'], proc['used_mib']) == (sim.pid, 'sleep', [0], 2048)


@needs_sim
def test_check_mode_reports_the_same_facts(sim):
    normal = run_module({'gpus': ['1']})
    checked = run_module({'gpus': ['1']}, check_mode=True)
    assert checked['changed'] is False
    assert checked['ansible_facts'] == normal['ansible_facts']
    assert [d['index'] for d in checked['ansible_facts']['gpu']['devices']] == [1]


@needs_sim
def test_unknown_gpu_fails_naming_the_value(sim):
    result = run_module({'gpus': ['0', 'GPU-does-not-exist']})
    assert result['failed'] is True
    assert "'GPU-does-not-exist'" in result['msg'] and 'GPUs here: 0 (GPU-' in result['msg']
    assert result['field'] == 'gpus' and result['value'] == 'GPU-does-not-exist'


@needs_sim
def test_gather_processes_false_and_fail_on_no_gpu_with_gpus(sim):
    result = run_module({'gather_processes': False, 'fail_on_no_gpu': True, 'vendor': 'nvidia'})
    gpu = result['ansible_facts']['gpu']
    assert not result.get('failed')
    assert gpu['processes'] == [] and gpu['holders'] == [] and gpu['devices'][0]['processes'] == [sim.pid]


def test_gpu_device_files_that_no_backend_reads_are_a_warning_with_the_fix(monkeypatch):
    """A node whose /dev/nvidiactl exists but whose interpreter lacks a working NVML never reads as GPU-less."""
    from ansible.module_utils import basic  # pylint: disable=import-outside-toplevel
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes  # pylint: disable=import-outside-toplevel
    warned = []
    monkeypatch.setattr(basic.AnsibleModule, 'warn', lambda self, text: warned.append(text))
    root = h.tempdir()
    try:
        dev = h.make_dev_dir(os.path.join(root, 'dev'))
        monkeypatch.setattr(processes, 'DEFAULT_DEV_ROOTS', (dev,))
        monkeypatch.setenv('LD_LIBRARY_PATH', root)          # no libnvidia-ml.so.1 here: NVML cannot load
        result = run_module({})
        assert not result.get('failed') and result['ansible_facts']['gpu']['devices'] == []
        (warning,) = warned
        error = result['ansible_facts']['gpu']['backends']['nvidia']['error']
        assert warning.startswith('nvidia GPU device files exist (%s/nvidiactl) but the nvidia backend cannot read them: %s.'
                                  % (dev, error))
        assert 'install nvidia-ml-py (imported as pynvml) for ' in warning and 'gpufleet.reclaim.prereqs' in warning
        warned[:] = []
        run_module({'vendor': 'amd'})                       # NVIDIA was not asked for: no NVIDIA warning
        assert warned == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_no_warning_without_gpu_device_files(monkeypatch):
    from ansible.module_utils import basic  # pylint: disable=import-outside-toplevel
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes  # pylint: disable=import-outside-toplevel
    warned = []
    monkeypatch.setattr(basic.AnsibleModule, 'warn', lambda self, text: warned.append(text))
    root = h.tempdir()
    try:
        monkeypatch.setattr(processes, 'DEFAULT_DEV_ROOTS', (root,))
        result = run_module({})
        assert result['ansible_facts']['gpu']['devices'] == [] and warned == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
