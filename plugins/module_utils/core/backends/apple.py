# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Apple Silicon backend: not implemented yet (and never available off macOS)."""

from __future__ import annotations

import sys

from .base import UnavailableBackend


class AppleBackend(UnavailableBackend):
    """Apple GPUs (IOAccelerator): reading them is not implemented yet."""

    name = 'apple'
    reason = 'Apple GPU support is not implemented yet'

    def reason_text(self):
        if sys.platform != 'darwin':
            return 'Apple GPUs exist only on macOS hosts (this host is %s)' % sys.platform
        return self.reason
