#!/usr/bin/env bash
# Workers started by the real Open MPI mpirun, with nothing extra: no `-x CONSORT_CHIEF_ADDRESS`,
# no TF_CONFIG. Every rank is on this machine (OMPI_COMM_WORLD_LOCAL_SIZE = OMPI_COMM_WORLD_SIZE),
# so each derives the chief's address from the job id mpirun put in its environment
# (PMIX_NAMESPACE) and listens on the loopback; every worker must form the group and pass every
# check of `mw_job collectives`.
#
# Usage: mpirun_test.sh MW_JOB N [--no-args]   (--no-args: run the job bare, not `JOB collectives`)
# Exit status: mpirun's (bounded by MW_TIMEOUT_S); 77 when Open MPI's mpirun is not installed
# (tools/setup.sh installs openmpi-bin, so CI runs it).
set -uo pipefail
job=$1 n=$2
args=(collectives)
[ "${3:-}" = "--no-args" ] && args=()
if ! command -v mpirun >/dev/null; then
  echo "skipped: mpirun is not installed (Debian's openmpi-bin; tools/setup.sh installs it)"
  exit 77
fi
if ! mpirun --version 2>&1 | grep -q "Open MPI"; then
  echo "skipped: mpirun is not Open MPI's: $(mpirun --version 2>&1 | head -1)"
  exit 77
fi
mpirun --version 2>&1 | head -1
# Nothing from this shell may give the cluster or the chief's address: the ranks inherit
# mpirun's environment.
# --allow-run-as-root: CI runs as root; --oversubscribe: more ranks than cores (2 in CI).
exec env -u TF_CONFIG -u SLURM_PROCID -u CONSORT_CHIEF_ADDRESS -u RANK -u WORLD_SIZE \
  -u MASTER_ADDR -u MASTER_PORT -u PMI_RANK -u PMI_SIZE \
  timeout -k 5 "${MW_TIMEOUT_S:-90}" \
  mpirun --allow-run-as-root --oversubscribe -np "$n" "$job" "${args[@]}"
