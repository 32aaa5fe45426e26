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
off the bus.`` (krcReportXid in NVIDIA's open kernel modules: ``NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[
GPU-CI:%02u]]): %d, pid=%s, name=%s, %s``; older drivers: no ``name=``, or no ``pid=``).  A record is an Xid
only when the kernel wrote it (a /dev/kmsg record of facility 0, a journal entry of ``_TRANSPORT=kernel``
without another facility) and its message BEGINS with that prefix in exactly that format; the pid and name
are read at their places right after the code, never searched for.  Users can make the kernel print text
of theirs (a process name at the start of some messages, file, cgroup and device names inside them) and
can write to /dev/kmsg where it is writable (always another facility): docs/health.md, "What users can
make the kernel print", says why none of it passes.  ``read_kmsg()`` reads what ``/dev/kmsg`` holds now
without blocking (one record per read; root, or CAP_SYSLOG, is needed) and keeps, per GPU, what a device
keeps (model.keep_xid_event: a flood of mild events never pushes out a severe one, and memory stays
bounded); ``$_GPUFLEET_KMSG`` names another file in the same format (the simulator's per-node fake kernel
log: an internal test seam, never a user option).  Where ``/dev/kmsg`` cannot be opened (the guard's
systemd unit keeps ``ProtectKernelLogs=yes`` and grants no CAP_SYSLOG; a container without it), the kernel
messages of this boot come from the journal instead: ``journalctl -k`` (an argument list, bounded in
entries, bytes and time; ``read_journal``).
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import time

from .model import MAX_XID_CODES, MAX_XID_EVENTS, XidEvent, keep_xid_event
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
# GPUs (PCI addresses) one read keeps the events of, MAX_XID_EVENTS each: a node has fewer.
MAX_XID_BUSES = 64
# The journal memo a guard tick keeps in its state (read_journal ``memo``): this boot's cursor, the Xid events
# already read as the devices keep them, and their counts, so a tick asks journalctl only for the kernel lines
# after the cursor.
MEMO_EVENTS = MAX_XID_BUSES * MAX_XID_EVENTS
# The /dev/kmsg record's first field is facility * 8 + level; the kernel's own messages have facility 0
# (LOG_KERN), and a write to /dev/kmsg never does (the kernel makes it LOG_USER unless it names another one).
KERNEL_FACILITY = 0
MAX_CURSOR = 512
BOOT_ID_PATH = '/proc/sys/kernel/random/boot_id'
_CURSOR_RE = re.compile(r'^[0-9A-Za-z=;_\-]+$')
_BOOT_RE = re.compile(r'^[0-9a-f]{32}$')
_CODE_RE = re.compile(r'^[0-9]{1,7}$')

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

# The driver's prefix, anchored at the start of the message (parse_line uses match, never search): the PCI
# address as %04x:%02x:%02x, an optional MIG attribution, ``): ``, the code as %d and ``, ``.
_XID_RE = re.compile(r'NVRM: Xid \(PCI:([0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2})(?: GPU-I:[0-9]{2,5}(?: GPU-CI:[0-9]{2,5})?)?\): '
                     r'([1-9][0-9]{0,4}), ')
# Right after the code: ``pid=%s, `` (digits or '<unknown>'), then ``name=%s, `` (the client's process name).
_WHO_RE = re.compile(r"pid=(?:([0-9]{1,10})|'<unknown>'), (?:name=(.{1,64}?), )?", re.S)
# A /dev/kmsg record's header: PRIO,SEQ,USEC,FLAGS[,more] (decimal numbers: the kernel's own format)
_HEADER_RE = re.compile(r'([0-9]{1,10}),([0-9]{1,20}),([0-9]{1,20}),[^;\n]*\Z')
_KMSG_ESCAPE_RE = re.compile(rb'\\x([0-9a-f]{2})')


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
    """An XidEvent (source ``kmsg``) from one kernel message, or None when the message does not BEGIN with the
    driver's prefix in its exact format (``NVRM: Xid (PCI:%04x:%02x:%02x): %d, ``).  The pid and name are read
    at their places right after the code (``pid=<digits>, name=<comm>, ``); a name is at most 64 characters
    and ends at the first ``, `` (a process whose name holds ``, `` is named wrongly: nothing it can use).
    Where the text came from (the kernel, not a user) is for the caller to know: parse_record, _journal_events."""
    match = _XID_RE.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    rest = text[match.end():]
    pid = name = None
    who = _WHO_RE.match(rest)
    if who is not None:
        pid = int(who.group(1)) if who.group(1) and int(who.group(1)) > 0 else None
        if who.group(2) and who.group(2) != '<unknown>':
            name = printable(who.group(2))
        rest = rest[who.end():]
    return make_event(int(match.group(2)), 'kmsg', time_s=time_s, pid=pid, name=name, pci_bus_id=match.group(1),
                      message=printable(rest.strip()[:MAX_MESSAGE]) or None)


def unescape_kmsg(text):
    """A /dev/kmsg message as the kernel logged it: /dev/kmsg writes each byte below 0x20, from 0x7f, and the
    backslash as ``\\xNN`` (so a user's own ``\\x4e`` arrives as ``\\x5cx4e`` and stays that text)."""
    if '\\x' not in text:
        return text
    data = _KMSG_ESCAPE_RE.sub(lambda found: bytes((int(found.group(1), 16),)), text.encode('utf-8', 'surrogateescape'))
    return data.decode('utf-8', 'replace')


def parse_record(record, boot_epoch):
    """An XidEvent from one /dev/kmsg record (``PRIO,SEQ,USEC,FLAGS;MESSAGE``, dictionary lines after it), or None.

    Only a record the kernel wrote counts: a well-formed header whose PRIO (facility * 8 + level) has facility 0.
    Whatever is written to /dev/kmsg (by anyone, root included) has facility LOG_USER or another one it names."""
    header, sep, message = record.partition(';')
    fields = _HEADER_RE.match(header) if sep else None
    if fields is None or int(fields.group(1)) >> 3 != KERNEL_FACILITY:
        return None
    stamp = int(fields.group(3))
    time_s = round(boot_epoch + stamp / 1e6, 3) if boot_epoch is not None else None
    return with_stamp(parse_line(unescape_kmsg(message.split('\n', 1)[0]), time_s), stamp)


def with_stamp(event, stamp):
    """``event`` (or None) with ``stamp``: the kernel's own time of the record, microseconds of CLOCK_MONOTONIC
    (the /dev/kmsg USEC field, the journal's _SOURCE_MONOTONIC_TIMESTAMP of a kernel message).  Unlike ``time``,
    which converts it to epoch seconds through this read's clocks (and so moves by a few ms between reads
    under load, or by a clock step), it is the same on every read of this boot: what identifies the event."""
    if event is not None:
        event.stamp = stamp
    return event


class XidEvents(list):
    """The Xid events one read of the kernel log kept, oldest first (a list of XidEvents), and ``counts``:
    {PCI address as the records give it: {code: n}}, every event read, kept or not."""

    counts = None


class XidFold(object):
    """Folds the events of one read per GPU (PCI address) as a device keeps them (model.keep_xid_event), as they
    are read: memory is bounded whatever the log holds (MAX_XID_BUSES addresses, MAX_XID_EVENTS events each)."""

    def __init__(self):
        self.buses = {}   # pci_key -> [PCI address text, kept events, {code: n}]

    def _slot(self, pci):
        key = pci_key(pci)
        slot = self.buses.get(key)
        if slot is None and key is not None and len(self.buses) < MAX_XID_BUSES:
            slot = self.buses[key] = [pci, [], {}]
        return slot

    def add(self, event, counted=True):
        """Keep ``event`` (an XidEvent, or None: nothing) with the others of its GPU."""
        slot = self._slot(event.pci_bus_id) if event is not None else None
        if slot is not None:
            keep_xid_event(slot[1], slot[2] if counted else None, event)

    def count(self, pci, counts):
        """Add ``counts`` ({code: n}) to the counts of the GPU ``pci``."""
        slot = self._slot(pci)
        for code, number in counts.items() if slot is not None else ():
            if code in slot[2] or len(slot[2]) < MAX_XID_CODES:
                slot[2][code] = slot[2].get(code, 0) + number

    def events(self):
        out = XidEvents(sorted((event for _pci, kept, _counts in self.buses.values() for event in kept),
                               key=lambda event: (event.time is None, event.time or 0)))
        out.counts = dict((pci, dict(counts)) for pci, _kept, counts in self.buses.values())
        return out


def read_kmsg(path=None, now=None, monotonic=None, memo=None):
    """(events, error): the Xid events in the kernel log now (XidEvents: as the devices keep them, with the counts),
    read without blocking; error is None, or why the log could not be read (then events is None: nobody can tell).
    ``memo``: read_journal's, for the journal fallback."""
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
    fold = XidFold()
    try:
        error = _read_records(fd, path, lambda line: fold.add(parse_record(line.decode('utf-8', 'replace'), boot_epoch)))
    finally:
        os.close(fd)
    return (None, error) if error else (fold.events(), None)


def _read_records(fd, path, take):
    """Pass each record of the kernel log ``fd`` that mentions an Xid to ``take`` (at most MAX_RECORDS reads and
    MAX_BYTES); returns None, or why the log could not be read."""
    import stat  # pylint: disable=import-outside-toplevel
    regular = stat.S_ISREG(os.fstat(fd).st_mode)
    pending = b''
    total = 0
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
            return 'cannot read the kernel log %s: %s' % (path, exc.strerror or exc)
        if not chunk:
            break
        total += len(chunk)
        if regular:
            lines = (pending + chunk).split(b'\n')
            pending = lines.pop()
        else:
            lines = [chunk]                 # /dev/kmsg: one record per read
        for line in lines:
            if b'Xid' in line:
                take(line)
        if total > MAX_BYTES:
            break
    if pending and b'Xid' in pending:
        take(pending)
    return None


def read_journal(journalctl=None, timeout=JOURNAL_TIMEOUT, memo=None, boot_id=None):
    """(events, error): the Xid events among this boot's kernel messages in the journal (``journalctl -k -b -o json``,
    its newest JOURNAL_ENTRIES entries, at most MAX_BYTES of output, within ``timeout`` seconds), as XidEvents.

    ``memo``: a dict kept between calls (the guard's state, checked by ``valid_memo``), changed in place: this boot's
    journal cursor, the Xid events read as the devices keep them, and their counts.  With a cursor of this boot, only
    the entries after it are read (``--after-cursor``) and folded into the memo's events (the same events and counts
    a full read gives); the full read instead when there is no memo (first tick), the cursor is another boot's,
    journalctl rejects it (rotated journal), or JOURNAL_ENTRIES new entries came (more may wait: the newest ones are
    read, as without a memo)."""
    journalctl = journalctl or find_program('journalctl')
    if not journalctl:
        return None, 'no journalctl to read the kernel messages from the journal'
    boot = current_boot_id() if boot_id is None else boot_id
    if memo is not None and memo.get('cursor') and boot and memo.get('boot') == boot:
        entries, error = _journal_entries(journalctl, timeout, ['--after-cursor', memo['cursor']])
        if entries is not None and len(entries) < JOURNAL_ENTRIES:
            events = _folded(_memo_fold(memo), entries)
            _remember(memo, boot, entries, events)
            return events, None
    entries, error = _journal_entries(journalctl, timeout, [])
    if entries is None:
        if memo is not None:
            memo.clear()
        return None, error
    events = _folded(XidFold(), entries)
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


def _from_kernel(entry):
    """Whether a journal entry is a message the kernel logged: journald's own ``_TRANSPORT=kernel`` (no client can
    set a field that starts with ``_``) and no ``SYSLOG_FACILITY`` (journald adds it to a /dev/kmsg record of another
    facility than the kernel's: what userspace wrote there).  ``logger``, ``systemd-cat`` and journal clients arrive
    with another transport."""
    return entry.get('_TRANSPORT') == 'kernel' and entry.get('SYSLOG_FACILITY') in (None, str(KERNEL_FACILITY))


def _journal_events(entries):
    """The Xid events of the kernel's own entries among ``entries`` (journalctl's JSON), in their order."""
    events = []
    for entry in entries:
        message = entry.get('MESSAGE') if _from_kernel(entry) else None
        if isinstance(message, list):   # journald's form of a message that is not valid UTF-8
            message = bytes(b & 0xff for b in message if isinstance(b, int)).decode('utf-8', 'replace')
        stamp = entry.get('__REALTIME_TIMESTAMP')
        time_s = round(int(stamp) / 1e6, 3) if isinstance(stamp, str) and stamp.isdigit() else None
        event = parse_line(message, time_s) if isinstance(message, str) and 'Xid' in message else None
        if event is not None:
            source = entry.get('_SOURCE_MONOTONIC_TIMESTAMP')
            events.append(with_stamp(event, int(source) if isinstance(source, str) and source.isdigit() else None))
    return events


def _folded(fold, entries):
    """XidEvents: ``fold`` with the Xid events of the journal ``entries`` added."""
    for event in _journal_events(entries):
        fold.add(event)
    return fold.events()


def _remember(memo, boot, entries, events):
    """Keep the last entry's cursor (or the one the memo had, when nothing new came), the events and their counts."""
    for entry in reversed(entries):
        cursor = entry.get('__CURSOR')
        if isinstance(cursor, str) and len(cursor) <= MAX_CURSOR and _CURSOR_RE.match(cursor):
            memo['cursor'] = cursor
            break
    memo['boot'] = boot
    memo['events'] = [event_dict(event) for event in events]
    memo['counts'] = dict((pci, dict((str(code), number) for code, number in counts.items()))
                          for pci, counts in events.counts.items())


def _memo_fold(memo):
    """An XidFold holding the memo's events and counts (a memo without counts: each event counts once)."""
    fold = XidFold()
    counts = memo.get('counts')
    for item in memo.get('events') or ():
        fold.add(event_from_dict(item), counted=counts is None)
    for pci, by_code in (counts or {}).items():
        fold.count(pci, dict((int(code), number) for code, number in by_code.items()))
    return fold


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


def _valid_counts(counts):
    """The memo's counts: at most MAX_XID_BUSES PCI addresses, each {code (decimal text): count} of at most
    MAX_XID_CODES codes."""
    def pci(value):
        return isinstance(value, str) and len(value) <= 64 and pci_key(value) is not None

    def by_code(value):
        return isinstance(value, dict) and len(value) <= MAX_XID_CODES and all(
            isinstance(code, str) and _CODE_RE.match(code) and isinstance(number, int) and not isinstance(number, bool)
            and 0 <= number < 1 << 40 for code, number in value.items())
    return isinstance(counts, dict) and len(counts) <= MAX_XID_BUSES and all(
        pci(key) and by_code(value) for key, value in counts.items())


def valid_memo(data):
    """The journal memo of a loaded state: ``data`` when it is one read_journal wrote (bounded, every field of the
    expected type, at most MAX_XID_EVENTS events per GPU), else {} (the next read is the full one; nothing else of
    the state is lost)."""
    if not isinstance(data, dict) or set(data) - {'cursor', 'boot', 'events', 'counts'}:
        return {}
    cursor, boot, events = data.get('cursor'), data.get('boot'), data.get('events', [])
    if cursor is not None and not (isinstance(cursor, str) and len(cursor) <= MAX_CURSOR and _CURSOR_RE.match(cursor)):
        return {}
    if boot is not None and not (isinstance(boot, str) and _BOOT_RE.match(boot)):
        return {}
    if not isinstance(events, list) or len(events) > MEMO_EVENTS or not all(_valid_event(item) for item in events):
        return {}
    per_gpu = {}
    for item in events:
        key = pci_key(item['pci_bus_id'])
        per_gpu[key] = per_gpu.get(key, 0) + 1
    if None in per_gpu or len(per_gpu) > MAX_XID_BUSES or any(number > MAX_XID_EVENTS for number in per_gpu.values()):
        return {}
    if 'counts' in data and not _valid_counts(data['counts']):
        return {}
    return data


def join_events(devices, events):
    """Give the events of one read to the devices of ``devices`` with their PCI address (domain, bus and device;
    the caller passes the GPUs whose backend says ``xid_log``: NVIDIA's), with the read's counts (XidEvents; a
    plain list: each event counts once).  An event whose address is no GPU of ``devices`` changes nothing (no
    health, no metric, no ladder step): returns those events."""
    by_pci = dict((pci_key(dev.pci_bus_id), dev) for dev in devices if dev.pci_bus_id)
    grouped = {}
    unmatched = []
    for event in events:
        key = pci_key(event.pci_bus_id)
        if key in by_pci:
            grouped.setdefault(key, []).append(event)
        else:
            unmatched.append(event)
    counts = getattr(events, 'counts', None)
    if counts is None:
        for key, kept in grouped.items():
            for event in kept:
                by_pci[key].add_xid_event(event)
        return unmatched
    counted = dict((pci_key(pci), by_code) for pci, by_code in counts.items())
    for key in set(grouped) | set(counted):
        if key in by_pci:
            by_pci[key].add_xid_events(grouped.get(key, ()), counted.get(key, {}))
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
