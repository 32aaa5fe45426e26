# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The schema of the policy's sections that say who may use what: limits (defaults, users, groups,
time windows), principals, groups, GPU rules, time windows, exemptions and protection, and the rule
ids a violation names."""

from __future__ import annotations

import math
import os
import re

from ..constants import DEFAULT_PROTECT_NAMES
from ..identity import name_trusted
from .validation import _Errors, _is_number, _join, _only
from .values import (
    ACTION_TERMINATE, WINDOW_KEYS, _abs_path, _action, _bool, _count, _dict, _duration, _expires, _gpu_set, _list, _name,
    _pct, _regex, _section, _size, _text, _window)


# Rule ids (the ``rule`` of a Violation; names for exemptions' ``rules``).
USER_RULES = ('max_mem_per_gpu', 'max_mem_total', 'max_gpus', 'max_procs', 'max_procs_per_gpu', 'max_runtime', 'idle',
              'gpu_access', 'require_allocation')
GROUP_RULES = ('group_max_mem_total', 'group_max_gpus', 'group_max_procs')
GPU_RULES = ('gpu_reserved', 'gpu_blocked_user', 'gpu_max_mem_total', 'maintenance')
QUOTA_RULES = USER_RULES + GROUP_RULES + GPU_RULES
RULES = QUOTA_RULES + ('rogue',)
RULE_GROUPS = {
    'memory': ('max_mem_per_gpu', 'max_mem_total', 'group_max_mem_total', 'gpu_max_mem_total'),
    'gpus': ('max_gpus', 'group_max_gpus', 'gpu_access', 'gpu_reserved', 'gpu_blocked_user'),
    'procs': ('max_procs', 'max_procs_per_gpu', 'group_max_procs'),
    'runtime': ('max_runtime',),
    'quota': QUOTA_RULES,
    'all': QUOTA_RULES,
}
# Rules whose violations concern one process each (the escalation clock is per process).
PER_PROCESS_RULES = ('max_runtime', 'idle', 'gpu_access', 'require_allocation', 'rogue')
_SHA256 = re.compile(r'^[0-9a-fA-F]{64}$')


# ============================================================================ limits
# user-facing key -> (canonical key, converter kind, unit)
LIMIT_ALIASES = {
    'max_mem_gib_per_gpu': ('max_mem_mib_per_gpu', 'size', 'gib'),
    'max_mem_per_gpu': ('max_mem_mib_per_gpu', 'size', 'gib'),
    'max_mem_mib_per_gpu': ('max_mem_mib_per_gpu', 'size', 'mib'),
    'max_mem_gib_total': ('max_mem_mib_total', 'size', 'gib'),
    'max_mem_total': ('max_mem_mib_total', 'size', 'gib'),
    'max_mem_mib_total': ('max_mem_mib_total', 'size', 'mib'),
    'max_mem': ('max_mem_mib_total', 'size', 'gib'),
    'max_memory': ('max_mem_mib_total', 'size', 'gib'),
    'max_memory_gb': ('max_mem_mib_total', 'size', 'gib'),
    'max_memory_gib': ('max_mem_mib_total', 'size', 'gib'),
    'max_gpus': ('max_gpus', 'count', None),
    'max_procs': ('max_procs', 'count', None),
    'max_processes': ('max_procs', 'count', None),
    'max_concurrent_processes': ('max_procs', 'count', None),
    'max_procs_per_gpu': ('max_procs_per_gpu', 'count', None),
    'max_runtime': ('max_runtime_s', 'duration', None),
    'max_runtime_h': ('max_runtime_s', 'duration', 3600.0),
    'max_runtime_hours': ('max_runtime_s', 'duration', 3600.0),
    'idle': ('idle', 'idle', None),
    'require_allocation': ('require_allocation', 'bool', None),
    'allowed_gpus': ('allowed_gpus', 'gpus', None),
    'blocked_gpus': ('blocked_gpus', 'gpus', None),
    'action': ('action', 'action', None),
}
LIMIT_HINTS = {
    'max_mem_gib': 'ambiguous: write max_mem_gib_per_gpu (each GPU) or max_mem_gib_total (all GPUs together)',
    'memory_limit_gb': 'a gpu-kill key: it belongs in a gpu-kill configuration (user_policies); here write max_mem_gib_total',
    'max_util_pct': 'utilization is not limited: busy GPUs are what they are for; see idle for the opposite',
}
IDLE_KEYS = {
    'util_max_pct': ('util_max_pct', 'pct'), 'util_below_pct': ('util_max_pct', 'pct'), 'util_pct': ('util_max_pct', 'pct'),
    'mem_min_gib': ('mem_min_mib', 'size'), 'mem_above_gib': ('mem_min_mib', 'size'), 'holding_gib': ('mem_min_mib', 'size'),
    'mem_min': ('mem_min_mib', 'size'),
    'for': ('for_s', 'duration'), 'duration': ('for_s', 'duration'), 'for_min': ('for_s', 'minutes'),
}


class IdleRule(object):
    """util <= util_max_pct while holding >= mem_min_mib for for_s seconds (any activity resets the clock)."""

    def __init__(self, util_max_pct=1.0, mem_min_mib=1024.0, for_s=3600.0):
        self.util_max_pct = util_max_pct
        self.mem_min_mib = mem_min_mib
        self.for_s = for_s


def _idle(value, path):
    if value is False or value is None:
        return False
    _dict(value, path)
    errors = _Errors()
    out = {}
    for key, item in value.items():
        sub = _join(path, key)
        if key not in IDLE_KEYS:
            errors.add(sub, item, 'unknown key; expected util_max_pct, mem_min_gib and for (as in 30m)')
            continue
        name, kind = IDLE_KEYS[key]
        if name in out:
            errors.add(sub, item, 'given twice (under another name)')
            continue
        if kind == 'pct':
            out[name] = errors.run(_pct, item, sub)
        elif kind == 'size':
            out[name] = errors.run(_size, item, sub)
        elif kind == 'minutes':
            out[name] = errors.run(_duration, item, sub, 60.0)
        else:
            out[name] = errors.run(_duration, item, sub)
    if 'for_s' not in out:
        errors.add(path, value, 'an idle rule needs "for" (how long, as in 30m)')
    errors.check()
    return IdleRule(out.get('util_max_pct', 1.0), out.get('mem_min_mib', 1024.0), out['for_s'])


def _limits(value, path, extra=()):
    """Parse a block of limits -> dict of canonical keys (only those given).  Every key is checked."""
    _dict(value, path)
    errors = _Errors()
    out = {}
    for key, item in value.items():
        if key in extra:
            continue
        sub = _join(path, key)
        if key not in LIMIT_ALIASES:
            why = LIMIT_HINTS.get(key, 'unknown key; expected one of %s' % ', '.join(sorted(set(LIMIT_ALIASES) | set(extra))))
            errors.add(sub, item, why)
            continue
        name, kind, unit = LIMIT_ALIASES[key]
        if name in out:
            errors.add(sub, item, 'this limit is given twice (under another name)')
            continue
        if item is None and kind not in ('idle',):
            out[name] = None  # explicitly "no limit" (overrides an inherited one)
            continue
        if kind == 'size':
            out[name] = errors.run(_size, item, sub, unit)
        elif kind == 'count':
            out[name] = errors.run(_count, item, sub)
        elif kind == 'duration':
            out[name] = errors.run(_duration, item, sub, unit)
        elif kind == 'idle':
            out[name] = errors.run(_idle, item, sub)
        elif kind == 'bool':
            out[name] = errors.run(_bool, item, sub)
        elif kind == 'gpus':
            out[name] = errors.run(_gpu_set, item, sub)
        elif kind == 'action':
            out[name] = errors.run(_action, item, sub)
    errors.check()
    return out


class Limits(object):
    """The limits that apply to one user at one moment (None = no limit)."""

    FIELDS = ('max_mem_mib_per_gpu', 'max_mem_mib_total', 'max_gpus', 'max_procs', 'max_procs_per_gpu', 'max_runtime_s',
              'idle', 'require_allocation', 'allowed_gpus', 'blocked_gpus', 'action')

    def __init__(self, values=None):
        values = values or {}
        for name in self.FIELDS:
            setattr(self, name, values.get(name))
        if self.action is None:
            self.action = ACTION_TERMINATE
        if self.idle is False:
            self.idle = None


# ============================================================================ policy parts
class Principals(object):
    """Users, ``group:NAME`` (policy group or Unix group) and ``@LIST`` (a named list) references."""

    def __init__(self, users=(), groups=(), lists=()):
        self.users = frozenset(users)
        self.groups = tuple(groups)
        self.lists = tuple(lists)

    def __bool__(self):
        return bool(self.users or self.groups or self.lists)

    def contains(self, user, policy, context):
        if user is None:
            return False
        if user in self.users or '*' in self.users:
            return True
        for name in self.lists:
            if user in policy.lists.get(name, ()):
                return True
        for name in self.groups:
            if policy.in_group(user, name, context):
                return True
        return False

    def describe(self):
        return sorted(self.users) + ['group:%s' % g for g in self.groups] + ['@%s' % n for n in self.lists]


def _principals(value, path, lists=None):
    errors = _Errors()
    if isinstance(value, dict):
        errors.run(_only, value, path, ('users', 'groups', 'lists'))
        found = []
        for key, what in (('users', 'a user or group name'), ('groups', 'a user or group name'), ('lists', 'a user or group name')):
            sub = _join(path, key)
            found.append([errors.run(_name, item, sub, what) for item in errors.run(_list, value.get(key), sub) or []])
        errors.check()
        return Principals(*found)
    items = [value] if isinstance(value, str) else _list(value, path)
    users, groups, named = [], [], []
    for item in items:
        if not isinstance(item, str):
            errors.run(_name, item, path)
            continue
        text = item.strip()
        if text.startswith('group:') or text.startswith('%'):
            groups.append(errors.run(_name, text.split(':', 1)[1] if text.startswith('group:') else text[1:], path, 'a group name'))
        elif text.startswith('@'):
            name = errors.run(_name, text[1:], path, 'a list name')
            if name is not None and lists is not None and name not in lists:
                errors.add(path, '@' + name, 'no such list in lists')
            named.append(name)
        elif text.startswith('user:'):
            users.append(errors.run(_name, text[5:], path))
        else:
            users.append(errors.run(_name, text, path))
    errors.check()
    return Principals(users, groups, named)


class Group(object):
    """A policy group: ``members`` (a named list) or a Unix group; limits for each member and for the group."""

    def __init__(self, name, members=None, unix_group=None, limits=None, aggregate=None, expires=None, action=None):
        self.name = name
        self.members = members            # frozenset of users, or None for a Unix group
        self.unix_group = unix_group
        self.limits = limits or {}
        self.aggregate = aggregate or {}  # group_max_mem_mib_total, group_max_gpus, group_max_procs
        self.expires = expires
        self.action = action


GROUP_EXTRA = ('members', 'unix_group', 'group_max_mem_gib_total', 'group_max_mem_total', 'group_max_gpus',
               'group_max_procs', 'description', 'expires')


def _group(name, value, path, lists):
    _dict(value, path)
    errors = _Errors()
    members = None
    unix_group = None
    if 'members' in value and 'unix_group' in value:
        errors.add(path, value, 'give members (a named list) or unix_group, not both')
    if 'members' in value:
        members = set()
        for item in errors.run(_list, value['members'], _join(path, 'members')) or []:
            text = errors.run(_name, item, _join(path, 'members'))
            if text is None:
                continue
            if text.startswith('@'):
                if text[1:] not in lists:
                    errors.add(_join(path, 'members'), text, 'no such list in lists')
                    continue
                members.update(lists[text[1:]])
            else:
                members.add(text)
        members = frozenset(members)
    else:
        unix_group = errors.run(_name, value.get('unix_group', name), _join(path, 'unix_group'), 'a Unix group name')
    limits = errors.run(_limits, value, path, GROUP_EXTRA) or {}
    aggregate = {}
    for key, canonical, kind in (('group_max_mem_gib_total', 'group_max_mem_mib_total', 'size'),
                                 ('group_max_mem_total', 'group_max_mem_mib_total', 'size'),
                                 ('group_max_gpus', 'group_max_gpus', 'count'),
                                 ('group_max_procs', 'group_max_procs', 'count')):
        if key in value:
            if canonical in aggregate:
                errors.add(_join(path, key), value[key], 'given twice (under another name)')
                continue
            sub = _join(path, key)
            aggregate[canonical] = errors.run(_size, value[key], sub) if kind == 'size' else errors.run(_count, value[key], sub)
    if 'description' in value and not isinstance(value['description'], str):
        errors.add(_join(path, 'description'), value['description'], 'expected text')
    expires = errors.run(_expires, value['expires'], _join(path, 'expires')) if value.get('expires') is not None else None
    errors.check()
    return Group(name, members, unix_group, limits, aggregate, expires, limits.get('action'))


class GpuRule(object):
    def __init__(self, key, gpus, reserved_for=None, blocked_users=None, maintenance=(), max_mem_mib_total=None,
                 action=None, message=''):
        self.key = key
        self.gpus = gpus
        self.reserved_for = reserved_for
        self.blocked_users = blocked_users
        self.maintenance = list(maintenance)
        self.max_mem_mib_total = max_mem_mib_total
        self.action = action
        self.message = message


GPU_KEYS = ('reserved_for', 'allowed_users', 'blocked_users', 'maintenance', 'maintenance_window', 'max_mem_gib_total',
            'max_mem_total', 'action', 'message', 'description')


def _gpu_rule(key, value, path, lists):
    errors = _Errors()
    gpus = errors.run(_gpu_set, key, path)
    _dict(value, path)
    errors.run(_only, value, path, GPU_KEYS, {'max_memory_gb': 'a gpu-kill key: write max_mem_gib_total here'})
    if 'reserved_for' in value and 'allowed_users' in value:
        errors.add(path, value, 'give reserved_for or allowed_users (the same thing), not both')
    reserved = None
    for name in ('reserved_for', 'allowed_users'):
        if value.get(name):
            reserved = errors.run(_principals, value[name], _join(path, name), lists)
    blocked = errors.run(_principals, value['blocked_users'], _join(path, 'blocked_users'), lists) if value.get('blocked_users') else None
    windows = []
    for name in ('maintenance', 'maintenance_window'):
        if value.get(name) is None:
            continue
        items = value[name] if isinstance(value[name], list) else [value[name]]
        for index, item in enumerate(items):
            windows.append(errors.run(_window, item, '%s[%d]' % (_join(path, name), index) if isinstance(value[name], list)
                                      else _join(path, name)))
    limit = None
    for name in ('max_mem_gib_total', 'max_mem_total'):
        if name in value:
            if limit is not None:
                errors.add(_join(path, name), value[name], 'given twice (under another name)')
                continue
            limit = errors.run(_size, value[name], _join(path, name))
    action = errors.run(_action, value['action'], _join(path, 'action')) if 'action' in value else None
    message = value.get('message') or ''
    if not isinstance(message, str):
        errors.add(_join(path, 'message'), message, 'expected text')
    errors.check()
    return GpuRule(key, gpus, reserved, blocked, windows, limit, action, message)


class TimeWindow(object):
    def __init__(self, name, window, applies_to=None, limits=None, multipliers=None):
        self.name = name
        self.window = window
        self.applies_to = applies_to      # Principals or None (everyone)
        self.limits = limits or {}
        self.multipliers = multipliers or {}


TIME_WINDOW_KEYS = ('name', 'days', 'start', 'end', 'tz', 'timezone', 'applies_to', 'users', 'limits', 'override',
                    'overrides', 'multipliers', 'description')
MULTIPLIER_KEYS = ('mem', 'runtime', 'procs', 'gpus')


def _time_window(value, path, lists):
    errors = _section(value, path, TIME_WINDOW_KEYS)
    window = errors.run(_window, dict((k, v) for k, v in value.items() if k in WINDOW_KEYS), path)
    applies = None
    if 'applies_to' in value and 'users' in value:
        errors.add(path, value, 'give applies_to or users, not both')
    for name in ('applies_to', 'users'):
        if value.get(name) is not None:
            applies = errors.run(_principals, value[name], _join(path, name), lists)
    given = [k for k in ('limits', 'override', 'overrides') if k in value]
    if len(given) > 1:
        errors.add(path, value, 'give limits once (override and overrides are other names for it)')
    limits = errors.run(_limits, value[given[0]], _join(path, given[0])) if given else {}
    multipliers = {}
    if value.get('multipliers') is not None:
        sub = _join(path, 'multipliers')
        if errors.run(_dict, value['multipliers'], sub) is not None:
            errors.run(_only, value['multipliers'], sub, MULTIPLIER_KEYS)
            for key, item in value['multipliers'].items():
                if not _is_number(item) or math.isnan(item) or item < 0 or item == float('inf'):
                    errors.add(_join(sub, key), item, 'expected a number, 0 or more')
                elif key in MULTIPLIER_KEYS:
                    multipliers[key] = float(item)
    if limits == {} and not multipliers and not value.get('multipliers'):
        errors.add(path, value, 'a time window changes limits: give limits (or multipliers)')
    name = value.get('name') or (window.describe() if window is not None else '')
    if not isinstance(name, str):
        errors.add(_join(path, 'name'), name, 'expected text')
    errors.check()
    return TimeWindow(name, window, applies, limits, multipliers)


class Exemption(object):
    """An identity-based exemption from some rules until ``expires`` (epoch seconds)."""

    def __init__(self, match, rules, expires, reason=''):
        self.match = match
        self.rules = frozenset(rules)
        self.expires = expires
        self.reason = reason

    def expired(self, now):
        return now >= self.expires

    def applies(self, proc, rule, context):
        if rule not in self.rules:
            return False
        match = self.match
        if 'user' in match and proc.user != match['user']:
            return False
        if 'cmdline' in match:
            text = ' '.join(proc.cmdline or ())[:32768]
            if not proc.cmdline or not match['cmdline'].search(text):
                return False
        if 'exe' in match and (proc.exe or '').replace(' (deleted)', '') != match['exe']:
            return False
        if 'container' in match:
            cid = proc.container.id if proc.container is not None else None
            if not cid or not (cid == match['container'] or (len(match['container']) >= 12 and cid.startswith(match['container']))):
                return False
        if 'pod' in match:
            pod = proc.container.pod_uid if proc.container is not None else None
            if pod != match['pod']:
                return False
        if 'slurm_job' in match and str(proc.slurm_job) != match['slurm_job']:
            return False
        if 'exe_sha256' in match:
            digest = context.exe_sha256(proc)
            if digest is None or digest.lower() != match['exe_sha256']:
                return False
        return True


EXEMPTION_MATCH_KEYS = ('user', 'cmdline', 'exe', 'exe_sha256', 'container', 'pod', 'slurm_job')


def _exemption(value, path):
    _dict(value, path)
    errors = _Errors()
    allowed = ('match', 'rules', 'expires', 'reason', 'comment') + EXEMPTION_MATCH_KEYS
    errors.run(_only, value, path, allowed)
    mpath = path
    raw = dict((k, v) for k, v in value.items() if k in EXEMPTION_MATCH_KEYS)
    if 'match' in value:
        mpath = _join(path, 'match')
        if raw:
            errors.add(path, value, 'put the identity either under match or beside it, not both')
        raw = errors.run(_dict, value['match'], mpath) or {}
        errors.run(_only, raw, mpath, EXEMPTION_MATCH_KEYS)
    match = {}
    for key, item in raw.items():
        sub = _join(mpath, key)
        if key == 'cmdline':
            match[key] = errors.run(_regex, item, sub)
        elif key == 'exe_sha256':
            match[key] = (errors.run(_text, item, sub, _SHA256, 'a SHA-256 hex digest (64 hex digits)') or '').lower()
        elif key == 'user':
            match[key] = errors.run(_name, item, sub)
        elif key == 'exe':
            match[key] = errors.run(_abs_path, item, sub)
        elif key in EXEMPTION_MATCH_KEYS:
            if _is_number(item) and not isinstance(item, float):
                item = str(item)
            match[key] = errors.run(_text, item, sub, None, 'an identifier')
    identity = ('exe_sha256' in match or 'container' in match or 'pod' in match or 'slurm_job' in match
                or ('user' in match and 'cmdline' in match))
    if not identity:
        errors.add(mpath, raw, 'an exemption needs an identity: exe_sha256, container, pod, slurm_job, or user together '
                               'with cmdline (a name or a user alone is not an identity)')
    expires = None
    if value.get('expires') is None:
        errors.add(_join(path, 'expires'), value.get('expires'), 'every exemption needs an expiry date (expires: YYYY-MM-DD)')
    else:
        expires = errors.run(_expires, value['expires'], _join(path, 'expires'))
    rules = set()
    names = value.get('rules', ['quota'])
    for name in ([names] if isinstance(names, str) else errors.run(_list, names, _join(path, 'rules')) or []):
        if name in RULE_GROUPS:
            rules.update(RULE_GROUPS[name])
        elif name in RULES:
            rules.add(name)
        else:
            errors.add(_join(path, 'rules'), name, 'unknown rule; expected rule ids (%s) or %s' % (
                ', '.join(RULES), ', '.join(sorted(RULE_GROUPS))))
    reason = value.get('reason') or value.get('comment') or ''
    if not isinstance(reason, str):
        errors.add(_join(path, 'reason'), reason, 'expected text')
    errors.check()
    return Exemption(match, rules, expires, reason)


class Protect(object):
    """Processes quota rules never touch (the rogue rule still applies to them).

    ``users``, ``groups``, ``lists`` and ``uid_below`` go by the real uid the kernel reports.  A
    ``name`` (comm, argv[0], the executable's basename, plus constants.DEFAULT_PROTECT_NAMES) or an
    ``exe`` path protects only a process whose owner could not have chosen it
    (identity.Identity.name_trusted: a system account runs it, from a root-owned executable outside
    directories users may write): an ordinary user's hog named ``sshd`` is charged like any other.
    """

    def __init__(self, users=(), groups=(), lists=(), uid_below=None, names=(), exe=()):
        self.users = frozenset(users)
        self.groups = tuple(groups)
        self.lists = tuple(lists)
        self.uid_below = uid_below
        self.names = frozenset(names) | frozenset(DEFAULT_PROTECT_NAMES)
        self.exe = frozenset(exe)

    def reason(self, proc, policy, context):
        if proc.user is not None and proc.user in self.users:
            return 'protected user %s' % proc.user
        if self.uid_below is not None and proc.uid is not None and proc.uid < self.uid_below:
            return 'protected: uid %d is below %d' % (proc.uid, self.uid_below)
        names = set()
        if proc.name:
            names.add(proc.name)
        if proc.cmdline:
            names.add(os.path.basename(proc.cmdline[0]))
        if proc.exe:
            names.add(os.path.basename(proc.exe.replace(' (deleted)', '')))
        trusted = name_trusted(getattr(proc, 'identity', None))
        hit = sorted(names & self.names)
        if hit and trusted:
            return 'protected name %s' % hit[0]
        if trusted and proc.exe and proc.exe.replace(' (deleted)', '') in self.exe:
            return 'protected executable %s' % proc.exe
        for name in self.lists:
            if proc.user in policy.lists.get(name, ()):
                return 'protected list @%s' % name
        for name in self.groups:
            if policy.in_group(proc.user, name, context):
                return 'protected group %s' % name
        return None


PROTECT_KEYS = ('users', 'groups', 'lists', 'uid_below', 'names', 'exe')


def _protect(value, path, lists):
    if value is None:
        return Protect()
    errors = _Errors()
    entries = []
    if isinstance(value, dict):
        errors.run(_only, value, path, PROTECT_KEYS)
        entries = [(k, v, _join(path, k)) for k, v in value.items() if k in PROTECT_KEYS]
    else:
        for index, item in enumerate(_list(value, path)):
            sub = '%s[%d]' % (path, index)
            if errors.run(_dict, item, sub) is None:
                continue
            if len(item) != 1:
                errors.add(sub, item, 'each protect entry has one key: user, group, list, name, exe or uid_below')
                continue
            key, val = list(item.items())[0]
            plural = {'user': 'users', 'group': 'groups', 'list': 'lists', 'name': 'names', 'exe': 'exe',
                      'uid_below': 'uid_below'}
            if key not in plural:
                errors.add(_join(sub, key), val, 'expected one of user, group, list, name, exe or uid_below')
                continue
            entries.append((plural[key], val if key == 'uid_below' or isinstance(val, list) else [val], _join(sub, key)))
    users, groups, named, names, exe, uid_below = [], [], [], [], [], None
    for key, val, sub in entries:
        if key == 'uid_below':
            uid_below = errors.run(_count, val, sub)
            continue
        for item in errors.run(_list, val, sub) or []:
            if key == 'users':
                users.append(errors.run(_name, item, sub))
            elif key == 'groups':
                groups.append(errors.run(_name, item, sub, 'a group name'))
            elif key == 'lists':
                text = (errors.run(_name, item, sub, 'a list name') or '').lstrip('@')
                if text and text not in lists:
                    errors.add(sub, item, 'no such list in lists')
                named.append(text)
            elif key == 'names':
                names.append(errors.run(_text, item, sub, None, 'a process name'))
            elif key == 'exe':
                exe.append(errors.run(_abs_path, item, sub))
    errors.check()
    return Protect(users, groups, named, uid_below, names, exe)
