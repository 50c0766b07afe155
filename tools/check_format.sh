#!/usr/bin/env bash
# Fails when a tracked C++ file is not clang-formatted (.clang-format at the repo root), or when a
# tracked file cites design notes that live outside the repository (DESIGN.md, STYLE.md): the
# repository explains itself in docs/.
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
while IFS= read -r f; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "not clang-formatted: $f"
    bad=1
  fi
done < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
if git grep -n -E '(DESIGN|STYLE)\.md' -- . ':!tools/check_format.sh'; then
  echo "the lines above cite DESIGN.md or STYLE.md, which are not in the repository; cite docs/"
  bad=1
fi
[ "$bad" -eq 0 ] && echo "format: ok"
exit "$bad"
