# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""backends.preload: the backends a snapshot's watchdog child and its parent both use, imported once before
the fork (issue #21): the requested vendor's, or with auto those whose device files exist."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import backends


@pytest.mark.parametrize('files, vendor, expected', [
    ((), 'auto', []),
    (('nvidiactl',), 'auto', ['nvidia']),
    (('kfd',), 'auto', ['amd']),
    (('nvidiactl', 'kfd'), 'auto', ['nvidia', 'amd']),
    (('nvidiactl',), 'intel', ['intel']),   # asked for by name: its devices are read, whatever the files say
    ((), 'apple', ['apple']),
    (('nvidiactl',), 'none-such', []),      # the read rejects it, naming the field
])
def test_preload(tmp_path, files, vendor, expected):
    for name in files:
        (tmp_path / name).write_text('')
    assert backends.preload(vendor, [str(tmp_path)]) == expected
    assert set(expected) <= set(backends.REGISTRY.loaded())
