# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note that this doc fragment is **PRIVATE** to the collection. It can have breaking changes at any time.
# Do not use this from other collections or standalone plugins/modules!

from __future__ import annotations


class ModuleDocFragment:

    # Standard documentation fragment: the attributes ansible.builtin.action_common_attributes lacks.
    DOCUMENTATION = r"""
options: {}
attributes:
  idempotent:
    description:
      - When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
      - This assumes that the system controlled/queried by the module has not changed in a relevant way.
"""

    # Should be used together with the standard fragment and ansible.builtin.action_common_attributes.facts.
    FACTS_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - This action does not modify state.
  diff_mode:
    support: N/A
    details:
      - This action does not modify state.
  facts:
    support: full
  idempotent:
    support: full
    details:
      - This action does not modify state.
"""

    # Membership of the gpufleet.reclaim.gpu action group (meta/runtime.yml).
    ACTIONGROUP_GPU = r"""
options: {}
attributes:
  action_group:
    description: Use C(group/gpufleet.reclaim.gpu) or C(group/gpu) in C(module_defaults) to set defaults for this module.
    support: full
    membership:
      - gpufleet.reclaim.gpu
"""
