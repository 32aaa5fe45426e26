#!/usr/bin/env bash
# The collection's playbooks on a 6-node simulated fleet plus one unreachable inventory host:
# exact processes killed and spared, memory freed, check mode kills nothing, a second run changes
# nothing, the report renders in headless Chromium. The scenario lives in playbooks_test.py.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-playbooks.XXXXXX)"
cleanup() {
  "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true
  # GPUFLEET_KEEP_OUTPUT=DIR keeps the reports, summaries and screenshots for a look
  if [ -n "${GPUFLEET_KEEP_OUTPUT:-}" ] && [ -d "$FLEET_DIR/out" ]; then cp -r "$FLEET_DIR/out" "$GPUFLEET_KEEP_OUTPUT"; fi
  rm -rf "$FLEET_DIR"
}
trap cleanup EXIT
for user in alice bob carol dave eve; do
  id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"
done
"$COLL/tests/fleet/up" --nodes 6 --dir "$FLEET_DIR" --gpus 4
# strategy free: every shipped playbook must be safe under it (docs/fleet-tuning.md)
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp" ANSIBLE_FORKS=10 ANSIBLE_NOCOLOR=1 \
  ANSIBLE_STRATEGY=free
python playbooks_test.py --fleet "$FLEET_DIR" "$@"
