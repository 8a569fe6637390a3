#!/usr/bin/python3
"""scripts/plot.py draws its five figures and index.md from a recorded sample of benchmark output
(tests/data/bench-sample.jsonl, tests/data/metrics-shm.json); then, from pipeline lines alone,
it falls back to them for the breakdown and skips the figures whose data are absent."""

import importlib.util
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PLOT = os.path.join(HERE, "..", "scripts", "plot.py")
SAMPLE = os.path.join(HERE, "data", "bench-sample.jsonl")
SNAPSHOT = os.path.join(HERE, "data", "metrics-shm.json")
FIGURES = ("breakdown.png", "hop.png", "batch.png", "throughput.png", "memory.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(out, *files):
    env = dict(os.environ, MPLCONFIGDIR=os.path.join(out, ".mpl"))  # no writable $HOME needed
    p = subprocess.run([sys.executable, PLOT, "--out", out, *files], capture_output=True, text=True, env=env)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    assert p.returncode == 0, f"plot.py exited with {p.returncode}"
    return p.stdout


def check_png(path):
    assert os.path.isfile(path), f"{path} missing"
    size = os.path.getsize(path)
    assert size > 1024, f"{path}: {size} bytes"
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, f"{path}: not a PNG"


def main():
    if importlib.util.find_spec("matplotlib") is None:
        print("plot test: SKIP (python3-matplotlib missing: scripts/install_deps.sh installs it)")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        stdout = run(out, SAMPLE, SNAPSHOT)
        with open(os.path.join(out, "index.md"), encoding="utf-8") as f:
            index = f.read()
        for name in FIGURES:
            check_png(os.path.join(out, name))
            assert f"]({name})" in index, f"index.md does not link {name}"
            assert os.path.join(out, name) in stdout, f"{name} not in the list of files written"
        assert "skipped" not in stdout, stdout
        # The snapshot's blocks (placement w1..w4) are in the breakdown table; every JSON line is listed.
        assert "| shm | block3 | w3 |" in index, "snapshot table"
        with open(SAMPLE, encoding="utf-8") as f:
            json_lines = [line for line in f if line.startswith("{")]
        assert index.count("`{\"bench\":") == len(json_lines), "index.md lists every line"
        # Synthetic sweep: 12/s gives 11.52 (>= 95%), 14/s gives 11.81 (< 95%): saturation at 14.
        assert "saturation (shm): 14 requests/s offered" in index, "saturation point"

        # Without snapshot, loadgen or batch lines: breakdown from pipeline lines, three figures skipped.
        only = os.path.join(tmp, "pipeline-only.jsonl")
        with open(only, "w", encoding="utf-8") as f:
            f.writelines(line for line in json_lines if '"bench":"pipeline"' in line or '"bench":"hop"' in line)
            f.write("bench.sh: a log line, not JSON\n")
        out2 = os.path.join(tmp, "report2")
        stdout = run(out2, only)
        for name in ("breakdown.png", "hop.png"):
            check_png(os.path.join(out2, name))
        for name in ("batch.png", "throughput.png", "memory.png"):
            assert not os.path.exists(os.path.join(out2, name)), f"{name} drawn without data"
            assert f"skipped {name}" in stdout, f"no note for {name}"
    print("plot test: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
