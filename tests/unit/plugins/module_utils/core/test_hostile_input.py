# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Hostile input: module arguments, observed process data, fdinfo and ioreg text.

Each property feeds random and adversarial input to a parser of the core and accepts only a
correct result or a clear error (InvalidArgument naming the field for user arguments).  Policy
and rules files are fuzzed in test_policy_fuzz.py and test_rogue_fuzz.py.  Nothing here starts or
signals a process, except the regex-termination test, which runs the matcher in a child Python
that it started itself and waits for with a timeout.
"""

from __future__ import annotations

import json
import math
import os
import plistlib
import re
import shutil
import subprocess
import sys
import tempfile
import types

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import drm_fdinfo, killer, notify, policy, processes, rogue, select, textmatch
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.apple import AppleBackend, gpu_time_ns, parse_creator
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.base import to_number
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import resolve_gpus
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.units import parse_duration, parse_size_mib

pytest.importorskip('hypothesis')
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402  pylint: disable=wrong-import-position


def bounded(examples):
    """Settings of one property: ``examples`` cases, no per-case deadline (CI machines are slow)."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))


FUZZ = bounded(300)
FILES = bounded(200)
SMALL = bounded(10)

REGEX_ATOMS = ['a', 'b', '.', '*', '+', '?', '{2}', '{1,30}', '{,}', '(', ')', '(?:', '|', '[', ']', '^', '$', '\\', '\\d', '\\w',
               '\\s', '\\1', '(?P<x>', '(?P=x)', '(?=', '(?!', '(?<=', '(?i)', '.*', '.+', '(a+)+', '(a|a)*', '((a+))+', '[^)]',
               '\x00', '\udcff', '\u00b2', '{99999999999}', '*?', '+?', '(?#', '\\Z', '\\b', 'x' * 100]
REGEX = st.one_of(st.text(max_size=30), st.lists(st.sampled_from(REGEX_ATOMS), max_size=16).map(''.join))
SUBJECT = st.one_of(st.text(max_size=64), st.sampled_from(['a' * 64, 'ab' * 32, 'a' * 63 + '!', '']))


def fake_proc(pid, name, cmdline, user='alice', gpu=0):
    return types.SimpleNamespace(pid=pid, name=name, cmdline=cmdline, user=user, gpu_indexes=[gpu], used_mib=100, create_time=0.0,
                                 devices=[], uid=1000)


def fake_snapshot(procs, gpus=2):
    devices = [types.SimpleNamespace(index=i, uuid='GPU-%d' % i, vendor='nvidia', minor=i) for i in range(gpus)]
    return types.SimpleNamespace(processes=procs, holders=[], all_devices=devices, devices=devices)


def assert_names(err, *fields):
    assert err.field in fields, err.field
    str(err)                                                      # the message can be formatted


# ---------------------------------------------------------------------------- module arguments: regexes
@FUZZ
@given(REGEX, st.sampled_from(['name', 'cmdline']), SUBJECT)
def test_regex_selectors_are_rejected_or_bounded(pattern, field, subject):
    try:
        selector = select.Selector(**{field: pattern})
    except InvalidArgument as err:
        assert_names(err, field, 'selectors')
        return
    snap = fake_snapshot([fake_proc(101, subject, [subject, subject]), fake_proc(102, None, None)])
    try:
        matches = selector.select(snap)
    except InvalidArgument as err:                                  # ran past MATCH_TIMEOUT_S
        assert_names(err, field)
        return
    for match in matches:
        assert match.proc.pid == 101


CATASTROPHIC = ['(a+)+$', '(a*)*$', '((a+))+$', '(?:(?:a|b)+)+$', '(a|aa)+$', '(a|a)*$', '.*.*.*x', 'a*a*a*a*a*x', '(\\w+\\s?)+$',
                '(.*a){12}$', '(a?){30}a{30}', '^(([a-z])+.)+[A-Z]([a-z])+$']
RUNNER = r'''
import json, sys, types
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import select, textmatch
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
textmatch.MATCH_TIMEOUT_S = 0.25
out = {}
texts = ['a' * (select.MAX_MATCH_TEXT - 1) + '!' + 'a' * 1000000]   # 1 MB; the first 32 KiB fail slowly
for pattern in json.loads(sys.argv[1]):
    for field in ('name', 'cmdline'):
        try:
            selector = select.Selector(**{field: pattern})
        except InvalidArgument as err:
            out[pattern + ' ' + field] = 'rejected: ' + err.field
            continue
        result = 'matched'
        for text in texts:
            proc = types.SimpleNamespace(pid=7, name=text, cmdline=[text], user='u', gpu_indexes=[0], used_mib=1, create_time=0)
            snap = types.SimpleNamespace(processes=[proc], holders=[], all_devices=[])
            try:
                selector.select(snap)
            except InvalidArgument as err:
                result = 'stopped: ' + err.field
        out[pattern + ' ' + field] = result
print(json.dumps(out))
'''


def test_catastrophic_regexes_terminate():
    """Backtracking patterns on 32 KiB - 1 MB texts: rejected or stopped, in a child with a generous bound."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, '-c', RUNNER, json.dumps(CATASTROPHIC)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr.decode('utf-8', 'replace')[-2000:]
    outcome = json.loads(proc.stdout.decode())
    assert len(outcome) == 2 * len(CATASTROPHIC)
    for key, result in outcome.items():
        field = key.rsplit(' ', 1)[1]
        assert result in ('rejected: ' + field, 'stopped: ' + field, 'matched'), (key, result)
    assert outcome['((a+))+$ name'] == 'rejected: name'              # nested quantifier inside a group
    assert outcome['.*.*.*x cmdline'] == 'stopped: cmdline'          # polynomial: stopped by the time bound


def test_regex_timeout_restores_an_earlier_timer():
    import signal  # pylint: disable=import-outside-toplevel
    if not hasattr(signal, 'setitimer'):
        pytest.skip('no setitimer')
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(a))
    try:
        signal.setitimer(signal.ITIMER_REAL, 50.0)
        regex = select.compile_regex('cmdline', 'python.*train')
        assert select.bounded_search(regex, 'python -m train', 'cmdline')
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0 < remaining <= 50.0
        with pytest.raises(InvalidArgument) as err:
            select.bounded_search(select.compile_regex('cmdline', '.*.*.*x'), 'a' * 20000, 'cmdline', timeout=0.2)
        assert err.value.field == 'cmdline' and '.*.*.*x' in str(err.value)
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 50.0
        # redaction (textmatch.bounded_sub) shares the bound and the timer handling
        patterns = [select.compile_regex('redact', p) for p in policy.DEFAULT_REDACT_PATTERNS]
        assert notify.redact(['x', '--token=abc'], patterns) == 'x --token=<redacted>'
        with pytest.raises(InvalidArgument) as err:
            select.bounded_sub(select.compile_regex('notify.redact_patterns', '.*.*.*x'), '', 'a' * 20000, 'notify.redact_patterns',
                               timeout=0.2)
        assert err.value.field == 'notify.redact_patterns'
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 50.0
        assert signal.getsignal(signal.SIGALRM) is not textmatch._on_alarm  # pylint: disable=protected-access
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


# ---------------------------------------------------------------------------- durations and sizes
NUMBERS = st.one_of(st.integers(), st.integers(min_value=10 ** 300, max_value=10 ** 4000), st.floats(allow_nan=True, allow_infinity=True))
UNIT_TEXT = st.lists(st.one_of(st.sampled_from(['1', '90', '1.5', '9' * 400, ' ', 's', 'm', 'h', 'ms', 'd', 'w', 'gib', 'GB', 'k', 'T',
                                                'parsecs', '-', '.', '\u0663', '\u00b2', '\n', '\x00', 'e9', 'inf', 'nan']),
                               st.text(max_size=5)), max_size=8).map(''.join)
ANY_VALUE = st.one_of(NUMBERS, UNIT_TEXT, st.none(), st.booleans(), st.binary(max_size=8), st.lists(st.integers(), max_size=2),
                      st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@FUZZ
@given(ANY_VALUE, st.sampled_from([parse_duration, parse_size_mib]))
def test_durations_and_sizes(value, parser):
    try:
        result = parser(value, 'idle_for')
    except InvalidArgument as err:
        assert_names(err, 'idle_for')
        return
    assert isinstance(result, float) and math.isfinite(result) and result >= 0


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=10 ** 6), st.sampled_from(['s', 'm', 'h', 'd', 'w', 'ms'])),
                min_size=1, max_size=4))
def test_compound_durations_are_exact(parts):
    text = ''.join('%d%s' % part for part in parts)
    factor = {'ms': 0.001, 's': 1, 'm': 60, 'h': 3600, 'd': 86400, 'w': 604800}
    if len(text) > 64:
        with pytest.raises(InvalidArgument):
            parse_duration(text, 'older_than')
        return
    assert parse_duration(text, 'older_than') == pytest.approx(sum(n * factor[u] for n, u in parts))


# ---------------------------------------------------------------------------- GPU selectors
GPU_KEYS = st.one_of(st.integers(min_value=-3, max_value=5), st.integers(min_value=2 ** 70, max_value=10 ** 4000),
                     st.sampled_from(['0', '1', ' 1 ', '01', 'GPU-0', 'gpu-1', '\u00b2', '\u0661', '-1', '1.0', '', ' ', 'all', '0x1']),
                     st.text(max_size=12), st.floats(), st.none(), st.booleans())


@FUZZ
@given(st.lists(GPU_KEYS, max_size=5))
def test_gpu_selectors(keys):
    devices = fake_snapshot([], gpus=2).all_devices
    try:
        found = resolve_gpus(devices, keys)
    except InvalidArgument as err:
        assert_names(err, 'gpus')
        return
    assert all(dev in devices for dev in found)
    assert [d.index for d in found] == sorted(set(d.index for d in found))


# ---------------------------------------------------------------------------- observed process data
ARG_BYTES = st.one_of(st.binary(max_size=60), st.sampled_from([b'\xff\xfe', b'\xc3', b'\xed\xa0\x80', b'--pass=hunter2', b'\n',
                                                               b'stratum+tcp://pool.example.org:3333', b')', b'(']))
STAT_COMMS = st.one_of(st.binary(max_size=20), st.sampled_from([b'a) R 1', b'))', b'(', b'x\ny', b'\xff']))


class ProcTree(object):
    """A fake /proc with files the test writes: never a real process."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix='hostile-proc-')
        with open(os.path.join(self.root, 'stat'), 'w') as handle:
            handle.write('cpu 1 2 3\nbtime 1700000000\n')

    def add(self, pid, comm=b'worker', cmdline=b'', environ=b'', status=None, stat=None, maps=b''):
        base = os.path.join(self.root, str(pid))
        os.makedirs(os.path.join(base, 'fd'))
        if stat is None:
            stat = b'%d (%s) S 1 %d %d 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0' % (pid, comm, pid, pid)
        files = {'stat': stat, 'cmdline': cmdline, 'environ': environ, 'maps': maps, 'cgroup': b'0::/user.slice\n',
                 'status': status if status is not None else b'Name:\tx\nUid:\t%d\t%d\t%d\t%d\n' % ((os.geteuid(),) * 4)}
        for name, data in files.items():
            with open(os.path.join(base, name), 'wb') as handle:
                handle.write(data)
        return base

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def check_texts(values):
    for value in values or ():
        assert isinstance(value, str)


@FILES
@given(st.lists(ARG_BYTES, max_size=12), st.lists(ARG_BYTES, max_size=12), STAT_COMMS, st.binary(max_size=80))
def test_proc_files_with_hostile_bytes(args, env_items, comm, status):
    tree = ProcTree()
    try:
        tree.add(4242, comm=comm, cmdline=b'\0'.join(args) + b'\0', environ=b'\0'.join(env_items), status=status)
        files = processes.read_proc_files(4242, tree.root)
        if files is not None:
            check_texts(files['cmdline'])
            assert files['uid'] is None or isinstance(files['uid'], int)
        rec = processes.ProcessInventory(proc_root=tree.root, use_psutil=False, scan_fds=False).record(4242)
        check_texts(rec.cmdline)
        info = killer.read_proc(4242, tree.root)
        if info is not None:
            check_texts(info.cmdline)
            assert info.pid == 4242
        assert rogue.parse_environ(b'\0'.join(env_items)) is not None
    finally:
        tree.close()


@FILES
@given(st.binary(max_size=300))
def test_garbled_stat_files(stat):
    tree = ProcTree()
    try:
        tree.add(4243, stat=stat)
        assert processes.read_starttime(4243, tree.root) is None or isinstance(processes.read_starttime(4243, tree.root), int)
        files = processes.read_proc_files(4243, tree.root)
        assert files is None or isinstance(files['stat']['ppid'], int)
        killer.read_proc(4243, tree.root)
        processes.ProcessInventory(proc_root=tree.root, use_psutil=False, scan_fds=False).record(4243)
    finally:
        tree.close()


def gpu_process(pid, cmdline, uid):
    return types.SimpleNamespace(pid=pid, starttime=12345, user='alice', uid=uid, name='worker', cmdline=cmdline, exe=None,
                                 slurm_job=None, gpu_indexes=[0], used_mib=512, container=None, status='running', ppid=None)


@pytest.mark.parametrize('size, nul, invalid', [(1024 * 1024, False, False), (1024 * 1024, True, True), (3 * 1024 * 1024, True, False)])
def test_megabyte_command_lines_and_environments(size, nul, invalid):
    """1-3 MB command lines and environment blocks from a fake /proc: read bounded, scored, redacted."""
    tree = ProcTree()
    unit = (b'\xff\xfe' if invalid else b'') + b'--user=4' + (b'\0' if nul else b' ') + b'x' * 50
    blob = (unit * (size // len(unit) + 1))[:size]
    env = (b'K=' + b'v' * 1000 + b'\0') * (size // 1000) + b'WALLET=4' + b'A' * 94 + b'\0'
    try:
        tree.add(4244, cmdline=blob, environ=env, maps=b'7f00-7f01 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n' * 1000)
        info = killer.read_proc(4244, tree.root)
        assert info is not None and sum(len(a) for a in info.cmdline) <= killer.CMDLINE_LIMIT
        files = processes.read_proc_files(4244, tree.root)
        check_texts(files['cmdline'])
        collector = rogue.FactsCollector(proc_root=tree.root, root=tree.root)
        collector.euid = os.geteuid()
        snap = types.SimpleNamespace(device=lambda i: None, processes=[], holders=[])
        facts = collector.facts_for(gpu_process(4244, files['cmdline'], os.geteuid()), snap)
        assert facts.env is not None and len(facts.env) <= rogue.MAX_ENV_BYTES
        finding = rogue.Detector(rogue.load_config()).evaluate(facts)
        if finding is not None:
            assert finding['level'] in rogue.LEVELS and 0 <= finding['score'] <= 100
        text = notify.redact(files['cmdline'], [select.compile_regex('redact', p) for p in policy.DEFAULT_REDACT_PATTERNS])
        assert len(text) <= notify.MAX_CMDLINE + 3
    finally:
        tree.close()


@FILES
@given(st.lists(ARG_BYTES, max_size=10), st.lists(ARG_BYTES, max_size=10))
def test_rogue_facts_from_hostile_proc_files(args, env_items):
    tree = ProcTree()
    try:
        tree.add(4245, cmdline=b'\0'.join(args), environ=b'\0'.join(env_items), maps=b'\0'.join(args))
        cmdline = processes.read_proc_files(4245, tree.root)['cmdline']
        collector = rogue.FactsCollector(proc_root=tree.root, root=tree.root)
        collector.euid = os.geteuid()
        snap = types.SimpleNamespace(device=lambda i: None, processes=[], holders=[])
        facts = collector.facts_for(gpu_process(4245, cmdline, os.geteuid()), snap)
        for key, value in (facts.env or {}).items():
            assert isinstance(key, str) and isinstance(value, str)
        finding = rogue.Detector(rogue.load_config()).evaluate(facts)
        assert finding is None or finding['level'] in rogue.LEVELS
    finally:
        tree.close()


REDACT_PATTERNS = [select.compile_regex('redact', p) for p in policy.DEFAULT_REDACT_PATTERNS]


@FUZZ
@given(st.one_of(st.none(), st.lists(
    st.one_of(st.text(max_size=80), ARG_BYTES.map(lambda b: b.decode('utf-8', 'surrogateescape')),
              st.sampled_from(['--password=hunter2', 'token=abc', 'PASSWORD', '=', '\x00', '\n'])),
    max_size=20)))
def test_redact_hostile_command_lines(argv):
    text = notify.redact(argv, REDACT_PATTERNS)
    if argv is None:
        assert text is None
        return
    assert isinstance(text, str) and len(text) <= notify.MAX_CMDLINE + 3
    assert 'hunter2' not in text


REDACT_RUNNER = r'''
import json, sys
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import notify, policy, select, textmatch
textmatch.MATCH_TIMEOUT_S = 0.25
out = {}
secret = 'hunter2'
argv = ['python', 'train.py', '--password=' + secret, 'a' * (select.MAX_MATCH_TEXT - 100) + '!' + 'a' * 1000000]
for pattern in json.loads(sys.argv[1]):
    doc = 'notify: {tty: false, redact_patterns: [%s]}\n' % json.dumps(pattern)
    try:
        patterns = policy.load_policy_text(doc).notify.redact_patterns
    except policy.PolicyError as err:
        out[pattern] = 'rejected: ' + ','.join(e[0] for e in err.errors)
        continue
    text = notify.redact(argv, patterns)
    described = notify.describe_procs([{'pid': 7, 'cmdline': argv}], patterns)[0]['cmdline']
    out[pattern] = {'text': text, 'same': described == text, 'leaks': secret in text}
print(json.dumps(out))
'''


def test_catastrophic_redact_patterns_are_rejected_or_fail_closed():
    """Policy ``notify.redact_patterns`` go through the selectors' guards: nested quantifiers are
    refused when the policy is validated (the error names the field); slow patterns are stopped by
    the same match time bound, and the command line is then redacted whole (never sent as it was)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    patterns = CATASTROPHIC + ['(?i)(--password=)\\S+']
    proc = subprocess.run([sys.executable, '-c', REDACT_RUNNER, json.dumps(patterns)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr.decode('utf-8', 'replace')[-2000:]
    outcome = json.loads(proc.stdout.decode())
    assert outcome['(a+)+$'] == 'rejected: notify.redact_patterns'          # nested: refused at validation
    assert outcome['((a+))+$'] == 'rejected: notify.redact_patterns'
    slow = outcome['.*.*.*x']                                               # polynomial: stopped, fails closed
    assert slow['text'] == notify.REDACTED_SLOW and slow['same'] and not slow['leaks']
    for pattern, result in outcome.items():
        if isinstance(result, str):
            assert result == 'rejected: notify.redact_patterns', (pattern, result)
            continue
        assert not result['leaks'] and result['same'], (pattern, result)
        assert result['text'] == notify.REDACTED_SLOW or len(result['text']) <= notify.MAX_CMDLINE + 3, pattern
    assert outcome['(?i)(--password=)\\S+']['text'].startswith('python train.py --password=<redacted> aaa')


# ---------------------------------------------------------------------------- fdinfo and ioreg text
FDINFO_ATOMS = ['drm-driver:\tamdgpu\n', 'drm-driver:\ti915\n', 'drm-pdev:\t0000:03:00.0\n', 'drm-client-id:\t7\n', 'drm-client-id:\t-1\n',
                'drm-engine-gfx:\t123 ns\n', 'drm-engine-gfx:\t99999999999999999999999999 ns\n', 'drm-engine-capacity-gfx:\t0\n',
                'drm-cycles-rcs:\t5\n', 'drm-total-cycles-rcs:\t9\n', 'drm-maxfreq-rcs:\t1 MHz\n', 'drm-memory-vram:\t4 KiB\n',
                'drm-resident-vram:\t1 GiB\n', 'drm-total-gtt:\t12 EiB\n', 'drm-shared-system:\tx\n', 'drm-engine-:\t1 ns\n',
                'drm-:\n', 'drm-client-name:\t\xff\n', 'pos:\t0\n', 'flags:\t02\n', ':', '\n', '\x00', ' ', 'drm-engine-gfx:\t',
                '\u0661\u0662 ns\n', '1e9 ns\n', 'drm-memory-:\t1 B\n']
FDINFO = st.one_of(st.text(max_size=300), st.lists(st.sampled_from(FDINFO_ATOMS), max_size=30).map(''.join))


@FUZZ
@given(FDINFO, FDINFO, st.floats(allow_nan=True, allow_infinity=True))
def test_fdinfo_text(first, second, elapsed):
    clients = [drm_fdinfo.parse_fdinfo(first), drm_fdinfo.parse_fdinfo(second)]
    for client in clients:
        if client is None:
            continue
        assert client.driver
        for value in (client.used_bytes(), client.local_bytes(), client.system_bytes()):
            assert value is None or value >= 0
        assert client.key is None or isinstance(client.key, tuple)
        assert all(isinstance(name, str) for name in client.engine_names)
    if clients[0] is not None and clients[1] is not None:
        for util in (drm_fdinfo.engine_utilization(clients[0], clients[1], elapsed),
                     drm_fdinfo.client_utilization(clients[0], clients[1], elapsed)):
            assert util is None or isinstance(util, (dict, int, float))


PLIST_VALUE = st.recursive(
    st.one_of(st.none().map(lambda x: ''), st.booleans(), st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=8),
              st.sampled_from(['pid 533, WindowServer', 'pid -1', 'pid 99999999999999999999999', 'pid 5,', 'pid\u0663'])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(['IOUserClientCreator', 'AppUsage', 'accumulatedGPUTime',
                                                             'IORegistryEntryChildren', 'PerformanceStatistics', 'Device Utilization %',
                                                             'In use system memory', 'Alloc system memory', 'model',
                                                             'IOClass', 'gpu-core-count', 'IORegistryEntryID', 'x']),
                                            inner, max_size=6)),
    max_leaves=25)


class IoregRunner(object):
    def __init__(self, out):
        self.out = out

    def __call__(self, argv, timeout):
        return 0, self.out, ''


def apple_devices(out):
    backend = AppleBackend(platform='darwin', runner=IoregRunner(out), which=lambda name: '/usr/sbin/ioreg', cache={}, interval=0.0,
                           sleep=lambda seconds: None)
    status = backend.probe()
    if not status.available:
        assert status.error
        return []
    return backend.devices()


@FILES
@given(st.lists(PLIST_VALUE, max_size=3))
def test_ioreg_plists(entries):
    for dev in apple_devices(plistlib.dumps(entries, fmt=plistlib.FMT_BINARY)):
        dev.to_dict()


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.text(max_size=200).map(lambda t: t.encode('utf-8', 'surrogatepass'))))
def test_ioreg_garbled_output(out):
    head = b'<?xml version="1.0"?><plist version="1.0"><array><dict><key>IOClass</key><string>AGX</string></dict></array></plist>'
    for blob in (out, head[:len(out) % len(head)] + out):
        assert isinstance(apple_devices(blob), list)


@FUZZ
@given(PLIST_VALUE)
def test_ioreg_value_parsers(value):
    pid, name = parse_creator(value)
    assert pid is None or pid >= 0
    assert name is None or isinstance(name, str)
    if isinstance(value, dict):
        gpu_time_ns(value)
    to_number(value)
    to_number(value, float)


@SMALL
@given(st.binary(max_size=100))
def test_sysfs_text(data):
    root = tempfile.mkdtemp(prefix='hostile-sys-')
    try:
        path = os.path.join(root, 'attr')
        with open(path, 'wb') as handle:
            handle.write(data)
        assert drm_fdinfo.read_int(path) is None or isinstance(drm_fdinfo.read_int(path), int)
        assert drm_fdinfo.read_int(path, 16) is None or isinstance(drm_fdinfo.read_int(path, 16), int)
        text = drm_fdinfo.read_sysfs(path)
        assert text is None or isinstance(text, str)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------- redaction, exactly (mutation testing)
def test_redaction_keeps_every_group_around_the_secret():
    patterns = [re.compile(r'(key=)\w+(;)(;)')]
    assert notify.redact_text('key=abc;;', patterns) == 'key=<redacted>;;'
    assert notify.redact_text('', patterns) == '' and notify.redact_text(None, patterns) is None


def test_a_redacted_command_line_is_cut_only_past_its_limit():
    assert notify.redact(['x' * 10], [], limit=10) == 'x' * 10
    assert notify.redact(['x' * 11], [], limit=10) == 'x' * 10 + '...'
    assert notify.redact(['x' * (notify.MAX_CMDLINE + 1)], []) == 'x' * notify.MAX_CMDLINE + '...'
    assert notify.redact(None, []) is None


def test_a_batch_whose_patterns_ran_out_of_time_is_redacted_whole(monkeypatch):
    def too_slow(*_args, **_kwargs):
        raise InvalidArgument('notify.redact_patterns', '(a+)+$', 'took longer than the bound')

    monkeypatch.setattr(notify, 'bounded_subs_each', too_slow)
    assert notify.redact_many([['python', 'a'], None, ['b']], []) == [notify.REDACTED_SLOW, None, notify.REDACTED_SLOW]


def test_a_url_is_logged_as_its_scheme_and_host_only():
    assert notify.redact_url('https://user:pw@hooks.example:8443/services/T0/B0?token=x') == 'https://hooks.example:8443/...'
    assert notify.redact_url('http://hooks.example') == 'http://hooks.example/...'
    assert notify.redact_url('ftp://hooks.example/x') is None and notify.redact_url(None) is None
