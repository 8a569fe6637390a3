#!/usr/bin/env bash
# Sanitizer runs (docs/sanitizers.md). For each kind asked for, configures and builds BlockFlow with
# BLOCKFLOW_SANITIZE=<kind> in its own build tree, then runs ctest there with the suppression files
# of scripts/sanitizers/ (every line in them says why it is there).
#
#   scripts/sanitize.sh [address|thread]... [-- CTEST_ARGS...]   (default: address thread)
#   JOBS=1 scripts/sanitize.sh thread                             (build and ctest jobs; default nproc)
#
# address (build-asan): ASan + UBSan + LeakSanitizer; the CPU suite (models are exported by the
#   ctest fixtures, as in scripts/test.sh) except SKIP_ADDRESS below, each for the reason given there.
#   The libFuzzer target is off: it is ASan-instrumented in every build already.
# thread (build-tsan): TSan on every CPU unit area of the suite but two_host (network namespaces):
#   AREAS_THREAD below. libtorch runs its intra-op work on libgomp, which TSan does not understand
#   (its barriers are futexes and atomics in uninstrumented code). OMP_NUM_THREADS=1 sets libgomp's
#   default only: lanes with intra_op_threads > 1 (most tests use 2) still make teams, and a race
#   between OpenMP workers (libtorch frames in its stacks) falls under tsan.supp's libtorch line.
#   What this run checks is our own code (docs/sanitizers.md).
#
# Worker processes (blockflow-worker and the runtime module it dlopens) are built with the same flags
# and inherit the environment set here. Every process writes its reports to a file of its own under
# <build>/sanitizer-logs (log_path), so a report in a worker is not lost with the worker's stderr; the
# run fails if any report file is left, and prints the first lines of each.
requested_jobs="${JOBS:-}"
source "$(dirname "$0")/common.sh"
JOBS="${requested_jobs:-$JOBS}"
BUILD_TYPE=RelWithDebInfo  # NDEBUG like the release build; the sanitizer flags bring -O1 -g
SUPP="$ROOT/scripts/sanitizers"

# Areas for TSan (one ctest per area, see tests/CMakeLists.txt): all of the CPU suite's unit areas.
AREAS_THREAD=(channel path session lanes layout update update_lifecycle worker_update wire link shm deployment process_channel
              admission planner torchscript dag metrics worker direct joined client kpi control worker_lifecycle batching
              curve worker_allowlist profile memory warming replan entry)

# ctests the address run leaves out, and why:
# - install_consumer builds an outside project against the installed package with that project's
#   own flags, so its executable has no ASan runtime of its own;
# - example_resnet_demo and example_resnet_demo_channels spend their ~140 s in ResNet50 forwards
#   inside uninstrumented libtorch; the BlockFlow code they drive (threads, shm and zmq workers,
#   every channel) runs instrumented in the areas direct, worker, shm and process_channel, on small
#   models;
# - blockflow_split, plot_report, layers and readme_snippets run only Python: nothing instrumented.
# The examples are not built here (BLOCKFLOW_BUILD_EXAMPLES=OFF, so their ctests do not exist): the
# release suite runs them, and the library code they call runs instrumented in the unit areas
# (process_channel for the TensorMQ pair, worker and direct for worker pipelines, client for serve).
SKIP_ADDRESS=(install_consumer example_resnet_demo example_resnet_demo_channels blockflow_split plot_report layers readme_snippets)

kinds=()
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    address | thread) kinds+=("$1") ;;
    --) shift; ctest_args=("$@"); break ;;
    *) echo "usage: $0 [address|thread]... [-- CTEST_ARGS...]" >&2; exit 2 ;;
  esac
  shift
done
[ ${#kinds[@]} -gt 0 ] || kinds=(address thread)

# Prints the first lines of every sanitizer report file under $1; fails if there is one.
check_reports() {
  local dir="$1" found=0 f
  for f in "$dir"/*; do
    [ -s "$f" ] || continue
    found=1
    echo "=== sanitizer report: $f"
    head -n 60 "$f"
  done
  return "$found"
}

run_kind() {
  local kind="$1" logs ctest_rc=0 t0 t1 t2
  case "$kind" in
    address) BUILD_DIR="$ROOT/build-asan" ;;
    thread) BUILD_DIR="$ROOT/build-tsan" ;;
  esac
  logs="$BUILD_DIR/sanitizer-logs"

  t0=$(date +%s)
  # A unity build (8 sources per compiler run): each source spends most of its compile time in the
  # torch headers, so this tree builds in about half the time. The release tree (scripts/test.sh)
  # stays one source per run, as users build it, so a missing #include still fails there.
  bf_setup -DBLOCKFLOW_SANITIZE="$kind" -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
    -DBLOCKFLOW_BUILD_BENCH=OFF -DBLOCKFLOW_BUILD_EXAMPLES=OFF -DBLOCKFLOW_FUZZ=OFF || {
    # set -e does not reach into a function called from `||`: without this, a tree that failed to
    # build would run its suite on the binaries of an earlier build.
    echo "sanitize: $kind: the build failed; no test was run" >&2
    return 1
  }
  t1=$(date +%s)

  rm -rf "$logs" && mkdir -p "$logs"
  local selection=()
  if [ "$kind" = address ]; then
    selection=(-L cpu -E "^($(IFS='|'; echo "${SKIP_ADDRESS[*]}"))\$")
  else
    selection=(-R "^($(IFS='|'; echo "${AREAS_THREAD[*]}"))\$")
  fi
  (
    cd "$BUILD_DIR"
    if [ "$kind" = address ]; then
      # intercept_tls_get_addr=0: GCC 12's runtime (fixed upstream in GCC 14 / LLVM 17) takes a
      # dynamic TLS block that happens to start 16 bytes into a page for a pre-2.25 glibc header and
      # reads a wild address and length from before it; LeakSanitizer's tracer then dies at exit
      # ("Tracer caught signal 11", no leak reported): it did once in CI, in one process of ~45.
      # With it off, LeakSanitizer does not scan dynamic TLS blocks, which no BlockFlow pointer
      # lives in only. log_exe_name=1: a report file names the program (asan.blockflow-worker.PID).
      # Paths in quotes: the options' parser splits at spaces, commas and colons outside them.
      local common="intercept_tls_get_addr=0:log_exe_name=1"
      export ASAN_OPTIONS="suppressions=\"$SUPP/asan.supp\":detect_leaks=1:halt_on_error=1:log_path=\"$logs/asan\":$common"
      export LSAN_OPTIONS="suppressions=\"$SUPP/lsan.supp\":print_suppressions=0:$common"
      export UBSAN_OPTIONS="suppressions=\"$SUPP/ubsan.supp\":print_stacktrace=1:halt_on_error=1:log_path=\"$logs/ubsan\""
    else
      export TSAN_OPTIONS="suppressions=\"$SUPP/tsan.supp\":second_deadlock_stack=1:halt_on_error=0:log_path=\"$logs/tsan\""
      export OMP_NUM_THREADS=1
    fi
    ctest --output-on-failure -j "$JOBS" "${selection[@]}" "${ctest_args[@]}"
  ) || ctest_rc=$?
  t2=$(date +%s)

  local reports_rc=0
  check_reports "$logs" || reports_rc=1
  echo "sanitize: $kind: build $((t1 - t0)) s, suite $((t2 - t1)) s, ctest rc $ctest_rc," \
       "report files: $(find "$logs" -type f -size +0 | wc -l) (in $logs)"
  [ "$ctest_rc" -eq 0 ] && [ "$reports_rc" -eq 0 ]
}

status=0
for kind in "${kinds[@]}"; do
  run_kind "$kind" || status=1
done
exit "$status"
