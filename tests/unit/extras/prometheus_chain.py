# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Debian's prometheus-node-exporter (one per textfile directory) and a real prometheus scraping them, on
127.0.0.1, for the tests of the guard's metrics (tests/unit/extras/test_prometheus_scrape.py and the fleet's
tests/fleet/tests/test_fleet_scrape.py); PromQL over prometheus's HTTP API; the queries of every panel of
extras/grafana/gpufleet-dashboard.json.

Plain Python (the fleet tests import it by path): no import of the collection.
SAFETY: the servers listen on 127.0.0.1 only; ``serve`` stops each by the pid it started, in a finally.
"""

from __future__ import annotations

import contextlib
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

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
RULES = os.path.join(ROOT, 'extras', 'prometheus', 'gpufleet-rules.yml')
DASHBOARD = os.path.join(ROOT, 'extras', 'grafana', 'gpufleet-dashboard.json')
PROMETHEUS = shutil.which('prometheus')
NODE_EXPORTER = shutil.which('prometheus-node-exporter') or shutil.which('node_exporter')
MISSING = 'prometheus and prometheus-node-exporter are not installed (Debian packages; .ci/run installs them)'
DEADLINE = 60          # seconds for the servers to come up and the first scrapes to land


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def get(port, path, **params):
    url = 'http://127.0.0.1:%d%s' % (port, path)
    if params:
        url += '?' + urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(url, timeout=5) as response:   # noqa: S310 (loopback, built here)
        return json.loads(response.read().decode()) if path.startswith('/api/') else response.read().decode()


def query(port, expr):
    body = get(port, '/api/v1/query', query=expr)
    assert body['status'] == 'success', body
    return body['data']['result']


def until(what, check):
    """``check()`` until it returns something true (OSError counts as not yet), for DEADLINE seconds at most."""
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


def by(result, *names):
    """{(label values...): value} of a query result."""
    return dict((tuple(r['metric'].get(n) for n in names), float(r['value'][1])) for r in result)


def _die_with_parent():
    """In the child: SIGTERM when the test's thread goes (a worker killed before its finally ran)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)     # PR_SET_PDEATHSIG


def _start(argv, log, env=None):
    with open(log, 'w') as handle:
        return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
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


@contextlib.contextmanager
def serve(workdir, textfile_dirs, rules=None, alertmanager=None):
    """One node_exporter per directory of ``textfile_dirs`` ({node label: directory}, textfile collector only)
    and one prometheus scraping them every second (job ``node``, label ``node``), loading ``rules`` if given
    and sending its alerts to the Alertmanager on 127.0.0.1:``alertmanager`` if given.
    Yields {'port': prometheus's port, 'targets': {node label: instance}} once every exporter serves the guard's
    series and prometheus scraped every node twice; stops them all on the way out."""
    workdir = str(workdir)
    names = sorted(textfile_dirs)
    ports = dict((name, _free_port()) for name in names)
    port = _free_port()
    config = os.path.join(workdir, 'prometheus.yml')
    with open(config, 'w') as handle:
        json.dump({'global': {'scrape_interval': '1s', 'evaluation_interval': '1s'},
                   'rule_files': [rules] if rules else [],
                   'scrape_configs': [{'job_name': 'node', 'static_configs': [
                       {'targets': ['127.0.0.1:%d' % ports[name]], 'labels': {'node': name}} for name in names]}],
                   'alerting': {'alertmanagers': [{'static_configs': [{'targets': ['127.0.0.1:%d' % alertmanager]}]}]
                                if alertmanager else []}}, handle)
    procs = []
    try:
        for name in names:
            procs.append(_start([NODE_EXPORTER, '--collector.disable-defaults', '--collector.textfile',
                                 '--collector.textfile.directory=%s' % textfile_dirs[name],
                                 '--web.listen-address=127.0.0.1:%d' % ports[name]],
                                os.path.join(workdir, 'node_exporter-%s.log' % name)))
        procs.append(_start([PROMETHEUS, '--config.file=%s' % config, '--storage.tsdb.path=%s' % os.path.join(workdir, 'tsdb'),
                             '--web.listen-address=127.0.0.1:%d' % port, '--log.level=warn'], os.path.join(workdir, 'prometheus.log')))
        for name in names:
            until('node_exporter of %s' % name, lambda name=name: 'gpufleet_guard_ticks_total' in get(ports[name], '/metrics'))
        until('the first scrapes of every node', lambda: len(query(
            port, 'count_over_time(gpufleet_guard_last_tick_timestamp_seconds[1m]) > 2')) == len(names))
        yield {'port': port, 'targets': dict((name, '127.0.0.1:%d' % ports[name]) for name in names)}
    finally:
        _stop(procs)
    assert all(proc.poll() is not None for proc in procs)


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


def check_every_dashboard_panel_query_returns_data(port):
    """Every panel's PromQL returns data, every query variable has values; the results of every panel."""
    board, queries = dashboard_queries()
    assert len(queries) == sum(1 for p in board['panels'] if p['type'] != 'row') >= 18
    results = [(title, expr, query(port, expr)) for title, expr in queries]
    empty = [(title, expr) for title, expr, result in results if not result]
    assert not empty, empty
    for variable in board['templating']['list']:
        if variable['type'] == 'query':
            metric, label = variable['query']['query'][len('label_values('):-1].split(', ')
            values = get(port, '/api/v1/label/%s/values' % label, **{'match[]': metric})['data']
            assert values, variable['name']
    return dict((title, result) for title, _expr, result in results)
