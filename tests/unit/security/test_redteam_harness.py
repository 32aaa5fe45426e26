# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The red-team harness itself: what the attack tests rely on must be true (the control).

A kill in the scenario's namespace is seen in ``signalled`` (whether the killer used os.kill or a
pidfd), only the selected user's process ends, and the scenario's pids are those of its namespace.
"""

from __future__ import annotations

from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace


def scenario_kill_alice(node):
    import os  # pylint: disable=import-outside-toplevel
    alice = node.spawn('alice', gpu=0, mib=2 * GIB)
    bob = node.spawn('bob', gpu=1, mib=2 * GIB)
    rc, result, signalled, err = node.cli('kill', '--user', 'alice', '--force', '--dev-root', node.sim.dev)
    return {'alice': alice, 'bob': bob, 'rc': rc, 'result': result, 'signalled': signalled, 'err': err,
            'alice_alive': node.alive(alice), 'bob_alive': node.alive(bob), 'init': os.getpid()}


def test_the_harness_sees_every_signal_and_only_the_selected_process_ends():
    out = redteam.run(scenario_kill_alice)
    assert out['rc'] == 0, out['err']
    assert out['init'] == 1                                  # the scenario is PID 1 of its own namespace
    assert out['signalled'] == [out['alice']]                # seen even when the killer signals through a pidfd
    assert not out['alice_alive'] and out['bob_alive']
    assert [e['pid'] for e in out['result']['killed']] == [out['alice']]
