# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vendor hooks of backends/base.py: every registered backend provides the abstract ones, the
device-file naming of each vendor, and the vendor-neutral core's use of them (a vendor the core
never names, added by registering one backend class)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import backends, reset, snapshot
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.base import DRAIN_UNAVAILABLE, PASS, Backend
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import InvalidArgument
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.model import BackendStatus, Device

CORE = os.path.dirname(inspect.getfile(reset))
DEVICE_HOOKS = ('device_keys', 'shared_device_file')
RESET_HOOKS = ('reset_checks', 'reset_device')


def abstract(cls, name):
    return getattr(getattr(cls, name), '__isabstractmethod__', False)


def test_base_declares_the_hooks_abstract_with_a_docstring():
    for name in DEVICE_HOOKS + RESET_HOOKS:
        assert abstract(Backend, name), name
    for name in DEVICE_HOOKS + RESET_HOOKS + ('persistence_mode', 'persistence_off', 'persistence_restore', 'drain_on',
                                              'drain_off', 'session_blocks_reset'):
        assert (getattr(Backend, name).__doc__ or '').strip(), name


@pytest.mark.parametrize('vendor', backends.VENDORS)
def test_every_registered_backend_provides_the_abstract_hooks(vendor):
    cls = backends.REGISTRY[vendor]
    assert cls.label != Backend.label
    for name in DEVICE_HOOKS:
        assert not abstract(cls, name), '%s does not provide %s' % (vendor, name)
    if cls.reset_refusal is None:
        for name in RESET_HOOKS:
            assert not abstract(cls, name), '%s does not provide %s' % (vendor, name)


def test_device_file_naming_per_vendor():
    nvidia, amd, intel, apple = (backends.vendor_backend(v) for v in ('nvidia', 'amd', 'intel', 'apple'))
    assert nvidia.device_keys(3) == (('nvidia', 3),)
    assert amd.device_keys(1) == intel.device_keys(1) == (('renderD', 129), ('card', 1))
    assert apple.device_keys(0) == ()
    assert nvidia.shared_device_file('/dev/nvidiactl') and nvidia.shared_device_file('/dev/nvidia-uvm')
    assert not nvidia.shared_device_file('/dev/kfd')
    assert amd.shared_device_file('/dev/kfd') and intel.shared_device_file('/dev/dri/renderD128')
    assert not amd.shared_device_file('/dev/nvidiactl') and not apple.shared_device_file('/dev/kfd')
    assert [v for v in backends.VENDORS if backends.vendor_backend(v).xid_log] == ['nvidia']
    assert reset.TOOLS == ('nvidia-smi', 'amd-smi', 'xpu-smi', 'systemctl', 'scontrol')


LAZY = """
import sys
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import backends, snapshot
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.backends.base import Backend
def loaded():
    return sorted(m.rsplit('.', 1)[-1] for m in sys.modules if '.core.backends.' in m)
class Fake(Backend):
    name = 'intel'
    def probe(self):
        return None
print(loaded())
print(loaded(), sorted(backends.select('intel', factories={'intel': Fake}).statuses))
print(backends.vendor_backend('nvidia').__name__, backends.AmdBackend.__name__, loaded(), backends.REGISTRY.loaded())
"""


def test_a_backend_module_is_imported_only_when_its_vendor_is_asked_for():
    """Issue #21: a node imports (compiles) only the backends it uses; AnsiballZ still ships them all."""
    out = subprocess.run([sys.executable, '-c', LAZY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "['base']",
        "['base'] ['amd', 'apple', 'intel', 'nvidia']",
        "NvidiaBackend AmdBackend ['amd', 'base', 'nvidia', 'nvidia_mig', 'nvml_arrays'] ('nvidia', 'amd')",
    ]


def test_an_unknown_vendor_is_named():
    with pytest.raises(InvalidArgument) as exc:
        backends.vendor_backend('matrox')
    assert exc.value.field == 'vendor' and exc.value.value == 'matrox'


def test_no_vendor_branch_outside_the_backends():
    """The core decides nothing by a vendor's name: that is what the backend hooks are for."""
    branch = re.compile(r"vendor\s*(==|!=|in|not in)\s*[(\[]?\s*'(nvidia|amd|intel|apple)'")
    found = []
    for directory, dirs, files in os.walk(CORE):
        dirs[:] = sorted(d for d in dirs if d not in ('backends', '__pycache__'))
        for name in sorted(f for f in files if f.endswith('.py')):
            with open(os.path.join(directory, name)) as handle:
                found.extend('%s:%d' % (name, n) for n, line in enumerate(handle, 1) if branch.search(line))
    assert 'reset.py' in os.listdir(CORE)
    assert found == []


class Acme(Backend):
    """A vendor the core never heard of: one GPU behind /dev/acme0, reset by writing a log line."""

    name = 'acme'
    label = 'Acme'
    reset_check_names = ('firmware',)

    def probe(self):
        self.status = BackendStatus(name=self.name, available=True, version='1')
        return self.status

    def devices(self):
        return [Device(vendor='acme', vendor_index=0, name='Acme GPU', pci_bus_id='0000:42:00.0', memory_total_mib=1024,
                       memory_used_mib=0, memory_free_mib=1024, minor=0)]

    @classmethod
    def device_keys(cls, minor):
        return (('acme', minor),)

    @classmethod
    def shared_device_file(cls, path):
        return os.path.basename(path) == 'acmectl'

    @classmethod
    def reset_checks(cls, item, snapshot, host):
        item.check('tool', PASS, 'the acme log')
        item.check('firmware', PASS, 'current')

    @classmethod
    def reset_device(cls, item, host):
        item.method, item.command, item.output = 'acme', ['acme-reset', item.target], 'done'
        host.resets.append(item.target)
        return None


class Absent(Backend):
    """Stands in for the real backends: this host has none of their GPUs."""

    def __init__(self, name):
        self.name = name
        super(Absent, self).__init__()

    def probe(self):
        self.status = BackendStatus(name=self.name, available=False, error='absent')
        return self.status


def test_a_new_vendor_is_one_backend_class(monkeypatch):
    """Registering one class is all a vendor needs for a reset: preconditions, the reset, the undo steps
    (the base's answers for a vendor without persistence mode or drain)."""
    monkeypatch.setitem(backends.REGISTRY, 'acme', Acme)
    for module in (backends, snapshot):   # what the registry's literal gives a vendor written into it
        monkeypatch.setattr(module, 'VENDOR_CHOICES', backends.VENDOR_CHOICES + ('acme',))
    factories = dict((vendor, (lambda v=vendor: Absent(v))) for vendor in backends.VENDORS)
    factories['acme'] = Acme
    host = reset.Host(factories=factories, tools={}, runner=lambda argv: (127, '', 'not run'), euid=0, poll=0.01)
    host.resets = []
    result = reset.reset(reset.ResetOptions(all_gpus=True, drain=True, verify_timeout=0), host)
    assert result['reset_gpus'] == [0] and result['failed_gpus'] == [] and host.resets == ['0000:42:00.0']
    gpu = result['resets'][0]
    assert gpu['vendor'] == 'acme' and gpu['status'] == 'reset' and gpu['verified'] and gpu['method'] == 'acme'
    checks = dict((c['name'], (c['status'], c['detail'])) for c in gpu['preconditions'])
    assert checks['firmware'] == ('pass', 'current') and checks['mig'] == ('not_applicable', 'NVIDIA only')
    assert checks['vendor'] == ('pass', 'acme GPU') and checks['root'][0] == 'pass'
    assert gpu['drain'] == {'requested': True, 'enabled': False, 'restored': None, 'detail': DRAIN_UNAVAILABLE}
    assert gpu['persistence_mode'] == {'before': None, 'switched_off': False, 'restored': None}
    assert any(DRAIN_UNAVAILABLE in w for w in result['warnings'])


def test_the_default_memory_view_keeps_the_gpus_asked_for():
    """Backend.memory_view (the vendors without their own): every GPU, or those of ``vendor_indexes``."""
    class Two(Backend):
        name = 'two'

        def devices(self):
            return [Device(vendor='two', vendor_index=i, memory_used_mib=10 * i, processes_complete=True) for i in range(2)]

    assert Two().memory_view() == {0: (0, set()), 1: (10, set())}
    assert Two().memory_view({1}) == {1: (10, set())}
