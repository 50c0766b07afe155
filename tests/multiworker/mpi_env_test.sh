#!/usr/bin/env bash
# Workers started as mpirun starts them, with no TF_CONFIG: each process has Open MPI's
# OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK and the chief's address (mpirun -x
# CONSORT_CHIEF_ADDRESS=...), so resolve_cluster() picks the Open MPI resolver, whose ranks know
# only their own and the chief's addresses until the rendezvous. Every worker must form the group
# and pass every check of `mw_job collectives`.
#
# Usage: mpi_env_test.sh MW_JOB N
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
job=$1 n=$2
port=$(mw_base_port 1)
for ((i = 0; i < n; i++)); do
  (
    exec env -u TF_CONFIG -u SLURM_PROCID OMPI_COMM_WORLD_RANK="$i" OMPI_COMM_WORLD_SIZE="$n" \
      OMPI_COMM_WORLD_LOCAL_RANK="$i" OMPI_COMM_WORLD_LOCAL_SIZE="$n" \
      CONSORT_CHIEF_ADDRESS="127.0.0.1:$port" timeout -k 5 "$MW_TIMEOUT_S" "$job" collectives
  ) > >(sed -u "s/^/[rank:$i] /") 2>&1 &
  MW_PIDS[$i]=$!
done
mw_finish
