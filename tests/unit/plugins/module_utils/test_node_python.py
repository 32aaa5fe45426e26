# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""module_utils/node_python.py: the modules respawn under the interpreter the prereqs role recorded,
only when that record and that interpreter are root's own (issue #16).

Every file is under the test's tmp_path; the "interpreters" are shell scripts that answer the import
probe with an empty list (imports everything) or exit 1 (imports nothing); node_python.respawn is
replaced by a function that records its argument, so nothing is ever re-executed (the real respawn,
through Ansible, is tests/unit/security/test_redteam_imports.py's).
"""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.plugins.module_utils import gpu_module, node_python
from ansible_collections.gpufleet.reclaim.plugins.modules import gpu_audit, gpu_facts, gpu_kill, gpu_remediate, gpu_reset
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h

OTHER_UID = 65534  # nobody: any uid other than root's shows the check


class Respawned(Exception):
    pass


class FakeModule(object):
    def __init__(self):
        self.warnings = []

    def warn(self, text):
        self.warnings.append(text)


def interpreter(path, imports=True):
    """A root-owned 0755 script standing for a Python: the probe's answer that nothing is missing, or exit 1."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/sh\necho "[]"\n' if imports else '#!/bin/sh\nexit 1\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def node(tmp_path):
    """A node: etc/python (the record) names venv/bin/python, a link to usr/bin/python3.11."""
    real = interpreter(tmp_path / 'usr' / 'bin' / 'python3.11')
    venv_bin = tmp_path / 'venv' / 'bin'
    venv_bin.mkdir(parents=True)
    os.symlink('../../usr/bin/python3.11', str(venv_bin / 'python'))
    etc = tmp_path / 'etc'
    etc.mkdir()
    (etc / 'python').write_text('%s\n' % (venv_bin / 'python'))
    (etc / 'python').chmod(0o644)
    dev = tmp_path / 'dev'
    dev.mkdir()
    return {'record': str(etc / 'python'), 'python': str(venv_bin / 'python'), 'real': str(real), 'dev': str(dev),
            'default': str(tmp_path / 'opt' / 'venv' / 'bin' / 'python'), 'root': tmp_path}


def find(node):
    return node_python.find_interpreter(node['record'], node['default'])


def test_a_trusted_record_names_the_interpreter(node):
    assert node_python.trusted_interpreter(node['python']) == node['python']
    assert find(node) == (node['python'], [])


def test_a_missing_record_and_no_default_is_no_interpreter_and_no_note(node):
    os.unlink(node['record'])
    assert find(node) == (None, [])


def test_the_default_venv_is_used_when_there_is_no_record_under_the_same_checks(node):
    os.unlink(node['record'])
    default = interpreter(node['root'] / 'opt' / 'venv' / 'bin' / 'python')
    assert find(node) == (str(default), [])
    (node['root'] / 'opt' / 'venv').chmod(0o777)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None
    assert note.startswith('the interpreter %s was not used: the directory %s is writable by group and others'
                           % (default, node['root'] / 'opt' / 'venv'))


def test_a_record_that_is_a_symlink_is_refused(node):
    real = node['root'] / 'etc' / 'python.real'
    os.rename(node['record'], str(real))
    os.symlink(str(real), node['record'])
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None
    assert note.startswith('the interpreter record %s was not used: the file %s is a symbolic link' % (node['record'], node['record']))


def test_a_record_in_a_group_writable_directory_is_refused(node):
    (node['root'] / 'etc').chmod(0o775)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'is writable by its group' in note and str(node['root'] / 'etc') in note


def test_a_record_owned_by_a_user_or_writable_by_others_is_refused(node):
    os.chown(node['record'], OTHER_UID, -1)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'is owned by uid %d' % OTHER_UID in note
    os.chown(node['record'], 0, -1)
    os.chmod(node['record'], 0o666)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'is writable by group and others' in note


def test_a_user_owned_interpreter_is_refused(node):
    os.chown(node['real'], OTHER_UID, -1)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None
    assert note.startswith('the interpreter %s named in %s was not used: the file %s is owned by uid %d'
                           % (node['python'], node['record'], node['real'], OTHER_UID))


def test_a_group_writable_interpreter_or_a_user_owned_link_is_refused(node):
    os.chmod(node['real'], 0o775)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'the file %s is writable by its group' % node['real'] in note
    os.chmod(node['real'], 0o755)
    os.lchown(node['python'], OTHER_UID, -1)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'the file %s is a symbolic link that is owned by uid %d' % (node['python'], OTHER_UID) in note


def test_an_interpreter_in_a_user_writable_directory_is_refused(node):
    os.chown(str(node['root'] / 'usr' / 'bin'), OTHER_UID, -1)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'the directory %s is owned by uid %d' % (node['root'] / 'usr' / 'bin', OTHER_UID) in note


def test_a_record_naming_no_interpreter_or_no_program_is_refused(node):
    missing = str(node['root'] / 'nowhere' / 'python')
    with open(node['record'], 'w') as handle:
        handle.write(missing + '\n')
    assert find(node) == (None, ['the interpreter %s named in %s does not exist' % (missing, node['record'])])
    os.chmod(node['real'], 0o644)
    with open(node['record'], 'w') as handle:
        handle.write(node['python'])
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and note.endswith('the file %s is not executable' % node['real'])


@pytest.mark.parametrize('content', ['python3\n', '', '/usr/bin/python3\n/tmp/x\n', '/usr/bin/py\x1bthon\n'])
def test_a_record_that_is_not_one_absolute_path_is_refused(node, content):
    with open(node['record'], 'w') as handle:
        handle.write(content)
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None
    assert note.startswith('the interpreter record %s was not used: %s must hold one line, the absolute path' % (node['record'], node['record']))


def test_a_link_loop_is_refused(node):
    os.unlink(node['python'])
    os.symlink('python', node['python'])
    interpreter_path, (note,) = find(node)
    assert interpreter_path is None and 'more than 8 symbolic links' in note


def test_the_node_needs_psutil_and_each_vendor_library_whose_device_files_exist(node):
    assert node_python.needed_modules([node['dev']]) == ['psutil']
    open(os.path.join(node['dev'], 'kfd'), 'w').close()
    assert node_python.needed_modules([node['dev']]) == ['psutil', 'amdsmi']
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert node_python.needed_modules([node['dev']]) == ['psutil', 'pynvml', 'amdsmi']
    assert node_python.missing_modules(['os', 'gpufleet_no_such_module']) == ['gpufleet_no_such_module']


@pytest.fixture
def respawns(monkeypatch):
    """The interpreters respawn was called with (it raises Respawned instead of re-running)."""
    called = []

    def fake_respawn(path, payload):
        called.append(path)
        raise Respawned(path)
    monkeypatch.setattr(node_python, 'respawn', fake_respawn)
    monkeypatch.setattr(node_python, 'respawn_payload', lambda: 'the payload')
    monkeypatch.setattr(node_python, 'has_respawned', lambda: False)
    return called


def respawn(node):
    module = FakeModule()
    try:
        node_python.respawn_if_needed(module, node['record'], node['default'], dev_roots=[node['dev']])
    except Respawned:
        pass
    return module.warnings


def test_nvidia_device_files_and_no_pynvml_respawn_under_the_recorded_interpreter(node, respawns, monkeypatch):
    monkeypatch.setitem(sys.modules, 'pynvml', None)      # this interpreter cannot import pynvml
    assert respawn(node) == [] and respawns == []          # no NVIDIA device files: nothing to respawn for
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert respawn(node) == [] and respawns == [node['python']]


def test_amd_device_files_and_no_amdsmi_respawn(node, respawns, monkeypatch):
    monkeypatch.setitem(sys.modules, 'amdsmi', None)
    open(os.path.join(node['dev'], 'kfd'), 'w').close()
    assert respawn(node) == [] and respawns == [node['python']]


def test_no_respawn_when_this_interpreter_has_what_the_node_needs(node, respawns, monkeypatch):
    monkeypatch.setitem(sys.modules, 'amdsmi', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()   # pynvml is importable here
    assert respawn(node) == [] and respawns == []


def test_a_missing_psutil_respawns_even_without_gpu_device_files(node, respawns, monkeypatch):
    monkeypatch.setitem(sys.modules, 'psutil', None)
    assert respawn(node) == [] and respawns == [node['python']]


def test_a_module_that_has_respawned_never_respawns_again(node, respawns, monkeypatch):
    monkeypatch.setattr(node_python, 'has_respawned', lambda: True)
    monkeypatch.setattr(node_python, 'probe_missing', lambda *args: pytest.fail('probed'))
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert respawn(node) == [] and respawns == []


def test_a_module_respawned_under_the_default_venv_repeats_why_the_record_was_refused(node, respawns, monkeypatch):
    default = interpreter(node['root'] / 'opt' / 'venv' / 'bin' / 'python')
    os.chmod(node['record'], 0o664)
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert respawn(node) == [] and respawns == [str(default)]             # the first process: its warnings would be lost
    monkeypatch.setattr(node_python, 'has_respawned', lambda: True)
    (warning,) = respawn(node)                                             # the respawned one says it
    assert warning.startswith('the interpreter record %s was not used: the file %s is writable by its group' % (node['record'], node['record']))


def test_no_respawn_into_an_interpreter_that_lacks_the_library_too(node, respawns, monkeypatch):
    interpreter(node['root'] / 'usr' / 'bin' / 'python3.11', imports=False)
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert respawn(node) == ['the interpreter %s cannot import psutil, pynvml; run the gpufleet.reclaim.prereqs role again'
                             % node['python']]
    assert respawns == []


def answers(monkeypatch, imports):
    """The recorded interpreter imports exactly ``imports`` (the probe, faked)."""
    monkeypatch.setattr(node_python, 'probe_missing', lambda path, names: [name for name in names if name not in imports])


def test_amdsmi_is_optional_no_respawn_and_no_warning_when_neither_interpreter_has_it(node, respawns, monkeypatch):
    monkeypatch.setitem(sys.modules, 'amdsmi', None)
    open(os.path.join(node['dev'], 'kfd'), 'w').close()
    answers(monkeypatch, ('psutil', 'pynvml'))
    assert respawn(node) == [] and respawns == []          # the AMD backend reads sysfs here as well there
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    assert respawn(node) == [] and respawns == [node['python']]   # pynvml is worth it; amdsmi is missing in both


def test_no_respawn_into_an_interpreter_that_lacks_what_this_one_has(node, respawns, monkeypatch):
    monkeypatch.setitem(sys.modules, 'amdsmi', None)
    open(os.path.join(node['dev'], 'kfd'), 'w').close()
    answers(monkeypatch, ('amdsmi',))                       # amdsmi, but no psutil
    assert respawn(node) == ['the interpreter %s cannot import psutil; run the gpufleet.reclaim.prereqs role again' % node['python']]
    assert respawns == []


def test_no_respawn_into_the_running_interpreter(node, respawns, monkeypatch):
    monkeypatch.setattr(node_python.sys, 'executable', node['python'])
    monkeypatch.setattr(node_python, 'probe_missing', lambda *args: pytest.fail('probed'))
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert respawn(node) == [] and respawns == []


def test_an_untrusted_record_is_no_respawn_and_a_warning(node, respawns, monkeypatch):
    (node['root'] / 'etc').chmod(0o777)
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    (warning,) = respawn(node)
    assert respawns == [] and warning.startswith('the interpreter record %s was not used: the directory' % node['record'])


def test_before_the_role_nothing_is_respawned_and_nothing_warned_here(node, respawns, monkeypatch):
    os.unlink(node['record'])
    monkeypatch.setitem(sys.modules, 'pynvml', None)
    open(os.path.join(node['dev'], 'nvidiactl'), 'w').close()
    assert respawn(node) == [] and respawns == []          # the backends' warning names the fix


@pytest.mark.parametrize('module', [gpu_facts, gpu_kill, gpu_reset, gpu_audit, gpu_remediate], ids=lambda m: m.__name__.rsplit('.', 1)[1])
def test_each_module_calls_the_helper_once_its_arguments_are_parsed(module, monkeypatch):
    h.patch_module_exits(monkeypatch)
    seen = []

    def fake(ansible_module):
        seen.append(ansible_module.params)
        raise h.ExitJson({'respawned': True})
    monkeypatch.setattr(gpu_module, 'respawn_if_needed', fake)  # every main() runs through gpu_module.run_module
    assert h.run_main(module.main, {}) == {'respawned': True} and len(seen) == 1


def test_the_role_records_where_the_modules_read():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', '..')
    with open(os.path.join(root, 'roles', 'prereqs', 'tasks', 'main.yml')) as handle:
        tasks = handle.read()
    with open(os.path.join(root, 'roles', 'prereqs', 'defaults', 'main.yml')) as handle:
        defaults = yaml.safe_load(handle)
    assert 'dest: %s\n' % node_python.RECORD in tasks and '- %s\n' % node_python.RECORD in tasks
    assert node_python.DEFAULT_INTERPRETER == defaults['gpu_prereqs_venv'] + '/bin/python'
