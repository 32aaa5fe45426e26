# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: fleet_accounting
short_description: Add up gpu_audit's GPU-hour accounting across nodes
version_added: 0.1.0
description:
  - Takes a mapping of host names to M(gpufleet.reclaim.gpu_audit) reports (O(gpufleet.reclaim.gpu_audit#module:history=true))
    and returns the fleet's accounting - C(nodes) (how many had one), C(unavailable) (C(host) and C(error) of the others),
    C(totals), C(unattributed), C(users) (summed over nodes, with C(nodes)), C(jobs) (a job on several nodes is one row,
    with its C(users) and C(nodes)) and C(gpus) (one row per node and GPU, with C(host)); each list by GPU-hours.
  - Every figure is C(gpu_hours), C(busy_gpu_hours) and C(idle_gpu_hours); the sums over users, over GPUs and over jobs
    plus unattributed agree as they do on each node (see C(docs/audit-schema.md)).
  - The values are the nodes' data, returned as they are; escape them for display (P(gpufleet.reclaim.printable#filter)).
positional: _input
options:
  _input:
    description: A mapping of host names to reports (one report alone is accepted too).
    type: dict
    required: true
  top:
    description: Keep only this many rows in each list (V(null), the default, keeps all); C(totals) counts them all.
    type: int
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: The fleet's top 20 users, jobs and GPUs by GPU-hours
  ansible.builtin.debug:
    msg: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, ['audit', 'report'])))
             | gpufleet.reclaim.fleet_accounting(top=20) }}"
  run_once: true
"""

RETURN = r"""
_value:
  description: The fleet's accounting.
  type: dict
"""

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.accounting import merge
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument


def fleet_accounting(reports, top=None):
    try:
        return merge(reports, top)
    except (InvalidArgument, TypeError, ValueError) as exc:
        raise AnsibleFilterError('fleet_accounting: %s' % exc)


class FilterModule(object):
    def filters(self):
        return {'fleet_accounting': fleet_accounting}
