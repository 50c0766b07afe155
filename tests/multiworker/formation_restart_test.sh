#!/usr/bin/env bash
# A worker lost during the first rendezvous, after its Join reached the chief and before the
# view (docs/multi_worker.md, "What happens at start-up"), and started again under its task, as
# `consort-launch --max-restarts` or a cluster manager would: the chief drops it ("dropped out
# before the view ... it may join again"), takes the new process's Join, and the group forms with
# every task; the job (elastic_job) then runs to its end on all three workers.
#   formation_restart_test.sh ELASTIC_JOB MIN_WORKERS   (0: a group that is not elastic)
set -u
job=$1 min=$2
source "$(dirname "$0")/lib.sh"
mw_cluster 3 127.0.0.1
chief_out=$(mktemp)
trap 'rm -f "$chief_out"' EXIT
args=(12 4 "$min")
tf() { echo "{\"cluster\":$CLUSTER,\"task\":{\"type\":\"worker\",\"index\":$1}}"; }
# The chief's output goes to a file, where the test reads what it saw of the others.
(exec env TF_CONFIG="$(tf 0)" timeout -k 5 "$MW_TIMEOUT_S" "$job" "${args[@]}") >"$chief_out" 2>&1 &
MW_PIDS[0]=$!
mw_start 1 "" "$job" "${args[@]}"
first=${MW_PIDS[1]}
mw_wait_lines "$chief_out" 1 'worker:1 \(rank 1\) joined from' ||
  { echo "FAIL: worker:1 did not join within 60 s"; cat "$chief_out"; exit 1; }
# worker:2 is not started yet: the chief holds worker:1's Join and waits. Kill worker:1's process
# (the child of its `timeout`), as a crash would.
pkill -KILL -P "$first" || { echo "FAIL: worker:1's process was not found"; exit 1; }
wait "$first"
rc=$?
[ "$rc" = 137 ] || { echo "FAIL: worker:1 exited with $rc, expected 137 (SIGKILL)"; exit 1; }
mw_wait_lines "$chief_out" 1 'worker:1 .*dropped out before the view.*it may join again' ||
  { echo "FAIL: the chief did not drop worker:1 within 60 s"; cat "$chief_out"; exit 1; }
echo "worker:1 was killed before the view and dropped; starting it again, and worker:2"
mw_start 1 "" "$job" "${args[@]}"
mw_start 2 "" "$job" "${args[@]}"
for i in 0 1 2; do mw_expect "$i" 0; done
mw_finish
status=$?
echo "what the chief said:"
sed 's/^/[worker:0] /' "$chief_out"
[ "$status" = 0 ] || exit 1
mw_lines "$chief_out" 1 '^worker:0: epoch 1, rank 0 of 3$'
mw_lines "$chief_out" 2 'worker:1 \(rank 1\) joined from'
mw_lines "$chief_out" 1 '^worker:0: final step 12: .*\(ok\)$'
echo "ok"
