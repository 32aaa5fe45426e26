#!/usr/bin/env bash
# gpu_reset on a simulated fleet: when_needed resets exactly the GPUs with leaked memory, proves it,
# and a second run changes nothing.  Every reset runs the simulator's fake nvidia-smi on a node.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-reset.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
"$COLL/tests/fleet/up" --nodes 4 --dir "$FLEET_DIR" --gpus 4
ANSIBLE_HOST_KEY_CHECKING=True ansible-playbook -i "$FLEET_DIR/inventory.ini" reset.yml "$@"
ansible-doc -j gpufleet.reclaim.gpu_reset | python -c 'import json,sys; d=json.load(sys.stdin); assert d["gpufleet.reclaim.gpu_reset"]["doc"]["options"]["when_needed"]'
