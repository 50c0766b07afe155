#!/usr/bin/env bash
# The README's test command, and what CI runs: set up, check formatting, build everything (our
# own targets with -Werror), run every test (unit, examples), then check that an installed consort
# works from a separate CMake project. .ci/run adds the fuzzers (tools/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/check_format.sh
CONSORT_WERROR=ON bash tools/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j2 --timeout 300
INSTALL_FROM="${BUILD_DIR:-build}" bash tools/check_install.sh "$PWD"
