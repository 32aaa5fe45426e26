# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.reset against the simulator: the fake NVML (in this process), the fake nvidia-smi and
amd-smi, the fake amdsmi package, and a temp sysfs tree for the Intel path.

SAFETY: every reset command is the simulator's fake (tests/sim/bin) or a stub runner; nothing
here can reach a real GPU.  Processes are started with ``gpusim spawn`` on a temp state (and
``gpusim kill-all`` cleans up) or by these tests themselves (reaped by their Popen handle).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, identity, kmod, reset
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import amd as amd_backend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import nvidia as nvidia_backend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.base import Backend, pci_bdf
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import BackendStatus, Device
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

SIM_BIN = os.path.join(h.sim_dir(), 'bin') if h.sim_dir() else None
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='the fake nvidia-smi resets only as root, like the real one')
BUS = ['00000000:07:00.0', '00000000:0B:00.0', '00000000:48:00.0']

BLOCKER = r'''
import os, sys, time
with open('/proc/self/comm', 'w') as handle:
    handle.write(sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.02)
'''

FAKE_SYSTEMCTL = r'''#!%(python)s
# Fake systemctl of the gpu_reset tests: logs its arguments; units.json maps a unit to the pid of
# a test process standing for its daemon and a stop file that makes that process exit.
import json, os, sys, time
base = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(base, 'systemctl.log'), 'a') as log:
    log.write(json.dumps(sys.argv[1:]) + '\n')
with open(os.path.join(base, 'units.json')) as handle:
    units = json.load(handle)
args = [a for a in sys.argv[1:] if not a.startswith('--')]
verb, unit = args[0], args[1]
info = units.get(unit)
if verb == 'is-active':
    sys.exit(0 if info and not os.path.exists(info['stopfile']) else 3)
if verb == 'stop':
    if info is None or info.get('fail_stop'):
        sys.stderr.write('Failed to stop %%s: Unit %%s not loaded.\n' %% (unit, unit))
        sys.exit(5)
    open(info['stopfile'], 'w').close()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with open('/proc/%%d/stat' %% info['pid']) as handle:
                if handle.read().rsplit(')', 1)[1].split()[0] in 'ZXx':
                    break
        except OSError:
            break
        time.sleep(0.02)
    sys.exit(0)
sys.exit(0 if verb == 'start' else 1)
'''


# ---------------------------------------------------------------------------- fixtures and helpers
class Recorder(object):
    """A runner that records every argv and runs it (argument lists only), with failure knobs:
    ``fail_reset`` is a set of nvidia-smi targets whose --gpu-reset answers an error without running,
    ``explode`` a set of targets whose --gpu-reset raises (a runner that breaks half-way)."""

    def __init__(self, fail_reset=(), explode=(), log=None):
        self.calls = []
        self.fail_reset = set(fail_reset)
        self.explode = set(explode)
        self.log = log if log is not None else []

    def __call__(self, argv):
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
        self.calls.append(argv)
        self.log.append(' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv)))
        if '--gpu-reset' in argv and argv[-1] in self.explode:
            raise RuntimeError('the runner broke')
        if '--gpu-reset' in argv and argv[-1] in self.fail_reset:
            return 255, 'GPU %s: Unknown Error\nTerminating early due to previous errors.\n' % argv[-1], ''
        return reset.run_command(argv, timeout=120)

    def verbs(self):
        return [tuple(a for a in argv[1:] if a != '-i' and not a.startswith('0000')) for argv in self.calls]


def tools(**overrides):
    found = {'nvidia-smi': os.path.join(SIM_BIN, 'nvidia-smi'), 'amd-smi': os.path.join(SIM_BIN, 'amd-smi'),
             'xpu-smi': None, 'systemctl': None}
    found.update(overrides)
    return found


def host_for(node, runner=None, **kwargs):
    kwargs.setdefault('tools', tools())
    kwargs.setdefault('amdsmi', False)
    return reset.Host(runner=runner or Recorder(), dev_roots=node.dev_roots, poll=0.05, **kwargs)


def run(node, check_mode=False, runner=None, host=None, **options):
    host = host or host_for(node, runner=runner)
    return reset.reset(reset.ResetOptions(**options), host, check_mode=check_mode)


def by_index(result):
    return dict((entry['index'], entry) for entry in result['resets'])


def check_of(entry, name):
    for check in entry['preconditions']:
        if check['name'] == name:
            return check
    raise AssertionError('no precondition %s in %s' % (name, entry['preconditions']))


def gpu_state(node, index):
    return node.show()['gpus'][index]


@pytest.fixture
def node():
    if h.sim_build() is None or h.gpusim_path() is None:
        pytest.skip('simulator not built: run `make sim`')
    with h.gpusim_node(gpus=3) as sim:
        yield sim


@pytest.fixture
def audit(tmp_path):
    return str(tmp_path / 'log' / 'actions.jsonl')


@pytest.fixture
def blocker(node, tmp_path):
    """A process named nv-hostengine holding the node's nvidiactl, and a fake systemctl whose unit
    nvidia-dcgm stands for it (``stop`` makes it exit).  Returns the fake's directory."""
    stopfile = str(tmp_path / 'dcgm.stop')
    fd = os.open(os.path.join(node.dev, 'nvidiactl'), os.O_RDONLY)
    try:
        proc = subprocess.Popen([sys.executable, '-c', BLOCKER, 'nv-hostengine', stopfile], pass_fds=[fd],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        os.close(fd)
    bindir = write_fake_systemctl(str(tmp_path / 'bin'), {'nvidia-dcgm': {'pid': proc.pid, 'stopfile': stopfile}})
    h.wait_for(lambda: _comm(proc.pid) == 'nv-hostengine', what='the blocker to start')
    try:
        yield bindir
    finally:
        if proc.poll() is None:
            proc.kill()  # our own child, by its Popen handle
        proc.wait(timeout=10)


def write_fake_systemctl(bindir, units):
    os.makedirs(bindir, exist_ok=True)
    path = os.path.join(bindir, 'systemctl')
    with open(path, 'w') as handle:
        handle.write(FAKE_SYSTEMCTL % {'python': sys.executable})
    os.chmod(path, 0o755)
    with open(os.path.join(bindir, 'units.json'), 'w') as handle:
        json.dump(units, handle)
    return bindir


def systemctl_log(bindir):
    try:
        with open(os.path.join(bindir, 'systemctl.log')) as handle:
            return [json.loads(line) for line in handle]
    except OSError:
        return []


def same_process(pid, start):
    """Whether ``pid`` still names the process that started at ``start`` (the reset drops dead entries from the state)."""
    try:
        return h.starttime(pid) == start and _state(pid) not in ('Z', 'X')
    except OSError:
        return False


def _state(pid):
    with open('/proc/%d/stat' % pid) as handle:
        return handle.read().rsplit(')', 1)[1].split()[0]


def _comm(pid):
    try:
        with open('/proc/%d/comm' % pid) as handle:
            return handle.read().strip()
    except OSError:
        return None


# ---------------------------------------------------------------------------- options and pure logic
@pytest.mark.parametrize('kwargs, field', [
    ({}, 'gpus'),
    ({'gpus': ['0'], 'all_gpus': True}, 'all'),
    ({'all_gpus': True, 'verify_timeout': -1}, 'verify_timeout'),
    ({'all_gpus': True, 'orphan_threshold_mib': True}, 'orphan_threshold_mib'),
    ({'all_gpus': True, 'stop_services': ['--now']}, 'stop_services'),
    ({'all_gpus': True, 'stop_services': ['dcgm; reboot']}, 'stop_services'),
])
def test_invalid_options_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as exc:
        reset.ResetOptions(**kwargs)
    assert exc.value.field == field


def test_needs_reset_reasons():
    dev = Device(vendor='nvidia', vendor_index=0, memory_used_mib=5000, orphaned_mib=5000)
    assert reset.needs_reset(dev, 1024) == ['5000 MiB of GPU memory held by no process (orphan_threshold_mib 1024)']
    assert reset.needs_reset(dev, 5000) == []
    dev.health.degrade('2 uncorrected volatile ECC error(s)', action='reset')
    assert reset.needs_reset(dev, 5000) == ['2 uncorrected volatile ECC error(s)']
    dev.health.recommended_action = 'reboot'
    dev.orphaned_mib = None
    assert reset.needs_reset(dev, 0) == []


def test_healthy_says_why_not():
    dev = Device(vendor='nvidia', vendor_index=0, memory_used_mib=0)
    dev.compute_orphaned()
    assert reset.healthy(dev, 0) is None
    dev.orphaned_mib = 10
    assert reset.healthy(dev, 0) == '10 MiB are still held by no process'
    dev.health.lose('gone')
    assert reset.healthy(dev, 0) == 'the GPU does not answer (lost)'
    assert reset.healthy(None, 0) == 'the GPU is not enumerated any more'


def test_pci_bdf_normalises_nvml_and_short_forms():
    assert pci_bdf('00000000:0B:00.0') == '0000:0b:00.0'
    assert pci_bdf('0000:0b:00.0') == '0000:0b:00.0'
    assert pci_bdf('29:00.0') == '0000:29:00.0'
    assert pci_bdf('zz:07:00.0') == 'zz:07:00.0'


def test_blocking_client_matches_names_and_truncated_comm():
    daemon = identity.Identity(4242, 1000, 'S', 1, 4242, 0, 'x', (0, 0, 0, 0),
                               identity.ExeIdentity('/usr/bin/nv-hostengine', False, 2049, 7, 0, 0o100755, False))

    class P(object):
        def __init__(self, name, exe=None, cmdline=None, ident=daemon):
            self.name, self.exe, self.cmdline, self.identity = name, exe, cmdline, ident
    assert reset.blocking_client(P('nvidia-persiste')) == ('nvidia-persistenced', 'nvidia-persistenced')
    assert reset.blocking_client(P('python3', cmdline=['/usr/bin/dcgm-exporter'])) == ('dcgm-exporter', 'dcgm-exporter')
    assert reset.blocking_client(P('Xorg')) == ('Xorg', 'display-manager')
    assert reset.blocking_client(P('python', exe='/usr/bin/python3.11', cmdline=['python', 'train.py'])) is None
    # a name is the user's text: her process named like a client is one of the GPU's processes (issue 15)
    users = identity.Identity(4242, 1000, 'S', 1, 4242, 0, 'x', (1001,) * 4, daemon.exe)
    assert reset.blocking_client(P('nv-hostengine', ident=users)) is None
    assert reset.blocking_client(P('nv-hostengine', ident=None)) is None


# ---------------------------------------------------------------------------- NVIDIA, against the simulator
@needs_root
def test_leaked_memory_is_cleared_and_persistence_restored(node, audit):
    node.gpusim('leak', '--gpu', '1', '--mib', '4096')
    runner = Recorder()
    result = run(node, runner=runner, gpus=['1'], audit_path=audit)
    gpu = by_index(result)[1]
    assert result['failed_gpus'] == [] and result['reset_gpus'] == [1] and result['changed'] is True
    assert gpu['status'] == 'reset' and gpu['verified'] is True and gpu['error'] is None
    assert gpu['before']['orphaned_mib'] == 4096 and gpu['after']['orphaned_mib'] == 0
    assert gpu['after']['health']['status'] == 'ok'
    assert gpu['method'] == 'nvidia-smi' and gpu['command'][1:] == ['--gpu-reset', '-i', BUS[1]]
    assert runner.calls == [[tools()['nvidia-smi'], '-pm', '0', '-i', BUS[1]], gpu['command'],
                            [tools()['nvidia-smi'], '-pm', '1', '-i', BUS[1]]]
    assert gpu['persistence_mode'] == {'before': True, 'switched_off': True, 'restored': True}
    state = gpu_state(node, 1)
    assert (state['leaked_mib'], state['reset_count'], state['persistence']) == (0, 1, True)
    assert gpu_state(node, 0)['reset_count'] == 0
    assert [c['name'] for c in gpu['preconditions']] == ['vendor', 'root', 'tool', 'mig', 'nvlink', 'fabric_manager',
                                                         'persistence_mode', 'nvml_session', 'recovery_action', 'kernel_modules',
                                                         'blocking_clients', 'processes']
    assert check_of(gpu, 'nvlink')['status'] == 'not_exposed' and check_of(gpu, 'fabric_manager')['status'] == 'not_exposed'
    assert check_of(gpu, 'nvml_session')['status'] == 'pass'
    log = audit_log.verify(audit)
    assert log['valid'] and log['lines'] == 1
    with open(audit) as handle:
        record = json.loads(handle.readline())
    assert record['event'] == 'gpu_reset' and record['gpu']['pci_bus_id'] == BUS[1] and record['verified'] is True
    assert record['after']['orphaned_mib'] == 0


@needs_root
def test_persistence_mode_off_is_left_alone(node):
    node.gpusim('set', '--gpu', '0', '--persistence', 'off')
    runner = Recorder()
    result = run(node, runner=runner, gpus=['0'])
    assert by_index(result)[0]['status'] == 'reset'
    assert runner.verbs() == [('--gpu-reset',)]
    assert gpu_state(node, 0)['persistence'] is False


@needs_root
def test_lost_gpu_is_found_reset_and_answers_again(node):
    node.gpusim('set', '--gpu', '2', '--persistence', 'off')
    node.gpusim('lose', '--gpu', '2')
    runner = Recorder()
    result = run(node, runner=runner, when_needed=True)
    gpu = by_index(result)[2]
    assert list(by_index(result)) == [2]
    assert gpu['before']['health']['status'] == 'lost' and gpu['pci_bus_id'] is None
    assert any('lost' in reason for reason in gpu['selected_because'])
    assert check_of(gpu, 'persistence_mode')['status'] == 'warn'
    assert gpu['command'][1:] == ['--gpu-reset', '-i', '2']  # no bus id from a lost GPU: the NVML index
    assert any('nvidia-smi -pm 0 failed' in w for w in result['warnings'])
    assert gpu['status'] == 'reset' and gpu['after']['health']['status'] == 'ok'
    assert gpu_state(node, 2)['lost'] is False and gpu_state(node, 2)['reset_count'] == 1


@needs_root
def test_refused_while_a_process_lives_then_done_with_kill_processes(node, audit):
    pid = node.spawn(gpu=0, mib=2048, children=2)
    family = [pid] + [c for c, _s in node.children(pid)]
    start = h.starttime(pid)
    runner = Recorder()
    refused = run(node, runner=runner, gpus=['0'], audit_path=audit)
    gpu = by_index(refused)[0]
    assert refused['failed_gpus'] == [0] and gpu['status'] == 'refused' and refused['changed'] is False
    assert check_of(gpu, 'processes')['status'] == 'fail'
    assert 'pid %d python' % pid in gpu['error'] and 'kill_processes: true' in gpu['error']
    assert 'kill_processes: true' in refused['msg'] and 'GPU 0 (%s)' % BUS[0] in refused['msg']
    assert set(p['pid'] for p in gpu['processes']) == set(family)
    assert runner.calls == [] and not os.path.exists(audit)
    assert node.alive(pid) and gpu_state(node, 0)['persistence'] is True and gpu_state(node, 0)['reset_count'] == 0

    done = run(node, gpus=['0'], kill_processes=True, kill_timeout=5, audit_path=audit)
    gpu = by_index(done)[0]
    assert gpu['status'] == 'reset', gpu['error']
    assert set(k['pid'] for k in gpu['killed']) == set(family)
    assert not same_process(pid, start) and gpu_state(node, 0)['reset_count'] == 1
    with open(audit) as handle:
        record = json.loads(handle.readline())
    assert pid in [k['pid'] for k in record['killed']]


@needs_root
def test_kill_escalates_to_sigkill(node):
    pid = node.spawn(gpu=1, mib=1024, ignore_term=True)
    result = run(node, gpus=['1'], kill_processes=True, kill_timeout=0.3)
    gpu = by_index(result)[1]
    assert gpu['status'] == 'reset'
    assert [k['signals'] for k in gpu['killed'] if k['pid'] == pid] == [['SIGTERM', 'SIGKILL']]


@needs_root
def test_when_needed_is_idempotent(node, audit):
    node.gpusim('leak', '--gpu', '1', '--mib', '4096')
    node.gpusim('leak', '--gpu', '2', '--mib', '512')  # below the default threshold: left alone
    first = run(node, when_needed=True, audit_path=audit)
    assert first['changed'] is True and first['reset_gpus'] == [1] and list(by_index(first)) == [1]
    runner = Recorder()
    second = run(node, runner=runner, when_needed=True, audit_path=audit)
    assert second['changed'] is False and second['resets'] == [] and second['failed_gpus'] == []
    assert second['msg'] == 'no GPU needs a reset' and runner.calls == []
    assert audit_log.verify(audit)['lines'] == 1
    assert gpu_state(node, 2)['leaked_mib'] == 512


@needs_root
def test_check_mode_touches_nothing(node, audit):
    node.gpusim('leak', '--gpu', '1', '--mib', '4096')
    pid = node.spawn(gpu=0, mib=2048)
    before = node.show()
    runner = Recorder()
    result = run(node, check_mode=True, runner=runner, all_gpus=True, kill_processes=True, drain=True, audit_path=audit)
    assert result['changed'] is True and result['failed_gpus'] == [] and result['reset_gpus'] == [0, 1, 2]
    gpus = by_index(result)
    assert all(g['status'] == 'would_reset' and g['would_reset'] and g['method'] is None for g in gpus.values())
    assert [k['pid'] for k in gpus[0]['would_kill']] == [pid] and gpus[0]['killed'] == []
    assert check_of(gpus[0], 'processes')['status'] == 'pass' and 'will be terminated' in check_of(gpus[0], 'processes')['detail']
    assert runner.calls == [] and not os.path.exists(audit)
    after = node.show()
    assert node.alive(pid)
    for old, new in zip(before['gpus'], after['gpus']):
        assert (new['leaked_mib'], new['persistence'], new['reset_count'], new['drain']) == \
            (old['leaked_mib'], old['persistence'], old['reset_count'], old['drain'])


@needs_root
def test_check_mode_reports_a_refusal_as_failure(node):
    pid = node.spawn(gpu=2, mib=1024)
    result = run(node, check_mode=True, gpus=['2'])
    assert result['failed_gpus'] == [2] and 'would fail' in result['msg']
    assert by_index(result)[2]['status'] == 'refused' and node.alive(pid)


@needs_root
def test_one_gpu_of_three_refused_the_others_reset(node, audit):
    for gpu in range(3):
        node.gpusim('leak', '--gpu', str(gpu), '--mib', '2048')
    protected = node.spawn(gpu=1, mib=1024, user='nobody')
    ordinary = node.spawn(gpu=2, mib=1024)
    ordinary_start = h.starttime(ordinary)
    result = run(node, all_gpus=True, kill_processes=True, protect_users=['nobody'], audit_path=audit)
    gpus = by_index(result)
    assert result['failed_gpus'] == [1] and result['reset_gpus'] == [0, 2] and result['changed'] is True
    assert gpus[1]['status'] == 'refused' and 'protected user nobody' in gpus[1]['error']
    assert 'GPU 1 (%s)' % BUS[1] in result['msg']
    assert gpus[0]['status'] == gpus[2]['status'] == 'reset'
    assert node.alive(protected) and not same_process(ordinary, ordinary_start)
    assert [gpu_state(node, i)['reset_count'] for i in range(3)] == [1, 0, 1]
    assert gpu_state(node, 1)['persistence'] is True and gpu_state(node, 1)['leaked_mib'] == 2048
    assert audit_log.verify(audit)['lines'] == 2


@needs_root
@pytest.mark.parametrize('knob, error', [('fail_reset', 'nvidia-smi --gpu-reset failed (rc 255): Terminating early'),
                                         ('explode', 'unexpected error: the runner broke')])
def test_one_gpu_of_three_failing_reset_does_not_stop_the_others(node, audit, knob, error):
    runner = Recorder(**{knob: {BUS[1]}})
    result = run(node, runner=runner, all_gpus=True, audit_path=audit)
    gpus = by_index(result)
    assert result['failed_gpus'] == [1] and result['reset_gpus'] == [0, 2]
    assert gpus[1]['status'] == 'failed' and error in gpus[1]['error']
    assert gpus[1]['persistence_mode'] == {'before': True, 'switched_off': True, 'restored': True}
    assert [gpu_state(node, i)['persistence'] for i in range(3)] == [True, True, True]
    assert [gpu_state(node, i)['reset_count'] for i in range(3)] == [1, 0, 1]
    lines = [json.loads(line) for line in open(audit)]
    assert [(r['gpu']['index'], r['status']) for r in lines] == [(0, 'reset'), (1, 'failed'), (2, 'reset')]


@needs_root
def test_reset_counts_only_when_verified(node):
    node.gpusim('set', '--gpu', '0', '--remapped-failure', 'on')  # a reset does not cure this
    result = run(node, gpus=['0'], verify_timeout=0.2)
    gpu = by_index(result)[0]
    assert gpu['status'] == 'failed' and gpu['verified'] is False and gpu['reset'] is False
    assert 'did not come back healthy' in gpu['error'] and 'row remapping failed' in gpu['error']
    assert gpu_state(node, 0)['reset_count'] == 1 and gpu_state(node, 0)['persistence'] is True


@needs_root
def test_missing_nvidia_smi_is_a_clear_refusal(node):
    node.gpusim('leak', '--gpu', '0', '--mib', '4096')
    runner = Recorder()
    result = run(node, host=host_for(node, runner=runner, tools=tools(**{'nvidia-smi': None})), when_needed=True)
    gpu = by_index(result)[0]
    assert gpu['status'] == 'refused' and check_of(gpu, 'tool')['status'] == 'fail'
    assert 'nvidia-smi was not found' in result['msg'] and 'PATH' in result['msg']
    assert runner.calls == [] and gpu_state(node, 0)['leaked_mib'] == 4096


@needs_root
def test_mig_mode_is_refused_with_guidance(node):
    node.gpusim('set', '--gpu', '0', '--mig', 'on')
    result = run(node, gpus=['0'])
    check = check_of(by_index(result)[0], 'mig')
    assert check['status'] == 'fail' and '-mig 0' in check['detail'] and 'mig -dgi' in check['detail']


@needs_root
def test_an_open_nvml_session_is_refused(node):
    import pynvml  # the shim, loaded by the node fixture
    pynvml.nvmlInit()
    try:
        result = run(node, gpus=['0'])
    finally:
        pynvml.nvmlShutdown()
    check = check_of(by_index(result)[0], 'nvml_session')
    assert check['status'] == 'fail' and '1 NVML session' in check['detail']
    assert gpu_state(node, 0)['reset_count'] == 0


@needs_root
def test_unknown_gpu_fails_before_anything(node):
    runner = Recorder()
    with pytest.raises(InvalidArgument) as exc:
        run(node, runner=runner, gpus=['0', '9'])
    assert exc.value.field == 'gpus' and exc.value.value == '9' and runner.calls == []


@needs_root
def test_drain_refused_by_the_driver_is_a_warning(node):
    result = run(node, gpus=['0'], drain=True)
    gpu = by_index(result)[0]
    assert gpu['status'] == 'reset'
    assert gpu['drain'] == {'requested': True, 'enabled': False, 'restored': None,
                            'detail': 'the driver refused to drain the GPU: not supported by this GPU or driver'}
    assert any('drain is best effort' in w for w in result['warnings'])


@needs_root
def test_drain_is_set_before_the_kill_and_undone_after_the_reset(node):
    pid = node.spawn(gpu=0, mib=1024)
    start = h.starttime(pid)
    runner = Recorder()
    nvml = FakeNvml(log=runner.log)
    result = run(node, host=host_for(node, runner=runner, nvml=nvml), gpus=['0'], drain=True, kill_processes=True)
    gpu = by_index(result)[0]
    assert gpu['status'] == 'reset' and not same_process(pid, start)
    assert gpu['drain'] == {'requested': True, 'enabled': True, 'restored': True,
                            'detail': 'drained: new clients cannot open the GPU until the reset is done'}
    assert runner.log == ['nvidia-smi -pm 0 -i %s' % BUS[0], 'drain %s 1' % BUS[0], 'nvidia-smi --gpu-reset -i %s' % BUS[0],
                          'drain %s 0' % BUS[0], 'nvidia-smi -pm 1 -i %s' % BUS[0]]


@needs_root
def test_nvlink_and_fabric_constraints_where_exposed(node):
    nvml = FakeNvml(links=(1, 1, 0), fabric=2)
    result = run(node, host=host_for(node, nvml=nvml), gpus=['0'])
    gpu = by_index(result)[0]
    assert check_of(gpu, 'nvlink')['status'] == 'warn' and '2 NVLink link(s) active' in check_of(gpu, 'nvlink')['detail']
    fabric = check_of(gpu, 'fabric_manager')
    assert fabric['status'] == 'fail' and 'in_progress' in fabric['detail'] and 'nvidia-fabricmanager' in fabric['detail']
    assert gpu['status'] == 'refused' and gpu_state(node, 0)['reset_count'] == 0
    assert nvml._nvmlLib_refcount == 0  # pylint: disable=protected-access


def test_nvml_helpers_against_the_shim(node):
    assert nvidia_backend.drain(BUS[0]) == (False, None)
    assert nvidia_backend.drain(BUS[0], True) == (None, 'not supported by this GPU or driver'
                                                  if os.geteuid() == 0 else 'no permission (needs root)')
    facts = nvidia_backend.reset_constraints(BUS[1])
    assert facts == {'nvlink_active': None, 'nvlink_error': 'not exposed by this driver', 'fabric_state': None,
                     'fabric_error': 'not exposed by this driver'}
    assert nvidia_backend.open_sessions() == 0


class FakeNvml(object):
    """Just enough of pynvml for drain and reset_constraints (the shim has neither NVLink nor a working drain)."""

    def __init__(self, links=(), fabric=None, log=None):
        import pynvml
        self.pynvml = pynvml
        for name in ('NVMLError', 'NVMLError_NotSupported', 'NVMLError_NoPermission', 'NVMLError_FunctionNotFound',
                     'NVMLError_InvalidArgument', 'NVMLError_GpuIsLost', 'nvmlPciInfo_t', 'c_nvmlGpuFabricInfo_t',
                     'NVML_FEATURE_ENABLED', 'NVML_FEATURE_DISABLED'):
            setattr(self, name, getattr(pynvml, name))
        self.NVML_NVLINK_MAX_LINKS = 18
        self.links, self.fabric = links, fabric
        self.log = log if log is not None else []
        self.drained = {}
        self._nvmlLib_refcount = 0

    def nvmlInit(self):
        self._nvmlLib_refcount += 1

    def nvmlShutdown(self):
        self._nvmlLib_refcount -= 1

    def nvmlSystemGetDriverVersion(self):
        return '550.54.15'

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return bus_id

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= len(self.links):
            raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.links[link]

    def nvmlDeviceGetGpuFabricInfo(self, handle, ref):
        if self.fabric is None:
            raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_NOT_SUPPORTED)
        ref._obj.state = self.fabric  # pylint: disable=protected-access

    def nvmlDeviceQueryDrainState(self, pci):
        return int(self.drained.get(_bus(pci), 0))

    def nvmlDeviceModifyDrainState(self, pci, state):
        self.log.append('drain %s %d' % (_bus(pci), state))
        self.drained[_bus(pci)] = state


def _bus(pci):
    value = pci.busId  # pynvml's structures hand strings back as str in recent releases, bytes in older ones
    return value.decode() if isinstance(value, bytes) else value


# ---------------------------------------------------------------------------- services and blocking clients
@needs_root
def test_blocking_client_is_named_and_refused(node, blocker):
    result = run(node, gpus=['0'])
    gpu = by_index(result)[0]
    check = check_of(gpu, 'blocking_clients')
    assert check['status'] == 'fail' and 'nv-hostengine (pid' in check['detail'] and 'stop_services: [nvidia-dcgm]' in check['detail']
    assert check_of(gpu, 'processes')['status'] == 'pass'
    assert [b['client'] for b in gpu['blocking_clients']] == ['nv-hostengine']
    assert gpu_state(node, 0)['reset_count'] == 0 and systemctl_log(blocker) == []


@needs_root
def test_stop_services_stops_the_blocker_and_starts_it_again(node, blocker):
    runner = Recorder()
    host = host_for(node, runner=runner, tools=tools(systemctl=os.path.join(blocker, 'systemctl')))
    result = run(node, host=host, gpus=['0', '1'], stop_services=['nvidia-dcgm', 'not-running'])
    assert result['reset_gpus'] == [0, 1] and result['failed_gpus'] == []
    assert check_of(by_index(result)[0], 'blocking_clients')['status'] == 'pass'
    assert result['services'] == {'requested': ['nvidia-dcgm', 'not-running'], 'stopped': ['nvidia-dcgm'],
                                  'not_active': ['not-running'], 'started': ['nvidia-dcgm'], 'errors': []}
    assert systemctl_log(blocker) == [['is-active', '--quiet', 'nvidia-dcgm'], ['stop', 'nvidia-dcgm'],
                                      ['is-active', '--quiet', 'not-running'], ['start', 'nvidia-dcgm']]
    assert [argv[1] for argv in runner.calls].index('start') == len(runner.calls) - 1  # started again at the very end


@needs_root
def test_a_failing_stop_resets_nothing(node, tmp_path):
    units = {'flaky': {'pid': os.getpid(), 'stopfile': str(tmp_path / 'x'), 'fail_stop': True}}
    bindir = write_fake_systemctl(str(tmp_path / 'bin'), units)
    host = host_for(node, tools=tools(systemctl=os.path.join(bindir, 'systemctl')))
    result = run(node, host=host, gpus=['0'], stop_services=['flaky'])
    assert result['failed_gpus'] == [0] and 'systemctl stop flaky failed (rc 5)' in result['msg']
    assert gpu_state(node, 0)['reset_count'] == 0


def test_stop_services_without_systemctl_is_refused(node):
    result = run(node, gpus=['0'], stop_services=['nvidia-dcgm'])
    check = check_of(by_index(result)[0], 'services')
    assert check['status'] == 'fail' and 'systemctl' in check['detail']


# ---------------------------------------------------------------------------- AMD
@pytest.fixture
def amd(monkeypatch):
    """An AMD node (gpusim --vendor amd) and the simulator's fake amdsmi package, imported for the test only."""
    if h.sim_build() is None or h.gpusim_path() is None:
        pytest.skip('simulator not built')
    saved = dict((k, v) for k, v in sys.modules.items() if k == 'amdsmi' or k.startswith('amdsmi.'))
    for name in saved:
        del sys.modules[name]
    path = os.path.join(h.sim_dir(), 'python')
    sys.path.insert(0, path)
    try:
        module = importlib.import_module('amdsmi')
    finally:
        sys.path.remove(path)
    node = h.GpuSim(gpus=2, init_args=('--vendor', 'amd'))
    monkeypatch.setenv('GPU_SIM_STATE', node.state)
    try:
        assert module.GPUSIM_FAKE is True
        node.amdsmi = module
        yield node
    finally:
        node.close()
        for name in [k for k in sys.modules if k == 'amdsmi' or k.startswith('amdsmi.')]:
            del sys.modules[name]
        sys.modules.update(saved)


def amd_host(node, library=True, runner=None, **kwargs):
    factories = {'amd': lambda: amd_backend.AmdBackend(amdsmi=node.amdsmi)}
    return host_for(node, runner=runner, factories=factories, amdsmi=node.amdsmi if library else False, **kwargs)


@needs_root
def test_amd_reset_through_the_library(amd):
    amd.gpusim('leak', '--gpu', '1', '--mib', '4096')
    runner = Recorder()
    result = run(amd, host=amd_host(amd, runner=runner), vendor='amd', when_needed=True)
    gpu = by_index(result)[1]
    assert gpu['status'] == 'reset' and gpu['method'] == 'amdsmi' and gpu['after']['orphaned_mib'] == 0
    assert check_of(gpu, 'persistence_mode')['status'] == 'not_applicable' and runner.calls == []
    assert gpu_state(amd, 1)['reset_count'] == 1


@needs_root
def test_amd_falls_back_to_amd_smi(amd):
    amd.gpusim('leak', '--gpu', '0', '--mib', '4096')
    result = run(amd, host=amd_host(amd, library=False), vendor='amd', gpus=['0'])
    gpu = by_index(result)[0]
    assert gpu['status'] == 'reset' and gpu['method'] == 'amd-smi', gpu['error']
    assert gpu['command'][1:] == ['reset', '--gpureset', '-g', gpu['pci_bus_id']] and 'Successfully reset GPU' in gpu['output']
    assert gpu_state(amd, 0)['reset_count'] == 1


@needs_root
@pytest.mark.parametrize('library, expected', [(True, 'the GPU is in use'), (False, 'GPU_RESET: Failed to reset GPU')])
def test_amd_refusal_is_read_from_the_library_and_the_cli_output(amd, library, expected):
    amd.spawn(gpu=0, mib=1024)
    host = amd_host(amd, library=library)
    snapshot = host.snapshot(vendor='amd')
    item = reset.GpuReset(snapshot.all_devices[0], ['test'])
    error = reset.reset_amd(item, host)  # straight to the vendor path, past the preconditions
    assert expected in error
    assert gpu_state(amd, 0)['reset_count'] == 0


def test_amd_without_library_or_cli_is_refused(amd):
    result = run(amd, host=amd_host(amd, library=False, tools=tools(**{'amd-smi': None})), vendor='amd', gpus=['0'])
    check = check_of(by_index(result)[0], 'tool')
    assert check['status'] == 'fail' and 'amd-smi' in check['detail']


# ---------------------------------------------------------------------------- Intel (sysfs seam) and Apple
class OneGpu(Backend):
    """A backend with one fixed GPU, standing in for the Intel and Apple backends that do not exist yet."""

    def __init__(self, vendor, bus_id=None, used_mib=0):
        self.name = vendor
        self.bus_id = bus_id
        self.used_mib = used_mib
        super(OneGpu, self).__init__()

    def probe(self):
        self.status = BackendStatus(name=self.name, available=True, version='test')
        return self.status

    def devices(self):
        return [Device(vendor=self.name, vendor_index=0, name='test GPU', pci_bus_id=self.bus_id, memory_total_mib=65536,
                       memory_used_mib=self.used_mib, memory_free_mib=None if self.used_mib is None else 65536 - self.used_mib)]


@pytest.fixture
def sysfs(tmp_path):
    device = tmp_path / 'sys' / 'bus' / 'pci' / 'devices' / '0000:29:00.0'
    device.mkdir(parents=True)
    (device / 'reset').write_text('')
    (device / 'reset_method').write_text('flr bus\n')
    return tmp_path / 'sys'


def intel_host(sysfs, used_mib=0, **kwargs):
    kwargs.setdefault('tools', tools())
    return reset.Host(factories={'intel': lambda: OneGpu('intel', '0000:29:00.0', used_mib)}, sys_root=str(sysfs),
                      runner=kwargs.pop('runner', Recorder()), poll=0.05, amdsmi=False, **kwargs)


@needs_root
def test_intel_reset_through_sysfs(sysfs):
    result = reset.reset(reset.ResetOptions(gpus=['0'], vendor='intel'), intel_host(sysfs))
    gpu = by_index(result)[0]
    assert gpu['status'] == 'reset' and gpu['method'] == 'sysfs' and gpu['output'] == 'reset methods: flr bus'
    assert (sysfs / 'bus' / 'pci' / 'devices' / '0000:29:00.0' / 'reset').read_text() == '1'
    assert check_of(gpu, 'mig')['status'] == 'not_applicable'


@needs_root
def test_a_driver_without_used_memory_verifies_with_a_warning(sysfs):
    result = reset.reset(reset.ResetOptions(gpus=['0'], vendor='intel'), intel_host(sysfs, used_mib=None))
    gpu = by_index(result)[0]
    assert gpu['status'] == 'reset' and gpu['verified'] is True and gpu['after']['orphaned_mib'] is None
    assert any('orphaned memory could not be checked' in w for w in result['warnings'])


@needs_root
def test_intel_reset_through_xpu_smi(sysfs):
    calls = []

    def stub(argv):
        calls.append(argv)
        return 0, 'Succeed to reset the GPU 0\n', ''
    host = intel_host(sysfs, runner=stub, tools=tools(**{'xpu-smi': '/opt/xpu/bin/xpu-smi'}))
    result = reset.reset(reset.ResetOptions(gpus=['0'], vendor='intel'), host)
    assert by_index(result)[0]['status'] == 'reset'
    assert calls == [['/opt/xpu/bin/xpu-smi', 'config', '-d', '0000:29:00.0', '--reset']]
    assert (sysfs / 'bus' / 'pci' / 'devices' / '0000:29:00.0' / 'reset').read_text() == ''


def test_intel_without_a_reset_method_is_refused(sysfs):
    os.unlink(str(sysfs / 'bus' / 'pci' / 'devices' / '0000:29:00.0' / 'reset'))
    result = reset.reset(reset.ResetOptions(gpus=['0'], vendor='intel'), intel_host(sysfs))
    check = check_of(by_index(result)[0], 'tool')
    assert check['status'] == 'fail' and '0000:29:00.0/reset is missing' in check['detail']


def test_apple_is_not_supported():
    host = reset.Host(factories={'apple': lambda: OneGpu('apple')}, tools=tools(), runner=Recorder(), amdsmi=False)
    result = reset.reset(reset.ResetOptions(all_gpus=True, vendor='apple'), host)
    gpu = by_index(result)[0]
    assert gpu['status'] == 'refused' and result['failed_gpus'] == [0]
    assert 'Apple GPUs cannot be reset' in result['msg']


def test_not_root_is_refused(sysfs):
    result = reset.reset(reset.ResetOptions(gpus=['0'], vendor='intel'), intel_host(sysfs, euid=1000))
    check = check_of(by_index(result)[0], 'root')
    assert check['status'] == 'fail' and 'become: true' in check['detail']


def test_default_runner_runs_argument_lists():
    assert reset.run_command([sys.executable, '-c', 'print("a b")']) == (0, 'a b\n', '')
    rc, _out, err = reset.run_command(['/nonexistent/tool'])
    assert rc == 127 and 'nonexistent' in err
    started = time.monotonic()
    assert reset.run_command([sys.executable, '-c', 'import time; time.sleep(5)'], timeout=0.2)[0] == 124
    assert time.monotonic() - started < 4


# ---------------------------------------------------------------------------- complete blockers (issue 17)
def sys_tree(root, modules):
    """A fake /sys/module tree: {name: (refcnt, [holders])}."""
    for name, (refcnt, holders) in modules.items():
        base = os.path.join(root, 'module', name)
        os.makedirs(os.path.join(base, 'holders'), exist_ok=True)
        with open(os.path.join(base, 'refcnt'), 'w') as handle:
            handle.write('%d\n' % refcnt)
        for holder in holders:
            open(os.path.join(base, 'holders', holder), 'w').close()
    return root


def test_module_refs_count_references_beyond_holders_and_uvm_files(tmp_path):
    root = sys_tree(str(tmp_path), {'nvidia_modeset': (1, ['nvidia_drm']), 'nvidia_drm': (2, []), 'nvidia_uvm': (3, [])})
    refs = dict((r.name, r) for r in kmod.module_refs(root, uvm_files=2))
    assert (refs['nvidia_modeset'].references, refs['nvidia_modeset'].holders) == (0, ['nvidia_drm'])
    assert refs['nvidia_drm'].references == 2 and 'nvidia_drm: 2 reference(s) (refcnt 2, holder modules none)' in refs['nvidia_drm'].describe()
    assert (refs['nvidia_uvm'].references, refs['nvidia_uvm'].explained) == (1, 2)
    assert [r.name for r in kmod.blocking(refs.values())] == ['nvidia_drm', 'nvidia_uvm']
    # not loaded: no directory, no reference; a malformed count is an error, not a number
    assert [r.loaded for r in kmod.module_refs(str(tmp_path / 'none'))] == [False, False, False]
    with open(os.path.join(root, 'module', 'nvidia_drm', 'refcnt'), 'w') as handle:
        handle.write('many\n')
    drm = kmod.module_refs(root)[0]
    assert drm.references == 0 and 'not a reference count' in drm.error


def test_module_refs_read_the_sys_root_seam(tmp_path, monkeypatch):
    root = sys_tree(str(tmp_path), {'nvidia_drm': (1, [])})
    monkeypatch.setenv(kmod.SYS_ROOT_ENV, root)
    assert kmod.sys_root() == root and reset.Host(tools={}).sys_root == root
    assert kmod.module_refs()[0].references == 1


def test_fabric_manager_and_imex_are_blocking_clients_only_with_a_trusted_identity():
    exe = identity.ExeIdentity('/usr/bin/nv-fabricmanager', False, 2049, 7, 0, 0o100755, False)
    system = identity.Identity(4242, 1000, 'S', 1, 4242, 0, 'x', (0, 0, 0, 0), exe)
    user = identity.Identity(4242, 1000, 'S', 1, 4242, 0, 'x', (1001,) * 4, exe)
    writable = identity.Identity(4242, 1000, 'S', 1, 4242, 0, 'x', (0, 0, 0, 0),
                                 identity.ExeIdentity('/tmp/nv-fabricmanager', False, 2049, 7, 1001, 0o100755, True))

    class P(object):
        def __init__(self, name, ident):
            self.name, self.exe, self.cmdline, self.identity = name, None, None, ident
    assert reset.blocking_client(P('nv-fabricmanager', system)) == ('nv-fabricmanager', 'nvidia-fabricmanager')
    assert reset.blocking_client(P('nvidia-imex', system)) == ('nvidia-imex', 'nvidia-imex')
    assert reset.blocking_client(P('nv-fabricmanager', user)) is None
    assert reset.blocking_client(P('nvidia-imex', writable)) is None


@needs_root
def test_a_kernel_reference_of_nvidia_drm_is_named_and_refused(node):
    node.gpusim('leak', '--gpu', '1', '--mib', '4096')
    node.gpusim('set', '--module-refcnt', 'nvidia_drm=1')
    host = host_for(node, sys_root=node.state[:-len('.json')] + '-sys')
    result = run(node, host=host, when_needed=True)
    gpu = by_index(result)[1]
    check = check_of(gpu, 'kernel_modules')
    assert gpu['status'] == 'refused' and check['status'] == 'fail'
    assert 'nvidia_drm: 1 reference(s) (refcnt 1, holder modules none)' in check['detail'] and 'modprobe -r nvidia_drm' in check['detail']
    assert gpu['reboot_recommended'] and 'nvidia_drm' in gpu['reboot_reason']
    assert [m['module'] for m in gpu['kernel_modules'] if m['references']] == ['nvidia_drm']
    assert gpu_state(node, 1)['reset_count'] == 0
    node.gpusim('set', '--module-refcnt', 'nvidia_drm=0')
    result = run(node, host=host, when_needed=True)
    assert result['reset_gpus'] == [1] and check_of(by_index(result)[1], 'kernel_modules')['status'] == 'pass'


@needs_root
def test_the_fake_nvidia_smi_names_a_reference_left_after_the_check(node):
    node.gpusim('leak', '--gpu', '0', '--mib', '4096')
    sysroot = node.state[:-len('.json')] + '-sys'

    class Late(Recorder):
        def __call__(self, argv):
            if '--gpu-reset' in argv:  # a console takes nvidia_drm between the check and the reset
                node.gpusim('set', '--module-refcnt', 'nvidia_drm=2')
            return Recorder.__call__(self, argv)
    result = run(node, host=host_for(node, runner=Late(), sys_root=sysroot), gpus=['0'])
    gpu = by_index(result)[0]
    assert gpu['status'] == 'failed' and 'kernel references keep the driver in use (nvidia_drm: 2 reference(s)' in gpu['error']
    assert gpu['reboot_recommended']


def test_a_reboot_recovery_action_is_refused_with_a_reboot_recommendation(node):
    host = host_for(node)
    snapshot = host.snapshot()
    snapshot.all_devices[0].recovery_action = 'reboot'
    host.snapshot = lambda vendor='auto', gather_processes=True: snapshot
    result = run(node, host=host, gpus=['0'])
    gpu = by_index(result)[0]
    assert gpu['status'] == 'refused' and check_of(gpu, 'recovery_action')['status'] == 'fail'
    assert gpu['reboot_recommended'] and 'recovery action is reboot' in gpu['reboot_reason']


@needs_root
def test_stop_services_auto_stops_the_blockers_unit_and_restores_it(node, blocker):
    host = host_for(node, tools=tools(systemctl=os.path.join(blocker, 'systemctl')))
    result = run(node, host=host, gpus=['0'], stop_services=['auto'], check_mode=True)
    assert check_of(by_index(result)[0], 'blocking_clients')['status'] == 'warn' and systemctl_log(blocker) == []
    result = run(node, host=host, gpus=['0'], stop_services=['auto'])
    assert result['reset_gpus'] == [0] and result['services']['stopped'] == ['nvidia-dcgm']
    assert systemctl_log(blocker) == [['is-active', '--quiet', 'nvidia-dcgm'], ['stop', 'nvidia-dcgm'], ['start', 'nvidia-dcgm']]


@needs_root
def test_stop_services_auto_is_restored_when_the_reset_fails(node, blocker):
    host = host_for(node, runner=Recorder(fail_reset=[BUS[0]]), tools=tools(systemctl=os.path.join(blocker, 'systemctl')))
    result = run(node, host=host, gpus=['0'], stop_services=['auto'])
    assert result['failed_gpus'] == [0] and result['services']['started'] == ['nvidia-dcgm']
    assert systemctl_log(blocker)[-1] == ['start', 'nvidia-dcgm']


def test_stop_services_auto_refuses_a_unit_it_may_not_stop():
    options = reset.ResetOptions(gpus=['0'], stop_services=['auto'])
    item = reset.GpuReset(Device(vendor='nvidia', vendor_index=0, index=0), ['requested'])
    display = {'pid': 77, 'name': 'Xorg', 'user': 'root', 'client': 'Xorg', 'unit': 'display-manager'}
    assert not reset._stoppable(display, options)
    assert reset._stoppable(dict(display, unit='nvidia-persistenced'), options)
    item.blockers = [display, dict(display, unit='nvidia-persistenced', client='nvidia-persistenced', pid=78)]
    assert reset._units_to_stop([item], options) == ['nvidia-persistenced']
