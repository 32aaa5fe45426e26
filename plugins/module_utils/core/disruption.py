# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""What gpufleet did to this node lately (issue #30): the disruption history in the ladder's state file, and the
node's disruption as the fleet-level limit reads it.

A disruptive action is a GPU reset, a drain, a reboot flag or the stop of a node service.  Each one gpufleet takes
is appended to ``disruptions`` in the remediation ladder's state file (``/var/lib/gpufleet/remediation.json``), by
the ladder (gpu_remediate, the guard's ``remediation`` section) and by gpu_reset: ``{'action', 'gpu', 'time',
'by', 'detail'}``, kept for ``DISRUPTION_KEEP_S`` and at most ``MAX_ENTRIES``.  Writers serialise on a lock file next to the
state and merge what another writer appended meanwhile (``merged``), so a guard tick and a playbook's reset never
lose each other's records.

``node_disruption`` is the node's side of the fleet limit (core/blast.py decides on the controller): the ladder's
own drain, this boot's reboot flag, Slurm's view of the node when its drain reason is gpufleet's (``sinfo --json``,
only where a root-vouched slurmd runs), and the recent actions with their age measured by this node's clock, so
the controller's clock never matters.  Nothing here is user input: the state file and the flag are root's, read
without following links (safe_files), and Slurm's answer comes from root-vouched commands."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

from . import safe_files
from .processes import scheduler_daemon
from .constants import DISRUPTION_KEEP_S, DISRUPTIVE_ACTIONS, REBOOT_FLAG_PATH, REMEDIATION_STATE_PATH
from .text import printable
from .xid import read_boot_id

MAX_ENTRIES = 1000
SHOWN_ENTRIES = 50            # the newest ones a node reports
STATE_LIMIT = 4 * 1024 * 1024
FLAG_LIMIT = 256 * 1024
DETAIL_LEN = 200
GPUFLEET_REASON = 'gpufleet'  # every drain reason gpufleet sets begins so (the ladder's, the Slurm epilog's)


def read_json(path, limit):
    """The JSON object in root's file ``path`` (checked, no link followed), {} when missing; (data, problem)."""
    if not path:
        return {}, None
    try:
        data = json.loads(safe_files.read_file(path, limit).decode('utf-8'))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:
        return {}, 'cannot read %s: %s' % (path, getattr(exc, 'why', None) or getattr(exc, 'strerror', None) or exc)
    return (data, None) if isinstance(data, dict) else ({}, '%s does not hold a JSON object' % path)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def valid_entries(entries):
    """The well-formed history entries of ``entries`` (anything else in the file is dropped, never trusted)."""
    out = []
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and entry.get('action') in DISRUPTIVE_ACTIONS and _number(entry.get('time')):
            gpu = entry.get('gpu')
            out.append({'action': entry['action'], 'gpu': gpu if isinstance(gpu, str) else None, 'time': float(entry['time']),
                        'by': entry.get('by') if isinstance(entry.get('by'), str) else None,
                        'detail': printable(entry['detail'])[:DETAIL_LEN] if isinstance(entry.get('detail'), str) else None})
    return out


def entry(action, now, gpu=None, by=None, detail=None):
    """One history entry (see the module docstring)."""
    return valid_entries([{'action': action, 'gpu': gpu, 'time': now, 'by': by, 'detail': detail}])[0]


def prune(entries, now):
    """``entries`` newer than DISRUPTION_KEEP_S, oldest first, at most MAX_ENTRIES, each once."""
    seen, out = set(), []
    for item in sorted(valid_entries(entries), key=lambda e: (e['time'], e['action'], e['gpu'] or '')):
        key = (item['action'], item['gpu'], item['time'])
        if item['time'] > now - DISRUPTION_KEEP_S and key not in seen:
            seen.add(key)
            out.append(item)
    return out[-MAX_ENTRIES:]


def recent(entries, action, window_s, now, gpu=None):
    """The entries of ``action`` (of ``gpu`` when given) no older than ``window_s``."""
    return [e for e in valid_entries(entries) if e['action'] == action and e['time'] > now - window_s and
            (gpu is None or e['gpu'] == gpu)]


@contextlib.contextmanager
def locked(state_path):
    """An exclusive lock of the state's writers (``STATE.lock`` next to it); nothing when there is no state."""
    if not state_path:
        yield
        return
    fd = safe_files.open_lock(state_path + '.lock')
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def merged(state_path, entries, now):
    """``entries`` with what the state file on disk holds now (another writer's records), pruned.  Call it holding
    ``locked(state_path)``, right before writing the state."""
    on_disk, _problem = read_json(state_path, STATE_LIMIT)
    return prune(list(entries or ()) + valid_entries(on_disk.get('disruptions')), now)


def note(state_path, entries, now=None):
    """Append ``entries`` to the history in the state file (gpu_reset's resets); returns a problem text or None.
    The rest of the state is kept as it is on disk."""
    if not state_path or not entries:
        return None
    now = time.time() if now is None else now
    try:
        with locked(state_path):
            state, problem = read_json(state_path, STATE_LIMIT)
            if problem:
                return problem + ': the disruption was not recorded'
            state['disruptions'] = prune(valid_entries(state.get('disruptions')) + list(entries), now)
            safe_files.write_atomic(state_path, json.dumps(state, sort_keys=True) + '\n', mode=0o600)
    except OSError as exc:
        return 'cannot record the disruption in %s: %s' % (state_path, exc.strerror or exc)
    return None


# ---------------------------------------------------------------------------- the node as the fleet limit sees it
def load_reboot_flag(path, current_boot):
    """(the flag's data or None, stale: True when it was written before the last boot)."""
    flag, _problem = read_json(path, FLAG_LIMIT)
    if not flag:
        return None, False
    return flag, bool(current_boot) and flag.get('boot_id') != current_boot


def _flag(path):
    """This boot's reboot flag: {'time', 'gpus'} or None (a flag from an earlier boot is no disruption any more)."""
    flag, stale = load_reboot_flag(path, read_boot_id())
    if not flag or stale:
        return None
    gpus = flag.get('gpus') if isinstance(flag.get('gpus'), dict) else {}
    return {'time': flag.get('time') if isinstance(flag.get('time'), str) else None,
            'gpus': dict((printable(k), printable(v)[:DETAIL_LEN]) for k, v in sorted(gpus.items()) if isinstance(v, str))}


def _slurm_view(node_name, client):
    """Slurm's state of this node when it is drained for a gpufleet reason, else None; (view, problem)."""
    from . import slurm  # pylint: disable=import-outside-toplevel  # only where a root-vouched slurmd runs
    client = client or slurm.SlurmClient()
    name = node_name or slurm.node_name()
    try:
        nodes = client.nodes()
    except slurm.SlurmError as exc:
        return None, 'cannot read the node\'s scheduler state: %s' % exc
    mine = [n for n in nodes if n.name == name]
    if not mine or not mine[0].drained or not mine[0].reason.startswith(GPUFLEET_REASON):
        return None, None
    return {'node': name, 'state': 'drained', 'reason': mine[0].reason, 'since': mine[0].reason_time}, None


def node_disruption(state_path=REMEDIATION_STATE_PATH, reboot_flag=REBOOT_FLAG_PATH, now=None, scheduler='auto',
                    node_name=None, client=None):
    """What gpufleet did to this node lately, for the fleet-level limit (see the module docstring):
    ``{'drained', 'reboot_flag', 'scheduler', 'actions', 'errors'}``.  ``actions`` are the newest SHOWN_ENTRIES
    of the history, each with ``ago_s`` (this node's clock).  ``scheduler``: 'slurmd' where a root-vouched slurmd
    runs, else None; 'auto' reads it (processes.scheduler_daemon).  Slurm is asked only with slurmd; ``client`` (a
    slurm.SlurmClient) is a seam."""
    now = time.time() if now is None else now
    errors = []
    state, problem = read_json(state_path, STATE_LIMIT)
    if problem:
        errors.append(problem)
    drained = state.get('drained') if isinstance(state.get('drained'), dict) else None
    if drained is not None:
        drained = {'reason': printable(drained.get('reason') or '')[:DETAIL_LEN], 'via': drained.get('via'),
                   'ago_s': round(now - drained['time'], 1) if _number(drained.get('time')) else None}
    flag = _flag(reboot_flag) if reboot_flag else None
    view = None
    if scheduler == 'auto':
        scheduler = scheduler_daemon()
    if scheduler == 'slurmd':
        view, problem = _slurm_view(node_name, client)
        if problem:
            errors.append(problem)
    actions = [dict(e, ago_s=round(now - e['time'], 1)) for e in prune(state.get('disruptions'), now)][-SHOWN_ENTRIES:]
    return {'drained': drained, 'reboot_flag': flag, 'scheduler': view, 'actions': list(reversed(actions)),
            'errors': errors}
