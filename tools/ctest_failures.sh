#!/usr/bin/env bash
# Prints the output of each test that failed in the last ctest run of BUILD_DIR, one after the
# other, so that the end of a long log (what CI shows) holds the failures themselves and not the
# hundreds of tests that ran after them.
#   tools/ctest_failures.sh [BUILD_DIR]     (default: build)
set -uo pipefail
dir=${1:-build}/Testing/Temporary
[ -s "$dir/LastTestsFailed.log" ] || { echo "ctest_failures: no failed tests recorded in $dir"; exit 0; }
cut -d: -f2- "$dir/LastTestsFailed.log" | while read -r name; do
  echo "==== $name"
  awk -v name="$name" '
    $0 ~ "^[0-9]+/[0-9]+ Testing: " && $3 == name { on = 1 }
    on { print }
    on && index($0, "\"" name "\" end time") == 1 { on = 0 }
  ' "$dir/LastTest.log" | tail -n 150
done
