# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""MIG (Multi-Instance GPU) on NVIDIA boards: reading the MIG devices, and the layout a reset recreates.

Reading (``read_mig_devices``), for a board whose MIG mode is on:

* each MIG device handle (``nvmlDeviceGetMigDeviceHandleByIndex`` 0 .. ``nvmlDeviceGetMaxMigDeviceCount``-1,
  NOT_FOUND for unused indexes) gives its GPU and compute instance ids, its ``MIG-`` UUID, its name
  (``NVIDIA H200 MIG 3g.71gb``: the profile follows `` MIG ``), its own memory figures and its own process
  lists; the GPU instance's profile id and placement and the compute instance's profile id come from
  ``nvmlDeviceGetGpuInstanceById`` / ``nvmlGpuInstanceGetInfo`` / ``nvmlComputeInstanceGetInfo_v2``;
* a process is attributed to a MIG device only by what the driver says: the ``gpuInstanceId`` /
  ``computeInstanceId`` of the board's process entries (0xFFFFFFFF: not on a MIG device), or its presence
  in a MIG device's process list.  Open ``/dev/nvidia-caps`` files prove nothing (a user opens what he likes);
* the board's memory figure already holds every instance's memory: a MIG device's memory is reported on the
  device, never added to the board's.  A process listed both on the board and on its MIG device is merged
  (the larger figure kept, as the compute/graphics lists are merged);
* without root the driver refuses the board's aggregate memory and process lists in MIG mode
  (NO_PERMISSION, nvml.h); they stay unknown (None) with a note, and the board's process list is the
  union of its MIG devices' lists (complete when every one of them could be read).

Reset support (``mig_layout``, ``recreate_layout``): the GPU instances (profile id + placement) and their
compute instances (profile id) as the driver describes them, and their re-creation after a reset in the
order they were read, each checked against the recorded layout.  Each call opens its own NVML session.
"""

from __future__ import annotations

import ctypes

from ..model import MigDevice, bytes_to_mib
from .base import FAIL, NOT_EXPOSED, PASS, error_text

# NVML's "not on a MIG device" value of nvmlProcessInfo_t.gpuInstanceId / computeInstanceId
NO_INSTANCE = 0xFFFFFFFF
AGGREGATE_NOTE = ('MIG mode: the driver gives the board\'s aggregate memory and process lists to root only (NVML: '
                  'no permission); the per-instance figures are read from the MIG devices')


def nvml_text(value):
    """An NVML string (bytes, NUL-padded) as text; None for an empty or missing one."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode('utf-8', 'replace')
    return value.rstrip('\x00').strip() or None


def instance_ref(gi, ci):
    """{gpu_instance_id, compute_instance_id, uuid: None} of a process list entry's GPU and compute instance ids, or
    None when it is on no MIG device (None: older process structures have no such fields)."""
    if gi is None or int(gi) == NO_INSTANCE:
        return None
    return {'gpu_instance_id': int(gi), 'compute_instance_id': None if ci is None or int(ci) == NO_INSTANCE else int(ci),
            'uuid': None}


def profile_of(name):
    """``3g.71gb`` from a MIG device name ``NVIDIA H200 MIG 3g.71gb``; None when the name has no profile."""
    if not name or ' MIG ' not in name:
        return None
    return name.rsplit(' MIG ', 1)[1].strip() or None


def read_mig_devices(backend, dev, handle):
    """``dev.mig_devices`` of a board in MIG mode (None otherwise), and the MIG attribution of its processes."""
    if not dev.mig_mode:
        dev.mig_devices = None
        return
    nvml = backend.nvml
    dev.mig_devices = []
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except backend.GpuIsLost:
        raise
    except (backend.NotSupported, backend.FunctionNotFound, AttributeError):
        return  # MIG mode without MIG devices to read (an older driver, or none exposed)
    except backend.NVMLError as exc:
        dev.reading_failed('the MIG devices', error_text(exc))
        return
    for index in range(count):
        try:
            mig_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except backend.NotFound:
            continue
        except backend.GpuIsLost:
            raise
        except backend.NVMLError as exc:
            dev.reading_failed('MIG device %d' % index, error_text(exc))
            continue
        dev.mig_devices.append(_read_one(backend, dev, handle, mig_handle, index))
    _attribute(dev)


def _read_one(backend, dev, handle, mig_handle, index):
    nvml = backend.nvml
    mig = MigDevice(index=index)
    what = 'MIG device %d' % index
    call = backend._call  # pylint: disable=protected-access
    mig.gpu_instance_id = call(dev, 'the GPU instance id of %s' % what, nvml.nvmlDeviceGetGpuInstanceId, mig_handle)
    mig.compute_instance_id = call(dev, 'the compute instance id of %s' % what, nvml.nvmlDeviceGetComputeInstanceId, mig_handle)
    mig.uuid = nvml_text(call(dev, 'the UUID of %s' % what, nvml.nvmlDeviceGetUUID, mig_handle))
    mig.profile = profile_of(nvml_text(call(dev, 'the name of %s' % what, nvml.nvmlDeviceGetName, mig_handle)))
    mem = call(dev, 'the memory usage of %s' % what, nvml.nvmlDeviceGetMemoryInfo, mig_handle)
    if mem is not None:
        mig.memory_total_mib = bytes_to_mib(mem.total)
        mig.memory_used_mib = bytes_to_mib(mem.used)
        mig.memory_free_mib = bytes_to_mib(mem.free)
    backend.read_process_lists(dev, mig_handle, mig, 'of %s' % what)
    _read_layout(backend, handle, mig)
    return mig


def _read_layout(backend, handle, mig):
    """The GPU instance's profile id and placement and the compute instance's profile id (None when not told)."""
    nvml = backend.nvml
    if mig.gpu_instance_id is None:
        return
    try:
        gi = nvml.nvmlDeviceGetGpuInstanceById(handle, mig.gpu_instance_id)
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        mig.gi_profile_id = int(info.profileId)
        mig.placement = {'start': int(info.placement.start), 'size': int(info.placement.size)}
        if mig.compute_instance_id is not None:
            ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, mig.compute_instance_id)
            mig.ci_profile_id = int(nvml.nvmlComputeInstanceGetInfo_v2(ci).profileId)
    except backend.GpuIsLost:
        raise
    except (backend.NVMLError, AttributeError):
        return  # not root, or a driver without these calls: the layout stays unknown


def _attribute(dev):
    """Join the board's process entries and the MIG devices' lists: each process gets its MIG device's ref."""
    for proc in dev.driver_processes:
        if proc.mig is not None:   # the ids of the board's process entry: add the MIG device's UUID
            mig = dev.mig_device(gpu_instance_id=proc.mig['gpu_instance_id'], compute_instance_id=proc.mig['compute_instance_id'])
            if mig is not None:
                proc.mig = mig.ref()
    complete = all(mig.processes_complete for mig in dev.mig_devices)
    for mig in dev.mig_devices:
        for mproc in mig.driver_processes:
            mproc.mig = mig.ref()
            proc = dev.add_driver_process(mproc.pid, mproc.used_mib, None)
            for ptype in mproc.types:
                proc.merge(None, ptype)
            proc.mig = mig.ref()
    if not dev.processes_complete and complete and dev.mig_devices and AGGREGATE_NOTE in dev.health.reasons:
        dev.processes_complete = True   # the board's lists were refused, every MIG device's list was read


# ---------------------------------------------------------------------------- reset: record and recreate the layout
def mig_layout(dev):
    """The layout to recreate after a reset: [{gpu_instance_id, compute_instance_id, profile, gi_profile_id,
    placement, ci_profile_id}], or None with the reason when it is not fully known."""
    if not dev.mig_devices:
        return [], None
    out = []
    for mig in sorted(dev.mig_devices, key=lambda m: (m.gpu_instance_id or 0, m.compute_instance_id or 0)):
        if mig.gi_profile_id is None or mig.placement is None or mig.ci_profile_id is None:
            return None, ('the driver did not describe MIG device %s (GPU instance %s): its profile and placement are '
                          'needed to recreate it' % (mig.uuid or mig.index, mig.gpu_instance_id))
        out.append({'gpu_instance_id': mig.gpu_instance_id, 'compute_instance_id': mig.compute_instance_id,
                    'profile': mig.profile, 'uuid': mig.uuid, 'gi_profile_id': mig.gi_profile_id,
                    'placement': dict(mig.placement), 'ci_profile_id': mig.ci_profile_id})
    return out, None


def recreate_layout(bus_id, layout, backend):
    """Create the GPU instances (profile id at the recorded placement) and their compute instances of ``layout``
    on the GPU at PCI ``bus_id``, then read them back, in a session of ``backend`` (a fresh NvidiaBackend, closed
    here).  Returns (created, error): ``created`` lists {gpu_instance_id, compute_instance_id, profile, placement,
    gi_profile_id, ci_profile_id} as the driver now reports them."""
    if not backend.probe().available:
        return [], backend.status.error
    nvml = backend.nvml
    created = []
    try:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        gpu_instances = {}
        for item in layout:
            key = (item['gi_profile_id'], item['placement']['start'])
            if key not in gpu_instances:
                placement = nvml.c_nvmlGpuInstancePlacement_t()
                placement.start, placement.size = item['placement']['start'], item['placement']['size']
                gpu_instances[key] = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, item['gi_profile_id'],
                                                                                   ctypes.byref(placement))
            gi = gpu_instances[key]
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, item['ci_profile_id'])
            gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            ci_info = nvml.nvmlComputeInstanceGetInfo_v2(ci)
            created.append({'gpu_instance_id': int(gi_info.id), 'compute_instance_id': int(ci_info.id), 'profile': item['profile'],
                            'placement': {'start': int(gi_info.placement.start), 'size': int(gi_info.placement.size)},
                            'gi_profile_id': int(gi_info.profileId), 'ci_profile_id': int(ci_info.profileId)})
    except Exception as exc:  # pylint: disable=broad-except
        return created, 'creating the MIG instances failed after %d of %d: %s' % (len(created), len(layout), error_text(exc))
    finally:
        backend.close()
    return created, verify_layout(layout, created)


def verify_layout(layout, created):
    """None when ``created`` has the same GPU instance profiles, placements and compute instance profiles as
    ``layout`` (the driver may number the instances differently), else what differs."""
    def shape(items):
        return sorted((i['gi_profile_id'], i['placement']['start'], i['placement']['size'], i['ci_profile_id']) for i in items)
    if shape(layout) == shape(created):
        return None
    return 'the recreated MIG layout differs from the recorded one: recorded %s, now %s' % (
        ', '.join('%s at %s' % (i['profile'], i['placement']['start']) for i in layout) or 'none',
        ', '.join('%s at %s' % (i['profile'], i['placement']['start']) for i in created) or 'none')


# ---------------------------------------------------------------------------- reset hooks (backends/nvidia.py)
def destroyed_by_reset(dev):
    """What a reset of board ``dev`` destroys: its MIG devices and the processes the driver lists on them."""
    return [{'gpu_instance_id': m.gpu_instance_id, 'compute_instance_id': m.compute_instance_id, 'profile': m.profile,
             'uuid': m.uuid, 'processes': m.pids} for m in dev.mig_devices or ()]


def _describe_destroyed(items):
    return '; '.join('GPU instance %s / compute instance %s (%s, %s): %s' % (
        i['gpu_instance_id'], i['compute_instance_id'], i['profile'] or 'profile unknown', i['uuid'] or 'no UUID',
        'processes %s' % ', '.join(str(p) for p in i['processes']) if i['processes'] else 'no process') for i in items) or 'none'


def check_mig(item):
    """The ``mig`` precondition.  MIG on: what a reset destroys (instances and their processes); refused unless
    ``mig_reset: recreate``, which records the layout (``item.mig``) that reset_device recreates."""
    dev = item.dev
    if dev.mig_mode is None:
        item.check('mig', NOT_EXPOSED, 'the driver does not report the MIG mode of this GPU')
        return
    if not dev.mig_mode:
        item.check('mig', PASS, 'MIG mode is off')
        return
    destroyed = destroyed_by_reset(dev)
    what = 'MIG mode is on: a reset destroys every GPU and compute instance of this GPU (%s)' % _describe_destroyed(destroyed)
    item.mig = {'mode': True, 'destroys': destroyed, 'layout': None, 'recreated': None, 'error': None}
    if getattr(item, 'mig_reset', None) != 'recreate':
        item.check('mig', FAIL, '%s; refused: set mig_reset: recreate to record the layout, reset and recreate the same '
                                'instances (their processes end: kill_processes: true), or destroy the instances yourself '
                                '(nvidia-smi mig -dci -i {i}; nvidia-smi mig -dgi -i {i}) and disable MIG (nvidia-smi -i {i} '
                                '-mig 0)'.format(i=dev.vendor_index) % what)
        return
    layout, why = mig_layout(dev)
    if layout is None:
        item.check('mig', FAIL, '%s; mig_reset: recreate cannot recreate them: %s' % (what, why))
        return
    item.mig['layout'] = layout
    item.check('mig', PASS, '%s; mig_reset: recreate: the same %d instance(s) are created again after the reset and '
                            'checked' % (what, len(layout)))


def recreate_after_reset(item, backend):
    """After a successful reset: recreate the recorded MIG layout (mig_reset: recreate) in a session of ``backend``
    (a fresh NvidiaBackend); None or an error text."""
    mig = getattr(item, 'mig', None)
    if not mig or not mig.get('layout'):
        return None
    created, error = recreate_layout(item.dev.pci_bus_id, mig['layout'], backend)
    mig['recreated'] = created
    mig['error'] = error
    if error is not None:
        return 'the reset succeeded but the MIG instances were not recreated as before: %s; recreate them with nvidia-smi ' \
               'mig -cgi ... -C -i %s' % (error, item.target)
    return None
