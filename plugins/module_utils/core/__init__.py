# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This package is the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
# It is plain Python (>= 3.8) without Ansible imports and uses relative imports only, so the same
# files also run on a node as a standalone agent.
"""Vendor-neutral GPU core of gpufleet.reclaim: backends -> snapshot -> decisions -> actions."""

from __future__ import annotations

# Run by a module from Ansible's AnsiballZ zip (no __pycache__ there): the files imported from now on are compiled
# once per node and source, not on every call (core/bytecode.py says how, and what it trusts).
if type(__spec__.loader).__name__ == 'zipimporter':
    from . import bytecode
    bytecode.install(__name__, __spec__.loader)
