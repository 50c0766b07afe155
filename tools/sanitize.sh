#!/usr/bin/env bash
# The sanitizer tier of CI (.ci/run runs it after tools/test.sh): builds the core, actors,
# transport and testing tests (and, for ASan, the multi-worker job) under
#   address  ASan + UBSan (UBSan findings fatal) into build-asan/,
#   thread   TSan into build-tsan/,
# with GCC 12 (the compiler libcaf-dev, libcapnp-dev and libgtest-dev were built with: the same
# libstdc++ ABI, and -Werror judged by the compiler of the normal build), CUDA off, -Werror on,
# and runs them with CTest. No benchmarks or examples are built.
#
# Usage:   tools/sanitize.sh [address|thread|all]      (default: all)
# Env:     JOBS=N  build jobs (default: nproc)
#          TEST_JOBS=N  test jobs (default: nproc + 1: most of these tests wait on sockets and
#                  deadlines rather than compute, so one more than the cores keeps them busy)
#          SANITIZE_BUILD_ONLY=1  build, run nothing
# Exit:    0 when every selected test passes with no sanitizer report.
#
# What runs (the rest is left out for time, or because it cannot work; docs/sanitizers.md has the
# reasons):
#   address: consort_core_tests, consort_actors_tests, consort_transport_tests and
#            consort_testing_tests (its fuzz test and its elastic scenarios at 200 seeds), all but the
#            1M-element all-reduce sweeps and the sweeps over shared memory (`large_sweeps`), and
#            multiworker.collectives_* (mw_job under tools/consort-launch, 2-4 workers x 1-2
#            replicas) and multiworker.elastic_{loss,rejoin,chief-loss,chief-then-rejoin,
#            join-at-boundary,hang,chief-hang,late-reform}_* (elastic_job: a worker killed, then restarted,
#            the chief killed, a worker or the chief stopped; over TCP and shared memory).
#   thread:  consort_core_tests and consort_transport_tests (without any 1M-element sweep or 64 MiB
#            all-reduce or two-way transfer: `tsan_slow`), consort_testing_tests' SimTransport
#            suite (the simulated network alone), and the suites of
#            consort_actors_tests that run under CAF's test_coordinator or without CAF
#            (`caf_free`, a list of suites to include, so that a new suite on CAF's threaded
#            scheduler is left out until it is known to work), not the ones that run CAF's
#            threaded scheduler: libcaf_core is not instrumented, so TSan cannot
#            see that a CAF message orders its sender's writes before its receiver's reads, and it
#            reports every message as a race (thousands per run). The multi-worker job is left out
#            for the same reason.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
test_jobs=${TEST_JOBS:-$((jobs + 1))}

kinds=()
case "${1:-all}" in
  address | thread) kinds=("$1") ;;
  all) kinds=(address thread) ;;
  *)
    echo "usage: tools/sanitize.sh [address|thread|all]" >&2
    exit 2
    ;;
esac

unit_binaries='^consort_(core|actors|transport|testing)_tests$'
# The 1M-element all-reduce sweeps: most of the unit tests' time under ASan; the same code paths
# run, chunked, at 1001 elements, and the 64 MiB all-reduce still runs. (Left out for CI's time
# budget: with them .ci/run came within minutes of its 30; docs/sanitizers.md, "Cost".)
large_sweeps='^(Direct|OutOfPlace|Shm)?(RanksAndCounts|Large)/AllReduceSweepTest\..*Ranks1048579Elements|^Shm(RanksAndCounts|RanksAndSizes|Large)/'
# The algorithm sweeps over shared memory (`Shm*/...SweepTest`) are left out of both tiers too:
# they run the algorithms' code again over another transport, whose own tests
# (tests/transport/shm_test.cpp: rings smaller than the messages, abort, close, processes) do run
# under both sanitizers; with them .ci/run overran its 30 minutes (docs/sanitizers.md, "Cost").
# Under TSan (5-20x slower on memory-bound loops) also every 1M-element sweep and the two 64 MiB
# transfers: most of its time for no new interleavings (the chunked paths run at 1001 elements with
# small chunks).
tsan_slow='Ranks1048579Elements|^AllReduceTest\.RingAllReduceOf64MiBOfFloat32IsExact|^TcpTest\.Transfers64MiBEachWayAtOnce'
# consort_actors_tests' suites that TSan can judge: under CAF's test_coordinator (one thread), or
# without CAF messages (see above). The others run the strategy on CAF's threaded scheduler.
caf_free='^(CallChecksTest|CallMatcherTest|PrepareLocalNccl|CollectiveActorTest|CollectiveBoardTest|MergeBoardTest|ReplicaQueue|StepJoinTest|StepActorTest|RunHereTest|SpinMutex)\.|^CrossWorkerTest\.RunOrPost'

# Runtime options. Reports go to stderr, which CTest prints for a failing test.
#  - UBSan: stack traces; halt on the first report (the build has -fno-sanitize-recover for all
#    checks but `null`, which only this makes fatal; cmake/ConsortSanitize.cmake says why).
#  - ASan: leak checking stays on (LSan); strict_string_checks and init-order checks cost little.
#  - TSan: exit non-zero at the end of a process that had a report (TSan's default exitcode 66), and
#    keep going after a report so one run shows them all.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=${root}/tools/ubsan.supp"
export ASAN_OPTIONS="strict_string_checks=1:detect_stack_use_after_return=0:check_initialization_order=1:strict_init_order=1"
export LSAN_OPTIONS="suppressions=${root}/tools/lsan.supp:print_suppressions=0"
# The host block cache (device/host_memory.hpp) reuses freed tensors and transport buffers, which
# would hide a use after free from ASan: it is off under ASan (its own tests check both modes).
# TSan keeps it: its mutex is part of what TSan should see.
# The harness's fuzz test runs 200 of its 1000 seeds (each seed builds three strategies).
asan_env=(env CONSORT_HOST_CACHE_MB=0 CONSORT_HARNESS_SEEDS=200 CONSORT_ELASTIC_SEEDS=200)
export TSAN_OPTIONS="suppressions=${root}/tools/tsan.supp:second_deadlock_stack=1:history_size=4:print_suppressions=0"
# Wall-clock upper bounds in the tests ("returned at once, not at the deadline") are margins times
# this factor in both tiers (tests/support/time_scale.hpp): sanitized code on 2 cores with 3 test
# jobs runs 5-20x slower, and a 1 s margin that is generous in the plain build is not here.
export CONSORT_TEST_TIME_SCALE=${CONSORT_TEST_TIME_SCALE:-10}

# build KIND DIR: configure and build the selected targets of one sanitizer build.
build() {
  local kind=$1 dir=$2
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  # -O1: the sanitizers' recommendation (usable speed, precise reports); -g1: line tables for
  # file:line in stack traces at a fraction of the compile and link cost of -g. No NDEBUG.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DCMAKE_CXX_COMPILER=g++ -DCMAKE_C_COMPILER=gcc "${launcher[@]}" \
    -DCONSORT_SANITIZE="$kind" -DCONSORT_WERROR=ON -DCONSORT_WITH_CUDA=OFF \
    -DCONSORT_BUILD_BENCH=OFF -DCONSORT_BUILD_EXAMPLES=OFF >/dev/null
  local targets=(consort_core_tests consort_actors_tests consort_transport_tests
    consort_testing_tests)
  [ "$kind" = address ] && targets+=(mw_job elastic_job)
  cmake --build "$dir" --parallel "$jobs" --target "${targets[@]}"
}

# run_tests KIND DIR: the CTest selections of one sanitizer build. Each goes through
# tools/ctest_selection.sh with the least number of tests it must hold (the count when it was last
# changed; raise it when tests are added): a selection that matches nothing, or lost a suite to a
# rename, fails instead of printing "tests passed". caf_free names suites one by one, so each of
# them must select at least one test too.
run_tests() {
  local kind=$1 dir=$2
  local ctest=(bash tools/ctest_selection.sh)
  local args=(--test-dir "$dir" --output-on-failure -j"$test_jobs" --timeout 300)
  # Every selection runs; the function fails when any of them did (it runs inside `if`, where
  # `set -e` does not stop at a failing command).
  local failed=0
  if [ "$kind" = address ]; then
    "${asan_env[@]}" "${ctest[@]}" 962 "${args[@]}" -L "$unit_binaries" -E "$large_sweeps" || failed=1
    "${asan_env[@]}" "${ctest[@]}" 6 "${args[@]}" -R '^multiworker\.collectives_' || failed=1
    # Elastic groups: loss, rejoin, the chief's succession, a join at a step boundary, a hung
    # worker left out and a hung chief replaced, over TCP and shared memory.
    "${asan_env[@]}" "${ctest[@]}" 14 "${args[@]}" \
      -R '^multiworker\.elastic_(loss|rejoin|chief-loss|chief-then-rejoin|join-at-boundary|hang|chief-hang|late-reform)_' ||
      failed=1
  else
    "${ctest[@]}" 678 "${args[@]}" -L '^consort_(core|transport)_tests$' -E "$large_sweeps|$tsan_slow" || failed=1
    local suite
    for suite in $(echo "$caf_free" | grep -oE '[A-Za-z]+(Test|Nccl|Queue)\b' | sort -u); do
      if [ "$(ctest --test-dir "$dir" -N -L '^consort_actors_tests$' -R "^$suite\." | sed -nE 's/^Total Tests: //p')" = 0 ]; then
        echo "sanitize: FAILED: caf_free names the suite $suite, which holds no test (renamed?)"
        failed=1
      fi
    done
    "${ctest[@]}" 58 "${args[@]}" -L '^consort_actors_tests$' -R "$caf_free" || failed=1
    # consort::testing's simulated network on its own (its cluster tests run CAF's threaded scheduler).
    "${ctest[@]}" 3 "${args[@]}" -L '^consort_testing_tests$' -R '^SimTransport\.' || failed=1
  fi
  return "$failed"
}

status=0
for kind in "${kinds[@]}"; do
  case "$kind" in
    address) dir=${BUILD_DIR_ASAN:-build-asan} ;;
    thread) dir=${BUILD_DIR_TSAN:-build-tsan} ;;
  esac
  echo "sanitize: $kind: building into $dir"
  start=$SECONDS
  build "$kind" "$dir"
  echo "sanitize: $kind: built in $((SECONDS - start)) s"
  [ "${SANITIZE_BUILD_ONLY:-0}" = 1 ] && continue
  start=$SECONDS
  if run_tests "$kind" "$dir"; then
    echo "sanitize: $kind: tests passed in $((SECONDS - start)) s"
  else
    echo "sanitize: $kind: FAILED (after $((SECONDS - start)) s)"
    status=1
  fi
done
exit "$status"
