# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Blast-radius limits across the fleet (issue #30): a bounded share of the fleet disrupted per run and per window.

Pure functions over what every node's plan said (the acting playbooks' check-mode pass; the filters
gpufleet.reclaim.blast_limits and gpufleet.reclaim.blast_radius call them on the controller):

* ``Limits``: the playbook variables ``reclaim_max_nodes_pct`` (default 20), ``reclaim_max_nodes`` (optional),
  ``reclaim_window`` (default 1h) and ``reclaim_max_kills`` (default 100), validated before any node is touched.
* ``fleet_plan``: which nodes may take a disruptive action (a GPU reset, a drain, a reboot flag, the stop of a
  node service) in this run.  At most ``max(1, floor(pct x targeted / 100))`` nodes, and at most
  ``reclaim_max_nodes``, are disrupted, counting the nodes already disrupted by gpufleet (still drained, flagged
  for a reboot, or with a disruptive action within the window, as each node's own state says:
  core/disruption.node_disruption).  A node already disrupted may act again (it is counted once); the others are
  taken worst first (reboot-class faults, then drains, resets, service stops; then the severity, then the oldest
  evidence, then the host name) until the limit is reached; the rest are held.
* ``kill_plan``: at most ``reclaim_max_kills`` processes killed per run across the fleet, in the one kill order
  (``kill_families``: the process with the most GPU memory first, a process and the children collected with it
  together), which gpu_kill's ``max_kills`` applies on each node in the same way.
"""

from __future__ import annotations

import math

from .constants import DISRUPTION_KEEP_S, DISRUPTIVE_ACTIONS
from .errors import InvalidArgument
from .units import human_duration, parse_duration

DEFAULT_MAX_NODES_PCT = 20
DEFAULT_WINDOW = '1h'
DEFAULT_MAX_KILLS = 100
MAX_KILLS_LIMIT = 1000000
HELD = 'held: blast-radius limit'


def _blank(value):
    return value is None or (isinstance(value, str) and value.strip().lower() in ('', 'none', 'null'))


def _number(field, value, low, high, whole, what):
    """``value`` (a number, or text of one: survey answers are text) within [low, high]; InvalidArgument otherwise."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise InvalidArgument(field, value, 'not a number: expected %s' % what)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or math.isnan(number) or math.isinf(number):
        raise InvalidArgument(field, value, 'not a number: expected %s' % what)
    if whole and not float(number).is_integer():
        raise InvalidArgument(field, value, 'expected %s (a whole number)' % what)
    if number < low:
        raise InvalidArgument(field, value, '%s: expected %s' % ('negative' if number < 0 else 'too small', what))
    if high is not None and number > high:
        raise InvalidArgument(field, value, 'over %s: expected %s' % (high, what))
    return int(number) if whole else float(number)


class Limits(object):
    """The fleet-level limits of one run (see the module docstring); InvalidArgument names the variable."""

    def __init__(self, max_nodes_pct=DEFAULT_MAX_NODES_PCT, max_nodes=None, window=DEFAULT_WINDOW, max_kills=DEFAULT_MAX_KILLS):
        self.max_nodes_pct = _number('reclaim_max_nodes_pct', max_nodes_pct, 0, 100, False, 'a percentage from 0 to 100')
        self.max_nodes = None if _blank(max_nodes) else _number('reclaim_max_nodes', max_nodes, 0, None, True,
                                                                'a number of nodes, 0 or more (or empty: no such limit)')
        if isinstance(window, str) and window.strip().replace('.', '', 1).isdigit():
            window = float(window)   # a survey's bare number is seconds
        self.window_s = parse_duration(window, 'reclaim_window')
        if self.window_s > DISRUPTION_KEEP_S:
            raise InvalidArgument('reclaim_window', window, 'over %s, the disruption history a node keeps' % human_duration(DISRUPTION_KEEP_S))
        self.window = window if isinstance(window, str) else human_duration(self.window_s)
        self.max_kills = _number('reclaim_max_kills', max_kills, 0, MAX_KILLS_LIMIT, True, 'a number of processes, 0 or more')

    def node_limit(self, targeted):
        """How many of ``targeted`` nodes may be disrupted at once: the percentage (at least one node), then max_nodes."""
        limit = max(1, int(math.floor(targeted * self.max_nodes_pct / 100.0 + 1e-9)))
        return limit if self.max_nodes is None else min(limit, self.max_nodes)

    def to_dict(self):
        return {'reclaim_max_nodes_pct': self.max_nodes_pct, 'reclaim_max_nodes': self.max_nodes, 'reclaim_window': self.window,
                'reclaim_window_s': self.window_s, 'reclaim_max_kills': self.max_kills}


def limits_from(values):
    """Limits from a mapping of the playbook variables (names as in Limits.to_dict; missing ones take the defaults)."""
    values = values or {}
    return Limits(max_nodes_pct=values.get('reclaim_max_nodes_pct', DEFAULT_MAX_NODES_PCT), max_nodes=values.get('reclaim_max_nodes'),
                  window=values.get('reclaim_window', DEFAULT_WINDOW), max_kills=values.get('reclaim_max_kills', DEFAULT_MAX_KILLS))


# ---------------------------------------------------------------------------- nodes
def disrupted_because(disruption, window_s):
    """Why a node counts as disrupted by gpufleet now (its core/disruption.node_disruption record): still drained,
    still flagged for a reboot, drained in the scheduler for a gpufleet reason, or a disruptive action no older
    than ``window_s``.  An empty list: not disrupted."""
    if not isinstance(disruption, dict):
        return []
    why = []
    if disruption.get('drained'):
        why.append('drained by the ladder (%s)' % (disruption['drained'].get('reason') or 'no reason recorded'))
    if disruption.get('reboot_flag'):
        why.append('flagged for a reboot (%s)' % '; '.join('%s: %s' % kv for kv in sorted(disruption['reboot_flag'].get('gpus', {}).items())))
    if disruption.get('scheduler') and not disruption.get('drained'):
        why.append('drained in the scheduler (%s)' % disruption['scheduler'].get('reason'))
    done = {}
    for entry in disruption.get('actions') or ():
        ago = entry.get('ago_s') if isinstance(entry, dict) else None
        if isinstance(ago, (int, float)) and not isinstance(ago, bool) and ago <= window_s and entry.get('action') in DISRUPTIVE_ACTIONS:
            label = entry['action'].replace('_', ' ') + (' of GPU %s' % entry['gpu'] if entry.get('gpu') else '')
            done.setdefault(label, ago)
    why.extend('%s %s ago' % (label, human_duration(ago)) for label, ago in sorted(done.items(), key=lambda kv: kv[1]))
    return why


def node_rank(disruptive):
    """The sort key of a node's planned disruptive actions: the worst class first (reboot flag, drain, reset, service
    stop), then the highest severity (0 ok .. 2 lost), then the oldest evidence (epoch seconds; none: last)."""
    classes = [DISRUPTIVE_ACTIONS.index(a['action']) for a in disruptive if a.get('action') in DISRUPTIVE_ACTIONS]
    severity = max([a.get('severity') or 0 for a in disruptive] or [0])
    since = [a['since'] for a in disruptive if isinstance(a.get('since'), (int, float)) and not isinstance(a.get('since'), bool)]
    return (min(classes) if classes else len(DISRUPTIVE_ACTIONS), -severity, min(since) if since else float('inf'))


def held_reason(disrupted, targeted, window):
    return '%s (%d of %d nodes disrupted in the last %s)' % (HELD, disrupted, targeted, window)


def raise_hint(limits, held):
    if not held:
        return None
    return ('%d node(s) held by the blast-radius limit; to act on more in one window, raise reclaim_max_nodes_pct (now %g)%s, '
            'or run again once the window (reclaim_window=%s) has passed or the disrupted nodes are back in service'
            % (held, limits.max_nodes_pct, '' if limits.max_nodes is None else ' or reclaim_max_nodes (now %d)' % limits.max_nodes,
               limits.window))


def fleet_plan(nodes, limits):
    """Which nodes act and which are held (see the module docstring).

    ``nodes``: one dict per targeted node: ``host``, ``ok`` (its plan ran), ``work`` (its plan has something to do),
    ``disruptive`` (the disruptive actions it plans, each with ``action`` and optionally ``severity`` and ``since``)
    and ``disruption`` (its node_disruption record).  Returns ``targeted``, ``limit``, ``disrupted`` (host: why, before
    this run), ``act`` (the hosts that act, worst first), ``held`` (host: reason), ``disrupted_after`` and ``hint``."""
    targeted = len(nodes)
    limit = limits.node_limit(targeted)
    before = {}
    for node in nodes:
        why = disrupted_because(node.get('disruption'), limits.window_s)
        if why:
            before[node['host']] = why
    wanting = [n for n in nodes if n.get('ok') and n.get('disruptive')]
    wanting.sort(key=lambda n: node_rank(n['disruptive']) + (n['host'],))
    count = len(before)
    act, held = [], {}
    for node in wanting:
        if node['host'] in before:
            act.append(node['host'])      # counted already: acting again disrupts no further node
        elif count < limit:
            act.append(node['host'])
            count += 1
        else:
            held[node['host']] = None
    for host in held:
        held[host] = held_reason(count, targeted, limits.window)
    act += sorted(n['host'] for n in nodes if n.get('ok') and n.get('work') and not n.get('disruptive'))
    return {'targeted': targeted, 'limit': limit, 'disrupted': before, 'act': act, 'held': held, 'disrupted_after': count,
            'window': limits.window, 'hint': raise_hint(limits, len(held)), 'limits': limits.to_dict()}


# ---------------------------------------------------------------------------- kills
def _mib(entry):
    value = entry.get('used_mib')
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def kill_families(entries):
    """``entries`` (gpu_kill's process records: ``pid``, ``used_mib``, ``parent_pid`` for a child collected with its
    parent) grouped as [head, child, ...] families in the kill order: the most GPU memory first, then the lowest pid."""
    pids = set(e.get('pid') for e in entries)
    heads = [e for e in entries if e.get('parent_pid') not in pids]
    children = {}
    for entry in entries:
        if entry.get('parent_pid') in pids:
            children.setdefault(entry['parent_pid'], []).append(entry)
    heads.sort(key=lambda e: (-_mib(e), e.get('pid') or 0))
    return [[head] + sorted(children.get(head.get('pid'), ()), key=lambda e: e.get('pid') or 0) for head in heads]


def take_families(families, budget):
    """(taken, held) entries: whole families in order while they fit in ``budget``; from the first that does not fit
    on, everything is held (so the order stays the worst first)."""
    taken, held, room = [], [], budget
    for family in families:
        if held or len(family) > room:
            held.extend(family)
        else:
            taken.extend(family)
            room -= len(family)
    return taken, held


def kill_held_reason(killed, planned, limits):
    return '%s (%d of %d processes in this run, reclaim_max_kills=%d)' % (HELD, killed, planned, limits.max_kills)


def kill_plan(nodes, limits):
    """How many processes each node may kill: ``nodes`` are dicts with ``host``, ``ok`` and ``kills`` (the entries its
    plan would kill).  Families across the fleet in the kill order (ties: by host), taken while reclaim_max_kills has
    room.  Returns ``planned``, ``allowed`` (host: count; only hosts with one or more), ``held`` (host: count),
    ``reason`` (for the held processes) and ``hint``."""
    families = []
    for node in nodes:
        if node.get('ok'):
            families.extend((node['host'], family) for family in kill_families(node.get('kills') or []))
    families.sort(key=lambda hf: (-_mib(hf[1][0]), hf[0], hf[1][0].get('pid') or 0))
    allowed, held, room, stopped = {}, {}, limits.max_kills, False
    for host, family in families:
        if stopped or len(family) > room:
            stopped = True
            held[host] = held.get(host, 0) + len(family)
        else:
            allowed[host] = allowed.get(host, 0) + len(family)
            room -= len(family)
    planned = sum(len(f) for _h, f in families)
    killed = planned - sum(held.values())
    hint = None
    if held:
        hint = ('%d process(es) held by the blast-radius limit; raise reclaim_max_kills (now %d) to kill more in one run, '
                'or run again' % (sum(held.values()), limits.max_kills))
    return {'planned': planned, 'allowed': allowed, 'held': held, 'reason': kill_held_reason(killed, planned, limits) if held else None,
            'hint': hint, 'limits': limits.to_dict()}
