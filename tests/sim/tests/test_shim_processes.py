"""Liveness and "counts as used" rules of the shim (docs/design/contracts.md), through pynvml."""

import time

import pytest

from conftest import MIB, kill_and_reap, make_gpu, make_process, probe, run_python, starttime, wait_zombie, write_state

pytest.importorskip('pynvml')


def listed(device):
    return sorted(p['pid'] for key in ('compute', 'graphics', 'mps') for p in device[key])


def used_mib(device):
    return device['mem_v1']['used'] // MIB


def test_killed_process_disappears_and_frees_memory(shim_dirs, state_path, spawn):
    a, b = spawn(), spawn()
    write_state(state_path, gpus=1, processes=[make_process(a.pid, used_mib=1000), make_process(b.pid, used_mib=300)])
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == sorted([a.pid, b.pid])
    assert used_mib(d0) == 1300
    kill_and_reap(a)
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == [b.pid]
    assert used_mib(d0) == 300
    assert [s['pid'] for s in d0['putil']] == [b.pid]


def test_zombie_is_not_listed(shim_dirs, state_path, spawn):
    a = spawn()
    write_state(state_path, gpus=1, processes=[make_process(a.pid, used_mib=512)])
    wait_zombie(a)  # reaped by the spawn fixture's teardown
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == []
    assert used_mib(d0) == 0


def test_pid_reuse_is_detected_by_starttime(shim_dirs, state_path, spawn):
    a, b = spawn(), spawn()
    reused = make_process(a.pid, used_mib=2048)
    reused['starttime'] += 1  # the recorded process is gone; a.pid now belongs to someone else
    write_state(state_path, gpus=1, processes=[reused, make_process(b.pid, used_mib=100)])
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == [b.pid]
    assert used_mib(d0) == 100


def test_leaked_memory_counts_as_used(shim_dirs, state_path, spawn):
    a = spawn()
    write_state(state_path, gpus=[make_gpu(0, leaked_mib=777)], processes=[make_process(a.pid, used_mib=23)])
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert used_mib(d0) == 800
    kill_and_reap(a)
    assert used_mib(probe(state_path, shim_dirs['full'])['devices'][0]) == 777


def test_live_children_keep_memory_used(shim_dirs, state_path, spawn):
    parent, child = spawn(), spawn()
    entry = make_process(parent.pid, used_mib=4000, children=[child.pid])
    write_state(state_path, gpus=1, processes=[entry])
    kill_and_reap(parent)
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == []          # only the entry's own pid is listed
    assert used_mib(d0) == 4000      # but its children still hold the memory
    kill_and_reap(child)
    assert used_mib(probe(state_path, shim_dirs['full'])['devices'][0]) == 0


@pytest.mark.parametrize('exited_ago, counted', [(1.0, True), (120.0, False)])
def test_release_delay_after_exited_at(shim_dirs, state_path, spawn, exited_ago, counted):
    a = spawn()
    entry = make_process(a.pid, used_mib=1500)
    kill_and_reap(a)
    entry['exited_at'] = time.time() - exited_ago
    write_state(state_path, gpus=1, processes=[entry], release_delay_ms=60000)
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == []
    assert used_mib(d0) == (1500 if counted else 0)


def test_release_delay_expires(shim_dirs, state_path, spawn):
    """Real time: used right after the exit, free once exited_at + release_delay_ms has passed."""
    a = spawn()
    entry = make_process(a.pid, used_mib=1500)
    kill_and_reap(a)
    entry['exited_at'] = time.time()
    write_state(state_path, gpus=1, processes=[entry], release_delay_ms=3000)
    code = '''
import json, time
import pynvml as N
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
samples = []
deadline = time.time() + 30
while time.time() < deadline:
    used = N.nvmlDeviceGetMemoryInfo(h).used // (1 << 20)
    samples.append([time.time(), used])  # taken after the call: never earlier than the shim's clock
    if samples[-1][1] == 0:
        break
    time.sleep(0.1)
print(json.dumps(samples))
'''
    samples = run_python(code, state_path, shim_dirs['full'])
    exited_at = entry['exited_at']
    assert samples[0][1] == 1500, samples[:3]
    assert samples[-1][1] == 0
    freed_at = samples[-1][0]
    assert exited_at + 3.0 <= freed_at < exited_at + 3.0 + 5.0
    assert all(used == 1500 for t, used in samples if t < exited_at + 2.9)


def test_supervisor_holds_memory_until_it_writes_exited_at(shim_dirs, state_path, spawn):
    a, supervisor = spawn(), spawn()
    entry = make_process(a.pid, used_mib=640, supervisor_pid=supervisor.pid)
    kill_and_reap(a)
    write_state(state_path, gpus=1, processes=[entry], release_delay_ms=5000)
    d0 = probe(state_path, shim_dirs['full'])['devices'][0]
    assert listed(d0) == []
    assert used_mib(d0) == 640
    kill_and_reap(supervisor)
    assert used_mib(probe(state_path, shim_dirs['full'])['devices'][0]) == 0


def test_state_changes_are_picked_up_without_reinit(shim_dirs, state_path, spawn):
    """One process, one nvmlInit: rewrites of the state file (rename or in place) show at once."""
    a = spawn()
    write_state(state_path, gpus=1)
    two_gpus = make_process(a.pid, gpu=1, used_mib=64)
    code = '''
import json, os
import pynvml as N
path = os.environ['GPU_SIM_STATE']
state = json.load(open(path))
out = []
N.nvmlInit()
out.append(N.nvmlDeviceGetCount())
state['gpus'].append(dict(state['gpus'][0], index=1, uuid='GPU-second', pci_bus_id='00000000:08:00.0'))
state['processes'] = [%r]
with open(path + '.tmp', 'w') as f:
    json.dump(state, f)
os.rename(path + '.tmp', path)
out.append(N.nvmlDeviceGetCount())
h = N.nvmlDeviceGetHandleByIndex(1)
out.append([p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)])
state['gpus'][1]['name'] = 'NVIDIA Renamed In Place'
with open(path, 'w') as f:   # same inode, different size
    json.dump(state, f)
out.append(N.nvmlDeviceGetName(h))
os.unlink(path)
try:
    N.nvmlDeviceGetCount()
except N.NVMLError as e:
    out.append(e.value)
with open(path, 'w') as f:
    f.write('{"gpus": [')
try:
    N.nvmlDeviceGetCount()
except N.NVMLError as e:
    out.append(e.value)
with open(path + '.tmp', 'w') as f:
    json.dump(state, f)
os.rename(path + '.tmp', path)
out.append(N.nvmlDeviceGetCount())
N.nvmlShutdown()
print(json.dumps(out))
''' % (two_gpus,)
    assert run_python(code, state_path, shim_dirs['full']) == [1, 2, [a.pid], 'NVIDIA Renamed In Place', 999, 999, 2]


def test_recorded_child_and_supervisor_starttimes(shim_dirs, state_path, spawn):
    """children_starttime / supervisor_starttime (written by gpusim) guard against pid reuse too."""
    dead, child, supervisor = spawn(), spawn(), spawn()
    good = make_process(dead.pid, used_mib=10, children=[child.pid], children_starttime=[starttime(child.pid)])
    reused_child = make_process(dead.pid, used_mib=20, children=[child.pid], children_starttime=[starttime(child.pid) + 1])
    reused_supervisor = make_process(dead.pid, used_mib=40, supervisor_pid=supervisor.pid,
                                     supervisor_starttime=starttime(supervisor.pid) + 1)
    live_supervisor = make_process(dead.pid, used_mib=80, supervisor_pid=supervisor.pid,
                                   supervisor_starttime=starttime(supervisor.pid))
    kill_and_reap(dead)
    write_state(state_path, gpus=1, processes=[good, reused_child, reused_supervisor, live_supervisor], release_delay_ms=1000)
    assert used_mib(probe(state_path, shim_dirs['full'])['devices'][0]) == 90
