#!/usr/bin/env bash
# Ranks as mpirun starts them on several nodes, without the chief's address: Open MPI's variables
# with OMPI_COMM_WORLD_LOCAL_SIZE below OMPI_COMM_WORLD_SIZE (one rank a node) and a job id, no
# CONSORT_CHIEF_ADDRESS. No rank can tell rank 0's host, so every rank, rank 0 included, must fail
# at once (exit status 1, well before the rendezvous timeout), saying to pass
# `-x CONSORT_CHIEF_ADDRESS=host0:port`.
#
# Usage: mpi_several_nodes_test.sh MW_JOB N
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
job=$1 n=$2
MW_TIMEOUT_S=20
start=$(date +%s%N)
for ((i = 0; i < n; i++)); do
  (
    exec env -u TF_CONFIG -u SLURM_PROCID -u CONSORT_CHIEF_ADDRESS OMPI_COMM_WORLD_RANK="$i" \
      OMPI_COMM_WORLD_SIZE="$n" OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=1 \
      PMIX_NAMESPACE=645005313 OMPI_MCA_ess_base_jobid=645005313 \
      timeout -k 5 "$MW_TIMEOUT_S" "$job" collectives
  ) > >(sed -u "s/^/[rank:$i] /") 2>&1 &
  MW_PIDS[$i]=$!
  mw_expect "$i" 1
done
mw_finish
rc=$?
echo "ok: every rank ended after $((($(date +%s%N) - start) / 1000000)) ms"
exit "$rc"
