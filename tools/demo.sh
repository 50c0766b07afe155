#!/usr/bin/env bash
# The README's first command: set up, build the training demo, run it on 4 CPU replicas with no
# configuration; it verifies its final weights against a single-replica run (examples/train/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/build.sh --target consort-train
./"${BUILD_DIR:-build}"/examples/train/consort-train "$@"
