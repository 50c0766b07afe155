#!/usr/bin/env bash
# False alarms of the failure detector under load (issue 32; bench/README.md, "Hung workers"):
# WORKERS workers of the demo (tools/consort-launch, examples/train/consort-train, one CPU replica
# each, elastic with a minimum of 1) train for SECONDS on this machine's cores, with every
# worker's membership thread watching the others (heartbeats every 100 ms, a peer lost after
# peer_timeout, 800 ms by default). Nothing is killed or stopped: every loss is a false alarm.
# A false alarm shows as a loss in the log ("sent no heartbeat"); a worker's own pause (its
# process not scheduled for half a timeout) shows as "did not run for", and costs nothing.
#
#   bash bench/liveness_bench.sh [BUILD_DIR] [SECONDS] [WORKERS] [PEER_TIMEOUT_MS]
#     defaults: build 600 (10 minutes) 2 per core (nproc x 2) 800 (the library's default)
set -uo pipefail
build=${1:-build}
seconds=${2:-600}
workers=${3:-$(($(nproc) * 2))}
timeout_ms=${4:-800}
train="$build/examples/train/consort-train"
[ -x "$train" ] || { echo "no $train: build first (bash tools/build.sh)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
# The run ends when --timeout stops it: its status says so, not a failure.
CONSORT_PEER_TIMEOUT_MS=$timeout_ms "$here/../tools/consort-launch" -n "$workers" \
  --timeout "$seconds" --elastic 1 --max-restarts 100 -- \
  "$train" --replicas 1 --steps 1000000000 --elastic 1 >"$log" 2>&1
status=$?
elapsed=$(($(date +%s) - start))
count() { grep -cE "$1" "$log"; }
steps=$(sed -nE 's/^\[worker:0\] step +([0-9]+).*/\1/p' "$log" | tail -1)
printf '%-28s %s\n' "workers" "$workers on $(nproc) cores"
printf '%-28s %s\n' "peer_timeout" "$timeout_ms ms (heartbeats every $((timeout_ms / 8)) ms)"
printf '%-28s %s\n' "seconds" "$elapsed (launcher status $status)"
printf '%-28s %s\n' "last step worker:0 printed" "${steps:-none}"
printf '%-28s %s\n' "losses (false alarms)" "$(count 'sent no heartbeat for [0-9]+ ms \(connection')"
printf '%-28s %s\n' "membership changes" "$(count '^\[worker:0\] .*membership: ')"
printf '%-28s %s\n' "own pauses seen" "$(count 'did not run for')"
grep -E 'sent no heartbeat|did not run for' "$log" | head -20
