# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: redact_gpu_facts
short_description: Redact the command lines in gpu_facts' facts
version_added: 0.1.0
description:
  - Returns a copy of the C(ansible_facts.gpu) that M(gpufleet.reclaim.gpu_facts) returns with the command line of
    every process and holder redacted by the guard's default patterns (passwords, tokens, keys, URL credentials become
    C(<redacted>); the same redaction as the guard's log and M(gpufleet.reclaim.gpu_kill)'s results).
  - A secret in the argument after its option (C(--password X)) makes that command line a list of one element, the
    whole redacted command line.
  - The C(inventory_report) playbook applies it before anything is written, so that C(fleet.json), C(fleet.csv) and
    C(index.html) never hold a secret from a command line.
positional: _input
options:
  _input:
    description: The facts (C(ansible_facts.gpu)); V(null) stays V(null).
    type: dict
    required: true
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Keep the facts without secrets
  ansible.builtin.set_fact:
    node_gpu: "{{ ansible_facts.gpu | gpufleet.reclaim.redact_gpu_facts }}"
"""

RETURN = r"""
_value:
  description: The facts, command lines redacted.
  type: dict
"""

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.notify import default_patterns, redact_argv


def redact_gpu_facts(facts):
    """A copy of gpu_facts' facts with ``processes[].cmdline`` and ``holders[].cmdline`` redacted."""
    if not isinstance(facts, dict):
        return facts
    patterns = default_patterns()
    out = dict(facts)
    for key in ('processes', 'holders'):
        if isinstance(facts.get(key), list):
            out[key] = [dict(item, cmdline=redact_argv(_argv(item.get('cmdline')), patterns)) if isinstance(item, dict) else item
                        for item in facts[key]]
    return out


def _argv(value):
    return [value] if isinstance(value, str) else value


class FilterModule(object):
    def filters(self):
        return {'redact_gpu_facts': redact_gpu_facts}
