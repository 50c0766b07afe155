#!/usr/bin/env bash
# compare_train.sh: the training demo's examples/s from two builds of consort, alternated in one
# sitting, so that a change to the demo or what it calls can be held to "within N %" on a noisy
# machine. Each round runs, for every layout, the old build's consort-train and then the new
# one's (the order flips every round); the examples/s of the rounds are printed with the median
# per side and new/old.
#
# Layouts: 1 replica, 2 replicas in one process, and 2 worker processes of 1 replica under
# tools/consort-launch (shared memory between them); a layout that names GPUs (GPU:0, or
# GPU:0,GPU:1 written GPU:0+GPU:1) runs one process on them. Each run is the demo's default model
# and batch for --steps steps, with --args added to every run's options.
#
# Usage:
#   bash bench/compare_train.sh OLD_BUILD_DIR NEW_BUILD_DIR [--rounds 5] [--steps 300]
#        [--layouts 1,2,2x1] [--args "--hidden 1024 --layers 3"]
# Exit status: 0 when every run printed its examples/s; 1 otherwise; 2 on usage.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
[ $# -ge 2 ] || usage
old=$1 new=$2
shift 2
rounds=5 steps=300 layouts=1,2,2x1 args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --layouts) layouts=$2; shift 2 ;;
    --args) args=$2; shift 2 ;;
    *) echo "compare_train.sh: unknown option '$1'" >&2; usage ;;
  esac
done
for dir in "$old" "$new"; do
  [ -x "$dir/examples/train/consort-train" ] ||
    { echo "compare_train.sh: $dir/examples/train/consort-train is missing; build it first" >&2; exit 2; }
done

# One run of layout $2 with build $1: prints its examples/s (the chief's "trained:" line).
run() {
  local build=$1 layout=$2 program="$1/examples/train/consort-train" log
  case "$layout" in
    GPU*) log=$("$program" --devices "${layout//+/,}" --steps "$steps" $args 2>&1) ;;
    *x*) log=$("$root/tools/consort-launch" -n "${layout%x*}" -- "$program" \
                 --replicas "${layout#*x}" --steps "$steps" $args 2>&1) ;;
    *) log=$("$program" --replicas "$layout" --steps "$steps" $args 2>&1) ;;
  esac
  sed -n 's/^\(\[worker:0\] \)\{0,1\}trained: .*; \([0-9]*\) examples\/s.*/\2/p' <<<"$log"
}

median() { sort -n | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }

status=0
declare -A results
for ((r = 1; r <= rounds; ++r)); do
  for layout in ${layouts//,/ }; do
    order=(old new)
    ((r % 2 == 0)) && order=(new old)
    for side in "${order[@]}"; do
      dir=$old
      [ "$side" = new ] && dir=$new
      value=$(run "$dir" "$layout")
      if [ -z "$value" ]; then
        echo "compare_train.sh: $side build, layout $layout, round $r printed no examples/s" >&2
        status=1
        continue
      fi
      results[$side,$layout]+="$value "
    done
  done
done

echo "# consort-train examples/s, $rounds rounds of $steps steps${args:+ ($args)}, old and new alternated"
echo "# old: $old   new: $new"
printf '%-8s %10s %10s %8s   %s\n' layout old new new/old "rounds (old | new)"
for layout in ${layouts//,/ }; do
  o=$(tr ' ' '\n' <<<"${results[old,$layout]:-}" | sed '/^$/d' | median)
  n=$(tr ' ' '\n' <<<"${results[new,$layout]:-}" | sed '/^$/d' | median)
  ratio=$(awk -v a="${o:-0}" -v b="${n:-0}" 'BEGIN { if (a > 0) printf "%.3f", b / a; else print "-" }')
  printf '%-8s %10s %10s %8s   %s| %s\n' "$layout" "${o:--}" "${n:--}" "$ratio" \
    "${results[old,$layout]:-}" "${results[new,$layout]:-}"
done
exit $status
