#!/usr/bin/python3
"""Turns BlockFlow benchmark output into PNG figures and a markdown page that links them.

    scripts/plot.py [--out DIR] FILE...

Each FILE is read for JSON objects: one per line (what scripts/bench.sh and the load generator
print; lines that are not JSON, such as log lines, are ignored) and metrics snapshots
(Session::metrics().to_json(), a possibly indented object with "blocks", as pipeline_bench writes
to stderr with BENCH_METRICS=1). A snapshot's channel is its "channel" key, else the file name
metrics-<channel>.json, else its sites' data channel ("inproc" when every block runs in threads).

Written into DIR (default bench-report), each only when its data are present (otherwise a note
is printed and the figure is left out):

  breakdown.png   mean wait / compute / overhead per block, stacked, one group per channel, from
                  snapshots; without one, from {"bench":"pipeline"} lines: the split pipeline's
                  e2e p50 (less the overhead p50) and overhead p50 against the monolithic p50.
  hop.png         {"bench":"hop"}: p50 latency against tensor bytes per channel (log-log, p50-p99
                  band), one memcpy of the same bytes dashed.
  batch.png       {"bench":"batch"}: p50 and p99 latency against batch size.
  throughput.png  {"bench":"loadgen"}: throughput against offered rate with y = x, the saturation
                  point (the first offered rate whose throughput is below 95% of it) marked;
                  below it, p50/p99 latency against offered rate.
  memory.png      {"bench":"loadgen"} lines with "rss_mb": resident memory against offered rate.
  index.md        links the figures and lists the lines and snapshots they were drawn from.

Formats of the lines (bench.sh's own are described in its header and in README.md "Figures"):

  {"bench":"hop","channel":"shm","bytes":3211264,"p50_us":..,"p99_us":..,"memcpy_us":..}
  {"bench":"pipeline","mode":"workers","channel":"shm","e2e_p50_ms":..,"monolithic_p50_ms":..,
   "overhead_p50_ms":..}
  {"bench":"worker_memory","rss_idle_mb":..,"rss_loaded_mb":..}   (listed in index.md only)
  Load generator, one line per offered rate of a sweep:
  {"bench":"loadgen","rate_per_s":R,"throughput_per_s":T,"p50_ms":..,"p99_ms":..,"rss_mb":M}
    rate_per_s: requests per second offered (open loop); throughput_per_s: completed requests
    per second; p50_ms/p99_ms: end-to-end latency of the completed requests; rss_mb: resident
    memory of the serving processes (host and workers, summed) at the end of the step, MiB.
  Batch sweep, one line per batch size:
  {"bench":"batch","batch":B,"p50_ms":..,"p99_ms":..}
    latency of one batched request of B samples, ms.
  Optional keys in any line: "series" (else "channel") names the curve a line belongs to;
  "note" is shown in index.md.

Uses only the standard library and Debian's python3-matplotlib (Agg backend, no display).
"""

import argparse
import json
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

FIGURES = ("breakdown.png", "hop.png", "batch.png", "throughput.png", "memory.png")
CHANNEL_ORDER = ("inproc", "shm", "shm-copy", "zmq-ipc", "zmq", "zmq-tcp", "cuda")
SATURATION = 0.95  # saturated: throughput below this fraction of the offered rate
DPI = 120
PARTS = (("wait", "#8fbbd9"), ("compute", "#2f6f9f"), ("overhead", "#e07b39"))


# ---------------------------------------------------------------------------------------------
# Reading


def read_objects(text):
    """Yields (object, its text) for the JSON objects in text: one per line, or spread over
    several lines (an indented snapshot). Lines that do not start a JSON object are skipped."""
    decoder = json.JSONDecoder()
    lines = text.splitlines(keepends=True)
    offsets = []
    pos = 0
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if not stripped.startswith("{"):
            i += 1
            continue
        start = offsets[i] + (len(lines[i]) - len(stripped))
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            i += 1
            continue
        if isinstance(obj, dict):
            yield obj, text[start:end]
        while i < len(lines) and offsets[i] < end:  # skip the lines the object spans
            i += 1


def snapshot_channel(snapshot, path):
    if isinstance(snapshot.get("channel"), str) and snapshot["channel"]:
        return snapshot["channel"]
    m = re.match(r"metrics-(.+)\.json$", os.path.basename(path))
    if m:
        return m.group(1)
    kinds = {s.get("data", {}).get("kind") for s in snapshot.get("sites", []) if s.get("data", {}).get("kind")}
    if len(kinds) == 1:
        kind = kinds.pop()
        return "zmq-ipc" if kind == "zmq" else kind
    if all(b.get("placement", "threads") == "threads" for b in snapshot.get("blocks", [])):
        return "inproc"
    return os.path.splitext(os.path.basename(path))[0]


def load(paths):
    records, snapshots = [], []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for obj, raw in read_objects(text):
            if isinstance(obj.get("blocks"), list):
                snapshots.append({"channel": snapshot_channel(obj, path), "source": path, "data": obj})
            elif isinstance(obj.get("bench"), str):
                records.append({"source": path, "data": obj, "raw": " ".join(raw.split())})
    return records, snapshots


# ---------------------------------------------------------------------------------------------
# Helpers


def channel_key(name):
    return (CHANNEL_ORDER.index(name), "") if name in CHANNEL_ORDER else (len(CHANNEL_ORDER), str(name))


def series_of(line):
    return str(line.get("series") or line.get("channel") or "")


def group(lines, key):
    out = {}
    for line in lines:
        out.setdefault(key(line), []).append(line)
    return {k: out[k] for k in sorted(out, key=channel_key)}


def colour(name, names):
    """The same channel keeps its colour in every figure."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if name in CHANNEL_ORDER:
        return cycle[CHANNEL_ORDER.index(name) % len(cycle)]
    return cycle[(len(CHANNEL_ORDER) + list(names).index(name)) % len(cycle)]


def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def human_bytes(n, _pos=None):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def noted(title, items):
    """Says in the title when some of the data carry a "note" (estimated or synthetic values)."""
    if any(isinstance(d, dict) and d.get("note") for d in items):
        return title + "\n(includes data marked with a \"note\": estimated or synthetic values, see index.md)"
    return title


def fmt(v):
    return f"{v:.3g}" if number(v) else str(v)


def saturation_point(points):
    """points: (offered rate, throughput), any order. The first offered rate (ascending) whose
    throughput is below SATURATION times it, as (rate, throughput), or None."""
    for rate, thr in sorted(points):
        if rate > 0 and thr < SATURATION * rate:
            return rate, thr
    return None


def save(fig, out_dir, name, written):
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    written.append(path)


# ---------------------------------------------------------------------------------------------
# Figures. Each returns a short markdown description, or None with a reason when not drawn.


def plot_breakdown(records, snapshots, out_dir, written):
    if snapshots:
        by_channel = {}
        for s in snapshots:  # a later snapshot of the same channel replaces an earlier one
            by_channel[s["channel"]] = s
        channels = sorted(by_channel, key=channel_key)
        fig, ax = plt.subplots(figsize=(max(7.0, 1.0 + 0.75 * sum(len(by_channel[c]["data"]["blocks"]) for c in channels)), 5.2))
        x, ticks, labels, centres = 0.0, [], [], []
        for c in channels:
            blocks = by_channel[c]["data"]["blocks"]
            first = x
            for b in blocks:
                bottom = 0.0
                for part, col in PARTS:
                    v = (b.get(part) or {}).get("mean_ms", 0.0) or 0.0
                    ax.bar(x, v, 0.8, bottom=bottom, color=col, edgecolor="white", linewidth=0.5,
                           label=f"{part}" if not ticks else None)
                    bottom += v
                ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
                ticks.append(x)
                placement = b.get("placement", "")
                labels.append(f"{b.get('name', '?')}\n{placement}" if placement else b.get("name", "?"))
                x += 1.0
            centres.append(((first + x - 1.0) / 2.0, c))
            x += 0.8  # gap between channels
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=8)
        for centre, c in centres:
            ax.annotate(f"channel: {c}", xy=(centre, 0), xycoords=("data", "axes fraction"), xytext=(0, -34),
                        textcoords="offset points", ha="center", va="top", fontsize=10, fontweight="bold")
        ax.set_ylabel("mean time per request (ms)")
        ax.set_title(noted("Per-block breakdown: wait, compute, overhead (metrics snapshot, mean)",
                           [by_channel[c]["data"] for c in channels]))
        ax.legend(title="part", loc="upper left")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        save(fig, out_dir, "breakdown.png", written)
        return ("Mean wait (queued at the block), compute (`forward()`) and overhead (the rest of the "
                "hop) per request for each block, from metrics snapshots; under each block its placement "
                "(`threads` or the worker). Means add up: a path's blocks sum to its mean e2e time.")

    for r in records:  # lines since compute lanes name the baseline in a clean process monolithic_alone_p50_ms
        if r["data"].get("bench") == "pipeline" and "monolithic_alone_p50_ms" in r["data"]:
            r["data"].setdefault("monolithic_p50_ms", r["data"]["monolithic_alone_p50_ms"])
    pipeline = [r["data"] for r in records if r["data"]["bench"] == "pipeline"
                and all(number(r["data"].get(k)) for k in ("e2e_p50_ms", "monolithic_p50_ms", "overhead_p50_ms"))]
    if not pipeline:
        return None, "no metrics snapshot and no {\"bench\":\"pipeline\"} lines"
    by_channel = group(pipeline, lambda d: str(d.get("channel", "?")))
    channels = list(by_channel)
    fig, ax = plt.subplots(figsize=(max(8.0, 2.2 * len(channels)), 5.2))
    for i, c in enumerate(channels):
        d = by_channel[c][-1]
        blocks = max(0.0, d["e2e_p50_ms"] - d["overhead_p50_ms"])
        ax.bar(i - 0.2, blocks, 0.38, color=PARTS[1][1], label="split: e2e p50 - overhead p50" if i == 0 else None)
        ax.bar(i - 0.2, d["overhead_p50_ms"], 0.38, bottom=blocks, color=PARTS[2][1],
               label="split: overhead p50" if i == 0 else None)
        ax.bar(i + 0.2, d["monolithic_p50_ms"], 0.38, color="#9a9a9a", label="monolithic p50" if i == 0 else None)
        ax.text(i - 0.2, d["e2e_p50_ms"], f"{d['e2e_p50_ms']:.1f}", ha="center", va="bottom", fontsize=8)
        ax.text(i + 0.2, d["monolithic_p50_ms"], f"{d['monolithic_p50_ms']:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(channels)))
    ax.set_xticklabels([f"{c}\n({by_channel[c][-1].get('mode', '')})" for c in channels])
    ax.set_xlabel("channel (mode)")
    ax.set_ylabel("latency p50 (ms)")
    ax.set_title(noted("Split pipeline against the monolithic model (no metrics snapshot: pipeline lines)", pipeline))
    top = max(max(d["e2e_p50_ms"], d["monolithic_p50_ms"]) for d in pipeline)
    ax.set_ylim(0, top * 1.3)
    ax.legend(loc="upper center", ncol=3, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    save(fig, out_dir, "breakdown.png", written)
    return ("No metrics snapshot was given, so this is drawn from the `pipeline` lines: the split "
            "pipeline's e2e p50 (less its overhead p50) with its overhead p50 on top, against the "
            "monolithic model's forward p50, per channel.")


def plot_hop(records, out_dir, written):
    hops = [r["data"] for r in records if r["data"]["bench"] == "hop"
            and number(r["data"].get("bytes")) and number(r["data"].get("p50_us"))]
    if not hops:
        return None, "no {\"bench\":\"hop\"} lines"
    by_channel = group(hops, lambda d: str(d.get("channel", "?")))
    fig, ax = plt.subplots(figsize=(8, 5.2))
    sizes = sorted({d["bytes"] for d in hops})
    for c, lines in by_channel.items():
        lines = sorted(lines, key=lambda d: d["bytes"])
        xs = [d["bytes"] for d in lines]
        col = colour(c, by_channel)
        ax.plot(xs, [d["p50_us"] for d in lines], marker="o", color=col, label=f"{c} p50")
        if all(number(d.get("p99_us")) for d in lines) and len(lines) > 1:
            ax.fill_between(xs, [d["p50_us"] for d in lines], [d["p99_us"] for d in lines], color=col, alpha=0.12,
                            linewidth=0)
        elif all(number(d.get("p99_us")) for d in lines):
            ax.errorbar(xs, [d["p50_us"] for d in lines], yerr=[[0] * len(lines), [d["p99_us"] - d["p50_us"] for d in lines]],
                        fmt="none", ecolor=col, alpha=0.5, capsize=3)
    memcpy = {}
    for d in hops:
        if number(d.get("memcpy_us")) and d["memcpy_us"] > 0:
            memcpy.setdefault(d["bytes"], []).append(d["memcpy_us"])
    if memcpy:
        xs = sorted(memcpy)
        ys = [sorted(memcpy[b])[len(memcpy[b]) // 2] for b in xs]  # median over the channels' runs
        ax.plot(xs, ys, linestyle="--", color="black", marker="x", label="one memcpy of the same bytes")
    ax.fill_between([], [], [], color="grey", alpha=0.2, label="p50 to p99 band")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.xaxis.set_major_formatter(FuncFormatter(human_bytes))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.set_xlabel("tensor size (bytes, log scale; KiB = 1024 bytes)")
    ax.set_ylabel("hop latency (µs, log scale)")
    ax.set_title(noted("One tensor hand-off per channel: latency against tensor size", hops))
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(which="major", alpha=0.3)
    ax.grid(which="minor", alpha=0.08)
    save(fig, out_dir, "hop.png", written)
    return ("Latency of one tensor hand-off (sender to a waiting receiver) against the tensor's size, "
            "p50 with the p50-p99 band, per channel; dashed: one `memcpy` of the same bytes.")


def plot_batch(records, out_dir, written):
    lines = [r["data"] for r in records if r["data"]["bench"] == "batch"
             and number(r["data"].get("batch")) and number(r["data"].get("p50_ms"))]
    if not lines:
        return None, "no {\"bench\":\"batch\"} lines"
    by_series = group(lines, series_of)
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for s, pts in by_series.items():
        pts = sorted(pts, key=lambda d: d["batch"])
        col = colour(s, by_series)
        name = f"{s} " if s else ""
        xs = [d["batch"] for d in pts]
        ax.plot(xs, [d["p50_ms"] for d in pts], marker="o", color=col, label=f"{name}p50")
        p99 = [d for d in pts if number(d.get("p99_ms"))]
        if p99:
            ax.plot([d["batch"] for d in p99], [d["p99_ms"] for d in p99], marker="^", linestyle="--", color=col,
                    label=f"{name}p99")
    batches = sorted({d["batch"] for d in lines})
    if batches[-1] / max(batches[0], 1) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size (samples per request)")
    ax.set_ylabel("latency per batched request (ms)")
    ax.set_title(noted("Latency against batch size", lines))
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    save(fig, out_dir, "batch.png", written)
    return "Latency of one batched request (p50 solid, p99 dashed) against its batch size."


def loadgen_series(records):
    lines = [r["data"] for r in records if r["data"]["bench"] == "loadgen"
             and number(r["data"].get("rate_per_s")) and number(r["data"].get("throughput_per_s"))]
    return group(lines, series_of)


def plot_throughput(records, out_dir, written, notes):
    by_series = loadgen_series(records)
    if not by_series:
        return None, "no {\"bench\":\"loadgen\"} lines"
    has_latency = any(number(d.get("p50_ms")) for pts in by_series.values() for d in pts)
    if has_latency:
        fig, (ax, lat) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(8, 5.2))
        lat = None
    top, marked = 0.0, False
    for s, pts in by_series.items():
        pts = sorted(pts, key=lambda d: d["rate_per_s"])
        col = colour(s, by_series)
        name = s or "throughput"
        xs = [d["rate_per_s"] for d in pts]
        ax.plot(xs, [d["throughput_per_s"] for d in pts], marker="o", color=col, label=name)
        top = max(top, max(xs), max(d["throughput_per_s"] for d in pts))
        sat = saturation_point([(d["rate_per_s"], d["throughput_per_s"]) for d in pts])
        if sat:
            rate, thr = sat
            ax.plot([rate], [thr], marker="X", markersize=13, color="crimson", zorder=5,
                    label=None if marked else f"saturation (< {SATURATION:.0%} of offered)")
            marked = True
            ax.annotate(f"saturation{' (' + s + ')' if s else ''}:\n{rate:g}/s offered, {thr:.3g}/s done",
                        xy=(rate, thr), xytext=(12, -34), textcoords="offset points", fontsize=9, color="crimson",
                        arrowprops={"arrowstyle": "->", "color": "crimson"})
            if lat is not None:
                lat.axvline(rate, color="crimson", linestyle=":", linewidth=1)
            notes.append(f"saturation{' (' + s + ')' if s else ''}: {rate:g} requests/s offered, "
                         f"{thr:.3g} requests/s completed")
        else:
            notes.append(f"saturation{' (' + s + ')' if s else ''}: not reached up to {max(xs):g} requests/s offered")
        if lat is not None:
            p50 = [d for d in pts if number(d.get("p50_ms"))]
            p99 = [d for d in pts if number(d.get("p99_ms"))]
            lat.plot([d["rate_per_s"] for d in p50], [d["p50_ms"] for d in p50], marker="o", color=col,
                     label=f"{s + ' ' if s else ''}p50")
            if p99:
                lat.plot([d["rate_per_s"] for d in p99], [d["p99_ms"] for d in p99], marker="^", linestyle="--",
                         color=col, label=f"{s + ' ' if s else ''}p99")
    ax.plot([0, top * 1.05], [0, top * 1.05], linestyle=":", color="grey", label="throughput = offered rate")
    ax.plot([0, top * 1.05], [0, SATURATION * top * 1.05], linestyle=":", color="grey", alpha=0.5, linewidth=0.8,
            label=f"{SATURATION:.0%} of offered rate")
    ax.set_xlim(0, top * 1.05)
    ax.set_ylim(0, top * 1.05)
    ax.set_ylabel("throughput (completed requests/s)")
    ax.set_title(noted("Throughput against offered rate (open loop)", [d for pts in by_series.values() for d in pts]))
    ax.legend(loc="upper left", fontsize=9)
    ax.grid(alpha=0.3)
    if lat is not None:
        lat.set_yscale("log")
        lat.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        lat.set_ylabel("end-to-end latency (ms, log scale)")
        lat.set_xlabel("offered rate (requests/s)")
        lat.legend(loc="upper left", fontsize=8)
        lat.grid(which="both", alpha=0.25)
        lat.set_title("Latency against offered rate (dotted: saturation)", fontsize=10)
    else:
        ax.set_xlabel("offered rate (requests/s)")
    save(fig, out_dir, "throughput.png", written)
    return (f"Completed requests per second against the rate offered; dotted grey: throughput = offered "
            f"rate. Saturation (marked): the first offered rate whose throughput is below "
            f"{SATURATION:.0%} of it." + (" Below: end-to-end latency p50 (solid) and p99 (dashed)." if lat else ""))


def plot_memory(records, out_dir, written):
    by_series = {s: [d for d in pts if number(d.get("rss_mb"))] for s, pts in loadgen_series(records).items()}
    by_series = {s: pts for s, pts in by_series.items() if pts}
    if not by_series:
        return None, "no {\"bench\":\"loadgen\"} lines with \"rss_mb\""
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for s, pts in by_series.items():
        pts = sorted(pts, key=lambda d: d["rate_per_s"])
        col = colour(s, by_series)
        ax.plot([d["rate_per_s"] for d in pts], [d["rss_mb"] for d in pts], marker="o", color=col,
                label=s or "resident memory")
        sat = saturation_point([(d["rate_per_s"], d["throughput_per_s"]) for d in pts])
        if sat:
            ax.axvline(sat[0], color="crimson", linestyle=":", linewidth=1,
                       label=f"saturation{' (' + s + ')' if s else ''}: {sat[0]:g}/s")
    ax.set_xlim(left=0)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(noted("Resident memory against offered rate", [d for pts in by_series.values() for d in pts]))
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    save(fig, out_dir, "memory.png", written)
    return ("Resident memory of the serving processes (host and workers, summed) at the end of each "
            "step of the rate sweep; dotted: the saturation point.")


# ---------------------------------------------------------------------------------------------
# Page


def md_cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ")


def write_index(out_dir, inputs, sections, notes, records, snapshots, written):
    def rel(p):  # inside the report: relative to it; elsewhere: as given
        r = os.path.relpath(os.path.abspath(p), os.path.abspath(out_dir))
        return p if r.startswith("..") else r

    out = ["# BlockFlow benchmark report", "",
           "Drawn by `scripts/plot.py` from: " + ", ".join(f"`{md_cell(rel(p))}`" for p in inputs) + ".", ""]
    drawn = [(s[0], s[1], s[2]) for s in sections if s[2] is not None]
    skipped = [(s[0], s[1], s[3]) for s in sections if s[2] is None]
    if drawn:
        out.append("Figures: " + ", ".join(f"[{t}](#{t.lower().replace(' ', '-').replace(',', '')})" for _, t, _ in drawn) + ".")
        out.append("")
    for f, title, desc in drawn:
        out += [f"## {title}", "", desc, "", f"![{title}]({f})", ""]
        if f == "throughput.png" and notes:
            out += [f"- {n}" for n in notes] + [""]
    if skipped:
        out += ["## Not drawn", ""]
        out += [f"- `{f}`: {why}" for f, _, why in skipped]
        out.append("")
    if snapshots:
        out += ["## Metrics snapshots", "",
                "| channel | block | placement | processed | wait mean / p50 (ms) | compute mean / p50 (ms) "
                "| overhead mean / p50 (ms) | source |", "|---|---|---|---:|---:|---:|---:|---|"]
        for s in sorted(snapshots, key=lambda s: channel_key(s["channel"])):
            for b in s["data"]["blocks"]:
                cells = [s["channel"], b.get("name", ""), b.get("placement", ""), b.get("processed", "")]
                for part in ("wait", "compute", "overhead"):
                    st = b.get(part) or {}
                    cells.append(f"{fmt(st.get('mean_ms', ''))} / {fmt(st.get('p50_ms', ''))}")
                cells.append(f"`{rel(s['source'])}`")
                out.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
        out.append("")
        out += [f"- `{md_cell(rel(s['source']))}`: {md_cell(s['data']['note'])}" for s in snapshots if s["data"].get("note")]
        out.append("")
    if records:
        out += ["## Lines", "", "| # | bench | line | source |", "|---:|---|---|---|"]
        for i, r in enumerate(records, 1):
            line = r["raw"]
            out.append(f"| {i} | {md_cell(r['data']['bench'])} | `{md_cell(line)}` | `{md_cell(rel(r['source']))}` |")
        out.append("")
    path = os.path.join(out_dir, "index.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out))
    written.append(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-report", help="folder for the figures and index.md (default bench-report)")
    ap.add_argument("files", nargs="+", metavar="FILE", help="JSON lines and/or metrics snapshots")
    args = ap.parse_args(argv)

    try:
        records, snapshots = load(args.files)
    except OSError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2
    if not records and not snapshots:
        print("plot.py: no benchmark lines or metrics snapshots in " + " ".join(args.files), file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    written, notes, sections = [], [], []
    figures = (
        ("breakdown.png", "Per-block breakdown", lambda: plot_breakdown(records, snapshots, args.out, written)),
        ("hop.png", "Hop latency", lambda: plot_hop(records, args.out, written)),
        ("batch.png", "Batch size", lambda: plot_batch(records, args.out, written)),
        ("throughput.png", "Throughput", lambda: plot_throughput(records, args.out, written, notes)),
        ("memory.png", "Memory", lambda: plot_memory(records, args.out, written)),
    )
    for name, title, draw in figures:
        result = draw()
        if isinstance(result, tuple):  # (None, why): not drawn
            print(f"plot.py: skipped {name}: {result[1]}")
            sections.append((name, title, None, result[1]))
        else:
            sections.append((name, title, result, ""))
    for n in notes:
        print(f"plot.py: {n}")
    write_index(args.out, args.files, sections, notes, records, snapshots, written)
    print(f"plot.py: {len(records)} line(s), {len(snapshots)} snapshot(s); wrote:")
    for p in written:
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
