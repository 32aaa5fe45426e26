#!/usr/bin/env bash
# Faults on a 3-node simulated fleet (issue #11): the SSH connection drops while gpu_kill runs (the
# module is killed halfway on the node and the controller sees the node unreachable), and a node
# becomes unreachable in the middle of rogue_cleanup, before its one gpu_kill call. In both, the
# rerun must finish the work, and nothing but the intended processes may be signalled.
# The scenario lives in faults_test.py.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-faults.XXXXXX)"
cleanup() {
  "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true
  rm -rf "$FLEET_DIR"
}
trap cleanup EXIT
"$COLL/tests/fleet/up" --nodes 3 --dir "$FLEET_DIR" --gpus 2
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp" ANSIBLE_NOCOLOR=1
python faults_test.py --fleet "$FLEET_DIR" --collection "$COLL" "$@"
