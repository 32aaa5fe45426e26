# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note that this doc fragment is **PRIVATE** to the collection. It can have breaking changes at any time.
# Do not use this from other collections or standalone plugins/modules!

from __future__ import annotations


class ModuleDocFragment:

    # audit_log of gpu_kill, gpu_reset and gpu_remediate (argument spec: module_utils/gpu_module.audit_log_option,
    # default core/constants.py ACTIONS_LOG_PATH).  What each module appends is said in its description.
    DOCUMENTATION = r"""
options:
  audit_log:
    description:
      - Absolute path of the JSON Lines file on the node that the module's actions are appended to - who, when, the options,
        and what happened, with the evidence. Lines are hash-chained, so edits are detectable. gpufleet.reclaim.gpu_kill,
        gpufleet.reclaim.gpu_reset and gpufleet.reclaim.gpu_remediate write the same format to the same default file.
      - An empty value disables the log.
    type: path
    default: /var/log/gpufleet/actions.jsonl
"""
