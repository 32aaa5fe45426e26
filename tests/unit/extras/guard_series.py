# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Real guard ticks in the situations the alerting rules and the dashboard are about, and their textfiles as series.

Each scenario runs ``guard.run_tick`` (test_guard.py's Node: a fake clock and a fake snapshot, policy dry-run,
so nothing is ever signalled) once a minute and keeps the textfile every tick wrote, as node_exporter's
textfile collector would serve it at that minute.
"""

from __future__ import annotations

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import policy as P
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import watchdog, xid
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.guard_test_helpers import GIB, MONDAY_NOON, proc, snapshot
from ansible_collections.gpufleet.reclaim.tests.unit.plugins.module_utils.core.test_guard import Node

STEP = 60                  # one tick a minute: the promtool test's `interval`
TICK_TIMESTAMP = 'gpufleet_guard_last_tick_timestamp_seconds'
CALM = 'mode: dry-run\nusers: {alice: {max_mem_gib_per_gpu: 64}}\nnotify: {tty: false}\n'
BUS = ('00000000:3B:00.0', '00000000:5E:00.0', '00000000:86:00.0', '00000000:AF:00.0')


def run(node, ticks, change=None, start=None):
    """``ticks`` ticks a minute apart (the first at ``start``, default the fake clock's); ``change(node, i)``
    before tick i. The textfile after each tick."""
    if start is not None:
        node.clock.now = float(start)
    texts = []
    for index in range(ticks):
        if change is not None:
            change(node, index)
        summary = node.tick(STEP if index else 0)
        assert 'skipped' not in summary, summary
        with open(node.paths.metrics) as handle:
            texts.append(handle.read())
    return texts


def healthy(root, ticks=10):
    return run(Node(root, policy=CALM), ticks)


def policy_invalid(root):
    return run(Node(root, policy=CALM), 6, lambda node, i: i == 2 and node.write_policy('mode: enforce\nusers: {alice: {max_gpus: many}}\n'))


def untrusted_input(root):
    def change(node, index):
        if index == 2:
            import os  # pylint: disable=import-outside-toplevel
            os.chmod(node.paths.policy, 0o666)   # writable by anyone: the guard refuses to act
    return run(Node(root, policy=CALM), 6, change)


def enforcement(root, start=None):
    """alice over her per-GPU limit on four GPUs: four violations, warned, then acted on after act_after (10m)."""
    snap = snapshot([proc(10 + gpu, 'alice', {gpu: 12 * GIB}) for gpu in range(4)] + [proc(20, 'bob', {0: 30 * GIB})])
    return run(Node(root, snap=snap), 12, start=start)


def orphaned(root):
    snap = snapshot([proc(1, 'alice', {0: 2 * GIB})])
    snap.devices[0].memory_used_mib += 4096      # memory no listed process accounts for
    snap.devices[0].compute_orphaned()
    return run(Node(root, policy=CALM, snap=snap), 20)


def idle(root):
    policy = 'mode: dry-run\nusers: {alice: {idle: {util_max_pct: 1, mem_min_gib: 1, for: 10m}}}\nnotify: {tty: false}\n'
    return run(Node(root, policy=policy, snap=snapshot([proc(1, 'alice', {1: 8 * GIB}, util=0)])), 45)


def rogue(root):
    finding = {'level': 'critical', 'score': 95, 'rules': [{'id': 'H-stratum', 'kind': 'hard'}]}
    snap = snapshot([proc(7, 'eve', {2: GIB}, name='xmrig')])
    node = Node(root, policy='mode: dry-run\nrogue: {act_min_level: critical}\nnotify: {tty: false}\n', snap=snap,
                context=P.Context(groups={}, rogue_findings={7: finding}))
    return run(node, 4)


def _with_xids(snap):
    """GPU 0: an application Xid (13); GPU 1: fell off the bus (Xid 79, lost, reboot wanted); GPU 2: a DBE (48, degraded)."""
    for gpu, code, pid in ((0, 13, 1), (1, 79, None), (2, 48, None)):
        dev = snap.devices[gpu]
        dev.pci_bus_id = BUS[gpu]
        dev.add_xid_event(xid.make_event(code, 'kmsg', time_s=MONDAY_NOON - 30, pid=pid, pci_bus_id=BUS[gpu]))
        xid.apply_health(dev, now=MONDAY_NOON)
    return snap


def xid_events(root):
    return run(Node(root, policy=CALM, snap=_with_xids(snapshot([proc(1, 'alice', {0: GIB})]))), 8)


def health_and_rogue(root, start=None):
    """The Xid GPUs of ``xid_events``, a crypto-miner found at level critical and an idle user (a fleet's second node)."""
    finding = {'level': 'critical', 'score': 95, 'rules': [{'id': 'H-stratum', 'kind': 'hard'}]}
    snap = _with_xids(snapshot([proc(1, 'alice', {0: GIB}), proc(7, 'eve', {3: GIB}, name='xmrig'), proc(8, 'carol', {2: 20 * GIB})]))
    policy = 'mode: dry-run\nrogue: {act_min_level: critical}\nnotify: {tty: false}\n'
    return run(Node(root, policy=policy, snap=snap, context=P.Context(groups={}, rogue_findings={7: finding})), 3, start=start)


def budget_exhausted(root):
    """The remediation ladder on (dry-run: it predicts): GPU 2 logged an Xid 48 and was reset twice in the last hour
    already (the ladder's disruption history), so its budget (2 per 24 h) holds the reset every tick."""
    import json  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    snap = snapshot([proc(1, 'alice', {0: GIB})])
    dev = snap.devices[2]
    dev.pci_bus_id = BUS[2]
    dev.add_xid_event(xid.make_event(48, 'kmsg', time_s=MONDAY_NOON - 30, pci_bus_id=BUS[2]))
    policy = ('mode: dry-run\nnotify: {tty: false}\nremediation: {enabled: true, drain_command: [/bin/true], reboot_flag: %s}\n'
              % os.path.join(str(root), 'lib', 'reboot-wanted'))
    node = Node(root, policy=policy, snap=snap)
    os.makedirs(os.path.dirname(node.paths.state), exist_ok=True)
    with open(os.path.join(os.path.dirname(node.paths.state), 'remediation.json'), 'w') as handle:
        # the ladder's clock is the real one (the tick passes it none): its history is written in real time
        json.dump({'disruptions': [{'action': 'reset', 'gpu': dev.key, 'time': time.time() - ago, 'by': 'remediate'}
                                   for ago in (1800, 600)]}, handle)
    return run(node, 4)


def driver_hung(root):
    node = Node(root, policy=CALM)
    texts = run(node, 2)

    def hung(**_kwargs):
        raise watchdog.DriverHung('nvmlDeviceGetUUID', 10, vendor='nvidia', gpu=1)
    for _index in range(4):
        node.tick(STEP, snapshot=None, take_snapshot=hung)
        with open(node.paths.metrics) as handle:
            texts.append(handle.read())
    return texts


def driver_crashed(root):
    node = Node(root, policy=CALM)
    texts = run(node, 2)

    def crashed(**_kwargs):
        raise watchdog.DriverCrashed('nvmlInit', 'SIGSEGV')
    for _index in range(2):
        node.tick(STEP, snapshot=None, take_snapshot=crashed)
        with open(node.paths.metrics) as handle:
            texts.append(handle.read())
    return texts


def samples(text):
    """{(name, ((label, value), ...)): value} of one textfile, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _number(value):
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def encode(values):
    """promtool's expanding notation: runs of one value as ``VxN`` (N+1 samples), gaps as ``_xN``."""
    parts = []
    index = 0
    while index < len(values):
        end = index
        while end + 1 < len(values) and values[end + 1] == values[index]:
            end += 1
        text = '_' if values[index] is None else _number(values[index])
        parts.append(text if end == index else '%sx%d' % (text, end - index))
        index = end + 1
    return ' '.join(parts)


def input_series(texts, labels, origin=MONDAY_NOON, repeat_last=0, gone_after=0):
    """promtool ``input_series`` from the textfiles of consecutive ticks (one a minute), with the scrape's
    ``labels`` (instance, job) added. The tick timestamp is moved from the fake clock (``origin``) to promtool's
    (0 at the first tick). ``repeat_last``: the last file served that many more minutes (the guard stopped);
    ``gone_after``: then no file at all for that many minutes."""
    parsed = [samples(text) for text in texts]
    parsed += [parsed[-1]] * repeat_last + [{}] * gone_after
    keys = []
    for entry in parsed:
        keys.extend(key for key in entry if key not in keys)
    out = []
    for name, pairs in keys:
        values = []
        for entry in parsed:
            value = entry.get((name, pairs))
            if value is not None and name == TICK_TIMESTAMP:
                value -= origin
            values.append(value)
        selector = ','.join('%s=%s' % (k, _quote(v)) for k, v in sorted(dict(pairs, **labels).items()))
        out.append({'series': '%s{%s}' % (name, selector), 'values': encode(values)})
    return out


def _quote(value):
    return '"%s"' % str(value).replace('\\', '\\\\').replace('"', '\\"').replace('\n', '\\n')
