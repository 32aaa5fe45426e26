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
  - The ladder's budget - at most O(max_resets) resets per GPU and one drain and one reboot flag per node per
    O(budget_window), and no Slurm drain while more than O(max_drained_pct) of a partition of the node is drained for a
    gpufleet reason already. A step past the budget is not taken and does not escalate - its status is
    C(budget_exhausted) (or C(partition_limit)) with the reason, and a human decides.
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
    description:
      - Where the handled events, the drain this module set and the disruptive actions gpufleet took on the node (the
        budget's counts) are remembered.
    type: path
    default: /var/lib/gpufleet/remediation.json
  max_resets:
    description: The budget - at most this many resets of one GPU per O(budget_window) (0 to 100; 0 never resets).
    type: int
    default: 2
  budget_window:
    description:
      - The budget's window, a duration such as V(24h) or V(90m) (more than 0, at most V(7d)); one drain and one reboot
        flag per node per window too.
    type: str
    default: 24h
  max_drained_pct:
    description:
      - Where Slurm drains the node - no drain while more than this percentage of a partition of the node is drained for
        a gpufleet reason already (C(sinfo --json); a Slurm that cannot be asked means no drain). V(100) turns the check
        off.
    type: float
    default: 50
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
remediation_budget_exhausted:
  description: Whether the ladder's budget held a step (RV(budget)).
  returned: always
  type: bool
budget:
  description: The budget - C(max_resets), C(window_s), C(max_drained_pct), and C(exhausted) (each held step with C(step),
    C(gpu) and C(why)).
  returned: always
  type: dict
disruptive:
  description:
    - The disruptive actions of this call (a GPU reset, a drain, a reboot flag, the stop of a node service), taken or, in
      check mode, predicted, each with C(action), C(gpu), C(why), C(severity) and C(since) (the oldest evidence).
    - The acting playbooks' plan pass reads them to apply the blast-radius limit (the collection's docs/fleet-tuning.md).
  returned: always
  type: list
  elements: dict
disruption:
  description:
    - What gpufleet did to this node lately, as the blast-radius limit reads it - C(drained) (the remediation ladder's own
      drain), C(reboot_flag) (this boot's flag), C(scheduler) (Slurm's drain of the node for a gpufleet reason, read only
      where a root-vouched slurmd runs), C(actions) (the newest disruptive actions gpufleet took, from the ladder's state
      file O(state_path) - C(action), C(gpu), C(time), C(ago_s) by this node's clock, C(by)) and C(errors).
  returned: always
  type: dict
driver_hung:
  description:
    - The driver call that did not return within O(driver_timeout) - C(call), C(vendor), C(gpu), C(pci_bus_id),
      C(timeout_s), C(message). The task then fails and no step is taken.
  returned: when the driver hung
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.budget import DEFAULT_MAX_DRAINED_PCT, DEFAULT_MAX_RESETS, Budget
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.constants import REBOOT_FLAG_PATH, REMEDIATION_STATE_PATH
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.disruption import node_disruption
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
        max_resets=dict(type='int', default=DEFAULT_MAX_RESETS),
        budget_window=dict(type='str', default='24h'),
        max_drained_pct=dict(type='float', default=DEFAULT_MAX_DRAINED_PCT),
    )


def build(params):
    """RemediateOptions from the module parameters; raises InvalidArgument."""
    keys = ('gpus', 'kill_application_xids', 'reset', 'kill_processes', 'kill_timeout', 'protect_names', 'protect_users',
            'stop_services', 'orphan_threshold_mib', 'verify_timeout', 'drain', 'drain_command', 'node_name', 'vendor')
    kwargs = dict((key, params[key]) for key in keys)
    budget = Budget(params['max_resets'], params['budget_window'], params['max_drained_pct'])
    return RemediateOptions(reboot_flag=params['reboot_flag'] or None, state_path=params['state_path'] or None,
                            audit_path=params['audit_log'] or None, budget=budget, **kwargs)


def work(module):
    options = build(module.params)
    result = remediate(options, module_host(module), check_mode=module.check_mode)
    # the node as the blast-radius limit reads it (core/disruption.py): what gpufleet did to it lately
    result['disruption'] = node_disruption(options.state_path, options.reboot_flag, scheduler=result['node']['scheduler'],
                                           node_name=result['node']['node_name'])
    return result


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    result = run_module(module, 'gpu_remediate', work)
    finish(module, result, failed=bool(result['errors']))


if __name__ == '__main__':
    main()
