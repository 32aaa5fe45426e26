# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The webhook's transport (docs/security.md, T14): plain http:// is refused when the policy or the
settings are validated (loopback hosts and an explicit opt-in excepted), and an https:// endpoint
whose certificate does not verify gets nothing.

SAFETY: the TLS server listens on 127.0.0.1 only, on a port the kernel picks; each test starts it,
and stops it and joins its thread in a ``finally``.  Every wait is bounded by a timeout.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import os
import ssl
import threading

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import guard, notify, policy
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument

REFUSED = ['http://hooks.example.com/gpu', 'http://ops:s3cret@hooks.example.com/gpu', 'http://10.0.0.7:8080/x',
           'http://127.0.0.1.nip.io/x', 'http://localhost.example.com/x', 'http://[::2]/x',
           'ftp://hooks.example.com/x', 'https://', 'http://127.0.0.1:port/x', 'hooks.example.com/gpu']
ACCEPTED = ['https://hooks.example.com/gpu', 'https://ops:s3cret@hooks.example.com/gpu', 'http://127.0.0.1:8080/x',
            'http://127.45.6.7/x', 'http://[::1]:9000/x', 'http://localhost/x', 'http://LOCALHOST:80/x', 'http://localhost./x']


def policy_with(url, allow_http=None):
    hook = {'url': url}
    if allow_http is not None:
        hook['allow_http'] = allow_http
    return policy.load_policy_text(json.dumps({'notify': {'tty': False, 'webhook': hook}}))


def settings_with(tmp_path, url, allow_http=None):
    doc = {'webhook_url': url}
    if allow_http is not None:
        doc['webhook_allow_http'] = allow_http
    path = tmp_path / 'guard.yaml'
    path.write_text(json.dumps(doc))
    return guard.load_settings(str(path), guard.Paths(root=str(tmp_path)))


# ---------------------------------------------------------------------------- http:// is refused
@pytest.mark.parametrize('url', REFUSED)
def test_a_plain_http_webhook_is_refused_in_the_policy(url):
    with pytest.raises(policy.PolicyError) as err:
        policy_with(url)
    (path, value, why) = err.value.errors[0]
    assert path == 'notify.webhook.url'
    assert 'https://' in why and 's3cret' not in str(err.value)                # the password never in the error
    if url.startswith('http://') and 'port' not in url:
        assert value == notify.redact_url(url) and 'http://' in str(err.value)   # the value, shortened to scheme and host
        assert 'allow_http' in why


@pytest.mark.parametrize('url', REFUSED)
def test_a_plain_http_webhook_is_refused_in_the_settings(tmp_path, url):
    with pytest.raises(InvalidArgument) as err:
        settings_with(tmp_path, url)
    assert err.value.field == 'webhook_url' and err.value.source.endswith('guard.yaml') and 's3cret' not in str(err.value)
    if url.startswith('http://') and 'port' not in url:
        assert err.value.value == notify.redact_url(url) and 'webhook_allow_http: true' in str(err.value)


@pytest.mark.parametrize('url', ACCEPTED)
def test_https_and_loopback_webhooks_are_accepted(tmp_path, url):
    assert policy_with(url).notify.webhook_url == url
    assert settings_with(tmp_path, url).webhook_url == url


@pytest.mark.parametrize('url', ['http://hooks.example.com/gpu', 'http://10.0.0.7:8080/x'])
def test_plain_http_needs_the_explicit_opt_in(tmp_path, url):
    assert policy_with(url, allow_http=True).notify.webhook_url == url
    assert settings_with(tmp_path, url, allow_http=True).webhook_url == url
    with pytest.raises(policy.PolicyError):
        policy_with(url, allow_http=False)
    with pytest.raises(InvalidArgument):
        settings_with(tmp_path, url, allow_http=False)
    with pytest.raises(InvalidArgument) as err:                                # a bool, not a word that looks like one
        settings_with(tmp_path, url, allow_http='yes please')
    assert err.value.field.endswith('webhook_allow_http') and err.value.value == 'yes please'


def test_the_role_checks_the_url_like_the_agent():
    """The guard role: a default (false) and an argument spec for the opt-in, the settings template
    passes it, and the role's own assertion accepts and refuses the same URLs as the agent."""
    yaml = pytest.importorskip('yaml')
    try:
        from ansible.parsing.dataloader import DataLoader  # pylint: disable=import-outside-toplevel
        from ansible.template import Templar, trust_as_template  # pylint: disable=import-outside-toplevel
    except ImportError:
        pytest.skip('needs ansible-core 2.19 or later (trust_as_template)')
    role = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', 'roles', 'guard')
    with open(os.path.join(role, 'defaults', 'main.yml')) as handle:
        assert yaml.safe_load(handle)['gpu_guard_webhook_allow_http'] is False
    with open(os.path.join(role, 'meta', 'argument_specs.yml')) as handle:
        spec = yaml.safe_load(handle)['argument_specs']['main']['options']['gpu_guard_webhook_allow_http']
    assert spec['type'] == 'bool' and spec['default'] is False
    with open(os.path.join(role, 'templates', 'guard.yaml.j2')) as handle:
        assert 'webhook_allow_http: {{ gpu_guard_webhook_allow_http | bool | to_json }}' in handle.read()
    with open(os.path.join(role, 'tasks', 'present.yml')) as handle:
        (task,) = [t for t in yaml.safe_load(handle) if t.get('name') == "Check the guard's settings"]
    (condition,) = [c for c in task['ansible.builtin.assert']['that'] if 'gpu_guard_webhook_url' in c]
    for url in REFUSED + ACCEPTED + ['']:
        for allow_http in (False, True):
            if allow_http and url.startswith('http://') and ':port' in url:
                continue                                                      # the agent refuses the port; the role leaves it to it
            templar = Templar(loader=DataLoader(), variables={'gpu_guard_webhook_url': url, 'gpu_guard_webhook_allow_http': allow_http})
            role_ok = templar.evaluate_conditional(trust_as_template(condition))
            agent_ok = url == '' or notify.webhook_url_problem(url, allow_http) is None
            assert role_ok == agent_ok, (url, allow_http, role_ok)


# ---------------------------------------------------------------------------- certificate verification
def make_cert(tmp_path, name, san):
    """A self-signed certificate and key for ``san`` (an IP address or a DNS name), as PEM files."""
    x509 = pytest.importorskip('cryptography.x509')
    from cryptography.hazmat.primitives import hashes, serialization  # pylint: disable=import-outside-toplevel
    from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=import-outside-toplevel
    from cryptography.x509.oid import NameOID  # pylint: disable=import-outside-toplevel
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, 'gpufleet webhook test')])
    try:
        alt = x509.IPAddress(ipaddress.ip_address(san))
    except ValueError:
        alt = x509.DNSName(san)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = str(tmp_path / (name + '.pem')), str(tmp_path / (name + '.key'))
    with open(cert_path, 'wb') as handle:
        handle.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, 'wb') as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


class _Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # pylint: disable=invalid-name
        length = int(self.headers.get('Content-Length') or 0)
        self.server.bodies.append(self.rfile.read(min(length, 1 << 20)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):  # pylint: disable=arguments-differ
        pass


class TlsHook(object):
    """An HTTPS endpoint on 127.0.0.1 with the given certificate; records the bodies it receives."""

    def __init__(self, cert, key):
        self.server = http.server.HTTPServer(('127.0.0.1', 0), _Hook)
        self.server.bodies = []
        self.server.handle_error = lambda request, address: None       # a refused handshake is expected
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return 'https://127.0.0.1:%d/hook' % self.server.server_address[1]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def tls_hook(tmp_path, monkeypatch):
    monkeypatch.delenv('SSL_CERT_FILE', raising=False)
    monkeypatch.delenv('SSL_CERT_DIR', raising=False)
    hooks = []

    def start(san):
        cert, key = make_cert(tmp_path, 'cert%d' % len(hooks), san)
        hooks.append(TlsHook(cert, key))
        return hooks[-1], cert
    try:
        yield start
    finally:
        for hook in hooks:
            hook.close()


PAYLOAD = {'event': 'gpu_policy', 'user': 'alice', 'decisions': [{'pids': [7], 'cmdline': 'python train.py --token=<redacted>'}]}


def test_a_self_signed_certificate_is_refused_and_nothing_is_sent(tls_hook):
    hook, _cert = tls_hook('127.0.0.1')
    error = notify.post_webhook(hook.url, PAYLOAD, timeout=5.0)
    assert error is not None and 'certificate verify failed' in error.lower()
    assert hook.server.bodies == []                                           # the payload never left the client


def test_a_trusted_certificate_for_another_name_is_refused(tls_hook, monkeypatch):
    hook, cert = tls_hook('webhook.gpufleet.invalid')
    monkeypatch.setenv('SSL_CERT_FILE', cert)                                 # trusted, but not for 127.0.0.1
    error = notify.post_webhook(hook.url, PAYLOAD, timeout=5.0)
    assert error is not None and 'mismatch' in error.lower()
    assert hook.server.bodies == []


def test_the_same_server_is_used_once_its_certificate_is_trusted(tls_hook, monkeypatch):
    """The control: the refusals above come from the verification, not from a broken server."""
    hook, cert = tls_hook('127.0.0.1')
    monkeypatch.setenv('SSL_CERT_FILE', cert)                                 # the system CA store, as ssl reads it
    assert notify.post_webhook(hook.url, PAYLOAD, timeout=5.0) is None
    assert [json.loads(body) for body in hook.server.bodies] == [PAYLOAD]
