#!/usr/bin/env bash
# Issue #16 item 8: README's Quick start on nodes whose interpreter lacks nvidia-ml-py.
# The nodes' ansible_python_interpreter is a venv with psutil and PyYAML only (no system site
# packages); /dev/nvidiactl and the simulated NVML are there.
#   1. ad-hoc gpu_facts before the role: no devices, and a warning that names the fix;
#   2. the prereqs role in check mode changes nothing, then for real: it creates its venv with
#      nvidia-ml-py (pip, from PyPI or the configured index) and records /etc/gpufleet/python;
#   3. the same ad-hoc gpu_facts, same interpreter: the GPUs are listed (the module respawned under
#      the recorded interpreter); with /usr/bin/python3 as the interpreter too;
#   4. a record that others could change is refused with a warning (the role's default venv, which
#      passes the checks, is used instead); a second role run changes nothing;
#   5. state=absent removes the record and the venv: the warning is back.
set -eux
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
WORK="$(mktemp -d /tmp/gpufleet-it-interp.XXXXXX)"
FLEET_DIR="$WORK/fleet"
cleanup() { "$COLL/tests/fleet/down" --dir "$FLEET_DIR" || true; rm -rf "$WORK"; }
trap cleanup EXIT
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 ANSIBLE_DEPRECATION_WARNINGS=False

# the nodes' interpreter: the system python3's venv with psutil and PyYAML, and no pynvml
/usr/bin/python3 -m venv "$WORK/nodepy"
"$WORK/nodepy/bin/pip" install -q --disable-pip-version-check psutil pyyaml
if "$WORK/nodepy/bin/python" -c 'import pynvml' 2>/dev/null; then echo "the nodes' interpreter must not import pynvml"; exit 1; fi
"$COLL/tests/fleet/up" --nodes 2 --dir "$FLEET_DIR" --gpus 2
# `up --python` insists on an interpreter with nvidia-ml-py: set the nodes' interpreter in the inventory instead
sed -i "s|^ansible_python_interpreter=.*|ansible_python_interpreter=$WORK/nodepy/bin/python|" "$FLEET_DIR/inventory.ini"
INV=(-i "$FLEET_DIR/inventory.ini")
facts() {  # README's ad-hoc command; the output files are named after the first argument
  local name="$1"; shift
  ansible gpu_nodes "${INV[@]}" -m gpufleet.reclaim.gpu_facts "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  cat "$WORK/$name.err"
}
recap() {  # the number of nodes whose play recap says changed=0 (first argument: the output file)
  grep -cE '^node0[12] +: ok=[0-9]+ +changed=0 +unreachable=0 +failed=0' "$1" || true
}

# 1. before the role
facts before
python check.py blind 2 2 "$WORK/before.out" "$WORK/before.err" "for $WORK/nodepy/bin/python"
# 2. the role: check mode, then for real
ansible-playbook "${INV[@]}" prereqs.yml --check "$@" | tee "$WORK/check.out"
test "$(recap "$WORK/check.out")" = 0
test ! -e "$FLEET_DIR/nodes/node01/fs/etc/gpufleet/python" && test ! -e "$FLEET_DIR/nodes/node01/fs/opt/gpufleet/venv"
ansible-playbook "${INV[@]}" prereqs.yml "$@" | tee "$WORK/role.out"
test "$(recap "$WORK/role.out")" = 0
for node in node01 node02; do
  record="$FLEET_DIR/nodes/$node/fs/etc/gpufleet/python"
  test "$(cat "$record")" = /opt/gpufleet/venv/bin/python
  test "$(stat -c '%U:%G %a' "$record" "$(dirname "$record")")" = "root:root 644
root:root 755"
done
# 3. the same command after the role: the GPUs are listed; and on the system python3 as well
facts after
python check.py sees 2 2 "$WORK/after.out" "$WORK/after.err"
facts system -e ansible_python_interpreter=/usr/bin/python3
python check.py sees 2 2 "$WORK/system.out" "$WORK/system.err"
# 4. a record others could change is not trusted (the default venv passes the checks and is used)
chmod g+w "$FLEET_DIR/nodes/node01/fs/etc/gpufleet/python"
facts tampered
python check.py sees 2 2 "$WORK/tampered.out" "$WORK/tampered.err" \
  "the interpreter record /etc/gpufleet/python was not used: the file /etc/gpufleet/python is writable by its group"
chmod g-w "$FLEET_DIR/nodes/node01/fs/etc/gpufleet/python"
ansible-playbook "${INV[@]}" prereqs.yml "$@" | tee "$WORK/again.out"
test "$(recap "$WORK/again.out")" = 2
# 5. state=absent: the record and the venv are gone, the node is as before the role
ansible-playbook "${INV[@]}" prereqs.yml -e gpu_prereqs_state=absent "$@" | tee "$WORK/absent.out"
test "$(recap "$WORK/absent.out")" = 0
test ! -e "$FLEET_DIR/nodes/node01/fs/etc/gpufleet/python" && test ! -e "$FLEET_DIR/nodes/node01/fs/opt/gpufleet/venv"
facts gone
python check.py blind 2 2 "$WORK/gone.out" "$WORK/gone.err"
