#!/usr/bin/env python
"""Install an offline stand-in for ansible-test's get-pip bootstrap script.

ansible-test builds its sanity virtual environments by running a cached copy of get-pip.py that it
downloads from a host this machine cannot reach.  The stand-in written here does the same job with
what Python ships: ``ensurepip`` seeds pip, then pip installs the pinned packages from the package
index that pip is configured to use.
"""
from __future__ import annotations

import os
import sys

SHIM = '''"""Offline get-pip stand-in written by gpufleet.reclaim's .ci/offline_get_pip.py."""
import subprocess
import sys

args = [a for a in sys.argv[1:] if a not in ('--no-setuptools', '--no-wheel')]
subprocess.check_call([sys.executable, '-m', 'ensurepip', '--default-pip'])
subprocess.check_call([sys.executable, '-m', 'pip', 'install'] + args)
'''


def main() -> int:
    cache = os.path.expanduser('~/.ansible/test/cache')
    os.makedirs(cache, exist_ok=True)
    for version in ('24.2', '24.0', '23.1.2', '25.0'):
        path = os.path.join(cache, 'get_pip_%s.py' % version.replace('.', '_'))
        with open(path, 'w', encoding='utf-8') as handle:
            handle.write(SHIM)
    print('offline get-pip stand-in written to %s' % cache)
    return 0


if __name__ == '__main__':
    sys.exit(main())
