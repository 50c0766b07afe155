#!/usr/bin/env bash
# Two nodes from one launcher each (tools/consort-launch --nnodes 2): every "node" is its own
# network namespace on its own address, joined by a bridge, and runs its launcher with --node-rank;
# the nodes meet at node 0's rendezvous endpoint, authenticated with the job's secret, and train
# the demo, whose --verify must pass on every worker. Nothing may depend on 127.0.0.1: each worker
# is reached at the address of its namespace's route to the endpoint.
#   netns_launch_test.sh CONSORT_LAUNCH CONSORT_TRAIN [WORKERS_PER_NODE]   (needs root)
set -u
launch=$1 train=$2 per_node=${3:-1}
source "$(dirname "$0")/lib.sh"
tag=cnl$$
net="10.232.$((($$ % 200) + 1))"
logs=$(mktemp -d)
trap 'netns_down "$tag" 2; rm -rf "$logs"' EXIT
netns_up "$tag" 2 "$net" || exit 77
# The job's secret, the same on both nodes, as a user exports it before starting each launcher.
CONSORT_CLUSTER_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export CONSORT_CLUSTER_SECRET
endpoint="$net.1:29400"
echo "nodes at $net.1 and $net.2, rendezvous at $endpoint, $per_node worker(s) per node"
pids=()
for i in 0 1; do
  ip netns exec "$tag-$i" bash "$launch" --nnodes 2 --node-rank "$i" --rdzv-endpoint "$endpoint" \
    -n "$per_node" --timeout 150 -- "$train" --steps 30 --verify >"$logs/node$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in 0 1; do
  wait "${pids[$i]}"
  rc=$?
  sed "s/^/[node $i] /" "$logs/node$i.log"
  if [ "$rc" -ne 0 ]; then
    echo "FAILED: node $i's launcher exited with status $rc"
    status=1
  fi
done
verified="vs 1 CPU replica: max relative difference [0-9.e+-]+ \(limit 1e-04\): OK"
for ((r = 0; r < 2 * per_node; r++)); do
  node=$((r / per_node))
  if ! grep -qE "^\[worker:$r\] verify \(worker $r\): .*$verified" "$logs/node$node.log"; then
    echo "FAILED: worker $r (node $node) did not print a passing verify line"
    status=1
  fi
done
if grep -q "127.0.0.1\|MISMATCH" "$logs/node0.log" "$logs/node1.log"; then
  echo "FAILED: a worker named the loopback address or reported a MISMATCH"
  status=1
fi
[ "$status" -eq 0 ] && echo "netns_launch_test: both nodes trained and verified"
exit "$status"
