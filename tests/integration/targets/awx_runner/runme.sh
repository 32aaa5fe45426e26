#!/usr/bin/env bash
# The AWX job templates (extras/awx/) run through ansible-runner, the executor of AWX and Automation
# Controller, on a 2-node simulated fleet: a private_data_dir per job laid out as AWX lays it out,
# extra vars typed as the surveys send them, check jobs, a confirmed kill. See awx_runner_test.py
# and docs/awx.md ("Tested with ansible-runner").
set -eux -o pipefail
COLL="${ANSIBLE_COLLECTIONS_PATH%%:*}/ansible_collections/gpufleet/reclaim"
WORK="$(mktemp -d /tmp/gpufleet-it-awx-runner.XXXXXX)"
cleanup() {
  "$COLL/tests/fleet/down" --dir "$WORK/fleet" || true
  # GPUFLEET_KEEP_OUTPUT=DIR keeps the jobs' private_data_dirs (artifacts, reports) for a look
  if [ -n "${GPUFLEET_KEEP_OUTPUT:-}" ] && [ -d "$WORK/jobs" ]; then cp -r "$WORK/jobs" "$GPUFLEET_KEEP_OUTPUT"; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
for user in alice eve; do
  id -u "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$user"
done
python -c 'import ansible_runner' || { echo "ansible-runner is needed: pip install ansible-runner (tests/requirements-dev.txt)" >&2; exit 1; }
"$COLL/tests/fleet/up" --nodes 2 --dir "$WORK/fleet" --gpus 2

# The project sync: AWX installs the project's collections/requirements.yml into the project cache's
# requirements_collections/ and copies it into each job's private_data_dir. Offline here: the
# collection under test, built and installed as Galaxy would deliver it. From here on only that copy
# is on the collections path (each job's env/envvars points at its own copy of it).
ansible-galaxy collection build --output-path "$WORK" "$COLL"
export ANSIBLE_COLLECTIONS_PATH="$WORK/cache/requirements_collections"
ansible-galaxy collection install -p "$ANSIBLE_COLLECTIONS_PATH" "$WORK"/gpufleet-reclaim-*.tar.gz
mkdir "$WORK/jobs"
python awx_runner_test.py --fleet "$WORK/fleet" --cache "$WORK/cache" --awx "$COLL/extras/awx" \
  --project "$COLL/extras/awx/project" --jobs "$WORK/jobs"
