#!/usr/bin/env bash
# The event-driven loop (issue #33) on a 2-node simulated fleet with the real parts: a genuine Xid 48 on
# both nodes, the guard's tick writes its metrics, prometheus-node-exporter serves node01's, a real
# Prometheus with the shipped rules scrapes them, a real Alertmanager with the shipped configuration sends
# GpuXidFault to a real ansible-rulebook running the shipped rulebook, and remediate resets node01's GPU,
# verified; node02 (same fault, no alert) is untouched; Alertmanager's repeats start no second run.
# The scenario lives in eda_loop_test.py.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-eda.XXXXXX)"
chmod 0755 "$FLEET_DIR"
cleanup() {
  "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true
  if [ -n "${GPUFLEET_KEEP_OUTPUT:-}" ] && [ -d "$FLEET_DIR/out" ]; then cp -r "$FLEET_DIR/out" "$GPUFLEET_KEEP_OUTPUT"; fi
  rm -rf "$FLEET_DIR"
}
trap cleanup EXIT
"$COLL/tests/fleet/up" --nodes 2 --dir "$FLEET_DIR" --gpus 2
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp" ANSIBLE_NOCOLOR=1
python eda_loop_test.py --fleet "$FLEET_DIR" --collection "$COLL" "$@"
