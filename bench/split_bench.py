#!/usr/bin/python3
"""split bench: blockflow-split's automatic cuts of ResNet50, MobileNetV3-Large and ViT-B/16.

Usage:
    /usr/bin/python3 bench/split_bench.py [--models resnet50,mobilenet_v3_large,vit_b_16]
                                          [--parts 2,3,4] [--threads 2] [--repeats 10] [--channel shm]
    (or scripts/bench.sh split; BENCH_THREADS sets --threads)

For each model (torchvision, random weights from seed 0, batch-norm statistics calibrated, input
1x3x224x224): trace it, profile the stages between its candidate cut points once, and measure the
uncut model exported the same way (TorchScript, frozen and optimized for inference, as the C++
loader does); then for each N choose the cuts as `blockflow-split --parts N` does, export the parts,
time each one and compare the chained parts with the model. One JSON line per model and N:

    {"bench":"split","model":..,"parts":N,"cuts":[..],"slowest_part_ms":..,"whole_ms":..,
     "slowest_over_whole":..,"max_abs_diff":..,"equal":true,"cpu":..,"threads":T, ...}

slowest_over_whole near 1/N means balanced parts: the best a pipeline of N workers can do for
throughput. Latencies are medians of --repeats runs after a warm-up, on --threads intra-op threads.
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch

SHAPE = [1, 3, 224, 224]
SEED = 0
DEPTH = 3  # blockflow-split's default --depth
TOLERANCE = 1e-4


def load_tool():
    """scripts/blockflow_split.py as a module."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "blockflow_split.py")
    spec = importlib.util.spec_from_file_location("blockflow_split", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def bench_model(tool, name, parts_list, args):
    """Yields one JSON-ready line per N of `parts_list` for the torchvision model `name`."""
    _, reference, gm = tool.load_model(None, name, SHAPE, SEED)
    example = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(SEED))
    splitter = tool.Splitter(gm, example)
    bounds = [0] + splitter.candidates(DEPTH) + [len(splitter.body)]
    stages = tool.profile_stages(splitter, bounds, example, args.repeats)
    _, whole_ms = tool.measure_whole(splitter, example, args.repeats)
    hop_us, us_per_mb = tool.CHANNEL_COSTS[args.channel]
    for parts in parts_list:
        chosen, predicted = tool.choose_cuts(stages, parts, hop_us, us_per_mb)
        positions = [bounds[i] for i in chosen]
        with tempfile.TemporaryDirectory() as out:
            reports, diff = tool.write_parts(splitter, positions, reference, example, out, args.repeats)
        slowest = max(p["latency_ms"] for p in reports)
        yield {"bench": "split", "model": name, "parts": parts, "cuts": [splitter.name_at(i) for i in positions],
               "slowest_part_ms": slowest, "whole_ms": round(whole_ms, 3),
               "slowest_over_whole": round(slowest / whole_ms, 4), "max_abs_diff": diff, "equal": diff <= TOLERANCE,
               "cpu": tool.cpu_model(), "threads": args.threads, "part_ms": [p["latency_ms"] for p in reports],
               "predicted_bottleneck_ms": round(predicted, 3), "stages": len(stages), "channel": args.channel}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,mobilenet_v3_large,vit_b_16")
    p.add_argument("--parts", default="2,3,4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--channel", default="shm", help="hand-off cost model for the choice: inproc, shm, zmq")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tool = load_tool()
    ok = True
    for name in args.models.split(","):
        for line in bench_model(tool, name, [int(n) for n in args.parts.split(",")], args):
            print(json.dumps(line), flush=True)
            ok = ok and line["equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
