# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""NVIDIA Xid errors: the classification table, the kernel-log reader and the health they imply.

``XID_TABLE`` is the one copy of the table that docs/health.md prints (a unit test checks that they
agree): per code, what it means, who is at fault (``application``, ``gpu``, ``driver``, ``system``) and
the remediation step (``none``, ``kill_app``, ``reset``, ``drain``, ``reboot``).  Source: NVIDIA's Xid
catalogue, "Analyzing Xid Errors with the Xid Catalog" (docs.nvidia.com/deploy/xid-errors/, the
Ampere-and-newer catalogue and its "Resolution Bucket (Immediate Action)" column).

The kernel log: the driver prints ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen
off the bus.`` (older drivers: no ``PCI:``, no pid, or ``pid='<unknown>'``).  ``read_kmsg()`` reads what
``/dev/kmsg`` holds now without blocking (one record per read; root, or CAP_SYSLOG, is needed) and turns
the Xid records into XidEvents; ``$_GPUFLEET_KMSG`` names another file in the same format (the
simulator's per-node fake kernel log: an internal test seam, never a user option).  Where ``/dev/kmsg``
cannot be opened (the guard's systemd unit keeps ``ProtectKernelLogs=yes`` and grants no CAP_SYSLOG; a
container without it), the kernel messages of this boot come from the journal instead: ``journalctl -k``
(an argument list, bounded in entries, bytes and time; ``read_journal``).
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import time

from .model import XidEvent
from .safe_files import find_program
from .text import printable

KMSG_PATH = '/dev/kmsg'
KMSG_ENV = '_GPUFLEET_KMSG'
# Events older than this (seconds) are listed but change no health, unless the caller passes ``since``.
DEFAULT_WINDOW_S = 3600.0
# Bounds of one read of the kernel log: records and bytes (the ring buffer holds far fewer).
MAX_RECORDS = 200000
MAX_BYTES = 64 * 1024 * 1024
MAX_MESSAGE = 512
# The journal fallback: the newest entries of this boot's kernel messages, and how long journalctl may take.
JOURNAL_ENTRIES = 20000
JOURNAL_TIMEOUT = 10.0
# The journal memo a guard tick keeps in its state (read_journal ``memo``): this boot's cursor and the newest
# Xid events already read, so a tick asks journalctl only for the kernel lines after the cursor.
MEMO_EVENTS = 512
MAX_CURSOR = 512
BOOT_ID_PATH = '/proc/sys/kernel/random/boot_id'
_CURSOR_RE = re.compile(r'^[0-9A-Za-z=;_\-]+$')
_BOOT_RE = re.compile(r'^[0-9a-f]{32}$')

FAULTS = ('application', 'gpu', 'driver', 'system', 'unknown')
ACTIONS = ('none', 'kill_app', 'reset', 'drain', 'reboot')

# code: (meaning, fault, action).  See docs/health.md for the catalogue's wording and the reasoning.
XID_TABLE = {
    8: ('GPU stopped processing: a channel idled out (the application hung the GPU)', 'application', 'kill_app'),
    13: ('Graphics engine exception: the application made an illegal access (out of range, bad instruction)',
         'application', 'kill_app'),
    31: ('GPU memory page fault: the application accessed memory it does not own', 'application', 'kill_app'),
    32: ('Invalid or corrupted push buffer stream: corruption on the PCIe bus or in system memory', 'system', 'reset'),
    38: ('Driver firmware error', 'driver', 'reset'),
    43: ('GPU stopped processing: the channel of a faulting application was reset', 'application', 'kill_app'),
    45: ('Preemptive cleanup after an earlier error or the application\'s end: informational', 'application', 'none'),
    48: ('Double-bit (uncorrectable) ECC error', 'gpu', 'reset'),
    61: ('Internal micro-controller breakpoint or warning', 'gpu', 'reset'),
    62: ('Internal micro-controller halt', 'gpu', 'reset'),
    63: ('Row remapping (or page retirement) recorded: reset the GPU to apply it', 'gpu', 'reset'),
    64: ('Row remapping (or page retirement) failed', 'gpu', 'drain'),
    68: ('Video decoder (NVDEC) exception', 'application', 'kill_app'),
    69: ('Graphics engine class error: the application used an illegal class or method', 'application', 'kill_app'),
    74: ('NVLink error', 'gpu', 'reset'),
    79: ('GPU has fallen off the bus: the GPU stopped answering on PCIe', 'gpu', 'reboot'),
    92: ('High single-bit ECC error rate (corrected): informational, watch it', 'gpu', 'none'),
    94: ('Contained ECC error: only the application that touched the memory is affected', 'gpu', 'kill_app'),
    95: ('Uncontained ECC error: every application on the GPU is affected', 'gpu', 'reset'),
    109: ('Context switch timeout', 'application', 'kill_app'),
    119: ('GSP RPC timeout: the GPU System Processor stopped answering the driver', 'gpu', 'reset'),
    120: ('GSP error', 'gpu', 'reset'),
    121: ('C2C link corrected error (Grace Hopper): informational', 'gpu', 'none'),
    123: ('SPI PMU RPC write failure', 'gpu', 'reset'),
    140: ('Unrecovered ECC error (the driver could not recover the memory)', 'gpu', 'reset'),
    143: ('GPU initialization failure', 'gpu', 'reset'),
    144: ('NVLink: SAW error', 'gpu', 'reset'),
    145: ('NVLink: RLW error', 'gpu', 'reset'),
    146: ('NVLink: TLW error', 'gpu', 'reset'),
    147: ('NVLink: TREX error', 'gpu', 'reset'),
    148: ('NVLink: NVLPW_CTRL error', 'gpu', 'reset'),
    149: ('NVLink: NETIR error', 'gpu', 'reset'),
    150: ('NVLink: MSE error', 'gpu', 'reset'),
    154: ('GPU recovery action changed: the driver\'s recovery action field says what to do', 'driver', 'none'),
}

_XID_RE = re.compile(r'NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})(?:\.[0-7])?\): (\d{1,5}),? ?(.*)')
_PID_RE = re.compile(r"\bpid=(?:(\d{1,10})|'?<unknown>'?)")
_NAME_RE = re.compile(r'\bname=([^,]*)')
_WHO_RE = re.compile(r"^\s*pid=[^,]*,\s*(?:name=[^,]*,\s*)?")


def classify(code):
    """(meaning, fault, action) of an Xid code; an unknown code: (None, 'unknown', 'none')."""
    return XID_TABLE.get(int(code), (None, 'unknown', 'none'))


def pci_key(text):
    """(domain, bus, device) numbers of a PCI address (``0000:3b:00``, ``00000000:3B:00.0``, ``3b:00.0``) or None."""
    parts = str(text or '').strip().split('.', 1)[0].split(':')
    if len(parts) == 2:
        parts.insert(0, '0')
    if len(parts) != 3:
        return None
    try:
        return tuple(int(part, 16) for part in parts)
    except ValueError:
        return None


def make_event(code, source, time_s=None, pid=None, name=None, pci_bus_id=None, message=None):
    """An XidEvent with its fault and action from the table."""
    _meaning, fault, action = classify(code)
    return XidEvent(time=time_s, code=int(code), pid=pid, name=name, pci_bus_id=pci_bus_id, message=message,
                    source=source, fault=fault, action=action)


def parse_line(text, time_s=None):
    """An XidEvent (source ``kmsg``) from one kernel-log message, or None when it is no Xid line."""
    match = _XID_RE.search(text)
    if match is None:
        return None
    rest = match.group(3)
    pid = name = None
    found = _PID_RE.search(rest)
    if found and found.group(1):
        pid = int(found.group(1))
    found = _NAME_RE.search(rest)
    if found and found.group(1).strip() and found.group(1).strip() not in ('<unknown>', "'<unknown>'"):
        name = printable(found.group(1).strip()[:64])
    return make_event(int(match.group(2)), 'kmsg', time_s=time_s, pid=pid, name=name, pci_bus_id=match.group(1).lower(),
                      message=printable(_WHO_RE.sub('', rest).strip()[:MAX_MESSAGE]) or None)


def parse_record(record, boot_epoch):
    """An XidEvent from one /dev/kmsg record (``PRIO,SEQ,USEC,FLAGS;MESSAGE``, continuation lines after it)."""
    header, sep, message = record.partition(';')
    if not sep:
        return parse_line(record)
    fields = header.split(',')
    time_s = stamp = None
    if len(fields) >= 3 and fields[2].isdigit():
        stamp = int(fields[2])
        if boot_epoch is not None:
            time_s = round(boot_epoch + stamp / 1e6, 3)
    return with_stamp(parse_line(message.split('\n', 1)[0], time_s), stamp)


def with_stamp(event, stamp):
    """``event`` (or None) with ``stamp``: the kernel's own time of the record, microseconds of CLOCK_MONOTONIC
    (the /dev/kmsg USEC field, the journal's _SOURCE_MONOTONIC_TIMESTAMP of a kernel message).  Unlike ``time``,
    which converts it to epoch seconds through this read's clocks (and so moves by a few ms between reads
    under load, or by a clock step), it is the same on every read of this boot: what identifies the event."""
    if event is not None:
        event.stamp = stamp
    return event


def read_kmsg(path=None, now=None, monotonic=None, memo=None):
    """(events, error): the Xid events in the kernel log now, read without blocking; error is None, or why
    the log could not be read (then events is None: nobody can tell).  ``memo``: read_journal's, for the
    journal fallback."""
    path = path or os.environ.get(KMSG_ENV) or KMSG_PATH
    wall = time.time() if now is None else now
    mono = time.monotonic() if monotonic is None else monotonic
    boot_epoch = wall - mono   # /dev/kmsg stamps records in microseconds of CLOCK_MONOTONIC
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        error = 'cannot read the kernel log %s: %s' % (path, exc.strerror or exc)
        if path != KMSG_PATH:
            return None, error
        events, why = read_journal(memo=memo)
        return (events, None) if events is not None else (None, '%s; %s' % (error, why))
    events = []
    pending = b''
    total = 0
    try:
        import stat  # pylint: disable=import-outside-toplevel
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        for _record in range(MAX_RECORDS):
            try:
                chunk = os.read(fd, 65536 if regular else 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:   # records overwritten while reading: go on with the next one
                    continue
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break                       # nothing more now: never wait for new records
                if exc.errno == errno.EINTR:
                    continue
                return None, 'cannot read the kernel log %s: %s' % (path, exc.strerror or exc)
            if not chunk:
                break
            total += len(chunk)
            if regular:
                pending += chunk
                lines = pending.split(b'\n')
                pending = lines.pop()
            else:
                lines = [chunk]                 # /dev/kmsg: one record per read
            for line in lines:
                if b'Xid' in line:
                    event = parse_record(line.decode('utf-8', 'replace'), boot_epoch)
                    if event is not None:
                        events.append(event)
            if total > MAX_BYTES:
                break
        if pending and b'Xid' in pending:
            event = parse_record(pending.decode('utf-8', 'replace'), boot_epoch)
            if event is not None:
                events.append(event)
    finally:
        os.close(fd)
    return events, None


def read_journal(journalctl=None, timeout=JOURNAL_TIMEOUT, memo=None, boot_id=None):
    """(events, error): the Xid events among this boot's kernel messages in the journal (``journalctl -k -b -o json``,
    its newest JOURNAL_ENTRIES entries, at most MAX_BYTES of output, within ``timeout`` seconds).

    ``memo``: a dict kept between calls (the guard's state, checked by ``valid_memo``), changed in place: this boot's
    journal cursor and the newest MEMO_EVENTS Xid events read.  With a cursor of this boot, only the entries after it
    are read (``--after-cursor``) and the events are the memo's plus the new ones; the full read instead when there
    is no memo (first tick), the cursor is another boot's, journalctl rejects it (rotated journal), or JOURNAL_ENTRIES
    new entries came (more may wait: the newest ones are read, as without a memo)."""
    journalctl = journalctl or find_program('journalctl')
    if not journalctl:
        return None, 'no journalctl to read the kernel messages from the journal'
    boot = current_boot_id() if boot_id is None else boot_id
    if memo is not None and memo.get('cursor') and boot and memo.get('boot') == boot:
        entries, error = _journal_entries(journalctl, timeout, ['--after-cursor', memo['cursor']])
        if entries is not None and len(entries) < JOURNAL_ENTRIES:
            events = [event_from_dict(item) for item in memo.get('events') or ()] + _journal_events(entries)
            _remember(memo, boot, entries, events)
            return events, None
    entries, error = _journal_entries(journalctl, timeout, [])
    if entries is None:
        if memo is not None:
            memo.clear()
        return None, error
    events = _journal_events(entries)
    if memo is not None:
        memo.clear()
        _remember(memo, boot, entries, events)
    return events, None


def _journal_entries(journalctl, timeout, extra):
    """(the JSON entries journalctl printed, error)."""
    argv = [journalctl, '-k', '-b', '-o', 'json', '-n', str(JOURNAL_ENTRIES)] + extra + ['--no-pager', '-q']
    subprocess = importlib.import_module('subprocess')   # on first use: a snapshot without the journal never loads it
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                close_fds=True)
    except OSError as exc:
        return None, 'cannot run %s: %s' % (journalctl, exc.strerror or exc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()   # our own child, by its Popen handle
        proc.communicate()
        return None, '%s -k did not finish within %gs' % (journalctl, timeout)
    if proc.returncode != 0:
        return None, '%s -k failed (rc %d): %s' % (journalctl, proc.returncode,
                                                   printable(err.decode('utf-8', 'replace').strip()[-300:]))
    entries = []
    for line in out[:MAX_BYTES].splitlines():
        try:
            entry = json.loads(line.decode('utf-8', 'replace'))
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries, None


def _journal_events(entries):
    events = []
    for entry in entries:
        message = entry.get('MESSAGE')
        if isinstance(message, list):   # journald's form of a message that is not valid UTF-8
            message = bytes(b & 0xff for b in message if isinstance(b, int)).decode('utf-8', 'replace')
        stamp = entry.get('__REALTIME_TIMESTAMP')
        time_s = round(int(stamp) / 1e6, 3) if isinstance(stamp, str) and stamp.isdigit() else None
        event = parse_line(message, time_s) if isinstance(message, str) and 'Xid' in message else None
        if event is not None:
            source = entry.get('_SOURCE_MONOTONIC_TIMESTAMP')
            events.append(with_stamp(event, int(source) if isinstance(source, str) and source.isdigit() else None))
    return events


def _remember(memo, boot, entries, events):
    """Keep the last entry's cursor (or the one the memo had, when nothing new came) and the newest events."""
    for entry in reversed(entries):
        cursor = entry.get('__CURSOR')
        if isinstance(cursor, str) and len(cursor) <= MAX_CURSOR and _CURSOR_RE.match(cursor):
            memo['cursor'] = cursor
            break
    memo['boot'] = boot
    memo['events'] = [event_dict(event) for event in events[-MEMO_EVENTS:]]


def read_boot_id(path=BOOT_ID_PATH):
    """This boot's id as the kernel gives it (a UUID with dashes), or None when unreadable: the one reader."""
    try:
        with open(path, 'rb') as handle:
            return handle.read(64).decode('ascii', 'replace').strip() or None
    except OSError:
        return None


def current_boot_id(path=BOOT_ID_PATH):
    """This boot's id as journald writes it (32 hex digits, no dashes), or None when unreadable."""
    text = (read_boot_id(path) or '').replace('-', '').lower()
    return text if _BOOT_RE.match(text) else None


def event_dict(event):
    """What the memo keeps of an event (the classification is the table's, derived again when it is read)."""
    return {'time': event.time, 'code': event.code, 'pid': event.pid, 'name': event.name, 'pci_bus_id': event.pci_bus_id,
            'message': event.message, 'stamp': getattr(event, 'stamp', None)}


def event_from_dict(item):
    event = make_event(item['code'], 'kmsg', time_s=item['time'], pid=item['pid'], name=item['name'],
                       pci_bus_id=item['pci_bus_id'], message=item['message'])
    return with_stamp(event, item.get('stamp'))


def _valid_event(item):
    def text(value, limit):
        return value is None or (isinstance(value, str) and len(value) <= limit and printable(value) == value)

    def integer(value, low, high):
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    return (isinstance(item, dict) and set(item) - {'stamp'} == {'time', 'code', 'pid', 'name', 'pci_bus_id', 'message'}
            and (item.get('stamp') is None or integer(item['stamp'], 0, 1 << 62))
            and integer(item['code'], 0, 1 << 20) and (item['pid'] is None or integer(item['pid'], 1, 1 << 32))
            and (item['time'] is None or (isinstance(item['time'], (int, float)) and not isinstance(item['time'], bool)
                                          and 0 <= item['time'] < 1e11))
            and text(item['name'], 64) and text(item['message'], MAX_MESSAGE) and text(item['pci_bus_id'], 64)
            and item['pci_bus_id'] is not None)


def valid_memo(data):
    """The journal memo of a loaded state: ``data`` when it is one read_journal wrote (bounded, every field of the
    expected type), else {} (the next read is the full one; nothing else of the state is lost)."""
    if not isinstance(data, dict) or set(data) - {'cursor', 'boot', 'events'}:
        return {}
    cursor, boot, events = data.get('cursor'), data.get('boot'), data.get('events', [])
    if cursor is not None and not (isinstance(cursor, str) and len(cursor) <= MAX_CURSOR and _CURSOR_RE.match(cursor)):
        return {}
    if boot is not None and not (isinstance(boot, str) and _BOOT_RE.match(boot)):
        return {}
    if not isinstance(events, list) or len(events) > MEMO_EVENTS or not all(_valid_event(item) for item in events):
        return {}
    return data


def join_events(devices, events):
    """Give each event (from the kernel log) to the device of ``devices`` with its PCI address (the caller
    passes the GPUs whose backend says ``xid_log``: NVIDIA's); returns the events that named no device here."""
    by_pci = {}
    for dev in devices:
        if dev.pci_bus_id:
            by_pci[pci_key(dev.pci_bus_id)] = dev
    unmatched = []
    for event in events:
        dev = by_pci.get(pci_key(event.pci_bus_id))
        if dev is None:
            unmatched.append(event)
        else:
            dev.add_xid_event(event)
    return unmatched


def apply_health(dev, now=None, since=None):
    """Derive ``dev.health`` from its Xid events newer than ``since`` (default: the last DEFAULT_WINDOW_S):
    a ``reboot`` Xid loses the GPU (recommended action reboot), ``reset``/``drain`` ones degrade it with that
    action, the others are noted (``xid_<code>`` in ``health_reasons``) without degrading it."""
    if not dev.xid_events:
        return
    now = time.time() if now is None else now
    since = now - DEFAULT_WINDOW_S if since is None else since
    for event in dev.xid_events:
        if event.time is not None and event.time < since:
            continue
        meaning = classify(event.code)[0] or 'an Xid the table does not know'
        who = ' (pid %d%s)' % (event.pid, ', %s' % event.name if event.name else '') if event.pid is not None else ''
        reason = 'Xid %d%s: %s' % (event.code, who, meaning)
        code = 'xid_%d' % event.code
        if event.action == 'reboot':
            dev.health.lose('%s; only a reboot of the node brings the GPU back' % reason, action='reboot', code=code)
        elif event.action in ('reset', 'drain'):
            dev.health.degrade('%s; %s the GPU' % (reason, event.action), action=event.action, code=code)
        elif event.action == 'kill_app':
            dev.health.note('%s; end the application' % reason, code)
        else:
            dev.health.note(reason, code)
