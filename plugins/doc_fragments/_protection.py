# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note that this doc fragment is **PRIVATE** to the collection. It can have breaking changes at any time.
# Do not use this from other collections or standalone plugins/modules!

from __future__ import annotations


class ModuleDocFragment:

    # protect_names and protect_users of gpu_kill, gpu_reset and gpu_remediate (argument spec:
    # module_utils/gpu_module.protection_options).  The default list is core/constants.py
    # DEFAULT_PROTECT_NAMES (tests/unit/plugins/modules/test_gpu_module.py checks that they are equal).
    DOCUMENTATION = r"""
options:
  protect_names:
    description:
      - Processes with these names (process name, executable basename or C(argv[0]) basename) are never signalled.
      - A name protects only a process that an ordinary user could not have named so - one whose real, effective and saved
        uids are system accounts (at most C(SYS_UID_MAX) of C(/etc/login.defs), else 999), executing a root-owned file
        that group and others may not write, from directories only root may write. A user's process named C(sshd) is not
        protected.
      - Replaces the default list; include the defaults to extend it.
    type: list
    elements: str
    default: [Xorg, X, Xwayland, gnome-shell, kwin_x11, kwin_wayland, gdm, gdm3, sddm, lightdm, WindowServer,
              nvidia-persistenced, nv-hostengine, dcgm-exporter, dcgmi, nvidia-fabricmanager, sshd, systemd, init,
              containerd, dockerd, kubelet, slurmd, slurmstepd]
  protect_users:
    description: Processes of these users are never signalled.
    type: list
    elements: str
    default: []
"""
