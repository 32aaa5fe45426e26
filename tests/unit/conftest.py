"""The unit-test session's setup: its tmp_path directories under a root of its own.

pytest's default root (``$TMPDIR/pytest-of-USER``) is shared by every session of that user on the machine, and
one session's cleanup of "old" numbered directories can remove files another is still using: a GPU device file
that a test's child holds open then reads back as ``... (deleted)``, which is no GPU file.  A root made for this
session (mkdtemp: 0700, a name no other session picks) is touched by nobody else, and it is removed at the end.
"""
import os
import shutil
import tempfile

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # an explicit --basetemp is the caller's; an xdist worker gets its own directory under the controller's
    if config.option.basetemp or hasattr(config, 'workerinput'):
        return
    root = tempfile.mkdtemp(prefix='gpufleet-units-')
    config.option.basetemp = os.path.join(root, 'tmp')
    config.gpufleet_tmp_root = root


def pytest_unconfigure(config):
    root = getattr(config, 'gpufleet_tmp_root', None)
    if root:
        shutil.rmtree(root, ignore_errors=True)
