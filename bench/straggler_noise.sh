#!/usr/bin/env bash
# straggler_noise.sh: how the live straggler rule (docs/debugging.md, "A straggler") fares against
# the host's scheduling noise. For each step length, RUNS even runs of 3 workers of
# tests/testing/straggler_job under tools/consort-launch (30 steps, nobody slower) and RUNS slow
# ones (20 steps, worker 1 computes 10 % longer), optionally beside LOAD busy loops that take
# cores from the workers. A row says in how many even runs the chief named someone (it should be
# none), in how many slow runs it named worker 1 and no other (it should be all), the step it was
# named at, and how late it was on average.
#
# Usage: bash bench/straggler_noise.sh [--runs 5] [--work-ms "20 100"] [--load 0]
#                                      [--job build/tests/testing/straggler_job]
# Environment such as CONSORT_STRAGGLER_SHARE passes through to the workers.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
runs=5 works="20 100" load=0 job=build/tests/testing/straggler_job
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --work-ms) works=$2; shift 2 ;;
    --load) load=$2; shift 2 ;;
    --job) job=$2; shift 2 ;;
    *) echo "straggler_noise.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -x "$job" ] || { echo "straggler_noise.sh: $job is not built (tools/build.sh)" >&2; exit 2; }
tmp=$(mktemp -d)
loops=()
cleanup() {
  [ ${#loops[@]} -gt 0 ] && kill "${loops[@]}" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
for ((i = 0; i < load; ++i)); do
  (while :; do :; done) &
  loops+=($!)
done

# job_run STEPS WORK_MS SLOW PERCENT: the chief's live straggler lines of one run, or "failed".
job_run() {
  local log="$tmp/run.log"
  if ! timeout 300 tools/consort-launch -n 3 --timeout 120 --dump-dir "$tmp/dumps" -- \
    "$job" "$1" "$2" "$3" "$4" >"$log" 2>&1; then
    echo failed
    return
  fi
  grep -E '^\[worker:0\] consort: straggler: ' "$log"
}

echo "# straggler_noise: 3 workers, $runs even runs (30 steps) and $runs slow ones (20 steps, worker 1 +10 %) per step length; $load busy loops; nproc=$(nproc)"
printf '# %8s %14s %18s %14s %18s %8s\n' "step_ms" "even: named" "slow: w1 alone" "named at" "late (ms)" "failed"
for work in $works; do
  even_named=0 slow_right=0 failed=0 steps="" lates=""
  for ((r = 0; r < runs; ++r)); do
    out=$(job_run 30 "$work" -1 0)
    if [ "$out" = failed ]; then failed=$((failed + 1)); elif [ -n "$out" ]; then even_named=$((even_named + 1)); fi
    out=$(job_run 20 "$work" 1 10)
    if [ "$out" = failed ]; then
      failed=$((failed + 1))
    elif [ "$(grep -c 'straggler: worker:1 ' <<<"$out")" -eq 1 ] && ! grep -qE 'straggler: worker:[02] ' <<<"$out"; then
      slow_right=$((slow_right + 1))
      steps+=" $(grep -oP 'through step \K[0-9]+' <<<"$out")"
      lates+=" $(grep -oP '\), \K[0-9.]+(?= ms)' <<<"$out")"
    fi
  done
  range() { tr ' ' '\n' <<<"$1" | awk 'NF { if (n++ == 0 || $1 < lo) lo = $1; if ($1 > hi) hi = $1 } END { print n ? lo "-" hi : "-" }'; }
  printf '  %8s %14s %18s %14s %18s %8s\n' "$work" "$even_named/$runs" "$slow_right/$runs" "$(range "$steps")" "$(range "$lates")" "$failed"
done
