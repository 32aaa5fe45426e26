# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/documents.py, the leaf that reads YAML, JSON and TOML documents: gpu_kill and the rogue rules
loader use it without importing the policy package, and PyYAML only once a YAML document is read."""

from __future__ import annotations

import os
import subprocess
import sys

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import documents, policy, rogue

PROBE = """
import sys
import ansible_collections.gpufleet.reclaim.plugins.modules.gpu_kill
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue
def loaded():
    return sorted(set(m.split('.')[6] if m.startswith('ansible_collections.') else m for m in sys.modules
                      if m == 'yaml' or '.core.policy' in m or '.core.reset' in m))
print(loaded())
rogue.load_config(text='miner_names: [xmrig-custom]\\n')
print(loaded())
"""


def test_gpu_kill_imports_neither_the_policy_nor_pyyaml_until_a_yaml_document_is_read():
    """Issue #21: the rules file reader is the leaf's; the policy engine, reset and PyYAML stay unloaded."""
    out = subprocess.run([sys.executable, '-c', PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ['[]', "['yaml']"]


def test_the_readers_names_stay_importable_from_the_policy_package():
    """The policy limit tests and docs/security.md (T22/T23) name policy.MAX_NESTING and policy.MAX_ALIAS_NODES."""
    assert policy.MAX_NESTING == documents.MAX_NESTING and policy.MAX_ALIAS_NODES == documents.MAX_ALIAS_NODES
    assert policy.PolicyError is documents.PolicyError and policy.DocumentLimitError is documents.DocumentLimitError
    for name in ('read_document', 'read_document_lines', 'document_format', 'document_syntax', 'yaml_loader', 'TOML_MISSING'):
        assert getattr(policy, name) is getattr(documents, name), name
    assert rogue.YAML_IMPORT_ERROR is None and documents.yaml_module() is not None   # PyYAML is installed here
