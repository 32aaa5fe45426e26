#!/bin/sh
# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# pid 1 of a simulated fleet node (exec'd by node_setup.py as: /bin/sh node_init.sh SSHD_CONFIG).
# dash's `wait` reaps every child, including the orphans the kernel reparents to pid 1 (simulated
# workloads are daemons), so dead processes never pile up as zombies.  SIGTERM (tests/fleet/down)
# makes it SIGTERM everything in the namespace and exit; the kernel SIGKILLs whatever is left.
trap 'kill -TERM -1 2>/dev/null; exit 0' TERM INT HUP
/usr/sbin/sshd -D -e -f "$1" </dev/null &
sshd_pid=$!
wait "$sshd_pid"
rc=$?
echo "gpufleet node init: sshd exited with status $rc" >&2
exit "$rc"
