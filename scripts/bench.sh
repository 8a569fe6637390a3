#!/usr/bin/env bash
# Runs benchmarks by name and prints one JSON object per line.
#   scripts/bench.sh hop pipeline
# Environment: BENCH_REQUESTS (pipeline requests, default 300), BENCH_THREADS (intra-op threads per
# block and for the monolithic model, default 2), BENCH_HOP_ITERATIONS (default 20000).
source "$(dirname "$0")/common.sh"
if [ $# -eq 0 ]; then
  echo "usage: scripts/bench.sh NAME... (names: hop pipeline)" >&2
  exit 2
fi
bf_setup >&2
for name in "$@"; do
  case "$name" in
    hop)
      "$BUILD_DIR/bench/hop_bench" "${BENCH_HOP_ITERATIONS:-20000}" ;;
    pipeline)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$BUILD_DIR/bench/pipeline_bench" --models "$BUILD_DIR/models" \
        --requests "${BENCH_REQUESTS:-300}" --threads "${BENCH_THREADS:-2}" ;;
    *)
      echo "bench.sh: unknown benchmark '$name' (names: hop pipeline)" >&2
      exit 2 ;;
  esac
done
