# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fake amdsmi (tests/sim/python/amdsmi) against the real PyPI amdsmi package.

The real package cannot be imported without ROCm (its import raises KeyError), so its source is
parsed with ast.  Every public function, enum and exception of the fake must exist in the real
package, with the same parameter names, enum members and constant values.  Skipped when the real
package is not installed (`pip install amdsmi`, or point GPUSIM_REAL_AMDSMI at its directory).
"""

import ast
import importlib.util
import inspect
import os
import site
import sys
from enum import IntEnum

import pytest

from conftest import FAKE_AMDSMI_DIR

FAKE_PKG = os.path.realpath(os.path.join(FAKE_AMDSMI_DIR, 'amdsmi'))


def _real_package_dir():
    candidates = []
    if os.environ.get('GPUSIM_REAL_AMDSMI'):
        candidates.append(os.environ['GPUSIM_REAL_AMDSMI'])
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # virtualenvs of old Pythons
        pass
    candidates += [os.path.join(root or '.', 'amdsmi') for root in roots]
    try:
        spec = importlib.util.find_spec('amdsmi')  # locates the package without running it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += list(spec.submodule_search_locations)
    for candidate in candidates:
        if os.path.realpath(candidate) == FAKE_PKG:
            continue
        if all(os.path.isfile(os.path.join(candidate, f)) for f in ('amdsmi_interface.py', 'amdsmi_wrapper.py',
                                                                    'amdsmi_exception.py', '__init__.py')):
            return candidate
    return None


REAL_DIR = _real_package_dir()
pytestmark = pytest.mark.skipif(REAL_DIR is None, reason='the real amdsmi package is not installed '
                                '(pip install amdsmi, or set GPUSIM_REAL_AMDSMI to its directory)')


def _parse(name):
    with open(os.path.join(REAL_DIR, name)) as f:
        return ast.parse(f.read(), name)


def _constants(tree):
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _params(func):
    args = func.args
    positional = list(getattr(args, 'posonlyargs', [])) + list(args.args)
    with_default = set(a.arg for a in positional[len(positional) - len(args.defaults):]) if args.defaults else set()
    names = [a.arg for a in positional] + [a.arg for a in args.kwonlyargs]
    with_default |= set(a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
    return names, with_default


@pytest.fixture(scope='module')
def real():
    wrapper = _constants(_parse('amdsmi_wrapper.py'))
    interface = _parse('amdsmi_interface.py')
    functions = dict((n.name, n) for n in interface.body if isinstance(n, ast.FunctionDef))
    enums = {}
    for node in interface.body:
        if isinstance(node, ast.ClassDef):
            members = {}
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    value = item.value
                    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) \
                            and value.value.id == 'amdsmi_wrapper':
                        members[item.targets[0].id] = wrapper.get(value.attr, ('missing', value.attr))
            enums[node.name] = members
    exceptions = {}
    for node in _parse('amdsmi_exception.py').body:
        if isinstance(node, ast.ClassDef):
            init = [i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == '__init__']
            exceptions[node.name] = {'bases': [b.id for b in node.bases if isinstance(b, ast.Name)],
                                     'init': _params(init[0])[0] if init else None}
    exported = set()
    for node in ast.walk(_parse('__init__.py')):
        if isinstance(node, ast.ImportFrom):
            exported |= set(alias.asname or alias.name for alias in node.names)
    version = _constants(_parse('_version.py')).get('__version__')
    return {'wrapper': wrapper, 'functions': functions, 'enums': enums, 'exceptions': exceptions,
            'exported': exported, 'version': version}


@pytest.fixture(scope='module')
def fake():
    saved = dict((k, v) for k, v in sys.modules.items() if k == 'amdsmi' or k.startswith('amdsmi.'))
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, FAKE_AMDSMI_DIR)
    try:
        module = __import__('amdsmi')
        assert os.path.realpath(os.path.dirname(module.__file__)) == FAKE_PKG
        yield module
    finally:
        sys.path.remove(FAKE_AMDSMI_DIR)
        for name in [k for k in sys.modules if k == 'amdsmi' or k.startswith('amdsmi.')]:
            del sys.modules[name]
        sys.modules.update(saved)


def _public(module):
    return [(name, getattr(module, name)) for name in dir(module) if not name.startswith('_')]


def test_every_fake_function_exists_in_the_real_package_with_the_same_parameters(real, fake):
    checked = 0
    for name, obj in _public(fake) + _public(fake.amdsmi_interface):
        if not inspect.isfunction(obj):
            continue
        assert name in real['functions'], 'amdsmi.%s does not exist in the real package' % name
        if obj.__module__.startswith('amdsmi') and getattr(fake, name, None) is obj:
            assert name in real['exported'], 'the real amdsmi does not export %s' % name
        real_names, real_defaults = _params(real['functions'][name])
        sig = inspect.signature(obj)
        assert list(sig.parameters) == real_names, name
        fake_defaults = set(p for p, v in sig.parameters.items() if v.default is not inspect.Parameter.empty)
        assert fake_defaults == real_defaults, name
        checked += 1
    assert checked >= 25


def test_every_fake_enum_matches_the_real_one(real, fake):
    enums = [(n, o) for n, o in _public(fake) if inspect.isclass(o) and issubclass(o, IntEnum)]
    assert len(enums) >= 6
    for name, enum in enums:
        assert name in real['exported'] and name in real['enums'], name
        for member, value in enum.__members__.items():
            assert member in real['enums'][name], '%s.%s' % (name, member)
            assert real['enums'][name][member] == int(value), '%s.%s' % (name, member)


def test_every_fake_exception_matches_the_real_one(real, fake):
    classes = [(n, o) for n, o in _public(fake) if inspect.isclass(o) and issubclass(o, Exception)]
    assert len(classes) == 7
    for name, cls in classes:
        assert name in real['exported'] and name in real['exceptions'], name
        spec = real['exceptions'][name]
        assert [b.__name__ for b in cls.__bases__] == spec['bases'], name
        if spec['init'] is not None:
            assert ['self'] + list(inspect.signature(cls.__init__).parameters)[1:] == spec['init'], name


def test_wrapper_constants_match(real, fake):
    constants = [(n, v) for n, v in _public(fake.amdsmi_wrapper) if n.startswith('AMDSMI_')]
    assert len(constants) > 50
    for name, value in constants:
        assert name in real['wrapper'], name
        assert real['wrapper'][name] == value, name


def test_no_other_public_names(real, fake):
    extra = set()
    for name, obj in _public(fake):
        if inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj):
            continue
        extra.add(name)
    assert extra == {'GPUSIM_FAKE'}
    assert fake.__version__ == real['version']
