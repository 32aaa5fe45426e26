# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""extras/alertmanager (issue #33): ``amtool check-config`` passes on the shipped configuration and fails on
planted typos; a real Alertmanager running it routes by severity and delivers to a real SMTP server (aiosmtpd),
to Slack and Teams (an HTTP receiver that checks each payload's shape) and to the EDA webhook with its bearer
token, with every label value escaped on the way to people.

SAFETY: loopback only; every server is stopped by its pid (alertmanager_chain.serve).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time

import pytest
import yaml

from ansible_collections.gpufleet.reclaim.tests.unit.extras import alertmanager_chain as ac

needs_amtool = pytest.mark.skipif(not ac.AMTOOL, reason=ac.MISSING)
HOSTILE = '0 <!channel> <https://evil.example|click> & \x1b[2J\nFORGED'
RULES = os.path.join(ac.ROOT, 'extras', 'prometheus', 'gpufleet-rules.yml')


@needs_amtool
def test_amtool_accepts_the_shipped_configuration():
    rc, out = ac.amtool_check(ac.CONFIG)
    assert rc == 0, out
    assert '3 receivers' in out and '1 templates' in out and out.rstrip().endswith('SUCCESS'), out


@needs_amtool
@pytest.mark.parametrize('old, new, complaint', [
    ('  smtp_smarthost:', '  smtp_smarthots:', 'smtp_smarthots'),                       # a misspelt key
    ('    - receiver: oncall-critical', '    - receiver: oncall-critcal', 'oncall-critcal'),  # a route to no receiver
    ('matchers: [severity="critical"]', 'matchers: [severity=="critical"]', 'unescaped double quote'),  # a bad matcher
    ('group_interval: 30s', 'group_interval: 30', 'not a valid duration string: "30"'),  # no unit
])
def test_a_planted_typo_fails_the_check(tmp_path, old, new, complaint):
    with open(ac.CONFIG) as handle:
        text = handle.read()
    assert old in text
    shutil.copy(ac.TEMPLATE, str(tmp_path))
    planted = tmp_path / 'alertmanager.yml'
    planted.write_text(text.replace(old, new, 1))
    rc, out = ac.amtool_check(str(planted))
    assert rc != 0 and 'FAILED' in out and complaint in out, out


@needs_amtool
def test_a_planted_typo_in_the_template_fails_the_check(tmp_path):
    shutil.copy(ac.CONFIG, str(tmp_path))
    with open(ac.TEMPLATE) as handle:
        text = handle.read()
    (tmp_path / 'gpufleet.tmpl').write_text(text.replace('{{ end }}{{ end }}', '{{ end }}{{ edn }}', 1))
    rc, out = ac.amtool_check(str(tmp_path / 'alertmanager.yml'))
    assert rc != 0 and 'edn' in out, out


def test_the_eda_route_carries_exactly_the_alerts_the_rulebook_acts_on():
    with open(ac.CONFIG) as handle:
        config = yaml.safe_load(handle)
    eda = config['route']['routes'][0]
    assert eda['receiver'] == 'gpufleet-eda' and eda['continue'] is True
    names = eda['matchers'][0].split('=~', 1)[1].strip('"').split('|')
    spec = importlib.util.spec_from_file_location('am_source', os.path.join(ac.ROOT, 'extensions', 'eda', 'plugins',
                                                                            'event_source', 'alertmanager.py'))
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    assert sorted(names) == sorted(source.ALERTNAMES)
    with open(RULES) as handle:
        severities = set(r['labels']['severity'] for g in yaml.safe_load(handle)['groups'] for r in g['rules'])
    routed = set(r['matchers'][0].split('=', 1)[1].strip('"') for r in config['route']['routes'][1:])
    assert severities == routed == {'critical', 'warning'}


def _alert(name, severity, gpu, **annotations):
    labels = {'alertname': name, 'severity': severity, 'instance': 'node01:9100', 'job': 'node', 'gpu': gpu}
    base = {'summary': '%s on GPU %s of node01:9100' % (name, gpu), 'description': 'GPU %s of node01 logged it.' % gpu,
            'runbook_url': 'https://example.invalid/gpufleet/reclaim/blob/main/docs/observability.md#%s' % name.lower()}
    base.update(annotations)
    return {'labels': labels, 'annotations': base, 'startsAt': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
            'generatorURL': 'http://127.0.0.1:9090/graph'}


@pytest.mark.skipif(not (ac.ALERTMANAGER and importlib.util.find_spec('aiosmtpd')),
                    reason='%s; aiosmtpd is in tests/requirements-dev.txt' % ac.MISSING)
def test_a_real_alertmanager_delivers_by_severity_to_smtp_slack_teams_and_the_rulebook(tmp_path):
    xid = _alert('GpuXidFault', 'critical', '0', summary='Xid 48 (gpu fault) on GPU %s of node01:9100' % HOSTILE)
    orphan = _alert('GpuOrphanedMemory', 'warning', '1')
    stale = _alert('GpuGuardTickStale', 'critical', '0')
    with ac.serve(tmp_path) as served:
        assert ac.post_alerts(served['port'], [xid, orphan, stale]) == 200
        receiver = served['receiver']
        ac.pc.until('every receiver', lambda: (len(receiver.got('/eda')) >= 2 and len(receiver.got('/slack')) >= 3
                                               and receiver.got('/teams') and len(ac.mails(served['maildir'])) >= 2))
        eda, slack, teams, mails = receiver.got('/eda'), receiver.got('/slack'), receiver.got('/teams'), ac.mails(served['maildir'])
    # the rulebook's webhook: Alertmanager's payload, version 4, the acting alerts only, with the bearer token
    assert all(h.get('Authorization') == 'Bearer %s' % ac.TOKEN for h, _body in eda)
    assert sorted(a['labels']['alertname'] for _h, body in eda for a in body['alerts']) == ['GpuOrphanedMemory', 'GpuXidFault']
    for _h, body in eda + teams:
        assert body['version'] == '4' and body['status'] == 'firing' and body['alerts'][0]['fingerprint']
        assert set(body) >= {'receiver', 'groupKey', 'groupLabels', 'commonLabels', 'commonAnnotations', 'externalURL', 'alerts'}
    # Teams (the workflow webhook): the critical alerts only
    assert sorted(a['labels']['alertname'] for _h, body in teams for a in body['alerts']) == ['GpuGuardTickStale', 'GpuXidFault']
    # Slack: critical to #gpu-oncall, warning to #gpu-fleet, the attachment's shape, the hostile text made inert
    by_channel = dict((body['channel'], body) for _h, body in slack)
    assert set(by_channel) == {'#gpu-oncall', '#gpu-fleet'}
    for body in by_channel.values():
        (attachment,) = body['attachments']
        assert body['username'] == 'gpufleet' and set(attachment) >= {'title', 'title_link', 'text', 'color', 'fallback'}
        assert attachment['title_link'].startswith('https://example.invalid/') and attachment['title'].startswith('[FIRING:')
    warning = by_channel['#gpu-fleet']['attachments'][0]
    assert warning['color'] == 'warning' and 'GpuOrphanedMemory on node01:9100' in warning['title']
    critical_texts = [body['attachments'][0]['text'] for _h, body in slack if body['channel'] == '#gpu-oncall']
    xid_text = [t for t in critical_texts if 'Xid 48' in t]
    assert xid_text and '&lt;!channel&gt; &lt;https://evil.example|click&gt; &amp; [2J' in xid_text[0]
    assert '<!channel>' not in xid_text[0] and '\x1b' not in xid_text[0] and 'FORGED' in xid_text[0]
    assert [body['attachments'][0]['color'] for _h, body in slack if body['channel'] == '#gpu-oncall'] == ['danger'] * len(critical_texts)
    # email: the critical alerts, with their subject, a text part and an escaped HTML part
    subjects = sorted(m['Subject'] for m in mails)
    assert subjects == ['[FIRING:1] GpuGuardTickStale on node01:9100', '[FIRING:1] GpuXidFault on node01:9100'], subjects
    mail = [m for m in mails if 'GpuXidFault' in m['Subject']][0]
    assert mail['To'] == 'gpu-oncall@example.org' and mail['From'] == 'gpufleet-alerts@example.org'
    parts = dict((p.get_content_type(), p.get_payload(decode=True).decode('utf-8')) for p in mail.walk() if not p.is_multipart())
    assert 'FIRING: Xid 48 (gpu fault)' in parts['text/plain'] and '\x1b' not in parts['text/plain']
    assert '&lt;!channel&gt;' in parts['text/html'] and '<!channel>' not in parts['text/html']
