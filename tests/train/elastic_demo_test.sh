#!/usr/bin/env bash
# elastic_demo_test.sh TRAIN LAUNCH MODE: the demo as an elastic job (docs/train.md, "Elastic
# training"): 3 workers under tools/consort-launch --elastic 2 --max-restarts 1, and once the
# chief has trained 100 steps, one worker is SIGKILLed.
#   MODE rejoin: worker 2. The other two go on as a group of 2 (each prints "membership: 3 -> 2
#                workers at step S; training resumed T ms after the loss"), the launcher starts
#                worker 2 again under its task, it joins the running group (2 -> 3), and the one
#                command ends with status 0.
#   MODE chief:  worker 0, the chief. Worker 1 succeeds it, the two go on (3 -> 2) and the one
#                command ends with status 0; the chief is not restarted.
# --verify compares the weights after 10 steps (before the kill) with one replica's; what the
# rollback must get right, every step applied once, multiworker.elastic_* checks exactly.
# Every wait has a deadline: the run is under --timeout, and its output is read as it comes.
set -uo pipefail
train=$1
launch=$2
mode=$3
victim=2
[ "$mode" = chief ] && victim=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  [ -f "$work/log" ] && tail -40 "$work/log"
  exit 1
}

mkfifo "$work/out"
bash "$launch" -n 3 --elastic 2 --max-restarts 1 --timeout 100 -- "$train" --replicas 1 \
  --steps 20000 --hidden 64 --layers 1 --elastic 2 --commit-every 10 >"$work/out" 2>&1 &
pid=$!
exec 3<"$work/out"
sent=0
while true; do
  IFS= read -r -t 110 line <&3
  status=$?
  if [ $status -gt 128 ]; then
    kill -KILL "$pid" 2>/dev/null
    fail "no output for 110 s"
  fi
  [ $status = 0 ] || [ -n "$line" ] || break # the end of the output
  echo "$line" >>"$work/log"
  case "$line" in
    "[worker:0] step  100/"*|"[worker:0] step 100/"*)
      if [ $sent = 0 ]; then
        sent=1
        # The victim's first process: the launcher's child whose environment says its rank.
        for child in $(pgrep -P "$pid"); do
          env_of=$(tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null)
          if grep -qx "CONSORT_LAUNCH_RANK=$victim" <<<"$env_of" &&
            grep -qx "CONSORT_RESTART_COUNT=0" <<<"$env_of"; then
            kill -KILL "$child"
            echo "test: SIGKILL to worker $victim (pid $child)" >>"$work/log"
          fi
        done
      fi
      ;;
  esac
done
exec 3<&-
wait "$pid"
status=$?
[ $status = 0 ] || fail "the job exited $status"
grep -q "^test: SIGKILL to worker $victim" "$work/log" || fail "no worker $victim was found to kill"
grep -q "stopping the others" "$work/log" && fail "the launcher stopped the job"
grep -q "MISMATCH" "$work/log" && fail "a verification failed"
if [ "$mode" = rejoin ]; then
  for w in 0 1; do
    # The join may come before a step of the group of 2 completed.
    grep -qE "^\[worker:$w\] membership: 3 -> 2 workers at step [0-9]+; (training resumed [0-9]+ ms after the loss|changed again before a step completed)$" "$work/log" ||
      fail "worker $w printed no 3 -> 2 line"
    grep -qE "^\[worker:$w\] membership: 2 -> 3 workers at step [0-9]+; training resumed [0-9]+ ms after the loss$" "$work/log" ||
      fail "worker $w printed no 2 -> 3 line"
    grep -qE "^\[worker:$w\] verify \(worker [0-9]\): weights after 10 steps .*: OK$" "$work/log" ||
      fail "worker $w did not verify its weights"
  done
  grep -q "restarting it alone, under its task, to rejoin the group (restart 1 of 1)" "$work/log" ||
    fail "the launcher did not restart worker 2 alone"
  grep -qE "^\[worker:2\] verify \(worker [0-9]\): joined the group at step [0-9]+, after the 10 steps" \
    "$work/log" || fail "worker 2 did not say it joined after the steps --verify compares"
else
  for w in 1 2; do
    grep -qE "^\[worker:$w\] membership: 3 -> 2 workers at step [0-9]+; training resumed [0-9]+ ms after the loss$" "$work/log" ||
      fail "worker $w printed no 3 -> 2 line"
    grep -qE "^\[worker:$w\] verify \(worker [0-9]\): weights after 10 steps .*: OK$" "$work/log" ||
      fail "worker $w did not verify its weights"
  done
  grep -q "(the chief) exited with status 137; the next worker succeeds it" "$work/log" ||
    fail "the launcher did not let the others go on without the chief"
  grep -qE "^\[worker:1\] weights sha256: [0-9a-f]{64}$" "$work/log" ||
    fail "the chief's successor did not print the final weights"
fi
grep -E "membership: " "$work/log"
grep -E "verify \(" "$work/log"
echo "elastic demo ($mode): OK"
