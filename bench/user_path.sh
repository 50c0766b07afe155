#!/usr/bin/env bash
# user_path.sh: the cross-worker collectives three ways in one run (issues 12 and 16), for N
# workers on this host: consort's user path (strategy_collective_bench:
# multi_worker_mirrored_strategy, strategy.run + ctx.all_reduce) once per transport the workers
# can use (shared memory and TCP, set with CONSORT_TRANSPORT), consort's raw algorithm over its TCP
# transport (collective_tcp_bench) and torch.distributed's gloo (torch_gloo_bench.py). Prints one
# table per collective: size | user path p50 per transport | whole strategy.run p50 | raw p50 |
# gloo p50 | each user path / raw | each / gloo, then the issues' target rows.
#
# Usage:
#   bash bench/user_path.sh N [--min-bytes 4] [--max-bytes 64M] [--factor 4] [--warmup 2]
#        [--iters 25] [--large-bytes 4M] [--large-iters 5] [--rounds 4]
#        [--ops all_reduce,all_gather,broadcast] [--bin-dir build/bench] [--gloo auto|off]
#        [--out DIR] [--timeout SECONDS] [--max-other 0.3] [--retries 2] [--transports shm,tcp]
#        [--step-barriers 2] [--dtype float32|float16|bfloat16]
#
# --dtype: the element type of the user path's tensors (strategy_collective_bench --dtype); a row
# of S bytes then holds S/2 16-bit elements, so rows move the same bytes whatever the type. The
# raw algorithm and gloo always move float32: with a 16-bit --dtype, compare the user path with
# a float32 run of this script rather than with those columns.
#
# --step-barriers: the user path's in-step barriers before its timed call (see
# strategy_collective_bench.cpp): 2 starts the call as the raw algorithm's bench does, after a
# call made in step with the peers; 1 times the first call after the skew of the step starts.
#
# Interleaving: every round runs, for each collective, the three programs one after the other
# (each a full sweep of that collective's sizes under tools/consort-launch), the order rotating
# from one collective and round to the next, so that a burst of noise on the machine lands on
# every side. A p50 is over the samples of all rounds pooled (each program writes every sample
# to its JSON; python3 with its standard library merges them). Sizes from --large-bytes on run
# --large-iters iterations instead of --iters, to keep the 64 MiB rows affordable.
#
# Noise: the driver measures, for every program it runs, the CPU time that other work on the
# machine took meanwhile (the machine's busy time from /proc/stat less the run's own) and prints
# it in CPUs; a run that saw more than --max-other CPUs of other work is run again, up to
# --retries times, and flagged NOISY when it still does.
#
# torch: the first of $TORCH_PYTHON, python3, /usr/bin/python3 that can import torch.distributed
# with gloo (Debian's python3-torch installs into /usr/bin/python3). When none can, or with
# --gloo off, the driver says so and leaves the gloo column out. The JSON files and every
# program's log stay in --out (default: a new directory under /tmp, printed).
# Exit status: 0 when every program ran and every result was right; 1 otherwise; 2 on usage.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
workers=$1
shift
[[ "$workers" =~ ^[0-9]+$ ]] && [ "$workers" -ge 2 ] ||
  { echo "user_path.sh: N must be a worker count >= 2, got '$workers'" >&2; exit 2; }
min_bytes=4 max_bytes=64M factor=4 warmup=2 iters=25 large_bytes=4M large_iters=5 rounds=4
ops=all_reduce,all_gather,broadcast
bin_dir=${BUILD_DIR:-$root/build}/bench
gloo=auto out="" timeout_s=900 max_other=0.3 retries=2 transports=shm,tcp step_barriers=2
dtype=float32
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "user_path.sh: option $1 needs a value" >&2; exit 2; }
  case "$1" in
    --min-bytes) min_bytes=$2 ;;
    --max-bytes) max_bytes=$2 ;;
    --factor) factor=$2 ;;
    --warmup) warmup=$2 ;;
    --iters) iters=$2 ;;
    --large-bytes) large_bytes=$2 ;;
    --large-iters) large_iters=$2 ;;
    --rounds) rounds=$2 ;;
    --ops) ops=$2 ;;
    --bin-dir) bin_dir=$2 ;;
    --gloo) gloo=$2 ;;
    --out) out=$2 ;;
    --timeout) timeout_s=$2 ;;
    --max-other) max_other=$2 ;;
    --retries) retries=$2 ;;
    --transports) transports=$2 ;;
    --step-barriers) step_barriers=$2 ;;
    --dtype) dtype=$2 ;;
    *) echo "user_path.sh: unknown option '$1'" >&2; usage ;;
  esac
  shift 2
done
[[ "$rounds" =~ ^[0-9]+$ ]] && [ "$rounds" -ge 1 ] ||
  { echo "user_path.sh: --rounds needs a count >= 1, got '$rounds'" >&2; exit 2; }
case "$gloo" in auto|off) ;; *) echo "user_path.sh: --gloo is auto or off" >&2; exit 2 ;; esac
IFS=, read -r -a transport_list <<<"$transports"
[ "${#transport_list[@]}" -ge 1 ] || { echo "user_path.sh: --transports is empty" >&2; exit 2; }
case "$dtype" in float32|float16|bfloat16) ;; *) echo "user_path.sh: --dtype is float32, float16 or bfloat16, got '$dtype'" >&2; exit 2 ;; esac
for t in "${transport_list[@]}"; do
  case "$t" in shm|tcp) ;; *) echo "user_path.sh: --transports takes shm and tcp, got '$t'" >&2; exit 2 ;; esac
done

launcher=$root/tools/consort-launch
user_bin=$bin_dir/strategy_collective_bench
raw_bin=$bin_dir/collective_tcp_bench
for b in "$user_bin" "$raw_bin"; do
  [ -x "$b" ] || {
    echo "user_path.sh: $b is not built (BUILD_DIR=build bash tools/build.sh --target" \
      "strategy_collective_bench collective_tcp_bench), or pass --bin-dir" >&2
    exit 1
  }
done
command -v python3 >/dev/null || { echo "user_path.sh: python3 is needed to merge the results" >&2; exit 1; }

# The interpreter for the gloo peer, if any.
torch_py=""
gloo_note=""
if [ "$gloo" = off ]; then
  gloo_note="torch gloo: skipped (--gloo off)"
else
  why=""
  for py in ${TORCH_PYTHON:-} python3 /usr/bin/python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    if msg=$("$py" -c 'import torch, torch.distributed as d
assert d.is_available() and d.is_gloo_available(), "torch.distributed has no gloo"
print(torch.__version__)' 2>&1); then
      torch_py=$py
      gloo_note="torch gloo: torch $msg with $py, one intra-op thread per rank"
      break
    fi
    why+="${why:+; }$py: $(tail -n 1 <<<"$msg")"
  done
  [ -n "$torch_py" ] || gloo_note="torch gloo: SKIPPED, no python can import torch.distributed with gloo ($why); the gloo column is left out"
fi

[ -n "$out" ] || out=$(mktemp -d /tmp/user_path.XXXXXX)
mkdir -p "$out" && rm -f "$out"/{user,user-shm,user-tcp,raw,gloo}_*_r*.json || exit 1
common=(--min-bytes "$min_bytes" --max-bytes "$max_bytes" --factor "$factor" --warmup "$warmup"
  --iters "$iters" --large-bytes "$large_bytes" --large-iters "$large_iters")

echo "# consort user_path.sh  workers=$workers transports=$transports dtype=$dtype (user path; raw and gloo: float32) rounds=$rounds ops=$ops sizes=$min_bytes..$max_bytes x$factor warmup=$warmup iters=$iters (from $large_bytes: $large_iters)"
echo "# machine: nproc=$(nproc) cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) load=$(cut -d' ' -f1-3 /proc/loadavg)"
echo "# commit: $(git -C "$root" log -1 --format='%h %s' 2>/dev/null | cut -c1-90)"
echo "# $gloo_note"
echo "# results and logs: $out"

failed=0
noisy=0
tick=$(getconf CLK_TCK 2>/dev/null || echo 100)
# Busy CPU time of the whole machine (user, nice, system, irq, softirq, steal), in ticks.
machine_busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; }
# CPU time of this shell's finished children (cutime + cstime), in ticks: a launch's workers.
our_busy() { awk '{print $16 + $17}' "/proc/$$/stat"; }

# run_one NAME OP ROUND COMMAND...: one program under the launcher, its log and JSON in $out.
# It also measures the CPU time that other work on the machine took meanwhile (busy time of the
# machine less the run's own), and runs the program again, up to --retries times, while that
# exceeds --max-other CPUs; the last attempt counts.
run_one() {
  local name=$1 op=$2 round=$3
  shift 3
  local log=$out/${name}_${op}_r${round}.log json=$out/${name}_${op}_r${round}.json
  local attempt rc other note
  for ((attempt = 0; attempt <= retries; attempt++)); do
    rm -f "$json"
    local t0 b0 c0 t1 b1 c1
    t0=$(date +%s%N) b0=$(machine_busy) c0=$(our_busy)
    "$launcher" -n "$workers" --timeout "$timeout_s" -- "$@" --ops "$op" --json "$json" >"$log" 2>&1
    rc=$?
    t1=$(date +%s%N) b1=$(machine_busy) c1=$(our_busy)
    other=$(awk -v b=$((b1 - b0 - (c1 - c0))) -v ns=$((t1 - t0)) -v hz="$tick" \
      'BEGIN {v = b / (ns / 1e9 * hz); printf "%.2f", v < 0 ? 0 : v}')
    note=""
    if [ $rc -ne 0 ]; then
      note="  FAILED (exit $rc), last lines of $log:"
    elif awk -v o="$other" -v m="$max_other" 'BEGIN {exit !(o > m)}'; then
      if [ "$attempt" -lt "$retries" ]; then note="  other work > $max_other CPUs: again"; else
        note="  NOISY: other work > $max_other CPUs after $retries retries; kept"
        noisy=$((noisy + 1))
      fi
    fi
    printf '#   round %d %-10s %-5s %4d s  other work %4s CPUs%s\n' "$round" "$op" "$name" \
      $(((t1 - t0) / 1000000000)) "$other" "$note"
    [ $rc -eq 0 ] && [ -z "$note" ] && break
    [ $rc -ne 0 ] && break
  done
  if [ $rc -ne 0 ]; then
    tail -n 15 "$log" | sed 's/^/#     /'
    failed=1
  fi
}

IFS=, read -r -a op_list <<<"$ops"
programs=()
for t in "${transport_list[@]}"; do programs+=("user-$t"); done
programs+=(raw)
[ -n "$torch_py" ] && programs+=(gloo)
limits=1
for ((r = 1; r <= rounds; r++)); do
  for ((o = 0; o < ${#op_list[@]}; o++)); do
    op=${op_list[$o]}
    k=${#programs[@]}
    for ((i = 0; i < k; i++)); do
      p=${programs[$(((i + r - 1 + o) % k))]}
      case $p in
        user-*) CONSORT_TRANSPORT=${p#user-} run_one "$p" "$op" "$r" "$user_bin" "${common[@]}" \
          --step-barriers "$step_barriers" --dtype "$dtype" ;;
        raw)
          # The TCP limits (stream, ping-pong) once, on the first raw run.
          run_one raw "$op" "$r" "$raw_bin" "${common[@]}" --limits "$limits"
          limits=0 ;;
        gloo) run_one gloo "$op" "$r" "$torch_py" "$root/bench/torch_gloo_bench.py" "${common[@]}" ;;
      esac
    done
  done
done

echo "# load average after the runs: $(cut -d' ' -f1-3 /proc/loadavg); runs kept with other work > $max_other CPUs: $noisy"
python3 - "$out" "$workers" "$ops" "$transports" <<'EOF' || failed=1
import glob, json, math, os, sys

out, workers, ops = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
users = ["user-" + t for t in sys.argv[4].split(",")]

def p50(values):
    s = sorted(values)
    if not s:
        return None
    return s[min(max(math.ceil(0.5 * len(s)), 1), len(s)) - 1]

# samples[(program, op, size)] -> pooled samples (us); runs[(program, op, size)] -> whole
# strategy.run; per_round[(program, op, size)] -> the p50 of each round
samples, runs, per_round, wrong, limits = {}, {}, {}, 0, None
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    program = os.path.basename(path).split("_")[0]
    with open(path) as f:
        doc = json.load(f)
    wrong += doc.get("out_of_bounds", 0)
    machine = doc.get("machine", {})
    if "tcp_stream_gbs" in machine:
        limits = machine
    for row in doc["results"]:
        key = (program, row["op"], row["size"])
        samples.setdefault(key, []).extend(row["samples_us"])
        per_round.setdefault(key, []).append(p50(row["samples_us"]))
        if "run_samples_us" in row:
            runs.setdefault(key, []).extend(row["run_samples_us"])

have_gloo = any(k[0] == "gloo" for k in samples)
def fmt(v, width=11, decimals=1):
    return ("%*.*f" % (width, decimals, v)) if v is not None else "%*s" % (width, "-")
def ratio(a, b):
    return a / b if a is not None and b else None
def short(program):
    return program.split("-", 1)[1]

print("#")
if limits:
    print("# TCP limits (raw run, ranks 0 <-> 1, blocking sockets): stream %.2f GB/s, 8-byte "
          "ping-pong p50 %.1f us" % (limits["tcp_stream_gbs"], limits["pingpong_p50_us"]))
print("# p50 in us over every sample of every round; shm / tcp = the ctx.<collective> call inside "
      "the step with CONSORT_TRANSPORT=shm / tcp,")
print("# run = the whole strategy.run (first transport), raw = collective_tcp_bench "
      "(transport/algorithms over transport/tcp),")
print("# gloo = torch.distributed gloo; rank 0 after a barrier (user path: --step-barriers in the step)")
found = {}
for op in ops:
    sizes = sorted({k[2] for k in samples if k[1] == op})
    if not sizes:
        continue
    print("#\n# %s, %d workers" % (op, workers))
    head = ["size (B)"] + ["%s p50" % short(u) for u in users] + ["run p50", "raw p50", "gloo p50"]
    head += ["%s/raw" % short(u) for u in users] + ["%s/gloo" % short(u) for u in users]
    print("#" + " ".join("%11s" % h for h in head[:len(users) + 4]) + " " +
          " ".join("%9s" % h for h in head[len(users) + 4:]))
    for size in sizes:
        u = {prog: p50(samples.get((prog, op, size), [])) for prog in users}
        run = p50(runs.get((users[0], op, size), []))
        raw = p50(samples.get(("raw", op, size), []))
        g = p50(samples.get(("gloo", op, size), [])) if have_gloo else None
        found[(op, size)] = (u, raw, g)
        cells = [fmt(u[prog]) for prog in users] + [fmt(run), fmt(raw), fmt(g)]
        cells += [fmt(ratio(u[prog], raw), 9, 2) for prog in users]
        cells += [fmt(ratio(u[prog], g), 9, 2) for prog in users]
        print(" %11d %s" % (size, " ".join(cells)))

print("#\n# Targets (issues 12 and 16; these compare p50s of this run)")
small = min((s for (o, s) in found if o == "all_reduce"), default=None)
large = (64 << 20) if ("all_reduce", 64 << 20) in found else None
# Against the raw TCP algorithm, the user path over the same transport.
same = "user-tcp" if "user-tcp" in users else users[0]
def verdict(v, limit):
    return "-" if v is None else ("met" if v <= limit else "NOT MET")
def show(v):
    return "-" if v is None else "%.2f" % v
def rounds_of(op, size):
    parts = []
    for program in users + ["raw", "gloo"]:
        if (program, op, size) in per_round:
            parts.append("%s %s" % (program, " ".join("%.1f" % v for v in
                                                      per_round[(program, op, size)])))
    print("#     p50 of each round (us): " + "; ".join(parts))
if small is not None:
    u, raw, g = found[("all_reduce", small)]
    print("#   all_reduce %d B, %d workers: %s/raw %s <= 2: %s" %
          (small, workers, short(same), show(ratio(u[same], raw)),
           verdict(ratio(u[same], raw), 2.0)))
    rounds_of("all_reduce", small)
    if workers == 2:
        for prog in users:
            if g is not None:
                print("#   all_reduce %d B, 2 workers: %s/gloo %s <= 0.5: %s" %
                      (small, short(prog), show(ratio(u[prog], g)),
                       verdict(ratio(u[prog], g), 0.5)))
            else:
                print("#   all_reduce %d B, 2 workers: %s/gloo <= 0.5: not evaluated (no gloo "
                      "run)" % (small, short(prog)))
if large is not None:
    u, raw, g = found[("all_reduce", large)]
    print("#   all_reduce 64 MiB, %d workers: %s/raw %s <= 1.1: %s" %
          (workers, short(same), show(ratio(u[same], raw)), verdict(ratio(u[same], raw), 1.1)))
    # Issue 16: over TCP at most gloo's time, over shared memory at most 0.6 of it.
    for prog, limit in (("user-tcp", 1.0), ("user-shm", 0.6)):
        if prog in users:
            print("#   all_reduce 64 MiB, %d workers: %s/gloo %s <= %.1f: %s" %
                  (workers, short(prog), show(ratio(u[prog], g)), limit,
                   verdict(ratio(u[prog], g), limit) if g is not None else "not evaluated "
                   "(no gloo run)"))
    rounds_of("all_reduce", large)
else:
    print("#   all_reduce 64 MiB: not evaluated (needs --max-bytes 64M)")
print("# Out of bounds values : %d %s" % (wrong, "OK" if wrong == 0 else "FAILED"))
sys.exit(0 if wrong == 0 else 1)
EOF

[ "$failed" -eq 0 ] || echo "# FAILED: a program failed or a result was wrong (logs in $out)"
exit "$failed"
