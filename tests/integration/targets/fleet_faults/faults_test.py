# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Faults on the simulated fleet: an SSH drop during gpu_kill, a node lost in the middle of a playbook.

Run by runme.sh after tests/fleet/up: python faults_test.py --fleet DIR --collection COLL.

The faults are injected on the node, where they happen in real life: each node's
``ansible_python_interpreter`` becomes a small wrapper (written here, run inside the node's
namespaces) that reads the pipelined module and, for gpu_kill only, applies the fault named in
the node's fault file:

* ``drop-after-exit PID``: run the module in its own process group; once PID (a workload the
  module is killing) has exited, SIGKILL that group (the module dies halfway, as it does when a
  dropped SSH session hangs up its terminal) and exit 255, which the controller's ssh connection
  reports as the node being unreachable.  The wait is bounded (60 s).
* ``unreachable``: exit 255 at once, before the module runs (the node vanished before its task).

Ground truth comes from ``gpusim show`` on the nodes.  Only processes this test started (through
gpusim on the nodes) are signalled, by the modules; the wrapper signals only the process group of
the module it started itself.  Network: loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

WALLET = '44AFFq5kSiGBoZ4NMDwYtN18obc8AemS33DBLWs3H7otXft3XjrpDtQGv7SqSsaBYBb98uNbr2VBBEt7f2wfn3RVGQBEP3A'
MINER_ARGV = ['python', 'train.py', '--url', 'stratum+tcp://pool.example.net:3333', '--user', WALLET, '-p', 'x']

WRAPPER = r'''#!/bin/sh
# Fault-injecting interpreter of one simulated node (tests/integration/targets/fleet_faults).
payload=$(mktemp) || exit 1
trap 'rm -f "$payload"' EXIT
cat > "$payload"
fault=$(cat %(fault_file)s 2>/dev/null)
if grep -q "plugins.modules.gpu_kill'" "$payload"; then
  case "$fault" in
    unreachable)
      echo "fleet_faults: simulated loss of the connection before gpu_kill" >&2
      exit 255;;
    drop-after-exit\ *)
      watch=${fault#drop-after-exit }
      setsid %(python)s "$@" < "$payload" > /dev/null 2>&1 &
      module=$!
      i=0
      while [ $i -lt 600 ]; do
        state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' /proc/$watch/status 2>/dev/null)
        if [ -z "$state" ] || [ "$state" = Z ]; then break; fi
        sleep 0.1; i=$((i + 1))
      done
      kill -s KILL -- "-$module" 2>/dev/null
      wait $module
      echo "fleet_faults: simulated SSH drop while gpu_kill was running (module killed)" >&2
      exit 255;;
  esac
fi
%(python)s "$@" < "$payload"
'''


class Fleet(object):
    def __init__(self, directory, collection):
        self.dir = directory
        self.collection = collection
        self.ssh_config = os.path.join(directory, 'ssh_config')
        self.inventory = os.path.join(directory, 'inventory-faults.ini')
        self.out = os.path.join(directory, 'out')
        os.makedirs(self.out)
        self.python = None
        self.runs = 0
        self.write_inventory()

    def fault_file(self, node):
        return os.path.join(self.dir, 'fault-%s' % node)

    def write_inventory(self):
        """The fleet's inventory with every node's interpreter replaced by its fault wrapper."""
        with open(os.path.join(self.dir, 'inventory.ini'), encoding='utf-8') as handle:
            lines = handle.read().splitlines()
        self.python = [x.split('=', 1)[1] for x in lines if x.startswith('ansible_python_interpreter=')][0]
        out = []
        for line in lines:
            name = line.split(' ', 1)[0]
            if name.startswith('node') and 'ansible_host=' in line:
                wrapper = os.path.join(self.dir, 'python-%s' % name)
                with open(wrapper, 'w', encoding='utf-8') as handle:
                    handle.write(WRAPPER % {'fault_file': shlex.quote(self.fault_file(name)),
                                            'python': shlex.quote(self.python)})
                os.chmod(wrapper, 0o755)
                line += ' ansible_python_interpreter=%s' % wrapper
            out.append(line)
        with open(self.inventory, 'w', encoding='utf-8') as handle:
            handle.write('\n'.join(out) + '\n')

    def fault(self, node, text):
        with open(self.fault_file(node), 'w', encoding='utf-8') as handle:
            handle.write(text)

    def ssh(self, node, argv):
        cmd = ['ssh', '-F', self.ssh_config, node, ' '.join(shlex.quote(a) for a in argv)]
        return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, universal_newlines=True, timeout=120).stdout

    def spawn(self, node, gpu, mib, argv, *extra):
        out = self.ssh(node, ['gpusim', 'spawn', '--gpu', str(gpu), '--mib', str(mib)] + list(extra) + ['--'] + argv)
        return int(out.split()[0])

    def show(self, node):
        return json.loads(self.ssh(node, ['gpusim', 'show']))

    def alive(self, node, pid):
        return [p for p in self.show(node)['processes'] if p['pid'] == pid][0]['alive']

    def used(self, node):
        return [g['used_mib'] for g in self.show(node)['gpus']]

    def command(self, argv, expect_rc):
        self.runs += 1
        print('\n### %s' % ' '.join(shlex.quote(a) for a in argv), flush=True)
        begun = time.monotonic()
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                              check=False, timeout=300)
        sys.stdout.write(proc.stdout)
        print('### rc=%d in %.1f s' % (proc.returncode, time.monotonic() - begun), flush=True)
        assert proc.returncode in expect_rc, 'exited %d, expected %s' % (proc.returncode, expect_rc)
        return proc.stdout

    def gpu_kill(self, node, args, expect_rc=(0,)):
        """Ad-hoc gpu_kill; returns (stdout, the node's result or None when there is none)."""
        argv = ['ansible', node, '-i', self.inventory, '-m', 'gpufleet.reclaim.gpu_kill', '-a', json.dumps(args)]
        stdout = self.command(argv, expect_rc)
        marker = '%s | ' % node
        start = stdout.find('{', stdout.find(marker)) if marker in stdout else -1
        result = json.loads(stdout[start:stdout.rindex('}') + 1]) if start >= 0 else None
        return stdout, result

    def playbook(self, name, extra_vars, expect_rc=(0,)):
        summary = os.path.join(self.out, '%02d-%s.json' % (self.runs + 1, name))
        evars = dict(extra_vars, summary_file=summary)
        argv = ['ansible-playbook', '-i', self.inventory, 'gpufleet.reclaim.%s' % name, '-e', json.dumps(evars)]
        stdout = self.command(argv, expect_rc)
        with open(summary, encoding='utf-8') as handle:
            return stdout, json.load(handle)

    def verify_audit_log(self, node):
        """The node's gpu_kill action log (a private path of the node, read from the host): chain intact."""
        sys.path.insert(0, os.path.join(self.collection, 'plugins', 'module_utils'))
        from core import audit_log  # pylint: disable=import-outside-toplevel
        path = os.path.join(self.dir, 'nodes', node, 'fs', 'var', 'log', 'gpufleet', 'actions.jsonl')
        report = audit_log.verify(path)
        return path, report


def test_ssh_drop_during_gpu_kill(fleet):
    """The module is killed after its SIGTERM ended one target and while it waits out the other's grace.
    Half the work is done; the controller sees the node unreachable; the rerun finishes the rest."""
    node = 'node01'
    stubborn = fleet.spawn(node, 0, 4096, ['python', 'train.py', '--epochs', '9'], '--ignore-term')
    polite = fleet.spawn(node, 1, 2048, ['python', 'serve.py'])
    bystander = fleet.spawn(node, 0, 1024, ['python', 'notebook.py'])
    fleet.fault(node, 'drop-after-exit %d' % polite)
    stdout, result = fleet.gpu_kill(node, {'pids': [stubborn, polite], 'force': True, 'timeout': 60}, expect_rc=(4,))
    assert '%s | UNREACHABLE!' % node in stdout, 'the controller must report the node unreachable'
    assert result is None or result.get('unreachable'), result
    assert not fleet.alive(node, polite), 'the TERM-honouring target got its SIGTERM before the drop'
    assert fleet.alive(node, stubborn), 'the TERM-ignoring target is still in its grace period when the module died'
    assert fleet.alive(node, bystander)

    fleet.fault(node, '')
    _out, rerun = fleet.gpu_kill(node, {'pids': [stubborn, polite], 'force': True, 'timeout': 1})
    assert rerun['changed'] is True, rerun
    assert [k['pid'] for k in rerun['killed']] == [stubborn], rerun['killed']
    assert rerun['killed'][0]['signals'] == ['SIGTERM', 'SIGKILL'], rerun['killed']
    gone = [s for s in rerun['skipped_processes'] if s['pid'] == polite]
    assert gone or polite not in [k['pid'] for k in rerun['killed']], rerun
    assert not fleet.alive(node, stubborn) and fleet.alive(node, bystander)
    assert fleet.used(node) == [1024, 0], fleet.used(node)

    _out, again = fleet.gpu_kill(node, {'pids': [stubborn, polite], 'force': True, 'timeout': 1})
    assert again['changed'] is False and again['killed'] == [], again
    path, report = fleet.verify_audit_log(node)
    print('audit log %s: %s' % (path, json.dumps(report, default=str)), flush=True)
    assert report['valid'] is True, report
    with open(path, encoding='utf-8') as handle:
        records = [json.loads(line) for line in handle]
    # The run that died left the record of the SIGTERMs it had sent (written right after them, before
    # the wait); the rerun left its own two records.  Nothing names the bystander.
    events = [r['event'] for r in records]
    assert events == ['gpu_kill_signalled', 'gpu_kill_signalled', 'gpu_kill'], events
    first = dict((e['pid'], e) for e in records[0]['signalled'])
    assert sorted(first) == sorted([stubborn, polite]), records[0]
    assert all(e['signals'] == ['SIGTERM'] for e in first.values()), records[0]
    assert [k['pid'] for k in records[2]['killed']] == [stubborn], records[2]
    assert str(bystander) not in json.dumps([[e.get('pid') for e in r.get('signalled', []) + r.get('killed', [])]
                                             for r in records])


def test_node_lost_mid_playbook(fleet):
    """node02 is lost before its one call (rogue_cleanup audits and kills in one gpu_kill call per node, issue #21):
    it is reported unreachable with nothing known and nothing killed, node03 is cleaned up, and the rerun cleans up node02."""
    miner02 = fleet.spawn('node02', 1, 4096, MINER_ARGV, '--util', '100')
    miner03 = fleet.spawn('node03', 0, 2048, MINER_ARGV, '--util', '100')
    worker02 = fleet.spawn('node02', 0, 8192, ['python', 'train.py', '--model', 'llama-7b'], '--util', '90')
    fleet.fault('node02', 'unreachable')
    stdout, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': True, 'kill_timeout': 2}, expect_rc=(2,))
    node02 = [n for n in summary['nodes'] if n['host'] == 'node02'][0]
    node03 = [n for n in summary['nodes'] if n['host'] == 'node03'][0]
    assert node02['status'] == 'unreachable' and node02['killed'] == [], node02
    # no audit ran apart from the kill, so an unreachable node has no findings (it had the audit's before #21)
    assert node02['findings'] == [] and node02['summary'] == {} and summary['nodes_scanned'] == len(summary['nodes']) - 1, node02
    assert node03['status'] == 'ok' and [k['pid'] for k in node03['killed']] == [miner03], node03
    assert summary['nodes_failed'] == ['node02'], summary['nodes_failed']
    assert 'node02' in stdout
    assert fleet.alive('node02', miner02) and fleet.alive('node02', worker02)
    assert not fleet.alive('node03', miner03)

    fleet.fault('node02', '')
    _out, summary = fleet.playbook('rogue_cleanup', {'reclaim_confirm': True, 'kill_timeout': 2})
    node02 = [n for n in summary['nodes'] if n['host'] == 'node02'][0]
    assert node02['status'] == 'ok' and [k['pid'] for k in node02['killed']] == [miner02], node02
    assert summary['nodes_failed'] == [] and summary['killed'] == 1, summary
    assert not fleet.alive('node02', miner02) and fleet.alive('node02', worker02)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--fleet', required=True)
    parser.add_argument('--collection', required=True)
    args = parser.parse_args()
    fleet = Fleet(args.fleet, args.collection)
    started = time.monotonic()
    test_ssh_drop_during_gpu_kill(fleet)
    test_node_lost_mid_playbook(fleet)
    print('\nfleet_faults: %d ansible runs passed in %.0f s' % (fleet.runs, time.monotonic() - started))


if __name__ == '__main__':
    main()
