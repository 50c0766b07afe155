#!/usr/bin/env bash
# checkpoint_resume_test.sh MODE TRAIN LAUNCH: consort-train --checkpoint-dir, interrupted and
# started again with the same command, ends with the same `weights sha256` line as a run that was
# never interrupted.
#   MODE sigterm: one worker of 2 replicas gets SIGTERM during training; it must save a checkpoint
#                 and exit with 143, and the same command resumes from it. Then the newest
#                 checkpoint is corrupted and the same command falls back to the one before.
#   MODE sigterm_gpu: the same on one GPU replica (GPU:0).
#   MODE sigterm_launch: 2 workers under tools/consort-launch, SIGTERM to the launcher, which
#                 passes it to every worker (status 130, the launcher's); they stop after the
#                 same step, the chief saves, and the same command resumes.
#   MODE sigkill: 2 workers under tools/consort-launch, every process SIGKILLed once the chief has
#                 saved a checkpoint; the same command resumes from the newest good one.
#   MODE restart: 2 workers under tools/consort-launch --max-restarts 1; worker 1 alone is
#                 SIGKILLed once the chief has saved a checkpoint. The launcher stops the other,
#                 starts both again, and they resume from the newest checkpoint: the one command
#                 ends with status 0 and the uninterrupted run's weights.
# Every wait has a deadline: each run is under `timeout`, and the output is read as it comes.
# Exit status: 0 when every check passed, 1 otherwise (the failing check is printed).
set -uo pipefail
mode=$1
stop_status=0
train=$2
launch=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

steps=4000
args=(--steps "$steps" --hidden 64 --layers 1 --no-verify --checkpoint-every 100)
launched=(bash "$launch" -n 2 --timeout 100 -- "$train" --replicas 1 "${args[@]}")
case "$mode" in
  sigterm) command=("$train" --replicas 2 "${args[@]}") signal=TERM stop_status=143 ;;
  sigterm_gpu) command=("$train" --devices GPU:0 "${args[@]}") signal=TERM stop_status=143 ;;
  sigterm_launch) command=("${launched[@]}") signal=TERM stop_status=130 ;;
  sigkill) command=("${launched[@]}") signal=KILL ;;
  restart)
    command=(bash "$launch" -n 2 --timeout 100 --max-restarts 1 -- "$train" --replicas 1 "${args[@]}")
    signal=KILL_WORKER ;;
  *) fail "unknown mode \"$mode\"" ;;
esac

# The sha of a finished run's log: the chief's last line must be the `weights sha256` line (the
# runtime's own log lines, "consort: ...", may follow it).
sha_of() {
  local last
  last=$(sed 's/^\[worker:0\] //' "$1" | grep -v -e '^\[worker:' -e '^consort: ' | tail -1)
  case "$last" in
    "weights sha256: "*) echo "${last#weights sha256: }" ;;
    *) fail "the last line of $1 is not \"weights sha256: HEX\": \"$last\"" ;;
  esac
}

# run LOG DIR: runs the command to its end with --checkpoint-dir DIR; returns its status.
run() {
  timeout 110 "${command[@]}" --checkpoint-dir "$2" >"$1" 2>&1
}

# interrupt LOG DIR SIGNAL: runs the command and, once the chief's first checkpoint line is out,
# sends SIGNAL to it: SIGTERM to the command's process (the demo or the launcher), SIGKILL to
# every process of its group. The deadline is the read's: 110 s without a line kills the group.
interrupt() {
  local log=$1 dir=$2 signal=$3 line sent=0 pid status
  mkfifo "$work/out"
  # In a group of its own (setsid, which execs in place here: the job is not a group leader), so
  # that SIGKILL can reach every process of the job at once.
  setsid "${command[@]}" --checkpoint-dir "$dir" >"$work/out" 2>&1 &
  pid=$!
  exec 3<"$work/out"
  while true; do
    IFS= read -r -t 110 line <&3
    status=$?
    if [ $status -gt 128 ]; then
      kill -KILL -- "-$pid" 2>/dev/null
      fail "no output for 110 s from: ${command[*]}"
    fi
    [ $status = 0 ] || [ -n "$line" ] || break # the end of the output
    echo "$line" >>"$log"
    case "$line" in
      *"saved checkpoint at step "*)
        if [ $sent = 0 ]; then
          sent=1
          if [ "$signal" = KILL ]; then
            kill -KILL -- "-$pid"
          elif [ "$signal" = KILL_WORKER ]; then
            # Worker 1 alone: the launcher's child whose environment says rank 1.
            for child in $(pgrep -P "$pid"); do
              if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx "CONSORT_LAUNCH_RANK=1"; then
                kill -KILL "$child"
                echo "test: SIGKILL to worker 1 (pid $child)" >>"$log"
              fi
            done
          else
            kill -TERM "$pid"
          fi
        fi
        ;;
    esac
  done
  exec 3<&-
  rm -f "$work/out"
  wait "$pid" 2>/dev/null
}

# 1. Uninterrupted.
run "$work/full.log" "$work/full" || fail "the uninterrupted run exited $? ($(cat "$work/full.log"))"
full=$(sha_of "$work/full.log") || fail "$full"
grep -q "saved checkpoint at step $steps:" "$work/full.log" || fail "no checkpoint at the end"

# 2. Interrupted, then the same command again.
if [ "$signal" = KILL_WORKER ]; then
  # One command: the launcher restarts the job, which resumes and ends as the uninterrupted run.
  interrupt "$work/restart.log" "$work/restart" KILL_WORKER
  status=$?
  # The whole log: which worker failed first, and why, is rarely in its last lines.
  [ $status = 0 ] || fail "the restarted job exited $status; its whole output:
$(cat "$work/restart.log")"
  grep -q "^test: SIGKILL to worker 1" "$work/restart.log" || fail "no worker 1 was found to kill"
  grep -q "restarting every worker (restart 1 of 1)" "$work/restart.log" ||
    fail "the launcher did not restart the job"
  resumed_at=$(sed -n 's/^\[worker:0\] resumed from checkpoint at step \([0-9]*\) .*/\1/p' "$work/restart.log")
  [ -n "$resumed_at" ] || fail "the restarted chief did not resume from a checkpoint"
  restarted=$(sha_of "$work/restart.log") || fail "$restarted"
  [ "$restarted" = "$full" ] ||
    fail "restarted at step $resumed_at: weights sha256 $restarted, uninterrupted $full"
  echo "worker 1 killed, the job restarted and resumed from step $resumed_at: weights sha256 $restarted, as uninterrupted"
  echo "checkpoint resume ($mode): OK"
  exit 0
fi
if [ "$signal" = TERM ]; then
  interrupt "$work/cut.log" "$work/cut" TERM
  status=$?
  [ $status = "$stop_status" ] ||
    fail "the run stopped by SIGTERM exited $status, expected $stop_status ($(tail -3 "$work/cut.log"))"
  stopped=$(sed -n 's/^\(\[worker:0\] \)\{0,1\}stopped by SIGTERM after step \([0-9]*\); checkpoint saved$/\2/p' "$work/cut.log")
  [ -n "$stopped" ] || fail "no \"stopped by SIGTERM after step N; checkpoint saved\" line"
  [ "$stopped" -lt "$steps" ] || fail "the run ended (step $stopped) before SIGTERM arrived"
  [ -f "$work/cut/ckpt-$stopped.safetensors" ] || fail "no checkpoint of step $stopped"
  expected_resume=$stopped
else
  interrupt "$work/cut.log" "$work/cut" KILL
  newest=$(ls "$work/cut" | sed -n 's/^ckpt-\([0-9]*\)\.safetensors$/\1/p' | sort -n | tail -1)
  [ -n "$newest" ] || fail "no checkpoint survived the SIGKILL"
  [ "$newest" -lt "$steps" ] || fail "the job ended (step $newest) before the SIGKILL"
  expected_resume=$newest
fi
run "$work/resumed.log" "$work/cut" || fail "the resumed run exited $? ($(tail -3 "$work/resumed.log"))"
grep -q "resumed from checkpoint at step $expected_resume " "$work/resumed.log" ||
  fail "no \"resumed from checkpoint at step $expected_resume\" line: $(grep resumed "$work/resumed.log")"
resumed=$(sha_of "$work/resumed.log") || fail "$resumed"
[ "$resumed" = "$full" ] || fail "resumed from step $expected_resume: weights sha256 $resumed, uninterrupted $full"
echo "resumed from step $expected_resume: weights sha256 $resumed, as uninterrupted"

# 3. (one process, SIGTERM) A corrupted newest checkpoint: the same command warns, takes the one
#    before, and still ends with the same weights.
if [ $stop_status = 143 ]; then
  newest="$work/full/ckpt-$steps.safetensors"
  size=$(stat -c %s "$newest")
  printf '\xff\xff\xff\xff' | dd of="$newest" bs=1 seek=$((size - 4)) conv=notrunc status=none
  run "$work/fallback.log" "$work/full" || fail "the run after the corruption exited $?"
  grep -q "skipping checkpoint \"$newest\" (data_loss)" "$work/fallback.log" ||
    fail "no warning about the corrupted checkpoint"
  grep -q "resumed from checkpoint at step $((steps - 100)) " "$work/fallback.log" ||
    fail "did not fall back to step $((steps - 100))"
  [ "$(sha_of "$work/fallback.log")" = "$full" ] || fail "after the fallback the weights differ"
  echo "a corrupted newest checkpoint: fell back to step $((steps - 100)), same weights"
fi
# 4. (one process, SIGTERM) A checkpoint of a run with other options is refused (status 2), naming
#    the option.
if [ $stop_status = 143 ]; then
  timeout 110 "${command[@]}" --global-batch 256 --checkpoint-dir "$work/full" >"$work/other.log" 2>&1
  status=$?
  [ $status = 2 ] || fail "a run with another --global-batch exited $status, expected 2"
  grep -q "was written by a run with global_batch 512, this one has 256" "$work/other.log" ||
    fail "the refusal does not name the option: $(cat "$work/other.log")"
  echo "a checkpoint of another --global-batch: refused"
fi
echo "checkpoint resume ($mode): OK"
