#!/usr/bin/env bash
# Builds BlockFlow on a GPU machine against the CUDA-enabled libtorch of its PyTorch, with the Debian
# dependencies carried in .gpu-debs (see ../shared/gpu/README.md and docs/gpu.md), then runs what
# is asked:  scripts/gpu.sh [build|test|bench|batching|kpi|all]...   Logs go to $OUT (default
# build-gpu/out).
# build: everything, or BUILD_TARGETS="t1 t2 ..." only; test: the whole ctest suite
# (CTEST_ARGS="-L gpu" for the GPU-labelled tests only); bench: the cuda hop lines and the pipeline
# on the GPU (threads, 4 cuda workers) with a witness of host<->device copies; batching: the batching
# bench with every block on cuda:0; kpi: the 4-worker pipeline with KPI sampling on, its metrics
# printed beside nvidia-smi's figures of the same moment (the GPU columns checked against the driver);
# mps: the eager 4-worker line with and without CUDA MPS, alternating.
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
  local targets=()
  for t in ${BUILD_TARGETS:-}; do targets+=(--target "$t"); done
  cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}" -- -k 0 > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -60; return 1; }
  echo "build ok"
}
run_tests() {
  local rc=0
  (cd "$BUILD_DIR" && ctest -j 8 --timeout 300 --output-on-failure ${CTEST_ARGS:-}) > "$OUT/ctest.log" 2>&1 || rc=$?
  tail -25 "$OUT/ctest.log"
  return $rc
}
models() {
  # Always: the export skips what its manifest says is done, and finishes what an interrupted one left.
  "$PY" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" > "$OUT/export.log" 2>&1 || { tail "$OUT/export.log"; return 1; }
}
# hop and pipeline on the GPU, with the LD_PRELOAD witness counting host<->device copies per process.
bench() {
  local witness="$BUILD_DIR/tests/libblockflow_cuda_copy_witness.so" models="$BUILD_DIR/models"
  models || return 1
  rm -f "$OUT"/witness-*.txt
  {
    BENCH_HOP_CUDA_ONLY=1 BLOCKFLOW_COPY_WITNESS="$OUT/witness-hop.txt" LD_PRELOAD="$witness" \
      "$BUILD_DIR/bench/hop_bench" "${BENCH_HOP_ITERATIONS:-2000}"
    # Eager, then with CUDA graphs in the split's blocks (the monolithic baseline stays eager).
    for graph in ${BENCH_CUDA_GRAPH:-0 1}; do
      "$BUILD_DIR/bench/pipeline_bench" --models "$models" --mode threads --device cuda --cuda-graph "$graph" \
        --requests "${BENCH_REQUESTS:-100}"
      # Four cuda workers, their data links' receivers sleeping between packets, then busy polling.
      for poll in ${BENCH_BUSY_POLL:-0 1}; do
        BENCH_METRICS=1 BLOCKFLOW_COPY_WITNESS="$OUT/witness-pipeline-graph$graph-poll$poll.txt" LD_PRELOAD="$witness" \
          "$BUILD_DIR/bench/pipeline_bench" --models "$models" --mode workers --channel cuda --device cuda \
          --cuda-graph "$graph" --busy-poll "$poll" --requests "${BENCH_REQUESTS:-100}" \
          2> "$OUT/metrics-cuda-graph$graph-poll$poll.txt"
      done
    done
  } | tee "$OUT/bench.jsonl"
  echo "--- host<->device copies per process (witness) ---"
  cat "$OUT"/witness-*.txt 2>/dev/null || true
}
# The eager 4-worker line with and without CUDA MPS (one GPU context shared by the five processes
# instead of time-sliced contexts), alternating, where the machine has nvidia-cuda-mps-control.
mps() {
  models || return 1
  if ! command -v nvidia-cuda-mps-control > /dev/null; then echo "mps: no nvidia-cuda-mps-control on this machine"; return 0; fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  local line=("$BUILD_DIR/bench/pipeline_bench" --models "$BUILD_DIR/models" --mode workers --channel cuda --device cuda
              --busy-poll 1 --requests "${BENCH_REQUESTS:-100}")
  for round in 1 2; do
    echo "mps off, round $round"; "${line[@]}"
    nvidia-cuda-mps-control -d && echo "mps on, round $round" && "${line[@]}"
    echo quit | nvidia-cuda-mps-control
    sleep 1
  done 2>&1 | tee "$OUT/mps.jsonl"
}
batching() {
  models || return 1
  "$PY" "$ROOT/scripts/batching_bench.py" "$BUILD_DIR/tools/blockflow-loadgen" "$BUILD_DIR/models" --device cuda:0 \
    --rates "${BENCH_RATES:-200,400,800,1600,2400,3200}" --duration "${BENCH_DURATION:-2}" \
    2> "$OUT/batching-runs.txt" | tee "$OUT/batching.jsonl"
  grep '"batching_run"' "$OUT/batching-runs.txt" || tail -20 "$OUT/batching-runs.txt"
}
kpi() {
  models || return 1
  BENCH_SAMPLING=100 BENCH_METRICS=1 BENCH_NVIDIA_SMI=1 "$BUILD_DIR/bench/pipeline_bench" --models "$BUILD_DIR/models" \
    --mode workers --channel cuda --device cuda --requests 60 2> "$OUT/kpi.txt"
  "$PY" - "$OUT/kpi.txt" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
start = text.index("{")
metrics, end = json.JSONDecoder().raw_decode(text[start:])
def walk(v, path=""):
    if isinstance(v, dict):
        for k, x in v.items():
            if any(w in k for w in ("gpu", "torch_cuda", "nvml")) or k in ("pid", "process_pid"):
                print(path + "." + k, json.dumps(x)[:600])
            else:
                walk(x, path + "." + k)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            walk(x, f"{path}[{i}]")
walk(metrics)
print("--- nvidia-smi at the same moment ---")
print(text[start + end:].strip())
PY
}
for step in "${@:-all}"; do
  case "$step" in
    build) build ;;
    test) run_tests ;;
    bench) bench ;;
    batching) batching ;;
    mps) mps ;;
    kpi) kpi ;;
    all) build; run_tests ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
