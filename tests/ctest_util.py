"""Helpers shared by the Python ctest drivers (tests/*_test.py)."""
import socket
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
