# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: what a user runs or creates must not switch a rule on or make her job someone else's
(docs/security.md): a fake ``slurmd``/``kubelet`` and a ``require_allocation`` policy, and cgroup
paths she can create (systemd delegation) that read as a Slurm job, a container or a pod that an
exemption covers.

Each scenario runs in a PID and mount namespace of its own (``redteam.run``); see redteam.py for the
safety.  The cgroup scenarios mount a tmpfs over /sys/fs/cgroup and bind a file over a workload's
/proc/PID/cgroup inside that mount namespace only: the guard then reads the cgroup tree the attack
made, owners included, and nothing outside the namespace changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace

CID = '3f4e1a9c0b2d4e6f8a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f'
POD = '6f1c3c2a-7d1e-4a53-9a3b-2f7c8d9e0a1b'
SLEEP = shutil.which('sleep')
ALLOCATION = ('mode: enforce\nrequire_allocation: true\n'
              'escalation: {act_after: 0s, sigkill_after: 2s}\nnotify: {tty: false}\n')


def _outcome(node, rc, summary, signalled, err, **pids):
    out = {'rc': rc, 'err': err, 'summary': summary, 'signalled': signalled, 'pids': pids,
           'alive': dict((name, node.alive(pid)) for name, pid in pids.items()),
           'acted': sorted(redteam.acted_pids(summary))}
    out['violations'] = [(v['rule'], v.get('user'), v['pids']) for v in (summary or {}).get('violations', [])] \
        if isinstance(summary, dict) else summary
    return out


def _run_as(uid, argv):
    """``argv`` as ``uid`` (a plain child of the scenario, ended with the namespace)."""
    def drop():
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=drop if uid else None)


# ============================================================================ a fake scheduler daemon
def scenario_fake_daemons(node):
    alice_uid = node.uids['alice']
    # gpusim workloads named slurmd and kubelet, and real copies of sleep of those names in her directory
    workloads = [node.spawn('alice', gpu=0, mib=256, argv=['slurmd']), node.spawn('alice', gpu=0, mib=256, argv=['kubelet'])]
    copies = []
    os.chmod(node.work, 0o755)
    mine = tempfile.mkdtemp(prefix='alice-', dir=node.work)
    os.chown(mine, alice_uid, alice_uid)
    for name in ('slurmd', 'kubelet'):
        shutil.copy(SLEEP, os.path.join(mine, name))
        os.chmod(os.path.join(mine, name), 0o755)
        copies.append(_run_as(alice_uid, [os.path.join(mine, name), '300']))
        copies.append(_run_as(0, [os.path.join(mine, name), '300']))       # even root's copy in her directory
    alice = node.spawn('alice', gpu=0, mib=2 * GIB)
    bob = node.spawn('bob', gpu=1, mib=2 * GIB)
    node.write_policy(ALLOCATION)
    rc, summary, signalled, err = node.tick()
    out = _outcome(node, rc, summary, signalled, err, alice=alice, bob=bob)
    out['daemons_alive'] = [node.alive(pid) for pid in workloads] + [child.poll() is None for child in copies]
    out['comms'] = sorted(set(node.comm(pid) for pid in workloads + [child.pid for child in copies]))
    return out


def test_a_process_named_slurmd_or_kubelet_does_not_switch_require_allocation_on():
    out = redteam.run(scenario_fake_daemons)
    assert out['rc'] == 0, out['err']
    assert out['comms'] == ['kubelet', 'slurmd'] and all(out['daemons_alive'])
    assert out['violations'] == [] and out['acted'] == [] and out['signalled'] == [], out['summary']
    assert out['alive'] == {'alice': True, 'bob': True}
    assert not [w for w in out['summary'].get('warnings') or () if 'require_allocation' in w], out['summary']  # not switched on


def scenario_real_daemon(node):
    """The control: root's slurmd (a root-owned executable in root-owned directories) does switch it on,
    and a process in a root-owned Slurm job cgroup is inside a job."""
    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'mode=0755', 'gpufleet-redteam', '/mnt'], check=True)
    os.makedirs('/mnt/sbin', mode=0o755)
    shutil.copy(SLEEP, '/mnt/sbin/slurmd')
    os.chmod('/mnt/sbin/slurmd', 0o755)
    _run_as(0, ['/mnt/sbin/slurmd', '300'])
    _fake_cgroup_fs()
    alice = node.spawn('alice', gpu=0, mib=2 * GIB)
    bob = node.spawn('bob', gpu=1, mib=2 * GIB)
    _place(node, bob, '0::/system.slice/slurmstepd.scope/job_77/step_0')
    node.write_policy(ALLOCATION)
    rc, summary, signalled, err = node.tick()
    return _outcome(node, rc, summary, signalled, err, alice=alice, bob=bob)


def test_root_s_slurmd_does_switch_require_allocation_on():
    """Root's slurmd switches the rule on; the rule then asks Slurm itself (issue #18), and no Slurm answers in this
    namespace, so it does not fire and the tick says why (the rule firing on a real Slurm:
    tests/fleet/tests/test_fleet_slurm_scripts.py)."""
    out = redteam.run(scenario_real_daemon)
    assert out['rc'] == 0, out['err']
    bob = out['pids']['bob']
    assert out['violations'] == [] and out['acted'] == [] and bob not in out['signalled'] and out['alive']['bob'], out['summary']
    assert [w for w in out['summary']['warnings'] if w.startswith('require_allocation: Slurm could not be asked')], out['summary']
    assert any(n.startswith('require_allocation not evaluated: Slurm could not be asked') for n in out['summary'].get('notes') or ()) \
        or 'notes' not in out['summary'], out['summary']


# ============================================================================ cgroup paths a user can create
def _fake_cgroup_fs():
    """A tmpfs over /sys/fs/cgroup in this mount namespace: a cgroup v2 root with a v1 memory controller."""
    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'mode=0755', 'gpufleet-redteam', '/sys/fs/cgroup'], check=True)
    open('/sys/fs/cgroup/cgroup.controllers', 'w').close()
    os.mkdir('/sys/fs/cgroup/memory', 0o755)


def _place(node, pid, line, owned=None):
    """Make the cgroup of ``line`` (directories root's 0755 unless ``owned`` {dir: uid}) and show it as
    /proc/PID/cgroup of ``pid``."""
    controllers, path = line.split(':', 2)[1:]
    base = '/sys/fs/cgroup' + ('/' + controllers if controllers else '')
    os.makedirs(base + path, mode=0o755, exist_ok=True)
    for directory, uid in (owned or {}).items():
        os.chown(base + directory, uid, uid)
    fake = os.path.join(node.work, 'cgroup-%d' % pid)
    with open(fake, 'w') as handle:
        handle.write(line + '\n')
    subprocess.run(['mount', '--bind', fake, '/proc/%d/cgroup' % pid], check=True)


def _exempt(match):
    """Over 2 GiB is acted on at once, except for ``match`` and Slurm job 77."""
    return ('mode: enforce\ndefaults: {max_mem_gib_total: 2}\nexemptions:\n'
            '  - {match: %s, rules: [memory], expires: 2099-01-01, reason: red team}\n'
            '  - {match: {slurm_job: "77"}, rules: [memory], expires: 2099-01-01}\n'
            'escalation: {act_after: 0s, sigkill_after: 2s}\nnotify: {tty: false}\n' % match)


def _cgroup_attack(node, line, match, owned=None):
    """alice's 4 GiB hog in a cgroup she made, under an exemption for the identity it names; bob's 3 GiB
    job in a root-owned Slurm job cgroup that an exemption covers too."""
    _fake_cgroup_fs()
    alice = node.spawn('alice', gpu=0, mib=4 * GIB)
    bob = node.spawn('bob', gpu=1, mib=3 * GIB)
    _place(node, alice, line % {'uid': node.uids['alice']}, dict(
        (path % {'uid': node.uids['alice']}, node.uids['alice']) for path in (owned or ())))
    _place(node, bob, '0::/system.slice/slurmstepd.scope/job_77/step_0')
    node.write_policy(_exempt(match))
    rc, summary, signalled, err = node.tick()
    out = _outcome(node, rc, summary, signalled, err, alice=alice, bob=bob)
    with open('/proc/%d/cgroup' % alice) as handle:
        out['cgroup'] = handle.read()
    return out


USER_MANAGER = '/user.slice/user-%(uid)d.slice/user@%(uid)d.service'


def scenario_user_manager_job(node):
    return _cgroup_attack(node, '0::' + USER_MANAGER + '/app.slice/job_4242', '{slurm_job: "4242"}', owned=[USER_MANAGER])


def scenario_user_manager_docker(node):
    return _cgroup_attack(node, '0::' + USER_MANAGER + '/app.slice/docker-%s.scope' % CID, '{container: "%s"}' % CID,
                          owned=[USER_MANAGER])


def scenario_user_manager_pod(node):
    return _cgroup_attack(node, '0::' + USER_MANAGER + '/kubepods/burstable/pod%s/%s' % (POD, CID), '{pod: "%s"}' % POD,
                          owned=[USER_MANAGER])


def scenario_session_scope_job(node):
    return _cgroup_attack(node, '0::/user.slice/user-%(uid)d.slice/session-3.scope/job_4242', '{slurm_job: "4242"}')


def scenario_delegated_service_job(node):
    # a system service with Delegate=yes and User=alice: no user slice, but the directory is hers
    return _cgroup_attack(node, '0::/system.slice/lab-%(uid)d.service/job_4242/step_0', '{slurm_job: "4242"}',
                          owned=['/system.slice/lab-%(uid)d.service'])


def scenario_v1_user_owned_slurm_dir(node):
    return _cgroup_attack(node, '4:memory:/slurm/uid_%(uid)d/job_1/step_0', '{slurm_job: "1"}', owned=['/slurm/uid_%(uid)d'])


def _assert_charged_to_alice(out, marker):
    assert out['rc'] == 0, out['err']
    assert marker in out['cgroup']
    alice, bob = out['pids']['alice'], out['pids']['bob']
    assert out['violations'] == [['max_mem_total', 'alice', [alice]]], out['summary']
    assert out['acted'] == [alice] and not out['alive']['alice']
    assert bob not in out['signalled'] and out['alive']['bob']          # bob's root-owned job stays exempt


def test_a_job_cgroup_under_her_user_manager_buys_no_exemption():
    _assert_charged_to_alice(redteam.run(scenario_user_manager_job), 'app.slice/job_4242')


def test_a_docker_scope_under_her_user_manager_buys_no_exemption():
    _assert_charged_to_alice(redteam.run(scenario_user_manager_docker), 'docker-%s.scope' % CID)


def test_a_kubepods_cgroup_under_her_user_manager_buys_no_exemption():
    _assert_charged_to_alice(redteam.run(scenario_user_manager_pod), 'pod%s' % POD)


def test_a_job_cgroup_under_her_session_scope_buys_no_exemption():
    _assert_charged_to_alice(redteam.run(scenario_session_scope_job), 'session-3.scope/job_4242')


def test_a_job_cgroup_in_a_service_delegated_to_her_buys_no_exemption():
    _assert_charged_to_alice(redteam.run(scenario_delegated_service_job), '.service/job_4242')


def test_a_slurm_v1_job_under_a_directory_she_owns_buys_no_exemption():
    _assert_charged_to_alice(redteam.run(scenario_v1_user_owned_slurm_dir), '/slurm/uid_')
