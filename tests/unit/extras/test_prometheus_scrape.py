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

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from ansible_collections.gpufleet.reclaim.tests.unit.extras import guard_series as gs

pytest.importorskip('prometheus_client.parser')

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
RULES = os.path.join(ROOT, 'extras', 'prometheus', 'gpufleet-rules.yml')
DASHBOARD = os.path.join(ROOT, 'extras', 'grafana', 'gpufleet-dashboard.json')
PROMETHEUS = shutil.which('prometheus')
NODE_EXPORTER = shutil.which('prometheus-node-exporter') or shutil.which('node_exporter')
pytestmark = pytest.mark.skipif(PROMETHEUS is None or NODE_EXPORTER is None,
                                reason='prometheus and prometheus-node-exporter are not installed (Debian packages; .ci/run installs them)')
DEADLINE = 60          # seconds for the servers to come up and the first scrapes to land


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _get(port, path, **params):
    url = 'http://127.0.0.1:%d%s' % (port, path)
    if params:
        url += '?' + urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(url, timeout=5) as response:   # noqa: S310 (loopback, built here)
        return json.loads(response.read().decode()) if path.startswith('/api/') else response.read().decode()


def query(port, expr):
    body = _get(port, '/api/v1/query', query=expr)
    assert body['status'] == 'success', body
    return body['data']['result']


def _until(what, check):
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, 'gave up waiting for %s' % what
        time.sleep(0.3)


def _die_with_parent():
    """In the child: SIGTERM when the test's thread goes (a worker killed before its finally ran)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)     # PR_SET_PDEATHSIG


def _start(argv, log):
    with open(log, 'w') as handle:
        return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)  # pylint: disable=subprocess-popen-preexec-fn


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def dashboard_queries():
    """(panel title, expr) of every panel target, the dashboard's variables set to match everything."""
    with open(DASHBOARD) as handle:
        board = json.load(handle)
    out = []
    for panel in board['panels']:
        for target in panel.get('targets') or ():
            expr = target['expr']
            for name in ('instance', 'user'):
                expr = expr.replace('${%s}' % name, '.*').replace('$%s' % name, '.*')
            assert '$' not in expr, (panel['title'], expr)
            out.append((panel['title'], expr))
    return board, out


def test_the_chain_guard_textfile_node_exporter_prometheus_rules_dashboard(tmp_path):
    """Two simulated nodes' textfiles (real ticks, the last one now), one node_exporter each, one prometheus;
    the servers live only within this test (started and stopped here, by their pids)."""
    base = tmp_path
    start = time.time() - 11 * gs.STEP      # the last tick of the first node: now
    node1 = gs.enforcement(base / 'node1', start=start)
    node2 = gs.health_and_rogue(base / 'node2', start=time.time() - 2 * gs.STEP)
    dirs = [str(base / name / 'var/lib/node_exporter/textfile_collector') for name in ('node1', 'node2')]
    assert all(os.listdir(d) == ['gpufleet.prom'] for d in dirs)
    ports = [_free_port() for _index in range(3)]
    config = base / 'prometheus.yml'
    config.write_text(json.dumps({
        'global': {'scrape_interval': '1s', 'evaluation_interval': '1s'},
        'rule_files': [RULES],
        'scrape_configs': [{'job_name': 'node', 'static_configs': [
            {'targets': ['127.0.0.1:%d' % ports[0]], 'labels': {'node': 'gpu-node-1'}},
            {'targets': ['127.0.0.1:%d' % ports[1]], 'labels': {'node': 'gpu-node-2'}}]}]}))
    procs = []
    try:
        for index, directory in enumerate(dirs):
            procs.append(_start([NODE_EXPORTER, '--collector.disable-defaults', '--collector.textfile',
                                 '--collector.textfile.directory=%s' % directory,
                                 '--web.listen-address=127.0.0.1:%d' % ports[index]], str(base / ('node_exporter%d.log' % index))))
        procs.append(_start([PROMETHEUS, '--config.file=%s' % config, '--storage.tsdb.path=%s' % (base / 'tsdb'),
                             '--web.listen-address=127.0.0.1:%d' % ports[2], '--log.level=warn'], str(base / 'prometheus.log')))
        for port in ports[:2]:
            _until('node_exporter on %d' % port, lambda port=port: 'gpufleet_guard_ticks_total' in _get(port, '/metrics'))
        _until('the first scrapes of both nodes',
               lambda: len(query(ports[2], 'count_over_time(gpufleet_guard_last_tick_timestamp_seconds[1m]) > 2')) == 2)
        fleet = {'port': ports[2], 'targets': ['127.0.0.1:%d' % p for p in ports[:2]], 'texts': (node1, node2)}
        check_the_guard_series_of_both_nodes(fleet)
        check_the_rules_load_and_the_instant_alerts_fire(fleet)
        check_every_dashboard_panel_query_returns_data(fleet)
    finally:
        _stop(procs)
    assert all(proc.poll() is not None for proc in procs)


def _by(result, *names):
    return dict((tuple(r['metric'].get(n) for n in names), float(r['value'][1])) for r in result)


def check_the_guard_series_of_both_nodes(fleet):
    port, (one, two) = fleet['port'], fleet['targets']
    up = _by(query(port, 'up{job="node"}'), 'instance', 'node')
    assert up == {(one, 'gpu-node-1'): 1.0, (two, 'gpu-node-2'): 1.0}
    assert _by(query(port, 'node_textfile_scrape_error'), 'instance') == {(one,): 0.0, (two,): 0.0}
    # the values the guard wrote, per node, with their labels (node 1: alice acted on 4 times, 12 GiB on 4 GPUs)
    node1, node2 = (gs.samples(texts[-1]) for texts in fleet['texts'])
    # node 2: the miner's user, acted on at once (the rogue grace is 0; dry-run: logged only)
    assert _by(query(port, 'gpufleet_guard_user_actions_total'), 'instance', 'user') == {(one, 'alice'): 4.0, (two, 'eve'): 1.0}
    memory = _by(query(port, 'gpufleet_user_gpu_memory_mib{instance="%s"}' % one), 'user', 'gpu')
    assert memory == dict(((dict(k)['user'], dict(k)['gpu']), v) for (n, k), v in node1.items() if n == 'gpufleet_user_gpu_memory_mib')
    assert memory[('alice', '3')] == 12 * 1024 and memory[('bob', '0')] == 30 * 1024
    ticks = _by(query(port, 'gpufleet_guard_last_tick_timestamp_seconds'), 'instance')
    assert ticks == {(one,): node1[('gpufleet_guard_last_tick_timestamp_seconds', ())],
                     (two,): node2[('gpufleet_guard_last_tick_timestamp_seconds', ())]}
    # node 2: the Xid GPUs by fault class, the lost GPU that wants a reboot, the rogue finding
    xids = _by(query(port, 'gpufleet_gpu_xid_errors'), 'instance', 'gpu', 'code', 'fault')
    assert xids == {(two, '0', '13', 'application'): 1.0, (two, '1', '79', 'gpu'): 1.0, (two, '2', '48', 'gpu'): 1.0}
    uuid = [dict(k)['uuid'] for (n, k) in node2 if n == 'gpufleet_gpu_reboot_wanted' and dict(k)['gpu'] == '1'][0]
    assert _by(query(port, 'gpufleet_gpu_reboot_wanted == 1'), 'instance', 'gpu', 'uuid') == {(two, '1', uuid): 1.0}
    assert _by(query(port, 'gpufleet_gpu_health_status > 0'), 'instance', 'gpu') == {(two, '1'): 2.0, (two, '2'): 1.0}
    assert _by(query(port, 'gpufleet_guard_rogue_findings > 0'), 'instance', 'level') == {(two, 'critical'): 1.0}
    assert _by(query(port, 'gpufleet_guard_mode == 1'), 'instance', 'mode') == {(one, 'dry-run'): 1.0, (two, 'dry-run'): 1.0}


def check_the_rules_load_and_the_instant_alerts_fire(fleet):
    port, two = fleet['port'], fleet['targets'][1]
    groups = _get(port, '/api/v1/rules')['data']['groups']
    assert sorted(g['name'] for g in groups) == ['gpufleet-enforcement', 'gpufleet-guard', 'gpufleet-health']
    assert all(r['health'] == 'ok' for g in groups for r in g['rules']), groups

    def firing():
        found = set((a['labels']['alertname'], a['labels'].get('instance'), a['labels'].get('user'))
                    for a in _get(port, '/api/v1/alerts')['data']['alerts'] if a['state'] == 'firing')
        return found if {('GpuLost', two, None), ('GpuRebootWanted', two, None)} <= found else None
    found = _until('the alerts without a for', firing)
    assert ('GpuUserEnforcementRate', None, 'alice') in found and ('GpuRogueProcess', two, None) in found
    assert not [a for a in found if a[0] in ('GpuGuardTickStale', 'GpuGuardPolicyInvalid', 'GpuGuardUntrustedInput')]


def check_every_dashboard_panel_query_returns_data(fleet):
    port = fleet['port']
    board, queries = dashboard_queries()
    assert len(queries) == sum(1 for p in board['panels'] if p['type'] != 'row') >= 18
    empty = [(title, expr) for title, expr in queries if not query(port, expr)]
    assert not empty, empty
    for variable in board['templating']['list']:
        if variable['type'] == 'query':
            metric, label = variable['query']['query'][len('label_values('):-1].split(', ')
            values = _get(port, '/api/v1/label/%s/values' % label, **{'match[]': metric})['data']
            assert values, variable['name']
