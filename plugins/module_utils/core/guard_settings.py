# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The guard agent's paths and settings (not policy): where it reads and writes, and the settings
file (``/etc/gpufleet/guard.yaml``) validated like a policy (errors name the setting, its line and
its value).  Importable from guard as before.
"""

from __future__ import annotations

import os

from . import constants, notify as notify_mod, policy as policy_mod, safe_files, watchdog
from .validation import Errors, boolean, in_range, join, unknown_key

# The files of the agent, by Paths attribute (constants.py holds each default once).
DEFAULT_PATHS = {
    'policy': constants.POLICY_PATH,
    'settings': constants.SETTINGS_PATH,
    'state': constants.STATE_PATH,
    'lock': constants.LOCK_PATH,
    'log': constants.GUARD_LOG_PATH,
    'audit_log': constants.AUDIT_LOG_PATH,
    'metrics': constants.METRICS_PATH,
    'history': constants.HISTORY_PATH,
    'allocations': constants.ALLOCATIONS_PATH,
}
SETTINGS_KEYS = ('audit_log_path', 'driver_timeout', 'history_path', 'history_retention_days', 'lock_path', 'log_path',
                 'metrics_path', 'policy_path', 'release_timeout', 'state_path', 'vendor', 'webhook_allow_http',
                 'webhook_timeout', 'webhook_url')   # sorted: the order the validator lists them in


class Paths(object):
    """Where the agent reads and writes.  ``root`` prefixes every default (tests); explicit paths win.
    An empty ``metrics`` or ``history`` path turns that output off."""

    def __init__(self, root=None, **overrides):
        for name, default in DEFAULT_PATHS.items():
            value = overrides.get(name)
            if value is None:
                value = os.path.join(root, default.lstrip('/')) if root else default
            setattr(self, name, value or None)
        self.root = root

    def to_dict(self):
        return dict((name, getattr(self, name)) for name in DEFAULT_PATHS)


class Settings(object):
    """Agent settings (not policy): from the settings file and the command line."""

    def __init__(self, vendor='auto', webhook_url=None, webhook_timeout=None, release_timeout=5.0,
                 history_retention_days=None, dev_root='/dev', utmp_paths=notify_mod.UTMP_PATHS, mode=None):
        self.vendor = vendor
        self.webhook_url = webhook_url
        self.webhook_timeout = webhook_timeout
        self.release_timeout = release_timeout
        self.history_retention_days = history_retention_days
        self.dev_root = dev_root
        self.utmp_paths = utmp_paths
        self.mode = mode              # overrides the policy's mode (tick --dry-run)
        # the snapshot's driver reads run in a watchdog child with this deadline (seconds)
        self.driver_timeout = watchdog.DEFAULT_TICK_TIMEOUT
        self.refused = None           # why the settings file was not read (a link, or someone else could change it)


def load_settings(path, paths):
    """Read the settings file (YAML or JSON mapping, mode 0600: it may hold the webhook URL).

    Missing file: defaults.  Path keys update ``paths``.  Raises InvalidArgument on a bad file (a
    PolicyError naming the file, and each bad setting with its line where known and its value).  A
    file that is a link, or that someone else than root (or the agent's user) could change or swap
    (safe_files): not read, the defaults, ``refused`` says why (a tick then refuses to act).
    """
    settings = Settings()
    if not path:
        return settings
    try:
        # no link followed; the file and every directory above it checked on their descriptors
        text = safe_files.read_file(path, 1024 * 1024).decode('utf-8')
    except FileNotFoundError:
        return settings
    except safe_files.UnsafeFile as exc:
        # not read: the defaults apply, and a tick refuses to act (untrusted_inputs checks this file too)
        settings.refused = 'the settings were not read: %s' % exc
        return settings
    except (OSError, UnicodeDecodeError) as exc:
        raise policy_mod.PolicyError([('', None, 'cannot read the settings: %s' % (getattr(exc, 'strerror', None) or exc))],
                                     path, what='settings')
    # the format by the extension (guard.yaml: YAML), the same limits as the policy's
    data, lines = policy_mod.read_document_lines(text, path, what='settings')
    if data is None:
        return settings
    if not isinstance(data, dict):
        raise policy_mod.PolicyError([('', data, 'the settings are a mapping')], path, what='settings')
    errors = Errors()
    allow_http = False
    for key, value in data.items():
        if key not in SETTINGS_KEYS:
            errors.add(join('', key), value, unknown_key(key, SETTINGS_KEYS, 'setting'))
        elif key == 'policy_path' and value in (None, ''):
            errors.add(key, value, 'expected the absolute path of the policy file (the policy cannot be turned off)')
        elif key.endswith('_path'):
            if value not in (None, '') and (not isinstance(value, str) or not value.startswith('/')):
                errors.add(key, value, 'expected an absolute path (or an empty value to turn it off)')
            else:
                setattr(paths, key[:-5], value or None)
        elif key == 'vendor':
            if value not in constants.VENDOR_CHOICES:
                errors.add(key, value, 'expected %s or %s' % (', '.join(constants.VENDOR_CHOICES[:-1]), constants.VENDOR_CHOICES[-1]))
            settings.vendor = value
        elif key == 'webhook_url':
            settings.webhook_url = value if value not in (None, '') else None
        elif key == 'webhook_allow_http':
            allow_http = False if value is None else errors.run(boolean, value, key)
        elif value is not None and errors.run(in_range, value, key, 0, 3650, False, 'expected a positive number', True) is not None:
            setattr(settings, key, float(value) if key != 'history_retention_days' else int(value))
    url = settings.webhook_url
    why = None if url is None or allow_http is None else notify_mod.webhook_url_problem(url, allow_http, 'webhook_allow_http')
    if why:
        errors.add('webhook_url', (notify_mod.redact_url(url) or '<redacted>') if isinstance(url, str) else url, why)
    if errors.items:
        raise policy_mod.PolicyError(errors.items, path, lines, what='settings')
    return settings
