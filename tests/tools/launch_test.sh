#!/usr/bin/env bash
# Tests of tools/consort-launch: per-worker TF_CONFIG and environment, prefixed output, failure
# propagation (the others are stopped, the status is passed on), the job timeout, usage errors,
# the cluster secret (generated per launch, or the caller's), and each worker's GPUs
# (CUDA_VISIBLE_DEVICES from --gpus, the caller's list or nvidia-smi; a fake nvidia-smi stands in
# for a machine with GPUs, so this runs without one), each worker's CPUs (--bind), and one node's
# part of a job on several (--nnodes: torchrun's variables, and the usage errors).
# Usage: launch_test.sh <path to consort-launch>
set -uo pipefail
launch=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
check() { # check NAME CONDITION...
  local name=$1; shift
  if "$@"; then echo "ok: $name"; else echo "FAILED: $name"; failures=$((failures + 1)); fi
}

cat > "$tmp/job.sh" <<'JOB'
#!/usr/bin/env bash
echo "$$" > "$PIDS/$CONSORT_LAUNCH_RANK"
echo "rank=$CONSORT_LAUNCH_RANK size=$CONSORT_LAUNCH_SIZE devices=$CONSORT_DEVICES_PER_WORKER"
echo "tf=${TF_CONFIG-unset}"
echo "torchrun=${RANK-unset}/${WORLD_SIZE-unset} local=${LOCAL_RANK-unset}/${LOCAL_WORLD_SIZE-unset} master=${MASTER_ADDR-unset}:${MASTER_PORT-unset} host=${CONSORT_WORKER_HOST-unset}"
echo "secret=${CONSORT_CLUSTER_SECRET:-}"
echo "cvd=${CUDA_VISIBLE_DEVICES-unset}"
echo "own=${CONSORT_OWN_GPUS-unset}"
echo "cpus=$(awk '/^Cpus_allowed_list:/ {print $2}' /proc/self/status) launch_cpus=${CONSORT_LAUNCH_CPUS-unset}"
echo "to stderr" >&2
echo "restart=${CONSORT_RESTART_COUNT-unset}"
echo "elastic=${CONSORT_ELASTIC_MIN_WORKERS-unset}"
# FAIL_ROUNDS: the failing rank fails only in the first FAIL_ROUNDS rounds (--max-restarts).
if [ "${FAIL_RANK:-none}" = "$CONSORT_LAUNCH_RANK" ] && [ "${CONSORT_RESTART_COUNT:-0}" -lt "${FAIL_ROUNDS:-1000}" ]; then
  # Fail only once every peer is up, so that stopping them is what the test observes.
  for ((i = 0; i < CONSORT_LAUNCH_SIZE; i++)); do
    while [ ! -s "$PIDS/$i" ]; do read -r -t 0.01 <> <(:) || true; done
  done
  exit 3
fi
[ -n "${HANG:-}" ] && exec tail -f /dev/null # a worker that never finishes
exit 0
JOB
chmod +x "$tmp/job.sh"
export PIDS="$tmp/pids"

# 1. Three workers with two devices each: every task gets its own TF_CONFIG.
mkdir -p "$PIDS"
out=$("$launch" -n 3 --devices-per-worker 2 --port 7100 -- "$tmp/job.sh" 2>&1)
rc=$?
check "three workers succeed" [ "$rc" -eq 0 ]
for i in 0 1 2; do
  check "worker:$i has its rank, size and devices" grep -qx "\[worker:$i\] rank=$i size=3 devices=2" <<<"$out"
  check "worker:$i has its TF_CONFIG" grep -qF "[worker:$i] tf={\"cluster\":{\"worker\":[\"127.0.0.1:7100\",\"127.0.0.1:7101\",\"127.0.0.1:7102\"]},\"task\":{\"type\":\"worker\",\"index\":$i}}" <<<"$out"
  check "worker:$i stderr is prefixed too" grep -qx "\[worker:$i\] to stderr" <<<"$out"
done

# 2. With --chief, task 0 is chief:0 and the rest are worker:0..
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$("$launch" -n 2 --chief --port 7200 -- "$tmp/job.sh" 2>&1)
check "chief layout" grep -qF '[chief:0] tf={"cluster":{"chief":["127.0.0.1:7200"],"worker":["127.0.0.1:7201"]},"task":{"type":"chief","index":0}}' <<<"$out"
check "worker after the chief" grep -qF '"task":{"type":"worker","index":0}' <<<"$out"

# 3. One worker fails: the others (which never finish) are stopped, its status comes back.
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(FAIL_RANK=1 HANG=1 "$launch" -n 3 --port 7300 --grace 2 -- "$tmp/job.sh" 2>&1)
rc=$?
check "the failing worker's status is the launcher's" [ "$rc" -eq 3 ]
check "the failure is reported with the task" grep -qF "consort-launch: worker:1 exited with status 3; stopping the others" <<<"$out"
for i in 0 2; do
  pid=$(cat "$PIDS/$i")
  check "worker:$i was stopped" bash -c "! kill -0 $pid 2>/dev/null"
done

# 3b. --max-restarts: a worker that fails in the first round only; every worker is started again,
#     told the round, and the job succeeds. One that keeps failing ends the job once the restarts
#     are spent, with its status.
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(FAIL_RANK=1 FAIL_ROUNDS=1 "$launch" -n 3 --port 7350 --grace 2 --max-restarts 2 -- "$tmp/job.sh" 2>&1)
rc=$?
check "a failure within --max-restarts: the job succeeds" [ "$rc" -eq 0 ]
check "the restart is announced" grep -qF "consort-launch: restarting every worker (restart 1 of 2)" <<<"$out"
for i in 0 1 2; do
  check "worker:$i ran in round 0 and round 1" \
    bash -c "grep -qx '\[worker:$i\] restart=0' <<<\"\$1\" && grep -qx '\[worker:$i\] restart=1' <<<\"\$1\"" _ "$out"
done
check "no third round" bash -c "! grep -q 'restart=2' <<<\"\$1\"" _ "$out"
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(FAIL_RANK=1 FAIL_ROUNDS=9 "$launch" -n 2 --port 7360 --grace 2 --max-restarts 2 -- "$tmp/job.sh" 2>&1)
rc=$?
check "a failure in every round: the worker's status after 2 restarts" [ "$rc" -eq 3 ]
check "three rounds ran" [ "$(grep -c '^\[worker:1\] restart=' <<<"$out")" -eq 3 ]
check "spent restarts are reported" grep -qF "no restarts left (--max-restarts 2); the job failed" <<<"$out"
out=$("$launch" -n 2 --max-restarts -1 -- "$tmp/job.sh" 2>&1)
check "a negative --max-restarts is a usage error" [ "$?" -eq 2 ]
check "a negative --max-restarts says what is expected" grep -qF -- "--max-restarts needs a count >= 0, got '-1'" <<<"$out"
# 3c. --elastic: a failed worker other than the chief is restarted alone while the others go on;
# the chief's failure is not restarted (its successor leads); every worker gets the minimum.
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(FAIL_RANK=1 FAIL_ROUNDS=1 "$launch" -n 3 --port 7370 --grace 2 --elastic 2 --max-restarts 1 -- "$tmp/job.sh" 2>&1)
rc=$?
check "--elastic: a worker's failure within --max-restarts: the job succeeds" [ "$rc" -eq 0 ]
check "--elastic: the failed worker runs twice" [ "$(grep -c '^\[worker:1\] restart=' <<<"$out")" -eq 2 ]
check "--elastic: the others run once" [ "$(grep -c '^\[worker:[02]\] restart=' <<<"$out")" -eq 2 ]
check "--elastic: the restart is reported" grep -qF "restarting it alone, under its task, to rejoin the group (restart 1 of 1)" <<<"$out"
check "--elastic: the others are not stopped" bash -c '! grep -qF "stopping the others" <<<"$1"' _ "$out"
check "--elastic: every worker gets the minimum" [ "$(grep -c '^\[worker:[012]\] elastic=2$' <<<"$out")" -eq 4 ]
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(FAIL_RANK=0 FAIL_ROUNDS=9 "$launch" -n 3 --port 7380 --grace 2 --elastic 2 --max-restarts 1 -- "$tmp/job.sh" 2>&1)
rc=$?
check "--elastic: the chief's failure leaves the others to succeed" [ "$rc" -eq 0 ]
check "--elastic: the chief is not restarted" [ "$(grep -c '^\[worker:0\] restart=' <<<"$out")" -eq 1 ]
check "--elastic: the succession is reported" grep -qF "(the chief) exited with status 3; the next worker succeeds it" <<<"$out"
out=$("$launch" -n 2 --elastic 3 -- "$tmp/job.sh" 2>&1)
check "an --elastic minimum above -n is a usage error" [ "$?" -eq 2 ]
check "an --elastic minimum above -n says what is expected" grep -qF -- "--elastic needs the minimum number of workers, 1 to -n (2), got '3'" <<<"$out"

# 4. A job that never finishes is stopped at --timeout with status 124.
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(HANG=1 "$launch" -n 2 --timeout 1 --grace 1 -- "$tmp/job.sh" 2>&1)
rc=$?
check "timeout gives 124" [ "$rc" -eq 124 ]
check "timeout is reported" grep -qF "did not finish within 1 s" <<<"$out"
for i in 0 1; do
  pid=$(cat "$PIDS/$i")
  check "worker:$i was stopped at the timeout" bash -c "! kill -0 $pid 2>/dev/null"
done

# 5. Usage errors are clear and give 2.
out=$("$launch" -n 0 -- true 2>&1); rc=$?
check "zero workers is a usage error" [ "$rc" -eq 2 ]
check "zero workers says what was expected" grep -qF "needs a worker count >= 1, got '0'" <<<"$out"
out=$("$launch" -n 2 2>&1); rc=$?
check "a missing command is a usage error" [ "$rc" -eq 2 ]
check "a missing command says where it goes" grep -qF "put it after --" <<<"$out"

# 6. Without CONSORT_CLUSTER_SECRET, every worker of a launch gets the same fresh 64-hex-digit
#    secret, another one per launch; a caller's secret is passed through unchanged.
secrets_of() { sed -n 's/^\[[^]]*\] secret=//p' <<<"$1" | sort -u; }
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(env -u CONSORT_CLUSTER_SECRET "$launch" -n 3 --port 7400 -- "$tmp/job.sh" 2>&1)
first=$(secrets_of "$out")
check "every worker gets one generated secret" [ "$(wc -l <<<"$first")" -eq 1 ]
check "the generated secret is 32 random bytes in hex" grep -qxE '[0-9a-f]{64}' <<<"$first"
check "the launcher does not print the secret" bash -c "! grep -v '\] secret=' <<<\"\$1\" | grep -qF \"\$2\"" _ "$out" "$first"
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(env -u CONSORT_CLUSTER_SECRET "$launch" -n 2 --port 7500 -- "$tmp/job.sh" 2>&1)
check "each launch generates another secret" [ "$(secrets_of "$out")" != "$first" ]
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(CONSORT_CLUSTER_SECRET=given "$launch" -n 2 --port 7600 -- "$tmp/job.sh" 2>&1)
check "a given secret is passed to every worker" [ "$(secrets_of "$out")" = "given" ]

# 7. GPUs: each worker gets its slice of the machine's GPUs as CUDA_VISIBLE_DEVICES.
cvd_of() { sed -n "s/^\[worker:$2\] cvd=//p" <<<"$1"; }
mkdir -p "$tmp/fake4" "$tmp/fake1" "$tmp/fake0"
printf '#!/bin/sh\nprintf "0\\n1\\n2\\n3\\n"\n' > "$tmp/fake4/nvidia-smi"
printf '#!/bin/sh\necho 0\n' > "$tmp/fake1/nvidia-smi"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n' > "$tmp/fake0/nvidia-smi"
chmod +x "$tmp/fake4/nvidia-smi" "$tmp/fake1/nvidia-smi" "$tmp/fake0/nvidia-smi"
run_gpus() { # run_gpus PATH_PREFIX ARGS...: the launch's output (the caller has no CUDA_VISIBLE_DEVICES)
  local prefix=$1; shift
  rm -rf "$PIDS"; mkdir -p "$PIDS"
  env -u CUDA_VISIBLE_DEVICES PATH="$prefix:$PATH" "$launch" "$@" -- "$tmp/job.sh" 2>&1
}
out=$(run_gpus "$tmp/fake4" -n 2 --devices-per-worker 2 --port 7700)
check "nvidia-smi's 4 GPUs: worker 0 gets 0,1" [ "$(cvd_of "$out" 0)" = "0,1" ]
check "nvidia-smi's 4 GPUs: worker 1 gets 2,3" [ "$(cvd_of "$out" 1)" = "2,3" ]
check "a worker given its GPUs is told they are its own" grep -qx "\[worker:1\] own=1" <<<"$out"
out=$(run_gpus "$tmp/fake4" -n 4 --port 7710)
check "one GPU per worker: worker 3 gets GPU 3" [ "$(cvd_of "$out" 3)" = "3" ]
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(CUDA_VISIBLE_DEVICES=5,7 PATH="$tmp/fake4:$PATH" "$launch" -n 2 --port 7720 -- "$tmp/job.sh" 2>&1)
check "the caller's CUDA_VISIBLE_DEVICES is shared out first" [ "$(cvd_of "$out" 0),$(cvd_of "$out" 1)" = "5,7" ]
out=$(run_gpus "$tmp/fake4" -n 2 --gpus GPU-a1,3 --port 7730)
check "--gpus names them (UUIDs too)" [ "$(cvd_of "$out" 0),$(cvd_of "$out" 1)" = "GPU-a1,3" ]
out=$(run_gpus "$tmp/fake1" -n 2 --port 7740)
check "too few GPUs in auto: CUDA_VISIBLE_DEVICES is left unset" [ "$(cvd_of "$out" 0)$(cvd_of "$out" 1)" = "unsetunset" ]
check "too few GPUs in auto: no worker is told it owns them" [ "$(grep -c "own=unset" <<<"$out")" -eq 2 ]
check "too few GPUs in auto: a note says so" grep -qF "2 worker(s) x 1 device(s) need 2 GPUs and nvidia-smi shows 1" <<<"$out"
out=$(run_gpus "$tmp/fake1" -n 2 --gpus 0 --port 7750)
rc=$?
check "too few GPUs in --gpus is a usage error" [ "$rc" -eq 2 ]
check "too few GPUs in --gpus names the counts" grep -qF "2 worker(s) x 1 device(s) need 2 GPUs, and --gpus names 1 (0)" <<<"$out"
out=$(run_gpus "$tmp/fake4" -n 2 --gpus "0 1" --port 7760)
rc=$?
check "a malformed --gpus is a usage error" [ "$rc" -eq 2 ]
check "a malformed --gpus says what is expected" grep -qF "a comma-separated list of GPU indices or UUIDs" <<<"$out"
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(CUDA_VISIBLE_DEVICES=2 PATH="$tmp/fake4:$PATH" "$launch" -n 2 --gpus none --port 7770 -- "$tmp/job.sh" 2>&1)
check "--gpus none leaves the caller's CUDA_VISIBLE_DEVICES" [ "$(cvd_of "$out" 0),$(cvd_of "$out" 1)" = "2,2" ]
out=$(run_gpus "$tmp/fake0" -n 2 --port 7780)
check "nvidia-smi without a GPU (it fails): nothing is set" [ "$(cvd_of "$out" 0)$(cvd_of "$out" 1)" = "unsetunset" ]

# 9. CPUs (--bind): the launcher runs under `taskset -c 0,1`, so that two CPUs are its to share
#    out whatever the machine has.
cpus_of() { sed -n "s/^\[worker:$2\] cpus=\([^ ]*\) launch_cpus=\(.*\)$/\1 \2/p" <<<"$1"; }
run_bind() { # run_bind ARGS...: the launch's output, the launcher on CPUs 0 and 1
  rm -rf "$PIDS"; mkdir -p "$PIDS"
  taskset -c 0,1 "$launch" "$@" -- "$tmp/job.sh" 2>&1
}
if ! command -v taskset >/dev/null 2>&1 || ! taskset -c 0,1 true 2>/dev/null; then
  echo "skipped: the --bind checks need taskset and CPUs 0 and 1"
else
  out=$(run_bind -n 2 --port 7800)
  check "auto, 2 workers on 2 CPUs: worker 0 runs on CPU 0" [ "$(cpus_of "$out" 0)" = "0 0" ]
  check "auto, 2 workers on 2 CPUs: worker 1 runs on CPU 1" [ "$(cpus_of "$out" 1)" = "1 1" ]
  out=$(run_bind -n 1 --port 7810)
  check "auto, 1 worker: it gets both CPUs" [ "$(cpus_of "$out" 0)" = "0-1 0,1" ]
  out=$(run_bind -n 3 --port 7820)
  check "auto, 3 workers on 2 CPUs: none is bound" \
    [ "$(cpus_of "$out" 0)|$(cpus_of "$out" 2)" = "0-1 unset|0-1 unset" ]
  out=$(run_bind -n 3 --bind core --port 7830)
  check "core, 3 workers on 2 CPUs: round robin, worker 2 on CPU 0" \
    [ "$(cpus_of "$out" 1)|$(cpus_of "$out" 2)" = "1 1|0 0" ]
  out=$(run_bind -n 2 --bind none --port 7840)
  check "none: no worker is bound" [ "$(cpus_of "$out" 0)|$(cpus_of "$out" 1)" = "0-1 unset|0-1 unset" ]
  rm -rf "$PIDS"; mkdir -p "$PIDS"
  out=$(CONSORT_BIND=none taskset -c 0,1 "$launch" -n 2 --port 7850 -- "$tmp/job.sh" 2>&1)
  check "CONSORT_BIND=none: no worker is bound" [ "$(cpus_of "$out" 1)" = "0-1 unset" ]
fi
out=$("$launch" -n 2 --bind socket -- "$tmp/job.sh" 2>&1)
rc=$?
check "an unknown --bind is a usage error" [ "$rc" -eq 2 ]
check "an unknown --bind says what is expected" grep -qF -- "--bind takes auto, core or none, got 'socket'" <<<"$out"

# 7. One node's part of a job on several nodes: node 1 of 2 with 2 workers gives ranks 2 and 3
#    of 4 torchrun's variables (no TF_CONFIG, even when the caller has one), and the address of
#    its route to the endpoint; the secret must come from the caller.
rm -rf "$PIDS"; mkdir -p "$PIDS"
out=$(TF_CONFIG=stale CONSORT_CLUSTER_SECRET=s3cret "$launch" --nnodes 2 --node-rank 1 \
  --rdzv-endpoint 127.0.0.1:29400 -n 2 -- "$tmp/job.sh" 2>&1)
rc=$?
check "node 1 of 2 succeeds" [ "$rc" -eq 0 ]
for i in 0 1; do
  r=$((2 + i))
  check "worker:$r is rank $r of 4 with torchrun's variables" \
    grep -qx "\[worker:$r\] torchrun=$r/4 local=$i/2 master=127.0.0.1:29400 host=127.0.0.1" <<<"$out"
  check "worker:$r has no TF_CONFIG" grep -qx "\[worker:$r\] tf=unset" <<<"$out"
  check "worker:$r has the caller's secret" grep -qx "\[worker:$r\] secret=s3cret" <<<"$out"
done
out=$(CONSORT_CLUSTER_SECRET=s3cret "$launch" --nnodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29400 \
  --local-addr 10.1.2.3 -n 1 -- "$tmp/job.sh" 2>&1)
check "--local-addr is the workers' CONSORT_WORKER_HOST" grep -qx "\[worker:0\] torchrun=0/2 local=0/1 master=127.0.0.1:29400 host=10.1.2.3" <<<"$out"
usage_error() { # usage_error NAME EXPECTED_TEXT ARGS...
  local name=$1 text=$2
  shift 2
  local o r
  o=$("$launch" "$@" -- "$tmp/job.sh" 2>&1)
  r=$?
  check "$name is a usage error" [ "$r" -eq 2 ]
  check "$name says what is expected" grep -qF -- "$text" <<<"$o"
}
usage_error "--nnodes without a secret" "--nnodes 2 needs CONSORT_CLUSTER_SECRET, the same on every node" \
  --nnodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29400 -n 1
export CONSORT_CLUSTER_SECRET=s3cret
usage_error "a node rank outside the nodes" "--node-rank needs this node's index in 0..1 (--nnodes 2), got '2'" \
  --nnodes 2 --node-rank 2 --rdzv-endpoint 127.0.0.1:29400 -n 1
usage_error "--nnodes without an endpoint" "--nnodes 2 needs --rdzv-endpoint HOST:PORT" \
  --nnodes 2 --node-rank 0 -n 1
usage_error "an endpoint without a port" "got 'host0'" --nnodes 2 --node-rank 0 --rdzv-endpoint host0 -n 1
usage_error "--chief with --nnodes" "--chief names a TF_CONFIG chief task" \
  --nnodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29400 -n 1 --chief
usage_error "--node-rank without --nnodes" "--node-rank and --rdzv-endpoint go with --nnodes N" \
  --node-rank 1 -n 1
unset CONSORT_CLUSTER_SECRET

[ "$failures" -eq 0 ] && echo "launch_test: all checks passed" || echo "launch_test: $failures check(s) failed"
exit "$failures"
