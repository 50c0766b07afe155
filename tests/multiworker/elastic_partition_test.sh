#!/usr/bin/env bash
# An elastic group split by a partition must not go on as two groups (docs/multi_worker.md,
# "Partitions"). Three workers of elastic_job, each in its own network namespace joined by a
# bridge, with a minimum of 1 worker: worker:1, the chief's successor, takes its link down inside
# step 5. Nobody sees a connection close. The chief's side (worker:0 and worker:2, two of the
# three) leaves worker:1 out and finishes; worker:1 finds the chief silent, succeeds it, reaches
# nobody, and with one of three (not a majority) ends its group with peer_lost instead of training
# on alone beside the others.
#   elastic_partition_test.sh ELASTIC_JOB        (needs root: ip netns, veth, bridge)
set -u
job=$1
source "$(dirname "$0")/lib.sh"
tag=cep$$
workers=3
net="10.233.$((($$ % 200) + 1))"
said=$(mktemp)
trap 'netns_down "$tag" "$workers"; rm -f "$said"' EXIT
netns_up "$tag" "$workers" "$net" || exit 77
hosts=()
for ((i = 0; i < workers; i++)); do hosts+=("$net.$((i + 1))"); done
echo "workers at ${hosts[*]}"
mw_cluster "$workers" "${hosts[@]}"
env="CONSORT_TRANSPORT=tcp ELASTIC_JOB_LOG=$said"
for ((i = 0; i < workers; i++)); do
  mw_start "$i" "$env" ip netns exec "$tag-$i" "$job" 40 4 1 --cut 1:5 --reform-timeout 2000
done
mw_expect 0 0
mw_expect 1 1
mw_expect 2 0
mw_finish || { cat "$said"; exit 1; }
echo "all statuses as expected; what the workers said:"
cat "$said"
expect() { mw_lines "$said" "$1" "$2"; }
expect 1 '^worker:1: cutting its network link$'
expect 2 '^worker:[02]: membership: 3 -> 2 workers at step [4-6]; training resumed [0-9]+ ms'
expect 2 '^worker:[02]: final step 40: .*\(ok\)$'
expect 1 '^worker:1: step [4-6] failed \(peer_lost\): .*1 of the 3 members of epoch 1 remain, not a majority'
expect 0 '^worker:1: membership:'
echo "PASS: the chief's side went on; the cut-off successor ended its group"
