# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""GPU usage policies: the schema, strict validation, and evaluation of a snapshot.

docs/policy.md documents the schema.  The API (also used by gpu_audit's policy dry-run):

``load_policy(path)`` / ``load_policy_text(text, source)`` / ``parse_policy(data, source)``
    -> Policy, or PolicyError whose ``errors`` each name the file, the path in the document and
    the value.  YAML (or JSON), our schema, gpu-kill's guard configuration (TOML, YAML or JSON)
    and the gpu-kill-style shorthand list (``[{user: "*", max_memory_gb: 12, action: kill}]``)
    are all accepted.
``observe(policy, snapshot, state, now, context=None)`` -> a new state dict with the idle clocks
    advanced (activity, unknown utilization or a gap in the samples resets a clock).
``evaluate(policy, snapshot, state, now, context=None)`` -> [Violation].  Pure: it reads the
    snapshot, the state (idle clocks) and the Context (group membership, Slurm/Kubernetes node,
    GPU allocations, rogue findings, executable hashes), and changes nothing.  Pass a Context
    built from plain data in tests; the default one looks at the live host.

The modules, bottom to top (each imports only those above it in this list):

``validation``   PolicyError; the validator and shape limits of core/validation.py under the parsers' names
``values``       parsers of single values: sizes, durations, dates, names, actions, modes, GPU sets, windows
``sections``     limits, principals, groups, GPU rules, time windows, exemptions, protection; the rule ids
``response``     escalation, the rogue rule, remediation, notifications
``gpukill``      the gpu-kill translator (from_gpukill)
``schema``       the Policy object and parse_policy (the top-level schema and the shorthand rules)
``loading``      YAML/JSON/TOML reading (nesting limit, alias budget), load_policy*, the agent's cache
``context``      host lookups for evaluation (Context: groups, executable hashes, scheduler, allocations)
``violations``   Violation and the choice of the fewest processes to name
``evaluate``     evaluate, evaluate_detailed
``idle_clocks``  observe: the idle clocks kept in the agent's state
"""

from __future__ import annotations

from ..constants import ROGUE_LEVELS
from .context import Context, detect_scheduler, read_allocations, slurm_allocations
from .evaluate import evaluate, evaluate_detailed
from .gpukill import GPUKILL_KEYS
from .idle_clocks import observe
from .loading import (
    MAX_POLICY_BYTES, TOML_MISSING, document_format, document_syntax, load_policy, load_policy_cached, load_policy_text,
    read_document, read_document_lines, yaml_loader)
from .response import CLEAR_AFTER, DEFAULT_REDACT_PATTERNS, ESCALATION_KEYS
from .schema import TOP_KEYS, Policy, parse_policy
from .sections import (
    EXEMPTION_MATCH_KEYS, GPU_KEYS, GROUP_EXTRA, IDLE_KEYS, LIMIT_ALIASES, PROTECT_KEYS, RULES, TIME_WINDOW_KEYS)
from .validation import MAX_ALIAS_NODES, MAX_NESTING, DocumentLimitError, PolicyError
from .values import Window
from .violations import Violation
# Private names that callers reach for today (guard's state check; the schema tests): kept importable
# here, outside __all__.
from .validation import _is_number  # noqa: F401
from .values import _days, _minutes, _window  # noqa: F401

__all__ = (
    'CLEAR_AFTER', 'DEFAULT_REDACT_PATTERNS', 'ESCALATION_KEYS', 'EXEMPTION_MATCH_KEYS', 'GPUKILL_KEYS', 'GPU_KEYS',
    'GROUP_EXTRA', 'IDLE_KEYS', 'LIMIT_ALIASES', 'MAX_ALIAS_NODES', 'MAX_NESTING', 'MAX_POLICY_BYTES', 'PROTECT_KEYS',
    'ROGUE_LEVELS', 'RULES', 'TIME_WINDOW_KEYS', 'TOML_MISSING', 'TOP_KEYS',
    'Context', 'DocumentLimitError', 'Policy', 'PolicyError', 'Violation', 'Window',
    'detect_scheduler', 'document_format', 'document_syntax', 'evaluate', 'evaluate_detailed', 'load_policy',
    'load_policy_cached', 'load_policy_text', 'observe', 'parse_policy', 'read_allocations', 'read_document', 'slurm_allocations',
    'read_document_lines', 'yaml_loader',
)
