# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fake sysfs and /proc trees for the DRM backends' tests (amdgpu, i915, xe), and the fixture readers."""

from __future__ import annotations

import os

UNIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FDINFO_FIXTURES = os.path.join(UNIT_DIR, 'fixtures', 'fdinfo')
IOREG_FIXTURES = os.path.join(UNIT_DIR, 'fixtures', 'ioreg')


def fixture(name):
    """The text of tests/unit/fixtures/fdinfo/NAME."""
    with open(os.path.join(FDINFO_FIXTURES, name)) as handle:
        return handle.read()


def write(path, text):
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent)
    with open(path, 'w') as handle:
        handle.write(text)


class FakeProc(object):
    """A /proc tree: per pid a ``stat``, ``fd/N`` links to device paths and ``fdinfo/N`` texts."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)

    def add(self, pid, ppid=1, fds=None):
        base = os.path.join(self.root, str(pid))
        os.makedirs(os.path.join(base, 'fd'), exist_ok=True)
        os.makedirs(os.path.join(base, 'fdinfo'), exist_ok=True)
        with open(os.path.join(base, 'stat'), 'w') as handle:
            handle.write('%d (proc %d) S %d %d %d 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n' % (pid, pid, ppid, pid, pid, 1000 + pid))
        for fd, (target, text) in (fds or {}).items():
            self.fd(pid, fd, target, text)
        return base

    def fd(self, pid, fd, target, text):
        """fd N of ``pid`` links to ``target`` and its fdinfo is ``text`` (replaced when it exists)."""
        base = os.path.join(self.root, str(pid))
        link = os.path.join(base, 'fd', str(fd))
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)
        write(os.path.join(base, 'fdinfo', str(fd)), text)


def make_card(sys_root, minor, bdf, vendor='0x8086', device='0x56a0', driver='i915', hwmon=None, attrs=None):
    """A DRM card in a fake sysfs: class/drm/card<minor>/device -> bus/pci/devices/<bdf> with vendor,
    device, class, a ``driver`` link, ``attrs`` {relative path: value} and ``hwmon`` {file: value}."""
    dev = os.path.join(sys_root, 'bus', 'pci', 'devices', bdf)
    values = {'vendor': vendor, 'device': device, 'class': '0x030000'}
    values.update(attrs or {})
    for name, value in (hwmon or {}).items():
        values[os.path.join('hwmon', 'hwmon%d' % minor, name)] = value
    for name, value in values.items():
        write(os.path.join(dev, name), '%s\n' % value)
    if driver:
        os.makedirs(os.path.join(sys_root, 'bus', 'pci', 'drivers', driver), exist_ok=True)
        os.symlink(os.path.join('..', '..', 'drivers', driver), os.path.join(dev, 'driver'))
    card = os.path.join(sys_root, 'class', 'drm', 'card%d' % minor)
    os.makedirs(card, exist_ok=True)
    os.symlink(os.path.join('..', '..', '..', 'bus', 'pci', 'devices', bdf), os.path.join(card, 'device'))
    os.makedirs(os.path.join(sys_root, 'class', 'drm', 'card%d-DP-1' % minor), exist_ok=True)  # a connector
    return dev


class FakeClock(object):
    """A monotonic clock for the two readings of a backend: ``clock()`` reads it, ``sleep(s)`` advances it."""

    def __init__(self, now=500.0):
        self.now = now

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def deny(monkeypatch, *paths):
    """``os.listdir``, ``os.scandir`` and ``open`` of these paths raise PermissionError (another user's /proc entries)."""
    denied = set(str(p) for p in paths)
    real_listdir = os.listdir
    real_scandir = os.scandir
    real_open = open

    def scandir(path='.'):
        if str(path) in denied:
            raise PermissionError(13, 'Permission denied', path)
        return real_scandir(path)

    def listdir(path):
        if str(path) in denied:
            raise PermissionError(13, 'Permission denied', path)
        return real_listdir(path)

    def fake_open(path, *args, **kwargs):
        if str(path) in denied:
            raise PermissionError(13, 'Permission denied', path)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, 'listdir', listdir)
    monkeypatch.setattr(os, 'scandir', scandir)
    monkeypatch.setattr('builtins.open', fake_open)
