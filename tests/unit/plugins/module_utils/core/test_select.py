# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Selectors: validation, and selection over snapshots of a simulated node (tests/sim).

Every GPU process here is a workload that ``gpusim spawn`` started on the test's own state;
nothing is signalled except through ``gpusim kill-all`` on that state (and, for the orphan test,
one identity-checked SIGKILL to a parent the test spawned).
"""

from __future__ import annotations

import signal
import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import killer
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.history import SampleStore
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.idle import IdleRule, idle_pids
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

needs_sim = h.needs_gpusim
needs_root = h.needs_root


@pytest.fixture
def node():
    with h.gpusim_node(gpus=2) as sim:
        yield sim


def snapshot(sim):
    return take_snapshot(dev_roots=sim.dev_roots)


def selected(sim, **kwargs):
    return sorted(m.proc.pid for m in Selector(**kwargs).select(snapshot(sim)))


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize('kwargs', [
    {}, {'gpus': ['0']}, {'exclude_users': ['bob']}, {'gpus': ['0'], 'exclude_users': ['bob']},
    {'pids': [], 'users': [], 'name': '', 'orphans': False, 'all_on_gpus': False},
])
def test_no_selector_is_an_error(kwargs):
    with pytest.raises(InvalidArgument) as err:
        Selector(**kwargs)
    assert err.value.field == 'selectors' and err.value.value is None
    assert 'all_on_gpus' in str(err.value) and 'only narrow' in str(err.value)
    assert str(err.value).startswith('selectors: no process is selected: give at least one of pids, ') and 'invalid value' not in str(err.value)


@pytest.mark.parametrize('kwargs, field', [
    ({'name': '(unclosed'}, 'name'),
    ({'cmdline': '[a-'}, 'cmdline'),
    ({'name': '(a+)+$'}, 'name'),
    ({'cmdline': 'x' * 600}, 'cmdline'),
    ({'idle_for': '30 parsecs'}, 'idle_for'),
    ({'idle_for': '-5m'}, 'idle_for'),
    ({'older_than': 'yesterday'}, 'older_than'),
    ({'users': ['bob'], 'min_used_mib': -1}, 'min_used_mib'),
    ({'users': ['bob'], 'min_used_mib': True}, 'min_used_mib'),
    ({'users': ['bob'], 'idle_util_pct': 101}, 'idle_util_pct'),
    ({'pids': [0]}, 'pids'),
    ({'pids': ['x']}, 'pids'),
    ({'pids': [True]}, 'pids'),
    ({'all_on_gpus': True}, 'all_on_gpus'),
    ({'rogue': True}, 'rogue'),
    ({'users': ['bob'], 'rogue_min_level': 'extreme'}, 'rogue_min_level'),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        Selector(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field + ': invalid value')


def test_rogue_is_rejected_with_a_clear_message_not_ignored():
    with pytest.raises(InvalidArgument) as err:
        Selector(rogue=True, users=['bob'])
    assert 'rogue detector is not available' in str(err.value)


def test_zero_mib_minimum_is_an_explicit_selector():
    assert Selector(min_used_mib=0).min_used_mib == 0


# ---------------------------------------------------------------------------- selection
@needs_sim
def test_unknown_gpu_fails_naming_the_value(node):
    node.spawn(0, 1024)
    snap = snapshot(node)
    for bad in ('7', 'GPU-does-not-exist'):
        with pytest.raises(InvalidArgument) as err:
            Selector(gpus=[bad], all_on_gpus=True).select(snap)
        assert err.value.field == 'gpus' and err.value.value == bad
        assert 'GPUs here: 0 (GPU-' in str(err.value)


@needs_sim
def test_pids_name_cmdline_and_memory(node):
    train = node.spawn(0, 4096, argv=['python', 'train.py', '--epochs', '3'])
    serve = node.spawn(1, 1024, argv=['tritonserver', '--model-repository', '/models'])
    miner = node.spawn(1, 512, argv=['xmrig', '-o', 'pool'])
    assert selected(node, pids=[serve, 999999]) == [serve]
    assert selected(node, name='^(xmrig|t-rex)$') == [miner]
    assert selected(node, name='python') == [train]
    assert selected(node, cmdline=r'--epochs\s+3') == [train]
    assert selected(node, cmdline='models') == [serve]
    assert selected(node, min_used_mib=1024) == sorted([train, serve])
    assert selected(node, min_used_mib=2048) == [train]
    assert selected(node, min_used_mib=0) == sorted([train, serve, miner])


@needs_sim
def test_every_selector_given_must_match(node):
    train = node.spawn(0, 4096, argv=['python', 'train.py'])
    node.spawn(1, 4096, argv=['python', 'eval.py'])
    node.spawn(0, 512, argv=['python', 'train.py'])
    assert selected(node, name='python', gpus=['0'], min_used_mib=1000) == [train]
    assert selected(node, cmdline='train', min_used_mib=1000) == [train]
    assert selected(node, pids=[train], name='tritonserver') == []


@needs_sim
def test_all_on_gpus_by_index_and_uuid(node):
    on0 = node.spawn(0, 100)
    on1 = [node.spawn(1, 100), node.spawn(1, 200, argv=['nv-hostengine'])]
    uuid1 = node.show()['gpus'][1]['uuid']
    assert selected(node, gpus=['1'], all_on_gpus=True) == sorted(on1)
    assert selected(node, gpus=[uuid1.lower()], all_on_gpus=True) == sorted(on1)
    assert selected(node, gpus=['0', '1'], all_on_gpus=True) == sorted([on0] + on1)
    match = Selector(gpus=['1'], all_on_gpus=True).select(snapshot(node))[0]
    assert match.reasons == ['on GPU 1 (all_on_gpus)']


@needs_sim
def test_older_than(node):
    old = node.spawn(0, 100)
    time.sleep(1.3)
    young = node.spawn(0, 100)
    snap = snapshot(node)
    # Judge ages at a fixed moment just after the young one started, so a loaded machine cannot age it.
    now = snap.process(young).create_time + 0.5
    assert [m.proc.pid for m in Selector(older_than='1s').select(snap, now=now)] == [old]
    assert Selector(older_than='1h').select(snap, now=now) == []
    assert sorted(m.proc.pid for m in Selector(older_than=0).select(snap, now=now)) == sorted([old, young])


@needs_sim
@needs_root
def test_users_and_exclude_users(node):
    mine = node.spawn(0, 100)
    theirs = node.spawn(0, 100, user='nobody')
    assert selected(node, users=['nobody']) == [theirs]
    assert selected(node, users=['root', 'nobody'], exclude_users=['nobody']) == [mine]
    assert selected(node, gpus=['0'], all_on_gpus=True, exclude_users=['root']) == [theirs]


@needs_sim
def test_orphans_are_holders_the_driver_does_not_list(node):
    parent = node.spawn(0, 2048, children=2)
    other = node.spawn(1, 100)
    kids = node.child_pids(parent)
    assert selected(node, orphans=True) == sorted(kids)  # children hold the device, unlisted
    # The parent dies: its children are left holding the device, and the GPU memory stays used.
    assert killer.send_signal(parent, node.entry(parent)['starttime'], signal.SIGKILL) == 'sent'
    h.wait_for(lambda: not node.alive(parent), what='the parent to die')
    snap = snapshot(node)
    matches = Selector(orphans=True).select(snap)
    assert sorted(m.proc.pid for m in matches) == sorted(kids)
    assert all(m.orphan and m.proc.gpu_indexes == [0] for m in matches)
    assert 'orphan' in matches[0].reasons[0] and node.dev in matches[0].reasons[0]
    assert snap.device(0).orphaned_mib == 2048
    assert selected(node, orphans=True, gpus=['1']) == []
    assert other not in selected(node, orphans=True)


# ---------------------------------------------------------------------------- idleness
@needs_sim
def test_per_process_utilization_comes_from_the_driver(node):
    idle = node.spawn(0, 1024, util=0)
    busy = node.spawn(0, 1024, util=85)
    procs = dict((p.pid, p) for p in snapshot(node).processes)
    assert (procs[idle].util_pct, procs[busy].util_pct) == (0, 85)


@needs_sim
def test_idle_for_needs_two_samples_far_enough_apart(node, tmp_path):
    idle = node.spawn(0, 1024, util=0)
    node.spawn(0, 1024, util=60)
    node.spawn(1, 1024, util=3)  # below the default 5 % threshold: idle as well
    selector = Selector(idle_for='2s', min_used_mib=1024)

    def sample(snap, pct=5):
        # one gpu_kill run: record the snapshot in the usage history, then the idleness rule over it
        with SampleStore(str(tmp_path / 'history.db')) as store:
            now = time.time()
            store.record(snap, now)
            return idle_pids(IdleRule(pct), snap, now, store)

    first = snapshot(node)
    assert selector.select(first, idle_since=sample(first)) == []  # the first sample only starts the clock

    time.sleep(2.2)
    second = snapshot(node)
    since = sample(second)  # a later run reads what the first one saved
    matches = selector.select(second, idle_since=since)
    low = [p.pid for p in second.processes if p.util_pct == 3]
    assert sorted(m.proc.pid for m in matches) == sorted([idle] + low)
    assert 'idle (<= 5% utilization) for ' in ' '.join(matches[0].reasons)
    # A stricter threshold drops the 3 % process; a longer window selects nothing yet.
    assert [m.proc.pid for m in Selector(idle_for='2s', idle_util_pct=0).select(
        second, idle_since=sample(second, 0))] == [idle]
    assert Selector(idle_for='1h').select(second, idle_since=since) == []
