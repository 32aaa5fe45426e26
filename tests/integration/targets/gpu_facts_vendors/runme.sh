#!/usr/bin/env bash
# gpu_facts on a mixed simulated fleet: one NVIDIA, one AMD and one Intel node report the same schema,
# each matching `gpusim show` there; gpu_kill on the AMD node shows the memory freed.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-vendors.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
"$COLL/tests/fleet/up" --nodes 3 --dir "$FLEET_DIR" --gpus 2 --vendors nvidia,amd,intel
ANSIBLE_HOST_KEY_CHECKING=True ansible-playbook -i "$FLEET_DIR/inventory.ini" vendors.yml "$@"
