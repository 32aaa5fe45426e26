# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gpusim CLI contract: init/show/env, spawn and its workload, leak/lose/set, kill-all.

Every test works on its own state file (the gpusim_node fixture) and only ever signals pids that
gpusim printed or that its state recorded; the fixture kills and checks everything afterwards.
"""

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAKE_AMD_SMI, FAKE_NVIDIA_SMI, GPUSIM, pid_alive, run_as, starttime, wait_until


def cmdline(pid):
    with open('/proc/%d/cmdline' % pid, 'rb') as f:
        return [a.decode('utf-8', 'surrogateescape') for a in f.read().split(b'\0')[:-1]]


def fd_targets(pid):
    out = []
    for name in os.listdir('/proc/%d/fd' % pid):
        try:
            out.append(os.readlink('/proc/%d/fd/%s' % (pid, name)))
        except OSError:
            pass
    return out


def stat_fields(pid):
    with open('/proc/%d/stat' % pid) as f:
        data = f.read()
    return data[data.rindex(')') + 2:].split()


def ppid(pid):
    return int(stat_fields(pid)[1])


def kill(pid, sig=signal.SIGKILL):
    os.kill(pid, sig)


# ---------------------------------------------------------------------------------------------
# init / show / env


def test_init_defaults_and_show(gpusim_node):
    gpusim_node.init()
    state = gpusim_node.show()
    assert state['schema'] == 1
    assert state['vendor'] == 'nvidia'
    assert state['driver'] == 'r550'
    assert state['driver_version'] == '550.54.15'
    assert state['release_delay_ms'] == 0
    assert state['dev_dir'] == gpusim_node.dev_dir
    assert state['processes'] == []
    gpus = state['gpus']
    assert [g['index'] for g in gpus] == [0, 1, 2, 3]
    assert [g['minor'] for g in gpus] == [0, 1, 2, 3]
    assert [g['pci_bus_id'] for g in gpus] == ['00000000:07:00.0', '00000000:0B:00.0', '00000000:48:00.0', '00000000:4C:00.0']
    assert len(set(g['uuid'] for g in gpus)) == 4
    for gpu in gpus:
        assert re.match(r'^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$', gpu['uuid'])
        assert gpu['name'] == 'NVIDIA A100-SXM4-80GB'
        assert gpu['memory_total_mib'] == 81559
        assert gpu['used_mib'] == 0 and gpu['free_mib'] == 81559
        assert gpu['persistence'] is True and gpu['lost'] is False and gpu['reset_count'] == 0
        assert gpu['fan_pct'] is None
    for name in ('nvidiactl', 'nvidia-uvm', 'nvidia0', 'nvidia3'):
        assert os.path.isfile(os.path.join(gpusim_node.dev_dir, name))


def test_init_options_amd(gpusim_node):
    gpusim_node.init('--gpus', '2', '--vendor', 'amd', '--release-delay-ms', '250')
    state = gpusim_node.show()
    assert state['vendor'] == 'amd' and state['release_delay_ms'] == 250
    assert [g['name'] for g in state['gpus']] == ['AMD Instinct MI250X'] * 2
    assert [g['memory_total_mib'] for g in state['gpus']] == [65520] * 2
    assert re.match(r'^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$', state['gpus'][0]['uuid'])
    assert os.path.isfile(os.path.join(gpusim_node.dev_dir, 'kfd'))
    assert os.path.isfile(os.path.join(gpusim_node.dev_dir, 'dri', 'renderD129'))


def test_init_model_memory_driver(gpusim_node):
    gpusim_node.init('--gpus', '8', '--model', 'NVIDIA H100 80GB HBM3', '--mem-mib', '81559', '--driver', 'r470')
    state = gpusim_node.show()
    assert state['driver'] == 'r470' and state['driver_version'].startswith('470.')
    assert len(state['gpus']) == 8
    assert len(set(g['pci_bus_id'] for g in state['gpus'])) == 8
    assert all(g['name'] == 'NVIDIA H100 80GB HBM3' for g in state['gpus'])


def test_uuids_are_deterministic_per_node_and_distinct_across_nodes(gpusim_node, tmp_path):
    gpusim_node.init()
    first = [g['uuid'] for g in gpusim_node.show()['gpus']]
    gpusim_node.init()
    assert [g['uuid'] for g in gpusim_node.show()['gpus']] == first
    other = str(tmp_path / 'other.json')
    gpusim_node.run('init', '--state', other)
    with open(other) as f:
        assert not set(first) & set(g['uuid'] for g in json.load(f)['gpus'])
    gpusim_node.run('init', '--uuid-seed', 'node-a')
    seeded = [g['uuid'] for g in gpusim_node.show()['gpus']]
    assert seeded != first and len(set(seeded)) == 4


def test_executables_run_through_their_shebang(gpusim_node):
    for path in (GPUSIM, FAKE_NVIDIA_SMI, FAKE_AMD_SMI):
        with open(path, 'rb') as f:
            assert f.readline() == b'#!/usr/bin/env python\n'  # ansible-test's shebang rule
        assert os.access(path, os.X_OK)
    gpusim_node.init('--gpus', '1')
    proc = subprocess.run([GPUSIM, 'show'], env=gpusim_node.env, stdout=subprocess.PIPE, universal_newlines=True,
                          check=True)
    assert json.loads(proc.stdout)['gpus'][0]['index'] == 0


def test_no_state_is_a_clear_error(gpusim_node):
    env = {'GPU_SIM_STATE': ''}
    proc = gpusim_node.run('show', check=False, env=env)
    assert proc.returncode == 1
    assert 'GPU_SIM_STATE' in proc.stderr
    proc = gpusim_node.run('env', check=False)
    assert proc.returncode == 1 and 'gpusim init' in proc.stderr


def test_create_dev_files_refuses_real_dev(gpusim_node):
    proc = gpusim_node.run('init', '--dev-dir', '/dev', '--create-dev-files', check=False)
    assert proc.returncode == 1 and '/dev' in proc.stderr
    assert not os.path.exists(gpusim_node.state)


def _source_env(node, *extra):
    script = 'eval "$(%s env %s)" && exec %s -c "import json, os; print(json.dumps(dict(os.environ)))"' % (
        GPUSIM, ' '.join(extra), sys.executable)
    proc = subprocess.run(['bash', '-c', script], env=dict(node.env, LD_LIBRARY_PATH='', PYTHONPATH=''),
                          stdout=subprocess.PIPE, universal_newlines=True, check=True)
    return json.loads(proc.stdout)


def test_env_nvidia(gpusim_node):
    gpusim_node.init()
    env = _source_env(gpusim_node)
    sim = os.path.dirname(os.path.realpath(GPUSIM))
    assert env['GPU_SIM_STATE'] == gpusim_node.state
    assert env['LD_LIBRARY_PATH'] == os.path.join(sim, 'build')  # no trailing ':' when it was empty
    assert env['PATH'].split(':')[:2] == [os.path.join(sim, 'bin'), sim]
    assert env.get('PYTHONPATH', '') == ''


def test_env_amd_r470_and_quoting(gpusim_node, tmp_path):
    odd = tmp_path / "it's a dir"
    odd.mkdir()
    path = str(odd / 'state.json')
    gpusim_node.run('init', '--state', path, '--vendor', 'amd', '--driver', 'r470')
    env = _source_env(gpusim_node, '--state', "'%s'" % path.replace("'", "'\\''"))
    sim = os.path.dirname(os.path.realpath(GPUSIM))
    assert env['GPU_SIM_STATE'] == path
    assert env['LD_LIBRARY_PATH'] == os.path.join(sim, 'build', 'r470')
    assert env['PYTHONPATH'] == os.path.join(sim, 'python')


# ---------------------------------------------------------------------------------------------
# spawn


def test_spawn_exact_argv_detached_and_registered(gpusim_node):
    gpusim_node.init()
    argv = ['python', 'train file.py', '', '--lr=0.1', u'caf\u00e9', '-- not an option']
    before = time.time()
    pid = gpusim_node.spawn('--gpu', '1', '--mib', '4096', '--util', '75', '--type', 'graphics', argv=argv)
    assert time.time() - before < 10
    assert cmdline(pid) == argv
    with open('/proc/%d/comm' % pid) as f:
        assert f.read().strip() == 'python'
    fields = stat_fields(pid)
    assert int(fields[3]) == pid  # session id: its own session (setsid), not gpusim's
    assert os.readlink('/proc/%d/fd/0' % pid) == '/dev/null'
    assert os.readlink('/proc/%d/fd/1' % pid) == '/dev/null'
    held = fd_targets(pid)
    for name in ('nvidiactl', 'nvidia-uvm', 'nvidia1'):
        assert os.path.join(gpusim_node.dev_dir, name) in held
    assert os.path.join(gpusim_node.dev_dir, 'nvidia0') not in held
    entry = gpusim_node.entry(pid)
    assert entry['alive'] is True
    assert entry['starttime'] == starttime(pid)
    assert entry['gpu'] == 1 and entry['used_mib'] == 4096 and entry['counted_mib'] == 4096
    assert entry['type'] == 'graphics' and entry['util_pct'] == 75
    assert entry['user'] == pwd.getpwuid(os.geteuid()).pw_name
    assert entry['argv'] == argv
    assert entry['children'] == [] and entry['supervisor_pid'] is None and entry['exited_at'] is None
    state = gpusim_node.show()
    assert [g['used_mib'] for g in state['gpus']] == [0, 4096, 0, 0]


def test_spawn_comm_is_argv0_basename(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '10', argv=['/opt/miner/xmrig', '-o', 'pool:3333'])
    with open('/proc/%d/comm' % pid) as f:
        assert f.read().strip() == 'xmrig'


def test_spawn_env(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '1', '--env', 'CUDA_VISIBLE_DEVICES=0', '--env', 'SLURM_JOB_ID=42')
    with open('/proc/%d/environ' % pid, 'rb') as f:
        env = dict(item.split(b'=', 1) for item in f.read().split(b'\0') if b'=' in item)
    assert env[b'CUDA_VISIBLE_DEVICES'] == b'0' and env[b'SLURM_JOB_ID'] == b'42'
    assert not [k for k in env if k.startswith(b'GPUSIM_')]


def test_spawn_mib_null(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '0', '--mib-null')
    entry = gpusim_node.entry(pid)
    assert entry['used_mib'] is None and entry['counted_mib'] == 0 and entry['alive'] is True


def test_unknown_gpu_exits_2_and_leaves_state_unchanged(gpusim_node):
    gpusim_node.init('--gpus', '2')
    with open(gpusim_node.state, 'rb') as f:
        before = f.read()
    for args in (['spawn', '--gpu', '7', '--mib', '1', '--', 'python'], ['leak', '--gpu', '7', '--mib', '1'],
                 ['lose', '--gpu', '7'], ['set', '--gpu', '7', '--util', '5']):
        proc = gpusim_node.run(*args, check=False)
        assert proc.returncode == 2, args
        assert '7' in proc.stderr and 'unknown GPU' in proc.stderr
    with open(gpusim_node.state, 'rb') as f:
        assert f.read() == before


def test_spawn_usage_errors(gpusim_node):
    gpusim_node.init()
    proc = gpusim_node.run('spawn', '--gpu', '0', '--mib', '1', check=False)
    assert proc.returncode != 0 and 'argv' in proc.stderr
    proc = gpusim_node.run('spawn', '--gpu', '0', '--', 'python', check=False)
    assert proc.returncode != 0 and '--mib' in proc.stderr
    proc = gpusim_node.run('spawn', '--gpu', '0', '--mib', '1', '--user', 'no-such-user-gpusim', '--', 'x', check=False)
    assert proc.returncode == 1 and 'no-such-user-gpusim' in proc.stderr
    assert gpusim_node.show()['processes'] == []


def test_spawn_refused_on_lost_gpu(gpusim_node):
    gpusim_node.init()
    gpusim_node.run('lose', '--gpu', '2')
    proc = gpusim_node.run('spawn', '--gpu', '2', '--mib', '1', '--', 'python', check=False)
    assert proc.returncode == 1 and 'lost' in proc.stderr


def test_default_sigterm_kills(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '100')
    kill(pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(pid))
    entry = gpusim_node.entry(pid)
    assert entry['alive'] is False and entry['counted_mib'] == 0
    assert gpusim_node.gpu(0)['used_mib'] == 0


def test_ignore_term(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '100', '--ignore-term')
    start = starttime(pid)
    kill(pid, signal.SIGTERM)
    time.sleep(0.3)
    assert pid_alive(pid, start)
    assert gpusim_node.entry(pid)['alive'] is True
    kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid, start))
    assert gpusim_node.entry(pid)['alive'] is False


def test_children_registered_share_devices_and_outlive_parent(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '2', '--mib', '2048', '--children', '3')
    entry = gpusim_node.entry(pid)
    kids = entry['children']
    assert len(kids) == 3 and len(entry['children_starttime']) == 3
    assert entry['children_alive'] == kids
    for kid, start in zip(kids, entry['children_starttime']):
        assert ppid(kid) == pid
        assert starttime(kid) == start
        assert cmdline(kid) == cmdline(pid)
        assert os.path.join(gpusim_node.dev_dir, 'nvidia2') in fd_targets(kid)
    # a dead child does not end the parent
    kill(kids[0])
    wait_until(lambda: not pid_alive(kids[0]))
    time.sleep(0.1)
    assert pid_alive(pid)
    # the parent killed, the remaining children keep the memory "used"
    kill(pid)
    wait_until(lambda: not pid_alive(pid))
    entry = gpusim_node.entry(pid)
    assert entry['alive'] is False
    assert entry['children_alive'] == kids[1:]
    assert entry['counted_mib'] == 2048
    assert gpusim_node.gpu(2)['used_mib'] == 2048
    for kid in kids[1:]:
        kill(kid)
    wait_until(lambda: not any(pid_alive(k) for k in kids))
    assert gpusim_node.entry(pid)['counted_mib'] == 0
    assert gpusim_node.gpu(2)['used_mib'] == 0


def test_lifetime_and_child_lifetime(gpusim_node):
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '10', '--children', '1', '--lifetime', '0.3',
                            '--child-lifetime', '30')
    kid = gpusim_node.entry(pid)['children'][0]
    wait_until(lambda: not pid_alive(pid), timeout=5)
    assert pid_alive(kid)
    assert gpusim_node.gpu(0)['used_mib'] == 10
    short = gpusim_node.spawn('--gpu', '1', '--mib', '10', '--lifetime', '0.2')
    wait_until(lambda: not pid_alive(short), timeout=5)


@pytest.mark.skipif(os.geteuid() != 0, reason='--user needs root')
def test_spawn_as_user_nobody(gpusim_node):
    try:
        nobody = pwd.getpwnam('nobody')
    except KeyError:
        pytest.skip('no user nobody here')
    gpusim_node.init()
    pid = gpusim_node.spawn('--gpu', '3', '--mib', '64', '--user', 'nobody', '--children', '1')
    entry = gpusim_node.entry(pid)
    assert entry['user'] == 'nobody'
    for p in [pid] + entry['children']:
        assert os.stat('/proc/%d' % p).st_uid == nobody.pw_uid  # dumpable: /proc/PID owned by the user
        with open('/proc/%d/status' % p) as f:
            uids = [line.split()[1:] for line in f if line.startswith('Uid:')][0]
        assert uids == [str(nobody.pw_uid)] * 4
    assert os.path.join(gpusim_node.dev_dir, 'nvidia3') in fd_targets(pid)
    with open('/proc/%d/environ' % pid, 'rb') as f:
        assert b'USER=nobody' in f.read().split(b'\0')


def test_dead_process_not_alive_and_memory_freed(gpusim_node):
    gpusim_node.init()
    keep = gpusim_node.spawn('--gpu', '0', '--mib', '1000')
    gone = gpusim_node.spawn('--gpu', '0', '--mib', '500')
    assert gpusim_node.gpu(0)['used_mib'] == 1500
    kill(gone)
    wait_until(lambda: not pid_alive(gone))
    state = gpusim_node.show()
    by_pid = dict((e['pid'], e) for e in state['processes'])
    assert by_pid[gone]['alive'] is False and by_pid[gone]['counted_mib'] == 0
    assert by_pid[keep]['alive'] is True and by_pid[keep]['counted_mib'] == 1000
    assert state['gpus'][0]['used_mib'] == 1000


def test_attach_lists_a_live_workload_on_a_second_gpu_until_it_dies(gpusim_node):
    gpusim_node.init('--gpus', '2')
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '1000', '--children', '1')
    kid = gpusim_node.entry(pid)['children'][0]
    gpusim_node.run('attach', '--pid', pid, '--gpu', '1', '--mib', '300')
    state = gpusim_node.show()
    assert sorted(e['gpu'] for e in state['processes'] if e['pid'] == pid) == [0, 1]
    assert [g['used_mib'] for g in state['gpus']] == [1000, 300]
    for args, code, text in ((['--pid', pid, '--gpu', '1', '--mib', '1'], 1, 'already holds memory on GPU 1'),
                             (['--pid', pid, '--gpu', '7', '--mib', '1'], 2, 'unknown GPU'),
                             (['--pid', kid, '--gpu', '1', '--mib', '1'], 1, 'no live workload')):
        proc = gpusim_node.run('attach', *args, check=False)
        assert proc.returncode == code and text in proc.stderr, (args, proc.stderr)
    if os.geteuid() == 0:
        proc = run_as(pwd.getpwnam('nobody'), gpusim_node, GPUSIM, 'attach', '--pid', str(pid), '--gpu', '1', '--mib', '1')
        assert proc.returncode == 1 and 'run it as root' in proc.stderr, proc.stderr
    out = json.loads(gpusim_node.run('kill-all').stdout)
    assert sorted(out['signalled']) == sorted([pid, kid])      # one signal per process, however many GPUs it is on
    wait_until(lambda: not pid_alive(pid) and not pid_alive(kid))
    assert [g['used_mib'] for g in gpusim_node.show()['gpus']] == [0, 0]


def test_release_delay_supervisor(gpusim_node):
    gpusim_node.init('--release-delay-ms', '2000')
    pid = gpusim_node.spawn('--gpu', '1', '--mib', '3000')
    entry = gpusim_node.entry(pid)
    sup = entry['supervisor_pid']
    assert sup and sup != pid and ppid(pid) == sup
    assert entry['supervisor_starttime'] == starttime(sup)
    assert 'nvidia1' not in ' '.join(fd_targets(sup))  # the supervisor holds no device
    assert cmdline(pid) == ['python', 'train.py']
    kill(pid)
    killed_at = time.time()
    wait_until(lambda: not pid_alive(pid))
    # counted while the supervisor has not written exited_at, then until exited_at + delay
    assert gpusim_node.entry(pid)['counted_mib'] == 3000
    entry = wait_until(lambda: [e for e in gpusim_node.show()['processes'] if e['exited_at'] is not None], timeout=5)[0]
    assert abs(entry['exited_at'] - killed_at) < 2.0
    if time.time() < entry['exited_at'] + 1.5:
        assert entry['counted_mib'] == 3000 and entry['alive'] is False
    wait_until(lambda: not pid_alive(sup, entry['supervisor_starttime']), timeout=5)
    wait_until(lambda: time.time() > entry['exited_at'] + 2.1, timeout=5)
    assert gpusim_node.entry(pid)['counted_mib'] == 0
    assert gpusim_node.gpu(1)['used_mib'] == 0


def test_short_lived_supervised_workload_still_gets_exited_at(gpusim_node):
    gpusim_node.init('--release-delay-ms', '100')
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '5', '--lifetime', '0')
    wait_until(lambda: gpusim_node.entry(pid)['exited_at'] is not None, timeout=8)


# ---------------------------------------------------------------------------------------------
# leak / lose / set


def test_leak_lose_set(gpusim_node):
    gpusim_node.init()
    gpusim_node.run('leak', '--gpu', '1', '--mib', '700')
    gpusim_node.run('leak', '--gpu', '1', '--mib', '300')
    gpu = gpusim_node.gpu(1)
    assert gpu['leaked_mib'] == 1000 and gpu['used_mib'] == 1000 and gpu['free_mib'] == 81559 - 1000
    gpusim_node.run('lose', '--gpu', '3')
    assert gpusim_node.gpu(3)['lost'] is True
    gpusim_node.run('set', '--gpu', '0', '--util', '97', '--temp', '81', '--power', '390.5', '--ecc-uncorrected', '3',
                    '--no-permission', 'on', '--persistence', 'off', '--release-delay-ms', '800', '--mem-util', '40',
                    '--fan', 'null', '--drain', 'on', '--remapped-pending', 'on', '--reserved-mib', '512')
    state = gpusim_node.show()
    gpu = state['gpus'][0]
    assert (gpu['util_pct'], gpu['temp_c'], gpu['power_w'], gpu['ecc_uncorrected']) == (97, 81, 390.5, 3)
    assert gpu['no_permission'] is True and gpu['persistence'] is False and gpu['drain'] is True
    assert gpu['mem_util_pct'] == 40 and gpu['fan_pct'] is None and gpu['remapped_rows']['pending'] is True
    assert gpu['memory_reserved_mib'] == 512 and gpu['used_mib'] == 512
    assert state['release_delay_ms'] == 800
    assert state['gpus'][1]['util_pct'] == 0
    gpusim_node.run('set', '--release-delay-ms', '0')
    gpusim_node.run('set', '--gpu', 'all', '--persistence', 'on', '--lost', 'off')
    state = gpusim_node.show()
    assert state['release_delay_ms'] == 0
    assert all(g['persistence'] and not g['lost'] for g in state['gpus'])
    proc = gpusim_node.run('set', '--gpu', '0', '--util', '101', check=False)
    assert proc.returncode == 2


# ---------------------------------------------------------------------------------------------
# concurrency and kill-all


def test_concurrent_spawns_do_not_corrupt_the_state(gpusim_node):
    gpusim_node.init('--gpus', '4')
    procs = [subprocess.Popen([sys.executable, GPUSIM, 'spawn', '--gpu', str(i % 4), '--mib', str(100 + i), '--', 'worker', str(i)],
                              env=gpusim_node.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True) for i in range(20)]
    pids = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        pids.append(int(out.strip()))
    assert len(set(pids)) == 20
    with open(gpusim_node.state) as f:
        raw = json.load(f)  # valid JSON, written atomically
    assert sorted(e['pid'] for e in raw['processes']) == sorted(pids)
    state = gpusim_node.show()
    assert all(e['alive'] for e in state['processes'])
    for i in range(4):
        assert state['gpus'][i]['used_mib'] == sum(100 + n for n in range(20) if n % 4 == i)
    for entry in state['processes']:
        assert entry['argv'] == ['worker', str(entry['used_mib'] - 100)]
    assert not [n for n in os.listdir(os.path.dirname(gpusim_node.state)) if '.tmp.' in n]


def test_kill_all_touches_only_its_own_state(gpusim_node, tmp_path):
    gpusim_node.init()
    mine = gpusim_node.spawn('--gpu', '0', '--mib', '1', '--children', '2', '--ignore-term')
    kids = gpusim_node.entry(mine)['children']
    other_state = str(tmp_path / 'other.json')
    gpusim_node.run('init', '--state', other_state)
    other = int(gpusim_node.run('spawn', '--state', other_state, '--gpu', '0', '--mib', '1', '--', 'other').stdout)
    try:
        out = json.loads(gpusim_node.run('kill-all').stdout)
        assert sorted(out['signalled']) == sorted([mine] + kids) and out['remaining'] == []
        assert not pid_alive(mine) and not any(pid_alive(k) for k in kids)
        assert pid_alive(other)
    finally:
        gpusim_node.run('kill-all', '--state', other_state)
    assert not pid_alive(other)


def test_kill_all_never_signals_a_reused_pid(gpusim_node):
    """An entry whose pid now belongs to another process (other starttime) is left alone."""
    gpusim_node.init()
    bystander = subprocess.Popen(['sleep', '30'])
    try:
        with open(gpusim_node.state) as f:
            state = json.load(f)
        state['processes'].append({'pid': bystander.pid, 'starttime': starttime(bystander.pid) - 1, 'gpu': 0,
                                   'used_mib': 5, 'type': 'compute', 'util_pct': 0, 'children': [bystander.pid],
                                   'children_starttime': [starttime(bystander.pid) - 1], 'user': 'x',
                                   'argv': ['x'], 'supervisor_pid': None, 'exited_at': None})
        with open(gpusim_node.state, 'w') as f:
            json.dump(state, f)
        assert gpusim_node.entry(bystander.pid)['alive'] is False
        out = json.loads(gpusim_node.run('kill-all').stdout)
        assert out['signalled'] == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_kill_all_prune(gpusim_node):
    gpusim_node.init()
    gpusim_node.spawn('--gpu', '0', '--mib', '1')
    gpusim_node.run('kill-all', '--prune')
    assert gpusim_node.show()['processes'] == []
