# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A real Alertmanager (Debian's prometheus-alertmanager) running the shipped extras/alertmanager configuration
with its endpoints pointed at loopback: a real SMTP server (aiosmtpd, its own process, a Maildir), and one
HTTP receiver (a thread of the test) that records what Slack, Teams and the EDA webhook were sent.  For
tests/unit/extras/test_alertmanager.py and the loop of tests/integration/targets/eda_loop.

Plain Python (the integration target imports it by path): no import of the collection.
SAFETY: everything listens on 127.0.0.1 only; each server is stopped by the pid (or the thread) that
started it, in a finally (prometheus_chain._stop).
"""

from __future__ import annotations

import contextlib
import json
import mailbox
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

try:    # the unit tests import it as a package module, the integration target by path
    from . import prometheus_chain as pc
except ImportError:
    import prometheus_chain as pc  # type: ignore

ROOT = pc.ROOT
CONFIG = os.path.join(ROOT, 'extras', 'alertmanager', 'alertmanager.yml')
TEMPLATE = os.path.join(ROOT, 'extras', 'alertmanager', 'gpufleet.tmpl')
ALERTMANAGER = shutil.which('prometheus-alertmanager') or shutil.which('alertmanager')
AMTOOL = shutil.which('amtool')
MISSING = 'prometheus-alertmanager (with amtool) is not installed (a Debian package; .ci/run installs it)'
TOKEN = 'eda-test-token-4c1d'


def amtool_check(path):
    """(exit status, output) of ``amtool check-config path``."""
    proc = subprocess.run([AMTOOL, 'check-config', path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=60, check=False)
    return proc.returncode, proc.stdout


class Receiver(object):
    """An HTTP server on 127.0.0.1 recording each POST: {path: [(headers, JSON body)]}."""

    def __init__(self):
        self.posts = {}
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                length = min(int(self.headers.get('Content-Length') or 0), 1 << 20)
                body = self.rfile.read(length)
                with owner.lock:
                    owner.posts.setdefault(self.path, []).append((dict(self.headers), json.loads(body.decode('utf-8'))))
                self.send_response(200)
                self.send_header('Content-Length', '2')
                self.end_headers()
                self.wfile.write(b'ok')

            def log_message(self, *args):   # quiet
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path):
        return 'http://127.0.0.1:%d%s' % (self.port, path)

    def got(self, path):
        with self.lock:
            return list(self.posts.get(path, ()))


def loopback_config(workdir, smtp_port, receiver, eda_url=None, repeat='1h', token=TOKEN):
    """The shipped configuration with every endpoint on loopback and short timings; its path.  ``eda_url`` is
    the rulebook's webhook (default: the receiver's /eda), ``token`` its bearer token, ``repeat`` the repeat
    interval of the EDA route."""
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    secrets = os.path.join(workdir, 'secrets')
    os.makedirs(secrets, exist_ok=True)
    files = {'slack_webhook_url': receiver.url('/slack'), 'gpufleet_eda_token': token}
    for name, value in files.items():
        with open(os.path.join(secrets, name), 'w') as handle:
            handle.write(value)
        os.chmod(os.path.join(secrets, name), 0o600)
    glob = config['global']
    for key in ('smtp_auth_username', 'smtp_auth_password_file'):
        del glob[key]                       # aiosmtpd on loopback asks for no login
    glob.update(smtp_smarthost='127.0.0.1:%d' % smtp_port, smtp_require_tls=False,
                slack_api_url_file=os.path.join(secrets, 'slack_webhook_url'))
    config['templates'] = [TEMPLATE]
    config['route'].update(group_wait='0s', group_interval='1s')
    for route in config['route']['routes']:
        route.update(group_wait='0s', group_interval='1s')
    config['route']['routes'][0]['repeat_interval'] = repeat
    receivers = dict((r['name'], r) for r in config['receivers'])
    eda = receivers['gpufleet-eda']['webhook_configs'][0]
    eda['url'] = eda_url or receiver.url('/eda')
    eda['http_config']['authorization']['credentials_file'] = os.path.join(secrets, 'gpufleet_eda_token')
    receivers['oncall-critical']['webhook_configs'][0]['url'] = receiver.url('/teams')
    path = os.path.join(workdir, 'alertmanager.yml')
    with open(path, 'w') as handle:
        yaml.safe_dump(config, handle)
    return path


@contextlib.contextmanager
def serve(workdir, eda_url=None, repeat='1h', token=TOKEN):
    """aiosmtpd, the HTTP receiver and Alertmanager with ``loopback_config``.  Yields {'port': Alertmanager's port,
    'receiver': Receiver, 'maildir': path}; stops them all on the way out."""
    workdir = str(workdir)
    receiver = Receiver()
    smtp_port, port = pc._free_port(), pc._free_port()
    maildir = os.path.join(workdir, 'maildir')
    config = loopback_config(workdir, smtp_port, receiver, eda_url, repeat, token)
    procs = []
    receiver.thread.start()
    try:
        procs.append(pc._start([sys.executable, '-m', 'aiosmtpd', '-n', '-l', '127.0.0.1:%d' % smtp_port,
                                '-c', 'aiosmtpd.handlers.Mailbox', maildir], os.path.join(workdir, 'aiosmtpd.log')))
        procs.append(pc._start([ALERTMANAGER, '--config.file=%s' % config, '--storage.path=%s' % os.path.join(workdir, 'am-data'),
                                '--web.listen-address=127.0.0.1:%d' % port, '--cluster.listen-address=', '--log.level=warn'],
                               os.path.join(workdir, 'alertmanager.log')))
        pc.until('alertmanager ready', lambda: pc.get(port, '/-/ready') is not None)
        pc.until('aiosmtpd listening', lambda: _connects(smtp_port))
        yield {'port': port, 'receiver': receiver, 'maildir': maildir, 'config': config}
    finally:
        pc._stop(procs)
        receiver.server.shutdown()
        receiver.server.server_close()
    assert all(proc.poll() is not None for proc in procs)


def _connects(port):
    with socket.create_connection(('127.0.0.1', port), timeout=2):
        return True


def post_alerts(port, alerts):
    """POST alerts to Alertmanager's API, as Prometheus does."""
    request = urllib.request.Request('http://127.0.0.1:%d/api/v2/alerts' % port, data=json.dumps(alerts).encode('utf-8'),
                                     headers={'Content-Type': 'application/json'}, method='POST')
    with urllib.request.urlopen(request, timeout=5) as response:   # noqa: S310 (loopback, built here)
        return response.status


def mails(maildir):
    """The messages aiosmtpd stored (email.message.Message each)."""
    if not os.path.isdir(os.path.join(maildir, 'new')):
        return []
    return list(mailbox.Maildir(maildir, create=False))
