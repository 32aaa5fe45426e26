# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The AWX job templates of extras/awx/, run the way AWX runs them: through ansible-runner.

Run by runme.sh after tests/fleet/up (2 nodes) and a simulated project sync:
python awx_runner_test.py --fleet DIR --cache DIR --awx DIR --jobs DIR

Each job gets its own private_data_dir, laid out as AWX's RunJob lays it out (awx/main/tasks/jobs.py):
``project/`` (a copy of the SCM project, extras/awx/project), ``requirements_collections/`` (the
collections the project sync installed from project/collections/requirements.yml, on
ANSIBLE_COLLECTIONS_PATH), ``inventory/hosts`` (an executable script printing the inventory as
JSON), ``env/extravars`` (the survey's defaults and answers, typed as AWX types them and dumped with
every string tagged ``!unsafe``, as AWX does for launch-time variables), ``env/envvars``,
``env/cmdline`` (``--check`` for a check job, ``-u``, ``--become``, ``--forks``) and ``env/settings``.
The job runs through ``ansible_runner.run()`` with an event and a status handler, as AWX calls it.

Checked on every job: status and rc, the status transitions, the job events (playbook_on_stats per
host, no failed or unreachable event, the set_stats artifacts), the artifacts on disk
(``artifacts/<ident>/{rc,status,stdout,job_events/}``). Checked on the nodes (``gpusim show`` over
the fleet's SSH config): check mode and the report-only default kill nothing, the confirmed job
kills the disguised miner and spares the training job, a rerun changes nothing. Only processes this
test started (gpusim workloads on the simulated nodes) are ever signalled. Network: loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import time

import ansible_runner
import yaml

NODES = ['node01', 'node02']
WALLET = '44AFFq5kSiGBoZ4NMDwYtN18obc8AemS33DBLWs3H7otXft3XjrpDtQGv7SqSsaBYBb98uNbr2VBBEt7f2wfn3RVGQBEP3A'
# (key, node, gpu, MiB, util %, user, argv): a crypto-miner disguised as training, next to real jobs
WORKLOADS = [
    ('train1', 'node01', 0, 8192, 95, 'alice', ['python', 'train.py', '--model', 'llama-7b']),
    ('train2', 'node02', 0, 6144, 90, 'alice', ['python', 'train.py', '--epochs', '3']),
    ('miner', 'node02', 1, 4096, 100, 'eve',
     ['python', 'train.py', '--url', 'stratum+tcp://pool.example.net:3333', '--user', WALLET, '-p', 'x']),
]
# rogue_cleanup plans every node (check mode), then calls the nodes the blast-radius limit lets kill again (issue #30)
PLAN_TASK = 'Find the rogue processes and what would be killed (check mode)'
KILL_TASK = "Kill the rogue processes, at most this node's share of reclaim_max_kills"
ANSI = re.compile(r'\x1b\[[0-9;]*m')
STATUSES = ['starting', 'running', 'successful']


class UnsafeDumper(yaml.SafeDumper):
    """AWX's extra vars dump (ALLOW_JINJA_IN_EXTRA_VARS=template, awx/main/utils/safe_yaml.py): every string
    not set in the job template's own extra_vars (none here), keys included, is tagged !unsafe."""

    def represent_data(self, data):
        if isinstance(data, str):
            return self.represent_scalar('!unsafe', data)
        return super().represent_data(data)


def survey_value_valid(question, value):
    """AWX's survey validation (SurveyJobTemplateMixin._survey_element_validation) for the types the surveys use:
    a survey default is sent only when it passes it, and a launch answer is refused when it does not."""
    kind = question['type']
    if kind in ('text', 'textarea'):
        return isinstance(value, str) and within(question, len(value))
    if kind == 'integer':
        return type(value) is int and within(question, value)  # pylint: disable=unidiomatic-typecheck
    if kind == 'multiplechoice':
        return value in question['choices']
    raise AssertionError('survey type %s is not handled by this test' % kind)


def within(question, number):
    """A survey question's min and max (empty or absent: no bound), for a text's length or an integer."""
    low, high = question.get('min'), question.get('max')
    return (low in ('', None) or number >= int(low)) and (high in ('', None) or number <= int(high))


def survey_extra_vars(spec, answers):
    """The extra vars of a launch: the survey defaults that validate, then the launch answers (validated)."""
    names = [q['variable'] for q in spec['spec']]
    unknown = sorted(set(answers) - set(names))
    assert not unknown, 'answers to no survey question: %s' % unknown
    extra = {}
    for question in spec['spec']:
        if question.get('default') is not None and survey_value_valid(question, question['default']):
            extra[question['variable']] = question['default']
    for question in spec['spec']:
        if question['variable'] in answers:
            value = answers[question['variable']]
            assert survey_value_valid(question, value), 'AWX would refuse %s=%r' % (question['variable'], value)
            extra[question['variable']] = value
    return extra


class Job(object):
    """One finished job: its private_data_dir, the runner, the events the handler got, the statuses."""

    def __init__(self, pdd, ident, runner, handled, statuses, args):
        self.pdd = pdd
        self.args = args
        self.ident = ident
        self.runner = runner
        self.handled = handled
        self.statuses = statuses
        self.artifacts = os.path.join(pdd, 'artifacts', ident)
        self.events = list(runner.events)
        with open(os.path.join(self.artifacts, 'stdout'), encoding='utf-8') as handle:
            self.stdout = ANSI.sub('', handle.read())

    def of(self, kind, task=None, host=None):
        return [e for e in self.events if e['event'] == kind
                and (task is None or e['event_data'].get('task') == task)
                and (host is None or e['event_data'].get('host') == host)]

    def stats(self):
        stats = self.of('playbook_on_stats')
        assert len(stats) == 1, 'one playbook_on_stats event, got %d' % len(stats)
        return stats[0]['event_data']

    def changed(self):
        return dict((host, self.stats()['changed'].get(host, 0)) for host in NODES + ['localhost'])

    def kill_results(self):
        """{host: res} of the kill task's runner_on_ok events, else (a node the job did not call to kill) the plan's."""
        results = dict((e['event_data']['host'], e['event_data']['res']) for e in self.of('runner_on_ok', task=PLAN_TASK))
        results.update((e['event_data']['host'], e['event_data']['res']) for e in self.of('runner_on_ok', task=KILL_TASK))
        return results


class Awx(object):
    def __init__(self, args):
        self.args = args
        self.fleet = args.fleet
        self.ssh_config = os.path.join(args.fleet, 'ssh_config')
        self.pids = {}
        self.next_id = 1
        self.started = time.monotonic()
        self.inventory = self.inventory_script_data()

    def ssh(self, node, argv):
        cmd = ['ssh', '-F', self.ssh_config, node, ' '.join(shlex.quote(a) for a in argv)]
        return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout

    def alive(self, key):
        node = [w[1] for w in WORKLOADS if w[0] == key][0]
        procs = json.loads(self.ssh(node, ['gpusim', 'show']))['processes']
        return [p for p in procs if p['pid'] == self.pids[key]][0]['alive']

    def plant(self):
        for key, node, gpu, mib, util, user, argv in WORKLOADS:
            out = self.ssh(node, ['gpusim', 'spawn', '--gpu', str(gpu), '--mib', str(mib), '--util', str(util),
                                  '--user', user, '--'] + argv)
            self.pids[key] = int(out.split()[0])

    def inventory_script_data(self):
        """The fleet's inventory as AWX's Inventory.get_script_data gives it: groups with hosts and vars, _meta.hostvars."""
        out = subprocess.run(['ansible-inventory', '-i', os.path.join(self.fleet, 'inventory.ini'), '--list', '--export'],
                             check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
        data = json.loads(out)
        assert sorted(data['gpu_nodes']['hosts']) == NODES, data
        return data

    def launch(self, template, answers=None, job_type='run'):
        """Launch the job template: lay out the private_data_dir as AWX does, run it through ansible_runner.run()."""
        ident = str(self.next_id)
        self.next_id += 1
        with open(os.path.join(self.args.awx, 'surveys', template + '.yml'), encoding='utf-8') as handle:
            spec = yaml.safe_load(handle)
        with open(os.path.join(self.args.awx, 'job_templates.yml'), encoding='utf-8') as handle:
            jt = [t for t in yaml.safe_load(handle)['controller_templates'] if t['playbook'] == template + '.yml'][0]
        assert job_type == jt['job_type'] or jt['ask_job_type_on_launch'], jt
        extra = survey_extra_vars(spec, answers or {})
        # meta variables AWX adds to every job (Job.awx_meta_vars), overriding the template's extra vars
        for prefix in ('awx', 'tower'):
            extra.update({prefix + '_job_id': int(ident), prefix + '_job_launch_type': 'manual',
                          prefix + '_job_template_name': jt['name'], prefix + '_project_revision': 'test'})

        pdd = os.path.join(self.args.jobs, 'job_%s' % ident)
        for sub in ('inventory', 'env'):
            os.makedirs(os.path.join(pdd, sub))
        os.mkdir(os.path.join(pdd, 'cp'), 0o700)
        # RunProjectUpdate.make_local_copy: the project checkout and the collections of its requirements
        shutil.copytree(self.args.project, os.path.join(pdd, 'project'), symlinks=True)
        shutil.copytree(os.path.join(self.args.cache, 'requirements_collections'), os.path.join(pdd, 'requirements_collections'),
                        symlinks=True)
        hosts = os.path.join(pdd, 'inventory', 'hosts')
        write(hosts, '#! /usr/bin/env python3\n# -*- coding: utf-8 -*-\nprint(%r)\n' % json.dumps(self.inventory), 0o700)
        write(os.path.join(pdd, 'env', 'extravars'), yaml.dump(extra, Dumper=UnsafeDumper, default_flow_style=False))
        write(os.path.join(pdd, 'env', 'envvars'), yaml.safe_dump({
            # awx/settings/defaults.py ANSIBLE_* (host key checking left on: the fleet pins its keys, docs/awx.md)
            'ANSIBLE_FORCE_COLOR': 'True', 'ANSIBLE_HOST_KEY_CHECKING': 'True', 'ANSIBLE_INVENTORY_UNPARSED_FAILED': 'True',
            'ANSIBLE_PARAMIKO_RECORD_HOST_KEYS': 'False', 'ANSIBLE_RETRY_FILES_ENABLED': 'False',
            'ANSIBLE_SSH_CONTROL_PATH_DIR': os.path.join(pdd, 'cp'), 'AWX_PRIVATE_DATA_DIR': pdd,
            'JOB_ID': ident, 'INVENTORY_ID': '1', 'PROJECT_REVISION': 'test',
            # RunJob.build_env: the job's requirements_collections first (/runner/requirements_collections in an EE)
            'ANSIBLE_COLLECTIONS_PATH': os.pathsep.join([os.path.join(pdd, 'requirements_collections'),
                                                         '~/.ansible/collections', '/usr/share/ansible/collections']),
        }))
        # RunJob.build_args: --check for a check job, the machine credential's user and become method, the template's forks
        args = (['--check'] if job_type == 'check' else []) + ['-u', 'root']
        if jt.get('become_enabled'):
            args += ['--become', '--become-method', 'su']
        args.append('--forks=%d' % jt['forks'])
        write(os.path.join(pdd, 'env', 'cmdline'), ansible_runner.utils.args2cmdline(*args))
        # AWX also sets suppress_output_file (it streams the events to its database): kept here to check the stdout artifact
        write(os.path.join(pdd, 'env', 'settings'), json.dumps({'job_timeout': 300, 'suppress_ansible_output': True,
                                                                'suppress_output_file': False}))

        handled, statuses = [], []
        print('\n### job %s: %s (%s) %s' % (ident, template, job_type, json.dumps(answers or {})), flush=True)
        begun = time.monotonic()
        runner = ansible_runner.run(private_data_dir=pdd, ident=ident, playbook=jt['playbook'], inventory=hosts,
                                    event_handler=lambda event: handled.append(event) or True,
                                    status_handler=lambda data, runner_config: statuses.append(data['status']))
        job = Job(pdd, ident, runner, handled, statuses, args)
        print(job.stdout[-6000:])
        print('### job %s: %s rc=%s in %.1f s' % (ident, runner.status, runner.rc, time.monotonic() - begun), flush=True)
        check_job(job)
        return job


def write(path, text, mode=0o600):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, 'w', encoding='utf-8') as handle:
        handle.write(text)


def check_job(job):
    """What every job of these templates must show: a successful run, its events and its artifacts."""
    assert (job.runner.status, job.runner.rc) == ('successful', 0), (job.runner.status, job.runner.rc)
    assert job.statuses == STATUSES, job.statuses
    for name, content in (('rc', '0'), ('status', 'successful')):
        with open(os.path.join(job.artifacts, name), encoding='utf-8') as handle:
            assert handle.read().strip() == content, name
    with open(os.path.join(job.artifacts, 'command'), encoding='utf-8') as handle:
        command = json.load(handle)
    # ansible-runner starts the playbook in the project directory, with the job's inventory, extra vars and cmdline
    assert command['cwd'] == os.path.join(job.pdd, 'project'), command['cwd']
    argv = command['command']
    assert os.path.basename(argv[0]) == 'ansible-playbook' and argv[-1].endswith('.yml'), argv
    for pair in (['-i', os.path.join(job.pdd, 'inventory', 'hosts')], ['-e', '@' + os.path.join(job.pdd, 'env', 'extravars')]):
        assert any(argv[i:i + 2] == pair for i in range(len(argv))), (pair, argv)
    assert [a for a in argv if a.startswith('-') and a not in ('-i', '-e')] == [a for a in job.args if a.startswith('-')], argv
    files = sorted(os.listdir(os.path.join(job.artifacts, 'job_events')))
    assert len(files) == len(job.events) == len(job.handled) > 0, (len(files), len(job.events), len(job.handled))
    assert sorted(e['uuid'] for e in job.events) == sorted(e['uuid'] for e in job.handled)
    assert [e['event'] for e in job.events][0] == 'playbook_on_start' and job.events[-1]['event'] == 'playbook_on_stats'
    bad = [(e['event'], e['event_data'].get('host'), e['event_data'].get('task'))
           for e in job.events if e['event'] in ('runner_on_failed', 'runner_on_unreachable', 'runner_on_async_failed')]
    assert not bad, bad
    stats = job.stats()
    for key in ('failures', 'dark', 'rescued', 'ignored'):
        assert not stats[key], (key, stats[key])
    assert sorted(stats['processed']) == sorted(NODES + ['localhost']), stats['processed']
    for host in NODES:
        # the recap's ok count for a node is its number of runner_on_ok events
        assert stats['ok'][host] == len(job.of('runner_on_ok', host=host)), (host, stats['ok'])
    assert 'PLAY RECAP' in job.stdout
    for host in NODES:
        assert re.search(r'^%s\s+: ok=%d\s+changed=%d\s+unreachable=0\s+failed=0' % (host, stats['ok'][host], stats['changed'].get(host, 0)),
                         job.stdout, re.M), 'recap line of %s' % host


def test_inventory_report(awx):
    """Survey defaults only: report_dir ./gpu-report lands in the job's project directory, the cwd of the run."""
    for job_type in ('run', 'check'):
        job = awx.launch('inventory_report', job_type=job_type)
        report_dir = os.path.join(job.pdd, 'project', 'gpu-report')
        for name in ('index.html', 'fleet.json', 'fleet.csv'):
            assert os.path.getsize(os.path.join(report_dir, name)) > 0, name
        assert not os.path.exists(os.path.join(job.pdd, 'requirements_collections', 'ansible_collections', 'gpufleet', 'reclaim',
                                               'playbooks', 'gpu-report')), 'the report went into the collection'
        with open(os.path.join(report_dir, 'fleet.json'), encoding='utf-8') as handle:
            report = json.load(handle)
        assert (report['totals']['nodes'], report['totals']['nodes_ok'], report['totals']['gpus']) == (2, 2, 4), report['totals']
        users = dict((u['user'], u['used_mib']) for u in report['offenders']['top_users'])
        assert users == {'alice': 8192 + 6144, 'eve': 4096}, users
        artifact = job.stats()['artifact_data']['gpufleet_inventory_report']
        assert artifact['report_dir'] == report_dir, artifact
        assert 'report: %s/index.html' % report_dir in job.stdout
        assert job.changed()['node01'] == job.changed()['node02'] == 0, job.changed()


def test_rogue_cleanup(awx):
    miner = awx.pids['miner']
    # 1. The survey defaults: reclaim_confirm "false", report only; the kill task runs in check mode and names the miner.
    job = awx.launch('rogue_cleanup')
    summary = job.stats()['artifact_data']['gpufleet_rogue_cleanup']
    assert (summary['mode'], summary['killed'], summary['would_kill']) == ('report only', 0, 1), summary
    assert [(p['host'], p['pid'], p['action']) for p in summary['processes']] == [('node02', miner, 'would kill')], summary
    results = job.kill_results()
    # one call per node audits and plans the kills (issues #21, #30): it runs on node01 too, which has nothing to kill
    assert sorted(results) == NODES and [p['pid'] for p in results['node02']['killed']] == [miner], results
    assert results['node01']['killed'] == [] and results['node01']['rogue_summary']['critical'] == 0, results['node01']
    assert [f['pid'] for f in results['node02']['findings'] if f['level'] == 'critical'] == [miner], results['node02']
    assert set(job.changed().values()) == {0}, job.changed()
    assert awx.alive('miner') and awx.alive('train1') and awx.alive('train2')

    # 2. Check job (job_type check, i.e. --check) with "Kill for real" = "true": check mode wins, nothing is killed.
    job = awx.launch('rogue_cleanup', {'reclaim_confirm': 'true'}, job_type='check')
    summary = job.stats()['artifact_data']['gpufleet_rogue_cleanup']
    assert (summary['mode'], summary['killed'], summary['would_kill']) == ('check mode', 0, 1), summary
    assert [p['pid'] for p in job.kill_results()['node02']['killed']] == [miner]
    # Ansible's check-mode convention: "changed" is what a real run would change (node02's kill), nothing more
    assert job.changed() == {'node01': 0, 'node02': 1, 'localhost': 0}, job.changed()
    assert awx.alive('miner') and awx.alive('train1') and awx.alive('train2')

    # 3. Confirmed: the miner dies, alice's training next to it on node02 and on node01 lives.
    job = awx.launch('rogue_cleanup', {'reclaim_confirm': 'true'})
    summary = job.stats()['artifact_data']['gpufleet_rogue_cleanup']
    assert (summary['mode'], summary['killed'], summary['kill_failures'], summary['freed_mib']) == ('kill', 1, 0, 4096), summary
    res = job.kill_results()['node02']
    assert res['changed'] and [(p['pid'], p['user']) for p in res['killed']] == [(miner, 'eve')], res
    assert res['killed'][0]['signals'] == ['SIGTERM'], res['killed']
    assert res['invocation']['module_args']['timeout'] == 10, 'the survey default kill_timeout (integer 10) was not used'
    assert job.changed() == {'node01': 0, 'node02': 1, 'localhost': job.changed()['localhost']}, job.changed()
    assert not awx.alive('miner'), 'the miner survived the confirmed job'
    assert awx.alive('train1') and awx.alive('train2'), 'a legitimate job was killed'
    assert 'node02: killed pid %d (eve, 4096 MiB on GPU 1)' % miner in job.stdout

    # 4. The same launch again: nothing left to kill, no node changed.
    job = awx.launch('rogue_cleanup', {'reclaim_confirm': 'true'})
    summary = job.stats()['artifact_data']['gpufleet_rogue_cleanup']
    assert (summary['killed'], summary['findings_by_level']['critical']) == (0, 0), summary
    assert not [h for h, res in job.kill_results().items() if res['killed'] or res['changed']], 'a kill ran on the rerun'
    assert job.changed()['node01'] == job.changed()['node02'] == 0, job.changed()
    assert awx.alive('train1') and awx.alive('train2')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--fleet', required=True, help='tests/fleet/up directory')
    parser.add_argument('--cache', required=True, help='the project sync cache: requirements_collections/')
    parser.add_argument('--awx', required=True, help="the collection's extras/awx (surveys/, job_templates.yml)")
    parser.add_argument('--project', required=True, help='the SCM project (extras/awx/project)')
    parser.add_argument('--jobs', required=True, help='where the private_data_dirs go')
    awx = Awx(parser.parse_args())
    awx.plant()
    test_inventory_report(awx)
    test_rogue_cleanup(awx)
    print('\nawx_runner: %d ansible-runner jobs passed in %.0f s' % (awx.next_id - 1, time.monotonic() - awx.started))


if __name__ == '__main__':
    main()
