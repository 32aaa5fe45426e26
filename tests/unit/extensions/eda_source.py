# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The collection's EDA source plugin loaded as ansible-rulebook loads it (by path), and Alertmanager-shaped
webhook bodies for the tests."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
SOURCE = os.path.join(ROOT, 'extensions', 'eda', 'plugins', 'event_source', 'alertmanager.py')
RULEBOOKS = os.path.join(ROOT, 'extensions', 'eda', 'rulebooks')


def load_source():
    spec = importlib.util.spec_from_file_location('gpufleet_eda_alertmanager', SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alert(name, instance=None, status='firing', fingerprint=None, **labels):
    labels = dict(labels, alertname=name)
    if instance is not None:
        labels['instance'] = instance
    return {'status': status, 'labels': labels, 'annotations': {'summary': '%s on %s' % (name, instance)},
            'startsAt': '2024-05-01T10:00:00Z', 'endsAt': '0001-01-01T00:00:00Z', 'generatorURL': 'http://prom/graph',
            'fingerprint': fingerprint or ('%016x' % (abs(hash((name, instance, tuple(sorted(labels.items()))))) % (1 << 64)))}


def payload(*alerts, receiver='gpufleet-eda'):
    """Alertmanager's webhook body (version 4)."""
    return {'version': '4', 'groupKey': '{}:{alertname="GpuXidFault"}', 'truncatedAlerts': 0, 'status': 'firing',
            'receiver': receiver, 'groupLabels': {}, 'commonLabels': {}, 'commonAnnotations': {},
            'externalURL': 'http://127.0.0.1:9093', 'alerts': list(alerts)}
