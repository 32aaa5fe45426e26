"""The shim's C ABI checked with raw ctypes: return codes, struct layouts, size protocol, robustness."""

import json
import os

from conftest import CTYPES_PRELUDE, make_gpu, make_process, run_python, write_raw_state, write_state

MIB = 1 << 20


def run_ctypes(body, state_path, lib_dir):
    return run_python(CTYPES_PRELUDE + body, state_path, lib_dir)


def test_init_refcount_and_uninitialized(shim_dirs, state_path):
    write_state(state_path, gpus=2)
    body = '''
n = c_uint(0)
out = [lib.nvmlDeviceGetCount_v2(byref(n)), lib.nvmlShutdown()]
out += [lib.nvmlInit_v2(), lib.nvmlInitWithFlags(0), lib.nvmlInit(), lib.nvmlShutdown(), lib.nvmlShutdown()]
out += [lib.nvmlDeviceGetCount_v2(byref(n)), n.value, lib.nvmlDeviceGetCount(byref(n)), n.value]
out += [lib.nvmlShutdown(), lib.nvmlDeviceGetCount_v2(byref(n)), lib.nvmlShutdown()]
print(json.dumps(out))
'''
    assert run_ctypes(body, state_path, shim_dirs['full']) == [1, 1, 0, 0, 0, 0, 0, 0, 2, 0, 2, 0, 1, 1]


def test_error_strings_and_strings(shim_dirs, state_path):
    write_state(state_path, gpus=[make_gpu(0, name='NVIDIA A100-SXM4-80GB')])
    body = '''
assert lib.nvmlInit_v2() == 0
h = handle(0)
small = ctypes.create_string_buffer(5)
big = ctypes.create_string_buffer(96)
out = [lib.nvmlErrorString(c).decode() for c in (0, 3, 4, 9, 13, 15, 25, 12345)]
out += [lib.nvmlDeviceGetName(h, small, c_uint(5)), lib.nvmlDeviceGetName(h, big, c_uint(96)), big.value.decode()]
out += [lib.nvmlDeviceGetName(h, big, c_uint(21)), lib.nvmlDeviceGetName(h, big, c_uint(22))]
drv = ctypes.create_string_buffer(80)
out += [lib.nvmlSystemGetDriverVersion(drv, c_uint(80)), drv.value.decode()]
out += [lib.nvmlDeviceGetName(c_void_p(12345), big, c_uint(96)), lib.nvmlDeviceGetName(None, big, c_uint(96))]
print(json.dumps(out))
'''
    out = run_ctypes(body, state_path, shim_dirs['full'])
    assert out[:8] == ['Success', 'Not Supported', 'Insufficient Permissions', 'Driver Not Loaded', 'Function Not Found',
                       'GPU is lost', 'Argument version mismatch', 'Unknown Error']
    assert out[8:11] == [7, 0, 'NVIDIA A100-SXM4-80GB']
    assert out[11:13] == [7, 0]   # 21 characters need 22 bytes
    assert out[13:15] == [0, '550.54.15']
    assert out[15:] == [2, 2]     # a pointer that is no handle, NULL


def test_two_call_size_protocol(shim_dirs, state_path, spawn):
    a, b = spawn(), spawn()
    write_state(state_path, gpus=2, processes=[make_process(a.pid, used_mib=10), make_process(b.pid, used_mib=None)])
    body = '''
assert lib.nvmlInit_v2() == 0
out = {}
for name, entry in (('nvmlDeviceGetComputeRunningProcesses_v3', ProcV2), ('nvmlDeviceGetComputeRunningProcesses_v2', ProcV2),
                    ('nvmlDeviceGetComputeRunningProcesses', ProcV1)):
    fn = getattr(lib, name)
    n = c_uint(0)
    r = [fn(handle(0), byref(n), None), n.value]
    n = c_uint(1)
    buf = (entry * 1)()
    r += [fn(handle(0), byref(n), buf), n.value]
    n = c_uint(8)
    buf = (entry * 8)()
    r += [fn(handle(0), byref(n), buf), n.value, [[e.pid, e.usedGpuMemory] for e in buf[:n.value]]]
    if entry is ProcV2:
        r.append([[e.gpuInstanceId, e.computeInstanceId] for e in buf[:n.value]])
    n = c_uint(0)
    r += [fn(handle(1), byref(n), None), n.value, fn(handle(0), None, None)]
    out[name] = r
print(json.dumps(out))
'''
    out = run_ctypes(body, state_path, shim_dirs['full'])
    entries = [[a.pid, 10 * MIB], [b.pid, 0xFFFFFFFFFFFFFFFF]]
    no_mig = [[0xFFFFFFFF, 0xFFFFFFFF]] * 2
    assert out['nvmlDeviceGetComputeRunningProcesses_v3'] == [7, 2, 7, 2, 0, 2, entries, no_mig, 0, 0, 2]
    assert out['nvmlDeviceGetComputeRunningProcesses_v2'] == [7, 2, 7, 2, 0, 2, entries, no_mig, 0, 0, 2]
    # The old unversioned symbol uses the 16-byte v1 entry.
    assert out['nvmlDeviceGetComputeRunningProcesses'] == [7, 2, 7, 2, 0, 2, entries, 0, 0, 2]


def test_struct_versions_and_pci_variants(shim_dirs, state_path):
    write_state(state_path, gpus=[make_gpu(0, pci_bus_id='00000000:1A:00.0', temp_c=50)])
    body = '''
assert lib.nvmlInit_v2() == 0
h = handle(0)
out = {}
m = MemV2()
out['mem_no_version'] = lib.nvmlDeviceGetMemoryInfo_v2(h, byref(m))
m.version = 0x02000028
out['mem_v2'] = [lib.nvmlDeviceGetMemoryInfo_v2(h, byref(m)), m.total // (1 << 20)]
t = TempV1(version=0x0200000C)
out['temp_bad'] = lib.nvmlDeviceGetTemperatureV(h, byref(t))
t = TempV1(version=0x0100000C, sensorType=0)
out['temp'] = [lib.nvmlDeviceGetTemperatureV(h, byref(t)), t.temperature]
for name in ('nvmlDeviceGetPciInfo_v3', 'nvmlDeviceGetPciInfo_v2', 'nvmlDeviceGetPciInfo'):
    p = Pci()
    out[name] = [getattr(lib, name)(h, byref(p)), p.busId.decode(), p.busIdLegacy.decode(), p.domain, p.bus, p.device]
found = []
for bus_id in (b'00000000:1A:00.0', b'0000:1a:00.0', b'1a:00.0', b'00000000:1B:00.0', b'garbage'):
    h2 = c_void_p()
    rc = lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus_id), byref(h2))
    found.append([rc, h2.value == h.value if rc == 0 else None])
out['by_bus'] = found
h3 = c_void_p()
out['by_uuid_missing'] = lib.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(b'GPU-nope'), byref(h3))
out['by_index_missing'] = lib.nvmlDeviceGetHandleByIndex_v2(c_uint(7), byref(h3))
print(json.dumps(out))
'''
    out = run_ctypes(body, state_path, shim_dirs['full'])
    assert out['mem_no_version'] == 25
    assert out['mem_v2'] == [0, 81559]
    assert out['temp_bad'] == 25
    assert out['temp'] == [0, 50]
    for name in ('nvmlDeviceGetPciInfo_v3', 'nvmlDeviceGetPciInfo_v2', 'nvmlDeviceGetPciInfo'):
        assert out[name] == [0, '00000000:1A:00.0', '0000:1A:00.0', 0, 0x1A, 0], name
    assert out['by_bus'] == [[0, True], [0, True], [0, True], [6, None], [2, None]]
    assert out['by_uuid_missing'] == 6
    assert out['by_index_missing'] == 2


def test_drain_state(shim_dirs, state_path):
    write_state(state_path, gpus=[make_gpu(0, drain=True), make_gpu(1)])
    body = '''
assert lib.nvmlInit_v2() == 0
out = []
for i in (0, 1):
    p = Pci()
    assert lib.nvmlDeviceGetPciInfo_v3(handle(i), byref(p)) == 0
    state = c_int(-1)
    out.append([lib.nvmlDeviceQueryDrainState(byref(p), byref(state)), state.value, lib.nvmlDeviceModifyDrainState(byref(p), 1)])
p = Pci(busId=b'00000000:7F:00.0')
out.append(lib.nvmlDeviceQueryDrainState(byref(p), byref(c_int())))
print(json.dumps(out))
'''
    modify = 3 if os.geteuid() == 0 else 4   # read-only for the shim: NOT_SUPPORTED for root, else NO_PERMISSION
    assert run_ctypes(body, state_path, shim_dirs['full']) == [[0, 1, modify], [0, 0, modify], 6]


MALFORMED = [
    '', ' ', '{', '}', '[]', 'null', 'true', '"x"', '12', '{"gpus": 5}', '{"gpus": [1, "x", null, [], {}]}',
    '{"gpus": [{"index": -3, "memory_total_mib": "big", "name": 7, "uuid": null, "pci_bus_id": "zz"}]}',
    '{"gpus": [{"memory_total_mib": 1e400, "temp_c": -1e300, "power_w": 1e30, "remapped_rows": [1]}]}',
    '{"gpus": [{}], "processes": [{"pid": "x"}, {"pid": -1}, {"pid": 1e30}, {}, 7, {"pid": 1, "children": [1, "a", null, -5]}]}',
    '{"gpus": [{}], "processes": {"pid": 1}}',
    '{"gpus": [{"name": "' + 'N' * 500 + '", "uuid": "\\u00e9\\ud83d\\ude00\\u0000"}]}',
    '{"gpus": [{"name": "\\ud800"}]}', '{"gpus": [{"name": "\\x"}]}', '{"gpus": [{"name": "a\nb"}]}',
    '{"gpus": [{},]}', '{"gpus": [{}]} trailing', '{"a": NaN}', '{"a": 01}', '{"a": -}', '{"a": 1.}', '{"a" 1}',
    '{"gpus": [' + '{}, ' * 200 + '{}]}',
    '[' * 100000, '{"a":' * 5000 + '1' + '}' * 5000, '"\\u12', '{"driver": "r470", "driver_version": 5}',
    '\x00\x01\x02', '{"gpus": [{}]}\x00',
]


def test_malformed_states_never_crash(shim_dirs, state_path):
    """Every document: init answers SUCCESS or DRIVER_NOT_LOADED and the calls do not crash."""
    write_state(state_path, gpus=1)
    docs_path = state_path + '.docs'
    with open(docs_path, 'w') as f:
        json.dump(MALFORMED, f)
    body = '''
import sys
docs = json.load(open(%r))
path = os.environ['GPU_SIM_STATE']
results = []
names = [b'nvmlDeviceGetMemoryInfo', b'nvmlDeviceGetUtilizationRates', b'nvmlDeviceGetPowerUsage', b'nvmlDeviceGetTemperature']
for i, doc in enumerate(docs):
    with open(path + '.tmp', 'w') as f:
        f.write(doc)
    os.rename(path + '.tmp', path)
    rc = lib.nvmlInit_v2()
    entry = {'init': rc}
    if rc == 0:
        n = c_uint(0)
        entry['count'] = [lib.nvmlDeviceGetCount_v2(byref(n)), n.value]
        for j in range(n.value):
            h = c_void_p()
            assert lib.nvmlDeviceGetHandleByIndex_v2(c_uint(j), byref(h)) == 0
            buf = ctypes.create_string_buffer(96)
            lib.nvmlDeviceGetName(h, buf, c_uint(96))
            lib.nvmlDeviceGetUUID(h, buf, c_uint(96))
            mem = (c_ulonglong * 3)()
            lib.nvmlDeviceGetMemoryInfo(h, mem)
            util = (c_uint * 2)()
            lib.nvmlDeviceGetUtilizationRates(h, util)
            v = c_uint()
            lib.nvmlDeviceGetTemperature(h, 0, byref(v))
            lib.nvmlDeviceGetPowerUsage(h, byref(v))
            cnt = c_uint(0)
            lib.nvmlDeviceGetComputeRunningProcesses_v3(h, byref(cnt), None)
            p = Pci()
            lib.nvmlDeviceGetPciInfo_v3(h, byref(p))
        lib.nvmlShutdown()
    results.append(entry)
print(json.dumps(results))
''' % docs_path
    results = run_ctypes(body, state_path, shim_dirs['full'])
    assert len(results) == len(MALFORMED)
    by_doc = dict(zip(MALFORMED, results))
    for doc, res in by_doc.items():
        assert res['init'] in (0, 9), (doc[:60], res)
    for doc in ('', '{', '[]', 'null', '12', '{"gpus": [{"name": "\\ud800"}]}', '{"gpus": [{},]}', '{"a": NaN}',
                '[' * 100000, '\x00\x01\x02', '{"gpus": [{}]}\x00', '{"gpus": [{}]} trailing'):
        assert by_doc[doc]['init'] == 9, doc[:60]
    assert by_doc['{"gpus": 5}']['count'] == [0, 0]
    assert by_doc['{"gpus": [1, "x", null, [], {}]}']['count'] == [0, 1]
    assert by_doc['{"gpus": [' + '{}, ' * 200 + '{}]}']['count'] == [0, 64]
    assert by_doc['{"a":' * 5000 + '1' + '}' * 5000]['init'] == 9   # nesting limit
    write_raw_state(state_path, '{}')


def test_threads_and_concurrent_rewrites(shim_dirs, state_path, spawn):
    a = spawn()
    write_state(state_path, gpus=4, processes=[make_process(a.pid, gpu=2, used_mib=5)])
    body = '''
import threading
path = os.environ['GPU_SIM_STATE']
state = json.load(open(path))
assert lib.nvmlInit_v2() == 0
errors = []


def worker():
    try:
        for _ in range(1500):
            n = c_uint(0)
            rc = lib.nvmlDeviceGetCount_v2(byref(n))
            assert rc == 0 and n.value in (2, 4), (rc, n.value)
            h = c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(c_uint(1), byref(h)) == 0:
                buf = ctypes.create_string_buffer(96)
                assert lib.nvmlDeviceGetName(h, buf, c_uint(96)) in (0, 2)
                cnt = c_uint(0)
                assert lib.nvmlDeviceGetComputeRunningProcesses_v3(h, byref(cnt), None) in (0, 2, 7)
    except AssertionError as e:
        errors.append(repr(e))


threads = [threading.Thread(target=worker) for _ in range(8)]
for t in threads:
    t.start()
for i in range(300):
    state['gpus'] = state['gpus'][:2] if i % 2 else (state['gpus'] * 2)[:4]
    with open(path + '.tmp', 'w') as f:
        json.dump(state, f)
    os.rename(path + '.tmp', path)
for t in threads:
    t.join()
print(json.dumps(errors))
'''
    assert run_ctypes(body, state_path, shim_dirs['full']) == []
