#!/usr/bin/env bash
# consort-train --trace with 2 workers of 2 replicas (docs/train.md, "--trace"): the chief writes
# one trace of the job, no worker writes a file of its own, and the trace holds a named process per
# worker, named replica threads (replicas by their id in the job), every step's spans on both workers, and each bucket's
# all-reduce linked from worker 0 to worker 1.
# Usage: job_trace_test.sh CONSORT_TRAIN CONSORT_LAUNCH
set -uo pipefail
train=$1 launch=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$launch" -n 2 --devices-per-worker 2 --timeout 100 -- "$train" --steps 12 --hidden 64 \
  --trace "$dir/trace.json" || { echo "FAIL: the job failed"; exit 1; }
extra=$(find "$dir" -name 'trace.json.*' | wc -l)
[ "$extra" -eq 0 ] || { echo "FAIL: $extra per-worker trace files besides the job's"; exit 1; }
python3 - "$dir/trace.json" <<'PY'
import collections, json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
assert procs == {0: "worker:0", 1: "worker:1"}, procs
threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
# Replicas by their id in the job: worker 1 holds replicas 2 and 3.
for pid, tid, name in ((0, -1, "steps"), (0, 0, "replica 0"), (0, 1, "replica 1"),
                       (1, -1, "steps"), (1, 2, "replica 2"), (1, 3, "replica 3")):
    assert threads.get((pid, tid)) == name, (pid, tid, threads)
steps = collections.Counter(e["pid"] for e in events if e["ph"] == "X" and e["name"].startswith("step "))
assert steps == {0: 12, 1: 12}, steps
starts = [e for e in events if e["ph"] == "s"]
ends = [e for e in events if e["ph"] == "f"]
# One bucket a step: worker 0's first replica to each of worker 1's two.
assert len(starts) == len(ends) == 12 * 2, (len(starts), len(ends))
assert all(e["pid"] == 0 for e in starts) and all(e["pid"] == 1 for e in ends)
assert min(e["ts"] for e in events if "ts" in e) == 0
print("job trace: ok,", len(events), "events")
PY
