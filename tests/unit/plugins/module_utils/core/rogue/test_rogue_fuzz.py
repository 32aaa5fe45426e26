# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fuzzing: random bytes and hostile command lines never crash or hang the rules parser or the detector."""

from __future__ import annotations

import time

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import GpuFleetError

hypothesis = pytest.importorskip('hypothesis')
st = hypothesis.strategies
given = hypothesis.given
settings = hypothesis.settings

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
SMALL = settings(max_examples=15, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
MARKERS = ['stratum+tcp://', '--donate-level', '-o', '-u', '-a', 'kawpow', 'kaspa:', '0x', '4', '@', '.', ':', '=', '|', '\x00',
           '\udcff', '\ufffd', '(', '[', '*', 'supportxmr.com', '--coin', '-epool', '-wal', ' ', '\n']
WORD = st.one_of(st.text(max_size=40), st.sampled_from(MARKERS),
                 st.lists(st.sampled_from(MARKERS), max_size=12).map(''.join))
ARGS = st.lists(st.one_of(WORD, st.binary(max_size=40)), max_size=30)
DETECTOR = rogue.Detector(rogue.load_config(rules={'pools': ['203.0.113.0/24', 'pool.example.org'],
                                                   'allowlist': [{'user': 'u', 'cmdline': '^x'}]}))


def check_finding(finding):
    if finding is None:
        return
    assert finding['level'] in rogue.LEVELS
    assert 0 <= finding['score'] <= 100
    for rule in finding['rules']:
        for item in rule['evidence']:
            assert isinstance(item['value'], str) and len(item['value']) <= rogue.MAX_EVIDENCE_TEXT + 3
            item['value'].encode('utf-8')                                      # no lone surrogates


@FUZZ
@given(st.binary(max_size=2000))
def test_rules_parser_random_bytes(data):
    try:
        rogue.load_config(text=data)
    except GpuFleetError:
        pass


YAML_ATOMS = ['version: 1\n', 'pools:\n', 'rules:\n', 'allowlist:\n', '  - ', 'id: ', 'kind: ', 'weight: ', 'match: ', 'cmdline: ',
              '{', '}', '[', ']', '&a ', '*a ', '!!python/object:os.system ', '"', "'", '\n', '  ', '- ', ': ', '(a+)+', '999',
              'hard', 'soft', '2026-01-01', '2026-13-45', '!!binary ', '!!timestamp ', '!!int ', '!!float ', '0x', '1e999',
              '<<: ', '? ', '|', '>', '%YAML 1.1\n', '---\n', '...\n', '\t', '\x00', '\ud800', 'expires: ', 'sha256: ', 'exe: /x\n']


@FUZZ
@given(st.lists(st.sampled_from(YAML_ATOMS), max_size=60).map(''.join))
def test_rules_parser_yaml_shaped_text(text):
    try:
        rogue.load_config(text=text)
    except GpuFleetError:
        pass


@FUZZ
@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20), st.binary(max_size=10)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.sampled_from(list(rogue.TOP_KEYS) + list(rogue.RULE_KEYS) +
                                                                            list(rogue.ALLOW_KEYS) + ['x']), inner, max_size=4)),
                    max_leaves=20))
def test_inline_rules_random_structures(rules):
    try:
        rogue.load_config(rules=rules if isinstance(rules, dict) else {'rules': rules})
    except GpuFleetError:
        pass


@FUZZ
@given(ARGS, st.dictionaries(WORD, WORD, max_size=5), st.one_of(st.none(), WORD), st.one_of(st.none(), WORD),
       st.lists(st.one_of(WORD, st.tuples(st.integers(0, 2 ** 32), st.integers(-5, 70000)).map(lambda t: '%d.%d.0.1:%d' % (
           t[0] % 256, t[0] // 256 % 256, t[1]))), max_size=5),
       st.lists(st.dictionaries(st.sampled_from(['pid', 'name', 'exe', 'cmdline']), st.one_of(WORD, ARGS), max_size=4), max_size=4))
def test_detector_hostile_facts(args, env, exe, name, conns, parents):
    parents = [dict((k, v) for k, v in p.items() if k != 'pid') for p in parents]
    item = rogue.ProcessFacts.from_dict({'pid': 7, 'user': 'u', 'cmdline': args, 'env': env, 'exe': exe, 'name': name,
                                         'connections': conns, 'parents': parents, 'maps': args[:3]})
    check_finding(DETECTOR.evaluate(item))


@SMALL
@given(st.sampled_from(['stratum+tcp://', 'a.' * 20, '-o ', '(' * 50, 'kaspa:', '0x' + 'f' * 39, '\x00', '@' * 100]),
       st.integers(1, 4))
def test_detector_megabyte_command_lines(unit, count):
    """1 MB arguments built from marker fragments finish quickly (no catastrophic backtracking)."""
    big = (unit * (1024 * 1024 // len(unit) + 1))[:1024 * 1024]
    started = time.monotonic()
    for cmdline in ([big] * count, ['python', 'x.py', '-u', big, '-o', big], big, big.encode('utf-8', 'surrogatepass')):
        item = rogue.ProcessFacts.from_dict({'pid': 1, 'cmdline': cmdline, 'env': {'K': big}, 'parents': [{'cmdline': [big]}]})
        check_finding(DETECTOR.evaluate(item))
    assert time.monotonic() - started < 60


def test_detector_invalid_utf8_and_nul_bytes():
    item = rogue.ProcessFacts.from_dict({'pid': 1, 'cmdline': [b'\xff\xfe\x00stratum+tcp://h:1', b'-u\x00', b'\xc3(' * 1000],
                                         'env': {b'\xff': b'\xfe\x00'}, 'exe': b'/tmp/\xff (deleted)'})
    finding = DETECTOR.evaluate(item)
    check_finding(finding)
    assert 'H-stratum' in [r['id'] for r in finding['rules']]
    assert 'S-exe-location' in [r['id'] for r in finding['rules']]
