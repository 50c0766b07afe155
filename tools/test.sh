#!/usr/bin/env bash
# The README's test command, and what CI runs: set up, check formatting, build everything (our
# own targets with -Werror), run every test (unit, examples), then check that an installed consort
# works from a separate CMake project. .ci/run adds the fuzzers (tools/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/check_format.sh
CONSORT_WERROR=ON bash tools/build.sh
# Registrations that could pass whatever happens (a PASS regex, a ctest selection of nothing, a
# gtest filter of nothing) fail here, before the tests run.
bash tools/check_registrations.sh "${BUILD_DIR:-build}"
if ! ctest --test-dir "${BUILD_DIR:-build}" --no-tests=error --output-on-failure -j2 --timeout 300; then
  echo "== the failed tests' output once more (the end of the log is what CI shows)"
  bash tools/ctest_failures.sh "${BUILD_DIR:-build}"
  exit 1
fi
INSTALL_FROM="${BUILD_DIR:-build}" bash tools/check_install.sh "$PWD"
