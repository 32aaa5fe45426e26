# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""tests/device/run's health (issue #17) and mig (issue #19) checks against the simulated driver.

The checks run in a fresh Python whose libnvidia-ml.so.1 is the shim (tests/sim), on a node that
``gpusim init`` made: an Xid 13 in its kernel log before the check (so the event set, registered
after it, must time out with no event) and the recovery action ``reset`` on GPU 1.  The shim has no
GPU-instance profile calls: the mig check must call them "not supported", not fail.  Nothing is
spawned, so nothing is signalled.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEVICE_RUN = os.path.join(ROOT, 'tests', 'device', 'run')
SIM = os.path.join(ROOT, 'tests', 'sim')
SHIM = os.path.join(SIM, 'build', 'libnvidia-ml.so.1')

DRIVE = r'''
import importlib.machinery, importlib.util, json, sys
loader = importlib.machinery.SourceFileLoader('device_run', sys.argv[1])
spec = importlib.util.spec_from_loader('device_run', loader)
run = importlib.util.module_from_spec(spec)
loader.exec_module(run)
print(json.dumps({'health': run.check_health(3, timeout_ms=300), 'mig': run.check_mig()}, default=str))
'''


def _load():
    loader = importlib.machinery.SourceFileLoader('device_run', DEVICE_RUN)
    spec = importlib.util.spec_from_loader('device_run', loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def result():
    if not os.path.isfile(SHIM):
        pytest.skip('the simulator is not built (make sim)')
    root = tempfile.mkdtemp(prefix='gpufleet-devcheck-')
    try:
        env = dict(os.environ, GPU_SIM_STATE=os.path.join(root, 'state.json'))
        env.pop('PYTHONPATH', None)

        def gpusim(*args):
            subprocess.run([sys.executable, os.path.join(SIM, 'gpusim')] + list(args), env=env, check=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        gpusim('init', '--gpus', '2', '--dev-dir', os.path.join(root, 'dev'), '--create-dev-files')
        gpusim('xid', '--gpu', '0', '--code', '13')
        gpusim('set', '--gpu', '1', '--recovery-action', 'reset')
        env.update(LD_LIBRARY_PATH=os.path.dirname(SHIM), _GPUFLEET_KMSG=os.path.join(root, 'state-kmsg'))
        proc = subprocess.run([sys.executable, '-c', DRIVE, DEVICE_RUN], env=env, cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr.decode(errors='replace')
        return json.loads(proc.stdout.decode().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_health_event_set_times_out_and_is_freed(result):
    health = result['health']
    assert health['ok'] is True, health['problems']
    events = health['event_set']
    assert (events['created'], events['timed_out'], events['event'], events['freed']) == (True, True, None, True)
    assert events['registered'] == {'0': {'types': '0xa'}, '1': {'types': '0xa'}}   # Xid | double-bit ECC
    assert 0.27 <= events['waited_s'] < 5
    assert health['core_read_events']['xid_events'] == {'0': [], '1': []}
    assert health['nvml_refused'] == []


def test_health_fields_and_facts(result):
    health = result['health']
    assert health['reads']['1']['recovery_action'] == {'value': 1}
    assert health['reads']['0']['recovery_action'] == {'supported': False, 'nvml_return': 3}
    assert health['reads']['0']['remapped_rows'] == {'value': {'correctable': 0, 'uncorrectable': 0, 'pending': 0, 'failure': 0}}
    assert health['reads']['0']['retired_pages_pending']['supported'] is False   # the shim lacks it: no crash
    assert health['facts']['1']['recovery_action'] == 'reset'
    assert health['facts']['1']['health_reasons'] == ['recovery_action_reset']
    assert [e['code'] for e in health['facts']['0']['xid_events']] == [13]
    assert health['kernel_log'] == {'xid_lines': 1, 'error': None}
    overhead = health['watchdog_overhead']
    assert overhead['reps'] == 3
    for key in ('inproc_wall_ms', 'watchdog_wall_ms', 'extra_wall_ms', 'inproc_cpu_ms', 'watchdog_cpu_ms', 'extra_cpu_ms'):
        assert overhead[key]['min'] <= overhead[key]['median'] <= overhead[key]['p90'] <= overhead[key]['max']


def test_mig_reads_mode_and_reports_missing_profiles_as_not_supported(result):
    mig = result['mig']
    assert mig['ok'] is True, mig['problems']
    assert mig['nvml_refused'] == []
    assert mig['core_mig_mode'] == {'0': False, '1': False}
    for gpu in mig['gpus'].values():
        assert gpu['mig_mode'] == {'value': {'current': 0, 'pending': 0}}
        assert gpu['profiles'] and all(p['supported'] is False for p in gpu['profiles'].values())
    assert mig['summary']['0']['profiles'] == 'not supported'


def test_nvml_guard_refuses_changes_and_restores_pynvml():
    pynvml = pytest.importorskip('pynvml')
    run = _load()
    original = pynvml.nvmlDeviceSetMigMode
    with run.NvmlReadOnly(allow=run.NVML_EVENT_SET) as guard:
        for name in ('nvmlDeviceSetMigMode', 'nvmlDeviceCreateGpuInstance', 'nvmlGpuInstanceDestroy',
                     'nvmlDeviceResetGpuLockedClocks', 'nvmlDeviceClearEccErrorCounts'):
            with pytest.raises(run.NvmlRefused):
                getattr(pynvml, name)(None)
        assert pynvml.nvmlEventSetCreate is not None and 'nvmlEventSetCreate' not in guard.saved
        assert 'nvmlDeviceGetMigMode' not in guard.saved
    assert guard.refused == ['nvmlDeviceSetMigMode', 'nvmlDeviceCreateGpuInstance', 'nvmlGpuInstanceDestroy',
                             'nvmlDeviceResetGpuLockedClocks', 'nvmlDeviceClearEccErrorCounts']
    assert pynvml.nvmlDeviceSetMigMode is original
