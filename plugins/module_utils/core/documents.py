# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Reading the documents the core is given (policy, agent settings, rogue rules): YAML (strict, with the
nesting limit and the alias budget), JSON and TOML, sniffed when the source names no format; and
PolicyError, the error such a document raises.  A leaf: PyYAML and tomllib are imported only when a
document of theirs is read, so a module that may read one (gpu_kill's rules file) pays nothing until it does."""

from __future__ import annotations

import datetime
import json
import os
import re

from .errors import InvalidArgument
from .validation import MAX_ALIAS_NODES, MAX_ERRORS, MAX_NESTING, DocumentLimitError, check_nesting, join, line_of, show, too_deep, type_name


# The yaml module (or None when PyYAML is missing), imported on first use: the agent's ticks
# usually read the policy from the state's cache and never pay for importing PyYAML.
_YAML = []
_YAML_ERROR = []


def yaml_module():
    """PyYAML, or None when it is not installed (imported on first use)."""
    if not _YAML:
        try:
            import yaml  # pylint: disable=import-outside-toplevel
        except ImportError:  # pragma: no cover - the agent then reads JSON (and TOML) only
            import traceback  # pylint: disable=import-outside-toplevel
            yaml = None
            _YAML_ERROR.append(traceback.format_exc())
        _YAML.append(yaml)
    return _YAML[0]


def yaml_import_error():
    """The traceback of the failed PyYAML import, or None when PyYAML is installed."""
    yaml_module()
    return _YAML_ERROR[0] if _YAML_ERROR else None


MAX_POLICY_BYTES = 4 * 1024 * 1024


def _node_extent(node, extents):
    """(nesting, nodes) of a composed YAML node whose children are in ``extents`` ({id: (node, nesting, nodes)})."""
    if isinstance(node.value, list):
        children = [n for item in node.value for n in (item if isinstance(item, tuple) else (item,))]
        known = [extents.get(id(child)) for child in children]
        if any(extent is None for extent in known):
            return None
        return 1 + max([extent[1] for extent in known] or [0]), 1 + sum(extent[2] for extent in known)
    return 0, 1


def _strict_yaml_loader():
    """A SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one), nesting past
    MAX_NESTING and aliases that expand past MAX_ALIAS_NODES (a "billion laughs" document): it
    counts while it composes, before anything is built, so a small bomb costs a small effort."""
    yaml = yaml_module()

    class StrictLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
        def __init__(self, stream):
            yaml.SafeLoader.__init__(self, stream)
            self.open_nodes = 0        # the nodes being composed around the current one
            self.extents = {}          # id(node) -> (node, nesting, nodes once aliases are expanded)
            self.alias_nodes = 0       # nodes the aliases added so far

        def compose_node(self, parent, index):
            alias = self.check_event(yaml.AliasEvent)
            line = self.peek_event().start_mark.line + 1
            if self.open_nodes > MAX_NESTING:
                raise DocumentLimitError(too_deep(), line)
            self.open_nodes += 1
            try:
                node = yaml.SafeLoader.compose_node(self, parent, index)
            finally:
                self.open_nodes -= 1
            known = self.extents.get(id(node))
            if known is None:
                extent = None if alias else _node_extent(node, self.extents)
                if extent is None:
                    raise DocumentLimitError('an alias refers to the node that contains it (a recursive alias)', line)
                known = self.extents[id(node)] = (node,) + extent
            elif alias:
                self.alias_nodes += known[2]
                if self.alias_nodes > MAX_ALIAS_NODES:
                    raise DocumentLimitError('aliases expand to more than %d nodes (the limit)' % MAX_ALIAS_NODES, line)
            if self.open_nodes + known[1] > MAX_NESTING:
                raise DocumentLimitError(too_deep(), line)
            return node

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        seen = {}
        for key_node, _value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, 'a mapping key must be a plain value', key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, 'duplicate key %r (also on line %d)' % (
                    key, seen[key] + 1), key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


_LOADER = []


def yaml_loader():
    """The loader class for every YAML document the agent reads (policy, settings, rogue rules):
    strict and limited (see _strict_yaml_loader).  None without PyYAML."""
    if not _LOADER:
        _LOADER.append(_strict_yaml_loader() if yaml_module() is not None else None)
    return _LOADER[0]


def _read_document(text, source):
    """(data, lines) of ``text``: the parser the file's extension names (.yaml/.yml, .json, .toml);
    unnamed input (stdin, text) is sniffed: YAML (or JSON) first, TOML when that yields no mapping
    or list.  ``lines`` maps paths to lines (YAML only; {} otherwise)."""
    fmt = document_format(source)
    if fmt == 'json':
        return _read_json(text, source), {}
    if fmt == 'toml':
        return _read_toml(text, source), {}
    if fmt == 'yaml':
        if yaml_module() is None:  # JSON is YAML: read it without PyYAML
            try:
                return _read_json(text, source), {}
            except PolicyError as exc:
                if exc.lines[0] is None:
                    raise  # nested too deep
                why = ('reading YAML needs PyYAML (python3-yaml), and this is not JSON either (%s): '
                       'install PyYAML, or write the document in JSON' % exc.errors[0][2])
                raise PolicyError([('', None, why)], source)
        return _read_yaml(text, source)
    return _sniffed(text, source)[1:]


def _sniffed(text, source):
    """('yaml'|'json'|'toml', data, lines) of unnamed input: YAML (or, without PyYAML, JSON) first,
    TOML when that fails on a document that looks like TOML, or yields no mapping or list."""
    try:
        if yaml_module() is not None:
            data, lines = _read_yaml(text, source)
            syntax = 'yaml'
        else:
            data, lines, syntax = _read_json(text, source), {}, 'json'
    except PolicyError:
        if not _looks_like_toml(text):
            raise
        return 'toml', _read_toml(text, source), {}
    if data is None or isinstance(data, (dict, list)):
        return syntax, data, lines
    try:
        return 'toml', _read_toml(text, source), {}
    except PolicyError:
        raise PolicyError([('', show(data), 'a policy is a mapping (or a list of shorthand rules), got %s' % type_name(data))], source)


def document_syntax(text, source):
    """'yaml', 'json' or 'toml': the parser that reads ``text`` (the extension of ``source``, else the
    one that sniffing picks, as the loaders do).  Raises PolicyError when none reads it."""
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    return document_format(source) or _sniffed(text, source)[0]


def document_format(source):
    """'yaml', 'json' or 'toml' from the extension of ``source`` (a file name); None for unnamed input."""
    ext = os.path.splitext(source or '')[1].lower()
    return {'.yaml': 'yaml', '.yml': 'yaml', '.json': 'json', '.toml': 'toml'}.get(ext)


def _looks_like_toml(text):
    """True when the first line that says something is a TOML table header or a ``key = value``."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith('#'):
            return bool(re.match(r'^(\[\[?\s*[A-Za-z0-9_."\' -]+\]\]?\s*(#.*)?|[A-Za-z0-9_."\'-]+\s*=.*)$', line))
    return False


def _syntax_error(fmt, line, column, why):
    return 'line %d, column %d: %s syntax error: %s' % (line, column, fmt, why)


def _read_yaml(text, source):
    yaml = yaml_module()
    try:
        loader = yaml_loader()(text)  # a SafeLoader subclass
    except yaml.YAMLError as exc:  # pragma: no cover - the reader fails on bytes it cannot decode
        raise PolicyError([('', None, 'YAML error: %s' % str(exc).replace('\n', ' '))], source)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except DocumentLimitError as exc:
        raise PolicyError([('', None, str(exc), exc.line)], source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        why = exc.problem or exc.context or str(exc)
        if mark is None:
            raise PolicyError([('', None, 'YAML syntax error: %s' % why)], source)
        raise PolicyError([('', None, _syntax_error('YAML', mark.line + 1, mark.column + 1, why), mark.line + 1)], source)
    except yaml.YAMLError as exc:
        raise PolicyError([('', None, 'YAML error: %s' % str(exc).replace('\n', ' '))], source)
    except RecursionError:
        raise PolicyError([('', None, too_deep())], source)
    except (ValueError, TypeError, OverflowError) as exc:
        raise PolicyError([('', None, 'cannot read the YAML document: %s' % exc)], source)
    finally:
        loader.dispose()
    return _plain(data), _node_lines(node)


def _node_lines(root):
    """{path: line} of every mapping key and list item in a composed YAML node tree (paths as the
    validators write them; a top-level list is the shorthand ``rules``).  Iterative, each node once."""
    lines = {}
    if root is None:
        return lines
    seen = set()
    pending = [(root, 'rules' if isinstance(root.value, list) and root.value and not isinstance(root.value[0], tuple) else '')]
    while pending:
        node, path = pending.pop()
        if id(node) in seen or not isinstance(node.value, list):
            continue
        seen.add(id(node))
        for index, item in enumerate(node.value):
            if isinstance(item, tuple):
                key, child = item
                if not isinstance(key.value, str):
                    continue
                sub = join(path, key.value)
            else:
                key = child = item
                sub = '%s[%d]' % (path, index)
            lines.setdefault(sub, key.start_mark.line + 1)
            pending.append((child, sub))
    return lines


def _unique_pairs(pairs):
    """object_pairs_hook for JSON: a key given twice is an error (as in YAML), not silently the last."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError('duplicate key %r' % key)
        out[key] = value
    return out


def _read_json(text, source):
    if not text.strip():
        return None
    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise PolicyError([('', None, too_deep())], source)
    except json.JSONDecodeError as exc:
        raise PolicyError([('', None, _syntax_error('JSON', exc.lineno, exc.colno, exc.msg), exc.lineno)], source)
    except ValueError as exc:
        raise PolicyError([('', None, 'invalid JSON: %s' % exc)], source)
    return data


_TOML = []
TOML_MISSING = ('reading TOML needs Python 3.11+ (tomllib) or the tomli package: install tomli, '
                'or write the policy in YAML')


def toml_module():
    """tomllib (Python 3.11+), else tomli (the same parser for older Pythons), else None."""
    if not _TOML:
        try:
            import tomllib as toml  # pylint: disable=import-outside-toplevel
        except ImportError:
            try:
                import tomli as toml  # pylint: disable=import-outside-toplevel
            except ImportError:
                toml = None
        _TOML.append(toml)
    return _TOML[0]


def _read_toml(text, source):
    toml = toml_module()
    if toml is None:
        raise PolicyError([('', None, TOML_MISSING)], source)
    try:
        return _plain(toml.loads(text))
    except toml.TOMLDecodeError as exc:
        message = str(exc)
        found = re.search(r'^(.*?)\s*\(at line (\d+), column (\d+)\)$', message)
        if found:
            line = int(found.group(2))
            why = found.group(1)
            if re.search(r'=\s*null\s*(#.*)?$', (text.splitlines()[line - 1:line] or [''])[0]):
                why += ' (TOML has no null: leave the key out)'
            raise PolicyError([('', None, _syntax_error('TOML', line, int(found.group(3)), why), line)], source)
        raise PolicyError([('', None, 'TOML syntax error: %s' % message)], source)
    except RecursionError:
        raise PolicyError([('', None, too_deep())], source)


def _plain(data, depth=0):
    """Dates and times as ISO text (what every date field accepts), so a document survives JSON."""
    if depth > 200:
        return data
    if isinstance(data, dict):
        return dict((k, _plain(v, depth + 1)) for k, v in data.items())
    if isinstance(data, list):
        return [_plain(v, depth + 1) for v in data]
    if isinstance(data, (datetime.date, datetime.datetime, datetime.time)):
        return data.isoformat()
    return data


def read_document(text, source='<policy>'):
    """The document in ``text`` (YAML, JSON or TOML, by the extension of ``source``) as plain data,
    not yet validated.  Raises PolicyError."""
    return read_document_lines(text, source)[0]


def read_document_lines(text, source='<policy>', what='policy'):
    """(data, {path: line}) of ``text``: read_document, with the line of each path (YAML only).
    ``what`` the document is (policy, settings) names the field of its PolicyError."""
    try:
        return _read_document_lines(text, source)
    except PolicyError as exc:
        if what != 'policy' and exc.field == 'policy':
            exc.field = what
        raise


def _read_document_lines(text, source):
    if isinstance(text, bytes):
        try:
            text = text.decode('utf-8')
        except UnicodeDecodeError as exc:
            raise PolicyError([('', None, 'the file is not UTF-8 text: %s' % exc)], source)
    if not isinstance(text, str):
        raise PolicyError([('', None, 'expected text')], source)
    if len(text) > MAX_POLICY_BYTES:
        raise PolicyError([('', None, 'the document is larger than %d bytes' % MAX_POLICY_BYTES)], source)
    data, lines = _read_document(text, source)
    try:
        check_nesting(data)
    except DocumentLimitError as exc:
        raise PolicyError([('', None, str(exc))], source)
    return data, lines


class PolicyError(InvalidArgument):
    """The policy (or another document the agent reads) is invalid.  ``errors`` is a list of
    ``(path, value, why)``; ``lines`` the line of each in ``source`` (None where unknown: JSON and
    TOML documents, or a cached document); ``source`` the file.  An error with no path and the value
    None concerns the whole document (cannot read it, a syntax error): it is printed as
    ``source: why``."""

    def __init__(self, errors, source='<policy>', lines=None, what='policy'):
        self.errors = [tuple(item[:3]) for item in errors]
        self.lines = [item[3] if len(item) > 3 else None for item in errors]
        self.source = source
        first = self.errors[0] if self.errors else ('', None, 'invalid %s' % what)
        super(PolicyError, self).__init__(first[0] or what, first[1], first[2])
        self.add_lines(lines)

    def add_lines(self, lines):
        """Fill in unknown lines from ``lines`` ({path: line}, as read_document_lines returns it)."""
        for index, (path, _value, _why) in enumerate(self.errors):
            if self.lines[index] is None and lines:
                self.lines[index] = line_of(lines, path)
        if lines:  # in the order of the file (errors without a line first: they concern the whole document)
            order = sorted(range(len(self.errors)), key=lambda i: self.lines[i] or 0)
            self.errors = [self.errors[i] for i in order]
            self.lines = [self.lines[i] for i in order]
        self._render()

    def problems(self):
        """Each error as a dict: file, line (when known), path, value, why."""
        out = []
        for (path, value, why), line in zip(self.errors, self.lines):
            item = {'file': self.source, 'path': path, 'value': None if _whole(path, value) else repr(value), 'why': why}
            if line is not None:
                item['line'] = line
            out.append(item)
        return out

    def _render(self):
        lines = []
        for (path, value, why), line in list(zip(self.errors, self.lines))[:MAX_ERRORS]:
            where = self.source if line is None else '%s:%d' % (self.source, line)
            if _whole(path, value):
                lines.append('%s: %s' % (self.source, why))  # a line it names is in ``why``, with the column
            else:
                lines.append('%s: %s: invalid value %s: %s' % (where, path or '(top)', show(value), why))
        if len(self.errors) > MAX_ERRORS:
            lines.append('... and %d more error(s)' % (len(self.errors) - MAX_ERRORS))
        self.args = ('\n'.join(lines),)

    def __str__(self):
        return self.args[0]


def _whole(path, value):
    """True for an error about the whole document (no path, no value)."""
    return not path and value is None


__all__ = ['MAX_ALIAS_NODES', 'MAX_NESTING', 'MAX_POLICY_BYTES', 'TOML_MISSING', 'DocumentLimitError', 'PolicyError',
           'document_format', 'document_syntax', 'read_document', 'read_document_lines', 'toml_module', 'yaml_import_error',
           'yaml_loader', 'yaml_module']
