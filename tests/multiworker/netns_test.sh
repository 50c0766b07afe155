#!/usr/bin/env bash
# Workers on distinct addresses, each in its own network namespace joined by a bridge, so that
# nothing silently depends on 127.0.0.1: (1) every collective against the reference, then (2) a
# partition: one worker takes its link down mid-step and every worker fails with peer_lost within
# the bound (no connection closes, so only heartbeats can tell).
#   netns_test.sh MW_JOB WORKERS        (needs root: ip netns, veth, bridge)
set -u
job=$1 workers=${2:-3}
source "$(dirname "$0")/lib.sh"
tag=cst$$
net="10.231.$((($$ % 200) + 1))"
trap 'netns_down "$tag" "$workers"' EXIT
netns_up "$tag" "$workers" "$net" || exit 77
hosts=()
for ((i = 0; i < workers; i++)); do hosts+=("$net.$((i + 1))"); done
echo "workers at ${hosts[*]}"
status=0

echo "== collectives across namespaces"
mw_cluster "$workers" "${hosts[@]}"
for ((i = 0; i < workers; i++)); do
  mw_start "$i" "CONSORT_DEVICES_PER_WORKER=2" ip netns exec "$tag-$i" "$job" collectives
done
mw_finish || status=1

echo "== a partitioned worker"
MW_PIDS=() MW_EXPECT=() MW_FAILED=0 MW_PORT=$((MW_PORT + 10))
mw_cluster "$workers" "${hosts[@]}"
victim=$((workers - 1))
for ((i = 0; i < workers; i++)); do
  mw_start "$i" "" ip netns exec "$tag-$i" "$job" partition "$victim"
done
mw_finish || status=1
exit $status
