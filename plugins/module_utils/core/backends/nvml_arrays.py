# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""NVML's per-process arrays read through ctypes, one tuple per entry.

pynvml's ``nvmlDevice*RunningProcesses_v3`` wrappers build a Python object per process per call
(three lists per GPU), and ``nvmlDeviceGetProcessUtilization`` a ctypes structure per sample: most
of the NVML cost of a snapshot at 1,000 processes.  ``ArrayReader`` calls the same library function
through pynvml's own loaded library (``_nvmlGetFunctionPointer``) with pynvml's own structure type,
with NVML's size protocol, and unpacks the filled entries in one pass (``struct.iter_unpack`` over
the array's bytes).  The size protocol: the first call passes an array of FIRST_SIZE entries, or of
what the reader's largest answer needed so far (pynvml's first call passes none, only to learn the
count: every list is then read twice, and the driver walks its processes twice); when NVML says
NVML_ERROR_INSUFFICIENT_SIZE with the count, the next call passes twice that plus five, as pynvml
sizes it, and a count that grew past that meanwhile is retried at most ``GROW_RETRIES`` times.

``ArrayReader.of(nvml, ...)`` is None when the binding lacks the function pointer, the structure or
one of the fields (old drivers and bindings, fakes in tests): the caller then uses pynvml's wrapper.
Errors are pynvml's own exceptions (``NVMLError(code)`` picks the subclass), as from the wrapper.
"""

from __future__ import annotations

import ctypes
import struct

NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
GROW_RETRIES = 3
FIRST_SIZE = 64
# struct's code ('=' mode: standard sizes) of a ctypes integer, by its size; upper case when unsigned (as ctypes' own codes)
_CODES = {1: 'b', 2: 'h', 4: 'i', 8: 'q'}


def entry_layout(entry_type, fields):
    """A ``struct.Struct`` reading ``fields`` (names, in the structure's order) of one ``entry_type``; None
    when a field is missing or not a plain integer of a size struct reads the same way."""
    try:
        types = dict(entry_type._fields_)  # pylint: disable=protected-access
        size = ctypes.sizeof(entry_type)
    except (AttributeError, TypeError):
        return None
    fmt, offset = ['='], 0
    for name in fields:
        ctype, desc = types.get(name), getattr(entry_type, name, None)
        kind = getattr(ctype, '_type_', None)
        if desc is None or not isinstance(kind, str) or kind not in 'bBhHiIlLqQ' or desc.size not in _CODES or desc.offset < offset:
            return None
        code = _CODES[desc.size].upper() if kind.isupper() else _CODES[desc.size]
        fmt.append('%dx%s' % (desc.offset - offset, code) if desc.offset > offset else code)
        offset = desc.offset + desc.size
    if offset > size:
        return None
    fmt.append('%dx' % (size - offset) if size > offset else '')
    return struct.Struct(''.join(fmt))


class ArrayReader(object):
    """One NVML function that fills an array of ``entry_type``: ``read(call)`` -> [tuple of ``fields``]."""

    def __init__(self, nvml, fn, entry_type, layout, size=FIRST_SIZE):
        self.nvml = nvml
        self.fn = fn
        self.entry_type = entry_type
        self.layout = layout
        self.size = size     # the array of the first call: FIRST_SIZE, then what the largest answer needed

    @classmethod
    def of(cls, nvml, function, type_name, fields):
        """The reader of NVML's ``function`` (entries: pynvml's ``type_name``), or None when this binding or
        library lacks something it needs."""
        entry_type = getattr(nvml, type_name, None)
        getter = getattr(nvml, '_nvmlGetFunctionPointer', None)
        layout = entry_layout(entry_type, fields) if entry_type is not None else None
        if getter is None or layout is None or layout.size != ctypes.sizeof(entry_type):
            return None
        try:
            fn = getter(function)
        except Exception:  # pylint: disable=broad-except
            return None   # NVMLError(FUNCTION_NOT_FOUND): an older driver; the caller falls back
        return cls(nvml, fn, entry_type, layout)

    def read(self, call):
        """The filled entries as tuples.  ``call(fn, count, array)`` calls the function with the count (a
        c_uint: the array's size in, the number of entries out) and the array; it returns NVML's code."""
        size = self.size
        for _attempt in range(GROW_RETRIES + 2):
            array = (self.entry_type * size)()
            count = ctypes.c_uint(size)
            ret = call(self.fn, count, array)
            if ret != NVML_ERROR_INSUFFICIENT_SIZE:
                break
            size = count.value * 2 + 5
        if ret != NVML_SUCCESS:
            raise self.nvml.NVMLError(ret)
        self.size = max(self.size, size)
        filled = min(count.value, size)
        if not filled:
            return []
        return list(self.layout.iter_unpack(ctypes.string_at(array, filled * self.layout.size)))


# ---------------------------------------------------------------------------- the two arrays the NVIDIA backend reads
# The fields of a process list entry that the backend reads (pynvml's names)
PROCESS_FIELDS = ('pid', 'usedGpuMemory', 'gpuInstanceId', 'computeInstanceId')
PROCESS_TYPE = 'c_nvmlProcessInfo_v3_t'
SAMPLE_FIELDS = ('pid', 'smUtil')
SAMPLE_TYPE = 'c_nvmlProcessUtilizationSample_t'
NVML_VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF   # usedGpuMemory when the driver cannot tell (None, as pynvml says it)


def running_processes(reader, handle):
    """``nvmlDevice*RunningProcesses_v3(handle)`` as [(pid, used bytes or None, GPU instance id, compute instance id)]."""
    rows = reader.read(lambda fn, count, array: fn(handle, ctypes.byref(count), array))
    return [(pid, None if used == NVML_VALUE_NOT_AVAILABLE else used, gi, ci) for pid, used, gi, ci in rows]


def process_rows(procs):
    """pynvml's process objects (the wrapper's answer) as running_processes() gives them; an old structure
    without the instance fields gives None there."""
    return [(int(p.pid), getattr(p, 'usedGpuMemory', None), getattr(p, 'gpuInstanceId', None), getattr(p, 'computeInstanceId', None))
            for p in procs or ()]


def utilization_samples(reader, handle, since_us):
    """``nvmlDeviceGetProcessUtilization(handle, since_us)`` as [(pid, SM %)]."""
    return reader.read(lambda fn, count, array: fn(handle, array, ctypes.byref(count), ctypes.c_ulonglong(since_us)))
