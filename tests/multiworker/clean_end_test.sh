#!/usr/bin/env bash
# The clean end of a run (issue "lose nothing"): WORKERS workers each do ITERS all-reduces of
# ELEMENTS float32 values through multi_worker_mirrored_strategy, check every result, and return
# from main; RUNS times in a row. A worker that leaves first must not take its peers' last bytes
# with it: every run must pass on every worker.
#
# Usage: clean_end_test.sh MW_JOB LAUNCHER WORKERS ELEMENTS ITERS RUNS
set -uo pipefail
job=$1 launch=$2 workers=$3 elements=$4 iters=$5 runs=$6
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((i = 1; i <= runs; i++)); do
  if ! bash "$launch" -n "$workers" --timeout 120 -- "$job" clean-end "$iters" "$elements" \
      >"$log" 2>&1; then
    failed=$((failed + 1))
    echo "run $i of $runs failed:"
    grep -v "joined from\|received the view\|formed the view" "$log" | tail -20
  fi
done
echo "clean end, $workers workers, $iters all-reduces of $elements float32: $((runs - failed)) of $runs runs passed"
[ "$failed" -eq 0 ]
