#!/usr/bin/env bash
# Builds BlockFlow on a GPU machine against the CUDA-enabled libtorch of its PyTorch, with the Debian
# dependencies carried in .gpu-debs (see ../shared/gpu/README.md and docs/gpu.md), then runs what
# is asked:  scripts/gpu.sh [build|test|bench|all]...   Logs go to $OUT (default build-gpu/out).
# test: the whole ctest suite (CTEST_ARGS="-L gpu" for the GPU-labelled tests only); bench: the hop
# and pipeline benchmarks on the GPU (cuda lines) with a witness of host<->device copies.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build-gpu/out}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-gpu}"
mkdir -p "$OUT"
PY="$(command -v python3)"
if [ ! -d /tmp/deps/usr ]; then bash .gpu-debs/unpack.sh /tmp/deps > /dev/null; fi
TORCH_PREFIX="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
export CMAKE_PREFIX_PATH="/tmp/deps/usr:$TORCH_PREFIX"
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:$PATH"

build() {
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBLOCKFLOW_PYTHON="$PY" \
    -DBLOCKFLOW_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native > "$OUT/configure.log" 2>&1 ||
    { tail -40 "$OUT/configure.log"; return 1; }
  cmake --build "$BUILD_DIR" -j "$(nproc)" > "$OUT/build.log" 2>&1 || { grep -B2 -A12 "error" "$OUT/build.log" | head -80; return 1; }
  echo "build ok"
}
run_tests() {
  (cd "$BUILD_DIR" && ctest -j 8 --timeout 300 --output-on-failure ${CTEST_ARGS:-}) > "$OUT/ctest.log" 2>&1 || true
  tail -25 "$OUT/ctest.log"
}
# hop and pipeline on the GPU, with the LD_PRELOAD witness counting host<->device copies per process.
bench() {
  local witness="$BUILD_DIR/tests/libblockflow_cuda_copy_witness.so" models="$BUILD_DIR/models"
  "$PY" "$ROOT/scripts/export_models.py" --out "$models" > "$OUT/export.log" 2>&1 || { tail "$OUT/export.log"; return 1; }
  rm -f "$OUT"/witness-*.txt
  {
    BLOCKFLOW_COPY_WITNESS="$OUT/witness-hop.txt" LD_PRELOAD="$witness" "$BUILD_DIR/bench/hop_bench" "${BENCH_HOP_ITERATIONS:-2000}"
    "$BUILD_DIR/bench/pipeline_bench" --models "$models" --mode threads --device cuda --requests "${BENCH_REQUESTS:-100}"
    BENCH_METRICS=1 BLOCKFLOW_COPY_WITNESS="$OUT/witness-pipeline.txt" LD_PRELOAD="$witness" \
      "$BUILD_DIR/bench/pipeline_bench" --models "$models" --mode workers --channel cuda --device cuda \
      --requests "${BENCH_REQUESTS:-100}" 2> "$OUT/metrics-cuda.txt"
  } | tee "$OUT/bench.jsonl"
  echo "--- host<->device copies per process (witness) ---"
  cat "$OUT"/witness-*.txt 2>/dev/null || true
}

for step in "${@:-all}"; do
  case "$step" in
    build) build ;;
    test) run_tests ;;
    bench) bench ;;
    all) build; run_tests ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
