#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the journal cursor (core/xid.py ``read_journal`` memo, issue #17) saves per guard tick.

Under the hardened unit (no /dev/kmsg) a tick on NVIDIA reads the kernel's Xid lines from the journal.  A fake
``journalctl`` (a Python script on PATH, as the unit tests fake it) serves a journal of L kernel lines (default
20,000, one Xid line in 50) in ``journalctl -k -o json`` form and honours ``-n`` and ``--after-cursor``.  In this one
process, interleaved, ``reps`` times each:

* ``full``: ``xid.read_journal()`` without a memo: the newest 20,000 entries, every one parsed (today's tick);
* ``cursor``: with the memo of the previous read and N new lines (default 50: a busy minute), the entries after
  the cursor only, the memo's events kept;
* ``floor``: a cursor read with nothing new (the fake's start and the memo alone: the floor both pay).

Reported: wall time and CPU time (this process plus the fake's) per read, median (min-max), and per-run ratios
full / cursor in the same run.  Nothing is signalled; the fake's files live in a temporary directory.

    python benchmarks/journal_cursor.py [--reps 20] [--lines 20000] [--new 50] [--json out.json] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

sys.path.insert(0, common.MODULE_UTILS)
from core import xid  # noqa: E402 pylint: disable=wrong-import-position,import-error

BOOT = '0123456789abcdef0123456789abcdef'
FAKE = r'''#!%(python)s
import sys
argv = sys.argv[1:]
limit = int(argv[argv.index('-n') + 1])
with open(%(journal)r) as handle:
    text = handle.read()
if '--after-cursor' in argv:
    at = text.find('"__CURSOR": "%%s"' %% argv[argv.index('--after-cursor') + 1])
    if at < 0:
        sys.stderr.write('Failed to seek to cursor: Invalid argument\n')
        sys.exit(1)
    lines = text[text.index('\n', at) + 1:].splitlines()[:limit]
else:
    lines = text.splitlines()[-limit:] if limit else []
sys.stdout.write(''.join(line + '\n' for line in lines))
'''


def line(n):
    message = ('NVRM: Xid (PCI:0000:%02x:00): %d, pid=%d, name=python, Graphics Exception' % (n % 8, (13, 31, 43)[n % 3], 1000 + n)
               if n % 50 == 0 else 'eth0: link up, 100Gbps, full duplex, flow control off (line %d)' % n)
    return json.dumps({'__CURSOR': 's=ab;i=%x;b=%s;m=%x;t=%x;x=%x' % (n, BOOT, n, n, n), '__REALTIME_TIMESTAMP': str(1700000000000000 + n),
                       'PRIORITY': '6', '_TRANSPORT': 'kernel', 'SYSLOG_FACILITY': '0', 'SYSLOG_IDENTIFIER': 'kernel',
                       '_BOOT_ID': BOOT, '_HOSTNAME': 'node01', 'MESSAGE': message})


def measure(fn):
    wall0, self0, kids0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    fn()
    wall = time.perf_counter() - wall0
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(getattr(b, f) - getattr(a, f) for a, b in ((self0, self1), (kids0, kids1)) for f in ('ru_utime', 'ru_stime'))
    return wall, cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n', maxsplit=1)[0])
    parser.add_argument('--reps', type=int, default=20)
    parser.add_argument('--lines', type=int, default=20000)
    parser.add_argument('--new', type=int, default=50)
    parser.add_argument('--json')
    parser.add_argument('--write-docs', action='store_true')
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix='gpufleet-journal-')
    try:
        journal = os.path.join(work, 'journal.jsonl')
        with open(journal, 'w') as handle:
            handle.write(''.join(line(n) + '\n' for n in range(args.lines + args.new)))
        fake = os.path.join(work, 'journalctl')
        with open(fake, 'w') as handle:
            handle.write(FAKE % {'python': sys.executable, 'journal': journal})
        os.chmod(fake, 0o755)
        # the memo as the previous tick left it: its cursor names the entry N lines before the end
        cursor = 's=ab;i=%x;b=%s;m=%x;t=%x;x=%x' % ((args.lines - 1,) + (BOOT,) + (args.lines - 1,) * 3)
        seen = xid._journal_events([json.loads(line(n)) for n in range(args.lines)])  # pylint: disable=protected-access
        kept = [xid.event_dict(e) for e in seen][-xid.MEMO_EVENTS:]
        full_events, _error = xid.read_journal(fake, boot_id=BOOT)
        memo = {'boot': BOOT, 'cursor': cursor, 'events': list(kept)}
        cursor_events, _error = xid.read_journal(fake, memo=memo, boot_id=BOOT)
        same = [e.to_dict() for e in cursor_events][-len(full_events):] == [e.to_dict() for e in full_events]
        runs = {'full': [], 'cursor': [], 'floor': []}

        last = 's=ab;i=%x;b=%s;m=%x;t=%x;x=%x' % ((args.lines + args.new - 1,) + (BOOT,) + (args.lines + args.new - 1,) * 3)

        def floor():
            xid.read_journal(fake, memo={'boot': BOOT, 'cursor': last, 'events': list(kept)}, boot_id=BOOT)
        for rep in range(args.reps):
            order = ['full', 'cursor', 'floor']
            order = order[rep % 3:] + order[:rep % 3]
            for name in order:
                if name == 'full':
                    runs[name].append(measure(lambda: xid.read_journal(fake, boot_id=BOOT)))
                elif name == 'cursor':
                    runs[name].append(measure(lambda: xid.read_journal(
                        fake, memo={'boot': BOOT, 'cursor': cursor, 'events': list(kept)}, boot_id=BOOT)))
                else:
                    runs[name].append(measure(floor))
    finally:
        shutil.rmtree(work)
    result = {'lines': args.lines, 'new': args.new, 'reps': args.reps, 'same_events_as_full_read': same,
              'events': len(cursor_events), 'machine': common.machine_info()}
    for name, values in runs.items():
        result[name] = {'wall_s': common.stats([w for w, _c in values]), 'cpu_s': common.stats([c for _w, c in values])}
    result['ratio_full_over_cursor'] = {
        'wall': common.stats(common.ratios([w for w, _c in runs['full']], [w for w, _c in runs['cursor']])),
        'cpu': common.stats(common.ratios([c for _w, c in runs['full']], [c for _w, c in runs['cursor']]))}
    rows = ['| read | wall ms | CPU ms (with journalctl) |', '|---|---|---|']
    labels = {'full': 'full read (no memo: today\'s tick, first tick, after a reboot)',
              'cursor': '`--after-cursor` (%d new lines; memo events kept)' % args.new,
              'floor': '`--after-cursor` at the end: nothing new (floor: the fake\'s start)'}
    for name in ('full', 'cursor', 'floor'):
        rows.append('| %s | %s | %s |' % (labels[name], common.fmt(result[name]['wall_s'], 1000, 1),
                                          common.fmt(result[name]['cpu_s'], 1000, 1)))
    body = '\n'.join(rows + ['', 'Full / cursor, per run (same run): wall %s x, CPU %s x; journal of %d kernel lines, one Xid in 50,'
                                 ' %d reps interleaved; the cursor read returned the same events as a full read: %s.' % (
                                     common.fmt(result['ratio_full_over_cursor']['wall'], 1, 1),
                                     common.fmt(result['ratio_full_over_cursor']['cpu'], 1, 1), args.lines, args.reps,
                                     'yes' if same else 'NO')])
    print(body)
    if args.json:
        common.write_json(args.json, result)
    if args.write_docs:
        common.rewrite_section(body, 'journal_cursor', title='## Journal cursor (`benchmarks/journal_cursor.py`)')
    return 0 if same else 1


if __name__ == '__main__':
    sys.exit(main())
