#!/usr/bin/env bash
# compare_builds.sh: the same benchmarks from two builds of consort, alternated in one sitting,
# so that a change can be held to "no slower" on a noisy machine (issue 30). Each round runs,
# for every case, the old build's program and then the new one's (the order flips every round);
# the p50s of the rounds are pooled per side and printed with new/old.
#
# Cases: the user path (strategy_collective_bench: strategy.run + ctx.all_reduce between worker
# processes under tools/consort-launch) of 4 B and 64 MiB over shared memory and TCP with 2 and 4
# workers, and the in-process step_overhead_bench (an empty step + reduce on 1 and 2 replicas).
#
# Usage:
#   bash bench/compare_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [--rounds 3] [--workers 2,4]
#        [--iters 200] [--large-iters 5] [--out DIR]
# Exit status: 0 when every program ran and every result was right; 1 otherwise; 2 on usage.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
[ $# -ge 2 ] || usage
old=$1 new=$2
shift 2
rounds=3 workers=2,4 iters=200 large_iters=5 out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --large-iters) large_iters=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "compare_builds.sh: unknown option '$1'" >&2; usage ;;
  esac
done
for dir in "$old" "$new"; do
  for prog in strategy_collective_bench step_overhead_bench; do
    [ -x "$dir/bench/$prog" ] ||
      { echo "compare_builds.sh: $dir/bench/$prog is missing; build it first" >&2; exit 2; }
  done
done
[ -n "$out" ] || out=$(mktemp -d /tmp/compare_builds.XXXXXX)
mkdir -p "$out"
echo "# compare_builds: old=$old new=$new rounds=$rounds workers=$workers out=$out"

failed=0
run_side() { # side round case_name command...
  local side=$1 round=$2 name=$3
  shift 3
  local json="$out/$name.$side.$round.json"
  if ! "$@" --json "$json" >"$out/$name.$side.$round.log" 2>&1; then
    echo "FAILED: $side $name round $round (log: $out/$name.$side.$round.log)" >&2
    failed=1
  fi
}

IFS=, read -r -a worker_counts <<<"$workers"
for ((round = 0; round < rounds; round++)); do
  sides=(old new)
  ((round % 2 == 1)) && sides=(new old)
  for n in "${worker_counts[@]}"; do
    for transport in shm tcp; do
      for side in "${sides[@]}"; do
        dir=$old
        [ "$side" = new ] && dir=$new
        CONSORT_TRANSPORT=$transport run_side "$side" "$round" "user_${transport}_${n}" \
          "$root/tools/consort-launch" -n "$n" -- "$dir/bench/strategy_collective_bench" \
          --ops all_reduce --min-bytes 4 --max-bytes 64M --factor 16777216 --iters "$iters" \
          --large-bytes 4M --large-iters "$large_iters"
      done
    done
  done
  for side in "${sides[@]}"; do
    dir=$old
    [ "$side" = new ] && dir=$new
    run_side "$side" "$round" step_overhead "$dir/bench/step_overhead_bench" --replicas 1,2 \
      --iters 2000
  done
done

python3 - "$out" "$rounds" <<'EOF'
import json, glob, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
def add(key, side, value):
    rows.setdefault(key, {"old": [], "new": []})[side].append(value)
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    name, side, _, _ = os.path.basename(path).rsplit(".", 3)
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        continue
    for r in doc.get("results", []):
        if name.startswith("user_"):
            add((name, r["size"], "call p50 us"), side, r["p50_us"])
            if "run_p50_us" in r:
                add((name, r["size"], "run p50 us"), side, r["run_p50_us"])
            if "allocs_per_call" in r:
                add((name, r["size"], "allocs/call"), side, r["allocs_per_call"])
        else:
            if "consort" in r:
                add((name, r.get("replicas", "?"), "step p50 us"), side, r["consort"]["p50_us"])
print("%-16s %10s %-12s %12s %12s %8s" % ("case", "size", "measure", "old", "new", "new/old"))
for key in sorted(rows, key=lambda k: (k[0], str(k[1]), k[2])):
    old = rows[key]["old"]; new = rows[key]["new"]
    if not old or not new:
        continue
    o, n = statistics.median(old), statistics.median(new)
    ratio = n / o if o else float("nan")
    print("%-16s %10s %-12s %12.2f %12.2f %8.3f" % (key[0], key[1], key[2], o, n, ratio))
EOF
exit $failed
