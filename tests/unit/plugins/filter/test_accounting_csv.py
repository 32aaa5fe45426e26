# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpufleet.reclaim.accounting_csv: gpu_audit's accounting as CSV on the controller (history.accounting_csv)."""

from __future__ import annotations

import pytest

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter.accounting_csv import FilterModule

ACCOUNTING = {'users': [{'user': '@bob', 'gpu_hours': 1.5, 'busy_gpu_hours': 1.0, 'idle_gpu_hours': 0.5, 'jobs': 1, 'gpus': 1}],
              'jobs': [{'job': '12', 'gpu_hours': 1.0, 'busy_gpu_hours': 1.0, 'idle_gpu_hours': 0.0, 'users': ['@bob'],
                        'gpu_indexes': [0], 'first_seen': 0.0, 'last_seen': 60.0}],
              'gpus': [{'gpu_index': 0, 'gpu_uuid': 'GPU-0', 'gpu_hours': 1.5, 'busy_gpu_hours': 1.0, 'idle_gpu_hours': 0.5,
                        'users': 1, 'jobs': 1}],
              'unattributed': {'gpu_hours': 0.5, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 0.5},
              'totals': {'gpu_hours': 1.5, 'busy_gpu_hours': 1.0, 'idle_gpu_hours': 0.5, 'users': 1, 'jobs': 1, 'gpus': 1}}


def test_the_filter_writes_one_row_per_user_job_gpu_and_the_sums_per_host():
    text = FilterModule().filters()['accounting_csv']({'node01': {'available': True, 'accounting': ACCOUNTING}})
    assert text.split('\r\n') == [
        'host,section,user,job,gpu_index,gpu_uuid,gpu_hours,busy_gpu_hours,idle_gpu_hours,first_seen,last_seen,message',
        '"node01","user","\'@bob",,,,1.5,1.0,0.5,,,',
        '"node01","job","\'@bob","12",,,1.0,1.0,0.0,"1970-01-01T00:00:00Z","1970-01-01T00:01:00Z",',
        '"node01","gpu",,,0,"GPU-0",1.5,1.0,0.5,,,',
        '"node01","unattributed",,,,,0.5,0.0,0.5,,,',
        '"node01","total",,,,,1.5,1.0,0.5,,,',
        '']


def test_anything_but_reports_is_a_clear_error():
    with pytest.raises(AnsibleFilterError, match='expected a gpu_audit report or a mapping of host names to reports'):
        FilterModule().filters()['accounting_csv']([1, 2])
