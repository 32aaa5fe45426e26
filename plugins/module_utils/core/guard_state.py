# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The guard tick's lock and its state file (``state.json``: escalations, counters, the kernel journal's cursor
and the Xid events already read (``xid_journal``, xid.read_journal); the idle clocks
are derived from the usage history at every tick and not kept here).
Importable from guard as before.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os

from . import safe_files, xid
from .units import is_number

STATE_VERSION = 1


class TickLock(object):
    """An exclusive, non-blocking flock; ``acquired`` is False when another tick holds it.

    The lock file is opened without following a link (O_NOFOLLOW, every directory above it
    checked) and checked on its descriptor; an unsafe one raises safe_files.UnsafeFile."""

    def __init__(self, path):
        self.path = path
        self.fd = None
        self.acquired = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False

    def acquire(self):
        self.fd = safe_files.open_lock(self.path, dir_mode=0o755)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.acquired = True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(self.fd)
                self.fd = None
                raise
        return self

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


def new_state(now):
    return {'version': STATE_VERSION, 'created': now, 'violations': {},
            'counters': {'ticks': 0, 'state_rebuilt': 0, 'warnings': {}, 'kills': {}, 'actions': {}, 'failures': {},
                         'notify_failures': {}}}


def _valid_state(data):
    if not isinstance(data, dict) or data.get('version') != STATE_VERSION:
        return 'not a version %d state' % STATE_VERSION
    for key in ('violations', 'counters'):
        if not isinstance(data.get(key), dict):
            return '"%s" is missing or not an object' % key
    for key, entry in data['violations'].items():
        if not isinstance(entry, dict) or not is_number(entry.get('first_seen')) \
                or not isinstance(entry.get('warnings'), int) or isinstance(entry.get('warnings'), bool):
            return 'violation entry %r is malformed' % key
        if any(entry.get(name) is not None and not is_number(entry.get(name)) for name in ('acted_at', 'gone_since')):
            return 'violation entry %r is malformed' % key
    return None


def load_state(path, now):
    """(state, warning or None).  A missing, unreadable or corrupt file gives a fresh state and a
    warning; so does a state whose clock lies in the future (the system clock went back)."""
    try:
        raw = safe_files.read_file(path, 64 * 1024 * 1024)
    except FileNotFoundError:
        return new_state(now), None
    except OSError as exc:
        state = new_state(now)
        state['counters']['state_rebuilt'] = 1
        return state, 'state file %s could not be read (%s); rebuilt: escalations restart from their first warning' % (
            path, exc.strerror or exc)
    try:
        data = json.loads(raw.decode('utf-8'))
        why = _valid_state(data)
    except (ValueError, UnicodeDecodeError) as exc:
        data, why = None, 'not JSON: %s' % exc
    if why is None and is_number(data.get('last_tick')) and data['last_tick'] > now + 300:
        why = 'its last tick (%s) lies in the future; the clock went back' % data['last_tick']
    if why is not None:
        state = new_state(now)
        counters = data.get('counters') if isinstance(data, dict) else None
        rebuilt = counters.get('state_rebuilt') if isinstance(counters, dict) else None
        state['counters']['state_rebuilt'] = (rebuilt if isinstance(rebuilt, int) and not isinstance(rebuilt, bool) else 0) + 1
        return state, 'state file %s is corrupt (%s); rebuilt: escalations restart from their first warning' % (path, why)
    for key in ('idle', 'idle_sampled_at'):  # the idle clocks an earlier release kept here
        data.pop(key, None)
    if 'xid_journal' in data:   # the kernel journal's cursor and the Xid events read (xid.read_journal): {} when malformed
        data['xid_journal'] = xid.valid_memo(data['xid_journal'])
    data.setdefault('counters', {})
    for key in ('warnings', 'kills', 'actions', 'failures', 'notify_failures', 'user_actions'):
        if not isinstance(data['counters'].get(key), dict):
            data['counters'][key] = {}
    return data, None


def save_state(path, state):
    """Write the state atomically (temp file, fsync, rename), mode 0600.

    Temporary files that a tick killed halfway through its write left behind are removed first
    (only a tick writes the state, and ticks hold the lock, so no other writer owns one).  The idle
    clocks (``idle``, derived from the usage history at every tick) are not saved."""
    state = dict((key, value) for key, value in state.items() if key != 'idle')
    text = json.dumps(state, sort_keys=True, separators=(',', ':'), default=str)
    safe_files.write_atomic(path, text, mode=0o600, dir_mode=0o750, remove_stale=True)
