# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The remediation ladder's node-local budget (issue #30): a flapping GPU, a forged or misread event, or a bad policy
costs a bounded number of disruptions on a node that has no fleet view (a guard tick).

* at most ``max_resets`` resets per GPU per ``window`` (defaults 2 per 24 h, as gpud's reboot threshold);
* at most one drain and one reboot flag per node per ``window``;
* where Slurm drains the node, no drain while more than ``max_drained_pct`` of a partition of the node is already
  drained for a gpufleet reason (``sinfo --json``, through core/slurm.py's client and its root-vouched commands).

The counts come from the disruption history in the ladder's state file (core/disruption.py): every reset, drain
and reboot flag gpufleet took on the node, whoever took it (the ladder, the guard's ladder, gpu_reset).  Past the
budget the step is not taken and does not escalate: the ladder reports ``budget_exhausted`` with the reason (and
the guard exports ``gpufleet_guard_remediation_budget_exhausted``); a human then decides.  The event that asked
for the step stays unhandled, so the step comes back once the window has room, and the metric holds meanwhile."""

from __future__ import annotations

from . import disruption
from .constants import DISRUPTION_KEEP_S
from .errors import InvalidArgument
from .units import human_duration, is_number, parse_duration

DEFAULT_MAX_RESETS = 2
DEFAULT_WINDOW_S = 86400.0
DEFAULT_MAX_DRAINED_PCT = 50.0
MAX_RESETS_LIMIT = 100
EXHAUSTED = 'budget_exhausted'
PARTITION_LIMIT = 'partition_limit'


class Budget(object):
    """What the ladder may do per window; validated here (InvalidArgument names the option)."""

    def __init__(self, max_resets=DEFAULT_MAX_RESETS, window=DEFAULT_WINDOW_S, max_drained_pct=DEFAULT_MAX_DRAINED_PCT,
                 fields=('max_resets', 'budget_window', 'max_drained_pct')):
        if isinstance(max_resets, float) and max_resets.is_integer():
            max_resets = int(max_resets)
        if isinstance(max_resets, bool) or not isinstance(max_resets, int) or not 0 <= max_resets <= MAX_RESETS_LIMIT:
            raise InvalidArgument(fields[0], max_resets, 'expected a whole number from 0 to %d' % MAX_RESETS_LIMIT)
        seconds = parse_duration(window, fields[1])
        if not 0 < seconds <= DISRUPTION_KEEP_S:
            raise InvalidArgument(fields[1], window, 'expected more than 0 and at most %s (the history a node keeps)'
                                  % human_duration(DISRUPTION_KEEP_S))
        if max_drained_pct is not None and (not is_number(max_drained_pct) or not 0 <= max_drained_pct <= 100):
            raise InvalidArgument(fields[2], max_drained_pct, 'expected a percentage from 0 to 100')
        self.max_resets = max_resets
        self.window = seconds
        self.max_drained_pct = None if max_drained_pct is None else float(max_drained_pct)
        self.fields = fields

    def to_dict(self):
        return {'max_resets': self.max_resets, 'window_s': self.window, 'max_drained_pct': self.max_drained_pct}

    def reset_refusal(self, entries, gpu_key, now):
        """Why the ladder may not reset GPU ``gpu_key`` now, or None."""
        count = len(disruption.recent(entries, 'reset', self.window, now, gpu=gpu_key))
        if count < self.max_resets:
            return None
        return ('%s: this GPU was reset %d time(s) in the last %s (%s %d); a human decides: reset it by hand '
                '(gpufleet.reclaim.reset_unhealthy) or raise %s (docs/health.md, "The ladder\'s budget")'
                % (EXHAUSTED, count, human_duration(self.window), self.fields[0], self.max_resets, self.fields[0]))

    def node_refusal(self, entries, action, now):
        """Why the ladder may not take the node-wide ``action`` (drain, reboot_flag) now: one per window, or None."""
        done = disruption.recent(entries, action, self.window, now)
        if not done:
            return None
        what = 'the node was drained' if action == 'drain' else 'a reboot flag was written'
        ago = human_duration(now - max(e['time'] for e in done))
        return ('%s: %s %s ago, and the ladder takes one per node per %s (%s); a human decides (docs/health.md, '
                '"The ladder\'s budget")' % (EXHAUSTED, what, ago, human_duration(self.window), self.fields[1]))

    def partition_refusal(self, node_name, client):
        """Why Slurm may not drain ``node_name`` now: more than max_drained_pct of one of its partitions is drained for a
        gpufleet reason already (the other nodes), or its share cannot be read (no drain then either); else None."""
        if self.max_drained_pct is None or self.max_drained_pct >= 100:
            return None
        from .slurm import SlurmError  # pylint: disable=import-outside-toplevel  # only with Slurm
        try:
            nodes = client.nodes()
        except SlurmError as exc:
            return PARTITION_LIMIT + ': the drained share of the node\'s partitions cannot be read (%s): not drained' % exc
        mine = [n for n in nodes if n.name == node_name]
        if not mine:
            return None
        for partition in sorted(mine[0].partitions):
            members = [n for n in nodes if partition in n.partitions]
            ours = [n for n in members if n.name != node_name and n.drained and n.reason.startswith(disruption.GPUFLEET_REASON)]
            share = 100.0 * len(ours) / len(members)
            if share > self.max_drained_pct:
                return (PARTITION_LIMIT + ': %d of %d nodes of partition %s are drained by gpufleet already (%.0f%%, more than '
                        'max_drained_pct %g): not drained; a human decides'
                        % (len(ours), len(members), partition, share, self.max_drained_pct))
        return None


# ---------------------------------------------------------------------------- what a ladder run disrupts
SEVERITY = {'ok': 0, 'degraded': 1, 'lost': 2}
_TAKEN = ('done', 'would_run', 'node_done', 'node_would_run', 'node_written', 'node_would_write')


def _evidence(gpu):
    times = [f['time'] for f in gpu.get('findings') or () if is_number(f.get('time'))]
    return {'severity': SEVERITY.get((gpu.get('health') or {}).get('status'), 0), 'since': min(times) if times else None}


def disruptive_actions(gpus):
    """The disruptive actions of a ladder run (taken, or in check mode predicted), from its ladders (``gpus``, as
    GpuLadder.to_dict gives them; a GPU's drain and reboot flag are the node's, carried on its ladder): each ``{'action', 'gpu', 'why',
    'severity', 'since'}``, for the fleet limit's order (core/blast.node_rank)."""
    out = []
    for gpu in gpus:
        for step in gpu.get('ladder') or ():
            if step.get('status') not in _TAKEN:
                continue
            action = {'reset': 'reset', 'drain': 'drain', 'reboot_flag': 'reboot_flag'}.get(step.get('step'))
            if action:
                out.append(dict(_evidence(gpu), action=action, gpu=gpu.get('index'), why=step.get('why')))
            services = ((step.get('result') or {}).get('services') or {}).get('requested') if action == 'reset' else None
            if services:
                out.append(dict(_evidence(gpu), action='stop_service', gpu=gpu.get('index'), why=', '.join(services)))
    return out


def reset_disruptions(result, now):
    """gpu_reset's side of the history and of the fleet limit: (the disruptive actions of its ``result``, taken or in
    check mode predicted; the history entries of the resets it ran and the services it stopped)."""
    planned, entries = [], []
    stopped = (result.get('services') or {}).get('stopped') or []
    for item in result.get('resets') or ():
        key = item.get('uuid') or item.get('pci_bus_id') or 'index:%s' % item.get('index')
        if item.get('status') in ('reset', 'would_reset'):
            planned.append({'action': 'reset', 'gpu': item.get('index'), 'why': '; '.join(item.get('selected_because') or ()),
                            'severity': 0, 'since': None})
        if item.get('status') in ('reset', 'failed'):   # a failed reset may have disturbed the GPU too: counted
            entries.append(disruption.entry('reset', now, gpu=key, by='gpu_reset', detail=item.get('status')))
    requested = (result.get('services') or {}).get('requested') or []
    if planned and requested:
        planned.append({'action': 'stop_service', 'gpu': None, 'why': ', '.join(requested), 'severity': 0, 'since': None})
    entries.extend(disruption.entry('stop_service', now, detail=str(unit), by='gpu_reset') for unit in stopped)
    return planned, entries
