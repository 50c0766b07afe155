#!/usr/bin/env bash
# Fails when a tracked C++ file is not clang-formatted (.clang-format at the repo root).
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
while IFS= read -r f; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "not clang-formatted: $f"
    bad=1
  fi
done < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
[ "$bad" -eq 0 ] && echo "format: ok"
exit "$bad"
