# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The gpu-kill translator: a gpu-kill guard configuration (guard_mode_config.toml, or its JSON/YAML
form) becomes a document of this schema, which schema.parse_policy then validates."""

from __future__ import annotations

import math
import re

from .sections import _limits
from .validation import _Bad, _is_number, _join, _only
from .values import MODE_DRY_RUN, MODE_ENFORCE, MODE_WARN, _bool, _count, _dict, _section, _window


GPUKILL_KEYS = ('global', 'user_policies', 'group_policies', 'gpu_policies', 'time_policies', 'enforcement')


def from_gpukill(data, errors, notes):
    """Translate a gpu-kill guard configuration (guard_mode_config.toml, or its JSON/YAML form) into
    this schema.  Every field gpu-kill documents is accepted; the ones that have no meaning here are
    listed in ``notes``."""
    out = {'defaults': {}, 'users': {}, 'groups': {}, 'gpus': {}, 'time_windows': []}

    def note(text):
        if text not in notes:
            notes.append(text)

    def number(value, path, what='a number, 0 or more'):
        if not _is_number(value) or math.isnan(value) or value < 0:
            raise _Bad(path, value, 'expected %s' % what)
        return value

    def section(name):
        value = data.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            errors.add(name, value, 'expected a table (mapping)')
            return {}
        return value

    glob = section('global')
    enforcement = section('enforcement')
    errors.run(_only, glob, 'global', ('enabled', 'default_memory_limit_gb', 'default_utilization_limit_pct',
                                       'default_duration_limit_hours', 'check_interval_seconds', 'dry_run'))
    errors.run(_only, enforcement, 'enforcement', ('soft_enforcement', 'hard_enforcement', 'grace_period_seconds', 'max_warnings',
                                                   'notifications'))
    if 'enabled' in glob:
        out['enabled'] = errors.run(_bool, glob['enabled'], 'global.enabled')
    dry_run = errors.run(_bool, glob.get('dry_run', True), 'global.dry_run')
    hard = errors.run(_bool, enforcement.get('hard_enforcement', False), 'enforcement.hard_enforcement')
    soft = errors.run(_bool, enforcement.get('soft_enforcement', True), 'enforcement.soft_enforcement')
    out['mode'] = MODE_DRY_RUN if dry_run is not False else (MODE_ENFORCE if hard else MODE_WARN)
    if dry_run is False and not hard and soft is False:
        note('enforcement: soft and hard enforcement are both off: violations are only logged (mode warn sends warnings)')
    if glob:
        # gpu-kill gives users without a policy the global defaults and a cap of 5 processes
        if glob.get('default_memory_limit_gb') is not None:
            out['defaults']['max_mem_gib_total'] = errors.run(number, glob['default_memory_limit_gb'], 'global.default_memory_limit_gb')
        if glob.get('default_duration_limit_hours') is not None:
            out['defaults']['max_runtime_h'] = errors.run(number, glob['default_duration_limit_hours'], 'global.default_duration_limit_hours')
        out['defaults']['max_procs'] = 5
        if 'default_utilization_limit_pct' in glob:
            note('global.default_utilization_limit_pct is accepted but not enforced (gpu-kill computed it from memory, '
                 'which the memory limit covers)')
    if glob.get('check_interval_seconds') is not None:
        seconds = errors.run(number, glob['check_interval_seconds'], 'global.check_interval_seconds')
        if seconds:
            out['interval'] = '%ss' % seconds
    if 'grace_period_seconds' in enforcement or 'max_warnings' in enforcement:
        grace = errors.run(number, enforcement.get('grace_period_seconds', 300), 'enforcement.grace_period_seconds')
        warnings = errors.run(_count, enforcement.get('max_warnings', 3), 'enforcement.max_warnings')
        if grace is not None and warnings is not None:
            out['escalation'] = {'act_after': '%ss' % grace, 'warnings': min(warnings, 100)}
    notif = enforcement.get('notifications')
    if notif is not None:
        if errors.run(_dict, notif, 'enforcement.notifications') is None:
            notif = {}
        errors.run(_only, notif, 'enforcement.notifications', ('console', 'log_file', 'email', 'email_recipients', 'webhook', 'webhook_url'))
        hook = {}
        if notif.get('webhook') and notif.get('webhook_url'):
            hook = {'webhook': {'url': notif['webhook_url']}}
        out['notify'] = dict(hook, tty=errors.run(_bool, notif.get('console', True), 'enforcement.notifications.console') is not False)
        if notif.get('email'):
            note('enforcement.notifications.email is not supported: use the webhook or the command hook')
        if notif.get('log_file') is False:
            note('enforcement.notifications.log_file=false is ignored: every decision is always logged')

    def entries(name, keys, name_field):
        """The valid (key, table, path) of a gpu-kill section; the others become errors."""
        for key, block in section(name).items():
            path = _join(name, key)
            if not isinstance(block, dict):
                errors.add(path, block, 'expected a table (mapping)')
                continue
            errors.run(_only, block, path, keys + (name_field,))  # the other fields are checked as well
            if block.get(name_field) is not None and str(block[name_field]) != str(key):
                errors.add(_join(path, name_field), block[name_field], 'the %s must be the table name (%s)' % (name_field, key))
                continue
            yield key, block, path

    def copy_fields(block, path, fields, target):
        """gpu-kill field -> our key; numbers are checked here so that errors name the gpu-kill path."""
        for field, ours, is_number in fields:
            value = block.get(field)
            if value is None or (not is_number and value == []):
                continue
            target[ours] = errors.run(number, value, _join(path, field)) if is_number else value
        return target

    def ignored(block, fields, section_name):
        for field, why in fields:
            if field in block:
                note('%s.*.%s is accepted but %s' % (section_name, field, why))

    for name, block, path in entries('user_policies', ('memory_limit_gb', 'utilization_limit_pct', 'duration_limit_hours',
                                                       'max_concurrent_processes', 'priority', 'allowed_gpus', 'blocked_gpus',
                                                       'time_overrides'), 'username'):
        out['users'][name] = copy_fields(block, path, (('memory_limit_gb', 'max_mem_gib_total', True),
                                                       ('duration_limit_hours', 'max_runtime_h', True),
                                                       ('max_concurrent_processes', 'max_procs', False),
                                                       ('allowed_gpus', 'allowed_gpus', False),
                                                       ('blocked_gpus', 'blocked_gpus', False)), {})
        ignored(block, (('utilization_limit_pct', 'not enforced'), ('priority', 'has no effect')), 'user_policies')
        for index, item in enumerate(block.get('time_overrides') or []):
            sub = '%s[%d]' % (_join(path, 'time_overrides'), index)
            window = errors.run(_gk_window, item, sub, ('start_time', 'end_time', 'days_of_week', 'overrides'))
            if window is None:
                continue
            over = item.get('overrides') or {}
            if not isinstance(over, dict):
                errors.add(_join(sub, 'overrides'), over, 'expected a table (mapping)')
                continue
            window['users'] = [name]
            window['limits'] = errors.run(_gk_limits, over, _join(sub, 'overrides')) or {}
            if window['limits']:
                out['time_windows'].append(window)
    for name, block, path in entries('group_policies', ('total_memory_limit_gb', 'total_utilization_limit_pct',
                                                        'max_concurrent_processes', 'priority', 'allowed_gpus', 'blocked_gpus',
                                                        'members'), 'group_name'):
        out['groups'][name] = copy_fields(block, path, (('total_memory_limit_gb', 'group_max_mem_gib_total', True),
                                                        ('max_concurrent_processes', 'group_max_procs', False),
                                                        ('allowed_gpus', 'allowed_gpus', False),
                                                        ('blocked_gpus', 'blocked_gpus', False)),
                                          {'members': block.get('members') or []})
        ignored(block, (('total_utilization_limit_pct', 'not enforced'), ('priority', 'has no effect')), 'group_policies')
    for key, block, path in entries('gpu_policies', ('max_memory_gb', 'max_utilization_pct', 'reserved_memory_gb',
                                                     'allowed_users', 'blocked_users', 'maintenance_window'), 'gpu_index'):
        if not re.match(r'^\d+$', str(key)):
            errors.add(path, key, 'gpu-kill GPU policies are keyed by the GPU index')
            continue
        gpu = copy_fields(block, path, (('allowed_users', 'reserved_for', False), ('blocked_users', 'blocked_users', False)), {})
        if block.get('max_memory_gb') is not None:
            limit = errors.run(number, block['max_memory_gb'], _join(path, 'max_memory_gb'))
            reserved = errors.run(number, block.get('reserved_memory_gb') or 0, _join(path, 'reserved_memory_gb'))
            if limit is not None and reserved is not None:
                gpu['max_mem_gib_total'] = max(0.0, limit - reserved)
        if block.get('maintenance_window') is not None:
            window = errors.run(_gk_window, block['maintenance_window'], _join(path, 'maintenance_window'),
                                ('start_time', 'end_time', 'days_of_week', 'message'))
            if window is not None:
                gpu['maintenance'] = [window]
        ignored(block, (('max_utilization_pct', 'not enforced'),), 'gpu_policies')
        out['gpus'][str(key)] = gpu
    policies = data.get('time_policies')
    if policies is not None:
        if not isinstance(policies, list):
            errors.add('time_policies', policies, 'expected an array of tables')
            policies = []
        for index, item in enumerate(policies):
            sub = 'time_policies[%d]' % index
            keys = ('name', 'start_time', 'end_time', 'days_of_week', 'memory_multiplier', 'utilization_multiplier',
                    'duration_multiplier', 'memory_limit_gb', 'utilization_limit_pct', 'duration_limit_hours',
                    'max_concurrent_processes')
            window = errors.run(_gk_window, item, sub, keys)
            if window is None:
                continue
            if item.get('name') is not None:
                window['name'] = item['name']
            multipliers = {}
            if item.get('memory_multiplier') is not None:
                multipliers['mem'] = item['memory_multiplier']
            if item.get('duration_multiplier') is not None:
                multipliers['runtime'] = item['duration_multiplier']
            if item.get('utilization_multiplier') is not None or item.get('utilization_limit_pct') is not None:
                note('time_policies: utilization settings are accepted but not enforced')
            limits = errors.run(_gk_limits, item, sub) or {}
            if multipliers:
                window['multipliers'] = multipliers
            if limits:
                window['limits'] = limits
            if multipliers or limits:
                out['time_windows'].append(window)
    if not out['time_windows']:
        out.pop('time_windows')
    return out


def _gk_window(item, path, keys):
    errors = _section(item, path, keys)
    if 'start_time' not in item or 'end_time' not in item:
        errors.add(path, item, 'a gpu-kill window needs start_time and end_time ("HH:MM", UTC)')
    errors.check()
    days = item.get('days_of_week')
    window = {'start': item['start_time'], 'end': item['end_time'], 'tz': 'UTC'}
    if days:
        window['days'] = days
    if item.get('message'):
        window['name'] = item['message']
    # validate now, so that errors name the gpu-kill path
    _window(dict(window), path)
    return window


def _gk_limits(item, path):
    limits = {}
    if item.get('memory_limit_gb') is not None:
        limits['max_mem_gib_total'] = item['memory_limit_gb']
    if item.get('duration_limit_hours') is not None:
        limits['max_runtime_h'] = item['duration_limit_hours']
    if item.get('max_concurrent_processes') is not None:
        limits['max_procs'] = item['max_concurrent_processes']
    _limits(limits, path)
    return limits
