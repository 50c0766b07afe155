#!/usr/bin/env bash
# tools/consort-diagnose on hand-made flight recorder dumps: a worker behind, a worker ahead,
# signatures that disagree (with a majority and without), a worker that left no dump, bad input;
# and the clocks, the trace and the stragglers of made-up dumps whose true times are known. Usage: diagnose_test.sh PATH/TO/consort-diagnose
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

# One timeline and stragglers, on dumps made up from known true times: 3 workers whose wall
# clocks are 2.5 s and -37 ms off the chief's and whose recorders started at different times, 40
# steps of 10 ms with one all-reduce each. In "late", worker 1 arrives 1 ms (10 %) after the
# others at every step; in "even", the arrivals differ by up to 50 us at random.
# Optional: "beats" adds what the membership heartbeats measured to each dump (the chief's wall
# clock minus the worker's, off the truth by 40 and -30 us, from round trips of 200 us), and
# "apart" numbers worker 2's collectives so that none is in common with the chief's.
made_up() {
  python3 - "$dir/$1" "$2" "${3:-}" "${4:-}" <<'PY'
import json, os, random, sys
out, late = sys.argv[1], float(sys.argv[2])
beats, apart = sys.argv[3].startswith("beats"), sys.argv[4] == "apart"
# "beats_tight": worker 1's heartbeats are 300 us off (-200 us with late steps), claiming +-10 us.
tight = sys.argv[3] == "beats_tight"
os.makedirs(out, exist_ok=True)
rng = random.Random(33)
wall = {0: 0, 1: 2_500_000, 2: -37_000}     # each wall clock's offset from true time, us
began = {0: 1_000, 1: 1_700, 2: 2_300}      # when each recorder began, true us
boot = 1_000_000_000                        # the shared steady clock at true time 0, us
entries = {w: [] for w in wall}
for step in range(40):
    t0 = 10_000 + step * 10_400
    arrive = {w: t0 + 9_000 + rng.uniform(0, 50) + (late if w == 1 else 0) for w in wall}
    release = max(arrive.values()) + 5
    for w in wall:
        local = lambda t: round(t - began[w])
        entries[w].append({"type": "step_start", "step": step, "time_us": local(t0)})
        number = step + 1 + (1000 if apart and w == 2 else 0)
        entries[w].append({"type": "collective", "number": number, "step": step, "seq": 0,
                           "replica": 0, "op": "all_reduce(SUM)", "signature": "float32[2]",
                           "state": "done", "enqueue_us": local(arrive[w]),
                           "start_us": local(arrive[w]),
                           "end_us": local(release + rng.uniform(0, 8)), "arrived": [0, 1, 2]})
        entries[w].append({"type": "step_end", "step": step, "ok": True,
                           "time_us": local(release + 20)})
for w in wall:
    doc = {"format": "consort-flight-recorder-1", "worker": f"worker:{w}", "rank": w,
           "workers": ["worker:0", "worker:1", "worker:2"], "pid": 100 + w,
           "epoch_unix_us": 1_700_000_000_000_000 + began[w] + wall[w],
           "clock": {"steady_epoch_ns": (boot + began[w]) * 1000, "host": "h", "boot_id": "b"},
           "entries": entries[w]}
    if beats:
        err = {0: 0, 1: (-200 if late else 300) if tight else 40, 2: -30}[w]
        doc["chief_clock_offset_us"] = wall[0] - wall[w] + err
        doc["chief_clock_offset_delay_us"] = 0 if w == 0 else 20 if tight and w == 1 else 200
    json.dump(doc, open(os.path.join(out, f"consort-flight-worker-{w}-{100 + w}.json"), "w"))
PY
}
made_up late 1000
made_up even 0
expect "a straggler" "straggler: worker:1 arrived last at 20 of the last 20 steps (steps 20-39)" --stragglers "$dir/late"
expect "named within 20 steps" "named from step 10" --stragglers "$dir/late"
expect "the straggler's metric" "worker:1 last_steps=20/20 late_ms=0.9" --stragglers "$dir/late"
expect "no straggler" "stragglers: none" --stragglers "$dir/even"
# clocks_within SUB...: each worker's estimate of each made-up job is checked against the shared
# clock, and is within 100 us of it.
clocks_within() {
  local sub got off
  for sub in "$@"; do
    got=$("$diagnose" --clocks "$dir/$sub" 2>&1)
    while read -r off; do
      if ! awk -v v="$off" 'BEGIN { exit !(v <= 100) }'; then
        echo "FAIL clocks of $sub: an estimate is off by $off us (> 100): $got"
        failures=$((failures + 1))
      fi
    done < <(grep -oP 'the estimate is off by \K[0-9.]+' <<<"$got")
    if [ "$(grep -c 'the estimate is off by' <<<"$got")" -ne 2 ]; then
      echo "FAIL clocks of $sub: the estimates were not checked against the shared clock: $got"
      failures=$((failures + 1))
    fi
  done
}
clocks_within late even
# The heartbeats' offsets in the dumps: beside a tighter estimate from the collectives they are
# only named; where a worker has no collective in common with the chief, they place it.
made_up beats 0 beats
made_up apart 0 beats apart
made_up apart_blind 0 "" apart
made_up late_beats 1000 beats
made_up tight 0 beats_tight
made_up loose 1000 beats_tight
expect "the heartbeats named" "the heartbeats said +2499960.0 us, within +-100.0 us" --clocks "$dir/beats"
expect "the heartbeats place a worker" "clock: worker:2's clock is -36970.0 us from worker:0's (the membership heartbeats' estimate, within +-100.0 us; no collective in common)" --clocks "$dir/apart"
expect "nothing places a worker" "clock: worker:2: no collective in common with worker:0, and no heartbeat offset in its dump; its wall clock is taken as it is" --clocks "$dir/apart_blind"
expect "loose bounds within the heartbeats'" "the heartbeats said +2499960.0 us, within +-100.0 us)" --clocks "$dir/late_beats"
expect "heartbeats the collectives rule out" "clock: worker:1's clock is +2499999.5 us from worker:0's (estimated from 40 collectives in 1 windows, each within +-5.5 us; the heartbeats said +2499700.0 us, within +-10.0 us, which the collectives rule out in 1 of the windows)" --clocks "$dir/tight"
expect "an estimate moved into the heartbeats' bound" "clock: worker:1's clock is +2500190.0 us from worker:0's (estimated from 40 collectives in 1 windows, each within +-487.0 us; the heartbeats said +2500200.0 us, within +-10.0 us, and 1 of the windows' estimates were moved into that bound)" --clocks "$dir/loose"
clocks_within beats apart late_beats
expect "a trace" "trace: " --trace "$dir/late.json" "$dir/late"
if ! python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert any(e.get("ph") == "C" and e["args"]["ms"] > 0.9 for e in d["traceEvents"])' "$dir/late.json"; then
  echo "FAIL the trace has no lateness counter for the straggler"
  failures=$((failures + 1))
fi
# A directory with an older dump of worker 1 too (another job's): the newest is read.
mkdir -p "$dir/twice"
cp "$dir"/late/*.json "$dir/twice/"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["epoch_unix_us"] -= 10**7; d["entries"] = d["entries"][:3]; json.dump(d, open(sys.argv[2], "w"))' \
  "$dir/late/consort-flight-worker-1-101.json" "$dir/twice/consort-flight-worker-1-99.json"
expect "an older dump" "4 dumps of 3 workers; the newest of each" --stragglers "$dir/twice"
expect "an older dump left out" "straggler: worker:1 arrived last at 20 of the last 20" --stragglers "$dir/twice"
"$diagnose" --straggler-steps 0 "$dir/late" >/dev/null 2>&1
if [ $? -ne 2 ]; then
  echo "FAIL --straggler-steps 0 must be a usage error (exit 2)"
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] && echo "consort-diagnose: every case named the right worker"
exit "$failures"
