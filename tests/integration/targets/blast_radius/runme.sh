#!/usr/bin/env bash
# The blast-radius limits (issue #30) on a simulated fleet of 11 nodes with one GPU each: on the ten of gpu_nodes:!node11,
# remediate with a genuine Xid 48 on every node resets at most 2 GPUs and names the 8 others as held, a second run within
# the window resets none, reclaim_max_nodes_pct=100 resets the rest (check mode and report-only predict the same; bad
# values fail before any node is touched; the fleet report lists the disrupted nodes); rogue_cleanup with 150 miners on
# three nodes kills 100 and reports 50 held; and on node11 the guard's ladder resets a GPU that keeps failing twice,
# then holds it by its budget (the metric, checked with promtool). blast_test.py starts and stops the fleet.
set -eux
id -u eve >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin eve
python blast_test.py "$@"
