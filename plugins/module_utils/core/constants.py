# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Names and default paths every layer of the core shares.  A leaf: it imports nothing.

Each value is defined here once; the modules' option defaults, the guard's settings and the docs
name the same values.
"""

from __future__ import annotations

# Rogue-process levels, lowest first (a threshold selects this level and the ones after it).
ROGUE_LEVELS = ('info', 'medium', 'high', 'critical')
# Guard policy modes and the actions a rule can take.
MODES = ('dry-run', 'warn', 'enforce')
ACTIONS = ('warn', 'terminate', 'kill')
# GPU vendors, in host-wide index order (backends.REGISTRY holds their backends in this order), and
# the choices of a ``vendor`` option.
VENDORS = ('nvidia', 'amd', 'intel', 'apple')
VENDOR_CHOICES = ('auto',) + VENDORS

# Process names that are never signalled when a system account runs them from a root-owned
# executable (see identity.name_trusted): display servers, GPU daemons, init, schedulers.
DEFAULT_PROTECT_NAMES = (
    'Xorg', 'X', 'Xwayland', 'gnome-shell', 'kwin_x11', 'kwin_wayland', 'gdm', 'gdm3', 'sddm', 'lightdm',
    'WindowServer', 'nvidia-persistenced', 'nv-hostengine', 'dcgm-exporter', 'dcgmi', 'nvidia-fabricmanager',
    'sshd', 'systemd', 'init', 'containerd', 'dockerd', 'kubelet', 'slurmd', 'slurmstepd',
)

# Default paths on a node.
POLICY_PATH = '/etc/gpufleet/policy.yaml'
SETTINGS_PATH = '/etc/gpufleet/guard.yaml'
STATE_PATH = '/var/lib/gpufleet/state.json'
LOCK_PATH = '/run/gpufleet/guard.lock'
GUARD_LOG_PATH = '/var/log/gpufleet/guard.jsonl'
AUDIT_LOG_PATH = '/var/log/gpufleet/audit.jsonl'
ACTIONS_LOG_PATH = '/var/log/gpufleet/actions.jsonl'
HISTORY_PATH = '/var/lib/gpufleet/history.db'
ALLOCATIONS_PATH = '/run/gpufleet/allocations.json'
METRICS_PATH = '/var/lib/node_exporter/textfile_collector/gpufleet.prom'
REBOOT_FLAG_PATH = '/var/lib/gpufleet/reboot-wanted'
REMEDIATION_STATE_PATH = '/var/lib/gpufleet/remediation.json'
# The disruptive actions (core/disruption.py's history, core/blast.py's fleet limit), worst first, and how long a
# node keeps their history: the longest window a limit may look back over.
DISRUPTIVE_ACTIONS = ('reboot_flag', 'drain', 'reset', 'stop_service')
DISRUPTION_KEEP_S = 7 * 86400.0
# the modules' compiled code of the core, by the hash of its source (core/bytecode.py); root's alone
BYTECODE_CACHE_PATH = '/var/lib/gpufleet/bytecode'
