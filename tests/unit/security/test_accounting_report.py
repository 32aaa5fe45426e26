# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The fleet report's GPU-hour accounting section (issue #18): user names, job ids and host names from the nodes'
usage histories are escaped like the rest of the page, and the section adds up what the nodes reported."""

from __future__ import annotations

import re

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import accounting
from ansible_collections.gpufleet.reclaim.tests.unit.security.test_output_escaping import _report_env, _report_vars, unsafe_in

HOURS = {'gpu_hours': 3.0, 'busy_gpu_hours': 1.25, 'idle_gpu_hours': 1.75}


def _node_report(user, job):
    acc = {'users': [dict(HOURS, user=user, jobs=1, gpus=1)],
           'jobs': [dict(HOURS, job=job, users=[user], gpu_indexes=[0], first_seen=0.0, last_seen=60.0)],
           'gpus': [dict(HOURS, gpu_index=0, gpu_uuid='GPU-0', users=1, jobs=1)],
           'unattributed': {'gpu_hours': 0.0, 'busy_gpu_hours': 0.0, 'idle_gpu_hours': 0.0},
           'totals': dict(HOURS, users=1, jobs=1, gpus=1)}
    return {'available': True, 'accounting': acc}


def test_the_accounting_section_escapes_what_the_nodes_reported():
    hostile = '<script>alert(1)</script>\x1b]0;t\x07\u202e'
    fleet = accounting.merge({'node1': _node_report(hostile, '42'), 'node\n2': _node_report('=cmd|x', '42<b>'),
                              '<i>node3': {'available': False, 'error': 'no usage history at /x\x1b[2J'}}, top=10)
    fleet['hours'] = 24.0
    html = _report_env().get_template('report.html.j2').render(**dict(_report_vars(), gpufleet_accounting=fleet))
    assert not unsafe_in(html, allow='\n'), unsafe_in(html, allow='\n')
    section = html[html.index('<section id="accounting">'):html.index('<section id="nodes">')]
    assert '<script' not in section and '&lt;script&gt;alert(1)&lt;/script&gt;\\x1b]0;t\\x07\\u202e' in section
    assert '42&lt;b&gt;' in section and 'node\\x0a2' in section and '&lt;i&gt;node3: no usage history at /x\\x1b[2J' in section
    assert '6.00 GPU-hours held\n(3.50 idle' in section and 'by 2 user(s) in 2 Slurm job(s) on 2 GPU(s)' in section
    assert len(re.findall('<tr><td>', section)) == 6     # two users, two jobs, two GPUs


def test_without_accounting_the_page_has_no_section():
    html = _report_env().get_template('report.html.j2').render(**_report_vars())
    assert 'id="accounting"' not in html
    html = _report_env().get_template('report.html.j2').render(**dict(_report_vars(), gpufleet_accounting=None))
    assert 'id="accounting"' not in html
