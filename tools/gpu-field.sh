#!/usr/bin/env bash
# gpu-field.sh: every check and benchmark that needs a GPU, in one call, for a machine that is
# lent for minutes (bench/README.md, "the H100 field run"; issues 12, 13 and 37). Build here with
# CUDA (tools/build.sh), copy the checkout with its build/ (and the shared libraries the binaries
# load, where the GPU machine lacks them) to the GPU machine, and run it there from the root:
#
#   bash tools/gpu-field.sh
#
# Writes one log per part under $OUT (the device tool's folder that comes back; ./gpu-field-logs
# when $OUT is unset) and summary.txt with the lines that matter: the GPU tests' verdict, nccl_bench's
# direct / wrapper / consort rows up to 1 MiB beside torch.distributed (NCCL) on the same GPU, the
# reduction kernels' bandwidth, and the training demo's examples/s on the GPU against one CPU
# replica in the same call, and the demo's --verify difference after 1 and 10 steps. Every part has its own time limit (the whole stays under 8 minutes) and a
# part that fails or times out is recorded and the next one still runs. Exit status: 0 when every
# part passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/gpu-field-logs}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
failed=0

note() { echo "$*" | tee -a "$summary"; }

# part NAME LIMIT_S COMMAND...: runs COMMAND with its output in NAME.log, and notes how it ended.
part() {
  local name=$1 limit=$2
  shift 2
  local begin=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local verdict="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMED OUT after ${limit} s"
    failed=1
  elif [ "$rc" -ne 0 ]; then
    verdict="FAILED (exit $rc)"
    failed=1
  fi
  note "== $name: $verdict in $((SECONDS - begin)) s ($*)"
  return 0
}

# The python3 with torch: the first one of PATH that imports it (the GPU machine's venv is on PATH).
torch_python=""
for py in python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch" >/dev/null 2>&1; then
    torch_python=$py
    break
  fi
done

# cuBLAS for the demo's GEMMs (examples/train/mlp_kernels.cu loads libcublas.so.<CUDA major>): where
# the loader cannot find it, the one of torch's NVIDIA packages.
if [ -z "${CONSORT_CUBLAS:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so\.13 '; then
  found=$(find / -xdev -name 'libcublas.so.13' -path '*nvidia*' 2>/dev/null | head -1)
  [ -n "$found" ] && export CONSORT_CUBLAS=$found
fi

{
  date -u
  echo "cuBLAS: ${CONSORT_CUBLAS:-libcublas.so.13 as the loader finds it}"
  echo "built from: $(cat build/built-from 2>/dev/null || echo 'unknown (no build/built-from)')"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not there"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  echo "torch python: ${torch_python:-none}"
  [ -n "$torch_python" ] && "$torch_python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
} >"$out/machine.log" 2>&1
head -3 "$out/machine.log" | sed 's/^/# /' >>"$summary"

# 1. The GPU tests (issue 13's "done": no failure; skips only where two GPUs are needed). A run in
#    which no gpu-labelled test passed (every one skipped, or none registered: a build without CUDA)
#    is a failure: a field run that ran nothing has verified nothing.
part ctest_gpu 240 ctest --test-dir build -L 'gpu|example' --no-tests=error --output-on-failure -j4 --timeout 120
# Every test's output (skips included, with their reasons) is in CTest's own log.
cp build/Testing/Temporary/LastTest.log "$out/ctest_gpu_full.log" 2>/dev/null
gpu_names=$(ctest --test-dir build -L gpu -N 2>/dev/null | sed -nE 's/^ *Test +#[0-9]+: +//p' | sort)
gpu_passed=$(grep -E "Test +#[0-9]+: .* Passed" "$out/ctest_gpu.log" | sed -nE 's/.*Test +#[0-9]+: +([^ ]+) .*/\1/p' |
  sort | comm -12 - <(echo "$gpu_names") | grep -c .)
{
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$out/ctest_gpu.log"
  echo "gpu-labelled tests: $(echo "$gpu_names" | grep -c .) registered, $gpu_passed passed"
  echo "skipped: $(grep -c "(Skipped)" "$out/ctest_gpu.log"); their reasons:"
  grep -A1 ": Skipped$" "$out/ctest_gpu_full.log" 2>/dev/null | grep -vE ": Skipped$|^--$" | sort | uniq -c
} >>"$summary"
if [ "$gpu_passed" -eq 0 ]; then
  note "== ctest_gpu: FAILED: no gpu-labelled test passed (all skipped, or none registered)"
  failed=1
fi

# 1b. The GPU cases of the other test binaries (variables and the optimizer on GPU copies, a GPU
#     strategy's defaults): they carry their binary's label, not `gpu`, and skip without a GPU.
part ctest_gpu_cases 120 ctest --test-dir build -R 'GpuTest|OnGpus' -LE 'gpu|example' --no-tests=error \
  --output-on-failure -j4 --timeout 120
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Skipped" "$out/ctest_gpu_cases.log" >>"$summary"

# 2. One GPU's collectives up to 1 MiB: direct NCCL, the wrapper, consort's strategy row (issue
#    12's target: consort <= 2x direct), and torch.distributed (NCCL) on the same GPU.
part nccl_bench 90 ./build/bench/nccl_bench --max-bytes 1M --iters 200 --json "$out/nccl_bench.json"
grep -E "^ +[0-9]+ .*(direct|wrapper|consort)" "$out/nccl_bench.log" | grep -E " float " |
  awk '$1 == 4 || $1 == 4096 || $1 == 1048576' >>"$summary"
if [ -n "$torch_python" ]; then
  part torch_nccl_bench 120 "$torch_python" bench/torch_nccl_bench.py --max-bytes 1M --iters 200 \
    --json "$out/torch_nccl_bench.json"
  grep -E "^ +[0-9]+ .* torch " "$out/torch_nccl_bench.log" | awk '$1 == 4 || $1 == 4096 || $1 == 1048576' >>"$summary"
else
  note "== torch_nccl_bench: skipped (no python3 with torch)"
fi

# 3. The reduction kernels' bandwidth against the device's peak.
part reduce_kernel_bench 60 ./build/bench/reduce_kernel_bench --max-bytes 1G \
  --dtypes float32,float16,bfloat16 --json "$out/reduce_kernel_bench.json"
grep -E " 1073741824 |Out of bounds" "$out/reduce_kernel_bench.log" >>"$summary"

# 3b. The demo's GEMMs: our tiled kernel against cuBLAS in one program, and cuBLAS through torch
#     (TF32 off) on the same shapes.
part gemm_bench 60 ./build/bench/gemm_bench --json "$out/gemm_bench.json"
grep -E "^# gemm_bench|^# +gemm|^  [a-z_]+ " "$out/gemm_bench.log" >>"$summary"
if [ -n "$torch_python" ]; then
  part torch_gemm_bench 60 "$torch_python" bench/torch_gemm_bench.py --json "$out/torch_gemm_bench.json"
  grep -E "^  [a-z_]+ " "$out/torch_gemm_bench.log" | sed 's/^/torch /' >>"$summary"
fi

# 4. The demo on the GPU (3000 steps: a 300-step run is a third cuBLAS's one-time start) with
#    cuBLAS and with the tiled kernel only, and on one CPU replica (300 steps), same model.
for shape in "--hidden 512 --layers 2" "--hidden 1024 --layers 3"; do
  tag=$(echo "$shape" | awk '{print $2 "x" $4}')
  # shellcheck disable=SC2086
  part "train_gpu_$tag" 120 ./build/examples/train/consort-train --devices GPU:0 --steps 3000 $shape
  # shellcheck disable=SC2086
  part "train_gpu_tiled_$tag" 120 env CONSORT_CUBLAS=off ./build/examples/train/consort-train \
    --devices GPU:0 --steps 3000 --no-verify $shape
  # shellcheck disable=SC2086
  part "train_cpu_$tag" 120 ./build/examples/train/consort-train --devices CPU:0 --steps 300 --no-verify $shape
  grep -hE "^GEMMs|^trained:|^verify" "$out/train_gpu_$tag.log" "$out/train_gpu_tiled_$tag.log" \
    "$out/train_cpu_$tag.log" >>"$summary"
done

# 5. The demo's verification after one step and after ten, where the GPU's kernels meet the host's
#    model: the measured difference sets verify_tolerance_gpu (examples/train/trainer.hpp).
for steps in 1 10; do
  part "verify_gpu_$steps" 120 ./build/examples/train/consort-train --devices GPU:0 --steps "$steps" \
    --verify-steps "$steps" --tolerance 1
  grep -h "^verify" "$out/verify_gpu_$steps.log" >>"$summary"
done

# 6. multi_worker_mirrored_strategy's default devices under the launcher: the one worker it gives
#    the GPU (CONSORT_OWN_GPUS) takes it, and every collective matches the CPU reference.
part mw_job_gpu_default 90 bash tools/consort-launch -n 1 --timeout 80 -- \
  ./build/tests/multiworker/mw_job collectives
grep -hE "devices |checks passed" "$out/mw_job_gpu_default.log" >>"$summary"

note "== gpu-field: $([ "$failed" -eq 0 ] && echo "every part passed" || echo "a part failed or timed out"); logs in $out/logs.tar.gz"
# The device tool brings back a handful of files: every log goes into one archive beside the summary.
(cd "$out" && find . -maxdepth 1 -type f ! -name summary.txt ! -name logs.tar.gz -printf '%P\n' |
  tar -czf logs.tar.gz --remove-files -T -)
exit "$failed"
