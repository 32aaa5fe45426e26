# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Loading policy documents: load_policy, load_policy_text and load_policy_cached (the agent's loader,
through a cache keyed by the file's SHA-256).  Reading YAML, JSON and TOML is core/documents.py's."""

from __future__ import annotations

import hashlib
import json

from .. import safe_files
from ..constants import POLICY_PATH
# the document readers live in the leaf core/documents.py; their names, importable from here as before
from ..documents import (  # noqa: F401  pylint: disable=unused-import
    MAX_POLICY_BYTES, TOML_MISSING, document_format, document_syntax, read_document, read_document_lines, yaml_loader)
from .schema import parse_policy
from .validation import PolicyError


def json_pure(data):
    """True when ``data`` comes back unchanged from JSON (so it may be cached as JSON)."""
    try:
        return json.loads(json.dumps(data, allow_nan=False)) == data
    except (TypeError, ValueError, RecursionError):
        return False


def _cannot_read(exc, path):
    return PolicyError([('', None, 'cannot read the policy: %s' % (exc.strerror or exc))], path)


def load_policy_cached(path, cache):
    """``load_policy(path)`` through ``cache`` (a dict kept by the caller, e.g. in the agent's state):
    when the file's SHA-256 matches the cached one, the cached document is validated again without
    reading YAML.  The cache is updated.  Raises PolicyError.  The agent's loader: the file is read
    without following a link, checked on its descriptor and parsed from those bytes (safe_files)."""
    try:
        raw = safe_files.read_file(path, MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise _cannot_read(exc, path)
    digest = hashlib.sha256(raw).hexdigest()
    lines = None
    if isinstance(cache, dict) and cache.get('sha256') == digest and 'document' in cache:
        data = cache['document']
    else:
        data, lines = read_document_lines(raw, path)
        if isinstance(cache, dict):
            cache.clear()
            if json_pure(data):
                cache.update(sha256=digest, document=data)
    try:
        policy = parse_policy(data, path)
    except PolicyError as exc:
        exc.add_lines(lines if lines is not None else read_document_lines(raw, path)[1])
        raise
    policy.sha256 = digest
    return policy


def load_policy_text(text, source='<policy>'):
    """Parse and validate a policy document -> Policy (``sha256`` of the text is recorded)."""
    data, lines = read_document_lines(text, source)
    try:
        policy = parse_policy(data, source)
    except PolicyError as exc:
        exc.add_lines(lines)
        raise
    policy.sha256 = hashlib.sha256(text.encode('utf-8') if isinstance(text, str) else text).hexdigest()
    return policy


def load_policy(path=POLICY_PATH):
    """Read and validate the policy file at ``path``.  Raises PolicyError (also for a missing file)."""
    try:
        with open(path, 'rb') as handle:
            raw = handle.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise _cannot_read(exc, path)
    return load_policy_text(raw, path)
