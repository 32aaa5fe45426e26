# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Rogue (crypto-miner) detection: indicators with weights, a score, a level, and the evidence.

The package by layer, each file importing only the ones above it in this list:

* ``rules``: the data: built-in rule ids, kinds and weights, score thresholds, names, lists, patterns.
* ``facts``: ``ProcessFacts``, a plain description of one GPU process, and the bounds on what one
  process can make the detector read (``ProcessFacts.from_dict`` builds one from a fixture).
* ``procfs``: the readers of the host: /proc parsers, container images and ``FactsCollector``,
  which builds ProcessFacts for a live snapshot.
* ``checks``: the built-in rule functions (``BUILTIN_CHECKS``) over an evaluation context.
* ``config``: ``RogueConfig``, the effective rule set, with ``CustomRule`` and ``AllowEntry``.
* ``loader``: the rules-file schema and validator, ``load_config`` and ``RulesError`` (errors name
  the file, the line and the field).
* ``detector``: scoring (``classify``), ``Detector`` and the entry points ``detect_snapshot``,
  ``selector_detector``, ``detector_argument_spec``.
* ``audit``: ``log_findings``, the findings in the hash-chained audit log.

The names below are the package's face (and the names ``core/rogue.py`` offered before the split);
``core/rogue_rules.py`` still offers the data of ``rules``.  A test that replaces a name replaces
it where the caller looks it up: ``rogue.detect_snapshot`` for the callers that go through this
package (cli, guard, gpu_audit), ``rogue.detector.detect_snapshot`` for ``selector_detector``.
"""

from __future__ import annotations

from ..errors import InvalidArgument
from . import rules as R
from .checks import (
    BUILTIN_CHECKS, MAX_OPTION_ARGS, is_algorithm, match_wallet, ml_libraries, parse_options, rule_algo, rule_exe_location,
    rule_flat_mem, rule_flat_util, rule_lineage, rule_masquerade, rule_miner_env, rule_miner_flags, rule_miner_name,
    rule_no_allocation, rule_no_ml_libs, rule_pool_conn, rule_pool_host, rule_pool_port, rule_stratum, rule_wallet,
    wallet_candidate)
from .config import AllowEntry, CustomRule, RogueConfig
from .detector import (
    LEVELS, MAX_OUTPUT_ARG, MAX_OUTPUT_ARGS, Detector, at_least, classify, detect_snapshot, detector_argument_spec,
    detector_options, finding_dict, level_index, selector_detector, summarize)
from .facts import (
    ACTIVE_STATES, MAX_ARGS, MAX_EVIDENCE, MAX_EVIDENCE_TEXT, MAX_PARENTS, MAX_SCAN_CHARS, Connection, ProcessFacts,
    is_public)
from .procfs import (
    CONTAINER_CONFIGS, MAX_ENV_BYTES, MAX_MAPS_LINES, TCP_STATES, FactsCollector, container_image, parse_environ,
    parse_maps, parse_proc_net_tcp)


# The names of ``loader`` (the rules file: its schema, the document readers, PyYAML) and ``audit`` (the
# audit log's record of findings), which most calls never use: gpu_kill rogue=true without rules, the
# guard's ticks.  They are loaded on first use (__getattr__), so that importing the package does not
# compile those files on every module call; ``rogue.load_config`` and the rest keep working.
LAZY_NAMES = {
    'loader': ('ALLOW_KEYS', 'MAX_RULES_FILE', 'RULE_KEYS', 'SCHEMA_VERSION', 'TOP_KEYS', 'RulesError', 'load_config'),
    'audit': ('RECORD_SCHEMA', 'log_findings'),
}


def _lazy_module(part):
    """The submodule ``part`` of LAZY_NAMES, imported on first use.  The imports are written out so that
    AnsiballZ still ships both with every module that imports this package."""
    # pylint: disable=import-outside-toplevel
    if part == 'loader':
        from . import loader as module
    else:
        from . import audit as module
    return module


def __getattr__(name):
    """The names of LAZY_NAMES, and YAML_IMPORT_ERROR (why PyYAML cannot be imported), loaded on first use (PEP 562): importing the
    package imports neither the rules-file loader nor PyYAML."""
    if name == 'YAML_IMPORT_ERROR':
        from ..documents import yaml_import_error  # pylint: disable=import-outside-toplevel
        return yaml_import_error()
    for part, names in LAZY_NAMES.items():
        if name in names:
            value = getattr(_lazy_module(part), name)
            globals()[name] = value
            return value
    raise AttributeError('module %r has no attribute %r' % (__name__, name))


__all__ = [
    # data and errors
    'R', 'LEVELS', 'InvalidArgument',
    # facts and their bounds
    'ProcessFacts', 'Connection', 'is_public', 'ACTIVE_STATES', 'MAX_ARGS', 'MAX_EVIDENCE', 'MAX_EVIDENCE_TEXT',
    'MAX_PARENTS', 'MAX_SCAN_CHARS',
    # host readers
    'FactsCollector', 'container_image', 'parse_environ', 'parse_maps', 'parse_proc_net_tcp', 'CONTAINER_CONFIGS',
    'MAX_ENV_BYTES', 'MAX_MAPS_LINES', 'TCP_STATES',
    # the built-in rules
    'BUILTIN_CHECKS', 'MAX_OPTION_ARGS', 'is_algorithm', 'match_wallet', 'ml_libraries', 'parse_options',
    'wallet_candidate', 'rule_algo', 'rule_exe_location', 'rule_flat_mem', 'rule_flat_util', 'rule_lineage',
    'rule_masquerade', 'rule_miner_env', 'rule_miner_flags', 'rule_miner_name', 'rule_no_allocation',
    'rule_no_ml_libs', 'rule_pool_conn', 'rule_pool_host', 'rule_pool_port', 'rule_stratum', 'rule_wallet',
    # the rule set (the rules file's names: LAZY_NAMES['loader'])
    'RogueConfig', 'CustomRule', 'AllowEntry',
    # scoring, the detector and its entry points
    'Detector', 'classify', 'level_index', 'at_least', 'finding_dict', 'summarize', 'detect_snapshot',
    'selector_detector', 'detector_argument_spec', 'detector_options', 'MAX_OUTPUT_ARG', 'MAX_OUTPUT_ARGS',
]
# The names of LAZY_NAMES (the rules file: RulesError, load_config, ...; the audit log: log_findings,
# RECORD_SCHEMA) and YAML_IMPORT_ERROR are attributes loaded on first use (__getattr__), not listed here:
# ``import *`` would import the loader and PyYAML.
