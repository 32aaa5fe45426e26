# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The remediation ladder on a simulated fleet of 3 nodes with 2 GPUs each.

Run by runme.sh after tests/fleet/up: python remediate_test.py --fleet DIR.

* node01 GPU 0: 4 GiB of orphaned memory -> a verified reset.
* node02 GPU 1: orphaned memory while ``nvidia_drm`` holds a kernel reference -> the reset is
  refused naming nvidia_drm and its refcnt, and the GPU is flagged for reboot.
* With the simulator's Xid events (``gpusim xid``, issue #17 item 6): node01 GPU 1 runs an
  application that logged Xid 13 -> that process is killed; node03 GPU 0 logged Xid 79 -> flagged
  for reboot.  Without ``gpusim xid`` these two cases are left out (said on stdout).

Check mode predicts every ladder and changes nothing; confirmed, the steps happen; a rerun
changes nothing.  Ground truth comes from ``gpusim show`` and the flag files on the nodes.  Only
processes this test started (gpusim spawn on the nodes) are signalled, by the module.
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--fleet', required=True)
    args = parser.parse_args()
    fleet = Fleet(args.fleet)
    started = time.monotonic()

    fleet.gpusim('node01', 'leak', '--gpu', '0', '--mib', '4096')
    fleet.gpusim('node02', 'leak', '--gpu', '1', '--mib', '4096')
    fleet.gpusim('node02', 'set', '--module-refcnt', 'nvidia_drm=1')
    xids = fleet.ssh('node01', ['gpusim', 'xid', '--help'], check=False).returncode == 0
    app = None
    if xids:
        app = int(fleet.gpusim('node01', 'spawn', '--gpu', '1', '--mib', '2048', '--', 'python', 'train.py').split()[0])
        fleet.gpusim('node01', 'xid', '--gpu', '1', '--code', '13', '--pid', app)
        fleet.gpusim('node03', 'xid', '--gpu', '0', '--code', '79')
    else:
        print('remediate: this simulator has no `gpusim xid` (issue #17 item 6): the Xid 13 and Xid 79 cases are left out')

    expected_plan = {
        ('node01', 0): [('reset', 'would_run')],
        ('node02', 1): [('reset', 'would_be_refused'), ('drain', 'node_unavailable'), ('reboot_flag', 'node_would_write')],
    }
    if xids:
        expected_plan[('node01', 1)] = [('kill_application', 'would_run')]
        expected_plan[('node03', 0)] = [('drain', 'node_unavailable'), ('reboot_flag', 'node_would_write')]

    for check in (True, False):  # --check, then report only (the default): both predict and change nothing
        summary, changed = fleet.playbook(check=check)
        assert ladders(summary) == expected_plan, ladders(summary)
        assert 'nvidia_drm: 1 reference(s) (refcnt 1' in details(summary, 'node02', 1)
        assert not any(changed.get(n) for n in ('node01', 'node02', 'node03')), changed
    assert [g['reset_count'] for g in fleet.show('node01')['gpus']] == [0, 0]
    assert all(fleet.flag(n) is None for n in ('node01', 'node02', 'node03'))
    if app:
        assert fleet.alive('node01', app)

    summary, changed = fleet.playbook({'reclaim_confirm': True})
    done = ladders(summary)
    assert done[('node01', 0)] == [('reset', 'done')], done
    assert done[('node02', 1)] == [('reset', 'refused'), ('drain', 'node_unavailable'), ('reboot_flag', 'node_written')], done
    assert 'kernel_modules' in details(summary, 'node02', 1) and 'nvidia_drm' in details(summary, 'node02', 1)
    node1 = fleet.show('node01')['gpus']
    assert (node1[0]['reset_count'], node1[0]['leaked_mib']) == (1, 0)
    assert fleet.show('node02')['gpus'][1]['reset_count'] == 0
    flag = fleet.flag('node02')
    assert list(flag['gpus'].values()) == [flag['reasons'][0]] and 'nvidia_drm' in flag['reasons'][0]
    assert summary['nodes_reboot_wanted'] == (['node02', 'node03'] if xids else ['node02'])
    if xids:
        assert done[('node01', 1)] == [('kill_application', 'done')] and not fleet.alive('node01', app)
        assert 'Xid 79' in json.dumps(fleet.flag('node03'))
    assert changed.get('node01') and changed.get('node02')

    summary, changed = fleet.playbook({'reclaim_confirm': True})
    assert ladders(summary) == {}, ladders(summary)
    assert not any(changed.get(n) for n in ('node01', 'node02', 'node03')), changed
    statuses = dict(((n['host'], g['index']), g['status']) for n in summary['nodes'] for g in n['gpus'])
    assert statuses[('node02', 1)] == 'awaiting_reboot'
    print('\nremediate: %d ansible-playbook runs passed in %.0f s' % (fleet.runs, time.monotonic() - started))


if __name__ == '__main__':
    main()
