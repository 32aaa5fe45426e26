#!/usr/bin/env bash
# The remediation ladder (issue #17) on a 3-node simulated fleet: gpufleet.reclaim.remediate in
# check mode predicts every GPU's ladder, confirmed it acts (a verified reset, the Xid 13 application
# killed, the Xid 79 GPU drained and flagged for reboot, a reset refused by an nvidia_drm kernel
# reference and flagged for reboot), a hung driver is reported as driver_hung within its timeout while
# the other nodes finish, and a rerun changes nothing.
# The scenario lives in remediate_test.py.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-remediate.XXXXXX)"
cleanup() {
  "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true
  rm -rf "$FLEET_DIR"
}
trap cleanup EXIT
"$COLL/tests/fleet/up" --nodes 3 --dir "$FLEET_DIR" --gpus 2
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp" ANSIBLE_NOCOLOR=1
python remediate_test.py --fleet "$FLEET_DIR" "$@"
