# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: printable
short_description: Escape the characters a terminal, a log viewer or a browser acts on
version_added: 0.1.0
description:
  - Returns the text with every C0 and C1 control character (tab and newline included), DEL, the Unicode line and
    paragraph separators and the bidirectional controls replaced by a visible escape (C(\x1b), C(\u202e)).
  - Process names, command lines and user names come from the nodes' users; the fleet report runs every such value
    through this filter before HTML escaping or CSV quoting, so that no value can forge a line or reorder the text.
  - The same function as the guard agent's terminal output (the collection's core C(text.printable)).
positional: _input
options:
  _input:
    description: The text (anything else is converted with C(str); V(null) stays V(null)).
    type: raw
    required: true
author:
  - gpufleet.reclaim developers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Show a command line safely
  ansible.builtin.debug:
    msg: "{{ proc.cmdline | join(' ') | gpufleet.reclaim.printable }}"
"""

RETURN = r"""
_value:
  description: The escaped text.
  type: str
"""

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import printable


class FilterModule(object):
    def filters(self):
        return {'printable': printable}
