# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Red team: a process name that tries to rewrite its owner (docs/security.md, issue 15).

The kernel escapes only the newline (and the backslash) of a process name in the ``Name:`` line of
/proc/PID/status.  A reader that splits with ``str.splitlines()`` also breaks at ``\\x1c``,
``\\x1d``, ``\\x1e``, ``\\x85``, ``\\u2028``, ``\\x0b``, ``\\x0c``, ``\\r``..., so a name such as
``"\\x1cUid:\\t1002"`` forged a second ``Uid:`` line; psutil's own status parser matches ``Uid:\\t0\\t0\\t0``
anywhere in the file, the name included.  Each test here plays alice naming her process so, against
the real tick (the /proc reader), ``gpufleet-guard list`` and the gpu_kill module (psutil where it is
installed), and asserts that her process is charged to her and that bob's is alive and never signalled.

Each scenario runs in a PID namespace of its own (``redteam.run``); see redteam.py for the safety.
"""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam
from ansible_collections.gpufleet.reclaim.tests.unit.security.redteam import GIB

pytestmark = redteam.needs_namespace

QUOTA = ('mode: enforce\ndefaults: {max_mem_gib_total: 12}\n'
         'escalation: {act_after: 0s, sigkill_after: 2s}\nnotify: {tty: false}\n')
# Every character str.splitlines() breaks at besides '\n' (one-byte ones and the UTF-8 encoded ones).
SEPARATORS = ('\x1c', '\x1d', '\x1e', '\x85', '\u2028', '\u2029', '\x0b', '\x0c', '\r')


def _owners(node, pids):
    """{pid: user} as ``gpufleet-guard list --json`` (the guard's /proc reader) and gpu_kill (psutil) see them."""
    _rc, listed, _sig, err = node.cli('list', '--json')
    assert isinstance(listed, (dict, list)), err
    rows = listed.get('processes', []) if isinstance(listed, dict) else listed
    by_list = dict((row.get('pid'), row.get('user')) for row in rows if row.get('pid') in pids)
    by_module = {}
    for user in ('alice', 'bob', 'root'):
        _rc, result, signalled, err = node.module('gpu_kill', users=[user], _ansible_check_mode=True)
        assert isinstance(result, dict) and signalled == [], err
        for entry in result.get('killed', []):
            by_module[entry['pid']] = user
    return {'list': by_list, 'gpu_kill': by_module}


def scenario_name_forges_uid(node, separator='\x1c'):
    bob = node.spawn('bob', gpu=0, mib=10 * GIB)
    alice = node.spawn('alice', gpu=1, mib=4 * GIB, argv=[separator + 'Uid:\t%d' % node.uids['bob']])
    node.write_policy(QUOTA)
    owners = _owners(node, (bob, alice))
    rc, summary, signalled, err = node.tick()
    return {'bob': bob, 'alice': alice, 'rc': rc, 'summary': summary, 'signalled': signalled, 'err': err,
            'bob_alive': node.alive(bob), 'alice_alive': node.alive(alice), 'comm': node.comm(alice), 'owners': owners}


# one scenario per separator: module-level functions (the harness imports them by name)
def scenario_separator_1c(node):
    return scenario_name_forges_uid(node, '\x1c')


def scenario_separator_1d(node):
    return scenario_name_forges_uid(node, '\x1d')


def scenario_separator_1e(node):
    return scenario_name_forges_uid(node, '\x1e')


def scenario_separator_85(node):
    return scenario_name_forges_uid(node, '\x85')


def scenario_separator_2028(node):
    return scenario_name_forges_uid(node, '\u2028')


def scenario_separator_2029(node):
    return scenario_name_forges_uid(node, '\u2029')


def scenario_separator_0b(node):
    return scenario_name_forges_uid(node, '\x0b')


def scenario_separator_0c(node):
    return scenario_name_forges_uid(node, '\x0c')


def scenario_separator_0d(node):
    return scenario_name_forges_uid(node, '\r')


SCENARIOS = dict((sep, globals()['scenario_separator_%02x' % ord(sep)]) for sep in SEPARATORS)


def check_bob_untouched(out):
    assert out['rc'] == 0, out['err']
    assert out['bob_alive'], out['summary']
    assert out['bob'] not in out['signalled']
    decisions = out['summary']['decisions']
    assert all(d.get('user') != 'bob' for d in decisions if d['decision'] in ('warn', 'act')), decisions
    assert out['bob'] not in redteam.acted_pids(out['summary'])


def test_a_name_with_a_line_separator_does_not_charge_bob():
    out = redteam.run(scenario_name_forges_uid)
    assert out['comm'].startswith('\x1c')
    check_bob_untouched(out)
    # alice's 4 GiB alone is under her quota: nothing is acted on at all
    assert out['alice_alive'] and out['signalled'] == []
    check_owners(out)


def check_owners(out):
    """Both readers charge each process to its real owner."""
    for reader in ('list', 'gpu_kill'):
        owners = dict((int(pid), user) for pid, user in out['owners'][reader].items())
        assert owners == {out['bob']: 'bob', out['alice']: 'alice'}, (reader, owners)


@pytest.mark.parametrize('separator', SEPARATORS[1:], ids=lambda sep: 'U+%04X' % ord(sep))
def test_every_line_separator_is_just_text_in_a_name(separator):
    out = redteam.run(SCENARIOS[separator])
    assert out['comm'].startswith(separator), repr(out['comm'])
    check_bob_untouched(out)
    assert out['alice_alive'] and out['signalled'] == []
    check_owners(out)


ROOT_FORGERIES = {
    'separator': '\x1cUid:\t0\t0\t0\t0',   # a whole forged line (14 bytes: fits the 15 of a comm)
    'psutil': 'Uid:\t0\t0\t0',             # no separator: psutil's status regex matches it inside Name:
    'unreadable': '\x1cUid:\tx',           # a forged line that does not parse: the owner read as unknown
}


def scenario_forged_root(node, name):
    bob = node.spawn('bob', gpu=0, mib=10 * GIB)
    hog = node.spawn('alice', gpu=1, mib=30 * GIB, argv=[name])
    node.write_policy(QUOTA + 'protect: [{uid_below: 1000}, {user: root}]\n')
    owners = _owners(node, (bob, hog))
    rc, summary, signalled, err = node.tick()
    again = node.spawn('alice', gpu=1, mib=30 * GIB, argv=[name])
    mod_rc, killed, mod_signalled, mod_err = node.module('gpu_kill', users=['alice'], timeout=5, force=True)
    return {'bob': bob, 'alice': hog, 'again': again, 'rc': rc, 'summary': summary, 'signalled': signalled, 'err': err,
            'bob_alive': node.alive(bob), 'alice_alive': node.alive(hog), 'again_alive': node.alive(again),
            'owners': owners, 'module': [mod_rc, killed, mod_signalled, mod_err]}


def scenario_forged_root_separator(node):
    return scenario_forged_root(node, ROOT_FORGERIES['separator'])


def scenario_forged_root_psutil(node):
    return scenario_forged_root(node, ROOT_FORGERIES['psutil'])


def scenario_forged_root_unreadable(node):
    return scenario_forged_root(node, ROOT_FORGERIES['unreadable'])


@pytest.mark.parametrize('kind', sorted(ROOT_FORGERIES))
def test_a_name_that_forges_root_or_hides_the_owner_buys_no_protection(kind):
    """alice's 30 GiB hog, named to read as uid 0 (protected by uid_below and user: root) or as an
    unreadable owner (once skipped by the quota rules): the tick acts on it as alice's, and
    gpu_kill users=[alice] kills it; bob's job is never touched."""
    out = redteam.run(globals()['scenario_forged_root_' + kind])
    check_bob_untouched(out)
    acted = redteam.acted_pids(out['summary'])
    assert out['alice'] in acted and acted[out['alice']]['outcome'] == 'killed', out['summary']
    assert [d['user'] for d in out['summary']['decisions'] if d['decision'] == 'act'] == ['alice']
    assert not any('protected' in note or 'owner unknown' in note for note in out['summary']['notes']), out['summary']['notes']
    assert not out['alice_alive'] and out['signalled'] == [out['alice']]
    rc, result, signalled, err = out['module']
    assert rc == 0 and [e['pid'] for e in result['killed']] == [out['again']], err
    assert result['killed'][0]['user'] == 'alice' and signalled == [out['again']] and not out['again_alive']
    check_owners(out)
