#!/usr/bin/env python3
"""The batching benchmark: the 4-block split ResNet50 (threads, 2 intra-op threads per block) under
open-loop Poisson load from blockflow-loadgen, batching off and on at every block for max_batch B in
2, 4, 8; for each, a rate sweep finds the saturation throughput (the most requests/s completed at
any offered rate). Prints, per B:
  {"bench":"batching","block":"block1-4","max_batch":B,"saturation_rps_off":..,"saturation_rps_on":..,
   "ratio":..,"p99_ms_on":..,"max_batch_delay_ms":..,"threads_per_block":2}
p99_ms_on is the p99 latency at the rate where the batched pipeline peaked.

Then, per batch size (1 and each B), the CPU-bound ceiling measured in this process with
Debian's python3-torch on the same block files, prepared as the library prepares them (frozen,
optimize_for_inference) and run alone with ONE intra-op thread, so that the time is CPU time:
  {"bench":"batching_ceiling","max_batch":B,"cpu_ms_per_image":..,"cores":C,"ceiling_rps":..}
ceiling_rps = cores * 1000 / cpu_ms_per_image estimates what C cores complete per second at that
batch size if they never idle, however the four blocks overlap. It is an estimate, not a strict
bound: the measured saturation may pass it by a few percent (timing noise; a block's CPU time also
moves with what runs beside it). It tells whether batching has anything left to win on this CPU.

usage: batching_bench.py LOADGEN MODELS_DIR [--rates 10,20,...] [--duration S]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

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


def ceiling(models, batches, repeats=3):
    """CPU ms per image of the four blocks, one intra-op thread, per batch size (see the docstring)."""
    import torch  # Debian's python3-torch, only for this measurement
    torch.set_num_threads(1)
    modules = {}
    for name, _ in BLOCKS:
        m = torch.jit.freeze(torch.jit.load(os.path.join(models, name + ".pt")).eval())
        modules[name] = torch.jit.optimize_for_inference(m)
    out = {}
    with torch.no_grad():
        for b in batches:
            total = 0.0
            for name, shape in BLOCKS:
                x = torch.randn([b] + shape[1:])
                modules[name](x)  # warm-up
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    modules[name](x)
                    best = min(best, time.perf_counter() - t0)
                total += best * 1e3 / b
            out[b] = total
    return out


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
    cores = os.cpu_count() or 1
    batches = [1] + [int(x) for x in a.batches.split(",")]
    for b, ms in ceiling(a.models, batches).items():
        print(json.dumps({"bench": "batching_ceiling", "max_batch": b, "cpu_ms_per_image": round(ms, 1),
                          "cores": cores, "ceiling_rps": round(cores * 1000.0 / ms, 2)}), flush=True)


if __name__ == "__main__":
    main()
