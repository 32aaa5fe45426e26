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
import shutil
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
    """Device used memory = reserved + leaked + sum of counted entries' used_mib (null as 0), plus the
    GPU's ``context_overhead_mib`` (memory the driver charges to no process) per counted entry."""
    gpu = gpu_by_index(state, index)
    if gpu is None:
        return None
    if now is None:
        now = time.time()
    delay = state.get('release_delay_ms') or 0
    used = (gpu.get('memory_reserved_mib') or 0) + (gpu.get('leaked_mib') or 0)
    for entry in state.get('processes', []):
        if entry.get('gpu') == index and entry_counted(entry, delay, now):
            used += (entry.get('used_mib') or 0) + (gpu.get('context_overhead_mib') or 0)
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
        overhead = (gpu_by_index(out, entry.get('gpu')) or {}).get('context_overhead_mib') or 0
        used[entry.get('gpu')] = used.get(entry.get('gpu'), 0) + entry['counted_mib'] + (overhead if counted else 0)
    for gpu in out.get('gpus', []):
        total_used = (gpu.get('memory_reserved_mib') or 0) + (gpu.get('leaked_mib') or 0) + used.get(gpu.get('index'), 0)
        gpu['used_mib'] = total_used
        gpu['free_mib'] = max(0, (gpu.get('memory_total_mib') or 0) - total_used)
        # What the shim reports as device utilization: the state's figure or its live processes' sum.
        if gpu.get('util_pct') is not None:
            gpu['effective_util_pct'] = max(gpu['util_pct'], min(100, busy.get(gpu.get('index'), 0)))
        for inst in gpu.get('mig_instances') or []:
            # per MIG instance: its memory (part of the board's used_mib, never counted twice) and live pids
            inst['used_mib'] = mig_used_mib(out, gpu, inst, now)
            inst['free_mib'] = max(0, (inst.get('memory_mib') or 0) - inst['used_mib'])
            inst['processes'] = [e['pid'] for e in out.get('processes', []) if e.get('gpu') == gpu.get('index')
                                 and e.get('mig_gi') == inst['gi'] and e.get('mig_ci') == inst['ci'] and e['alive']]
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
              dev_dir='/dev', seed='gpusim', reserved_mib=0, drm_root=None, intel_driver='xe', sys_root=None):
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
    state = {
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
    if vendor == 'nvidia':
        # extra keys of NVIDIA nodes: the kernel modules' references and where their fake /sys lives
        state['kernel_modules'] = default_kernel_modules()
        state['sys_root'] = sys_root
    if vendor == 'intel':
        if intel_driver not in INTEL_DRIVERS:
            raise StateError('unknown Intel driver %r (%s)' % (intel_driver, ', '.join(INTEL_DRIVERS)))
        # extra keys of Intel nodes (readers of other vendors ignore them): the fake DRM tree
        state['intel_driver'] = intel_driver
        state['drm_root'] = drm_root
    return state


def device_paths(state, gpu, instance=None):
    """The device files a workload on this GPU opens (contracts.md, "Simulated device files").

    ``instance`` (an entry of the GPU's ``mig_instances``): also the capability files of that MIG
    instance, ``<dev_dir>/nvidia-caps/nvidia-cap<GI minor>`` and ``nvidia-cap<CI minor>``."""
    dev_dir = state.get('dev_dir') or '/dev'
    minor = gpu.get('minor', gpu.get('index', 0))
    if state.get('vendor') == 'amd':
        return [os.path.join(dev_dir, 'kfd'), os.path.join(dev_dir, 'dri', 'renderD%d' % (128 + minor))]
    if state.get('vendor') == 'intel':
        return [os.path.join(dev_dir, 'dri', 'renderD%d' % (128 + minor))]
    paths = [os.path.join(dev_dir, 'nvidiactl'), os.path.join(dev_dir, 'nvidia-uvm'),
             os.path.join(dev_dir, 'nvidia%d' % minor)]
    if instance is not None:
        gi_minor, ci_minor = mig_cap_minors(minor, instance['gi'], instance['ci'])
        paths += [os.path.join(dev_dir, 'nvidia-caps', 'nvidia-cap%d' % gi_minor),
                  os.path.join(dev_dir, 'nvidia-caps', 'nvidia-cap%d' % ci_minor)]
    return paths


# ---------------------------------------------------------------------------
# MIG on an H200-class board (141 GB).  Names, compute slices, memory fractions, engines and the
# most instances per profile: NVIDIA's MIG User Guide, "Supported MIG Profiles", table "GPU Instance
# Profiles on H200".  Placements (start:size in memory eighths) follow the guide's placement diagram
# for H100/H200 (as `nvidia-smi mig -lgipp` prints them on an A100/H100); profile ids (the `id` of
# nvmlGpuInstanceProfileInfo_t, as `nvidia-smi mig -lgip` shows them) and SM counts are those of
# `nvidia-smi mig -lgip` on Hopper.  The guide gives memory as fractions, not MiB: one eighth is
# taken as 17920 MiB (17.5 GiB), so 7g.141gb is 143360 MiB (140.00 GiB, as `-lgip` prints it on an
# H200) of the board's 143771 MiB.  Confirm on real hardware with tests/device/run's `mig` check.

MIG_BOARD = {'name': 'NVIDIA H200', 'memory_total_mib': 143771, 'compute_capability': '9.0'}
MIG_COMPUTE_SLICES = 7
MIG_MEMORY_SLICES = 8
MIG_MEMORY_SLICE_MIB = 17920
# name: NVML_GPU_INSTANCE_PROFILE_* (enum), profile id, compute slices, memory eighths, most instances,
#       SMs, copy engines, NVDEC, NVJPG, OFA, placement starts, NVML_COMPUTE_INSTANCE_PROFILE_* of the full-size CI
_MIG_TABLE = (
    ('1g.18gb', 0x0, 19, 1, 1, 7, 16, 1, 1, 1, 0, (0, 1, 2, 3, 4, 5, 6), 0x0),
    ('1g.35gb', 0x9, 15, 1, 2, 4, 26, 1, 1, 1, 0, (0, 2, 4, 6), 0x0),
    ('2g.35gb', 0x1, 14, 2, 2, 3, 32, 2, 2, 2, 0, (0, 2, 4), 0x1),
    ('3g.71gb', 0x2, 9, 3, 4, 2, 60, 3, 3, 3, 0, (0, 4), 0x2),
    ('4g.71gb', 0x3, 5, 4, 4, 1, 64, 4, 4, 4, 0, (0,), 0x3),
    ('7g.141gb', 0x4, 0, 7, 8, 1, 132, 8, 7, 7, 1, (0,), 0x4),
)
MIG_PROFILES = dict((row[0], {
    'name': row[0], 'enum': row[1], 'id': row[2], 'slices': row[3], 'memory_slices': row[4], 'instance_count': row[5],
    'multiprocessors': row[6], 'copy_engines': row[7], 'decoders': row[8], 'encoders': 0, 'jpegs': row[9], 'ofas': row[10],
    'placements': list(row[11]), 'ci_enum': row[12], 'memory_mib': row[4] * MIG_MEMORY_SLICE_MIB}) for row in _MIG_TABLE)


def mig_cap_minors(gpu_minor, gi, ci):
    """Minors of /dev/nvidia-caps/nvidia-cap<N> guarding a GPU instance and its compute instance, as the
    driver numbers them in /proc/driver/nvidia-caps/mig-minors (1 config, 2 monitor, then per GPU 15 GIs
    of 1 + 8 minors: gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, ..., gpu3/gi3/ci3/access 439)."""
    gi_minor = 3 + int(gpu_minor) * 135 + int(gi) * 9
    return gi_minor, gi_minor + 1 + int(ci)


def mig_uuid(gpu_uuid, gi, ci):
    """A stable MIG device UUID (``MIG-`` + a version-5-looking UUID) from the parent's UUID and GI/CI."""
    digest = hashlib.sha256(('mig|%s|%d|%d' % (gpu_uuid, gi, ci)).encode('utf-8')).hexdigest()
    return 'MIG-%s-%s-5%s-%s%s-%s' % (digest[0:8], digest[8:12], digest[13:16], '89ab'[int(digest[16], 16) % 4], digest[17:20],
                                      digest[20:32])


def parse_mig_spec(text):
    """``GPU:PROFILE,PROFILE...`` of ``gpusim init --mig`` -> (gpu index, [profile names]); StateError naming the value."""
    index, sep, profiles = str(text).partition(':')
    if not sep or not index.strip().isdigit():
        raise StateError('--mig expects GPU:PROFILE[,PROFILE...] (e.g. 0:3g.71gb,2g.35gb,1g.18gb), got %r' % (text,))
    names = [name.strip() for name in profiles.split(',') if name.strip()]
    if not names:
        raise StateError('--mig %r names no profile (H200 profiles: %s)' % (text, ', '.join(MIG_PROFILES)))
    for name in names:
        if name not in MIG_PROFILES:
            raise StateError('--mig %r: unknown MIG profile %r (H200 profiles: %s)' % (text, name, ', '.join(MIG_PROFILES)))
    return int(index), names


def _mig_place(names, taken=()):
    """Memory-slice placements for the profiles in order (first fit, backtracking), or None when none fits."""
    if not names:
        return []
    profile = MIG_PROFILES[names[0]]
    for start in profile['placements']:
        span = set(range(start, start + profile['memory_slices']))
        if span & set(taken):
            continue
        rest = _mig_place(names[1:], set(taken) | span)
        if rest is not None:
            return [start] + rest
    return None


def mig_layout(gpu, names):
    """The ``mig_instances`` of a GPU holding the named profiles (GI ids 1.. in the given order, one
    full-size compute instance 0 each); StateError naming the offending value when the board cannot."""
    what = '%d:%s' % (gpu['index'], ','.join(names))
    for name in set(names):
        most = MIG_PROFILES[name]['instance_count']
        if names.count(name) > most:
            raise StateError('--mig %s: at most %d instance(s) of %s fit on an H200, got %d' % (what, most, name, names.count(name)))
    slices = sum(MIG_PROFILES[name]['slices'] for name in names)
    if slices > MIG_COMPUTE_SLICES:
        raise StateError('--mig %s: the profiles need %d compute slices, an H200 has %d' % (what, slices, MIG_COMPUTE_SLICES))
    starts = _mig_place(names)
    if starts is None:
        raise StateError('--mig %s: no placement fits these profiles in the 8 memory slices of an H200 '
                         '(placements: %s)' % (what, '; '.join('%s at %s' % (n, MIG_PROFILES[n]['placements']) for n in names)))
    out = []
    for gi, (name, start) in enumerate(zip(names, starts), 1):
        out.append({'gi': gi, 'ci': 0, 'profile': name, 'placement': start, 'memory_mib': MIG_PROFILES[name]['memory_mib'],
                    'uuid': mig_uuid(gpu['uuid'], gi, 0)})
    return out


def mig_profile_table():
    """The per-GPU ``mig_profiles`` the shim answers nvmlDeviceGetGpuInstanceProfileInfo* from."""
    return [dict(MIG_PROFILES[row[0]]) for row in _MIG_TABLE]


def apply_mig(state, specs):
    """Put the GPUs named by ``--mig`` specs into MIG mode with their instances (StateError on a bad spec)."""
    seen = set()
    for text in specs:
        index, names = parse_mig_spec(text)
        gpu = gpu_by_index(state, index)
        if gpu is None:
            raise StateError('--mig %r: unknown GPU index %d (this node has GPUs 0-%d)' % (text, index, len(state['gpus']) - 1))
        if index in seen:
            raise StateError('--mig %r: GPU %d is given twice' % (text, index))
        seen.add(index)
        gpu['mig'] = True
        gpu['mig_profiles'] = mig_profile_table()
        gpu['mig_instances'] = mig_layout(gpu, names)


def mig_instance(gpu, gi, ci=0):
    """The GPU's MIG instance with these ids, or None."""
    for inst in gpu.get('mig_instances') or []:
        if inst.get('gi') == gi and inst.get('ci') == ci:
            return inst
    return None


def mig_used_mib(state, gpu, inst, now=None):
    """Memory used on one MIG instance: its counted entries (plus the driver's context overhead each)."""
    if now is None:
        now = time.time()
    delay = state.get('release_delay_ms') or 0
    used = 0
    for entry in state.get('processes', []):
        if (entry.get('gpu') == gpu.get('index') and entry.get('mig_gi') == inst['gi'] and entry.get('mig_ci') == inst['ci']
                and entry_counted(entry, delay, now)):
            used += (entry.get('used_mib') or 0) + (gpu.get('context_overhead_mib') or 0)
    return used


# Creating and destroying GPU and compute instances (the shim's nvmlDeviceCreateGpuInstance[WithPlacement],
# nvmlGpuInstanceCreateComputeInstance, nvmlGpuInstanceDestroy, nvmlComputeInstanceDestroy run `gpusim _mig`).
# A GPU instance without compute instance is an entry with "ci": null and "uuid": null (no MIG device).  The
# errors carry the NVML return code the shim answers with.
NVML_INVALID_ARGUMENT, NVML_NOT_SUPPORTED, NVML_NOT_FOUND, NVML_IN_USE, NVML_INSUFFICIENT_RESOURCES = 2, 3, 6, 19, 23


class MigError(StateError):
    """A refused MIG change: ``code`` is the NVML return code."""

    def __init__(self, code, message):
        StateError.__init__(self, message)
        self.code = code


def _mig_gpu(state, index):
    gpu = gpu_by_index(state, index)
    if gpu is None or not gpu.get('mig') or 'mig_instances' not in gpu:
        raise MigError(NVML_NOT_SUPPORTED, 'GPU %s is not in MIG mode with a MIG layout' % index)
    return gpu


def mig_create_gi(state, index, profile_id, start=None):
    """Add a GPU instance of the profile with this id (at memory slice ``start``, else the first free placement);
    returns its GI id (the lowest unused, from 1)."""
    gpu = _mig_gpu(state, index)
    profile = next((p for p in gpu.get('mig_profiles') or [] if p.get('id') == profile_id), None)
    if profile is None:
        raise MigError(NVML_INVALID_ARGUMENT, 'GPU %s has no GPU instance profile id %s' % (index, profile_id))
    insts = gpu['mig_instances']
    taken = set()
    for inst in insts:
        size = MIG_PROFILES[inst['profile']]['memory_slices'] if inst['profile'] in MIG_PROFILES else 1
        taken.update(range(inst['placement'], inst['placement'] + size))
    slices = sum(MIG_PROFILES[i['profile']]['slices'] for i in insts if i['profile'] in MIG_PROFILES)
    if start is not None and start not in profile['placements']:
        raise MigError(NVML_INVALID_ARGUMENT,
                       '%s cannot start at memory slice %s (placements %s)' % (profile['name'], start, profile['placements']))
    free = [s for s in ([start] if start is not None else profile['placements'])
            if not taken & set(range(s, s + profile['memory_slices']))]
    count = sum(1 for i in insts if i['profile'] == profile['name'])
    if not free or slices + profile['slices'] > MIG_COMPUTE_SLICES or count >= profile['instance_count']:
        raise MigError(NVML_INSUFFICIENT_RESOURCES, 'no room for a %s instance on GPU %s' % (profile['name'], index))
    gi = min(set(range(1, MIG_COMPUTE_SLICES + 1)) - set(i['gi'] for i in insts))
    insts.append({'gi': gi, 'ci': None, 'profile': profile['name'], 'placement': free[0], 'memory_mib': profile['memory_mib'],
                  'uuid': None})
    insts.sort(key=lambda i: i['gi'])
    return gi


def mig_create_ci(state, index, gi, profile_id):
    """Add the full-size compute instance (CI 0) to GPU instance ``gi``; returns its CI id."""
    gpu = _mig_gpu(state, index)
    inst = next((i for i in gpu['mig_instances'] if i['gi'] == gi), None)
    if inst is None:
        raise MigError(NVML_INVALID_ARGUMENT, 'GPU %s has no GPU instance %s' % (index, gi))
    if MIG_PROFILES[inst['profile']]['ci_enum'] != profile_id:
        raise MigError(NVML_NOT_SUPPORTED, 'only the full-size compute instance (profile %s) is simulated'
                       % MIG_PROFILES[inst['profile']]['ci_enum'])
    if inst['ci'] is not None:
        raise MigError(NVML_INSUFFICIENT_RESOURCES, 'GPU instance %s already has its compute instance' % gi)
    inst['ci'] = 0
    inst['uuid'] = mig_uuid(gpu['uuid'], gi, 0)
    return 0


def mig_destroy_ci(state, index, gi, now=None):
    gpu = _mig_gpu(state, index)
    inst = next((i for i in gpu['mig_instances'] if i['gi'] == gi and i['ci'] is not None), None)
    if inst is None:
        raise MigError(NVML_INVALID_ARGUMENT, 'GPU %s has no compute instance on GPU instance %s' % (index, gi))
    busy = [e['pid'] for e in state.get('processes', []) if e.get('gpu') == index and e.get('mig_gi') == gi and entry_busy(e)]
    if busy:
        raise MigError(NVML_IN_USE, 'processes %s run on GPU instance %s' % (busy, gi))
    inst['ci'] = None
    inst['uuid'] = None
    return 0


def mig_destroy_gi(state, index, gi):
    gpu = _mig_gpu(state, index)
    inst = next((i for i in gpu['mig_instances'] if i['gi'] == gi), None)
    if inst is None:
        raise MigError(NVML_INVALID_ARGUMENT, 'GPU %s has no GPU instance %s' % (index, gi))
    if inst['ci'] is not None:
        raise MigError(NVML_IN_USE, 'GPU instance %s still has a compute instance' % gi)
    gpu['mig_instances'].remove(inst)
    return 0


# ---------------------------------------------------------------------------
# health: Xid events (the NVML event queue and the fake kernel log), recovery action, hung driver

KMSG_ENV = '_GPUFLEET_KMSG'
MAX_XID_EVENTS = 256
# NVML_GPU_RECOVERY_ACTION_* of nvml.h
RECOVERY_ACTIONS = {'none': 0, 'reset': 1, 'reboot': 2, 'drain_p2p': 3, 'drain_and_reset': 4, 'recover_imex_domain': 5,
                    'bus_reset': 6, 'system_reboot': 7}
# What the driver prints after the code (a few common ones; the rest get a generic text)
XID_TEXTS = {
    13: 'Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address',
    31: 'Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_00000000. '
        'Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ',
    43: 'Ch 00000010',
    45: 'Ch 00000010',
    48: 'An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.',
    63: 'Row Remapper: New row marked for remapping, reset gpu to activate.',
    64: 'Row Remapper: Error when marking a row for remapping.',
    79: 'GPU has fallen off the bus.',
    94: 'Contained: SM (0x1). RST: No, D-RST: No',
    95: 'Uncontained: FBHUB. RST: Yes, D-RST: No',
    119: 'Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL).',
}


def default_kmsg_path(path):
    """The node's fake kernel log: next to the state file."""
    return os.path.splitext(os.path.abspath(path))[0] + '-kmsg'


def kmsg_pci(gpu):
    """The PCI address as an Xid line gives it: ``0000:07:00`` (4-digit domain, no function)."""
    domain, bus, rest = str(gpu.get('pci_bus_id') or '00000000:00:00.0').split(':')
    return '%04x:%s:%s' % (int(domain, 16), bus.lower(), rest.split('.')[0].lower())


# /dev/kmsg's PRIO field is facility * 8 + level: the kernel's own records have facility 0 (LOG_KERN); a write to
# /dev/kmsg gets LOG_USER (1) unless it names another facility, never 0.
KMSG_FACILITIES = {'kern': 0, 'user': 1, 'mail': 2, 'daemon': 3, 'auth': 4, 'syslog': 5, 'lpr': 6, 'news': 7,
                   'uucp': 8, 'cron': 9, 'authpriv': 10, 'ftp': 11, 'local0': 16, 'local7': 23}
KMSG_LEVELS = {'emerg': 0, 'alert': 1, 'crit': 2, 'err': 3, 'warning': 4, 'notice': 5, 'info': 6, 'debug': 7}


def kmsg_escape(text):
    """A message as /dev/kmsg prints it: each byte below 0x20, from 0x7f, and the backslash as ``\\xNN``."""
    data = text.encode('utf-8', 'surrogateescape') if isinstance(text, str) else bytes(text)
    return ''.join('\\x%02x' % b if b < 0x20 or b >= 0x7f or b == 0x5c else chr(b) for b in data)


def kmsg_record(state, message, facility=0, level=4, monotonic=None, usec=None, flags='-'):
    """One /dev/kmsg record (``PRIO,SEQ,USEC,FLAGS;MESSAGE``, the message escaped as the kernel does), with the
    node's next sequence number; USEC: microseconds of CLOCK_MONOTONIC (default now)."""
    seq = int(state.get('xid_seq') or 0) + 1
    state['xid_seq'] = seq
    if usec is None:
        usec = int((time.monotonic() if monotonic is None else monotonic) * 1e6)
    return '%d,%d,%d,%s;%s' % (facility * 8 + level, seq, usec, flags, kmsg_escape(message))


def append_kmsg(state, path, record):
    """Append ``record`` to the node's fake kernel log (the state's ``kmsg_path``, default next to ``path``)."""
    kmsg = state.get('kmsg_path') or default_kmsg_path(path)
    state['kmsg_path'] = kmsg
    with open(kmsg, 'a') as handle:
        handle.write(record + '\n')


def add_xid(state, gpu, code, pid=None, name=None, message=None, now=None, monotonic=None):
    """Queue an Xid event for the NVML event API and return the kernel-log record (``/dev/kmsg`` format): what the
    driver prints (krcReportXid), from the kernel (facility 0, level warning)."""
    now = time.time() if now is None else now
    who = "pid=%d, name=%s, " % (pid, name or '<unknown>') if pid is not None else "pid='<unknown>', name=<unknown>, "
    text = message or XID_TEXTS.get(int(code), 'simulated Xid %d' % int(code))
    line = 'NVRM: Xid (PCI:%s): %d, %s%s' % (kmsg_pci(gpu), int(code), who, text.replace('\n', ' '))
    record = kmsg_record(state, line, monotonic=monotonic)
    events = gpu.setdefault('xid_events', [])   # the NVML event shares the record's sequence number
    events.append({'seq': state['xid_seq'], 'time': round(now, 3), 'code': int(code), 'pid': pid})
    del events[:-MAX_XID_EVENTS]
    return record


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
    gpu.pop('recovery_action', None)
    gpu.pop('hang_until', None)
    gpu['xid_events'] = []
    if 'mig_instances' in gpu:
        gpu['mig_instances'] = []  # MIG mode survives a reset, its GPU and compute instances do not
    state['processes'] = [e for e in state.get('processes', []) if e.get('gpu') != gpu.get('index')]


# ---------------------------------------------------------------------------
# NVIDIA nodes: the kernel modules' reference counts, as a fake /sys/module tree read by the
# collection through its test seam $_GPUFLEET_SYS_ROOT (docs/design/contracts.md):
#
#   <sys_root>/module/<name>/refcnt          the reference count, one decimal line
#   <sys_root>/module/<name>/holders/<mod>   one empty file per module that depends on <name>
#
# As in the kernel, each holder module accounts for one reference of the module it depends on.
# References beyond the holders of nvidia_drm, nvidia_modeset or nvidia_uvm make the fake
# nvidia-smi refuse every reset ("In use by another client"), as a DRM console or a kernel client
# does on a real node.  Workloads' open device files are not counted here.

SYS_ROOT_ENV = '_GPUFLEET_SYS_ROOT'
KERNEL_MODULES = ('nvidia', 'nvidia_modeset', 'nvidia_drm', 'nvidia_uvm')
BLOCKING_MODULES = ('nvidia_drm', 'nvidia_modeset', 'nvidia_uvm')
SYS_MARKER = '.gpusim-sys-tree'


def default_kernel_modules():
    """The modules of an idle NVIDIA node: nvidia used by nvidia_modeset and nvidia_uvm, nvidia_modeset by nvidia_drm."""
    return {'nvidia': {'refcnt': 2, 'holders': ['nvidia_modeset', 'nvidia_uvm']},
            'nvidia_modeset': {'refcnt': 1, 'holders': ['nvidia_drm']},
            'nvidia_drm': {'refcnt': 0, 'holders': []},
            'nvidia_uvm': {'refcnt': 0, 'holders': []}}


def default_sys_root(path):
    """Where an NVIDIA node's fake /sys lives: next to the state file."""
    return os.path.splitext(os.path.abspath(path))[0] + '-sys'


def module_blockers(state):
    """[(module, refcnt, holders)] for the blocking modules with references beyond their holders."""
    out = []
    modules = state.get('kernel_modules') or {}
    for name in BLOCKING_MODULES:
        info = modules.get(name) or {}
        refcnt, holders = int(info.get('refcnt') or 0), list(info.get('holders') or [])
        if refcnt > len(holders):
            out.append((name, refcnt, holders))
    return out


def sync_sys_tree(state):
    """Write an NVIDIA node's fake /sys/module tree from the state (no-op for other vendors)."""
    root = state.get('sys_root')
    if state.get('vendor') != 'nvidia' or not root:
        return
    if os.path.isdir(root) and os.listdir(root) and not os.path.exists(os.path.join(root, SYS_MARKER)):
        raise StateError('%s exists and was not made by gpusim: choose another state path' % root)
    _put(os.path.join(root, SYS_MARKER), 'fake /sys/module tree of a gpusim NVIDIA node; gpusim rewrites it\n')
    for name, info in sorted((state.get('kernel_modules') or {}).items()):
        base = os.path.join(root, 'module', name)
        _put(os.path.join(base, 'refcnt'), '%d\n' % int(info.get('refcnt') or 0))
        holders = os.path.join(base, 'holders')
        os.makedirs(holders, exist_ok=True)
        wanted = set(info.get('holders') or [])
        for entry in os.listdir(holders):
            if entry not in wanted:
                os.unlink(os.path.join(holders, entry))
        for entry in wanted:
            _put(os.path.join(holders, entry), '')


# ---------------------------------------------------------------------------
# Intel nodes: a fake sysfs and /proc/PID/fdinfo tree (the DRM client usage stats of the i915 and
# xe drivers), read by the collection's Intel backend through its test seam $_GPUFLEET_DRM_ROOT.
#
#   <drm_root>/sys/class/drm/card<minor>/device -> ../../../bus/pci/devices/<bdf>
#   <drm_root>/sys/class/drm/renderD<128+minor>/device -> same
#   <drm_root>/sys/bus/pci/devices/<bdf>/{vendor,device,class,driver->../../drivers/<drv>,
#                                         tile<N>/physical_vram_size_bytes (xe),
#                                         hwmon/hwmon<minor>/{name,temp1_input,power1_max,energy1_input}}
#   <drm_root>/proc/sys/kernel/osrelease, <drm_root>/usr/share/misc/pci.ids
#   <drm_root>/proc/<pid>/fd -> /proc/<pid>/fd (the real fds: a dead pid's link dangles)
#   <drm_root>/proc/<pid>/stat -> /proc/<pid>/stat
#   <drm_root>/proc/<pid>/fdinfo/<fd>   for the fd on which the real process holds its render node
#
# The fdinfo is rewritten whenever gpusim runs; between runs it is static, so engine counters do
# not advance (utilization read from two samples is 0 on i915 and unknown on xe).

DRM_ROOT_ENV = '_GPUFLEET_DRM_ROOT'
INTEL_DRIVERS = ('xe', 'i915')
# product name (lower case substring) -> PCI device id
INTEL_DEVICE_IDS = (('max 1550', '0x0bd5'), ('max 1100', '0x0bda'), ('flex 170', '0x56c0'), ('arc(tm) a770', '0x56a0'),
                    ('a770', '0x56a0'))
DEFAULT_INTEL_DEVICE_ID = '0x0bd5'
_INTEL_TILE_MIB = 65536


def default_drm_root(path):
    """Where an Intel node's fake sysfs/proc tree lives: next to the state file."""
    return os.path.splitext(os.path.abspath(path))[0] + '-drm'


def sysfs_bdf(gpu):
    dom, bus, dev, fn = _norm_bus_id(gpu.get('pci_bus_id', '0:0.0')) or (0, 0, 0, 0)
    return '%04x:%02x:%02x.%x' % (dom & 0xFFFF, bus, dev, fn)


def intel_device_id(name):
    low = str(name or '').lower()
    for needle, device_id in INTEL_DEVICE_IDS:
        if needle in low:
            return device_id
    return DEFAULT_INTEL_DEVICE_ID


def _put(path, text):
    """Write a small file atomically (tmp + rename), creating its directory."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    tmp = '%s.tmp.%d' % (path, os.getpid())
    with open(tmp, 'w') as handle:
        handle.write(text)
    os.rename(tmp, path)


def _link(target, path):
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        if os.readlink(path) == target:
            return
        os.unlink(path)
    except OSError:
        pass
    os.symlink(target, path)


def _write_intel_sysfs(state, root):
    driver = state.get('intel_driver') or 'xe'
    sys_root = os.path.join(root, 'sys')
    os.makedirs(os.path.join(sys_root, 'bus', 'pci', 'drivers', driver), exist_ok=True)
    os.makedirs(os.path.join(sys_root, 'module', driver), exist_ok=True)
    names = {}
    for gpu in state.get('gpus', []):
        bdf = sysfs_bdf(gpu)
        minor = gpu.get('minor', gpu.get('index', 0))
        device_id = intel_device_id(gpu.get('name'))
        names[device_id] = re.sub(r'^Intel(?:\(R\))?\s+', '', str(gpu.get('name') or 'GPU'))
        dev = os.path.join(sys_root, 'bus', 'pci', 'devices', bdf)
        _put(os.path.join(dev, 'vendor'), '0x8086\n')
        _put(os.path.join(dev, 'device'), device_id + '\n')
        _put(os.path.join(dev, 'class'), '0x038000\n')
        _link('../../drivers/%s' % driver, os.path.join(dev, 'driver'))
        total = int(gpu.get('memory_total_mib') or 0)
        if driver == 'xe':
            tiles = max(1, -(-total // _INTEL_TILE_MIB))
            for tile in range(tiles):
                size = min(_INTEL_TILE_MIB, total - tile * _INTEL_TILE_MIB)
                _put(os.path.join(dev, 'tile%d' % tile, 'physical_vram_size_bytes'), '%d\n' % (size * 1048576))
        hwmon = os.path.join(dev, 'hwmon', 'hwmon%d' % minor)
        _put(os.path.join(hwmon, 'name'), driver + '\n')
        _put(os.path.join(hwmon, 'temp1_input'), '%d\n' % (int(gpu.get('temp_c') or 0) * 1000))
        _put(os.path.join(hwmon, 'power1_max'), '%d\n' % int(round(float(gpu.get('power_limit_w') or 0) * 1e6)))
        _put(os.path.join(hwmon, 'energy1_input'), '%d\n' % int(round(float(gpu.get('power_w') or 0) * 1e6 * 1000)))
        for name in ('card%d' % minor, 'renderD%d' % (128 + minor)):
            _link('../../../bus/pci/devices/%s' % bdf, os.path.join(sys_root, 'class', 'drm', name, 'device'))
    _put(os.path.join(root, 'proc', 'sys', 'kernel', 'osrelease'), os.uname()[2] + '\n')
    ids = ['# pci.ids of a gpusim Intel node', '8086  Intel Corporation']
    ids += ['\t%s  %s' % (device_id.replace('0x', ''), name) for device_id, name in sorted(names.items())]
    _put(os.path.join(root, 'usr', 'share', 'misc', 'pci.ids'), '\n'.join(ids) + '\n')


def _started_at(start_ticks, now):
    """Epoch seconds of a /proc starttime (clock ticks after boot); ``now`` when unknown."""
    if start_ticks is None:
        return now
    try:
        with open('/proc/stat') as handle:
            boot = next(float(line.split()[1]) for line in handle if line.startswith('btime '))
        ticks = os.sysconf('SC_CLK_TCK')
    except (OSError, ValueError, StopIteration):
        return now
    return boot + float(start_ticks) / ticks


def _render_fd(pid, device):
    """The fd number on which ``pid`` holds ``device`` open, or None."""
    base = '/proc/%d/fd' % pid
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    for fd in sorted(fds, key=int):
        try:
            if os.readlink(os.path.join(base, fd)) == device:
                return fd
        except OSError:
            continue
    return None


def intel_fdinfo(state, gpu, entry, now=None):
    """The fdinfo text of an entry's DRM client, as the i915 or xe driver prints it."""
    driver = state.get('intel_driver') or 'xe'
    if now is None:
        now = time.time()
    used = entry.get('used_mib')
    util = float(entry.get('util_pct') or 0) / 100.0
    age_ns = int(max(0.0, now - _started_at(entry.get('starttime'), now)) * 1e9)
    lines = ['pos:\t0', 'flags:\t02100002', 'mnt_id:\t26', 'ino:\t%d' % (1000 + int(gpu.get('minor', 0))),
             'drm-driver:\t%s' % driver, 'drm-client-id:\t%d' % entry['pid'], 'drm-pdev:\t%s' % sysfs_bdf(gpu)]
    if driver == 'xe':
        if used is not None:
            for region, value in (('system', '0'), ('gtt', '192 KiB'), ('vram0', '%d MiB' % used)):
                lines += ['drm-total-%s:\t%s' % (region, value), 'drm-shared-%s:\t0' % region,
                          'drm-active-%s:\t0' % region, 'drm-resident-%s:\t%s' % (region, value)]
                if region == 'system':
                    lines.append('drm-purgeable-system:\t0')
        total_cycles = 7655183225 + age_ns // 10
        lines += ['drm-cycles-rcs:\t0', 'drm-total-cycles-rcs:\t%d' % total_cycles,
                  'drm-cycles-ccs:\t%d' % int(age_ns // 10 * util * 4), 'drm-total-cycles-ccs:\t%d' % total_cycles,
                  'drm-engine-capacity-ccs:\t4']
    else:
        if used is not None:
            for region, value in (('system0', '4 MiB'), ('local0', '%d MiB' % used)):
                lines += ['drm-total-%s:\t%s' % (region, value), 'drm-shared-%s:\t0' % region,
                          'drm-active-%s:\t0' % region, 'drm-resident-%s:\t%s' % (region, value),
                          'drm-purgeable-%s:\t0' % region]
        lines += ['drm-engine-render:\t%d ns' % int(age_ns * util), 'drm-engine-copy:\t0 ns',
                  'drm-engine-video:\t0 ns', 'drm-engine-capacity-video:\t2', 'drm-engine-video-enhance:\t0 ns']
    return '\n'.join(lines) + '\n'


def _sync_intel_clients(state, root, now=None):
    proc_root = os.path.join(root, 'proc')
    wanted = {}
    for entry in state.get('processes', []):
        gpu = gpu_by_index(state, entry.get('gpu'))
        if gpu is None:
            continue
        devices = device_paths(state, gpu)
        pids = []
        if entry_listed(entry):
            pids.append(entry['pid'])
        pids += children_alive(entry)
        for pid in pids:
            fd = _render_fd(pid, devices[0])
            if fd is not None:
                wanted[pid] = (fd, intel_fdinfo(state, gpu, entry, now))
    try:
        present = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        present = []
    for name in present:
        if int(name) not in wanted:
            shutil.rmtree(os.path.join(proc_root, name), ignore_errors=True)
    for pid, (fd, text) in wanted.items():
        base = os.path.join(proc_root, str(pid))
        _link('/proc/%d/fd' % pid, os.path.join(base, 'fd'))
        _link('/proc/%d/stat' % pid, os.path.join(base, 'stat'))
        fdinfo = os.path.join(base, 'fdinfo')
        if os.path.isdir(fdinfo):
            for old in os.listdir(fdinfo):
                if old != fd:
                    os.unlink(os.path.join(fdinfo, old))
        _put(os.path.join(fdinfo, fd), text)


DRM_MARKER = '.gpusim-drm-tree'


def sync_drm_tree(state, now=None, fresh=False):
    """Bring an Intel node's fake sysfs/fdinfo tree in line with the state (no-op for other vendors).

    ``fresh``: first remove a tree a previous ``init`` left (only one carrying gpusim's marker).
    """
    root = state.get('drm_root')
    if state.get('vendor') != 'intel' or not root:
        return
    if fresh and os.path.exists(os.path.join(root, DRM_MARKER)):
        shutil.rmtree(root, ignore_errors=True)
    if os.path.isdir(root) and os.listdir(root) and not os.path.exists(os.path.join(root, DRM_MARKER)):
        raise StateError('%s exists and was not made by gpusim: choose another --drm-root' % root)
    _put(os.path.join(root, DRM_MARKER), 'fake sysfs/proc tree of a gpusim Intel node; gpusim init replaces it\n')
    _write_intel_sysfs(state, root)
    _sync_intel_clients(state, root, now)
