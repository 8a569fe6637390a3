#!/usr/bin/env bash
# One command from a fresh clone to the whole test suite: same set-up as demo.sh, then ctest
# (models for the tests are exported by ctest fixtures). Extra arguments go to ctest.
# Under CI (CI=true) the benchmarks are not built: no ctest runs them, and their ~2 minutes of
# compiling on 2 cores is what keeps .ci/run inside its 30-minute budget. bench.sh builds them
# (scripts/test.sh without CI=true does too).
source "$(dirname "$0")/common.sh"
bench=ON
if [ "${CI:-}" = "true" ]; then bench=OFF; fi
bf_setup -DBLOCKFLOW_BUILD_BENCH="$bench"
cd "$BUILD_DIR"
ctest --output-on-failure -j "$JOBS" "$@"
