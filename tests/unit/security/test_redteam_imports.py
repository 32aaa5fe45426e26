# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: root imports nothing a user planted, on every path that starts our Python (issue #28, T63-T65).

alice leaves modules named like psutil, pynvml, yaml, ansible, json and __future__ (files and package
directories), sitecustomize.py, usercustomize.py and .pth files in the directory the admin works in,
in a directory PYTHONPATH names, in her user site-packages (PYTHONUSERBASE, HOME) and behind
PYTHONWARNINGS (tests/unit/security/planted.py).  Each planted piece leaves a mark when it runs.

* the control: a Python that is not isolated, started from her directory with her environment,
  runs every piece (so each is a live attack);
* the modules' import probe and the module respawned through Ansible (``ansible -c local`` from her
  directory, ansible-core of this run, and 2.17 with a Python 3.8 record when the floor suite names
  them) run none, and the module still runs under the recorded interpreter (a wrapper that logs how
  it was started, and the GPUs only that interpreter's pynvml can list);
* a relative path in a module option still names the file in the working directory;
* the guard's launcher and the Slurm prolog and epilog, started from her directory with her
  environment, run none and still do their work.

SAFETY: the Ansible, launcher and Slurm runs happen in a PID and mount namespace (redteam.run):
/etc/gpufleet, /var/lib/gpufleet, /var/log/gpufleet and /var/lib/node_exporter are private tmpfs
there and /dev is a private tmpfs with plain files for the GPU device nodes (tests/fleet's
build_dev), so nothing of the host is written; missing mount points are created empty, as
tests/fleet/up does.  No process is signalled: the prolog and epilog find none of the job's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from ansible.plugins.filter.core import FilterModule as CoreFilters

from ansible_collections.gpufleet.reclaim.plugins.module_utils import node_python
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.security import planted, redteam

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
# the floor suite (tests/floor/run) names its ansible-core 2.17 controller and its Python 3.8 node interpreter
FLOOR_ANSIBLE = os.environ.get('GPUFLEET_FLOOR_ANSIBLE_BIN', '')
FLOOR_PYTHON = os.environ.get('GPUFLEET_FLOOR_NODE_PYTHON', '')
PRIVATE_DIRS = ('/etc/gpufleet', '/var/lib/gpufleet', '/var/log/gpufleet', '/var/lib/node_exporter')
GPU_FILES = ('nvidiactl', 'nvidia0', 'nvidia1')
RULES = 'allowlist:\n  - user: alice\n    no_such_key: 1\n'   # line 3 names a key the schema does not know


def ansible_parent():
    """The directory the running ansible-core is imported from (what an AnsiballZ zip holds)."""
    import ansible  # pylint: disable=import-outside-toplevel
    return os.path.dirname(os.path.dirname(os.path.abspath(ansible.__file__)))


# ============================================================================ the control and the probe (no namespace)
@pytest.mark.parametrize('layout', planted.LAYOUTS)
def test_what_a_user_plants_runs_in_a_python_that_is_not_isolated(tmp_path, layout):
    """The harness sees what it bans: every vector is live for `python -c` started as before the fix."""
    user = planted.HostileUser(str(tmp_path / 'alice'), str(tmp_path / 'marks'), layout, pythons=[planted.base_python()])
    found = planted.control_run(user, planted.base_python())
    uid = os.getuid()
    for mark in ('psutil.cwd', 'json.cwd', 'sitecustomize.pythonpath', 'planted_warning.pythonpath', 'usercustomize.usersite',
                 'pth.usersite'):
        assert '%s.%d' % (mark, uid) in found, (mark, found)


@pytest.mark.parametrize('layout', planted.LAYOUTS)
def test_the_import_probe_runs_nothing_a_user_planted(tmp_path, monkeypatch, layout):
    """node_python.probe_missing from her directory with her environment: no mark, and the answer is right."""
    pythons = [planted.this_python(), planted.base_python()]
    user = planted.HostileUser(str(tmp_path / 'alice'), str(tmp_path / 'marks'), layout, pythons=pythons)
    for name, value in user.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(user.cwd)
    assert node_python.probe_missing(planted.this_python(), ['psutil', 'pynvml', 'yaml'], modlib_path=ansible_parent()) == []
    node_python.probe_missing(planted.base_python(), ['psutil', 'pynvml', 'yaml'], modlib_path=ansible_parent())
    assert node_python.probe_missing(planted.this_python(), ['gpufleet_no_such_module', 'yaml'], '') == ['gpufleet_no_such_module']
    assert user.seen() == []


def test_an_interpreter_that_does_not_answer_lacks_everything(tmp_path):
    script = tmp_path / 'python'
    script.write_text('#!/bin/sh\necho "import noise"\nexit 0\n')
    script.chmod(0o755)
    assert node_python.probe_missing(str(script), ['psutil'], '') == ['psutil']
    assert node_python.probe_missing(str(tmp_path / 'missing'), ['psutil'], '/x.zip') == ['psutil', node_python.ANSIBLE_BASIC]


def test_the_respawn_runs_the_payload_isolated_in_the_working_directory(tmp_path, monkeypatch):
    """node_python.respawn: the payload on standard input of `interpreter -I -`, here, and its exit status."""
    log = tmp_path / 'started'
    wrapper = tmp_path / 'python'
    wrapper.write_text('#!/bin/sh\necho "$1 $2 $PWD" > %s\nexec %s "$@"\n' % (log, sys.executable))
    wrapper.chmod(0o755)
    work = tmp_path / 'work'
    work.mkdir()
    monkeypatch.chdir(str(work))
    with pytest.raises(SystemExit) as ended:
        node_python.respawn(str(wrapper), 'import sys, os\nsys.exit(7 if sys.flags.isolated and "" not in sys.path else 1)\n')
    assert ended.value.code == 7 and log.read_text().split() == ['-I', '-', str(work)]


def test_an_ansible_core_without_a_known_payload_is_no_respawn_and_a_warning(tmp_path, monkeypatch):
    python = tmp_path / 'python'
    python.write_text('#!/bin/sh\necho "[]"\n')
    python.chmod(0o755)
    record = tmp_path / 'record'
    record.write_text('%s\n' % python)
    record.chmod(0o644)

    def unknown():
        raise ImportError('no payload')
    monkeypatch.setattr(node_python, 'respawn_payload', unknown)
    monkeypatch.setattr(node_python, 'respawn', lambda *args: pytest.fail('respawned'))
    monkeypatch.setattr(node_python, 'has_respawned', lambda: False)
    monkeypatch.setitem(sys.modules, 'psutil', None)
    warnings = []
    module = type('Module', (), {'warn': lambda self, text: warnings.append(text)})()
    node_python.respawn_if_needed(module, str(record), str(tmp_path / 'none'), dev_roots=[str(tmp_path)])
    assert warnings == ['the module was not re-run under %s: this ansible-core has no respawn payload the collection knows' % python]


def test_both_ansible_core_payloads_are_known():
    """2.19 and later: _ansiballz._respawn.create_payload; 2.17 and 2.18: common.respawn._create_payload (the floor runs it)."""
    try:
        from ansible.module_utils._internal._ansiballz import _respawn  # pylint: disable=import-outside-toplevel
        assert callable(_respawn.create_payload)
    except ImportError:
        from ansible.module_utils.common import respawn  # pylint: disable=import-outside-toplevel
        assert callable(respawn._create_payload)  # pylint: disable=protected-access


# ============================================================================ static: every Python a role starts is isolated
def python_argvs(text):
    """(task name, the argv's first two elements) of every command task in a role's tasks file that runs a Python."""
    found = []
    for task in _tasks(yaml.safe_load(text) or []):
        for key in ('ansible.builtin.command', 'command'):
            argv = (task.get(key) or {}).get('argv') if isinstance(task.get(key), dict) else None
            if isinstance(argv, str):   # a template of a list: its first two elements
                argv = [part.strip(" '\"") for part in argv.strip('{} []').split(',')[:2]]
            if argv and any(word in str(argv[0]) for word in ('python', 'interpreter')):
                found.append((task.get('name'), [str(part) for part in argv[:2]]))
        venv = (task.get('ansible.builtin.pip') or {}).get('virtualenv_command')
        if venv:
            found.append((task.get('name'), venv.split()[:2]))
    return found


def _tasks(items):
    for item in items:
        if isinstance(item, dict):
            yield item
            for key in ('block', 'rescue', 'always'):
                yield from _tasks(item.get(key) or [])


def test_the_static_check_sees_a_python_that_is_not_isolated():
    text = ('- name: probe\n  ansible.builtin.command:\n    argv: "{{ [__x_interpreter, \'-c\', script] }}"\n'
            '- name: venv\n  ansible.builtin.pip:\n    name: x\n    virtualenv_command: /usr/bin/python3 -m venv\n')
    assert python_argvs(text) == [('probe', ['__x_interpreter', '-c']), ('venv', ['/usr/bin/python3', '-m'])]


def test_every_python_a_role_starts_runs_isolated():
    seen = []
    for dirpath, _dirnames, filenames in os.walk(os.path.join(ROOT, 'roles')):
        for filename in filenames:
            if filename.endswith('.yml') and os.path.basename(dirpath) == 'tasks':
                with open(os.path.join(dirpath, filename)) as handle:
                    seen.extend(python_argvs(handle.read()))
    assert len(seen) >= 5 and all(argv[1] == '-I' for _name, argv in seen), seen


def test_the_units_cron_and_slurm_scripts_start_the_launcher_itself():
    """Its shebang's -I then holds: nothing runs it as `python launcher`."""
    templates = os.path.join(ROOT, 'roles', 'guard', 'templates')
    with open(os.path.join(templates, 'gpufleet-guard.j2')) as handle:
        assert handle.readline() == "{{ '#!' ~ __gpu_guard_python ~ ' -I' }}\n"
    for name in ('gpufleet-guard.service.j2', 'gpufleet-guard-audit.service.j2'):
        with open(os.path.join(templates, name)) as handle:
            assert [line for line in handle if line.startswith('ExecStart=')] in (
                ['ExecStart={{ __gpu_guard_bin }} tick --quiet\n'], ['ExecStart={{ __gpu_guard_bin }} audit\n'])
    with open(os.path.join(templates, 'gpufleet-guard.cron.j2')) as handle:
        assert 'python' not in handle.read()
    with open(os.path.join(ROOT, 'roles', 'slurm', 'templates', 'gpufleet-slurm.sh.j2')) as handle:
        script = handle.read()
    assert '\ncd / || exit 2\n' in script and '\nexec {{ gpu_slurm_guard | quote }} {{ __gpu_slurm_script }} ' in script


# ============================================================================ in a namespace: Ansible, the launcher, the Slurm scripts
def _private_node(node):
    """The paths root writes become private tmpfs, /dev a private one with the NVIDIA device files."""
    sys.path.insert(0, os.path.join(ROOT, 'tests', 'fleet', 'lib'))
    import node_setup  # pylint: disable=import-outside-toplevel,import-error
    for path in PRIVATE_DIRS:
        if not os.path.isdir(path):
            os.makedirs(path, 0o755)   # an empty mount point, as tests/fleet/up makes them; never mounted on in the host's namespace
        node_setup.mount('gpufleet-redteam', path, 'tmpfs', node_setup.MS_NOSUID, 'mode=0755')
    stage = os.path.join(node.sim.root, 'devstage')
    os.mkdir(stage)
    node_setup.build_dev(stage, GPU_FILES, ())


def _run(argv, cwd, env, data=None):
    proc = subprocess.run(argv, cwd=cwd, env=env, input=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300, check=False)
    return {'rc': proc.returncode, 'out': proc.stdout.decode(errors='replace')[-6000:], 'err': proc.stderr.decode(errors='replace')[-3000:]}


def _recorded_interpreter(real):
    """/etc/gpufleet/python names a root-owned wrapper that logs its first two arguments and working directory."""
    os.makedirs('/etc/gpufleet/bin', 0o755)
    with open('/etc/gpufleet/bin/python', 'w') as handle:
        handle.write('#!/bin/sh\necho "$1 $2 $PWD" >> /etc/gpufleet/started\nexec %s "$@"\n' % real)
    os.chmod('/etc/gpufleet/bin/python', 0o755)
    with open(node_python.RECORD, 'w') as handle:
        handle.write('/etc/gpufleet/bin/python\n')
    os.chmod(node_python.RECORD, 0o644)


def _started():
    with open('/etc/gpufleet/started') as handle:
        lines = handle.read().splitlines()
    os.unlink('/etc/gpufleet/started')
    return lines


def ansible_scenario(node):
    """gpu_facts and gpu_audit through `ansible -c local` from alice's directory, the node's first interpreter lacking
    psutil and pynvml; /etc/gpufleet/python names the interpreter that has them."""
    _private_node(node)
    ansible_bin = os.environ['GPUFLEET_REDTEAM_ANSIBLE_BIN']
    recorded = os.environ['GPUFLEET_REDTEAM_RECORDED']
    _recorded_interpreter(recorded)
    work = os.path.join(node.work, 'admin')
    first = os.path.join(node.work, 'first')
    subprocess.run([sys.executable, '-I', '-m', 'venv', '--without-pip', first], check=True, timeout=120, cwd='/')
    os.makedirs(work)
    open(os.path.join(work, 'ansible.cfg'), 'w').close()
    env = h.shim_env(node.sim.state)
    env.update(PATH=ansible_bin + os.pathsep + env['PATH'], HOME=work, ANSIBLE_CONFIG=os.path.join(work, 'ansible.cfg'),
               ANSIBLE_COLLECTIONS_PATH=h.COLLECTIONS_DIR, ANSIBLE_LOCAL_TEMP=os.path.join(work, 'tmp'),
               ANSIBLE_REMOTE_TEMP=os.path.join(work, 'rtmp'), ANSIBLE_PIPELINING='0', ANSIBLE_NOCOLOR='1')

    def ansible(cwd, module, args):
        return _run([os.path.join(ansible_bin, 'ansible'), 'localhost', '-i', 'localhost,', '-c', 'local', '-m', module, '-a', args,
                     '-e', 'ansible_python_interpreter=%s/bin/python' % first], cwd, env)

    out = {'version': _run([os.path.join(ansible_bin, 'ansible'), '--version'], '/', env)['out'].splitlines()[0]}
    for layout in planted.LAYOUTS:
        user = planted.HostileUser(os.path.join(node.work, layout), os.path.join(node.work, layout + '-marks'), layout,
                                   pythons=[recorded])
        os.chmod(node.work, 0o755)
        result = ansible(user.cwd, 'gpufleet.reclaim.gpu_facts', 'vendor=nvidia')
        out[layout] = dict(result, marks=user.seen(), started=_started(), cwd=user.cwd)
    # a relative path in an option: the file in the (root's) working directory, read after the respawn
    with open(os.path.join(work, 'rules.yml'), 'w') as handle:
        handle.write(RULES)
    out['relative'] = dict(ansible(work, 'gpufleet.reclaim.gpu_audit', 'rules_file=rules.yml'), started=_started(), cwd=work)
    return out


def _ansible_result(text):
    """(SUCCESS or FAILED!, the result) from the line `localhost | STATUS => {` of the minimal callback on."""
    start = text.rfind('localhost | ')
    assert start >= 0, text
    head, _sep, body = text[start:].partition(' => ')
    return head.split(' | ', 1)[1].strip(), json.loads(body)


def _controllers():
    found = [pytest.param(os.path.dirname(shutil.which('ansible') or sys.executable), planted.this_python(), id='this-ansible-core')]
    if FLOOR_ANSIBLE and FLOOR_PYTHON:
        found.append(pytest.param(FLOOR_ANSIBLE, FLOOR_PYTHON, id='floor-2.17-python3.8'))
    return found


@redteam.needs_namespace
@pytest.mark.parametrize('ansible_bin, recorded', _controllers())
def test_a_module_run_from_a_hostile_directory_imports_nothing_there_and_runs_under_the_recorded_interpreter(
        monkeypatch, ansible_bin, recorded):
    if not os.path.exists(os.path.join(ansible_bin, 'ansible')):
        pytest.skip('no ansible command next to %s' % ansible_bin)
    monkeypatch.setenv('GPUFLEET_REDTEAM_ANSIBLE_BIN', ansible_bin)
    monkeypatch.setenv('GPUFLEET_REDTEAM_RECORDED', recorded)
    seen = redteam.run(ansible_scenario, timeout=600)
    sys.stderr.write('redteam imports: %s, recorded %s\n' % (seen['version'], recorded))
    for layout in planted.LAYOUTS:
        run = seen[layout]
        status, result = _ansible_result(run['out'])
        assert status == 'SUCCESS', run
        assert run['marks'] == [], run['marks']
        # the probe (from /) and the respawn (in her directory, where the module was started), both isolated
        assert run['started'] == ['-I -c /', '-I - %s' % run['cwd']], run['started']
        # only the recorded interpreter's pynvml lists the simulated GPUs (the first interpreter has no pynvml)
        assert len(result['ansible_facts']['gpu']['devices']) == 2, result
    status, result = _ansible_result(seen['relative']['out'])
    assert status == 'FAILED!' and seen['relative']['started'][-1] == '-I - %s' % seen['relative']['cwd']
    assert result['msg'].startswith('invalid rogue rules: rules.yml:3: ') and result['file'] == 'rules.yml', result


def _render(template, **variables):
    import jinja2  # pylint: disable=import-outside-toplevel
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.dirname(template)), undefined=jinja2.StrictUndefined,
                             trim_blocks=True)
    env.filters.update(CoreFilters().filters())
    return env.get_template(os.path.basename(template)).render(ansible_managed='Ansible managed (test)', **variables)


def _install(path, text):
    with open(path, 'w') as handle:
        handle.write(text)
    os.chmod(path, 0o755)


def guard_scenario(node):
    """The launcher (`list`, `check-config`) and the Slurm prolog and epilog started from alice's directory with her
    environment, as sudo -E, a cron job or slurmd could start them."""
    _private_node(node)
    prefix = os.path.join(node.work, 'opt')
    os.makedirs(os.path.join(prefix, 'bin'))
    os.makedirs(os.path.join(prefix, 'lib'))
    planted.copy_core(h.MODULE_UTILS_DIR, os.path.join(prefix, 'lib'))
    launcher = os.path.join(prefix, 'bin', 'gpufleet-guard')
    _install(launcher, _render(os.path.join(ROOT, 'roles', 'guard', 'templates', 'gpufleet-guard.j2'),
                               __gpu_guard_python=planted.this_python(), gpu_guard_prefix=prefix))
    scripts = {}
    for script in ('prolog', 'epilog'):
        scripts[script] = os.path.join(prefix, 'bin', script)
        _install(scripts[script], _render(
            os.path.join(ROOT, 'roles', 'slurm', 'templates', 'gpufleet-slurm.sh.j2'), __gpu_slurm_script=script,
            gpu_slurm_env={}, gpu_slurm_guard=launcher, gpu_slurm_grace=1, gpu_slurm_kill_wait=1, gpu_slurm_release_timeout=2,
            gpu_slurm_command_timeout=2, gpu_slurm_drain=False, gpu_slurm_dry_run=False))
    os.chmod(node.work, 0o755)
    out = {'shebang': open(launcher).readline().strip()}
    for layout in planted.LAYOUTS:
        user = planted.HostileUser(os.path.join(node.work, layout), os.path.join(node.work, layout + '-marks'), layout,
                                   pythons=[planted.this_python()])
        env = user.env(h.shim_env(node.sim.state))
        env.update(SLURM_JOB_ID='7', SLURM_JOB_UID=str(node.uids['alice']), SLURM_JOB_GPUS='0', SLURMD_NODENAME='node01')
        runs = {'list': _run([launcher, 'list', '--json'], user.cwd, env),
                'check-config': _run([launcher, 'check-config', '--json', '-'], user.cwd, env, b'mode: dry-run\n')}
        for script in ('prolog', 'epilog'):
            runs[script] = _run([scripts[script]], user.cwd, env)
        out[layout] = dict(runs=runs, marks=user.seen())
    out['log'] = []
    if os.path.exists('/var/log/gpufleet/guard.jsonl'):
        with open('/var/log/gpufleet/guard.jsonl') as handle:
            out['log'] = [json.loads(line) for line in handle if line.strip()]
    return out


@redteam.needs_namespace
def test_the_guard_launcher_and_the_slurm_scripts_from_a_hostile_directory_and_environment_import_nothing_there():
    seen = redteam.run(guard_scenario, timeout=600)
    assert seen['shebang'] == '#!%s -I' % planted.this_python()
    for layout in planted.LAYOUTS:
        runs = seen[layout]['runs']
        assert seen[layout]['marks'] == [], seen[layout]['marks']
        assert all(run['rc'] == 0 for run in runs.values()), runs
        listing = json.loads(runs['list']['out'])
        assert len(listing['devices']) == 2, listing        # pynvml of the launcher's interpreter, on the simulated NVML
        assert json.loads(runs['check-config']['out'])['valid'] is True, runs['check-config']
    records = [(r['event'], r['job']['job'], r['gpus'], r['rc']) for r in seen['log'] if r['event'] in ('slurm_prolog', 'slurm_epilog')]
    assert records == [('slurm_prolog', '7', [0], 0), ('slurm_epilog', '7', [0], 0)] * 2, seen['log']
