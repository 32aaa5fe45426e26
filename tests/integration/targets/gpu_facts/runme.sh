#!/usr/bin/env bash
# gpu_facts on a simulated fleet: facts on every node must match `gpusim show` there.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-facts.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
for user in alice bob; do id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"; done
"$COLL/tests/fleet/up" --nodes 3 --dir "$FLEET_DIR" --gpus 4
ANSIBLE_HOST_KEY_CHECKING=True ansible-playbook -i "$FLEET_DIR/inventory.ini" facts.yml "$@"
ansible-doc gpufleet.reclaim.gpu_facts | grep -q 'ansible_facts.gpu\|gpu_facts'
ansible-doc -j gpufleet.reclaim.gpu_facts | python -c 'import json,sys; d=json.load(sys.stdin); assert d["gpufleet.reclaim.gpu_facts"]["doc"]["options"]["vendor"]'
