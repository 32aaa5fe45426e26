# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The guard's Prometheus textfile metrics: format, escaping, atomic writes."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import metrics
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.policy import Violation
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, proc, snapshot

parser = pytest.importorskip('prometheus_client.parser')


def parse(text):
    return dict((f.name, f) for f in parser.text_string_to_metric_families(text))


def test_every_family_parses_with_types_and_labels():
    snap = snapshot([proc(1, 'alice', {0: 4 * GIB, 1: GIB}), proc(2, 'alice', {0: GIB}), proc(3, None, {2: 512})])
    violations = [Violation('max_mem_per_gpu', 'user:alice', 5, 4, 'terminate', [1], gpu=0),
                  Violation('max_mem_per_gpu', 'user:bob', 5, 4, 'terminate', [4], gpu=1),
                  Violation('idle', 'user:alice', 5, 4, 'terminate', [2])]
    counters = {'kills': {'idle': 2}, 'warnings': {'idle': 5, 'max_gpus': 1}, 'ticks': 7, 'state_rebuilt': 1,
                'notify_failures': {'webhook': 3}}
    text = metrics.guard_metrics(snap, violations, counters, {'time': 1700000000.5, 'duration': 0.25, 'cpu': 0.1},
                                 'enforce').render()
    families = parse(text)
    assert families['gpufleet_guard_kills'].type == 'counter'
    assert families['gpufleet_guard_violations'].type == 'gauge'
    values = dict(((s.name, tuple(sorted(s.labels.items()))), s.value) for f in families.values() for s in f.samples)
    assert values[('gpufleet_user_gpu_memory_mib', (('gpu', '0'), ('user', 'alice')))] == 5 * GIB
    assert values[('gpufleet_user_gpu_memory_mib', (('gpu', '2'), ('user', 'unknown')))] == 512
    assert values[('gpufleet_user_gpu_processes', (('gpu', '0'), ('user', 'alice')))] == 2
    assert values[('gpufleet_guard_violations', (('rule', 'max_mem_per_gpu'),))] == 2
    assert values[('gpufleet_guard_kills_total', (('rule', 'idle'),))] == 2
    assert values[('gpufleet_guard_notify_failures_total', (('channel', 'webhook'),))] == 3
    assert values[('gpufleet_guard_ticks_total', ())] == 7
    assert values[('gpufleet_guard_mode', (('mode', 'enforce'),))] == 1
    assert values[('gpufleet_guard_mode', (('mode', 'dry-run'),))] == 0
    assert values[('gpufleet_guard_tick_duration_seconds', ())] == 0.25
    labels = (('gpu', '0'), ('name', 'NVIDIA A100-SXM4-80GB'), ('uuid', snap.devices[0].uuid))
    assert values[('gpufleet_gpu_memory_used_mib', labels)] == 5 * GIB


def test_label_values_are_escaped():
    out = metrics.Metrics()
    out.add('x', 'gauge', 'help with \\ backslash\nand newline', 1, {'user': 'we"ird\\na\nme'})
    out.add('x', 'gauge', 'h', None, {'user': 'skipped'})
    text = out.render()
    sample = parse(text)['x'].samples
    assert len(sample) == 1 and sample[0].labels['user'] == 'we"ird\\na\nme'


def test_unknown_values_are_left_out_and_specials_render():
    assert metrics._number(None) is None
    assert metrics._number(float('nan')) == 'NaN' and metrics._number(float('inf')) == '+Inf'
    assert metrics._number(True) == '1'


def test_policy_error_metrics_without_a_snapshot():
    text = metrics.guard_metrics(None, [], {}, {'time': 1.0}, None, policy_valid=False).render()
    values = dict((s.name, s.value) for f in parse(text).values() for s in f.samples)
    assert values['gpufleet_guard_policy_valid'] == 0 and 'gpufleet_guard_mode' not in values


def test_xid_fault_class_untrusted_input_rogue_levels_and_actions_per_user():
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import xid  # pylint: disable=import-outside-toplevel
    snap = snapshot([proc(1, 'alice', {0: GIB})])
    for code in (13, 79, 79):
        snap.devices[0].add_xid_event(xid.make_event(code, 'kmsg', time_s=1.0))
    findings = {7: {'level': 'critical'}, 8: {'level': 'high', 'allowlisted': True}, 9: {'level': 'bogus'}}
    text = metrics.guard_metrics(snap, [], {'user_actions': {'alice': 3}}, {'time': 1.0}, 'enforce', untrusted=True,
                                 rogue_findings=findings).render()
    values = dict(((s.name, tuple(sorted(s.labels.items()))), s.value) for f in parse(text).values() for s in f.samples)
    gpu = (('gpu', '0'), ('name', 'NVIDIA A100-SXM4-80GB'), ('uuid', snap.devices[0].uuid))
    assert values[('gpufleet_gpu_xid_errors', tuple(sorted(gpu + (('code', '13'), ('fault', 'application')))))] == 1
    assert values[('gpufleet_gpu_xid_errors', tuple(sorted(gpu + (('code', '79'), ('fault', 'gpu')))))] == 2
    assert values[('gpufleet_guard_untrusted_input', ())] == 1
    assert values[('gpufleet_guard_user_actions_total', (('user', 'alice'),))] == 3
    assert [(dict(k)['level'], v) for (n, k), v in sorted(values.items()) if n == 'gpufleet_guard_rogue_findings'] == [
        ('critical', 1), ('high', 0), ('info', 0), ('medium', 0)]
    plain = dict((s.name, s.value) for f in parse(metrics.guard_metrics(snap).render()).values() for s in f.samples)
    assert plain['gpufleet_guard_untrusted_input'] == 0 and 'gpufleet_guard_rogue_findings' not in plain
