#!/usr/bin/env bash
# gpu_audit on a simulated fleet: a miner disguised as "python train.py" with stratum arguments on two
# of three nodes is flagged with its evidence (and nothing else is), findings go to the JSON Lines log,
# the usage history is reported, and gpu_kill rogue=true kills exactly the miners.
set -eux
COLL_ROOT="${ANSIBLE_COLLECTIONS_PATH%%:*}"
COLL="$COLL_ROOT/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-audit.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
for user in alice bob; do id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"; done
"$COLL/tests/fleet/up" --nodes 3 --dir "$FLEET_DIR" --gpus 4
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp"
ansible-playbook -i "$FLEET_DIR/inventory.ini" audit.yml -e "coll_root=$COLL_ROOT" "$@"
ansible-doc gpufleet.reclaim.gpu_audit | grep -q 'violations'
ansible-doc -j gpufleet.reclaim.gpu_audit | python -c 'import json,sys; d=json.load(sys.stdin); assert "policy" in d["gpufleet.reclaim.gpu_audit"]["doc"]["options"]'
