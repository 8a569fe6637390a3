#!/usr/bin/python3
"""blockflow-split: cut a model into TorchScript blocks and write a BlockFlow deployment for them.

Usage:
    blockflow-split (MODEL.pt | --torchvision NAME) --input-shape 1,3,224,224
                    (--cuts NAME[,NAME...] | --parts N) --out DIR
                    [--placement threads|workers] [--channel inproc|shm|zmq] [--threads 2]
                    [--seed 0] [--repeats 10] [--depth 3] [--task NAME] [--tolerance 1e-4]
                    [--handoff-us-per-hop US] [--handoff-us-per-mb US]

The model is a TorchScript file or a torchvision model (random weights from --seed, eval mode,
batch-norm statistics calibrated on random inputs so that activations stay in range). Its forward is
turned into a torch.fx graph (a TorchScript file: the calls its top-level forward makes to its child
modules; a torchvision model: traced down to torch.nn's layers). A cut point is the start of a
module (named by its path, `layer3`, `encoder.layers.encoder_layer_6`) where exactly one tensor is
live: everything after it needs only that tensor. A cut elsewhere, or a model with no such point (a
top level that is not a sequence), is refused with the list of the valid cut points.

--cuts puts the part boundaries before the named modules. --parts N profiles the stages between
the candidate cut points (modules up to --depth levels deep, never separating a convolution or
linear layer from its batch norm or activation) on this CPU with --threads intra-op threads: each
stage's TorchScript is loaded, frozen and optimized as the C++ loader does and timed on the example
input. A dynamic program then picks the N - 1 cuts that minimise the slowest part's latency plus its
hand-off (per hop + output MB x per MB; defaults per channel from the hop benchmark: inproc 0.4 us
per hop, shm 4 us per hop + 1.2 us per MB, zmq-ipc 60 us per hop + 240 us per MB).

Writes to DIR: part1.pt..partN.pt (scripted, or traced where scripting fails; saved unfrozen, eval
mode), deployment.json (one chain task; --placement workers puts part k in worker wk, whose channel
is the session's WorkerOptions::channel: the deployment format has no field for it) and report.json
(per part latency, output MB, parameters MB, load ms). The chained parts are checked against the
whole model on the example input: exit 1 when the max abs difference exceeds --tolerance, 2 on a
refusal.
"""

import argparse
import collections
import dis
import inspect
import io
import json
import operator
import os
import re
import sys
import time
import warnings

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

# Hand-off cost per channel: (us per hop, us per MB), from the hop benchmark's lines in README.md.
CHANNEL_COSTS = {"inproc": (0.4, 0.0), "shm": (4.0, 1.2), "zmq": (60.0, 240.0)}
# Freezing fuses these with the layer before them: a cut between the two would undo that.
FUSED_AFTER = {"Conv1d", "Conv2d", "Conv3d", "Linear", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}
FUSED_INTO = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "ReLU", "ReLU6", "Hardswish", "Hardsigmoid",
              "SiLU", "GELU", "Sigmoid", "Tanh", "LeakyReLU"}
CALIBRATION_PASSES, CALIBRATION_BATCH = 2, 4
# TorchScript's profiling executor settles after two runs (the C++ side's warmup_runs is 2 too); timed
# runs stop after --repeats, or once they have taken MEASURE_BUDGET_S with at least 3 done.
WARMUP_RUNS, MEASURE_BUDGET_S = 3, 5.0


class SplitError(Exception):
    """A model or a request the tool refuses; the message says what to give it instead."""


# --- From a model to an fx graph whose nodes know the modules they run in ---------------------------


def _unpack(proxy):
    """Proxy.__iter__ for Python 3.11: torch 1.13 finds the UNPACK_SEQUENCE by an index that 3.11's
    inline caches shifted, so `n, c, h, w = x.shape` fails to trace. Look it up by byte offset."""
    frame = inspect.currentframe().f_back
    for inst in dis.get_instructions(frame.f_code):
        if inst.offset == frame.f_lasti and inst.opname == "UNPACK_SEQUENCE":
            return (proxy[i] for i in range(inst.argval))
    return proxy.tracer.iter(proxy)


class _Proxy(fx.Proxy):
    __iter__ = _unpack

    def __getattr__(self, name):
        return _Attribute(self, name)


class _Attribute(fx.proxy.Attribute):
    __iter__ = _unpack


class _ScopeTracer(fx.Tracer):
    """Traces down to torch.nn's layers; each node's meta["scope"] lists the modules it runs in,
    outermost first."""

    def __init__(self):
        super().__init__()
        self.scope = []

    def proxy(self, node):
        return _Proxy(node, self)

    def call_module(self, module, forward, args, kwargs):
        self.scope.append(self.path_of_module(module))
        try:
            return super().call_module(module, forward, args, kwargs)
        finally:
            self.scope.pop()

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        node.meta["scope"] = tuple(self.scope)
        return node


def trace_module(model):
    """An nn.Module as an fx GraphModule (scopes in node.meta["scope"])."""
    try:
        return fx.GraphModule(model, _ScopeTracer().trace(model))
    except Exception as e:  # fx names what it could not trace (control flow on values, ...)
        raise SplitError("torch.fx cannot trace the model: %s" % str(e).splitlines()[0])


# A TorchScript value that is a module: its path from the top level.
_ModuleRef = collections.namedtuple("_ModuleRef", "path")


def graph_from_torchscript(module):
    """A ScriptModule's forward as an fx GraphModule: one call_module node per call of a child's
    forward, its other operations as torch.ops calls. Methods of the top level (ResNet's
    _forward_impl) are followed; control flow is refused."""
    graph, attrs = fx.Graph(), {}

    def resolve(path):
        obj = module
        for name in filter(None, path.split(".")):
            obj = getattr(obj, name)
        return obj

    def op_call(node, values):
        ns, name = node.kind().split("::")
        schema = node.schema()
        if schema == "(no schema)":
            raise SplitError("the TorchScript forward uses %s, which blockflow-split cannot copy" % node.kind())
        args = torch._C.parse_schema(schema).arguments
        positional = tuple(v for a, v in zip(args, values) if not a.kwarg_only)
        keywords = {a.name: v for a, v in zip(args, values) if a.kwarg_only}
        return graph.call_function(getattr(getattr(torch.ops, ns), name), positional, keywords)

    def translate(ts_graph, self_path, args):
        inputs = list(ts_graph.inputs())
        env = {inputs[0].unique(): _ModuleRef(self_path)}
        env.update({v.unique(): a for v, a in zip(inputs[1:], args)})
        for node in ts_graph.nodes():
            kind, outputs = node.kind(), list(node.outputs())
            values = [env[v.unique()] for v in node.inputs()]
            if kind == "prim::Constant":
                value = outputs[0].toIValue()
                if isinstance(value, torch.Tensor):
                    name = "_constant%d" % len(attrs)
                    attrs[name] = value
                    value = graph.get_attr(name)
                results = [value]
            elif kind == "prim::GetAttr":
                path = ".".join(filter(None, [values[0].path, node.s("name")]))
                obj = resolve(path)
                if isinstance(obj, torch.nn.Module):
                    results = [_ModuleRef(path)]
                elif isinstance(obj, torch.Tensor):
                    attrs[path] = obj
                    results = [graph.get_attr(path)]
                else:
                    results = [obj]
            elif kind == "prim::CallMethod":
                ref, method = values[0], node.s("name")
                if method == "forward" and ref.path != self_path:
                    attrs[ref.path] = resolve(ref.path)
                    results = [graph.call_module(ref.path, tuple(values[1:]))]
                elif ref.path == self_path:
                    results = translate(getattr(resolve(ref.path), method).graph, ref.path, values[1:])
                else:
                    raise SplitError("the TorchScript forward calls %s.%s(); only children's forward() can be "
                                     "copied" % (ref.path, method))
            elif kind in ("prim::ListConstruct", "prim::TupleConstruct"):
                results = [list(values) if kind == "prim::ListConstruct" else tuple(values)]
            elif kind in ("prim::ListUnpack", "prim::TupleUnpack"):
                seq = values[0]
                results = [seq[i] if isinstance(seq, (list, tuple)) else graph.call_function(operator.getitem, (seq, i))
                           for i in range(len(outputs))]
            elif kind in ("prim::If", "prim::Loop") or not kind.startswith(("aten::", "prim::")):
                raise SplitError("the TorchScript forward has %s: blockflow-split cuts a straight sequence of "
                                 "calls (move the branch or loop into a child module)" % kind)
            else:
                call = op_call(node, values)
                results = [call] if len(outputs) == 1 else [graph.call_function(operator.getitem, (call, i))
                                                            for i in range(len(outputs))]
            env.update({v.unique(): r for v, r in zip(outputs, results)})
        return [env[v.unique()] for v in ts_graph.outputs()]

    inputs = list(module.graph.inputs())[1:]
    if len(inputs) != 1:
        raise SplitError("the model's forward takes %d inputs; blockflow-split cuts models of one tensor" % len(inputs))
    (out,) = translate(module.graph, "", [graph.placeholder("x")])
    graph.output(out)
    for node in graph.nodes:
        node.meta["scope"] = (node.target,) if node.op == "call_module" else ()
    return fx.GraphModule(attrs, graph)


def calibrate_batchnorm(model, shape, seed):
    """Recomputes batch-norm running statistics from random inputs (cumulative average), as
    scripts/export_models.py does, so that random weights give activations in a sane range."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.momentum = None
        m.reset_running_stats()
    if norms:
        model.train()
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for _ in range(CALIBRATION_PASSES):
                model(torch.randn(CALIBRATION_BATCH, *shape[1:], generator=generator))
    return model.eval()


def load_model(source, torchvision_name, shape, seed):
    """(name, reference module, GraphModule) for a TorchScript file or a torchvision model name."""
    if torchvision_name:
        import torchvision
        if torchvision_name not in torchvision.models.list_models():
            raise SplitError("unknown torchvision model '%s' (e.g. resnet50, mobilenet_v3_large, vit_b_16)"
                             % torchvision_name)
        torch.manual_seed(seed)
        model = calibrate_batchnorm(torchvision.models.get_model(torchvision_name, weights=None), shape, seed)
        return torchvision_name, model, trace_module(model)
    try:
        model = torch.jit.load(source).eval()
    except Exception as e:
        raise SplitError("cannot load TorchScript file '%s': %s" % (source, str(e).splitlines()[0]))
    name = os.path.splitext(os.path.basename(source))[0]
    return name, model, graph_from_torchscript(model)


# --- Cut points --------------------------------------------------------------------------------------


def _tensor_bytes(meta):
    return meta.shape.numel() * torch.empty((), dtype=meta.dtype).element_size()


class Splitter:
    """A model's fx graph, the values live at each point of its forward, and its parts.

    body: the nodes that compute, in forward order (placeholders, get_attr and the output left out:
    parameters are copied into every part that uses them). Position i cuts between body[i - 1] and
    body[i]."""

    def __init__(self, gm, example):
        self.gm = gm.eval()
        with torch.no_grad():
            ShapeProp(self.gm).propagate(example)
        nodes = list(self.gm.graph.nodes)
        self.inputs = [n for n in nodes if n.op == "placeholder"]
        self.output = nodes[-1]
        self.body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
        index = {n: i for i, n in enumerate(self.body)}
        index.update({n: -1 for n in self.inputs})
        last_use = {n: max((index.get(u, len(self.body)) for u in n.users), default=-1) for n in index}
        self.live = [[n for n in self.inputs + self.body[:i] if last_use[n] >= i] for i in range(len(self.body) + 1)]
        self.starts = {}  # module path -> position of its first node
        for i, node in enumerate(self.body):
            for path in node.meta.get("scope", ()):
                self.starts.setdefault(path, i)

    def live_tensor(self, i):
        """The one tensor live at position i, or None."""
        live = self.live[i]
        ok = len(live) == 1 and isinstance(live[0].meta.get("tensor_meta"), TensorMetadata)
        return live[0] if ok else None

    def name_at(self, i):
        """The outermost module that starts at position i."""
        return min((p for p, s in self.starts.items() if s == i), key=lambda p: (p.count("."), p))

    def first_module(self, start, end):
        """The outermost module that starts first in body[start:end] ("-" if none does)."""
        first = min((s for s in self.starts.values() if start <= s < end), default=None)
        return "-" if first is None else self.name_at(first)

    def _module_type(self, node):
        if node.op != "call_module":
            return None
        module = self.gm.get_submodule(node.target)
        return getattr(module, "original_name", type(module).__name__)

    def candidates(self, depth):
        """Positions offered for automatic cuts: valid module starts at most `depth` levels deep
        that do not separate a layer from what freezing fuses into it."""
        out = set()
        for path, i in self.starts.items():
            if (0 < i and path.count(".") < depth and self.live_tensor(i) is not None
                    and not (self._module_type(self.body[i - 1]) in FUSED_AFTER
                             and self._module_type(self.body[i]) in FUSED_INTO)):
                out.add(i)
        return sorted(out)

    def valid_names(self, depth):
        names = [self.name_at(i) for i in self.candidates(depth)]
        return ", ".join(names) if names else "none"

    def resolve(self, names, depth):
        """Positions of explicit cuts, in forward order; refuses unknown or invalid ones."""
        positions = {}
        for name in names:
            if name not in self.starts:
                raise SplitError("unknown cut '%s': no module of that name in the model; valid cut points: %s"
                                 % (name, self.valid_names(depth)))
            i = self.starts[name]
            if i == 0:
                raise SplitError("cut '%s' is at the start of the model; valid cut points: %s"
                                 % (name, self.valid_names(depth)))
            if self.live_tensor(i) is None:
                live = self.live[i]
                raise SplitError("cut '%s' is not valid: %d values are live there (%s), a cut needs exactly one "
                                 "tensor; valid cut points: %s" % (name, len(live), ", ".join(n.name for n in live),
                                                                    self.valid_names(depth)))
            if i in positions:
                raise SplitError("cuts '%s' and '%s' are the same point" % (positions[i], name))
            positions[i] = name
        return sorted(positions)

    def part(self, start, end):
        """body[start:end] as a GraphModule in eval mode: the tensor live at `start` in (the model's
        input for start 0), the one live at `end` out (the model's output at the end)."""
        graph, env = fx.Graph(), {}

        def arg(node):
            if node not in env:  # a parameter or buffer, copied where it is used
                env[node] = graph.node_copy(node)
            return env[node]

        for node in self.inputs if start == 0 else [self.live_tensor(start)]:
            env[node] = graph.placeholder(node.name)
        for node in self.body[start:end]:
            env[node] = graph.node_copy(node, arg)
        graph.output(fx.node.map_arg(self.output.args[0], arg) if end == len(self.body) else arg(self.live_tensor(end)))
        return fx.GraphModule(self.gm, graph).eval()

    def output_bytes(self, end):
        if end < len(self.body):
            return _tensor_bytes(self.live_tensor(end).meta["tensor_meta"])
        meta = self.output.args[0].meta.get("tensor_meta") if isinstance(self.output.args[0], fx.Node) else None
        return _tensor_bytes(meta) if isinstance(meta, TensorMetadata) else 0


# --- Export, measurement, choice of cuts ----------------------------------------------------------------


def export(part, example):
    """(TorchScript module, "script" or "trace"): scripted where TorchScript can compile the part's
    code, traced on the example input otherwise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.jit.script(part), "script"
        except Exception:
            return torch.jit.trace(part, example), "trace"


def measure(saved, example, repeats):
    """(load ms, median forward ms) of a saved TorchScript module (a path or a buffer), loaded,
    frozen and optimized for inference as the C++ loader does."""
    start = time.perf_counter()
    module = torch.jit.optimize_for_inference(torch.jit.load(saved).eval())
    load_ms = (time.perf_counter() - start) * 1e3
    times = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 1.13's optimized MobileNets warn of resized outputs
        for _ in range(WARMUP_RUNS):
            module(example)
        while len(times) < repeats and (len(times) < 3 or sum(times) < MEASURE_BUDGET_S * 1e3):
            start = time.perf_counter()
            module(example)
            times.append((time.perf_counter() - start) * 1e3)
    return load_ms, sorted(times)[len(times) // 2]


def _parameter_bytes(module):
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def profile_stages(splitter, bounds, example, repeats):
    """Per stage between consecutive bounds: {"name", "latency_ms", "output_bytes", "load_ms"}."""
    stages, x = [], example
    for start, end in zip(bounds, bounds[1:]):
        part = splitter.part(start, end)
        load_ms, latency_ms = measure(io.BytesIO(export(part, x)[0].save_to_buffer()), x, repeats)
        stages.append({"name": splitter.first_module(start, end), "latency_ms": latency_ms,
                       "output_bytes": splitter.output_bytes(end), "load_ms": load_ms})
        with torch.no_grad():
            x = part(x)
    return stages


def choose_cuts(stages, parts, hop_us, us_per_mb):
    """Indices (1..len(stages)-1) of the stages that start parts 2..N, minimising the slowest part's
    latency plus its output's hand-off; and that bottleneck, in ms."""
    m = len(stages)

    def cost(a, b):  # stages a..b-1 as one part
        handoff = 0.0 if b == m else (hop_us + stages[b - 1]["output_bytes"] / 1e6 * us_per_mb) / 1e3
        return sum(s["latency_ms"] for s in stages[a:b]) + handoff

    # best[b]: (bottleneck, first stages of parts 2..k) for the first b stages cut into k parts.
    best = {b: (cost(0, b), []) for b in range(1, m + 1)}
    for k in range(2, parts + 1):
        best = {b: min((max(best[a][0], cost(a, b)), best[a][1] + [a]) for a in range(k - 1, b))
                for b in range(k, m + 1)}
    return best[m][1], best[m][0]


def _flat(value):
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _flat(v)]


def max_abs_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(_flat(a), _flat(b)))


def write_parts(splitter, positions, reference, example, out_dir, repeats):
    """Exports the parts cut at `positions` as DIR/part<k>.pt, measures each, and compares the
    chained saved parts with `reference` on the example. Returns (part reports, max abs diff)."""
    os.makedirs(out_dir, exist_ok=True)
    bounds = [0] + list(positions) + [len(splitter.body)]
    reports, x, y = [], example, example
    for k, (start, end) in enumerate(zip(bounds, bounds[1:]), 1):
        part = splitter.part(start, end)
        scripted, method = export(part, x)
        path = os.path.join(out_dir, "part%d.pt" % k)
        scripted.save(path)
        load_ms, latency_ms = measure(path, x, repeats)
        with torch.no_grad():
            x_next, y = part(x), torch.jit.load(path)(y)
        reports.append({"name": "part%d" % k, "file": os.path.basename(path), "export": method,
                        "first_module": splitter.first_module(start, end),
                        "input_shape": list(x.shape), "output_shape": [list(t.shape) for t in _flat(x_next)],
                        "latency_ms": round(latency_ms, 3), "output_mb": round(splitter.output_bytes(end) / 1e6, 6),
                        "params_mb": round(_parameter_bytes(part) / 1e6, 3), "load_ms": round(load_ms, 1)})
        x = x_next
    with torch.no_grad():
        expected = reference(example)
    return reports, max_abs_diff(y, expected)


def measure_whole(splitter, example, repeats):
    """The uncut model exported and measured as a part is: (load ms, latency ms)."""
    whole = export(splitter.part(0, len(splitter.body)), example)[0]
    return measure(io.BytesIO(whole.save_to_buffer()), example, repeats)


def deployment(parts, task, placement):
    """A BlockFlow deployment (lib/deploy/deployment.cpp's format) of one chain task over the parts;
    with workers, part k runs in worker wk. The batch dimension of a scripted part is left free."""
    blocks = []
    for k, part in enumerate(parts, 1):
        shape = list(part["input_shape"])
        if part["export"] == "script":
            shape[0] = -1
        block = {"name": part["name"], "torchscript": part["file"], "input_shapes": [shape]}
        if placement == "workers":
            block["placement"] = "w%d" % k
        blocks.append(block)
    return {"blocks": blocks, "tasks": {task: [p["name"] for p in parts]}}


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (figures are compared only on the same CPU)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def task_name(name):
    """`name` made to follow the rule of include/blockflow/core/names.hpp."""
    return (re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".-") or "model")[:64]


# --- Command line -----------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="blockflow-split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="a TorchScript file")
    src.add_argument("--torchvision", metavar="NAME", help="a torchvision model, random weights (resnet50, ...)")
    p.add_argument("--input-shape", required=True, help="example input shape, e.g. 1,3,224,224")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--cuts", help="module names to cut before, comma-separated (layer2,layer4)")
    how.add_argument("--parts", type=int, help="number of parts; cuts chosen from a profile")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--placement", choices=["threads", "workers"], default="threads")
    p.add_argument("--channel", choices=sorted(CHANNEL_COSTS), help="hand-off cost model (default: inproc for "
                   "threads, shm for workers)")
    p.add_argument("--handoff-us-per-hop", type=float, help="override the channel's cost per hand-off")
    p.add_argument("--handoff-us-per-mb", type=float, help="override the channel's cost per MB handed off")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for profiling (default 2)")
    p.add_argument("--seed", type=int, default=0, help="weights and example input seed (default 0)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (default 10)")
    p.add_argument("--depth", type=int, default=3, help="deepest module level offered for --parts (default 3)")
    p.add_argument("--task", help="task name in the deployment (default: the model's name)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs difference allowed (default 1e-4)")
    args = p.parse_args(argv)
    try:
        args.shape = [int(d) for d in args.input_shape.split(",")]
    except ValueError:
        p.error("--input-shape: comma-separated integers, e.g. 1,3,224,224")
    if (args.parts is not None and args.parts < 1) or args.repeats < 1:
        p.error("--parts and --repeats must be at least 1")
    args.channel = args.channel or ("shm" if args.placement == "workers" else "inproc")
    hop_us, us_per_mb = CHANNEL_COSTS[args.channel]
    args.hop_us = hop_us if args.handoff_us_per_hop is None else args.handoff_us_per_hop
    args.us_per_mb = us_per_mb if args.handoff_us_per_mb is None else args.handoff_us_per_mb
    return args


def plan(name, splitter, args, example):
    """(cut positions, extra report fields) for --cuts or --parts."""
    if args.cuts is not None:
        return splitter.resolve([c for c in args.cuts.split(",") if c], args.depth), {}
    candidates = splitter.candidates(args.depth)
    if args.parts > 1 and not any(i > 0 and splitter.live_tensor(i) is not None for i in splitter.starts.values()):
        raise SplitError("model '%s' cannot be cut: no module starts where exactly one tensor is live (its top level "
                         "is not a sequence of modules); valid cut points: none" % name)
    if args.parts > len(candidates) + 1:
        raise SplitError("--parts %d: the model has %d valid cut points, so at most %d parts (valid cut points: %s)"
                         % (args.parts, len(candidates), len(candidates) + 1, splitter.valid_names(args.depth)))
    bounds = [0] + candidates + [len(splitter.body)]
    stages = profile_stages(splitter, bounds, example, args.repeats)
    chosen, bottleneck = choose_cuts(stages, args.parts, args.hop_us, args.us_per_mb)
    return [bounds[i] for i in chosen], {"predicted_bottleneck_ms": round(bottleneck, 3), "stages": [
        {"name": s["name"], "latency_ms": round(s["latency_ms"], 3), "load_ms": round(s["load_ms"], 1),
         "output_mb": round(s["output_bytes"] / 1e6, 6)} for s in stages]}


def print_report(report, out_dir):
    print("blockflow-split: %s in %d parts, cut before %s (%s, %d threads, %s)"
          % (report["model"], len(report["parts"]), ", ".join(report["cuts"]) or "nothing",
             report["placement"], report["threads"], report["cpu"]))
    print("%-7s %-34s %10s %10s %10s %9s  %s" % ("part", "from", "latency ms", "output MB", "params MB",
                                               "load ms", "input shape"))
    for p in report["parts"]:
        print("%-7s %-34s %10.2f %10.3f %10.2f %9.1f  %s" % (p["name"], p["first_module"], p["latency_ms"],
                                                            p["output_mb"], p["params_mb"], p["load_ms"],
                                                            p["input_shape"]))
    print("whole model %.2f ms, slowest part %.2f ms (%.2f of it)"
          % (report["whole_ms"], report["slowest_part_ms"], report["slowest_over_whole"]))
    print("chained parts vs whole model: max abs diff %.3e (tolerance %.0e): %s"
          % (report["max_abs_diff"], report["tolerance"], "PASS" if report["equal"] else "FAIL"))
    print("wrote %s, deployment.json, report.json in %s" % (", ".join(p["file"] for p in report["parts"]), out_dir))
    if report["placement"] == "workers" and report["channel"] != "shm":
        print("note: run the workers with WorkerOptions::channel = \"%s\" (deployments do not name channels)"
              % report["channel"])


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        name, reference, gm = load_model(args.model, args.torchvision, args.shape, args.seed)
        example = torch.randn(*args.shape, generator=torch.Generator().manual_seed(args.seed))
        splitter = Splitter(gm, example)
        positions, extra = plan(name, splitter, args, example)
    except SplitError as e:
        print("blockflow-split: %s" % e, file=sys.stderr)
        return 2
    parts, diff = write_parts(splitter, positions, reference, example, args.out, args.repeats)
    whole_load_ms, whole_ms = measure_whole(splitter, example, args.repeats)
    slowest = max(p["latency_ms"] for p in parts)
    report = {"model": name, "input_shape": args.shape, "cuts": [splitter.name_at(i) for i in positions],
              "placement": args.placement, "channel": args.channel, "threads": args.threads, "cpu": cpu_model(),
              "handoff_us_per_hop": args.hop_us, "handoff_us_per_mb": args.us_per_mb,
              "whole_ms": round(whole_ms, 3), "whole_load_ms": round(whole_load_ms, 1), "slowest_part_ms": slowest,
              "slowest_over_whole": round(slowest / whole_ms, 4), "max_abs_diff": diff, "tolerance": args.tolerance,
              "equal": diff <= args.tolerance, "parts": parts, **extra}
    for filename, document in (("deployment.json", deployment(parts, task_name(args.task or name), args.placement)),
                               ("report.json", report)):
        with open(os.path.join(args.out, filename), "w") as f:
            f.write(json.dumps(document, indent=2) + "\n")
    print_report(report, args.out)
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
