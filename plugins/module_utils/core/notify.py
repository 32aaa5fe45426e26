# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""How the guard's warnings reach people: the user's terminals, a webhook (JSON, Slack or Teams: chat.py), a command hook.

Nothing here may hold up enforcement: terminal writes are non-blocking and bounded, the webhook
has a timeout, the command hook has a timeout, and every failure is returned as text for the
log instead of being raised.  Payloads never contain a process environment, and command lines are
redacted (``redact``) before they leave the node.
"""

from __future__ import annotations

import datetime
import errno
import importlib
import json
import os
import re
import stat
import struct

from .errors import InvalidArgument
from .text import printable
from .textmatch import bounded_subs, bounded_subs_each
from .units import human_duration

UTMP_PATHS = ('/run/utmp', '/var/run/utmp')
USER_PROCESS = 7
# struct utmp on Linux (glibc, 64-bit and 32-bit alike): 384 bytes.
_UTMP = struct.Struct('<hh i 32s 4s 32s 256s hh i ii 16s 20s')
MAX_TTYS = 32
MAX_MESSAGE = 4096
MAX_CMDLINE = 512
MAX_PAYLOAD = 256 * 1024
REDACTED = '<redacted>'
# What a command line becomes when a redact pattern ran past the match time bound.
REDACTED_SLOW = '<redacted: a redact_patterns entry took too long on this command line>'


# ---------------------------------------------------------------------------- redaction
# What the names of secret-bearing options, variables and keys end with.
_SECRET_WORDS = r'password|passwd|passphrase|pass|pwd|token|secret|api[-_]?key|access[-_]?key|secret[-_]?key|private[-_]?key|auth|credentials?'
DEFAULT_REDACT_PATTERNS = (
    # --password X, --password=X, -token X, --db-password X, --aws-secret-access-key X (not --max-tokens, --author)
    r'(?i)((?<![\w-])--?(?:[a-z0-9_-]*[-_])?(?:%s)[= ])\S+' % _SECRET_WORDS,
    # PASSWORD=x, AWS_SECRET_ACCESS_KEY=x, HF_TOKEN=x, ?token=x&...
    r'(?i)((?:%s)=)[^\s&]+' % _SECRET_WORDS,
    # {"password": "x"} (JSON) and {'api_key': 'x'} (a Python dict)
    r'(?i)("[\w-]*(?:%s)"\s*:\s*")(?:[^"\\]|\\.)*(")' % _SECRET_WORDS,
    r"(?i)('[\w-]*(?:%s)'\s*:\s*')[^']*(')" % _SECRET_WORDS,
    # Authorization: Bearer x / Basic x / x, X-Api-Key: x, PRIVATE-TOKEN: x, bearer x
    r'(?i)(authorization:\s*(?:\w+\s+)?)\S+',
    r'(?i)((?<![\w-])(?:x-)?(?:api[-_]?key|auth[-_]?token|access[-_]?token|private[-_]?token):\s*)\S+',
    r'(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+',
    # credentials in a URL: postgres://user:pw@host, redis://:pw@host (bounded: no quadratic scan of '://://...')
    r'(://[^/\s:@]{0,256}:)[^@\s]{1,1024}(@)',
    # mysql -pPASS, mysqldump -uroot -pPASS (the password glued to -p; -p alone prompts)
    r'^((?:\S*/)?(?:mysql|mariadb)[\w-]*\s(?:.*?\s)?-p)\S+',
    # tokens recognised by their prefix: AWS key ids, GitHub, GitLab, Slack, OpenAI/Anthropic-style sk-, Stripe, Hugging Face
    r'\b((?:AKIA|ASIA))[0-9A-Z]{16}\b',
    r'\b(gh[pousr]_|github_pat_|glpat-|xox[abeprs]-|sk-(?:proj-|ant-|svcacct-)?|[sr]k_live_)[A-Za-z0-9_-]{16,}',
    r'\b(hf_)[A-Za-z0-9]{30,}',
)


def urlsplit(url):
    """urllib.parse.urlsplit, imported on first use (the webhook): ``list`` does not load urllib.parse."""
    return importlib.import_module('urllib.parse').urlsplit(url)


def default_patterns():
    """DEFAULT_REDACT_PATTERNS compiled (a new list: callers append their own patterns)."""
    return [re.compile(p) for p in DEFAULT_REDACT_PATTERNS]


def redact_text(text, patterns):
    """``text`` with every match of ``patterns`` replaced.  A pattern's groups are kept (so that
    ``--password=`` stays readable) and the rest of the match becomes ``<redacted>``.

    The patterns run under the selectors' bounds (textmatch.bounded_subs: the first MAX_MATCH_TEXT
    characters, MATCH_TIMEOUT_S per pattern).  A pattern that runs out of time fails closed: the
    whole text becomes REDACTED_SLOW, never the unredacted text."""
    if not text:
        return text
    try:
        return bounded_subs(patterns, _keep_groups, text, 'notify.redact_patterns')
    except InvalidArgument:
        return REDACTED_SLOW


def _keep_groups(match):
    groups = [g for g in match.groups() if g]
    if not groups:
        return REDACTED
    if len(groups) == 1:
        return groups[0] + REDACTED
    return groups[0] + REDACTED + ''.join(groups[1:])


def redact(argv, patterns, limit=MAX_CMDLINE):
    """A command line (list) as one redacted, bounded string (None stays None)."""
    return redact_many([argv], patterns, limit)[0]


def redact_many(argvs, patterns, limit=MAX_CMDLINE):
    """``[redact(argv, patterns, limit) for argv in argvs]``, the time bound's alarm handler set once for all
    of them (textmatch.bounded_subs_each): a listing of 1,000 processes pays it once, not 1,000 times."""
    texts = [None if argv is None else ' '.join(str(a) for a in argv) for argv in argvs]
    try:
        done = bounded_subs_each(patterns, _keep_groups, [t for t in texts if t], 'notify.redact_patterns')
    except InvalidArgument:   # the alarm fired between two texts: fail closed for all of them
        done = [None] * sum(1 for t in texts if t)
    found = iter(done)
    result = []
    for text in texts:
        if text:
            text = next(found)
            text = REDACTED_SLOW if text is None else text
            if len(text) > limit:
                text = text[:limit] + '...'
        result.append(text)
    return result


def redact_argv(argv, patterns):
    """A command line (list) redacted for a record that keeps the list form (None stays None).

    The patterns run on the command line joined with spaces, as ``redact`` does; when nothing
    matches, ``argv`` comes back as it was.  Otherwise each argument is redacted on its own, and
    when a pattern still matches the joined result (a secret in the argument after its option,
    ``--password X``, or ``mysql -u me -pX``), the command line becomes one redacted string: a
    list of one.  Never the unredacted text; bounded like ``redact_text`` (32 KiB per text)."""
    if argv is None:
        return None
    args = [str(a) for a in argv]
    joined = ' '.join(args)
    whole = redact_text(joined, patterns)
    if whole == joined:
        return args
    each = [redact_text(a, patterns) for a in args]
    rejoined = ' '.join(each)
    if redact_text(rejoined, patterns) == rejoined:
        return each
    return [whole]


# ---------------------------------------------------------------------------- terminals
def utmp_ttys(user, paths=UTMP_PATHS):
    """The ttys (``pts/3``, ``tty1``) where ``user`` is logged in according to utmp."""
    found = []
    for path in paths:
        try:
            with open(path, 'rb') as handle:
                data = handle.read(_UTMP.size * 4096)
        except OSError:
            continue
        for offset in range(0, len(data) - _UTMP.size + 1, _UTMP.size):
            fields = _UTMP.unpack_from(data, offset)
            if fields[0] != USER_PROCESS:
                continue
            name = fields[5].split(b'\0', 1)[0].decode('utf-8', 'replace')
            line = fields[3].split(b'\0', 1)[0].decode('utf-8', 'replace')
            if name == user and line and '/' not in line.replace('pts/', '', 1) and '..' not in line:
                if line not in found:
                    found.append(line)
        break
    return found


def pts_ttys(uid, dev_root='/dev'):
    """The pseudo-terminals under ``<dev_root>/pts`` owned by ``uid``."""
    found = []
    base = os.path.join(dev_root, 'pts')
    try:
        names = os.listdir(base)
    except OSError:
        return found
    for name in sorted(names, key=lambda n: (len(n), n)):
        if not name.isdigit():
            continue
        try:
            info = os.stat(os.path.join(base, name))
        except OSError:
            continue
        if info.st_uid == uid and stat.S_ISCHR(info.st_mode):
            found.append('pts/%s' % name)
    return found


def user_ttys(user, uid, dev_root='/dev', utmp_paths=UTMP_PATHS):
    """Terminals of ``user``: utmp entries whose device ``uid`` owns, plus /dev/pts owned by ``uid``."""
    ttys = []
    for line in utmp_ttys(user, utmp_paths) + (pts_ttys(uid, dev_root) if uid is not None else []):
        if line in ttys:
            continue
        path = os.path.join(dev_root, line)
        try:
            info = os.stat(path)
        except OSError:
            continue
        if uid is not None and info.st_uid != uid:
            continue  # a stale utmp entry: the terminal now belongs to someone else
        if not stat.S_ISCHR(info.st_mode):
            continue
        ttys.append(line)
    return ttys[:MAX_TTYS]


def write_ttys(user, uid, text, dev_root='/dev', utmp_paths=UTMP_PATHS):
    """Write ``text`` to every terminal of ``user`` without blocking.  Returns (written, errors)."""
    data = ('\r\n' + text.replace('\n', '\r\n') + '\r\n').encode('utf-8', 'replace')[:MAX_MESSAGE]
    written, errors = 0, []
    for line in user_ttys(user, uid, dev_root, utmp_paths):
        path = os.path.join(dev_root, line)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | getattr(os, 'O_CLOEXEC', 0))
        except OSError as exc:
            errors.append('%s: %s' % (line, exc.strerror or exc))
            continue
        try:
            os.write(fd, data)
            written += 1
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                errors.append('%s: %s' % (line, exc.strerror or exc))
            else:
                errors.append('%s: terminal busy (output blocked); message dropped' % line)
        finally:
            os.close(fd)
    return written, errors


# ---------------------------------------------------------------------------- webhook and command
def post_webhook(url, payload, timeout=5.0):
    """POST ``payload`` as JSON.  Returns None on a 2xx answer, else the error text (never raises).

    http.client directly (the agent has no Ansible, hence no open_url); no proxy, no redirects.
    """
    # ssl and http.client cost a tick about 30 ms to import: loaded only when a webhook is sent
    import http.client  # pylint: disable=import-outside-toplevel
    import ssl  # pylint: disable=import-outside-toplevel
    body = json.dumps(payload, sort_keys=True, default=str).encode('utf-8')
    if len(body) > MAX_PAYLOAD:
        return 'payload larger than %d bytes; not sent' % MAX_PAYLOAD
    try:
        parts = urlsplit(url)
        if parts.scheme not in ('http', 'https') or not parts.hostname:
            return 'webhook URL is not http(s)'
        path = parts.path or '/'
        if parts.query:
            path += '?' + parts.query
        headers = {'Content-Type': 'application/json', 'User-Agent': 'gpufleet-guard', 'Content-Length': str(len(body))}
        if parts.username is not None:
            import base64  # pylint: disable=import-outside-toplevel
            token = base64.b64encode(('%s:%s' % (parts.username, parts.password or '')).encode('utf-8')).decode('ascii')
            headers['Authorization'] = 'Basic ' + token
        if parts.scheme == 'https':
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        try:
            conn.request('POST', path, body=body, headers=headers)
            response = conn.getresponse()
            code = response.status
            response.read(65536)
        finally:
            conn.close()
        if not 200 <= code < 300:
            return 'webhook answered HTTP %s' % code
        return None
    except Exception as exc:  # pylint: disable=broad-except
        return 'webhook failed: %s' % _strip_url(str(exc) or exc.__class__.__name__, url)


def _strip_url(text, url):
    return text.replace(url, '<webhook url>') if url else text


def run_hook(argv, payload, timeout=10.0):
    """Run the command hook (an argument list, never a shell) with the JSON payload on stdin.
    Returns None on exit 0, else the error text (never raises)."""
    import subprocess  # pylint: disable=import-outside-toplevel
    env = {'PATH': '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin', 'LANG': 'C.UTF-8'}
    try:
        proc = subprocess.run(list(argv), input=json.dumps(payload, sort_keys=True, default=str).encode('utf-8'),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, env=env,
                              check=False, close_fds=True)
    except subprocess.TimeoutExpired:
        return 'command hook %s did not finish within %.0f s' % (argv[0], timeout)
    except OSError as exc:
        return 'command hook %s: %s' % (argv[0], exc.strerror or exc)
    if proc.returncode != 0:
        err = proc.stderr.decode('utf-8', 'replace').strip().splitlines()
        return 'command hook %s exited %d%s' % (argv[0], proc.returncode, (': ' + err[-1][:200]) if err else '')
    return None


# ---------------------------------------------------------------------------- messages
def describe_procs(procs, patterns):
    out = []
    for proc in procs:
        out.append({'pid': proc.get('pid'), 'name': proc.get('name'), 'user': proc.get('user'),
                    'used_mib': proc.get('used_mib'), 'gpu_indexes': list(proc.get('gpu_indexes') or []),
                    'cmdline': redact(proc.get('cmdline'), patterns)})
    return out


def user_text(host, user, items, mode, prefix=''):
    """The terminal message for ``user``: one line per decision.  Every line is escaped
    (text.printable): messages name processes and users, whose text their owners chose, and the
    message goes to terminals; the policy's ``message`` keeps its own line breaks."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S UTC')
    lines = ['*** gpufleet-guard on %s, %s: a message for %s ***' % (host, stamp, user)]
    if prefix:
        lines.extend(prefix.split('\n'))
    for item in items:
        pids = ', '.join(str(p) for p in item['pids']) or '-'
        if item['decision'] == 'act':
            verb = 'terminated' if mode == 'enforce' else 'would be terminated'
            lines.append('- %s. Process(es) %s %s.' % (item['message'], pids, verb))
        else:
            when = item.get('act_in')
            tail = ''
            if item.get('acts') and when is not None:
                tail = ' Process(es) %s will be terminated in about %s unless this is fixed.' % (pids, human_duration(when))
            lines.append('- Warning %s: %s.%s' % (item.get('step') or 1, item['message'], tail))
    return '\n'.join(printable(line) for line in lines)[:MAX_MESSAGE]


class Notifier(object):
    """Sends one message per user per tick through the configured channels."""

    def __init__(self, notify, host, dev_root='/dev', utmp_paths=UTMP_PATHS, webhook_url=None, webhook_timeout=None):
        self.notify = notify
        self.host = host
        self.dev_root = dev_root
        self.utmp_paths = utmp_paths
        self.webhook_url = webhook_url or notify.webhook_url
        self.webhook_timeout = webhook_timeout or notify.webhook_timeout

    def payload(self, user, items, mode):
        return {'event': 'gpufleet_guard', 'host': self.host, 'user': user, 'mode': mode,
                'ts': datetime.datetime.now(datetime.timezone.utc).isoformat(),
                'decisions': [dict((k, v) for k, v in item.items() if k != 'procs_raw') for item in items]}

    def send(self, user, uid, items, mode):
        """Deliver ``items`` (decision dicts with redacted procs) for ``user``.  Returns a result dict."""
        result = {'tty': 0, 'errors': []}
        text = user_text(self.host, user or 'unknown user', items, mode, self.notify.message)
        if self.notify.tty and user is not None:
            written, errors = write_ttys(user, uid, text, self.dev_root, self.utmp_paths)
            result['tty'] = written
            result['errors'].extend(errors)
        payload = self.payload(user, items, mode)
        if self.webhook_url:
            # the chat formats are the guard's only (the modules import this file and never send): loaded here
            from .chat import chat_payload  # pylint: disable=import-outside-toplevel
            body = chat_payload(self.notify.webhook_format, self.host, user, mode, text, payload)
            error = post_webhook(self.webhook_url, body, self.webhook_timeout)
            result['webhook'] = 'ok' if error is None else 'failed'
            if error:
                result['errors'].append(error)
        if self.notify.command:
            error = run_hook(self.notify.command, payload)
            result['command'] = 'ok' if error is None else 'failed'
            if error:
                result['errors'].append(error)
        return result


def webhook_url_problem(url, allow_http=False, opt_in='allow_http'):
    """None when ``url`` may be used as a webhook, else why not (for an error naming the field).

    Only ``https://`` URLs, unless the host is a loopback one (127.0.0.0/8, ::1, localhost: the
    payload never leaves the node) or ``allow_http`` (the setting named ``opt_in``) is true.
    """
    if not isinstance(url, str) or not re.match(r'^https?://[^\s]+$', url):
        return 'expected an https:// URL'
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # pylint: disable=pointless-statement  # raises ValueError for a port that is not a number
    except ValueError as exc:
        return 'not a usable https:// URL: %s' % exc
    if not host:
        return 'expected an https:// URL with a host name'
    if parts.scheme == 'https' or allow_http or is_loopback_host(host):
        return None
    return ('plain http:// would send the payload (user names, pids, command lines) and any password in the URL '
            'unencrypted; use https://, a loopback host (127.0.0.0/8, ::1, localhost), or set %s: true' % opt_in)


def is_loopback_host(host):
    """Whether a URL's host name is a loopback address or ``localhost`` (no name is resolved)."""
    if host.lower().rstrip('.') == 'localhost':
        return True
    import ipaddress  # pylint: disable=import-outside-toplevel
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redact_url(url):
    """A URL safe to log: scheme and host only."""
    match = re.match(r'^(https?://)(?:[^@/]*@)?([^/?#]*)', url or '')
    return (match.group(1) + match.group(2) + '/...') if match else None
