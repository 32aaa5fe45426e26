# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Smoke test: ``benchmarks/run --quick`` still works (tiny sizes, one repetition, no fleet).

No benchmark figure is asserted (machines are noisy): only that every selected part ran, that
every tool saw the simulated workloads, that --quick leaves the docs alone, that the results
section is rewritten between its markers, and that nothing the run started is left behind.
The external scripts of other parts (kill latency, guard tick, hostile load, fleet) are left out here
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, 'benchmarks')
RUN = os.path.join(BENCH, 'run')
SHIM = os.path.join(ROOT, 'tests', 'sim', 'build', 'libnvidia-ml.so.1')
HAND_WRITTEN = '# Benchmarks\n\nA hand-written section that the run must keep.\n'


def _load(name, path):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _pids_running(exe):
    found = []
    for name in os.listdir('/proc'):
        if name.isdigit():
            try:
                if os.readlink('/proc/%s/exe' % name) == exe:
                    found.append(int(name))
            except OSError:
                pass
    return found


def test_quick_run(tmp_path):
    """One ``--quick`` run (a single test: xdist would start one run per worker for a shared fixture)."""
    if not os.path.isfile(SHIM):
        pytest.skip('the simulator is not built (make sim)')
    docs = tmp_path / 'benchmarks.md'
    docs.write_text(HAND_WRITTEN)
    out = tmp_path / 'out.json'
    build = tmp_path / 'build'
    env = dict(os.environ, GPUFLEET_BENCH_BUILD=str(build))
    env['PATH'] = os.path.dirname(sys.executable) + ':' + env.get('PATH', '/usr/bin:/bin')
    proc = subprocess.run([sys.executable, RUN, '--quick', '--no-peers', '--skip', 'kill,tick,hostile', '--docs', str(docs),
                           '--json', str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                          check=False)
    text = proc.stdout.decode('utf-8', 'replace')
    assert proc.returncode == 0, text[-4000:]
    assert '# ratios' in text
    assert docs.read_text() == HAND_WRITTEN  # --quick leaves the docs alone
    assert not _pids_running(str(build / 'sleepers'))  # the sleepers are gone (the workloads: gpusim kill-all)
    data = json.loads(out.read_text())
    _check_parts(data)
    _check_rewrite(data, tmp_path / 'rewritten.md')


def _check_parts(data):
    assert data['parts'] == ['snapshot', 'module']
    snap = data['results']['snapshot']
    assert snap['status'] == 'ok', snap['why']
    cells = snap['data']['cells']
    assert cells
    for cell in cells:
        assert {'ours', 'ours_holders', 'fdscan', 'tick'} <= set(cell['tools'])
        for tool, fig in cell['tools'].items():
            assert fig['cpu_s']['n'] == 1
            assert not fig['notes'], (tool, fig['notes'])
            if fig.get('seen') is not None:
                assert fig['seen'] == cell['gpu_processes'], tool
    assert snap['data']['peers']['error'] == 'skipped (--no-peers)'
    module = data['results']['module']
    assert module['status'] == 'ok', module['why']
    rows = module['data']['rows']
    assert rows['core']['seen'] == module['data']['gpu_processes']
    if 'cpu_s' in rows['facts']:
        assert rows['facts']['seen'] == module['data']['gpu_processes'], rows['facts']['notes']


def _check_rewrite(data, docs):
    run = _load('gpufleet_bench_run', RUN)
    common = _load('common', os.path.join(BENCH, 'common.py'))
    body = run.markdown(data['results'], data['info'])
    assert '### 1. Snapshot cost' in body and '### 2. Module overhead' in body
    docs.write_text(HAND_WRITTEN + '\n## Kill latency\n\nanother helper\'s section\n')
    common.rewrite_section('first', run.SECTION, path=str(docs), title=run.TITLE)
    docs.write_text(docs.read_text() + '\n## Appended later\n\nby someone else\n')
    common.rewrite_section(body, run.SECTION, path=str(docs), title=run.TITLE)
    text = docs.read_text()
    assert text.count(common.begin_marker(run.SECTION)) == 1
    assert text.count(common.end_marker(run.SECTION)) == 1
    assert 'first' not in text.split(common.begin_marker(run.SECTION))[1]
    assert text.startswith(HAND_WRITTEN)
    assert "another helper's section" in text and 'by someone else' in text
    assert text.count(run.TITLE) == 1


def test_statistics_helpers():
    common = _load('common', os.path.join(BENCH, 'common.py'))
    assert common.stats([3, 1, 2]) == {'median': 2, 'min': 1, 'max': 3, 'n': 3}
    assert common.stats([4, 1, 2, 3])['median'] == 2.5
    assert common.ratios([2, 3, 4], [1, 0, 2]) == [2.0, 2.0]
    assert common.fmt(common.stats([0.1, 0.2, 0.3]), 1000) == '200 (100-300)'
    assert common.fmt(common.stats([0.5]), 1000, unit=' ms') == '500 ms'
    fit = common.linear_fit([1000, 2000, 3000], [1.0, 2.0, 3.0])
    assert abs(fit['slope'] - 0.001) < 1e-12 and abs(fit['r2'] - 1.0) < 1e-12 and fit['n'] == 3
    assert common.linear_fit([1, 2], [1, 2])['r2'] is None
