#!/usr/bin/env bash
# Tests of the checks that keep test registrations honest, each fed a run that must fail:
#   tests/tools/expect_run.sh     (how CTest registrations check a program's status and lines),
#   tools/ctest_selection.sh      (a ctest selection that must hold at least N tests),
#   tools/check_registrations.sh  (rejects registrations that can pass whatever happens).
# Usage: check_tools_test.sh <project root> <build dir with registered tests>
set -uo pipefail
root=$1
build=$2
expect_run=(bash "$root/tests/tools/expect_run.sh")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
# check NAME EXPECTED_STATUS COMMAND...: COMMAND must exit with EXPECTED_STATUS.
check() {
  local name=$1 want=$2
  shift 2
  "$@" >"$tmp/out" 2>&1
  local rc=$?
  if [ "$rc" -eq "$want" ]; then
    echo "ok: $name"
  else
    echo "FAILED: $name: exit status $rc, expected $want; its output:"
    sed 's/^/    /' "$tmp/out"
    failures=$((failures + 1))
  fi
}
# said NAME REGEX: the last check's output has a line matching REGEX.
said() {
  if grep -qE -- "$2" "$tmp/out"; then echo "ok: $1"; else
    echo "FAILED: $1: no line matches '$2'"
    failures=$((failures + 1))
  fi
}

# -- expect_run.sh: the failing runs that PASS_REGULAR_EXPRESSION let through.
check "the right line and status 0 pass" 0 "${expect_run[@]}" --match "verify.*: OK" -- \
  bash -c 'echo "verify (worker 0): OK"'
check "the right line then a crash fails" 1 "${expect_run[@]}" --match "verify.*: OK" -- \
  bash -c 'echo "verify (worker 0): OK"; kill -SEGV $$'
check "the right line then the launcher's timeout (124) fails" 1 "${expect_run[@]}" \
  --match "verify.*: OK" -- bash -c 'echo "verify (worker 0): OK"; exit 124'
check "one worker's line without the other's fails" 1 "${expect_run[@]}" \
  --match "verify \(worker 0\).*OK" --match "verify \(worker 1\).*OK" -- \
  bash -c 'echo "verify (worker 0): OK"'
check "a forbidden line fails" 1 "${expect_run[@]}" --match "OK" --forbid MISMATCH -- \
  bash -c 'echo "OK"; echo "MISMATCH"'
check "a refusal must exit with its status" 1 "${expect_run[@]}" --status 2 \
  --match "unknown device" -- bash -c 'echo "unknown device"; exit 1'
check "a refusal with its status and line passes" 0 "${expect_run[@]}" --status 2 \
  --match "unknown device" -- bash -c 'echo "unknown device"; exit 2'
check "a skip line skips (77)" 77 "${expect_run[@]}" --skip-if "^no GPU visible \(" \
  --match "on GPU:0" -- bash -c 'echo "no GPU visible (no driver): CPU replicas"; exit 0'
said "the skip names its reason" "skipped: no GPU visible \(no driver\)"
check "GPUs seen but not taken fails instead of skipping" 1 "${expect_run[@]}" \
  --skip-if "^no GPU visible \(" --match "replica\(s\) on GPU:0" -- \
  bash -c 'echo "consort-train: 1 worker(s) x 2 replica(s) on CPU:0,CPU:1"'
check "a usage error is reported" 2 "${expect_run[@]}" --status x -- true

# -- ctest_selection.sh: a selection that matches nothing, or too little, fails.
check "a selection of no test fails" 1 bash "$root/tools/ctest_selection.sh" 1 --test-dir "$build" \
  -R '^no\.such\.test$'
said "it says what it selected" "selects 0 test\(s\), expected at least 1"
check "a selection smaller than its floor fails" 1 bash "$root/tools/ctest_selection.sh" 2 \
  --test-dir "$build" -R '^train\.demo_rejects_unknown_devices$'
check "a selection at its floor runs" 0 bash "$root/tools/ctest_selection.sh" 1 \
  --test-dir "$build" -R '^train\.demo_rejects_unknown_devices$'

# -- check_registrations.sh: a fixture tree with one of each defect, then the same tree fixed.
fixture=$tmp/tree
mkdir -p "$fixture/tools" "$fixture/b"
cat >"$fixture/CMakeLists.txt" <<'CMAKE'
add_test(NAME a COMMAND prog)
set_tests_properties(a PROPERTIES PASS_REGULAR_EXPRESSION "done")
add_test(NAME b COMMAND bash expect_run.sh --match "faster: (yes|NO)" -- prog)
add_test(NAME c COMMAND $<TARGET_FILE:fake_tests>
                --gtest_filter=Renamed.Suite)
CMAKE
printf '#!/usr/bin/env bash\nctest --test-dir b -L renamed\n' >"$fixture/tools/run.sh"
# A stand-in gtest binary whose list holds one suite, Present.
printf '#!/usr/bin/env bash\n[ "$2" = "--gtest_filter=Present.Test" ] && printf "Present.\\n  Test\\n"\nexit 0\n' \
  >"$fixture/b/fake_tests"
chmod +x "$fixture/b/fake_tests"
(cd "$fixture" && git init -q && git add -A) || { echo "FAILED: git init of the fixture"; exit 1; }
check "a tree with every defect fails" 1 env CHECK_REGISTRATIONS_ROOT="$fixture" \
  bash "$root/tools/check_registrations.sh" b
said "it names the PASS_REGULAR_EXPRESSION" "CMakeLists.txt:2:.*PASS_REGULAR_EXPRESSION ignores the exit status"
said "it names the success-or-failure alternation" "CMakeLists.txt:3:.*accepts success and failure alike"
said "it names the ctest without --no-tests=error" "tools/run.sh:2:.*ctest without --no-tests=error"
said "it names the filter that selects nothing" "--gtest_filter=Renamed.Suite selects no test of fake_tests"
cat >"$fixture/CMakeLists.txt" <<'CMAKE'
add_test(NAME a COMMAND bash expect_run.sh --match "done" -- prog)
add_test(NAME b COMMAND bash expect_run.sh --match "faster: " -- prog)
add_test(NAME c COMMAND $<TARGET_FILE:fake_tests>
                --gtest_filter=Present.Test)
CMAKE
printf '#!/usr/bin/env bash\nctest --test-dir b --no-tests=error -L renamed\n' >"$fixture/tools/run.sh"
(cd "$fixture" && git add -A)
check "the fixed tree passes" 0 env CHECK_REGISTRATIONS_ROOT="$fixture" \
  bash "$root/tools/check_registrations.sh" b

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
