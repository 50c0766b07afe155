#!/usr/bin/env bash
# data_checkpoint_test.sh CONSORT_TRAIN: `consort-train --data` on a small CSV file with a header
# and the label in its first column (--label-column label), with --checkpoint-dir:
#   1. a run of 6 steps saves its checkpoint, and its data line names the label column;
#   2. the same file with another --test-fraction (other training rows) is refused, status 2,
#      naming training_rows_sha256;
#   3. the first command with --steps 8 resumes from step 6.
# Prints "data checkpoint: OK" when every check held; exits 1 at the first that did not.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: data_checkpoint_test.sh CONSORT_TRAIN" >&2; exit 2; }
train=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

fail() {
  echo "data checkpoint: FAILED: $1"
  echo "--- output ---"
  cat "$dir/out"
  exit 1
}

{
  echo "label,x,y,z"
  for i in $(seq 0 199); do echo "$((i % 3)),$((i * 7 % 11)),$((i % 5)).5,$((i * 3 % 7))"; done
} >"$dir/rows.csv"
run=("$train" --replicas 2 --hidden 16 --data "$dir/rows.csv" --label-column label
     --checkpoint-dir "$dir/ckpt")

"${run[@]}" --steps 6 >"$dir/out" 2>&1 || fail "the first run ended with status $?"
grep -q 'label column 1 "label" (header row), 3 classes; .* 160 train, 40 held out' "$dir/out" ||
  fail "no data line naming the label column and the split"
grep -q '^saved checkpoint at step 6' "$dir/out" || fail "no checkpoint at step 6"
grep -qE '^held-out: 40 rows, loss [0-9.]+, accuracy [0-9.]+$' "$dir/out" || fail "no held-out line"

"${run[@]}" --steps 8 --test-fraction 0.3 >"$dir/out" 2>&1
status=$?
[ "$status" -eq 2 ] || fail "other training rows: status $status, expected 2"
grep -q 'was written by a run with training_rows_sha256 [0-9a-f]\{64\}, this one has' "$dir/out" ||
  fail "other training rows: no refusal naming training_rows_sha256"

"${run[@]}" --steps 8 >"$dir/out" 2>&1 || fail "the resumed run ended with status $?"
grep -q '^resumed from checkpoint at step 6 ' "$dir/out" || fail "no resume from step 6"
grep -q '^trained: 8 steps' "$dir/out" || fail "the resumed run did not end at step 8"
echo "data checkpoint: OK"
