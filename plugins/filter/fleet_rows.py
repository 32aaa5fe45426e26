# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: fleet_rows
short_description: The fleet report's rows, offenders and totals from the node records, in one pass
version_added: 0.2.0
description:
  - Takes the node records of C(inventory_report) (P(gpufleet.reclaim.fleet_records#filter) with workflow
    V(inventory_report)) and returns what the report is written from, in time linear in the number of GPUs and
    processes (the Jinja loops it replaces copied whole lists for every row).
  - C(gpus) has one row per GPU of every node read (C(host), the device's fields, C(health), C(recommended_action),
    C(reasons), C(processes) (how many), C(top_user), C(top_pid), C(top_used_mib) (the process holding most memory),
    C(used_pct), C(proc_pct), C(orphan_pct) and C(mig), one entry per MIG instance).
  - C(procs) has one row per GPU process (C(host), C(pid), C(user) (V(?) when unknown), C(name), C(cmd), C(used_mib),
    C(gpus), C(gpu_util_pct) (the busiest of its GPUs; V(null) when one is unknown), C(idle), C(container),
    C(slurm_job), C(status)); C(holders) one row per holder of a GPU device file that the driver does not list, with C(host)
    and C(cmd).
  - C(nodes) has one row per node record, in their order (C(host), C(status), C(msg), C(first_gpu) and C(gpus), where its
    GPU rows start in C(gpus) and how many there are, C(processes), C(memory_used_mib), C(memory_total_mib), C(unhealthy)
    and C(orphaned) (how many of its GPUs), and C(backend_error), V(null) when the node's facts name no backend, else the
    first backend's error or an empty string), so that a page of nodes is written from its own rows only.
  - C(csv) is fleet.csv's text (one line per GPU, docs/report.md), C(records) the node records it was given (so that one
    C(set_fact) carries both).
  - C(disrupted) has one row per node that gpufleet disrupted lately (C(host), C(why)) - still drained by the remediation
    ladder or in Slurm for a gpufleet reason, flagged for a reboot, or reset, drained, flagged or with a service stopped
    within O(disruption_window) - from each node's C(disruption) fact (the blast-radius limit's own reading,
    P(gpufleet.reclaim.blast_radius#filter)).
  - C(users) (per user, by GPU memory), C(idle) (idle holders by memory), C(orphaned) (GPUs with orphaned memory, by
    that memory), C(unhealthy) (GPUs whose health is not V(ok)) and C(totals) (the counts and sums the report's summary,
    fleet.json and the job artifacts show).
  - C(pages) lists the files of a report too large for one page (empty unless O(page_nodes) is set and the fleet has
    more nodes than that), one entry per file (C(kind), C(page) (from 1), C(file), C(start) and C(stop), the slice of
    C(nodes) or of the offenders' list that it holds), C(nodes-0001.html), ... of O(page_nodes) nodes each, then, for
    each of C(idle), C(orphaned), C(holders) and C(unhealthy) longer than O(index_rows), C(idle-0001.html), ... of
    O(page_rows) rows each.
  - Node values are returned as they are (command lines already redacted by P(gpufleet.reclaim.fleet_records#filter));
    escape them for display (P(gpufleet.reclaim.printable#filter)).
positional: _input
options:
  _input:
    description: The node records (C(host), C(status), C(msg) and C(gpu), the node's C(ansible_facts.gpu) or V(null)).
    type: list
    elements: dict
    required: true
  idle_util_pct:
    description: A GPU at or below this utilization counts as idle.
    type: int
    default: 5
  idle_min_mib:
    description: An idle holder holds at least this much GPU memory.
    type: int
    default: 1024
  page_nodes:
    description: Past this many nodes the report's nodes go on pages of this many (V(0), the default, makes no pages).
    type: int
    default: 0
  page_rows:
    description: Rows per page of an offenders' list.
    type: int
    default: 1000
  index_rows:
    description: How many rows of an offenders' list the report's first page shows; a longer list gets pages of its own.
    type: int
    default: 100
  disruption_window:
    description: How long a node counts as disrupted after gpufleet reset, drained or flagged it (a duration, such as the
      acting playbooks' C(reclaim_window)).
    type: str
    default: 1h
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: The report's rows, offenders and totals
  ansible.builtin.set_fact:
    fleet: "{{ records | gpufleet.reclaim.fleet_rows(idle_util_pct=5, idle_min_mib=1024) }}"

- name: Fleet summary
  ansible.builtin.debug:
    msg: "{{ fleet.totals.gpus }} GPU(s), {{ fleet.totals.idle_holders }} idle holder(s)"
"""

RETURN = r"""
_value:
  description: The report's rows and totals.
  type: dict
  contains:
    gpus:
      description: One row per GPU.
      type: list
      elements: dict
    procs:
      description: One row per GPU process.
      type: list
      elements: dict
    nodes:
      description: One row per node record.
      type: list
      elements: dict
    holders:
      description: One row per holder of a GPU device file that the driver does not list.
      type: list
      elements: dict
    users:
      description: One row per user (C(user), C(used_mib), C(idle_mib), C(processes), C(gpus), C(nodes)), by C(used_mib).
      type: list
      elements: dict
    idle:
      description: The rows of C(procs) that are idle holders, by C(used_mib).
      type: list
      elements: dict
    orphaned:
      description: The rows of C(gpus) with orphaned memory, by C(orphaned_mib).
      type: list
      elements: dict
    unhealthy:
      description: The rows of C(gpus) whose health is not V(ok).
      type: list
      elements: dict
    disrupted:
      description: One row per node gpufleet disrupted lately (C(host), C(why), a list of reasons).
      type: list
      elements: dict
    pages:
      description: The report's pages past the first (C(kind), C(page), C(file), C(start), C(stop)).
      type: list
      elements: dict
    records:
      description: The node records the filter was given.
      type: list
      elements: dict
    csv:
      description: fleet.csv's text.
      type: str
    totals:
      description: C(nodes), C(nodes_ok), C(nodes_unreachable), C(nodes_failed), C(gpus), C(memory_total_mib),
        C(memory_used_mib), C(orphaned_mib), C(idle_mib), C(processes), C(users), C(unhealthy_gpus), C(idle_holders),
        C(orphan_holders), C(disrupted_nodes).
      type: dict
"""

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.blast import disrupted_because
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.idle import IdleRule
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import csv_cell, csv_row
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.units import parse_duration

# fleet.csv's columns: a GPU row's fields, then message (a node that could not be read, or has no GPU, is one row)
CSV_COLUMNS = ('host', 'status', 'gpu_index', 'uuid', 'name', 'pci_bus_id', 'memory_used_mib', 'memory_total_mib', 'memory_used_pct',
               'orphaned_mib', 'utilization_pct', 'temperature_c', 'power_w', 'health', 'recommended_action', 'health_reasons',
               'processes', 'top_user', 'top_pid', 'top_used_mib', 'message')
CSV_FIELDS = ('index', 'uuid', 'name', 'pci_bus_id', 'memory_used_mib', 'memory_total_mib', 'used_pct', 'orphaned_mib', 'utilization_pct',
              'temperature_c', 'power_w', 'health', 'recommended_action', 'reasons', 'processes', 'top_user', 'top_pid', 'top_used_mib')


def _pct(part, whole):
    return round(part * 100.0 / whole, 1)


def _cmd(entry):
    return ' '.join(str(arg) for arg in entry.get('cmdline') or []) or entry.get('name') or ''


def _mig_row(dev, mig, total):
    used, size = mig.get('memory_used_mib'), mig.get('memory_total_mib')
    return {'unit': '%s:%s' % (dev.get('index'), mig.get('gpu_instance_id')), 'gpu_instance_id': mig.get('gpu_instance_id'),
            'compute_instance_id': mig.get('compute_instance_id'), 'profile': mig.get('profile'), 'uuid': mig.get('uuid'),
            'memory_used_mib': used, 'memory_total_mib': size, 'processes': len(mig.get('processes') or []),
            'width_pct': _pct(size, total) if (size and total) else 0,
            'used_pct': _pct(used, size) if (used is not None and size) else None}


def _gpu_row(host, dev, processes):
    pids = set(dev.get('processes') or [])
    mine = [proc for proc in processes if proc.get('pid') in pids]     # one node's processes: a few, never the fleet's
    top, top_mib = None, -1
    for proc in mine:
        if (proc.get('used_mib') or 0) > top_mib:
            top, top_mib = proc, proc.get('used_mib') or 0
    total, used = dev.get('memory_total_mib'), dev.get('memory_used_mib')
    orphaned = dev.get('orphaned_mib') if dev.get('orphaned_mib') is not None else 0
    health = dev.get('health') or {}
    known = used is not None and total
    return {'host': host, 'index': dev.get('index'), 'name': dev.get('name'), 'uuid': dev.get('uuid'),
            'pci_bus_id': dev.get('pci_bus_id'), 'vendor': dev.get('vendor'),
            'memory_total_mib': total, 'memory_used_mib': used, 'memory_free_mib': dev.get('memory_free_mib'),
            'orphaned_mib': dev.get('orphaned_mib'), 'utilization_pct': dev.get('utilization_pct'),
            'temperature_c': dev.get('temperature_c'), 'power_w': dev.get('power_w'),
            'health': health.get('status'), 'recommended_action': health.get('recommended_action'),
            'reasons': health.get('reasons', []), 'processes': len(mine),
            'top_user': top.get('user') if top else None, 'top_pid': top.get('pid') if top else None,
            'top_used_mib': top.get('used_mib') if top else None,
            'used_pct': _pct(used, total) if known else None,
            'proc_pct': _pct(used - orphaned, total) if known else None,
            'orphan_pct': _pct(orphaned, total) if known else None,
            'mig_mode': dev.get('mig_mode'),
            'mig': [_mig_row(dev, mig, total) for mig in dev.get('mig_devices') or []]}


def _node_row(node, first_gpu, gpus, processes):
    facts = node.get('gpu') or {}
    backends = facts.get('backends') or {}
    errors = [entry.get('error') for entry in backends.values() if isinstance(entry, Mapping) and entry.get('error')]
    return {'host': node['host'], 'status': node.get('status'), 'msg': node.get('msg'), 'first_gpu': first_gpu, 'gpus': len(gpus),
            'processes': len(processes), 'memory_used_mib': sum(row['memory_used_mib'] or 0 for row in gpus),
            'memory_total_mib': sum(row['memory_total_mib'] or 0 for row in gpus),
            'unhealthy': len([row for row in gpus if row['health'] != 'ok']), 'orphaned': len([row for row in gpus if row['orphaned_mib']]),
            'backend_error': (errors[0] if errors else '') if backends else None}


def _proc_row(host, proc, utils, rule):
    gpus = proc.get('gpu_indexes', [])
    pu = [utils.get(index) for index in gpus]
    util = max(pu) if pu and None not in pu else None
    used = proc.get('used_mib')
    container = proc.get('container')
    return {'host': host, 'pid': proc.get('pid'), 'user': proc.get('user') if proc.get('user') is not None else '?',
            'name': proc.get('name'), 'cmd': _cmd(proc), 'used_mib': used, 'gpus': gpus,
            'gpu_util_pct': util, 'idle': rule.is_idle(util, used),   # core.idle: the one idleness rule
            'container': container.get('id') if container else None,
            'slurm_job': proc.get('slurm_job'), 'status': proc.get('status')}


def fleet_csv(nodes, gpus):
    """fleet.csv (one line per GPU, LF line ends, a header line) from the ``nodes`` and ``gpus`` rows: every text cell
    escaped and formulas defused by ``core.text.csv_cell``; a node that could not be read, or has no GPU, is one line."""
    lines = [','.join(CSV_COLUMNS)]
    for node in nodes:
        if node['status'] != 'ok' or not node['gpus']:
            why = node['msg'] if node['status'] != 'ok' else 'no GPU found'
            lines.append(csv_row((node['host'], node['status']) + (None,) * (len(CSV_COLUMNS) - 3) + (why,)))
            continue
        for row in gpus[node['first_gpu']:node['first_gpu'] + node['gpus']]:
            cells = [csv_cell(row['host']), 'ok']
            cells.extend(csv_cell('; '.join(str(why) for why in row['reasons']) if key == 'reasons' else row[key]) for key in CSV_FIELDS)
            lines.append(','.join(cells) + ',')
    return '\n'.join(lines) + '\n'


def _users(procs):
    """Per user: memory, idle memory, processes, distinct (GPUs, node) pairs and nodes; by memory, then user name.

    User and host names are compared exactly (the Jinja this replaces grouped them without regard to case)."""
    acc = {}
    for row in procs:
        user = acc.setdefault(row['user'], {'user': row['user'], 'used_mib': 0, 'processes': 0, 'gpus': set(), 'nodes': set(),
                                            'idle_mib': 0})
        user['used_mib'] += row['used_mib'] or 0
        user['idle_mib'] += (row['used_mib'] or 0) if row['idle'] else 0
        user['processes'] += 1
        user['gpus'].add((tuple(row['gpus']), row['host']))
        user['nodes'].add(row['host'])
    rows = [dict(user, gpus=len(user['gpus']), nodes=len(user['nodes'])) for _name, user in sorted(acc.items(), key=lambda item: str(item[0]))]
    return sorted(rows, key=lambda row: row['used_mib'], reverse=True)


def _pages(kind, count, size):
    return [{'kind': kind, 'page': number, 'file': '%s-%04d.html' % (kind, number), 'start': start, 'stop': min(start + size, count)}
            for number, start in enumerate(range(0, count, size), 1)]


def _count(name, value, least):
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < least:
        raise AnsibleFilterError('fleet_rows: invalid %s %r: expected an integer of at least %d' % (name, value, least))
    return number


def _window(value):
    try:
        return parse_duration(value, 'disruption_window')
    except InvalidArgument as exc:
        raise AnsibleFilterError('fleet_rows: %s' % exc)


def fleet_rows(records, idle_util_pct=5, idle_min_mib=1024, page_nodes=0, page_rows=1000, index_rows=100, disruption_window='1h'):
    if not isinstance(records, (list, tuple)):
        raise AnsibleFilterError('fleet_rows: the node records must be a list, got %s' % type(records).__name__)
    try:
        idle_util_pct, idle_min_mib = int(idle_util_pct), int(idle_min_mib)
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError('fleet_rows: idle_util_pct and idle_min_mib must be integers: %s' % exc)
    rule = IdleRule(idle_util_pct, idle_min_mib)
    page_nodes, page_rows, index_rows = _count('page_nodes', page_nodes, 0), _count('page_rows', page_rows, 1), _count('index_rows', index_rows, 0)
    window = _window(disruption_window)
    gpus, procs, holders, nodes, disrupted = [], [], [], [], []
    status = {'ok': 0, 'unreachable': 0}
    for node in records:
        if not isinstance(node, Mapping) or 'host' not in node:
            raise AnsibleFilterError('fleet_rows: a node record must be a mapping with a host, got %r' % (node,))
        host = node['host']
        status[node.get('status')] = status.get(node.get('status'), 0) + 1
        facts = node.get('gpu') or {}
        devices, processes = facts.get('devices') or [], facts.get('processes') or []
        utils = dict((dev.get('index'), dev.get('utilization_pct')) for dev in devices)
        mine = [_gpu_row(host, dev, processes) for dev in devices]
        nodes.append(_node_row(node, len(gpus), mine, processes))
        gpus.extend(mine)
        procs.extend(_proc_row(host, proc, utils, rule) for proc in processes)
        holders.extend(dict(holder, host=host, cmd=_cmd(holder)) for holder in facts.get('holders') or [])
        why = disrupted_because(facts.get('disruption'), window)
        if why:
            disrupted.append({'host': host, 'why': why})
    users = _users(procs)
    idle = sorted((row for row in procs if row['idle']), key=lambda row: row['used_mib'], reverse=True)
    orphaned = sorted((row for row in gpus if row['orphaned_mib']), key=lambda row: row['orphaned_mib'], reverse=True)
    unhealthy = [row for row in gpus if row['health'] != 'ok']
    totals = {'nodes': len(records), 'nodes_ok': status['ok'], 'nodes_unreachable': status['unreachable'],
              'nodes_failed': len(records) - status['ok'] - status['unreachable'], 'gpus': len(gpus),
              'memory_total_mib': sum(row['memory_total_mib'] or 0 for row in gpus),
              'memory_used_mib': sum(row['memory_used_mib'] or 0 for row in gpus),
              'orphaned_mib': sum(row['orphaned_mib'] or 0 for row in gpus),
              'idle_mib': sum(row['used_mib'] or 0 for row in idle), 'processes': len(procs), 'users': len(users),
              'unhealthy_gpus': len(unhealthy), 'idle_holders': len(idle), 'orphan_holders': len(holders),
              'disrupted_nodes': len(disrupted)}
    pages = []
    if page_nodes and len(nodes) > page_nodes:
        pages = _pages('nodes', len(nodes), page_nodes)
        for kind, rows in (('idle', idle), ('orphaned', orphaned), ('holders', holders), ('unhealthy', unhealthy)):
            pages.extend(_pages(kind, len(rows), page_rows) if len(rows) > index_rows else [])
    return {'records': records, 'gpus': gpus, 'procs': procs, 'holders': holders, 'nodes': nodes, 'users': users, 'idle': idle,
            'orphaned': orphaned, 'unhealthy': unhealthy, 'disrupted': disrupted, 'pages': pages, 'totals': totals, 'csv': fleet_csv(nodes, gpus)}


class FilterModule(object):
    def filters(self):
        return {'fleet_rows': fleet_rows}
