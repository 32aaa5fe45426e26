# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the gpu_* modules share: the argument spec of their common options and the one way they run.

The option functions return argument-spec pieces; each is documented by one doc fragment
(``plugins/doc_fragments``), and its defaults come from ``core/constants.py``.  :func:`run_module` is
the modules' one path from a core exception to ``module.fail_json``, :func:`finish` their one way to end.
"""

from __future__ import annotations

import traceback

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import watchdog
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.constants import ACTIONS_LOG_PATH, DEFAULT_PROTECT_NAMES, VENDOR_CHOICES
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core.errors import GpuFleetError, InvalidArgument, MissingLibrary
from ansible_collections.gpufleet.reclaim.plugins.module_utils.core import processes
from ansible_collections.gpufleet.reclaim.plugins.module_utils.node_python import missing_modules, respawn_if_needed


def gpu_options():
    """vendor and gpus (doc fragment gpufleet.reclaim._selection) and driver_timeout (gpufleet.reclaim._attributes.DRIVER_TIMEOUT):
    every gpu_* module."""
    return dict(
        vendor=dict(type='str', default='auto', choices=list(VENDOR_CHOICES)),
        gpus=dict(type='list', elements='str'),
        driver_timeout=watchdog.option(),
    )


def protection_options():
    """protect_names and protect_users (gpufleet.reclaim._protection): gpu_kill, gpu_reset, gpu_remediate."""
    return dict(
        protect_names=dict(type='list', elements='str', default=list(DEFAULT_PROTECT_NAMES)),
        protect_users=dict(type='list', elements='str', default=[]),
    )


def audit_log_option():
    """audit_log (gpufleet.reclaim._audit_log): gpu_kill, gpu_reset, gpu_remediate."""
    return dict(audit_log=dict(type='path', default=ACTIONS_LOG_PATH))


def reset_options():
    """The options gpu_remediate passes on to its resets, with gpu_reset's defaults (each module documents them)."""
    return dict(
        kill_processes=dict(type='bool', default=False),
        kill_timeout=dict(type='float', default=10.0),
        stop_services=dict(type='list', elements='str', default=[]),
        orphan_threshold_mib=dict(type='int', default=1024),
        verify_timeout=dict(type='float', default=60.0),
    )


def invalid_policy(exc):
    """fail_json's arguments for a policy.PolicyError (gpu_audit's O(policy))."""
    return dict(msg='invalid policy: %s' % exc, source=exc.source, field=exc.field, value=str(exc.value))


def invalid_rules(exc):
    """fail_json's arguments for a rogue.RulesError (O(rules_file), O(rules))."""
    return dict(msg='invalid rogue rules: %s' % exc, file=exc.source, line=exc.line, field=exc.field)


def failure(name, exc, errors=()):
    """The arguments of ``module.fail_json`` for ``exc``, raised by the work of module ``name``.

    ``errors`` pairs exception classes of the core that only some modules load (policy.PolicyError
    with :func:`invalid_policy`, rogue.RulesError with :func:`invalid_rules`) with the function that
    gives their arguments; they are tried first.  It may also be a function returning those pairs,
    called only here, so that a module imports an optional part of the core (and its exception) only
    when a call uses it (gpu_audit's policy).  Then: a hung driver names the call (``driver_hung``),
    a bad argument its ``field`` and ``value``, a missing library the package, any other core error
    (AuditLogError, HistoryError, ...) its message; anything else is a bug, reported with its traceback.
    """
    for cls, details in (errors() if callable(errors) else errors):
        if isinstance(exc, cls):
            return details(exc)
    if isinstance(exc, watchdog.DriverHung):
        return dict(msg=str(exc), driver_hung=exc.details)
    if isinstance(exc, InvalidArgument):
        return dict(msg=str(exc), field=exc.field, value=str(exc.value))
    if isinstance(exc, MissingLibrary):
        return dict(msg=str(exc), package=exc.package)
    if isinstance(exc, GpuFleetError):
        return dict(msg=str(exc))
    return dict(msg='%s failed: %s' % (name, exc), exception=''.join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def psutil_error():
    """None when this interpreter finds psutil, else the traceback of its failed import.

    Found, not imported: no module imports psutil on its way (the process records come from /proc,
    processes.ProcessInventory), and importing it only to see that it is there cost every call about
    10 ms of the node's CPU."""
    if not missing_modules(['psutil']):
        return None
    return processes.PSUTIL_IMPORT_ERROR or 'psutil is not installed'


def run_module(module, name, work, errors=()):
    """Run ``work(module)`` for the gpu_* module ``name`` and return what it returns.

    First re-run under the node's recorded Python when this one lacks a library the node needs
    (node_python), and fail when psutil is missing.  An exception of ``work`` fails the task with
    :func:`failure`'s arguments.
    """
    respawn_if_needed(module)
    missing = psutil_error()
    if missing is not None:
        module.fail_json(msg=missing_required_lib('psutil'), exception=missing)
    try:
        return work(module)
    except Exception as exc:  # pylint: disable=broad-except
        module.fail_json(**failure(name, exc, errors))
    return None  # not reached: fail_json exits


def finish(module, result, failed=False):
    """End the task with ``result``: its ``warnings`` become Ansible warnings, then the task fails with
    the result when ``failed``, else exits with it."""
    for warning in result.pop('warnings', None) or []:
        module.warn(warning)
    if failed:
        module.fail_json(**result)
    module.exit_json(**result)
