#!/usr/bin/env bash
# Fuzzes the decoders of untrusted bytes (docs/fuzzing.md): builds the libFuzzer targets of
# tests/fuzz/ with clang in ${FUZZ_BUILD_DIR:-build-fuzz}, writes their seed corpora with the
# real encoders, and runs each target for SECONDS (default 60), both at once.
#
# Usage: tools/fuzz.sh [SECONDS]
# Exit status: 0 when no target found anything; 1 on any finding (crash, sanitizer report,
# property violation, leak, timeout, out-of-memory), with the reproducer's path printed.
# Installs clang-14, libclang-rt-14-dev (libFuzzer, ASan, UBSan) and llvm-14 (the symbolizer)
# when missing, as root or with sudo, like tools/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -lt 1 ]; then
  echo "usage: $0 [SECONDS]" >&2
  exit 2
fi
build_dir=${FUZZ_BUILD_DIR:-build-fuzz}
started=$(date +%s)

# -- tools -----------------------------------------------------------------------------------------

bash tools/setup.sh
packages=(clang-14 libclang-rt-14-dev llvm-14)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "fuzz: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  echo "fuzz: installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# -- build -----------------------------------------------------------------------------------------

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
CC=clang-14 CXX=clang++-14 cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCONSORT_BUILD_FUZZ=ON -DCONSORT_BUILD_TESTS=OFF -DCONSORT_BUILD_BENCH=OFF \
  -DCONSORT_BUILD_EXAMPLES=OFF -DCONSORT_WITH_CUDA=OFF "${launcher[@]}" >/dev/null
cmake --build "$build_dir" --target wire_fuzz membership_codec_fuzz make_seeds
built=$(date +%s)

# -- seeds -----------------------------------------------------------------------------------------

bin="$build_dir/tests/fuzz"
work="$build_dir/fuzz"
rm -rf "$work/seeds" "$work/findings" "$work/logs"
mkdir -p "$work/seeds" "$work/findings" "$work/logs" "$work/corpus/wire_fuzz" \
  "$work/corpus/membership_codec_fuzz"
"$bin/make_seeds" "$work/seeds/wire_fuzz" "$work/seeds/membership_codec_fuzz"

# -- fuzzing ---------------------------------------------------------------------------------------

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
command -v llvm-symbolizer-14 >/dev/null && export ASAN_SYMBOLIZER_PATH=$(command -v llvm-symbolizer-14)

# run TARGET MAX_LEN: fuzzes TARGET for $seconds; the working corpus (kept between local runs)
# comes first, so that new inputs go there and not among the seeds.
run() {
  local target=$1 max_len=$2
  "$bin/$target" "$work/corpus/$target" "$work/seeds/$target" \
    -max_total_time="$seconds" -max_len="$max_len" -timeout=25 -rss_limit_mb=2048 \
    -malloc_limit_mb=64 -print_final_stats=1 \
    -artifact_prefix="$work/findings/$target-" >"$work/logs/$target.log" 2>&1
}

declare -A pids
run wire_fuzz 1024 & pids[wire_fuzz]=$!
run membership_codec_fuzz 16384 & pids[membership_codec_fuzz]=$!

status=0
for target in wire_fuzz membership_codec_fuzz; do
  rc=0
  wait "${pids[$target]}" || rc=$?
  log="$work/logs/$target.log"
  echo "== $target (exit $rc; log $log)"
  grep -E "^#[0-9]+[[:space:]]+DONE|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)" \
    "$log" || true
  shopt -s nullglob
  findings=("$work/findings/$target-"*)
  shopt -u nullglob
  if [ "$rc" -ne 0 ] || [ ${#findings[@]} -gt 0 ]; then
    status=1
    echo "fuzz: $target FOUND A PROBLEM; the end of its log:"
    tail -n 60 "$log"
    for f in "${findings[@]}"; do
      echo "fuzz: reproducer: $f"
      echo "fuzz:   replay with: $bin/$target $f"
    done
    [ ${#findings[@]} -gt 0 ] || echo "fuzz: $target exited with $rc but wrote no reproducer"
  fi
done

finished=$(date +%s)
echo "fuzz: build $((built - started)) s, fuzzing $((finished - built)) s, total $((finished - started)) s"
[ "$status" -eq 0 ] && echo "fuzz: no findings in ${seconds} s per target"
exit "$status"
