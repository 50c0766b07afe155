#!/usr/bin/env bash
# Fails when a tracked C++ file is not clang-formatted (.clang-format at the repo root), or when a
# tracked file cites the design notes that were kept outside the repository (the two upper-case
# "*.md" files the pattern below names): the repository explains itself in docs/ (docs/design.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
while IFS= read -r f; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "not clang-formatted: $f"
    bad=1
  fi
done < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
# Written with [.] so that this line does not match itself.
if git grep -n -E '(DESIGN|STYLE)[.]md'; then
  echo "the lines above cite design notes that are not in the repository; cite docs/ instead"
  bad=1
fi
[ "$bad" -eq 0 ] && echo "format: ok"
exit "$bad"
