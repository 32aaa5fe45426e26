# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Append-only JSON Lines audit log with a hash chain.

Every line is one JSON object.  Its ``prev_hash`` is the SHA-256 of the previous line's bytes
(without the newline) and its ``hash`` is the SHA-256 of the line's canonical JSON without the
``hash`` key (keys as text, sorted as text: what the verifier reads back from the line).  Editing,
deleting or reordering lines breaks the chain, and ``verify`` says where.
Writers serialise on an exclusive ``flock`` of the log file itself, so concurrent writers (two
module runs, or a module and the guard timer) never interleave or fork the chain.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import importlib
import json
import os
import re

from . import safe_files
from .errors import AuditLogError

GENESIS = '0' * 64


def _canonical(record):
    return json.dumps(record, sort_keys=True, separators=(',', ':'), ensure_ascii=True, default=str)


def _as_json(record):
    """``record`` as JSON gives it back: every key text (a pid 9 becomes "9"), every value plain.

    The hash is taken over this form, so the writer sorts the keys exactly as the verifier, which
    only ever sees text keys, does (pids 9 and 10 sort as "10", "9" on both sides)."""
    return json.loads(json.dumps(record, separators=(',', ':'), ensure_ascii=True, default=str))


_INTEGER_KEY = re.compile(r'-?(?:0|[1-9][0-9]*)\Z')


def _legacy_order(value):
    """True when every object in ``value`` lists its keys as the writers before the fix did: sorted
    as text, or (integer keys, e.g. pids) sorted as numbers."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            keys = list(item)
            if keys != sorted(keys) and not (all(_INTEGER_KEY.match(k) for k in keys) and keys == sorted(keys, key=int)):
                return False
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return True


def _hash_matches(entry, claimed):
    """Whether ``claimed`` is the hash of ``entry`` (without its hash key, keys in the order read).

    The canonical form sorts the keys as text.  Logs written before that fix hashed integer keys
    (the pids of one action) sorted as numbers: such a line is accepted when its hash matches its
    own key order and that order is one the old writer produced, so old logs still verify while
    any change of a key or a value still breaks the hash."""
    if claimed == _line_hash(_canonical(entry).encode('ascii')):
        return True
    if not _legacy_order(entry):
        return False
    return claimed == _line_hash(json.dumps(entry, separators=(',', ':'), ensure_ascii=True).encode('ascii'))


def _line_hash(raw):
    return hashlib.sha256(raw).hexdigest()


def _last_line(handle):
    """(the last line of an open binary file without its newline, or None if empty; True when the
    file does not end with a newline: its last line is torn)."""
    handle.seek(0, os.SEEK_END)
    end = handle.tell()
    if end == 0:
        return None, False
    block = 4096
    pos = end
    data = b''
    while pos > 0:
        step = min(block, pos)
        pos -= step
        handle.seek(pos)
        data = _read_exactly(handle, step) + data
        stripped = data.rstrip(b'\n')
        if b'\n' in stripped:
            return stripped.rsplit(b'\n', 1)[1], not data.endswith(b'\n')
    return data.rstrip(b'\n'), not data.endswith(b'\n')


def _read_exactly(handle, size):
    chunks = []
    while size > 0:
        chunk = handle.read(size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b''.join(chunks)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='milliseconds').replace('+00:00', 'Z')


def actor():
    """Who is acting: the login name of the effective user, and the Ansible/sudo user if any."""
    try:
        name = importlib.import_module('getpass').getuser()   # imported here: a ``list`` never loads it
    except Exception:  # pylint: disable=broad-except
        name = str(os.geteuid())
    return {'user': name, 'uid': os.geteuid(), 'sudo_user': os.environ.get('SUDO_USER'), 'host': os.uname().nodename}


def append(path, record):
    """Append ``record`` (a dict) to the chained log at ``path``; returns the written record.

    Creates the file (mode 0640) and its directory (0750) when missing.  Raises AuditLogError
    with the reason when the line cannot be written completely (disk full, quota, I/O error): the
    partial line is truncated away again, so the lines before it stay intact and chained.  A torn
    last line left by an earlier crash is ended with a newline first (verify reports it; the new
    line chains onto its bytes), so a new record is never glued onto it.
    """
    try:
        # no link followed anywhere in the path; the directories and the file checked on their descriptors
        fd = safe_files.open_append(path, mode=0o640, dir_mode=0o750)
    except OSError as exc:
        raise AuditLogError('cannot open audit log %s: %s' % (path, exc.strerror or exc))
    # Unbuffered: a failed write leaves nothing in a buffer that a later flush (or close) could
    # append behind the truncation.
    with os.fdopen(fd, 'r+b', buffering=0) as handle:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise AuditLogError('cannot lock audit log %s: %s' % (path, exc.strerror or exc))
        try:
            try:
                last, torn = _last_line(handle)
            except OSError as exc:
                raise AuditLogError('cannot read audit log %s: %s' % (path, exc.strerror or exc))
            entry = _as_json(record)
            entry.setdefault('ts', now_iso())
            entry['prev_hash'] = GENESIS if last is None else _line_hash(last)
            entry.pop('hash', None)
            entry['hash'] = _line_hash(_canonical(entry).encode('ascii'))
            line = (b'\n' if torn else b'') + _canonical(entry).encode('ascii') + b'\n'
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                safe_files.write_all(fd, line)
                os.fsync(fd)
            except OSError as exc:
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    pass
                reason = 'disk full' if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc))
                raise AuditLogError('cannot write audit log %s: %s' % (path, reason))
            return entry
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


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
            except (ValueError, RecursionError) as exc:
                errors.append({'line': count, 'error': 'not a JSON object: %s' % exc})
                prev = _line_hash(raw)
                continue
            if entry.get('prev_hash') != prev:
                errors.append({'line': count, 'error': 'chain broken: prev_hash does not match the line before'})
            claimed = entry.pop('hash', None)
            if not _hash_matches(entry, claimed):
                errors.append({'line': count, 'error': 'line content does not match its hash (edited)'})
            prev = _line_hash(raw)
    return {'valid': not errors, 'lines': count, 'errors': errors}
