#!/usr/bin/env bash
# gpufleet.reclaim.guard on a simulated fleet: install (check mode, real, idempotent), ticks run by
# hand the way the timer would, enforcement vs dry-run, the log chain, metrics, systemd units, the
# cron path, a bad policy, and state=absent.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-guard.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
for user in alice bob; do id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"; done
"$COLL/tests/fleet/up" --nodes 3 --dir "$FLEET_DIR" --gpus 4
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0
INV=(-i "$FLEET_DIR/inventory.ini")

recap() {  # the number of nodes whose play recap says changed=0 (first argument: the output file)
  grep -cE '^node0[1-3] +: ok=[0-9]+ +changed=0 +unreachable=0 +failed=0' "$1" || true
}

# 1. check mode predicts changes on a fresh fleet and changes nothing
ansible-playbook "${INV[@]}" apply.yml --check "$@" | tee "$FLEET_DIR/check.out"
test "$(recap "$FLEET_DIR/check.out")" = 0
test ! -e "$FLEET_DIR/nodes/node01/fs/etc/gpufleet/policy.yaml"
# 2. the real run, 3. a second run changes nothing, 4. check mode now predicts no change
ansible-playbook "${INV[@]}" apply.yml "$@" | tee "$FLEET_DIR/first.out"
test "$(recap "$FLEET_DIR/first.out")" = 0
ansible-playbook "${INV[@]}" apply.yml "$@" | tee "$FLEET_DIR/second.out"
test "$(recap "$FLEET_DIR/second.out")" = 3
ansible-playbook "${INV[@]}" apply.yml --check "$@" | tee "$FLEET_DIR/check2.out"
test "$(recap "$FLEET_DIR/check2.out")" = 3
# 5. enforcement, dry-run, log chain, metrics, units, cron
ansible-playbook "${INV[@]}" enforce.yml "$@"
# 6. a bad policy fails the play and leaves the old one in force
ansible-playbook "${INV[@]}" bad_policy.yml "$@"
# 6b. a policy given as TOML text goes to policy.toml, which the agent reads; a mapping again goes back to policy.yaml
ansible-playbook "${INV[@]}" toml_policy.yml "$@"
# 7. state=absent leaves nothing behind (and is idempotent)
ansible-playbook "${INV[@]}" apply.yml -e '{"gpu_guard_state": "absent", "gpu_guard_purge_logs": true}' "$@" | tee "$FLEET_DIR/absent.out"
test "$(recap "$FLEET_DIR/absent.out")" = 0
ansible-playbook "${INV[@]}" apply.yml -e '{"gpu_guard_state": "absent", "gpu_guard_purge_logs": true}' "$@" | tee "$FLEET_DIR/absent2.out"
test "$(recap "$FLEET_DIR/absent2.out")" = 3
ansible-playbook "${INV[@]}" absent_check.yml "$@"
# the files themselves, seen from the host (each node's private paths are under nodes/NODE/fs)
for node in node01 node02 node03; do
  left="$(cd "$FLEET_DIR/nodes/$node/fs" && find etc/gpufleet var/lib/gpufleet var/log/gpufleet opt/gpufleet etc/systemd/system \
          etc/cron.d etc/logrotate.d var/lib/node_exporter \( -type f -o -type l \) ! -path etc/gpufleet/python 2>/dev/null || true)"
  test -z "$left" || { echo "left behind on $node: $left"; exit 1; }
done
