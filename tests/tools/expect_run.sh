#!/usr/bin/env bash
# expect_run.sh: runs a command for a CTest registration and checks its exit status AND its output.
#
# CTest's PASS_REGULAR_EXPRESSION ignores the exit status, so a program that prints the right line
# and then crashes, hangs into a timeout that exits under CTest's own limit, or returns 1 still
# passes. Registrations use this script instead:
#
#   expect_run.sh [--status N] [--match REGEX]... [--forbid REGEX]... [--skip-if REGEX]
#                 -- COMMAND [ARGS...]
#
#   --status N      the exit status COMMAND must end with (default 0);
#   --match REGEX   a line of COMMAND's output (stdout and stderr together) must match REGEX
#                   (grep -E); give it once per line that must be there;
#   --forbid REGEX  no line may match REGEX;
#   --skip-if REGEX when a line matches, the run is skipped: the script prints that line as the
#                   reason and exits 77 (register the test with SKIP_RETURN_CODE 77). A skip wins
#                   over every other check, so pick a line that only the skip case prints.
#
# COMMAND's output is printed as it was; then one line per failed check, and the verdict. Exit
# status: 0 when every check held, 1 when one did not, 77 on a skip, 2 on a usage error.
set -uo pipefail

usage() {
  echo "expect_run.sh: $1" >&2
  echo "usage: expect_run.sh [--status N] [--match REGEX]... [--forbid REGEX]... [--skip-if REGEX] -- COMMAND..." >&2
  exit 2
}

status=0
matches=()
forbids=()
skip_if=""
while [ $# -gt 0 ]; do
  case "$1" in
    --status)
      [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] || usage "--status needs an exit status (0-255), got '${2-}'"
      status=$2
      shift 2
      ;;
    --match)
      [ $# -ge 2 ] || usage "--match needs a regular expression"
      matches+=("$2")
      shift 2
      ;;
    --forbid)
      [ $# -ge 2 ] || usage "--forbid needs a regular expression"
      forbids+=("$2")
      shift 2
      ;;
    --skip-if)
      [ $# -ge 2 ] || usage "--skip-if needs a regular expression"
      skip_if=$2
      shift 2
      ;;
    --)
      shift
      break
      ;;
    *) usage "unknown option '$1' (the command goes after --)" ;;
  esac
done
[ $# -gt 0 ] || usage "no command after --"

out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" >"$out" 2>&1
rc=$?
cat "$out"

if [ -n "$skip_if" ]; then
  reason=$(grep -E -m1 -- "$skip_if" "$out")
  if [ -n "$reason" ]; then
    echo "expect_run: skipped: $reason"
    exit 77
  fi
fi

failed=0
if [ "$rc" -ne "$status" ]; then
  echo "expect_run: FAILED: exit status $rc, expected $status"
  failed=1
fi
for m in "${matches[@]}"; do
  if ! grep -qE -- "$m" "$out"; then
    echo "expect_run: FAILED: no line matches '$m'"
    failed=1
  fi
done
for f in "${forbids[@]}"; do
  if line=$(grep -E -m1 -- "$f" "$out"); then
    echo "expect_run: FAILED: a line matches the forbidden '$f': $line"
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "expect_run: ok (exit status $rc, ${#matches[@]} line(s) matched)"
exit "$failed"
