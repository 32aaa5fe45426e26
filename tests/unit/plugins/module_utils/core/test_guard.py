# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The guard tick: escalation with a fake clock, state, lock, log, metrics, notifications, and real kills.

SAFETY: only processes these tests start are ever signalled (gpusim workloads of a private state, and
``sleep`` children started here); the webhook server listens on 127.0.0.1 and is stopped by the test.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import audit_log, guard, notify
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils import gpu_test_helpers as h
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import (
    DEEP_TOML, GIB, TOO_DEEP, TOO_MANY_ALIASED, Clock, billion_laughs, proc, snapshot)
from ansible_collections.gpufleet.reclaim.tests.unit.security import redteam

POLICY = '''
mode: %s
users:
  alice: {max_mem_gib_per_gpu: 8}
escalation: {warn_again_after: 5m, act_after: 10m, sigkill_after: 2s, retry_after: 5m}
notify: {tty: false}
'''


class Node(object):
    """A guard with its files under a temp root, a fake clock and a fake (or real) snapshot."""

    def __init__(self, root, policy=POLICY % 'dry-run', snap=None, context=None):
        self.paths = guard.Paths(root=str(root))
        self.settings = guard.Settings(release_timeout=2.0, utmp_paths=())
        self.clock = Clock()
        self.snap = snap if snap is not None else snapshot([proc(1, 'alice', {0: 12 * GIB}), proc(2, 'alice', {1: 6 * GIB}),
                                                            proc(3, 'bob', {0: 30 * GIB})])
        self.context = context if context is not None else P.Context(groups={})
        self.write_policy(policy)

    def write_policy(self, text):
        os.makedirs(os.path.dirname(self.paths.policy), exist_ok=True)
        with open(self.paths.policy, 'w') as handle:
            handle.write(text)
        os.chmod(self.paths.policy, 0o644)  # as the role installs it, whatever the umask

    def tick(self, advance=0, **kwargs):
        self.clock.advance(advance)
        kwargs.setdefault('snapshot', self.snap)
        kwargs.setdefault('context', self.context)
        return guard.run_tick(self.paths, self.settings, now=self.clock.now, **kwargs)

    def log(self):
        with open(self.paths.log) as handle:
            return [json.loads(line) for line in handle]

    def state(self):
        with open(self.paths.state) as handle:
            return json.load(handle)


def decisions(summary):
    return [(d['decision'], d.get('rule'), d.get('step')) for d in summary['decisions']]


# ============================================================================ escalation with a fake clock
def test_warn_then_warn_again_then_act_after_the_grace(tmp_path):
    node = Node(tmp_path)
    assert decisions(node.tick()) == [('warn', 'max_mem_per_gpu', 1)]
    assert node.tick(60)['decisions'] == []
    assert decisions(node.tick(239)) == []                                   # 4m59s: nothing yet
    assert decisions(node.tick(1)) == [('warn', 'max_mem_per_gpu', 2)]      # 5m: the second warning
    assert decisions(node.tick(299)) == []
    summary = node.tick(1)                                                   # 10m: the action
    assert decisions(summary) == [('act', 'max_mem_per_gpu', 2)]
    act = summary['decisions'][0]
    assert act['pids'] == [1] and act['outcome']['result'] == 'not_enforced' and act['dry_run']
    assert decisions(node.tick(60)) == []                                    # no repetition before retry_after
    assert decisions(node.tick(240)) == [('act', 'max_mem_per_gpu', 2)]
    node.snap = snapshot([proc(2, 'alice', {1: 6 * GIB})])
    assert decisions(node.tick(30)) == [('clear', 'max_mem_per_gpu', None)]
    assert node.state()['violations'] == {}
    log = node.log()
    assert [r['decision'] for r in log] == ['warn', 'warn', 'act', 'act', 'clear']
    assert all(r['event'] == 'guard_decision' and r['mode'] == 'dry-run' for r in log)
    assert audit_log.verify(node.paths.log)['valid']


OVER = [proc(1, 'alice', {0: 12 * GIB})]
UNDER = [proc(1, 'alice', {0: 6 * GIB})]


def test_new_processes_after_the_action_are_a_new_violation(tmp_path):
    """The action ended the process it was taken on; another process of the same user on the same GPU,
    seen before a tick cleared the violation (a job restarted at once, or the same job after a node
    reboot: found by tests/integration/targets/guard_systemd), starts from its first warning instead
    of waiting for retry_after and being acted on without a warning."""
    node = Node(tmp_path)
    node.snap = snapshot(OVER)
    steps = [decisions(node.tick(advance)) for advance in (0, 300, 300)]
    assert steps == [[('warn', 'max_mem_per_gpu', 1)], [('warn', 'max_mem_per_gpu', 2)], [('act', 'max_mem_per_gpu', 2)]]
    node.snap = snapshot([proc(7, 'alice', {0: 12 * GIB})])                 # pid 1 is gone, alice's pid 7 in its place
    assert decisions(node.tick(5)) == [('warn', 'max_mem_per_gpu', 1)]
    [entry] = node.state()['violations'].values()
    assert entry['acted_at'] is None and entry['pids'] == [7] and entry['warnings'] == 1
    assert decisions(node.tick(300)) == [('warn', 'max_mem_per_gpu', 2)]
    summary = node.tick(300)
    assert decisions(summary) == [('act', 'max_mem_per_gpu', 2)] and summary['decisions'][0]['pids'] == [7]
    node.snap = snapshot([proc(7, 'alice', {0: 12 * GIB}), proc(8, 'alice', {0: 1 * GIB})])   # pid 7 survived: a retry
    assert decisions(node.tick(60)) == []
    assert decisions(node.tick(240)) == [('act', 'max_mem_per_gpu', 2)]


def test_single_ticks_under_the_limit_do_not_restart_the_escalation(tmp_path):
    """Over the limit on 4 ticks of 5 (30 s apart), under it on the 5th: warned, warned again, acted on after the grace."""
    node = Node(tmp_path)
    seen = []
    for index in range(21):
        node.snap = snapshot(UNDER if index % 5 == 4 else OVER)
        seen.extend((index * 30, decision) for decision in decisions(node.tick(30 if index else 0)))
    assert seen == [(0, ('warn', 'max_mem_per_gpu', 1)), (300, ('warn', 'max_mem_per_gpu', 2)), (600, ('act', 'max_mem_per_gpu', 2))]
    assert 'clear' not in [r['decision'] for r in node.log()]


def test_a_violation_clears_once_it_stayed_away_for_clear_after(tmp_path):
    node = Node(tmp_path, policy=(POLICY % 'dry-run').replace('retry_after: 5m}', 'retry_after: 5m, clear_after: 2m}'))
    node.snap = snapshot(OVER)
    assert decisions(node.tick()) == [('warn', 'max_mem_per_gpu', 1)]
    node.snap = snapshot(UNDER)
    assert decisions(node.tick(30)) == []                                     # away since 30 s
    [(key, entry)] = node.state()['violations'].items()
    assert entry['gone_since'] == node.clock.now and entry['warnings'] == 1   # kept, with its escalation
    assert decisions(node.tick(60)) == []                                     # away for 60 s
    node.snap = snapshot(OVER)
    assert decisions(node.tick(60)) == []                                     # back after 2 ticks: no new first warning
    assert 'gone_since' not in node.state()['violations'][key]
    node.snap = snapshot(UNDER)
    assert decisions(node.tick(30)) == []                                     # away again, the clock starts again
    assert decisions(node.tick(119)) == []                                    # 119 s away
    assert decisions(node.tick(1)) == [('clear', 'max_mem_per_gpu', None)]   # 120 s away: cleared
    assert node.state()['violations'] == {}
    node.snap = snapshot(OVER)
    assert decisions(node.tick(30)) == [('warn', 'max_mem_per_gpu', 1)]      # a new violation starts from its first warning
    assert [r['decision'] for r in node.log()] == ['warn', 'clear', 'warn']


@pytest.mark.parametrize('policy,cleared_after', [
    ((POLICY % 'dry-run').replace('retry_after: 5m}', 'retry_after: 5m, clear_after: 0s}'), 30),   # 0: at the first tick away
    (POLICY % 'dry-run', 90),                                                                      # the default, 60 s
])
def test_clear_after_zero_and_default(tmp_path, policy, cleared_after):
    node = Node(tmp_path, policy=policy)
    node.snap = snapshot(OVER)
    node.tick()
    start = node.clock.now
    node.snap = snapshot(UNDER)
    cleared = []
    for _tick in range(6):
        if decisions(node.tick(30)) == [('clear', 'max_mem_per_gpu', None)]:
            cleared.append(node.clock.now - start)
    assert cleared == [cleared_after]


def test_a_late_first_tick_still_warns_before_it_acts(tmp_path):
    node = Node(tmp_path, policy=POLICY % 'warn')
    node.tick()
    # the guard was down for an hour: both warnings are overdue, only one goes out, the action waits a tick
    summary = node.tick(3600)
    assert decisions(summary) == [('warn', 'max_mem_per_gpu', 2)]
    summary = node.tick(30)
    assert decisions(summary) == [('act', 'max_mem_per_gpu', 2)]
    assert summary['decisions'][0]['outcome']['result'] == 'not_enforced'      # mode warn: never acts


def test_escalation_steps_list_and_zero_grace(tmp_path):
    node = Node(tmp_path, policy='mode: dry-run\nusers: {alice: {max_mem_gib_per_gpu: 8}}\n'
                                 'escalation: [{after: 0, action: terminate}]\n')
    assert decisions(node.tick()) == [('act', 'max_mem_per_gpu', 0)]


def test_warn_only_rules_never_act(tmp_path):
    node = Node(tmp_path, policy='mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 8, action: warn}}\n'
                                 'escalation: {act_after: 1m}\n')
    assert decisions(node.tick()) == [('warn', 'max_mem_per_gpu', 1)]
    assert decisions(node.tick(30)) == [('warn', 'max_mem_per_gpu', 2)]
    for _tick in range(5):
        assert decisions(node.tick(600)) == []


def test_rogue_violations_use_the_rogue_grace(tmp_path):
    finding = {'level': 'critical', 'score': 95, 'rules': [{'id': 'H-stratum', 'kind': 'hard'}]}
    snap = snapshot([proc(7, 'eve', {2: GIB}, name='xmrig')])
    node = Node(tmp_path, policy='mode: dry-run\nrogue: {act_min_level: critical}\n', snap=snap,
                context=P.Context(groups={}, rogue_findings={7: finding}))
    summary = node.tick()
    assert decisions(summary) == [('act', 'rogue', 0)]


# ============================================================================ state, lock, invalid policy
def test_corrupt_state_is_rebuilt_with_a_warning_and_never_kills(tmp_path):
    node = Node(tmp_path, policy=POLICY % 'dry-run')
    node.tick()
    node.tick(600)
    with open(node.paths.state, 'w') as handle:
        handle.write('{"version": 1, "idle": [')
    summary = node.tick(1)
    assert any('corrupt' in w for w in summary['warnings'])
    assert decisions(summary) == [('warn', 'max_mem_per_gpu', 1)]             # escalation starts over
    events = [r['event'] for r in node.log()]
    assert 'guard_state_rebuilt' in events
    assert node.state()['counters']['state_rebuilt'] == 1


@pytest.mark.parametrize('content', ['', 'null', '[]', '{"version": 1}', '{"version": 1, "idle": {}, "violations": {"k": 5}, "counters": {}}',
                                     '{"version": 99, "idle": {}, "violations": {}, "counters": {}}', '\x00\xff'])
def test_any_broken_state_file_is_rebuilt(tmp_path, content):
    node = Node(tmp_path)
    os.makedirs(os.path.dirname(node.paths.state), exist_ok=True)
    with open(node.paths.state, 'w', encoding='latin-1') as handle:
        handle.write(content)
    summary = node.tick()
    assert summary['rc'] == 0 and decisions(summary) == [('warn', 'max_mem_per_gpu', 1)]


def test_a_state_from_the_future_is_not_trusted(tmp_path):
    node = Node(tmp_path)
    node.tick()
    node.tick(700)
    node.clock.advance(-86400)
    summary = node.tick()
    assert any('future' in w for w in summary['warnings'])


def test_missing_state_is_simply_created(tmp_path):
    node = Node(tmp_path)
    summary = node.tick()
    assert summary['warnings'] == [] and node.state()['counters']['ticks'] == 1
    assert oct(os.stat(node.paths.state).st_mode & 0o777) == '0o600'


def test_two_ticks_never_overlap(tmp_path):
    node = Node(tmp_path)
    os.makedirs(os.path.dirname(node.paths.lock), exist_ok=True)
    fd = os.open(node.paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        summary = node.tick()
        assert 'another tick' in summary['skipped'] and summary['rc'] == 0
        assert not os.path.exists(node.paths.state)
    finally:
        os.close(fd)
    assert 'skipped' not in node.tick()


def test_an_invalid_policy_decides_nothing_and_is_logged(tmp_path):
    node = Node(tmp_path)
    node.tick()
    node.write_policy('mode: enforce\nusers: {alice: {max_gpus: many}}\n')
    summary = node.tick(3600)
    assert summary['rc'] == 1 and 'users.alice.max_gpus' in summary['error']
    assert node.log()[-1]['event'] == 'guard_policy_invalid'
    with open(node.paths.metrics) as handle:
        assert 'gpufleet_guard_policy_valid 0' in handle.read()


@pytest.mark.parametrize('text,why', [
    (DEEP_TOML, TOO_DEEP),                      # 2 KB of TOML
    (billion_laughs(), TOO_MANY_ALIASED),       # a few hundred bytes of YAML
], ids=['toml-nesting', 'yaml-alias-bomb'])
def test_a_policy_past_the_document_limits_is_logged_and_alerts(tmp_path, text, why):
    """Not an uncaught RecursionError (or minutes of alias expansion): the invalid-policy record and policy_valid 0."""
    node = Node(tmp_path)
    node.tick()
    if text == DEEP_TOML:
        node.paths.policy = node.paths.policy[:-len('.yaml')] + '.toml'  # the extension names the format
    node.write_policy(text)
    summary = node.tick(60)
    assert summary['rc'] == 1 and why in summary['error'] and 'decisions' not in summary
    record = node.log()[-1]
    assert record['event'] == 'guard_policy_invalid' and why in record['error']
    with open(node.paths.metrics) as handle:
        assert 'gpufleet_guard_policy_valid 0' in handle.read()
    assert audit_log.verify(node.paths.log)['valid']


@pytest.mark.parametrize('target,mode,words', [
    ('policy', 0o666, 'writable by group and others'),
    ('policy', 0o664, 'writable by its group'),
    ('state_dir', 0o777, 'state directory'),
])
def test_untrusted_inputs_are_refused(tmp_path, target, mode, words):
    node = Node(tmp_path, policy=POLICY % 'enforce')
    node.tick()
    path = node.paths.policy if target == 'policy' else os.path.dirname(node.paths.state)
    os.chmod(path, mode)
    before = node.state()
    summary = node.tick(3600)      # the grace has long passed: a trusted tick would act now
    assert summary['rc'] == 1 and 'refusing to act on untrusted input' in summary['error'] and words in summary['error']
    assert 'decisions' not in summary
    assert node.log()[-1]['event'] == 'guard_untrusted_input'
    assert node.state() == before   # nothing decided, nothing written
    preview = guard.preview(node.paths, node.settings, now=node.clock.now, snapshot=node.snap, context=node.context)
    assert preview['rc'] == 1
    os.chmod(path, 0o644 if target == 'policy' else 0o750)
    assert node.tick(1)['rc'] == 0


@pytest.mark.parametrize('target,words', [
    ('policy', 'the policy file'),
    ('settings', 'the settings file'),
    ('policy_dir', 'the policy directory'),
    ('state_dir', 'the state directory'),
    ('root_dir', 'above the policy file'),
])
def test_inputs_owned_by_another_user_are_refused(tmp_path, target, words):
    node = Node(tmp_path, policy=POLICY % 'enforce')
    with open(node.paths.settings, 'w') as handle:
        handle.write('{}\n')
    os.chmod(node.paths.settings, 0o600)
    node.tick()
    path = {'policy': node.paths.policy, 'settings': node.paths.settings, 'policy_dir': os.path.dirname(node.paths.policy),
            'state_dir': os.path.dirname(node.paths.state), 'root_dir': str(tmp_path / 'etc')}[target]
    if os.geteuid() != 0:
        # only root can give a file away: the same check, told that the agent runs as someone else
        problems = guard.untrusted_inputs(node.paths, euid=os.geteuid() + 4242)
        assert problems and 'owned by uid %d' % os.geteuid() in problems[0]
        return
    uid = redteam.ensure_users(('alice',))['alice']
    os.chown(path, uid, -1)         # as root: really owned by another user (a fresh CI machine runs this branch)
    before = node.state()
    summary = node.tick(3600)       # the grace has long passed: a trusted tick would act now
    assert summary['rc'] == 1 and 'refusing to act on untrusted input' in summary['error'], summary
    assert words in summary['error'] and 'owned by uid %d, not by root' % uid in summary['error']
    assert 'decisions' not in summary
    assert node.log()[-1]['event'] == 'guard_untrusted_input'
    assert node.state() == before   # nothing decided, nothing written
    os.chown(path, 0, -1)
    assert node.tick(1)['rc'] == 0
    assert guard.untrusted_inputs(guard.Paths(root=str(tmp_path / 'nothing-here'))) == []


def test_disabled_policy_clears_everything(tmp_path):
    node = Node(tmp_path)
    node.tick()
    node.write_policy('enabled: false\nusers: {alice: {max_mem_gib_per_gpu: 8}}\n')
    assert decisions(node.tick(10)) == [('clear', 'max_mem_per_gpu', None)]


def test_preview_changes_nothing(tmp_path):
    node = Node(tmp_path, policy=POLICY % 'enforce')
    summary = guard.preview(node.paths, node.settings, now=node.clock.now, snapshot=node.snap, context=node.context)
    assert [v['rule'] for v in summary['violations']] == ['max_mem_per_gpu']
    assert decisions(summary) == [('warn', 'max_mem_per_gpu', 1)]
    for path in (node.paths.state, node.paths.log, node.paths.metrics):
        assert not os.path.exists(path)


# ============================================================================ metrics and history
def test_metrics_are_written_atomically_and_parse(tmp_path):
    parser = pytest.importorskip('prometheus_client.parser')
    node = Node(tmp_path)
    node.tick()
    node.tick(300)
    with open(node.paths.metrics) as handle:
        text = handle.read()
    families = dict((f.name, f) for f in parser.text_string_to_metric_families(text))
    samples = dict(((s.name, tuple(sorted(s.labels.items()))), s.value) for f in families.values() for s in f.samples)
    assert samples[('gpufleet_user_gpu_memory_mib', (('gpu', '0'), ('user', 'alice')))] == 12 * GIB
    assert samples[('gpufleet_guard_violations', (('rule', 'max_mem_per_gpu'),))] == 1
    assert samples[('gpufleet_guard_warnings_total', (('rule', 'max_mem_per_gpu'),))] == 2
    assert samples[('gpufleet_guard_last_tick_timestamp_seconds', ())] == node.clock.now
    assert ('gpufleet_guard_tick_duration_seconds', ()) in samples
    assert families['gpufleet_guard_kills'].type == 'counter'
    assert [n for n in os.listdir(os.path.dirname(node.paths.metrics)) if n != 'gpufleet.prom'] == []


def test_history_samples_are_recorded(tmp_path):
    history = pytest.importorskip('ansible_collections.gpufleet.reclaim.plugins.module_utils.core.history')
    node = Node(tmp_path)
    node.tick()
    node.tick(30)
    import sqlite3  # pylint: disable=import-outside-toplevel
    conn = sqlite3.connect(node.paths.history)
    try:
        assert conn.execute('SELECT COUNT(DISTINCT ts) FROM gpu_samples').fetchone()[0] == 2
    finally:
        conn.close()
    assert history.DEFAULT_PATH == guard.DEFAULT_PATHS['history']


def test_outputs_can_be_turned_off(tmp_path):
    node = Node(tmp_path)
    node.paths.metrics = None
    node.paths.history = None
    node.tick()
    assert not os.path.exists(os.path.join(str(tmp_path), 'var/lib/node_exporter'))
    assert not os.path.exists(os.path.join(str(tmp_path), 'var/lib/gpufleet/history.db'))


def test_settings_file(tmp_path):
    paths = guard.Paths(root=str(tmp_path))
    os.makedirs(os.path.dirname(paths.settings))
    with open(paths.settings, 'w') as handle:
        handle.write('metrics_path: /srv/m.prom\nhistory_path: ""\nwebhook_url: https://h.example/x\nwebhook_timeout: 3\n')
    settings = guard.load_settings(paths.settings, paths)
    assert paths.metrics == '/srv/m.prom' and paths.history is None
    assert settings.webhook_url == 'https://h.example/x' and settings.webhook_timeout == 3.0
    with open(paths.settings, 'w') as handle:
        handle.write('policy_path: /etc/gpufleet/policy.toml\n')
    guard.load_settings(paths.settings, paths)
    assert paths.policy == '/etc/gpufleet/policy.toml'              # the role names a TOML policy's file
    with open(paths.settings, 'w') as handle:
        handle.write('policy_path: ""\n')
    with pytest.raises(guard.InvalidArgument) as info:
        guard.load_settings(paths.settings, paths)
    assert 'the policy cannot be turned off' in str(info.value)
    with open(paths.settings, 'w') as handle:
        handle.write('colour: blue\nvendor: ati\nmetrics_path: rel/m.prom\nrelease_timeout: -1\n')
    with pytest.raises(guard.InvalidArgument) as info:
        guard.load_settings(paths.settings, paths)
    assert str(info.value).splitlines() == [                 # every bad setting, with its line and value
        "%s:1: colour: invalid value 'blue': unknown setting; expected one of %s" % (paths.settings, ', '.join(guard.SETTINGS_KEYS)),
        "%s:2: vendor: invalid value 'ati': expected auto, nvidia, amd, intel or apple" % paths.settings,
        "%s:3: metrics_path: invalid value 'rel/m.prom': expected an absolute path (or an empty value to turn it off)" % paths.settings,
        "%s:4: release_timeout: invalid value -1: expected a positive number" % paths.settings]
    with open(paths.settings, 'w') as handle:
        handle.write('vendor: [nvidia\n')
    with pytest.raises(guard.InvalidArgument) as info:
        guard.load_settings(paths.settings, paths)
    assert str(info.value).startswith('%s: line 2, column 1: YAML syntax error: ' % paths.settings) and info.value.field == 'settings'
    for text, why in (('vendor: ' + '[' * 40 + ']' * 40 + '\n', TOO_DEEP), (billion_laughs(), TOO_MANY_ALIASED)):
        with open(paths.settings, 'w') as handle:
            handle.write(text)
        with pytest.raises(guard.InvalidArgument) as info:
            guard.load_settings(paths.settings, paths)
        assert info.value.field == 'settings' and why in info.value.why


# ============================================================================ notifications
class _Hook(http.server.BaseHTTPRequestHandler):
    received = []
    status = 200

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get('Content-Length') or 0)
        _Hook.received.append(json.loads(self.rfile.read(length).decode('utf-8')))
        self.send_response(_Hook.status)
        self.end_headers()

    def log_message(self, *args):  # pylint: disable=arguments-differ
        pass


@pytest.fixture
def webhook():
    _Hook.received = []
    _Hook.status = 200
    server = http.server.HTTPServer(('127.0.0.1', 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, kwargs={'poll_interval': 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield 'http://127.0.0.1:%d/hook' % server.server_address[1], _Hook
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_webhook_gets_redacted_json_and_never_the_environment(tmp_path, webhook):
    url, hook = webhook
    snap = snapshot([proc(1, 'alice', {0: 12 * GIB}, cmdline=['python', 'train.py', '--token=s3cr3t', '--password', 'hunter2',
                                                              'https://bob:pw@host/x'])])
    node = Node(tmp_path, policy=POLICY % 'warn', snap=snap)
    node.settings.webhook_url = url
    summary = node.tick()
    assert summary['decisions'][0]['outcome']['notified']['webhook'] == 'ok'
    assert len(hook.received) == 1
    payload = hook.received[0]
    assert payload['user'] == 'alice' and payload['mode'] == 'warn'
    text = json.dumps(payload)
    assert 's3cr3t' not in text and 'hunter2' not in text and ':pw@' not in text and '<redacted>' in text
    assert 'environ' not in text and 'PATH' not in text
    assert payload['decisions'][0]['procs'][0]['cmdline'].startswith('python train.py --token=<redacted>')


def test_dry_run_notifies_nobody(tmp_path, webhook):
    url, hook = webhook
    node = Node(tmp_path, policy=POLICY % 'dry-run')
    node.settings.webhook_url = url
    summary = node.tick()
    assert hook.received == [] and summary['decisions'][0]['outcome']['notified'] == 'not sent (dry-run)'


def test_a_failing_webhook_is_logged_and_does_not_block(tmp_path, webhook):
    url, hook = webhook
    hook.status = 500
    node = Node(tmp_path, policy=POLICY % 'warn')
    node.settings.webhook_url = url
    summary = node.tick()
    notified = summary['decisions'][0]['outcome']['notified']
    assert notified['webhook'] == 'failed' and 'HTTP 500' in notified['errors'][0]
    assert node.state()['counters']['notify_failures'] == {'webhook': 1}
    node.settings.webhook_url = 'http://127.0.0.1:9/closed'
    node.settings.webhook_timeout = 1.0
    summary = node.tick(600)
    assert summary['decisions'][0]['outcome']['notified']['webhook'] == 'failed'
    assert summary['duration'] < 10


def test_command_hook_gets_the_payload_on_stdin(tmp_path):
    out = tmp_path / 'hook.json'
    script = 'import sys; open(%r, "w").write(sys.stdin.read())' % str(out)
    policy = POLICY % 'warn' + 'notify_cmd: 1\n'
    policy = policy.replace('notify: {tty: false}', 'notify: {tty: false, command: [%s, "-c", %s]}' % (
        json.dumps(sys.executable), json.dumps(script))).replace('notify_cmd: 1\n', '')
    node = Node(tmp_path, policy=policy)
    summary = node.tick()
    assert summary['decisions'][0]['outcome']['notified']['command'] == 'ok'
    payload = json.loads(out.read_text())
    assert payload['decisions'][0]['rule'] == 'max_mem_per_gpu' and payload['host']


def test_command_hook_failures_are_reported():
    assert 'exited 3' in notify.run_hook([sys.executable, '-c', 'import sys; sys.exit(3)'], {})
    assert 'did not finish' in notify.run_hook([sys.executable, '-c', 'import time; time.sleep(5)'], {}, timeout=0.5)
    assert notify.run_hook(['/nonexistent/hook'], {}).startswith('command hook /nonexistent/hook')


def test_terminal_messages_reach_the_users_own_pty(tmp_path):
    master, slave = os.openpty()
    try:
        dev = tmp_path / 'dev'
        (dev / 'pts').mkdir(parents=True)
        os.symlink(os.ttyname(slave), str(dev / 'pts' / '7'))
        uid = os.stat(os.ttyname(slave)).st_uid
        written, errors = notify.write_ttys('someone', uid, 'GPU limit exceeded', dev_root=str(dev), utmp_paths=())
        assert (written, errors) == (1, [])
        assert b'GPU limit exceeded' in os.read(master, 4096)
        assert notify.write_ttys('someone', uid + 1, 'x', dev_root=str(dev), utmp_paths=()) == (0, [])
    finally:
        os.close(master)
        os.close(slave)


def test_utmp_parsing(tmp_path):
    import struct  # pylint: disable=import-outside-toplevel
    entry = notify._UTMP.pack(7, 0, 123, b'pts/4', b'ts/4', b'alice', b'host', 0, 0, 0, 0, 0, b'', b'')
    other = notify._UTMP.pack(8, 0, 124, b'pts/5', b'ts/5', b'alice', b'host', 0, 0, 0, 0, 0, b'', b'')
    evil = notify._UTMP.pack(7, 0, 125, b'../../etc/x', b'x', b'alice', b'', 0, 0, 0, 0, 0, b'', b'')
    path = tmp_path / 'utmp'
    path.write_bytes(entry + other + evil + b'partial')
    assert notify.utmp_ttys('alice', [str(path)]) == ['pts/4']
    assert struct.calcsize('<hh i 32s 4s 32s 256s hh i ii 16s 20s') == 384


def test_redaction_defaults_and_extra_patterns():
    policy = P.load_policy_text('notify: {redact_patterns: ["customer-[0-9]+"]}')
    text = notify.redact(['run', '--api-key', 'AB12', 'customer-42', 'Authorization: Bearer xyz.abc', 'AKIAABCDEFGHIJKLMNOP',
                          'PASSWORD=pw'], policy.notify.redact_patterns)
    for secret in ('AB12', 'customer-42', 'xyz.abc', 'ABCDEFGHIJKLMNOP', '=pw'):
        assert secret not in text
    assert notify.redact(['x' * 2000], []).endswith('...')


# ============================================================================ real processes (gpusim) and the killer
needs_sim = pytest.mark.skipif(h.shim_path() is None or h.gpusim_path() is None, reason='the simulator is not built (make sim)')


@needs_sim
def test_enforce_kills_the_offender_after_the_grace_and_spares_the_rest(tmp_path):
    if os.geteuid() != 0:
        pytest.skip('spawning workloads as other users needs root')
    redteam.ensure_users(('alice', 'bob'))      # a fresh machine has them only once the integration targets ran
    with h.gpusim_node(gpus=2) as node:
        big = node.spawn(gpu=0, mib=12 * GIB, argv=('python', 'big.py'), user='alice')
        small = node.spawn(gpu=0, mib=6 * GIB, argv=('python', 'small.py'), user='alice')
        other = node.spawn(gpu=1, mib=20 * GIB, argv=('python', 'other.py'), user='bob')
        policy = ('mode: enforce\nusers: {alice: {max_mem_gib_total: 40}}\ndefaults: {max_mem_gib_per_gpu: 8}\n'
                  'protect: {users: [bob]}\n'
                  'escalation: {warn_again_after: 1s, act_after: 2s, sigkill_after: 3s}\nnotify: {tty: false}\n')
        guard_node = Node(tmp_path, policy=policy, snap=None)
        clock = guard_node.clock

        def tick(advance):
            clock.advance(advance)
            return guard.run_tick(guard_node.paths, guard_node.settings, now=clock.now, dev_roots=node.dev_roots)

        assert decisions(tick(0)) == [('warn', 'max_mem_per_gpu', 1)]
        assert decisions(tick(1)) == [('warn', 'max_mem_per_gpu', 2)]
        assert node.alive(big)
        summary = tick(1)
        assert decisions(summary) == [('act', 'max_mem_per_gpu', 2)]
        outcome = summary['decisions'][0]['outcome']
        assert outcome['pids'][big]['outcome'] == 'killed' and outcome['pids'][big]['signals'] == ['SIGTERM']
        assert not node.alive(big) and node.alive(small) and node.alive(other)
        assert decisions(tick(1)) == [('clear', 'max_mem_per_gpu', None)]
        assert guard_node.state()['counters']['kills'] == {'max_mem_per_gpu': 1}
        assert audit_log.verify(guard_node.paths.log)['valid']


def test_identity_is_checked_again_before_the_signal(tmp_path):
    child = subprocess.Popen(['sleep', '600'], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        h.wait_for(lambda: os.path.exists('/proc/%d/stat' % child.pid) and h.starttime(child.pid) > 0, what='sleep')
        real_start = h.starttime(child.pid)
        snap = snapshot([proc(child.pid, 'alice', {0: 12 * GIB}, starttime=real_start + 1)])   # the pid was "reused"
        node = Node(tmp_path, snap=snap, policy='mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 8}}\n'
                                                'escalation: {act_after: 0s}\nnotify: {tty: false}\n')
        summary = node.tick()
        act = summary['decisions'][0]
        assert act['decision'] == 'act'
        outcome = act['outcome']['pids'][child.pid]
        assert outcome['outcome'] == 'skipped' and 'reused' in outcome['reason']
        assert child.poll() is None                       # never signalled
    finally:
        child.kill()
        child.wait(10)


def test_a_listed_pid_that_holds_no_gpu_file_here_is_never_signalled(tmp_path):
    """The snapshot skips the fd scan; the processes about to be signalled get their files checked."""
    child = subprocess.Popen(['sleep', '600'], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        h.wait_for(lambda: os.path.exists('/proc/%d/stat' % child.pid) and h.starttime(child.pid) > 0, what='sleep')
        snap = snapshot([proc(child.pid, 'alice', {0: 12 * GIB}, starttime=h.starttime(child.pid))])
        snap.processes[0].device_paths = None            # as a tick's snapshot leaves it
        node = Node(tmp_path, snap=snap, policy='mode: enforce\nusers: {alice: {max_mem_gib_per_gpu: 8}}\n'
                                                'escalation: {act_after: 0s}\nnotify: {tty: false}\n')
        outcome = node.tick()['decisions'][0]['outcome']['pids'][child.pid]
        assert outcome['outcome'] == 'skipped' and 'holds no GPU device file' in outcome['reason']
        assert snap.processes[0].device_paths == []
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(10)


# ============================================================================ idle clocks from the usage history
IDLE_POLICY = 'mode: dry-run\nusers: {alice: {idle: {util_max_pct: 1, mem_min_gib: 1, for: 10m}}}\nnotify: {tty: false}\n'


def idle_rules(summary):
    return [v['rule'] for v in summary['violations']]


def test_idle_clocks_come_from_the_history_not_the_state(tmp_path):
    pytest.importorskip('ansible_collections.gpufleet.reclaim.plugins.module_utils.core.history')
    node = Node(tmp_path, policy=IDLE_POLICY, snap=snapshot([proc(1, 'alice', {0: 4 * GIB}, util=0)]))
    for _step in range(10):
        assert idle_rules(node.tick(60)) == []
    assert 'idle' not in node.state() and 'idle_sampled_at' not in node.state()
    assert idle_rules(node.tick(60)) == ['idle']                    # 10 minutes of samples
    # a state file of an earlier release (with its clocks) is read; its clocks are not used or kept
    state = node.state()
    state.update(idle={'1:10': {'since': 0}}, idle_sampled_at=node.clock.now)
    with open(node.paths.state, 'w') as handle:
        json.dump(state, handle)
    os.remove(node.paths.history)                                            # no samples: no clock
    summary = node.tick(60)
    assert idle_rules(summary) == [] and not [w for w in summary['warnings'] if 'state' in w]
    assert 'idle' not in node.state()
    # dry_run (gpu_audit policy=) reads the same history, read-only
    for _step in range(11):
        node.tick(60)
    violations, _notes, _warnings = guard.dry_run(P.load_policy(node.paths.policy), node.snap, node.paths, now=node.clock.now)
    assert [v['rule'] for v in violations] == ['idle']
