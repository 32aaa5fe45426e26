# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The schema of the policy's sections that say how the guard responds: escalation (warnings, then
the action), the rogue-process rule, the remediation ladder and notifications."""

from __future__ import annotations

import re

from .. import chat, notify as notify_mod
from ..constants import DISRUPTION_KEEP_S, REBOOT_FLAG_PATH, ROGUE_LEVELS
from .validation import _join, _only
from .values import (
    ACTION_TERMINATE, ACTION_WARN, _NAME, _abs_path, _action, _bool, _command, _count, _dict, _duration, _list, _pct, _regex, _section)


# The default redaction (docs/policy.md, "Redaction") lives with the redaction itself.
DEFAULT_REDACT_PATTERNS = notify_mod.DEFAULT_REDACT_PATTERNS


CLEAR_AFTER = 60.0   # a violation that disappears is cleared after this long away (escalation.clear_after)


class Escalation(object):
    """Warnings at ``warn_at`` seconds after a violation is first seen; the action at ``act_at``;
    SIGKILL ``sigkill_after`` seconds after SIGTERM; a failed action is retried after ``retry_after``;
    a violation that disappears is cleared once it has stayed away for ``clear_after`` seconds."""

    def __init__(self, warn_at=(0.0, 300.0), act_at=600.0, sigkill_after=30.0, retry_after=300.0, clear_after=CLEAR_AFTER):
        self.warn_at = sorted(float(x) for x in warn_at)
        self.act_at = float(act_at)
        self.sigkill_after = float(sigkill_after)
        self.retry_after = float(retry_after)
        self.clear_after = float(clear_after)

    def to_dict(self):
        return {'warn_at': self.warn_at, 'act_at': self.act_at, 'sigkill_after': self.sigkill_after,
                'retry_after': self.retry_after, 'clear_after': self.clear_after}


ESCALATION_KEYS = ('warn_again_after', 'act_after', 'grace', 'warnings', 'sigkill_after', 'kill_after', 'retry_after', 'steps',
                   'clear_after')


def _escalation(value, path):
    if value is None:
        return Escalation()
    if isinstance(value, list):
        value = {'steps': value}
    errors = _section(value, path, ESCALATION_KEYS)
    sigkill = None
    for name in ('sigkill_after', 'kill_after'):
        if name in value:
            if sigkill is not None:
                errors.add(_join(path, name), value[name], 'given twice (kill_after is another name for sigkill_after)')
                continue
            sigkill = errors.run(_duration, value[name], _join(path, name))
    retry = errors.run(_duration, value['retry_after'], _join(path, 'retry_after')) if 'retry_after' in value else 300.0
    clear = errors.run(_duration, value['clear_after'], _join(path, 'clear_after')) if 'clear_after' in value else CLEAR_AFTER
    if 'steps' in value:
        if any(k in value for k in ('warn_again_after', 'act_after', 'grace', 'warnings')):
            errors.add(path, value, 'give steps, or warn_again_after/act_after, not both')
        warn_at, act_at = [], None
        steps = errors.run(_list, value['steps'], _join(path, 'steps'))
        for index, step in enumerate(steps or []):
            sub = '%s[%d]' % (_join(path, 'steps'), index)
            if errors.run(_dict, step, sub) is None:
                continue
            errors.run(_only, step, sub, ('after', 'after_min', 'action', 'sigkill_after'))
            if 'after' in step and 'after_min' in step:
                errors.add(sub, step, 'give after or after_min, not both')
            after = errors.run(_duration, step['after_min'], _join(sub, 'after_min'), 60.0) if 'after_min' in step else \
                errors.run(_duration, step.get('after', 0), _join(sub, 'after'))
            action = errors.run(_action, step.get('action', ACTION_WARN), _join(sub, 'action'))
            if after is None or action is None:
                continue
            if action == ACTION_WARN:
                if act_at is not None:
                    errors.add(sub, step, 'warnings come before the action')
                warn_at.append(after)
            else:
                if act_at is not None:
                    errors.add(sub, step, 'only one step acts (terminate or kill)')
                act_at = after
                if 'sigkill_after' in step:
                    sigkill = errors.run(_duration, step['sigkill_after'], _join(sub, 'sigkill_after'))
        if steps is not None and act_at is None:
            errors.add(_join(path, 'steps'), steps, 'the last step acts: action terminate (or kill)')
        elif warn_at and act_at is not None and max(warn_at) > act_at:
            errors.add(_join(path, 'steps'), steps, 'warnings come before the action')
        errors.check()
        return Escalation(warn_at, act_at, 30.0 if sigkill is None else sigkill, retry, clear)
    if 'act_after' in value and 'grace' in value:
        errors.add(path, value, 'give act_after or grace (the same thing), not both')
    act_at = 600.0
    for name in ('act_after', 'grace'):
        if name in value:
            act_at = errors.run(_duration, value[name], _join(path, name))
    warn_at = []
    if 'warn_again_after' in value:
        if 'warnings' in value:
            errors.add(path, value, 'give warn_again_after or warnings, not both')
        again = errors.run(_duration, value['warn_again_after'], _join(path, 'warn_again_after'))
        if again is not None and act_at is not None and again > act_at:
            errors.add(_join(path, 'warn_again_after'), value['warn_again_after'], 'the second warning comes before the action (act_after)')
        warn_at = [0.0, again]
    else:
        count = errors.run(_count, value['warnings'], _join(path, 'warnings')) if 'warnings' in value else 2
        if count is not None and count > 100:
            errors.add(_join(path, 'warnings'), value['warnings'], 'at most 100 warnings')
        elif count and act_at is not None:
            warn_at = [act_at * i / count for i in range(count)]
    errors.check()
    return Escalation(warn_at, act_at, 30.0 if sigkill is None else sigkill, retry, clear)


class RoguePolicy(object):
    def __init__(self, enabled=False, act_min_level=ROGUE_LEVELS[-1], action=ACTION_TERMINATE, grace=0.0, rules_file=None):
        self.enabled = enabled
        self.act_min_level = act_min_level
        self.action = action
        self.grace = grace
        self.rules_file = rules_file


def _switched(value, section):
    """``section`` (a class) off for a missing or false value, on for true; None for a mapping to parse."""
    if value is None or value is False:
        return section()
    if value is True:
        return section(enabled=True)
    return None


def _rogue(value, path):
    switched = _switched(value, RoguePolicy)
    if switched is not None:
        return switched
    errors = _section(value, path, ('enabled', 'act_min_level', 'min_level', 'action', 'grace', 'require_hard_indicator', 'rules_file'))
    if 'act_min_level' in value and 'min_level' in value:
        errors.add(path, value, 'give act_min_level or min_level, not both')
    level = value.get('act_min_level', value.get('min_level', ROGUE_LEVELS[-1]))
    if level not in ROGUE_LEVELS[1:]:  # medium, high or critical: info is never acted on
        errors.add(_join(path, 'act_min_level'), level, 'expected medium, high or critical')
    if 'require_hard_indicator' in value and value['require_hard_indicator'] is not True:
        errors.add(_join(path, 'require_hard_indicator'), value['require_hard_indicator'],
                   'acting on a rogue finding always needs a hard indicator (content or network evidence); '
                   'behaviour alone never leads to an action')
    rules_file = value.get('rules_file')
    if rules_file is not None:
        errors.run(_abs_path, rules_file, _join(path, 'rules_file'))
    rogue = RoguePolicy(enabled=errors.run(_bool, value.get('enabled', True), _join(path, 'enabled')),
                        act_min_level=level,
                        action=errors.run(_action, value.get('action', ACTION_TERMINATE), _join(path, 'action')),
                        grace=errors.run(_duration, value['grace'], _join(path, 'grace')) if 'grace' in value else 0.0,
                        rules_file=rules_file)
    errors.check()
    return rogue


class RemediationPolicy(object):
    """The guard's remediation ladder (core/remediate.py): off unless ``enabled``."""

    def __init__(self, enabled=False, kill_application_xids=True, reset=True, kill_processes=False, stop_services=(),
                 drain=True, drain_command=None, reboot_flag=REBOOT_FLAG_PATH, orphan_threshold_mib=1024,
                 verify_timeout=60.0, node_name=None, max_resets=2, window=86400.0, max_drained_pct=50.0):
        self.enabled = enabled
        self.kill_application_xids = kill_application_xids
        self.reset = reset
        self.kill_processes = kill_processes
        self.stop_services = list(stop_services)
        self.drain = drain
        self.drain_command = drain_command
        self.reboot_flag = reboot_flag
        self.orphan_threshold_mib = orphan_threshold_mib
        self.verify_timeout = verify_timeout
        self.node_name = node_name
        # the ladder's budget (core/budget.py): resets per GPU, one drain and one reboot flag per node, per window
        self.max_resets = max_resets
        self.window = window
        self.max_drained_pct = max_drained_pct


REMEDIATION_KEYS = ('enabled', 'kill_application_xids', 'reset', 'kill_processes', 'stop_services', 'drain', 'drain_command',
                    'reboot_flag', 'orphan_threshold_mib', 'verify_timeout', 'node_name', 'max_resets', 'window', 'max_drained_pct')


def _remediation(value, path):
    switched = _switched(value, RemediationPolicy)
    if switched is not None:
        return switched
    errors = _section(value, path, REMEDIATION_KEYS)
    out = RemediationPolicy(enabled=errors.run(_bool, value.get('enabled', True), _join(path, 'enabled')))
    for key in ('kill_application_xids', 'reset', 'kill_processes', 'drain'):
        if key in value:
            setattr(out, key, errors.run(_bool, value[key], _join(path, key)))
    services = value.get('stop_services')
    if services is not None:
        # only for this key: the tick stays light
        from ..reset import UNIT_RE  # pylint: disable=import-outside-toplevel
        services = [services] if services == 'auto' else errors.run(_list, services, _join(path, 'stop_services')) or []
        for unit in services:
            if not isinstance(unit, str) or not UNIT_RE.match(unit):
                errors.add(_join(path, 'stop_services'), unit, 'not a systemd unit name (or auto)')
        out.stop_services = list(services)
    if value.get('drain_command') is not None:
        out.drain_command = errors.run(_command, value['drain_command'], _join(path, 'drain_command'))
    if 'reboot_flag' in value:
        flag = value['reboot_flag']
        out.reboot_flag = None if flag is False else errors.run(_abs_path, flag, _join(path, 'reboot_flag'))
    if 'orphan_threshold_mib' in value:
        out.orphan_threshold_mib = errors.run(_count, value['orphan_threshold_mib'], _join(path, 'orphan_threshold_mib'))
    if 'verify_timeout' in value:
        out.verify_timeout = errors.run(_duration, value['verify_timeout'], _join(path, 'verify_timeout'))
    name = value.get('node_name')
    if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
        errors.add(_join(path, 'node_name'), name, 'expected a scheduler node name')
    out.node_name = name
    _budget(value, path, out, errors)
    errors.check()
    return out


def _budget(value, path, out, errors):
    """The ladder's budget keys: max_resets (0-100), window (more than 0, at most 7 days), max_drained_pct (0-100)."""
    if 'max_resets' in value:
        count = errors.run(_count, value['max_resets'], _join(path, 'max_resets'))
        if count is not None and count > 100:
            errors.add(_join(path, 'max_resets'), value['max_resets'], 'expected a whole number from 0 to 100')
        out.max_resets = count
    if 'window' in value:
        window = errors.run(_duration, value['window'], _join(path, 'window'))
        if window is not None and not 0 < window <= DISRUPTION_KEEP_S:
            errors.add(_join(path, 'window'), value['window'], 'expected more than 0 and at most 7d (the history a node keeps)')
        out.window = window
    if 'max_drained_pct' in value:
        out.max_drained_pct = errors.run(_pct, value['max_drained_pct'], _join(path, 'max_drained_pct'))


class Notify(object):
    def __init__(self, tty=True, webhook_url=None, webhook_timeout=5.0, command=None, redact_patterns=(), message='',
                 webhook_format='json'):
        self.tty = tty
        self.webhook_url = webhook_url
        self.webhook_timeout = webhook_timeout
        self.webhook_format = webhook_format
        self.command = command
        self.redact_patterns = list(redact_patterns)
        self.message = message


def _notify(value, path):
    defaults = [re.compile(p) for p in DEFAULT_REDACT_PATTERNS]
    if value is None:
        return Notify(redact_patterns=defaults)
    errors = _section(value, path, ('tty', 'webhook', 'command', 'redact_patterns', 'redact_defaults', 'message'))
    url, timeout, fmt = None, 5.0, 'json'
    hook = value.get('webhook')
    if isinstance(hook, str):
        hook = {'url': hook}
    if hook is not None and errors.run(_dict, hook, _join(path, 'webhook')) is not None:
        sub = _join(path, 'webhook')
        errors.run(_only, hook, sub, ('url', 'timeout', 'enabled', 'allow_http', 'format'))
        fmt = hook.get('format', 'json')
        if fmt not in chat.FORMATS:
            errors.add(_join(sub, 'format'), fmt, 'expected one of %s' % ', '.join(chat.FORMATS))
        allow_http = errors.run(_bool, hook.get('allow_http', False), _join(sub, 'allow_http'))
        if hook.get('enabled', True):
            url = hook.get('url')
            why = None if url is None else notify_mod.webhook_url_problem(url, bool(allow_http), _join(sub, 'allow_http'))
            if why:
                errors.add(_join(sub, 'url'), (notify_mod.redact_url(url) or '<redacted>') if isinstance(url, str) else url, why)
        if 'timeout' in hook:
            timeout = errors.run(_duration, hook['timeout'], _join(sub, 'timeout'))
            if timeout is not None and not 0 < timeout <= 60:
                errors.add(_join(sub, 'timeout'), hook['timeout'], 'expected more than 0 and at most 60 seconds')
    command = None
    if value.get('command') is not None:
        command = errors.run(_command, value['command'], _join(path, 'command'))
    patterns = defaults if errors.run(_bool, value.get('redact_defaults', True), _join(path, 'redact_defaults')) is not False else []
    for item in errors.run(_list, value.get('redact_patterns'), _join(path, 'redact_patterns')) or []:
        patterns.append(errors.run(_regex, item, _join(path, 'redact_patterns')))
    message = value.get('message') or ''
    if not isinstance(message, str):
        errors.add(_join(path, 'message'), message, 'expected text')
    tty = errors.run(_bool, value.get('tty', True), _join(path, 'tty'))
    errors.check()
    return Notify(tty, url, timeout, command, patterns, message, fmt)
