# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The remediation ladder on a simulated fleet of 3 nodes with 2 GPUs each (issue #17's acceptance).

Run by runme.sh after tests/fleet/up: python remediate_test.py --fleet DIR.

* node01 GPU 0: 4 GiB of orphaned memory -> a verified reset.
* node01 GPU 1: an application that logged Xid 13 (``gpusim xid --pid``) -> that process is killed.
* node02 GPU 0: Xid 79 (fallen off the bus) -> the node is drained (the drain hook: no slurmd on the
  simulated nodes) and the GPU flagged for reboot.
* node02 GPU 1: orphaned memory while ``nvidia_drm`` holds a kernel reference -> the reset is refused
  naming nvidia_drm and its refcnt, and the GPU is flagged for reboot.
* node03: a hung driver (``gpusim hang``) -> reported as ``driver_hung`` (the call that hung) within
  ``driver_timeout``, while the other nodes finish.

Check mode predicts every ladder and changes nothing; confirmed, the steps happen; a rerun changes
nothing (the Xid lines stay in the nodes' kernel logs).  Ground truth comes from ``gpusim show`` and the
flag files on the nodes.  Only processes this test started (gpusim spawn on the nodes) are signalled,
by the module.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

FLAG = '/var/lib/gpufleet/reboot-wanted'


class Fleet(object):
    def __init__(self, directory):
        self.dir = directory
        self.ssh_config = os.path.join(directory, 'ssh_config')
        self.inventory = os.path.join(directory, 'inventory.ini')
        self.out = os.path.join(directory, 'out')
        os.makedirs(self.out, exist_ok=True)
        self.runs = 0

    def ssh(self, node, argv, check=True):
        cmd = ['ssh', '-F', self.ssh_config, node, ' '.join(shlex.quote(a) for a in argv)]
        proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                              timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError('%s on %s failed (%d): %s' % (argv, node, proc.returncode, proc.stderr))
        return proc

    def gpusim(self, node, *args):
        return self.ssh(node, ['gpusim'] + [str(a) for a in args]).stdout

    def show(self, node):
        return json.loads(self.gpusim(node, 'show'))

    def alive(self, node, pid):
        return [p for p in self.show(node)['processes'] if p['pid'] == pid][0]['alive']

    def flag(self, node):
        proc = self.ssh(node, ['cat', FLAG], check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def playbook(self, extra_vars=None, check=False):
        self.runs += 1
        summary = os.path.join(self.out, '%02d-remediate.json' % self.runs)
        evars = dict(extra_vars or {}, summary_file=summary)
        argv = ['ansible-playbook', '-i', self.inventory, 'gpufleet.reclaim.remediate', '-e', json.dumps(evars)]
        argv += ['--check'] if check else []
        print('\n### remediate%s %s' % (' --check' if check else '', json.dumps(evars)), flush=True)
        begun = time.monotonic()
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
        sys.stdout.write(proc.stdout)
        print('### remediate: rc=%d in %.1f s' % (proc.returncode, time.monotonic() - begun), flush=True)
        assert proc.returncode == 0, 'remediate exited %d' % proc.returncode
        changed = dict((m.group(1), int(m.group(2))) for m in re.finditer(r'^(\S+)\s+: ok=\d+\s+changed=(\d+)', proc.stdout, re.M))
        with open(summary) as handle:
            return json.load(handle), changed


def ladders(summary):
    """{(host, gpu): [(step, status), ...]} of the GPUs with a ladder."""
    out = {}
    for node in summary['nodes']:
        for gpu in node['gpus']:
            if gpu['ladder']:
                out[(node['host'], gpu['index'])] = [(s['step'], s['status']) for s in gpu['ladder']]
    return out


def details(summary, host, index):
    node = [n for n in summary['nodes'] if n['host'] == host][0]
    return ' '.join(s['detail'] or '' for s in [g for g in node['gpus'] if g['index'] == index][0]['ladder'])


DRIVER_TIMEOUT = 3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--fleet', required=True)
    args = parser.parse_args()
    fleet = Fleet(args.fleet)
    started = time.monotonic()
    nodes = ('node01', 'node02', 'node03')

    fleet.gpusim('node01', 'leak', '--gpu', '0', '--mib', '4096')
    app = int(fleet.gpusim('node01', 'spawn', '--gpu', '1', '--mib', '2048', '--', 'python', 'train.py').split()[0])
    fleet.gpusim('node01', 'xid', '--gpu', '1', '--code', '13', '--pid', app)
    fleet.gpusim('node02', 'xid', '--gpu', '0', '--code', '79')
    fleet.gpusim('node02', 'leak', '--gpu', '1', '--mib', '4096')
    fleet.gpusim('node02', 'set', '--module-refcnt', 'nvidia_drm=1')
    fleet.gpusim('node03', 'hang', '--gpu', '0', '--seconds', '600')   # every run of this test finds it hung
    # two nodes act in one run: the blast-radius limit (20 % of 3 nodes: one; tests/integration/targets/blast_radius) is
    # raised for this scenario
    options = {'driver_timeout': DRIVER_TIMEOUT, 'drain_command': ['/bin/true'], 'fail_on_node_errors': False,
               'reclaim_max_nodes_pct': 100}

    def hung(summary):
        assert summary['nodes_driver_hung'] == ['node03'] and summary['nodes_failed'] == ['node03'], summary
        node = [n for n in summary['nodes'] if n['host'] == 'node03'][0]
        assert node['status'] == 'driver_hung' and node['driver_hung']['timeout_s'] == DRIVER_TIMEOUT, node
        assert node['driver_hung']['call'].startswith('nvml') and node['driver_hung']['gpu'] == 0, node
        assert 'did not answer within %ds' % DRIVER_TIMEOUT in node['msg'], node
        assert all(n['status'] == 'ok' for n in summary['nodes'] if n['host'] != 'node03'), summary['nodes']

    expected_plan = {
        ('node01', 0): [('reset', 'would_run')],
        ('node01', 1): [('kill_application', 'would_run')],
        ('node02', 0): [('drain', 'node_would_run'), ('reboot_flag', 'node_would_write')],
        ('node02', 1): [('reset', 'would_be_refused'), ('drain', 'node_would_run'), ('reboot_flag', 'node_would_write')],
    }
    for check in (True, False):  # --check, then report only (the default): both predict and change nothing
        summary, changed = fleet.playbook(options, check=check)
        assert ladders(summary) == expected_plan, ladders(summary)
        assert 'nvidia_drm: 1 reference(s) (refcnt 1' in details(summary, 'node02', 1)
        assert not any(changed.get(n) for n in nodes), changed
        hung(summary)
    assert [g['reset_count'] for g in fleet.show('node01')['gpus']] == [0, 0]
    assert all(fleet.flag(n) is None for n in nodes) and fleet.alive('node01', app)

    summary, changed = fleet.playbook(dict(options, reclaim_confirm=True))
    done = ladders(summary)
    assert done == {
        ('node01', 0): [('reset', 'done')],
        ('node01', 1): [('kill_application', 'done')],
        ('node02', 0): [('drain', 'node_done'), ('reboot_flag', 'node_written')],
        ('node02', 1): [('reset', 'refused'), ('drain', 'node_done'), ('reboot_flag', 'node_written')],
    }, done
    hung(summary)
    assert 'kernel_modules' in details(summary, 'node02', 1) and 'nvidia_drm' in details(summary, 'node02', 1)
    assert not fleet.alive('node01', app)
    node1 = fleet.show('node01')['gpus']
    assert (node1[0]['reset_count'], node1[0]['leaked_mib']) == (1, 0)
    assert fleet.show('node02')['gpus'][1]['reset_count'] == 0
    flag = fleet.flag('node02')
    reasons = sorted(flag['gpus'].values())
    assert len(reasons) == 2 and 'Xid 79' in reasons[0] and 'nvidia_drm' in reasons[1], flag
    assert summary['nodes_reboot_wanted'] == ['node02'] and fleet.flag('node01') is None
    node2 = [n for n in summary['nodes'] if n['host'] == 'node02'][0]
    assert node2['drained'] and node2['node']['drain']['command'][:3] == ['/bin/true', 'drain', 'node02'], node2['node']
    assert changed.get('node01') and changed.get('node02') and not changed.get('node03'), changed

    summary, changed = fleet.playbook(dict(options, reclaim_confirm=True))
    assert ladders(summary) == {}, ladders(summary)
    assert not any(changed.get(n) for n in nodes), changed
    hung(summary)
    statuses = dict(((n['host'], g['index']), g['status']) for n in summary['nodes'] for g in n['gpus'])
    assert statuses == {('node01', 0): 'ok', ('node01', 1): 'ok', ('node02', 0): 'awaiting_reboot',
                        ('node02', 1): 'awaiting_reboot'}, statuses
    print('\nremediate: %d ansible-playbook runs passed in %.0f s' % (fleet.runs, time.monotonic() - started))


if __name__ == '__main__':
    main()
