# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The Policy object and the top of the schema: parse_policy validates a loaded document (ours, a
gpu-kill configuration, or the shorthand rule list) into a Policy."""

from __future__ import annotations

import re
import shlex

from .gpukill import GPUKILL_KEYS, from_gpukill
from .response import (
    DEFAULT_REDACT_PATTERNS, Escalation, Notify, RemediationPolicy, RoguePolicy, _escalation, _notify, _remediation, _rogue)
from .sections import Group, IdleRule, Limits, Protect, _exemption, _gpu_rule, _group, _limits, _protect, _time_window
from .validation import DocumentLimitError, PolicyError, _Bad, _Errors, _is_number, _join, _only, _type, check_nesting
from .values import MODE_DRY_RUN, GpuSet, _abs_path, _bool, _dict, _duration, _expires, _list, _mode, _name


SCHEMA_VERSION = 1


class Policy(object):
    """A validated policy.  ``notes`` hold warnings for check-config (ignored keys, expired exemptions)."""

    def __init__(self):
        self.version = SCHEMA_VERSION
        self.enabled = True
        self.mode = MODE_DRY_RUN
        self.interval_s = None
        self.lists = {}
        self.defaults = {}
        self.users = {}
        self.user_expires = {}
        self.groups = []          # Group, in the order written
        self.gpus = []            # GpuRule
        self.time_windows = []
        self.exemptions = []
        self.protect = Protect()
        self.escalation = Escalation()
        self.rogue = RoguePolicy()
        self.remediation = RemediationPolicy()
        self.notify = Notify(redact_patterns=[re.compile(p) for p in DEFAULT_REDACT_PATTERNS])
        self.allocations_file = None
        self.idle_max_gap_s = 600.0
        self.notes = []
        self.source = '<policy>'
        self.sha256 = None
        self.format = 'gpufleet'

    # ------------------------------------------------------------------ membership
    def group(self, name):
        for group in self.groups:
            if group.name == name:
                return group
        return None

    def in_group(self, user, name, context):
        if user is None:
            return False
        group = self.group(name)
        if group is not None:
            if group.members is not None:
                return user in group.members
            return group.unix_group in context.groups_of(user)
        return name in context.groups_of(user)

    def groups_of_user(self, user, context, now):
        """The policy groups (in the order written) whose members include ``user`` and that have not expired."""
        return [g for g in self.groups if (g.expires is None or now < g.expires) and self.in_group(user, g.name, context)]

    # ------------------------------------------------------------------ resolution
    def limits_for(self, user, now, context):
        """The Limits of ``user`` at ``now``: defaults, then each of the user's groups in the order written
        (a later group overrides an earlier one), then the user's own entry, then the active time
        windows that apply to the user, in the order written."""
        merged = dict(self.defaults)
        for group in self.groups_of_user(user, context, now):
            merged.update(group.limits)
        expires = self.user_expires.get(user)
        if user in self.users and (expires is None or now < expires):
            merged.update(self.users[user])
        for window in self.time_windows:
            if not window.window.contains(now):
                continue
            if window.applies_to is not None and not window.applies_to.contains(user, self, context):
                continue
            merged.update(window.limits)
            for key, factor in window.multipliers.items():
                for name in {'mem': ('max_mem_mib_per_gpu', 'max_mem_mib_total'), 'runtime': ('max_runtime_s',),
                             'procs': ('max_procs', 'max_procs_per_gpu'), 'gpus': ('max_gpus',)}[key]:
                    if merged.get(name) is not None:
                        value = merged[name] * factor
                        merged[name] = int(value) if name in ('max_procs', 'max_procs_per_gpu', 'max_gpus') else value
        return Limits(merged)

    def active_exemptions(self, now):
        return [e for e in self.exemptions if not e.expired(now)]

    def summary(self):
        """A short description for logs and check-config."""
        return {'mode': self.mode, 'enabled': self.enabled, 'format': self.format, 'users': sorted(self.users),
                'groups': [g.name for g in self.groups], 'gpus': [g.key for g in self.gpus],
                'time_windows': [w.name for w in self.time_windows], 'exemptions': len(self.exemptions),
                'rogue': self.rogue.enabled, 'escalation': self.escalation.to_dict(), 'sha256': self.sha256}


TOP_KEYS = ('version', 'enabled', 'mode', 'interval', 'description', 'metadata', 'lists', 'defaults', 'users', 'groups',
            'gpus', 'time_windows', 'exemptions', 'protect', 'escalation', 'rogue', 'require_allocation',
            'allocations_file', 'notify', 'rules', 'idle_max_gap', 'remediation')


def parse_policy(data, source='<policy>'):
    """Validate a loaded document (dict, or a shorthand list) -> Policy.  Raises PolicyError."""
    try:
        check_nesting(data)  # every format and caller (check-config, tick, gpu_audit's mapping) passes here
    except DocumentLimitError as exc:
        raise PolicyError([('', None, str(exc))], source)
    errors = _Errors()
    if data is None:
        data = {}
    if isinstance(data, list):
        data = {'rules': data}
    if not isinstance(data, dict):
        raise PolicyError([('', data, 'a policy is a mapping (or a list of shorthand rules), got %s' % _type(data))], source)
    for key in data:
        if not isinstance(key, str):
            raise PolicyError([('', key, 'keys must be text, got %s' % _type(key))], source)
    notes = []
    fmt = 'gpufleet'
    if any(key in data for key in GPUKILL_KEYS):
        mixed = [k for k in data if k not in GPUKILL_KEYS and k != 'metadata']
        if mixed:
            raise PolicyError([(mixed[0], data[mixed[0]], 'this looks like a gpu-kill guard configuration (%s); do not mix '
                                                          'it with gpufleet keys' % ', '.join(k for k in GPUKILL_KEYS if k in data))],
                              source)
        data = from_gpukill(data, errors, notes)
        fmt = 'gpu-kill'
        if errors.items:
            raise PolicyError(errors.items, source)
    policy = Policy()
    policy.source = source
    policy.format = fmt
    policy.notes = notes
    errors.run(_only, data, '', TOP_KEYS, dict((k, 'a gpu-kill key; a gpu-kill configuration uses only %s' % ', '.join(GPUKILL_KEYS))
                                               for k in ('dry_run', 'hard_enforcement')))
    _parse_top(policy, data, errors)
    if errors.items:
        raise PolicyError(errors.items, source)
    return policy


def _parse_top(policy, data, errors):
    version = data.get('version', SCHEMA_VERSION)
    if version != SCHEMA_VERSION and str(version) != str(SCHEMA_VERSION):
        errors.add('version', version, 'this agent reads policy version %d' % SCHEMA_VERSION)
    if 'enabled' in data:
        policy.enabled = errors.run(_bool, data['enabled'], 'enabled')
    if 'mode' in data:
        policy.mode = errors.run(_mode, data['mode'], 'mode') or MODE_DRY_RUN
    if data.get('interval') is not None:
        policy.interval_s = errors.run(_duration, data['interval'], 'interval')
    if data.get('idle_max_gap') is not None:
        gap = errors.run(_duration, data['idle_max_gap'], 'idle_max_gap')
        if gap is not None:
            policy.idle_max_gap_s = gap
    for key in ('description',):
        if key in data and not isinstance(data[key], str):
            errors.add(key, data[key], 'expected text')
    # lists first: everything else may refer to them
    lists = {}
    if data.get('lists') is not None:
        for name, members, path in _named(data, 'lists', errors, 'a list name'):
            items = errors.run(_list, members, path)
            if items is None:
                continue
            users = [errors.run(_name, m, path) for m in items]
            lists[name] = frozenset(u for u in users if u is not None)
    policy.lists = lists
    rules = data.get('rules')
    shorthand = _shorthand(rules, errors) if rules is not None else {'defaults': {}, 'users': {}, 'groups': {}}
    if data.get('defaults') is not None:
        policy.defaults = errors.run(_limits, data['defaults'], 'defaults') or {}
    _merge_into(policy.defaults, shorthand['defaults'], 'rules', errors)
    if data.get('users') is not None:
        for name, block, path in _named(data, 'users', errors):
            if block is None:
                block = {}
            if not isinstance(block, dict):
                errors.add(path, block, 'expected a mapping of limits')
                continue
            limits = errors.run(_limits, block, path, ('expires',))
            if limits is None:
                continue
            if block.get('expires') is not None:
                policy.user_expires[name] = errors.run(_expires, block['expires'], _join(path, 'expires'))
            if name == '*':
                _merge_into(policy.defaults, limits, path, errors)
            else:
                policy.users[name] = limits
    for name, limits in shorthand['users'].items():
        if name == '*':
            _merge_into(policy.defaults, limits, 'rules', errors)
        else:
            _merge_into(policy.users.setdefault(name, {}), limits, 'rules', errors)
    if data.get('groups') is not None:
        for name, block, path in _named(data, 'groups', errors, 'a group name'):
            group = errors.run(_group, name, block if block is not None else {}, path, lists)
            if group is not None:
                policy.groups.append(group)
    for name, limits in shorthand['groups'].items():
        group = policy.group(name)
        if group is None:
            group = Group(name, None, name, {}, {})
            policy.groups.append(group)
        _merge_into(group.limits, limits, 'rules', errors)
    if data.get('gpus') is not None:
        raw = data['gpus']
        if isinstance(raw, dict):
            raw = dict((str(k) if _is_number(k) and not isinstance(k, float) else k, v) for k, v in raw.items())
        raw = errors.run(_dict, raw, 'gpus') or {}
        for key, block in raw.items():
            path = _join('gpus', key)
            rule = errors.run(_gpu_rule, key, block if block is not None else {}, path, lists)
            if rule is not None:
                policy.gpus.append(rule)
    if data.get('time_windows') is not None:
        items = errors.run(_list, data['time_windows'], 'time_windows') or []
        for index, item in enumerate(items):
            window = errors.run(_time_window, item, 'time_windows[%d]' % index, lists)
            if window is not None:
                policy.time_windows.append(window)
    if data.get('exemptions') is not None:
        items = errors.run(_list, data['exemptions'], 'exemptions') or []
        for index, item in enumerate(items):
            exemption = errors.run(_exemption, item, 'exemptions[%d]' % index)
            if exemption is not None:
                policy.exemptions.append(exemption)
    for key, parse, extra in (('protect', _protect, (lists,)), ('escalation', _escalation, ()), ('rogue', _rogue, ()),
                              ('notify', _notify, ()), ('remediation', _remediation, ())):
        section = errors.run(parse, data.get(key), key, *extra)
        if section is not None:  # else the defaults stay
            setattr(policy, key, section)
    alloc = data.get('require_allocation')
    if alloc is not None:
        if isinstance(alloc, dict):
            errors.run(_only, alloc, 'require_allocation', ('enabled', 'allocations_file'))
            enabled = errors.run(_bool, alloc.get('enabled', True), 'require_allocation.enabled')
            if alloc.get('allocations_file') is not None:
                policy.allocations_file = errors.run(_abs_path, alloc['allocations_file'], 'require_allocation.allocations_file')
            if enabled is not None:
                policy.defaults.setdefault('require_allocation', enabled)
        else:
            enabled = errors.run(_bool, alloc, 'require_allocation')
            if enabled is not None:
                policy.defaults.setdefault('require_allocation', enabled)
    if data.get('allocations_file') is not None:
        policy.allocations_file = errors.run(_abs_path, data['allocations_file'], 'allocations_file')


def _named(data, key, errors, what='a user or group name'):
    """(name, value, path) of each entry of the mapping ``data[key]`` whose name is ``what`` (the others are errors)."""
    for name, value in (errors.run(_dict, data[key], key) or {}).items():
        path = _join(key, name)
        if errors.run(_name, name, path, what) is not None:
            yield name, value, path


def _merge_into(target, extra, path, errors):
    for key, value in extra.items():
        if key in target and target[key] != value and not (isinstance(value, (IdleRule, GpuSet))):
            errors.add(path, value, 'limit %s is given twice for the same users (%r and %r)' % (key, target[key], value))
            continue
        target[key] = value


# ---------------------------------------------------------------------------- shorthand rules
SHORTHAND_SCOPE = ('user', 'users', 'group', 'groups')
_FLAG_KEYS = {'--user': 'user', '--group': 'group', '--max-mem': 'max_mem', '--max-memory': 'max_mem',
              '--max-mem-total': 'max_mem_total', '--max-mem-per-gpu': 'max_mem_per_gpu', '--max-gpus': 'max_gpus',
              '--max-procs': 'max_procs', '--max-processes': 'max_procs', '--max-runtime': 'max_runtime',
              '--action': 'action'}


def _flags_entry(text, path):
    """``"--user alice --max-mem 8GB --action kill"`` -> the equivalent mapping."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise _Bad(path, text, 'cannot split this rule: %s' % exc)
    out = {}
    index = 0
    while index < len(words):
        word = words[index]
        flag, _eq, inline = word.partition('=')
        if flag not in _FLAG_KEYS:
            raise _Bad(path, text, 'unknown option %r; expected %s' % (flag, ', '.join(sorted(_FLAG_KEYS))))
        if _eq:
            value = inline
        else:
            index += 1
            if index >= len(words):
                raise _Bad(path, text, '%s needs a value' % flag)
            value = words[index]
        key = _FLAG_KEYS[flag]
        if key in out:
            raise _Bad(path, text, '%s is given twice' % flag)
        if key in ('max_gpus', 'max_procs'):
            if not re.match(r'^\d+$', value):
                raise _Bad(path, text, '%s needs a whole number' % flag)
            value = int(value)
        out[key] = value
        index += 1
    return out


def _shorthand(rules, errors):
    """``rules``: a list of shorthand entries -> {'defaults': {...}, 'users': {u: {...}}, 'groups': {g: {...}}}."""
    out = {'defaults': {}, 'users': {}, 'groups': {}}
    items = errors.run(_list, rules, 'rules') or []
    for index, entry in enumerate(items):
        path = 'rules[%d]' % index
        if isinstance(entry, str):
            entry = errors.run(_flags_entry, entry, path)
            if entry is None:
                continue
        if not isinstance(entry, dict):
            errors.add(path, entry, 'expected a mapping such as {user: "*", max_memory_gb: 12, action: kill}')
            continue
        scopes = [k for k in SHORTHAND_SCOPE if k in entry]
        if len(scopes) > 1:
            errors.add(path, entry, 'give one of user, users, group or groups')
            continue
        limits = errors.run(_limits, entry, path, SHORTHAND_SCOPE)
        if limits is None:
            continue
        if not limits:
            errors.add(path, entry, 'this rule sets no limit')
            continue
        targets = []
        if not scopes:
            targets = [('defaults', None)]
        else:
            value = entry[scopes[0]]
            names = value if isinstance(value, list) else [value]
            for name in names:
                checked = errors.run(_name, name, _join(path, scopes[0]))
                if checked is None:
                    continue
                if scopes[0].startswith('user'):
                    targets.append(('defaults', None) if checked in ('*', 'all') else ('users', checked))
                else:
                    targets.append(('groups', checked))
        for kind, name in targets:
            block = out['defaults'] if kind == 'defaults' else out[kind].setdefault(name, {})
            _merge_into(block, limits, path, errors)
    return out
