#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_facts
short_description: Gather facts about GPUs, the processes using them and other holders of GPU device files
version_added: 0.1.0
description:
  - Reads every GPU of the host through its vendor's interface (NVML for NVIDIA; amdsmi for AMD, else the amdgpu
    driver's sysfs and DRM fdinfo; sysfs and DRM fdinfo for Intel i915/xe, plus xpu-smi where installed; ioreg for
    Apple Silicon) in one pass and returns them as RV(ansible_facts.gpu), together with the processes the driver lists
    on them, joined with the host's process table (user, command line, container, Slurm job), and the processes that
    hold GPU device files open without being listed by the driver.
  - A vendor whose library is missing is not an error; RV(ansible_facts.gpu.backends) says why it is unavailable.
    A host without any GPU succeeds with empty lists unless O(fail_on_no_gpu=true).
  - Values the driver cannot tell are V(null), never V(0). Every vendor returns the same keys; what each vendor
    cannot tell (for example used memory on Intel without xpu-smi, or per-process memory on Apple Silicon) is listed
    in the collection's C(docs/vendors.md).
author:
  - gpufleet.reclaim developers (!UNKNOWN)
requirements:
  - psutil
  - nvidia-ml-py (for NVIDIA GPUs; without it the C(nvidia) backend reports itself unavailable)
  - amdsmi (for AMD GPUs; the Python library of the installed ROCm release; without it the amdgpu driver's sysfs is read)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.facts
  - gpufleet.reclaim._attributes
  - gpufleet.reclaim._attributes.FACTS_MODULE
  - gpufleet.reclaim._attributes.ACTIONGROUP_GPU
  - gpufleet.reclaim._attributes.DRIVER_TIMEOUT
  - gpufleet.reclaim._selection
attributes:
  platform:
    support: full
    platforms: posix
options:
  gather_processes:
    description:
      - Join the driver's process lists with the host's process table and scan open files for other holders
        of GPU device files.
      - When V(false), RV(ansible_facts.gpu.processes) and RV(ansible_facts.gpu.holders) are empty; each device
        still lists the pids the driver reports.
    type: bool
    default: true
  gpus:
    description:
      - Report only these GPUs, each given as a host-wide index (as in RV(ansible_facts.gpu.devices[].index))
        or as a UUID.
      - A value that matches no GPU of the host fails the task.
      - Omit to report every GPU.
  fail_on_no_gpu:
    description:
      - Fail when no GPU is found, naming each backend's reason.
    type: bool
    default: false
notes:
  - Run as root (C(become=true)) to see the processes and open files of other users; without privileges the
    driver may refuse the process lists, which is reported in the device's RV(ansible_facts.gpu.devices[].health.reasons).
    Intel and library-free AMD process lists come from other processes' DRM fdinfo, which only root can read.
  - Per-process utilization on AMD, Intel and Apple GPUs is measured between two readings a quarter of a second apart,
    so the first read of a task takes that much longer.
  - The NVIDIA driver reports process ids of the host's PID namespace. A listed process that is not visible here
    (the module runs in a container) has RV(ansible_facts.gpu.processes[].status=not_found).
seealso:
  - name: NVML API reference
    description: The NVIDIA Management Library that the NVIDIA backend reads.
    link: https://docs.nvidia.com/deploy/nvml-api/
"""

EXAMPLES = r"""
- name: Gather GPU facts
  gpufleet.reclaim.gpu_facts:

- name: Show memory use per GPU
  ansible.builtin.debug:
    msg: "GPU {{ item.index }} ({{ item.name }}): {{ item.memory_used_mib }} / {{ item.memory_total_mib }} MiB"
  loop: "{{ ansible_facts.gpu.devices }}"

- name: Gather facts about two GPUs only, without the process table
  gpufleet.reclaim.gpu_facts:
    gpus:
      - "0"
      - GPU-6f7c1b2e-0d4a-4e1b-9a43-2c1f0e5d7a11
    gather_processes: false

- name: Require an NVIDIA GPU
  gpufleet.reclaim.gpu_facts:
    vendor: nvidia
    fail_on_no_gpu: true
  become: true

- name: List GPUs holding memory that no process accounts for
  ansible.builtin.debug:
    msg: "{{ ansible_facts.gpu.devices | selectattr('orphaned_mib') | map(attribute='index') | list }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts to add to C(ansible_facts).
  returned: always
  type: dict
  contains:
    gpu:
      description: The GPUs of the host, the processes using them and the holders of GPU device files.
      returned: always
      type: dict
      contains:
        backends:
          description:
            - One entry per vendor (V(nvidia), V(amd), V(intel), V(apple)) saying whether its library could be used.
          returned: always
          type: dict
          contains:
            available:
              description: Whether the vendor library loaded and initialised.
              type: bool
              returned: always
              sample: true
            version:
              description: Driver version reported by the vendor library, V(null) when unknown.
              type: str
              returned: always
              sample: 550.54.15
            error:
              description: Why the backend is unavailable (or why reading it failed), else V(null).
              type: str
              returned: always
              sample: nvidia-ml-py (pynvml) is not installed
          sample:
            nvidia: {available: true, version: 550.54.15, error: null}
            amd: {available: false, version: null, error: amdsmi (the ROCm AMD SMI Python library) is not installed}
            intel: {available: false, version: null, error: no Intel GPU driven by the i915 or xe kernel driver was found}
            apple: {available: false, version: null, error: Apple GPUs exist only on macOS hosts (this host is linux)}
        devices:
          description: The GPUs (those selected by O(gpus)), in host-wide index order.
          returned: always
          type: list
          elements: dict
          contains:
            index:
              description:
                - Host-wide index, the position across vendors (NVIDIA first, then AMD, Intel, Apple).
                - Equals the C(nvidia-smi) index on hosts with NVIDIA GPUs only.
              type: int
              returned: always
              sample: 0
            vendor:
              description: Vendor of the GPU.
              type: str
              returned: always
              sample: nvidia
            vendor_index:
              description: Index of the GPU in its vendor library.
              type: int
              returned: always
              sample: 0
            uuid:
              description:
                - UUID of the GPU, V(null) when it cannot be read (a lost GPU, an Intel GPU without xpu-smi, an AMD GPU
                  read without amdsmi, an Apple GPU).
              type: str
              returned: always
              sample: GPU-6f7c1b2e-0d4a-4e1b-9a43-2c1f0e5d7a11
            name:
              description: Product name.
              type: str
              returned: always
              sample: NVIDIA A100-SXM4-80GB
            pci_bus_id:
              description: PCI bus id as the vendor library formats it (V(null) on Apple Silicon).
              type: str
              returned: always
              sample: 00000000:07:00.0
            memory_total_mib:
              description: Total memory in MiB; V(null) when the driver does not publish it (Apple Silicon's unified memory, integrated Intel GPUs).
              type: int
              returned: always
              sample: 81559
            memory_used_mib:
              description:
                - Used memory in MiB, excluding memory the driver reserves for itself when the driver reports it
                  separately (NVIDIA drivers 510 and later), as C(nvidia-smi) shows it.
                - V(null) when the driver does not publish it (mainline Intel drivers without xpu-smi).
              type: int
              returned: always
              sample: 30720
            memory_free_mib:
              description: Free memory in MiB.
              type: int
              returned: always
              sample: 50839
            utilization_pct:
              description: GPU (compute/graphics engine) utilization in percent.
              type: int
              returned: always
              sample: 97
            temperature_c:
              description: GPU temperature in degrees Celsius.
              type: int
              returned: always
              sample: 34
            power_w:
              description: Power draw in watts.
              type: float
              returned: always
              sample: 61.0
            power_limit_w:
              description: Enforced power limit in watts.
              type: float
              returned: always
              sample: 400.0
            orphaned_mib:
              description:
                - Used memory in MiB that no process listed by the driver accounts for (used memory minus the sum of
                  the listed processes' memory, never below 0), for example memory leaked after a crash, or held by
                  forked children that the driver no longer lists.
                - NVIDIA drivers use a few MiB per CUDA context that they charge to no process (8, 14 and 25 MiB with
                  1, 2 and 4 processes on an H200 with driver 580). Up to 16 MiB per listed process this reads as V(0);
                  above that the whole unattributed figure is returned.
                - V(null) when it cannot be computed (a process list could not be read, a process's memory is not
                  available, or the GPU is lost).
              type: int
              returned: always
              sample: 0
            health:
              description: Health of the GPU.
              type: dict
              returned: always
              contains:
                status:
                  description: V(ok), V(degraded) or V(lost) (the GPU stopped answering).
                  type: str
                  returned: always
                  sample: ok
                recommended_action:
                  description: V(none), V(reset), V(reboot) or V(drain) (take the GPU out of service).
                  type: str
                  returned: always
                  sample: none
                reasons:
                  description:
                    - Why the status is not V(ok), and readings that failed (for example a process list that the
                      driver refused without root).
                  type: list
                  elements: str
                  returned: always
                  sample: []
            processes:
              description: Pids the driver lists on this GPU (compute, graphics and MPS).
              type: list
              elements: int
              returned: always
              sample: [12345]
            xid_events:
              description:
                - The GPU's Xid errors (oldest first) from the kernel log (C(/dev/kmsg), needs root) and from the driver's
                  event API; V(null) when neither could be read. Only the driver's own records count (the kernel's facility,
                  the driver's exact prefix, a GPU of this node). At most 32 are kept - per remediation class the newest
                  (reboot 4, drain 4, reset 8, kill_app 12, none 4), so milder events never push out a severe one. See the
                  collection's docs/health.md.
                - Each has C(time) (epoch seconds), C(code), C(pid) and C(name) (the process the kernel line names, else
                  V(null)), C(pci_bus_id), C(message), C(source) (V(kmsg) or V(nvml)), C(fault) (V(application), V(gpu),
                  V(driver), V(system) or V(unknown)) and C(action) (V(none), V(kill_app), V(reset), V(drain) or V(reboot)).
              type: list
              elements: dict
              returned: always
              sample:
                - time: 1767225600.5
                  code: 79
                  pid: null
                  name: null
                  pci_bus_id: "0000:3b:00"
                  message: GPU has fallen off the bus.
                  source: kmsg
                  fault: gpu
                  action: reboot
            recovery_action:
              description:
                - What the driver's GPU recovery action field asks for (NVIDIA driver R550 and later), V(null) when the driver
                  cannot tell.
              type: str
              returned: always
              sample: none
              choices: [none, reset, reboot, drain_p2p, drain_and_reset, recover_imex_domain, bus_reset, system_reboot]
            health_reasons:
              description:
                - The findings behind C(health) as stable tokens, for programs (C(health.reasons) has the sentences), for
                  example V(xid_79), V(recovery_action_reboot), V(gpu_lost), V(ecc_uncorrected), V(remapped_rows_pending).
              type: list
              elements: str
              returned: always
              sample: [xid_79]
            mig_mode:
              description: Whether the GPU is in MIG mode (NVIDIA), V(null) when the driver cannot tell (other vendors).
              type: bool
              returned: always
            mig_devices:
              description:
                - V(null) unless C(mig_mode) is true; then the MIG devices (a GPU instance and its compute instance), each
                  with C(index), C(gpu_instance_id), C(compute_instance_id), C(profile) (V(3g.71gb)), C(uuid)
                  (V(MIG-...)), C(placement) (C(start), C(size) in memory slices), C(memory_total_mib),
                  C(memory_used_mib), C(memory_free_mib), C(orphaned_mib) and C(processes) (pids).
                - A MIG device's memory is part of the board's C(memory_used_mib), never added to it a second time.
                - Without root the driver refuses a MIG board's aggregate memory and process lists - the board's memory
                  figures stay V(null) (C(health.reasons) says so) and its C(processes) are those of its MIG devices.
              type: list
              elements: dict
              returned: always
              sample: [{index: 0, gpu_instance_id: 1, compute_instance_id: 0, profile: 3g.71gb,
                        uuid: MIG-2ac4c716-946e-555e-acde-a78bd9e865db, placement: {start: 0, size: 4},
                        memory_total_mib: 71680, memory_used_mib: 6144, memory_free_mib: 65536, orphaned_mib: 0,
                        processes: [4242, 4243]}]
        processes:
          description:
            - Processes the driver lists on the selected GPUs, one entry per pid, joined with the host's process table.
            - Empty when O(gather_processes=false).
          returned: always
          type: list
          elements: dict
          contains:
            pid:
              description: Process id as the driver reports it.
              type: int
              returned: always
              sample: 12345
            gpu_indexes:
              description: Host-wide indexes of the GPUs the process uses.
              type: list
              elements: int
              returned: always
              sample: [0]
            used_mib:
              description: GPU memory used by the process, summed over its GPUs, in MiB; V(null) when not available.
              type: int
              returned: always
              sample: 4096
            user:
              description: Owner of the process.
              type: str
              returned: always
              sample: alice
            uid:
              description: Real user id of the process.
              type: int
              returned: always
              sample: 1000
            name:
              description: Process name.
              type: str
              returned: always
              sample: python
            cmdline:
              description: Command line, V(null) when it cannot be read.
              type: list
              elements: str
              returned: always
              sample: [python, train.py]
            create_time:
              description: Start time of the process, in seconds since the epoch.
              type: float
              returned: always
              sample: 1767225600.52
            status:
              description:
                - Process state as psutil names it (V(running), V(sleeping), V(disk-sleep), V(zombie), ...).
                - V(not_found) when the driver lists a pid that this PID namespace does not see.
              type: str
              returned: always
              sample: sleeping
            container:
              description:
                - The container the process runs in, from the root-owned part of its cgroup path, else V(null). A cgroup that
                  a user created (systemd delegation, anything under a user slice, so a rootless container too) names nothing.
                - C(id) is the container id, C(runtime) one of V(docker), V(containerd), V(cri-o), V(podman) or
                  V(null) when the cgroup path does not name it, C(pod_uid) the Kubernetes pod UID or V(null).
              type: dict
              returned: always
              sample: {id: 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef, runtime: containerd,
                       pod_uid: 6f1c3c2a-7d1e-4a53-9a3b-2f7c8d9e0a1b}
            slurm_job:
              description: Slurm job id from the root-owned part of the process's cgroup path, else V(null).
              type: str
              returned: always
              sample: "4242"
            mig:
              description:
                - The MIG device the driver lists the process on (C(gpu_instance_id), C(compute_instance_id), C(uuid)), from
                  NVML's per-process instance ids or the MIG device's process list, V(null) when it runs on no MIG device.
              type: dict
              returned: always
              sample: {gpu_instance_id: 1, compute_instance_id: 0, uuid: MIG-2ac4c716-946e-555e-acde-a78bd9e865db}
        driver_hung:
          description:
            - V(null), or the driver call that did not return within O(driver_timeout) (the task then fails with it),
              with C(call), C(vendor), C(gpu) (the vendor's index of the GPU being read, V(null) outside a per-GPU call),
              C(pci_bus_id), C(timeout_s) and C(message).
          returned: always
          type: dict
          sample: null
        holders_incomplete:
          description:
            - V(null) when the holder scan read the open files of every process (that it may read); else what its bound
              left. The scan reads at most 131,072 descriptors and starts no process after 3 s, so that descriptors users
              open (any user can hold millions) cannot make it run on; the driver's processes are read first, then
              the others, the largest fd tables left first. A GPU device file held by a process it left is not in
              RV(ansible_facts.gpu.holders). The task warns with what was left.
            - C(reason) (C(descriptors), C(large tables) or C(time)), C(processes) (how many were left), C(descriptors) (their open files
              in all, where known), C(largest) (the largest ten, each C(pid), C(fds), C(user)), C(read) (descriptors
              read), C(limit) and C(seconds) (the bounds).
          returned: always
          type: dict
          sample: {reason: large tables, processes: 50, descriptors: 999500, read: 612, limit: 131072, seconds: 3.0,
                   largest: [{pid: 4242, fds: 19990, user: mallory}]}
        disruption:
          description:
            - What gpufleet did to this node lately (the blast-radius limit's reading, shown by the C(inventory_report)
              playbook) - C(drained) (the remediation ladder's own drain, its C(reason), C(via) and C(ago_s)),
              C(reboot_flag) (this boot's flag, its C(time) and C(gpus)), C(scheduler) (Slurm's drain of the node for a
              gpufleet reason, read only where a root-vouched slurmd runs), C(actions) (the newest disruptive actions
              gpufleet took - a reset, a drain, a reboot flag, a stopped service - each C(action), C(gpu), C(time),
              C(ago_s) by this node's clock, C(by), C(detail)) and C(errors) (what could not be read; root reads it all).
          returned: always
          type: dict
          sample: {drained: null, reboot_flag: null, scheduler: null, errors: [],
                   actions: [{action: reset, gpu: GPU-3a6588f9-70db-f709-499d-076dde68e602, time: 1767225600.0, ago_s: 312.4,
                              by: remediate, detail: Xid 48 (gpu fault)}]}
        holders:
          description:
            - Processes that hold a GPU device file (C(/dev/nvidia*), C(/dev/dri/*), C(/dev/kfd)) open but are not listed
              by the driver, for example forked workers that inherited a CUDA context, or monitoring daemons.
            - Only processes whose open files can be read are seen; run as root to see everyone's.
            - Within the holder scan's bound; RV(ansible_facts.gpu.holders_incomplete) says what it left.
            - Empty when O(gather_processes=false).
          returned: always
          type: list
          elements: dict
          contains:
            pid:
              description: Process id.
              type: int
              returned: always
              sample: 12346
            user:
              description: Owner of the process.
              type: str
              returned: always
              sample: alice
            name:
              description: Process name.
              type: str
              returned: always
              sample: python
            cmdline:
              description: Command line, V(null) when it cannot be read.
              type: list
              elements: str
              returned: always
              sample: [python, -c, worker]
            devices:
              description: The GPU device files the process holds open.
              type: list
              elements: str
              returned: always
              sample: [/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import watchdog
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.disruption import node_disruption
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.fdwalk import incomplete_text
from ansible_collections.gpufleet.reclaim.plugins.module_utils.gpu_module import gpu_options, run_module


def argument_spec():
    return dict(
        gpu_options(),
        gather_processes=dict(type='bool', default=True),
        fail_on_no_gpu=dict(type='bool', default=False),
    )


def no_gpu_message(facts):
    reasons = []
    for name, status in facts['backends'].items():
        if status['available']:
            reasons.append('%s: no GPU found' % name)
        else:
            reasons.append('%s: %s' % (name, status['error']))
    return 'No GPU found on this host (%s)' % '; '.join(reasons)


def gather(module):
    params = module.params
    return take_snapshot(vendor=params['vendor'], gpus=params['gpus'], gather_processes=params['gather_processes'],
                         driver_timeout=watchdog.check_timeout('driver_timeout', params['driver_timeout']))


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    snapshot = run_module(module, 'gpu_facts', gather)
    for warning in snapshot.unreadable:
        module.warn(warning)
    if snapshot.holders_incomplete is not None:
        module.warn(incomplete_text(snapshot.holders_incomplete))
    facts = snapshot.to_facts()
    facts['disruption'] = node_disruption()
    if module.params['fail_on_no_gpu'] and not snapshot.all_devices:
        module.fail_json(msg=no_gpu_message(facts), ansible_facts=dict(gpu=facts))

    module.exit_json(changed=False, ansible_facts=dict(gpu=facts))


if __name__ == '__main__':
    main()
