# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""extras/prometheus/gpufleet-rules.yml under the real promtool, fed with what real guard ticks wrote.

Every scenario of guard_series.py runs real ticks (dry-run: nothing is signalled); their textfiles become
promtool ``input_series`` and every alert of the file is checked at the scenario's evaluation time: the
expected ones fire with the labels of the guard's own series, all the others stay silent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.tests.unit.extras import guard_series as gs

pytest.importorskip('prometheus_client.parser')

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
RULES = os.path.join(ROOT, 'extras', 'prometheus', 'gpufleet-rules.yml')
DOC = os.path.join(ROOT, 'docs', 'observability.md')
PROMTOOL = shutil.which('promtool')
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason='promtool is not installed (Debian package prometheus; .ci/run installs it)')
SCRAPE = {'instance': 'gpu-node-1:9100', 'job': 'node'}
EVALUATION_INTERVAL = 30
# GpuGuardTickStale: the tick timestamp older than 180 s, for 2m: fires 5 minutes after the last tick (+ one evaluation)
STALE_AFTER, STALE_FOR = 180, 120


def alerts():
    with open(RULES) as handle:
        groups = yaml.safe_load(handle)['groups']
    return dict((rule['alert'], rule) for group in groups for rule in group['rules'] if 'alert' in rule)


def _render(text, labels):
    return re.sub(r'\{\{ \$labels\.(\w+) \}\}', lambda m: labels.get(m.group(1), ''), text)


def expect(rule, labels):
    """The alert promtool must report: the result's labels plus the rule's, annotations rendered from them."""
    return {'exp_labels': dict(labels, **rule.get('labels', {})),
            'exp_annotations': dict((k, _render(v, labels)) for k, v in rule['annotations'].items())}


def labels_of(texts, name, **match):
    """The label sets (with the scrape's) of the ``name`` series the last tick wrote whose labels include ``match``."""
    found = []
    for (sample, pairs), _value in sorted(gs.samples(texts[-1]).items()):
        labels = dict(pairs)
        if sample == name and all(labels.get(k) == str(v) for k, v in match.items()):
            found.append(dict(labels, **SCRAPE))
    assert found, (name, match)
    return found


def _minutes(seconds):
    return '%ds' % seconds


def cases(tmp_path):
    """(name, input_series, eval seconds, {alert: [labels]}) for each situation, from real ticks."""
    out = []

    def root(name):
        return tmp_path / name

    healthy = gs.healthy(root('healthy'))
    last = (len(healthy) - 1) * gs.STEP
    out.append(('healthy', gs.input_series(healthy, SCRAPE), last, {}))
    stale = gs.input_series(healthy, SCRAPE, repeat_last=20)
    out.append(('stale-not-yet', stale, last + STALE_AFTER, {}))
    out.append(('stale', stale, last + STALE_AFTER + STALE_FOR + EVALUATION_INTERVAL, {'GpuGuardTickStale': [SCRAPE]}))
    out.append(('gone', gs.input_series(healthy, SCRAPE, gone_after=20), last + 11 * 60, {'GpuGuardMetricsGone': [SCRAPE]}))
    texts = gs.policy_invalid(root('invalid'))
    out.append(('policy-invalid', gs.input_series(texts, SCRAPE), 5 * 60, {'GpuGuardPolicyInvalid': [SCRAPE]}))
    texts = gs.untrusted_input(root('untrusted'))
    out.append(('untrusted-input', gs.input_series(texts, SCRAPE), 5 * 60, {'GpuGuardUntrustedInput': [SCRAPE]}))
    texts = gs.enforcement(root('enforcement'))
    assert gs.samples(texts[-1])[('gpufleet_guard_user_actions_total', (('user', 'alice'),))] == 4
    out.append(('enforcement', gs.input_series(texts, SCRAPE), 11 * 60, {'GpuUserEnforcementRate': [{'user': 'alice'}]}))
    texts = gs.orphaned(root('orphaned'))
    out.append(('orphaned', gs.input_series(texts, SCRAPE), 19 * 60,
                {'GpuOrphanedMemory': labels_of(texts, 'gpufleet_gpu_orphaned_memory_mib', gpu=0)}))
    texts = gs.idle(root('idle'))
    out.append(('idle', gs.input_series(texts, SCRAPE), 44 * 60,
                {'GpuIdleMemoryHeld': labels_of(texts, 'gpufleet_guard_violations', rule='idle'),
                 # dry-run: the idle process stays, so the guard decides to act again every retry_after (5m)
                 'GpuUserEnforcementRate': [{'user': 'alice'}]}))
    texts = gs.rogue(root('rogue'))
    out.append(('rogue', gs.input_series(texts, SCRAPE), 3 * 60,
                {'GpuRogueProcess': labels_of(texts, 'gpufleet_guard_rogue_findings', level='critical')}))
    texts = gs.xid_events(root('xid'))
    out.append(('xid', gs.input_series(texts, SCRAPE), 7 * 60, {
        'GpuLost': labels_of(texts, 'gpufleet_gpu_health_status', gpu=1),
        'GpuDegraded': labels_of(texts, 'gpufleet_gpu_health_status', gpu=2),
        'GpuRebootWanted': labels_of(texts, 'gpufleet_gpu_reboot_wanted', gpu=1),
        'GpuXidApplicationError': labels_of(texts, 'gpufleet_gpu_xid_errors', fault='application'),
        'GpuXidFault': labels_of(texts, 'gpufleet_gpu_xid_errors', gpu=1, code=79, fault='gpu')
        + labels_of(texts, 'gpufleet_gpu_xid_errors', gpu=2, code=48, fault='gpu')}))
    texts = gs.budget_exhausted(root('budget'))
    assert gs.samples(texts[-1])[('gpufleet_guard_remediation_held', (('gpu', '2'), ('reason', 'budget'), ('step', 'reset')))] == 1
    # at 3 minutes (the second tick that held the reset, + 1m): the Xid 48 is a GPU fault; GpuDegraded waits 5m
    out.append(('budget-exhausted', gs.input_series(texts, SCRAPE), 3 * 60, {
        'GpuRemediationBudgetExhausted': [SCRAPE], 'GpuXidFault': labels_of(texts, 'gpufleet_gpu_xid_errors', gpu=2)}))
    texts = gs.driver_hung(root('hung'))
    out.append(('driver-hung', gs.input_series(texts, SCRAPE), 5 * 60,
                {'GpuDriverHung': labels_of(texts, 'gpufleet_guard_driver_hung', call='nvmlDeviceGetUUID')}))
    texts = gs.driver_crashed(root('crashed'))
    out.append(('driver-crashed', gs.input_series(texts, SCRAPE), 3 * 60, {'GpuDriverCrashed': [SCRAPE]}))
    return out


def _sorted(found):
    return sorted(found, key=lambda labels: json.dumps(labels, sort_keys=True))


def test_every_alert_has_a_summary_description_and_a_runbook_section():
    with open(DOC) as handle:
        doc = handle.read()
    anchors = set(re.sub(r'[^a-z0-9 -]', '', line.lstrip('#').strip().lower()).replace(' ', '-')
                  for line in doc.splitlines() if line.startswith('#'))
    for name, rule in alerts().items():
        assert rule['annotations']['summary'] and rule['annotations']['description'], name
        url = rule['annotations']['runbook_url']
        assert '/docs/observability.md#' in url and url.rsplit('#', 1)[1] in anchors, (name, url)
        assert rule['labels']['severity'] in ('warning', 'critical'), name


@needs_promtool
def test_promtool_checks_the_rules():
    result = subprocess.run([PROMTOOL, 'check', 'rules', RULES], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and 'SUCCESS: %d rules found' % len(alerts()) in result.stdout, result.stdout + result.stderr


@needs_promtool
def test_promtool_rule_tests_on_what_the_guard_wrote(tmp_path):
    rules = alerts()
    tests = []
    fired = set()
    for name, series, at, want in cases(tmp_path):
        checks = []
        for alert, rule in sorted(rules.items()):
            expected = [expect(rule, labels) for labels in _sorted(want.get(alert, []))]
            fired.update([alert] if expected else [])
            checks.append({'eval_time': _minutes(at), 'alertname': alert, 'exp_alerts': expected})
        tests.append({'name': name, 'interval': '%ds' % gs.STEP, 'input_series': series, 'alert_rule_test': checks})
    assert fired == set(rules), 'alerts no scenario makes fire: %s' % sorted(set(rules) - fired)
    path = tmp_path / 'gpufleet-rules.test.yml'
    path.write_text(json.dumps({'rule_files': [RULES], 'evaluation_interval': '%ds' % EVALUATION_INTERVAL, 'tests': tests},
                               indent=1))
    result = subprocess.run([PROMTOOL, 'test', 'rules', str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and 'SUCCESS' in result.stdout, result.stdout + result.stderr
