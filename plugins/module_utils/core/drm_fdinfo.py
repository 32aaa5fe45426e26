# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""DRM client usage stats (``/proc/PID/fdinfo/FD``) and DRM cards in sysfs, for amdgpu, i915 and xe.

The kernel's Documentation/gpu/drm-usage-stats.rst defines the fdinfo format: one ``key: value``
per line, every DRM key prefixed ``drm-``; numbers may end with a unit.

* Identity: ``drm-driver`` (mandatory), ``drm-pdev`` (PCI address), ``drm-client-id`` (one per
  ``struct drm_file``: a dup()'d or inherited fd shows the same id, so clients are counted once
  per ``(drm-pdev, drm-client-id)``), ``drm-client-name``.
* Engines: ``drm-engine-<e>: N ns`` (busy time), ``drm-engine-capacity-<e>`` (identical engines
  behind one name, 1 when absent), ``drm-cycles-<e>`` with either ``drm-total-cycles-<e>`` (xe:
  a GPU timestamp, so busy = delta cycles / delta total cycles) or ``drm-maxfreq-<e>`` (Hz, KHz,
  MHz).  Counters may briefly go backwards: a lower value than the previous one counts as no
  progress.
* Memory per region: ``drm-total-``, ``drm-shared-``, ``drm-resident-``, ``drm-purgeable-``,
  ``drm-active-<region>`` and the legacy ``drm-memory-<region>`` (an alias of resident), in bytes
  or with ``KiB``/``MiB``.  Regions: amdgpu ``vram``/``gtt``/``cpu``; i915 ``system0``,
  ``local0``, ``stolen-*``; xe ``system``, ``gtt``, ``vram0``..., ``stolen``.

Utilization needs two readings a short interval apart (``sample_pair``).  Only fds whose link
target is a DRM device file (``.../dri/renderD*`` or ``.../dri/card*``) are read.  Other users'
fds need root or CAP_SYS_PTRACE; those processes are counted in ``fds_denied``.  The walk is bounded (core/fdwalk.py):
what its bound leaves makes the device's process list incomplete, with the reason.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict

from .identity import kernel_lines, read_ppid
from .fdwalk import FdBudget, incomplete_text, walk_fd_links

MIB = 1024 * 1024
MEMORY_CATEGORIES = ('total', 'shared', 'resident', 'purgeable', 'active')
_MEMORY_UNITS = {'': 1, 'B': 1, 'KiB': 1024, 'MiB': MIB, 'GiB': 1024 * MIB}
_FREQ_UNITS = {'Hz': 1, 'KHz': 1000, 'kHz': 1000, 'MHz': 1000000, 'GHz': 1000000000}
_TIME_UNITS = {'': 1, 'ns': 1}

# Device-local memory (VRAM, Intel "local memory"); stolen memory is neither local nor system.
_LOCAL_REGION_RE = re.compile(r'^(?:vram|local)\d*$')
_STOLEN_REGION_RE = re.compile(r'^stolen')
# An fd link target naming a DRM device file (any device root: /dev, or a test's scratch dir).
_DRM_LINK_RE = re.compile(r'(?:^|/)dri/(card|renderD)(\d+)$')

INTEL_DRIVERS = ('i915', 'xe')
AMD_DRIVERS = ('amdgpu',)

# Default interval between the two readings that make a utilization figure, and how old a
# previous reading of the same process may be to serve as the first of the two.
SAMPLE_INTERVAL_S = 0.25
BASELINE_MAX_AGE_S = 30.0

# Test seam, never a user option: read sysfs and /proc below this directory (<root>/sys,
# <root>/proc).  The simulator (tests/sim/gpusim, Intel nodes) sets it.
ROOT_ENV = '_GPUFLEET_DRM_ROOT'


def drm_root(root=None):
    """The directory that holds ``sys`` and ``proc`` for the DRM readers ('/' on a real host)."""
    if root:
        return root
    return os.environ.get(ROOT_ENV) or '/'


# ---------------------------------------------------------------------------- parsing
def _number(value, units):
    """``'123 KiB'`` -> 123 * 1024 with ``units`` {suffix: factor}; None when malformed."""
    parts = value.split()
    if not parts or len(parts) > 2:
        return None
    unit = parts[1] if len(parts) == 2 else ''
    if unit not in units:
        return None
    try:
        number = int(parts[0])
    except ValueError:
        return None
    if number < 0:
        return None
    return number * units[unit]


class DrmClient(object):
    """One DRM client (``struct drm_file``) as its fdinfo shows it.

    ``engines`` {name: busy ns}, ``capacity`` {name: n}, ``cycles``/``total_cycles`` {name: n},
    ``maxfreq`` {name: Hz}, ``memory`` {category: {region: bytes}} (legacy ``drm-memory-`` lands in
    ``resident``).  ``pids`` and ``fds`` are filled by the scan; ``parse_errors`` counts DRM keys
    whose value could not be parsed.
    """

    def __init__(self):
        self.driver = None
        self.pdev = None
        self.client_id = None
        self.name = None
        self.engines = {}
        self.capacity = {}
        self.cycles = {}
        self.total_cycles = {}
        self.maxfreq = {}
        self.memory = dict((cat, {}) for cat in MEMORY_CATEGORIES)
        self._legacy_memory = {}
        self.parse_errors = 0
        self.pids = set()
        self.fds = []

    @property
    def key(self):
        """``(pdev, client_id)``; None when the driver gives no client id (then nothing can be deduplicated)."""
        if self.client_id is None:
            return None
        return (self.pdev or '', self.client_id)

    @property
    def engine_names(self):
        return sorted(set(self.engines) | set(self.cycles))

    def regions(self):
        names = set(self._legacy_memory)
        for values in self.memory.values():
            names.update(values)
        return sorted(names)

    def region_bytes(self, region):
        """Memory of one region the client holds: resident, else total; None when not reported."""
        for category in ('resident', 'total'):
            if region in self.memory[category]:
                return self.memory[category][region]
        return None

    def _sum(self, predicate):
        values = [self.region_bytes(r) for r in self.regions() if predicate(r)]
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    def local_bytes(self):
        """Device-local memory (VRAM, local memory); None when the client reports no such region."""
        return self._sum(lambda r: bool(_LOCAL_REGION_RE.match(r)))

    def system_bytes(self):
        """System memory used for GPU buffers (system, gtt, cpu regions; not stolen); None if none reported."""
        return self._sum(lambda r: not _LOCAL_REGION_RE.match(r) and not _STOLEN_REGION_RE.match(r))

    def used_bytes(self):
        """The memory figure of this client: device-local memory where the GPU has any (discrete
        GPUs), else the system memory its buffers use (integrated GPUs have no memory of their own)."""
        local = self.local_bytes()
        return local if local is not None else self.system_bytes()

    def merge(self, other):
        """Fold another read of the same client in (a second fd of it): keep the larger counters."""
        for attr in ('engines', 'cycles', 'total_cycles'):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            for name, value in theirs.items():
                if value > mine.get(name, -1):
                    mine[name] = value
        for name, value in other.capacity.items():
            self.capacity.setdefault(name, value)
        for name, value in other.maxfreq.items():
            self.maxfreq.setdefault(name, value)
        self.pids.update(other.pids)
        self.fds.extend(other.fds)

    def _finish(self):
        for region, value in self._legacy_memory.items():
            self.memory['resident'].setdefault(region, value)


def parse_fdinfo(text):
    """Parse one fdinfo text; a DrmClient, or None when it is not a DRM fd (no ``drm-driver``)."""
    client = DrmClient()
    for line in kernel_lines(text or ''):  # drm-client-name is the client's own text
        key, sep, value = line.partition(':')
        if not sep:
            continue
        key = key.strip()
        value = value.strip()
        if not key.startswith('drm-'):
            continue
        rest = key[4:]
        if rest == 'driver':
            client.driver = value or None
        elif rest == 'pdev':
            client.pdev = value.lower() or None
        elif rest == 'client-id':
            number = _number(value, {'': 1})
            if number is None:
                client.parse_errors += 1
            else:
                client.client_id = number
        elif rest == 'client-name':
            client.name = value or None
        else:
            _parse_counter(client, rest, value)
    if client.driver is None:
        return None
    client._finish()  # pylint: disable=protected-access
    return client


# (key prefix after "drm-", attribute, units); longer prefixes first: "total-cycles-" before "total-",
# "engine-capacity-" before "engine-".
_COUNTER_KEYS = (
    ('engine-capacity-', 'capacity', {'': 1}),
    ('engine-', 'engines', _TIME_UNITS),
    ('total-cycles-', 'total_cycles', {'': 1}),
    ('cycles-', 'cycles', {'': 1}),
    ('maxfreq-', 'maxfreq', _FREQ_UNITS),
)


def _parse_counter(client, rest, value):
    for prefix, attr, units in _COUNTER_KEYS:
        if rest.startswith(prefix) and len(rest) > len(prefix):
            number = _number(value, units)
            if number is None or (attr == 'capacity' and number == 0):
                client.parse_errors += 1
            else:
                getattr(client, attr)[rest[len(prefix):]] = number
            return
    category, sep, region = rest.partition('-')
    if sep and region and (category in MEMORY_CATEGORIES or category == 'memory'):
        number = _number(value, _MEMORY_UNITS)
        if number is None:
            client.parse_errors += 1
        elif category == 'memory':
            client._legacy_memory[region] = number  # pylint: disable=protected-access
        else:
            client.memory[category][region] = number
    # other drm- keys (drm-curfreq-, future keys) are ignored


# ---------------------------------------------------------------------------- scanning /proc
class ClientScan(object):
    """One pass over ``<proc_root>/*/fd``: the DRM clients found, deduplicated.

    ``clients``: OrderedDict key -> DrmClient (key ``(pdev, client_id)``, or a per-fd key when the
    driver prints no client id).  ``fds_denied``: processes whose fds or fdinfo we may not read.
    ``taken_at``: the clock reading when the scan finished.
    """

    def __init__(self, clients, fds_denied, taken_at, extra=None, incomplete=None):
        self.clients = clients
        self.fds_denied = fds_denied
        self.taken_at = taken_at
        self.extra = extra if extra is not None else {}
        self.incomplete = incomplete   # None, or what the walk's bound left (fdwalk.FdBudget.incomplete)

    @property
    def complete(self):
        return self.fds_denied == 0 and self.incomplete is None


def _read(path):
    with open(path, 'rb') as handle:
        return handle.read().decode('utf-8', 'replace')


def scan_clients(proc_root='/proc', drivers=None, exclude=(), clock=time.monotonic, budget=None):
    """Read the fdinfo of every DRM device fd under ``proc_root``; a ClientScan.  Never raises.

    The fds come from the core's one fd walk (fdwalk.walk_fd_links, under ``budget``: a default
    fdwalk.FdBudget when None), in pid order; what its bound left is the scan's ``incomplete``."""
    clients = OrderedDict()
    denied = 0
    budget = FdBudget() if budget is None else budget
    for pid, names, targets, complete in walk_fd_links(proc_root, exclude=exclude, ordered=True, budget=budget):
        blocked = complete is False
        for fd, target in zip(names, targets):
            if target.endswith(' (deleted)') or not _DRM_LINK_RE.search(target):
                continue
            try:
                client = parse_fdinfo(_read(os.path.join(proc_root, str(pid), 'fdinfo', fd)))
            except PermissionError:
                blocked = True
                continue
            except OSError:  # the fd was closed meanwhile, or the process exited
                continue
            if client is None or (drivers and client.driver not in drivers):
                continue
            client.pids.add(pid)
            client.fds.append((pid, fd))
            key = client.key
            if key is None:
                key = (client.pdev or '', 'pid %d fd %s' % (pid, fd))
            if key in clients:
                clients[key].merge(client)
            else:
                clients[key] = client
        if blocked:
            denied += 1
    return ClientScan(clients, denied, clock(), incomplete=budget.incomplete())


def owner_pid(pids, proc_root='/proc'):
    """The pid a client shared by several processes (inherited fds) is attributed to.

    The process whose parent is not among them (the one that opened the device and forked the
    others), the lowest such pid when there are several; the others show as device holders.
    """
    pids = sorted(set(pids))
    if len(pids) <= 1:
        return pids[0] if pids else None
    members = set(pids)
    roots = [pid for pid in pids if read_ppid(pid, proc_root) not in members]
    return (roots or pids)[0]


# ---------------------------------------------------------------------------- utilization
def _progress(prev, cur):
    """cur - prev, or 0 when a counter went backwards (the spec: stay with the larger value)."""
    if prev is None or cur is None:
        return None
    return cur - prev if cur >= prev else 0


def engine_utilization(prev, cur, elapsed_s):
    """{engine: percent (float)} of one client between two readings ``elapsed_s`` apart."""
    result = {}
    for name in cur.engine_names:
        capacity = cur.capacity.get(name) or prev.capacity.get(name) or 1
        busy = None
        if name in cur.engines and name in prev.engines:
            delta = _progress(prev.engines[name], cur.engines[name])
            if elapsed_s and elapsed_s > 0:
                busy = delta / (elapsed_s * 1e9 * capacity)
        elif name in cur.cycles and name in prev.cycles:
            delta = _progress(prev.cycles[name], cur.cycles[name])
            if name in cur.total_cycles and name in prev.total_cycles:
                span = _progress(prev.total_cycles[name], cur.total_cycles[name])
                if span:
                    busy = delta / float(span * capacity)
            elif name in cur.maxfreq and elapsed_s and elapsed_s > 0:
                busy = delta / (cur.maxfreq[name] * elapsed_s * capacity)
        if busy is not None:
            result[name] = max(0.0, min(100.0, busy * 100.0))
    return result


def client_utilization(prev, cur, elapsed_s):
    """Busiest engine of one client in percent (int), or None when the readings cannot tell."""
    if prev is None or cur is None:
        return None
    engines = engine_utilization(prev, cur, elapsed_s)
    if not engines:
        return None
    return int(round(max(engines.values())))


def device_utilization(prev_clients, cur_clients, elapsed_s):
    """Busiest engine of a device in percent (int): per engine, the sum over its clients.

    ``prev_clients``/``cur_clients`` map client key -> DrmClient.  None when no client was read
    twice or no engine counter could be compared (not reported, or not advancing).
    """
    per_engine = {}
    compared = False
    for key, cur in cur_clients.items():
        prev = prev_clients.get(key)
        if prev is None:
            continue
        compared = True
        for name, pct in engine_utilization(prev, cur, elapsed_s).items():
            per_engine[name] = per_engine.get(name, 0.0) + pct
    if not compared or not per_engine:
        return None
    return int(round(min(100.0, max(per_engine.values()))))


def _of_pdev(scan, pdev):
    pdev = (pdev or '').lower()
    return OrderedDict((k, c) for k, c in scan.clients.items() if (c.pdev or '') == pdev)


def pdev_utilization(first, second, pdev):
    """Utilization of the device at PCI address ``pdev`` from every client's engine time (int percent).

    Only meaningful when both scans were complete (every process's fdinfo readable).  0 when the
    device has no client; None when its clients were not all read twice (they are new).
    """
    cur = _of_pdev(second, pdev)
    if not cur:
        return 0
    prev = _of_pdev(first, pdev)
    if any(key not in prev for key in cur):
        return None
    return device_utilization(prev, cur, second.taken_at - first.taken_at)


_GRAPHICS_ENGINES = ('render', 'rcs', '3d', 'gfx')


def add_client_processes(dev, first, second, pdev, proc_root='/proc'):
    """Add the DRM clients of the device at ``pdev`` to ``dev`` (a model.Device) as driver processes.

    One entry per owning pid (owner_pid): memory summed over its clients in MiB (None when one
    client reports no memory), utilization summed over its clients (None when one was not read
    twice), type ``graphics`` when a render engine is its busiest, else ``compute``.  Each
    DriverProcess also gets ``system_mib`` (GTT / system memory of its buffers) when reported.
    Returns the device's clients in the second reading.
    """
    elapsed = second.taken_at - first.taken_at
    clients = list(_of_pdev(second, pdev).values())
    per_pid = OrderedDict()
    for client in clients:
        pid = owner_pid(client.pids, proc_root)
        if pid is None:
            continue
        prev = first.clients.get(client.key) if client.key is not None else None
        util = client_utilization(prev, client, elapsed)
        used = client.used_bytes()
        system = client.system_bytes() if client.local_bytes() is not None else None
        entry = per_pid.setdefault(pid, {'used': 0, 'util': 0, 'system': 0, 'graphics': False})
        entry['used'] = None if entry['used'] is None or used is None else entry['used'] + used
        entry['util'] = None if entry['util'] is None or util is None else min(100, entry['util'] + util)
        entry['system'] = None if entry['system'] is None or system is None else entry['system'] + system
        if prev is not None:
            engines = engine_utilization(prev, client, elapsed)
            if engines and max(engines.values()) > 0 and max(engines, key=engines.get) in _GRAPHICS_ENGINES:
                entry['graphics'] = True
    for pid in sorted(per_pid):
        entry = per_pid[pid]
        used = entry['used'] // MIB if entry['used'] is not None else None
        proc = dev.add_driver_process(pid, used, 'graphics' if entry['graphics'] else 'compute')
        proc.util_pct = entry['util']
        if entry['system'] is not None:
            proc.system_mib = entry['system'] // MIB
    return clients


def card_lost(dev, card):
    """Mark ``dev`` lost when its card left sysfs since the probe; True then."""
    if card.exists():
        return False
    dev.processes_complete = False
    dev.health.lose('the GPU disappeared from sysfs (%s): it fell off the bus or its driver was unbound; '
                    'reset it, and reboot the node if that fails' % card.device_path, action='reset')
    return True


def note_incomplete(dev, scan):
    """When some processes' fdinfo could not be read, the device's process list is incomplete: say why."""
    if scan.complete:
        return False
    dev.processes_complete = False
    if scan.fds_denied:
        dev.reading_failed('the GPU clients of every process',
                           'no permission to read the open files of %d process(es) (run as root)' % scan.fds_denied)
    if scan.incomplete is not None:
        dev.reading_failed('the GPU clients of every process', incomplete_text(scan.incomplete))
    return True


# ---------------------------------------------------------------------------- two readings
_BASELINES = {}


class TwoReadings(object):
    """The test seams of a backend that compares two readings: clock, sleep, interval, baseline cache."""

    def __init__(self, clock=time.monotonic, sleep=time.sleep, interval=None, cache=None):
        self.clock = clock
        self.sleep = sleep
        self.interval = SAMPLE_INTERVAL_S if interval is None else interval
        self.cache = cache

    def pair(self, sample, key, needed=None):
        """sample_pair() with these seams."""
        return sample_pair(sample, key, interval=self.interval, clock=self.clock, sleep=self.sleep, cache=self.cache,
                           needed=needed)


def sample_pair(sample, key, interval=SAMPLE_INTERVAL_S, max_age=BASELINE_MAX_AGE_S, clock=time.monotonic,
                sleep=time.sleep, cache=None, needed=None):
    """Two readings of ``sample()`` at least ``interval`` seconds apart: (first, second).

    ``sample()`` returns an object with ``taken_at`` (``clock()`` seconds).  The second reading of
    the previous call with the same ``key`` serves as the first one when it is at most ``max_age``
    seconds old, so repeated snapshots in one process (a reclaim polling for released memory) do
    not wait each time.  The first reading of a process waits ``interval`` seconds, unless
    ``needed(reading)`` says that reading has nothing to compare (then both are the same reading).
    """
    cache = _BASELINES if cache is None else cache
    first = cache.get(key)
    now = clock()
    if first is None or now - first.taken_at > max_age or now < first.taken_at:
        first = sample()
        now = first.taken_at
        if needed is not None and not needed(first):
            cache[key] = first
            return first, first
    wait = interval - (now - first.taken_at)
    if wait > 0:
        sleep(wait)
    second = sample()
    cache[key] = second
    return first, second


# ---------------------------------------------------------------------------- DRM cards in sysfs
_CARD_RE = re.compile(r'^card(\d+)$')
DISPLAY_CLASS_PREFIX = '0x03'


def read_sysfs(path, default=None):
    """A sysfs attribute as stripped text, or ``default`` when it cannot be read."""
    try:
        return _read(path).strip()
    except (OSError, ValueError):
        return default


def read_int(path, base=10):
    text = read_sysfs(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


class DrmCard(object):
    """One DRM card: ``/sys/class/drm/card<minor>`` and its PCI device."""

    def __init__(self, minor, path, device_path, bdf, vendor_id, device_id, driver, pci_class):
        self.minor = minor
        self.path = path                  # <sys>/class/drm/cardN
        self.device_path = device_path    # <sys>/class/drm/cardN/device
        self.bdf = bdf                    # 0000:03:00.0
        self.vendor_id = vendor_id        # 0x8086
        self.device_id = device_id        # 0x56a0
        self.driver = driver              # i915, xe, amdgpu
        self.pci_class = pci_class        # 0x030000

    def attr(self, name):
        return read_sysfs(os.path.join(self.device_path, name))

    def exists(self):
        return os.path.isdir(self.device_path)

    def hwmon_dirs(self):
        base = os.path.join(self.device_path, 'hwmon')
        try:
            return [os.path.join(base, name) for name in sorted(os.listdir(base)) if name.startswith('hwmon')]
        except OSError:
            return []


def list_drm_cards(sys_root='/sys', vendor_id=None, drivers=None):
    """The DRM cards under ``<sys_root>/class/drm`` (connectors excluded), by minor.

    ``vendor_id`` ('0x8086', '0x1002') and ``drivers`` (names of the bound kernel driver, the
    basename of the ``device/driver`` link) filter them.
    """
    base = os.path.join(sys_root, 'class', 'drm')
    try:
        names = os.listdir(base)
    except OSError:
        return []
    cards = []
    for name in names:
        match = _CARD_RE.match(name)
        if not match:
            continue
        path = os.path.join(base, name)
        device_path = os.path.join(path, 'device')
        vendor = (read_sysfs(os.path.join(device_path, 'vendor')) or '').lower()
        if vendor_id and vendor != vendor_id:
            continue
        try:
            driver = os.path.basename(os.readlink(os.path.join(device_path, 'driver')))
        except OSError:
            driver = None
        if drivers and driver not in drivers:
            continue
        bdf = os.path.basename(os.path.realpath(device_path)).lower()
        cards.append(DrmCard(int(match.group(1)), path, device_path, bdf, vendor or None,
                             (read_sysfs(os.path.join(device_path, 'device')) or '').lower() or None, driver,
                             (read_sysfs(os.path.join(device_path, 'class')) or '').lower() or None))
    cards.sort(key=lambda c: c.minor)
    return cards


def count_pci_display_devices(sys_root='/sys', vendor_id='0x8086'):
    """Display-class PCI devices of a vendor (bound to a driver or not); 0 when sysfs is unreadable."""
    base = os.path.join(sys_root, 'bus', 'pci', 'devices')
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    count = 0
    for entry in entries:
        vendor = (read_sysfs(os.path.join(base, entry, 'vendor')) or '').lower()
        pci_class = (read_sysfs(os.path.join(base, entry, 'class')) or '').lower()
        if vendor == vendor_id and pci_class.startswith(DISPLAY_CLASS_PREFIX):
            count += 1
    return count


def hwmon_readings(card):
    """{'temp_c', 'power_w', 'power_cap_w', 'energy_uj'} from the card's hwmon (None when absent).

    Temperatures are millidegrees, powers microwatts and energy microjoules in hwmon.
    """
    out = {'temp_c': None, 'power_w': None, 'power_cap_w': None, 'energy_uj': None}
    for hwmon in card.hwmon_dirs():
        if out['temp_c'] is None:
            for index in range(1, 10):
                value = read_int(os.path.join(hwmon, 'temp%d_input' % index))
                if value is not None:
                    out['temp_c'] = int(round(value / 1000.0))
                    break
        if out['power_w'] is None:
            for name in ('power1_average', 'power1_input'):
                value = read_int(os.path.join(hwmon, name))
                if value is not None:
                    out['power_w'] = round(value / 1e6, 3)
                    break
        if out['power_cap_w'] is None:
            for name in ('power1_cap', 'power1_max'):
                value = read_int(os.path.join(hwmon, name))
                if value:  # 0: no limit set
                    out['power_cap_w'] = round(value / 1e6, 3)
                    break
        if out['energy_uj'] is None:
            out['energy_uj'] = read_int(os.path.join(hwmon, 'energy1_input'))
    return out


_PCI_IDS_PATHS = ('usr/share/misc/pci.ids', 'usr/share/hwdata/pci.ids', 'usr/share/pci.ids')


def pci_device_name(vendor_id, device_id, root='/'):
    """The device's name from the pci.ids database (as lspci shows it), or None."""
    if not vendor_id or not device_id:
        return None
    vendor = vendor_id.lower().replace('0x', '').zfill(4)
    device = device_id.lower().replace('0x', '').zfill(4)
    for rel in _PCI_IDS_PATHS:
        try:
            with open(os.path.join(root, rel), 'rb') as handle:
                in_vendor = False
                for raw in handle:
                    line = raw.decode('utf-8', 'replace').rstrip('\n')
                    if not line or line.startswith('#'):
                        continue
                    if not line.startswith('\t'):
                        if in_vendor:
                            break
                        in_vendor = line[:4].lower() == vendor
                    elif in_vendor and not line.startswith('\t\t') and line[1:5].lower() == device:
                        return line[5:].strip() or None
        except OSError:
            continue
    return None
