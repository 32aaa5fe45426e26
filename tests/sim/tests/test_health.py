"""Health scenarios of the simulator (issue #17): gpusim xid, set --recovery-action, hang, through the real pynvml."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import GPUSIM, run_python, shim_env

pytest.importorskip('pynvml')

EVENTS = r'''
import json, subprocess, sys
import pynvml as N
N.nvmlInit()
handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
out = {'supported': N.nvmlDeviceGetSupportedEventTypes(handles[0])}
es = N.nvmlEventSetCreate()
for h in handles:
    N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError, es)
# an event that happens after the registration is delivered; the one before it never is
subprocess.run([sys.executable, GPUSIM, 'xid', '--gpu', '1', '--code', '79'], check=True)
subprocess.run([sys.executable, GPUSIM, 'xid', '--gpu', '0', '--code', '13', '--pid', str(PID)], check=True)
got = []
for _ in range(5):
    try:
        data = N.nvmlEventSetWait_v2(es, 200)
    except N.NVMLError_Timeout:
        got.append('timeout')
        break
    got.append([N.nvmlDeviceGetIndex(data.device), int(data.eventType), int(data.eventData)])
out['events'] = got
N.nvmlEventSetFree(es)
print(json.dumps(out))
'''


def test_xid_event_api_and_kernel_log(gpusim_node, shim_dirs):
    gpusim_node.init('--gpus', '2')
    pid = gpusim_node.spawn('--gpu', '0', '--mib', '1024', argv=['python', 'train.py'])
    gpusim_node.run('xid', '--gpu', '0', '--code', '48')   # before any registration: never delivered
    code = EVENTS.replace('GPUSIM', repr(GPUSIM)).replace('PID', str(pid))
    with_env = dict(shim_env(gpusim_node.state, shim_dirs['full']))
    proc = subprocess.run([sys.executable, '-c', code], env=with_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out['supported'] & 0x8 and out['supported'] & 0x2
    assert sorted(out['events'][:2]) == [[0, 8, 13], [1, 8, 79]]
    assert out['events'][2] == 'timeout'
    state = gpusim_node.raw()
    assert [e['code'] for e in state['gpus'][0]['xid_events']] == [48, 13]
    assert state['gpus'][0]['xid_events'][1]['pid'] == pid
    with open(state['kmsg_path']) as handle:
        lines = handle.read().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith('4,') and ';NVRM: Xid (PCI:0000:07:00): 48, ' in lines[0]
    assert 'NVRM: Xid (PCI:0000:0b:00): 79, ' in lines[1] and 'GPU has fallen off the bus.' in lines[1]
    assert 'NVRM: Xid (PCI:0000:07:00): 13, pid=%d, name=python, ' % pid in lines[2]
    env = gpusim_node.run('env').stdout
    assert "export _GPUFLEET_KMSG=%s" % state['kmsg_path'] in env


def test_xid_bad_input(gpusim_node):
    gpusim_node.init('--gpus', '1')
    proc = gpusim_node.run('xid', '--gpu', '3', '--code', '79', check=False)
    assert proc.returncode == 2 and '3' in proc.stderr
    proc = gpusim_node.run('xid', '--gpu', '0', '--code', '-1', check=False)
    assert proc.returncode == 2 and '--code' in proc.stderr


RECOVERY = r'''
import json
import pynvml as N
N.nvmlInit()
out = []
for i in range(N.nvmlDeviceGetCount()):
    v = N.nvmlDeviceGetFieldValues(N.nvmlDeviceGetHandleByIndex(i), [N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 1])
    out.append([int(v[0].nvmlReturn), int(v[0].value.uiVal) if int(v[0].nvmlReturn) == 0 else None, int(v[1].nvmlReturn)])
print(json.dumps(out))
'''


@pytest.mark.parametrize('name, number', [('none', 0), ('reset', 1), ('reboot', 2), ('drain_p2p', 3), ('drain_and_reset', 4)])
def test_recovery_action_field(gpusim_node, shim_dirs, name, number):
    gpusim_node.init('--gpus', '2')
    gpusim_node.run('set', '--gpu', '1', '--recovery-action', name)
    out = run_python(RECOVERY, gpusim_node.state, shim_dirs['full'])
    assert out[0] == [3, None, 3]                # not set: NOT_SUPPORTED, as a driver before R550 answers
    assert out[1] == [0, number, 3]
    gpusim_node.run('set', '--gpu', '1', '--recovery-action', 'null')
    assert run_python(RECOVERY, gpusim_node.state, shim_dirs['full'])[1] == [3, None, 3]


def test_recovery_action_needs_a_gpu_and_a_known_name(gpusim_node):
    gpusim_node.init('--gpus', '1')
    assert gpusim_node.run('set', '--recovery-action', 'reboot', check=False).returncode != 0
    proc = gpusim_node.run('set', '--gpu', '0', '--recovery-action', 'explode', check=False)
    assert proc.returncode == 2 and 'explode' in proc.stderr


HANG = r'''
import json, time
import pynvml as N
N.nvmlInit()
t = time.time(); N.nvmlDeviceGetName(N.nvmlDeviceGetHandleByIndex(0)); other = time.time() - t
t = time.time(); N.nvmlDeviceGetName(N.nvmlDeviceGetHandleByIndex(1)); hung = time.time() - t
t = time.time(); N.nvmlDeviceGetName(N.nvmlDeviceGetHandleByIndex(1)); after = time.time() - t
print(json.dumps([other, hung, after]))
'''


def test_hang_blocks_the_next_calls_on_that_gpu_only(gpusim_node, shim_dirs):
    gpusim_node.init('--gpus', '2')
    gpusim_node.run('hang', '--gpu', '1', '--seconds', '1.5')
    assert gpusim_node.raw()['gpus'][1]['hang_until'] > time.time()
    other, hung, after = run_python(HANG, gpusim_node.state, shim_dirs['full'])
    assert other < 0.5
    assert 0.8 < hung < 5.0
    assert after < 0.5
    gpusim_node.run('hang', '--gpu', '1', '--seconds', '30')
    gpusim_node.run('hang', '--gpu', '1', '--seconds', '0')
    assert 'hang_until' not in gpusim_node.raw()['gpus'][1]


def test_r470_variant_serves_the_health_calls(gpusim_node, shim_dirs):
    gpusim_node.init('--gpus', '1', '--driver', 'r470')
    gpusim_node.run('set', '--gpu', '0', '--recovery-action', 'reset')
    assert run_python(RECOVERY, gpusim_node.state, shim_dirs['r470']) == [[0, 1, 3]]


def test_reset_clears_the_health_faults(gpusim_node):
    gpusim_node.init('--gpus', '1')
    gpusim_node.run('xid', '--gpu', '0', '--code', '48')
    gpusim_node.run('set', '--gpu', '0', '--recovery-action', 'reset', '--persistence', 'off')
    gpusim_node.run('hang', '--gpu', '0', '--seconds', '0.01')
    time.sleep(0.05)
    env = {'PATH': os.path.join(os.path.dirname(GPUSIM), 'bin') + ':' + os.environ.get('PATH', '')}
    gpusim_node.tool(os.path.join(os.path.dirname(GPUSIM), 'bin', 'nvidia-smi'), '-r', '-i', '0', env=env)
    gpu = gpusim_node.raw()['gpus'][0]
    assert gpu['xid_events'] == [] and 'recovery_action' not in gpu and 'hang_until' not in gpu
