# -*- coding: utf-8 -*-

# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: abspath
short_description: Make a controller path absolute against the directory the run started in
version_added: 0.1.0
description:
  - Returns the absolute, normalized form of a path on the controller. A relative path is resolved
    against the current working directory of the controller process, that is the directory
    C(ansible-playbook) was started in; under AWX, Automation Controller and C(ansible-runner), the
    project directory. A leading C(~) is expanded to the controller user's home directory.
  - Modules that run on the controller through the local connection resolve relative paths against
    the playbook's directory instead, which for a collection playbook lies inside the installed
    collection. The collection's playbooks pass every path they write on the controller (C(report_dir),
    C(audit_dir), C(summary_file)) through this filter first.
  - Symbolic links are not resolved and the path need not exist.
options:
  _input:
    description: The path, absolute or relative.
    type: str
    required: true
author:
  - gpufleet.reclaim developers
"""

EXAMPLES = r"""
- name: Write a report next to where the run started, never inside the collection
  ansible.builtin.copy:
    dest: "{{ report_dir | default('gpu-report') | gpufleet.reclaim.abspath }}/fleet.json"
    content: "{{ report | to_nice_json }}"
    mode: "0644"
  delegate_to: localhost

# started in /srv/runs:  'gpu-report' -> '/srv/runs/gpu-report', './a/../b' -> '/srv/runs/b'
# '/var/tmp/x' -> '/var/tmp/x', '~/reports' -> '/root/reports' (for root)
"""

RETURN = r"""
_value:
  description: The absolute path, normalized (no C(.) or C(..) components, no trailing slash).
  type: str
"""

import os

from ansible.errors import AnsibleFilterError


def abspath(path):
    """Return path made absolute against the controller's current working directory."""
    if not isinstance(path, str):
        raise AnsibleFilterError('gpufleet.reclaim.abspath: invalid value %r: a path must be a string, not %s' % (path, type(path).__name__))
    if not path.strip():
        raise AnsibleFilterError('gpufleet.reclaim.abspath: invalid value %r: the path is empty' % (path,))
    if '\0' in path:
        raise AnsibleFilterError('gpufleet.reclaim.abspath: invalid value %r: a path cannot contain a NUL character' % (path,))
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded)
    try:
        cwd = os.getcwd()
    except OSError as exc:
        raise AnsibleFilterError('gpufleet.reclaim.abspath: cannot resolve %r: the current directory is gone (%s)' % (path, exc))
    return os.path.normpath(os.path.join(cwd, expanded))


class FilterModule(object):
    """gpufleet.reclaim path filters."""

    def filters(self):
        return {'abspath': abspath}
