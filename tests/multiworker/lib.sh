# Helpers for the multi-worker integration tests: start workers with their TF_CONFIG by hand
# (unlike tools/consort-launch, which stops every worker when one fails, these tests need to
# watch each worker's own exit status), bound each with `timeout`, and check the statuses.
#
#   source lib.sh
#   mw_cluster 3 127.0.0.1              # CLUSTER (TF_CONFIG's cluster part) for 3 workers
#   mw_start 0 "" ./mw_job collectives  # worker 0; the second argument is extra `env` settings
#   mw_expect 0 0                       # worker 0 must exit with status 0
#   mw_finish                           # waits for every worker; fails if an expectation failed

MW_TIMEOUT_S=${MW_TIMEOUT_S:-90}
MW_PIDS=()
MW_EXPECT=()
MW_FAILED=0

# mw_base_port N: a base port for N workers below the kernel's ephemeral range, with none of its
# N ports (and the 10 after them, which a second scenario of the same test takes) in use now.
# Not in the ephemeral range: every outgoing connection and every mesh listener takes a port
# there, and one of them on a worker's port failed a CI run (as it did consort-launch once).
mw_base_port() {
  local n=$1 low=32768 used="" base attempt p clash
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  local span=$((low - 10000 - n - 20))
  [ "$span" -gt 1000 ] || span=1000
  command -v ss >/dev/null && used=$(ss -Htan 2>/dev/null | awk '{k = split($4, a, ":"); print a[k]}')
  for ((attempt = 0; attempt < 50; attempt++)); do
    base=$((10000 + ($$ * 7 + RANDOM * 32768 + RANDOM) % span))
    clash=0
    for ((p = base; p < base + n + 10; p++)); do
      if grep -qx "$p" <<<"$used"; then clash=1; break; fi
    done
    [ "$clash" -eq 0 ] && break
  done
  echo "$base"
}

# mw_cluster N HOST [HOST...]: worker i listens at HOST_i (the last host repeats) on a base port
# chosen per run (mw_base_port).
mw_cluster() {
  local n=$1
  shift
  local hosts=("$@")
  MW_PORT=${MW_PORT:-$(mw_base_port "$n")}
  local parts=() i host
  for ((i = 0; i < n; i++)); do
    host=${hosts[$i]:-${hosts[-1]}}
    parts+=("\"$host:$((MW_PORT + i))\"")
  done
  local IFS=,
  CLUSTER="{\"worker\":[${parts[*]}]}"
}

# mw_start I ENV CMD...: starts worker I (task worker:I) in the background; ENV is a
# space-separated list of NAME=VALUE for `env`; output lines are prefixed with [worker:I], and
# `wait` on its pid returns the worker's own exit status.
mw_start() {
  local i=$1 extra=$2
  shift 2
  local tf="{\"cluster\":$CLUSTER,\"task\":{\"type\":\"worker\",\"index\":$i}}"
  (
    # shellcheck disable=SC2086
    exec env TF_CONFIG="$tf" $extra timeout -k 5 "$MW_TIMEOUT_S" "$@"
  ) > >(sed -u "s/^/[worker:$i] /") 2>&1 &
  MW_PIDS[$i]=$!
}

# mw_expect I STATUS: worker I must exit with STATUS (137: killed by SIGKILL).
mw_expect() {
  MW_EXPECT[$1]=$2
}

mw_finish() {
  local i rc
  for i in "${!MW_PIDS[@]}"; do
    wait "${MW_PIDS[$i]}"
    rc=$?
    if [ "$rc" != "${MW_EXPECT[$i]:-0}" ]; then
      echo "FAIL: worker:$i exited with $rc, expected ${MW_EXPECT[$i]:-0}"
      MW_FAILED=1
    else
      echo "ok: worker:$i exited with $rc"
    fi
  done
  # Let the prefixers drain before the verdict.
  wait 2>/dev/null
  return "$MW_FAILED"
}

# mw_wait_lines FILE COUNT PATTERN: waits (60 s at most) until COUNT lines of FILE match PATTERN;
# status 0 when they did. Reads the file's growth through a FIFO (a process substitution would
# not see it next to the workers' own output substitutions).
mw_wait_lines() {
  local fifo tail_pid ok
  fifo=$(mktemp -u)
  mkfifo "$fifo"
  tail -n +1 -f "$1" >"$fifo" &
  tail_pid=$!
  timeout 60 grep -m "$2" -qE "$3" "$fifo"
  ok=$?
  kill "$tail_pid" 2>/dev/null
  wait "$tail_pid" 2>/dev/null
  rm -f "$fifo"
  return "$ok"
}

# mw_lines FILE COUNT PATTERN: exactly COUNT lines of FILE match PATTERN; else says so and exits
# the test with status 1.
mw_lines() {
  local got
  got=$(grep -cE "$3" "$1")
  [ "$got" = "$2" ] || { echo "FAIL: $got lines match '$3', expected $2"; exit 1; }
}

# netns_up TAG N NET: N network namespaces TAG-0 .. TAG-(N-1) joined by the bridge brTAG, the
# eth0 of namespace i at NET.(i+1)/24 (NET: three octets). Status 1, having said SKIP, when
# namespaces cannot be made here (they need root). netns_down TAG N removes them all.
netns_up() {
  local tag=$1 n=$2 net=$3 i ns err
  if ! err=$(ip link add "br$tag" type bridge 2>&1); then
    echo "SKIP: cannot create network namespaces here ($err); needs root"
    return 1
  fi
  ip link set "br$tag" up
  for ((i = 0; i < n; i++)); do
    ns="$tag-$i"
    ip netns add "$ns"
    ip link add "v$tag$i" type veth peer name eth0 netns "$ns"
    ip link set "v$tag$i" master "br$tag" up
    ip -n "$ns" addr add "$net.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
}

netns_down() {
  local tag=$1 n=$2 i
  for ((i = 0; i < n; i++)); do ip netns del "$tag-$i" 2>/dev/null; done
  ip link del "br$tag" 2>/dev/null
}
