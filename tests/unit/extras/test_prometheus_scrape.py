# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The whole chain on loopback: guard ticks write their textfiles on two simulated nodes, Debian's
prometheus-node-exporter serves each node's textfile directory, a real prometheus scrapes both (and loads
extras/prometheus/gpufleet-rules.yml), and PromQL over its HTTP API returns the guard's series with their
labels and values; every target of extras/grafana/gpufleet-dashboard.json returns data.

SAFETY: the ticks run in dry-run on fake snapshots (nothing is signalled); the three servers listen on
127.0.0.1 only and are stopped by this test, by the pid it started, in a finally.
"""

from __future__ import annotations

import os
import time

import pytest

from ansible_collections.gpufleet.reclaim.tests.unit.extras import guard_series as gs
from ansible_collections.gpufleet.reclaim.tests.unit.extras import prometheus_chain as pc

pytest.importorskip('prometheus_client.parser')

pytestmark = pytest.mark.skipif(pc.PROMETHEUS is None or pc.NODE_EXPORTER is None, reason=pc.MISSING)


def test_the_chain_guard_textfile_node_exporter_prometheus_rules_dashboard(tmp_path):
    """Two simulated nodes' textfiles (real ticks, the last one now), one node_exporter each, one prometheus;
    the servers live only within this test (started and stopped here, by their pids)."""
    base = tmp_path
    start = time.time() - 11 * gs.STEP      # the last tick of the first node: now
    node1 = gs.enforcement(base / 'node1', start=start)
    node2 = gs.health_and_rogue(base / 'node2', start=time.time() - 2 * gs.STEP)
    dirs = [str(base / name / 'var/lib/node_exporter/textfile_collector') for name in ('node1', 'node2')]
    assert all(os.listdir(d) == ['gpufleet.prom'] for d in dirs)
    with pc.serve(base, {'gpu-node-1': dirs[0], 'gpu-node-2': dirs[1]}, rules=pc.RULES) as served:
        fleet = {'port': served['port'], 'targets': [served['targets']['gpu-node-1'], served['targets']['gpu-node-2']],
                 'texts': (node1, node2)}
        check_the_guard_series_of_both_nodes(fleet)
        check_the_rules_load_and_the_instant_alerts_fire(fleet)
        pc.check_every_dashboard_panel_query_returns_data(fleet['port'])


def check_the_guard_series_of_both_nodes(fleet):
    port, (one, two) = fleet['port'], fleet['targets']
    up = pc.by(pc.query(port, 'up{job="node"}'), 'instance', 'node')
    assert up == {(one, 'gpu-node-1'): 1.0, (two, 'gpu-node-2'): 1.0}
    assert pc.by(pc.query(port, 'node_textfile_scrape_error'), 'instance') == {(one,): 0.0, (two,): 0.0}
    # the values the guard wrote, per node, with their labels (node 1: alice acted on 4 times, 12 GiB on 4 GPUs)
    node1, node2 = (gs.samples(texts[-1]) for texts in fleet['texts'])
    # node 2: the miner's user, acted on at once (the rogue grace is 0; dry-run: logged only)
    assert pc.by(pc.query(port, 'gpufleet_guard_user_actions_total'), 'instance', 'user') == {(one, 'alice'): 4.0, (two, 'eve'): 1.0}
    memory = pc.by(pc.query(port, 'gpufleet_user_gpu_memory_mib{instance="%s"}' % one), 'user', 'gpu')
    assert memory == dict(((dict(k)['user'], dict(k)['gpu']), v) for (n, k), v in node1.items() if n == 'gpufleet_user_gpu_memory_mib')
    assert memory[('alice', '3')] == 12 * 1024 and memory[('bob', '0')] == 30 * 1024
    ticks = pc.by(pc.query(port, 'gpufleet_guard_last_tick_timestamp_seconds'), 'instance')
    assert ticks == {(one,): node1[('gpufleet_guard_last_tick_timestamp_seconds', ())],
                     (two,): node2[('gpufleet_guard_last_tick_timestamp_seconds', ())]}
    # node 2: the Xid GPUs by fault class, the lost GPU that wants a reboot, the rogue finding
    xids = pc.by(pc.query(port, 'gpufleet_gpu_xid_errors'), 'instance', 'gpu', 'code', 'fault')
    assert xids == {(two, '0', '13', 'application'): 1.0, (two, '1', '79', 'gpu'): 1.0, (two, '2', '48', 'gpu'): 1.0}
    uuid = [dict(k)['uuid'] for (n, k) in node2 if n == 'gpufleet_gpu_reboot_wanted' and dict(k)['gpu'] == '1'][0]
    assert pc.by(pc.query(port, 'gpufleet_gpu_reboot_wanted == 1'), 'instance', 'gpu', 'uuid') == {(two, '1', uuid): 1.0}
    assert pc.by(pc.query(port, 'gpufleet_gpu_health_status > 0'), 'instance', 'gpu') == {(two, '1'): 2.0, (two, '2'): 1.0}
    assert pc.by(pc.query(port, 'gpufleet_guard_rogue_findings > 0'), 'instance', 'level') == {(two, 'critical'): 1.0}
    assert pc.by(pc.query(port, 'gpufleet_guard_mode == 1'), 'instance', 'mode') == {(one, 'dry-run'): 1.0, (two, 'dry-run'): 1.0}


def check_the_rules_load_and_the_instant_alerts_fire(fleet):
    port, two = fleet['port'], fleet['targets'][1]
    groups = pc.get(port, '/api/v1/rules')['data']['groups']
    assert sorted(g['name'] for g in groups) == ['gpufleet-enforcement', 'gpufleet-guard', 'gpufleet-health']
    assert all(r['health'] == 'ok' for g in groups for r in g['rules']), groups

    def firing():
        found = set((a['labels']['alertname'], a['labels'].get('instance'), a['labels'].get('user'))
                    for a in pc.get(port, '/api/v1/alerts')['data']['alerts'] if a['state'] == 'firing')
        return found if {('GpuLost', two, None), ('GpuRebootWanted', two, None)} <= found else None
    found = pc.until('the alerts without a for', firing)
    assert ('GpuUserEnforcementRate', None, 'alice') in found and ('GpuRogueProcess', two, None) in found
    assert not [a for a in found if a[0] in ('GpuGuardTickStale', 'GpuGuardPolicyInvalid', 'GpuGuardUntrustedInput')]
