# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core/bytecode.py: the modules' bytecode cache, on real zip archives as AnsiballZ builds them."""

from __future__ import annotations

import marshal
import os
import sys
import zipfile
import zipimport

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import bytecode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason='the cache is root\'s alone: these tests run as root (as in CI)')

FILES = {
    'bcpkg/__init__.py': '',
    'bcpkg/core/__init__.py': 'VALUE = "core"\n',
    'bcpkg/core/leaf.py': 'from . import VALUE\nANSWER = 42\nWHO = VALUE\n',
    'bcpkg/core/sub/__init__.py': 'from ..leaf import ANSWER\nDOUBLE = ANSWER * 2\n',
}


@pytest.fixture
def archive(tmp_path):
    """A zip like AnsiballZ's, on sys.path; the modules it provides are forgotten afterwards."""
    def build(files=None, name='payload.zip'):
        path = tmp_path / name
        with zipfile.ZipFile(str(path), 'w') as handle:
            for member, text in (files or FILES).items():
                handle.writestr(member, text)
        sys.path.insert(0, str(path))
        return str(path)

    saved_meta = list(sys.meta_path)
    yield build
    sys.meta_path[:] = saved_meta
    sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]
    for name in [n for n in sys.modules if n == 'bcpkg' or n.startswith('bcpkg.')]:
        del sys.modules[name]
    sys.path_importer_cache.clear()


def forget():
    for name in [n for n in sys.modules if n == 'bcpkg' or n.startswith('bcpkg.')]:
        del sys.modules[name]


def run_imports(cache_dir):
    """Import the package as a module's first imports would: the core package installs the finder."""
    forget()
    import bcpkg.core  # pylint: disable=import-outside-toplevel
    finder = bytecode.install('bcpkg.core', sys.modules['bcpkg.core'].__spec__.loader, directory=cache_dir)
    import bcpkg.core.sub  # pylint: disable=import-outside-toplevel
    return finder, sys.modules['bcpkg.core.sub'], sys.modules['bcpkg.core.leaf']


def entries(cache_dir):
    return sorted(n for n in os.listdir(cache_dir) if n.endswith(bytecode.SUFFIX))


def test_first_call_compiles_and_stores_later_calls_load_the_same_code(archive, tmp_path):
    archive()
    cache_dir = str(tmp_path / 'cache')
    finder, sub, leaf = run_imports(cache_dir)
    assert isinstance(finder, bytecode.CachedFinder) and finder.prefix == 'bcpkg.'
    assert (sub.DOUBLE, leaf.WHO) == (84, 'core') and (finder.cache.misses, finder.cache.hits) == (2, 0)
    assert isinstance(sub.__loader__, bytecode.CachedLoader) and sub.__file__.endswith('bcpkg/core/sub/__init__.py')
    assert sub.__path__ and sub.__path__[0].endswith('payload.zip/bcpkg/core/sub') and sub.__spec__.submodule_search_locations
    assert len(entries(cache_dir)) == 2 and (os.stat(cache_dir).st_mode & 0o777) == 0o700
    assert all((os.stat(os.path.join(cache_dir, n)).st_mode & 0o777) == 0o600 for n in entries(cache_dir))
    sys.meta_path.remove(finder)
    finder, sub, leaf = run_imports(cache_dir)       # the next call: every file from the cache
    assert (sub.DOUBLE, leaf.WHO) == (84, 'core') and (finder.cache.misses, finder.cache.hits) == (0, 2)
    assert bytecode.install('bcpkg.core', sys.modules['bcpkg.core'].__spec__.loader, directory=cache_dir) is finder  # once


def test_a_changed_source_is_another_key_never_stale_code(archive, tmp_path):
    archive()
    cache_dir = str(tmp_path / 'cache')
    finder, _sub, _leaf = run_imports(cache_dir)
    sys.meta_path.remove(finder)
    sys.path_importer_cache.clear()
    archive(dict(FILES, **{'bcpkg/core/leaf.py': 'from . import VALUE\nANSWER = 7\nWHO = VALUE\n'}), name='newer.zip')
    finder, sub, _leaf = run_imports(cache_dir)
    assert sub.DOUBLE == 14 and (finder.cache.misses, finder.cache.hits) == (1, 1) and len(entries(cache_dir)) == 3


@pytest.mark.parametrize('spoil', ['group_writable', 'symlink', 'not_code', 'garbage', 'dir_world_writable', 'dir_symlink'])
def test_what_the_cache_cannot_vouch_for_is_compiled_from_the_source(archive, tmp_path, spoil):
    archive()
    cache_dir = str(tmp_path / 'cache')
    finder, _sub, _leaf = run_imports(cache_dir)
    sys.meta_path.remove(finder)
    name = entries(cache_dir)[0]
    path = os.path.join(cache_dir, name)
    if spoil == 'group_writable':
        os.chmod(path, 0o620)
    elif spoil == 'symlink':
        planted = tmp_path / 'planted'
        planted.write_bytes(marshal.dumps(compile('DOUBLE = -1\nANSWER = -1\nWHO = "planted"\n', 'x', 'exec')))
        os.unlink(path)
        os.symlink(str(planted), path)
    elif spoil == 'not_code':
        with open(path, 'wb') as handle:
            handle.write(marshal.dumps({'DOUBLE': -1}))
    elif spoil == 'garbage':
        with open(path, 'wb') as handle:
            handle.write(b'\x00not marshal data')
    elif spoil == 'dir_world_writable':
        os.chmod(cache_dir, 0o777)
    else:
        os.rename(cache_dir, cache_dir + '.real')
        os.symlink(cache_dir + '.real', cache_dir)
    finder, sub, leaf = run_imports(cache_dir)
    assert (sub.DOUBLE, leaf.WHO) == (84, 'core')            # the source's code, never what the file held
    if spoil in ('dir_world_writable', 'dir_symlink'):
        assert finder.cache.hits == 0 and finder.cache.errors
    else:
        assert (finder.cache.hits, finder.cache.misses) == (1, 1)
        if spoil in ('group_writable', 'symlink'):
            assert finder.cache.errors


def test_only_root_only_zips_and_not_when_turned_off(archive, tmp_path, monkeypatch):
    archive()
    forget()
    import bcpkg.core  # pylint: disable=import-outside-toplevel
    loader = sys.modules['bcpkg.core'].__spec__.loader
    assert isinstance(loader, zipimport.zipimporter)
    assert bytecode.wanted({}, 0) and not bytecode.wanted({}, 1000) and not bytecode.wanted({bytecode.ENV: '0'}, 0)
    monkeypatch.setenv(bytecode.ENV, '0')
    assert bytecode.install('bcpkg.core', loader, directory=str(tmp_path / 'c')) is None
    monkeypatch.delenv(bytecode.ENV)
    # the core imported from files (the guard agent, the tests): its own __pycache__, no finder
    from ansible_collections.gpufleet.reclaim.plugins.module_utils import core  # pylint: disable=import-outside-toplevel
    assert bytecode.install(core.__name__, core.__spec__.loader, directory=str(tmp_path / 'c')) is None
    assert not os.path.exists(str(tmp_path / 'c'))


def test_the_cache_keeps_its_newest_entries(archive, tmp_path, monkeypatch):
    cache = bytecode.Cache(str(tmp_path / 'cache'))
    monkeypatch.setattr(bytecode, 'MAX_ENTRIES', 3)
    for index in range(5):
        cache.code('m%d' % index, 'X = %d\n' % index, 'm%d.py' % index)
        path = os.path.join(cache.directory, cache.key('m%d' % index, 'X = %d\n' % index) + bytecode.SUFFIX)
        os.utime(path, (1000 + index, 1000 + index))
    kept = entries(cache.directory)
    assert len(kept) == 3 and cache.key('m4', 'X = 4\n') + bytecode.SUFFIX in kept
    assert cache.key('m0', 'X = 0\n') + bytecode.SUFFIX not in kept
    cache.close()
