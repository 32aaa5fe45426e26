# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A module's documented options as ansible-doc shows them: its own merged over those of the collection's
doc fragments it extends (each option of a fragment updated with the keys the module gives it, as
ansible.utils.plugin_docs.add_fragments does)."""

from __future__ import annotations

import importlib

import yaml

PREFIX = 'gpufleet.reclaim.'


def fragment_options(slug):
    """The options of the collection's doc fragment ``slug`` (``gpufleet.reclaim._name`` or ``..._name.VAR``)."""
    name, _dot, var = slug[len(PREFIX):].partition('.')
    module = importlib.import_module('ansible_collections.gpufleet.reclaim.plugins.doc_fragments.%s' % name)
    return yaml.safe_load(getattr(module.ModuleDocFragment, var or 'DOCUMENTATION')).get('options') or {}


def documented_options(module):
    doc = yaml.safe_load(module.DOCUMENTATION)
    options = {}
    for slug in doc.get('extends_documentation_fragment') or ():
        if slug.startswith(PREFIX):
            options.update(fragment_options(slug))
    for name, option in doc['options'].items():
        merged = dict(options.get(name) or {})
        merged.update(option)
        options[name] = merged
    return options
