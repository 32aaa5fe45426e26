# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/backends/nvml_arrays.py: the process arrays read through ctypes, against pynvml's wrappers on the
simulator's libnvidia-ml (loaded into this process by absolute path; the processes are sleepers these
tests start and reap)."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends import nvml_arrays
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.nvidia import NvidiaBackend
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

pytestmark = pytest.mark.skipif(h.sim_build() is None,
                                reason='simulator not built: run `make sim` (tests/sim/build/libnvidia-ml.so.1 missing)')

LISTS = (('compute', 'nvmlDeviceGetComputeRunningProcesses'), ('graphics', 'nvmlDeviceGetGraphicsRunningProcesses'),
         ('mps', 'nvmlDeviceGetMPSComputeRunningProcesses'))


@pytest.fixture
def work():
    root = h.tempdir()
    kids = h.Children()

    class Work(object):
        dev = h.make_dev_dir(os.path.join(root, 'dev'), minors=(0, 1))
        state = os.path.join(root, 'state.json')
        children = kids

        def node(self, count, driver='r550', **extra):
            """A state with ``count`` sleepers on GPU 0 (compute, graphics and MPS in turn; the second one's
            memory not available) and one on GPU 1; returns (state, pids)."""
            pids = [self.children.sleeper().pid for _index in range(count + 1)]
            kinds = ('compute', 'graphics', 'mps')
            procs = [h.make_process(pid, 0, 100 + i, kinds[i % 3], **extra) for i, pid in enumerate(pids[:-1])]
            if len(procs) > 1:
                procs[1]['used_mib'] = None
            procs.append(h.make_process(pids[-1], 1, 4096))
            state = h.make_state(gpus=2, driver=driver, dev_dir=self.dev, processes=procs)
            h.write_state(self.state, state)
            return state, pids

    try:
        yield Work()
    finally:
        kids.close()
        shutil.rmtree(root, ignore_errors=True)


def _reader(nvml, name):
    return nvml_arrays.ArrayReader.of(nvml, name, nvml_arrays.PROCESS_TYPE, nvml_arrays.PROCESS_FIELDS)


def test_ctypes_rows_match_the_wrapper(work):
    """Every list of every GPU, and the utilization samples: the same entries both ways."""
    work.node(5)
    with h.shim_in_process(work.state) as nvml:
        nvml.nvmlInit()
        try:
            for index in (0, 1):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                seen = 0
                for _kind, name in LISTS:
                    ours = nvml_arrays.running_processes(_reader(nvml, name + '_v3'), handle)
                    assert ours == nvml_arrays.process_rows(getattr(nvml, name)(handle))
                    seen += len(ours)
                assert seen == (5 if index == 0 else 1)
                samples = nvml_arrays.ArrayReader.of(nvml, 'nvmlDeviceGetProcessUtilization', nvml_arrays.SAMPLE_TYPE,
                                                     nvml_arrays.SAMPLE_FIELDS)
                wrapped = [(int(s.pid), int(s.smUtil)) for s in nvml.nvmlDeviceGetProcessUtilization(handle, 0)]
                assert nvml_arrays.utilization_samples(samples, handle, 0) == wrapped and wrapped
            rows = nvml_arrays.running_processes(_reader(nvml, LISTS[1][1] + '_v3'), nvml.nvmlDeviceGetHandleByIndex(0))
            assert [r[1] for r in rows] == [None, 104 * 1024 * 1024]   # NVML_VALUE_NOT_AVAILABLE -> None, as pynvml
        finally:
            nvml.nvmlShutdown()


def test_count_that_grows_between_the_calls_is_read_again(work):
    """An array too small for the list, which then grows past the next array too: NVML says INSUFFICIENT_SIZE
    with the count each time, and the reader calls again with a bigger array; the next read starts with the
    size the largest answer needed."""
    state, _pids = work.node(4)     # two compute processes on GPU 0 (and a graphics and an MPS one)
    more = [work.children.sleeper().pid for _index in range(9)]
    with h.shim_in_process(work.state) as nvml:
        nvml.nvmlInit()
        try:
            reader = _reader(nvml, 'nvmlDeviceGetComputeRunningProcesses_v3')
            assert reader.size == nvml_arrays.FIRST_SIZE
            reader.size = 1
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            real, calls = reader.fn, []

            def growing(handle_, count, array):
                calls.append((count._obj.value, len(array)))  # pylint: disable=protected-access
                result = real(handle_, count, array)
                if len(calls) == 1:
                    # after the first call (2 processes for an array of 1): 9 more, past the next array (2 * 2 + 5)
                    state['processes'].extend(h.make_process(pid, 0, 10) for pid in more)
                    h.write_state(work.state, state)
                return result
            reader.fn = growing
            rows = nvml_arrays.running_processes(reader, handle)
            assert sorted(r[0] for r in rows) == sorted(p['pid'] for p in state['processes'] if p['gpu'] == 0 and p['type'] == 'compute')
            assert len(rows) == 11 and calls == [(1, 1), (9, 9), (27, 27)]    # 2 -> 2 * 2 + 5; 11 -> 2 * 11 + 5
            assert rows == nvml_arrays.process_rows(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            del calls[:]
            assert nvml_arrays.running_processes(reader, handle) == rows and calls == [(27, 27)]   # one call now
        finally:
            nvml.nvmlShutdown()


def test_retries_are_bounded():
    """A count that keeps growing ends in NVML's INSUFFICIENT_SIZE error after GROW_RETRIES more calls."""
    pynvml = pytest.importorskip('pynvml')
    calls = []

    def always_more(count):
        calls.append(count.value)
        count.value = count.value * 3 + 1
        return nvml_arrays.NVML_ERROR_INSUFFICIENT_SIZE
    reader = nvml_arrays.ArrayReader(pynvml, None, pynvml.c_nvmlProcessInfo_v3_t,
                                     nvml_arrays.entry_layout(pynvml.c_nvmlProcessInfo_v3_t, nvml_arrays.PROCESS_FIELDS))
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        reader.read(lambda fn, count, array: always_more(count))
    assert calls[0] == nvml_arrays.FIRST_SIZE and len(calls) == 2 + nvml_arrays.GROW_RETRIES
    with pytest.raises(pynvml.NVMLError_NoPermission):
        reader.read(lambda fn, count, array: pynvml.NVML_ERROR_NO_PERMISSION)
    assert reader.size == nvml_arrays.FIRST_SIZE     # a failed read does not size the next one
    assert reader.read(lambda fn, count, array: setattr(count, 'value', 0) or nvml_arrays.NVML_SUCCESS) == []


def test_missing_symbol_falls_back_to_the_wrappers(work):
    """r470 (the shim built without the _v3 symbols): no ctypes reader, the backend reads _v2 through pynvml;
    the r550 shim on an r470 state has the symbols but answers FUNCTION_NOT_FOUND: _v2 too.  Both give the
    lists that the ctypes path gives on r550."""
    if h.shim_path('r470') is None:
        pytest.skip('the -DSIM_R470 shim variant is not built (tests/sim/build/r470)')
    state, _pids = work.node(4, driver='r470')
    found = {}
    for variant, driver in (('r470', 'r470'), ('', 'r470'), ('', 'r550')):
        state.update(h.make_state(gpus=2, driver=driver, dev_dir=work.dev, processes=state['processes']))
        h.write_state(work.state, state)
        with h.shim_in_process(work.state, variant) as nvml:
            backend = NvidiaBackend(nvml=nvml)
            assert backend.probe().available
            try:
                devices = backend.devices()
                arrays, fallen_back = dict(backend._arrays), dict(backend._proc_v2)  # pylint: disable=protected-access
            finally:
                backend.close()
        found[variant, driver] = [[(p.pid, p.used_mib, p.types, p.util_pct) for p in d.driver_processes] for d in devices]
        assert all(d.processes_complete and not d.errors for d in devices)
        if variant:
            assert [arrays[name + '_v3'] for _kind, name in LISTS] == [False, False, False]
        else:
            assert arrays['nvmlDeviceGetComputeRunningProcesses_v3'] and arrays['nvmlDeviceGetProcessUtilization']
        assert bool(fallen_back) == (driver == 'r470')
    assert found['r470', 'r470'] == found['', 'r470'] == found['', 'r550']
    assert [len(procs) for procs in found['', 'r550']] == [4, 1]


class _Odd(ctypes.Structure):
    _fields_ = [('pid', ctypes.c_uint), ('usedGpuMemory', ctypes.c_double), ('gpuInstanceId', ctypes.c_uint)]


class _Fake(object):
    """A binding with the structure but without _nvmlGetFunctionPointer (the fakes of other tests)."""
    c_nvmlProcessInfo_v3_t = _Odd


def test_layout_refuses_what_it_cannot_read():
    assert nvml_arrays.entry_layout(_Odd, ('pid', 'usedGpuMemory')) is None          # a float
    assert nvml_arrays.entry_layout(_Odd, ('pid', 'computeInstanceId')) is None      # no such field
    assert nvml_arrays.entry_layout(_Odd, ('gpuInstanceId', 'pid')) is None          # out of order
    assert nvml_arrays.entry_layout(_Odd, ('pid', 'gpuInstanceId')).format == '=I12xI4x'
    assert nvml_arrays.ArrayReader.of(_Fake(), 'nvmlDeviceGetComputeRunningProcesses_v3', 'c_nvmlProcessInfo_v3_t',
                                      ('pid',)) is None
