#!/usr/bin/env bash
# Workers given different clusters (issue 35, item 6), as real processes with their own TF_CONFIG:
# the chief refuses the Join of a worker whose cluster differs from its own, and both fail at
# once, with an invalid_argument that names both worker lists and says that the cluster comes
# from TF_CONFIG and must be the same on every task; within a second (times
# CONSORT_TEST_TIME_SCALE), not at the end of their 60 s rendezvous. (1) The worker was given 3
# workers, the chief 2; (2) the chief and worker:2 were given 3, worker:1 only 2 (started once
# worker:2 has joined): worker:2 is aborted with the same message.
#   cluster_mismatch_test.sh MW_JOB
set -u
job=$1
source "$(dirname "$0")/lib.sh"
status=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# The bound on each process's time from constructing the strategy to its error, in ms.
scale=${CONSORT_TEST_TIME_SCALE:-1}
[[ "$scale" =~ ^[0-9]+$ ]] && [ "$scale" -ge 1 ] && [ "$scale" -le 100 ] || scale=1
bound_ms=$((1000 * scale))
rule="the cluster comes from TF_CONFIG \(or the cluster resolver\) and must be the same on every task"
# A list of 2 and of 3 workers, with or without addresses ("worker:0" or "worker:0=host:port").
two='\[worker:0[^],]*, worker:1[^],]*\]'
three='\[worker:0[^],]*, worker:1[^],]*, worker:2[^],]*\]'

# check I CODE REGEX...: worker I's strategy failed with CODE within the bound, and its error
# matches every REGEX.
check() {
  local i=$1 code=$2 line ms re failed=0
  shift 2
  line=$(grep -E -m1 "^\[worker:$i\] join failed after [0-9]+ ms: " "$out")
  if [ -z "$line" ]; then
    echo "FAIL: worker:$i did not report a failed join"
    status=1
    return
  fi
  ms=$(sed -E 's/^.* join failed after ([0-9]+) ms: .*$/\1/' <<<"$line")
  if [ "$ms" -ge "$bound_ms" ]; then
    echo "FAIL: worker:$i failed after $ms ms, expected under $bound_ms ms"
    failed=1
  fi
  if ! grep -qE " ms: $code: " <<<"$line"; then
    echo "FAIL: worker:$i failed with another code than $code"
    failed=1
  fi
  for re in "$@"; do
    if ! grep -qE -- "$re" <<<"$line"; then
      echo "FAIL: worker:$i's error does not match '$re'"
      failed=1
    fi
  done
  if [ "$failed" -eq 0 ]; then
    echo "ok: worker:$i failed after $ms ms, naming both lists"
  else
    status=1
  fi
}

# wait_for_line FILE REGEX SECONDS: returns once a line of FILE (which grows) matches REGEX, or
# fails after SECONDS.
wait_for_line() {
  local fd pid rc
  exec {fd}< <(exec timeout "$3" tail -n +1 -f "$1")
  pid=$!
  grep -m1 -qE -- "$2" <&"$fd"
  rc=$?
  kill "$pid" 2>/dev/null
  exec {fd}<&-
  return $rc
}

echo "== a worker given 3 workers, the chief 2"
mw_cluster 3 127.0.0.1
cluster3=$CLUSTER
mw_cluster 2 127.0.0.1 # the same first two addresses (MW_PORT is kept)
cluster2=$CLUSTER
{
  CLUSTER=$cluster2
  mw_start 0 "" "$job" join-fails 60000 "must be the same on every task"
  CLUSTER=$cluster3
  mw_start 1 "" "$job" join-fails 60000 "must be the same on every task"
  mw_finish
} >"$out" 2>&1 || status=1
cat "$out"
mismatch="worker:1 was given another cluster than the chief \(worker:0\): worker:1 has $three, the chief has $two; $rule"
check 0 invalid_argument "the rendezvous failed: the Join of worker:1" "$mismatch"
check 1 invalid_argument "refused by the chief at 127\.0\.0\.1:" "$mismatch"

echo "== the chief and worker:2 given 3 workers, worker:1 only 2"
MW_PIDS=() MW_EXPECT=() MW_FAILED=0 MW_PORT=$((MW_PORT + 10))
mw_cluster 3 127.0.0.1
cluster3=$CLUSTER
mw_cluster 2 127.0.0.1
cluster2=$CLUSTER
{
  CLUSTER=$cluster3
  mw_start 0 "" "$job" join-fails 60000 "must be the same on every task"
  mw_start 2 "" "$job" join-fails 60000 "must be the same on every task"
  # worker:1 only once worker:2 has joined: a worker that starts after the chief has failed
  # cannot reach it, and waits out its own rendezvous.
  wait_for_line "$out" "worker:0 \(rank 0\): worker:2 \(rank 2\) joined" 30 ||
    echo "FAIL: worker:2 did not join within 30 s"
  CLUSTER=$cluster2
  mw_start 1 "" "$job" join-fails 60000 "must be the same on every task"
  mw_finish
} >"$out" 2>&1 || status=1
cat "$out"
grep -q "^FAIL: worker:2 did not join" "$out" && status=1
mismatch="worker:1 has $two, the chief has $three; $rule"
check 0 invalid_argument "the rendezvous failed: the Join of worker:1" "$mismatch"
check 1 invalid_argument "refused by the chief at 127\.0\.0\.1:" "$mismatch"
# worker:2 joined with the right cluster: the chief aborts its rendezvous with the same message.
check 2 collective_timeout "the rendezvous failed: the Join of worker:1" "$mismatch"

[ "$status" -eq 0 ] && echo "cluster_mismatch_test: ok" || echo "cluster_mismatch_test: FAILED"
exit $status
