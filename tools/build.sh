#!/usr/bin/env bash
# Configures and builds consort (Release) into ${BUILD_DIR:-build}. Extra arguments go to the
# build step, e.g. `tools/build.sh --target demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build "$build_dir" "$@"
