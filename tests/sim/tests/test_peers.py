"""Real peer tools against the shim: gpustat --json and nvitop --once list what the state says.

Both tools show compute and graphics contexts only (not MPS), so the state here has none.  When
tests/sim/gpusim exists, `gpusim show` must agree with the shim as well.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import MIB, SIM_DIR, kill_and_reap, make_gpu, make_process, probe, shim_env, wait_zombie, write_state

GPUSIM = os.path.join(SIM_DIR, 'gpusim')


def peer_state(state_path, spawn, driver):
    """Two healthy GPUs and a lost one; a dead entry that must not show up anywhere."""
    c0, g0, c1, dead = spawn(), spawn(), spawn(), spawn()
    gpus = [
        make_gpu(0, leaked_mib=100, util_pct=37),
        make_gpu(1, name='NVIDIA H100 80GB HBM3', uuid='GPU-11111111-2222-3333-4444-555555555555', pci_bus_id='00000000:0B:00.0'),
        make_gpu(2, lost=True),
    ]
    procs = [
        make_process(c0.pid, gpu=0, used_mib=4096),
        make_process(g0.pid, gpu=0, used_mib=None, type='graphics'),
        make_process(c1.pid, gpu=1, used_mib=20000),
        make_process(dead.pid, gpu=1, used_mib=999),
    ]
    kill_and_reap(dead)
    versions = {'r550': ('550.54.15', '12.550.54.15', 12040), 'r470': ('470.256.02', '11.470.256.02', 11040)}[driver]
    state = write_state(state_path, gpus=gpus, processes=procs, driver=driver, driver_version=versions[0],
                        nvml_version=versions[1], cuda_driver_version=versions[2])
    expected = {
        0: {'uuid': gpus[0]['uuid'], 'name': gpus[0]['name'], 'bus': '00000000:07:00.0', 'used_mib': 4196,
            'procs': {c0.pid: ('C', 4096), g0.pid: ('G', None)}},
        1: {'uuid': gpus[1]['uuid'], 'name': gpus[1]['name'], 'bus': '00000000:0B:00.0', 'used_mib': 20000,
            'procs': {c1.pid: ('C', 20000)}},
    }
    return state, expected, dead.pid


def run_tool(module, args, state_path, lib_dir):
    if importlib.util.find_spec(module) is None:
        pytest.skip('%s is not installed' % module)
    proc = subprocess.run([sys.executable, '-m', module] + args, env=shim_env(state_path, lib_dir, {'COLUMNS': '120'}),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=120, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert 'Traceback' not in output, output
    return proc.stdout


@pytest.mark.parametrize('variant', ['full', 'r470'])
def test_gpustat_json(shim_dirs, state_path, spawn, variant):
    _state, expected, dead = peer_state(state_path, spawn, variant if variant == 'r470' else 'r550')
    report = json.loads(run_tool('gpustat', ['--json'], state_path, shim_dirs[variant]))
    assert report['driver_version'] == ('550.54.15' if variant == 'full' else '470.256.02')
    gpus = {g['index']: g for g in report['gpus']}
    assert sorted(gpus) == [0, 1, 2]
    assert gpus[2]['name'] == '((GPU is lost))'
    for index, want in expected.items():
        gpu = gpus[index]
        assert (gpu['uuid'], gpu['name']) == (want['uuid'], want['name'])
        assert gpu['memory.total'] == 81559
        assert gpu['memory.used'] == want['used_mib']
        assert {p['pid']: p['gpu_memory_usage'] for p in gpu['processes']} == {pid: mib for pid, (_t, mib) in want['procs'].items()}
    assert gpus[0]['utilization.gpu'] == 37
    assert gpus[0]['power.draw'] == 61 and gpus[0]['enforced.power.limit'] == 400
    assert dead not in [p['pid'] for g in report['gpus'] for p in (g.get('processes') or [])]


@pytest.mark.parametrize('variant', ['full', 'r470'])
def test_nvitop_once(shim_dirs, state_path, spawn, variant):
    _state, expected, dead = peer_state(state_path, spawn, variant if variant == 'r470' else 'r550')
    out = run_tool('nvitop', ['--once'], state_path, shim_dirs[variant])
    from nvitop.api.utils import bytes2human  # pylint: disable=import-outside-toplevel

    lines = out.splitlines()
    devices = {}
    for i, line in enumerate(lines):
        m = re.match(r'^│\s+(\d+)\s+(.+?)\s+(On|Off|N/A)\s+│\s+(\S+)\s+(\S+)\s+│', line)
        if m:
            mem = re.search(r'│\s+(\S+) / (\S+)\s+│', lines[i + 1])
            devices[int(m.group(1))] = {'bus': m.group(4), 'used': mem.group(1), 'total': mem.group(2)}
    assert sorted(devices) == [0, 1, 2], out
    assert devices[2] == {'bus': 'N/A', 'used': 'N/A', 'total': 'N/A'}
    procs = {}
    for line in lines:
        m = re.match(r'^│\s+(\d+)\s+(\d+)\s+(C|G|C\+G|X)\s+\S+\s+(\S+)\s', line)
        if m:
            procs[int(m.group(2))] = (int(m.group(1)), m.group(3), m.group(4))
    want_procs = {}
    for index, want in expected.items():
        assert devices[index]['bus'] == want['bus']
        assert devices[index]['used'] == bytes2human(want['used_mib'] * MIB)
        assert devices[index]['total'] == bytes2human(81559 * MIB)
        for pid, (kind, mib) in want['procs'].items():
            want_procs[pid] = (index, kind, 'N/A' if mib is None else bytes2human(mib * MIB))
    assert procs == want_procs, out
    assert dead not in procs


def test_gpusim_show_agrees_with_the_shim(shim_dirs, state_path, spawn):
    """The liveness and "counts as used" rules, evaluated by gpusim show and by the shim."""
    if not os.path.exists(GPUSIM):
        pytest.skip('tests/sim/gpusim does not exist yet')
    live, zombie, child_holder, child, recent, old, sup_dead, supervisor, reused = (spawn() for _index in range(9))
    now = time.time()
    procs = [
        make_process(live.pid, gpu=0, used_mib=100),
        make_process(zombie.pid, gpu=0, used_mib=200),
        make_process(child_holder.pid, gpu=0, used_mib=400, children=[child.pid]),
        make_process(recent.pid, gpu=1, used_mib=800, exited_at=now - 1),
        make_process(old.pid, gpu=1, used_mib=1600, exited_at=now - 600),
        make_process(sup_dead.pid, gpu=1, used_mib=3200, supervisor_pid=supervisor.pid),
        make_process(reused.pid, gpu=1, used_mib=6400, starttime=0),
        make_process(live.pid, gpu=1, used_mib=None, type='graphics'),
    ]
    for child_proc in (child_holder, recent, old, sup_dead):
        kill_and_reap(child_proc)
    wait_zombie(zombie)
    write_state(state_path, gpus=[make_gpu(0, leaked_mib=5), make_gpu(1, memory_reserved_mib=7), make_gpu(2, lost=True)],
                processes=procs, release_delay_ms=60000)
    show = subprocess.run([sys.executable, GPUSIM, 'show'], env=shim_env(state_path, shim_dirs['full']),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=60, check=False)
    assert show.returncode == 0, show.stderr
    show = json.loads(show.stdout)
    out = probe(state_path, shim_dirs['full'])
    assert out['count'] == len(show['gpus'])
    for gpu, dev in zip(show['gpus'], out['devices']):
        assert dev['index'] == gpu['index']
        if gpu.get('lost'):
            assert dev['name']['code'] == 15
            continue
        assert (dev['uuid'], dev['name'], dev['pci']['busId']) == (gpu['uuid'], gpu['name'], gpu['pci_bus_id'])
        assert dev['mem_v1']['total'] == gpu['memory_total_mib'] * MIB
        assert dev['mem_v1']['used'] == gpu['used_mib'] * MIB
        shown = sorted(p['pid'] for p in show['processes'] if p['alive'] and p['gpu'] == gpu['index'])
        assert sorted(p['pid'] for key in ('compute', 'graphics', 'mps') for p in dev[key]) == shown
    assert [d['mem_v1']['used'] // MIB for d in out['devices'][:2]] == [5 + 100 + 400, 7 + 800 + 3200]
