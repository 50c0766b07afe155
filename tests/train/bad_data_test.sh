#!/usr/bin/env bash
# bad_data_test.sh CASE COMMAND...: writes the bad data file of CASE into a fresh temporary
# directory and runs `COMMAND... --data FILE` (consort-train with its options, or the launcher
# running it), exiting with its status.
# The CTest registrations (tests/train/CMakeLists.txt) check the status (2) and the message, which
# must name the file, the line and the column where there is one.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: bad_data_test.sh CASE COMMAND..." >&2; exit 2; }
case_name=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

file="$dir/$case_name.csv"
rows="1,2,0\n3,4,1\n5,6,2\n"
case "$case_name" in
  ragged) printf '1,2,0\n3,4,1\n5,2\n' >"$file" ;;
  not_a_number) printf 'a,b,label\n1,2,0\n3,four,1\n' >"$file" ;;
  missing) file="$dir/missing.csv" ;;
  empty) : >"$file" ;;
  header_only) printf 'a,b,label\n' >"$file" ;;
  label_negative) printf "$rows"'7,8,-1\n' >"$file" ;;
  label_not_integer) printf "$rows"'7,8,1.5\n' >"$file" ;;
  label_too_many_classes) printf "$rows"'7,8,5000\n' >"$file" ;;
  bad_gzip)
    # The first half of a gzip'd file of 3000 rows: the stream ends early.
    file="$dir/cut.csv.gz"
    for i in $(seq 3000); do echo "$i,$((i * 7 % 13)),$((i % 3))"; done | gzip -c >"$dir/whole.gz"
    head -c $(($(stat -c %s "$dir/whole.gz") / 2)) "$dir/whole.gz" >"$file"
    ;;
  *) echo "bad_data_test.sh: unknown case '$case_name'" >&2; exit 2 ;;
esac
"$@" --data "$file"
