#!/usr/bin/env python3
"""The batching benchmark: the 4-block split ResNet50 (threads, 2 intra-op threads per block) under
open-loop Poisson load from blockflow-loadgen, batching off and on at every block for max_batch B in
2, 4, 8; for each, a rate sweep finds the saturation throughput (the most requests/s completed at
any offered rate). The session's lanes are the default (elastic: docs/lanes.md); batching off is
also swept with one team lane (--lanes 1, the lanes without elasticity) for comparison.

Next to each sweep, the CPU-bound ceiling at that batch size, measured just before and just after
the sweep (the machine is shared and its speed drifts; the mean of the two is used) with Debian's
python3-torch on the same block files, prepared as the library prepares them (frozen,
optimize_for_inference) and run alone with ONE intra-op thread, so that the time is CPU time:
cpu_ms_per_image is the mean time per image of the four blocks run back to back (each block run for
about 0.4 s), and ceiling_rps = cores * 1000 / cpu_ms_per_image estimates what C cores complete per
second at that batch size if they never idle, however the four blocks overlap. It is an estimate, not
a strict bound: the saturation may pass it by a few percent (timing noise; a block's CPU time also
moves with what runs beside it). It tells whether batching has anything left to win on this CPU.

Beside it, the parallel floor: C processes of python3-torch, one intra-op thread each, started
together, each running the four blocks back to back for 3 s at that batch size (also before and after
the sweep): parallel_rps is the images per second they complete together. It is what the cores give
when every one of them runs a block of its own with one thread and nothing else to do; where cores
slow each other down (shared caches and memory bandwidth, a hypervisor's neighbours) it falls below
ceiling_rps. It is the fair measure of a one-thread-per-core schedule, not a bound: the session's
elastic lanes also run units with a team of threads, which passes it where two units side by side
slow each other more than one unit on two threads does (batches, on some CPUs).

Every line carries "cpu" (the model) and "cores" (those this process may run on). Prints, per B
(batching off swept again right before each B, so that each ratio's two sides are measured side by
side):
  {"bench":"batching","block":"block1-4","max_batch":B,"saturated_off":..,"saturated_on":..,
   "saturation_rps_off":..,"saturation_rps_on":..,
   "ratio":..,"p99_ms_on":..,"max_batch_delay_ms":..,"threads_per_block":2,"ceiling_rps_off":..,
   "ceiling_rps_on":..,"of_ceiling_off":..,"of_ceiling_on":..,"parallel_rps_off":..,"parallel_rps_on":..,
   "of_parallel_off":..,"of_parallel_on":..}
saturated_*: whether loadgen found a rate the deployment could not keep up with (false: the figure is
the top rate offered, nothing saturated; raise --rates). p99_ms_on is the p99 latency at the rate
where the batched pipeline peaked; of_ceiling_* are the
saturations over the ceiling measured beside them (the issue's targets: >= 0.97), of_parallel_* over
the parallel floor. Then
  {"bench":"batching_ceiling","max_batch":B,"cpu_ms_per_image":..,"cores":C,"ceiling_rps":..,
   "parallel_rps":..}
per batch size (1 and each B), and
  {"bench":"batching_lanes","saturation_rps_elastic":..,"saturation_rps_team_lanes":..,"ratio":..}
for batching off with the default lanes (swept again right after) against one team lane. Per-rate runs (with each run's lane
figures) go to stderr as "batching_run" lines.

With --device cuda:0 every block runs on that GPU (scripts/gpu.sh batching): the CPU ceilings and
the lanes comparison do not apply and are left out; each line names the GPU ("device") and the
sweep's best p50 latency, off and on.

usage: batching_bench.py LOADGEN MODELS_DIR [--rates 10,20,...] [--duration S] [--device cuda:0]
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


def deployment(models, max_batch, delay_ms, threads, device="cpu"):
    blocks = [{"name": n, "torchscript": os.path.join(os.path.abspath(models), n + ".pt"), "intra_op_threads": threads,
               "input_shapes": [s], "warmup_runs": 1, "max_batch": max_batch, "max_batch_delay_ms": delay_ms,
               "queue_capacity": 256}
              for n, s in BLOCKS]
    if device != "cpu":
        for b in blocks:
            b["device"] = device
    return {"blocks": blocks, "tasks": {"split": [n for n, _ in BLOCKS]}}


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def usable_cores():
    """The cores this process may run on (affinity; os.cpu_count() ignores it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def sweep(loadgen, models, max_batch, rates, duration, delay_ms, threads, lanes=0, device="cpu"):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(deployment(models, max_batch, delay_ms, threads, device), f)
        path = f.name
    try:
        out = subprocess.run([loadgen, "--deployment", path, "--sweep", ",".join(str(r) for r in rates),
                              "--duration", str(duration), "--lanes", str(lanes), "--quiet"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"blockflow-loadgen exited with status {out.returncode}: {out.stderr[-2000:]}")
    finally:
        os.unlink(path)
    runs = [json.loads(l) for l in out.stdout.splitlines() if l.startswith('{"bench":"loadgen"') or '"loadgen"' in l]
    saturation = [json.loads(l) for l in out.stdout.splitlines() if '"saturation"' in l]
    runs = [r for r in runs if r.get("bench") == "loadgen"]
    best = dict(max(runs, key=lambda r: r["throughput_per_s"]))
    # loadgen's verdict: null rate when no offered rate saturated the deployment. Then the "saturation"
    # is only the top rate offered, and a ratio of two such figures says nothing: raise --rates.
    best["saturated"] = bool(saturation) and saturation[-1].get("rate_per_s") is not None
    for r in runs:
        print(json.dumps({"bench": "batching_run", "device": device, "max_batch": max_batch, "lanes": lanes or "auto",
                          "rate_per_s": r["rate_per_s"], "throughput_per_s": round(r["throughput_per_s"], 2),
                          "p50_ms": round(r["p50_ms"], 1), "p99_ms": round(r["p99_ms"], 1),
                          "lanes_run": r.get("lanes", [])}), file=sys.stderr)
    return best


class Ceiling:
    """CPU ms per image of the four blocks, one intra-op thread, per batch size (see the docstring)."""

    def __init__(self, models):
        import torch  # Debian's python3-torch, only for this measurement
        torch.set_num_threads(1)
        self.torch = torch
        self.modules = load_blocks(torch, models)

    def ms_per_image(self, b, seconds=0.4):
        total = 0.0
        with self.torch.no_grad():
            for name, shape in BLOCKS:
                x = self.torch.randn([b] + shape[1:])
                self.modules[name](x)  # warm-up
                runs, t0 = 0, time.perf_counter()
                while runs < 3 or time.perf_counter() - t0 < seconds:
                    self.modules[name](x)
                    runs += 1
                total += (time.perf_counter() - t0) * 1e3 / (runs * b)
        return total


def load_blocks(torch, models):
    """The four blocks as the library prepares them (frozen, optimize_for_inference)."""
    modules = {}
    for name, _ in BLOCKS:
        m = torch.jit.freeze(torch.jit.load(os.path.join(models, name + ".pt")).eval())
        modules[name] = torch.jit.optimize_for_inference(m)
    return modules


def parallel_worker(models, b, seconds):
    """One process of the parallel floor: loads, says "ready", waits for "go", prints images/s."""
    import torch
    torch.set_num_threads(1)
    modules = load_blocks(torch, models)
    inputs = {name: torch.randn([b] + shape[1:]) for name, shape in BLOCKS}
    with torch.no_grad():
        for name, _ in BLOCKS:
            modules[name](inputs[name])  # warm-up
        print("ready", flush=True)
        sys.stdin.readline()
        images, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for name, _ in BLOCKS:
                modules[name](inputs[name])
            images += b
        print(images / (time.perf_counter() - t0), flush=True)


def parallel_rps(models, b, cores, seconds=3.0):
    """The parallel floor at batch size b (see the docstring)."""
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--parallel-worker", models, str(b),
                               str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(cores)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a parallel-floor process failed to start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    total = sum(float(p.stdout.readline()) for p in procs)
    for p in procs:
        p.wait()
    return total


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--parallel-worker":
        parallel_worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("loadgen")
    ap.add_argument("models")
    ap.add_argument("--rates", default="14,22,30,34,38,42,46")
    ap.add_argument("--duration", type=float, default=6)
    ap.add_argument("--delay-ms", type=float, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    if a.device != "cpu":
        gpu_sweeps(a, rates)
        return
    cores = usable_cores()
    machine = {"cpu": cpu_model(), "cores": cores}
    ceiling = Ceiling(a.models)
    ceilings, parallels = {}, {}

    def beside(b, run):
        """Runs the sweep `run` between two ceiling and parallel-floor measurements at batch size b."""
        before, par_before = ceiling.ms_per_image(b), parallel_rps(a.models, b, cores)
        result = run()
        after, par_after = ceiling.ms_per_image(b), parallel_rps(a.models, b, cores)
        ceilings.setdefault(b, []).extend([before, after])
        parallels.setdefault(b, []).extend([par_before, par_after])
        return result, cores * 1000.0 / ((before + after) / 2), (par_before + par_after) / 2

    for b in [int(x) for x in a.batches.split(",")]:
        # Batching off swept again beside each batch size, right before it: the machine's drift over
        # the minutes the bench takes falls on both sides of each ratio alike.
        off, ceiling_off, parallel_off = beside(
            1, lambda: sweep(a.loadgen, a.models, 1, rates, a.duration, a.delay_ms, a.threads))
        on, ceiling_on, parallel_on = beside(
            b, lambda: sweep(a.loadgen, a.models, b, rates, a.duration, a.delay_ms, a.threads))
        print(json.dumps({"bench": "batching", **machine, "block": "block1-4", "max_batch": b,
                          "saturated_off": off["saturated"], "saturated_on": on["saturated"],
                          "saturation_rps_off": round(off["throughput_per_s"], 2),
                          "saturation_rps_on": round(on["throughput_per_s"], 2),
                          "ratio": round(on["throughput_per_s"] / off["throughput_per_s"], 3),
                          "p99_ms_on": round(on["p99_ms"], 1), "max_batch_delay_ms": a.delay_ms,
                          "threads_per_block": a.threads, "ceiling_rps_off": round(ceiling_off, 2),
                          "ceiling_rps_on": round(ceiling_on, 2),
                          "of_ceiling_off": round(off["throughput_per_s"] / ceiling_off, 3),
                          "of_ceiling_on": round(on["throughput_per_s"] / ceiling_on, 3),
                          "parallel_rps_off": round(parallel_off, 2), "parallel_rps_on": round(parallel_on, 2),
                          "of_parallel_off": round(off["throughput_per_s"] / parallel_off, 3),
                          "of_parallel_on": round(on["throughput_per_s"] / parallel_on, 3)}), flush=True)
    for b, ms in sorted(ceilings.items()):
        mean = sum(ms) / len(ms)
        print(json.dumps({"bench": "batching_ceiling", **machine, "max_batch": b, "cpu_ms_per_image": round(mean, 1), "ceiling_rps": round(cores * 1000.0 / mean, 2),
                          "parallel_rps": round(sum(parallels[b]) / len(parallels[b]), 2)}), flush=True)
    team = sweep(a.loadgen, a.models, 1, rates, a.duration, a.delay_ms, a.threads, lanes=1)
    off = sweep(a.loadgen, a.models, 1, rates, a.duration, a.delay_ms, a.threads)  # beside it, after
    print(json.dumps({"bench": "batching_lanes", **machine, "max_batch": 1,
                      "saturated_elastic": off["saturated"], "saturated_team_lanes": team["saturated"],
                      "saturation_rps_elastic": round(off["throughput_per_s"], 2),
                      "saturation_rps_team_lanes": round(team["throughput_per_s"], 2),
                      "ratio": round(off["throughput_per_s"] / team["throughput_per_s"], 3),
                      "threads_per_block": a.threads}), flush=True)


def gpu_sweeps(a, rates):
    """Batching off and on with every block on a.device: no CPU ceiling applies there."""
    import torch  # the GPU machine's PyTorch, for the device's name
    index = int(a.device.split(":")[1]) if ":" in a.device else 0
    name = torch.cuda.get_device_name(index) if torch.cuda.is_available() else a.device
    best = None
    for b in [int(x) for x in a.batches.split(",")]:
        off = sweep(a.loadgen, a.models, 1, rates, a.duration, a.delay_ms, a.threads, device=a.device)  # beside each B
        on = sweep(a.loadgen, a.models, b, rates, a.duration, a.delay_ms, a.threads, device=a.device)
        ratio = on["throughput_per_s"] / off["throughput_per_s"]
        best = max(best or ratio, ratio)
        print(json.dumps({"bench": "batching", "device": name, "cpu": cpu_model(), "block": "block1-4", "max_batch": b,
                          "saturated_off": off["saturated"], "saturated_on": on["saturated"],
                          "saturation_rps_off": round(off["throughput_per_s"], 2),
                          "saturation_rps_on": round(on["throughput_per_s"], 2), "ratio": round(ratio, 3),
                          "p50_ms_off": round(off["p50_ms"], 2), "p50_ms_on": round(on["p50_ms"], 2),
                          "p99_ms_on": round(on["p99_ms"], 1), "max_batch_delay_ms": a.delay_ms,
                          "threads_per_block": a.threads, "rates": rates, "duration_s": a.duration}), flush=True)
    print(json.dumps({"bench": "batching_best", "device": name, "ratio": round(best, 3)}), flush=True)


if __name__ == "__main__":
    main()
