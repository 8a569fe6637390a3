# Shared set-up for demo.sh, test.sh and bench.sh: dependencies, configure, build.
# Sourced, not run. BUILD_DIR and BUILD_TYPE may be set by the caller.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
BUILD_TYPE="${BUILD_TYPE:-Release}"
# Debian's interpreter: it is the one with python3-torch, whatever python3 is first on PATH.
PYTHON=/usr/bin/python3
JOBS="$(nproc)"

bf_setup() {
  # Each step returns on failure itself: set -e does not apply inside a function called from `||`.
  bash "$ROOT/scripts/install_deps.sh" || return 1
  local werror=OFF
  if [ "${CI:-}" = "true" ]; then werror=ON; fi
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DBLOCKFLOW_PYTHON="$PYTHON" -DBLOCKFLOW_WARNINGS_AS_ERRORS="$werror" "$@" || return 1
  cmake --build "$BUILD_DIR" -j "$JOBS"
}
