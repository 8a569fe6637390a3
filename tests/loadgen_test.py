#!/usr/bin/env python3
"""ctest loadgen: blockflow-loadgen against an in-process deployment (a C++ block in a worker, one in
threads) and against the serve example's client endpoint. Checks what the JSON lines say: every
request accounted for, per-block breakdown, a sweep's saturation point.

usage: loadgen_test.py LOADGEN PLUGIN SERVE
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ctest_util import check, stop_serve  # noqa: E402


def run(cmd, expect=0):
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    sys.stderr.write(out.stderr[-3000:])
    if out.returncode != expect:
        sys.exit(f"FAIL: exit {out.returncode}, expected {expect}")
    lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    for l in lines:
        print(json.dumps(l))
    return lines




def main():
    loadgen, plugin, serve = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as tmp:
        deployment = os.path.join(tmp, "deploy.json")
        with open(deployment, "w") as f:
            json.dump({"blocks": [{"name": "slow", "factory": "slow_identity", "placement": "w1"},
                                  {"name": "affine", "factory": "affine", "input_shapes": [[-1, 4]]}],
                       "tasks": {"both": ["affine", "slow"], "quick": ["affine"]}}, f)

        # Closed loop, a fixed number of requests over two tasks.
        (line,) = run([loadgen, "--deployment", deployment, "--plugin", plugin, "--clients", "3",
                       "--requests", "60", "--quiet"])
        check(line["bench"] == "loadgen" and line["mode"] == "clients", "a loadgen line")
        check(line["sent"] == 60 and line["completed"] == 60 and line["failed"] == 0 and line["lost"] == 0,
              "60 sent, 60 completed")
        blocks = {b["name"]: b for b in line["blocks"]}
        check(set(blocks) == {"affine", "slow"}, "per-block breakdown for both blocks")
        check(blocks["slow"]["compute_p50_ms"] >= 4.5, "the slow block's 5 ms show in its compute")
        check(line["rss_mb"] > 100, "memory of this process and its worker")

        # An entry window of one request per task: three closed-loop clients keep three requests of
        # 'both' outstanding, so the others wait at its entry while one is inside.
        (line,) = run([loadgen, "--deployment", deployment, "--plugin", plugin, "--tasks", "both", "--clients", "3",
                       "--requests", "30", "--max-in-flight", "1", "--quiet"])
        check(line["completed"] == 30 and line["failed"] == 0, "30 completed through a window of one")
        check(line["max_in_flight_per_task"] == 1 and line["waited_at_entry"] > 0,
              "requests waited at the entry: %s" % line.get("waited_at_entry"))
        refused = subprocess.run([loadgen, "--endpoint", "tcp://127.0.0.1:1", "--tasks", "t", "--shape", "1x4",
                                  "--clients", "1", "--max-in-flight", "2"], capture_output=True, text=True, timeout=60)
        check(refused.returncode != 0 and "--max-in-flight" in refused.stderr, "--max-in-flight is refused with --endpoint")

        # Open loop sweep: 'slow' (5 ms, one worker thread) saturates near 200 requests/s of 'both'.
        out = os.path.join(tmp, "sweep.jsonl")
        lines = run([loadgen, "--deployment", deployment, "--plugin", plugin, "--tasks", "both",
                     "--sweep", "40,600", "--duration", "1.5", "--json", out, "--quiet"])
        runs = [l for l in lines if l["bench"] == "loadgen"]
        check(len(runs) == 2 and all(r["sent"] == r["completed"] + r["failed"] for r in runs),
              "every request of the sweep resolved")
        check(runs[0]["completed"] == runs[0]["sent"] and runs[0]["p50_ms"] > 0,
              "40/s offered: all served, each timed")
        check(runs[1]["throughput_per_s"] < 0.95 * 600, "600/s offered, less served")
        check(lines[-1] == {"bench": "saturation", "rate_per_s": 600.0,
                            "throughput_per_s": runs[1]["throughput_per_s"]}, "saturation point at 600/s")
        with open(out) as f:
            check([json.loads(l) for l in f] == lines, "--json wrote the same lines")

        # A Poisson stream per task (--task-rates): figures per task, adding up to the line's.
        (line,) = run([loadgen, "--deployment", deployment, "--plugin", plugin, "--task-rates", "both=30,quick=60",
                       "--duration", "1.5", "--quiet"])
        per = {t["task"]: t for t in line["per_task"]}
        check(set(per) == {"both", "quick"} and per["both"]["rate_per_s"] == 30 and per["quick"]["rate_per_s"] == 60,
              "a per_task entry for each stream, with its rate")
        check(all(t["sent"] > 0 and t["sent"] == t["completed"] and t["failed"] == 0 for t in per.values()),
              "every request of each stream completed")
        check(line["sent"] == per["both"]["sent"] + per["quick"]["sent"] and line["completed"] == line["sent"],
              "the line's counts are the streams' sums")
        check(line["rate_per_s"] == 90, "the line's rate is the streams' sum")
        check({b["name"] for b in line["blocks"]} == {"affine", "slow"}, "both tasks' blocks in the breakdown")
        bad = subprocess.run([loadgen, "--deployment", deployment, "--plugin", plugin, "--task-rates", "both=30",
                              "--rate", "5"], capture_output=True, text=True, timeout=60)
        check(bad.returncode == 2 and "--task-rates" in bad.stderr, "--task-rates with --rate is refused")
        for args, says in ((["--task-rates", "both=20,both=100"], "task 'both' is given twice"),
                           (["--clients", "abc"], "--clients takes a whole number from 1 to 100000, not 'abc'"),
                           (["--rate", "5", "--duration", "5m"], "--duration takes a number"),
                           (["--rate", "nan"], "--rate takes a number"),
                           (["--sweep", "10,20", "--rate", "5"], "give one of --rate and --sweep"),
                           (["--clients", "1", "--shape", "1x-3"], "--shape takes a whole number"),
                           (["--clients", "1", "--json", os.path.join(tmp, "no", "dir.json")], "--json: cannot write")):
            bad = subprocess.run([loadgen, "--deployment", deployment, "--plugin", plugin] + args,
                                 capture_output=True, text=True, timeout=60)
            check(bad.returncode == 2 and says in bad.stderr, f"{' '.join(args)}: refused, saying {says!r}")
        # An arrival scheduled past the run's end is not sent: at 0.01/s the second comes ~100 s after
        # the first (fixed seed), long after a run of 0.5 s (before: slept until it, then sent it).
        (line,) = run([loadgen, "--deployment", deployment, "--plugin", plugin, "--tasks", "quick", "--rate", "0.01",
                       "--duration", "0.5", "--warmup", "1", "--quiet"])
        check(line["sent"] == 1 and line["completed"] == 1, "a 0.01/s run of 0.5 s sends its first arrival only")

        # Through a client endpoint.
        srv = subprocess.Popen([serve, "--endpoint", "tcp://127.0.0.1:*"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        try:
            endpoint = srv.stdout.readline().strip().removeprefix("serving on ")
            (line,) = run([loadgen, "--endpoint", endpoint, "--tasks", "affine", "--shape", "2x3",
                           "--clients", "2", "--requests", "40", "--quiet"])
            check(line["completed"] == 40 and line["failed"] == 0, "40 requests through the endpoint")
            # Every request failed: the line says so, and so does the exit status (1).
            (line,) = run([loadgen, "--endpoint", endpoint, "--tasks", "fails", "--shape", "2x3",
                           "--rate", "50", "--requests", "10", "--warmup", "0", "--quiet"], expect=1)
            check(line["failed"] == 10 and "calibration" in line.get("first_error", ""),
                  "failures counted, the first error named")
            warm = subprocess.run([loadgen, "--endpoint", endpoint, "--tasks", "fails", "--shape", "2x3",
                                   "--rate", "50", "--requests", "10", "--quiet"], capture_output=True, text=True, timeout=120)
            check(warm.returncode == 1 and "no warm-up request succeeded" in warm.stderr and "calibration" in warm.stderr
                  and warm.stdout == "", "a warm-up with no success ends the run, naming the error")
        finally:
            rc = stop_serve(srv)
        check(rc == 0, f"serve exits 0 once its stdin closes (status {rc}; None: killed after 30 s)")
    print("loadgen test: PASS")


if __name__ == "__main__":
    main()
