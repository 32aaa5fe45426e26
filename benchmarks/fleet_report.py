#!/usr/bin/env python
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fleet report at scale: the inventory_report playbook's report play on synthetic facts of N nodes.

No node is contacted: every node's record (``host``, ``status``, ``msg`` and ``gpu``, the node's
``ansible_facts.gpu`` as docs/design/contracts.md describes it, 8 GPUs) is made here and handed to
Ansible as inventory variables (``gpufleet_scan`` of each host of the ``gpufleet_bench_nodes``
group: the result the playbook's node play registers, ``ansible_facts.gpu`` or ``unreachable``),
and the real playbook (``gpufleet.reclaim.inventory_report`` imported by a one-line driver, run with
``--limit localhost`` so its node play matches no host) renders fleet.json, fleet.csv and index.html
(and, past ``report_page_nodes`` nodes, the node pages and offenders' pages index.html links) with
its own tasks, templates and filters.

Measured: wall and CPU time and peak RSS of ``ansible-playbook`` (wait4: the controller and its
forks), the size of every file, and the pages in headless Chromium: index.html and the largest
page of each other kind (``nodes-NNNN.html``, ``idle-NNNN.html``, ...), each a copy with a
measuring script (the report itself carries no script and its Content-Security-Policy forbids
one). The script records the time to the load event, a forced layout, a filter (hiding the node
cards, or the rows of a table, whose host does not match, as a find-and-filter would), the
browser's own find (``window.find`` of the last item's host) and scrolling the page top to bottom
in 20 steps, each with a forced layout. A page is usable when every scroll step, the filter, its
undoing and the find take at most ``FREEZE_MS``; the report is usable when every page probed is,
and the table shows the worst figure of each across its pages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402 pylint: disable=wrong-import-position

GPUS = 8
USERS = ['user%03d' % n for n in range(300)]
# a step longer than this is a freeze a user notices (RAIL: respond to input within 100 ms)
FREEZE_MS = 100

DRIVER = '- ansible.builtin.import_playbook: gpufleet.reclaim.inventory_report\n'
INVENTORY_SCRIPT = '#!%s\nimport sys\nsys.stdout.write(open(%r).read() if "--list" in sys.argv else "{}")\n'

PROBE = r'''<script>
(function () {
  function now() { return performance.now(); }
  function layout() { return document.body.offsetHeight + document.documentElement.scrollHeight; }
  window.addEventListener('load', function () {
    var out = {}, t, steps = [], i, nav = performance.getEntriesByType('navigation')[0];
    // the node cards (a page of nodes), the rows of the index of node pages (index.html past one page of nodes) or of a page of rows
    var cards = document.querySelectorAll('#nodes .node, #nodes tbody tr, #rows tbody tr');
    out.nodes = cards.length;
    out.dom_elements = document.getElementsByTagName('*').length;
    out.dom_content_loaded_ms = nav ? nav.domContentLoadedEventEnd : null;
    out.load_ms = nav ? nav.loadEventStart : now();
    t = now(); layout(); out.first_layout_ms = now() - t;
    var height = document.documentElement.scrollHeight;
    for (i = 0; i <= 20; i++) {
      t = now(); window.scrollTo(0, height * i / 20); layout(); document.elementFromPoint(200, 200); steps.push(now() - t);
    }
    out.scroll_steps_ms = steps;
    function host(card) { return (card.querySelector('h3 span') || card.querySelector('span') || card.querySelector('td') || card).textContent; }
    var last = cards.length ? host(cards[cards.length - 1]) : 'none';
    t = now(); out.find_found = window.find(last, false, false, true); out.find_ms = now() - t;
    t = now();
    for (i = 0; i < cards.length; i++) { if (host(cards[i]).indexOf('-07') < 0) { cards[i].style.display = 'none'; } }
    layout(); out.filter_ms = now() - t;
    t = now();
    for (i = 0; i < cards.length; i++) { cards[i].style.display = ''; }
    layout(); out.unfilter_ms = now() - t;
    out.page_height_px = height;
    var pre = document.createElement('pre'); pre.id = 'gpufleet-probe'; pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  });
})();
</script>'''


def synthetic_records(nodes, gpus=GPUS, seed=21):
    """``nodes`` node records as the playbook's node play leaves them (status ok, a few unreachable)."""
    rng = random.Random(seed)
    records = []
    for n in range(nodes):
        host = 'gpu-node-%05d' % n
        if rng.random() < 0.005:
            records.append({'host': host, 'status': 'unreachable', 'msg': 'Failed to connect to the host via ssh', 'gpu': None})
            continue
        devices, processes, pid = [], [], 1000
        for index in range(gpus):
            total = 81559
            util = rng.choice((0, 0, 3, 35, 60, 88, 97, 100))
            owners = []
            for _slot in range(rng.choice((0, 1, 1, 1, 2, 3))):
                pid += rng.randint(1, 400)
                user = rng.choice(USERS)
                used = rng.choice((512, 2048, 8192, 20480, 40960))
                owners.append(pid)
                processes.append({'pid': pid, 'user': user, 'uid': 1000 + USERS.index(user), 'name': 'python',
                                  'cmdline': ['python', 'train.py', '--run', '%s-%d' % (user, pid)], 'used_mib': used,
                                  'gpu_indexes': [index], 'status': 'sleeping', 'create_time': 1796000000.0 + pid,
                                  'container': None, 'slurm_job': str(100000 + n) if rng.random() < 0.5 else None, 'mig': None})
            held = sum(p['used_mib'] for p in processes if p['pid'] in owners)
            orphaned = rng.choice((0,) * 60 + (4096,))
            sick = rng.random() < 0.01
            devices.append({
                'index': index, 'vendor_index': index, 'vendor': 'nvidia', 'name': 'NVIDIA H100 80GB HBM3',
                'uuid': 'GPU-%08x-0000-0000-0000-%012x' % (n, index), 'pci_bus_id': '00000000:%02X:00.0' % (0x18 + index),
                'memory_total_mib': total, 'memory_used_mib': min(total, held + orphaned),
                'memory_free_mib': total - min(total, held + orphaned), 'orphaned_mib': orphaned,
                'utilization_pct': util, 'temperature_c': 30 + util // 3, 'power_w': 70.0 + util * 6, 'power_limit_w': 700.0,
                'processes': owners, 'xid_events': [],
                'health': {'status': 'degraded' if sick else 'ok', 'recommended_action': 'reset' if sick else 'none',
                           'reasons': ['Xid 79: GPU has fallen off the bus'] if sick else []},
                'health_reasons': [], 'recovery_action': None, 'mig_mode': False, 'mig_devices': None})
        facts = {'backends': {'nvidia': {'available': True, 'error': None, 'version': '580.159.04'}},
                 'devices': devices, 'processes': processes, 'holders': [], 'driver_hung': None}
        records.append({'host': host, 'status': 'ok', 'msg': '', 'gpu': facts})
    return records


def registered(record):
    """The result the playbook's node play registers (``gpufleet_scan``) for ``record``."""
    if record['status'] == 'unreachable':
        return {'unreachable': True, 'changed': False, 'msg': record['msg']}
    if record['status'] != 'ok':
        return {'failed': True, 'changed': False, 'msg': record['msg']}
    return {'changed': False, 'ansible_facts': {'gpu': record['gpu']}}


def write_inventory(records, work):
    """A script inventory (JSON is read far faster than YAML) holding every node's record as a host variable."""
    data = {'_meta': {'hostvars': dict((r['host'], {'gpufleet_scan': registered(r), 'ansible_connection': 'local'}) for r in records)},
            'gpufleet_bench_nodes': {'hosts': [r['host'] for r in records]}, 'gpufleet_bench_controller': {'hosts': ['localhost']}}
    # the controller in the inventory, so that --limit localhost leaves the node play nothing to run on
    data['_meta']['hostvars']['localhost'] = {'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable}
    path = os.path.join(work, 'inventory.json')
    with open(path, 'w') as handle:
        json.dump(data, handle, separators=(',', ':'))
    script = os.path.join(work, 'inventory.py')
    with open(script, 'w') as handle:
        handle.write(INVENTORY_SCRIPT % (sys.executable, path))
    os.chmod(script, 0o755)
    return script, os.path.getsize(path)


def render(nodes, work, collections, timeout=1800):
    """Run the report play on ``nodes`` synthetic nodes; returns the figures."""
    t0 = time.monotonic()
    records = synthetic_records(nodes)
    inventory, inventory_bytes = write_inventory(records, work)
    generate_s = time.monotonic() - t0
    driver = os.path.join(work, 'driver.yml')
    with open(driver, 'w') as handle:
        handle.write(DRIVER)
    report_dir = os.path.join(work, 'report')
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=collections, ANSIBLE_NOCOLOR='1', ANSIBLE_HOST_KEY_CHECKING='False',
               ANSIBLE_INVENTORY_ENABLED='script', ANSIBLE_LOCALHOST_WARNING='False', ANSIBLE_RETRY_FILES_ENABLED='False')
    argv = [os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'), '-i', inventory, driver,
            '--limit', 'localhost', '-e', 'target_hosts=gpufleet_bench_nodes', '-e', 'report_dir=%s' % report_dir]
    meas = common.run_child(argv, env=env, timeout=timeout)
    result = {'nodes': nodes, 'gpus': sum(len(r['gpu']['devices']) for r in records if r['gpu']),
              'processes': sum(len(r['gpu']['processes']) for r in records if r['gpu']),
              'generate_s': generate_s, 'inventory_mib': inventory_bytes / 1048576.0, 'rc': meas.returncode,
              'wall_s': meas.wall_s, 'cpu_s': meas.cpu_s, 'maxrss_mib': meas.maxrss_kib / 1024.0, 'files': {}}
    if meas.returncode != 0:
        result['error'] = meas.text()[-2000:]
        return result
    for name in sorted(os.listdir(report_dir)):
        result['files'][name] = os.path.getsize(os.path.join(report_dir, name)) / 1048576.0
    with open(os.path.join(report_dir, 'fleet.json'), encoding='utf-8') as handle:
        result['totals'] = json.load(handle)['totals']
    if result['totals']['nodes'] != len(records):
        result['error'] = 'the report lists %d of %d nodes' % (result['totals']['nodes'], len(records))
        return result
    result['report_dir'] = report_dir
    return result


def pages_to_probe(files):
    """index.html and, of each kind of page past it (nodes-0001.html, idle-0001.html, ...), the largest one."""
    largest = {}
    for name, mib in files.items():
        match = re.match(r'([a-z]+)-[0-9]{4}\.html$', name)
        if match and mib >= largest.get(match.group(1), ('', -1))[1]:
            largest[match.group(1)] = (name, mib)
    return ['index.html'] + sorted(name for name, _mib in largest.values())


def probe_report(res, work):
    """Probe every kind of page of a rendered report; the worst figure of each across them decides."""
    pages = dict((name, probe_page(os.path.join(res['report_dir'], name), work)) for name in pages_to_probe(res['files']))
    worst = {'pages': sorted(pages)}
    for key in ('load_ms', 'scroll_step_max_ms', 'filter_ms', 'unfilter_ms', 'find_ms', 'dom_elements'):
        values = [page[key] for page in pages.values() if key in page]
        worst[key] = max(values) if values else None
    worst['usable'] = all(page.get('usable') for page in pages.values())
    worst['error'] = '; '.join('%s: %s' % (name, page['error']) for name, page in sorted(pages.items()) if page.get('error')) or None
    return {'pages': pages, 'worst': worst}


def chromium():
    for name in ('chromium', 'chromium-browser', 'google-chrome'):
        path = shutil.which(name)
        if path:
            return path
    return None


def probe_page(html_path, work, timeout=600):
    """Open a copy of the page with the measuring script in headless Chromium; returns its figures."""
    browser = chromium()
    if browser is None:
        return {'error': 'no chromium (apt-get install chromium)'}
    with open(html_path, encoding='utf-8') as handle:
        page = handle.read()
    page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', '', page, count=1)
    page = page.replace('</body>', PROBE + '</body>', 1)
    probe = os.path.join(work, 'probe.html')
    with open(probe, 'w', encoding='utf-8') as handle:
        handle.write(page)
    profile = tempfile.mkdtemp(prefix='gpufleet-chromium-', dir=work)
    argv = [browser, '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
            '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-extensions',
            '--host-resolver-rules=MAP * ~NOTFOUND', '--user-data-dir=%s' % profile, '--window-size=1280,900',
            '--dump-dom', 'file://%s' % probe]
    meas = common.run_child(argv, timeout=timeout)
    match = re.search(r'<pre id="gpufleet-probe">(.*?)</pre>', meas.text())
    if not match:
        return {'error': 'no probe result (rc %s): %s' % (meas.returncode, meas.text()[-500:]), 'wall_s': meas.wall_s}
    found = json.loads(match.group(1).replace('&quot;', '"').replace('&amp;', '&'))
    steps = found['scroll_steps_ms']
    found.update({'browser_wall_s': meas.wall_s, 'browser_cpu_s': meas.cpu_s, 'browser_maxrss_mib': meas.maxrss_kib / 1024.0,
                  'scroll_step_max_ms': max(steps), 'scroll_step_median_ms': sorted(steps)[len(steps) // 2]})
    found['usable'] = all(found[k] <= FREEZE_MS for k in ('scroll_step_max_ms', 'filter_ms', 'unfilter_ms', 'find_ms'))
    return found


def run(sizes, collections=None, browser=True, log=print):
    started = time.monotonic()
    made = collections is None
    if made:
        collections = common.private_collections()
    results = []
    try:
        for nodes in sizes:
            work = tempfile.mkdtemp(prefix='gpufleet-bench-report-')
            try:
                res = render(nodes, work, collections)
                if browser and 'report_dir' in res:
                    res['browser'] = probe_report(res, work)
                res.pop('report_dir', None)
                results.append(res)
                log('# report %d nodes: %s' % (nodes, json.dumps(res, default=str)[:600]))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if made:
            shutil.rmtree(collections, ignore_errors=True)
    return {'sizes': results, 'seconds': time.monotonic() - started, 'freeze_ms': FREEZE_MS}


def markdown(data):
    lines = ['| nodes | GPUs | processes | render wall s | render CPU s | peak RSS MiB | index.html MiB | other pages (largest MiB) | '
             'fleet.json MiB | fleet.csv MiB | pages probed | page load ms | scroll step max ms | filter ms | find ms | usable |',
             '|---' * 16 + '|']
    for res in data['sizes']:
        if res.get('error'):
            lines.append('| %d | %d | %d | failed: %s |' % (res['nodes'], res['gpus'], res['processes'], res['error'][-200:].replace('\n', ' ')))
            continue
        files = res['files']
        pages = [mib for name, mib in files.items() if re.match(r'[a-z]+-[0-9]{4}\.html$', name)]
        b = (res.get('browser') or {}).get('worst') or {}

        def ms(key):
            return '%.0f' % b[key] if b.get(key) is not None else '-'
        lines.append('| %d | %d | %d | %.1f | %.1f | %.0f | %.2f | %s | %.1f | %.1f | %s | %s | %s | %s | %s | %s |' % (
            res['nodes'], res['gpus'], res['processes'], res['wall_s'], res['cpu_s'], res['maxrss_mib'], files['index.html'],
            '%d (%.2f)' % (len(pages), max(pages)) if pages else '0', files['fleet.json'], files['fleet.csv'],
            len(b.get('pages') or []) or '-', ms('load_ms'), ms('scroll_step_max_ms'), ms('filter_ms'), ms('find_ms'),
            b.get('error') or {True: 'yes', False: '**no**'}.get(b.get('usable'), '-')))
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--nodes', default='1000,10000', help='fleet sizes (comma list)')
    parser.add_argument('--no-browser', action='store_true')
    parser.add_argument('--json', help='write the figures here')
    args = parser.parse_args(argv)
    data = run([int(x) for x in args.nodes.split(',')], browser=not args.no_browser)
    print(markdown(data))
    common.write_json(args.json, data)
    return 0


if __name__ == '__main__':
    sys.exit(main())
