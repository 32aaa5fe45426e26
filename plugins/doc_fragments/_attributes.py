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
notes:
  - Run as root, the module keeps the compiled code of the collection's Python files in C(/var/lib/gpufleet/bytecode)
    (as Python keeps C(__pycache__) for installed packages), named by a hash of each file's source, so later calls
    on the node do not compile them again. It is a cache, in check mode too, and not a change the task reports; a
    file there that root does not own alone is not used. Set C(GPUFLEET_BYTECODE_CACHE=0) in the task's
    C(environment) to turn it off.
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

    # The options the rogue detector is built from (core.rogue.detector_argument_spec): gpu_audit, gpu_kill.
    DRIVER_TIMEOUT = r"""
options:
  driver_timeout:
    description:
      - Seconds the GPU driver reads may take. They run in a child process of the module; when a driver call does not
        return in time (a hung driver, where C(nvidia-smi) itself would never return), that child is killed and the task
        fails with C(driver_hung) naming the call, instead of waiting forever.
    type: float
    default: 30
"""

    ROGUE_DETECTOR = r"""
options:
  require_allocation:
    description:
      - Whether GPU use outside any Slurm job or container counts as a rogue indicator (rule C(S-no-allocation)).
      - V(auto) counts it on hosts that use allocations - where other GPU processes run in Slurm jobs or containers (as the
        root-owned part of their cgroup paths says), or where root runs C(slurmd) or C(kubelet) from a root-owned executable.
        A process that a user merely names C(slurmd) does not count.
    type: str
    default: auto
    choices: [auto, always, never]
  history_path:
    description:
      - The SQLite usage history on the node, written by the guard.
      - When it exists, the rogue detector reads each process's utilization and memory samples from it (for the flat
        utilization and flat memory indicators). The file is opened read-only.
    type: path
    default: /var/lib/gpufleet/history.db
"""
