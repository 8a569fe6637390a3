#!/usr/bin/env python3
"""What crossed a network interface, without tcpdump: for tests/two_host_test.sh.

    wire_capture.py capture IFACE FILE   records every frame on IFACE (an AF_PACKET socket; root)
                                         into FILE until SIGTERM; prints "capturing" once ready
    wire_capture.py find FILE HEX MIN    prints the bytes captured and how often HEX repeated MIN
                                         times in a row occurs; exit 0 if found, 1 if not

Frames are stored whole (headers too): searching a run of MIN copies of a 4-byte value cannot be
fooled by headers, and finding none in traffic that carried the value says it was encrypted.
"""
import signal
import socket
import sys

ETH_P_ALL = 0x0003


def capture(iface, path):
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    running = [True]
    signal.signal(signal.SIGTERM, lambda *_: running.__setitem__(0, False))
    with open(path, "wb") as out:
        print("capturing", flush=True)
        while running[0]:
            try:
                frame = sock.recv(65536)
            except socket.timeout:
                continue
            except InterruptedError:
                continue
            out.write(len(frame).to_bytes(4, "little") + frame)
    return 0


def find(path, pattern_hex, repeats):
    pattern = bytes.fromhex(pattern_hex) * int(repeats)
    frames = []
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at + 4 <= len(data):
        n = int.from_bytes(data[at:at + 4], "little")
        frames.append(data[at + 4:at + 4 + n])
        at += 4 + n
    hits = sum(frame.count(pattern) for frame in frames)
    total = sum(len(frame) for frame in frames)
    print(f"wire_capture: {len(frames)} frames, {total} bytes; {hits} run(s) of {repeats} x {pattern_hex}")
    return 0 if hits > 0 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "capture":
        sys.exit(capture(sys.argv[2], sys.argv[3]))
    if len(sys.argv) == 5 and sys.argv[1] == "find":
        sys.exit(find(sys.argv[2], sys.argv[3], sys.argv[4]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
