# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team, hostile load (issue #28, docs/security.md T69-T71): a user who opens descriptors, processes and fd
tables to slow the holder scan, or to hide a GPU holder from it.

The scan's work is bounded (core/fdwalk.py) and the tests assert on counted work (links read, names listed,
processes visited), never on wall-clock time.  Each attack checks three things: the work stays within the
bound, the holders that matter (the driver's processes, small holders) are still found or the result says
what was left, and nothing is signalled that should not be.

The end-to-end attacks run in a PID namespace of their own (tests/unit/security/redteam.py): the entry points
see only the scenario's processes, and signal only those.  The others walk the test's own children.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import fdwalk, guard, processes, reclaim
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import GpuProcess
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, proc, snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam

# A process holding COUNT descriptors: /dev/null on 3..COUNT-1, then (when DEVICE is given) DEVICE at COUNT,
# the end of its table; GAP > 1 leaves only every GAP-th number open (a sparse table).  It says "ready" and waits.
HOLD = r'''
import os, resource, signal, sys
count, device, gap = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
null = os.open('/dev/null', os.O_RDONLY)
for fd in range(4, count):
    if fd % gap == 0 or gap == 1:
        os.dup2(null, fd)
last = count
if device:
    gpu = os.open(device, os.O_RDONLY)
    if gpu != last:
        os.dup2(gpu, last)
        os.close(gpu)
sys.stdout.write('ready\n')
sys.stdout.flush()
signal.pause()
'''
# A process that holds DEVICE on fd 3 and keeps opening and closing descriptors 10..10+SPAN while it runs.
# It raises its soft RLIMIT_NOFILE as HOLD does: ansible-test runs the units under a soft limit of 1024, where
# dup2 to fd 1024 would end it (and the walks would read a zombie's empty table).
CHURN = r'''
import os, resource, sys
device, span = sys.argv[1], int(sys.argv[2])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
gpu = os.open(device, os.O_RDONLY)
assert gpu == 3, gpu
null = os.open('/dev/null', os.O_RDONLY)
sys.stdout.write('ready\n')
sys.stdout.flush()
while True:
    for fd in range(10, 10 + span):
        os.dup2(null, fd)
    for fd in range(10, 10 + span):
        os.close(fd)
'''


def table_size():
    """The descriptors one hostile process of this test holds: 19,990 (the issue's), or what RLIMIT_NOFILE allows."""
    return min(19990, resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 16)


needs_large_tables = pytest.mark.skipif(table_size() <= fdwalk.LARGE_FLOOR + fdwalk.ORDINARY_TABLE,
                                        reason='RLIMIT_NOFILE too low for tables larger than the bound of large tables')


class Holders(object):
    """The hostile processes of one test (its own children): started as a user, ended by their Popen handle."""

    def __init__(self):
        self.procs = []

    def start(self, count, device='', user=None, gap=1, code=HOLD):
        python, kwargs = sys.executable, {}
        if user:   # an interpreter the user may run (the venv's may live where others cannot enter)
            python, kwargs = h.python_for_user(user, ('resource',))[0], h._as_user(user)
        argv = [python, '-c', code] + ([str(count), device, str(gap)] if code is HOLD else [device, str(count)])
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 start_new_session=True, **kwargs)   # not the reclaiming process's session (protected)
        self.procs.append(child)
        line = child.stdout.readline()
        assert line == b'ready\n', 'a hostile process did not start (%r)' % line
        return child.pid

    def close(self):
        for child in self.procs:
            if child.poll() is None:
                child.kill()
            child.wait(30)
            child.stdout.close()
        self.procs = []


def fd_count(pid):
    return len(os.listdir('/proc/%d/fd' % pid))


def register(node, pid, gpu, mib, user):
    """Make the simulated driver list ``pid`` on ``gpu`` (as it lists a CUDA process), by the node's state file."""
    with open(node.sim.state) as handle:
        state = json.load(handle)
    state['processes'].append(h.make_process(pid, gpu, mib, user=user, argv=['python3', 'serve.py']))
    h.write_state(node.sim.state, state)


# ---------------------------------------------------------------------------- end to end, in a PID namespace
FAKE_SLURM = {'squeue': '#!/bin/sh\nprintf \'{"jobs": []}\\n\'\n',
              'scontrol': '#!/bin/sh\n[ "$1" = listpids ] && echo "PID JOBID STEPID LOCALID GLOBALID"\nexit 0\n'}


def scenario_descriptor_flood(node):
    """Alice floods the node with fd tables of /dev/null (more than the whole bound) and hides a GPU holder at the end
    of one more; bob holds GPU 1's device file in a small table; carol runs a GPU job; the driver lists two more
    processes with huge tables: alice's server with its GPU file at the end, and a pid of bob's that holds no GPU
    file (as another PID namespace's pid would look here).  Then gpu_facts, the Slurm prolog of a job on GPU 1,
    gpu_kill of the two listed pids, and gpu_kill orphans=true run as Ansible and slurmd run them."""
    holders = Holders()
    try:
        per = table_size()
        floods = [holders.start(per, user='alice') for _flood in range(fdwalk.DESCRIPTORS // per + 2)]
        hidden = holders.start(per, os.path.join(node.sim.dev, 'nvidia1'), user='alice')
        small = holders.start(8, os.path.join(node.sim.dev, 'nvidia1'), user='bob')
        job = node.spawn('carol', gpu=0, mib=2 * redteam.GIB)
        server = holders.start(per, os.path.join(node.sim.dev, 'nvidia0'), user='alice')
        collision = holders.start(per, user='bob')
        register(node, server, 0, 4 * redteam.GIB, 'alice')
        register(node, collision, 0, 4 * redteam.GIB, 'bob')
        facts_rc, facts, facts_signalled, facts_err = node.module('gpu_facts', vendor='nvidia')
        bindir = os.path.join(node.work, 'bin')
        os.mkdir(bindir)
        for name, text in FAKE_SLURM.items():
            with open(os.path.join(bindir, name), 'w') as handle:
                handle.write(text)
            os.chmod(os.path.join(bindir, name), 0o755)
        metrics = os.path.join(node.work, 'prolog.prom')
        os.environ.update(PATH=bindir + os.pathsep + os.environ['PATH'], SLURM_JOB_ID='77', SLURM_JOB_GPUS='1',
                          SLURM_JOB_UID=str(node.uids['carol']), SLURMD_NODENAME='node01')
        prolog = node.cli('prolog', '--json', '--dry-run', '--no-drain', '--vendor', 'nvidia', '--script-metrics', metrics)
        with open(metrics) as handle:
            prom = handle.read()
        kill = node.module('gpu_kill', pids=[server, collision], timeout=5, force=True, audit_log='', release_timeout=5)
        alive_after_kill = dict((pid, node_alive(pid)) for pid in (server, collision))
        orphans = node.module('gpu_kill', orphans=True, timeout=5, force=True, audit_log='', release_timeout=5)
        return {'per': per, 'floods': floods, 'hidden': hidden, 'small': small, 'job': job, 'server': server,
                'collision': collision, 'facts': [facts_rc, facts, facts_signalled, facts_err], 'prolog': prolog, 'prom': prom,
                'kill': kill, 'alive_after_kill': alive_after_kill, 'orphans': orphans,
                'alive': dict((pid, node_alive(pid)) for pid in floods + [hidden, small, job, collision])}
    finally:
        holders.close()


def node_alive(pid):
    """Alive and not a zombie (the scenario's processes are its own children, reaped when they end)."""
    try:
        with open('/proc/%d/stat' % pid) as handle:
            return handle.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
    except OSError:
        return False


@pytest.fixture(scope='module')
def flood():
    if table_size() <= fdwalk.LARGE_FLOOR + fdwalk.ORDINARY_TABLE:
        pytest.skip('RLIMIT_NOFILE too low for tables larger than the bound of large tables')
    return redteam.run(scenario_descriptor_flood, timeout=600)


@redteam.needs_namespace
def test_a_descriptor_flood_is_left_unread_and_reported_and_small_holders_are_still_found(flood):
    """T69: gpu_facts reads every small table and the driver's processes, leaves alice's flood (and the GPU holder
    she hid at the end of a huge table), and says so in holders_incomplete, naming her processes."""
    rc, result, signalled, err = flood['facts']
    assert rc == 0 and signalled == [], err
    assert 'were not read' in json.dumps(result['warnings'])
    facts = result['ansible_facts']['gpu']
    holders = dict((holder['pid'], holder) for holder in facts['holders'])
    assert flood['small'] in holders and holders[flood['small']]['devices'][0].endswith('/nvidia1')
    assert flood['hidden'] not in holders and not set(flood['floods']) & set(holders)
    listed = dict((p['pid'], p) for p in facts['processes'])
    assert {flood['job'], flood['server'], flood['collision']} <= set(listed)
    incomplete = facts['holders_incomplete']
    left = set(entry['pid'] for entry in incomplete['largest'])
    assert incomplete['reason'] == 'large tables' and incomplete['limit'] == fdwalk.DESCRIPTORS
    assert incomplete['processes'] == len(flood['floods']) + 1 and left == set(flood['floods']) | {flood['hidden']}
    assert all(entry['user'] == 'alice' and entry['fds'] >= flood['per'] for entry in incomplete['largest'])
    # the counted work: the driver's two huge tables (read first, in full) and the small ones; no flood table
    assert incomplete['read'] <= 2 * (flood['per'] + 8) + fdwalk.ORDINARY_TABLE
    assert incomplete['descriptors'] >= (len(flood['floods']) + 1) * flood['per']


@redteam.needs_namespace
def test_the_prolog_under_a_flood_sees_the_small_holder_and_reports_what_it_left(flood):
    """T70: the prolog of a job on GPU 1 stays within the bound, finds bob's holder of GPU 1 (blocking), reports the
    flood in its result and its metrics, and refuses (dry run) for bob's holder only, never for the flood."""
    rc, result, signalled, err = flood['prolog']
    assert rc == 0 and signalled == [], err
    assert [entry['pid'] for entry in result['blocking']] == [flood['small']]
    assert result['would_refuse'] is True and result['unreleased'][0]['pids'] == [flood['small']]
    incomplete = result['holders_incomplete']
    assert incomplete['processes'] == len(flood['floods']) + 1 and incomplete['read'] <= fdwalk.DESCRIPTORS
    assert any('were not read' in warning for warning in result['warnings'])
    assert 'gpufleet_slurm_prolog_holders_unread{node="node01"} %d' % (len(flood['floods']) + 1) in flood['prom']


@redteam.needs_namespace
def test_the_driver_listed_pids_are_decided_under_a_flood_and_only_the_gpu_holder_is_signalled(flood):
    """T71 (and T3 under load): the driver's pids are read first whatever the flood: alice's server, whose GPU file is
    the last of 19,990 descriptors, is signalled; bob's listed pid with as many descriptors and no GPU file is not
    (it may be another PID namespace's pid)."""
    rc, result, signalled, err = flood['kill']
    assert rc == 0 and signalled == [flood['server']], err
    skipped = dict((entry['pid'], entry['reason']) for entry in result['skipped_processes'])
    assert 'holds no GPU device file' in skipped[flood['collision']]
    assert result['unchecked'] is None
    assert flood['alive_after_kill'] == {str(flood['server']): False, str(flood['collision']): True}   # (JSON keys)


@redteam.needs_namespace
def test_orphans_under_a_flood_signal_only_the_holder_that_was_seen(flood):
    """gpu_kill orphans=true ends bob's small holder; alice's flood and her hidden holder (not seen: reported) and
    carol's job are never signalled."""
    rc, result, signalled, err = flood['orphans']
    assert rc == 0 and signalled == [flood['small']], err
    assert 'were not read' in json.dumps(result['warnings'])   # (ansible-core's warning objects, or texts)
    alive = dict((int(pid), value) for pid, value in flood['alive'].items())
    assert alive.pop(flood['small']) is False and all(alive.values())


def scenario_many_processes(node):
    """In the namespace: 300 idle processes, a small GPU holder started last, three large tables; the walk of every
    process under budgets that fit the ordinary tables and not the large ones, then one that fits half of them."""
    holders = Holders()
    idle = []
    try:
        for _idle in range(300):
            idle.append(subprocess.Popen(['sleep', '600'], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL))
        large = [holders.start(3 * fdwalk.ORDINARY_TABLE) for _large in range(3)]
        with open(os.path.join(node.sim.dev, 'nvidia0')) as device:
            small = subprocess.Popen(['sleep', '600'], stdin=device, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        idle.append(small)
        h.wait_for(lambda: all(processes.read_cmdline(p.pid) == ['sleep', '600'] for p in idle), timeout=60, what='the sleeps')
        counts = {}
        for name in os.listdir('/proc'):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    counts[int(name)] = fd_count(int(name))
                except OSError:
                    continue
        ordinary = sum(count for count in counts.values() if count <= fdwalk.ORDINARY_TABLE)
        out = {'small': small.pid, 'large': large, 'processes': len(counts), 'ordinary': ordinary, 'walks': []}
        for limit in (ordinary + fdwalk.ORDINARY_TABLE, ordinary // 2):
            budget = fdwalk.FdBudget(descriptors=limit, seconds=None)
            found, readable, _denied = processes.scan_device_fds('/proc', node.sim.dev_roots, exclude=[os.getpid()], budget=budget)
            out['walks'].append({'limit': limit, 'holders': sorted(found), 'readable': len(readable), 'readlinks': budget.readlinks,
                                 'listed': budget.listed, 'visited': budget.visited, 'unread': sorted(budget.unread),
                                 'incomplete': budget.incomplete()})
        return out
    finally:
        for child in idle:
            child.kill()
            child.wait(30)
        holders.close()


@redteam.needs_namespace
def test_many_processes_small_tables_first_and_the_bound_holds():
    """T69: with a budget that holds every ordinary table, the walk reads them all (the small GPU holder started last
    among them) and leaves exactly the three large tables; with half of that, it stays within the bound and reports
    what it left.  Every process is visited; counted work never passes the bound."""
    out = redteam.run(scenario_many_processes, timeout=300)
    roomy, tight = out['walks']
    assert roomy['holders'] == [out['small']] and roomy['unread'] == sorted(out['large'])
    assert roomy['readlinks'] + roomy['listed'] <= roomy['limit'] and roomy['visited'] == out['processes']
    assert roomy['incomplete']['processes'] == 3 and roomy['incomplete']['reason'] == 'descriptors'
    assert tight['readlinks'] + tight['listed'] <= tight['limit'] and tight['visited'] == out['processes']
    assert set(out['large']) <= set(tight['unread']) and tight['incomplete']['processes'] == len(tight['unread'])
    assert tight['readable'] + len(tight['unread']) == out['processes']


# ---------------------------------------------------------------------------- the walk, on the test's own children
@pytest.fixture
def children():
    """The hostile processes of one test, ended after it whatever it asserted."""
    holders = Holders()
    try:
        yield holders
    finally:
        holders.close()


@pytest.fixture
def dev(tmp_path):
    root = tmp_path / 'dev'
    root.mkdir()
    for name in ('nvidia0', 'nvidia1', 'nvidiactl'):
        (root / name).write_text('')
    return str(root)


def _procfs_counts():
    if not os.path.isdir('/proc/self/fd') or not fdwalk.fd_dirs_report_counts():
        pytest.skip('procfs without fd counts (Linux < 6.2)')


@needs_large_tables
def test_a_gpu_file_at_the_end_of_a_huge_table_is_found_by_the_check_before_signalling(children, dev):
    """T71: the listed process about to be signalled whose files the snapshot did not read is read now, to its GPU
    file at the end of 19,990 descriptors, within its own bound; with a bound smaller than its table it stays
    undecided, and reclaim does not signal it (not even as "holds no GPU file")."""
    per = table_size()
    pid = children.start(per, os.path.join(dev, 'nvidia0'))
    listed = GpuProcess(pid=pid, status='sleeping')
    budget = fdwalk.FdBudget(descriptors=fdwalk.VICTIM_DESCRIPTORS, seconds=None)
    assert processes.check_device_holding([listed], dev_roots=[dev], budget=budget) == []
    assert listed.device_paths == [os.path.join(dev, 'nvidia0')] and listed.holds_gpu_device is True
    assert budget.readlinks + budget.listed <= 2 * (per + 1) + fdwalk._FD_GAPS + 1
    undecided = GpuProcess(pid=pid, status='sleeping')
    small = fdwalk.FdBudget(descriptors=per // 2, seconds=None)
    assert processes.check_device_holding([undecided], dev_roots=[dev], budget=small) == [pid]
    assert undecided.device_paths is None and small.used <= per // 2 and small.unread == {pid: per + 1}


@needs_large_tables
def test_reclaim_skips_a_listed_pid_it_could_not_check_and_one_that_holds_no_gpu_file(children, dev, monkeypatch):
    """T71: gpu_kill's plan (the guard's too) checks the listed victims' files before signalling: one bound per run.
    A victim whose table is larger than what is left is skipped with the reason and reported as ``unchecked``; one
    whose whole table holds no GPU device file is skipped as a possible other PID namespace's pid (T3)."""
    per = table_size()
    server = children.start(per, os.path.join(dev, 'nvidia0'))
    other = children.start(per)
    snap = snapshot([proc(server, 'alice', {0: 4 * GIB}, starttime=h.starttime(server)),
                     proc(other, 'bob', {0: 4 * GIB}, starttime=h.starttime(other))])
    for entry in snap.processes:
        entry.device_paths = None     # as a snapshot that did not read them leaves them
    protection = reclaim.killer.Protection(protect_names=(), euid=0)
    monkeypatch.setattr(fdwalk, 'VICTIM_DESCRIPTORS', per // 2)
    plan = reclaim.plan(snap, Selector(pids=[server, other]), reclaim.ReclaimOptions(), protection, dev_roots=[dev])
    assert plan.victims == [] and plan.unchecked['processes'] == 2
    assert all('holds more open files than this run reads' in entry['reason'] for entry in plan.skipped)
    monkeypatch.setattr(fdwalk, 'VICTIM_DESCRIPTORS', 1 << 20)
    for entry in snap.processes:
        entry.device_paths = None
    plan = reclaim.plan(snap, Selector(pids=[server, other]), reclaim.ReclaimOptions(), protection, dev_roots=[dev])
    assert [victim.pid for victim in plan.victims] == [server] and plan.unchecked is None
    assert [entry['pid'] for entry in plan.skipped] == [other] and 'holds no GPU device file' in plan.skipped[0]['reason']


@needs_large_tables
def test_the_tick_reports_a_victim_it_could_not_check_and_signals_it_once_it_can(children, dev, tmp_path, monkeypatch):
    """T71: a tick that may not read a victim's whole table in its bound leaves it alive, logs it as skipped, says so
    in its summary, its warnings and the gpufleet_guard_unchecked_processes metric; a later tick with the room
    signals it (our own child)."""
    per = table_size()
    victim = children.start(per, os.path.join(dev, 'nvidia0'))
    snap = snapshot([proc(victim, 'alice', {0: 12 * GIB}, starttime=h.starttime(victim))])
    snap.processes[0].device_paths = None
    paths, settings = guard.Paths(root=str(tmp_path)), guard.Settings(release_timeout=1.0, utmp_paths=())
    os.makedirs(os.path.dirname(paths.policy))
    with open(paths.policy, 'w') as handle:
        handle.write('mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 8}}\n'
                     'escalation: {act_after: 0s, retry_after: 1m}\nnotify: {tty: false}\n')
    os.chmod(paths.policy, 0o644)

    def tick(now):
        return guard.run_tick(paths, settings, now=now, snapshot=snap, context=guard.policy_mod.Context(groups={}), dev_roots=[dev])
    monkeypatch.setattr(fdwalk, 'VICTIM_DESCRIPTORS', per // 2)
    summary = tick(1000.0)
    outcome = summary['decisions'][0]['outcome']['pids'][victim]
    assert outcome['outcome'] == 'skipped' and 'holds more open files than this run reads' in outcome['reason']
    assert summary['unchecked_processes'] == 1 and any('hold more open files than one tick reads' in w for w in summary['warnings'])
    with open(paths.metrics) as handle:
        assert 'gpufleet_guard_unchecked_processes 1' in handle.read()
    assert children.procs[0].poll() is None
    monkeypatch.setattr(fdwalk, 'VICTIM_DESCRIPTORS', 1 << 20)
    snap.processes[0].device_paths = None
    summary = tick(1120.0)
    assert summary['decisions'][0]['outcome']['pids'][victim]['outcome'] == 'killed' and 'unchecked_processes' not in summary
    assert children.procs[0].wait(30) == -signal.SIGTERM


def test_gaps_in_a_huge_table_cost_the_listing_within_the_bound(children, dev):
    """T53 under the bound: a sparse table (only every 4th number open, the GPU file last) is listed and read within
    the bound, and its GPU file is found; a bound smaller than the listing cuts it and says so."""
    _procfs_counts()
    count = min(4 * fdwalk.ORDINARY_TABLE, table_size())
    pid = children.start(count, os.path.join(dev, 'nvidia1'), gap=4)
    open_fds = fd_count(pid)
    budget = fdwalk.FdBudget(seconds=None)
    found = processes.scan_device_fds('/proc', [dev], pids=[pid], budget=budget)[0]
    assert found == {pid: [os.path.join(dev, 'nvidia1')]} and budget.unread == {}
    assert budget.listed <= open_fds + 1 and budget.readlinks <= 2 * open_fds + fdwalk._FD_GAPS + 1
    tight = fdwalk.FdBudget(descriptors=open_fds // 2, seconds=None)
    walked = list(fdwalk.walk_fd_links('/proc', [pid], budget=tight))
    assert [item[3] for item in walked] == [None] and tight.used <= open_fds // 2 and pid in tight.unread


def test_a_process_opening_and_closing_descriptors_during_the_walk(children, dev):
    """A table that changes while it is read (descriptors opened and closed in a loop) never makes a walk pass its
    bound, and the GPU file the process keeps on fd 3 is found by every walk."""
    _procfs_counts()
    pid = children.start(4000, os.path.join(dev, 'nvidia0'), code=CHURN)
    device = processes._device_matcher([dev])[1]
    for _walk in range(20):
        assert children.procs[-1].poll() is None, 'the churning process ended (%r)' % children.procs[-1].returncode
        budget = fdwalk.FdBudget(descriptors=1500, seconds=None)
        walked = list(fdwalk.walk_fd_links('/proc', [pid], budget=budget))
        assert budget.used <= 1500 and len(walked) == 1
        assert [target for target in walked[0][2] if device(target)] == [os.path.join(dev, 'nvidia0')], \
            (walked[0][1][:6], walked[0][2][:6], walked[0][3], children.procs[-1].poll())
        check = GpuProcess(pid=pid, status='running')
        assert processes.check_device_holding([check], dev_roots=[dev]) == [] and check.device_paths == [os.path.join(dev, 'nvidia0')]


def test_the_time_bound_leaves_the_rest_and_says_so(children, dev):
    """The deadline of a walk (a clock seam: no wall-clock assertion) leaves every process not started yet."""
    pids = [children.start(8) for _child in range(3)]
    ticks = iter(range(1000))
    budget = fdwalk.FdBudget(descriptors=None, seconds=1.5, clock=lambda: next(ticks))
    list(fdwalk.walk_fd_links('/proc', pids, budget=budget))
    assert budget.incomplete()['reason'] == 'time' and len(budget.unread) == 2
    assert budget.incomplete()['largest'][0]['pid'] in pids


def test_gpu_reset_warns_and_does_not_refuse_when_the_scan_is_incomplete(monkeypatch):
    """T70: a reset whose holder scan stopped at its bound names what it left (a warning): refusing would let any user
    block every reset by opening descriptors; a holder left unseen makes the driver refuse the reset itself."""
    from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core import test_reset as R
    if h.sim_build() is None or h.gpusim_path() is None:
        pytest.skip('simulator not built: run `make sim`')
    with h.gpusim_node(gpus=1) as sim:
        sim.spawn(gpu=0, mib=1024)
        monkeypatch.setattr(fdwalk, 'DESCRIPTORS', 2)
        result = R.run(sim, check_mode=True, gpus=['0'], kill_processes=True)
        check = R.check_of(R.by_index(result)[0], 'blocking_clients')
        assert check['status'] == 'warn' and 'were not read' in check['detail'] and 'the reset fails' in check['detail']
        assert R.check_of(R.by_index(result)[0], 'processes')['status'] == 'pass'


def test_counted_work_of_an_unloaded_walk_is_its_descriptors(children, dev):
    """The fast path stays one stat and N readlinks per process: no listing, nothing left, for ordinary tables."""
    _procfs_counts()
    pids = [children.start(8), children.start(40, os.path.join(dev, 'nvidiactl'))]
    budget = fdwalk.FdBudget()
    found = processes.scan_device_fds('/proc', [dev], pids=pids, budget=budget)[0]
    assert found == {pids[1]: [os.path.join(dev, 'nvidiactl')]}
    assert budget.listed == 0 and budget.visited == 2 and budget.unread == {}
    assert budget.readlinks == sum(fd_count(pid) for pid in pids)


def test_a_snapshot_reads_the_listed_pids_first_and_reports_the_rest(children, dev):
    """The inventory's walk gives the driver's pids the first claim on the budget: with a budget smaller than one
    flood table, the listed process is still read and the flood is what is left (holders_incomplete)."""
    _procfs_counts()
    per = table_size()
    if per <= 2100:
        pytest.skip('RLIMIT_NOFILE too low for a table larger than the budget of this test')
    flood = children.start(per)
    listed = children.start(16, os.path.join(dev, 'nvidia0'))
    inventory = processes.ProcessInventory(dev_roots=[dev], fd_budget=lambda: fdwalk.FdBudget(descriptors=2000, seconds=None))
    result = inventory.scan([listed])
    assert result.record(listed).device_paths == [os.path.join(dev, 'nvidia0')]
    left = dict((entry['pid'], entry) for entry in result.incomplete['largest'])
    assert flood not in result.readable and result.incomplete['processes'] >= 1
    if flood in left:
        assert left[flood]['fds'] == per and left[flood]['user'] == 'root'
    else:   # the host's /proc: larger tables of other tests running beside this one are named first, as they should be
        assert len(left) == fdwalk.REPORTED and all(entry['fds'] >= per for entry in left.values()), left
