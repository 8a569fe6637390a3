#!/usr/bin/env python3
"""ctest blockflow_split: scripts/blockflow_split.py cuts small models into blocks.

- A small CNN saved as TorchScript (scripted, and traced) is cut at explicit points and by
  `--parts 2`; the parts, chained here, equal the whole model (max abs diff <= 1e-4).
- A torchvision ResNet18 (random weights, a small input) goes through the torch.fx path.
- The deployments run: blockflow-loadgen answers requests from the threads one, and the serve
  example, given the workers one through blockflowctl apply, answers the whole model's output to
  the Python client.
- Refusals: a model whose top level is not a sequence, an invalid cut, an unknown cut, too many
  parts, control flow in a TorchScript forward, a failed equality check.

usage: blockflow_split_test.py SPLIT_SCRIPT LOADGEN SERVE BLOCKFLOWCTL
"""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from ctest_util import check, free_port, stop_serve  # noqa: E402
from python_client import BlockflowClient  # noqa: E402

SHAPE = (1, 3, 16, 16)


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(x + self.bn(self.conv(x)))


class Net(nn.Module):
    """A sequence at the top level: conv1, bn1, relu, layer1, layer2 (two blocks), pool, fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.layer1 = Residual(8)
        self.layer2 = nn.Sequential(Residual(8), Residual(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.pool(x), 1))


class Fork(nn.Module):
    """Not a sequence: both branches read the input, their sum is the output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return self.a(x) + self.b(x)


class Branchy(nn.Module):
    """Control flow at the top level."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.a(x)
        if bool(y.sum() > 0):
            y = y * 2
        return self.b(y)


def split(script, *args, expect=0):
    """Runs the tool as the installed blockflow-split is run; returns (stdout, stderr)."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
    print(f"+ blockflow-split {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}", end="")
    check(out.returncode == expect, f"blockflow-split {' '.join(args)} exits {expect}")
    return out.stdout, out.stderr


def refusal(tool, argv):
    """Runs the tool's main() in this process (one torch import for all refusals): (exit, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = tool.main(argv)
    print(f"+ blockflow-split {' '.join(argv)} -> {rc}: {err.getvalue().strip()}")
    return rc, err.getvalue()


def chain_diff(out_dir, parts, model, x):
    """Max abs difference between the saved parts chained and the model."""
    y = x
    with torch.no_grad():
        for k in range(1, parts + 1):
            y = torch.jit.load(os.path.join(out_dir, f"part{k}.pt"))(y)
        return (y - model(x)).abs().max().item()


def read_json(path):
    with open(path) as f:
        return json.load(f)


def check_explicit_cuts(script, model_file, model, x, out):
    stdout, _ = split(script, model_file, "--input-shape", "1,3,16,16", "--cuts", "layer1,pool", "--out", out,
                      "--repeats", "3")
    check("max abs diff" in stdout and "PASS" in stdout, "the report says the parts equal the model")
    report = read_json(os.path.join(out, "report.json"))
    check(report["cuts"] == ["layer1", "pool"] and len(report["parts"]) == 3, "cut before layer1 and pool: 3 parts")
    check(report["equal"] and report["max_abs_diff"] <= 1e-4, "report.json: equal")
    check(all(p["latency_ms"] > 0 and p["load_ms"] > 0 and p["params_mb"] >= 0 and p["output_mb"] > 0
              for p in report["parts"]), "report.json: latency, load time, parameters and output per part")
    check(chain_diff(out, 3, model, x) <= 1e-4, "the saved parts chained here equal the model")
    deployment = read_json(os.path.join(out, "deployment.json"))
    check(deployment == {"blocks": [{"name": "part1", "torchscript": "part1.pt", "input_shapes": [[-1, 3, 16, 16]]},
                                    {"name": "part2", "torchscript": "part2.pt", "input_shapes": [[-1, 8, 16, 16]]},
                                    {"name": "part3", "torchscript": "part3.pt", "input_shapes": [[-1, 8, 16, 16]]}],
                         "tasks": {"net": ["part1", "part2", "part3"]}}, "deployment.json: a chain task, threads")


def check_automatic_cuts(script, model_file, model, x, out):
    split(script, model_file, "--input-shape", "1,3,16,16", "--parts", "2", "--placement", "workers",
          "--task", "classify", "--out", out, "--repeats", "3")
    report = read_json(os.path.join(out, "report.json"))
    names = [s["name"] for s in report["stages"]]
    check(names == ["conv1", "layer1", "layer2", "pool", "fc"], "stages between the valid cut points, profiled")
    check(len(report["cuts"]) == 1 and report["cuts"][0] in names[1:] and report["predicted_bottleneck_ms"] > 0,
          "--parts 2: one cut chosen among them")
    check(report["channel"] == "shm" and report["handoff_us_per_hop"] == 4.0, "workers: the shm cost model")
    check(chain_diff(out, 2, model, x) <= 1e-4, "the saved parts chained here equal the model")
    deployment = read_json(os.path.join(out, "deployment.json"))
    check([b.get("placement") for b in deployment["blocks"]] == ["w1", "w2"]
          and deployment["tasks"] == {"classify": ["part1", "part2"]}, "deployment.json: one worker per part")


def check_torchvision(script, out):
    split(script, "--torchvision", "resnet18", "--input-shape", "1,3,32,32", "--cuts", "layer2,layer4", "--out", out,
          "--repeats", "2")
    report = read_json(os.path.join(out, "report.json"))
    check(report["equal"] and [p["first_module"] for p in report["parts"]] == ["conv1", "layer2", "layer4"],
          "torchvision resnet18 traced with torch.fx, cut and equal")


def check_loadgen(loadgen, out):
    run = subprocess.run([loadgen, "--deployment", os.path.join(out, "deployment.json"), "--clients", "1",
                          "--requests", "3", "--quiet"], capture_output=True, text=True, timeout=120)
    print(run.stdout + run.stderr[-2000:])
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    check(run.returncode == 0 and len(lines) == 1 and lines[0]["completed"] == 3 and lines[0]["failed"] == 0,
          "blockflow-loadgen runs the threads deployment: 3 requests completed")


def check_served(serve, ctl, out, model, x):
    control = f"tcp://127.0.0.1:{free_port()}"
    srv = subprocess.Popen([serve, "--empty", "--endpoint", "tcp://127.0.0.1:*", "--control", control,
                            "--models", out], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = srv.stdout.readline().strip().removeprefix("serving on ")
        applied = subprocess.run([ctl, "--endpoint", control, "apply", os.path.join(out, "deployment.json")],
                                 capture_output=True, text=True, timeout=120)
        print(applied.stdout + applied.stderr)
        check(applied.returncode == 0, "blockflowctl apply: the workers deployment loads")
        with BlockflowClient(endpoint, timeout_s=60) as client:
            (y,) = client.submit("classify", x.numpy())
        with torch.no_grad():
            diff = float(np.abs(y - model(x).numpy()).max())
        print(f"  served by the session's two workers: max |y - model(x)| = {diff:.3e}")
        check(diff <= 1e-4, "the session answers the whole model's output")
    finally:
        rc = stop_serve(srv)
    check(rc == 0, f"serve exits 0 once its stdin closes (status {rc}; None: killed after 30 s)")


def check_refusals(tool, tmp, net_file):
    fork, branchy = os.path.join(tmp, "fork.pt"), os.path.join(tmp, "branchy.pt")
    torch.jit.script(Fork().eval()).save(fork)
    torch.jit.script(Branchy().eval()).save(branchy)
    out = os.path.join(tmp, "refused")
    common = ["--input-shape", "1,3,16,16", "--out", out, "--repeats", "1"]
    rc, err = refusal(tool, [fork, "--parts", "2"] + common)
    check(rc == 2 and "model 'fork' cannot be cut: no module starts where exactly one tensor is live" in err
          and "valid cut points: none" in err, "a model that is not a sequence is refused")
    rc, err = refusal(tool, [fork, "--cuts", "b"] + common)
    check(rc == 2 and "cut 'b' is not valid: 2 values are live there (x, a)" in err, "a cut with two live values")
    rc, err = refusal(tool, [net_file, "--cuts", "layer1,nope"] + common)
    check(rc == 2 and "unknown cut 'nope'" in err and "valid cut points: layer1, layer2, pool, fc" in err,
          "an unknown cut, with the valid ones")
    rc, err = refusal(tool, [net_file, "--parts", "9"] + common)
    check(rc == 2 and "at most 5 parts" in err, "more parts than stages")
    rc, err = refusal(tool, [branchy, "--parts", "2"] + common)
    check(rc == 2 and "has prim::If" in err, "control flow in a TorchScript forward")
    check(not os.path.exists(out), "nothing written for a refusal")
    rc, _ = refusal(tool, [net_file, "--cuts", "layer2", "--tolerance", "-1"] + common)
    check(rc == 1, "a difference above the tolerance exits 1")


def main():
    script, loadgen, serve, ctl = sys.argv[1:5]
    torch.set_num_threads(2)
    spec = importlib.util.spec_from_file_location("blockflow_split", script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    torch.manual_seed(0)
    model = tool.calibrate_batchnorm(Net(), SHAPE, 0)
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(0))  # the tool's example for --seed 0
    with tempfile.TemporaryDirectory() as tmp:
        scripted, traced = os.path.join(tmp, "net.pt"), os.path.join(tmp, "net_traced.pt")
        torch.jit.script(model).save(scripted)
        torch.jit.trace(model, x).save(traced)
        explicit, automatic = os.path.join(tmp, "explicit"), os.path.join(tmp, "automatic")
        check_explicit_cuts(script, scripted, model, x, explicit)
        check_automatic_cuts(script, traced, model, x, automatic)
        check_torchvision(script, os.path.join(tmp, "resnet18"))
        check_loadgen(loadgen, explicit)
        check_served(serve, ctl, automatic, model, x)
        check_refusals(tool, tmp, scripted)
    print("blockflow_split test: PASS")


if __name__ == "__main__":
    main()
