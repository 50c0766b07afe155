#!/usr/bin/env bash
# tools/consort-diagnose on hand-made flight recorder dumps: a worker behind, a worker ahead,
# signatures that disagree (with a majority and without), a worker that left no dump, and bad
# input. Usage: diagnose_test.sh PATH/TO/consort-diagnose
set -uo pipefail
diagnose=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0

# dump SUBDIR NAME RANK WORKERS ENTRY...: one dump in $dir/SUBDIR; an entry is
# "number:state:signature[:arrived ranks]".
dump() {
  local sub=$1 name=$2 rank=$3 workers=$4 entries="" e number state sig arrived
  shift 4
  for e in "$@"; do
    IFS=: read -r number state sig arrived <<<"$e"
    [ -n "$entries" ] && entries+=","
    entries+="{\"type\":\"collective\",\"number\":$number,\"step\":$((number - 1)),\"seq\":0,"
    entries+="\"op\":\"all_reduce(SUM)\",\"signature\":\"$sig\",\"state\":\"$state\","
    entries+="\"arrived\":[${arrived:-}]}"
  done
  printf '{"format":"consort-flight-recorder-1","worker":"%s","rank":%d,"workers":%s,"entries":[%s]}\n' \
    "$name" "$rank" "$workers" "$entries" >"$dir/$sub/consort-flight-${name/:/-}-$rank.json"
}

expect() {
  local what=$1 want=$2 got
  shift 2
  got=$("$diagnose" "$@" 2>&1)
  if [[ "$got" != *"$want"* ]]; then
    echo "FAIL $what: got '$got', want it to contain '$want'"
    failures=$((failures + 1))
  else
    echo "ok   $what: $got"
  fi
}

three='["worker:0","worker:1","worker:2"]'
mkdir -p "$dir/behind" "$dir/ahead" "$dir/major" "$dir/tie" "$dir/silent"
for w in 0 2; do dump behind "worker:$w" $w "$three" "1:done:float32[2]" "2:failed:float32[2]:0,2"; done
dump behind "worker:1" 1 "$three" "1:done:float32[2]"
expect "behind" "diagnosis: worker:1 is behind: it never called collective #2" "$dir/behind"

dump ahead "worker:0" 0 "$three" "1:done:float32[2]"
dump ahead "worker:1" 1 "$three" "1:done:float32[2]"
dump ahead "worker:2" 2 "$three" "1:done:float32[2]" "2:waiting:float32[2]:2"
expect "ahead" "diagnosis: worker:2 is ahead: it called collective #2" "$dir/ahead"

for w in 0 1; do dump major "worker:$w" $w "$three" "1:failed:float32[2]"; done
dump major "worker:2" 2 "$three" "1:failed:float32[3]"
expect "a majority" "worker:2 called all_reduce(SUM) (float32[3]) at step 0 where worker:0 and worker:1 called" "$dir/major"

two='["worker:0","worker:1"]'
dump tie "worker:0" 0 "$two" "1:failed:float32[2]"
dump tie "worker:1" 1 "$two" "1:failed:float32[3]"
expect "no majority" "disagree at collective #1: worker:0 called all_reduce(SUM) (float32[2]) at step 0; worker:1 called all_reduce(SUM) (float32[3])" "$dir/tie"

dump silent "worker:0" 0 "$three" "1:done:float32[2]" "2:failed:float32[2]:0,2"
dump silent "worker:2" 2 "$three" "1:done:float32[2]" "2:failed:float32[2]:0,2"
expect "no dump" "diagnosis: worker:1 left no dump and never called collective #2" "$dir/silent"

echo '{"not": "a dump"}' >"$dir/other.json"
expect "not a dump" "is not a flight recorder dump" "$dir/other.json"
if "$diagnose" "$dir/other.json" >/dev/null 2>&1; then
  echo "FAIL nothing to read must exit non-zero"
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] && echo "consort-diagnose: every case named the right worker"
exit "$failures"
