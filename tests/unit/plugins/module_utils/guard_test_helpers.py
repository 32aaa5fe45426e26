# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fake snapshots and a fake clock for the policy, guard and CLI tests (no processes are started here)."""

from __future__ import annotations

import datetime
from collections import OrderedDict

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import ContainerInfo, Device, GpuProcess
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import Snapshot

GIB = 1024
# Monday 2026-03-02 12:00:00 UTC: the fake clock's default
MONDAY_NOON = datetime.datetime(2026, 3, 2, 12, 0, tzinfo=datetime.timezone.utc).timestamp()


def proc(pid, user, gpus, util=0, ct=1000.0, name='python', cmdline=None, uid=None, job=None, pod=None, container=None,
         starttime=None, exe='/usr/bin/python3'):
    """A process spec for ``snapshot``: ``gpus`` maps a GPU index to MiB (None: unknown)."""
    return {'pid': pid, 'user': user, 'gpus': dict(gpus), 'util': util, 'ct': ct, 'name': name,
            'cmdline': cmdline if cmdline is not None else [name, 'train.py'], 'uid': uid, 'job': job, 'pod': pod,
            'container': container, 'starttime': starttime if starttime is not None else pid * 10, 'exe': exe}


def snapshot(procs=(), gpus=4, device_util=None, uuids=None):
    """A Snapshot with ``gpus`` NVIDIA GPUs and the given process specs (all found, running)."""
    devices = []
    for index in range(gpus):
        uuid = (uuids or {}).get(index, 'GPU-%08x-0000-0000-0000-%012x' % (index, index))
        devices.append(Device(vendor='nvidia', vendor_index=index, index=index, uuid=uuid, minor=index,
                              name='NVIDIA A100-SXM4-80GB', memory_total_mib=81920,
                              utilization_pct=(device_util or {}).get(index, 0)))
    processes = []
    for spec in procs:
        entry = GpuProcess(pid=spec['pid'])
        for gpu, mib in sorted(spec['gpus'].items()):
            entry.add_gpu(gpu, mib, ['compute'], spec['util'])
            devices[gpu].add_driver_process(spec['pid'], mib, 'compute')
        entry.user = spec['user']
        entry.uid = spec['uid'] if spec['uid'] is not None else (1000 + sum(ord(c) for c in spec['user'] or ''))
        entry.name = spec['name']
        entry.cmdline = list(spec['cmdline'])
        entry.create_time = spec['ct']
        entry.starttime = spec['starttime']
        entry.status = 'running'
        entry.exe = spec['exe']
        entry.slurm_job = spec['job']
        if spec['pod'] or spec['container']:
            entry.container = ContainerInfo(id=spec['container'], runtime='containerd', pod_uid=spec['pod'])
        entry.device_paths = ['/dev/nvidia%d' % g for g in sorted(spec['gpus'])]
        processes.append(entry)
    for dev in devices:
        dev.memory_used_mib = sum(p.used_mib or 0 for p in dev.driver_processes)
        dev.memory_free_mib = dev.memory_total_mib - dev.memory_used_mib
        dev.compute_orphaned()
    return Snapshot(OrderedDict(), devices, devices, processes, [], MONDAY_NOON)


class Clock(object):
    """A fake clock: ``now`` seconds since the epoch, moved by ``advance``."""

    def __init__(self, now=MONDAY_NOON):
        self.now = float(now)

    def advance(self, seconds):
        self.now += seconds
        return self.now


def pids(violations, rule=None):
    return sorted(p for v in violations if rule is None or v.rule == rule for p in v.pids)


def rules(violations):
    return sorted(v.rule for v in violations)


# Hostile documents for the loaders' limits (policy.MAX_NESTING, policy.MAX_ALIAS_NODES)
DEEP_TOML = '.'.join(['a'] * 1000) + ' = 1\n'      # 2 KB: 1,000 nested tables from dotted keys
TOO_DEEP = 'mappings and lists nested more than 32 levels deep (the limit)'
TOO_MANY_ALIASED = 'aliases expand to more than 100000 nodes (the limit)'
BOMB_LINE = 6                                       # the line whose aliases pass the limit


def billion_laughs(levels=9):
    """The classic YAML alias bomb (a few hundred bytes): 9**levels strings once every alias is expanded."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, levels):
        lines.append('l%d: &l%d [%s]' % (level, level, ','.join(['*l%d' % (level - 1)] * 9)))
    return '\n'.join(lines) + '\n'
