#!/usr/bin/env bash
# mpi_peer.sh: consort's user path against Open MPI on this host, in one sitting (issue 38): the
# p50 of one float32 SUM all-reduce as strategy_collective_bench times ctx.all_reduce inside
# strategy.run (one CPU replica per worker, under tools/consort-launch, shared memory), beside
# mpi_allreduce_bench's MPI_Allreduce under mpirun (Open MPI's vader on one host). Two consort
# columns: its waits as chosen (yield_when_idle automatic: on when the workers outnumber the
# cores) and with yielding off (CONSORT_YIELD_WHEN_IDLE=0, the wait before it existed). The three
# programs alternate, the order rotating each round, and each p50 is the median of the rounds'.
#
# Usage: bash bench/mpi_peer.sh [--np "2 4"] [--max-bytes 1M] [--iters 300] [--rounds 3]
#                               [--bin-dir build/bench]
# Needs mpirun and mpi_allreduce_bench (built where Open MPI's headers are: libopenmpi-dev).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
nps="2 4" max_bytes=1M iters=300 rounds=3 bin=build/bench
while [ $# -gt 0 ]; do
  case "$1" in
    --np) nps=$2; shift 2 ;;
    --max-bytes) max_bytes=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --bin-dir) bin=$2; shift 2 ;;
    *) echo "mpi_peer.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
for need in "$bin/strategy_collective_bench" "$bin/mpi_allreduce_bench"; do
  [ -x "$need" ] || { echo "mpi_peer.sh: $need is not built (mpi_allreduce_bench needs libopenmpi-dev)" >&2; exit 2; }
done
command -v mpirun >/dev/null || { echo "mpi_peer.sh: mpirun not found (openmpi-bin)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# run_one KIND NP ROUND: one sweep, its "size p50" rows in $tmp/KIND.NP.ROUND
run_one() {
  local kind=$1 np=$2 round=$3 out="$tmp/$1.$2.$3"
  case "$kind" in
    mpi)
      timeout 300 mpirun --allow-run-as-root --oversubscribe -np "$np" "$bin/mpi_allreduce_bench" \
        --max-bytes "$max_bytes" --iters "$iters" --warmup 50 2>&1 |
        awk '$1 ~ /^[0-9]+$/ {print $1, $2}' >"$out" ;;
    consort|consort_noyield)
      local env=()
      [ "$kind" = consort_noyield ] && env=(CONSORT_YIELD_WHEN_IDLE=0)
      # The p50 from rank 0's JSON (to the nanosecond; the printed table rounds to 0.1 us).
      env "${env[@]}" timeout 300 bash tools/consort-launch -n "$np" --timeout 280 -- \
        "$bin/strategy_collective_bench" --ops all_reduce --max-bytes "$max_bytes" \
        --iters "$iters" --warmup 50 --json "$out.json" >/dev/null 2>&1
      [ -s "$out.json" ] && python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["size"], r["p50_us"])' "$out.json" >"$out" ;;
  esac
  [ -s "$out" ] || echo "mpi_peer.sh: $kind np=$np round $round printed no rows" >&2
}

kinds=(consort consort_noyield mpi)
echo "# mpi_peer.sh: $(nproc) CPUs, $(mpirun --version 2>&1 | head -1), max $max_bytes, $iters iterations, $rounds rounds, $(date -u +%F)"
for np in $nps; do
  for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < 3; k++)); do run_one "${kinds[$(((k + r) % 3))]}" "$np" "$r"; done
  done
  echo
  echo "## np=$np: all_reduce p50 (us), median of $rounds rounds"
  printf "%10s %12s %16s %12s %14s %14s\n" "size (B)" "consort" "consort no-yield" "Open MPI" \
    "consort / MPI" "no-yield / MPI"
  python3 - "$tmp" "$np" "$rounds" <<'PY'
import statistics, sys
tmp, np, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(kind):
    by_size = {}
    for r in range(rounds):
        try:
            for line in open(f"{tmp}/{kind}.{np}.{r}"):
                size, p50 = line.split()
                by_size.setdefault(int(size), []).append(float(p50))
        except FileNotFoundError:
            pass
    return {s: statistics.median(v) for s, v in by_size.items()}
c, n, m = load("consort"), load("consort_noyield"), load("mpi")
for size in sorted(set(c) & set(m)):
    nv = n.get(size, float("nan"))
    print(f"{size:10d} {c[size]:12.2f} {nv:16.2f} {m[size]:12.2f} {c[size] / m[size]:14.2f} {nv / m[size]:14.2f}")
PY
done
