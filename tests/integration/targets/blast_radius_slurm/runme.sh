#!/usr/bin/env bash
# The remediation ladder's partition check (issue #30) against a real Slurm on the simulated fleet (tests/fleet/up
# --slurm: Debian's slurmctld, slurmd and munge on loopback): with 3 of the partition's 4 nodes drained by gpufleet
# (the remediate playbook drained them for an Xid 79), the guard's ladder on the 4th does not drain it; once one of them
# is back in service, it does. slurm_test.py starts and stops the fleet.
set -eux
for tool in slurmctld slurmd sbatch munged; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed (Debian packages slurmctld, slurmd, slurm-client, munge)"; exit 0; }
done
python slurm_test.py "$@"
