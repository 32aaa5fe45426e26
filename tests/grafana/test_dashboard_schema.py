# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""extras/grafana/gpufleet-dashboard.json against Grafana's own types (@grafana/schema, type-checked by tsc;
issue #33). Run by `make dashboard-schema` (part of `make test`), which installs the pinned npm packages of
tests/grafana/package.json into build/grafana-schema first. The panels' queries themselves are proven against a
real Prometheus (tests/unit/extras/test_prometheus_scrape.py): @grafana/schema types them per data source
(Record<string, unknown>).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NPM = os.environ.get('GPUFLEET_GRAFANA_NPM') or os.path.join(os.path.dirname(os.path.dirname(HERE)), 'build', 'grafana-schema')
_spec = importlib.util.spec_from_file_location('check_dashboard', os.path.join(HERE, 'check_dashboard.py'))
cd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cd)

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(NPM, 'node_modules', 'typescript')) and
                                not os.environ.get('GPUFLEET_GRAFANA_NPM'),
                                reason='the npm packages are not installed: run `make dashboard-schema`')


def board():
    with open(cd.DASHBOARD) as handle:
        return json.load(handle)


def test_the_shipped_dashboard_type_checks(tmp_path):
    ok, out = cd.check(board(), NPM, str(tmp_path))
    assert ok, out


def _plant(where):
    planted = copy.deepcopy(board())
    panel = [p for p in planted['panels'] if p['type'] == 'stat'][0]
    if where == 'dashboard key':
        planted['refrsh'] = planted.pop('refresh')
    elif where == 'panel key':
        panel['gridPoss'] = panel.pop('gridPos')
    elif where == 'field config key':
        panel['fieldConfig']['defaults']['unitt'] = panel['fieldConfig']['defaults'].pop('unit')
    elif where == 'variable key':
        planted['templating']['list'][0]['hdie'] = planted['templating']['list'][0].pop('hide')
    elif where == 'value type':
        panel['id'] = str(panel['id'])
    elif where == 'allowed key elsewhere':
        panel['definition'] = 'label_values(up, instance)'     # allowed on variables only
    elif where == 'a current selection of the wrong shape':
        planted['templating']['list'][0]['current'] = {'text': 'All'}     # not empty: checked, and value is missing
    return planted


@pytest.mark.parametrize('where, complaint', [
    ('dashboard key', "'\"refrsh\"' does not exist in type 'Dashboard'"),
    ('panel key', "'\"gridPoss\"' does not exist in type 'Panel"),
    ('field config key', "'\"unitt\"' does not exist in type 'FieldConfig"),
    ('variable key', "'\"hdie\"' does not exist in type 'VariableModel'"),
    ('value type', "Type 'string' is not assignable to type 'number'"),
    ('allowed key elsewhere', "'\"definition\"' does not exist in type 'Panel"),
    ('a current selection of the wrong shape', "'value' is missing"),
])
def test_a_planted_typo_fails_the_check(tmp_path, where, complaint):
    ok, out = cd.check(_plant(where), NPM, str(tmp_path))
    assert not ok and complaint in out, out


def test_only_the_allowed_keys_are_taken_out_and_only_where_allowed():
    original = board()
    stripped, taken = cd.allowed_out(original)
    variables = original['templating']['list']
    expected = ['templating.list[%d].%s' % (i, key) for i, v in enumerate(variables)
                for key in ('definition', 'current') if key in v and (key != 'current' or v[key] == {})]
    assert taken == expected and taken
    assert stripped['panels'] == original['panels'] and original['templating']['list'] == variables   # a copy
    kept = {'templating': {'list': [{'name': 'x', 'type': 'custom', 'current': {'text': 'a', 'value': 'a'}}]}}
    assert cd.allowed_out(kept) == (kept, [])


def test_the_command_line_says_ok_or_failed(tmp_path, capsys):
    assert cd.main(['--npm', NPM]) == 0 and 'OK against @grafana/schema' in capsys.readouterr().out
    planted = tmp_path / 'planted.json'
    planted.write_text(json.dumps(_plant('panel key')))
    assert cd.main(['--npm', NPM, str(planted)]) == 1 and 'FAILED' in capsys.readouterr().out
