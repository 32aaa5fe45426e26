# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The bottom of the policy package: PolicyError, the error a document's reader raises (the agent
settings' error as well; defined in core/documents.py).  The validator the section parsers use is core/validation.py's, under the
names they know: a parser raises _Bad (validation.Invalid), and _Errors (validation.Errors) collects
every failure of a document so that none hides another."""

from __future__ import annotations

# the document readers' error (core/documents.py), importable from here as before
from ..documents import PolicyError  # noqa: F401  pylint: disable=unused-import
# the leaf's names, importable from here as before
from ..validation import (  # noqa: F401  pylint: disable=unused-import
    MAX_ALIAS_NODES, MAX_ERRORS, MAX_NESTING, DocumentLimitError, Errors, Invalid, check_nesting, is_number, join, line_of, only, show,
    too_deep, type_name,
)

# The names the policy's parsers use (core/validation.py holds each once).
_Bad = Invalid
_Errors = Errors
_join = join
_is_number = is_number
_type = type_name
_only = only
_show = show
_too_deep = too_deep
