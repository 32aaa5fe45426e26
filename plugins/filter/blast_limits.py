# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: blast_limits
short_description: The blast-radius limit variables of an acting playbook, checked before any node is touched
version_added: 0.2.0
description:
  - Validates and normalises the variables of the blast-radius limit (see P(gpufleet.reclaim.blast_radius#filter)). A bad
    value (negative, over 100 for the percentage, not a number, an unknown duration) fails with the variable, the value
    and the reason; the acting playbooks call it in their first play, on the controller, so nothing has run on a node yet.
  - Survey answers are text - numbers in text are read as numbers, an empty C(reclaim_max_nodes) is no such limit, and a
    bare number for C(reclaim_window) is seconds.
positional: _input
options:
  _input:
    description:
      - A mapping with any of C(reclaim_max_nodes_pct) (a percentage of the targeted nodes, 0 to 100, default 20; the limit
        is at least one node), C(reclaim_max_nodes) (a number of nodes, 0 or more, or empty), C(reclaim_window) (a duration
        such as V(1h), at most V(7d), default V(1h)) and C(reclaim_max_kills) (processes per run, 0 or more, default 100).
    type: dict
    required: true
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check the limits before any node is touched
  ansible.builtin.set_fact:
    limits: "{{ {'reclaim_max_nodes_pct': reclaim_max_nodes_pct | default(20), 'reclaim_window': reclaim_window | default('1h')}
                | gpufleet.reclaim.blast_limits }}"
"""

RETURN = r"""
_value:
  description: C(reclaim_max_nodes_pct) (float), C(reclaim_max_nodes) (int or null), C(reclaim_window) (text),
    C(reclaim_window_s) (seconds) and C(reclaim_max_kills) (int).
  type: dict
"""

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import blast
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument


def blast_limits(values):
    """The playbook's limit variables, validated (the variable, the value and the reason when one is bad) and normalised."""
    if not isinstance(values, Mapping):
        raise AnsibleFilterError('gpufleet.reclaim.blast_limits: expected a mapping of the reclaim_* variables, got %r' % (values,))
    try:
        return blast.limits_from(dict(values)).to_dict()
    except InvalidArgument as exc:
        raise AnsibleFilterError('gpufleet.reclaim.blast_limits: %s' % exc)


class FilterModule(object):
    """gpufleet.reclaim blast-radius limit variables."""

    def filters(self):
        return {'blast_limits': blast_limits}
