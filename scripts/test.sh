#!/usr/bin/env bash
# One command from a fresh clone to the whole test suite: same set-up as demo.sh, then ctest
# (models for the tests are exported by ctest fixtures). Extra arguments go to ctest.
source "$(dirname "$0")/common.sh"
bf_setup
cd "$BUILD_DIR"
ctest --output-on-failure -j "$JOBS" "$@"
