# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Hostile vendor answers (issue #11): the amdsmi value helpers and an amdsmi that answers odd
values ('N/A', dicts, huge and negative numbers, infinities, nested structures), and xpu-smi printing
random JSON or random text.  Expected: a correct reading or None / a note - never a traceback, never
a negative or non-finite figure.  Nothing here starts or signals a process."""

from __future__ import annotations

import json
import math

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import amd
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.drm_test_helpers import FakeClock
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.backends.test_backend_amd import FakeAmdSmi, amdsmi_backend
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.backends.test_backend_intel import DISCOVERY, STATS, IntelHost, XE_BDF

pytest.importorskip('hypothesis')
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402  pylint: disable=wrong-import-position

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
DEVICES = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

U64 = 2 ** 64
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10, max_value=10 ** 6), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.integers(min_value=U64 - 2, max_value=U64 + 2), st.integers(min_value=10 ** 300, max_value=10 ** 400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(['N/A', 'NA', 'n/a', '', ' ', '12', '-3', '1e400', 'inf', '-inf', 'nan', 'NaN', '\u0663', '0x10', '12 W',
                     '9' * 400, '\x00', '\udcff']),
    st.text(max_size=12))
ODD = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(['value', 'unit', 'N/A', 'pid', 'mem']), inner, max_size=3)),
    max_leaves=6)


def finite_or_none(value, low=0, high=None):
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value >= low and (high is None or value <= high)


# ---------------------------------------------------------------------------- the amdsmi value helpers
@FUZZ
@given(ODD, st.sampled_from([int, float]))
def test_amdsmi_numbers(value, cast):
    """_num: a number amdsmi can mean (a uint64, not a bool) or None; never a negative, infinite or absurd one."""
    result = amd._num(value, cast)  # pylint: disable=protected-access
    assert result is None or type(result) is cast                              # pylint: disable=unidiomatic-typecheck
    assert finite_or_none(result, 0, U64)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < U64 and cast(value) < U64:
        assert result == cast(value)                                           # a plain good value is kept


@FUZZ
@given(ODD)
def test_amdsmi_watts(value):
    """_watts(_num(x)): microwatts (hwmon's power1_cap) become watts, watts stay watts."""
    result = amd._watts(amd._num(value, float))  # pylint: disable=protected-access
    assert finite_or_none(result)
    if result is not None:
        assert result <= U64


@FUZZ
@given(ODD, ODD, st.floats(allow_nan=True, allow_infinity=True))
def test_amdsmi_engine_usage_and_busy_percent(first, second, elapsed):
    """_engine_ns on whatever a process entry holds, _busy_pct between two of them: 0-100 or None."""
    before = amd._engine_ns({'engine_usage': first})  # pylint: disable=protected-access
    after = amd._engine_ns({'engine_usage': second})  # pylint: disable=protected-access
    assert all(isinstance(k, str) or k is not None for k in after) and all(finite_or_none(v, 0, U64) for v in after.values())
    pct = amd._busy_pct(before, after, elapsed)  # pylint: disable=protected-access
    assert pct is None or (isinstance(pct, int) and 0 <= pct <= 100)


class OddAmdSmi(FakeAmdSmi):
    """The two-GPU fake amdsmi, with every reading replaced by a value the test draws."""

    def __init__(self, clock, odd):
        super(OddAmdSmi, self).__init__(clock)
        self.odd = odd

    def amdsmi_get_gpu_vram_usage(self, handle):
        return self.odd['vram']

    def amdsmi_get_gpu_activity(self, handle):
        return self.odd['activity']

    def amdsmi_get_temp_metric(self, handle, sensor, metric):
        return self.odd['temp']

    def amdsmi_get_power_info(self, handle):
        return self.odd['power']

    def amdsmi_get_gpu_total_ecc_count(self, handle):
        return self.odd['ecc']

    def amdsmi_get_gpu_enumeration_info(self, handle):
        return self.odd['enum']

    def amdsmi_get_gpu_process_list(self, handle):
        return self.odd['procs']

    def amdsmi_get_gpu_process_info(self, handle, item):
        return self.odd['proc_info']


def _mapping(keys):
    return st.one_of(ODD, st.fixed_dictionaries({}, optional=dict((k, ODD) for k in keys)))


PROC_ENTRY = st.one_of(ODD, st.fixed_dictionaries({}, optional={
    'pid': ODD, 'name': ODD, 'mem': ODD, 'engine_usage': ODD, 'memory_usage': _mapping(['vram_mem', 'gtt_mem']), 'error': ODD}))
AMD_ANSWERS = st.fixed_dictionaries({
    'vram': _mapping(['vram_total', 'vram_used']), 'activity': _mapping(['gfx_activity', 'umc_activity']), 'temp': ODD,
    'power': _mapping(['current_socket_power', 'socket_power', 'power_limit']),
    'ecc': _mapping(['uncorrectable_count', 'deferred_count']), 'enum': _mapping(['drm_card']),
    'procs': st.one_of(ODD, st.lists(PROC_ENTRY, max_size=4)), 'proc_info': PROC_ENTRY})


def assert_sane(dev):
    for name in ('memory_total_mib', 'memory_used_mib', 'memory_free_mib', 'power_w', 'power_limit_w', 'minor',
                 'ecc_uncorrected_volatile'):
        assert finite_or_none(getattr(dev, name, None)), (name, getattr(dev, name, None))
    for name in ('utilization_pct', 'memory_utilization_pct'):
        assert finite_or_none(getattr(dev, name), 0, 100), (name, getattr(dev, name))
    assert finite_or_none(dev.temperature_c, -273, 1000), dev.temperature_c
    assert dev.name is None or isinstance(dev.name, str)
    for proc in dev.driver_processes:
        assert isinstance(proc.pid, int) and proc.pid > 0
        assert finite_or_none(proc.used_mib) and finite_or_none(proc.util_pct, 0, 100)
        assert proc.name is None or isinstance(proc.name, str)
    json.dumps([str(e) for e in dev.errors])


@DEVICES
@given(AMD_ANSWERS)
def test_an_amdsmi_answering_odd_values(odd):
    clock = FakeClock()
    backend = amdsmi_backend(clock, lib=OddAmdSmi(clock, odd))
    assert backend.probe().available
    devices = backend.devices()
    assert len(devices) == 2
    for dev in devices:
        assert_sane(dev)
        # a reading that fails as a whole is a bug of ours, not an odd value: it must not happen here
        assert not any('the device' in str(e) for e in dev.errors), dev.errors


# ---------------------------------------------------------------------------- xpu-smi JSON
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10 ** 20), max_value=10 ** 20), st.floats(allow_nan=False),
              st.text(max_size=10), st.sampled_from([XE_BDF, XE_BDF.upper(), 'XPUM_STATS_MEMORY_USED', 'XPUM_STATS_POWER',
                                                     'XPUM_STATS_GPU_UTILIZATION', 'XPUM_STATS_GPU_CORE_TEMPERATURE'])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
DEVICE_ITEM = st.fixed_dictionaries({'pci_bdf_address': st.one_of(st.just(XE_BDF), JSON_VALUES)}, optional={
    'device_id': st.one_of(st.integers(min_value=-2, max_value=3), JSON_VALUES, st.sampled_from(['0', 'Infinity', '1e400'])),
    'device_name': JSON_VALUES, 'uuid': JSON_VALUES, 'memory_physical_size_byte': JSON_VALUES})
METRIC = st.fixed_dictionaries({'metrics_type': st.one_of(JSON_VALUES, st.sampled_from(sorted(
    e['metrics_type'] for e in STATS[0]['device_level'])))}, optional={'value': st.one_of(JSON_VALUES, st.sampled_from(
        [float('inf'), float('-inf'), float('nan'), -5, 10 ** 30, '61.5']))})
DEVICE_LIST = st.one_of(JSON_VALUES, st.lists(st.one_of(DEVICE_ITEM, JSON_VALUES), max_size=3))
DISCOVERY_DOC = st.one_of(JSON_VALUES, st.fixed_dictionaries({'device_list': DEVICE_LIST}))
DEVICE_LEVEL = st.one_of(JSON_VALUES, st.lists(st.one_of(METRIC, JSON_VALUES), max_size=5))
STATS_DOC = st.one_of(JSON_VALUES, st.fixed_dictionaries({'device_level': DEVICE_LEVEL}))
TEXT = st.one_of(st.text(max_size=200), st.sampled_from(['[' * 100000, '{"device_list": ' * 50000, 'Infinity', '-Infinity', 'NaN',
                                                         '\ufeff{}', '{"device_list": [}']))


class Runner(object):
    """xpu-smi whose discovery and stats print what the test drew (JSON documents or raw text)."""

    def __init__(self, discovery, stats):
        self.discovery = discovery
        self.stats = stats

    def __call__(self, argv, timeout):
        out = self.discovery if argv[1] == 'discovery' else self.stats
        return 0, out if isinstance(out, str) else json.dumps(out), ''


@pytest.fixture(scope='module')
def intel_host(tmp_path_factory):
    return IntelHost(tmp_path_factory.mktemp('intel'))


def run_intel(host, discovery, stats):
    backend = host.backend(which=lambda name: '/usr/bin/xpu-smi', runner=Runner(discovery, stats))
    assert backend.probe().available                          # a broken tool is never a reason to lose the GPUs
    devices = backend.devices()
    assert len(devices) == 2
    for dev in devices:
        assert_sane(dev)
        assert dev.uuid is None or isinstance(dev.uuid, str)
    return devices


@DEVICES
@given(DISCOVERY_DOC, STATS_DOC)
def test_xpu_smi_random_json(intel_host, discovery, stats):
    run_intel(intel_host, discovery, stats)


@DEVICES
@given(st.one_of(TEXT, DISCOVERY_DOC), TEXT)
def test_xpu_smi_random_text(intel_host, discovery, stats):
    if not isinstance(discovery, str):
        discovery = {'device_list': [dict(DISCOVERY['device_list'][0])]}
    run_intel(intel_host, discovery, stats)


def test_xpu_smi_good_answers_are_still_read(intel_host):
    """The control: the documents of test_backend_intel still give their figures through this harness."""
    _igpu, xe = run_intel(intel_host, DISCOVERY, STATS[0])
    assert (xe.memory_used_mib, xe.utilization_pct, xe.temperature_c, xe.power_w) == (3100, 61, 55, 95.5)
