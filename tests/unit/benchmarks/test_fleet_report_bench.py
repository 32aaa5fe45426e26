# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""benchmarks/fleet_report.py: its synthetic facts have the shape of a snapshot's facts, and its
table says when a size failed.  No Ansible run and no browser here, and no timing asserted."""

from __future__ import annotations

import os
import sys

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import Device, GpuProcess

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), 'benchmarks')
sys.path.insert(0, BENCH)
import fleet_report  # noqa: E402 pylint: disable=wrong-import-position,import-error


def test_synthetic_facts_have_the_snapshot_shape():
    records = fleet_report.synthetic_records(400)
    assert len(records) == 400 and {r['status'] for r in records} == {'ok', 'unreachable'}
    device_keys = set(Device(index=0, vendor='nvidia', vendor_index=0).to_dict())
    process_keys = set(GpuProcess(pid=1).to_dict())
    for record in records:
        if record['gpu'] is None:
            continue
        pids = set(p['pid'] for p in record['gpu']['processes'])
        assert len(record['gpu']['devices']) == fleet_report.GPUS
        for dev in record['gpu']['devices']:
            assert device_keys <= set(dev), device_keys - set(dev)
            assert set(dev['processes']) <= pids and dev['memory_used_mib'] <= dev['memory_total_mib']
        for proc in record['gpu']['processes']:
            assert process_keys <= set(proc) | {'create_time'}, process_keys - set(proc)


def test_markdown_names_a_failed_size():
    data = {'sizes': [{'nodes': 5, 'gpus': 40, 'processes': 50, 'error': 'boom\nat the end'}], 'seconds': 1, 'freeze_ms': 100}
    text = fleet_report.markdown(data)
    assert '| 5 | 40 | 50 | failed: boom at the end |' in text
