# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The rules file of the rogue detector: its schema, the validator and ``load_config``.

A rules file (YAML, JSON or TOML) or inline rules (a dictionary) are checked field by field;
every error of a document is collected and raised at once as a ``RulesError`` naming the source,
the line (YAML) and the field.  docs/rogue-detection.md describes the schema.
"""

from __future__ import annotations

import datetime
import ipaddress
import re

from .. import documents, safe_files, validation
from ..errors import GpuFleetError, InvalidArgument, MissingLibrary
from ..textmatch import compile_regex
from ..text import clean_text
from ..units import parse_duration
from ..validation import DocumentLimitError, Errors, Invalid, join, type_name
from . import rules as R
from .config import AllowEntry, CustomRule, RogueConfig


SCHEMA_VERSION = 1
MAX_RULES_FILE = 1024 * 1024
_ID_RE = re.compile(r'^[A-Za-z][A-Za-z0-9_.-]{0,63}$')
_HOST_RE = re.compile(r'^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)+$')
_SHA256_RE = re.compile(r'^[0-9a-f]{64}$')


class RulesError(GpuFleetError):
    """A rules file or inline rules that do not match the schema: names the source, line and field."""

    def __init__(self, source, line, field_name, why, errors=None):
        self.source = source
        self.line = line
        self.field = field_name or None
        self.why = why
        # every error of the document, (source, line, field, why), in the order of the file
        self.errors = list(errors) if errors else [(source, line, field_name or None, why)]
        super(RulesError, self).__init__('\n'.join('%s: %s: %s' % (src if ln is None else '%s:%d' % (src, ln), fld or '(document)', text)
                                                   for src, ln, fld, text in self.errors))

    @classmethod
    def collected(cls, source, items):
        """One RulesError for the validator's ``items`` ((path, value, why, line), see core/validation.py), sorted by line."""
        errors = sorted(((source, line, path or None, why) for path, _value, why, line in items), key=lambda item: item[1] or 0)
        return cls(errors[0][0], errors[0][1], errors[0][2], errors[0][3], errors)


class _Val(object):
    """A value of the rules document with its YAML node (line numbers) and its path; the checks of
    core/validation.py, with the line.  ``errors`` (a validation.Errors) is shared by the whole
    document: every error is collected."""

    def __init__(self, value, node, path, source, loader=None, errors=None):
        self.value = value
        self.node = node
        self.path = path
        self.source = source
        self.loader = loader
        self.errors = Errors() if errors is None else errors

    def run(self, func, *args):
        """func(*args), or None with its error collected (the other fields are checked as well)."""
        return self.errors.run(func, *args)

    @property
    def line(self):
        return _line(self.node)

    def error(self, why):
        return Invalid(self.path, self.value, why, line=self.line)

    def _check(self, check, *args):
        """check(value, self.path, *args), its error with the line of this value.  The value of a
        YAML mapping or list node (walked through its nodes) is checked as an empty one."""
        value = self.value
        if self.node is not None:
            yaml = documents.yaml_module()
            value = {} if isinstance(self.node, yaml.MappingNode) else [] if isinstance(self.node, yaml.SequenceNode) else value
        try:
            return check(value, self.path, *args)
        except Invalid as exc:
            raise self.error(exc.why)

    def child(self, value, node, key):
        path = join(self.path, key) if isinstance(key, str) else '%s[%d]' % (self.path, key)
        return _Val(value, node, path, self.source, self.loader, self.errors)

    def mapping(self, allowed):
        """{key: _Val} of a mapping, rejecting keys not in ``allowed``."""
        value = self._check(validation.mapping)
        if self.node is None:
            self.run(validation.only, value, self.path, allowed, None, 'key', True)
            return dict((key, self.child(item, None, key)) for key, item in value.items() if key in allowed)
        out = {}
        yaml = documents.yaml_module()
        for knode, vnode in self.node.value:
            key = knode.value if isinstance(knode, yaml.ScalarNode) else None
            if not isinstance(key, str) or key not in allowed:
                self.errors.add(join(self.path, str(key)), key, validation.unknown_key(key, allowed, named=True), _line(knode))
                continue
            if key in out:
                raise Invalid(join(self.path, key), key, 'duplicate key', line=_line(knode))
            out[key] = self.child(_construct(self.loader, vnode), vnode, key)
        return out

    def sequence(self):
        value = self._check(validation.sequence)
        if self.node is None:
            return [self.child(v, None, i) for i, v in enumerate(value)]
        return [self.child(_construct(self.loader, n), n, i) for i, n in enumerate(self.node.value)]

    def string(self, allow_empty=False):
        return self._check(validation.text, None, allow_empty)

    def integer(self, low, high):
        return self._check(validation.in_range, low, high, True)

    def regex(self):
        pattern = self.string()
        try:
            return compile_regex(self.path, pattern)
        except InvalidArgument as exc:
            raise self.error('bad regular expression %r: %s' % (pattern, exc.why))


def _line(node):
    return None if node is None else node.start_mark.line + 1


def _construct(loader, node):
    """The Python value of a scalar node (mappings and sequences are walked through their nodes)."""
    yaml = documents.yaml_module()
    if not isinstance(node, yaml.ScalarNode):
        return None
    try:
        return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
        raise Invalid('', node.value, 'cannot read the value %r: %s' % (
            clean_text(node.value, 80), clean_text(getattr(exc, 'problem', None) or exc, 200)), line=_line(node))


def _parse_document(text, source):
    """Compose ``text`` (YAML) into a node tree; returns (root _Val, loader)."""
    yaml = documents.yaml_module()
    if yaml is None:
        raise MissingLibrary('PyYAML', documents.yaml_import_error(), 'read rogue rules files')
    if isinstance(text, bytes):
        try:
            text = text.decode('utf-8')
        except UnicodeDecodeError as exc:
            raise RulesError(source, None, None, 'not UTF-8 text: %s' % exc)
    if len(text) > MAX_RULES_FILE:
        raise RulesError(source, None, None, 'larger than %d bytes' % MAX_RULES_FILE)
    try:
        loader = documents.yaml_loader()(text)   # the policy's loader: the same nesting and alias limits
    except yaml.YAMLError as exc:
        raise RulesError(source, None, None, 'not valid YAML: %s' % clean_text(exc, 300))
    try:
        return loader.get_single_node(), loader
    except DocumentLimitError as exc:
        loader.dispose()
        raise RulesError(source, exc.line, None, exc.why)
    except yaml.MarkedYAMLError as exc:
        loader.dispose()
        mark = exc.problem_mark or exc.context_mark
        raise RulesError(source, mark.line + 1 if mark else None, None, 'not valid YAML: %s' % (exc.problem or exc))
    except yaml.YAMLError as exc:
        loader.dispose()
        raise RulesError(source, None, None, 'not valid YAML: %s' % clean_text(exc, 300))
    except RecursionError:
        loader.dispose()
        raise RulesError(source, None, None, 'nested too deeply')


TOP_KEYS = ('version', 'pools', 'pool_ports', 'miner_names', 'miner_env', 'disable', 'weights', 'allowlist', 'rules',
            'window', 'min_samples')
RULE_KEYS = ('id', 'kind', 'weight', 'description', 'match')
ALLOW_KEYS = ('exe', 'sha256', 'user', 'cmdline', 'image', 'expires', 'comment')


def load_config(rules_file=None, rules=None, text=None, now=None, checked=False):
    """The effective RogueConfig: built-ins, then ``rules_file`` (a path), ``text`` (YAML) and ``rules`` (a dict).

    Raises RulesError naming the source, the line (YAML only) and the field.  Expired allowlist
    entries are dropped and listed in ``config.warnings``.  ``checked`` (the guard agent): the
    rules file is read without following a link and checked on its descriptor (safe_files).
    """
    config = RogueConfig()
    now = now if now is not None else datetime.datetime.now(datetime.timezone.utc)
    sources = []
    if rules_file:
        try:
            if checked:
                data = safe_files.read_file(rules_file, MAX_RULES_FILE + 1)
            else:
                with open(rules_file, 'rb') as handle:
                    data = handle.read(MAX_RULES_FILE + 1)
        except OSError as exc:
            raise RulesError(rules_file, None, None, 'cannot read the rules file: %s' % (exc.strerror or exc))
        sources.append((data, rules_file))
    if text is not None:
        sources.append((text, '<rules text>'))
    for data, source in sources:
        if source == rules_file and documents.document_format(source) in ('json', 'toml'):
            # JSON and TOML by their own parsers (no lines for the fields); YAML through its nodes, with lines
            try:
                doc = documents.read_document(data, source)
            except documents.PolicyError as exc:
                raise RulesError(source, None, None, exc.errors[0][2])  # a line it names is in the text, with the column
            if doc is not None:
                _apply_all(config, _Val(doc, None, '', source), now)
            continue
        node, loader = _parse_document(data, source)
        try:
            if node is None:
                continue
            _apply_all(config, _Val(None, node, '', source, loader), now)
        except RecursionError:
            raise RulesError(source, None, None, 'nested too deeply')
        finally:
            loader.dispose()
    if rules:
        _apply_all(config, _Val(rules, None, '', 'rules (inline)'), now)
    return config


def _apply_all(config, root, now):
    """_apply, then every error of the document at once."""
    root.run(_apply, config, root, now)
    if root.errors.items:
        raise RulesError.collected(root.source, root.errors.items)


def _apply(config, root, now):
    config.sources.append(root.source)
    top = root.mapping(TOP_KEYS)
    run = root.run
    if 'version' in top and top['version'].value != SCHEMA_VERSION:
        raise top['version'].error('unsupported version %r (this release reads version %d)' % (top['version'].value, SCHEMA_VERSION))
    for item in run(top['pools'].sequence) or () if 'pools' in top else ():
        run(_pool, config, item)
    for item in run(top['pool_ports'].sequence) or () if 'pool_ports' in top else ():
        port = run(item.integer, 1, 65535)
        if port is not None:
            config.pool_ports.add(port)
    for item in run(top['miner_names'].sequence) or () if 'miner_names' in top else ():
        name = run(item.string)
        if name is not None:
            config.miner_names.add(name.strip().lower())
    for item in run(top['miner_env'].sequence) or () if 'miner_env' in top else ():
        key = run(item.string)
        if key is not None:
            config.miner_env_keys.add(key.strip())
    if 'window' in top:
        run(_window_setting, config, top['window'])
    if 'min_samples' in top:
        config.min_samples = run(top['min_samples'].integer, 2, 100000) or config.min_samples
    for item in run(top['rules'].sequence) or () if 'rules' in top else ():
        rule = run(_custom_rule, config, item)
        if rule is not None:
            config.custom.append(rule)
    known = set(config.rule_ids())
    for item in run(top['disable'].sequence) or () if 'disable' in top else ():
        rid = run(item.string)
        if rid is not None and rid not in known:
            run(_raise, item.error('unknown rule id %r (known: %s)' % (rid, ', '.join(sorted(known)))))
        elif rid is not None:
            config.disabled.add(rid)
    if 'weights' in top:
        for rid, item in (run(top['weights'].mapping, known) or {}).items():
            weight = run(item.integer, R.MIN_WEIGHT, R.MAX_WEIGHT)
            if weight is not None:
                config.weights[rid] = weight
    for item in run(top['allowlist'].sequence) or () if 'allowlist' in top else ():
        entry = run(_allow_entry, item, len(config.allowlist) + len(config.expired))
        if entry is None:
            continue
        if entry.expires is not None and entry.expires <= now:
            config.expired.append(entry)
            config.warnings.append('allowlist entry %s (%s) expired on %s and is ignored' % (
                item.path, entry.source, entry.expires.isoformat()))
        else:
            config.allowlist.append(entry)


def _raise(error):
    raise error


def _pool(config, item):
    text = item.string().strip().lower()
    try:
        config.pool_networks.append(ipaddress.ip_network(text, strict=False))
        return
    except ValueError:
        pass
    host = text.lstrip('*').lstrip('.')
    if not _HOST_RE.match(host):
        raise item.error('%r is neither an IP address, a network (CIDR) nor a host name' % text)
    config.pool_domains.add(host)


def _window_setting(config, item):
    try:
        window = parse_duration(item.value, 'window')
    except InvalidArgument as exc:
        raise item.error(exc.why)
    if not 60 <= window <= 7 * 86400:
        raise item.error('the window must be from 1m to 7d')
    config.window_s = window


def _custom_rule(config, item):
    before = len(item.errors)
    spec = item.mapping(RULE_KEYS)
    run = item.run
    missing = [key for key in ('id', 'kind', 'weight', 'description', 'match') if key not in spec]
    if missing:
        run(_raise, item.error('a rule needs %s' % ', '.join(missing)))
    rid = run(spec['id'].string) if 'id' in spec else None
    if rid is not None and not _ID_RE.match(rid):
        run(_raise, spec['id'].error('a rule id is a letter followed by up to 63 letters, digits, _ . or -'))
    elif rid is not None and rid in config.rule_ids():
        run(_raise, spec['id'].error('the rule id %r is already taken (built-in or earlier rule)' % rid))
    kind = run(spec['kind'].string) if 'kind' in spec else None
    if kind is not None and kind not in R.KINDS:
        run(_raise, spec['kind'].error('expected one of %s, got %r' % (', '.join(R.KINDS), kind)))
    weight = run(spec['weight'].integer, R.MIN_WEIGHT, R.MAX_WEIGHT) if 'weight' in spec else None
    description = run(spec['description'].string) if 'description' in spec else None
    match = run(_matchers, spec['match']) if 'match' in spec else None
    if len(item.errors) > before:
        return None  # its errors are collected
    source = item.source if item.line is None else '%s:%d' % (item.source, item.line)
    return CustomRule(rid, kind, weight, description, match, source=source)


def _matchers(value):
    """The ``match`` of a custom rule: each matcher checked."""
    matchers = value.mapping(CustomRule.MATCHERS)
    if not matchers:
        raise value.error('give at least one of %s' % ', '.join(CustomRule.MATCHERS))
    match = {}
    for key, item in matchers.items():
        if key == 'remote_port':
            match[key] = set(p for p in (item.run(v.integer, 1, 65535) for v in item.run(item.sequence) or ()) if p is not None)
        elif key == 'remote_addr':
            nets = []
            for v in item.run(item.sequence) or ():
                text = v.run(v.string)
                try:
                    if text is not None:
                        nets.append(ipaddress.ip_network(text.strip(), strict=False))
                except ValueError:
                    item.run(_raise, v.error('%r is not an IP address or network' % v.value))
            match[key] = nets
        else:
            match[key] = item.run(item.regex)
    return match


def _allow_entry(item, index):
    before = len(item.errors)
    spec = item.mapping(ALLOW_KEYS)
    if len(item.errors) > before:
        return None  # an unknown key: collected
    has = set(spec)
    source = item.source if item.line is None else '%s:%d' % (item.source, item.line)
    kwargs = {}
    if 'exe' in has or 'sha256' in has:
        if not {'exe', 'sha256'} <= has:
            raise item.error('an executable entry needs both exe (the path) and sha256: a path alone can be replaced')
        exe = spec['exe'].string()
        if not exe.startswith('/'):
            raise spec['exe'].error('exe must be an absolute path')
        digest = spec['sha256'].string().strip().lower()
        if not _SHA256_RE.match(digest):
            raise spec['sha256'].error('expected 64 hexadecimal digits')
        kwargs.update(exe=exe, sha256=digest)
        if 'cmdline' in has or 'image' in has:
            raise item.error('use one of exe+sha256, user+cmdline or image per entry')
    elif 'image' in has:
        kwargs['image'] = spec['image'].string().strip()
        if 'cmdline' in has:
            raise item.error('use one of exe+sha256, user+cmdline or image per entry')
    elif 'cmdline' in has:
        if 'user' not in has:
            raise item.error('a cmdline entry needs user as well: anyone can choose their command line')
        kwargs['cmdline'] = spec['cmdline'].regex()
    else:
        raise item.error('an allowlist entry matches by exe+sha256, by user+cmdline or by image; '
                         'never by a process name or a user alone')
    if 'user' in has:
        kwargs['user'] = spec['user'].string().strip()
    if 'expires' in has:
        kwargs['expires'] = _expiry(spec['expires'])
    if 'comment' in has:
        kwargs['comment'] = spec['comment'].string(allow_empty=True)
    return AllowEntry(index, source, **kwargs)


def _expiry(item):
    value = item.value
    if isinstance(value, datetime.datetime):
        parsed = value
    elif isinstance(value, datetime.date):
        parsed = datetime.datetime(value.year, value.month, value.day, tzinfo=datetime.timezone.utc) + datetime.timedelta(days=1)
    elif isinstance(value, str):
        text = value.strip()
        try:
            if len(text) == 10:
                day = datetime.date(int(text[:4]), int(text[5:7]), int(text[8:10]))
                if text[4] != '-' or text[7] != '-':
                    raise ValueError(text)
                parsed = datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc) + datetime.timedelta(days=1)
            else:
                parsed = datetime.datetime.fromisoformat(text.replace('Z', '+00:00'))
        except (ValueError, IndexError):
            raise item.error('expected a date (YYYY-MM-DD) or an ISO 8601 date and time, got %r' % value)
    else:
        raise item.error('expected a date (YYYY-MM-DD), got %s' % type_name(value))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed
