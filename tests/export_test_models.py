#!/usr/bin/env python3
"""Export tiny TorchScript models used by the BlockFlow unit tests.

Usage:
    /usr/bin/python3 tests/export_test_models.py --out DIR [--force]

Produces in DIR (all TorchScript, eval mode, NOT frozen):
    cnn_block1.pt        Conv(3->8)+BN+ReLU             1x3x16x16 -> 1x8x16x16
    cnn_block2.pt        Conv(8->16, stride 2)+BN+ReLU  1x8x16x16 -> 1x16x8x8
    cnn_block3.pt        AvgPool+Flatten+Linear(16,5)   1x16x8x8  -> 1x5
    cnn_monolithic.pt    cnn_block1..3 composed         1x3x16x16 -> 1x5
    head_a.pt            AvgPool+Flatten+Linear(16,5)   1x16x8x8  -> 1x5
    head_b.pt            same architecture, other seed  1x16x8x8  -> 1x5
    tuple_block.pt       x -> (x * 2, x + 1)
    two_input_block.pt   (x, y) -> x * y + 1
    list_block.pt        x -> [x, x * 3]
    raise_block.pt       x -> raises RuntimeError("boom from raise_block")
    manifest.json        files with their input/output shapes

Idempotent: if DIR/manifest.json was written by the same script_version,
torch version and seed and all listed files exist, nothing is done (unless
--force is given).
"""

import argparse
import json
import os
import sys
import time
from typing import List, Tuple

import torch
import torch.nn as nn

# Bump whenever the exported models or the manifest layout change.
SCRIPT_VERSION = 2
SEED = 0
HEAD_A_SEED = 1
HEAD_B_SEED = 2
QUANTIZED_SEED = 3
QUANTIZED_WIDTH = 256
TOLERANCE = 1e-5

CNN_INPUT = [1, 3, 16, 16]
FEATURE_SHAPE = [1, 16, 8, 8]
MISC_INPUT = [2, 3]


class TupleBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class TwoInputBlock(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y + 1


class ListBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        return [x, x * 3]


class RaiseBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > 0:
            raise RuntimeError("boom from raise_block")
        return x


def log(msg):
    print(msg, flush=True)


def is_up_to_date(out_dir):
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
    models = manifest.get("models")
    if not isinstance(models, dict) or not models:
        return False
    for entry in models.values():
        if not isinstance(entry, dict) or "file" not in entry:
            return False
        if not os.path.isfile(os.path.join(out_dir, entry["file"])):
            return False
    return True


def randomize_bn(bn):
    """Give a BatchNorm non-trivial affine params and running statistics."""
    n = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(n) * 0.5)
        bn.running_var.copy_(torch.rand(n) * 1.5 + 0.25)  # strictly positive
        bn.weight.copy_(1.0 + 0.3 * torch.randn(n))
        bn.bias.copy_(0.2 * torch.randn(n))
    return bn


def make_head(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1),
                         nn.Linear(16, 5))


def make_quantized(seed):
    """Two linear layers with dynamically quantized int8 weights: fbgemm packs them in memory of
    its own (not libtorch's allocator)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(QUANTIZED_WIDTH, 512), nn.ReLU(), nn.Linear(512, QUANTIZED_WIDTH)).eval()
    return torch.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def script(module):
    module.eval()
    scripted = torch.jit.script(module)
    scripted.eval()
    return scripted


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
            json.dump(obj, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, final_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def shape_of(value):
    """Output shape(s) as a list of shapes (one per returned tensor)."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape)]
    return [list(t.shape) for t in value]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="re-export even if the models are up to date")
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    out_dir = args.out

    if not args.force and is_up_to_date(out_dir):
        log("test models up to date in %s" % out_dir)
        return 0

    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    torch.manual_seed(SEED)

    # --- Small CNN split into three blocks ------------------------------------
    block1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                           randomize_bn(nn.BatchNorm2d(8)), nn.ReLU())
    block2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1),
                           randomize_bn(nn.BatchNorm2d(16)), nn.ReLU())
    block3 = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1),
                           nn.Linear(16, 5))
    monolithic = nn.Sequential(block1, block2, block3)
    head_a = make_head(HEAD_A_SEED)
    head_b = make_head(HEAD_B_SEED)

    modules = {
        "cnn_block1": script(block1),
        "cnn_block2": script(block2),
        "cnn_block3": script(block3),
        "cnn_monolithic": script(monolithic),
        "head_a": script(head_a),
        "head_b": script(head_b),
        "tuple_block": script(TupleBlock()),
        "two_input_block": script(TwoInputBlock()),
        "list_block": script(ListBlock()),
        "raise_block": script(RaiseBlock()),
        "quantized_block": script(make_quantized(QUANTIZED_SEED)),
    }

    # --- Verification -----------------------------------------------------------
    ok = True

    def check(cond, msg):
        nonlocal ok
        if not cond:
            log("ERROR: " + msg)
            ok = False

    gen = torch.Generator()
    gen.manual_seed(1234)
    x = torch.randn(*CNN_INPUT, generator=gen)
    feat_in = torch.randn(*FEATURE_SHAPE, generator=gen)
    a = torch.randn(*MISC_INPUT, generator=gen)
    b = torch.randn(*MISC_INPUT, generator=gen)
    inputs = {
        "cnn_block1": [x],
        "cnn_monolithic": [x],
        "head_a": [feat_in],
        "head_b": [feat_in],
        "tuple_block": [a],
        "two_input_block": [a, b],
        "list_block": [a],
        "raise_block": [a],
        "quantized_block": [torch.randn(1, QUANTIZED_WIDTH, generator=gen)],
    }
    outputs = {}
    with torch.no_grad():
        h1 = modules["cnn_block1"](x)
        h2 = modules["cnn_block2"](h1)
        y = modules["cnn_block3"](h2)
        inputs["cnn_block2"] = [h1]
        inputs["cnn_block3"] = [h2]
        outputs["cnn_block1"] = h1
        outputs["cnn_block2"] = h2
        outputs["cnn_block3"] = y
        ref = modules["cnn_monolithic"](x)
        outputs["cnn_monolithic"] = ref
        diff = (y - ref).abs().max().item()
        eager_diff = (monolithic(x) - ref).abs().max().item()
        log("cnn: max|blocks - monolithic| = %.3e (scripted vs eager %.3e), "
            "max|y| = %.4f" % (diff, eager_diff, ref.abs().max().item()))
        check(diff <= TOLERANCE, "cnn blocks != monolithic (%.3e)" % diff)
        check(eager_diff <= TOLERANCE,
              "scripted monolithic != eager (%.3e)" % eager_diff)

        # Freezing (BN folding) must still give the same result.
        frozen = torch.jit.freeze(torch.jit.script(monolithic.eval()))
        frozen_diff = (frozen(x) - ref).abs().max().item()
        log("cnn: max|frozen - unfrozen| = %.3e" % frozen_diff)
        check(frozen_diff <= TOLERANCE,
              "frozen monolithic differs (%.3e)" % frozen_diff)

        outputs["head_a"] = modules["head_a"](feat_in)
        outputs["head_b"] = modules["head_b"](feat_in)
        y3 = modules["cnn_block3"](feat_in)
        check(not torch.allclose(outputs["head_a"], y3)
              and not torch.allclose(outputs["head_b"], y3)
              and not torch.allclose(outputs["head_a"], outputs["head_b"]),
              "heads are not distinct")

        t = modules["tuple_block"](a)
        check(isinstance(t, tuple) and len(t) == 2
              and torch.equal(t[0], a * 2) and torch.equal(t[1], a + 1),
              "tuple_block output wrong")
        outputs["tuple_block"] = t

        t = modules["two_input_block"](a, b)
        check(torch.equal(t, a * b + 1), "two_input_block output wrong")
        outputs["two_input_block"] = t

        t = modules["list_block"](a)
        check(isinstance(t, list) and len(t) == 2
              and torch.equal(t[0], a) and torch.equal(t[1], a * 3),
              "list_block output wrong")
        outputs["list_block"] = t

        outputs["quantized_block"] = modules["quantized_block"](inputs["quantized_block"][0])

        raised = False
        try:
            modules["raise_block"](a)
        except Exception as e:  # torch.jit.Error derives from RuntimeError
            raised = "boom from raise_block" in str(e)
        check(raised, "raise_block did not raise the expected error")

    expected = {
        "cnn_block1": [[1, 8, 16, 16]],
        "cnn_block2": [[1, 16, 8, 8]],
        "cnn_block3": [[1, 5]],
        "cnn_monolithic": [[1, 5]],
        "head_a": [[1, 5]],
        "head_b": [[1, 5]],
        "quantized_block": [[1, QUANTIZED_WIDTH]],
    }
    for name, shape in expected.items():
        got = shape_of(outputs[name])
        check(got == shape, "%s output shape %s, expected %s"
              % (name, got, shape))
    if not ok:
        return 1

    # --- Save -------------------------------------------------------------------
    models = {}
    for name, module in modules.items():
        filename = name + ".pt"
        save_atomic_module(module, out_dir, filename)
        entry = {
            "file": filename,
            "input_shapes": [list(t.shape) for t in inputs[name]],
        }
        if name == "raise_block":
            entry["output_shapes"] = [list(inputs[name][0].shape)]
            entry["raises"] = "boom from raise_block"
        else:
            entry["output_shapes"] = shape_of(outputs[name])
        entry["output_kind"] = {"tuple_block": "tuple",
                                "list_block": "list"}.get(name, "tensor")
        models[name] = entry

    manifest = {
        "models": models,
        "cnn_chain": ["cnn_block1", "cnn_block2", "cnn_block3"],
        "cnn_monolithic": "cnn_monolithic",
        "tolerance": TOLERANCE,
        "torch_version": torch.__version__,
        "seed": SEED,
        "script_version": SCRIPT_VERSION,
    }
    save_atomic_json(manifest, out_dir, "manifest.json")  # manifest last

    for name in list(modules) + ["manifest"]:
        filename = name + (".json" if name == "manifest" else ".pt")
        size = os.path.getsize(os.path.join(out_dir, filename))
        log("  %-22s %8d bytes" % (filename, size))
    log("exported test models to %s in %.2f s"
        % (out_dir, time.perf_counter() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
