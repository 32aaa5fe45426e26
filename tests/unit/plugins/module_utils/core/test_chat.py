# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/chat.py and notify.webhook.format (issue #33): the guard's webhook as Slack's and Teams' own payloads,
sent by the real Notifier to an HTTP receiver on 127.0.0.1 that checks each payload's shape; the text that a
node's users shape (process names) is escaped for each chat's markup, and no command line or secret reaches it.
"""

from __future__ import annotations

import json

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import chat, errors, notify, policy
from ansible_collections.gpufleet.reclaim.tests.unit.extras.alertmanager_chain import Receiver

HOSTILE = 'miner <!channel> <https://evil.example|log in> [click](https://evil.example) **now** \x1b[2J & co'
CMDLINE = ['python', 'train.py', '--password=hunter2', '--hf-token', 'hf_abcdefghijklmnopqrstuvwxyz0123456789']


@pytest.fixture()
def receiver():
    hook = Receiver()
    hook.thread.start()
    try:
        yield hook
    finally:
        hook.server.shutdown()
        hook.server.server_close()


def send(receiver, fmt):
    text = 'notify: {tty: false, webhook: {url: "%s", format: %s}}' % (receiver.url('/' + fmt), fmt)
    notifier = notify.Notifier(policy.load_policy_text(text).notify, 'node07')
    procs = notify.describe_procs([{'pid': 4242, 'name': HOSTILE, 'user': 'alice', 'used_mib': 12288, 'gpu_indexes': [0],
                                    'cmdline': CMDLINE}], notify.default_patterns())
    items = [{'decision': 'act', 'rule': 'max_mem_per_gpu', 'pids': [4242], 'procs': procs,
              'message': 'process %s of alice uses 12 GiB on GPU 0 (limit 8 GiB)' % HOSTILE}]
    result = notifier.send('alice', None, items, 'enforce')
    assert result['webhook'] == 'ok' and not result['errors'], result
    ((headers, body),) = receiver.got('/' + fmt)
    assert headers['Content-Type'] == 'application/json'
    return body


def test_slack_gets_its_own_message_shape_with_the_text_made_inert(receiver):
    body = send(receiver, 'slack')
    assert set(body) == {'text', 'blocks'} and body['text'] == 'gpufleet-guard on node07 (enforce mode): a message for alice'
    section, context = body['blocks']
    assert section['type'] == 'section' and section['text']['type'] == 'mrkdwn'
    assert context == {'type': 'context', 'elements': [{'type': 'mrkdwn', 'text': body['text']}]}
    text = section['text']['text']
    assert '&lt;!channel&gt; &lt;https://evil.example|log in&gt;' in text and '&amp; co' in text and 'terminated' in text
    assert '<!' not in text and '<http' not in text and '\x1b' not in text and '\\x1b[2J' in text
    assert 'hunter2' not in json.dumps(body) and 'hf_abc' not in json.dumps(body)


def test_teams_gets_an_adaptive_card_with_the_markdown_escaped(receiver):
    body = send(receiver, 'teams')
    assert body['type'] == 'message'
    (attachment,) = body['attachments']
    assert attachment['contentType'] == 'application/vnd.microsoft.card.adaptive' and attachment['contentUrl'] is None
    card = attachment['content']
    assert (card['type'], card['version'], card['$schema']) == ('AdaptiveCard', '1.4', 'http://adaptivecards.io/schemas/adaptive-card.json')
    assert all(block['type'] == 'TextBlock' and block['wrap'] is True for block in card['body'])
    assert card['body'][0]['weight'] == 'Bolder' and 'gpufleet\\-guard on node07' in card['body'][0]['text']
    text = '\n'.join(block['text'] for block in card['body'])
    assert '\\[click\\]\\(https://evil\\.example\\)' in text and '\\*\\*now\\*\\*' in text
    assert '[click](' not in text and '**now**' not in text and '\x1b' not in text
    assert 'hunter2' not in json.dumps(body) and 'hf_abc' not in json.dumps(body)


def test_json_stays_the_guards_own_payload_with_redacted_command_lines(receiver):
    body = send(receiver, 'json')
    assert body['event'] == 'gpufleet_guard' and body['host'] == 'node07' and body['user'] == 'alice'
    cmdline = body['decisions'][0]['procs'][0]['cmdline']
    assert '--password=<redacted>' in cmdline and 'hunter2' not in cmdline and 'hf_abc' not in cmdline


def test_an_unknown_format_is_refused_naming_the_field():
    with pytest.raises(errors.InvalidArgument) as err:
        policy.load_policy_text('notify: {webhook: {url: "https://hooks.example.org/x", format: discord}}')
    assert 'notify.webhook.format' in str(err.value) and 'discord' in str(err.value)
    assert policy.load_policy_text('notify: {webhook: "https://hooks.example.org/x"}').notify.webhook_format == 'json'


def test_the_escapes():
    assert chat.slack_escape('a <b> & c') == 'a &lt;b&gt; &amp; c'
    assert chat.markdown_escape('x_[y](z) #1 `c`') == 'x\\_\\[y\\]\\(z\\) \\#1 \\`c\\`'
    assert chat.chat_payload('json', 'h', 'u', 'enforce', 'text', {'a': 1}) == {'a': 1}
