# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""An ansible-rulebook event source: Prometheus Alertmanager's webhook, one event per alert, each mapped to
the inventory host it is about, with a storm limit (docs/event-driven.md).

ansible-rulebook loads this file by path (``gpufleet.reclaim.alertmanager`` in a rulebook) and awaits
``main(queue, args)``.  Everything but the HTTP server is plain functions and classes, tested without the
rules engine (tests/unit/extensions/test_alertmanager_source.py).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import logging
import os
import re
import time

DOCUMENTATION = r"""
---
short_description: Receive Prometheus Alertmanager webhooks, one event per alert on its inventory host.
description:
  - Listens for Alertmanager's webhook (C(webhook_configs), payload version 4) and puts one event on the
    queue for every alert of a payload whose C(alertname) is in O(alertnames), firing or resolved.
  - The event is C({alert, node, receiver, group_key}). The rulebook passes C(node) to the playbook as
    C(target_hosts), so the playbook's node plays run on that host only while its summary play on
    localhost still runs (a C(meta.hosts) limit would skip it).
  - The node is the alert's C(node) label, else its C(instance) label without the port
    (C(gpu-node-01:9100) -> C(gpu-node-01), C([fd00::1]:9100) -> C(fd00::1)). A name that is not a plain
    host name (a host pattern such as C(all), C(*), C(a:b), C(!x), C(~re)) is refused and logged. With
    O(inventory), only host names of that inventory (never group names) are accepted.
  - Storm limit. Firing alerts reach at most O(storm_max_nodes) distinct nodes within O(storm_window)
    seconds. The alerts of further nodes are not put on the queue; the first of them in a window puts one
    C({gpufleet_storm: {...}}) event (the nodes admitted and suppressed, the limits) on the queue for the
    rulebook to report, and every suppressed node is logged.
options:
  host:
    description: The address to listen on.
    type: str
    default: 127.0.0.1
  port:
    description: The TCP port to listen on.
    type: int
    required: true
  token:
    description:
      - A bearer token every request must carry (C(Authorization: Bearer TOKEN), Alertmanager's
        C(http_config.authorization.credentials_file)). Empty or unset accepts any request.
    type: str
  alertnames:
    description: The alert names that make events; other alerts are counted and dropped.
    type: list
    elements: str
    default: [GpuXidFault, GpuRebootWanted, GpuOrphanedMemory, GpuRogueProcess, GpuIdleMemoryHeld]
  storm_max_nodes:
    description: How many distinct nodes firing alerts may reach within O(storm_window); 0 suppresses all.
    type: int
    default: 5
  storm_window:
    description: The storm limit's window, in seconds.
    type: int
    default: 600
  inventory:
    description:
      - An Ansible inventory (a path, read with ansible-core's inventory manager): only its host names
        are accepted as nodes. Re-read when the file changes.
    type: str
  max_alerts:
    description: The most alerts read from one payload (Alertmanager's C(max_alerts)); the rest are dropped.
    type: int
    default: 200
"""

EXAMPLES = r"""
- gpufleet.reclaim.alertmanager:
    host: 127.0.0.1
    port: 5001
    token: "{{ gpufleet_eda_token }}"
    storm_max_nodes: 5
    storm_window: 600
"""

logger = logging.getLogger(__name__)

ALERTNAMES = ('GpuXidFault', 'GpuRebootWanted', 'GpuOrphanedMemory', 'GpuRogueProcess', 'GpuIdleMemoryHeld')
MAX_BODY = 1024 * 1024          # bytes of one webhook body
MAX_REPORTED = 50               # node names listed in one storm event
# An inventory host name as Ansible reads it from an ini or YAML inventory, and nothing that is a host pattern.
HOST_RE = re.compile(r'^[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$')
IPV6_RE = re.compile(r'^[0-9A-Fa-f:.]{2,45}$')
NOT_HOSTS = ('all', 'ungrouped')
KEPT = ('status', 'labels', 'annotations', 'fingerprint', 'startsAt', 'endsAt', 'generatorURL')


def _load_text():
    """core/text.py of this collection (the one escaping of text for people), loaded by its path: this file
    is run by ansible-rulebook by path, outside Ansible's collection loader."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    path = os.path.join(root, 'plugins', 'module_utils', 'core', 'text.py')
    spec = importlib.util.spec_from_file_location('gpufleet_reclaim_core_text', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


printable = _load_text().printable


class Refused(ValueError):
    """An alert that maps to no acceptable node (the reason is the message)."""


def strip_port(instance):
    """``host:port`` -> ``host``; ``[v6]:port`` -> ``v6``; a bare IPv6 address or a name stays."""
    if instance.startswith('['):
        end = instance.find(']')
        return instance[1:end] if end > 0 else instance
    if instance.count(':') == 1:
        return instance.split(':', 1)[0]
    return instance


def node_of(labels, known=None):
    """The inventory host an alert is about: its ``node`` label, else its ``instance`` label without the port.
    Raises Refused (naming the label, the value and why) for anything that is not one plain host name, or,
    with ``known`` (a set of inventory host names), for a name not in it."""
    if not isinstance(labels, dict):
        raise Refused('the alert has no labels')
    label = 'node' if labels.get('node') else 'instance'
    value = labels.get(label)
    if not isinstance(value, str) or not value:
        raise Refused('the alert has neither a node nor an instance label')
    name = value if label == 'node' else strip_port(value)
    if not (HOST_RE.match(name) or (':' in name and IPV6_RE.match(name))) or name in NOT_HOSTS:
        raise Refused('%s label %r: not a plain host name (host patterns are refused)' % (label, name[:80]))
    if known is not None and name not in known:
        raise Refused('%s label %r: not a host of the inventory' % (label, name[:80]))
    return name


class StormLimit(object):
    """At most ``max_nodes`` distinct nodes admitted within ``window`` seconds (a node admitted stays
    admitted until its admission is ``window`` old); the nodes refused meanwhile, for the report."""

    def __init__(self, max_nodes, window):
        self.max_nodes = max_nodes
        self.window = window
        self.admitted = {}          # node -> when it was admitted
        self.suppressed = {}        # node -> when it was last refused (this storm)
        self.reported_at = None     # when the last storm event went out

    def _expire(self, now):
        for table in (self.admitted, self.suppressed):
            for node in [n for n, when in table.items() if now - when >= self.window]:
                del table[node]

    def admit(self, node, now):
        self._expire(now)
        if node in self.admitted:
            return True
        if len(self.admitted) < self.max_nodes:
            self.admitted[node] = now
            return True
        self.suppressed[node] = now
        return False

    def report_due(self, now):
        """Whether a storm event goes out now: the first refusal since the last report's window ended."""
        if not self.suppressed or (self.reported_at is not None and now - self.reported_at < self.window):
            return False
        self.reported_at = now
        return True

    def report(self):
        return {'max_nodes': self.max_nodes, 'window_s': self.window, 'admitted': sorted(self.admitted)[:MAX_REPORTED],
                'suppressed': sorted(self.suppressed)[:MAX_REPORTED], 'suppressed_count': len(self.suppressed)}


class Inventory(object):
    """The host names of an inventory (never its groups), re-read when its file changes."""

    def __init__(self, path):
        self.path = path
        self.stamp = None
        self.hosts = frozenset()

    def names(self):
        info = os.stat(self.path)
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        if stamp != self.stamp:
            # ansible-core is where ansible-rulebook runs playbooks; imported only for this option
            from ansible.inventory.manager import InventoryManager  # pylint: disable=import-outside-toplevel
            from ansible.parsing.dataloader import DataLoader  # pylint: disable=import-outside-toplevel
            manager = InventoryManager(loader=DataLoader(), sources=[self.path])
            self.hosts = frozenset(h.name for h in manager.get_hosts())
            self.stamp = stamp
        return self.hosts


class Router(object):
    """Alertmanager payloads -> events (one per alert of interest), the storm limit applied."""

    def __init__(self, alertnames=ALERTNAMES, storm=None, inventory=None, max_alerts=200, clock=time.monotonic):
        self.alertnames = frozenset(alertnames)
        self.storm = storm or StormLimit(5, 600)
        self.inventory = inventory
        self.max_alerts = max_alerts
        self.clock = clock
        self.counts = {'payloads': 0, 'events': 0, 'refused': 0, 'suppressed': 0, 'ignored': 0, 'dropped': 0}

    def route(self, payload):
        """The events for one webhook body (a dict). Raises Refused for a body that is not Alertmanager's."""
        if not isinstance(payload, dict) or not isinstance(payload.get('alerts'), list):
            raise Refused('not an Alertmanager webhook payload (no alerts list)')
        self.counts['payloads'] += 1
        alerts = payload['alerts']
        if len(alerts) > self.max_alerts:
            self.counts['dropped'] += len(alerts) - self.max_alerts
            logger.warning('gpufleet alertmanager: %d alerts in one payload, only the first %d read',
                           len(alerts), self.max_alerts)
        known = self.inventory.names() if self.inventory is not None else None
        now = self.clock()
        events = []
        for alert in alerts[:self.max_alerts]:
            event = self._event(payload, alert, known, now)
            if event is not None:
                events.append(event)
        if self.storm.report_due(now):
            report = self.storm.report()
            logger.warning('gpufleet alertmanager: alert storm: more than %d nodes within %d s; not acting on %s',
                           report['max_nodes'], report['window_s'], ', '.join(report['suppressed']))
            events.append({'gpufleet_storm': report})
        self.counts['events'] += len(events)
        return events

    def _event(self, payload, alert, known, now):
        labels = alert.get('labels') if isinstance(alert, dict) else None
        name = labels.get('alertname') if isinstance(labels, dict) else None
        if name not in self.alertnames:
            self.counts['ignored'] += 1
            return None
        try:
            node = node_of(labels, known)
        except Refused as exc:
            self.counts['refused'] += 1
            logger.warning('gpufleet alertmanager: %s refused: %s', printable(name), printable(str(exc)))
            return None
        status = alert.get('status')
        if status == 'firing' and not self.storm.admit(node, now):
            self.counts['suppressed'] += 1
            logger.warning('gpufleet alertmanager: %s on %s not acted on: storm limit (%d nodes within %d s)',
                           name, node, self.storm.max_nodes, self.storm.window)
            return None
        kept = dict((key, alert[key]) for key in KEPT if key in alert)
        return {'alert': kept, 'node': node, 'receiver': payload.get('receiver'), 'group_key': payload.get('groupKey')}


def router_from_args(args):
    """A Router from the source's arguments (rulebook text: numbers may come as strings)."""
    inventory = Inventory(args['inventory']) if args.get('inventory') else None
    storm = StormLimit(int(args.get('storm_max_nodes', 5)), int(args.get('storm_window', 600)))
    names = args.get('alertnames') or ALERTNAMES
    return Router(names, storm, inventory, int(args.get('max_alerts', 200)))


def authorized(header, token):
    """Whether an Authorization header carries the bearer ``token`` (compared in constant time)."""
    if not token:
        return True
    scheme, _space, given = (header or '').partition(' ')
    return scheme == 'Bearer' and hmac.compare_digest(given.strip().encode('utf-8'), token.encode('utf-8'))


def make_app(queue, router, token=None):
    """The aiohttp application: POST any path with Alertmanager's JSON body."""
    from aiohttp import web  # pylint: disable=import-outside-toplevel  # ansible-rulebook's own dependency

    async def receive(request):
        if not authorized(request.headers.get('Authorization'), token):
            raise web.HTTPUnauthorized(text='a bearer token is required')
        try:
            payload = await request.json()
            events = router.route(payload)
        except ValueError as exc:       # JSON that does not parse, or Refused
            raise web.HTTPBadRequest(text=printable(str(exc))[:200]) from None
        for event in events:
            await queue.put(event)
        return web.json_response({'events': len(events)})

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post('/{path:.*}', receive)
    return app


async def main(queue, args):
    """ansible-rulebook's entry point: serve until cancelled."""
    from aiohttp import web  # pylint: disable=import-outside-toplevel
    if 'port' not in args:
        raise ValueError('gpufleet.reclaim.alertmanager: the port argument is required')
    router = router_from_args(args)
    runner = web.AppRunner(make_app(queue, router, args.get('token')))
    await runner.setup()
    site = web.TCPSite(runner, args.get('host') or '127.0.0.1', int(args['port']))
    await site.start()
    logger.info('gpufleet alertmanager: listening on %s:%s', args.get('host') or '127.0.0.1', args['port'])
    try:
        await asyncio.Future()
    finally:
        await runner.cleanup()
