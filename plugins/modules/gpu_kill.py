#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_kill
short_description: Safely terminate GPU processes and verify that their GPU memory comes back
version_added: 0.1.0
description:
  - Selects GPU processes by pid, GPU, user, name, command line, memory, age, idleness or orphan state (a process
    must match every selector given), never touches protected processes, signals the selected processes in
    parallel, escalates to SIGKILL only with O(force=true), and then waits until the driver shows their GPU
    memory as free.
  - Each target is identified at discovery by its pid and its start time. Immediately before each signal the
    module checks that the pid still names that process (with a pidfd on Linux 5.3+ and Python 3.9+), so a
    reused pid is skipped, never signalled.
  - A call without any selector fails; O(gpus) and O(exclude_users) only narrow a selection. To empty whole
    GPUs, for example before a reset, use O(all_on_gpus=true).
  - Every run that signals something is appended to a hash-chained JSON Lines log on the node (O(audit_log), which
    V(none) also disables), with the selectors and options; command lines in it are redacted like RV(killed[].cmdline).
author:
  - gpufleet.reclaim developers (!UNKNOWN)
requirements:
  - psutil
  - nvidia-ml-py (for NVIDIA GPUs)
  - amdsmi (for AMD GPUs)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpufleet.reclaim._attributes
  - gpufleet.reclaim._attributes.ACTIONGROUP_GPU
  - gpufleet.reclaim._attributes.DRIVER_TIMEOUT
  - gpufleet.reclaim._attributes.ROGUE_DETECTOR
  - gpufleet.reclaim._selection
  - gpufleet.reclaim._protection
  - gpufleet.reclaim._audit_log
attributes:
  check_mode:
    support: full
    details:
      - Check mode runs the whole selection and protection logic and returns in RV(killed) exactly the processes
        a real run would signal, without sending any signal. RV(killed[].signals) then lists the signals a real run
        would send (V(SIGKILL) only with O(force=true), for a process that outlives O(timeout)).
      - With O(idle_for), check mode still records one utilization sample per GPU process in O(utilization_history),
        so that idleness can be measured without killing anything.
  diff_mode:
    support: full
    details:
      - The diff lists the selected processes (pid, user, command line) before, and after the ones still running
        (skipped and failed ones).
  idempotent:
    support: full
    details:
      - A second run with the same selectors finds nothing left to signal and reports no change.
  platform:
    support: full
    platforms: posix
options:
  pids:
    description: Select these process ids.
    type: list
    elements: int
  gpus:
    description:
      - Only processes on these GPUs, each a host-wide index (see gpufleet.reclaim.gpu_facts) or a UUID.
      - On a GPU in MIG mode, a MIG device's UUID (V(MIG-...)) or V(GPU:GI) (V(0:1), or V(0:1:0) with the compute
        instance) selects only the processes the driver lists on that MIG device.
      - A value that matches no GPU fails the task before anything is signalled.
  users:
    description: Only processes of these users (login names).
    type: list
    elements: str
  exclude_users:
    description: Never select processes of these users.
    type: list
    elements: str
  name:
    description:
      - Only processes whose name matches this Python regular expression (searched, not anchored).
      - Patterns longer than 512 characters and nested quantifiers such as V((a+\)+) are rejected.
    type: str
  cmdline:
    description: Only processes whose command line, joined with spaces, matches this Python regular expression (searched).
    type: str
  min_used_mib:
    description: Only processes that hold at least this much GPU memory (MiB).
    type: int
  idle_for:
    description:
      - Only processes that hold GPU memory while their GPU utilization stayed at or below O(idle_util_pct) for at least
        this long, for example V(30m) or V(2h).
      - Idleness is sampled. Each gpu_kill run with O(idle_for), check mode included, records one utilization sample
        per GPU process in O(utilization_history), the usage history that the guard (role C(gpufleet.reclaim.guard))
        also writes at every tick, so on a node that runs the guard its samples count as well. A process is idle since
        the oldest sample of the unbroken run of idle samples that ends with the current one; an unknown sample breaks
        the run. This is the same idleness rule as the guard policy's C(idle) rule, with O(idle_util_pct) as the
        threshold and no memory floor or gap limit. The per-process figure is the
        driver's own per-process utilization (for NVIDIA the highest SM utilization in NVML's process utilization
        samples of the last 10 seconds; no sample means 0) where the driver has one, else the GPU's utilization when
        the process is alone on it; otherwise it is unknown and the process is never called idle.
      - So the first run only starts the clock. Run gpu_kill periodically (in check mode to only sample), at an
        interval short compared to O(idle_for), because a process idle at two consecutive samples counts as idle in between.
    type: str
  idle_util_pct:
    description: The utilization (percent) at or below which a sample counts as idle.
    type: int
    default: 5
  older_than:
    description: Only processes that have been running for at least this long, for example V(12h).
    type: str
  orphans:
    description:
      - Select processes that hold GPU device files (C(/dev/nvidia*), C(/dev/dri/*), C(/dev/kfd)) while the driver
        does not list them, such as children left behind by a dead parent.
    type: bool
    default: false
  rogue:
    description:
      - Select processes that the rogue (crypto-miner) detector classifies at or above O(rogue_min_level).
      - This is the detector of gpufleet.reclaim.gpu_audit, with its built-in rules plus O(rules_file) and O(rules) (the
        same site rules and allowlist that gpu_audit was given). The findings of that very detection, every level with their
        evidence, come back in RV(findings) (in check mode too), so gpu_audit need not run first.
        V(critical) needs a hard indicator such as a stratum URL, miner options, a wallet address or a pool connection.
      - Utilization and memory samples are read from the usage history O(history_path) when it exists, and O(require_allocation)
        decides whether GPU use outside any job or container counts, exactly as in gpufleet.reclaim.gpu_audit, so that both
        modules reach the same findings.
    type: bool
    default: false
  rogue_min_level:
    description: The lowest rogue level that O(rogue=true) selects.
    type: str
    default: critical
    choices: [info, medium, high, critical]
  rules_file:
    description:
      - For O(rogue=true), a YAML rules file on the node with extra pools, miner names, custom rules and the allowlist, as
        in O(gpufleet.reclaim.gpu_audit#module:rules_file) (schema in C(docs/rogue-detection.md)). An allowlisted process
        is never selected.
      - Validated before anything is read or signalled; an error names the file, the line and the field. Only used with
        O(rogue=true); given without it, the task fails.
    type: path
  rules:
    description: The same content as O(rules_file), inline; applied after O(rules_file). Only used with O(rogue=true).
    type: dict
  all_on_gpus:
    description: Select every process on the GPUs named in O(gpus), for example to drain them before a reset.
    type: bool
    default: false
  signal:
    description: The first signal to send.
    type: str
    default: TERM
    choices: [TERM, INT, HUP, QUIT, KILL, USR1, USR2]
  timeout:
    description: Seconds to wait for the processes to exit after O(signal). Must not be negative.
    type: float
    default: 10
  force:
    description:
      - Send SIGKILL to processes still running after O(timeout). Without it, survivors are reported in
        RV(failed_processes) and the task fails.
    type: bool
    default: false
  tree:
    description: Also terminate the children of each selected process (collected before the first signal).
    type: bool
    default: true
  max_kills:
    description:
      - Signal at most this many processes; the rest of the selection is left alone and reported in
        RV(held_processes). The processes with the most GPU memory go first, a process and the children collected with
        it (O(tree)) together; once a family does not fit, it and every later one are held.
      - The playbooks C(rogue_cleanup) and C(reclaim_idle) give each node its share of C(reclaim_max_kills) (the
        blast-radius limit, see the collection's C(docs/fleet-tuning.md)). Omit for no limit.
    type: int
  release_timeout:
    description:
      - Seconds to wait, after the processes exit, for the driver to show their memory as free. Must not be negative.
      - Memory still held then is reported in RV(unreleased) with the likely cause.
    type: float
    default: 15
  utilization_history:
    description:
      - Absolute path of the SQLite usage history on the node that keeps the utilization samples for O(idle_for);
        by default the guard's (its C(history_path)), created (mode 0600) when missing. Concurrent runs and guard
        ticks write it in transactions.
      - An empty value or V(none) disables it; O(idle_for) then fails.
      - Earlier releases kept a JSON file, C(/var/lib/gpufleet/utilization.json); it is not read any more (the
        idle clocks start again), and a path that names such a file is refused with a warning.
    type: path
    default: /var/lib/gpufleet/history.db
notes:
  - Never signalled, whatever the selectors say, in check mode or not - pid 0 and 1, the module's own process, its
    ancestors and its session, kernel threads, processes named in O(protect_names), processes of O(protect_users),
    and, for a non-root caller, processes of other users.
  - A pid that the driver lists but that is not visible in the module's PID namespace (a container without
    C(--pid=host)) is never signalled, and a visible pid that holds no GPU device file is skipped as a likely
    pid-namespace collision. Both are reported in RV(skipped_processes) with the reason.
  - A process that exits by itself during the run counts as killed, not as an error.
seealso:
  - module: gpufleet.reclaim.gpu_facts
"""

EXAMPLES = r"""
- name: Kill everything bob runs on GPUs, escalating to SIGKILL after 10 seconds
  gpufleet.reclaim.gpu_kill:
    users: [bob]
    force: true
  become: true

- name: Show what would be reclaimed from idle holders of at least 10 GiB
  gpufleet.reclaim.gpu_kill:
    idle_for: 2h
    min_used_mib: 10240
    exclude_users: [svc-inference]
  check_mode: true
  register: idle

- name: Empty GPUs 2 and 3 before a reset
  gpufleet.reclaim.gpu_kill:
    gpus: ["2", "3"]
    all_on_gpus: true
    force: true
    timeout: 30
  become: true

- name: Kill processes named like xmrig wherever they hide, and orphans holding GPU devices
  gpufleet.reclaim.gpu_kill:
    name: "^(xmrig|t-rex|lolMiner)$"
    force: true
  become: true
"""

RETURN = r"""
killed:
  description:
    - The processes that were signalled and exited, and those that exited by themselves during the run (with
      RV(killed[].reason) saying so and no signal). In check mode, the processes a real run would signal.
    - Children collected with O(tree=true) carry RV(killed[].parent_pid).
  returned: always
  type: list
  elements: dict
  contains:
    pid:
      description: Process id.
      type: int
      returned: always
    user:
      description: Owner (login name of the real user id).
      type: str
      returned: always
    name:
      description: Process name.
      type: str
      returned: always
    cmdline:
      description:
        - Command line, redacted with the default patterns of the guard's policy (C(notify.redact_patterns) in the
          collection's C(docs/policy.md)). Passwords, tokens, keys and URL credentials become C(<redacted>). When a secret
          is in the argument after its option (C(--password X)), the list holds one element, the whole redacted command
          line. The same goes to O(audit_log).
      type: list
      elements: str
      returned: always
    gpu_indexes:
      description: Host-wide indexes of the GPUs the process used.
      type: list
      elements: int
      returned: always
    used_mib:
      description: GPU memory the process held (MiB), V(null) when unknown.
      type: int
      returned: always
    signals:
      description: Signals sent, in order, for example V([SIGTERM, SIGKILL]); in check mode the signals a real run would send.
      type: list
      elements: str
      returned: always
    seconds_to_exit:
      description: Seconds from the first signal until the process was gone.
      type: float
      returned: always
    seconds_to_release:
      description: Seconds from the start of the release check until the driver showed the memory of its GPUs as free.
      type: float
      returned: always
    selected_because:
      description: Why the process was selected.
      type: list
      elements: str
      returned: always
    reason:
      description: Notes, for example that the process exited by itself.
      type: str
      returned: always
    parent_pid:
      description: The selected process this child was collected under (O(tree=true)).
      type: int
      returned: for children collected with O(tree=true)
  sample:
    - pid: 41234
      user: bob
      name: python
      cmdline: [python, train.py]
      gpu_indexes: [0]
      used_mib: 12288
      signals: [SIGTERM]
      seconds_to_exit: 0.21
      seconds_to_release: 0.4
      selected_because: [user bob]
      reason: null
skipped_processes:
  description:
    - Processes that matched the selectors but were not signalled, with RV(killed[].reason) saying why (protected, a
      reused pid, not visible in this PID namespace, not permitted for a non-root caller).
    - Entries have the same keys as RV(killed).
    - Not called C(skipped), which is Ansible's own key for a skipped task.
  returned: always
  type: list
  elements: dict
  sample:
    - pid: 2211
      user: root
      name: nv-hostengine
      cmdline: [nv-hostengine]
      gpu_indexes: [0]
      used_mib: 300
      signals: []
      seconds_to_exit: null
      seconds_to_release: null
      selected_because: [on GPU 0 (all_on_gpus)]
      reason: protected name nv-hostengine (protect_names)
held_processes:
  description:
    - "Processes that matched the selectors but were left alone because O(max_kills) was reached, with
      RV(killed[].reason) saying so (C(held: blast-radius limit ...)). Entries have the same keys as RV(killed)."
  returned: always
  type: list
  elements: dict
failed_processes:
  description:
    - Processes that were signalled but are still running, with the reason (SIGTERM ignored without O(force), D state,
      signal refused). Entries have the same keys as RV(killed).
    - When it is not empty the task fails. Not called C(failed), which is Ansible's own key for a failed task.
  returned: always
  type: list
  elements: dict
unmatched:
  description:
    - Each request that led nowhere, with why. A pid of O(pids) that selected nothing (it does not exist here, it is
      not a GPU process, it holds a GPU device file the driver does not list, or it does not match the other
      selectors; a protected pid says so too), a user of O(users) that selected nothing (unknown on this node, no GPU
      process here, or none matching the other selectors), or, when nothing was selected at all and no pid or user
      explains it, the selection as a whole.
    - A pid that does not exist or is not a GPU process, and a user this node does not know, are also reported as
      warnings; the task does not fail for them (on a fleet, user databases and running processes differ per node, and
      a pid that is gone is what a kill wants). A user who exists but has no GPU process here is no warning.
  returned: always
  type: list
  elements: dict
  contains:
    request:
      description: What was asked for.
      type: str
      choices: [pid, user, selection]
    value:
      description: The pid, the user name, or (for C(selection)) the selectors as given.
      type: raw
    reason:
      description: Why it selected nothing.
      type: str
  sample:
    - request: pid
      value: 99999
      reason: no process with pid 99999 exists here (it has exited, or never existed)
    - request: user
      value: nosuchuser
      reason: no user nosuchuser exists on this node (checked with the system user database)
unchecked:
  description:
    - V(null), or the processes of the selection whose open files this run did not read before signalling them, because
      the check (does the driver's pid hold a GPU device file here, so that it is not another PID namespace's process)
      reads at most one whole table of the kernel's default C(fs.nr_open) (1,048,576 descriptors) per run. They are in
      RV(skipped_processes) with the reason; the next run checks them again.
    - C(reason), C(processes), C(descriptors) (their open files in all, where known), C(largest) (pid and fds of the
      largest), C(read) (descriptors read), C(limit) and C(seconds) (the bounds).
  returned: always
  type: dict
  sample: null
freed_mib:
  description: MiB freed per GPU (keys are host-wide GPU indexes as strings), measured through the driver.
  returned: always
  type: dict
  sample: {"0": 12288}
release:
  description:
    - Per GPU whose processes exited (keys are host-wide GPU indexes as strings), the outcome of the release check.
    - C(released) is V(true) once the driver listed none of the exited processes and its used memory had dropped by what
      they held; C(seconds) is how long that took after the release check started; C(freed_mib) and C(unreleased_mib)
      are MiB.
  returned: always
  type: dict
  sample: {"0": {"released": true, "seconds": 0.41, "freed_mib": 12288, "unreleased_mib": 0}}
unreleased:
  description: GPUs whose memory did not come back within O(release_timeout), with the MiB still held and the likely cause.
  returned: always
  type: list
  elements: dict
  sample:
    - gpu: 1
      unreleased_mib: 4096
      cause: "no process holds the GPU device any more: the driver kept the memory (a leak, or a slow release);
        gpufleet.reclaim.gpu_reset clears it"
findings:
  description:
    - With O(rogue=true), every finding of the rogue detector run that made the selection (every level, from V(info) up,
      holders that the driver does not list included), with the same keys and evidence as
      RV(gpufleet.reclaim.gpu_audit#module:findings); RV(killed) holds those at or above O(rogue_min_level) that were
      signalled (in check mode, those that would be).
    - So one call audits, kills and verifies the release (the C(rogue_cleanup) playbook does that). The findings, the
      kills and the release proof come from one snapshot, and there is no gap between an audit and the kill.
  returned: with O(rogue=true)
  type: list
  elements: dict
rogue_summary:
  description:
    - With O(rogue=true), the number of RV(findings) per level, C(allowlisted), C(total) and C(evaluated) (the processes
      examined), as RV(gpufleet.reclaim.gpu_audit#module:summary).
  returned: with O(rogue=true)
  type: dict
  sample: {"critical": 1, "high": 0, "medium": 0, "info": 3, "allowlisted": 0, "total": 4, "evaluated": 7}
unreleased_mib:
  description: Total MiB not released.
  returned: always
  type: int
seconds:
  description: Wall time of the module's work, from the snapshot to the confirmed release.
  returned: always
  type: float
msg:
  description: One-line summary.
  returned: always
  type: str
  sample: killed 2 process(es), skipped 0, failed 0; freed 24576 MiB
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.constants import HISTORY_PATH, ROGUE_LEVELS
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.reclaim import SIGNALS, ReclaimOptions, reclaim
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.select import Selector
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.text import printable
from ansible_collections.gpufleet.reclaim.plugins.module_utils.gpu_module import (
    audit_log_option, finish, gpu_options, invalid_rules, protection_options, run_module)


def argument_spec():
    # require_allocation and history_path (for rogue=true): detector_argument_spec(), as in gpu_audit
    return dict(
        rogue.detector_argument_spec(), **gpu_options(), **protection_options(), **audit_log_option(),
        pids=dict(type='list', elements='int'),
        users=dict(type='list', elements='str'),
        exclude_users=dict(type='list', elements='str'),
        name=dict(type='str'),
        cmdline=dict(type='str'),
        min_used_mib=dict(type='int'),
        idle_for=dict(type='str'),
        idle_util_pct=dict(type='int', default=5),
        older_than=dict(type='str'),
        orphans=dict(type='bool', default=False),
        rogue=dict(type='bool', default=False),
        rogue_min_level=dict(type='str', default='critical', choices=list(ROGUE_LEVELS)),
        rules_file=dict(type='path'),
        rules=dict(type='dict'),
        all_on_gpus=dict(type='bool', default=False),
        signal=dict(type='str', default='TERM', choices=list(SIGNALS)),
        timeout=dict(type='float', default=10.0),
        force=dict(type='bool', default=False),
        tree=dict(type='bool', default=True),
        release_timeout=dict(type='float', default=15.0),
        max_kills=dict(type='int'),
        utilization_history=dict(type='path', default=HISTORY_PATH),
    )


def rogue_config(params):
    """The detector's rules for O(rogue=true): None (built-ins) or the validated rules; raises RulesError."""
    for field in ('rules_file', 'rules'):
        if params.get(field) and not params['rogue']:
            raise InvalidArgument(field, params[field], 'only used with rogue=true')
    if not (params.get('rules_file') or params.get('rules')):
        return None
    return rogue.load_config(rules_file=params['rules_file'], rules=params['rules'])


def build(params, report=None):
    """Validate every option before anything is read or signalled; raises InvalidArgument naming the field.

    ``report``, a dict, receives the rogue detector's findings, summary and warnings of the run (rogue=true)."""
    config = rogue_config(params)
    detector = rogue.selector_detector(config=config, report=report, **rogue.detector_options(params))
    selector = Selector(pids=params['pids'], gpus=params['gpus'], users=params['users'], exclude_users=params['exclude_users'],
                        name=params['name'], cmdline=params['cmdline'], min_used_mib=params['min_used_mib'],
                        idle_for=params['idle_for'], idle_util_pct=params['idle_util_pct'], older_than=params['older_than'],
                        orphans=params['orphans'], rogue=params['rogue'], rogue_min_level=params['rogue_min_level'],
                        all_on_gpus=params['all_on_gpus'], rogue_detector=detector)
    options = ReclaimOptions(signal=params['signal'], timeout=params['timeout'], force=params['force'], tree=params['tree'],
                             release_timeout=params['release_timeout'], protect_names=params['protect_names'],
                             protect_users=params['protect_users'], vendor=params['vendor'],
                             audit_path=params['audit_log'], history_path=params['utilization_history'],
                             driver_timeout=params.get('driver_timeout'), max_kills=params['max_kills'])
    return selector, options


def _line(entry):
    """One process in the diff (shown as it is by Ansible's diff output: escaped; the command line is redacted)."""
    return printable('%s %s %s' % (entry['pid'], entry.get('user'), ' '.join(entry.get('cmdline') or []) or entry.get('name') or ''))


def diff(result):
    """Before: every selected process; after: the ones still running (failed and skipped)."""
    still = result['failed_processes'] + result['skipped_processes'] + result['held_processes']
    before = sorted(_line(e) for e in result['killed'] + still)
    after = sorted(_line(e) for e in still)
    return {'before': ''.join(line + '\n' for line in before), 'after': ''.join(line + '\n' for line in after),
            'before_header': 'selected GPU processes', 'after_header': 'selected GPU processes still running'}


def module_result(result):
    """The core's result with Ansible-safe names: ``failed`` and ``skipped`` are Ansible's own task
    status keys (a non-empty list would mark the task failed or skipped, and callbacks hide them)."""
    result = dict(result)
    result['skipped_processes'] = result.pop('skipped')
    result['failed_processes'] = result.pop('failed')
    result['held_processes'] = result.pop('held')
    return result


def work(module):
    report = {}
    selector, options = build(module.params, report=report)
    # reclaim() selects (resolving gpus, failing on an unknown one) before anything is signalled.
    result = module_result(reclaim(selector, options, check_mode=module.check_mode))
    if module.params['rogue']:
        # the findings of the detection that selected the processes: one call audits, kills and proves the release
        result['findings'] = report.get('findings', [])
        result['rogue_summary'] = report.get('summary', {})
        result['warnings'] = result['warnings'] + [w for w in report.get('warnings', []) if w not in result['warnings']]
    return result


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    # rogue.RulesError is looked up only when the call failed: the rules-file loader is imported only with rules
    result = run_module(module, 'gpu_kill', work, errors=lambda: ((rogue.RulesError, invalid_rules),))
    release_timeout = module.params['release_timeout']
    result['warnings'] = result.get('warnings', []) + [
        '%d MiB on GPU %s did not come back within %s s: %s' % (entry['unreleased_mib'], entry['gpu'], release_timeout, entry['cause'])
        for entry in result['unreleased']]
    if module._diff:
        result['diff'] = diff(result)
    finish(module, result, failed=bool(result['failed_processes']))


if __name__ == '__main__':
    main()
