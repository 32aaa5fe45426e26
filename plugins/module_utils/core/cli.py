# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""``gpufleet-guard``: the node agent (python3 and the vendor library; no Ansible).

Run as ``python3 -m gpufleet_core.cli`` (the package installed by the gpufleet.reclaim.guard role)
or through the launcher that role installs (``/opt/gpufleet/bin/gpufleet-guard``).

Commands: ``tick`` (one enforcement pass, what the timer runs), ``test`` (what a tick would do
now, changing nothing), ``check-config FILE``, ``list [--watch] [--json]``, ``kill``, ``reset``,
``audit`` (rogue scan to the audit log), ``verify-log``, and the Slurm ``epilog`` and ``prolog``
(core/slurm_scripts.py).  ``--root DIR`` prefixes every
default path (tests); ``--policy``, ``--state``, ``--log``, ``--metrics``, ... name files directly.

Exit codes: 0 ok; 1 a failure (invalid policy, failed action, broken log chain, ...); 2 usage.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import sys
import os
import time

from . import constants, guard_settings, guard_state, notify as notify_mod, policy as policy_mod
from .errors import GpuFleetError
from .text import printable, printable_lines
from .units import human_duration

PROG = 'gpufleet-guard'
VERSION = '1.0.0'


def _common(parser):
    group = parser.add_argument_group('paths')
    group.add_argument('--root', help='prefix every default path with this directory (tests)')
    for name in sorted(guard_settings.DEFAULT_PATHS):
        group.add_argument('--%s' % name.replace('_', '-'), dest='path_%s' % name, metavar='PATH',
                           help='default: %s' % guard_settings.DEFAULT_PATHS[name])
    parser.add_argument('--vendor', choices=constants.VENDOR_CHOICES, help='GPU vendors to read')
    parser.add_argument('--dev-root', action='append', dest='dev_roots', help=argparse.SUPPRESS)  # test seam


def build_parser(only=None):
    """The argument parser; with ``only`` (a command name) just that command's subparser (a tick then
    does not pay for building the other seven: about 15 ms of its CPU)."""
    parser = argparse.ArgumentParser(prog=PROG, description='GPU policy guard of gpufleet.reclaim (node agent).')
    parser.add_argument('--version', action='version', version='%s %s' % (PROG, VERSION))
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')
    sub.required = True

    if only in (None, 'tick'):
        cmd = sub.add_parser('tick', help='one enforcement pass (what the timer runs)')
        _common(cmd)
        cmd.add_argument('--dry-run', action='store_true', help='decide and log, whatever the policy mode says, but signal and notify nobody')
        cmd.add_argument('--json', action='store_true', help='print the tick summary as JSON')
        cmd.add_argument('-q', '--quiet', action='store_true', help='print nothing unless the tick fails (cron)')
        cmd.add_argument('--now', type=float, help=argparse.SUPPRESS)  # test seam: the clock

    if only in (None, 'test'):
        cmd = sub.add_parser('test', help='what a tick would decide now (changes nothing)')
        _common(cmd)
        cmd.add_argument('--json', action='store_true')
        cmd.add_argument('--now', type=float, help=argparse.SUPPRESS)

    if only in (None, 'check-config'):
        cmd = sub.add_parser('check-config', help='validate a policy file')
        cmd.add_argument('file', help='the policy file (YAML, JSON, or a gpu-kill TOML configuration); - reads stdin')
        cmd.add_argument('--json', action='store_true')

    if only in (None, 'list'):
        cmd = sub.add_parser('list', help='GPUs and GPU processes of this node')
        _common(cmd)
        cmd.add_argument('--json', action='store_true')
        cmd.add_argument('--watch', action='store_true', help='refresh in place (bounded by --count when not a terminal)')
        cmd.add_argument('--interval', type=float, default=2.0, help='seconds between refreshes (default 2)')
        cmd.add_argument('--count', type=int, help='refreshes before exiting (default: until Ctrl-C on a terminal, 3 otherwise)')
        cmd.add_argument('--holders', choices=('auto', 'always', 'never'), default='auto',
                         help='walk every process\'s open files for GPU device holders the driver does not list: always, '
                              'never, or auto (default) - only when some GPU\'s used memory is not explained by its listed processes')

    if only in (None, 'kill'):
        cmd = sub.add_parser('kill', help='end GPU processes (core reclaim: identity check, TERM then KILL)')
        _common(cmd)
        cmd.add_argument('--pid', type=int, action='append', dest='pids', help='a pid (repeatable)')
        cmd.add_argument('--user', action='append', dest='users', help='every GPU process of this user (repeatable)')
        cmd.add_argument('--gpu', action='append', dest='gpus', help='only on this GPU (index or UUID; repeatable)')
        cmd.add_argument('--all-on-gpus', action='store_true', help='every process on the --gpu GPUs')
        cmd.add_argument('--name', help='process name regex')
        cmd.add_argument('--cmdline', help='command line regex')
        cmd.add_argument('--signal', default='TERM', choices=('TERM', 'INT', 'HUP', 'QUIT', 'KILL', 'USR1', 'USR2'))
        cmd.add_argument('--timeout', type=float, default=10.0, help='seconds to wait before giving up or escalating')
        cmd.add_argument('--force', action='store_true', help='send SIGKILL to survivors after --timeout')
        cmd.add_argument('--no-tree', action='store_true', help='leave the children of a selected process alone')
        cmd.add_argument('--dry-run', action='store_true', help='show what would be signalled')

    if only in (None, 'reset'):
        cmd = sub.add_parser('reset', help='reset GPUs (core reset: preconditions, vendor reset, verification)')
        _common(cmd)
        cmd.add_argument('--gpu', action='append', dest='gpus', help='GPU index or UUID (repeatable)')
        cmd.add_argument('--all', action='store_true', dest='all_gpus')
        cmd.add_argument('--when-needed', action='store_true', help='GPUs whose health asks for a reset')
        cmd.add_argument('--kill-processes', action='store_true', help='end the processes on the GPU first')
        cmd.add_argument('--dry-run', action='store_true')

    if only in (None, 'audit'):
        cmd = sub.add_parser('audit', help='rogue (crypto-miner) scan; findings go to the audit log')
        _common(cmd)
        cmd.add_argument('--min-level', default='medium', choices=constants.ROGUE_LEVELS)
        cmd.add_argument('--rules-file', help='rogue rules file')
        cmd.add_argument('--no-log', action='store_true', help='print only; do not append to the audit log')
        cmd.add_argument('--json', action='store_true')

    for script in ('epilog', 'prolog'):
        if only in (None, script):
            _slurm_script_parser(sub, script)

    if only in (None, 'verify-log'):
        cmd = sub.add_parser('verify-log', help='check the hash chain of a log (default: the guard log)')
        cmd.add_argument('files', nargs='*', help='log files (default: the guard log)')
        cmd.add_argument('--root', help='prefix of the default path')
        cmd.add_argument('--log', dest='path_log', metavar='PATH')
        cmd.add_argument('--json', action='store_true')
    return parser


def _slurm_script_parser(sub, script):
    from . import slurm_scripts as scripts  # pylint: disable=import-outside-toplevel
    cmd = sub.add_parser(script, help='Slurm %s: %s (docs/slurm.md)' % (script, {
        'epilog': 'end what the ending job left on its GPUs, check the memory came back, drain the node if not',
        'prolog': 'refuse the job when its GPUs hold memory or processes not of it (drain, exit 1)'}[script]))
    _common(cmd)
    cmd.add_argument('--grace', type=float, default=scripts.DEFAULT_GRACE_S, help='seconds between SIGTERM and SIGKILL')
    cmd.add_argument('--kill-wait', type=float, default=scripts.DEFAULT_KILL_WAIT_S, help='seconds to wait after SIGKILL')
    cmd.add_argument('--release-timeout', type=float, default=scripts.DEFAULT_RELEASE_TIMEOUT_S,
                     help='seconds for the GPU memory to come back (default %g)' % scripts.DEFAULT_RELEASE_TIMEOUT_S)
    cmd.add_argument('--slurm-timeout', type=float, default=scripts.SLURM_TIMEOUT_S, help='seconds per Slurm command (squeue, scontrol)')
    cmd.add_argument('--driver-timeout', type=float, default=scripts.DEFAULT_DRIVER_TIMEOUT_S, help='seconds per driver read')
    cmd.add_argument('--script-metrics', metavar='PATH',
                     help='textfile of this script (default: gpufleet_slurm_%s.prom next to the guard\'s metrics; empty: none)' % script)
    cmd.add_argument('--no-drain', action='store_true', help='never drain the node (report only)')
    cmd.add_argument('--dry-run', action='store_true', help='decide and report; signal and drain nothing, exit 0')
    cmd.add_argument('--json', action='store_true')


def _paths(args):
    overrides = dict((name, getattr(args, 'path_%s' % name, None)) for name in guard_settings.DEFAULT_PATHS)
    return guard_settings.Paths(root=getattr(args, 'root', None), **overrides)


def _settings(args, paths):
    explicit = dict((name, getattr(args, 'path_%s' % name, None)) for name in guard_settings.DEFAULT_PATHS)
    settings = guard_settings.load_settings(paths.settings, paths)
    # command-line paths win over the settings file
    for name, value in explicit.items():
        if value is not None:
            setattr(paths, name, value or None)
    if getattr(args, 'vendor', None):
        settings.vendor = args.vendor
    return settings


def _print_json(data, out):
    """Indented for a terminal; one line when piped (json's C encoder runs only without indentation:
    indenting a busy node's tick summary cost a quarter of the tick's CPU)."""
    try:
        indent = 2 if out.isatty() else None
    except (AttributeError, ValueError):
        indent = None
    # ensure_ascii (the default): every control character, DEL and non-ASCII character is escaped
    out.write(json.dumps(data, indent=indent, sort_keys=True, default=str) + '\n')


def _line(out, text):
    """One line of human-facing output: whatever it quotes from processes, users or files is escaped
    (text.printable), so it cannot move the cursor, retitle the terminal or forge another line."""
    out.write(printable(text) + '\n')


def _err(text):
    """An error or warning on stderr; a message of several lines keeps them, indented under the first."""
    sys.stderr.write('%s: %s\n' % (PROG, printable_lines(text).replace('\n', '\n  ')))


# ---------------------------------------------------------------------------- tick and test
def _decision_line(record):
    pids = ','.join(str(p) for p in record.get('pids') or []) or '-'
    if record['decision'] == 'clear':
        return 'clear   %s %s (no longer violated)' % (record.get('rule'), record.get('subject'))
    text = '%-7s %s %s: %s [pids %s]' % (
        record['decision'], record.get('rule'), record.get('subject'), record.get('message'), pids)
    outcome = record.get('outcome') or {}
    if record['decision'] == 'act' and outcome:
        if isinstance(outcome.get('pids'), dict):
            text += ' -> ' + ', '.join('%s %s' % (pid, o.get('outcome')) for pid, o in sorted(outcome['pids'].items()))
        elif outcome.get('why'):
            text += ' -> %s' % outcome['why']
        elif outcome.get('would'):
            text += ' -> would %s' % outcome['would']
    if record['decision'] == 'warn' and record.get('act_in') is not None:
        text += ' (action in %ss)' % int(record['act_in'])
    return text


def cmd_tick(args, out):
    paths = _paths(args)
    settings = _settings(args, paths)
    if args.dry_run:
        settings.mode = 'dry-run'
    summary = _module('guard').run_tick(paths, settings, now=args.now, dev_roots=args.dev_roots)
    if args.quiet:
        if summary['rc'] != 0:
            _err(summary.get('error') or 'the tick failed: %s' % '; '.join(summary.get('warnings') or ()))
        return summary['rc']
    if args.json:
        _print_json(summary, out)
    else:
        if summary.get('skipped'):
            _line(out, summary['skipped'])
        elif summary.get('error'):
            _err(summary['error'])
        else:
            _line(out, 'tick %s mode %s: %d violation(s), %d decision(s) in %.2fs' % (
                summary['tick'], summary['mode'], len(summary['violations']), len(summary['decisions']), summary['duration']))
            for record in summary['decisions']:
                _line(out, '  %s' % _decision_line(record))
    for warning in summary.get('warnings') or ():
        _err('warning: %s' % warning)
    return summary['rc']


def cmd_test(args, out):
    paths = _paths(args)
    settings = _settings(args, paths)
    summary = _module('guard').preview(paths, settings, now=args.now, dev_roots=args.dev_roots)
    if args.json:
        _print_json(summary, out)
        return summary['rc']
    if summary.get('error'):
        _err(summary['error'])
        return summary['rc']
    _line(out, 'policy %s (mode %s): %d violation(s) now' % (paths.policy, summary['mode'], len(summary['violations'])))
    for violation in summary['violations']:
        _line(out, '  %-18s %-22s %s; would end pid(s) %s' % (
            violation['rule'], violation['subject'], violation['message'], ','.join(str(p) for p in violation['pids']) or '-'))
    if summary['decisions']:
        _line(out, 'a tick now would decide:')
        for record in summary['decisions']:
            _line(out, '  %s' % _decision_line(record))
    else:
        _line(out, 'a tick now would decide nothing new')
    for note in summary.get('notes') or ():
        _line(out, '  note: %s' % note)
    for warning in summary.get('warnings') or ():
        _err('warning: %s' % warning)
    return summary['rc']


def cmd_check_config(args, out, stdin=None):
    try:
        if args.file == '-':
            stdin = stdin or sys.stdin
            data = stdin.buffer.read(policy_mod.MAX_POLICY_BYTES + 1) if hasattr(stdin, 'buffer') else stdin.read()
            policy = policy_mod.load_policy_text(data, '<stdin>')
            syntax = policy_mod.document_syntax(data, '<stdin>')
        else:
            policy = policy_mod.load_policy(args.file)
            syntax = policy_mod.document_format(args.file)
    except policy_mod.PolicyError as exc:
        if args.json:
            _print_json({'valid': False, 'errors': exc.problems()}, out)
        else:
            sys.stderr.write(printable_lines(exc) + '\n')
        return 1
    now = time.time()
    notes = list(policy.notes)
    for index, exemption in enumerate(policy.exemptions):
        if exemption.expired(now):
            notes.append('exemptions[%d] expired on %s and is ignored' % (
                index, datetime.datetime.fromtimestamp(exemption.expires, datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')))
    if args.json:
        _print_json({'valid': True, 'file': args.file, 'syntax': syntax, 'summary': policy.summary(), 'notes': notes}, out)
    else:
        _line(out, '%s: valid (%s format, mode %s%s)' % (args.file, policy.format, policy.mode,
                                                         '' if policy.enabled else ', disabled'))
        for note in notes:
            _line(out, 'note: %s' % note)
    return 0


# ---------------------------------------------------------------------------- list
def _snapshot(settings, args):
    from .snapshot import take_snapshot  # pylint: disable=import-outside-toplevel
    holders = {'auto': 'auto', 'always': True, 'never': False}[getattr(args, 'holders', 'always')]
    return take_snapshot(vendor=settings.vendor, gather_processes=True, dev_roots=getattr(args, 'dev_roots', None),
                         scan_holders=holders)


def _age(create_time, now):
    return '-' if create_time is None else human_duration(now - create_time)


def _fmt(value, suffix=''):
    return '-' if value is None else '%s%s' % (value, suffix)


def render_list(snapshot, patterns, now=None, width=160):
    now = time.time() if now is None else now
    lines = ['%-4s %-28s %17s %5s %5s %7s %5s' % ('GPU', 'NAME', 'MEMORY MiB', 'UTIL', 'TEMP', 'POWER', 'PIDS')]
    for dev in snapshot.devices:
        memory = '%s/%s' % (_fmt(dev.memory_used_mib), _fmt(dev.memory_total_mib))
        lines.append('%-4s %-28s %17s %5s %5s %7s %5d' % (dev.index, printable(dev.name or '-')[:28], memory,
                                                          _fmt(dev.utilization_pct, '%'), _fmt(dev.temperature_c, 'C'),
                                                          _fmt(dev.power_w, 'W'), len(dev.driver_processes)))
    lines.append('')
    lines.append('%-8s %-12s %-6s %9s %5s %9s  %s' % ('PID', 'USER', 'GPU', 'MEM MiB', 'UTIL', 'AGE', 'COMMAND'))
    procs = sorted(snapshot.processes, key=lambda p: (-(p.used_mib or 0), p.pid))
    for proc, cmd in zip(procs, notify_mod.redact_many([proc.cmdline for proc in procs], patterns)):
        cmd = cmd or proc.name or '?'
        line = '%-8d %-12s %-6s %9s %5s %9s  %s' % (
            proc.pid, printable(proc.user or '?')[:12], ','.join(str(g) for g in proc.gpu_indexes), _fmt(proc.used_mib),
            _fmt(proc.util_pct, '%'), _age(proc.create_time, now), printable(cmd))
        lines.append(line[:width])
    if not snapshot.processes:
        lines.append('(no GPU processes)')
    return '\n'.join(lines) + '\n'


def list_json(snapshot, patterns):
    facts = snapshot.to_facts()
    listed = facts['processes'] + facts['holders']
    for item, cmdline in zip(listed, notify_mod.redact_many([item['cmdline'] for item in listed], patterns)):
        item['cmdline'] = cmdline
    facts['holders_scanned'] = snapshot.holders_scanned
    facts['host'] = os.uname().nodename
    facts['ts'] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    return facts


def cmd_list(args, out, sleep=time.sleep, isatty=None):
    paths = _paths(args)
    settings = _settings(args, paths)
    patterns = _patterns(paths)
    tty = out.isatty() if isatty is None else isatty
    count = args.count
    if count is None:
        count = (0 if tty else 3) if args.watch else 1
    if count < 0 or args.interval <= 0:
        _err('--count must be 0 or more and --interval more than 0')
        return 2
    if args.watch:
        gc.enable()  # the launcher turns the cyclic collector off for one-shot runs; a watch runs for long
    done = 0
    try:
        while True:
            snapshot = _snapshot(settings, args)
            if args.json:
                text = json.dumps(list_json(snapshot, patterns), sort_keys=True, default=str) + '\n'
            else:
                text = render_list(snapshot, patterns)
            if args.watch and tty:
                out.write('\x1b[H\x1b[2J')  # home and clear: refresh in place
                out.write('%s  every %.0fs  %s\n\n' % (printable(os.uname().nodename), args.interval,
                                                       time.strftime('%Y-%m-%d %H:%M:%S')))
            elif args.watch and done and not args.json:
                out.write('\n')
            out.write(text)
            out.flush()
            done += 1
            if not args.watch or (count and done >= count):
                return 0
            sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _patterns(paths):
    """The policy's redaction patterns.  The policy document comes from the agent state's cache when
    the file's SHA-256 matches it, as at a tick (no YAML parsing); ``list`` never writes the state."""
    try:
        cache = guard_state.load_state(paths.state, time.time())[0].get('policy_cache') if paths.state else None
        return policy_mod.load_policy_cached(paths.policy, dict(cache) if isinstance(cache, dict) else {}).notify.redact_patterns
    except policy_mod.PolicyError:
        return notify_mod.default_patterns()


# ---------------------------------------------------------------------------- kill, reset, audit
def cmd_kill(args, out):
    from .reclaim import ReclaimOptions, reclaim  # pylint: disable=import-outside-toplevel
    from .select import Selector  # pylint: disable=import-outside-toplevel
    paths = _paths(args)
    settings = _settings(args, paths)
    selector = Selector(pids=args.pids, users=args.users, gpus=args.gpus, all_on_gpus=args.all_on_gpus, name=args.name,
                        cmdline=args.cmdline)
    options = ReclaimOptions(signal=args.signal, timeout=args.timeout, force=args.force, tree=not args.no_tree,
                             vendor=settings.vendor, audit_path=paths.log, redact_patterns=_patterns(paths))
    result = reclaim(selector, options, check_mode=args.dry_run, dev_roots=args.dev_roots)
    _print_json(result, out)
    return 1 if result['failed'] else 0


def _module(name):
    """The core module ``name`` (guard, audit_log), imported on first use: ``list`` and ``check-config`` do not
    load what a tick or the log check needs (about 10 ms of a ``list``'s start-up)."""
    return importlib.import_module('.' + name, __package__)


def _core_module(name, command):
    """The core module ``name`` (reset, rogue), or None with an error when this build lacks it."""
    try:
        return importlib.import_module('.' + name, __package__)
    except ImportError:
        _err('%s: not available in this build (core/%s.py is missing)' % (command, name))
        return None


def cmd_reset(args, out):
    reset_mod = _core_module('reset', 'reset')
    if reset_mod is None:
        return 1
    paths = _paths(args)
    settings = _settings(args, paths)
    options = reset_mod.ResetOptions(gpus=args.gpus, all_gpus=args.all_gpus, when_needed=args.when_needed,
                                     kill_processes=args.kill_processes, vendor=settings.vendor, audit_path=paths.log)
    result = reset_mod.reset(options, check_mode=args.dry_run)
    _print_json(result, out)
    return 1 if result.get('failed_gpus') else 0


def cmd_audit(args, out):
    rogue = _core_module('rogue', 'audit')
    if rogue is None:
        return 1
    paths = _paths(args)
    settings = _settings(args, paths)
    config = rogue.load_config(rules_file=args.rules_file)
    snapshot = _snapshot(settings, args)
    findings, warnings, evaluated = rogue.detect_snapshot(snapshot, config=config, min_level=args.min_level,
                                                          history_path=paths.history)
    warnings = list(config.warnings) + list(warnings)
    logged = 0 if args.no_log else rogue.log_findings(paths.audit_log, findings, source=PROG, warnings=warnings)
    summary = rogue.summarize(findings, evaluated)
    if args.json:
        _print_json({'findings': findings, 'summary': summary, 'logged': logged, 'warnings': warnings}, out)
    else:
        _line(out, 'examined %d process(es): %s; %d finding(s) logged to %s' % (
            evaluated, ', '.join('%d %s' % (summary.get(level, 0), level) for level in reversed(rogue.LEVELS)), logged,
            paths.audit_log))
        for finding in findings:
            _line(out, '  %-8s score %3s pid %s user %s %s' % (
                finding['level'], finding['score'], finding['pid'], finding['user'], ', '.join(r['id'] for r in finding['rules'])))
    for warning in warnings:
        _err('warning: %s' % warning)
    return 0


def cmd_verify_log(args, out):
    files = args.files or [_paths(args).log]
    results = []
    for path in files:
        result = _module('audit_log').verify(path)
        result['file'] = path
        results.append(result)
    if args.json:
        _print_json(results if len(results) > 1 else results[0], out)
    else:
        for result in results:
            if result['valid']:
                _line(out, '%s: chain valid, %d line(s)' % (result['file'], result['lines']))
            else:
                _line(out, '%s: chain BROKEN' % result['file'])
                for error in result['errors'][:20]:
                    _line(out, '  line %s: %s' % (error['line'], error['error']))
    return 0 if all(r['valid'] for r in results) else 1


def cmd_slurm_script(args, out):
    from . import slurm_scripts as scripts  # pylint: disable=import-outside-toplevel
    paths = _paths(args)
    settings = _settings(args, paths)
    textfile = args.script_metrics
    if textfile is None and paths.metrics:
        textfile = os.path.join(os.path.dirname(paths.metrics), 'gpufleet_slurm_%s.prom' % args.command)
    try:
        options = scripts.ScriptOptions(grace=args.grace, kill_wait=args.kill_wait, release_timeout=args.release_timeout,
                                        slurm_timeout=args.slurm_timeout, driver_timeout=args.driver_timeout, vendor=settings.vendor,
                                        log=paths.log, metrics=textfile or None, drain=not args.no_drain, dry_run=args.dry_run)
        result = getattr(scripts, args.command)(options)
    except scripts.SlurmError as exc:
        _err(str(exc))
        return scripts.EXIT_USAGE
    if args.json:
        _print_json(result, out)
    else:
        _line(out, '%s job %s on %s: killed %d, spared %d, blocking %d, unreleased %s, drained %s, exit %d in %.2fs' % (
            args.command, (result.get('job') or {}).get('job'), result['node'], len(result['killed']), len(result['spared']),
            len(result['blocking']), ','.join('GPU %s %s MiB' % (u['gpu'], u['mib']) for u in result['unreleased']) or 'none',
            result['drained'] or 'no', result['rc'], result['seconds']))
        for warning in result['warnings']:
            _err('warning: %s' % warning)
    return result['rc']


COMMANDS = {'tick': cmd_tick, 'test': cmd_test, 'check-config': cmd_check_config, 'list': cmd_list, 'kill': cmd_kill,
            'reset': cmd_reset, 'audit': cmd_audit, 'verify-log': cmd_verify_log, 'epilog': cmd_slurm_script, 'prolog': cmd_slurm_script}


def main(argv=None, out=None):
    out = out or sys.stdout
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args, out)
    except GpuFleetError as exc:
        _err(str(exc))
        return 1
    except OSError as exc:
        _err('%s: %s' % (getattr(exc, 'filename', None) or 'error', exc.strerror or exc))
        return 1


if __name__ == '__main__':
    raise SystemExit(main())
