# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What leaves a node, and who can read what the guard writes (docs/security.md).

The webhook, the terminal messages and the decision log carry the rule, the user, the pids and
redacted command lines - never a process environment, and never the rogue detector's evidence
(which may quote environment values).  The files the guard writes get strict modes.
No process is started or signalled here; notifications are captured, not sent.
"""

from __future__ import annotations

import json
import os
import stat

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, notify
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, proc, snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_guard import Node, decisions

SECRET = 'Zq9-env-secret-value'


def test_notifications_and_log_never_carry_the_environment_or_the_evidence(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(notify.Notifier, 'send', lambda self, user, uid, items, mode: sent.append(items) or {'errors': []})
    finding = {'level': 'critical', 'score': 95,
               'rules': [{'id': 'H-stratum', 'kind': 'hard',
                          'evidence': [{'source': 'env:POOL_URL', 'value': 'stratum+tcp://w:%s@pool:3333' % SECRET}]}],
               'env': {'POOL_PASS': SECRET}}
    snap = snapshot([proc(7, 'eve', {2: GIB}, name='xmrig', cmdline=['xmrig', '--pass=%s' % SECRET, '--token', SECRET])])
    snap.processes[0].environ = {'POOL_PASS': SECRET}      # whatever a collector may have attached
    node = Node(tmp_path, policy='mode: warn\nrogue: {act_min_level: critical}\nnotify: {tty: false}\n', snap=snap,
                context=P.Context(groups={}, rogue_findings={7: finding}))
    summary = node.tick()
    assert decisions(summary) == [('act', 'rogue', 0)]
    assert len(sent) == 1 and sent[0][0]['pids'] == [7]
    for text in (json.dumps(sent), open(node.paths.log).read(), open(node.paths.state).read()):
        assert SECRET not in text and 'POOL_PASS' not in text and 'environ' not in text
    assert sent[0][0]['procs'][0]['cmdline'].startswith('xmrig --pass=<redacted>')
    assert 'H-stratum' in sent[0][0]['message']                 # the rule id says why, not the evidence


def test_files_the_guard_writes_get_strict_modes(tmp_path):
    old = os.umask(0)                                            # the modes must not depend on the umask
    try:
        os.mkdir(str(tmp_path / 'etc'), 0o755)                   # as the role makes it (makedirs would make
        os.mkdir(str(tmp_path / 'etc' / 'gpufleet'), 0o755)      # etc 0777 under this umask: a refused tick)
        node = Node(tmp_path)
        node.paths.history = str(tmp_path / 'var' / 'lib' / 'gpufleet' / 'history.db')
        assert node.tick()['rc'] == 0
    finally:
        os.umask(old)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)
    assert mode(node.paths.state) == 0o600                      # escalation state (policy cache)
    assert mode(node.paths.history) == 0o600                    # command lines of every user
    assert mode(node.paths.log) & 0o027 == 0                    # decisions: root and its group only
    assert mode(os.path.dirname(node.paths.log)) & 0o027 == 0
    assert mode(node.paths.lock) == 0o600
    assert audit_log.verify(node.paths.log)['valid']


def test_a_policy_directory_others_can_write_is_refused(tmp_path):
    """Whoever can write /etc/gpufleet can rename another file over policy.yaml: the file's own mode
    is not enough.  A sticky directory (like /tmp) is accepted: there only the owner may replace
    the file, and the file's owner is checked."""
    node = Node(tmp_path)
    policy_dir = os.path.dirname(node.paths.policy)
    for dir_mode, refused in ((0o777, True), (0o775, True), (0o1777, False), (0o755, False)):
        os.chmod(policy_dir, dir_mode)
        summary = node.tick(30)
        assert (summary['rc'] == 1 and 'policy directory' in summary.get('error', '')) is refused
        if refused:
            assert summary.get('decisions') is None                # nothing decided, nothing signalled
            assert node.log()[-1]['event'] == 'guard_untrusted_input'
    assert audit_log.verify(node.paths.log)['valid']
