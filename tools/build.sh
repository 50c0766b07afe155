#!/usr/bin/env bash
# Configures and builds consort (Release) into ${BUILD_DIR:-build}. Extra arguments go to the
# build step, e.g. `tools/build.sh --target demo`. CONSORT_WERROR=ON in the environment builds
# consort's own targets with -Werror (tools/test.sh, CI); when unset, the build directory keeps
# what it had. The commit built (and whether the tree had changes) goes to $build_dir/built-from,
# which the GPU field run prints: the build travels to the GPU machine, its git history may not.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
options=()
[ -n "${CONSORT_WERROR:-}" ] && options+=(-DCONSORT_WERROR="${CONSORT_WERROR}")
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "${options[@]}" >/dev/null
cmake --build "$build_dir" "$@"
{
  git rev-parse HEAD 2>/dev/null || echo unknown
  git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo "with uncommitted changes"
} | paste -sd' ' >"$build_dir/built-from" || true
