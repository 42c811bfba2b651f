#!/usr/bin/env bash
# The test command: install what the build and the tests need (scripts/deps.sh, only what is
# missing), configure, build (warnings are errors when KVR_CMAKE_FLAGS says so), and run
# every test with CTest. Extra arguments go to ctest (e.g. -R engine).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
build=${KVR_BUILD_DIR:-build}
# shellcheck disable=SC2086
cmake -S . -B "$build" -G Ninja ${KVR_CMAKE_FLAGS:-} >/dev/null
cmake --build "$build"
ctest --test-dir "$build" --output-on-failure -j2 "$@"
