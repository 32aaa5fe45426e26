# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: blast_radius
short_description: The blast-radius limit of an acting playbook - which nodes act and which are held
version_added: 0.2.0
description:
  - The acting playbooks (C(remediate), C(reset_unhealthy), C(rogue_cleanup), C(reclaim_idle)) first plan every node (their
    module in check mode, registered per node), then act only where this filter lets them. It reads each node's plan from
    O(hostvars) and returns the decision, for the act play's hosts and the summary.
  - O(kind=nodes) - at most O(limits)'s C(reclaim_max_nodes_pct) percent of the targeted nodes (at least one) and at most
    C(reclaim_max_nodes) are disrupted (a GPU reset, a drain, a reboot flag, the stop of a node service), counting the nodes
    gpufleet disrupted already (still drained, flagged for a reboot, or with a disruptive action within C(reclaim_window), as
    each node's plan reports its own state in C(disruption)). Worst first - reboot-class faults, then drains, resets and
    service stops, then the severity, then the oldest evidence, then the host name. A node already disrupted may act again; a
    node whose plan has no disruptive action (only a kill, an undrain) always acts.
  - O(kind=kills) - at most C(reclaim_max_kills) processes killed in the run across the fleet, the ones with the most GPU memory
    first (a process and its children together); each node gets its share for gpu_kill's C(max_kills).
  - A plan is a module result with C(disruptive) (a list of C(action), C(gpu), C(why), C(severity), C(since)) and C(disruption)
    (gpufleet.reclaim.gpu_remediate and gpufleet.reclaim.gpu_reset return both), or, for O(kind=kills), C(killed) (the
    processes gpufleet.reclaim.gpu_kill would kill). Another playbook's own module can return the same keys to use the limit
    (see the collection's docs/fleet-tuning.md, "Blast-radius limits").
positional: _input, hostvars, register, limits
options:
  _input:
    description:
      - The targeted host names, for example C(query('inventory_hostnames', target_hosts)).
      - A host that did not register a plan (excluded by C(--limit)) is not targeted.
    required: true
    type: list
    elements: str
  hostvars:
    description: C(hostvars), where each node's plan is read.
    required: true
    type: dict
  register:
    description: The name each node registered its plan (the check-mode result) under.
    type: str
    required: true
  limits:
    description: The limits, as P(gpufleet.reclaim.blast_limits#filter) returns them.
    type: dict
    required: true
  kind:
    description: What is limited - V(nodes) (disruptive actions) or V(kills) (process kills).
    type: str
    default: nodes
    choices: [nodes, kills]
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Plan every node (check mode), then act only where the limit lets
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Plan
      gpufleet.reclaim.gpu_reset:
        when_needed: true
      check_mode: true
      register: plan

- name: Apply the limit
  hosts: localhost
  gather_facts: false
  tasks:
    - name: The decision
      ansible.builtin.set_fact:
        decision: "{{ query('inventory_hostnames', 'gpu_nodes')
                      | gpufleet.reclaim.blast_radius(hostvars, 'plan', {'reclaim_max_nodes_pct': 20} | gpufleet.reclaim.blast_limits) }}"

- name: Act on the nodes the limit lets act
  hosts: "{{ hostvars['localhost'].decision.act or 'all:!all' }}"
  gather_facts: false
  tasks:
    - name: Reset
      gpufleet.reclaim.gpu_reset:
        when_needed: true
"""

RETURN = r"""
_value:
  description:
    - "C(kind), C(targeted) (nodes), C(act) (the hosts that act, worst first), C(held) (host - reason, such as
      C(held: blast-radius limit (2 of 10 nodes disrupted in the last 1h))), C(hint) (how to raise the limit, or null),
      C(limits), C(lines) (the plan for people)."
    - For V(nodes) also C(limit), C(disrupted) (host - why, before this run) and C(disrupted_after); for V(kills) also
      C(planned), C(kills) (host - how many it may kill) and C(held_kills) (host - how many are held).
  type: dict
"""

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter.blast_limits import blast_limits
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import blast
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import printable

# the statuses of a remediation ladder's steps that act without disrupting the node (a kill, an undrain)
_WOULD = ('would_run',)


def _plan_ok(result):
    return isinstance(result, Mapping) and not (result.get('failed') or result.get('unreachable') or result.get('skipped'))


def _would_act(result):
    """Whether a plan has work that is not disruptive: gpu_remediate's kill of an application, its undrain, or the
    removal of a stale reboot flag (a disruptive plan acts anyway)."""
    for gpu in result.get('gpus') or ():
        if any(step.get('step') == 'kill_application' and step.get('status') in _WOULD for step in gpu.get('ladder') or ()):
            return True
    undrain = (result.get('node') or {}).get('undrain') or {}
    return undrain.get('status') in _WOULD or bool(result.get('stale_reboot_flag_removed'))


def _nodes(hosts, hostvars, register):
    if isinstance(hosts, str) or not all(isinstance(host, str) for host in hosts or []):
        raise AnsibleFilterError('gpufleet.reclaim.blast_radius: invalid hosts %r: expected a list of host names' % (hosts,))
    out = []
    for host in sorted(set(hosts or [])):
        if host not in hostvars or register not in hostvars[host]:
            continue
        result = hostvars[host][register]
        ok = _plan_ok(result)
        out.append({'host': host, 'ok': ok, 'disruptive': list(result.get('disruptive') or []) if ok else [],
                    'work': ok and (bool(result.get('disruptive')) or _would_act(result)),
                    'disruption': result.get('disruption') if ok else None,
                    'kills': list(result.get('killed') or []) if ok else []})
    return out


def _lines(decision, kind):
    held = decision['held']
    if kind == 'kills':
        lines = ['blast-radius limit: at most %d process(es) killed in this run (reclaim_max_kills); %d planned across %d node(s)'
                 % (decision['limits']['reclaim_max_kills'], decision['planned'], decision['targeted'])]
        lines += ['%s: may kill %d' % (host, count) for host, count in sorted(decision['kills'].items())]
        lines += ['%s: %d held: %s' % (host, count, decision['reason']) for host, count in sorted(decision['held_kills'].items())]
    else:
        limits = decision['limits']
        lines = ['blast-radius limit: at most %d of %d targeted node(s) disrupted in the last %s (reclaim_max_nodes_pct=%g%s); '
                 '%d disrupted by gpufleet already' % (decision['limit'], decision['targeted'], decision['window'],
                                                       limits['reclaim_max_nodes_pct'],
                                                       '' if limits['reclaim_max_nodes'] is None else ', reclaim_max_nodes=%d' % limits['reclaim_max_nodes'],
                                                       len(decision['disrupted']))]
        lines += ['%s: disrupted already: %s' % (host, '; '.join(why)) for host, why in sorted(decision['disrupted'].items())]
        lines += ['%s: acts' % host for host in decision['act']]
        lines += ['%s: %s' % (host, reason) for host, reason in sorted(held.items())]
    if decision['hint']:
        lines.append(decision['hint'])
    return [printable(line) for line in lines]


def blast_radius(hosts, hostvars, register, limits, kind='nodes'):
    """The decision of the run (see DOCUMENTATION)."""
    if kind not in ('nodes', 'kills'):
        raise AnsibleFilterError('gpufleet.reclaim.blast_radius: invalid kind %r: expected nodes or kills' % (kind,))
    if not isinstance(register, str) or not register:
        raise AnsibleFilterError('gpufleet.reclaim.blast_radius: invalid register %r: expected a variable name' % (register,))
    checked = blast_limits(limits)
    parsed = blast.limits_from(checked)
    nodes = _nodes(hosts, hostvars, register)
    if kind == 'kills':
        plan = blast.kill_plan(nodes, parsed)
        decision = {'kind': kind, 'targeted': len(nodes), 'planned': plan['planned'], 'kills': plan['allowed'],
                    'held_kills': plan['held'], 'act': sorted(plan['allowed']), 'reason': plan['reason'],
                    'held': dict((host, plan['reason']) for host in plan['held']), 'hint': plan['hint'], 'limits': plan['limits']}
    else:
        decision = dict(blast.fleet_plan(nodes, parsed), kind=kind)
    decision['lines'] = _lines(decision, kind)
    return decision


class FilterModule(object):
    """gpufleet.reclaim blast-radius limits."""

    def filters(self):
        return {'blast_radius': blast_radius}
