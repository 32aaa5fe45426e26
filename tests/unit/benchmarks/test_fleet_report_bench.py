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


def test_the_probe_opens_the_index_and_the_largest_page_of_each_kind():
    files = {'index.html': 0.1, 'fleet.json': 9.0, 'fleet.csv': 1.0, 'nodes-0001.html': 0.3, 'nodes-0002.html': 0.35,
             'idle-0001.html': 0.1, 'idle-0002.html': 0.05}
    assert fleet_report.pages_to_probe(files) == ['index.html', 'idle-0001.html', 'nodes-0002.html']
    assert fleet_report.pages_to_probe({'index.html': 4.0, 'fleet.json': 9.0}) == ['index.html']


def test_markdown_shows_the_worst_page():
    worst = {'pages': ['index.html', 'nodes-0002.html'], 'load_ms': 286.0, 'scroll_step_max_ms': 18.2, 'filter_ms': 41.0, 'unfilter_ms': 60.0,
             'find_ms': 143.0, 'usable': False, 'error': None}
    res = {'nodes': 1000, 'gpus': 7968, 'processes': 10644, 'wall_s': 113.8, 'cpu_s': 66.3, 'maxrss_mib': 558.9,
           'files': {'index.html': 0.06, 'nodes-0001.html': 0.3, 'nodes-0002.html': 0.35, 'fleet.json': 11.1, 'fleet.csv': 1.3},
           'browser': {'worst': worst}}
    text = fleet_report.markdown({'sizes': [res], 'seconds': 1, 'freeze_ms': 100})
    assert '| 1000 | 7968 | 10644 | 113.8 | 66.3 | 559 | 0.06 | 2 (0.35) | 11.1 | 1.3 | 2 | 286 | 18 | 41 | 143 | **no** |' in text
