# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The live side of the rogue detector: FactsCollector reading /proc of processes this test starts
(environment, mapped libraries, TCP sockets, parent chain, deleted executables, SHA-256), the
history-fed behavioural rules, and the gpu_kill selector hook.

SAFETY: only processes started here are signalled, through their Popen objects.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import history, rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import ContainerInfo, Device, GpuProcess
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.processes import ProcessInventory
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import Snapshot

pytestmark = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc')

XMR = '45ASi45ub7Qe4ZE36UT5G6cU4ud8Fhhe4deS4F3cw9KTAb8dLcukC7edhDQ7cn5d4gEYkbUrMWeWQLGsCmrG6dLaYyNoVKf'
CONNECT = ('import socket, sys, time\n'
           's = socket.create_connection(("127.0.0.1", int(sys.argv[1])))\n'
           'sys.stdout.write("ok\\n"); sys.stdout.flush()\n'
           'time.sleep(120)\n')
SLEEP = 'import sys, time\nsys.stdout.write("ok\\n"); sys.stdout.flush()\ntime.sleep(120)\n'


class Kids(object):
    """Processes this test started (killed and reaped by Popen object at the end)."""

    def __init__(self):
        self.procs = []

    def python(self, code, *args, env=None):
        full_env = dict(os.environ)
        full_env.update(env or {})
        proc = subprocess.Popen([sys.executable, '-c', code] + list(args), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=full_env)
        self.procs.append(proc)
        assert proc.stdout.readline().strip() == b'ok'
        return proc

    def binary(self, path, argv):
        proc = subprocess.Popen(argv, executable=path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.path.realpath('/proc/%d/exe' % proc.pid) == os.path.realpath(path):
                    return proc
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError('%s did not start' % path)

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture
def kids():
    k = Kids()
    yield k
    k.close()


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(('127.0.0.1', 0))
    server.listen(8)
    accepted = []
    yield server, accepted
    for conn in accepted:
        conn.close()
    server.close()


def snapshot_of(pids, containers=None, util=100):
    """A Snapshot listing ``pids`` on GPU 0, joined with the real process table."""
    dev = Device(vendor='nvidia', vendor_index=0, index=0, uuid='GPU-test-0', memory_total_mib=81559, memory_used_mib=0,
                 utilization_pct=util, minor=0)
    result = ProcessInventory(scan_fds=False).scan(pids)
    procs = []
    for pid in pids:
        dev.add_driver_process(pid, 1024, 'compute')
        proc = GpuProcess(pid=pid)
        proc.add_gpu(0, 1024, ['compute'])
        proc.join(result.record(pid))
        if containers and pid in containers:
            proc.container = containers[pid]
        procs.append(proc)
    return Snapshot(backends={}, devices=[dev], all_devices=[dev], processes=procs, holders=[], taken_at=time.time())


def by_id(finding):
    return dict((r['id'], r['evidence']) for r in finding['rules'])


def test_collector_reads_env_maps_sockets_and_parents(kids, listener):
    server, accepted = listener
    port = server.getsockname()[1]
    proc = kids.python(CONNECT, str(port), '-o', 'stratum+tcp://pool.example.net:3333', '-u', XMR,
                       env={'GPU_MAX_ALLOC_PERCENT': '100'})
    accepted.append(server.accept()[0])
    snap = snapshot_of([proc.pid])
    facts = rogue.FactsCollector(allocation='never').collect(snap)[0]
    assert facts.pid == proc.pid and facts.listed
    assert facts.env is not None and facts.env['GPU_MAX_ALLOC_PERCENT'] == '100'
    assert facts.maps is not None and any('.so' in m for m in facts.maps)
    assert ['127.0.0.1:%d' % port] == [c.text() for c in facts.connections if c.port == port]
    assert facts.connections[0].state == 'ESTABLISHED'
    assert facts.parents[0]['pid'] == os.getpid()
    assert facts.exe and os.path.realpath(facts.exe) == os.path.realpath(sys.executable)
    assert facts.gpu_indexes == [0] and facts.used_mib == 1024 and facts.gpu_memory_total_mib == 81559
    config = rogue.load_config(rules={'pools': ['127.0.0.1/32']})
    finding = rogue.Detector(config).evaluate(facts)
    rules = by_id(finding)
    assert rules['H-pool-conn'][0]['value'] == '127.0.0.1:%d' % port
    assert rules['H-stratum'][0]['value'] == 'stratum+tcp://pool.example.net:3333'
    assert 'H-wallet' in rules and 'S-miner-env' in rules
    assert finding['level'] == 'critical'


def test_collector_without_root_skips_other_users_environment(kids):
    proc = kids.python(SLEEP, env={'GPU_MAX_ALLOC_PERCENT': '100'})
    collector = rogue.FactsCollector(allocation='never')
    collector.euid = os.geteuid() + 4242            # pretend to be another, unprivileged user
    facts = collector.collect(snapshot_of([proc.pid]))[0]
    assert facts.env is None
    assert any('environment not read' in n for n in facts.notes)


def test_deleted_hidden_executable_and_sha256(kids):
    root = tempfile.mkdtemp(prefix='gpufleet-rogue-')
    try:
        hidden = os.path.join(root, '.cache-x')
        os.mkdir(hidden)
        path = os.path.join(hidden, 'sleeper')
        shutil.copy2(shutil.which('sleep'), path)
        with open(path, 'rb') as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        proc = kids.binary(path, ['python', '600'])
        os.unlink(path)
        facts = rogue.FactsCollector(allocation='never').collect(snapshot_of([proc.pid]))[0]
        assert facts.exe == path + ' (deleted)'
        assert facts.sha256() == digest                 # read through /proc/PID/exe, even though deleted
        rules = by_id(rogue.Detector().evaluate(facts))
        notes = [e['note'] for e in rules['S-exe-location']]
        assert any('deleted' in n for n in notes) and any('.cache-x' in n for n in notes)
        assert 'claims to be python' in rules['S-masquerade'][0]['note']
    finally:
        shutil.rmtree(root)


def test_allowlist_by_exe_and_sha256_live(kids):
    root = tempfile.mkdtemp(prefix='gpufleet-rogue-')
    try:
        path = os.path.join(root, 'gpu-burn')
        shutil.copy2(shutil.which('sleep'), path)
        with open(path, 'rb') as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        proc = kids.binary(path, [path, '600'])
        good = rogue.load_config(rules={'allowlist': [{'exe': path, 'sha256': digest}]})
        bad = rogue.load_config(rules={'allowlist': [{'exe': path, 'sha256': '0' * 64}]})
        snap = snapshot_of([proc.pid])
        # /tmp location makes it a finding; the allowlist entry matches only with the right hash.
        finding = rogue.detect_snapshot(snap, config=good, allocation='never')[0][0]
        assert finding['allowlisted']['match'] == 'exe+sha256' and finding['level'] == 'info'
        assert rogue.detect_snapshot(snap, config=bad, allocation='never')[0][0]['allowlisted'] is None
    finally:
        shutil.rmtree(root)


def test_allocation_auto(kids):
    a = kids.python(SLEEP)
    b = kids.python(SLEEP)
    plain = snapshot_of([a.pid])
    assert rogue.FactsCollector(allocation='always').collect(plain)[0].allocation_expected is True
    assert rogue.FactsCollector(allocation='never').collect(plain)[0].allocation_expected is False
    mixed = snapshot_of([a.pid, b.pid], containers={b.pid: ContainerInfo(id='ab' * 32, runtime='docker')})
    facts = dict((f.pid, f) for f in rogue.FactsCollector(allocation='auto').collect(mixed))
    assert facts[a.pid].allocation_expected is True
    assert 'S-no-allocation' in by_id(rogue.Detector().evaluate(facts[a.pid]))
    assert rogue.Detector().evaluate(facts[b.pid]) is None or 'S-no-allocation' not in by_id(rogue.Detector().evaluate(facts[b.pid]))
    with pytest.raises(rogue.InvalidArgument):
        rogue.FactsCollector(allocation='sometimes')


def test_not_visible_and_reused_pids(kids):
    proc = kids.python(SLEEP)
    snap = snapshot_of([proc.pid])
    snap.processes[0].starttime += 1                   # as if the pid had been reused since the snapshot
    facts = rogue.FactsCollector(allocation='never').collect(snap)[0]
    assert any('exited or was reused' in n for n in facts.notes)
    assert facts.env is None and facts.maps is None
    snap.processes[0].status = 'not_found'
    facts = rogue.FactsCollector(allocation='never').collect(snap)[0]
    assert any('not visible here' in n for n in facts.notes)


def test_history_feeds_flat_utilization(kids, tmp_path):
    proc = kids.python(SLEEP)
    snap = snapshot_of([proc.pid], util=100)
    db = str(tmp_path / 'history.db')
    now = time.time()
    for minute in range(40, -1, -1):
        history.record_samples(db, snap, now=now - 60 * minute, interval_s=60)
    snap.taken_at = now
    facts = rogue.FactsCollector(history_path=db, allocation='never').collect(snap)[0]
    # the collector reads one window (plus a minute) back
    assert len(facts.util_series) == sum(1 for m in range(41) if 60 * m <= rogue.R.WINDOW_S + 60)
    assert facts.util_series[-1][1] == 100.0
    assert facts.mem_series[-1][1] == 1024.0
    rules = by_id(rogue.Detector().evaluate(facts))
    assert 'B-flat-util' in rules and 'B-flat-mem' in rules
    # an unreadable history is a warning, not a failure
    bad = tmp_path / 'bad.db'
    bad.write_bytes(b'not a database' * 100)
    collector = rogue.FactsCollector(history_path=str(bad), allocation='never')
    assert collector.collect(snap)[0].util_series == []
    assert collector.warnings


def test_selector_uses_the_detector(kids):
    miner = kids.python(SLEEP, '-o', 'stratum+tcp://pool.example.net:3333', '-u', XMR)
    legit = kids.python(SLEEP, 'train.py')
    snap = snapshot_of([miner.pid, legit.pid])
    detector = rogue.selector_detector(allocation='never')
    found = detector(snap, 'critical')
    assert list(found) == [miner.pid]
    assert found[miner.pid]['level'] == 'critical'
    selector = Selector(rogue=True, rogue_detector=detector)
    matches = selector.select(snap)
    assert [m.proc.pid for m in matches] == [miner.pid]
    assert matches[0].reasons == ['rogue: critical (score 100)']
