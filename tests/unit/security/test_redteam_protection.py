# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: a chosen name buys protection (docs/security.md, issue 15).

alice runs her GPU hogs as ``sshd``, ``Xorg``, ``nvidia-persistenced``, ``slurmstepd``, ``systemd``
and ``kubelet`` (argv[0] and comm), and from a copy of her binary named ``sshd`` (the executable's
basename).  A protected name protects only a process that a system account runs from a root-owned
executable outside directories users may write: the tick charges her hogs to her and acts on them,
``gpufleet-guard kill --user alice`` and gpu_kill ``users: [alice]`` kill them, and bob's job is
alive and never signalled.  A root daemon named ``sshd`` (the simulator's root-owned binary) stays
protected; the same daemon run from a directory users may write does not.

Each scenario runs in a PID namespace of its own (``redteam.run``); see redteam.py for the safety.
"""

from __future__ import annotations

import os
import shutil

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import identity
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace

QUOTA = ('mode: enforce\ndefaults: {max_mem_gib_total: 12}\n'
         'escalation: {act_after: 0s, sigkill_after: 2s}\nnotify: {tty: false}\n')
# argv of alice's hogs: comm is basename(argv[0]) (nvidia-persistenced: its first 15 bytes, as the kernel keeps)
DISGUISES = (['sshd'], ['/usr/sbin/sshd', '-D'], ['Xorg', ':0'], ['/usr/bin/nvidia-persistenced', '--verbose'],
             ['slurmstepd'], ['/lib/systemd/systemd', '--user'], ['/usr/bin/kubelet'])
# each hog alone is over the quota, so every one of them must be acted on
HOG_MIB = 14 * GIB


def _copy_workload(directory, name):
    """A copy of the simulator's workload binary at ``directory/name`` (root-owned, 0755); gpusim runs it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    shutil.copyfile(os.path.join(h.sim_build(), 'gpusim-workload'), path)
    os.chmod(path, 0o755)
    return path


def _spawn_from(node, path, *args, **kwargs):
    """node.spawn with gpusim's workload binary replaced by ``path``."""
    os.environ['GPUSIM_WORKLOAD'] = path
    try:
        return node.spawn(*args, **kwargs)
    finally:
        del os.environ['GPUSIM_WORKLOAD']


def _hogs(node):
    """alice's disguised hogs, two per GPU on GPUs 1-4, and one from her own copy of the binary named sshd."""
    hogs = [node.spawn('alice', gpu=1 + index // 2, mib=HOG_MIB, argv=argv) for index, argv in enumerate(DISGUISES)]
    mine = _copy_workload(os.path.join(node.work, 'alice-bin'), 'sshd')
    hogs.append(_spawn_from(node, mine, 'alice', gpu=4, mib=HOG_MIB, argv=['./sshd']))
    return hogs


def _state(node, hogs, bob):
    return {'hogs': hogs, 'bob': bob, 'comms': [node.comm(pid) for pid in hogs], 'bob_alive': node.alive(bob),
            'alive': [pid for pid in hogs if node.alive(pid)]}


def scenario_tick(node):
    bob = node.spawn('bob', gpu=0, mib=10 * GIB)
    hogs = _hogs(node)
    node.write_policy(QUOTA)
    rc, summary, signalled, err = node.tick()
    out = _state(node, hogs, bob)
    out.update(rc=rc, summary=summary, signalled=signalled, err=err)
    return out


def scenario_guard_kill(node):
    bob = node.spawn('bob', gpu=0, mib=10 * GIB)
    hogs = _hogs(node)
    node.write_policy(QUOTA)
    rc, result, signalled, err = node.cli('kill', '--user', 'alice', '--timeout', '5', '--force')
    out = _state(node, hogs, bob)
    out.update(rc=rc, result=result, signalled=signalled, err=err)
    return out


def scenario_gpu_kill(node):
    bob = node.spawn('bob', gpu=0, mib=10 * GIB)
    hogs = _hogs(node)
    rc, result, signalled, err = node.module('gpu_kill', users=['alice'], timeout=5, force=True, audit_log='')
    out = _state(node, hogs, bob)
    out.update(rc=rc, result=result, signalled=signalled, err=err)
    return out


def check_comms(out):
    assert out['comms'][:len(DISGUISES)] == [os.path.basename(argv[0])[:15] for argv in DISGUISES]
    assert out['comms'][-1] == 'sshd'


def check_killed_and_bob_untouched(out):
    assert out['alive'] == [], out.get('result') or out.get('summary')
    assert out['bob_alive'] and out['bob'] not in out['signalled']
    assert sorted(out['signalled']) == sorted(out['hogs']), out['err']


def test_a_hog_named_like_a_daemon_is_charged_and_acted_on_by_the_tick():
    out = redteam.run(scenario_tick, gpus=5)
    assert out['rc'] == 0, out['err']
    check_comms(out)
    check_killed_and_bob_untouched(out)
    acted = redteam.acted_pids(out['summary'])
    assert sorted(acted) == sorted(out['hogs']) and all(entry['outcome'] == 'killed' for entry in acted.values())
    decisions = [d for d in out['summary']['decisions'] if d['decision'] in ('warn', 'act')]
    assert [d['user'] for d in decisions] == ['alice'], decisions
    assert not [note for note in out['summary']['notes'] if 'protected' in note], out['summary']['notes']


def test_a_hog_named_like_a_daemon_is_killed_by_gpufleet_guard_kill():
    out = redteam.run(scenario_guard_kill, gpus=5)
    assert out['rc'] == 0, out['err']
    check_comms(out)
    check_killed_and_bob_untouched(out)
    assert sorted(e['pid'] for e in out['result']['killed']) == sorted(out['hogs']) and out['result']['skipped'] == []
    assert all(e['user'] == 'alice' for e in out['result']['killed'])


def test_a_hog_named_like_a_daemon_is_killed_by_gpu_kill():
    out = redteam.run(scenario_gpu_kill, gpus=5)
    assert out['rc'] == 0, out['err']
    check_comms(out)
    check_killed_and_bob_untouched(out)
    result = out['result']
    assert sorted(e['pid'] for e in result['killed']) == sorted(out['hogs']) and result['skipped_processes'] == []
    assert all(e['user'] == 'alice' for e in result['killed'])


def scenario_root_daemons(node):
    """Root's sshd from the simulator's root-owned binary, root's Xorg from a copy in a directory that
    users may write (the node's work directory lies under the sticky, world-writable /tmp), alice's hog."""
    daemon = node.spawn('root', gpu=0, mib=20 * GIB, argv=['/usr/sbin/sshd', '-D'])
    planted = _copy_workload(os.path.join(node.work, 'planted'), 'Xorg')
    xorg = _spawn_from(node, planted, 'root', gpu=0, mib=20 * GIB, argv=['Xorg'])
    hog = node.spawn('alice', gpu=0, mib=20 * GIB, argv=['sshd'])
    exe = identity.read_exe_identity(daemon)
    node.write_policy(QUOTA)
    tick = node.tick()
    rc, result, signalled, err = node.module('gpu_kill', gpus=['0'], all_on_gpus=True, timeout=5, force=True, audit_log='')
    return {'daemon': daemon, 'xorg': xorg, 'hog': hog, 'exe': exe.to_dict(), 'exe_trusted': exe.trusted,
            'tick': tick, 'rc': rc, 'result': result, 'signalled': signalled, 'err': err,
            'daemon_alive': node.alive(daemon), 'xorg_alive': node.alive(xorg), 'hog_alive': node.alive(hog)}


def test_a_root_daemon_from_a_root_owned_executable_is_still_protected():
    out = redteam.run(scenario_root_daemons)
    assert out['exe_trusted'], ('the simulator binary must sit in directories only root may write (the checkout, '
                                'as CI makes it): %r' % out['exe'])
    # the tick: root's 20 GiB sshd is protected by its name; root's planted Xorg and alice's sshd are charged
    rc, summary, tick_signalled, tick_err = out['tick']
    assert rc == 0, tick_err
    assert 'pid %d (root): protected name sshd; quota rules skip it' % out['daemon'] in summary['notes']
    acted = redteam.acted_pids(summary)
    assert sorted(acted) == sorted([out['xorg'], out['hog']]) and out['daemon'] not in tick_signalled
    # gpu_kill on the whole GPU afterwards: only the daemon is left, and it is skipped as protected
    assert out['rc'] == 0, out['err']
    assert out['result']['killed'] == [] and out['signalled'] == []
    (skipped,) = out['result']['skipped_processes']
    assert skipped['pid'] == out['daemon'] and skipped['reason'] == 'protected name sshd (protect_names)'
    assert out['daemon_alive'] and not out['xorg_alive'] and not out['hog_alive']
