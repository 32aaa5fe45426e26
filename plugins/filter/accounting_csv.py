# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: accounting_csv
short_description: Turn gpu_audit's GPU-hour accounting into CSV
version_added: 0.1.0
description:
  - Returns the C(accounting) of a M(gpufleet.reclaim.gpu_audit) report (O(gpufleet.reclaim.gpu_audit#module:history=true)) as
    CSV text (RFC 4180, CRLF line ends, a header row) - on the controller, so that nothing is written on the nodes.
  - "Columns: C(host), C(section) (V(user), V(job), V(gpu), V(unattributed), V(total), or V(unavailable) for a host without a
    readable history), C(user) (a job's users, space-separated), C(job), C(gpu_index), C(gpu_uuid), C(gpu_hours),
    C(busy_gpu_hours), C(idle_gpu_hours), C(first_seen), C(last_seen) (UTC, ISO 8601) and C(message)."
  - Numbers are written as they are and unknown values as empty cells. Every text cell is quoted, its control, line break
    and bidi characters escaped visibly (as P(gpufleet.reclaim.printable#filter) does), and text that starts with C(=), C(+), C(-) or
    C(@) gets a leading apostrophe, so that a user name cannot start a formula in a spreadsheet (CSV injection).
positional: _input
options:
  _input:
    description: One report (RV(gpufleet.reclaim.gpu_audit#module:report)), or a mapping of host names to reports.
    type: dict
    required: true
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Account the last week's GPU-hours on every node
  gpufleet.reclaim.gpu_audit:
    history: true
    hours: 168
    top: 1000
  become: true
  register: audit

- name: Write one CSV for the fleet on the controller
  ansible.builtin.copy:
    dest: /srv/reports/gpu-hours.csv
    mode: "0644"
    content: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, ['audit', 'report'])))
                 | gpufleet.reclaim.accounting_csv }}"
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
_value:
  description: The CSV text.
  type: str
"""

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.accounting import accounting_csv
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument


def _accounting_csv(reports):
    try:
        return accounting_csv(reports)
    except InvalidArgument as exc:
        raise AnsibleFilterError(str(exc))


class FilterModule(object):
    def filters(self):
        return {'accounting_csv': _accounting_csv}
