# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: fleet_records
short_description: One record per node from the result each node registered in a gpufleet.reclaim playbook
version_added: 0.2.0
description:
  - The shipped playbooks make one module call per node and register its result; nothing else runs per node. Their
    fleet summary play (on the controller) turns those results into one record per node with this filter, instead of
    a chain of per-node C(set_fact) tasks (each of which cost the controller a task per node).
  - A node appears when it registered the result (reached, failed, unreachable or skipped); a node of O(_input) that
    never ran the task (excluded by C(--limit)) does not.
  - Every record has C(host), C(status) (V(ok), V(failed), V(unreachable); V(halted) for a skipped reset of
    C(reset_unhealthy); V(driver_hung) for C(remediate) when the driver hung) and C(msg), plus the fields of its
    O(workflow) (C(docs/fleet-tuning.md), "One round trip per node"). Records are sorted by host.
  - For C(rogue_cleanup) and C(reclaim_idle) a node whose killed processes' GPU memory did not come back is V(failed)
    with a message naming the GPUs (what the playbooks' per-node check did before). For C(inventory_report) the
    command lines in the facts are redacted (P(gpufleet.reclaim.redact_gpu_facts#filter)) before the record exists.
positional: _input, hostvars, register, workflow
options:
  _input:
    description: The host names to look at, for example C(query('inventory_hostnames', target_hosts)).
    type: list
    elements: str
    required: true
  hostvars:
    description: C(hostvars).
    type: dict
    required: true
  register:
    description:
      - The name each node registered the module's result under, or a list of names - the first one a node registered
        is its result (the act play's before the plan's, in the playbooks that plan every node first).
    type: raw
    required: true
  workflow:
    description: The playbook whose records to build.
    type: str
    required: true
    choices: [rogue_cleanup, reclaim_idle, reset_unhealthy, remediate, audit, inventory_report]
  extra:
    description: Fields added to every record, for example the run's mode.
    type: dict
    default: {}
  max_fail_percentage:
    description: For C(reset_unhealthy), the threshold named in a halted node's message.
    type: raw
  blast:
    description:
      - The run's blast-radius decision (P(gpufleet.reclaim.blast_radius#filter)). Every record then has C(held) - the
        reason when the limit held the node, else V(null) - and for C(rogue_cleanup) and C(reclaim_idle)
        C(held_processes), the processes the limit held (a held node's planned kills among them), each with the reason.
    type: dict
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Kill rogue processes, one call per node
  hosts: gpu_nodes
  gather_facts: false
  ignore_unreachable: true
  tasks:
    - name: Audit, kill and verify the release
      gpufleet.reclaim.gpu_kill:
        rogue: true
        force: true
      register: node_kill
      ignore_errors: true

- name: Summary
  hosts: localhost
  gather_facts: false
  tasks:
    - name: One record per node
      ansible.builtin.set_fact:
        records: "{{ query('inventory_hostnames', 'gpu_nodes') | gpufleet.reclaim.fleet_records(hostvars, 'node_kill', 'rogue_cleanup') }}"
"""

RETURN = r"""
_value:
  description: One record per node that registered the result, sorted by host.
  type: list
  elements: dict
"""

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter.redact_gpu_facts import redact_gpu_facts

# The keys of a finding, a reset and a remediated GPU that the records keep (the summary files stay small).
FINDING_KEYS = ('pid', 'user', 'name', 'cmdline', 'gpu_indexes', 'used_mib', 'score', 'level')
RESET_KEYS = ('index', 'uuid', 'name', 'selected_because', 'status', 'verified', 'seconds', 'error', 'would_kill', 'killed')
LADDER_KEYS = ('index', 'key', 'findings', 'ladder', 'status', 'awaiting_reboot')


def _pick(items, keys):
    return [dict((k, item[k]) for k in keys if k in item) for item in items or [] if isinstance(item, dict)]


def _freed(result):
    return sum(int(v or 0) for v in (result.get('freed_mib') or {}).values())


def _kills(result):
    return {'killed': result.get('killed') or [], 'kill_failed': result.get('failed_processes') or [],
            'freed_mib': _freed(result), 'unreleased': result.get('unreleased') or [],
            'held_processes': result.get('held_processes') or []}


def _rogue_cleanup(result):
    record = _kills(result)
    record.update(summary=result.get('rogue_summary') or {}, findings=_pick(result.get('findings'), FINDING_KEYS),
                  skipped=result.get('skipped_processes') or [])
    return record


def _reset_unhealthy(result):
    return {'resets': _pick(result.get('resets'), RESET_KEYS), 'reset_gpus': result.get('reset_gpus') or [],
            'failed_gpus': result.get('failed_gpus') or []}


def _remediate(result):
    return {'gpus': _pick(result.get('gpus'), LADDER_KEYS), 'node': result.get('node') or {},
            'reboot_wanted': bool(result.get('reboot_wanted')), 'drained': bool(result.get('drained')),
            'driver_hung': result.get('driver_hung') if result.get('failed') else None}


def _audit(result):
    return {'findings': result.get('findings') or [], 'summary': result.get('summary') or {}, 'report': result.get('report')}


def _inventory_report(result):
    facts = (result.get('ansible_facts') or {}).get('gpu') if not (result.get('failed') or result.get('unreachable')) else None
    return {'gpu': redact_gpu_facts(facts) if facts is not None else None}


WORKFLOWS = {
    'rogue_cleanup': _rogue_cleanup,
    'reclaim_idle': _kills,
    'reset_unhealthy': _reset_unhealthy,
    'remediate': _remediate,
    'audit': _audit,
    'inventory_report': _inventory_report,
}


def node_status(result, workflow):
    """(status, msg) of one node's registered result."""
    msg = result.get('msg') or ''
    if result.get('unreachable'):
        return 'unreachable', msg or 'unreachable'
    if result.get('skipped'):
        return ('halted' if workflow == 'reset_unhealthy' else 'skipped'), msg
    if result.get('failed'):
        return ('driver_hung' if workflow == 'remediate' and result.get('driver_hung') else 'failed'), msg or 'failed'
    if result.get('unreleased') and workflow in ('rogue_cleanup', 'reclaim_idle'):
        return 'failed', 'GPU memory not released: %s' % (result['unreleased'],)
    return 'ok', msg


def _held(record, host, blast):
    """The blast-radius decision's part of a node's record (see the option ``blast``)."""
    reason = (blast.get('held') or {}).get(host)
    record['held'] = reason
    if 'held_processes' not in record:
        return
    if reason and host not in (blast.get('kills') or {}):
        record['held_processes'] = record['held_processes'] + record['killed']   # the plan's: none was signalled
        record['killed'] = []
    if blast.get('reason'):
        record['held_processes'] = [dict(proc, reason=blast['reason']) for proc in record['held_processes']]


def _registers(register):
    names = [register] if isinstance(register, str) else list(register) if isinstance(register, (list, tuple)) else []
    if not names or not all(isinstance(name, str) and name for name in names):
        raise AnsibleFilterError('gpufleet.reclaim.fleet_records: invalid register %r: expected a variable name or a list of them'
                                 % (register,))
    return names


def fleet_records(hosts, hostvars, register, workflow, extra=None, max_fail_percentage=None, blast=None):
    """One record per host of ``hosts`` that registered ``register`` (see DOCUMENTATION)."""
    if workflow not in WORKFLOWS:
        raise AnsibleFilterError('gpufleet.reclaim.fleet_records: invalid workflow %r: expected one of %s'
                                 % (workflow, ', '.join(sorted(WORKFLOWS))))
    registers = _registers(register)
    if isinstance(hosts, str) or not all(isinstance(host, str) for host in hosts or []):
        raise AnsibleFilterError('gpufleet.reclaim.fleet_records: invalid hosts %r: expected a list of host names' % (hosts,))
    records = []
    for host in sorted(set(hosts or [])):
        if host not in hostvars:
            continue
        node_vars = hostvars[host]
        name = next((n for n in registers if n in node_vars), None)
        if name is None:
            continue
        result = node_vars[name]
        if not isinstance(result, Mapping):
            raise AnsibleFilterError('gpufleet.reclaim.fleet_records: %s of %s is %r, not a task result' % (name, host, result))
        status, msg = node_status(result, workflow)
        record = {'host': host, 'status': status, 'msg': msg}
        record.update(WORKFLOWS[workflow](result))
        if blast is not None:
            _held(record, host, blast)
        record.update(extra or {})
        records.append(record)
    if workflow == 'reset_unhealthy':
        failed = len([r for r in records if r['status'] == 'failed'])
        for record in records:
            if record['status'] == 'halted':
                record['msg'] = ('not attempted: %d of %d node(s) failed their reset (in the plan or an earlier batch), more than '
                                 'reset_max_fail_percentage=%s%%' % (failed, len(records), max_fail_percentage))
    return records


class FilterModule(object):
    """gpufleet.reclaim fleet bookkeeping."""

    def filters(self):
        return {'fleet_records': fleet_records}
