# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The rogue detector against the corpus in tests/unit/fixtures/rogue: every miner case reaches
high or critical, no legitimate case reaches high.  The confusion matrix is printed (pytest -s)."""

from __future__ import annotations

import datetime
import os

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', '..', 'fixtures', 'rogue')
GPU_TOTAL_MIB = 81559
NOW = datetime.datetime(2026, 1, 15, tzinfo=datetime.timezone.utc)


def load_cases(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        return yaml.safe_load(handle)


def series(spec, key):
    """One sample a minute for spec['minutes'] minutes, alternating +/- jitter around the mean."""
    minutes = int(spec['minutes'])
    base = float(spec[key])
    jitter = float(spec.get('jitter', 0))
    return [[60.0 * i, base + (jitter if i % 2 else -jitter)] for i in range(minutes + 1)]


def case_facts(case):
    data = dict(case['facts'])
    data.setdefault('gpu_memory_total_mib', GPU_TOTAL_MIB)
    if 'util' in case:
        data['util_series'] = series(case['util'], 'mean')
    if 'mem' in case:
        data['mem_series'] = series(case['mem'], 'mib')
    return rogue.ProcessFacts.from_dict(data)


def corpus_config():
    return rogue.load_config(rules_file=os.path.join(FIXTURES, 'corpus-rules.yml'), now=NOW)


MINERS = load_cases('miners.yml')
LEGIT = load_cases('legit.yml')
FLAGGED = ('high', 'critical')


def evaluate_all():
    detector = rogue.Detector(corpus_config())
    results = []
    for truth, cases in (('miner', MINERS), ('legit', LEGIT)):
        for case in cases:
            finding = detector.evaluate(case_facts(case))
            level = finding['level'] if finding else None
            results.append((truth, case, finding, level))
    return results


def test_corpus_size():
    assert len(MINERS) >= 30
    assert len(LEGIT) >= 30
    ids = [c['id'] for c in MINERS + LEGIT]
    assert len(ids) == len(set(ids))


def test_confusion_matrix():
    results = evaluate_all()
    matrix = {('miner', True): 0, ('miner', False): 0, ('legit', True): 0, ('legit', False): 0}
    lines = []
    for truth, case, finding, level in results:
        flagged = level in FLAGGED
        matrix[(truth, flagged)] += 1
        rules = ','.join(r['id'] for r in finding['rules']) if finding else '-'
        lines.append('%-5s %-42s %-8s %3s  %s' % (truth, case['id'], level or 'none', finding['score'] if finding else 0, rules))
    print('\nrogue detector corpus (flagged = high or critical)')
    print('\n'.join(lines))
    print('')
    print('                 flagged   not flagged')
    print('  miner (%3d)    %5d     %5d' % (len(MINERS), matrix[('miner', True)], matrix[('miner', False)]))
    print('  legit (%3d)    %5d     %5d' % (len(LEGIT), matrix[('legit', True)], matrix[('legit', False)]))
    missed = [c['id'] for t, c, _f, lvl in results if t == 'miner' and lvl not in FLAGGED]
    false_alarms = [c['id'] for t, c, _f, lvl in results if t == 'legit' and lvl in FLAGGED]
    assert not missed, 'miners below high: %s' % missed
    assert not false_alarms, 'legitimate cases at high or above: %s' % false_alarms


@pytest.mark.parametrize('case', MINERS, ids=[c['id'] for c in MINERS])
def test_miner_case(case):
    finding = rogue.Detector(corpus_config()).evaluate(case_facts(case))
    assert finding is not None
    assert finding['level'] in FLAGGED, finding
    assert finding['allowlisted'] is None
    # Every fired rule carries concrete evidence.
    for rule in finding['rules']:
        assert rule['evidence'] and all(e['value'] for e in rule['evidence']), rule
    if finding['level'] == 'critical':
        assert finding['points']['hard'] > 0
    assert finding['pid'] == case['facts']['pid']
    assert finding['user'] == case['facts']['user']


@pytest.mark.parametrize('case', LEGIT, ids=[c['id'] for c in LEGIT])
def test_legit_case(case):
    finding = rogue.Detector(corpus_config()).evaluate(case_facts(case))
    level = finding['level'] if finding else None
    assert level not in FLAGGED, finding
    if case.get('expect_allowlisted'):
        assert finding is not None and finding['allowlisted'] is not None, finding
    elif finding is not None:
        assert finding['allowlisted'] is None, finding


def test_allowlist_is_what_keeps_allowlisted_cases_low():
    """Without the allowlist the allowlisted cases still get findings (the entries are doing work)."""
    detector = rogue.Detector(rogue.RogueConfig())
    for case in LEGIT:
        if case.get('expect_allowlisted'):
            finding = detector.evaluate(case_facts(case))
            assert finding is not None and finding['allowlisted'] is None
