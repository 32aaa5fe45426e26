# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The guard's webhook in the formats chat tools take (``notify.webhook.format``): Slack's incoming webhooks
and Microsoft Teams' workflow webhooks (an Adaptive Card in a message), beside the plain JSON payload.

The text is the terminal message (notify.user_text: every line already escaped by text.printable, no
command line in it), escaped once more for the chat's own markup, so that a process or user name can make
no link, mention or formatting: Slack's ``& < >`` become entities (no ``<!channel>``, no ``<url|text>``);
for Teams' Markdown, every CommonMark punctuation character that starts markup is backslash-escaped.  The
decisions themselves (with redacted command lines) stay out of the chat message: they are in the JSON
payload and the guard's log.
"""

from __future__ import annotations

import re

FORMATS = ('json', 'slack', 'teams')
MAX_TEXT = 3000                     # Slack's limit for one section's text
_SLACK = (('&', '&amp;'), ('<', '&lt;'), ('>', '&gt;'))
_MARKDOWN = re.compile(r'([\\`*_{}\[\]()#+\-.!|~<>])')


def slack_escape(text):
    """``text`` with Slack's mrkdwn control characters as entities."""
    for char, entity in _SLACK:
        text = text.replace(char, entity)
    return text


def markdown_escape(text):
    """``text`` with every character that starts CommonMark markup backslash-escaped."""
    return _MARKDOWN.sub(r'\\\1', text)


def _headline(host, user, mode):
    return 'gpufleet-guard on %s (%s mode): a message for %s' % (host, mode, user or 'unknown user')


def slack_payload(host, user, mode, text):
    """A Slack incoming-webhook message: fallback text and two blocks (the message, then its context)."""
    body = slack_escape(text)[:MAX_TEXT]
    head = slack_escape(_headline(host, user, mode))
    return {'text': head,
            'blocks': [{'type': 'section', 'text': {'type': 'mrkdwn', 'text': body}},
                       {'type': 'context', 'elements': [{'type': 'mrkdwn', 'text': head}]}]}


def teams_payload(host, user, mode, text):
    """A Teams workflow-webhook message: one Adaptive Card (1.4) with a heading and one block per line."""
    lines = [markdown_escape(line) for line in text.split('\n') if line]
    return {'type': 'message',
            'attachments': [{'contentType': 'application/vnd.microsoft.card.adaptive', 'contentUrl': None,
                             'content': {'$schema': 'http://adaptivecards.io/schemas/adaptive-card.json',
                                         'type': 'AdaptiveCard', 'version': '1.4',
                                         'body': [{'type': 'TextBlock', 'text': markdown_escape(_headline(host, user, mode)),
                                                   'weight': 'Bolder', 'wrap': True}] +
                                         [{'type': 'TextBlock', 'text': line[:MAX_TEXT], 'wrap': True} for line in lines[:40]]}}]}


def chat_payload(fmt, host, user, mode, text, payload):
    """The body to POST for webhook format ``fmt``: ``payload`` itself for json."""
    if fmt == 'slack':
        return slack_payload(host, user, mode, text)
    if fmt == 'teams':
        return teams_payload(host, user, mode, text)
    return payload
