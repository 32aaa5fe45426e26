# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one Python reader and writer of the gpusim state file.

See docs/design/contracts.md ("The simulator state file") for the schema and the
liveness and "counts as used" rules.  Standard library only, Python >= 3.8, so that
gpusim, the fake nvidia-smi / amd-smi and the fake amdsmi package can all import it.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import time

SCHEMA = 1
STATE_ENV = 'GPU_SIM_STATE'

DRIVERS = {
    # driver: (driver_version, nvml_version, cuda_driver_version)
    'r550': ('550.54.15', '12.550.54.15', 12040),
    'r470': ('470.256.02', '11.470.256.02', 11040),
}

VENDOR_DEFAULTS = {
    'nvidia': {'name': 'NVIDIA A100-SXM4-80GB', 'memory_total_mib': 81559, 'power_limit_w': 400.0,
               'power_w': 61.0, 'temp_c': 34},
    'amd': {'name': 'AMD Instinct MI250X', 'memory_total_mib': 65520, 'power_limit_w': 560.0,
            'power_w': 88.0, 'temp_c': 38},
    'intel': {'name': 'Intel(R) Data Center GPU Max 1550', 'memory_total_mib': 131072, 'power_limit_w': 600.0,
              'power_w': 95.0, 'temp_c': 36},
}

# PCI buses of the first GPUs (an 8-GPU HGX board spreads them over the root complexes).
_BASE_BUSES = [0x07, 0x0B, 0x48, 0x4C, 0x88, 0x8B, 0xC8, 0xCB]

MAX_GPUS = 64


class StateError(Exception):
    """A state file problem that a CLI should print and exit on."""


def state_path(explicit=None):
    """The absolute state path: an explicit one, else $GPU_SIM_STATE; StateError if neither."""
    path = explicit or os.environ.get(STATE_ENV)
    if not path:
        raise StateError('no simulator state: set %s=/path/to/state.json (or pass --state PATH)' % STATE_ENV)
    return os.path.abspath(path)


def lock_path(path):
    return path + '.lock'


def load(path=None):
    """Read the state (no lock needed: writers replace the file atomically)."""
    path = state_path(path)
    try:
        with open(path, 'r') as handle:
            data = json.load(handle)
    except (IOError, OSError) as exc:
        if exc.errno == errno.ENOENT:
            raise StateError('simulator state %s does not exist (run "gpusim init" first)' % path)
        raise StateError('cannot read simulator state %s: %s' % (path, exc))
    except ValueError as exc:
        raise StateError('simulator state %s is not valid JSON: %s' % (path, exc))
    if not isinstance(data, dict) or data.get('schema') != SCHEMA:
        raise StateError('simulator state %s has an unknown schema (want %d)' % (path, SCHEMA))
    return data


def _write(path, state):
    """Write tmp then rename over the state; the caller holds the lock."""
    tmp = '%s.tmp.%d' % (path, os.getpid())
    data = json.dumps(state, indent=1, sort_keys=True).encode('utf-8') + b'\n'
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextlib.contextmanager
def _flock(path):
    lpath = lock_path(path)
    try:
        fd = os.open(lpath, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise StateError('cannot open lock %s: %s' % (lpath, exc))
        try:
            fd = os.open(lpath, os.O_RDONLY)
        except OSError as exc2:
            raise StateError('cannot open lock %s: %s' % (lpath, exc2))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def save(state, path=None):
    """Replace the state atomically under the lock."""
    path = state_path(path)
    with _flock(path):
        _write(path, state)


@contextlib.contextmanager
def locked(path=None, create=None):
    """Read-modify-write: yields the state dict under the lock and saves it (if changed) on a clean exit.

    With create (a dict), a missing state starts from that dict instead of failing.
    The body may replace the whole content by mutating the yielded dict in place.
    """
    path = state_path(path)
    with _flock(path):
        try:
            state = load(path)
            before = json.dumps(state, sort_keys=True)
        except StateError:
            if create is None or os.path.exists(path):
                raise
            state, before = create, None
        yield state
        if json.dumps(state, sort_keys=True) != before:
            _write(path, state)


# ---------------------------------------------------------------------------
# /proc and liveness


def read_stat(pid):
    """(state letter, starttime) from /proc/PID/stat, or None if there is no such pid."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        with open('/proc/%d/stat' % pid, 'rb') as handle:
            data = handle.read()
    except (IOError, OSError):
        return None
    end = data.rfind(b')')
    fields = data[end + 2:].split()
    if len(fields) < 20:
        return None
    # fields[0] is field 3 (state), so field 22 (starttime) is fields[19]
    return fields[0].decode('ascii', 'replace'), int(fields[19])


def starttime(pid):
    stat = read_stat(pid)
    return None if stat is None else stat[1]


def pid_alive(pid, start=None):
    """Contract liveness: /proc/PID/stat exists, not a zombie, and the starttime matches."""
    stat = read_stat(pid)
    if stat is None or stat[0] in ('Z', 'X', 'x'):
        return False
    if start is not None and stat[1] != start:
        return False
    return True


def children_alive(entry):
    """The recorded children of an entry that are alive (pids)."""
    kids = entry.get('children') or []
    starts = entry.get('children_starttime') or []
    parent_start = entry.get('starttime')
    alive = []
    for i, kid in enumerate(kids):
        start = starts[i] if i < len(starts) else None
        if start is None:
            stat = read_stat(kid)
            ok = (stat is not None and stat[0] not in ('Z', 'X', 'x')
                  and (parent_start is None or stat[1] >= parent_start))
        else:
            ok = pid_alive(kid, start)
        if ok:
            alive.append(kid)
    return alive


def entry_listed(entry):
    """An entry is listed by the driver while its pid is alive."""
    return pid_alive(entry.get('pid'), entry.get('starttime'))


def supervisor_alive(entry):
    sup = entry.get('supervisor_pid')
    if not sup:
        return False
    return pid_alive(sup, entry.get('supervisor_starttime'))


def entry_counted(entry, release_delay_ms=0, now=None):
    """Whether an entry's memory counts as used (contracts.md)."""
    if entry_listed(entry):
        return True
    if children_alive(entry):
        return True
    exited_at = entry.get('exited_at')
    if exited_at is not None:
        if now is None:
            now = time.time()
        return now < float(exited_at) + (release_delay_ms or 0) / 1000.0
    return supervisor_alive(entry)


def entry_busy(entry):
    """A live pid or a live child: what blocks a reset."""
    return entry_listed(entry) or bool(children_alive(entry))


def gpu_by_index(state, index):
    for gpu in state.get('gpus', []):
        if gpu.get('index') == index:
            return gpu
    return None


def _norm_bus_id(text):
    """'7:0.0', '07:00.0', '0000:07:00.0' and '00000000:07:00.0' -> (domain, bus, dev, fn) or None."""
    match = re.match(r'^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$', text.strip())
    if not match:
        return None
    dom, bus, dev, fn = match.groups()
    return (int(dom or '0', 16), int(bus, 16), int(dev, 16), int(fn, 16))


def find_gpu(state, ident):
    """A GPU by index, UUID or PCI bus id (as nvidia-smi -i / amd-smi -g accept them)."""
    ident = str(ident).strip()
    if re.match(r'^[0-9]+$', ident):
        return gpu_by_index(state, int(ident))
    low = ident.lower()
    for gpu in state.get('gpus', []):
        uuid = str(gpu.get('uuid', '')).lower()
        if low in (uuid, 'gpu-' + uuid) or 'gpu-' + low == uuid:
            return gpu
    want = _norm_bus_id(ident)
    if want is not None:
        for gpu in state.get('gpus', []):
            if _norm_bus_id(gpu.get('pci_bus_id', '')) == want:
                return gpu
    return None


def gpu_used_mib(state, index, now=None):
    """Device used memory = reserved + leaked + sum of counted entries' used_mib (null as 0)."""
    gpu = gpu_by_index(state, index)
    if gpu is None:
        return None
    if now is None:
        now = time.time()
    delay = state.get('release_delay_ms') or 0
    used = (gpu.get('memory_reserved_mib') or 0) + (gpu.get('leaked_mib') or 0)
    for entry in state.get('processes', []):
        if entry.get('gpu') == index and entry_counted(entry, delay, now):
            used += entry.get('used_mib') or 0
    return used


def annotate(state, now=None):
    """A copy of the state for `gpusim show`: per process alive/children_alive/counted_mib,
    per GPU used_mib/free_mib/effective_util_pct."""
    if now is None:
        now = time.time()
    out = json.loads(json.dumps(state))
    delay = out.get('release_delay_ms') or 0
    used = {}
    busy = {}
    for entry in out.get('processes', []):
        entry['alive'] = entry_listed(entry)
        if entry['alive']:
            busy[entry.get('gpu')] = busy.get(entry.get('gpu'), 0) + (entry.get('util_pct') or 0)
        entry['children_alive'] = children_alive(entry)
        entry['supervisor_alive'] = supervisor_alive(entry)
        counted = entry_counted(entry, delay, now)
        entry['counted'] = counted
        entry['counted_mib'] = (entry.get('used_mib') or 0) if counted else 0
        used[entry.get('gpu')] = used.get(entry.get('gpu'), 0) + entry['counted_mib']
    for gpu in out.get('gpus', []):
        total_used = (gpu.get('memory_reserved_mib') or 0) + (gpu.get('leaked_mib') or 0) + used.get(gpu.get('index'), 0)
        gpu['used_mib'] = total_used
        gpu['free_mib'] = max(0, (gpu.get('memory_total_mib') or 0) - total_used)
        # What the shim reports as device utilization: the state's figure or its live processes' sum.
        if gpu.get('util_pct') is not None:
            gpu['effective_util_pct'] = max(gpu['util_pct'], min(100, busy.get(gpu.get('index'), 0)))
    return out


# ---------------------------------------------------------------------------
# building a node


def bus_ids(count):
    buses = list(_BASE_BUSES)
    candidate = 0x0F
    while len(buses) < count:
        if candidate not in buses:
            buses.append(candidate)
        candidate = (candidate + 4) % 0x100
    return ['00000000:%02X:00.0' % bus for bus in buses[:count]]


def make_uuid(vendor, seed, index):
    digest = hashlib.sha256(('%s|%s|%d' % (vendor, seed, index)).encode('utf-8')).hexdigest()
    text = '%s-%s-%s-%s-%s' % (digest[0:8], digest[8:12], digest[12:16], digest[16:20], digest[20:32])
    if vendor == 'nvidia':
        return 'GPU-' + text
    return text


def default_seed(path):
    """Distinct per node (hostname) and per state file, stable across re-inits."""
    return '%s|%s' % (socket.gethostname(), os.path.abspath(path))


def new_state(gpus=4, vendor='nvidia', model=None, mem_mib=None, driver='r550', release_delay_ms=0,
              dev_dir='/dev', seed='gpusim', reserved_mib=0):
    if vendor not in VENDOR_DEFAULTS:
        raise StateError('unknown vendor %r (nvidia, amd or intel)' % (vendor,))
    if driver not in DRIVERS:
        raise StateError('unknown driver %r (%s)' % (driver, ', '.join(sorted(DRIVERS))))
    if not 1 <= gpus <= MAX_GPUS:
        raise StateError('--gpus must be between 1 and %d, got %r' % (MAX_GPUS, gpus))
    defaults = VENDOR_DEFAULTS[vendor]
    driver_version, nvml_version, cuda_version = DRIVERS[driver]
    devices = []
    for index, bus in enumerate(bus_ids(gpus)):
        devices.append({
            'index': index,
            'uuid': make_uuid(vendor, seed, index),
            'name': model or defaults['name'],
            'pci_bus_id': bus,
            'minor': index,
            'memory_total_mib': int(mem_mib or defaults['memory_total_mib']),
            'memory_reserved_mib': int(reserved_mib or 0),
            'util_pct': 0,
            'mem_util_pct': 0,
            'temp_c': defaults['temp_c'],
            'power_w': defaults['power_w'],
            'power_limit_w': defaults['power_limit_w'],
            'fan_pct': None,
            'persistence': vendor == 'nvidia',
            'mig': False,
            'ecc_uncorrected': 0,
            'ecc_corrected': 0,
            'remapped_rows': {'correctable': 0, 'uncorrectable': 0, 'pending': False, 'failure': False},
            'leaked_mib': 0,
            'lost': False,
            'no_permission': False,
            'drain': False,
            'reset_count': 0,
        })
    return {
        'schema': SCHEMA,
        'vendor': vendor,
        'driver': driver,
        'driver_version': driver_version,
        'nvml_version': nvml_version,
        'cuda_driver_version': cuda_version,
        'release_delay_ms': int(release_delay_ms or 0),
        'dev_dir': dev_dir,
        'gpus': devices,
        'processes': [],
    }


def device_paths(state, gpu):
    """The device files a workload on this GPU opens (contracts.md, "Simulated device files")."""
    dev_dir = state.get('dev_dir') or '/dev'
    minor = gpu.get('minor', gpu.get('index', 0))
    if state.get('vendor') == 'amd':
        return [os.path.join(dev_dir, 'kfd'), os.path.join(dev_dir, 'dri', 'renderD%d' % (128 + minor))]
    if state.get('vendor') == 'intel':
        return [os.path.join(dev_dir, 'dri', 'renderD%d' % (128 + minor))]
    return [os.path.join(dev_dir, 'nvidiactl'), os.path.join(dev_dir, 'nvidia-uvm'),
            os.path.join(dev_dir, 'nvidia%d' % minor)]


# ---------------------------------------------------------------------------
# reset (shared by the fake nvidia-smi, amd-smi and amdsmi)


def busy_entries(state, index):
    return [e for e in state.get('processes', []) if e.get('gpu') == index and entry_busy(e)]


def apply_reset(state, gpu):
    """What a successful reset does: forget leaked memory, the lost flag, volatile ECC counts,
    pending row remaps and every (dead) process entry of the GPU; count the reset."""
    gpu['leaked_mib'] = 0
    gpu['lost'] = False
    gpu['ecc_uncorrected'] = 0
    gpu['ecc_corrected'] = 0
    rows = gpu.get('remapped_rows')
    if isinstance(rows, dict):
        rows['pending'] = False
    gpu['util_pct'] = 0
    gpu['mem_util_pct'] = 0
    gpu['reset_count'] = int(gpu.get('reset_count') or 0) + 1
    state['processes'] = [e for e in state.get('processes', []) if e.get('gpu') != gpu.get('index')]
