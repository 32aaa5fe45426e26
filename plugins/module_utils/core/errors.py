# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Exceptions raised by the core: every one is a GpuFleetError.  Callers catch GpuFleetError; nothing
else is expected.  A leaf: it imports nothing (subclasses that belong to one topic, such as
policy.PolicyError or history.HistoryError, derive from the classes here)."""

from __future__ import annotations


class GpuFleetError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidArgument(GpuFleetError):
    """A caller passed a value the core cannot use.

    ``field`` names the argument (the module option), ``value`` is what was passed, ``why`` explains.
    """

    def __init__(self, field, value, why):
        self.field = field
        self.value = value
        self.why = why
        super(InvalidArgument, self).__init__('%s: invalid value %r: %s' % (field, value, why))


class MissingArgument(InvalidArgument):
    """A required choice was not made: ``field`` names the options, ``why`` what to give.  There is
    no value to show, so the message is ``field: why`` (``value`` is None)."""

    def __init__(self, field, why):
        super(MissingArgument, self).__init__(field, None, why)
        self.args = ('%s: %s' % (field, why),)


class MissingLibrary(GpuFleetError):
    """A Python package the requested operation needs is not importable.

    ``package`` is the distribution name to install (for example ``psutil``), ``error`` the
    import error text recorded when the import was attempted.
    """

    def __init__(self, package, error=None, purpose=None):
        self.package = package
        self.error = error
        self.purpose = purpose
        msg = 'the Python package %s is required' % package
        if purpose:
            msg += ' to %s' % purpose
        if error:
            msg += ' (import failed: %s)' % error.strip().splitlines()[-1]
        super(MissingLibrary, self).__init__(msg)


class HistoryError(GpuFleetError):
    """The history database cannot be read or written (permissions, corruption, newer schema)."""


class AuditLogError(GpuFleetError):
    """The audit log could not be written (permissions, disk full, a path that is not a file)."""
