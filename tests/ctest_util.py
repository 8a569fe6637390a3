"""Helpers shared by the Python ctest drivers (tests/*_test.py)."""
import socket
import subprocess
import sys


def check(ok, what):
    """Prints one check; exits with "FAIL: what" (the ctests' FAIL_REGULAR_EXPRESSION) when it fails."""
    print(f"  check {what}: {'ok' if ok else 'FAILED'}")
    if not ok:
        sys.exit(f"FAIL: {what}")


def free_port():
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_serve(srv, timeout_s=30):
    """Stops the serve example by closing its stdin; kills it when it has not exited within
    `timeout_s`. Returns its exit status, None when it had to be killed."""
    if srv.stdin and not srv.stdin.closed:
        srv.stdin.close()
    try:
        return srv.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        srv.kill()
        srv.wait()
        return None
