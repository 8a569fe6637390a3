#!/usr/bin/env python3
"""The batching benchmark: the 4-block split ResNet50 (threads, 2 intra-op threads per block) under
open-loop Poisson load from blockflow-loadgen, batching off and on at every block for max_batch B in
2, 4, 8; for each, a rate sweep finds the saturation throughput (the most requests/s completed at
any offered rate). Prints, per B:
  {"bench":"batching","block":"block1-4","max_batch":B,"saturation_rps_off":..,"saturation_rps_on":..,
   "ratio":..,"p99_ms_on":..,"max_batch_delay_ms":..,"threads_per_block":2}
p99_ms_on is the p99 latency at the rate where the batched pipeline peaked.

usage: batching_bench.py LOADGEN MODELS_DIR [--rates 10,20,...] [--duration S]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

BLOCKS = [("block1", [-1, 3, 224, 224]), ("block2", [-1, 256, 56, 56]), ("block3", [-1, 512, 28, 28]),
          ("block4", [-1, 1024, 14, 14])]


def deployment(models, max_batch, delay_ms, threads):
    blocks = [{"name": n, "torchscript": os.path.join(os.path.abspath(models), n + ".pt"), "intra_op_threads": threads,
               "input_shapes": [s], "warmup_runs": 1, "max_batch": max_batch, "max_batch_delay_ms": delay_ms,
               "queue_capacity": 256}
              for n, s in BLOCKS]
    return {"blocks": blocks, "tasks": {"split": [n for n, _ in BLOCKS]}}


def sweep(loadgen, models, max_batch, rates, duration, delay_ms, threads):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(deployment(models, max_batch, delay_ms, threads), f)
        path = f.name
    try:
        out = subprocess.run([loadgen, "--deployment", path, "--sweep", ",".join(str(r) for r in rates),
                              "--duration", str(duration), "--quiet"], capture_output=True, text=True, check=True)
    finally:
        os.unlink(path)
    runs = [json.loads(l) for l in out.stdout.splitlines() if l.startswith('{"bench":"loadgen"') or '"loadgen"' in l]
    runs = [r for r in runs if r.get("bench") == "loadgen"]
    best = max(runs, key=lambda r: r["throughput_per_s"])
    for r in runs:
        print(json.dumps({"bench": "batching_run", "max_batch": max_batch, "rate_per_s": r["rate_per_s"],
                          "throughput_per_s": round(r["throughput_per_s"], 2), "p50_ms": round(r["p50_ms"], 1),
                          "p99_ms": round(r["p99_ms"], 1)}), file=sys.stderr)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("loadgen")
    ap.add_argument("models")
    ap.add_argument("--rates", default="10,14,18,22,26,30,36")
    ap.add_argument("--duration", type=float, default=6)
    ap.add_argument("--delay-ms", type=float, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="2,4,8")
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    off = sweep(a.loadgen, a.models, 1, rates, a.duration, a.delay_ms, a.threads)
    for b in [int(x) for x in a.batches.split(",")]:
        on = sweep(a.loadgen, a.models, b, rates, a.duration, a.delay_ms, a.threads)
        print(json.dumps({"bench": "batching", "block": "block1-4", "max_batch": b,
                          "saturation_rps_off": round(off["throughput_per_s"], 2),
                          "saturation_rps_on": round(on["throughput_per_s"], 2),
                          "ratio": round(on["throughput_per_s"] / off["throughput_per_s"], 3),
                          "p99_ms_on": round(on["p99_ms"], 1), "max_batch_delay_ms": a.delay_ms,
                          "threads_per_block": a.threads}), flush=True)


if __name__ == "__main__":
    main()
