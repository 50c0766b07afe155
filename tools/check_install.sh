#!/usr/bin/env bash
# check_install.sh: checks that consort works as a dependency of another CMake project, in the two
# ways projects take one in:
#   1. installed:  builds consort from SOURCE_DIR (library only), `cmake --install`s it into a
#                  temporary prefix, checks the installed files, then builds the consumer project
#                  tests/install with find_package(consort CONFIG REQUIRED) against that prefix
#                  alone, and runs it;
#   2. vendored:   builds the same consumer with add_subdirectory(SOURCE_DIR) and runs it.
# The consumer links only consort::consort; its two programs exit 0 only when a 2-replica reduce is
# right (app) and when a consort::testing cluster sums and reports a killed worker (harness).
#
# Usage:   tools/check_install.sh [SOURCE_DIR]     (default: the repository holding this script)
# Env:     JOBS=N      parallel build jobs (default: nproc)
#          INSTALL_FROM=DIR  install from this existing build tree of SOURCE_DIR (configured
#                      Release, e.g. tools/test.sh's build/) instead of building the library in a
#                      fresh one: the same install rules, one library build less (about 5 minutes
#                      on 2 cores); the add_subdirectory check still builds from the sources
#          KEEP_TMP=1  keep the temporary directory (build trees, prefix, logs) for inspection
# Exit:    0 when every check passes; 1 at the first failure, after printing the tail of its log.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "${1:-${script_dir}/..}" && pwd)"
consumer="${src}/tests/install"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

if [[ ! -f "${src}/CMakeLists.txt" || ! -f "${consumer}/CMakeLists.txt" ]]; then
  echo "check_install: ${src} is not a consort source tree (needs CMakeLists.txt and" \
       "tests/install/CMakeLists.txt)" >&2
  exit 1
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/consort-check-install.XXXXXX")"
cleanup() {
  if [[ "${KEEP_TMP:-0}" == 1 ]]; then
    echo "check_install: kept ${tmp}"
  else
    rm -rf "${tmp}"
  fi
}
trap cleanup EXIT

generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
prefix="${tmp}/prefix"

# run LOG_NAME COMMAND...: runs the command with its output in ${tmp}/LOG_NAME.log; on failure
# prints the end of that log and fails.
run() {
  local log="${tmp}/$1.log"
  shift
  if ! "$@" >"${log}" 2>&1; then
    echo "check_install: FAILED: $*" >&2
    echo "---- last 60 lines of $(basename "${log}")" >&2
    tail -n 60 "${log}" >&2
    return 1
  fi
}

step() { echo "check_install: $*"; }
fail() {
  echo "check_install: FAILED: $*" >&2
  exit 1
}

echo "check_install: source ${src}"
echo "check_install: temporary directory ${tmp}, ${jobs} build jobs${generator:+, Ninja}"

# -- 1. install, then consume with find_package ---------------------------------------------------
if [[ -n "${INSTALL_FROM:-}" ]]; then
  build_tree="$(cd "${INSTALL_FROM}" && pwd)"
  [[ -f "${build_tree}/CMakeCache.txt" ]] || fail "INSTALL_FROM=${INSTALL_FROM} is not a build tree"
  step "[1/6] build consort's library in ${build_tree} (an existing build of ${src})"
  run consort-build cmake --build "${build_tree}" --parallel "${jobs}" --target consort
else
  build_tree="${tmp}/consort-build"
  step "[1/6] configure and build consort (library only, Release)"
  run consort-configure cmake -S "${src}" -B "${build_tree}" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="${prefix}" \
    -DCONSORT_BUILD_TESTS=OFF -DCONSORT_BUILD_BENCH=OFF -DCONSORT_BUILD_EXAMPLES=OFF
  run consort-build cmake --build "${build_tree}" --parallel "${jobs}"
fi

step "[2/6] cmake --install into ${prefix}"
run consort-install cmake --install "${build_tree}" --prefix "${prefix}"
# The prefix must hold the package config, its dependencies' Find modules and every public header.
libdir=""
for candidate in lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu; do
  if [[ -f "${prefix}/${candidate}/cmake/consort/consortConfig.cmake" ]]; then
    libdir="${candidate}"
    break
  fi
done
[[ -n "${libdir}" ]] || fail "no consortConfig.cmake under ${prefix}/lib*/cmake/consort"
for file in "${libdir}/cmake/consort/consortConfig.cmake" \
            "${libdir}/cmake/consort/consortConfigVersion.cmake" \
            "${libdir}/cmake/consort/consortTargets.cmake" \
            "${libdir}/cmake/consort/FindCAF.cmake" \
            include/consort/consort.hpp include/consort/config.hpp include/consort/asio.hpp; do
  [[ -f "${prefix}/${file}" ]] || fail "the install lacks ${file}"
done
# The engine's internals stay in the source tree (docs/architecture.md): its actor protocol header
# is not installed, and no installed header names step_join, step_launcher or collective_request,
# or defines replica_services (replica_context.hpp only forward-declares it).
[[ ! -e "${prefix}/include/consort/actors/protocol.hpp" ]] ||
  fail "the install has the engine's private actors/protocol.hpp"
if grep -rnE 'step_join|step_launcher|collective_request|(class|struct) replica_services[^;]' \
     "${prefix}/include"; then
  fail "the installed headers above expose the engine's internals"
fi
while read -r header; do
  [[ -f "${prefix}/include/${header}" ]] || fail "the install lacks the public header ${header}"
done < <(cd "${src}/include" && find consort -name '*.hpp')
# An installed package must not point back into the tree it was built from.
config_dir="${prefix}/${libdir}/cmake/consort"
if grep -l -F -e "${src}/" -e "${build_tree}" "${config_dir}/"*.cmake; then
  fail "the installed CMake files above refer to the source or build tree"
fi
step "      installed: $(cd "${prefix}" && find . -type f | wc -l) files; config, targets," \
     "FindCAF.cmake and all $(find "${src}/include/consort" -name '*.hpp' | wc -l) public headers"

step "[3/6] build tests/install with find_package(consort CONFIG REQUIRED), prefix ${prefix} only"
# Only the temporary prefix: no package registry, so nothing but the install can satisfy it.
run package-configure cmake -S "${consumer}" -B "${tmp}/consumer-package" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCONSORT_CONSUMER_MODE=package -DCMAKE_PREFIX_PATH="${prefix}" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
found_dir="$(sed -n 's/^consort_DIR:PATH=//p' "${tmp}/consumer-package/CMakeCache.txt")"
[[ "${found_dir}" == "${prefix}/"* ]] || fail "find_package found consort in '${found_dir}'," \
  "not in ${prefix}"
run package-build cmake --build "${tmp}/consumer-package" --parallel "${jobs}"

step "[4/6] run the find_package consumer (app, harness)"
run package-run "${tmp}/consumer-package/app"
step "      $(cat "${tmp}/package-run.log")"
run package-harness "${tmp}/consumer-package/harness"
step "      $(cat "${tmp}/package-harness.log")"

# -- 2. consume with add_subdirectory -------------------------------------------------------------
step "[5/6] build tests/install with add_subdirectory(${src})"
# A parent that sets no build type: consort must not force its own on it (the library then builds
# without optimisation, which is also the cheapest way to compile it a second time on CI).
run subdirectory-configure cmake -S "${consumer}" -B "${tmp}/consumer-subdirectory" \
  "${generator[@]}" -DCONSORT_CONSUMER_MODE=subdirectory -DCONSORT_SOURCE_DIR="${src}"
parent_build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "${tmp}/consumer-subdirectory/CMakeCache.txt")
[[ -z "${parent_build_type}" ]] ||
  fail "add_subdirectory(consort) changed its parent's CMAKE_BUILD_TYPE from none to '${parent_build_type}'"
run subdirectory-build cmake --build "${tmp}/consumer-subdirectory" --parallel "${jobs}"

step "[6/6] run the add_subdirectory consumer (app, harness)"
run subdirectory-run "${tmp}/consumer-subdirectory/app"
step "      $(cat "${tmp}/subdirectory-run.log")"
run subdirectory-harness "${tmp}/consumer-subdirectory/harness"
step "      $(cat "${tmp}/subdirectory-harness.log")"

echo "check_install: PASS (installed package and add_subdirectory both work)"
