# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the snapshot's cost cuts keep (issue #21): the same records, names, cgroup verdicts and
redactions as before, from fewer reads and calls.  No timing is asserted."""

from __future__ import annotations

import json
import re
import signal

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import cli, guard, notify, textmatch
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes as P
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.policy import loading
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_cli import (  # noqa: F401 pylint: disable=unused-import
    fake_host, run)
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_gpu_processes import (  # noqa: F401 pylint: disable=unused-import
    fake_proc)

CID = '3f4e1a9c0b2d4e6f8a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f'


def test_every_identity_pattern_needs_one_of_the_words_checked_first():
    """_cgroup_identity skips its searches for a path without any of _IDENTITY_WORDS: a pattern added
    without its word would never match."""
    patterns = [pattern.pattern for pattern, _runtime in P._CONTAINER_PATTERNS] + [P._SLURM_RE.pattern]
    for pattern in patterns:
        assert any(word in pattern.replace('\\', '') for word in P._IDENTITY_WORDS), pattern
    assert P._cgroup_identity('/system.slice/sshd.service') == (None, None, None, None)
    assert P._cgroup_identity('/system.slice/docker-%s.scope' % CID) == (CID, 'docker', None, None)
    assert P._cgroup_identity('/slurm/uid_0/job_12/step_0') == (None, None, None, '12')


def test_cgroup_verdicts_are_kept_per_text_until_cleared(tmp_path):
    trust = P.CgroupTrust(str(tmp_path / 'no-cgroupfs'))
    text = '0::/system.slice/docker-%s.scope\n' % CID
    first = trust.parse(text)
    assert first == P.parse_cgroup(text, trust) and first[0].id == CID and trust.parse(text) is first
    trust.clear()
    assert trust.parse(text) is not first and trust.parse(text) == first
    assert trust.parse('0::/user.slice/user-1000.slice/user@1000.service/docker-%s.scope\n' % CID) == (None, None)


def test_records_of_two_processes_of_one_cgroup_do_not_share_a_container(fake_proc, tmp_path):  # noqa: F811
    text = '0::/system.slice/docker-%s.scope\n' % CID
    fake_proc(100, cgroup=text)
    fake_proc(101, cgroup=text)
    # no cgroup file system there: only the structural rule applies (test_cgroup_trust.py tests the owners)
    inv = P.ProcessInventory(proc_root=fake_proc.proc, scan_fds=False, cgroup_root=str(tmp_path / 'none'))
    one, two = inv.record(100), inv.record(101)
    assert one.container == two.container and one.container is not two.container and one.container.id == CID


@pytest.mark.parametrize('comm, argv0, name', [
    ('gnome-keyring-d', '/usr/bin/gnome-keyring-daemon', 'gnome-keyring-daemon'),   # cut by the kernel: argv[0] completes it
    ('gnome-keyring-d', '/usr/bin/other-program-name', 'gnome-keyring-d'),          # argv[0] is something else
    ('python', '/usr/bin/python3.11', 'python'),                                    # not cut: comm as it is
    ('xmrig-but-longer', None, 'xmrig-but-longer'),                                 # no command line
])
def test_process_name_is_completed_like_psutil_does(comm, argv0, name):
    assert P.full_name(comm, [argv0, '--flag'] if argv0 else []) == name


def test_the_proc_reader_is_the_default_without_psutil(fake_proc):  # noqa: F811
    fake_proc(100, comm='gnome-keyring-d', cmdline=('/usr/bin/gnome-keyring-daemon', '--start'))
    inv = P.ProcessInventory(proc_root=fake_proc.proc, scan_fds=False)
    assert inv.use_psutil is False and P.ProcessInventory().use_psutil is False
    assert inv.record(100).name == 'gnome-keyring-daemon'


def test_bounded_subs_is_each_bounded_sub_in_turn():
    regexes = [re.compile(r'(--token=)\S+'), re.compile(r'(password=)\S+'), re.compile(r'x')]
    text = 'run --token=abc password=def xx'
    expected = text
    for regex in regexes:
        expected = textmatch.bounded_sub(regex, notify._keep_groups, expected, 'f')
    assert textmatch.bounded_subs(regexes, notify._keep_groups, text, 'f') == expected
    assert textmatch.bounded_subs([], notify._keep_groups, text, 'f') == text
    assert textmatch.bounded_subs([regexes[2]], '', 'x' * (textmatch.MAX_MATCH_TEXT + 10), 'f') == ''  # cut first


def test_bounded_subs_stops_the_slow_regex_and_names_it():
    slow = textmatch.compile_regex('notify.redact_patterns', '.*.*.*x')
    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(InvalidArgument) as err:
        textmatch.bounded_subs([re.compile('a'), slow], 'a', 'a' * 20000, 'notify.redact_patterns', timeout=0.2)
    assert '.*.*.*x' in str(err.value) and '20000-character' in str(err.value)
    assert signal.getsignal(signal.SIGALRM) == before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert notify.redact_text('a' * 20000, [re.compile('b'), slow]) != 'a' * 20000


def test_redact_many_is_redact_of_each():
    """One alarm handler for a listing's command lines: the same texts as redact() one by one."""
    patterns = notify.default_patterns() + [re.compile(r'(train)\.py')]
    argvs = [None, [], ['python', 'train.py', '--token=abc'], ['mysql', '-pSECRET'], ['x'] * 400, ['a', 'b c'], ['']]
    for limit in (notify.MAX_CMDLINE, 5):
        assert notify.redact_many(argvs, patterns, limit) == [notify.redact(a, patterns, limit) for a in argvs]
    assert notify.redact_many(argvs, patterns)[:4] == [None, '', 'python train<redacted> --token=<redacted>', 'mysql -p<redacted>']
    assert notify.redact_many([], patterns) == []


def test_redact_many_fails_closed_on_the_slow_text_only(monkeypatch):
    monkeypatch.setattr(textmatch, 'MATCH_TIMEOUT_S', 0.2)
    slow = textmatch.compile_regex('notify.redact_patterns', '.*.*.*x')
    before = signal.getsignal(signal.SIGALRM)
    out = notify.redact_many([['run', '--token=abc'], ['a' * 20000], ['fine']], notify.default_patterns() + [slow])
    assert out == ['run --token=<redacted>', notify.REDACTED_SLOW, 'fine']
    assert signal.getsignal(signal.SIGALRM) == before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert textmatch.bounded_subs_each([slow], '', ['a' * 20000, 'ax'], 'f') == [None, '']


def test_list_takes_the_policy_from_the_agent_state_cache(tmp_path, fake_host, monkeypatch):  # noqa: F811
    paths = guard.Paths(root=str(tmp_path))
    (tmp_path / 'etc' / 'gpufleet').mkdir(parents=True)
    with open(paths.policy, 'w') as handle:
        handle.write("mode: dry-run\nusers: {alice: {max_gpus: 1}}\nnotify: {tty: false, redact_patterns: ['(train)\\.py']}\n")
    assert run(['tick', '--dry-run', '--root', str(tmp_path)])[0] == 0  # the tick caches the document in the state

    def no_yaml(*_args, **_kwargs):
        raise AssertionError('the policy file was parsed again')
    parse = loading.read_document_lines
    monkeypatch.setattr(loading, 'read_document_lines', no_yaml)
    rc, out = run(['list', '--json', '--root', str(tmp_path)])
    assert rc == 0 and json.loads(out)['processes'][0]['cmdline'] == 'python train<redacted> --token=<redacted>'
    # an edited policy file no longer matches the cache: it is read again
    monkeypatch.setattr(loading, 'read_document_lines', parse)
    with open(paths.policy, 'a') as handle:
        handle.write('# edited\n')
    monkeypatch.setattr(cli.guard_state, 'load_state', lambda *_a: ({'policy_cache': {'sha256': 'other', 'document': {}}}, None))
    rc, out = run(['list', '--json', '--root', str(tmp_path)])
    assert rc == 0 and json.loads(out)['processes'][0]['cmdline'] == 'python train<redacted> --token=<redacted>'
