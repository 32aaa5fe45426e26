# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note that this doc fragment is **PRIVATE** to the collection. It can have breaking changes at any time.
# Do not use this from other collections or standalone plugins/modules!

from __future__ import annotations


class ModuleDocFragment:

    # vendor and gpus, the options every gpu_* module reads the GPUs with (argument spec:
    # module_utils/gpu_module.gpu_options, with driver_timeout of _attributes.DRIVER_TIMEOUT).
    # A module whose O(gpus) does more (gpu_reset resets them) documents its own description of gpus;
    # Ansible keeps the rest of the option from here.
    DOCUMENTATION = r"""
options:
  vendor:
    description:
      - Which vendor library to read.
      - V(auto) reads every vendor whose library loads on the host.
      - V(intel) reads GPUs driven by the i915 or xe kernel driver; V(apple) reads Apple Silicon GPUs on macOS.
    type: str
    default: auto
    choices: [auto, nvidia, amd, intel, apple]
  gpus:
    description:
      - Only these GPUs, each a host-wide index (see gpufleet.reclaim.gpu_facts) or a UUID; default every GPU.
    type: list
    elements: str
"""
