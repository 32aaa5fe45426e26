# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The core against the simulated driver (tests/sim), through the real pynvml.

Most tests run take_snapshot() in a fresh Python whose libnvidia-ml.so.1 is the shim (the core
imported standalone, as the node agent will); a few load the shim into this process by absolute
path.  The GPU processes are children these tests start and reap.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

pytestmark = pytest.mark.skipif(h.sim_build() is None,
                                reason='simulator not built: run `make sim` (tests/sim/build/libnvidia-ml.so.1 missing)')

FACT_DEVICE_KEYS = {'index', 'vendor', 'vendor_index', 'uuid', 'name', 'pci_bus_id', 'memory_total_mib', 'memory_used_mib',
                    'memory_free_mib', 'utilization_pct', 'temperature_c', 'power_w', 'power_limit_w', 'orphaned_mib',
                    'health', 'processes', 'xid_events', 'recovery_action', 'health_reasons',  # these three: issue #17
                    'mig_mode', 'mig_devices'}  # issue #19
FACT_PROCESS_KEYS = {'pid', 'gpu_indexes', 'used_mib', 'user', 'uid', 'name', 'cmdline', 'create_time', 'status',
                     'container', 'slurm_job', 'mig'}  # mig: issue #19


@pytest.fixture
def work():
    """A temp dir with a fake device dir, a state path, and children that are always reaped."""
    root = h.tempdir()
    kids = h.Children()

    class Work(object):
        dev = h.make_dev_dir(os.path.join(root, 'dev'), minors=(0, 1, 2, 3))
        state = os.path.join(root, 'state.json')
        children = kids
        tmp = root

        def path(self, name):
            return os.path.join(self.dev, name)

        def snapshot(self, state, variant='', **kwargs):
            h.write_state(self.state, state)
            kwargs.setdefault('dev_roots', [self.dev])
            return h.run_snapshot(self.state, variant=variant, **kwargs)

    try:
        yield Work()
    finally:
        kids.close()
        shutil.rmtree(root, ignore_errors=True)


def by_index(result):
    return {d['index']: d for d in result['facts']['devices']}


def procs(result):
    return {p['pid']: p for p in result['facts']['processes']}


def test_identity_metrics_and_contract_keys(work):
    job = work.children.sleeper([work.path('nvidia0'), work.path('nvidiactl'), work.path('nvidia-uvm')])
    state = h.make_state(gpus=2, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 4096)])
    state['gpus'][1].update(util_pct=87, temp_c=71, power_w=312.5, power_limit_w=350.0)
    result = work.snapshot(state)
    facts = result['facts']
    assert set(facts) == {'backends', 'devices', 'processes', 'holders', 'driver_hung', 'holders_incomplete'}   # issues #17, #28
    assert facts['backends']['nvidia'] == {'available': True, 'version': '550.54.15', 'error': None}
    assert set(facts['backends']) == {'nvidia', 'amd', 'intel', 'apple'}
    assert [d['index'] for d in facts['devices']] == [0, 1]
    for dev in facts['devices']:
        assert set(dev) == FACT_DEVICE_KEYS
        assert dev['vendor'] == 'nvidia'
        assert dev['health'] == {'status': 'ok', 'recommended_action': 'none', 'reasons': []}
    gpu0, gpu1 = facts['devices']
    assert gpu0['uuid'] == 'GPU-6f7c1a2b-0000-4000-8000-000000000000'
    assert gpu0['pci_bus_id'] == '00000000:07:00.0'
    assert gpu0['name'] == 'NVIDIA A100-SXM4-80GB'
    assert gpu0['memory_total_mib'] == 81559
    assert gpu0['memory_used_mib'] == 4096
    assert gpu0['memory_free_mib'] == 81559 - 4096
    assert gpu0['orphaned_mib'] == 0
    assert gpu0['processes'] == [job.pid]
    assert (gpu1['utilization_pct'], gpu1['temperature_c'], gpu1['power_w'], gpu1['power_limit_w']) == (87, 71, 312.5, 350.0)
    assert gpu1['processes'] == [] and gpu1['memory_used_mib'] == 0
    proc = procs(result)[job.pid]
    assert set(proc) == FACT_PROCESS_KEYS
    assert proc['gpu_indexes'] == [0] and proc['used_mib'] == 4096
    assert proc['name'] == 'sleep' and proc['cmdline'] == ['sleep', '600']
    assert proc['status'] in ('sleeping', 'running') and proc['uid'] == os.getuid()
    assert proc['create_time'] > 0
    assert result['extra']['processes'][str(job.pid)]['device_paths'] == sorted(
        [work.path('nvidia0'), work.path('nvidiactl'), work.path('nvidia-uvm')])
    assert result['extra']['processes'][str(job.pid)]['starttime'] == h.starttime(job.pid)
    assert facts['holders'] == []
    assert result['extra']['devices'][0]['memory_api'] == 'v2'
    assert result['extra']['devices'][0]['persistence_mode'] is True
    assert result['extra']['devices'][0]['mig_mode'] is False


def test_reserved_memory_is_not_orphaned_and_leak_is(work):
    job = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=2, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 2048)])
    for gpu in state['gpus']:
        gpu['memory_reserved_mib'] = 512
    state['gpus'][1]['leaked_mib'] = 3000
    result = work.snapshot(state)
    gpu0, gpu1 = result['facts']['devices']
    # MemoryInfo v2: "used" excludes the driver reserve, which therefore never looks orphaned
    assert gpu0['memory_used_mib'] == 2048 and gpu0['orphaned_mib'] == 0
    assert gpu0['memory_free_mib'] == 81559 - 2048 - 512
    assert result['extra']['devices'][0]['memory_reserved_mib'] == 512
    assert gpu1['memory_used_mib'] == 3000 and gpu1['orphaned_mib'] == 3000 and gpu1['processes'] == []


def test_lost_gpu_does_not_hide_the_others(work):
    job = work.children.sleeper([work.path('nvidia2')])
    state = h.make_state(gpus=3, dev_dir=work.dev, processes=[h.make_process(job.pid, 2, 1024)])
    state['gpus'][1]['lost'] = True
    result = work.snapshot(state)
    devs = by_index(result)
    assert sorted(devs) == [0, 1, 2]
    lost = devs[1]
    assert lost['health']['status'] == 'lost'
    assert lost['health']['recommended_action'] == 'reset'
    assert 'lost' in lost['health']['reasons'][0]
    assert lost['uuid'] is None and lost['memory_used_mib'] is None and lost['orphaned_mib'] is None
    assert lost['processes'] == []
    assert devs[0]['health']['status'] == 'ok' and devs[0]['uuid'].endswith('0000')
    assert devs[2]['processes'] == [job.pid] and devs[2]['orphaned_mib'] == 0
    assert procs(result)[job.pid]['gpu_indexes'] == [2]


def test_no_permission_on_process_lists_is_not_fatal(work):
    job = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=2, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 1024)])
    state['gpus'][0]['no_permission'] = True
    result = work.snapshot(state)
    gpu0, gpu1 = result['facts']['devices']
    assert gpu0['processes'] == []
    assert gpu0['orphaned_mib'] is None  # unknown: we could not see who uses the memory
    assert gpu0['memory_used_mib'] == 1024
    assert gpu0['health']['status'] == 'ok'
    assert any('Insufficient Permissions' in r for r in gpu0['health']['reasons'])
    assert result['extra']['devices'][0]['processes_complete'] is False
    assert gpu1['health']['reasons'] == []
    # the driver hid it, the fd scan still sees a holder of /dev/nvidia0
    assert [x['pid'] for x in result['facts']['holders']] == [job.pid]
    assert result['extra']['holders'][str(job.pid)]['gpu_indexes'] == [0]


def test_used_mib_not_available_is_none(work):
    job = work.children.sleeper([work.path('nvidia0')])
    other = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=1, dev_dir=work.dev,
                         processes=[h.make_process(job.pid, 0, None), h.make_process(other.pid, 0, 512)])
    result = work.snapshot(state)
    gpu0 = result['facts']['devices'][0]
    assert gpu0['processes'] == sorted([job.pid, other.pid])
    assert gpu0['orphaned_mib'] is None
    assert procs(result)[job.pid]['used_mib'] is None
    assert procs(result)[other.pid]['used_mib'] == 512


def test_compute_graphics_and_mps_lists_merge_per_pid(work):
    job = work.children.sleeper([work.path('nvidia0')])
    mps = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=1, dev_dir=work.dev, processes=[
        h.make_process(job.pid, 0, 4096, 'compute'),
        h.make_process(job.pid, 0, 0, 'graphics'),
        h.make_process(mps.pid, 0, 256, 'mps'),
    ])
    result = work.snapshot(state)
    gpu0 = result['facts']['devices'][0]
    assert gpu0['processes'] == sorted([job.pid, mps.pid])
    types = result['extra']['devices'][0]['types']
    assert types[str(job.pid)] == ['compute', 'graphics']
    assert types[str(mps.pid)] == ['mps']
    assert procs(result)[job.pid]['used_mib'] == 4096
    assert gpu0['orphaned_mib'] == 0


@pytest.mark.parametrize('variant', ['', 'r470'])
def test_r470_memory_v1_and_process_v2_fallback(work, variant):
    """driver r470: no MemoryInfo_v2 and no *_v3 process lists (answers, or with -DSIM_R470 absent symbols)."""
    if variant and h.shim_path(variant) is None:
        pytest.skip('the -DSIM_R470 shim variant is not built (tests/sim/build/r470)')
    job = work.children.sleeper([work.path('nvidia1')])
    state = h.make_state(gpus=2, driver='r470', dev_dir=work.dev,
                         processes=[h.make_process(job.pid, 1, 3072), h.make_process(job.pid, 1, 0, 'graphics')])
    state['gpus'][1]['leaked_mib'] = 100
    result = work.snapshot(state, variant=variant)
    assert result['facts']['backends']['nvidia']['version'] == '470.223.02'
    assert [d['memory_api'] for d in result['extra']['devices']] == ['v1', 'v1']
    gpu1 = by_index(result)[1]
    assert gpu1['processes'] == [job.pid]
    assert gpu1['memory_used_mib'] == 3172 and gpu1['orphaned_mib'] == 100
    assert result['extra']['devices'][1]['types'][str(job.pid)] == ['compute', 'graphics']
    assert gpu1['health']['reasons'] == []


def test_context_overhead_is_not_orphaned_memory_but_a_leak_on_top_is(work):
    """The shim's per-process context overhead (what a real driver charges to no process: 8 MiB on an
    H200 with driver 580) reads as 0 orphaned; a leak on top is reported whole, overhead included."""
    jobs = [work.children.sleeper([work.path('nvidia0')]) for _index in range(4)]
    other = work.children.sleeper([work.path('nvidia1')])
    state = h.make_state(gpus=2, dev_dir=work.dev,
                         processes=[h.make_process(job.pid, 0, 1024 * (n + 1)) for n, job in enumerate(jobs)]
                         + [h.make_process(other.pid, 1, 1024)])
    for gpu in state['gpus']:
        gpu['context_overhead_mib'] = 8
    state['gpus'][1]['leaked_mib'] = 512
    devices = by_index(work.snapshot(state))
    gpu0, gpu1 = devices[0], devices[1]
    assert gpu0['memory_used_mib'] == 10240 + 4 * 8 and gpu0['orphaned_mib'] == 0
    assert gpu1['memory_used_mib'] == 1024 + 8 + 512 and gpu1['orphaned_mib'] == 520


def test_fd_only_holder_and_leftover_memory(work):
    """A forked worker keeps the device open after the driver stopped listing the parent."""
    listed = work.children.sleeper([work.path('nvidia0')])
    worker = work.children.sleeper([work.path('nvidia0'), work.path('nvidiactl')])
    monitor = work.children.sleeper([work.path('nvidiactl')])
    dead = h.unused_pid()
    state = h.make_state(gpus=2, dev_dir=work.dev, processes=[
        h.make_process(listed.pid, 0, 1000),
        # the parent died; its child still holds the context, so the memory still counts as used
        h.make_process(dead, 0, 2000, start=1, children=[worker.pid]),
    ])
    result = work.snapshot(state)
    gpu0 = result['facts']['devices'][0]
    assert gpu0['processes'] == [listed.pid]
    assert gpu0['memory_used_mib'] == 3000
    assert gpu0['orphaned_mib'] == 2000
    holders = {x['pid']: x for x in result['facts']['holders']}
    assert sorted(holders) == sorted([worker.pid, monitor.pid])
    assert holders[worker.pid]['devices'] == sorted([work.path('nvidia0'), work.path('nvidiactl')])
    assert holders[worker.pid]['name'] == 'sleep' and holders[worker.pid]['cmdline'] == ['sleep', '600']
    assert set(holders[worker.pid]) == {'pid', 'user', 'name', 'cmdline', 'devices'}
    assert result['extra']['holders'][str(worker.pid)]['gpu_indexes'] == [0]
    assert result['extra']['holders'][str(monitor.pid)]['gpu_indexes'] == []  # nvidiactl names no GPU
    assert listed.pid not in holders


def test_gpus_filter_restricts_devices_processes_and_holders(work):
    a = work.children.sleeper([work.path('nvidia0')])
    b = work.children.sleeper([work.path('nvidia1')])
    c = work.children.sleeper([work.path('nvidia1')])  # an unlisted holder of GPU 1
    state = h.make_state(gpus=3, dev_dir=work.dev, processes=[h.make_process(a.pid, 0, 10), h.make_process(b.pid, 1, 20)])
    result = work.snapshot(state, gpus=['GPU-6f7c1a2b-0000-4000-8000-000000000001', '2'])
    assert [d['index'] for d in result['facts']['devices']] == [1, 2]
    assert [p['pid'] for p in result['facts']['processes']] == [b.pid]
    assert [x['pid'] for x in result['facts']['holders']] == [c.pid]


def test_driver_pid_invisible_here_is_not_found(work):
    """The driver lists a pid that this process table does not have (another PID namespace)."""
    job = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=1, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 700)])
    empty_proc = os.path.join(work.tmp, 'proc')
    os.mkdir(empty_proc)
    result = work.snapshot(state, inventory={'proc_root': empty_proc, 'dev_roots': [work.dev]})
    proc = procs(result)[job.pid]
    assert proc['status'] == 'not_found'
    assert proc['used_mib'] == 700 and proc['gpu_indexes'] == [0]
    assert proc['user'] is None and proc['cmdline'] is None and proc['create_time'] is None
    assert result['facts']['devices'][0]['orphaned_mib'] == 0


def _can_unshare():
    if shutil.which('unshare') is None:
        return False
    probe = subprocess.run(['unshare', '--pid', '--fork', '--mount', '--propagation', 'private', 'true'],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return probe.returncode == 0


def test_snapshot_inside_another_pid_namespace(work):
    """take_snapshot() running in a new PID namespace: the driver (the shim, reading the host's /proc)
    lists a host pid that the namespace's own procfs does not show."""
    if not _can_unshare():
        pytest.skip('unshare --pid --mount is not permitted here')
    job = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=1, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 1500)])
    ns_proc = os.path.join(work.tmp, 'nsproc')
    os.mkdir(ns_proc)
    prefix = ['unshare', '--pid', '--fork', '--mount', '--propagation', 'private',
              'sh', '-c', 'mount -t proc proc "$0" && exec "$@"', ns_proc]
    h.write_state(work.state, state)
    result = h.run_snapshot(work.state, prefix=prefix, inventory={'proc_root': ns_proc, 'dev_roots': [work.dev]})
    assert result['facts']['devices'][0]['processes'] == [job.pid]
    assert procs(result)[job.pid]['status'] == 'not_found'
    # the host job's fds are invisible in the namespace: no holders either
    assert result['facts']['holders'] == []


def test_health_from_ecc_and_row_remapping(work):
    state = h.make_state(gpus=4, dev_dir=work.dev)
    state['gpus'][1]['ecc_uncorrected'] = 3
    state['gpus'][2]['remapped_rows'] = {'correctable': 0, 'uncorrectable': 2, 'pending': True, 'failure': False}
    state['gpus'][3]['remapped_rows'] = {'correctable': 0, 'uncorrectable': 9, 'pending': False, 'failure': True}
    devs = by_index(work.snapshot(state))
    assert devs[0]['health'] == {'status': 'ok', 'recommended_action': 'none', 'reasons': []}
    assert devs[1]['health']['status'] == 'degraded' and devs[1]['health']['recommended_action'] == 'reset'
    assert 'ECC' in devs[1]['health']['reasons'][0]
    assert devs[2]['health']['status'] == 'degraded' and devs[2]['health']['recommended_action'] == 'reset'
    assert 'pending' in devs[2]['health']['reasons'][0]
    assert devs[3]['health']['status'] == 'degraded' and devs[3]['health']['recommended_action'] == 'drain'


def test_gather_processes_false_keeps_driver_pids(work):
    job = work.children.sleeper([work.path('nvidia0')])
    holder = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=1, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 64)])
    result = work.snapshot(state, gather_processes=False)
    assert result['facts']['processes'] == [] and result['facts']['holders'] == []
    assert result['facts']['devices'][0]['processes'] == [job.pid]
    assert holder.pid  # started, but not looked for


def test_gpusim_spawned_workload_with_children(work):
    """End to end with the simulator's own workload: it opens its device files and forks children
    that inherit them (holders the driver does not list)."""
    run, cleanup = _gpusim(work)
    run('init', '--gpus', '2', '--dev-dir', work.dev)
    try:
        pid = int(run('spawn', '--gpu', '1', '--mib', '6000', '--children', '2', '--', 'python', 'train.py').split()[-1])
        result = h.run_snapshot(work.state, dev_roots=[work.dev])
        gpu1 = by_index(result)[1]
        assert gpu1['processes'] == [pid] and gpu1['memory_used_mib'] == 6000 and gpu1['orphaned_mib'] == 0
        proc = procs(result)[pid]
        assert proc['cmdline'] == ['python', 'train.py'] and proc['status'] != 'not_found'
        assert result['extra']['processes'][str(pid)]['device_paths'] == sorted(
            [work.path('nvidiactl'), work.path('nvidia-uvm'), work.path('nvidia1')])
        kids = [x for x in result['facts']['holders'] if work.path('nvidia1') in x['devices']]
        assert len(kids) == 2
    finally:
        cleanup()


def test_in_process_shim_through_real_pynvml(work):
    """The shim loaded into this process by absolute path; state changes are seen by the next snapshot."""
    job = work.children.sleeper([work.path('nvidia0')])
    state = h.make_state(gpus=2, dev_dir=work.dev, processes=[h.make_process(job.pid, 0, 1234)])
    h.write_state(work.state, state)
    with h.shim_in_process(work.state):
        inv = ProcessInventory(dev_roots=[work.dev])
        snap = take_snapshot(inventory=inv)
        assert [d.memory_used_mib for d in snap.devices] == [1234, 0]
        assert snap.process(job.pid).name == 'sleep'
        assert snap.device('GPU-6f7c1a2b-0000-4000-8000-000000000001').index == 1
        state['gpus'][1]['leaked_mib'] = 77
        state['gpus'][0]['lost'] = True
        h.write_state(work.state, state)
        snap = take_snapshot(inventory=ProcessInventory(dev_roots=[work.dev]))
        assert snap.devices[0].health.status == 'lost'
        assert snap.devices[1].orphaned_mib == 77
        assert snap.processes == []
        assert [x.pid for x in snap.holders] == [job.pid]  # lost GPU: only the fd scan still sees it


def _gpusim(work):
    gpusim = os.path.join(h.sim_dir(), 'gpusim')
    if not os.path.isfile(os.path.join(h.sim_build(), 'gpusim-workload')) or not os.access(gpusim, os.X_OK):
        pytest.skip('gpusim or gpusim-workload is not built')
    env = h.shim_env(work.state)

    def run(*args):
        return subprocess.run([gpusim, args[0], '--state', work.state] + list(args[1:]), env=env, check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60).stdout.decode()

    def cleanup():
        subprocess.run([gpusim, 'kill-all', '--state', work.state], env=env, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    return run, cleanup


def test_amd_node_through_the_fake_amdsmi(work):
    """An AMD node: the AMD backend over the simulator's amdsmi package, render nodes mapped to GPUs."""
    fake = os.path.join(h.sim_dir(), 'python')
    if not os.path.isfile(os.path.join(fake, 'amdsmi', '__init__.py')):
        pytest.skip('the fake amdsmi package (tests/sim/python/amdsmi) is missing')
    run, cleanup = _gpusim(work)
    run('init', '--gpus', '2', '--vendor', 'amd', '--dev-dir', work.dev, '--create-dev-files')
    try:
        pid = int(run('spawn', '--gpu', '1', '--mib', '3000', '--children', '1', '--', 'python', 'serve.py').split()[-1])
        run('leak', '--gpu', '0', '--mib', '100')
        result = h.run_snapshot(work.state, extra_env={'PYTHONPATH': fake}, dev_roots=[work.dev])
        facts = result['facts']
        assert facts['backends']['amd']['available'] is True
        assert facts['backends']['nvidia']['available'] is False  # the state is not an NVIDIA node
        gpu0, gpu1 = facts['devices']
        assert (gpu0['vendor'], gpu0['index'], gpu0['vendor_index']) == ('amd', 0, 0)
        assert gpu0['orphaned_mib'] == 100 and gpu0['memory_used_mib'] == 100
        assert gpu1['processes'] == [pid] and gpu1['memory_used_mib'] == 3000 and gpu1['orphaned_mib'] == 0
        assert 0 < gpu1['power_limit_w'] < 10000  # microwatts from amdsmi become watts
        assert procs(result)[pid]['used_mib'] == 3000
        kids = [x for x in facts['holders'] if work.path('kfd') in x['devices']]
        assert len(kids) == 1 and result['extra']['holders'][str(kids[0]['pid'])]['gpu_indexes'] == [1]
    finally:
        cleanup()
