#!/usr/bin/env python3
"""Export the BlockFlow demo models: a ResNet50 split into TorchScript blocks.

Usage:
    /usr/bin/python3 scripts/export_models.py --out DIR [--force]

Produces in DIR:
    block1.pt      conv1+bn1+relu+maxpool+layer1   1x3x224x224  -> 1x256x56x56
    block2.pt      layer2                          1x256x56x56  -> 1x512x28x28
    block3.pt      layer3                          1x512x28x28  -> 1x1024x14x14
    block4.pt      layer4+avgpool+flatten+fc       1x1024x14x14 -> 1x1000
    head_b.pt      second task head (different weights, 10 classes)
                                                   1x1024x14x14 -> 1x10
    monolithic.pt  the whole ResNet50 (same weights as block1..block4)
    monolithic_b.pt block1..block3 followed by head_b
    manifest.json  shapes, task definitions and version information

The weights are random (no download), but BatchNorm running statistics are
calibrated on random inputs so that activations stay in a sane range in eval
mode. Modules are saved as plain (non-frozen) TorchScript in eval mode; the C++
side is responsible for freezing them.

The export is idempotent: if DIR/manifest.json was written by the same
script_version, torch version and seed and all listed files exist, nothing is
done (unless --force is given).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torchvision

# Bump whenever the exported models or the manifest layout change.
SCRIPT_VERSION = 1
SEED = 0
HEAD_B_SEED = 1
HEAD_B_FC_SEED = 2
CALIB_SEED = 1
CALIB_PASSES = 4
CALIB_BATCH = 8
INPUT_SHAPE = [1, 3, 224, 224]
TOLERANCE = 1e-4

BLOCK_NAMES = ["block1", "block2", "block3", "block4", "head_b"]
TASKS = {
    "task_a": ["block1", "block2", "block3", "block4"],
    "task_b": ["block1", "block2", "block3", "head_b"],
}
MONOLITHIC = {"task_a": "monolithic.pt", "task_b": "monolithic_b.pt"}


def log(msg):
    print(msg, flush=True)


def expected_files():
    files = ["%s.pt" % name for name in BLOCK_NAMES]
    files.extend(MONOLITHIC.values())
    return files


def is_up_to_date(out_dir):
    """True when DIR already holds an export made by this script version."""
    manifest_path = os.path.join(out_dir, "manifest.json")
    if not os.path.isfile(manifest_path):
        return False
    try:
        with open(manifest_path, "r") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict):
        return False
    if manifest.get("script_version") != SCRIPT_VERSION:
        return False
    if manifest.get("torch_version") != torch.__version__:
        return False
    if manifest.get("seed") != SEED:
        return False
    files = list(expected_files())
    blocks = manifest.get("blocks")
    if isinstance(blocks, dict):
        for entry in blocks.values():
            if isinstance(entry, dict) and "file" in entry:
                files.append(entry["file"])
    for name in files:
        if not os.path.isfile(os.path.join(out_dir, name)):
            return False
    return True


def calibrate_batchnorm(model):
    """Recompute BN running stats from random inputs (cumulative average)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
            m.reset_running_stats()
    model.train()
    gen = torch.Generator()
    gen.manual_seed(CALIB_SEED)
    with torch.no_grad():
        for _ in range(CALIB_PASSES):
            x = torch.randn(CALIB_BATCH, 3, 224, 224, generator=gen)
            model(x)
    model.eval()
    return model


def build_resnet50(seed):
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None)
    return calibrate_batchnorm(model)


def script(module):
    module.eval()
    scripted = torch.jit.script(module)
    scripted.eval()
    return scripted


def max_abs_diff(a, b):
    return (a - b).abs().max().item()


def save_atomic_module(module, out_dir, filename):
    final_path = os.path.join(out_dir, filename)
    tmp_path = os.path.join(out_dir, ".%s.tmp.%d" % (filename, os.getpid()))
    try:
        torch.jit.save(module, tmp_path)
        os.replace(tmp_path, final_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def save_atomic_json(obj, out_dir, filename):
    final_path = os.path.join(out_dir, filename)
    tmp_path = os.path.join(out_dir, ".%s.tmp.%d" % (filename, os.getpid()))
    try:
        with open(tmp_path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, final_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="re-export even if the models are up to date")
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    out_dir = args.out

    if not args.force and is_up_to_date(out_dir):
        log("models up to date in %s" % out_dir)
        return 0

    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()

    # --- Task A backbone: ResNet50 with seed 0 --------------------------------
    t0 = time.perf_counter()
    model = build_resnet50(SEED)
    log("built + calibrated resnet50 (seed %d) in %.2f s"
        % (SEED, time.perf_counter() - t0))

    # --- Task B head: layer4 of an independently seeded ResNet50 --------------
    t0 = time.perf_counter()
    other = build_resnet50(HEAD_B_SEED)
    torch.manual_seed(HEAD_B_FC_SEED)
    head_b_eager = nn.Sequential(
        other.layer4,
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(1),
        nn.Linear(2048, 10),
    ).eval()
    del other
    log("built + calibrated head_b (seed %d, fc seed %d) in %.2f s"
        % (HEAD_B_SEED, HEAD_B_FC_SEED, time.perf_counter() - t0))

    # --- Split into blocks -----------------------------------------------------
    block_eager = {
        "block1": nn.Sequential(model.conv1, model.bn1, model.relu,
                                model.maxpool, model.layer1),
        "block2": nn.Sequential(model.layer2),
        "block3": nn.Sequential(model.layer3),
        "block4": nn.Sequential(model.layer4, model.avgpool, nn.Flatten(1),
                                model.fc),
        "head_b": head_b_eager,
    }
    monolithic_b_eager = nn.Sequential(block_eager["block1"],
                                       block_eager["block2"],
                                       block_eager["block3"],
                                       head_b_eager)

    t0 = time.perf_counter()
    scripted = {name: script(mod) for name, mod in block_eager.items()}
    mono_a = script(model)
    mono_b = script(monolithic_b_eager)
    log("scripted modules in %.2f s" % (time.perf_counter() - t0))

    # --- Verify that the split equals the monolithic models -------------------
    t0 = time.perf_counter()
    gen = torch.Generator()
    gen.manual_seed(1234)
    x = torch.randn(*INPUT_SHAPE, generator=gen)
    shapes = {}
    with torch.no_grad():
        h1 = scripted["block1"](x)
        h2 = scripted["block2"](h1)
        h3 = scripted["block3"](h2)
        out_a = scripted["block4"](h3)
        out_b = scripted["head_b"](h3)
        ref_a = mono_a(x)
        ref_b = mono_b(x)
        eager_a = model(x)
    for name, t in (("block1", h1), ("block2", h2), ("block3", h3),
                    ("block4", out_a), ("head_b", out_b)):
        shapes[name] = list(t.shape)
        log("  %-7s output shape %-18s max|act| %.4f  std %.4f"
            % (name, str(list(t.shape)), t.abs().max().item(), t.std().item()))

    diff_a = max_abs_diff(out_a, ref_a)
    diff_b = max_abs_diff(out_b, ref_b)
    diff_eager = max_abs_diff(ref_a, eager_a)
    log("task_a: max|blocks - monolithic| = %.3e (scripted vs eager %.3e)"
        % (diff_a, diff_eager))
    log("task_b: max|blocks - monolithic_b| = %.3e" % diff_b)
    log("task_a output magnitude: max|y| = %.4f" % ref_a.abs().max().item())
    log("task_b output magnitude: max|y| = %.4f" % ref_b.abs().max().item())
    log("verified in %.2f s" % (time.perf_counter() - t0))

    expected_shapes = {
        "block1": [1, 256, 56, 56],
        "block2": [1, 512, 28, 28],
        "block3": [1, 1024, 14, 14],
        "block4": [1, 1000],
        "head_b": [1, 10],
    }
    ok = True
    for name, shape in expected_shapes.items():
        if shapes[name] != shape:
            log("ERROR: %s output shape %s, expected %s"
                % (name, shapes[name], shape))
            ok = False
    if list(ref_a.shape) != [1, 1000] or list(ref_b.shape) != [1, 10]:
        log("ERROR: unexpected monolithic output shapes %s / %s"
            % (list(ref_a.shape), list(ref_b.shape)))
        ok = False
    for label, d in (("task_a", diff_a), ("task_b", diff_b),
                     ("task_a scripted vs eager", diff_eager)):
        if not (d <= TOLERANCE):  # also catches NaN
            log("ERROR: %s mismatch: max abs diff %.3e > %.1e"
                % (label, d, TOLERANCE))
            ok = False
    for label, t in (("task_a", ref_a), ("task_b", ref_b)):
        if not torch.isfinite(t).all():
            log("ERROR: %s output is not finite" % label)
            ok = False
    if not ok:
        return 1

    # --- Save ----------------------------------------------------------------
    t0 = time.perf_counter()
    for name in BLOCK_NAMES:
        save_atomic_module(scripted[name], out_dir, "%s.pt" % name)
    save_atomic_module(mono_a, out_dir, MONOLITHIC["task_a"])
    save_atomic_module(mono_b, out_dir, MONOLITHIC["task_b"])

    input_shapes = {
        "block1": list(INPUT_SHAPE),
        "block2": shapes["block1"],
        "block3": shapes["block2"],
        "block4": shapes["block3"],
        "head_b": shapes["block3"],
    }
    manifest = {
        "input_shape": list(INPUT_SHAPE),
        "blocks": {
            name: {
                "file": "%s.pt" % name,
                "input_shape": input_shapes[name],
                "output_shape": shapes[name],
            }
            for name in BLOCK_NAMES
        },
        "tasks": TASKS,
        "monolithic": MONOLITHIC,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "seed": SEED,
        "script_version": SCRIPT_VERSION,
        "verification": {
            "task_a_max_abs_diff": diff_a,
            "task_b_max_abs_diff": diff_b,
            "task_a_output_max_abs": ref_a.abs().max().item(),
            "task_b_output_max_abs": ref_b.abs().max().item(),
        },
    }
    save_atomic_json(manifest, out_dir, "manifest.json")  # manifest last
    log("saved to %s in %.2f s" % (out_dir, time.perf_counter() - t0))

    for name in expected_files() + ["manifest.json"]:
        size = os.path.getsize(os.path.join(out_dir, name))
        log("  %-16s %10.1f KiB" % (name, size / 1024.0))
    log("export finished in %.2f s" % (time.perf_counter() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
