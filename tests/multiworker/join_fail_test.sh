#!/usr/bin/env bash
# Start-up failures: (1) a worker that never starts: the chief's rendezvous fails naming it, and
# the worker that did join fails with the same list, both well before their own deadline passes
# twice; (2) a worker with the wrong shared secret is refused, and the chief names it as missing.
#   join_fail_test.sh MW_JOB
set -u
job=$1
source "$(dirname "$0")/lib.sh"
status=0

echo "== a worker that never starts"
mw_cluster 3 127.0.0.1
mw_start 0 "" "$job" join-fails 3000 "worker:2 did not join"
mw_start 1 "" "$job" join-fails 3000 "worker:2"
mw_finish || status=1

echo "== a worker with the wrong secret"
MW_PIDS=() MW_EXPECT=() MW_FAILED=0 MW_PORT=$((MW_PORT + 10))
mw_cluster 2 127.0.0.1
mw_start 0 "CONSORT_CLUSTER_SECRET=right" "$job" join-fails 3000 "worker:1"
mw_start 1 "CONSORT_CLUSTER_SECRET=wrong" "$job" join-fails 3000 "authentication failed"
mw_finish || status=1
exit $status
