#!/usr/bin/env bash
# Elastic re-formation, measured over real processes (issue 32's targets; bench/README.md,
# "Elastic re-formation"):
#   - from a SIGKILL of 1 of W workers (inside a step, while the others are in its all-reduce) to
#     the step the others complete first after re-forming without it;
#   - from the start of the killed worker's new process to its first step in the running group.
# Each run is W processes of tests/multiworker/elastic_job (60 steps, a commit every 4, worker V
# dies in step 20, the group waits for it to rejoin at step 40; V cycles over 1..W-1: the chief
# leads the group and is not killed). The times come from the monotonic clock, which every process
# of the machine shares: the victim prints when it raises SIGKILL, the others when their first
# step after the change completed.
#
#   bash bench/elastic_bench.sh [BUILD_DIR] [RUNS] [WORKERS] [TRANSPORT] [VICTIM]
#     defaults: build 20 4 shm worker
#   VICTIM chief: the chief is the one killed instead (the first worker after it succeeds it);
#   nothing restarts, so the last column is empty.
#   VICTIM hang: the victim is stopped (SIGSTOP, every thread) for 2 s instead of killed: the
#   others find it by its silence (peer_timeout, 800 ms by default) and go on; continued, it
#   learns it was left out and its reform joins them again in the same process (no restart). The
#   first columns then measure SIGSTOP -> step, and the last one the victim's own rejoin: from
#   learning it was left out to its first step in the group.
set -uo pipefail
build=${1:-build}
runs=${2:-20}
workers=${3:-4}
transport=${4:-shm}
victim_kind=${5:-worker}
case "$victim_kind" in worker | chief | hang) ;; *) echo "VICTIM is worker, chief or hang, not $victim_kind" >&2; exit 2 ;; esac
job="$build/tests/multiworker/elastic_job"
[ -x "$job" ] || { echo "no $job: build first (bash tools/build.sh)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../tests/multiworker/lib.sh"
MW_TIMEOUT_S=60
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
survivors=$((workers - 1))

printf '%-4s %-7s %22s %22s %16s\n' run victim "kill->all resumed ms" "kill->first resumed ms" "rejoin ms"
all=()
first=()
rejoin=()
for ((r = 0; r < runs; r++)); do
  victim=$((1 + r % survivors))
  [ "$victim_kind" = chief ] && victim=0
  said="$work/said.$r"
  : >"$said"
  MW_PORT="" MW_PIDS=() MW_EXPECT=() MW_FAILED=0
  unset MW_PORT
  mw_cluster "$workers" 127.0.0.1
  env="CONSORT_TRANSPORT=$transport ELASTIC_JOB_LOG=$said"
  args=(60 4 "$survivors" --die "$victim:20" --regrow "$workers:40")
  [ "$victim_kind" = chief ] && args=(60 4 "$survivors" --die 0:20)
  [ "$victim_kind" = hang ] && args=(60 4 "$survivors" --stop "$victim:20:2000" --regrow "$workers:40")
  for ((i = 0; i < workers; i++)); do
    mw_start "$i" "$env" "$job" "${args[@]}" >"$work/out.$r.$i" 2>&1
  done
  # A killed victim's process ends; a stopped one goes on and rejoins in its process.
  [ "$victim_kind" = hang ] || { wait "${MW_PIDS[$victim]}"; } 2>/dev/null
  if ! mw_wait_lines "$said" "$survivors" "$workers -> $survivors workers"; then
    echo "run $r: the others did not go on without worker:$victim; its log:" >&2
    cat "$said" "$work"/out."$r".* >&2
    exit 1
  fi
  if [ "$victim_kind" = hang ]; then
    mw_expect "$victim" 0
  elif [ "$victim_kind" != chief ]; then
    mw_start "$victim" "$env ELASTIC_JOB_RESTARTED=1" "$job" "${args[@]}" >"$work/out.$r.$victim.2" 2>&1
    mw_expect "$victim" 0
  else
    mw_expect 0 137
  fi
  if ! mw_finish >/dev/null; then
    echo "run $r: a worker failed; what they said:" >&2
    cat "$said" "$work"/out."$r".* >&2
    exit 1
  fi
  killed=$(sed -n 's/.*: \(killed\|stopped\) at \([0-9]*\).*$/\2/p' "$said")
  read -r worst best < <(sed -n "s/.*: membership: $workers -> $survivors workers.*(at \\([0-9]*\\))\$/\\1/p" "$said" |
    awk -v k="$killed" 'NR == 1 {max = $1; min = $1} {if ($1 > max) max = $1; if ($1 < min) min = $1}
                        END {printf "%.3f %.3f\n", (max - k) / 1e6, (min - k) / 1e6}')
  back=$(sed -n 's/.*: started at \([0-9]*\), first step in the group at \([0-9]*\)$/\1 \2/p' "$said" |
    awk '{printf "%.3f\n", ($2 - $1) / 1e6}')
  [ "$victim_kind" = hang ] &&
    back=$(sed -n "s/^worker:$victim: membership: $workers -> $workers workers.*training resumed \([0-9]*\) ms after.*/\1/p" "$said")
  printf '%-4s %-7s %22s %22s %16s\n' "$r" "worker:$victim" "$worst" "$best" "$back"
  all+=("$worst")
  first+=("$best")
  [ -n "$back" ] && rejoin+=("$back")
done

# percentile P VALUES...: the nearest-rank percentile.
percentile() {
  local p=$1
  shift
  printf '%s\n' "$@" | sort -g | awk -v p="$p" '{v[NR] = $1} END {i = int((p * NR + 99) / 100); if (i < 1) i = 1; print v[i]}'
}
echo
echo "$runs runs, $workers workers over $transport, 1 replica each, the victim: $victim_kind:"
printf '%-34s %10s %10s %10s\n' "" p50 p99 max
signal=SIGKILL
[ "$victim_kind" = hang ] && signal=SIGSTOP
printf '%-34s %10s %10s %10s\n' "$signal -> every survivor's step" "$(percentile 50 "${all[@]}")" "$(percentile 99 "${all[@]}")" "$(percentile 100 "${all[@]}")"
printf '%-34s %10s %10s %10s\n' "$signal -> first survivor's step" "$(percentile 50 "${first[@]}")" "$(percentile 99 "${first[@]}")" "$(percentile 100 "${first[@]}")"
if [ "${#rejoin[@]}" -gt 0 ]; then
  rejoin_label="restart -> its first step in group"
  [ "$victim_kind" = hang ] && rejoin_label="left out -> its first step in group"
  printf '%-34s %10s %10s %10s\n' "$rejoin_label" "$(percentile 50 "${rejoin[@]}")" "$(percentile 99 "${rejoin[@]}")" "$(percentile 100 "${rejoin[@]}")"
fi
echo "(milliseconds; target: p99 of the first row <= 1000 ms)"
