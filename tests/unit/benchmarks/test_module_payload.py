# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Smoke test: ``benchmarks/module_payload.py`` builds gpu_facts' AnsiballZ payload and measures it.

No figure is asserted beyond what the payload must hold (machines are noisy): the module and the
core it imports are in the zip, what it imports at load is shipped, and the CPU figures exist.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, 'benchmarks', 'module_payload.py')


def test_payload_of_gpu_facts(tmp_path):
    if not (os.access(os.path.join(os.path.dirname(sys.executable), 'ansible'), os.X_OK) or shutil.which('ansible')):
        pytest.skip('ansible-core is not installed')
    out = tmp_path / 'payload.json'
    proc = subprocess.run([sys.executable, SCRIPT, '--modules', 'gpu_facts', '--reps', '1', '--json', str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600, check=False)
    text = proc.stdout.decode('utf-8', 'replace')
    assert proc.returncode == 0, text[-4000:]
    fig = json.loads(out.read_text())['figures']['this']['gpu_facts']
    assert fig['zip_bytes'] > 0 and fig['wrapper_bytes'] > fig['zip_bytes']      # base64 of the zip, and the wrapper
    assert 0 < fig['our_imported'] <= fig['our_files'] < fig['py_files']
    assert 'core.snapshot' not in fig['shipped_not_imported']
    assert fig['import_cpu_ms'] > 0 and fig['basic_cpu_ms'] > 0
    assert '| gpu_facts | this |' in text
