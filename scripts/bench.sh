#!/usr/bin/env bash
# Runs benchmarks by name and prints one JSON object per line.
#   scripts/bench.sh hop pipeline worker_memory
# hop: one tensor hand-off per channel (inproc, shm with the tensor allocated in a slot, shm-copy, shm-zmq, zmq-ipc,
#   socketpair (the bare kernel socket under zmq-ipc), zmq-tcp) at 4 KB, 3.2 MB and 100 MB, with
#   the time of one memcpy of the same bytes; pipeline: the 4-block split ResNet50 against the
#   monolithic model in a clean process of its own (and the bare chain of the four blocks in another:
#   the floor of any pipeline of them), in threads (inproc) and in 4 worker processes (shm, then
#   zmq-ipc), alternating rounds; host_app: the application's own monolithic model next to a started,
#   idle 4-block session, run on a session lane and on its own thread, against a clean process; worker_memory: a
#   worker's resident memory before and after loading the four blocks; sampler_cost: the 4-worker
#   pipeline's e2e p50 with KPI sampling on (10 Hz, every process) over off, interleaved; update:
#   apply() under Poisson traffic (re-route, add, remove a block), its duration and lost requests;
#   batching: saturation throughput of the split ResNet50 with batching off and on (B = 2, 4, 8),
#   through blockflow-loadgen rate sweeps (BENCH_RATES=14,22,... to change the sweep), each between two
#   measurements of the CPU-bound ceiling at its batch size (the blocks' one-thread CPU ms per image,
#   cores x 1000 / it; "of_ceiling_*" in the line, "batching_ceiling" lines after), then batching off
#   with one team lane against the default elastic lanes ("batching_lanes");
#   soak: the split ResNet50 in 4 workers over shm under Poisson traffic at 90% of its measured
#   saturation for BENCH_SOAK_S seconds (default 600), a worker SIGKILLed every 30 s and task_a
#   re-routed with apply() every 45 s; a line every 30 s (sent, completed, failed, lost, per-process
#   RSS, shm slots in use, descriptors), then a "final" line with the RSS slopes and one boolean per target;
#   metrics_http: the metrics HTTP endpoint's scrape latency while 16 clients trickle request bytes,
#   and the threads it adds, next to cpp-httplib's in the same run where libcpp-httplib-dev is installed
#   (not a dependency: the line is there only if the build found it); plan_quality: the planner's
#   heuristic against the exhaustive optimum on 50 random instances, and its time for 20 blocks over 4
#   sites; profile: blockflow-profile's wall time on the four ResNet50 blocks at batch 1-8;
#   plan_accuracy: profile -> plan -> run (scripts/plan_accuracy_bench.py): four tasks over the split
#   ResNet50 and head_b planned on the session's threads and two workers, the admitted ones driven at
#   their rates for BENCH_PLAN_S seconds (default 20), predicted against measured p50 per task, then
#   the refused task forced in beside them;
#   cold_start: process start to the first resolved request, a fresh process each time, alternating:
#   the monolithic model, the split in threads, in 4 workers over shm (started as programs, and forked
#   from a fork server), and three floors (the blocks loaded at once with no session and no warm-up;
#   4 processes bringing libtorch up at once; 4 forked children loading a block each), and the
#   split beside a second task (head_b) in threads, without and with serve_while_warming;
#   BENCH_COLD_ROUNDS rounds (default 5); split: blockflow-split's automatic cuts (N = 2, 3, 4 parts) of
#   ResNet50, MobileNetV3-Large and ViT-B/16 (random weights): the cuts, the slowest part's latency over
#   the whole model's, the chained parts' max abs difference from it (bench/split_bench.py);
#   memory_budget: six blocks (the split ResNet50, head_b, monolithic_b) for three tasks sent
#   round-robin by one closed-loop client, loaded on demand on the session's threads: an unlimited
#   run (each block loads once) measures the blocks' footprints, then runs with the budget at
#   BENCH_MEMORY_FRACTION (default 0.5) of their total alternate with unlimited ones, a process each
#   (bench/memory_budget_bench.cpp); a last line compares them (p50/p99 against unlimited, sampled
#   RSS against the budget, and the floor: unlimited p50 plus the loads a request pays); the budgeted
#   runs go with swapping (SessionOptions::swap) on (weights paged back in), cold (paged back in from
#   the disk: the page cache dropped at each unload) and off (blocks built again), the last with
#   SessionOptions::prefetch off and on, a summary line each; runs with the budget at the largest
#   block alone give the floor of the sampled RSS under any budget (`rss_floor_mb`: what no unload
#   frees, plus one block).
#   replan: three tasks over three worker processes that are not restarted, profiled here; the
#   worker running block3 is killed under traffic and the session re-plans (on_site_lost =
#   replanner()): kill -> loss detected, loss -> re-planned deployment applied, kill -> each task's
#   first result again, requests failed meanwhile (all must name the lost worker), the tasks demoted
#   or refused with the reasons (bench/replan_bench.cpp).
# Environment: BENCH_REQUESTS (pipeline requests, default 300), BENCH_THREADS (intra-op threads per
# block and for the monolithic model, default 2), BENCH_HOP_ITERATIONS (default 20000),
# BENCH_SAMPLER_REQUESTS (sampler_cost requests, default 1000), BENCH_ROUND (pipeline: requests per
# alternating round of split and monolithic, default 20; 1 = interleaved one by one), BENCH_SOAK_S
# (soak seconds, default 600).
# --plot (anywhere among the names): also writes a report into bench-report/ at the repository root
#   (BENCH_REPORT=DIR for another folder): bench.jsonl (the lines printed), metrics-<channel>.json
#   (with pipeline: each run's metrics snapshot, BENCH_METRICS=1), the figures scripts/plot.py draws
#   from them and index.md, a page that links them.
#   scripts/bench.sh --plot hop pipeline worker_memory
source "$(dirname "$0")/common.sh"
BENCHES="hop pipeline host_app worker_memory sampler_cost update batching soak metrics_http plan_quality plan_accuracy profile cold_start split memory_budget replan"
plot=0
names=()
for arg in "$@"; do
  if [ "$arg" = --plot ]; then plot=1; else names+=("$arg"); fi
done
set -- ${names[@]+"${names[@]}"}
if [ $# -eq 0 ]; then
  echo "usage: scripts/bench.sh [--plot] NAME... (names: $BENCHES)" >&2
  exit 2
fi
if [ "$plot" = 1 ]; then
  # Runs the benchmarks through this script again, saving what they print, then draws.
  report="${BENCH_REPORT:-$ROOT/bench-report}"
  mkdir -p "$report"
  report="$(cd "$report" && pwd)"
  rm -f "$report/bench.jsonl" "$report"/metrics-*.json "$report/index.md" \
    "$report"/{breakdown,hop,batch,throughput,memory}.png
  BENCH_REPORT_DIR="$report" bash "$ROOT/scripts/bench.sh" "$@" | tee "$report/bench.jsonl"
  shopt -s nullglob
  "$PYTHON" "$ROOT/scripts/plot.py" --out "$report" "$report/bench.jsonl" "$report"/metrics-*.json >&2
  exit 0
fi
# Set by --plot (above): a pipeline run also writes its metrics snapshot (BENCH_METRICS=1, printed
# on stderr) to $BENCH_REPORT_DIR/metrics-<channel>.json; the rest of its stderr stays on stderr.
capture_metrics() {
  local mode="" channel="" prev="" a rc=0
  for a in "$@"; do
    if [ "$prev" = --mode ]; then mode="$a"; fi
    if [ "$prev" = --channel ]; then channel="$a"; fi
    prev="$a"
  done
  if [ -z "${BENCH_REPORT_DIR:-}" ] || [ "$mode" = worker_memory ] || [ "$mode" = sampler_cost ]; then
    "$@"
    return
  fi
  if [ "$mode" = threads ]; then channel=inproc; fi
  if [ "$channel" = zmq ]; then channel=zmq-ipc; fi
  local err="$BENCH_REPORT_DIR/metrics-$channel.stderr"
  BENCH_METRICS=1 "$@" 2> "$err" || rc=$?
  awk -v out="$BENCH_REPORT_DIR/metrics-$channel.json" '
    !inside && /^\{/ { inside = 1 }
    inside { print > out; if ($0 == "}" || $0 ~ /^\{.*\}$/) inside = 0; next }
    { print > "/dev/stderr" }' "$err"
  rm -f "$err"
  return "$rc"
}
bf_setup -DBLOCKFLOW_BUILD_BENCH=ON >&2
for name in "$@"; do
  case "$name" in
    hop)
      "$BUILD_DIR/bench/hop_bench" "${BENCH_HOP_ITERATIONS:-20000}" ;;
    host_app)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      for on in lane thread; do
        "$BUILD_DIR/bench/pipeline_bench" --models "$BUILD_DIR/models" --mode host_app --app-on "$on" \
          --requests "${BENCH_REQUESTS:-300}" --threads "${BENCH_THREADS:-2}"
      done ;;
    pipeline|worker_memory|sampler_cost)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      runs=("threads shm" "workers shm" "workers zmq")
      [ "$name" = worker_memory ] && runs=("worker_memory shm")
      requests="${BENCH_REQUESTS:-300}"
      # A 2% bound needs more samples than a p50 of 300: interleaved rounds, 1000 requests by default.
      [ "$name" = sampler_cost ] && runs=("sampler_cost shm") && requests="${BENCH_SAMPLER_REQUESTS:-1000}"
      for run in "${runs[@]}"; do
        read -r mode channel <<< "$run"
        capture_metrics "$BUILD_DIR/bench/pipeline_bench" --models "$BUILD_DIR/models" --mode "$mode" --channel "$channel" \
          --requests "$requests" --threads "${BENCH_THREADS:-2}" ${BENCH_ROUND:+--round "$BENCH_ROUND"}
      done ;;
    update)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$BUILD_DIR/bench/update_bench" --models "$BUILD_DIR/models" --threads "${BENCH_THREADS:-2}" ;;
    soak)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$BUILD_DIR/bench/soak_bench" --models "$BUILD_DIR/models" --threads "${BENCH_THREADS:-2}" \
        --seconds "${BENCH_SOAK_S:-600}" ;;
    metrics_http)
      "$BUILD_DIR/bench/metrics_http_bench" --tricklers 16 --scrapes 10 ;;
    plan_quality)
      "$BUILD_DIR/bench/plan_quality_bench" ;;
    cold_start)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$BUILD_DIR/bench/cold_start_bench" --models "$BUILD_DIR/models" --threads "${BENCH_THREADS:-2}" \
        --rounds "${BENCH_COLD_ROUNDS:-5}" ;;
    profile)
      # Wall time of blockflow-profile on the four blocks at batch 1, 2, 4, 8 (and the channels).
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      out="$(mktemp)"
      start=$(date +%s.%N)
      # Its progress is kept aside and shown only when it fails (the temporary files removed either way).
      err="$(mktemp)"
      "$BUILD_DIR/tools/blockflow-profile" "$BUILD_DIR"/models/block{1,2,3,4}.pt --input 1,3,224,224 \
        --threads "${BENCH_THREADS:-2}" --out "$out" 2>"$err" || { tail -20 "$err" >&2; rm -f "$out" "$err"; exit 1; }
      rm -f "$err"
      end=$(date +%s.%N)
      "$PYTHON" - "$out" "$start" "$end" <<'PY'
import json, os, sys
p = json.load(open(sys.argv[1]))
print(json.dumps({"bench": "profile", "blocks": len(p["blocks"]), "batches": [l["batch"] for l in p["blocks"][0]["latency"]],
                  "wall_s": round(float(sys.argv[3]) - float(sys.argv[2]), 1),
                  "p50_ms_batch1": {b["name"]: round(b["latency"][0]["p50_ms"], 2) for b in p["blocks"]},
                  "max_rate_rps": {b["name"]: round(b["max_rate_rps"], 1) for b in p["blocks"]},
                  "memory_mb": {b["name"]: round(b["memory_bytes"] / 1048576, 1) for b in p["blocks"]},
                  "channels": p["channels"], "cpu": p["machine"]["cpu"], "hardware_threads": p["machine"]["hardware_threads"]}))
PY
      rm -f "$out" ;;
    plan_accuracy)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$PYTHON" "$ROOT/scripts/plan_accuracy_bench.py" "$BUILD_DIR" "$BUILD_DIR/models" --duration "${BENCH_PLAN_S:-20}" ;;
    split)
      "$PYTHON" "$ROOT/bench/split_bench.py" --threads "${BENCH_THREADS:-2}" ;;
    replan)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$BUILD_DIR/bench/replan_bench" --models "$BUILD_DIR/models" ;;
    memory_budget)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$PYTHON" - "$BUILD_DIR/bench/memory_budget_bench" "$BUILD_DIR/models" "${BENCH_THREADS:-2}" \
        "${BENCH_MEMORY_REQUESTS:-60}" "${BENCH_MEMORY_FRACTION:-0.5}" <<'PY'
import json, statistics, subprocess, sys
bench, models, threads, requests, fraction = sys.argv[1:6]
footprints = []
def run(budget_mb, prefetch=False, swap="on", measure="blocks"):
    p = subprocess.run([bench, "--models", models, "--budget-mb", str(budget_mb), "--threads", threads,
                        "--requests", requests, "--prefetch", "1" if prefetch else "0", "--swap", swap,
                        "--measure", measure] + footprints,
                       capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not lines or p.returncode != 0:
        sys.exit(f"memory_budget_bench failed ({p.returncode}): {p.stderr[-2000:]}")
    line = json.loads(lines[-1])
    print(json.dumps(line), flush=True)
    return line
unlimited = [run(0)]  # measures each block's footprint by its first load; the later runs take them as profiles
footprints = ["--footprints", ",".join(f"{k}={v}" for k, v in unlimited[0]["footprint_mb"].items())]
budget = round(unlimited[0]["blocks_total_mb"] * float(fraction), 1)
# (swap, prefetch, measure): measure "process" bounds the process's growth, not only the blocks'
configs = [("on", False, "blocks"), ("on", False, "process"), ("cold", False, "blocks"), ("off", False, "blocks"),
           ("off", True, "blocks")]
budgeted = {c: [] for c in configs}
# The floor of the process's resident memory under any budget: the budget at the largest block alone
# (swapping on), so that every other block is paged out whenever it runs. What it still holds is
# what no unload frees (the working memory, each module's unswapped part) plus one block.
largest = max(unlimited[0]["footprint_mb"].values())
floor_runs = []
for _ in range(2):
    for swap, prefetch, measure in configs:
        budgeted[(swap, prefetch, measure)].append(run(budget, prefetch, swap, measure))
    floor_runs.append(run(largest))
    unlimited.append(run(0))
rss_floor = min(r["max_blocks_rss_mb"] for r in floor_runs)
med = lambda runs, k: round(statistics.median(r[k] for r in runs), 1)
p50_u, p99_u = med(unlimited, "p50_ms"), med(unlimited, "p99_ms")
# What the process holds beside the blocks' footprints (activations, oneDNN's caches, a load's
# transient copies): the unlimited runs' sampled RSS over the footprints' sum.
working = round(statistics.median(r["max_blocks_rss_mb"] for r in unlimited) - unlimited[0]["blocks_total_mb"], 1)
for (swap, prefetch, measure), runs in budgeted.items():
    p50_b, p99_b = med(runs, "p50_ms"), med(runs, "p99_ms")
    max_blocks = max(r["max_blocks_rss_mb"] for r in runs)  # while serving; start()'s builds apart
    max_start = max(r["max_blocks_rss_start_mb"] for r in runs)
    peak, peak_start = max(r["peak_blocks_rss_mb"] for r in runs), max(r["peak_blocks_rss_start_mb"] for r in runs)
    floor = round(p50_u + med(runs, "load_ms_per_request"), 1)
    print(json.dumps({"bench": "memory_budget_summary", "budget_mb": budget, "blocks_total_mb": unlimited[0]["blocks_total_mb"],
                      "budget_fraction": float(fraction), "max_blocks_rss_mb": max_blocks,
                      "max_rss_over_budget": round(max_blocks / budget, 3), "working_mb_unlimited": working,
                      "max_blocks_rss_start_mb": max_start, "max_rss_start_over_budget": round(max_start / budget, 3),
                      "peak_blocks_rss_mb": peak, "peak_over_budget": round(peak / budget, 3),
                      "peak_blocks_rss_start_mb": peak_start,
                      "max_rss_over_budget_plus_working": round(max_blocks / (budget + working), 3),
                      "rss_floor_mb": rss_floor, "rss_floor_budget_mb": largest,
                      "rss_floor_over_budget": round(rss_floor / budget, 3),
                      "failed_all_runs": sum(r["failed"] for r in runs + unlimited + floor_runs),
                      "p50_ms": p50_b, "p50_ms_unlimited": p50_u, "p99_ms": p99_b, "p99_ms_unlimited": p99_u,
                      "p99_over_unlimited": round(p99_b / p99_u, 2), "loads": med(runs, "loads"),
                      "evictions": med(runs, "evictions"), "ms_per_load": med(runs, "ms_per_load"),
                      "floor_p50_ms": floor, "p50_over_floor": round(p50_b / floor, 3), "swap": swap, "prefetch": prefetch,
                      "measure": measure,
                      "swap_ins": med(runs, "swap_ins"),
                      "prefetches": med(runs, "prefetches"),
                      "targets": {"rss_within_budget_plus_10pct": max_blocks <= 1.1 * budget,
                                  "rss_within_budget_plus_working_plus_10pct": max_blocks <= 1.1 * (budget + working),
                                  "p99_within_1_5x_unlimited": p99_b <= 1.5 * p99_u},
                      "cpu": unlimited[0]["cpu"], "threads": int(threads), "hardware_threads": unlimited[0]["hardware_threads"]}))
PY
      ;;
    batching)
      "$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models" >&2
      "$PYTHON" "$ROOT/scripts/batching_bench.py" "$BUILD_DIR/tools/blockflow-loadgen" "$BUILD_DIR/models" \
        --threads "${BENCH_THREADS:-2}" ${BENCH_RATES:+--rates "$BENCH_RATES"} ;;
    *)
      echo "bench.sh: unknown benchmark '$name' (names: $BENCHES)" >&2
      exit 2 ;;
  esac
done
