#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_audit
short_description: Find rogue GPU processes such as crypto-miners, with evidence, and report GPU usage history
version_added: 0.1.0
description:
  - Examines every process that uses a GPU (and every process holding a GPU device file) with the rogue detector and
    returns one finding per suspicious process - who, which GPU, how much memory, a score from 0 to 100, a level
    (V(critical), V(high), V(medium) or V(info)) and every rule that fired with its concrete evidence (the matched
    argument, wallet address, pool address and port, executable path).
  - Indicators come in three kinds. Hard ones (a stratum URL, a set of miner options, a wallet address as a user option, a
    known pool host, a connection to a pool) are what miners cannot do without. Soft ones (a miner binary name, an
    algorithm option, a process that claims to be Python but runs another executable, an executable that was deleted or
    lives in C(/tmp), C(/dev/shm) or a hidden directory, miner environment variables, GPU use outside any Slurm job or
    container on a host that uses them) are suspicious. Behavioural ones (flat 95%+ utilization over a long window, flat
    memory, no ML library mapped, started by a web server, cron or C(curl | sh)) are weak and capped.
  - V(critical) needs a hard indicator. V(high) needs a hard indicator or several soft ones. Behavioural indicators alone
    never go beyond V(medium). The rules, their weights and the scoring are documented in C(docs/rogue-detection.md).
  - Operators add pools, miner names, custom rules and an allowlist in a YAML O(rules_file) or inline in O(rules).
    Allowlist entries match by executable path plus SHA-256, by user plus a command line pattern, or by container image;
    never by a process name or a user alone. An allowlisted process is reported at level V(info) with RV(findings[].allowlisted).
  - With O(history=true) the module also reports GPU usage from the usage history that the guard records on the node
    (GPU-hours, idle GPU-hours and peak memory per user, the top processes, per-GPU figures) over the last O(hours), and
    GPU-hour accounting - busy and idle GPU-hours per user, per Slurm job and per GPU (C(accounting) of RV(report); the
    P(gpufleet.reclaim.accounting_csv#filter) filter turns it into CSV on the controller).
  - The module never changes anything on the node except appending to O(log_path) and sending to syslog, which it does not
    do in check mode.
author:
  - gpufleet.reclaim developers (!UNKNOWN)
requirements:
  - psutil
  - PyYAML (only for O(rules_file))
  - nvidia-ml-py (for NVIDIA GPUs)
  - amdsmi (for AMD GPUs)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpufleet.reclaim._attributes
  - gpufleet.reclaim._attributes.ACTIONGROUP_GPU
  - gpufleet.reclaim._attributes.DRIVER_TIMEOUT
  - gpufleet.reclaim._attributes.ROGUE_DETECTOR
  - gpufleet.reclaim._selection
attributes:
  check_mode:
    support: full
    details:
      - Check mode examines and returns the same findings and report; it does not append to O(log_path) or send to syslog.
  diff_mode:
    support: none
  idempotent:
    support: full
    details:
      - The module never reports a change.
  platform:
    support: full
    platforms: posix
options:
  rules_file:
    description:
      - A YAML file on the node with extra pools, pool ports, miner names, miner environment variables, custom rules, weight
        overrides, disabled rules and the allowlist (schema in C(docs/rogue-detection.md)).
      - The file is validated before anything is examined; an unknown key, a bad regular expression or a weight out of
        range fails the task with the file, the line and the field.
    type: path
  rules:
    description:
      - The same content as O(rules_file), given inline; applied after O(rules_file).
    type: dict
  min_level:
    description: Return (and log) only findings at or above this level.
    type: str
    default: info
    choices: [info, medium, high, critical]
  history:
    description: Also return RV(report), the GPU usage report from O(history_path).
    type: bool
    default: false
  hours:
    description: The period of RV(report), in hours before now.
    type: float
    default: 24
  top:
    description: How many processes the C(top_processes) of RV(report) lists, and how many users, jobs and GPUs its C(accounting) lists.
    type: int
    default: 10
  idle_util_pct:
    description: In RV(report), a GPU held with memory at or below this utilization (percent) counts as idle.
    type: int
    default: 5
  log_path:
    description:
      - Append each returned finding as one JSON object per line (JSON Lines, hash-chained) to this file on the node.
      - The record format is documented in C(docs/audit-schema.md) and stays stable within a major version.
    type: path
  syslog:
    description: Also send each returned finding to the local syslog (ident C(gpufleet-audit)), one message per finding.
    type: bool
    default: false
  facility:
    description: The syslog facility for O(syslog=true).
    type: str
    default: user
    choices: [user, daemon, auth, authpriv, local0, local1, local2, local3, local4, local5, local6, local7]
  gpus:
    description: Examine only processes on these GPUs (host-wide indexes or UUIDs).
  policy:
    description:
      - A guard policy to evaluate against the node's current state, without enforcing it - a dry run of what
        C(gpufleet-guard tick) would decide (the same engine; schema in C(docs/policy.md)).
      - Either the path of a policy file on the node (YAML, JSON or TOML; gpu-kill's guard configuration is accepted too),
        or the policy itself as a mapping, or a list of gpu-kill-style shorthand rules (see the examples).
      - An invalid policy fails the task with the file, the path inside the policy and the value, and examines nothing.
      - Nothing is ever signalled, whatever the policy's C(mode). Results are in RV(violations).
    type: raw
  state_path:
    description:
      - The guard's state file on the node, read (never written) for O(policy) - how far each violation's escalation
        has gone. When it does not exist every violation is judged as newly seen. The idle clocks come from the usage
        history O(history_path), read the same way.
    type: path
    default: /var/lib/gpufleet/state.json
notes:
  - Run as root (C(become=true)). Without root the environment, mapped libraries, open sockets and executable of other users'
    processes cannot be read; what could not be read is listed in RV(findings[].notes) and those indicators cannot fire.
  - O(policy) is the answer to gpu-kill's C(--guard-test-policies) and is safe in production - it reads, it never signals.
  - Pool host names are matched in command lines and environments only; connections are matched against the IP addresses
    and networks of the pool list and against the pool ports. No DNS lookups are made.
seealso:
  - module: gpufleet.reclaim.gpu_kill
  - module: gpufleet.reclaim.gpu_facts
"""

EXAMPLES = r"""
- name: Audit every GPU node for miners
  gpufleet.reclaim.gpu_audit:
  become: true
  register: audit

- name: Show what was found
  ansible.builtin.debug:
    msg: "{{ item.level }} {{ item.score }}: pid {{ item.pid }} ({{ item.user }}) {{ item.rules | map(attribute='id') | list }}"
  loop: "{{ audit.findings }}"

- name: Audit with site rules, log findings of medium and above, and report the last week's usage
  gpufleet.reclaim.gpu_audit:
    rules_file: /etc/gpufleet/rogue.yml
    min_level: medium
    log_path: /var/log/gpufleet/audit.jsonl
    syslog: true
    history: true
    hours: 168
  become: true

- name: Inline pool list and an allowlisted benchmark
  gpufleet.reclaim.gpu_audit:
    rules:
      pools: [203.0.113.0/24, pool.example.net]
      allowlist:
        - user: alice
          cmdline: '^hashcat -b'
          expires: 2026-12-31
          comment: hashcat benchmark for the GPU acceptance test
  become: true

- name: Dry-run a guard policy against what runs now (nothing is signalled)
  gpufleet.reclaim.gpu_audit:
    policy:
      mode: enforce
      defaults: {max_mem_gib: 40, idle: {util_pct: 1, min_mem_gib: 1, minutes: 60}}
      users: {alice: {max_gpus: 2}}
  become: true
  register: policy_check

- name: The gpu-kill shorthand - everyone 12 GiB in total
  gpufleet.reclaim.gpu_audit:
    policy:
      - {user: "*", max_memory_gb: 12, action: kill}
  become: true

- name: Or the policy file the guard enforces
  gpufleet.reclaim.gpu_audit:
    policy: /etc/gpufleet/policy.yaml
  become: true

- name: Kill what the audit calls critical (the same detector)
  gpufleet.reclaim.gpu_kill:
    rogue: true
    force: true
  become: true
"""

RETURN = r"""
findings:
  description:
    - One entry per examined process on which at least one rule fired, at or above O(min_level), highest score first.
    - The same objects are written to O(log_path) (with a few record fields added, see C(docs/audit-schema.md)).
  returned: always
  type: list
  elements: dict
  contains:
    pid:
      description: Process id.
      type: int
      returned: always
    starttime:
      description: Start time of the process (field 22 of C(/proc/PID/stat)); with RV(findings[].pid) it identifies the process.
      type: int
      returned: always
    user:
      description: Owner.
      type: str
      returned: always
    uid:
      description: Owner's uid.
      type: int
      returned: always
    name:
      description: Process name.
      type: str
      returned: always
    exe:
      description: The executable (C(/proc/PID/exe)), with C( (deleted)) when it was deleted.
      type: str
      returned: always
    cmdline:
      description:
        - The command line (at most 64 arguments of 1024 characters each), redacted with the default patterns of the
          guard's policy (passwords, tokens, keys, URL credentials become C(<redacted>); a secret in the argument after
          its option makes the list one element, the whole redacted command line).
      type: list
      elements: str
      returned: always
    cmdline_truncated:
      description: Whether RV(findings[].cmdline) was shortened.
      type: bool
      returned: always
    gpu_indexes:
      description: Host-wide indexes of the GPUs the process uses.
      type: list
      elements: int
      returned: always
    used_mib:
      description: GPU memory the process holds (MiB), V(null) when unknown.
      type: int
      returned: always
    container:
      description: Container id, runtime, pod uid and image (when the runtime's files tell it), or V(null).
      type: dict
      returned: always
    slurm_job:
      description: Slurm job id, or V(null).
      type: str
      returned: always
    listed:
      description: V(false) for a process that holds a GPU device file but that the driver does not list.
      type: bool
      returned: always
    score:
      description: 0 to 100.
      type: int
      returned: always
    level:
      description: V(critical), V(high), V(medium) or V(info).
      type: str
      returned: always
    points:
      description: The points of the hard, soft and behavioural rules (behavioural capped and after suppressors) before the total is capped at 100.
      type: dict
      returned: always
    rules:
      description: Every rule that fired - C(id), C(kind), C(weight), C(description) and C(evidence), a list of C(source) (where, such
        as C(argv[3]), C(env:POOL), C(exe), C(connection)), C(value) (the matched text, address or path) and C(note).
      type: list
      elements: dict
      returned: always
    suppressors:
      description: Indicators that lowered the behavioural points (such as ML libraries mapped), with evidence.
      type: list
      elements: dict
      returned: always
    allowlisted:
      description: The allowlist entry that matched (its number, source, kind and expiry), else V(null).
      type: dict
      returned: always
    notes:
      description: What could not be examined and why.
      type: list
      elements: str
      returned: always
  sample:
    - pid: 4242
      starttime: 1234567
      user: bob
      uid: 1001
      name: python
      exe: /dev/shm/.x/python (deleted)
      cmdline: [python, train.py, -o, "stratum+tcp://pool.example.net:3333", -u, "4...wallet"]
      cmdline_truncated: false
      gpu_indexes: [0]
      used_mib: 2048
      container: null
      slurm_job: null
      listed: true
      score: 100
      level: critical
      points: {hard: 100, soft: 55, behavioural: 10}
      rules:
        - id: H-stratum
          kind: hard
          weight: 60
          description: a stratum mining URL in the command line or environment
          evidence: [{source: "argv[3]", value: "stratum+tcp://pool.example.net:3333", note: null}]
      suppressors: []
      allowlisted: null
      notes: []
violations:
  description:
    - The violations of O(policy) in the node's current state (empty without O(policy)).
    - Each has C(rule), C(subject), C(user), C(gpu), C(measured) and C(limit) in C(unit), C(action), the C(pids) that
      enforcement would end (the fewest that bring the user back under the limit, largest first), C(procs), C(message),
      C(kind) and C(enforcement) - what the guard would do at this moment - C(mode), C(next) (V(warn), V(act) or V(wait)),
      C(step), C(act_in) (seconds) and C(would).
  returned: always
  type: list
  elements: dict
  sample:
    - rule: max_mem_per_gpu
      subject: alice
      user: alice
      gpu: 0
      measured: 12288
      limit: 8192
      unit: MiB
      action: terminate
      pids: [4242]
      message: alice uses 12.0 GiB on GPU 0; the limit is 8.0 GiB
      kind: quota
      enforcement: {mode: enforce, next: warn, step: 1, act_in: 300.0, would: terminate pid(s) 4242}
policy:
  description: The policy that O(policy) evaluated - its C(source), C(format) (V(gpufleet) or V(gpu-kill)), C(mode), C(sha256)
    and C(notes) (how a gpu-kill configuration was translated, and what evaluation left out). V(null) without O(policy).
  returned: always
  type: dict
  sample: {source: /etc/gpufleet/policy.yaml, format: gpufleet, mode: dry-run, sha256: 9f2c..., notes: []}
summary:
  description: Counts of RV(findings) per level, the number of allowlisted findings and of examined processes.
  returned: always
  type: dict
  sample: {critical: 1, high: 0, medium: 2, info: 3, allowlisted: 1, total: 6, evaluated: 9}
report:
  description:
    - The usage report when O(history=true), else V(null). C(available) is V(false) (with C(error)) when there is no history.
    - C(users) has C(user), C(gpu_hours), C(idle_gpu_hours), C(peak_mib), C(gpus) and C(processes); C(top_processes) has C(pid),
      C(starttime), C(user), C(name), C(cmdline), C(gpu_indexes), C(gpu_hours), C(idle_gpu_hours), C(peak_mib), C(mean_util_pct),
      C(first_seen) and C(last_seen); C(gpus) has C(gpu_index), C(gpu_uuid), C(busy_hours), C(mean_util_pct), C(peak_used_mib) and
      C(memory_total_mib).
    - C(accounting) (V(null) when C(available) is V(false)) splits each GPU's sample time equally among the holders on it (a
      holder is one user's processes of one Slurm job, or of no job), so the sums agree - over C(users) == over C(gpus) ==
      over C(jobs) plus C(unattributed). C(users) has C(user), C(gpu_hours), C(busy_gpu_hours), C(idle_gpu_hours), C(jobs) and
      C(gpus); C(jobs) has C(job), the GPU-hours, C(users), C(gpu_indexes), C(first_seen) and C(last_seen); C(gpus) has
      C(gpu_index), C(gpu_uuid), the GPU-hours, C(users) and C(jobs) - each the O(top) by GPU-hours. C(unattributed) has the
      GPU-hours of processes no root-owned Slurm job cgroup vouches for; C(totals) the GPU-hours of everything and how many
      users, jobs and GPUs there were. Schema in C(docs/audit-schema.md).
  returned: always
  type: dict
  sample:
    available: true
    hours: 24
    samples: 1440
    retention_days: 30
    users: [{user: alice, gpu_hours: 23.9, idle_gpu_hours: 4.5, peak_mib: 40960, gpus: 2, processes: 3}]
    top_processes: []
    gpus: []
    accounting:
      users: [{user: alice, gpu_hours: 20.0, busy_gpu_hours: 15.5, idle_gpu_hours: 4.5, jobs: 2, gpus: 2}]
      jobs: [{job: '4242', gpu_hours: 16.0, busy_gpu_hours: 14.0, idle_gpu_hours: 2.0, users: [alice], gpu_indexes: [0, 1],
              first_seen: 1767225600.0, last_seen: 1767254400.0}]
      gpus: [{gpu_index: 0, gpu_uuid: GPU-0, gpu_hours: 10.0, busy_gpu_hours: 8.0, idle_gpu_hours: 2.0, users: 1, jobs: 1}]
      unattributed: {gpu_hours: 4.0, busy_gpu_hours: 1.5, idle_gpu_hours: 2.5}
      totals: {gpu_hours: 20.0, busy_gpu_hours: 15.5, idle_gpu_hours: 4.5, users: 1, jobs: 2, gpus: 2}
logged:
  description: How many findings were appended to O(log_path) and sent to syslog.
  returned: always
  type: dict
  sample: {log_path: 1, syslog: 1}
msg:
  description: One-line summary.
  returned: always
  type: str
  sample: "examined 9 process(es): 1 critical, 0 high, 2 medium, 3 info"
"""

import hashlib
import json

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.constants import ROGUE_LEVELS, STATE_PATH
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.snapshot import take_snapshot
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import watchdog
from ansible_collections.gpufleet.reclaim.plugins.module_utils.gpu_module import (
    finish, gpu_options, invalid_policy, invalid_rules, run_module)

FACILITIES = ('user', 'daemon', 'auth', 'authpriv', 'local0', 'local1', 'local2', 'local3', 'local4', 'local5', 'local6', 'local7')


def argument_spec():
    # require_allocation and history_path: rogue.detector_argument_spec(), as in gpu_kill
    return dict(
        rogue.detector_argument_spec(), **gpu_options(),
        rules_file=dict(type='path'),
        rules=dict(type='dict'),
        min_level=dict(type='str', default='info', choices=list(ROGUE_LEVELS)),
        history=dict(type='bool', default=False),
        hours=dict(type='float', default=24.0),
        top=dict(type='int', default=10),
        idle_util_pct=dict(type='int', default=5),
        log_path=dict(type='path'),
        syslog=dict(type='bool', default=False),
        facility=dict(type='str', default='user', choices=list(FACILITIES)),
        policy=dict(type='raw'),
        state_path=dict(type='path', default=STATE_PATH),
    )


def validate(params):
    """Check the numeric options; raises InvalidArgument."""
    if not 0 < params['hours'] <= 24 * 3660:
        raise InvalidArgument('hours', params['hours'], 'expected more than 0 and at most 87840 hours')
    if not 1 <= params['top'] <= 1000:
        raise InvalidArgument('top', params['top'], 'expected 1 to 1000')
    if not 0 <= params['idle_util_pct'] <= 100:
        raise InvalidArgument('idle_util_pct', params['idle_util_pct'], 'expected a percentage from 0 to 100')


# The policy engine (core.guard, core.policy) and the usage history (core.history, sqlite3) are imported
# only when O(policy) or O(history) asks for them: they were about a third of the module's import time
# (docs/benchmarks.md, "Module payloads"), paid by every audit.
def policy_package():
    """core.policy, imported on first use."""
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy  # pylint: disable=import-outside-toplevel
    return policy


def load_policy(spec):
    """The Policy that O(policy) names: a file path, a mapping or a shorthand list.  Raises PolicyError."""
    policy_mod = policy_package()
    if isinstance(spec, str):
        return policy_mod.load_policy(spec)
    if isinstance(spec, (dict, list)):
        policy = policy_mod.parse_policy(spec, source='policy')
        policy.sha256 = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode('utf-8')).hexdigest()
        return policy
    raise InvalidArgument('policy', spec, 'expected the path of a policy file, a mapping or a list of shorthand rules')


def policy_dry_run(policy, params, snapshot, now=None):
    """(violations, policy summary, warnings) for the loaded O(policy); nothing is written or signalled."""
    from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard  # pylint: disable=import-outside-toplevel
    paths = guard.Paths(state=params['state_path'] or '', history=params['history_path'] or '')
    violations, notes, warnings = guard.dry_run(policy, snapshot, paths, now=now)
    summary = {'source': policy.source, 'format': policy.format, 'mode': policy.mode,
               'sha256': policy.sha256, 'notes': list(policy.notes or []) + list(notes[:100])}
    return violations, summary, warnings


def syslog_message(finding):
    """One syslog line: JSON with ensure_ascii, so no control character of the user's exe path reaches syslog."""
    brief = {'level': finding['level'], 'score': finding['score'], 'pid': finding['pid'], 'user': finding['user'],
             'gpu_indexes': finding['gpu_indexes'], 'used_mib': finding['used_mib'], 'exe': finding['exe'],
             'rules': [r['id'] for r in finding['rules']], 'allowlisted': bool(finding['allowlisted'])}
    return 'gpufleet rogue finding: %s' % json.dumps(brief, sort_keys=True, separators=(',', ':'))


def send_syslog(findings, facility_name):
    import syslog  # pylint: disable=import-outside-toplevel
    priorities = {'critical': syslog.LOG_CRIT, 'high': syslog.LOG_ERR, 'medium': syslog.LOG_WARNING, 'info': syslog.LOG_INFO}
    facility = getattr(syslog, 'LOG_' + facility_name.upper())
    syslog.openlog('gpufleet-audit', syslog.LOG_PID, facility)
    try:
        for finding in findings:
            syslog.syslog(priorities[finding['level']], syslog_message(finding))
    finally:
        syslog.closelog()
    return len(findings)


def run(params, check_mode=False, snapshot=None):
    """The module's work without AnsibleModule: returns (result, warnings)."""
    validate(params)
    policy_result = None
    # loaded first, so that a bad policy fails before anything is examined
    policy = load_policy(params['policy']) if params.get('policy') is not None else None
    # the built-in rules without a rules file: the loader (and PyYAML) is not imported
    config = rogue.load_config(rules_file=params['rules_file'], rules=params['rules']) if params['rules_file'] or params['rules'] \
        else rogue.RogueConfig()
    warnings = list(config.warnings)
    if snapshot is None:
        snapshot = take_snapshot(vendor=params['vendor'], gpus=params['gpus'], gather_processes=True,
                                 driver_timeout=watchdog.check_timeout('driver_timeout', params.get('driver_timeout')))
    findings, detect_warnings, evaluated = rogue.detect_snapshot(
        snapshot, config=config, min_level=params['min_level'], **rogue.detector_options(params))
    warnings.extend(w for w in detect_warnings if w not in warnings)
    warnings.extend(snapshot.errors)
    violations = []
    if policy is not None:
        violations, policy_result, policy_warnings = policy_dry_run(policy, params, snapshot)
        warnings.extend(w for w in policy_warnings if w not in warnings)
    report = None
    if params['history']:
        from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import history  # pylint: disable=import-outside-toplevel
        report = history.report(params['history_path'], hours=params['hours'], idle_util_pct=params['idle_util_pct'],
                                top=params['top'])
        warnings.extend(report.get('warnings') or [])
    logged = {'log_path': 0, 'syslog': 0}
    if not check_mode and findings:
        logged['log_path'] = rogue.log_findings(params['log_path'], findings)
        if params['syslog']:
            logged['syslog'] = send_syslog(findings, params['facility'])
    summary = rogue.summarize(findings, evaluated)
    counts = ', '.join('%d %s' % (summary[level], level) for level in reversed(ROGUE_LEVELS))
    if policy_result is not None:
        counts += '; %d policy violation(s)' % len(violations)
    result = {
        'changed': False,
        'findings': findings,
        'violations': violations,
        'policy': policy_result,
        'summary': summary,
        'report': report,
        'logged': logged,
        'msg': 'examined %d process(es): %s' % (evaluated, counts),
    }
    return result, warnings


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    result, warnings = run_module(module, 'gpu_audit', lambda m: run(m.params, check_mode=m.check_mode),
                                  errors=lambda: ((policy_package().PolicyError, invalid_policy), (rogue.RulesError, invalid_rules)))
    finish(module, dict(result, warnings=warnings))


if __name__ == '__main__':
    main()
