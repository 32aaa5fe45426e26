#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_remediate
short_description: Walk each GPU up the remediation ladder - kill the offending application, reset, drain, flag for reboot
version_added: 0.2.0
description:
  - Classifies every GPU from its Xid events, the driver's recovery action, orphaned memory and health (the
    C(xid_events), C(recovery_action) and C(health) facts of gpufleet.reclaim.gpu_facts), then per GPU takes the steps
    of the ladder in order, each appended with its evidence to the audit log (O(audit_log)).
  - C(kill_application) - an application Xid (13, 31, 43, ...) names the pid of the offending process; that process is
    terminated with the gpu_kill machinery (identity checked before every signal, protected processes never), only if
    at that moment the driver lists that pid on that GPU, its name is the one the Xid record gives, and it started
    before the record; otherwise the step reports why and does nothing.
  - Only the driver's own Xid records count - a kernel-log record of the kernel's facility (a journal entry of the
    kernel transport) that begins with the driver's prefix, for a GPU of this node; text a user makes the kernel print,
    or writes to C(/dev/kmsg), changes nothing. See the collection's docs/health.md.
  - C(reset) - GPU Xids (48, 95, 119, ...), orphaned memory above O(orphan_threshold_mib), a health reading or a recovery
    action of C(reset) - a verified reset through gpufleet.reclaim.gpu_reset (every precondition, every blocker named).
  - C(drain) - the node leaves the scheduler with a reason - C(scontrol update nodename=NODE state=drain reason=...)
    where a root-vouched slurmd runs, else O(drain_command). Only a drain this module set is undone, once health
    reads clean on every GPU and no reboot is pending.
  - C(reboot_flag) - a reset cannot help (Xid 79, recovery action C(reboot), kernel references) or it failed - the
    root-owned flag file O(reboot_flag) names the GPUs and the reasons. A GPU named there waits for the reboot.
  - A handled Xid event is remembered in O(state_path), so a rerun changes nothing; so is the time of each verified
    reset - the Xid lines logged before it stay in the kernel log, but they change that GPU's health no more, and the
    node returns to service once health reads clean.
  - Every driver read runs under O(driver_timeout) - a hung driver fails the task with C(driver_hung) naming the call,
    before any step is taken.
author:
  - gpufleet.reclaim developers (!UNKNOWN)
requirements:
  - psutil
  - root on the node
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpufleet.reclaim._attributes
  - gpufleet.reclaim._attributes.ACTIONGROUP_GPU
  - gpufleet.reclaim._attributes.DRIVER_TIMEOUT
  - gpufleet.reclaim._selection
  - gpufleet.reclaim._protection
  - gpufleet.reclaim._audit_log
attributes:
  check_mode:
    support: full
    details:
      - Check mode predicts the whole ladder - the planned steps, the reset's own preconditions (a reset that would be
        refused shows the drain and reboot flag that would follow), the drain command - and changes nothing.
  diff_mode:
    support: none
  idempotent:
    support: full
    details:
      - Handled events are remembered, a drain is set once, and the reboot flag is written once per boot.
  platform:
    support: full
    platforms: posix
options:
  kill_application_xids:
    description: Terminate the process an application Xid names.
    type: bool
    default: true
  reset:
    description: Reset the GPUs that need it; V(false) drains the node instead.
    type: bool
    default: true
  kill_processes:
    description: Terminate the processes still on a GPU before its reset (see gpufleet.reclaim.gpu_reset).
    type: bool
    default: false
  kill_timeout:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 10
  stop_services:
    description:
      - Systemd units to stop around a reset and start again afterwards, or V(auto) - the units of the blocking
        clients found (nvidia-persistenced, nvidia-dcgm, dcgm-exporter, nvidia-fabricmanager, nvidia-imex).
    type: list
    elements: str
    default: []
  orphan_threshold_mib:
    description: Orphaned memory above this many MiB calls for a reset.
    type: int
    default: 1024
  verify_timeout:
    description: Seconds for a reset GPU to come back healthy.
    type: float
    default: 60
  drain:
    description: Drain the node in the scheduler when a GPU stays unhealthy or waits for a reboot.
    type: bool
    default: true
  drain_command:
    description:
      - Where no root-vouched slurmd runs, the command (an argument list, never a shell line; the program an absolute
        path) that drains the node. It is run with V(drain), the node name and the reason appended, and to return the
        node to service with V(resume), the node name and the reason.
    type: list
    elements: str
  node_name:
    description: The node's name in the scheduler (default the short host name).
    type: str
  reboot_flag:
    description: The root-owned flag file written when a reboot is wanted; empty turns it off.
    type: path
    default: /var/lib/gpufleet/reboot-wanted
  state_path:
    description: Where the handled events and the drain this module set are remembered.
    type: path
    default: /var/lib/gpufleet/remediation.json
seealso:
  - module: gpufleet.reclaim.gpu_reset
  - module: gpufleet.reclaim.gpu_kill
  - module: gpufleet.reclaim.gpu_facts
"""

EXAMPLES = r"""
- name: Show the ladder each GPU would take
  gpufleet.reclaim.gpu_remediate:
  check_mode: true
  become: true
  register: ladder

- name: Remediate, stopping the monitoring agents that block a reset
  gpufleet.reclaim.gpu_remediate:
    stop_services: [auto]
    drain_command: [/usr/local/sbin/gpu-node-drain]
  become: true
"""

RETURN = r"""
gpus:
  description: One entry per GPU - C(index), C(key), C(uuid), C(findings) (the evidence), C(ladder) (the steps, each
    with C(step), C(why), C(evidence), C(status), C(detail)), C(status) (ok, remediated, would_remediate, blocked,
    reboot_wanted, awaiting_reboot), C(recovery_action), C(health).
  returned: always
  type: list
  elements: dict
node:
  description: The node-wide steps - C(scheduler), C(node_name), C(drain), C(undrain), C(reboot_flag).
  returned: always
  type: dict
reboot_wanted:
  description: Whether a GPU of the node waits for a reboot.
  returned: always
  type: bool
reboot_reasons:
  description: Why.
  returned: always
  type: list
  elements: str
drained:
  description: Whether the node is drained by this module.
  returned: always
  type: bool
stale_reboot_flag_removed:
  description: A flag written before the last boot was removed.
  returned: always
  type: bool
errors:
  description: Steps that failed (a drain command, the flag file); the task fails when this is not empty.
  returned: always
  type: list
  elements: str
msg:
  description: One-line summary.
  returned: always
  type: str
driver_hung:
  description:
    - The driver call that did not return within O(driver_timeout) - C(call), C(vendor), C(gpu), C(pci_bus_id),
      C(timeout_s), C(message). The task then fails and no step is taken.
  returned: when the driver hung
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.constants import REBOOT_FLAG_PATH, REMEDIATION_STATE_PATH
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.remediate import RemediateOptions, remediate
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.reset import module_host
from ansible_collections.gpufleet.reclaim.plugins.module_utils.gpu_module import (
    audit_log_option, gpu_options, finish, protection_options, reset_options, run_module)


def argument_spec():
    return dict(
        **gpu_options(), **protection_options(), **audit_log_option(), **reset_options(),
        kill_application_xids=dict(type='bool', default=True),
        reset=dict(type='bool', default=True),
        drain=dict(type='bool', default=True),
        drain_command=dict(type='list', elements='str'),
        node_name=dict(type='str'),
        reboot_flag=dict(type='path', default=REBOOT_FLAG_PATH),
        state_path=dict(type='path', default=REMEDIATION_STATE_PATH),
    )


def build(params):
    """RemediateOptions from the module parameters; raises InvalidArgument."""
    keys = ('gpus', 'kill_application_xids', 'reset', 'kill_processes', 'kill_timeout', 'protect_names', 'protect_users',
            'stop_services', 'orphan_threshold_mib', 'verify_timeout', 'drain', 'drain_command', 'node_name', 'vendor')
    kwargs = dict((key, params[key]) for key in keys)
    return RemediateOptions(reboot_flag=params['reboot_flag'] or None, state_path=params['state_path'] or None,
                            audit_path=params['audit_log'] or None, **kwargs)


def work(module):
    return remediate(build(module.params), module_host(module), check_mode=module.check_mode)


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    result = run_module(module, 'gpu_remediate', work)
    finish(module, result, failed=bool(result['errors']))


if __name__ == '__main__':
    main()
