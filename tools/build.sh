#!/usr/bin/env bash
# Configures and builds consort (Release) into ${BUILD_DIR:-build}. Extra arguments go to the
# build step, e.g. `tools/build.sh --target demo`. CONSORT_WERROR=ON in the environment builds
# consort's own targets with -Werror (tools/test.sh, CI); when unset, the build directory keeps
# what it had.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
options=()
[ -n "${CONSORT_WERROR:-}" ] && options+=(-DCONSORT_WERROR="${CONSORT_WERROR}")
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "${options[@]}" >/dev/null
cmake --build "$build_dir" "$@"
