# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""core.rogue's names from ``loader`` and ``audit`` load on first use (issue #21): the package keeps its face."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import rogue
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.rogue import RulesError, audit, load_config, loader


def test_every_lazy_name_is_the_submodules_own():
    assert RulesError is loader.RulesError and load_config is loader.load_config
    for part, module in (('loader', loader), ('audit', audit)):
        for name in rogue.LAZY_NAMES[part]:
            assert getattr(rogue, name) is getattr(module, name), name
            assert name not in rogue.__all__   # import * must not load them


def test_yaml_import_error_and_unknown_names():
    assert rogue.YAML_IMPORT_ERROR is None   # PyYAML is installed where the tests run
    with pytest.raises(AttributeError, match='no_such_name'):
        rogue.no_such_name  # pylint: disable=pointless-statement
