#!/usr/bin/env bash
# A worker that gets no CPU for longer than the peer timeout, on a loaded host, is not a hung
# worker (docs/multi_worker.md, "Hung and stopped workers"): 2 workers of elastic_job, not
# elastic, worker:0 on CPU 1 and worker:1 on CPU 0; while the group is idle at step 5, a real-time
# busy loop (SCHED_FIFO) takes CPU 0 for 2.5 s, so that worker:1 is runnable but runs at most
# what the kernel's real-time throttling leaves it (50 ms a second, none where the CPUs share
# their real-time budget). The chief reads /proc, finds worker:1's process waiting for a CPU, and
# waits for it instead of ending the group after 800 ms of silence; both then train to the end.
# Skipped (status 0, saying SKIP) without two CPUs, or where real-time scheduling is not allowed.
set -u
job=$1
source "$(dirname "$0")/lib.sh"
if [ "$(nproc)" -lt 2 ]; then
  echo "SKIP: needs 2 CPUs, this machine has $(nproc)"
  exit 0
fi
if ! chrt -f 10 true 2>/dev/null; then
  echo "SKIP: real-time scheduling (chrt -f) is not allowed here"
  exit 0
fi
mw_cluster 2 127.0.0.1
work=$(mktemp -d)
go="$work/go"
hog=""
trap '[ -n "$hog" ] && kill -KILL "$hog" 2>/dev/null; rm -rf "$work"' EXIT
args=(12 4 0 --wait-for "5:$go")
tf() { echo "{\"cluster\":$CLUSTER,\"task\":{\"type\":\"worker\",\"index\":$1}}"; }
# The chief's output goes to a file, where the test reads what it saw of worker:1.
(exec env TF_CONFIG="$(tf 0)" timeout -k 5 "$MW_TIMEOUT_S" taskset -c 1 "$job" "${args[@]}") \
  >"$work/chief" 2>&1 &
MW_PIDS[0]=$!
mw_start 1 "ELASTIC_JOB_LOG=$work/said" taskset -c 0 "$job" "${args[@]}"
mw_wait_lines "$work/chief" 1 'worker:0: waiting for .* at step 5' ||
  { echo "FAIL: the chief did not reach step 5 within 60 s"; cat "$work/chief"; exit 1; }
mw_wait_lines "$work/said" 1 'worker:1: waiting for .* at step 5' ||
  { echo "FAIL: worker:1 did not reach step 5 within 60 s"; cat "$work/said"; exit 1; }
# The busy loop at real-time priority on worker:1's CPU for 2.5 s, then the group goes on.
timeout -s KILL 2.5 chrt -f 50 taskset -c 0 bash -c 'while :; do :; done' &
hog=$!
wait "$hog"
hog=""
touch "$go"
for i in 0 1; do mw_expect "$i" 0; done
mw_finish
status=$?
echo "what the chief said:"
sed 's/^/[worker:0] /' "$work/chief"
[ "$status" = 0 ] || exit 1
# It was silent past the timeout, seen waiting for a CPU, and heard again: not a loss.
grep -qE 'worker:1 \(rank 1\) sent no heartbeat for [0-9]+ ms, but its process \(pid [0-9]+\) on this host is runnable, waiting for a CPU' "$work/chief" ||
  { echo "FAIL: the chief never found worker:1 silent and waiting for a CPU (was it starved?)"; exit 1; }
grep -qE 'heard from worker:1 \(rank 1\) again after [0-9]+ ms of silence' "$work/chief" ||
  { echo "FAIL: the chief did not say it heard from worker:1 again"; exit 1; }
mw_lines "$work/chief" 0 'lost worker:1'
mw_lines "$work/chief" 1 '^worker:0: final step 12: .*\(ok\)$'
echo "ok"
