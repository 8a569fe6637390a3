#!/usr/bin/env bash
# Runs benchmarks by name and prints one JSON object per line.
#   scripts/bench.sh hop pipeline worker_memory
# hop: one tensor hand-off per channel (inproc, shm, zmq-ipc, zmq-tcp) at 4 KB, 3.2 MB and 100 MB, with
#   the time of one memcpy of the same bytes; pipeline: the 4-block split ResNet50 against the
#   monolithic model, in threads (inproc) and in 4 worker processes (shm, then zmq-ipc); worker_memory: a
#   worker's resident memory before and after loading the four blocks.
# Environment: BENCH_REQUESTS (pipeline requests, default 300), BENCH_THREADS (intra-op threads per
# block and for the monolithic model, default 2), BENCH_HOP_ITERATIONS (default 20000).
source "$(dirname "$0")/common.sh"
if [ $# -eq 0 ]; then
  echo "usage: scripts/bench.sh NAME... (names: hop pipeline worker_memory)" >&2
  exit 2
fi
bf_setup >&2
for name in "$@"; do
  case "$name" in
    hop)
      "$BUILD_DIR/bench/hop_bench" "${BENCH_HOP_ITERATIONS:-20000}" ;;
    pipeline|worker_memory)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      runs=("threads shm" "workers shm" "workers zmq")
      [ "$name" = worker_memory ] && runs=("worker_memory shm")
      for run in "${runs[@]}"; do
        read -r mode channel <<< "$run"
        "$BUILD_DIR/bench/pipeline_bench" --models "$BUILD_DIR/models" --mode "$mode" --channel "$channel" \
          --requests "${BENCH_REQUESTS:-300}" --threads "${BENCH_THREADS:-2}"
      done ;;
    *)
      echo "bench.sh: unknown benchmark '$name' (names: hop pipeline worker_memory)" >&2
      exit 2 ;;
  esac
done
