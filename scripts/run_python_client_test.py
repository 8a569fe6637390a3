#!/usr/bin/env python3
"""Runs examples/python_client.py against the `serve` example (the ctest example_python_client).

usage: run_python_client_test.py --serve PATH/serve --client examples/python_client.py [--python PY]
                                 [--keygen PATH/blockflowctl]

Starts `serve --endpoint tcp://127.0.0.1:*` with a pipe on its stdin, reads its `serving on EP`
line, runs the client against EP, closes serve's stdin (which stops it) and waits for it to exit 0.
Every step has a timeout; on any failure serve is killed (nothing is left running), the reason is
printed as `run_python_client_test: FAIL: ...` and the exit status is non-zero.

With --keygen, serve runs behind CURVE: `blockflowctl keygen` makes the keys of the server, of
alice (admitted) and of mallory (not admitted); the client runs with alice's keys, and clients
without keys or with mallory's must get no reply (TimeoutError) while serve counts them refused.
"""
import argparse
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time

STARTUP_TIMEOUT_S = 30
CLIENT_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 20


class Failure(Exception):
    pass


def read_first_line(proc, timeout_s):
    """The first stdout line of `proc`, without blocking past the timeout."""
    fd = proc.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Failure(f"serve printed no 'serving on' line within {timeout_s} s (got {data!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            rc = proc.wait(timeout=5)
            raise Failure(f"serve exited (status {rc}) before printing 'serving on' (got {data!r})")
        data += chunk
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


# A client without keys and one whose key serve does not admit: each must time out, unanswered.
REFUSED_CLIENTS = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from python_client import BlockflowClient
endpoint, keys = sys.argv[2], sys.argv[3]
for who, key, server_key in (("no key", None, None),
                             ("mallory", keys + "/mallory.key_secret", keys + "/server.key")):
    with BlockflowClient(endpoint, timeout_s=2, key_file=key, server_key_file=server_key) as client:
        try:
            client.submit("affine", np.ones((2, 3), np.float32))
            print(f"refused clients: {who} got an answer: FAIL")
            sys.exit(1)
        except TimeoutError:
            print(f"refused clients: {who} got no reply: ok")
"""


def check_refused(args, endpoint, keys):
    refused = subprocess.run([args.python, "-c", REFUSED_CLIENTS, os.path.dirname(os.path.abspath(args.client)),
                              endpoint, keys], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=CLIENT_TIMEOUT_S)
    print(refused.stdout, end="", flush=True)
    if refused.returncode != 0:
        raise Failure("a client serve should refuse was answered, or failed otherwise")


def run(args):
    # A clear message rather than a traceback when the client's dependencies are missing.
    check = subprocess.run([args.python, "-c", "import zmq, numpy"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise Failure(f"{args.python} cannot import zmq and numpy (install python3-zmq python3-numpy, "
                      f"see scripts/install_deps.sh): {check.stderr.strip()}")

    keys = tempfile.mkdtemp(prefix="bf-python-client-keys-") if args.keygen else None
    serve_args, client_args = [], []
    if keys:
        os.mkdir(os.path.join(keys, "clients"))
        for name in ("server", "alice", "mallory"):
            made = subprocess.run([args.keygen, "keygen", name, "--dir", keys], timeout=30, capture_output=True, text=True)
            if made.returncode != 0:
                shutil.rmtree(keys, ignore_errors=True)  # secret keys: not left in /tmp
                raise Failure(f"blockflowctl keygen {name} exited with status {made.returncode}: {made.stderr.strip()}")
        shutil.copy(os.path.join(keys, "alice.key"), os.path.join(keys, "clients"))
        serve_args = ["--key", os.path.join(keys, "server.key_secret"), "--authorized-keys", os.path.join(keys, "clients")]
        client_args = ["--key", os.path.join(keys, "alice.key_secret"), "--server-key", os.path.join(keys, "server.key")]
    serve_log = tempfile.TemporaryFile()  # a file, not a pipe: serve never blocks on its log
    serve = subprocess.Popen([args.serve, "--endpoint", "tcp://127.0.0.1:*"] + serve_args, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=serve_log)
    try:
        line = read_first_line(serve, STARTUP_TIMEOUT_S)
        m = re.fullmatch(r"serving on (\S+)", line)
        if not m:
            raise Failure(f"unexpected first line from serve: {line!r}")
        endpoint = m.group(1)
        print(f"run_python_client_test: serve is on {endpoint}", flush=True)

        try:
            client = subprocess.run([args.python, args.client, endpoint] + client_args, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, timeout=CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            print(out, flush=True)
            raise Failure(f"the client did not finish within {CLIENT_TIMEOUT_S} s") from None
        print(client.stdout, end="", flush=True)
        if client.returncode != 0:
            raise Failure(f"the client exited with status {client.returncode}")
        if keys:
            check_refused(args, endpoint, keys)

        serve.stdin.close()  # EOF on stdin stops serve
        try:
            rc = serve.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failure(f"serve did not exit within {SHUTDOWN_TIMEOUT_S} s of its stdin closing") from None
        if rc != 0:
            raise Failure(f"serve exited with status {rc}")
        rest = serve.stdout.read().decode("utf-8", "replace")
        if rest:
            raise Failure(f"serve printed more than one stdout line: {rest!r}")
        serve_log.seek(0)
        log = serve_log.read().decode("utf-8", "replace")
        print(log, end="", flush=True)
        refused = re.search(r"(\d+) peers refused", log)
        if keys and (not refused or int(refused.group(1)) < 2):
            raise Failure("serve did not count the two refused clients (its last line: "
                          f"{log.strip().splitlines()[-1] if log.strip() else ''!r})")
    except Failure:
        serve_log.seek(0)  # what serve said is what explains most failures
        print("run_python_client_test: serve's stderr:\n" + serve_log.read().decode("utf-8", "replace"), end="", flush=True)
        raise
    finally:
        if keys:
            shutil.rmtree(keys, ignore_errors=True)
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        serve_log.close()
        for stream in (serve.stdin, serve.stdout):
            if stream and not stream.closed:
                stream.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", required=True, help="the serve example binary")
    parser.add_argument("--client", required=True, help="examples/python_client.py")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the client")
    parser.add_argument("--keygen", help="blockflowctl: serve behind CURVE with keys it makes")
    args = parser.parse_args()
    try:
        run(args)
    except Failure as e:
        print(f"run_python_client_test: FAIL: {e}", flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - any surprise is a failure, named
        print(f"run_python_client_test: FAIL: {type(e).__name__}: {e}", flush=True)
        return 1
    print("run_python_client_test: serve stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
