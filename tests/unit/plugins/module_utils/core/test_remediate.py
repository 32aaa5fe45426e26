# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.remediate: the planner on constructed snapshots, and the ladder against the simulator.

SAFETY: resets run only through the simulator's fake nvidia-smi; the drain commands are scripts
these tests write (they record their argv); the only processes signalled are gpusim workloads
this test spawned.  The Xid events (model.XidEvent, classified by core/xid.py, as the snapshot makes them)
and recovery actions are attached to the snapshots here, or come from the simulator's kernel log (gpusim xid).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import remediate as rem
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes, reset, xid
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import guard_test_helpers as g

SIM_BIN = os.path.join(h.sim_dir(), 'bin') if h.sim_dir() else None
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='the fake nvidia-smi resets only as root, like the real one')
BUS = ['00000000:07:00.0', '00000000:0B:00.0', '00000000:48:00.0']

RECORDER = r'''#!%(python)s
# Fake %(name)s of the remediation tests: appends its argv as one JSON line, answers rc %(rc)d.
import json, os, sys
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), '%(name)s.log'), 'a') as log:
    log.write(json.dumps(sys.argv[1:]) + '\n')
sys.exit(%(rc)d)
'''


def recorder(tmp_path, name, rc=0):
    """A script that records its argv (never the real tool); returns (path, reader)."""
    bindir = tmp_path / 'bin'
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text(RECORDER % {'python': sys.executable, 'name': name, 'rc': rc})
    path.chmod(0o755)

    def calls():
        log = bindir / ('%s.log' % name)
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return str(path), calls


def event(code, pid=None, when=None, bus=BUS[0], name=None):
    """An Xid as the driver logs it: a pid's record names its comm (``name``, default read from /proc)."""
    if name is None and pid is not None and os.path.exists('/proc/%d/comm' % pid):
        with open('/proc/%d/comm' % pid) as handle:
            name = handle.read().rstrip('\n')
    return xid.make_event(code, 'kmsg', time_s=when if when is not None else g.MONDAY_NOON, pid=pid, pci_bus_id=bus,
                          name=name, message='simulated Xid %d' % code)


def options(tmp_path=None, **kwargs):
    if tmp_path is not None:
        kwargs.setdefault('reboot_flag', str(tmp_path / 'lib' / 'reboot-wanted'))
        kwargs.setdefault('state_path', str(tmp_path / 'lib' / 'remediation.json'))
    else:
        kwargs.setdefault('reboot_flag', None)
        kwargs.setdefault('state_path', None)
    return rem.RemediateOptions(**kwargs)


def names(ladder):
    return [s.name for s in ladder.steps]


# ---------------------------------------------------------------------------- the planner
@pytest.mark.parametrize('code, steps', [
    (13, ['kill_application']),          # application fault: the pid the event names
    (31, ['kill_application']),
    (43, ['kill_application']),
    (48, ['reset']),                     # double-bit ECC: the GPU
    (95, ['reset']),
    (119, ['reset']),
    (64, ['drain']),                     # row remapping failed: take no new work
    (79, ['drain', 'reboot_flag']),      # fallen off the bus: a reset cannot help
    (92, []),                            # high corrected-ECC rate: informational (core/xid.py's table)
    (45, []),                            # preemptive cleanup after another error: informational
    (9999, []),                          # not in the table: recorded, nothing done
])
def test_each_xid_class_gets_its_ladder(code, steps):
    snap = g.snapshot([g.proc(100, 'alice', {1: 2048})])
    snap.all_devices[1].xid_events = [event(code, pid=100, bus=BUS[1])]
    ladder = rem.plan_remediation(snap, options())[1]
    assert names(ladder) == steps
    assert ladder.findings[0]['code'] == code and ladder.findings[0]['source'] == 'xid'
    if steps == ['kill_application']:
        assert ladder.steps[0].pid == 100 and ladder.findings[0]['fault'] == 'application'
    assert all(names(other) == [] for other in rem.plan_remediation(snap, options()) if other.dev.index != 1)


def test_an_application_xid_without_a_pid_or_with_kill_off_is_only_recorded():
    snap = g.snapshot([g.proc(100, 'alice', {0: 2048})])
    snap.all_devices[0].xid_events = [event(13)]
    assert names(rem.plan_remediation(snap, options())[0]) == []
    snap.all_devices[0].xid_events = [event(13, pid=100)]
    assert names(rem.plan_remediation(snap, options(kill_application_xids=False))[0]) == []


@pytest.mark.parametrize('action, steps', [
    ('reset', ['reset']), ('drain_and_reset', ['reset']), ('reboot', ['drain', 'reboot_flag']),
    ('drain_p2p', ['drain']), ('none', []), (None, []),
])
def test_the_recovery_action_picks_the_ladder(action, steps):
    snap = g.snapshot()
    snap.all_devices[2].recovery_action = action
    assert names(rem.plan_remediation(snap, options())[2]) == steps


def test_orphaned_memory_and_health_ask_for_a_reset_or_a_drain_when_reset_is_off():
    snap = g.snapshot()
    dev = snap.all_devices[0]
    dev.memory_used_mib, dev.orphaned_mib = 8192, 8192
    snap.all_devices[1].health.degrade('row remapping is pending', 'reset')
    ladders = rem.plan_remediation(snap, options())
    assert names(ladders[0]) == ['reset'] and ladders[0].findings[0] == {'source': 'orphaned_memory', 'orphaned_mib': 8192,
                                                                         'threshold_mib': 1024}
    assert names(ladders[1]) == ['reset'] and ladders[1].findings[0]['recommended_action'] == 'reset'
    ladders = rem.plan_remediation(snap, options(reset=False))
    assert names(ladders[0]) == ['drain'] and 'reset is off' in ladders[0].steps[0].why


def test_ladder_order_and_a_reboot_replaces_the_reset():
    snap = g.snapshot([g.proc(100, 'alice', {3: 2048})])
    dev = snap.all_devices[3]
    dev.xid_events = [event(48), event(13, pid=100), event(79)]
    dev.health.lose('the GPU is lost')
    assert names(rem.plan_remediation(snap, options())[3]) == ['kill_application', 'drain', 'reboot_flag']
    dev.xid_events = [event(48), event(13, pid=100)]
    assert names(rem.plan_remediation(snap, options())[3]) == ['kill_application', 'reset']


def test_handled_events_and_gpus_awaiting_a_reboot_plan_nothing():
    snap = g.snapshot()
    dev = snap.all_devices[1]
    dev.xid_events = [event(48, bus=BUS[1])]
    key = rem.event_key(dev, dev.xid_events[0])
    ladder = rem.plan_remediation(snap, options(), {'handled': {key: 1.0}})[1]
    assert names(ladder) == [] and ladder.findings[0]['handled'] == 1.0
    dev.xid_events = [event(79, bus=BUS[1])]
    ladder = rem.plan_remediation(snap, options(), None, {'gpus': {dev.uuid: 'Xid 79'}})[1]
    assert names(ladder) == [] and ladder.status == 'awaiting_reboot' and ladder.awaiting_reboot == 'Xid 79'


def test_a_handled_event_stays_handled_when_its_epoch_time_moves_between_reads():
    """The regression behind an intermittent second reset: the key was the epoch time, which each read of the
    kernel log converts through its own clocks.  The key is now the kernel's stamp; keys of older states still
    count, and an event older than the GPU's last verified reset is handled by that reset."""
    snap = g.snapshot()
    dev = snap.all_devices[1]
    first = xid.with_stamp(event(48, bus=BUS[1], when=g.MONDAY_NOON), 7000123)
    moved = xid.with_stamp(event(48, bus=BUS[1], when=g.MONDAY_NOON + 0.004), 7000123)
    dev.xid_events = [first]
    ladder = rem.plan_remediation(snap, options())[1]
    assert names(ladder) == ['reset'] and len(ladder.handled) == 1
    state = {'handled': {ladder.handled[0]: 5.0}}
    dev.xid_events = [moved]
    ladder = rem.plan_remediation(snap, options(), state)[1]
    assert names(ladder) == [] and ladder.findings[0]['handled'] == 5.0 and ladder.handled == []
    other = xid.with_stamp(event(48, bus=BUS[1], when=g.MONDAY_NOON + 30), 37000123)   # a new Xid 48: acted on
    dev.xid_events = [moved, other]
    assert names(rem.plan_remediation(snap, options(), state)[1]) == ['reset']
    # a state written before the stamp was kept: its time-based key still counts, and is kept under the new key
    dev.xid_events = [first]
    ladder = rem.plan_remediation(snap, options(), {'handled': {rem.legacy_event_key(dev, first): 4.0}})[1]
    assert names(ladder) == [] and ladder.findings[0]['handled'] == 4.0 and ladder.handled == [rem.event_key(dev, first, rem.boot_id())]
    # no key at all, but a verified reset of this GPU ran after the event: that reset handled it
    dev.xid_events = [moved]
    ladder = rem.plan_remediation(snap, options(), {'reset_at': {dev.key: g.MONDAY_NOON + 2}})[1]
    assert names(ladder) == [] and ladder.findings[0]['handled'] == g.MONDAY_NOON + 2
    ladder = rem.plan_remediation(snap, options(), {'reset_at': {dev.key: g.MONDAY_NOON - 2}})[1]
    assert names(ladder) == ['reset']                       # a reset before the event handles nothing


def test_health_since_is_the_last_verified_reset_of_that_gpu_within_the_window():
    snap = g.snapshot()
    devs = snap.all_devices
    assert rem.health_since({'reset_at': {}}, g.MONDAY_NOON) is None
    since = rem.health_since({'reset_at': {devs[0].key: g.MONDAY_NOON - 60, devs[1].key: g.MONDAY_NOON - 7200}}, g.MONDAY_NOON)
    assert since(devs[0]) == g.MONDAY_NOON - 60                    # the reset: older Xid lines change no health
    assert since(devs[1]) == g.MONDAY_NOON - xid.DEFAULT_WINDOW_S  # a reset before the window: the window
    assert since(devs[2]) is None                                  # never reset: the snapshot's default


@pytest.mark.parametrize('kwargs, field', [
    ({'drain_command': '/usr/local/bin/drain --now'}, 'drain_command'),
    ({'drain_command': ['drain']}, 'drain_command'),
    ({'drain_command': []}, 'drain_command'),
    ({'reboot_flag': 'reboot-wanted'}, 'reboot_flag'),
    ({'state_path': 'x.json'}, 'state_path'),
    ({'node_name': 'a b'}, 'node_name'),
    ({'verify_timeout': -1}, 'verify_timeout'),
    ({'stop_services': ['dcgm; reboot']}, 'stop_services'),
])
def test_invalid_options_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as exc:
        rem.RemediateOptions(**kwargs)
    assert exc.value.field == field


# ---------------------------------------------------------------------------- against the simulator
class SimHost(reset.Host):
    """The simulator's host, with Xid events and recovery actions attached to every snapshot."""

    def __init__(self, node, events=None, actions=None, **kwargs):
        tools = {'nvidia-smi': os.path.join(SIM_BIN, 'nvidia-smi'), 'amd-smi': None, 'xpu-smi': None, 'systemctl': None,
                 'scontrol': kwargs.pop('scontrol', None)}
        reset.Host.__init__(self, tools=tools, dev_roots=node.dev_roots, amdsmi=False, poll=0.05,
                            sys_root=node.state[:-len('.json')] + '-sys', **kwargs)
        self.events = events or {}
        self.actions = actions or {}

    def snapshot(self, vendor='auto', gather_processes=True, xid_since=None):
        snap = reset.Host.snapshot(self, vendor, gather_processes, xid_since)
        for dev in snap.all_devices:
            if self.events:   # else: the simulator's kernel log, read by the snapshot
                dev.xid_events = list(self.events.get(dev.index, []))
            dev.recovery_action = self.actions.get(dev.index)
        return snap


@pytest.fixture
def node():
    if h.sim_build() is None or h.gpusim_path() is None:
        pytest.skip('simulator not built: run `make sim`')
    with h.gpusim_node(gpus=3) as sim:
        yield sim


def statuses(result):
    return dict((gpu['index'], [(s['step'], s['status']) for s in gpu['ladder']]) for gpu in result['gpus'])


@needs_root
def test_the_ladder_predicts_acts_and_a_rerun_changes_nothing(node, tmp_path):
    app = node.spawn(gpu=0, mib=2048)
    node.gpusim('lose', '--gpu', '1')
    node.gpusim('leak', '--gpu', '2', '--mib', '4096')
    node.gpusim('set', '--module-refcnt', 'nvidia_drm=1')
    now = time.time()
    host = SimHost(node, events={0: [event(13, pid=app, when=now)], 1: [event(79, when=now, bus=BUS[1])]})
    audit = str(tmp_path / 'log' / 'actions.jsonl')
    opts = options(tmp_path, audit_path=audit, node_name='node1')

    plan = rem.remediate(opts, host, check_mode=True, scheduler=None)
    assert statuses(plan) == {
        0: [('kill_application', 'would_run')],
        1: [('drain', 'node_unavailable'), ('reboot_flag', 'node_would_write')],
        2: [('reset', 'would_be_refused'), ('drain', 'node_unavailable'), ('reboot_flag', 'node_would_write')],
    }
    assert plan['changed'] is False and plan['reboot_wanted'] is True
    assert 'nvidia_drm: 1 reference(s)' in plan['gpus'][2]['ladder'][0]['detail']
    assert node.alive(app) and not os.path.exists(opts.reboot_flag) and not os.path.exists(audit)

    done = rem.remediate(opts, host, scheduler=None)
    assert done['changed'] is True and not node.alive(app)
    assert statuses(done)[0] == [('kill_application', 'done')]
    assert statuses(done)[2][0] == ('reset', 'refused') and 'kernel_modules' in done['gpus'][2]['ladder'][0]['detail']
    with open(opts.reboot_flag) as handle:
        flag = json.load(handle)
    uuids = [gpu['key'] for gpu in done['gpus']]   # a lost GPU has no UUID: index:1
    assert sorted(flag['gpus']) == sorted(uuids[1:]) and uuids[1] == 'index:1' and 'Xid 79' in flag['gpus'][uuids[1]]
    assert 'nvidia_drm' in flag['gpus'][uuids[2]] and flag['boot_id'] == rem.boot_id()
    assert os.stat(opts.reboot_flag).st_uid == 0 and not os.stat(opts.reboot_flag).st_mode & 0o022
    records = [json.loads(line) for line in open(audit)]
    assert 'gpu_kill' in [r['event'] for r in records]     # the killer's own record of the signal
    records = [r for r in records if r['event'] == 'gpu_remediation']
    assert [(r['step'], r['status']) for r in records] == [('kill_application', 'done'), ('reset', 'refused'),
                                                           ('reboot_flag', 'written')]
    assert records[0]['evidence']['code'] == 13 and records[0]['pid'] == app

    again = rem.remediate(opts, host, scheduler=None)
    assert again['changed'] is False and all(gpu['ladder'] == [] for gpu in again['gpus'])
    assert [gpu['status'] for gpu in again['gpus']] == ['ok', 'awaiting_reboot', 'awaiting_reboot']
    assert len([line for line in open(audit) if '"gpu_remediation"' in line]) == 3


@needs_root
def test_a_protected_or_reused_pid_is_never_signalled(node, tmp_path):
    protected = node.spawn(gpu=0, mib=1024, argv=('sshd', '-D'))
    young = node.spawn(gpu=1, mib=1024)
    host = SimHost(node, events={0: [event(13, pid=protected, when=time.time())],
                                 1: [event(13, pid=young, when=time.time() - 3600, bus=BUS[1])]})
    result = rem.remediate(options(tmp_path), host, scheduler=None)
    assert statuses(result)[0] == [('kill_application', 'skipped')] and 'protect' in result['gpus'][0]['ladder'][0]['detail']
    assert statuses(result)[1] == [('kill_application', 'skipped')] and 'reused' in result['gpus'][1]['ladder'][0]['detail']
    assert node.alive(protected) and node.alive(young)


@needs_root
def test_slurm_drain_then_resume_once_health_reads_clean(node, tmp_path):
    scontrol, calls = recorder(tmp_path, 'scontrol')
    host = SimHost(node, actions={2: 'reboot'}, scontrol=scontrol)
    opts = options(tmp_path, node_name='gpu-node-7')
    # the partition check (core/budget.py) asks sinfo first: the node's partition has no node drained by gpufleet
    from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_budget import fake_sinfo
    client, sinfo = fake_sinfo(tmp_path, [{'name': 'gpu-node-7', 'partitions': ['gpu']}, {'name': 'gpu-node-8', 'partitions': ['gpu']}])
    result = rem.remediate(opts, host, check_mode=True, scheduler='slurmd', slurm_client=client)
    assert result['node']['drain']['status'] == 'would_run' and calls() == [] and sinfo() == ['--json']
    result = rem.remediate(opts, host, scheduler='slurmd', slurm_client=client)
    assert calls() == [['update', 'nodename=gpu-node-7', 'state=drain',
                        'reason=gpufleet: GPU 2 (%s): reboot wanted (the driver\'s recovery action is reboot)' % BUS[2]]]
    assert result['drained'] is True and statuses(result)[2] == [('drain', 'node_done'), ('reboot_flag', 'node_written')]
    assert rem.remediate(opts, host, scheduler='slurmd')['changed'] is False and len(calls()) == 1
    # the node rebooted: the flag of the earlier boot goes, health reads clean, the node returns to service
    with open(opts.reboot_flag) as handle:
        flag = json.load(handle)
    flag['boot_id'] = 'an-earlier-boot'
    with open(opts.reboot_flag, 'w') as handle:
        json.dump(flag, handle)
    host.actions = {}
    result = rem.remediate(opts, host, scheduler='slurmd')
    assert result['stale_reboot_flag_removed'] and not os.path.exists(opts.reboot_flag)
    assert result['node']['undrain']['status'] == 'done' and calls()[-1] == ['update', 'nodename=gpu-node-7', 'state=resume']
    assert rem.remediate(opts, host, scheduler='slurmd')['changed'] is False and len(calls()) == 2


@needs_root
def test_the_drain_hook_runs_without_slurm_and_a_user_named_slurmd_does_not_count(node, tmp_path, monkeypatch):
    hook, calls = recorder(tmp_path, 'drain-hook')
    scontrol, scalls = recorder(tmp_path, 'scontrol')
    host = SimHost(node, events={1: [event(64, when=time.time(), bus=BUS[1])]}, scontrol=scontrol)
    opts = options(tmp_path, drain_command=[hook, '--cluster', 'a'], node_name='n1')
    with h.a_user_named_slurmd(str(tmp_path / 'proc')) as proc_root:
        # the ladder reads the scheduler from a process table of the test's own (the host's may hold a real slurmd)
        monkeypatch.setattr(rem, 'scheduler_daemon', functools.partial(processes.scheduler_daemon, proc_root))
        result = rem.remediate(opts, host)   # the user's slurmd is no root-vouched one
    assert result['node']['scheduler'] is None and scalls() == []
    assert calls() == [['--cluster', 'a', 'drain', 'n1', 'gpufleet: GPU 1 (%s): Xid 64 (gpu fault): the GPU should take no '
                                                         'new work' % BUS[1]]]
    assert result['node']['drain']['via'] == 'drain_command'


@needs_root
def test_a_failing_drain_command_is_an_error_and_is_retried(node, tmp_path):
    hook, calls = recorder(tmp_path, 'drain-hook', rc=3)
    host = SimHost(node, actions={0: 'drain_p2p'})
    opts = options(tmp_path, drain_command=[hook])
    result = rem.remediate(opts, host, scheduler=None)
    assert result['node']['drain']['status'] == 'failed' and 'rc 3' in result['errors'][0]
    rem.remediate(opts, host, scheduler=None)
    assert len(calls()) == 2  # not recorded as drained: the next run tries again


@needs_root
def test_after_a_verified_reset_its_xid_changes_nothing_and_the_node_returns_to_service(node, tmp_path, monkeypatch):
    """The Xid 48 that asked for the reset stays in the kernel log: the reset still verifies, a rerun changes
    nothing, and the drain this ladder set is undone once health reads clean."""
    monkeypatch.setenv(xid.KMSG_ENV, json.loads(node.gpusim('show'))['kmsg_path'])
    hook, calls = recorder(tmp_path, 'drain-hook')
    opts = options(tmp_path, drain_command=[hook], node_name='n1')
    os.makedirs(os.path.dirname(opts.state_path))
    with open(opts.state_path, 'w') as handle:   # an earlier run of this ladder drained the node
        json.dump({'handled': {}, 'drained': {'reason': 'gpufleet: earlier', 'via': 'drain_command', 'time': 1.0}}, handle)
    node.gpusim('xid', '--gpu', '1', '--code', '48')
    host = SimHost(node)
    plan = rem.remediate(opts, host, check_mode=True, scheduler=None)
    assert statuses(plan)[1] == [('reset', 'would_run')] and plan['gpus'][1]['health']['status'] == 'degraded'
    done = rem.remediate(opts, host, scheduler=None)
    assert statuses(done)[1] == [('reset', 'done')] and done['gpus'][1]['ladder'][0]['result']['verified'] is True
    with open(opts.state_path) as handle:
        reset_at = json.load(handle)['reset_at']
    assert list(reset_at) == [done['gpus'][1]['key']] and reset_at[done['gpus'][1]['key']] <= time.time()
    assert done['node']['undrain'] is None and calls() == []
    again = rem.remediate(opts, host, scheduler=None)
    assert all(gpu['ladder'] == [] for gpu in again['gpus']) and again['gpus'][1]['health']['status'] == 'ok'
    assert again['gpus'][1]['findings'][0]['code'] == 48 and 'handled' in again['gpus'][1]['findings'][0]
    assert again['node']['undrain']['status'] == 'done' and calls() == [['resume', 'n1', 'gpufleet: earlier']]
    assert again['drained'] is False
    last = rem.remediate(opts, host, scheduler=None)
    assert last['changed'] is False and len(calls()) == 1
