# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a hostile user plants for a Python that root starts (issue #28), and how a test sees it.

``HostileUser(base, marks)`` writes, under ``base`` (owned by alice when the test is root):

* ``cwd/``: the working directory she leaves the admin in, with modules named like what root's
  code imports (``psutil``, ``pynvml``, ``yaml``, ``ansible``, ``json``, ``__future__``,
  ``gpufleet_core``) as files (layout ``modules``) or as package directories (layout ``packages``),
  plus ``sitecustomize.py``, ``usercustomize.py`` and a ``.pth`` file;
* ``pythonpath/``: the same modules and ``sitecustomize.py``, for ``PYTHONPATH``;
* ``home/.local/lib/pythonX.Y/site-packages``: her user site-packages (``PYTHONUSERBASE`` and
  ``HOME`` point there) with ``usercustomize.py``, a ``.pth`` file that runs code and the modules;
* ``planted_warning.py`` in ``pythonpath/``, which ``PYTHONWARNINGS`` makes Python import at start.

Every planted piece, when imported or run, creates ``marks/<name>.<where>.<uid>``: a test that
finds no file there proves that nothing was imported, and a control run of a Python that is not
isolated (:func:`control_run`) proves each piece is a live attack.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys

# what root's code imports, planted under the same names
MODULES = ('psutil', 'pynvml', 'yaml', 'ansible', 'json', '__future__', 'gpufleet_core')
LAYOUTS = ('modules', 'packages')
WARNING_MODULE = 'planted_warning'


def marker_code(marks, name, where):
    """Python that records its own execution: marks/<name>.<where>.<uid>."""
    return ('import os as _os\nopen(_os.path.join(%r, %r + "." + str(_os.getuid())), "w").close()\n'
            % (marks, '%s.%s' % (name, where)))


def this_python():
    """The interpreter of this test run as a path root would record: a virtual environment's own
    ``bin/python`` (a link to the base interpreter, which alone would not find the venv's packages)."""
    if sys.prefix != getattr(sys, 'base_prefix', sys.prefix):
        candidate = os.path.join(sys.prefix, 'bin', 'python')
        if os.path.exists(candidate):
            return candidate
    return sys.executable


def base_python():
    """The interpreter behind this one: outside a virtual environment its user site-packages is live."""
    return os.path.realpath(sys.executable)


def user_site(python, userbase):
    """Where ``python`` looks for the user site-packages of ``userbase`` (asked with -s: without running what is there)."""
    env = dict((name, value) for name, value in os.environ.items() if name != 'PYTHONPATH')
    env['PYTHONUSERBASE'] = userbase
    out = subprocess.run([python, '-s', '-c', 'import site; print(site.getusersitepackages())'], env=env, cwd='/',
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60, check=True)
    return out.stdout.decode().strip()


class HostileUser(object):
    """alice's files (see the module docstring) under ``base``; ``marks`` is where planted code reports."""

    def __init__(self, base, marks, layout='modules', pythons=()):
        self.base, self.marks, self.layout = base, marks, layout
        self.cwd = os.path.join(base, 'cwd')
        self.pythonpath = os.path.join(base, 'pythonpath')
        self.home = os.path.join(base, 'home')
        self.userbase = os.path.join(self.home, '.local')
        os.makedirs(marks, exist_ok=True)
        os.chmod(marks, 0o777)
        self._plant(self.cwd, 'cwd', layout)
        self._write(os.path.join(self.cwd, 'sitecustomize.py'), marker_code(marks, 'sitecustomize', 'cwd'))
        self._write(os.path.join(self.cwd, 'usercustomize.py'), marker_code(marks, 'usercustomize', 'cwd'))
        self._write(os.path.join(self.cwd, 'planted.pth'), self._pth('cwd'))
        self._plant(self.pythonpath, 'pythonpath', 'modules')
        self._write(os.path.join(self.pythonpath, 'sitecustomize.py'), marker_code(marks, 'sitecustomize', 'pythonpath'))
        self._write(os.path.join(self.pythonpath, WARNING_MODULE + '.py'),
                    marker_code(marks, WARNING_MODULE, 'pythonpath') + 'class PlantedWarning(Warning):\n    pass\n')
        self._write(os.path.join(self.pythonpath, 'startup.py'), marker_code(marks, 'startup', 'pythonpath'))
        for python in tuple(pythons) or (sys.executable,):
            site_dir = user_site(python, self.userbase)
            if not os.path.isdir(site_dir):
                self._plant(site_dir, 'usersite', 'modules')
                self._write(os.path.join(site_dir, 'usercustomize.py'), marker_code(marks, 'usercustomize', 'usersite'))
                self._write(os.path.join(site_dir, 'planted.pth'), self._pth('usersite'))
        self._hand_over()

    def _pth(self, where):
        # a .pth line that starts with "import" is executed by site.py
        return 'import os; open(os.path.join(%r, "pth.%s." + str(os.getuid())), "w").close()\n' % (self.marks, where)

    @staticmethod
    def _write(path, text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, 'w') as handle:
            handle.write(text)

    def _plant(self, directory, where, layout):
        for name in MODULES:
            code = marker_code(self.marks, name, where)
            if layout == 'modules':
                self._write(os.path.join(directory, name + '.py'), code)
            elif name != '__future__':   # a package named __future__ is no module Python would look for
                self._write(os.path.join(directory, name, '__init__.py'), code)
        if layout == 'packages':
            self._write(os.path.join(directory, 'ansible', 'module_utils', '__init__.py'), '')
            self._write(os.path.join(directory, 'ansible', 'module_utils', 'basic.py'),
                        marker_code(self.marks, 'ansible.module_utils.basic', where))

    def _hand_over(self):
        """Everything under base becomes alice's (when root runs the test and alice exists)."""
        if os.geteuid() != 0:
            return
        try:
            entry = pwd.getpwnam('alice')
        except KeyError:
            return
        for dirpath, dirnames, filenames in os.walk(self.base):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                os.lchown(name, entry.pw_uid, entry.pw_gid)

    def env(self, base_env=None):
        """``base_env`` (default this process's) with every variable she could steer towards her files."""
        env = dict(os.environ if base_env is None else base_env)
        env.update(PYTHONPATH=self.pythonpath, PYTHONUSERBASE=self.userbase, HOME=self.home,
                   PYTHONWARNINGS='ignore::%s.PlantedWarning' % WARNING_MODULE, PYTHONSTARTUP=os.path.join(self.pythonpath, 'startup.py'))
        return env

    def seen(self):
        """The marks planted code left: [] when nothing she planted ran."""
        return sorted(os.listdir(self.marks))

    def clear(self):
        for name in os.listdir(self.marks):
            os.unlink(os.path.join(self.marks, name))


def control_run(user, python, code='import psutil, pynvml, yaml, json'):
    """``python -c code`` started as root starts a Python that is not isolated: from her directory,
    with her environment.  Returns the marks it left (and clears them)."""
    subprocess.run([python, '-c', code], cwd=user.cwd, env=user.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=60, check=False)
    found = user.seen()
    user.clear()
    return found


def copy_core(module_utils_dir, lib):
    """The core package as the guard role installs it: ``lib/gpufleet_core``, root's copy."""
    shutil.copytree(os.path.join(module_utils_dir, 'core'), os.path.join(lib, 'gpufleet_core'),
                    ignore=shutil.ignore_patterns('__pycache__'))
