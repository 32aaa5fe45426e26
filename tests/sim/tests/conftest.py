"""Shared pytest helpers for the simulator's own tests (tests/sim/tests).

Sections are owned by different test files; append new fixtures in a new section and leave the
others alone.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

SIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_BUILD = os.environ.get('GPUFLEET_SIM_BUILD') or os.path.join(SIM_DIR, 'build')
MIB = 1 << 20

# ---------------------------------------------------------------------------------------------
# NVML shim (tests/sim/nvml_shim.c): used by test_shim*.py, test_conformance_nvml.py, test_peers.py
# ---------------------------------------------------------------------------------------------

SHIM_SOURCE = os.path.join(SIM_DIR, 'nvml_shim.c')
SHIM_SONAME = 'libnvidia-ml.so.1'
# Variant name -> (sub-directory of the build dir, extra gcc flags).  `make sim` builds both.
SHIM_VARIANTS = {'full': ('', []), 'r470': ('r470', ['-DSIM_R470'])}


def starttime(pid):
    """Field 22 of /proc/PID/stat (clock ticks since boot): the state's pid-reuse check."""
    with open('/proc/%d/stat' % pid) as f:
        data = f.read()
    return int(data[data.rindex(')') + 2:].split()[19])


def proc_state(pid):
    """The one-letter state of /proc/PID/stat, or None when the pid is gone."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(')') + 2:].split()[0]


def make_gpu(index=0, **overrides):
    """One schema-1 GPU entry with realistic defaults."""
    gpu = {
        'index': index,
        'uuid': 'GPU-6f7c1a2b-0000-4000-8000-%012d' % index,
        'name': 'NVIDIA A100-SXM4-80GB',
        'pci_bus_id': '00000000:%02X:00.0' % (7 + index),
        'minor': index,
        'memory_total_mib': 81559,
        'memory_reserved_mib': 0,
        'util_pct': 0,
        'mem_util_pct': 0,
        'temp_c': 34,
        'power_w': 61.0,
        'power_limit_w': 400.0,
        'fan_pct': None,
        'persistence': True,
        'mig': False,
        'ecc_uncorrected': 0,
        'ecc_corrected': 0,
        'remapped_rows': {'correctable': 0, 'uncorrectable': 0, 'pending': False, 'failure': False},
        'leaked_mib': 0,
        'lost': False,
        'no_permission': False,
        'drain': False,
        'reset_count': 0,
    }
    gpu.update(overrides)
    return gpu


def make_process(pid, gpu=0, used_mib=1024, **overrides):
    """One schema-1 process entry for a live pid (its starttime is read unless given)."""
    entry = {
        'pid': pid,
        'starttime': None,
        'gpu': gpu,
        'used_mib': used_mib,
        'type': 'compute',
        'util_pct': 0,
        'children': [],
        'user': 'tester',
        'argv': ['sleep', '300'],
        'supervisor_pid': None,
        'exited_at': None,
    }
    entry.update(overrides)
    if entry['starttime'] is None and 'starttime' not in overrides:
        entry['starttime'] = starttime(pid)
    return entry


def write_state(path, gpus=None, processes=None, **top):
    """Write a schema-1 state file the way gpusim does (temp file + rename) and return it.

    gpus: list of GPU dicts (see make_gpu) or an int (that many default GPUs); processes: list
    of process dicts (see make_process).  Keyword arguments override top-level keys.
    """
    if gpus is None:
        gpus = 1
    if isinstance(gpus, int):
        gpus = [make_gpu(i) for i in range(gpus)]
    state = {
        'schema': 1,
        'vendor': 'nvidia',
        'driver': 'r550',
        'driver_version': '550.54.15',
        'nvml_version': '12.550.54.15',
        'cuda_driver_version': 12040,
        'release_delay_ms': 0,
        'dev_dir': '/dev',
        'gpus': gpus,
        'processes': processes or [],
    }
    state.update(top)
    write_raw_state(path, json.dumps(state, indent=2))
    return state


def write_raw_state(path, text):
    """Atomically replace the state file with arbitrary text (for malformed-state tests)."""
    path = str(path)
    tmp = '%s.tmp.%d' % (path, os.getpid())
    with open(tmp, 'w') as f:
        f.write(text)
    os.rename(tmp, path)


def _compile_shim(out_dir, flags):
    gcc = shutil.which('gcc') or shutil.which('cc')
    if not gcc:
        return None
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, SHIM_SONAME)
    cmd = [gcc, '-O2', '-Wall', '-Wextra', '-shared', '-fPIC', '-Wl,-soname,' + SHIM_SONAME] + flags
    subprocess.run(cmd + ['-o', out, SHIM_SOURCE, '-lm'], check=True)
    return out


@pytest.fixture(scope='session')
def shim_dirs(tmp_path_factory):
    """Directories holding each shim variant: {'full': dir, 'r470': dir}.

    Uses what `make sim` built when it is newer than the source; otherwise compiles the variant
    into a temp dir with gcc; skips when neither is possible.
    """
    dirs = {}
    src_mtime = os.stat(SHIM_SOURCE).st_mtime
    for variant, (sub, flags) in SHIM_VARIANTS.items():
        built = os.path.join(SIM_BUILD, sub, SHIM_SONAME)
        if os.path.exists(built) and os.stat(built).st_mtime >= src_mtime:
            dirs[variant] = os.path.dirname(built)
            continue
        out_dir = str(tmp_path_factory.mktemp('shim-' + variant))
        if _compile_shim(out_dir, flags) is None:
            pytest.skip('no built %s shim and no C compiler to build it' % variant)
        dirs[variant] = out_dir
    return dirs


@pytest.fixture
def state_path(tmp_path):
    """Path of this test's state file (not yet written)."""
    return str(tmp_path / 'state.json')


@pytest.fixture
def spawn():
    """Factory starting `sleep 300` children of this test; all are killed and reaped afterwards.

    spawn() -> subprocess.Popen.  Only processes started here are ever signalled.
    """
    children = []
    sleep = shutil.which('sleep')

    def _spawn():
        argv = [sleep, '300'] if sleep else [sys.executable, '-c', 'import time; time.sleep(300)']
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        children.append(child)
        return child

    yield _spawn
    for child in children:
        if child.returncode is None:
            try:
                child.kill()
            except OSError:
                pass
            child.wait()


def kill_and_reap(child):
    """Kill a child started by the spawn fixture and wait for it."""
    child.kill()
    child.wait()


def wait_zombie(child, timeout=10.0):
    """Kill a spawn()ed child without reaping it; returns once it is a zombie."""
    child.kill()
    deadline = time.time() + timeout
    while proc_state(child.pid) != 'Z':
        if time.time() > deadline:
            raise AssertionError('pid %d did not become a zombie' % child.pid)
        time.sleep(0.01)


def shim_env(state_path, lib_dir, extra=None):
    """Environment for a child that loads the shim from lib_dir with the given state file."""
    env = dict(os.environ)
    env['LD_LIBRARY_PATH'] = lib_dir + (':' + env['LD_LIBRARY_PATH'] if env.get('LD_LIBRARY_PATH') else '')
    env.pop('LD_PRELOAD', None)
    if state_path is None:
        env.pop('GPU_SIM_STATE', None)
    else:
        env['GPU_SIM_STATE'] = str(state_path)
    env.update(extra or {})
    return env


def run_python(code, state_path, lib_dir, timeout=120, check=True):
    """Run code in a fresh interpreter that loads the shim; return the JSON of its last stdout line."""
    with tempfile.NamedTemporaryFile('w', suffix='.py', delete=False) as f:
        f.write(code)
        script = f.name
    try:
        proc = subprocess.run([sys.executable, script], env=shim_env(state_path, lib_dir),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=timeout, check=False)
    finally:
        os.unlink(script)
    if not check:
        return proc
    assert proc.returncode == 0, 'rc=%s\nstdout:\n%s\nstderr:\n%s' % (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Runs in the child: every pynvml query of every GPU, errors as {"error": ClassName, "code": N}.
PROBE = r'''
import json, time
import pynvml as N


def call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except N.NVMLError as e:
        return {'error': type(e).__name__, 'code': e.value}
    except N.NVMLLibraryMismatchError:
        return {'error': 'NVMLLibraryMismatchError', 'code': None}


def procs(fn, h):
    res = call(fn, h)
    if isinstance(res, dict):
        return res
    return [{'pid': p.pid, 'used': p.usedGpuMemory, 'gi': p.gpuInstanceId, 'ci': p.computeInstanceId} for p in res]


def mem(h, **kw):
    m = N.nvmlDeviceGetMemoryInfo(h, **kw)
    d = {'total': m.total, 'free': m.free, 'used': m.used}
    if kw:
        d['reserved'] = m.reserved
        d['version'] = m.version
    return d


def text(value):
    return value.decode() if isinstance(value, bytes) else value


def pci(h):
    p = N.nvmlDeviceGetPciInfo(h)
    return {'busId': text(p.busId), 'legacy': text(p.busIdLegacy), 'domain': p.domain, 'bus': p.bus,
            'device': p.device, 'pciDeviceId': p.pciDeviceId}


def is_mig(h):
    value = N.nvmlDeviceIsMigDeviceHandle(h)  # a c_uint in nvidia-ml-py 13
    return int(getattr(value, 'value', value))


def putil(h, last_seen):
    return [{'pid': s.pid, 'sm': s.smUtil, 'mem': s.memUtil, 'ts': s.timeStamp} for s in N.nvmlDeviceGetProcessUtilization(h, last_seen)]


def device(i):
    h = N.nvmlDeviceGetHandleByIndex(i)
    d = {
        'index': call(N.nvmlDeviceGetIndex, h),
        'name': call(N.nvmlDeviceGetName, h),
        'uuid': call(N.nvmlDeviceGetUUID, h),
        'pci': call(pci, h),
        'minor': call(N.nvmlDeviceGetMinorNumber, h),
        'mem_v1': call(mem, h),
        'mem_v2': call(mem, h, version=N.nvmlMemory_v2),
        'mem_bad_version': call(mem, h, version=0x01000028),
        'util': call(lambda: [N.nvmlDeviceGetUtilizationRates(h).gpu, N.nvmlDeviceGetUtilizationRates(h).memory]),
        'temp': call(N.nvmlDeviceGetTemperature, h, N.NVML_TEMPERATURE_GPU),
        'tempv': call(N.nvmlDeviceGetTemperatureV, h, N.NVML_TEMPERATURE_GPU),
        'power': call(N.nvmlDeviceGetPowerUsage, h),
        'power_limit': call(N.nvmlDeviceGetPowerManagementLimit, h),
        'enforced_limit': call(N.nvmlDeviceGetEnforcedPowerLimit, h),
        'fan': call(N.nvmlDeviceGetFanSpeed, h),
        'persistence': call(N.nvmlDeviceGetPersistenceMode, h),
        'mig': call(N.nvmlDeviceGetMigMode, h),
        'is_mig': call(is_mig, h),
        'ecc_unc': call(N.nvmlDeviceGetTotalEccErrors, h, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC),
        'ecc_corr': call(N.nvmlDeviceGetTotalEccErrors, h, N.NVML_MEMORY_ERROR_TYPE_CORRECTED, N.NVML_AGGREGATE_ECC),
        'remapped': call(N.nvmlDeviceGetRemappedRows, h),
        'cc': call(N.nvmlDeviceGetCudaComputeCapability, h),
        'pstate': call(N.nvmlDeviceGetPerformanceState, h),
        'compute_mode': call(N.nvmlDeviceGetComputeMode, h),
        'display_active': call(N.nvmlDeviceGetDisplayActive, h),
        'encoder': call(N.nvmlDeviceGetEncoderUtilization, h),
        'clock': call(N.nvmlDeviceGetClockInfo, h, N.NVML_CLOCK_SM),
        'compute': procs(N.nvmlDeviceGetComputeRunningProcesses, h),
        'compute_v2': procs(N.nvmlDeviceGetComputeRunningProcesses_v2, h),
        'compute_v3': procs(N.nvmlDeviceGetComputeRunningProcesses_v3, h),
        'graphics': procs(N.nvmlDeviceGetGraphicsRunningProcesses, h),
        'graphics_v2': procs(N.nvmlDeviceGetGraphicsRunningProcesses_v2, h),
        'mps': procs(N.nvmlDeviceGetMPSComputeRunningProcesses, h),
        'mps_v2': procs(N.nvmlDeviceGetMPSComputeRunningProcesses_v2, h),
        'putil': call(putil, h, 0),
        'putil_future': call(putil, h, int((time.time() + 3600) * 1e6)),
        'drain': call(lambda: N.nvmlDeviceQueryDrainState(N.nvmlDeviceGetPciInfo(h))),
    }
    uuid_h = call(N.nvmlDeviceGetHandleByUUID, d['uuid']) if isinstance(d['uuid'], str) else None
    d['by_uuid_index'] = call(N.nvmlDeviceGetIndex, uuid_h) if uuid_h is not None and not isinstance(uuid_h, dict) else uuid_h
    return d


out = {'init': call(N.nvmlInit)}
if out['init'] is None:
    out['driver_version'] = call(N.nvmlSystemGetDriverVersion)
    out['nvml_version'] = call(N.nvmlSystemGetNVMLVersion)
    out['cuda'] = call(N.nvmlSystemGetCudaDriverVersion)
    out['cuda_v2'] = call(N.nvmlSystemGetCudaDriverVersion_v2)
    out['count'] = call(N.nvmlDeviceGetCount)
    out['devices'] = [device(i) for i in range(out['count'])]
    N.nvmlShutdown()
print(json.dumps(out))
'''

# Prelude for raw ctypes checks in the child: the library and the NVML structs.
CTYPES_PRELUDE = r'''
import ctypes, json, os, time
from ctypes import byref, c_char, c_int, c_uint, c_ulonglong, c_void_p, POINTER, Structure

lib = ctypes.CDLL('libnvidia-ml.so.1')


class ProcV1(Structure):
    _fields_ = [('pid', c_uint), ('usedGpuMemory', c_ulonglong)]


class ProcV2(Structure):
    _fields_ = [('pid', c_uint), ('usedGpuMemory', c_ulonglong), ('gpuInstanceId', c_uint), ('computeInstanceId', c_uint)]


class Pci(Structure):
    _fields_ = [('busIdLegacy', c_char * 16), ('domain', c_uint), ('bus', c_uint), ('device', c_uint),
                ('pciDeviceId', c_uint), ('pciSubSystemId', c_uint), ('busId', c_char * 32)]


class MemV2(Structure):
    _fields_ = [('version', c_uint), ('total', c_ulonglong), ('reserved', c_ulonglong), ('free', c_ulonglong), ('used', c_ulonglong)]


class TempV1(Structure):
    _fields_ = [('version', c_uint), ('sensorType', c_int), ('temperature', c_int)]


lib.nvmlErrorString.restype = ctypes.c_char_p


def handle(i):
    h = c_void_p()
    rc = lib.nvmlDeviceGetHandleByIndex_v2(c_uint(i), byref(h))
    assert rc == 0, rc
    return h
'''


def probe(state_path, lib_dir):
    """Everything pynvml reports about the state, as seen by a fresh process loading lib_dir."""
    return run_python(PROBE, state_path, lib_dir)


# ---------------------------------------------------------------------------------------------
# gpusim CLI, fake nvidia-smi / amd-smi, fake amdsmi: used by test_gpusim*.py, test_fake_*.py,
# test_conformance_amdsmi.py
# ---------------------------------------------------------------------------------------------

GPUSIM = os.path.join(SIM_DIR, 'gpusim')
FAKE_NVIDIA_SMI = os.path.join(SIM_DIR, 'bin', 'nvidia-smi')
FAKE_AMD_SMI = os.path.join(SIM_DIR, 'bin', 'amd-smi')
FAKE_AMDSMI_DIR = os.path.join(SIM_DIR, 'python')
WORKLOAD_SOURCE = os.path.join(SIM_DIR, 'workload.c')


def wait_until(predicate, timeout=5.0, interval=0.02):
    """Poll predicate() until it is truthy (returns its value) or fail after timeout seconds."""
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError('condition not met within %.1fs' % timeout)
        time.sleep(interval)


def pid_alive(pid, start=None):
    """Contract liveness (exists, not a zombie, same starttime when given)."""
    state = proc_state(pid)
    if state is None or state in ('Z', 'X', 'x'):
        return False
    try:
        return start is None or starttime(pid) == start
    except (OSError, ValueError):
        return False


class GpuSimNode(object):
    """One simulated node for one test: its own state file and device dir in a 0755 temp dir.

    Every command runs with GPU_SIM_STATE pointing at this node, so tests never touch another
    test's processes; the fixture kills only what this state recorded.
    """

    def __init__(self, root):
        self.root = root
        self.state = os.path.join(root, 'state.json')
        self.dev_dir = os.path.join(root, 'dev')
        self.env = dict(os.environ)
        self.env['GPU_SIM_STATE'] = self.state

    def run(self, *args, **kwargs):
        """Run gpusim ARGS; check=True asserts rc 0.  Returns the CompletedProcess (text)."""
        return self.tool(GPUSIM, *args, **kwargs)

    def tool(self, path, *args, **kwargs):
        check = kwargs.pop('check', True)
        env = dict(self.env)
        env.update(kwargs.pop('env', {}))
        # through this interpreter: a pyenv-style `python3` shim would add ~0.2 s to every call
        proc = subprocess.run([sys.executable, path] + [str(a) for a in args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=kwargs.pop('timeout', 60),
                              check=False, **kwargs)
        if check:
            assert proc.returncode == 0, 'rc=%s\nstdout:\n%s\nstderr:\n%s' % (proc.returncode, proc.stdout, proc.stderr)
        return proc

    def init(self, *args):
        return self.run('init', '--dev-dir', self.dev_dir, '--create-dev-files', *args)

    def spawn(self, *options, **kwargs):
        """gpusim spawn OPTIONS -- ARGV (argv=[...], default a sleeper); returns the pid printed."""
        argv = kwargs.pop('argv', ['python', 'train.py'])
        proc = self.run('spawn', *(list(options) + ['--'] + list(argv)), **kwargs)
        return int(proc.stdout.strip())

    def show(self):
        return json.loads(self.run('show').stdout)

    def entry(self, pid):
        for entry in self.show()['processes']:
            if entry['pid'] == pid:
                return entry
        raise AssertionError('pid %d is not in the state' % pid)

    def gpu(self, index):
        return self.show()['gpus'][index]

    def raw(self):
        with open(self.state) as f:
            return json.load(f)

    def recorded_pids(self):
        """(pid, starttime) of everything this state recorded: workloads, children, supervisors."""
        out = []
        try:
            state = self.raw()
        except (OSError, ValueError):
            return out
        for entry in state.get('processes', []):
            out.append((entry['pid'], entry.get('starttime')))
            starts = entry.get('children_starttime') or []
            for i, kid in enumerate(entry.get('children') or []):
                out.append((kid, starts[i] if i < len(starts) else None))
            if entry.get('supervisor_pid'):
                out.append((entry['supervisor_pid'], entry.get('supervisor_starttime')))
        return out

    def cleanup(self):
        """kill-all, then make sure nothing this state recorded is left running."""
        if os.path.exists(self.state):
            self.run('kill-all', '--timeout', '5', check=False)
        leftovers = [p for p in self.recorded_pids() if pid_alive(*p)]
        for pid, start in leftovers:
            if pid_alive(pid, start):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        return [p[0] for p in leftovers]


def _workload_buildable():
    built = os.path.join(SIM_BUILD, 'gpusim-workload')
    if os.environ.get('GPUSIM_WORKLOAD') or os.access(built, os.X_OK):
        return True
    return bool(shutil.which(os.environ.get('CC', 'gcc')))


@pytest.fixture
def gpusim_node():
    """A fresh (not yet initialised) simulated node; cleaned up (processes killed) afterwards."""
    if not _workload_buildable():
        pytest.skip('gpusim-workload is not built and there is no C compiler (run make sim)')
    root = tempfile.mkdtemp(prefix='gpusim-test-')
    os.chmod(root, 0o755)  # workloads running as another user must reach the device files
    node = GpuSimNode(root)
    try:
        yield node
    finally:
        leftovers = node.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, 'processes survived gpusim kill-all: %s' % leftovers


def _demote(user):
    def demote():
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
    return demote


def interpreter_for(user):
    """A Python that `user` may execute (the venv may live under root's 0700 home), or None."""
    for candidate in (sys.executable, '/usr/bin/python3', '/usr/local/bin/python3'):
        if not os.path.exists(candidate):
            continue
        try:
            proc = subprocess.run([candidate, '-c', 'pass'], preexec_fn=_demote(user),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        except OSError:
            continue
        if proc.returncode == 0:
            return candidate
    return None


def run_as(user, node, path, *args):
    """Run the stdlib-only script path as user (a pwd entry) against node's state; skip if impossible."""
    python = interpreter_for(user)
    if python is None:
        pytest.skip('no Python interpreter that %s may execute' % user.pw_name)
    return subprocess.run([python, path] + list(args), env=node.env, preexec_fn=_demote(user), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, check=False, timeout=60)
