#!/usr/bin/env bash
# A worker killed with SIGKILL while the others enter an all-reduce: every survivor fails with
# peer_lost within the bound (mw_job checks the time and the code) and exits cleanly.
#   kill_test.sh MW_JOB WORKERS VICTIM_RANK
set -u
job=$1 workers=$2 victim=$3
source "$(dirname "$0")/lib.sh"
mw_cluster "$workers" 127.0.0.1
for ((i = 0; i < workers; i++)); do
  mw_start "$i" "CONSORT_DEVICES_PER_WORKER=2" "$job" kill "$victim"
  if [ "$i" -eq "$victim" ]; then mw_expect "$i" 137; else mw_expect "$i" 0; fi
done
mw_finish
