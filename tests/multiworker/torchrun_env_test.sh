#!/usr/bin/env bash
# Workers started as torchrun starts them, with no TF_CONFIG and no CONSORT_CHIEF_ADDRESS: each
# process has torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
# TORCHELASTIC_RUN_ID and TORCHELASTIC_USE_AGENT_STORE, so resolve_cluster() picks the torchrun
# resolver, whose ranks learn each other's addresses at the rendezvous through MASTER_ADDR.
#
#   torchrun_env_test.sh MW_JOB plain N     N workers; every one passes `mw_job collectives`.
#   torchrun_env_test.sh MW_JOB agent-store N
#       As plain, with TORCHELASTIC_USE_AGENT_STORE=True while something (standing in for
#       torchrun's agent store) listens on MASTER_PORT: the chief must listen on MASTER_PORT + 1.
#       Needs python3 for the listener; exits 77 (skip) without it.
#   torchrun_env_test.sh MW_JOB half-set
#       Workers whose environment is half set must fail within a second (times
#       CONSORT_TEST_TIME_SCALE), naming what is set and what is missing: RANK and WORLD_SIZE
#       without MASTER_ADDR; MASTER_ADDR and MASTER_PORT without RANK and WORLD_SIZE.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
job=$1 scenario=$2 n=${3:-2}

# Every variable a resolver reads, so that the workers see only what each case sets.
launcher_variables=(TF_CONFIG SLURM_PROCID SLURM_MPI_TYPE OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE
  OMPI_COMM_WORLD_LOCAL_RANK PMI_RANK PMI_SIZE MPI_LOCALRANKID PMI_LOCAL_RANK PMIX_RANK RANK
  WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
  TORCHELASTIC_USE_AGENT_STORE CONSORT_CHIEF_ADDRESS KUBERNETES_SERVICE_HOST)
unset_all=()
for v in "${launcher_variables[@]}"; do unset_all+=(-u "$v"); done

# start_worker I SETTINGS...: worker I (output prefixed [rank:I]) with only SETTINGS (NAME=VALUE)
# of the launcher variables.
start_worker() {
  local i=$1
  shift
  (
    exec env "${unset_all[@]}" "$@" timeout -k 5 "$MW_TIMEOUT_S" "$job" collectives
  ) > >(sed -u "s/^/[rank:$i] /") 2>&1 &
  MW_PIDS[$i]=$!
}

# start_torchrun_workers N PORT AGENT_STORE: N workers as torchrun starts them on one host.
start_torchrun_workers() {
  local count=$1 port=$2 store=$3 i
  for ((i = 0; i < count; i++)); do
    start_worker "$i" RANK="$i" WORLD_SIZE="$count" LOCAL_RANK="$i" LOCAL_WORLD_SIZE="$count" \
      MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" TORCHELASTIC_RUN_ID=consort-test \
      TORCHELASTIC_USE_AGENT_STORE="$store"
  done
}

case "$scenario" in
plain)
  port=$(mw_base_port 2)
  echo "== $n workers with torchrun's variables, MASTER_PORT $port"
  start_torchrun_workers "$n" "$port" False
  mw_finish
  ;;

agent-store)
  command -v python3 >/dev/null || {
    echo "skipped: python3 is needed to listen on MASTER_PORT"
    exit 77
  }
  port=$(mw_base_port 2)
  echo "== $n workers with TORCHELASTIC_USE_AGENT_STORE=True; 127.0.0.1:$port is taken"
  # The stand-in for torchrun's agent store: it listens on MASTER_PORT, says so through a FIFO,
  # and lives at most as long as the workers may. It is not a child of this shell, so that
  # mw_finish's `wait` does not wait for it.
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  mkfifo "$dir/store"
  exec {store}<>"$dir/store"
  store_pid=$( (exec timeout "$((MW_TIMEOUT_S + 10))" python3 -c '
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(3600)
' "$port" >"$dir/store" 2>&1 &
    echo $!))
  if ! read -r -t 10 -u "$store" line || [ "$line" != listening ]; then
    echo "FAIL: the stand-in store did not listen on 127.0.0.1:$port within 10 s (${line:-nothing})"
    kill "$store_pid" 2>/dev/null
    exit 1
  fi
  echo "the stand-in store listens on 127.0.0.1:$port"
  {
    start_torchrun_workers "$n" "$port" True
    mw_finish
  } >"$dir/out" 2>&1
  status=$?
  cat "$dir/out"
  # Every worker other than the chief reached the chief at MASTER_PORT + 1.
  for ((i = 1; i < n; i++)); do
    if grep -q "^\[rank:$i\] .* from the chief at 127\.0\.0\.1:$((port + 1)): $n members" "$dir/out"; then
      echo "ok: rank $i reached the chief at MASTER_PORT + 1 = $((port + 1))"
    else
      echo "FAIL: rank $i did not report the view of $n members from the chief at 127.0.0.1:$((port + 1))"
      status=1
    fi
  done
  if kill -0 "$store_pid" 2>/dev/null; then
    echo "ok: the stand-in store still listened on 127.0.0.1:$port at the end"
  else
    echo "FAIL: the stand-in store on 127.0.0.1:$port is gone"
    status=1
  fi
  kill "$store_pid" 2>/dev/null
  exec {store}<&-
  exit $status
  ;;

half-set)
  scale=${CONSORT_TEST_TIME_SCALE:-1}
  [[ "$scale" =~ ^[0-9]+$ ]] && [ "$scale" -ge 1 ] && [ "$scale" -le 100 ] || scale=1
  bound_ms=$((1000 * scale))
  port=$(mw_base_port 2)
  status=0
  # half_set NAME SETTINGS...: one worker with SETTINGS must exit with status 1 within the bound.
  half_set() {
    local name=$1 start end ms
    shift
    echo "== $name"
    start=$(date +%s%N)
    MW_PIDS=() MW_EXPECT=() MW_FAILED=0
    start_worker 1 "$@"
    mw_expect 1 1
    mw_finish || status=1
    end=$(date +%s%N)
    ms=$(((end - start) / 1000000))
    if [ "$ms" -lt "$bound_ms" ]; then
      echo "ok: $name: failed after $ms ms"
    else
      echo "FAIL: $name: failed after $ms ms, expected under $bound_ms ms"
      status=1
    fi
  }
  half_set "RANK and WORLD_SIZE without MASTER_ADDR" RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 \
    LOCAL_WORLD_SIZE=2 MASTER_PORT="$port"
  half_set "MASTER_ADDR and MASTER_PORT without RANK and WORLD_SIZE" MASTER_ADDR=127.0.0.1 \
    MASTER_PORT="$port" LOCAL_RANK=0
  exit $status
  ;;

*)
  echo "usage: torchrun_env_test.sh MW_JOB plain|agent-store N | half-set" >&2
  exit 2
  ;;
esac
