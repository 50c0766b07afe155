#!/usr/bin/env bash
# The README's first command: set up, build the demo, run it on CPU replicas.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/build.sh --target demo
./"${BUILD_DIR:-build}"/examples/demo "$@"
