# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpusim_state.py: locking, atomic writes, liveness and the "counts as used" rules."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from conftest import SIM_DIR, proc_state, wait_until

sys.path.insert(0, SIM_DIR)
import gpusim_state as gs  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order


@pytest.fixture
def path(tmp_path, monkeypatch):
    state_file = str(tmp_path / 'state.json')
    monkeypatch.setenv(gs.STATE_ENV, state_file)
    gs.save(gs.new_state(gpus=2, seed='unit'), state_file)
    return state_file


@pytest.fixture
def sleeper():
    children = []

    def start(argv=None):
        child = subprocess.Popen(argv or ['sleep', '30'])
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def entry(pid, start, **kw):
    out = {'pid': pid, 'starttime': start, 'gpu': 0, 'used_mib': 100, 'type': 'compute', 'util_pct': 0,
           'children': [], 'children_starttime': [], 'user': 'u', 'argv': ['x'], 'supervisor_pid': None,
           'supervisor_starttime': None, 'exited_at': None}
    out.update(kw)
    return out


def test_state_path_requires_a_setting(monkeypatch):
    monkeypatch.delenv(gs.STATE_ENV, raising=False)
    with pytest.raises(gs.StateError) as exc:
        gs.state_path()
    assert gs.STATE_ENV in str(exc.value)
    assert gs.state_path('rel.json') == os.path.abspath('rel.json')


def test_load_errors(tmp_path):
    missing = str(tmp_path / 'none.json')
    with pytest.raises(gs.StateError):
        gs.load(missing)
    bad = tmp_path / 'bad.json'
    bad.write_text('{not json')
    with pytest.raises(gs.StateError):
        gs.load(str(bad))
    other = tmp_path / 'other.json'
    other.write_text(json.dumps({'schema': 99}))
    with pytest.raises(gs.StateError):
        gs.load(str(other))


def test_save_is_atomic_and_world_readable(path):
    before = os.stat(path).st_ino
    with gs.locked() as state:
        state['gpus'][0]['util_pct'] = 5
    after = os.stat(path)
    assert after.st_ino != before  # replaced by rename, never rewritten in place
    assert after.st_mode & 0o777 == 0o644
    assert gs.load()['gpus'][0]['util_pct'] == 5
    assert [n for n in os.listdir(os.path.dirname(path)) if '.tmp.' in n] == []
    ino = os.stat(path).st_ino
    with gs.locked():
        pass  # unchanged: not rewritten, so readers keyed on (ino, mtime, size) see no change
    assert os.stat(path).st_ino == ino


def test_locked_discards_changes_on_error(path):
    with pytest.raises(RuntimeError):
        with gs.locked() as state:
            state['gpus'][0]['leaked_mib'] = 99
            raise RuntimeError('boom')
    assert gs.load()['gpus'][0]['leaked_mib'] == 0


def _bump(path, times):
    for _unused in range(times):
        with gs.locked(path) as state:
            state['gpus'][0]['reset_count'] += 1


def test_concurrent_read_modify_write(path):
    ctx = multiprocessing.get_context('fork')
    workers = [ctx.Process(target=_bump, args=(path, 25)) for _unused in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert gs.load(path)['gpus'][0]['reset_count'] == 200


def test_read_stat_and_liveness(sleeper):
    child = sleeper(['sleep', '30'])
    state, start = gs.read_stat(child.pid)
    assert state in 'RSD' and start > 0
    assert gs.pid_alive(child.pid) and gs.pid_alive(child.pid, start)
    assert not gs.pid_alive(child.pid, start + 1)  # pid reuse: another starttime is another process
    assert gs.read_stat(0) is None and gs.read_stat('x') is None and not gs.pid_alive(None)
    child.kill()
    wait_until(lambda: proc_state(child.pid) == 'Z')
    assert gs.read_stat(child.pid)[0] == 'Z'
    assert not gs.pid_alive(child.pid, start)  # a zombie counts as dead


def test_read_stat_with_odd_comm(sleeper, tmp_path):
    odd = tmp_path / 'a) (b c'
    os.symlink('/bin/sleep' if os.path.exists('/bin/sleep') else '/usr/bin/sleep', str(odd))
    child = sleeper([str(odd), '30'])
    wait_until(lambda: gs.read_stat(child.pid) is not None)
    stat = gs.read_stat(child.pid)
    with open('/proc/%d/stat' % child.pid) as f:
        expect = int(f.read().rsplit(')', 1)[1].split()[19])
    assert stat[1] == expect


def test_counted_rules(sleeper):
    live = sleeper()
    dead = sleeper()
    dead_start = gs.starttime(dead.pid)
    live_start = gs.starttime(live.pid)
    dead.kill()
    dead.wait()
    now = time.time()
    assert gs.entry_counted(entry(live.pid, live_start))
    assert not gs.entry_counted(entry(dead.pid, dead_start))
    # a live child keeps the memory
    kid = entry(dead.pid, dead_start, children=[live.pid], children_starttime=[live_start])
    assert gs.entry_counted(kid) and gs.entry_busy(kid) and not gs.entry_listed(kid)
    assert gs.children_alive(kid) == [live.pid]
    # without a recorded starttime a child must not predate the parent
    assert gs.children_alive(entry(dead.pid, live_start + 10 ** 6, children=[live.pid])) == []
    # exited_at + release delay
    assert gs.entry_counted(entry(dead.pid, dead_start, exited_at=now - 0.5), release_delay_ms=1000, now=now)
    assert not gs.entry_counted(entry(dead.pid, dead_start, exited_at=now - 1.5), release_delay_ms=1000, now=now)
    # a live supervisor that has not written exited_at yet
    sup = entry(dead.pid, dead_start, supervisor_pid=live.pid, supervisor_starttime=live_start)
    assert gs.entry_counted(sup, release_delay_ms=1000) and not gs.entry_busy(sup)
    assert not gs.entry_counted(dict(sup, supervisor_starttime=live_start + 1), release_delay_ms=1000)


def test_gpu_used_and_annotate(path, sleeper):
    live = sleeper()
    with gs.locked() as state:
        state['gpus'][0]['leaked_mib'] = 10
        state['gpus'][0]['memory_reserved_mib'] = 5
        state['processes'] = [entry(live.pid, gs.starttime(live.pid), used_mib=100),
                              entry(live.pid, gs.starttime(live.pid), used_mib=None),
                              entry(live.pid, gs.starttime(live.pid) + 1, used_mib=1000)]
    state = gs.load()
    assert gs.gpu_used_mib(state, 0) == 115 and gs.gpu_used_mib(state, 1) == 0 and gs.gpu_used_mib(state, 9) is None
    shown = gs.annotate(state)
    assert [p['alive'] for p in shown['processes']] == [True, True, False]
    assert [p['counted_mib'] for p in shown['processes']] == [100, 0, 0]
    assert shown['gpus'][0]['used_mib'] == 115 and shown['gpus'][0]['free_mib'] == 81559 - 115
    assert 'alive' not in state['processes'][0]  # annotate works on a copy


def test_find_gpu():
    state = gs.new_state(gpus=4, seed='unit')
    gpu = state['gpus'][2]
    for ident in ('2', gpu['uuid'], gpu['uuid'].upper(), gpu['uuid'][4:], '00000000:48:00.0', '0000:48:00.0',
                  '48:00.0', '00000000:48:00.0 '):
        assert gs.find_gpu(state, ident) is gpu, ident
    for ident in ('9', 'GPU-nope', '00000000:49:00.0', ''):
        assert gs.find_gpu(state, ident) is None, ident


def test_new_state_shapes():
    state = gs.new_state(gpus=64, seed='unit')
    assert len(set(g['pci_bus_id'] for g in state['gpus'])) == 64
    assert len(set(g['uuid'] for g in state['gpus'])) == 64
    assert gs.new_state(seed='a')['gpus'][0]['uuid'] != gs.new_state(seed='b')['gpus'][0]['uuid']
    assert gs.new_state(seed='a')['gpus'][0]['uuid'] == gs.new_state(seed='a')['gpus'][0]['uuid']
    with pytest.raises(gs.StateError):
        gs.new_state(gpus=0)
    with pytest.raises(gs.StateError):
        gs.new_state(vendor='matrox')
    amd = gs.new_state(vendor='amd', gpus=1, dev_dir='/x')
    assert gs.device_paths(amd, amd['gpus'][0]) == ['/x/kfd', '/x/dri/renderD128']
    nv = gs.new_state(gpus=2, dev_dir='/x')
    assert gs.device_paths(nv, nv['gpus'][1]) == ['/x/nvidiactl', '/x/nvidia-uvm', '/x/nvidia1']


def test_apply_reset():
    state = gs.new_state(gpus=2, seed='unit')
    gpu = state['gpus'][0]
    gpu.update(leaked_mib=5, lost=True, ecc_uncorrected=3, util_pct=90)
    gpu['remapped_rows']['pending'] = True
    state['processes'] = [entry(1, 1, gpu=0), entry(2, 2, gpu=1)]
    gs.apply_reset(state, gpu)
    assert (gpu['leaked_mib'], gpu['lost'], gpu['ecc_uncorrected'], gpu['util_pct']) == (0, False, 0, 0)
    assert gpu['remapped_rows']['pending'] is False and gpu['reset_count'] == 1
    assert [p['gpu'] for p in state['processes']] == [1]
