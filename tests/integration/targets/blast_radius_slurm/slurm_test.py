# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ladder's partition check against a real Slurm (issue #30's acceptance).  Run by runme.sh: python slurm_test.py,
which starts tests/fleet/up --nodes 4 --slurm --gpus 1 and stops it when it ends.

1. node01..node03 log an Xid 79 (the GPU fell off the bus): the confirmed ``remediate`` playbook drains them in Slurm
   (``scontrol``, reason ``gpufleet: GPU 0 (...): reboot wanted (Xid 79 ...)``) and flags them for a reboot.
2. node04 logs an Xid 79 too; the guard's ladder there (the guard role, policy ``remediation``, a tick run by hand)
   reads ``sinfo --json``: 3 of the partition's 4 nodes are drained for a gpufleet reason, more than
   ``remediation.max_drained_pct`` (50): node04 is neither drained nor flagged (``partition_limit``), on every tick,
   the metric says so, and Slurm shows it in service.
3. node01 goes back to service (``scontrol update ... state=resume``): 2 of 4 are drained, no more than 50 %; the next
   tick drains node04 (its Xid stayed unhandled) and flags it.

Nothing of Slurm is mocked; its daemons are the fleet's own, on 127.0.0.1, and go with tests/fleet/down.  The fleet
helpers are the blast_radius target's (blast_test.Fleet).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'blast_radius'))

from blast_test import Fleet, simulated_fleet  # noqa: E402 pylint: disable=wrong-import-position

DRAINERS = ['node01', 'node02', 'node03']
LAST = 'node04'
HELD = ('partition_limit: 3 of 4 nodes of partition gpu are drained by gpufleet already (75%, more than max_drained_pct 50): '
        'not drained')


def slurm(fleet, *argv):
    """A Slurm client command on the host, against the fleet's own cluster."""
    return subprocess.run(list(argv), stdout=subprocess.PIPE, universal_newlines=True, env=fleet.env, timeout=60, check=True).stdout


def drained(fleet):
    """{node: (drained, reason)}, as sinfo --json tells it (Slurm 22.05: state_flags; 23.02 and later: the state list)."""
    out = {}
    for node in json.loads(slurm(fleet, 'sinfo', '--json'))['nodes']:
        words = (node['state'] if isinstance(node['state'], list) else [node['state']]) + node.get('state_flags', [])
        out[node['name']] = ('DRAIN' in words, node.get('reason') or '')
    return out


def flagged(fleet, node):
    return fleet.node_file(node, 'var', 'lib', 'gpufleet', 'reboot-wanted') is not None


def test_the_last_node_of_a_partition_drained_by_gpufleet_is_not_drained(fleet):
    assert drained(fleet) == dict((n, (False, '')) for n in DRAINERS + [LAST]), drained(fleet)
    for node in DRAINERS:
        fleet.on(node, ['gpusim', 'xid', '--gpu', '0', '--code', '79'])
    fleet.target = ':'.join(DRAINERS)
    fleet.playbook('remediate', {'reclaim_confirm': True, 'reclaim_max_nodes_pct': 100})
    state = drained(fleet)
    for node in DRAINERS:
        assert state[node][0] and state[node][1].startswith('gpufleet: GPU 0 (') and 'Xid 79' in state[node][1], (node, state)
        assert flagged(fleet, node)
    assert state[LAST] == (False, '')

    fleet.guard(LAST, {'notify': {'tty': False}, 'remediation': {'enabled': True, 'max_drained_pct': 50}})
    fleet.on(LAST, ['gpusim', 'xid', '--gpu', '0', '--code', '79'])
    for _tick in (1, 2):   # held on every tick while the partition's drained share stays over the limit
        result = fleet.tick(LAST)['remediation']
        assert result['node']['drain']['status'] == 'partition_limit' and HELD in result['node']['drain']['detail'], result['node']
        assert result['node']['reboot_flag']['status'] == 'partition_limit' and result['remediation_budget_exhausted']
        assert drained(fleet)[LAST] == (False, '') and not flagged(fleet, LAST)
    text = fleet.metrics(LAST)
    assert 'gpufleet_guard_remediation_budget_exhausted 1' in text, text
    assert 'gpufleet_guard_remediation_held{gpu="",reason="partition",step="drain"} 1' in text, text

    slurm(fleet, 'scontrol', 'update', 'nodename=node01', 'state=resume')
    result = fleet.tick(LAST)['remediation']
    assert result['node']['drain']['status'] == 'done' and result['node']['drain']['via'] == 'slurm', result['node']
    state = drained(fleet)[LAST]
    assert state[0] and state[1].startswith('gpufleet: GPU 0 (') and flagged(fleet, LAST), state
    assert 'gpufleet_guard_remediation_budget_exhausted 0' in fleet.metrics(LAST)


if __name__ == '__main__':
    BEGUN = time.monotonic()
    with simulated_fleet('blast-slurm', '--nodes', '4', '--slurm', '--gpus', '1') as DIR:
        test_the_last_node_of_a_partition_drained_by_gpufleet_is_not_drained(
            Fleet(DIR, env=dict(os.environ, SLURM_CONF=os.path.join(DIR, 'slurm', 'etc', 'slurm.conf'))))
    print('\nblast_radius_slurm: passed in %.0f s' % (time.monotonic() - BEGUN))
