# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Version of the amdsmi Python API this fake mirrors (PyPI amdsmi 7.0.2)."""

__version__ = '7.0.2'
