#!/usr/bin/env python3
"""ctest blockflowctl: the control endpoint of a running session (the serve example) driven from the
shell: status, metrics (JSON and Prometheus), sampling, a live update, a refused update.

usage: blockflowctl_test.py BLOCKFLOWCTL SERVE
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ctest_util import check, free_port, stop_serve  # noqa: E402




def ctl(tool, endpoint, *args, expect=0):
    out = subprocess.run([tool, "--endpoint", endpoint, *args], capture_output=True, text=True, timeout=60)
    print(f"+ blockflowctl {' '.join(args)} -> {out.returncode}")
    print(out.stdout[:1500] + out.stderr[:1500])
    check(out.returncode == expect, f"'{' '.join(args)}' exits {expect}")
    return out




def main():
    tool, serve = sys.argv[1:3]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    srv = subprocess.Popen([serve, "--endpoint", "tcp://127.0.0.1:*", "--control", endpoint],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()  # "serving on ..."
        status = json.loads(ctl(tool, endpoint, "status").stdout)
        check(status["ok"] and status["version"] == 0, "status: version 0")
        check(sorted(status["tasks"]) == ["affine", "fails", "sum2"], "status: the three tasks")

        both = ctl(tool, endpoint, "metrics").stdout
        check('"uptime_s"' in both and "# TYPE blockflow_uptime_seconds gauge" in both, "metrics: JSON and Prometheus")
        check("--period takes a whole number of milliseconds above 0, not 'soon'" in
              ctl(tool, endpoint, "sampling", "on", "--period", "soon", expect=2).stderr, "a bad --period is named")
        ctl(tool, endpoint, "sampling", "on", "--period", "50")
        metrics = json.loads(ctl(tool, endpoint, "metrics", "--json").stdout)
        check(metrics["sampling"] is True and metrics["sampling_period_s"] == 0.05, "sampling switched on")
        check("blockflow_sampling_enabled 1" in ctl(tool, endpoint, "metrics", "--prometheus").stdout,
              "the Prometheus text says so")

        with tempfile.TemporaryDirectory() as tmp:
            # serve's blocks are C++ objects: a deployment that leaves one out would remove it for good.
            drop = os.path.join(tmp, "drop.json")
            with open(drop, "w") as f:
                json.dump({"blocks": ["affine"], "tasks": {"affine": ["affine"]}}, f)
            out = ctl(tool, endpoint, "apply", drop, expect=1)
            check("is a C++ object (added with Session::add_block())" in out.stderr,
                  "apply refuses to remove a C++ block for good, naming it")
            keep = os.path.join(tmp, "keep-affine.json")
            with open(keep, "w") as f:
                json.dump({"blocks": ["affine", "sum2", "fails"], "tasks": {"affine": ["affine"]}}, f)
            check("applied: version 1" in ctl(tool, endpoint, "apply", keep).stdout, "apply: version 1")
            status = json.loads(ctl(tool, endpoint, "status").stdout)
            check(status["tasks"] == ["affine"] and status["version"] == 1, "status after the update")

            # A placement's settings reach the worker serve starts for it: its memory budget refuses a
            # block whose profiled memory is over it, naming both (before, the worker started without one).
            budget = os.path.join(tmp, "budget.json")
            with open(budget, "w") as f:
                json.dump({"blocks": ["affine", "sum2", "fails",
                                      {"name": "big", "torchscript": "big.pt", "placement": "w1",
                                       "memory_bytes": 200 << 20}],
                           "tasks": {"affine": ["affine"], "big": ["big"]},
                           "sites": {"w1": {"memory": {"budget": 100 << 20, "policy": "admit"}}}}, f)
            out = ctl(tool, endpoint, "apply", budget, expect=1)
            check("site 'w1': its blocks' profiled memory is 200.0 MB ('big' 200.0 MB), over its memory budget of "
                  "100.0 MB" in out.stderr,
                  "a deployment's memory budget for a worker site is applied, naming the block")

            bad = os.path.join(tmp, "bad.json")
            with open(bad, "w") as f:
                json.dump({"blocks": ["affine"], "tasks": {"affine": ["affine", "nope"]}}, f)
            out = ctl(tool, endpoint, "apply", bad, expect=1)
            check("task 'affine': unknown block 'nope'" in out.stderr, "a refused update says why")
            with open(bad, "w") as f:
                f.write("{not json")
            ctl(tool, endpoint, "apply", bad, expect=1)
            with open(bad, "w") as f:  # dumping it would recurse once a level: refused before
                f.write("[" * 300000 + "]" * 300000)
            check("nests deeper than 63 levels" in ctl(tool, endpoint, "apply", bad, expect=1).stderr,
                  "a file nested too deep is refused by blockflowctl itself")
            check(json.loads(ctl(tool, endpoint, "status").stdout)["version"] == 1, "nothing changed")
        ctl(tool, endpoint, "frobnicate", expect=2)
    finally:
        rc = stop_serve(srv)
    check(rc == 0, f"serve exits 0 once its stdin closes (status {rc}; None: killed after 30 s)")
    control_keys(tool, serve)
    print("blockflowctl test: PASS")


def control_keys(tool, serve):
    """Behind CURVE the control endpoint admits its own allow-list: a client key does not grant it."""
    with tempfile.TemporaryDirectory() as keys:
        for name in ("server", "alice", "ops"):
            subprocess.run([tool, "keygen", name, "--dir", keys], check=True, timeout=30, capture_output=True)
        for sub, name in (("clients", "alice"), ("operators", "ops")):
            os.mkdir(os.path.join(keys, sub))
            os.rename(os.path.join(keys, name + ".key"), os.path.join(keys, sub, name + ".key"))
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        common = [serve, "--endpoint", "tcp://127.0.0.1:*", "--control", endpoint, "--no-stdin",
                  "--key", os.path.join(keys, "server.key_secret"), "--authorized-keys", os.path.join(keys, "clients")]
        refused = subprocess.run(common, capture_output=True, text=True, timeout=60)
        print(refused.stderr[:500])
        check(refused.returncode == 2 and "--control-authorized-keys" in refused.stderr,
              "serve refuses --control with --key but no control allow-list, naming the option")
        srv = subprocess.Popen(common + ["--control-authorized-keys", os.path.join(keys, "operators")],
                               stdout=subprocess.PIPE, text=True)
        try:
            srv.stdout.readline()  # "serving on ..."
            as_key = lambda who: ["--key", os.path.join(keys, who + ".key_secret"),  # noqa: E731
                                  "--server-key", os.path.join(keys, "server.key")]
            ctl(tool, endpoint, *as_key("alice"), "status", expect=2)  # a client's key: no answer
            check(json.loads(ctl(tool, endpoint, *as_key("ops"), "status").stdout)["ok"], "an operator's key is answered")
        finally:
            srv.terminate()
            srv.wait(timeout=20)


if __name__ == "__main__":
    main()
