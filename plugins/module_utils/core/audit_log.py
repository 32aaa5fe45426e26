# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Append-only JSON Lines audit log with a hash chain.

Every line is one JSON object.  Its ``prev_hash`` is the SHA-256 of the previous line's bytes
(without the newline) and its ``hash`` is the SHA-256 of the line's canonical JSON without the
``hash`` key.  Editing, deleting or reordering lines breaks the chain, and ``verify`` says where.
Writers serialise on an exclusive ``flock`` of the log file itself, so concurrent writers (two
module runs, or a module and the guard timer) never interleave or fork the chain.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import getpass
import hashlib
import json
import os
import socket

GENESIS = '0' * 64


class AuditLogError(Exception):
    """The audit log could not be written (permissions, disk full, a path that is not a file)."""


def _canonical(record):
    return json.dumps(record, sort_keys=True, separators=(',', ':'), ensure_ascii=True, default=str)


def _line_hash(raw):
    return hashlib.sha256(raw).hexdigest()


def _last_line(handle):
    """The last complete line of an open binary file (without its newline), or None if empty."""
    handle.seek(0, os.SEEK_END)
    end = handle.tell()
    if end == 0:
        return None
    block = 4096
    pos = end
    data = b''
    while pos > 0:
        step = min(block, pos)
        pos -= step
        handle.seek(pos)
        data = handle.read(step) + data
        stripped = data.rstrip(b'\n')
        if b'\n' in stripped:
            return stripped.rsplit(b'\n', 1)[1]
    return data.rstrip(b'\n')


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='milliseconds').replace('+00:00', 'Z')


def actor():
    """Who is acting: the login name of the effective user, and the Ansible/sudo user if any."""
    try:
        name = getpass.getuser()
    except Exception:  # pylint: disable=broad-except
        name = str(os.geteuid())
    return {'user': name, 'uid': os.geteuid(), 'sudo_user': os.environ.get('SUDO_USER'), 'host': socket.gethostname()}


def append(path, record):
    """Append ``record`` (a dict) to the chained log at ``path``; returns the written record.

    Creates the file (mode 0640) and its directory (0750) when missing.  Raises AuditLogError
    with the reason when the line cannot be written completely; a partial line is truncated
    away again so that the chain stays intact.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, 'O_CLOEXEC', 0) | getattr(os, 'O_NOFOLLOW', 0), 0o640)
    except OSError as exc:
        raise AuditLogError('cannot open audit log %s: %s' % (path, exc.strerror or exc))
    with os.fdopen(fd, 'r+b') as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            last = _last_line(handle)
            entry = dict(record)
            entry.setdefault('ts', now_iso())
            entry['prev_hash'] = GENESIS if last is None else _line_hash(last)
            entry.pop('hash', None)
            entry['hash'] = _line_hash(_canonical(entry).encode('ascii'))
            line = _canonical(entry).encode('ascii')
            handle.seek(0, os.SEEK_END)
            start = handle.tell()
            try:
                handle.write(line + b'\n')
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as exc:
                try:
                    handle.truncate(start)
                except OSError:
                    pass
                reason = 'disk full' if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
                raise AuditLogError('cannot write audit log %s: %s' % (path, reason))
            return entry
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def verify(path):
    """Check the chain.  Returns a dict: ``valid``, ``lines``, and ``errors`` (line number and why)."""
    errors = []
    count = 0
    prev = GENESIS
    try:
        handle = open(path, 'rb')
    except OSError as exc:
        return {'valid': False, 'lines': 0, 'errors': [{'line': 0, 'error': 'cannot read %s: %s' % (path, exc.strerror or exc)}]}
    with handle:
        for count, raw in enumerate(handle, 1):
            if not raw.endswith(b'\n'):
                errors.append({'line': count, 'error': 'incomplete last line (torn write)'})
            raw = raw.rstrip(b'\n')
            try:
                entry = json.loads(raw.decode('utf-8'))
                if not isinstance(entry, dict):
                    raise ValueError('not an object')
            except ValueError as exc:
                errors.append({'line': count, 'error': 'not a JSON object: %s' % exc})
                prev = _line_hash(raw)
                continue
            if entry.get('prev_hash') != prev:
                errors.append({'line': count, 'error': 'chain broken: prev_hash does not match the line before'})
            claimed = entry.pop('hash', None)
            if claimed != _line_hash(_canonical(entry).encode('ascii')):
                errors.append({'line': count, 'error': 'line content does not match its hash (edited)'})
            prev = _line_hash(raw)
    return {'valid': not errors, 'lines': count, 'errors': errors}
