# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The rogue detector's data, now in rogue/rules.py: this name stays importable."""

from __future__ import annotations

from .rogue.rules import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import
