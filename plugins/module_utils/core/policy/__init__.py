# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""GPU usage policies (the package face; the split by topic follows)."""

from __future__ import annotations

from .sections import (  # noqa: F401
    CLEAR_AFTER, DEFAULT_REDACT_PATTERNS, ESCALATION_KEYS, EXEMPTION_MATCH_KEYS, GPU_KEYS, GPUKILL_KEYS, GROUP_EXTRA, IDLE_KEYS,
    LIMIT_ALIASES, MAX_ALIAS_NODES, MAX_NESTING, MAX_POLICY_BYTES, PROTECT_KEYS, ROGUE_LEVELS, RULES, TIME_WINDOW_KEYS, TOML_MISSING,
    TOP_KEYS, Context, DocumentLimitError, PolicyError, Violation, Window, _days, _is_number, _minutes, _window, detect_scheduler,
    document_format, document_syntax, evaluate, evaluate_detailed, load_policy, load_policy_cached, load_policy_text, observe,
    parse_policy, read_allocations, read_document, read_document_lines, yaml_loader,
)
