#!/usr/bin/env bash
# ctest_selection.sh MIN CTEST_ARGS...: runs a CTest selection that must hold at least MIN tests.
#
# A `ctest -L ...` or `-R ...` that matches nothing exits 0 and prints "tests passed", so a renamed
# suite or label silently leaves a tier (the sanitizers, say). This lists the selection first
# (`ctest -N` with the same arguments), fails saying so when it holds fewer than MIN tests, and
# then runs it with --no-tests=error. Exit status: ctest's, or 1 when the selection is too small,
# 2 on a usage error.
set -uo pipefail
[[ "${1-}" =~ ^[0-9]+$ ]] || { echo "ctest_selection.sh: usage: ctest_selection.sh MIN CTEST_ARGS..." >&2; exit 2; }
min=$1
shift
count=$(ctest -N "$@" 2>/dev/null | sed -nE 's/^Total Tests: ([0-9]+)$/\1/p')
count=${count:-0}
if [ "$count" -lt "$min" ]; then
  echo "ctest_selection: FAILED: 'ctest $*' selects $count test(s), expected at least $min" \
    "(a renamed suite or label?)"
  exit 1
fi
echo "ctest_selection: 'ctest $*': $count test(s) (at least $min expected)"
ctest --no-tests=error "$@"
