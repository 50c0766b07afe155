#!/usr/bin/env bash
# check_registrations.sh [BUILD_DIR]: rejects test registrations that can pass whatever happens.
# tools/test.sh runs it after the build. It fails, naming the file and line, on
#   1. a PASS_REGULAR_EXPRESSION in a CMakeLists.txt: with one, CTest ignores the exit status, so a
#      run that prints its line and then crashes or times out passes. Register through
#      tests/tools/expect_run.sh (--status, --match, --forbid, --skip-if) instead;
#   2. an expected line (--match or a regular expression) that accepts a success word and a
#      failure word alike, such as "(yes|NO)" or "(OK|MISMATCH)";
#   3. a ctest run in tools/ or .ci/ without --no-tests=error (a selection that matches nothing
#      exits 0 and prints "tests passed"); tools/ctest_selection.sh adds it, and `ctest -N` only
#      lists;
#   4. a --gtest_filter in a CMakeLists.txt that selects no test of its binary (gtest runs zero
#      tests and exits 0): each is listed with --gtest_list_tests from BUILD_DIR (default build).
# CHECK_REGISTRATIONS_ROOT: the git tree to check (default: this one; its test uses a fixture).
# Exit status: 0 when nothing was found, 1 otherwise.
set -uo pipefail
cd "${CHECK_REGISTRATIONS_ROOT:-$(dirname "$0")/..}" || exit 1
build=${1:-build}
problems=0
complain() {
  echo "check_registrations: $*"
  problems=$((problems + 1))
}

mapfile -t cmake_files < <(git ls-files '*CMakeLists.txt' '*.cmake')

# 1. PASS_REGULAR_EXPRESSION.
while IFS= read -r hit; do
  complain "$hit: PASS_REGULAR_EXPRESSION ignores the exit status; use tests/tools/expect_run.sh"
done < <(grep -nHE '^[^#]*PASS_REGULAR_EXPRESSION' "${cmake_files[@]}")

# 2. Alternations of a success word and a failure word, in any order.
success='(yes|ok|pass|passed|success|true)'
failure='(no|mismatch|fail|failed|failure|false|error)'
alternation="\\((${success}\\|([^()]*\\|)?${failure}|${failure}\\|([^()]*\\|)?${success})([^()]*)?\\)"
while IFS= read -r hit; do
  complain "$hit: an expected line that accepts success and failure alike"
done < <(grep -inHE "^[^#]*(--match|REGULAR_EXPRESSION).*${alternation}" "${cmake_files[@]}")

# 3. ctest without --no-tests=error in the scripts CI runs.
while IFS= read -r hit; do
  line=${hit#*:*:}
  case "$line" in
    *--no-tests=error* | *" -N"* | *ctest_selection.sh*) ;;
    *) complain "$hit: ctest without --no-tests=error (or tools/ctest_selection.sh)" ;;
  esac
done < <(grep -nHE '^[^#]*(^|[[:space:];&|({"(])ctest[[:space:]]' tools/*.sh .ci/run 2>/dev/null |
  grep -v '^tools/check_registrations.sh:')

# 4. --gtest_filter that selects nothing. A registration names its binary as $<TARGET_FILE:name>.
filters=$(for file in "${cmake_files[@]}"; do
  awk -v file="$file" '
    /\$<TARGET_FILE:[A-Za-z0-9_]+>/ { match($0, /\$<TARGET_FILE:[A-Za-z0-9_]+>/); target = substr($0, RSTART + 14, RLENGTH - 15) }
    /--gtest_filter=/ { match($0, /--gtest_filter=[^ )"]+/); print file ":" FNR, target, substr($0, RSTART + 15, RLENGTH - 15) }' "$file"
done)
while read -r where target filter; do
  [ -n "$where" ] || continue
  binary=$(find "$build" -type f -name "$target" -perm -u+x 2>/dev/null | head -1)
  if [ -z "$binary" ]; then
    echo "check_registrations: $where: $target is not built in $build; its --gtest_filter=$filter is not checked"
    continue
  fi
  count=$("$binary" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -c '^  ')
  [ "$count" -gt 0 ] || complain "$where: --gtest_filter=$filter selects no test of $target"
done <<<"$filters"

if [ "$problems" -gt 0 ]; then
  echo "check_registrations: $problems problem(s) found"
  exit 1
fi
echo "check_registrations: ok"
