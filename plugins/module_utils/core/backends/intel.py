# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Intel backend: not implemented yet.  It says so, and says whether Intel GPUs are present."""

from __future__ import annotations

import os

from .base import UnavailableBackend

INTEL_PCI_VENDOR = '0x8086'
# PCI class 0x03xxxx: display controllers (integrated and discrete GPUs).
DISPLAY_CLASS_PREFIX = '0x03'


def count_intel_gpus(sys_root='/sys'):
    """Intel display devices under /sys/bus/pci/devices (0 when sysfs is not readable)."""
    base = os.path.join(sys_root, 'bus', 'pci', 'devices')
    count = 0
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(base, entry, 'vendor')) as handle:
                vendor = handle.read().strip()
            with open(os.path.join(base, entry, 'class')) as handle:
                pci_class = handle.read().strip()
        except OSError:
            continue
        if vendor == INTEL_PCI_VENDOR and pci_class.startswith(DISPLAY_CLASS_PREFIX):
            count += 1
    return count


class IntelBackend(UnavailableBackend):
    """Intel GPUs (i915/xe): reading them is not implemented yet."""

    name = 'intel'
    reason = 'Intel GPU support is not implemented yet'

    def __init__(self, sys_root='/sys'):
        super(IntelBackend, self).__init__()
        self.sys_root = sys_root

    def reason_text(self):
        found = count_intel_gpus(self.sys_root)
        if found:
            return '%s (%d Intel display device(s) found on the PCI bus)' % (self.reason, found)
        return self.reason
