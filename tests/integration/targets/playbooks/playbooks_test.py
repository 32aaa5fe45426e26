# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Drive every gpufleet.reclaim playbook on a simulated fleet and check what happened on the nodes.

Run by runme.sh after tests/fleet/up: python playbooks_test.py --fleet DIR [ansible-playbook args].
Ground truth comes from `gpusim show` on each node (over the fleet's SSH config); the playbooks'
own accounting comes from their summary_file / report files. Only processes this test started
(through gpusim on the simulated nodes) are ever signalled. Network: loopback only.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

WALLET = '44AFFq5kSiGBoZ4NMDwYtN18obc8AemS33DBLWs3H7otXft3XjrpDtQGv7SqSsaBYBb98uNbr2VBBEt7f2wfn3RVGQBEP3A'
XSS = '<script>alert("x")</script>'
NODES = ['node01', 'node02', 'node03', 'node04', 'node05', 'node06']
DOWN = 'node07'
# Playbooks that make one module call per node and nothing else per node (issue #21): each node's recap counts
# exactly one task (ok, or skipped for a halted reset), whatever happened to it.  The acting ones plan every node
# first (issue #30): a confirmed run adds the act, a second call (in check mode with --check), on the nodes that act only.
ONE_CALL = ('rogue_cleanup', 'reclaim_idle', 'reset_unhealthy', 'remediate', 'audit', 'inventory_report')
ACTING = ('rogue_cleanup', 'reclaim_idle', 'reset_unhealthy', 'remediate')

# Bar colours of playbooks/templates/report.html.j2 (memory held by processes, orphaned memory).
PROC_RGB = (0x25, 0x63, 0xeb)
ORPH_RGB = (0xf9, 0x73, 0x16)

# (key, node, gpu, MiB, util %, user, extra gpusim options, argv)
WORKLOADS = [
    ('train1', 'node01', 0, 30720, 97, 'alice', [], ['python', 'train.py', '--model', 'llama-7b']),
    ('jupyter', 'node01', 2, 20480, 0, 'bob', [], ['python', '-m', 'ipykernel_launcher', '-f', 'kernel-1.json']),
    ('carol_idle', 'node01', 1, 8192, 0, 'carol', [], ['python', '-m', 'ipykernel_launcher', '-f', 'kernel-2.json']),
    ('small_idle', 'node01', 3, 512, 0, 'dave', [], ['python', 'notebook.py']),
    ('miner1', 'node02', 1, 4096, 100, 'eve', ['--children', '2'],
     ['python', 'train.py', '--url', 'stratum+tcp://pool.example.net:3333', '--user', WALLET, '-p', 'x']),
    ('train2', 'node02', 0, 16384, 90, 'alice', [], ['python', 'train.py', '--epochs', '3']),
    ('infer', 'node03', 0, 12288, 50, 'alice', [], ['python', 'serve.py', '--engine', 'vllm']),
    ('miner2', 'node04', 3, 8192, 100, 'eve', ['--ignore-term'],
     ['python', 'train.py', '--epochs', '10', '-o', 'stratum+ssl://eu.pool.example.org:4444', '-u', WALLET]),
    ('busy_bob', 'node04', 1, 2048, 60, 'bob', [], ['python', 'finetune.py']),
    ('xss', 'node05', 0, 4096, 40, 'alice', [], ['python', 'eval.py', '--name', XSS]),
]
LEAK = ('node03', 2, 6144)


class Fleet(object):
    def __init__(self, directory, extra):
        self.dir = directory
        self.extra = extra
        self.inventory = os.path.join(directory, 'inventory.ini')
        self.inventory_down = os.path.join(directory, 'inventory-with-down-node.ini')
        self.ssh_config = os.path.join(directory, 'ssh_config')
        self.out = os.path.join(directory, 'out')
        os.makedirs(self.out)
        self.pids = {}
        self.runs = 0
        self.started = time.monotonic()

    def ssh(self, node, argv):
        cmd = ['ssh', '-F', self.ssh_config, node, ' '.join(shlex.quote(a) for a in argv)]
        return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout

    def show(self, node):
        return json.loads(self.ssh(node, ['gpusim', 'show']))

    def alive(self, node, pid):
        return [p for p in self.show(node)['processes'] if p['pid'] == pid][0]['alive']

    def children(self, node, pid):
        return [p for p in self.show(node)['processes'] if p['pid'] == pid][0]['children']

    def used(self, node):
        return [g['used_mib'] for g in self.show(node)['gpus']]

    def write_down_inventory(self):
        """The fleet's inventory plus node07 on a loopback port nothing listens on."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
        sock.close()
        with open(self.inventory, encoding='utf-8') as handle:
            text = handle.read()
        line = '%s ansible_host=127.0.0.1 ansible_port=%d ansible_user=root\n' % (DOWN, port)
        text = text.replace('[gpu_nodes]\n', '[gpu_nodes]\n' + line, 1)
        with open(self.inventory_down, 'w', encoding='utf-8') as handle:
            handle.write(text)

    def playbook(self, name, extra_vars=None, check=False, down=True, expect_rc=0):
        """Run gpufleet.reclaim.NAME; returns (stdout, {host: recap counts}, summary or None)."""
        self.runs += 1
        summary = os.path.join(self.out, '%02d-%s.json' % (self.runs, name))
        evars = dict(extra_vars or {})
        if name in ('rogue_cleanup', 'reclaim_idle', 'reset_unhealthy'):
            evars.setdefault('summary_file', summary)
        argv = ['ansible-playbook', '-i', self.inventory_down if down else self.inventory,
                'gpufleet.reclaim.%s' % name, '-e', json.dumps(evars)] + (['--check'] if check else []) + self.extra
        print('\n### %s%s %s' % (name, ' --check' if check else '', json.dumps(evars)), flush=True)
        begun = time.monotonic()
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
        sys.stdout.write(proc.stdout)
        print('### %s: rc=%d in %.1f s' % (name, proc.returncode, time.monotonic() - begun), flush=True)
        assert proc.returncode == expect_rc, '%s exited %d, expected %d' % (name, proc.returncode, expect_rc)
        recap = {}
        for match in re.finditer(r'^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)',
                                 proc.stdout, re.M):
            recap[match.group(1)] = {'changed': int(match.group(3)), 'unreachable': int(match.group(4)),
                                     'failed': int(match.group(5)), 'ok': int(match.group(2)), 'skipped': int(match.group(6))}
        if name in ONE_CALL:
            tasks = dict((host, counts['ok'] + counts['skipped']) for host, counts in recap.items() if host != 'localhost')
            confirmed = str(evars.get('reclaim_confirm', False)).lower() == 'true'
            allowed = {1, 2} if name in ACTING and confirmed else {1}
            assert tasks and set(tasks.values()) <= allowed, \
                '%s must run one task per node (and the act where it acts): %s' % (name, tasks)
        data = None
        if os.path.exists(summary):
            with open(summary, encoding='utf-8') as handle:
                data = json.load(handle)
        return proc.stdout, recap, data


def nodes_unchanged(recap):
    changed = dict((host, counts['changed']) for host, counts in recap.items() if host != 'localhost' and counts['changed'])
    assert not changed, 'a second run changed something: %s' % changed


def check_down_node_recorded(stdout, summary):
    assert 'FAILED NODE %s | unreachable' % DOWN in stdout, 'the recap must name the unreachable node'
    if summary is not None:
        record = [n for n in summary['nodes'] if n['host'] == DOWN][0]
        assert record['status'] == 'unreachable', record


def killed_pids(summary):
    return sorted((n['host'], p['pid']) for n in summary['nodes'] for p in n['killed'] if p.get('parent_pid') is None)


# ---------------------------------------------------------------------------- PNG and Chromium
def png_pixels(path):
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into (width, height, rows)."""
    with open(path, 'rb') as handle:
        data = handle.read()
    assert data[:8] == b'\x89PNG\r\n\x1a\n', 'not a PNG'
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack('>I4s', data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b'IHDR':
            header = struct.unpack('>IIBBBBB', body)
        elif kind == b'IDAT':
            idat.append(body)
        pos += 12 + length
    width, height, depth, colour, _comp, _filter, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, 'unsupported PNG %r' % (header,)
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(b''.join(idat))
    stride = width * bpp
    rows, prev, pos = [], bytearray(stride), 0
    for _row in range(height):
        kind = raw[pos]
        line = bytearray(raw[pos + 1:pos + 1 + stride])
        pos += 1 + stride
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up = prev[i]
            corner = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xff
            elif kind == 2:
                line[i] = (line[i] + up) & 0xff
            elif kind == 3:
                line[i] = (line[i] + ((left + up) >> 1)) & 0xff
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
                line[i] = (line[i] + pred) & 0xff
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def count_colour(png, rgb, tolerance=6):
    _width, _height, bpp, rows = png
    hits = 0
    for row in rows:
        for i in range(0, len(row), bpp):
            if all(abs(row[i + k] - rgb[k]) <= tolerance for k in range(3)):
                hits += 1
    return hits


def chromium():
    for name in ('chromium', 'chromium-browser', 'google-chrome'):
        path = shutil.which(name)
        if path:
            return path
    return None


def render(browser, html_path, png_path, size):
    """Screenshot html_path; returns the console messages Chromium logged (errors and others)."""
    with tempfile.TemporaryDirectory(prefix='gpufleet-chromium-') as profile:
        argv = [browser, '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-extensions',
                '--host-resolver-rules=MAP * ~NOTFOUND', '--user-data-dir=%s' % profile,
                '--force-device-scale-factor=0.5', '--screenshot=%s' % png_path, '--window-size=%s' % size, '--enable-logging=stderr', '--v=0',
                'file://%s' % os.path.abspath(html_path)]
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=120, check=False)
    assert os.path.exists(png_path), 'chromium wrote no screenshot: %s' % proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ':CONSOLE' in line]


def check_html_in_browser(report_dir, shots):
    browser = chromium()
    if browser is None:
        if os.environ.get('GPUFLEET_SKIP_BROWSER') == '1':
            print('chromium not found: browser checks skipped (GPUFLEET_SKIP_BROWSER=1)')
            return
        raise AssertionError('chromium is needed for the report checks: apt-get install chromium '
                             '(or set GPUFLEET_SKIP_BROWSER=1 to skip them)')
    # The console detector must see a console error on a page that has one.
    bad = os.path.join(shots, 'console-error.html')
    with open(bad, 'w', encoding='utf-8') as handle:
        handle.write('<!DOCTYPE html><html><body><p>x</p><script>undefinedFunctionGpufleet();</script></body></html>')
    messages = render(browser, bad, os.path.join(shots, 'console-error.png'), '400,300')
    assert any('undefinedFunctionGpufleet' in m for m in messages), 'console detector is blind: %s' % messages

    index = os.path.join(report_dir, 'index.html')
    # Whole pages in tall windows, rendered at half scale (a quarter of the pixels to decode).
    for label, size in (('desktop', '1280,3600'), ('phone', '390,7200')):
        png_path = os.path.join(shots, 'report-%s.png' % label)
        messages = render(browser, index, png_path, size)
        assert not messages, 'console messages on the %s report page: %s' % (label, messages)
        png = png_pixels(png_path)
        proc, orph = count_colour(png, PROC_RGB), count_colour(png, ORPH_RGB)
        print('%s screenshot %dx%d: %d process-bar pixels, %d orphan-bar pixels' % (label, png[0], png[1], proc, orph))
        assert proc > 400, 'no memory bars in the %s screenshot' % label
        assert orph > 40, 'no orphaned-memory bar in the %s screenshot' % label
        width = int(size.split(',', maxsplit=1)[0])
        assert png[0] == width // 2, '%s screenshot is %d pixels wide, expected %d' % (label, png[0], width // 2)


# ---------------------------------------------------------------------------- the scenario
def setup(fleet):
    for key, node, gpu, mib, util, user, extra, argv in WORKLOADS:
        out = fleet.ssh(node, ['gpusim', 'spawn', '--gpu', str(gpu), '--mib', str(mib), '--util', str(util),
                               '--user', user] + extra + ['--'] + argv)
        fleet.pids[key] = int(out.split()[0])
    node, gpu, mib = LEAK
    fleet.ssh(node, ['gpusim', 'leak', '--gpu', str(gpu), '--mib', str(mib)])
    fleet.write_down_inventory()


def all_alive(fleet, keys):
    for key in keys:
        node = [w[1] for w in WORKLOADS if w[0] == key][0]
        assert fleet.alive(node, fleet.pids[key]), '%s (pid %d on %s) must be alive' % (key, fleet.pids[key], node)


def test_inventory_report(fleet, label, expect):
    report_dir = os.path.join(fleet.out, 'report-%s' % label)
    stdout, recap, _summary = fleet.playbook('inventory_report', {'report_dir': report_dir})
    check_down_node_recorded(stdout, None)
    assert recap[DOWN]['unreachable'] == 0, 'the unreachable node must be ignored, not fatal'
    with open(os.path.join(report_dir, 'fleet.json'), encoding='utf-8') as handle:
        report = json.load(handle)
    totals = report['totals']
    assert (totals['nodes'], totals['nodes_ok'], totals['nodes_unreachable']) == (7, 6, 1), totals
    assert totals['gpus'] == 24, totals
    assert [n['host'] for n in report['nodes'] if n['status'] == 'unreachable'] == [DOWN]
    for key, value in expect.items():
        assert totals[key] == value, 'totals[%s] = %r, expected %r' % (key, totals[key], value)
    with open(os.path.join(report_dir, 'fleet.csv'), encoding='utf-8', newline='') as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 * 4 + 1, len(rows)
    assert [r['host'] for r in rows if r['status'] == 'unreachable'] == [DOWN]
    node03 = [r for r in rows if r['host'] == 'node03' and r['gpu_index'] == '2'][0]
    assert int(node03['orphaned_mib']) == expect.get('orphaned_mib', 0), node03
    with open(os.path.join(report_dir, 'index.html'), encoding='utf-8') as handle:
        html = handle.read()
    assert '<script' not in html.lower(), 'a script (or an unescaped command line) in the report'
    assert not re.search(r'(src|href)\s*=\s*"(?!data:|#)', html, re.I), 'a resource reference in the report'
    assert not re.search(r'url\(|@import|https?://', html, re.I), 'a network resource in the report'
    assert "default-src 'none'" in html
    assert '&lt;script&gt;' in html, 'the command line with markup must show, escaped'
    for node in NODES + [DOWN]:
        assert 'id="node-%s"' % node in html
    return report_dir, report


def test_rogue_cleanup(fleet):
    spared = ['train1', 'jupyter', 'carol_idle', 'small_idle', 'train2', 'infer', 'busy_bob', 'xss']
    miners = [('node02', fleet.pids['miner1']), ('node04', fleet.pids['miner2'])]

    # Report only (the default): lists exactly the two miners, kills nothing; node07 fails the run.
    stdout, recap, summary = fleet.playbook('rogue_cleanup', expect_rc=2)
    check_down_node_recorded(stdout, summary)
    assert summary['mode'] == 'report only' and summary['killed'] == 0 and summary['would_kill'] == 2 + 2, summary  # + 2 children
    assert summary['nodes_scanned'] == len(NODES), summary  # every reachable node's one call returned its audit
    assert killed_pids(summary) == miners, killed_pids(summary)
    critical = sorted((n['host'], f['pid']) for n in summary['nodes'] for f in n['findings'] if f['level'] == 'critical')
    children = [('node02', pid) for pid in fleet.children('node02', fleet.pids['miner1'])]
    assert critical == sorted(miners + children), (critical, miners, children)
    all_alive(fleet, spared + ['miner1', 'miner2'])
    nodes_unchanged(recap)  # report-only runs change nothing

    # Check mode with confirmation: still nothing killed.
    _out, _recap, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': True, 'fail_on_node_errors': False}, check=True)
    assert summary['mode'] == 'check mode' and summary['killed'] == 0, summary
    all_alive(fleet, spared + ['miner1', 'miner2'])

    # Confirmed (AWX surveys send strings): the two miners (and miner1's two children) die, memory comes back.
    before02, before04 = fleet.used('node02'), fleet.used('node04')
    stdout, recap, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': 'true', 'fail_on_node_errors': 'false',
                                                              'kill_timeout': '2'})
    check_down_node_recorded(stdout, summary)
    assert summary['mode'] == 'kill' and killed_pids(summary) == miners, summary
    assert summary['killed'] == 4 and summary['kill_failures'] == 0, summary
    assert summary['freed_mib'] == 4096 + 8192, summary
    node04 = [n for n in summary['nodes'] if n['host'] == 'node04'][0]
    assert node04['killed'][0]['signals'] == ['SIGTERM', 'SIGKILL'], node04['killed']
    assert not fleet.alive('node02', miners[0][1]) and not fleet.alive('node04', miners[1][1])
    all_alive(fleet, spared)
    after02, after04 = fleet.used('node02'), fleet.used('node04')
    assert before02[1] - after02[1] == 4096 and before04[3] - after04[3] == 8192, (before02, after02, before04, after04)
    assert after02[0] == before02[0] and after04[1] == before04[1]
    assert recap['node02']['changed'] == 1 and recap['node04']['changed'] == 1 and recap['node01']['changed'] == 0

    # Again, without the unreachable node: nothing left, nothing changed, exit 0.
    _out, recap, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': True}, down=False)
    assert summary['killed'] == 0 and summary['findings_by_level']['critical'] == 0, summary
    nodes_unchanged(recap)


def test_reclaim_idle(fleet):
    evars = {'idle_for': '2s', 'min_used_mib': 1024, 'exclude_users': 'carol, nobody', 'kill_timeout': 5}
    # The first report-only run starts the clock (one sample); nothing is idle for 2 s yet.
    _out, _recap, summary = fleet.playbook('reclaim_idle', dict(evars, fail_on_node_errors=False))
    assert summary['would_kill'] == 0, summary
    time.sleep(3)
    # Report only: bob's idle Jupyter kernel, not carol's (excluded), dave's (512 MiB) or the busy ones.
    stdout, _recap, summary = fleet.playbook('reclaim_idle', evars, expect_rc=2)
    check_down_node_recorded(stdout, summary)
    assert killed_pids(summary) == [('node01', fleet.pids['jupyter'])], summary
    assert summary['would_free_mib'] == 20480 and summary['killed'] == 0, summary
    _out, _recap, summary = fleet.playbook('reclaim_idle', dict(evars, reclaim_confirm=True), check=True, down=False)
    assert summary['killed'] == 0, summary
    all_alive(fleet, ['jupyter', 'carol_idle', 'small_idle', 'train1'])

    before = fleet.used('node01')
    _out, recap, summary = fleet.playbook('reclaim_idle', dict(evars, reclaim_confirm=True), down=False)
    assert killed_pids(summary) == [('node01', fleet.pids['jupyter'])] and summary['freed_mib'] == 20480, summary
    after = fleet.used('node01')
    assert before[2] - after[2] == 20480 and before[0] == after[0] and before[1] == after[1], (before, after)
    assert not fleet.alive('node01', fleet.pids['jupyter'])
    all_alive(fleet, ['carol_idle', 'small_idle', 'train1', 'train2', 'infer', 'busy_bob', 'xss'])
    assert recap['node01']['changed'] == 1

    _out, recap, summary = fleet.playbook('reclaim_idle', dict(evars, reclaim_confirm=True), down=False)
    assert summary['killed'] == 0, summary
    nodes_unchanged(recap)


def test_reset_unhealthy(fleet):
    node, gpu, mib = LEAK
    stdout, _recap, summary = fleet.playbook('reset_unhealthy', {'fail_on_node_errors': False, 'reset_batch': '50%'})
    check_down_node_recorded(stdout, summary)
    assert [(g['host'], g['gpu'], g['status']) for g in summary['gpus']] == [(node, gpu, 'would_reset')], summary
    _out, _recap, summary = fleet.playbook('reset_unhealthy', {'reclaim_confirm': True, 'reset_batch': 3}, check=True, down=False)
    assert summary['gpus_reset'] == 0 and fleet.show(node)['gpus'][gpu]['leaked_mib'] == mib

    _out, recap, summary = fleet.playbook('reset_unhealthy', {'reclaim_confirm': True, 'reset_batch': 2}, down=False)
    assert [(g['host'], g['gpu'], g['status'], g['verified']) for g in summary['gpus']] == [(node, gpu, 'reset', True)], summary
    state = fleet.show(node)['gpus'][gpu]
    assert state['leaked_mib'] == 0 and state['reset_count'] == 1, state
    assert fleet.show(node)['gpus'][0]['reset_count'] == 0
    all_alive(fleet, ['infer'])
    assert recap[node]['changed'] == 1

    _out, recap, summary = fleet.playbook('reset_unhealthy', {'reclaim_confirm': True, 'reset_batch': '100%'}, down=False)
    assert summary['gpus'] == [] and summary['gpus_reset'] == 0, summary
    nodes_unchanged(recap)


def test_reset_halts(fleet):
    """After a failed reset in the first batch the later batches are not attempted."""
    for node in ('node05', 'node06'):
        fleet.ssh(node, ['gpusim', 'leak', '--gpu', '3', '--mib', '4096'])
    # node05's GPU 3 also has a live process: without reset_kill_processes its reset is refused.
    fleet.ssh('node05', ['gpusim', 'spawn', '--gpu', '3', '--mib', '100', '--user', 'dave', '--', 'python', 'hold.py'])
    # both nodes act (the blast-radius limit, 20 % of 2 nodes, would let one: issue #30), one per batch
    evars = {'reclaim_confirm': True, 'reset_batch': 1, 'target_hosts': 'node05:node06', 'reclaim_max_nodes_pct': 100}
    stdout, _recap, summary = fleet.playbook('reset_unhealthy', evars, down=False, expect_rc=2)
    assert summary['nodes_failed'] == ['node05', 'node06'] and summary['nodes_halted'] == ['node06'], summary
    assert 'FAILED NODE node06 | halted' in stdout
    assert fleet.show('node06')['gpus'][3]['leaked_mib'] == 4096, 'a halted node must not be reset'


def test_audit(fleet):
    audit_dir = os.path.join(fleet.out, 'audit')
    stdout, recap, _summary = fleet.playbook('audit', {'audit_dir': audit_dir})
    check_down_node_recorded(stdout, None)
    fleet.playbook('audit', {'audit_dir': audit_dir, 'audit_min_level': 'medium'}, check=True, down=False)
    runs = sorted(os.listdir(os.path.join(audit_dir, 'runs')))
    assert len(runs) == 2, runs
    with open(os.path.join(audit_dir, 'fleet-audit.jsonl'), encoding='utf-8') as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    nodes = [r for r in records if r['record'] == 'node']
    assert len(nodes) == 7 + 6, len(nodes)
    assert [r['status'] for r in nodes if r['host'] == DOWN] == ['unreachable']
    findings = [r for r in records if r['record'] == 'finding']
    assert findings and all(r['host'] in NODES and r['level'] and r['rules'] for r in findings)
    assert not [r for r in findings if r['level'] == 'critical'], 'the miners are gone by now'
    assert len(set(r['run'] for r in records)) == 2
    nodes_unchanged(recap)


def test_guard_deploy(fleet):
    """One node (and the unreachable one): the guard role has its own target (guard_role); this one shows the
    playbook applies it with a survey-style policy text and records every node."""
    policy = 'mode: dry-run\nrules:\n  - user: "*"\n    max_memory_gb: 40\n    action: kill\n'
    stdout, recap, _summary = fleet.playbook('guard_deploy', {
        'target_hosts': 'node06:%s' % DOWN, 'guard_policy': policy, 'gpu_guard_audit_schedule': 'off',
        'gpu_guard_install_prereqs': False, 'gpu_guard_verify_units': False, 'fail_on_node_errors': False})
    check_down_node_recorded(stdout, None)
    path = os.path.join(fleet.dir, 'nodes', 'node06', 'fs', 'etc', 'gpufleet', 'policy.yaml')
    with open(path, encoding='utf-8') as handle:
        text = handle.read()
    assert 'max_memory_gb' in text and 'dry-run' in text, text
    assert not os.path.exists(os.path.join(fleet.dir, 'nodes', 'node01', 'fs', 'etc', 'gpufleet', 'policy.yaml'))
    assert recap['node06']['changed'] > 0 and 'node01' not in recap


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--fleet', required=True)
    args, extra = parser.parse_known_args()
    fleet = Fleet(args.fleet, extra)
    setup(fleet)
    shots = os.path.join(fleet.out, 'screenshots')
    os.makedirs(shots)

    report_dir, report = test_inventory_report(fleet, 'before', {'orphaned_mib': 6144, 'idle_holders': 2, 'unhealthy_gpus': 0})
    idle = sorted((p['host'], p['pid']) for p in report['offenders']['idle_holders'])
    assert idle == sorted([('node01', fleet.pids['jupyter']), ('node01', fleet.pids['carol_idle'])]), idle
    users = dict((u['user'], u['used_mib']) for u in report['offenders']['top_users'])
    assert users['alice'] == 30720 + 16384 + 12288 + 4096 and users['eve'] == 4096 + 8192, users
    check_html_in_browser(report_dir, shots)

    test_rogue_cleanup(fleet)
    test_reclaim_idle(fleet)
    test_reset_unhealthy(fleet)
    test_audit(fleet)
    test_inventory_report(fleet, 'after', {'orphaned_mib': 0, 'idle_holders': 1})
    test_guard_deploy(fleet)
    test_reset_halts(fleet)
    print('\nplaybooks: %d ansible-playbook runs passed in %.0f s' % (fleet.runs, time.monotonic() - fleet.started))


if __name__ == '__main__':
    main()
