#!/usr/bin/env bash
# The collection as a user gets it (issue #16): built with `ansible-galaxy collection build`
# (galaxy.yml's build_ignore), installed with `ansible-galaxy collection install`, then made
# read-only (chmod -R a-w, and a read-only bind mount in a private mount namespace, which holds for
# root too, like an execution environment image). From a scratch directory, the playbooks with their
# default, relative and AWX-style paths must write there, never into the collection, and
# `ansible-galaxy collection verify --offline` must stay clean. One local node on the simulated driver.
set -eux -o pipefail
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
WORK="$(mktemp -d /tmp/gpufleet-it-installed.XXXXXX)"
INSTALLED="$WORK/collections"
RUN="$WORK/run"
export GPU_SIM_STATE="$WORK/sim/state.json"
cleanup() {
  "$COLL/tests/sim/gpusim" kill-all >/dev/null 2>&1 || true
  chmod -R u+w "$WORK" || true
  rm -rf "$WORK"
}
trap cleanup EXIT
mkdir -p "$WORK/sim" "$RUN"

ansible-galaxy collection build --output-path "$WORK" "$COLL"
# From here on only the installed copy is on the collections path: the playbooks come from there
# (and the install does not stop at "already installed" because of the copy under test).
export ANSIBLE_COLLECTIONS_PATH="$INSTALLED" ANSIBLE_NOCOLOR=1
ansible-galaxy collection install -p "$INSTALLED" "$WORK"/gpufleet-reclaim-*.tar.gz
test -f "$INSTALLED/ansible_collections/gpufleet/reclaim/MANIFEST.json"
chmod -R a-w "$INSTALLED"

"$COLL/tests/sim/gpusim" init --gpus 2
eval "$("$COLL/tests/sim/gpusim" env)"
id -u alice >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin alice
gpusim spawn --gpu 0 --mib 4096 --util 90 --user alice -- python train.py --epochs 1
printf '[gpu_nodes]\nlocalhost ansible_connection=local ansible_python_interpreter=%s\n' "$(command -v python)" > "$WORK/inventory.ini"

# run_ro ARGV...: run ARGV in $RUN with the installed collection mounted read-only.
run_ro() {
  unshare -m --propagation private bash -euc '
    mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1"
    if touch "$1/.write-probe" 2>/dev/null; then echo "the collection is not read-only" >&2; exit 1; fi
    cd "$2" && shift 2 && exec "$@"' run_ro "$INSTALLED" "$RUN" "$@"
}

# 1. the defaults, as the AWX survey sends them
run_ro ansible-playbook -i "$WORK/inventory.ini" gpufleet.reclaim.inventory_report | tee "$WORK/report.log"
for f in index.html fleet.json fleet.csv; do test -s "$RUN/gpu-report/$f"; done
grep -F "report: $RUN/gpu-report/index.html (also fleet.json, fleet.csv)" "$WORK/report.log"
python - "$RUN/gpu-report/fleet.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
node = report['nodes'][0]
assert node['host'] == 'localhost' and node['status'] == 'ok', node
assert len(node['gpu']['devices']) == 2, node['gpu']['devices']
assert [p['user'] for p in node['gpu']['processes']] == ['alice'], node['gpu']['processes']
PY

# 2. a relative report_dir with .. and a survey-style string, the audit's default directory and a
#    relative summary_file (reset_unhealthy in check mode: nothing on the node changes)
run_ro ansible-playbook -i "$WORK/inventory.ini" gpufleet.reclaim.inventory_report -e report_dir=out/../reports
test -s "$RUN/reports/index.html" && test ! -e "$RUN/out"
run_ro ansible-playbook -i "$WORK/inventory.ini" gpufleet.reclaim.audit -e '{"audit_dir": "./gpu-audit", "audit_min_level": "info"}'
test -s "$RUN/gpu-audit/fleet-audit.jsonl" && ls "$RUN"/gpu-audit/runs/audit-*.jsonl
run_ro ansible-playbook -i "$WORK/inventory.ini" gpufleet.reclaim.reset_unhealthy --check -e summary_file=reset-summary.json
python -c 'import json, sys; json.load(open(sys.argv[1]))' "$RUN/reset-summary.json"

# 3. nothing landed in the collection: the installed files still match the tarball's manifest
chmod -R u+w "$INSTALLED"
ansible-galaxy collection verify --offline -p "$INSTALLED" gpufleet.reclaim | tee "$WORK/verify.log"
grep -E "Successfully verified that checksums for 'gpufleet.reclaim:[^']+' are internally consistent" "$WORK/verify.log"
test -z "$(find "$INSTALLED" -name 'gpu-report' -o -name 'gpu-audit' -o -name 'reset-summary.json')"
