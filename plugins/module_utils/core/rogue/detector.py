# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Scoring and the rogue detector: evaluates ProcessFacts against a RogueConfig, and the entry points.

``Detector`` runs every enabled rule and returns a finding (a dictionary: who, which GPU, how much
memory, the score, the level and each fired rule with its concrete evidence), or None when no rule
fires.  Scoring (docs/rogue-detection.md): hard + soft + behavioural points, where behavioural
points are capped and lowered by suppressors; critical needs a hard indicator, high needs a hard
indicator or enough soft ones.  ``detect_snapshot`` and ``selector_detector`` run it on a live
snapshot (through procfs.FactsCollector).
"""

from __future__ import annotations

from .. import notify
from ..constants import HISTORY_PATH, ROGUE_LEVELS
from ..text import clean_text
from . import rules as R
from .checks import _Context, ml_libraries
from .config import RogueConfig
from .facts import MAX_ARGS, MAX_EVIDENCE, MAX_SCAN_CHARS, _evidence
from .procfs import FactsCollector

LEVELS = ROGUE_LEVELS
MAX_OUTPUT_ARGS = 64
MAX_OUTPUT_ARG = 1024


# ---------------------------------------------------------------------------- the detector
def level_index(level):
    return LEVELS.index(level)


def at_least(level, min_level):
    return level is not None and level_index(level) >= level_index(min_level)


def classify(hard, soft, behavioural):
    """(score, level) from the three families' points (behavioural already capped and suppressed)."""
    score = min(R.MAX_SCORE, hard + soft + behavioural)
    if score >= R.CRITICAL_AT and hard > 0:
        return score, 'critical'
    if score >= R.HIGH_AT and (hard > 0 or soft >= R.SOFT_HIGH_GATE):
        return score, 'high'
    if score >= R.MEDIUM_AT:
        return score, 'medium'
    return score, 'info'


class Detector(object):
    """Evaluates ProcessFacts against a RogueConfig."""

    def __init__(self, config=None):
        self.config = config if config is not None else RogueConfig()
        self._rules = self.config.rules()

    def evaluate(self, facts):
        """The finding for ``facts`` (a dict, see docs/audit-schema.md), or None when no rule fires."""
        ctx = _Context(facts, self.config)
        fired = []
        notes = list(facts.notes)
        points = {'hard': 0, 'soft': 0, 'behavioural': 0}
        for rid, kind, weight, description, check in self._rules:
            try:
                evidence = check(ctx)
            except Exception as exc:  # pylint: disable=broad-except
                notes.append('rule %s could not be evaluated: %s' % (rid, clean_text(exc, 200)))
                continue
            if evidence:
                fired.append({'id': rid, 'kind': kind, 'weight': weight, 'description': description,
                              'evidence': evidence[:MAX_EVIDENCE]})
                points[kind] += weight
        if not fired:
            return None
        suppressors = []
        libs = ml_libraries(facts.maps)
        if libs:
            for sid, weight, description in R.BUILTIN_SUPPRESSORS:
                suppressors.append({'id': sid, 'weight': weight, 'description': description,
                                    'evidence': [_evidence('maps', ', '.join(libs[:6]), '%d ML libraries mapped' % len(libs))]})
        behavioural = min(points['behavioural'], R.BEHAVIOURAL_CAP)
        behavioural = max(0, behavioural + sum(s['weight'] for s in suppressors))
        score, level = classify(points['hard'], points['soft'], behavioural)
        allowed = None
        for entry in self.config.allowlist:
            if entry.matches(facts, ctx.args):
                allowed = entry.describe()
                break
        if allowed is not None:
            level = 'info'
        if facts.truncated:
            notes.append('the command line was longer than %d characters or %d arguments; only its start and end were examined' % (
                MAX_SCAN_CHARS, MAX_ARGS))
        return finding_dict(facts, score, level, fired, suppressors, points, behavioural, allowed, notes)

    def detect(self, facts_list, min_level='info'):
        """Findings at or above ``min_level``, highest score first."""
        findings = []
        for facts in facts_list:
            finding = self.evaluate(facts)
            if finding is not None and at_least(finding['level'], min_level):
                findings.append(finding)
        findings.sort(key=lambda f: (-f['score'], -level_index(f['level']), f['pid']))
        return findings


def _output_cmdline(args):
    """The command line of a finding (returned, and appended to the audit log): bounded, and redacted
    with the default patterns (notify.redact_argv: a finding at level info is any GPU process)."""
    if args is None:
        return None
    return notify.redact_argv([clean_text(a, MAX_OUTPUT_ARG) for a in args[:MAX_OUTPUT_ARGS]], notify.default_patterns())


def finding_dict(facts, score, level, fired, suppressors, points, behavioural, allowed, notes):
    container = None
    if facts.container:
        container = dict((k, facts.container.get(k)) for k in ('id', 'runtime', 'pod_uid', 'image', 'image_digest'))
    return {
        'pid': facts.pid,
        'starttime': facts.starttime,
        'user': facts.user,
        'uid': facts.uid,
        'name': facts.name,
        'exe': clean_text(facts.exe, MAX_OUTPUT_ARG),
        'cmdline': _output_cmdline(facts.cmdline),
        'cmdline_truncated': bool(facts.truncated or (facts.cmdline is not None and (
            len(facts.cmdline) > MAX_OUTPUT_ARGS or any(len(a) > MAX_OUTPUT_ARG for a in facts.cmdline)))),
        'gpu_indexes': list(facts.gpu_indexes),
        'used_mib': facts.used_mib,
        'container': container,
        'slurm_job': facts.slurm_job,
        'listed': facts.listed,
        'score': score,
        'level': level,
        'points': {'hard': points['hard'], 'soft': points['soft'], 'behavioural': behavioural},
        'rules': fired,
        'suppressors': suppressors,
        'allowlisted': allowed,
        'notes': notes,
    }


def summarize(findings, evaluated=None):
    """Counts per level (and allowlisted, evaluated)."""
    summary = dict((level, 0) for level in LEVELS)
    allowlisted = 0
    for finding in findings:
        summary[finding['level']] += 1
        if finding.get('allowlisted'):
            allowlisted += 1
    summary['allowlisted'] = allowlisted
    summary['total'] = len(findings)
    if evaluated is not None:
        summary['evaluated'] = evaluated
    return summary


# ---------------------------------------------------------------------------- entry points
def detector_argument_spec():
    """The module options that the detector is built from, in gpu_audit and in gpu_kill (rogue=true):
    one definition, so that both read the same usage history and decide allocations alike.  Their
    documentation is the doc fragment gpufleet.reclaim._attributes.ROGUE_DETECTOR."""
    return dict(require_allocation=dict(type='str', default='auto', choices=['auto', 'always', 'never']),
                history_path=dict(type='path', default=HISTORY_PATH))


def detector_options(params):
    """The keyword arguments of detect_snapshot and selector_detector that a module's parameters give."""
    return {'history_path': params['history_path'], 'allocation': params['require_allocation']}


def detect_snapshot(snapshot, config=None, min_level='info', history_path=None, allocation='auto', collector=None,
                    exe_hashes=None):
    """(findings, warnings, evaluated) for a live snapshot."""
    config = config if config is not None else RogueConfig()
    if collector is None:
        collector = FactsCollector(history_path=history_path, allocation=allocation, window_s=config.window_s,
                                   exe_hashes=exe_hashes)
    facts_list = collector.collect(snapshot)
    findings = Detector(config).detect(facts_list, min_level)
    return findings, list(config.warnings) + list(collector.warnings), len(facts_list)


def selector_detector(config=None, history_path=None, allocation='auto', report=None):
    """A ``rogue_detector`` for select.Selector: ``(snapshot, min_level) -> {pid: finding}``.

    Only processes the driver lists are returned (the selector looks at those).  ``report``, a dict,
    receives what this very run found, as gpu_audit reports it: ``findings`` (every level, holders
    included), ``summary`` (:func:`summarize`) and ``warnings``; so one call can select, kill and
    report the evidence of the same detection (gpu_kill rogue=true).
    """
    def detector(snapshot, min_level):
        findings, warnings, count = detect_snapshot(snapshot, config=config, min_level='info' if report is not None else min_level,
                                                    history_path=history_path, allocation=allocation)
        if report is not None:
            report.update(findings=findings, summary=summarize(findings, count), warnings=warnings)
        return dict((f['pid'], f) for f in findings if f['listed'] and at_least(f['level'], min_level))
    return detector
