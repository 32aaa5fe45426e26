#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_reset
short_description: Reset GPUs with every precondition checked, and prove that the reset worked
version_added: 0.1.0
description:
  - Resets the GPUs named in O(gpus), every GPU (O(all=true)), or only the GPUs that need it (O(when_needed=true)) -
    those whose health recommends a reset (lost GPU, uncorrected ECC errors, pending row remapping, the driver's
    recovery action) or that hold more than O(orphan_threshold_mib) MiB of memory that no process accounts for.
  - Before anything is touched, every precondition is checked per GPU and reported by name in
    RV(resets[].preconditions) - C(vendor), C(root), C(tool), C(mig), C(nvlink), C(fabric_manager),
    C(persistence_mode), C(nvml_session), C(recovery_action), C(kernel_modules), C(services), C(blocking_clients),
    C(processes).
  - Every holder is named - the GPU's processes; the blocking clients C(nvidia-persistenced), C(nv-hostengine),
    C(dcgm-exporter), C(nv-fabricmanager), C(nvidia-imex) and display servers (counted only for a system account's
    process running a root-owned executable); and the kernel references of C(nvidia_drm), C(nvidia_modeset) and
    C(nvidia_uvm) beyond their holder modules and the processes' open files (C(/sys/module/<m>/refcnt) and
    C(holders/)). A kernel reference refuses the reset with the module and its count, and recommends a reboot
    (RV(resets[].reboot_recommended)), as does a driver recovery action of C(reboot). A GPU with a failed
    precondition is not touched, and its message says what to do; the other GPUs go on.
  - The scan of every process's open files is bounded (131,072 descriptors and 3 s; the driver's processes first,
    the largest fd tables left first), so that the descriptors users open cannot make it run on. When it left
    processes unread, C(blocking_clients) is C(warn) and names the largest of them; it does not refuse (or any user
    could block every reset), and a holder left unseen makes the driver refuse the reset itself.
  - NVIDIA - C(nvidia-smi --gpu-reset -i <PCI bus id>), with persistence mode switched off for the reset and restored
    afterwards. NVLink and NVSwitch fabric state are checked where the driver exposes them (else reported as
    C(not_exposed)).
  - NVIDIA MIG - a reset destroys every GPU and compute instance of the board. With MIG mode on, the C(mig) precondition
    lists the instances and the processes on them (check mode included), and the reset is refused unless
    O(mig_reset=recreate). Then the layout (each GPU instance's profile and placement, its compute instance's profile)
    is recorded, the board is reset, the same instances are created again and compared with the record
    (RV(resets[].mig)). A MIG UUID or C(GPU:GI) in O(gpus) selects its board.
  - AMD - C(amdsmi_reset_gpu) through the amdsmi library, falling back to C(amd-smi reset --gpureset -g <BDF>).
  - Intel - C(xpu-smi config -d <BDF> --reset) where xpu-smi is installed, else a PCI reset through
    C(/sys/bus/pci/devices/<BDF>/reset).
  - Apple GPUs cannot be reset; such a GPU fails with a clear message.
  - After the reset the module waits up to O(verify_timeout) seconds until the GPU answers again, its health is
    C(ok) and its orphaned memory is at most O(orphan_threshold_mib). Only then does it count as reset. Where the driver
    reports no used memory at all (Intel without xpu-smi), the orphaned memory cannot be checked, and a warning says so.
    RV(resets[].before) and RV(resets[].after) show the proof.
  - A failure on one GPU does not stop the others; the task fails if any selected GPU failed, and
    RV(failed_gpus) says which.
  - Every GPU the module acted on is appended to the hash-chained JSON Lines audit log on the node (O(audit_log)),
    in the same format as gpufleet.reclaim.gpu_kill.
author:
  - gpufleet.reclaim developers (!UNKNOWN)
requirements:
  - psutil
  - root on the node
  - nvidia-ml-py and nvidia-smi (for NVIDIA GPUs)
  - amdsmi or amd-smi (for AMD GPUs)
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
      - Check mode evaluates every precondition and reports per GPU whether the reset would run
        (RV(resets[].would_reset)), which preconditions pass or fail, and which processes would be terminated
        (RV(resets[].would_kill)). It changes nothing - no signal, no service, no persistence mode, no reset.
      - In check mode the task fails when a selected GPU would be refused, as the real run would.
  diff_mode:
    support: none
  idempotent:
    support: partial
    details:
      - With O(when_needed=true) the module is idempotent - once the GPUs are healthy a second run selects nothing and
        reports no change.
      - With O(gpus) or O(all=true) every run resets the GPUs again and reports a change.
  platform:
    support: full
    platforms: posix
options:
  gpus:
    description:
      - Reset these GPUs, each a host-wide index (see gpufleet.reclaim.gpu_facts) or a UUID.
      - With O(when_needed=true), only those of these GPUs that need a reset.
      - A value that matches no GPU fails the task before anything is touched.
      - Mutually exclusive with O(all).
  all:
    description: Reset every GPU of the node.
    type: bool
    default: false
  when_needed:
    description:
      - Reset only the GPUs whose health recommends a reset (RV(resets[].selected_because) says why) or that hold more than
        O(orphan_threshold_mib) MiB of memory that no process accounts for.
      - One of O(gpus), O(all=true) or O(when_needed=true) is required.
    type: bool
    default: false
  orphan_threshold_mib:
    description:
      - Orphaned memory (used memory no listed process accounts for) above this many MiB makes O(when_needed=true) select
        the GPU, and a reset only counts as verified when the orphaned memory is at most this much afterwards.
      - Drivers older than 510 report the memory the driver reserves for itself as used, so it shows as orphaned;
        keep the threshold above that reserve.
    type: int
    default: 1024
  kill_processes:
    description:
      - Terminate the processes that use a GPU before resetting it, with the gpu_kill machinery (the same protection
        rules - O(protect_names), O(protect_users), the module's own process tree; SIGTERM, then SIGKILL after
        O(kill_timeout) seconds; children included).
      - Without it a GPU with any process on it is refused, and the processes are named. A GPU that a process protected by
        O(protect_names) or O(protect_users) uses is refused in any case.
    type: bool
    default: false
  kill_timeout:
    description: Seconds between SIGTERM and SIGKILL when O(kill_processes=true).
    type: float
    default: 10
  stop_services:
    description:
      - Systemd units to stop before the reset (those that are active) and to start again afterwards, whatever happened,
        for example V(nvidia-persistenced), V(nvidia-dcgm) or V(dcgm-exporter). Always run as C(systemctl stop UNIT) and
        C(systemctl start UNIT) (argument lists, no shell).
      - V(auto) stops the units of the blocking clients found, among V(nvidia-persistenced), V(nvidia-dcgm),
        V(dcgm-exporter), V(nvidia-fabricmanager) and V(nvidia-imex); a blocking client of another unit (a display
        manager) refuses the reset, naming the client and its pid.
      - The blocking clients are checked again after stopping them.
    type: list
    elements: str
    default: []
  drain:
    description:
      - Put each NVIDIA GPU into the NVML drain state (C(nvmlDeviceModifyDrainState)) while it is emptied and reset, so
        that no new client can open it, and take it out again afterwards.
      - Best effort - when the driver refuses (not supported, no permission) the module warns and resets without the
        drain. The reset itself still refuses a GPU that is in use, so a missing drain cannot reset a busy GPU.
      - A drain that was set and cannot be undone fails the GPU, with the command to undo it.
    type: bool
    default: false
  mig_reset:
    description:
      - What to do with a GPU in MIG mode. V(refuse) - do not reset it; the C(mig) precondition says what a reset would
        destroy. V(recreate) - record its GPU and compute instances, reset it, create the same instances again (same
        profiles and placements) and verify them. The processes on the instances must be gone first
        (O(kill_processes=true)).
    type: str
    choices: [refuse, recreate]
    default: refuse
  state_path:
    description:
      - The remediation ladder's state file, where each reset this module runs (and each service it stops) is recorded, so
        that the ladder's budget and the playbooks' blast-radius limit count it. Empty records nothing.
    type: path
    default: /var/lib/gpufleet/remediation.json
  verify_timeout:
    description: Seconds to wait after the reset for the GPU to answer again with health C(ok) and no orphaned memory.
    type: float
    default: 60
notes:
  - The module's own NVML session is closed before any reset (the C(nvml_session) precondition asserts it).
  - The blocking clients (C(nvidia-persistenced), C(nv-hostengine), C(dcgm-exporter), C(Xorg)) are never terminated,
    whatever O(protect_names) says; stop them with O(stop_services).
  - Blocking clients are found by the names of the processes that hold the GPU's device files or the shared
    control device (C(/dev/nvidiactl)).
  - The order for one GPU is - persistence mode off, drain, terminate the processes, reset, verify, undo the drain,
    persistence mode back on. Stopped services are started again at the very end.
seealso:
  - module: gpufleet.reclaim.gpu_facts
  - module: gpufleet.reclaim.gpu_kill
"""

EXAMPLES = r"""
- name: Reset the GPUs that need it (leaked memory, lost GPU, ECC errors); a healthy node reports no change
  gpufleet.reclaim.gpu_reset:
    when_needed: true
  become: true

- name: Show what a reset of GPU 2 would do
  gpufleet.reclaim.gpu_reset:
    gpus: ["2"]
    kill_processes: true
  check_mode: true
  become: true
  register: plan

- name: Empty and reset two GPUs, stopping the monitoring agents for the duration
  gpufleet.reclaim.gpu_reset:
    gpus: ["GPU-6f7c1a2b-0000-4000-8000-000000000000", "3"]
    kill_processes: true
    kill_timeout: 30
    stop_services: [nvidia-dcgm, dcgm-exporter]
    drain: true
  become: true
"""

RETURN = r"""
resets:
  description: One entry per selected GPU, in index order.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: Host-wide GPU index.
      type: int
      returned: always
    uuid:
      description: GPU UUID, V(null) when the GPU does not answer.
      type: str
      returned: always
    pci_bus_id:
      description: PCI bus id, V(null) when the GPU does not answer.
      type: str
      returned: always
    vendor:
      description: V(nvidia), V(amd), V(intel) or V(apple).
      type: str
      returned: always
    name:
      description: Product name.
      type: str
      returned: always
    selected_because:
      description: Why the GPU was selected (with O(when_needed=true), the health reasons or the orphaned memory).
      type: list
      elements: str
      returned: always
    status:
      description:
        - V(reset) (done and verified), V(failed) (something went wrong after the module started to act),
          V(refused) (a precondition failed; nothing was touched), or in check mode V(would_reset).
      type: str
      returned: always
    would_reset:
      description: Whether every precondition passed.
      type: bool
      returned: always
    reset:
      description: Whether the GPU was reset and verified.
      type: bool
      returned: always
    preconditions:
      description: Every precondition with its C(name), C(status) (pass, fail, warn, not_exposed, not_applicable) and C(detail).
      type: list
      elements: dict
      returned: always
    processes:
      description: Processes that used the GPU at the check (pid, name, user, cmdline).
      type: list
      elements: dict
      returned: always
    blocking_clients:
      description: Known clients that block a reset (C(client), C(unit), pid, name, devices).
      type: list
      elements: dict
      returned: always
    would_kill:
      description: The processes O(kill_processes=true) terminates, as planned at the check.
      type: list
      elements: dict
      returned: always
    killed:
      description: The processes that were terminated, as gpufleet.reclaim.gpu_kill reports them.
      type: list
      elements: dict
      returned: always
    method:
      description: V(nvidia-smi), V(amdsmi), V(amd-smi), V(xpu-smi) or V(sysfs); V(null) when no reset ran.
      type: str
      returned: always
    command:
      description: The reset command as an argument list.
      type: list
      elements: str
      returned: always
    output:
      description: What the reset command printed.
      type: str
      returned: always
    persistence_mode:
      description: NVIDIA persistence mode C(before) the reset, whether it was C(switched_off), and whether it was C(restored).
      type: dict
      returned: always
    drain:
      description: Whether the drain was C(requested), C(enabled), C(restored), and the C(detail).
      type: dict
      returned: always
    before:
      description: Memory used, orphaned memory, health, processes and persistence mode before the reset.
      type: dict
      returned: always
    after:
      description: The same after the reset (V(null) when no reset ran).
      type: dict
      returned: always
    verified:
      description: Whether the GPU answered with health C(ok) and orphaned memory at most O(orphan_threshold_mib).
      type: bool
      returned: always
    seconds:
      description: Time spent on this GPU.
      type: float
      returned: always
    reset_at:
      description:
        - When the reset command ran (epoch seconds), V(null) when none ran. The Xid lines logged before it stay in the
          kernel log; health read after the reset leaves them out.
      type: float
      returned: always
    error:
      description: Why the GPU failed or was refused, with what to do.
      type: str
      returned: always
    kernel_modules:
      description: C(nvidia_drm), C(nvidia_modeset), C(nvidia_uvm) - C(module), C(loaded), C(refcnt), C(holders),
        C(explained) (open files of processes), C(references) (those that block), C(error). Empty for other vendors.
      type: list
      elements: dict
      returned: always
    mig:
      description:
        - V(null) unless the GPU is in MIG mode. C(destroys) - the MIG devices a reset destroys (C(gpu_instance_id),
          C(compute_instance_id), C(profile), C(uuid), C(processes)). C(layout) - with O(mig_reset=recreate), what is
          recreated (C(gi_profile_id), C(placement), C(ci_profile_id), ...). C(recreated) - the instances as the driver
          reports them after the re-creation. C(error) - why they could not be recreated as recorded.
      type: dict
      returned: always
    reboot_recommended:
      description: A reset cannot help (kernel references, the recovery action says reboot) or it failed - reboot the node.
      type: bool
      returned: always
    reboot_reason:
      description: Why a reboot is recommended, or V(null).
      type: str
      returned: always
  sample:
    - index: 1
      uuid: GPU-3a6588f9-70db-f709-499d-076dde68e602
      pci_bus_id: "00000000:0B:00.0"
      vendor: nvidia
      name: NVIDIA A100-SXM4-80GB
      selected_because: ["4096 MiB of GPU memory held by no process (orphan_threshold_mib 1024)"]
      status: reset
      would_reset: true
      reset: true
      preconditions:
        - {name: root, status: pass, detail: running as root}
        - {name: mig, status: pass, detail: MIG mode is off}
        - {name: nvlink, status: not_exposed, detail: "NVLink state: not exposed by this driver"}
      method: nvidia-smi
      command: [/usr/bin/nvidia-smi, --gpu-reset, -i, "00000000:0B:00.0"]
      persistence_mode: {before: true, switched_off: true, restored: true}
      before: {memory_used_mib: 4096, orphaned_mib: 4096}
      after: {memory_used_mib: 0, orphaned_mib: 0}
      verified: true
      error: null
disruptive:
  description:
    - The resets of this call and the services it stops, taken or in check mode predicted, in the shape of
      RV(gpufleet.reclaim.gpu_remediate#module:disruptive); the C(reset_unhealthy) playbook's plan pass reads them.
  returned: always
  type: list
  elements: dict
disruption:
  description: What gpufleet did to this node lately, as RV(gpufleet.reclaim.gpu_remediate#module:disruption) describes it.
  returned: always
  type: dict
reset_gpus:
  description: Indexes of the GPUs that were reset and verified (in check mode, that would be reset).
  returned: always
  type: list
  elements: int
  sample: [1]
failed_gpus:
  description: Indexes of the GPUs that failed or were refused; the task fails when this is not empty.
  returned: always
  type: list
  elements: int
  sample: []
services:
  description: The O(stop_services) that were C(stopped), C(not_active), C(started) again, and any C(errors).
  returned: always
  type: dict
seconds:
  description: Wall time of the module's work.
  returned: always
  type: float
msg:
  description: One-line summary; on failure it names each failed GPU and what to do.
  returned: always
  type: str
  sample: "reset 1 GPU(s): 1 (verified)"
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import disruption
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.budget import reset_disruptions
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.constants import REBOOT_FLAG_PATH, REMEDIATION_STATE_PATH
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.reset import ResetOptions, module_host, reset
from ansible_collections.gpufleet.reclaim.plugins.module_utils.gpu_module import (
    audit_log_option, gpu_options, finish, protection_options, reset_options, run_module)


def argument_spec():
    return dict(
        **gpu_options(), **protection_options(), **audit_log_option(), **reset_options(),
        all=dict(type='bool', default=False),
        when_needed=dict(type='bool', default=False),
        drain=dict(type='bool', default=False),
        mig_reset=dict(type='str', default='refuse', choices=['refuse', 'recreate']),
        state_path=dict(type='path', default=REMEDIATION_STATE_PATH),
    )


def build(params):
    """ResetOptions from the module parameters; raises InvalidArgument."""
    return ResetOptions(gpus=params['gpus'], all_gpus=params['all'], when_needed=params['when_needed'],
                        orphan_threshold_mib=params['orphan_threshold_mib'], kill_processes=params['kill_processes'],
                        kill_timeout=params['kill_timeout'], protect_names=params['protect_names'],
                        protect_users=params['protect_users'], stop_services=params['stop_services'], drain=params['drain'],
                        verify_timeout=params['verify_timeout'], vendor=params['vendor'], audit_path=params['audit_log'] or None,
                        mig_reset=params['mig_reset'])


def work(module):
    state_path = module.params['state_path'] or None
    if state_path and not state_path.startswith('/'):
        raise InvalidArgument('state_path', state_path, 'expected an absolute path (or empty to record nothing)')
    result = reset(build(module.params), module_host(module), check_mode=module.check_mode)
    planned, entries = reset_disruptions(result, time.time())
    result['disruptive'] = planned
    if not module.check_mode:
        problem = disruption.note(state_path, entries)
        if problem:
            result['warnings'] = result['warnings'] + [problem]
    # the node as the blast-radius limit reads it (core/disruption.py): what gpufleet did to it lately
    result['disruption'] = disruption.node_disruption(state_path, REBOOT_FLAG_PATH)
    return result


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    result = run_module(module, 'gpu_reset', work)
    finish(module, result, failed=bool(result['failed_gpus']))


if __name__ == '__main__':
    main()
