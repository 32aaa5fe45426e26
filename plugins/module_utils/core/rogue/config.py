# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The effective rule set of the rogue detector: built-in rules, lists, custom rules, the allowlist.

``RogueConfig`` starts from the built-ins (rules.py); loader.load_config adds what a rules file or
inline rules give: ``CustomRule`` (a rule made of regular expressions, ports and networks) and
``AllowEntry`` (an allowlist entry).
"""

from __future__ import annotations

from ..textmatch import MAX_MATCH_TEXT
from . import rules as R
from .checks import BUILTIN_CHECKS
from .facts import ACTIVE_STATES, _evidence


# ---------------------------------------------------------------------------- custom rules
class CustomRule(object):
    """A rule from the rules file: every given matcher must match."""

    MATCHERS = ('cmdline', 'argv0', 'name', 'exe', 'user', 'env', 'maps', 'parent', 'image', 'remote_port', 'remote_addr')

    def __init__(self, rule_id, kind, weight, description, match, source=None):
        self.id = rule_id
        self.kind = kind
        self.weight = weight
        self.description = description
        self.match = match      # matcher -> compiled regex, set of ports, or list of networks
        self.source = source

    def check(self, ctx):
        facts = ctx.facts
        evidence = []
        for key, matcher in self.match.items():
            hit = self._one(key, matcher, ctx, facts)
            if hit is None:
                return []
            evidence.append(hit)
        return evidence

    @staticmethod
    def _search(regex, values, source):
        for value in values:
            if value and regex.search(value[:MAX_MATCH_TEXT]):
                return _evidence(source, value, 'matches %s' % regex.pattern)
        return None

    def _one(self, key, matcher, ctx, facts):
        if key == 'cmdline':
            return self._search(matcher, [' '.join(ctx.args)], 'cmdline')
        if key == 'argv0':
            return self._search(matcher, [ctx.argv0()], 'argv[0]')
        if key == 'name':
            return self._search(matcher, [facts.name], 'name')
        if key == 'exe':
            return self._search(matcher, [facts.exe], 'exe')
        if key == 'user':
            return self._search(matcher, [facts.user], 'user')
        if key == 'env':
            return self._search(matcher, ['%s=%s' % kv for kv in sorted((facts.env or {}).items())], 'env')
        if key == 'maps':
            return self._search(matcher, list(facts.maps or ()), 'maps')
        if key == 'parent':
            values = []
            for parent in facts.parents:
                values.append(parent.get('name'))
                values.append(' '.join(parent.get('cmdline') or []))
            return self._search(matcher, values, 'parent')
        if key == 'image':
            container = facts.container or {}
            return self._search(matcher, [container.get('image'), container.get('image_digest')], 'container.image')
        if key in ('remote_port', 'remote_addr'):
            for conn in facts.connections or ():
                if conn.state not in ACTIVE_STATES:
                    continue
                if key == 'remote_port' and conn.port in matcher:
                    return _evidence('connection', conn.text(), 'port %d' % conn.port)
                if key == 'remote_addr' and any(conn.address.version == n.version and conn.address in n for n in matcher):
                    return _evidence('connection', conn.text(), 'address in the rule\'s list')
            return None
        return None


# ---------------------------------------------------------------------------- allowlist
class AllowEntry(object):
    """One allowlist entry: exe+sha256, user+cmdline regex, or container image (optionally with user)."""

    def __init__(self, index, source, exe=None, sha256=None, user=None, cmdline=None, image=None, expires=None, comment=None):
        self.index = index
        self.source = source
        self.exe = exe
        self.sha256 = sha256
        self.user = user
        self.cmdline = cmdline
        self.image = image
        self.expires = expires
        self.comment = comment

    def kind(self):
        if self.exe:
            return 'exe+sha256'
        if self.image:
            return 'image'
        return 'user+cmdline'

    def matches(self, facts, args):
        if self.user is not None and facts.user != self.user:
            return False
        if self.exe:
            return facts.exe == self.exe and (facts.sha256() or '').lower() == self.sha256
        if self.image:
            container = facts.container or {}
            if '@' in self.image or self.image.startswith('sha256:'):
                # A digest names the content: compare the digest only.
                wanted = self.image.split('@', 1)[-1]
                return container.get('image_digest') == wanted
            return container.get('image') == self.image
        return self.cmdline is not None and bool(self.cmdline.search(' '.join(args)[:MAX_MATCH_TEXT]))

    def describe(self):
        return {'entry': self.index, 'source': self.source, 'match': self.kind(),
                'expires': self.expires.isoformat() if self.expires else None, 'comment': self.comment}


# ---------------------------------------------------------------------------- configuration
class RogueConfig(object):
    """The effective rule set: built-ins (weights, enabled), lists, custom rules and the allowlist."""

    def __init__(self):
        self.weights = dict((rid, weight) for rid, _kind, weight, _desc in R.BUILTIN_RULES)
        self.kinds = dict((rid, kind) for rid, kind, _weight, _desc in R.BUILTIN_RULES)
        self.descriptions = dict((rid, desc) for rid, _kind, _weight, desc in R.BUILTIN_RULES)
        self.disabled = set()
        self.pool_networks = []
        self.pool_domains = set(R.POOL_DOMAINS)
        self.pool_ports = set(R.POOL_PORTS)
        self.miner_names = set(R.MINER_NAMES)
        self.miner_env_keys = set(R.MINER_ENV_KEYS)
        self.custom = []
        self.allowlist = []
        self.expired = []
        self.warnings = []
        self.window_s = R.WINDOW_S
        self.min_samples = R.MIN_SAMPLES
        self.sources = []

    def rules(self):
        """(id, kind, weight, description, check) of every enabled rule, in order."""
        out = []
        for rid, _kind, _weight, _desc in R.BUILTIN_RULES:
            if rid not in self.disabled:
                out.append((rid, self.kinds[rid], self.weights[rid], self.descriptions[rid], BUILTIN_CHECKS[rid]))
        for rule in self.custom:
            if rule.id not in self.disabled:
                out.append((rule.id, rule.kind, self.weights.get(rule.id, rule.weight), rule.description, rule.check))
        return out

    def rule_ids(self):
        return [rid for rid, _k, _w, _d in R.BUILTIN_RULES] + [r.id for r in self.custom]
