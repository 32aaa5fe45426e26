# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpufleet.reclaim.fleet_rows: the fleet report's rows, offenders and totals from the node records, in one pass."""

from __future__ import annotations

import re

import pytest

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.reclaim.plugins.filter.fleet_rows import FilterModule, fleet_rows
from ansible_collections.gpufleet.reclaim.plugins.filter.redact_gpu_facts import redact_gpu_facts
from ansible_collections.gpufleet.reclaim.tests.unit.security.test_output_escaping import _report_env, unsafe_in

GIB = 1024


def device(index, used, procs, util=0, orphaned=0, health='ok', **extra):
    dev = {'index': index, 'name': 'H100', 'uuid': 'GPU-%d' % index, 'pci_bus_id': '0000:%02x:00.0' % index, 'vendor': 'nvidia',
           'memory_total_mib': 80 * GIB, 'memory_used_mib': used, 'memory_free_mib': None if used is None else 80 * GIB - used,
           'orphaned_mib': orphaned, 'utilization_pct': util, 'temperature_c': 40, 'power_w': 100.0, 'processes': procs,
           'health': {'status': health, 'recommended_action': 'none' if health == 'ok' else 'reset',
                      'reasons': [] if health == 'ok' else ['Xid 79']}}
    dev.update(extra)
    return dev


def process(pid, user, mib, gpus, cmdline=None, **extra):
    proc = {'pid': pid, 'user': user, 'name': 'python', 'cmdline': ['python', 'train.py'] if cmdline is None else cmdline,
            'used_mib': mib, 'gpu_indexes': gpus, 'status': 'sleeping', 'container': None, 'slurm_job': None}
    proc.update(extra)
    return proc


def records():
    mig = [{'gpu_instance_id': 1, 'compute_instance_id': 0, 'profile': '3g.40gb', 'uuid': 'MIG-1', 'memory_used_mib': 10 * GIB,
            'memory_total_mib': 40 * GIB, 'processes': [{'pid': 12}]},
           {'gpu_instance_id': 2, 'compute_instance_id': 0, 'profile': '3g.40gb', 'uuid': 'MIG-2', 'memory_used_mib': None,
            'memory_total_mib': 40 * GIB}]
    gpu1 = device(1, 20 * GIB + 4 * GIB, [12], util=90, orphaned=4 * GIB, mig_mode='enabled', mig_devices=mig)
    node1 = {'devices': [device(0, 6 * GIB, [10, 11], util=0), gpu1],
             'processes': [process(10, 'alice', 2 * GIB, [0]), process(11, 'bob', 4 * GIB, [0], container={'id': 'c0ffee'}),
                           process(12, 'alice', 20 * GIB, [1], slurm_job='42')],
             'holders': [{'pid': 99, 'user': 'eve', 'name': 'sleep', 'cmdline': ['sleep', '9'], 'devices': ['/dev/nvidia0']}]}
    node2 = {'devices': [device(0, None, [20], util=None, health='degraded')],
             'processes': [process(20, None, None, [0], cmdline=[])], 'holders': []}
    return [{'host': 'node1', 'status': 'ok', 'msg': '', 'gpu': node1},
            {'host': 'node2', 'status': 'ok', 'msg': '', 'gpu': node2},
            {'host': 'node3', 'status': 'unreachable', 'msg': 'ssh: timed out', 'gpu': None},
            {'host': 'node4', 'status': 'failed', 'msg': 'module failed', 'gpu': None}]


def test_one_row_per_gpu_with_its_top_process_percentages_and_mig_slices():
    rows = fleet_rows(records())
    gpus = rows['gpus']
    assert [(g['host'], g['index']) for g in gpus] == [('node1', 0), ('node1', 1), ('node2', 0)]
    g0, g1, g2 = gpus
    assert (g0['processes'], g0['top_user'], g0['top_pid'], g0['top_used_mib']) == (2, 'bob', 11, 4 * GIB)
    assert (g0['used_pct'], g0['proc_pct'], g0['orphan_pct']) == (7.5, 7.5, 0.0)
    assert (g1['used_pct'], g1['proc_pct'], g1['orphan_pct'], g1['mig_mode']) == (30.0, 25.0, 5.0, 'enabled')
    assert g1['mig'] == [
        {'unit': '1:1', 'gpu_instance_id': 1, 'compute_instance_id': 0, 'profile': '3g.40gb', 'uuid': 'MIG-1',
         'memory_used_mib': 10 * GIB, 'memory_total_mib': 40 * GIB, 'processes': 1, 'width_pct': 50.0, 'used_pct': 25.0},
        {'unit': '1:2', 'gpu_instance_id': 2, 'compute_instance_id': 0, 'profile': '3g.40gb', 'uuid': 'MIG-2',
         'memory_used_mib': None, 'memory_total_mib': 40 * GIB, 'processes': 0, 'width_pct': 50.0, 'used_pct': None}]
    # memory use unknown: no percentages; a process without memory use still is the GPU's (only) top process
    assert (g2['used_pct'], g2['proc_pct'], g2['orphan_pct'], g2['top_pid'], g2['health']) == (None, None, None, 20, 'degraded')
    assert g2['mig'] == [] and g2['mig_mode'] is None and g2['reasons'] == ['Xid 79'] and g2['recommended_action'] == 'reset'


def test_one_row_per_process_with_idle_decided_by_its_gpus_utilization():
    procs = fleet_rows(records(), idle_util_pct=5, idle_min_mib=GIB)['procs']
    expected = [('node1', 10, 'alice'), ('node1', 11, 'bob'), ('node1', 12, 'alice'), ('node2', 20, '?')]
    assert [(p['host'], p['pid'], p['user']) for p in procs] == expected
    p10, p11, p12, p20 = procs
    assert (p10['idle'], p10['gpu_util_pct'], p10['cmd']) == (True, 0, 'python train.py')
    assert (p11['idle'], p11['container']) == (True, 'c0ffee')
    assert (p12['idle'], p12['gpu_util_pct'], p12['slurm_job']) == (False, 90, '42')
    assert (p20['idle'], p20['gpu_util_pct'], p20['cmd']) == (False, None, 'python')   # utilization unknown: never idle
    # a higher floor: alice's 2 GiB is no longer an idle holder
    assert [p['pid'] for p in fleet_rows(records(), idle_min_mib=3 * GIB)['procs'] if p['idle']] == [11]


def test_offenders_and_totals():
    rows = fleet_rows(records())
    assert rows['users'] == [
        {'user': 'alice', 'used_mib': 22 * GIB, 'idle_mib': 2 * GIB, 'processes': 2, 'gpus': 2, 'nodes': 1},
        {'user': 'bob', 'used_mib': 4 * GIB, 'idle_mib': 4 * GIB, 'processes': 1, 'gpus': 1, 'nodes': 1},
        {'user': '?', 'used_mib': 0, 'idle_mib': 0, 'processes': 1, 'gpus': 1, 'nodes': 1}]
    assert [p['pid'] for p in rows['idle']] == [11, 10]
    assert [(g['host'], g['index']) for g in rows['orphaned']] == [('node1', 1)]
    assert [(g['host'], g['index']) for g in rows['unhealthy']] == [('node2', 0)]
    assert rows['holders'] == [{'pid': 99, 'user': 'eve', 'name': 'sleep', 'cmdline': ['sleep', '9'], 'devices': ['/dev/nvidia0'],
                                'host': 'node1', 'cmd': 'sleep 9'}]
    assert rows['totals'] == {'nodes': 4, 'nodes_ok': 2, 'nodes_unreachable': 1, 'nodes_failed': 1, 'gpus': 3,
                              'memory_total_mib': 240 * GIB, 'memory_used_mib': 30 * GIB, 'orphaned_mib': 4 * GIB, 'idle_mib': 6 * GIB,
                              'processes': 4, 'users': 3, 'unhealthy_gpus': 1, 'idle_holders': 2, 'orphan_holders': 1,
                              'disrupted_nodes': 0}


def test_the_nodes_gpufleet_disrupted_lately_are_listed_with_why_and_escaped_on_the_page():
    """issue #30: the report shows the nodes that count against the blast-radius limit, from each node's disruption."""
    recs = records()
    recs[0]['gpu'] = dict(recs[0]['gpu'], disruption={
        'drained': {'reason': 'gpufleet: GPU 1 <b>x</b>\x1b[2J', 'via': 'slurm', 'ago_s': 9000.0}, 'reboot_flag': None,
        'scheduler': None, 'actions': [{'action': 'reset', 'gpu': 'GPU-1', 'time': 1.0, 'ago_s': 600.0, 'by': 'remediate'}]})
    recs[1]['gpu'] = dict(recs[1]['gpu'], disruption={'drained': None, 'reboot_flag': None, 'scheduler': None, 'actions': [
        {'action': 'reset', 'gpu': 'GPU-2', 'time': 1.0, 'ago_s': 4000.0, 'by': 'gpu_reset'}]})
    rows = fleet_rows(recs)
    why = ['drained by the ladder (gpufleet: GPU 1 <b>x</b>\x1b[2J)', 'reset of GPU GPU-1 10m00s ago']
    assert rows['disrupted'] == [{'host': 'node1', 'why': why}]
    assert rows['totals']['disrupted_nodes'] == 1
    assert [d['host'] for d in fleet_rows(recs, disruption_window='2h')['disrupted']] == ['node1', 'node2']
    html = _report_env().get_template('report.html.j2').render(**_report(rows))
    assert 'Nodes disrupted by gpufleet' in html and 'gpufleet: GPU 1 &lt;b&gt;x&lt;/b&gt;\\x1b[2J' in html
    assert not unsafe_in(html, allow='\n')
    with pytest.raises(AnsibleFilterError) as exc:
        fleet_rows(recs, disruption_window='soon')
    assert 'disruption_window' in str(exc.value)


def test_unreachable_nodes_only_count_and_an_empty_fleet_is_zero():
    down = [r for r in records() if r['gpu'] is None]
    rows = fleet_rows(down)
    assert rows['gpus'] == rows['procs'] == rows['users'] == rows['holders'] == []
    assert (rows['totals']['nodes'], rows['totals']['nodes_unreachable'], rows['totals']['nodes_failed']) == (2, 1, 1)
    assert fleet_rows([])['totals'] == dict.fromkeys(rows['totals'], 0)


def test_values_stay_raw_in_the_rows_and_the_page_escapes_them():
    hostile = ['python', '<script>alert(1)</script>', '\x1b]0;pwned\x07', '--token=abc']
    facts = {'devices': [device(0, 8 * GIB, [7], name='<b>H100</b>\u202e')],
             'processes': [process(7, 'mallory\x1b[2J', 8 * GIB, [0], cmdline=hostile)], 'holders': []}
    recs = [{'host': 'node1', 'status': 'ok', 'msg': '', 'gpu': redact_gpu_facts(facts)},
            {'host': 'node<2>', 'status': 'unreachable', 'msg': 'ssh \x1b[31m<down>', 'gpu': None}]
    rows = fleet_rows(recs)
    assert rows['procs'][0]['user'] == 'mallory\x1b[2J' and '<script>' in rows['procs'][0]['cmd'] and 'abc' not in rows['procs'][0]['cmd']
    assert rows['gpus'][0]['name'] == '<b>H100</b>\u202e'
    html = _report_env().get_template('report.html.j2').render(**_report(rows))
    assert not unsafe_in(html, allow='\n'), unsafe_in(html, allow='\n')
    assert '<script>' not in html and '&lt;script&gt;alert(1)&lt;/script&gt;' in html and '&lt;b&gt;H100&lt;/b&gt;\\u202e' in html
    assert 'mallory\\x1b[2J' in html and 'id="node-node&lt;2&gt;"' in html and 'ssh \\x1b[31m&lt;down&gt;' in html
    # node1's GPUs are in a section under its name (open in a small fleet); the unreachable node shows its reason without one
    node1 = html[html.index('id="node-node1"'):html.index('id="node-node&lt;2&gt;"')]
    assert '<details open>' in node1 and '<summary>' in node1 and 'GPU 0' in node1
    assert '<details' not in html[html.index('id="node-node&lt;2&gt;"'):]


def test_fleet_csv_has_a_line_per_gpu_and_one_per_node_without_gpus():
    recs = records() + [{'host': 'node5', 'status': 'ok', 'msg': '', 'gpu': {'devices': [], 'processes': []}}]
    rows = fleet_rows(recs)
    assert rows['records'] is recs
    lines = rows['csv'].split('\n')
    assert lines[0].startswith('host,status,gpu_index,uuid,') and lines[0].endswith(',top_pid,top_used_mib,message') and lines[-1] == ''
    expected = [['"node1"', 'ok', '0'], ['"node1"', 'ok', '1'], ['"node2"', 'ok', '0'], ['"node3"', '"unreachable"', ''],
                ['"node4"', '"failed"', ''], ['"node5"', '"ok"', '']]
    assert [line.split(',')[:3] for line in lines[1:-1]] == expected
    assert lines[2] == ('"node1",ok,1,"GPU-1","H100","0000:01:00.0",24576,81920,30.0,4096,90,40,100.0,"ok","none","",1,"alice",12,20480,')
    assert lines[3].split(',')[8] == '' and lines[3].split(',')[15] == '"Xid 79"'      # memory use unknown: an empty cell, never 0
    assert lines[4].endswith(',"ssh: timed out"') and lines[6].endswith(',"no GPU found"')


def _report(rows):
    """The variables the playbook hands the report's templates."""
    return dict(gpufleet_gpus=rows['gpus'], gpufleet_procs=rows['procs'], gpufleet_holders=rows['holders'], gpufleet_nodes=rows['nodes'],
                gpufleet_users=rows['users'], gpufleet_idle=rows['idle'], gpufleet_orphaned=rows['orphaned'],
                gpufleet_unhealthy=rows['unhealthy'], gpufleet_totals=rows['totals'], gpufleet_pages=rows['pages'],
                gpufleet_disrupted=rows['disrupted'], gpufleet_window='1h',
                gpufleet_generated='2026-01-01T00:00:00Z', gpufleet_top=10, gpufleet_idle_util_pct=5, gpufleet_idle_min_mib=1024,
                gpufleet_page_nodes=100, gpufleet_index_rows=100)


def _pages(recs, page_nodes=100, page_rows=500):
    """Every file of the report: index.html and the pages it links, by name."""
    rows = fleet_rows(recs, page_nodes=page_nodes, page_rows=page_rows)
    env, report = _report_env(), _report(rows)
    files = {'index.html': env.get_template('report.html.j2').render(**report)}
    for page in rows['pages']:
        template = 'report-nodes.html.j2' if page['kind'] == 'nodes' else 'report-rows.html.j2'
        files[page['file']] = env.get_template(template).render(gpufleet_page=page, **report)
    return files


def _page(recs):
    return _pages(recs)['index.html']


def _idle_node(count):
    return {'devices': [device(0, count * GIB, list(range(1, count + 1)))],
            'processes': [process(pid, 'u%d' % pid, GIB, [0]) for pid in range(1, count + 1)], 'holders': []}


def test_nodes_rows_point_at_their_gpus_and_add_them_up():
    nodes = fleet_rows(records())['nodes']
    assert [(n['host'], n['status'], n['first_gpu'], n['gpus'], n['processes']) for n in nodes] == [
        ('node1', 'ok', 0, 2, 3), ('node2', 'ok', 2, 1, 1), ('node3', 'unreachable', 3, 0, 0), ('node4', 'failed', 3, 0, 0)]
    node1, node2 = nodes[0], nodes[1]
    assert (node1['memory_used_mib'], node1['memory_total_mib'], node1['unhealthy'], node1['orphaned']) == (30 * GIB, 160 * GIB, 0, 1)
    assert (node2['memory_used_mib'], node2['unhealthy'], node2['orphaned'], node2['backend_error']) == (0, 1, 0, None)
    assert nodes[2]['msg'] == 'ssh: timed out'
    # a node without GPUs says why when a backend does
    facts = {'backends': {'amd': {'error': None}, 'nvidia': {'error': 'no libnvidia-ml'}}, 'devices': [], 'processes': []}
    empty = [{'host': 'n', 'status': 'ok', 'msg': '', 'gpu': facts}]
    assert fleet_rows(empty)['nodes'][0]['backend_error'] == 'no libnvidia-ml'
    assert 'No GPU found (no libnvidia-ml).' in _page(empty)


def test_pages_only_past_page_nodes_and_only_for_long_offenders_lists():
    recs = [{'host': 'n%03d' % n, 'status': 'ok' if n == 0 else 'unreachable', 'msg': 'down', 'gpu': _idle_node(130) if n == 0 else None}
            for n in range(201)]
    assert fleet_rows(recs)['pages'] == [] and fleet_rows(recs[:100], page_nodes=100)['pages'] == []
    pages = fleet_rows(recs, page_nodes=100, page_rows=50)['pages']
    assert [(p['kind'], p['page'], p['file'], p['start'], p['stop']) for p in pages] == [
        ('nodes', 1, 'nodes-0001.html', 0, 100), ('nodes', 2, 'nodes-0002.html', 100, 200), ('nodes', 3, 'nodes-0003.html', 200, 201),
        ('idle', 1, 'idle-0001.html', 0, 50), ('idle', 2, 'idle-0002.html', 50, 100), ('idle', 3, 'idle-0003.html', 100, 130)]
    assert [p['kind'] for p in fleet_rows(recs, page_nodes=100, index_rows=130)['pages']] == ['nodes'] * 3


def test_a_small_fleet_is_one_page_and_long_tables_open_under_n_more():
    recs = [{'host': 'n%03d' % n, 'status': 'ok' if n == 0 else 'unreachable', 'msg': 'down', 'gpu': _idle_node(130) if n == 0 else None}
            for n in range(100)]
    files = _pages(recs)
    assert list(files) == ['index.html']
    html = files['index.html']
    assert html.count('<article class="node') == 100 and '<nav class="pages"' not in html
    # 130 idle holders: 100 rows shown, 30 under "30 more", every one of them in the page
    assert '<details>\n<summary><h3><span>n000</span>' in html      # past 50 nodes a node's GPUs start closed
    assert '<summary>30 more</summary>' in html and all('<td class="num">%d</td>' % pid in html for pid in range(1, 131))
    assert '<details open>\n<summary><h3><span>n000</span>' in _page(recs[:50])


def test_a_large_fleet_gets_an_index_and_pages_of_nodes_and_of_rows():
    recs = [{'host': 'n%03d' % n, 'status': 'ok' if n % 50 == 0 else 'unreachable', 'msg': 'down', 'gpu': _idle_node(130) if n % 50 == 0 else None}
            for n in range(201)]
    files = _pages(recs, page_rows=200)
    assert sorted(files) == ['idle-000%d.html' % n for n in range(1, 5)] + ['index.html'] + ['nodes-000%d.html' % n for n in range(1, 4)]
    index = files['index.html']
    # the index: totals, offenders (first 100 rows, then links to pages of every row), one line per page of nodes; no node card
    assert '<article' not in index and '<summary>' not in index
    assert '<tr><td><a href="nodes-0002.html">2</a></td><td><span>n100</span> … <span>n199</span></td><td class="num">100</td>' in index
    # the first 100 idle holders' rows, and 10 largest processes (the same row)
    assert len(re.findall(r'<td class="num">[0-9]+</td><td>u[0-9]+</td><td class="num">1.0</td>', index)) == 100 + 10
    assert ('<nav class="pages" aria-label="Idle holders: every row">All 650 rows: <a href="idle-0001.html">1-200</a> '
            '<a href="idle-0002.html">201-400</a> <a href="idle-0003.html">401-600</a> <a href="idle-0004.html">601-650</a> </nav>') in index
    # a page of nodes: its nodes' cards, GPUs open, links to the other pages and back
    page2 = files['nodes-0002.html']
    assert page2.count('<article class="node') == 100 and 'id="node-n100"' in page2 and 'id="node-n200"' not in page2
    assert '<details open>\n<summary><h3><span>n150</span>' in page2 and '<a href="index.html">' in page2
    assert '<a href="nodes-0001.html">1</a> <b>2</b> <a href="nodes-0003.html">3</a>' in page2
    # a page of rows: its slice of the list
    rows2 = files['idle-0002.html']
    assert rows2.count('<tr><td>n') == 200 and 'rows 201-400 of 650' in rows2
    for name, html in files.items():
        assert '<script' not in html and "default-src 'none'" in html, name
        assert set(re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', html)) <= set(files) | {'data:,'}, name


def test_every_page_escapes_what_the_nodes_wrote():
    hostile = ['python', '<script>alert(1)</script>', '\x1b]0;pwned\x07', '--token=abc']
    facts = {'devices': [device(0, 8 * GIB, [1, 2], name='<b>H100</b>\u202e')],
             'processes': [process(pid, 'mallory\x1b[2J', 4 * GIB, [0], cmdline=hostile) for pid in (1, 2)], 'holders': []}
    recs = [{'host': 'node<%03d>\u202e' % n, 'status': 'ok', 'msg': '', 'gpu': redact_gpu_facts(facts)} for n in range(101)]
    files = _pages(recs, page_rows=150)
    assert sorted(files) == ['idle-0001.html', 'idle-0002.html', 'index.html', 'nodes-0001.html', 'nodes-0002.html']
    for name, html in files.items():
        assert not unsafe_in(html, allow='\n'), (name, unsafe_in(html, allow='\n'))
        assert '<script>' not in html and '<b>H100' not in html and 'abc' not in html, name
        assert 'node&lt;000&gt;\\u202e' in html or 'node&lt;100&gt;\\u202e' in html, name
    assert '&lt;b&gt;H100&lt;/b&gt;\\u202e' in files['nodes-0001.html'] and 'mallory\\x1b[2J' in files['idle-0002.html']
    assert '&lt;script&gt;alert(1)&lt;/script&gt;' in files['idle-0002.html']


@pytest.mark.parametrize('bad, needle', [
    ('node1', 'must be a list'),
    ([{'status': 'ok'}], 'must be a mapping with a host'),
    ([None], 'must be a mapping with a host'),
])
def test_bad_input_is_a_clear_error(bad, needle):
    with pytest.raises(AnsibleFilterError, match=needle):
        fleet_rows(bad)
    with pytest.raises(AnsibleFilterError, match='idle_util_pct and idle_min_mib must be integers'):
        fleet_rows([], idle_util_pct='five')
    with pytest.raises(AnsibleFilterError, match="invalid page_rows 0: expected an integer of at least 1"):
        fleet_rows([], page_rows=0)
    with pytest.raises(AnsibleFilterError, match="invalid page_nodes 'many': expected an integer of at least 0"):
        fleet_rows([], page_nodes='many')


def test_the_filter_is_registered():
    assert FilterModule().filters() == {'fleet_rows': fleet_rows}
