#!/usr/bin/env bash
# A real one-node Slurm (issue 34): slurmctld and slurmd on this machine, configured in a temporary
# directory, then `srun -n N ./job collectives` as a user would run it. Authentication: auth/none
# and cred/none where their plugins are installed (Debian 12's Slurm 22.05 has them; newer Slurm
# releases dropped them), so no third daemon; otherwise, or with SLURM_TEST_AUTH=munge, auth/munge
# with a munged of this test's own (its own key and socket in the temporary directory). Every task listens on this node's address, each on its own port: one step per way
# the Slurm resolver finds its ports, and one per srun MPI plugin that puts another launcher's
# variables next to Slurm's:
#   resv-ports  srun --resv-ports=N: the ports come from SLURM_STEP_RESV_PORTS;
#   port-base   CONSORT_PORT_BASE=P in srun's environment (srun exports it): task k listens on P + k;
#   pmi2        srun --mpi=pmi2 --resv-ports=N: PMI_RANK and PMI_SIZE are set, SLURM_MPI_TYPE=pmi2;
#   pmix        srun --mpi=pmix --resv-ports=N: PMIX_RANK is set (only where Slurm's mpi/pmix
#               plugin loads; otherwise the step is skipped with a note).
# In each step every worker must print "worker I: K of K checks passed".
#
# Usage: slurm_test.sh MW_JOB [N]          (N tasks, default 3; needs root)
# Output: each step's lines prefixed "[STEP] " (and srun -l's "RANK: "), then "ok: ..." or
# "FAILED: ..." per step. Exit status: 0 when every step passed; 1 when one failed; 77 with a
# "skipped: ..." line when Slurm is not installed (Debian's slurmctld, slurmd and slurm-client;
# tools/setup.sh installs them), when not root, or when the daemons do not come up in time.
# Bounds: SLURM_TEST_START_S (default 30) for the daemons to come up, MW_TIMEOUT_S (default 60) per
# srun; the daemons themselves run under timeout(1), so none outlives the test by long even if this
# script is killed with SIGKILL.
set -uo pipefail
job=${1:?usage: slurm_test.sh MW_JOB [N]} n=${2:-3}
start_s=${SLURM_TEST_START_S:-30}
step_s=${MW_TIMEOUT_S:-60}
keep=${SLURM_TEST_KEEP:-0}
auth=${SLURM_TEST_AUTH:-}
ms() { echo $(($(date +%s%N) / 1000000)); }

for tool in slurmctld slurmd srun scontrol sinfo squeue scancel; do
  if ! command -v "$tool" >/dev/null; then
    echo "skipped: slurm is not installed ($tool not found; Debian's slurmctld, slurmd and" \
      "slurm-client, which tools/setup.sh installs)"
    exit 77
  fi
done
if [ "$(id -u)" -ne 0 ]; then
  echo "skipped: slurmd must run as root to start the job's tasks"
  exit 77
fi

# Nothing from the caller's environment may reach srun or the tasks: not an enclosing Slurm job
# (srun would join it), not another launcher's variables, not the port base.
for v in $(compgen -e); do
  case "$v" in
    SLURM_* | SLURMD_* | SALLOC_* | SBATCH_* | SRUN_* | OMPI_* | PMI_* | PMIX_* | MPI_LOCALRANKID)
      unset "$v" ;;
  esac
done
unset TF_CONFIG CONSORT_CHIEF_ADDRESS CONSORT_PORT_BASE CONSORT_WORKER_HOST RANK WORLD_SIZE \
  LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID \
  TORCHELASTIC_USE_AGENT_STORE KUBERNETES_SERVICE_HOST
# A secret, as a user should set one (srun exports the environment to every task): connections are
# authenticated, and no warning about an unauthenticated cluster.
export CONSORT_CLUSTER_SECRET="slurm-test-$$-$RANDOM$RANDOM"

dir=$(mktemp -d /tmp/consort-slurm.XXXXXX) || { echo "FAILED: mktemp"; exit 1; }
mkdir -p "$dir/state" "$dir/spool"
ctld_wrapper="" slurmd_wrapper="" srun_wrapper="" munged_wrapper=""

# Stops what this script started, by process id, on every exit path: the job's steps first (so no
# slurmstepd is left behind), then the daemons, each given 10 s to end before SIGKILL.
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # An srun still running (this script was interrupted): SIGTERM makes it cancel its step.
  [ -n "$srun_wrapper" ] && kill -TERM "$srun_wrapper" 2>/dev/null
  if [ -n "$ctld_wrapper" ] && kill -0 "$ctld_wrapper" 2>/dev/null; then
    # The tasks of any step still running, as slurmd knows them, then every job cancelled; a task
    # still alive 10 s later gets SIGKILL.
    local tasks
    tasks=$(timeout -k 1 3 scontrol listpids 2>/dev/null | awk '$1 ~ /^[0-9]+$/ { print $1 }')
    timeout -k 2 5 scancel --partition=debug >/dev/null 2>&1
    local end_ms=$(($(ms) + 10000))
    while [ "$(ms)" -lt "$end_ms" ] && [ -n "$(timeout -k 1 3 squeue -h -o %i 2>/dev/null)" ]; do
      sleep 0.1
    done
    for p in $tasks; do kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null; done
  fi
  local pids=()
  for p in "$srun_wrapper" "$slurmd_wrapper" "$ctld_wrapper" "$munged_wrapper"; do
    [ -n "$p" ] && pids+=("$p")
  done
  for f in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munged.pid"; do
    [ -s "$f" ] && pids+=("$(cat "$f")")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    kill -TERM "${pids[@]}" 2>/dev/null
    local end_ms=$(($(ms) + 10000)) alive=1
    while [ "$alive" = 1 ] && [ "$(ms)" -lt "$end_ms" ]; do
      alive=0
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" = 1 ] && sleep 0.1
    done
    if [ "$alive" = 1 ]; then
      echo "note: a daemon ignored SIGTERM for 10 s; sending SIGKILL"
      kill -KILL "${pids[@]}" 2>/dev/null
    fi
    wait 2>/dev/null
  fi
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; then
    for log in slurmctld slurmd munged; do
      echo "--- the end of $log.log"
      tail -n 15 "$dir/$log.log" 2>/dev/null
    done
  fi
  if [ "$keep" = 1 ]; then echo "note: kept $dir"; else rm -rf "$dir"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The node is this host under its own name (slurmctld runs only where SlurmctldHost names it),
# reached at 127.0.0.1. The tasks resolve SLURM_STEP_NODELIST, so that name must resolve; where it
# does not, slurmd takes the node name "localhost".
host=$(hostname -s)
node=$host
getent hosts "$node" >/dev/null || node=localhost
# What slurmd finds on this machine, so that the node is not drained for having fewer CPUs than
# configured.
cpus=$(slurmd -C 2>/dev/null | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p')
[ -n "$cpus" ] || cpus=1

# Ports: a block of 30 + N below the kernel's ephemeral range (as tests/multiworker/lib.sh picks
# its own) with none in use now: the daemons take the first two, srun --resv-ports draws from
# base + 10 .. base + 29, and CONSORT_PORT_BASE is base + 30.
pick_base() {
  local low=32768 used="" tries base p clash span
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  span=$((low - 10000 - 30 - n))
  [ "$span" -gt 1000 ] || span=1000
  command -v ss >/dev/null && used=$(ss -Htan 2>/dev/null | awk '{k = split($4, a, ":"); print a[k]}')
  for ((tries = 0; tries < 50; tries++)); do
    base=$((10000 + (RANDOM * 32768 + RANDOM) % span))
    clash=0
    for ((p = base; p < base + 30 + n; p++)); do
      if grep -qx "$p" <<<"$used"; then clash=1; break; fi
    done
    [ "$clash" -eq 0 ] && { echo "$base"; return 0; }
  done
  return 1
}
base=$(pick_base) || { echo "skipped: no free block of $((30 + n)) ports below the ephemeral range"; exit 77; }

# auth/none where its plugin is installed (newer Slurm releases dropped it), else munge.
if [ -z "$auth" ]; then
  auth=munge
  for plugins in /usr/lib/*/slurm-wlm /usr/lib/*/slurm /usr/lib64/slurm /usr/lib/slurm \
    /usr/local/lib/slurm; do
    [ -e "$plugins/auth_none.so" ] && [ -e "$plugins/cred_none.so" ] && auth=none
  done
fi
life=$((start_s + 4 * (step_s + 10) + 30))
auth_conf="AuthType=auth/none
CredType=cred/none"
if [ "$auth" = munge ]; then
  if ! command -v munged >/dev/null || ! command -v mungekey >/dev/null; then
    echo "skipped: auth/munge needs munged and mungekey (Debian's munge)"
    exit 77
  fi
  # Its own key and socket; --force: root owns the key, and the socket's directory is private.
  mungekey -c -k "$dir/munge.key" >/dev/null 2>&1 || { echo "FAILED: mungekey -c"; exit 1; }
  timeout -k 5 "$life" munged -F --force --socket="$dir/munge.socket" --key-file="$dir/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" \
    >"$dir/munged.out" 2>&1 &
  munged_wrapper=$!
  munge_deadline=$(($(ms) + start_s * 1000))
  until [ -S "$dir/munge.socket" ]; do
    if ! kill -0 "$munged_wrapper" 2>/dev/null || [ "$(ms)" -ge "$munge_deadline" ]; then
      tail -n 15 "$dir/munged.out"
      echo "skipped: munged did not create its socket within ${start_s} s"
      exit 77
    fi
    sleep 0.05
  done
  auth_conf="AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge"
elif [ "$auth" != none ]; then
  echo "FAILED: SLURM_TEST_AUTH is '$auth'; expected none or munge"
  exit 1
fi

cat >"$dir/slurm.conf" <<EOF
# A one-node cluster for tests/multiworker/slurm_test.sh (consort).
ClusterName=consorttest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base
SlurmdPort=$((base + 1))
SlurmUser=root
SlurmdUser=root
$auth_conf
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
MpiParams=ports=$((base + 10))-$((base + 29))
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=2
MessageTimeout=5
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
# mpi.conf (read from slurm.conf's directory): srun --mpi=pmix's client directories under ours, not
# /tmp/spmix_appdir_UID_JOB.STEP, which another such cluster's job 4 would also want.
mkdir -p "$dir/pmix"
echo "PMIxCliTmpDirBase=$dir/pmix" >"$dir/mpi.conf"
export SLURM_CONF="$dir/slurm.conf"
# (srun reads the configuration even for --version: without one it looks for a DNS SRV record.)
echo "$(slurmctld -V) (slurmctld), $(slurmd -V) (slurmd), $(timeout -k 1 5 srun --version) (srun);" \
  "auth/$auth"

# The daemons in the foreground of their own (-D), in the background of this script, under a
# timeout that outlasts every step.
t0=$(ms)
timeout -k 5 "$life" slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
ctld_wrapper=$!
timeout -k 5 "$life" slurmd -D -N "$node" -f "$SLURM_CONF" >"$dir/slurmd.out" 2>&1 &
slurmd_wrapper=$!

# Up means: the controller answers a ping, and the node has registered and is idle.
deadline=$((t0 + start_s * 1000))
state=""
while :; do
  if ! kill -0 "$ctld_wrapper" 2>/dev/null || ! kill -0 "$slurmd_wrapper" 2>/dev/null; then
    which=slurmctld
    kill -0 "$ctld_wrapper" 2>/dev/null && which=slurmd
    echo "--- $which's output"
    tail -n 15 "$dir/$which.out" "$dir/$which.log" 2>/dev/null
    echo "skipped: $which exited during start-up (see its output above)"
    exit 77
  fi
  if timeout -k 1 3 scontrol ping 2>/dev/null | grep -q "is UP"; then
    state=$(timeout -k 1 3 sinfo -h -n "$node" -o %T 2>/dev/null)
    [ "$state" = idle ] && break
  fi
  if [ "$(ms)" -ge "$deadline" ]; then
    echo "--- the end of slurmctld's and slurmd's logs"
    tail -n 15 "$dir/slurmctld.log" "$dir/slurmd.log" 2>/dev/null
    echo "skipped: the one-node cluster was not up within ${start_s} s (node state: '${state:-none}')"
    exit 77
  fi
  sleep 0.1
done
echo "ok: slurmctld and slurmd up, node $node idle with $cpus CPU(s), after $(($(ms) - t0)) ms"

failures=0
# run_step NAME [VAR=VALUE...] -- SRUN_OPTIONS...: srun -n N of `JOB collectives` (-O: more tasks
# than CPUs; -l: each line prefixed "RANK: "), then every worker's line checked.
run_step() {
  local name=$1 settings=() opts=()
  shift
  while [ "$1" != "--" ]; do settings+=("$1"); shift; done
  shift
  opts=("$@")
  local out="$dir/$name.out" t rc
  t=$(ms)
  echo "== $name: ${settings[*]}${settings[*]:+ }srun -n $n -O ${opts[*]}${opts[*]:+ }-l MW_JOB collectives"
  # In the background, so that a signal to this script is handled at once, not when srun ends.
  env "${settings[@]}" timeout -k 5 "$step_s" \
    srun -n "$n" -O "${opts[@]}" -l --kill-on-bad-exit=1 "$job" collectives >"$out" 2>&1 &
  srun_wrapper=$!
  wait "$srun_wrapper"
  rc=$?
  srun_wrapper=""
  sed "s/^/[$name] /" "$out"
  local passed=0 i
  for ((i = 0; i < n; i++)); do
    grep -Eq "^ *$i: worker $i: ([0-9]+) of \1 checks passed$" "$out" && passed=$((passed + 1))
  done
  if [ "$rc" -eq 0 ] && [ "$passed" -eq "$n" ]; then
    echo "ok: $name: $passed of $n workers passed every check, in $(($(ms) - t)) ms"
  else
    echo "FAILED: $name: srun exited with $rc; $passed of $n workers passed every check"
    failures=$((failures + 1))
  fi
}

run_step resv-ports -- --resv-ports="$n"
run_step port-base "CONSORT_PORT_BASE=$((base + 30))" --
run_step pmi2 -- --mpi=pmi2 --resv-ports="$n"
if timeout -k 1 5 srun --mpi=list 2>&1 | grep -q pmix; then
  run_step pmix -- --mpi=pmix --resv-ports="$n"
else
  echo "note: pmix: Slurm's mpi/pmix plugin is not installed here; step not run"
fi

[ "$failures" -eq 0 ] && echo "ok: every step passed" || exit 1
