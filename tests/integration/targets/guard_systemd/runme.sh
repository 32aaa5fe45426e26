#!/usr/bin/env bash
# gpufleet.reclaim.guard under a real systemd: two nodes with systemd as pid 1 (tests/fleet/up
# --systemd). The role picks the systemd timer by itself; the timer (never a tick run by hand)
# warns and then kills a 20 GiB process over a 12 GiB per-user limit while another user's process
# survives; the hardened service's runs all succeed; the audit timer fires; a reboot of the nodes
# brings the guard back enforcing without any Ansible run; state=absent removes everything.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
FLEET_DIR="$(mktemp -d /tmp/gpufleet-it-guard-systemd.XXXXXX)"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$FLEET_DIR"; }
trap cleanup EXIT
for user in alice bob; do id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"; done
"$COLL/tests/fleet/up" --systemd --nodes 2 --dir "$FLEET_DIR" --gpus 2
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 ANSIBLE_SSH_CONTROL_PATH_DIR="$FLEET_DIR/cp"
INV=(-i "$FLEET_DIR/inventory.ini")
# the nodes run the agent with this checkout's venv and simulated NVML: under /tmp the service's
# private /tmp would hide them (see gpu_guard_private_tmp); anywhere else the unit stays as shipped
case "$(cd "$COLL" && pwd -P)" in
  /tmp/*|/var/tmp/*) INV+=(-e guard_it_private_tmp=false) ;;
esac

# 1. systemd is pid 1 on the nodes; bob runs his jobs; the audit's last run is 2 hours old; then the
#    role (gpu_guard_scheduler: auto) installs and starts the timers
ansible-playbook "${INV[@]}" apply.yml "$@"
echo "guard_systemd: nodes up, role applied after ${SECONDS}s"
# 2. the timer's ticks warn alice, then kill her 20 GiB process; bob's survive; the audit timer fired
ansible-playbook "${INV[@]}" enforce.yml -e guard_it_phase=installed "$@"
echo "guard_systemd: enforced after ${SECONDS}s"
# 3. reboot both nodes (orderly shutdown by the harness, same trees): no Ansible run re-enables anything
"$COLL/tests/fleet/reboot" --dir "$FLEET_DIR" node01 node02
ansible-playbook "${INV[@]}" enforce.yml -e guard_it_phase=rebooted "$@"
echo "guard_systemd: rebooted and enforced again after ${SECONDS}s"
# 4. state=absent stops and removes everything
ansible-playbook "${INV[@]}" remove.yml "$@"
for node in node01 node02; do
  left="$(cd "$FLEET_DIR/nodes/$node/fs" && find etc/gpufleet var/lib/gpufleet var/log/gpufleet opt/gpufleet etc/cron.d etc/logrotate.d \
          var/lib/node_exporter etc/systemd/system \( -type f -o -type l \) \! -name 'gpufleet-sim-driver.service' \
          \! -name 'gpufleet-node-sshd.service' \! -path etc/gpufleet/python 2>/dev/null || true)"
  test -z "$left" || { echo "left behind on $node: $left"; exit 1; }
done
echo "guard_systemd: removed after ${SECONDS}s"
