# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The EDA source gpufleet.reclaim.alertmanager (extensions/eda/plugins/event_source/alertmanager.py): alerts
to nodes, host patterns refused, the storm limit, and its HTTP server on 127.0.0.1 (issue #33).

The loop with the real ansible-rulebook, Alertmanager and Prometheus: tests/integration/targets/eda_loop.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from ansible_collections.gpufleet.reclaim.tests.unit.extensions.eda_source import alert, load_source, payload

am = load_source()


class Clock(object):
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize('labels, node', [
    ({'instance': 'gpu-node-01:9100'}, 'gpu-node-01'),
    ({'instance': 'gpu-node-01.dc1.example.org:9100'}, 'gpu-node-01.dc1.example.org'),
    ({'instance': 'node01'}, 'node01'),
    ({'instance': '10.0.0.7:9100', 'node': 'gpu-node-07'}, 'gpu-node-07'),   # the relabelled node label wins
    ({'instance': '[fd00::7]:9100'}, 'fd00::7'),
    ({'instance': 'fd00::7'}, 'fd00::7'),
    ({'instance': '10.0.0.7:9100'}, '10.0.0.7'),
])
def test_the_node_is_the_node_label_or_the_instance_without_its_port(labels, node):
    assert am.node_of(labels) == node


@pytest.mark.parametrize('value', ['all', 'ungrouped', '*', 'node*', 'gpu_nodes:&rack1', '!node01', '~node0[1-9]',
                                   'node01,node02', 'node01 node02', '', 'node\x1b[2Jx', '../x', '-i'])
def test_host_patterns_and_odd_names_are_refused(value):
    with pytest.raises(am.Refused) as err:
        am.node_of({'node': value} if value else {'instance': value})
    assert 'label' in str(err.value)


def test_with_the_inventory_only_its_hosts_are_nodes_never_its_groups(tmp_path):
    path = tmp_path / 'inventory.ini'
    path.write_text('[gpu_nodes]\nnode01\nnode02\n[rack1:children]\ngpu_nodes\n')
    inventory = am.Inventory(str(path))
    assert am.node_of({'instance': 'node01:9100'}, inventory.names()) == 'node01'
    for group in ('gpu_nodes', 'rack1', 'node03'):
        with pytest.raises(am.Refused, match='not a host of the inventory'):
            am.node_of({'node': group}, inventory.names())
    path.write_text('[gpu_nodes]\nnode01\nnode02\nnode03-new\n')       # re-read once the file changed
    assert am.node_of({'node': 'node03-new'}, inventory.names()) == 'node03-new'


def test_one_event_per_alert_of_interest_with_its_node():
    router = am.Router(clock=Clock())
    events = router.route(payload(alert('GpuXidFault', 'node01:9100', gpu='0', code='48', fault='gpu'),
                                  alert('GpuRogueProcess', 'node02:9100', level='critical'),
                                  alert('GpuGuardTickStale', 'node03:9100'),
                                  alert('GpuXidFault', 'all:9100'),
                                  alert('GpuXidFault', 'node04:9100', status='resolved')))
    assert [(e['node'], e['alert']['labels']['alertname'], e['alert']['status']) for e in events] == [
        ('node01', 'GpuXidFault', 'firing'), ('node02', 'GpuRogueProcess', 'firing'), ('node04', 'GpuXidFault', 'resolved')]
    assert events[0]['alert']['labels']['code'] == '48' and events[0]['alert']['fingerprint']
    assert events[0]['receiver'] == 'gpufleet-eda' and 'meta' not in events[0]
    assert router.counts == {'payloads': 1, 'events': 3, 'refused': 1, 'suppressed': 0, 'ignored': 1, 'dropped': 0}


def test_an_alert_storm_reaches_a_few_nodes_and_is_reported_once_per_window(caplog):
    clock = Clock()
    router = am.Router(storm=am.StormLimit(3, 600), clock=clock)
    storm = payload(*[alert('GpuXidFault', 'node%02d:9100' % n, gpu='0') for n in range(1, 41)])
    events = router.route(storm)
    acting = [e for e in events if 'alert' in e]
    reports = [e['gpufleet_storm'] for e in events if 'gpufleet_storm' in e]
    assert [e['node'] for e in acting] == ['node01', 'node02', 'node03']
    assert len(reports) == 1 and reports[0]['suppressed_count'] == 37 and reports[0]['max_nodes'] == 3
    assert reports[0]['admitted'] == ['node01', 'node02', 'node03'] and 'node40' in reports[0]['suppressed']
    assert 'alert storm' in caplog.text and 'GpuXidFault on node40 not acted on' in caplog.text
    # Alertmanager repeats the group: the admitted nodes' alerts still pass (the rulebook throttles them), no new report
    clock.now += 60
    again = router.route(storm)
    assert [e['node'] for e in again if 'alert' in e] == ['node01', 'node02', 'node03']
    assert not [e for e in again if 'gpufleet_storm' in e]
    # resolved alerts of suppressed nodes pass (they start nothing) and take no place in the limit
    resolved = router.route(payload(alert('GpuXidFault', 'node30:9100', status='resolved')))
    assert [(e['node'], e['alert']['status']) for e in resolved] == [('node30', 'resolved')]
    # a window later the storm is over: other nodes are admitted again, and a new storm is reported anew
    clock.now += 600
    later = router.route(payload(*[alert('GpuXidFault', 'node%02d:9100' % n) for n in range(20, 25)]))
    assert [e['node'] for e in later if 'alert' in e] == ['node20', 'node21', 'node22']
    assert [e['gpufleet_storm']['suppressed'] for e in later if 'gpufleet_storm' in e] == [['node23', 'node24']]


def test_a_limit_of_zero_acts_nowhere_and_one_payload_is_bounded():
    router = am.Router(storm=am.StormLimit(0, 600), max_alerts=10, clock=Clock())
    events = router.route(payload(*[alert('GpuXidFault', 'node%02d' % n) for n in range(30)]))
    assert [e['gpufleet_storm']['suppressed_count'] for e in events] == [10]
    assert router.counts['dropped'] == 20


def test_a_body_that_is_not_alertmanagers_is_refused():
    router = am.Router()
    for body in ({}, [], {'alerts': 'x'}, 'text'):
        with pytest.raises(am.Refused):
            router.route(body)


def test_arguments_from_the_rulebook_are_text():
    router = am.router_from_args({'port': '5001', 'storm_max_nodes': '2', 'storm_window': '30', 'inventory': '',
                                  'alertnames': ['GpuXidFault']})
    assert (router.storm.max_nodes, router.storm.window, router.inventory, router.alertnames) == (2, 30, None, {'GpuXidFault'})


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def test_the_webhook_server_on_loopback_with_a_token():
    aiohttp = pytest.importorskip('aiohttp', reason='aiohttp comes with ansible-rulebook (tests/requirements-dev.txt)')
    port = _free_port()

    async def scenario():
        queue = asyncio.Queue()
        server = asyncio.ensure_future(am.main(queue, {'host': '127.0.0.1', 'port': str(port), 'token': 's3cret',
                                                       'storm_max_nodes': 5}))
        url = 'http://127.0.0.1:%d/alerts' % port
        body = json.dumps(payload(alert('GpuXidFault', 'node01:9100')))
        answers = []
        try:
            async with aiohttp.ClientSession() as session:
                for _attempt in range(100):              # the server binds within a second
                    try:
                        async with session.post(url, data=body) as response:
                            answers.append(response.status)
                            break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
                for headers, data in (({'Authorization': 'Bearer wrong'}, body), ({'Authorization': 'Bearer s3cret'}, '{x'),
                                      ({'Authorization': 'Bearer s3cret'}, '{}'), ({'Authorization': 'Bearer s3cret'}, body)):
                    async with session.post(url, data=data, headers=headers) as response:
                        answers.append((response.status, await response.text()))
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        return answers, [queue.get_nowait() for _event in range(queue.qsize())]

    answers, events = asyncio.run(scenario())
    assert answers[0] == 401 and answers[1][0] == 401
    assert answers[2][0] == 400 and answers[3][0] == 400 and 'no alerts list' in answers[3][1]
    assert answers[4] == (200, '{"events": 1}')
    assert [(e['node'], e['alert']['labels']['alertname']) for e in events] == [('node01', 'GpuXidFault')]
    with socket.socket() as sock:                 # the port is free again once the source is cancelled
        sock.bind(('127.0.0.1', port))
