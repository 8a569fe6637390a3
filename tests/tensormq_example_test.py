#!/usr/bin/env python3
"""ctest driver of examples/tensormq_producer.cpp and tensormq_consumer.cpp: two processes with no
Session exchange 1000 tensors of 3.2 MB.

shm://: the consumer is killed with SIGKILL mid-stream while it holds 8 tensors; a new consumer
opens the same URI; the producer takes the dead consumer's slots back (reclaimed > 0), goes on, and
the new consumer gets every tensor up to the last, with the right values; bytes_copied is 0 on both
sides. tcp://127.0.0.1: the same pair, 1000 tensors, no kill. cuda://: where CUDA can carry tensors
between processes (a GPU machine: scripts/gpu.sh), the shm:// run again with CUDA tensors (empty()
makes them on the device; zero copies, the killed consumer's CUDA records reclaimed); elsewhere the
consumer must refuse the URI, naming why ("no CUDA channel here"), and that part is reported as not
run.
Prints "tensormq example: PASS" when every check holds.
usage: tensormq_example_test.py PRODUCER CONSUMER
"""
import os
import re
import signal
import socket
import subprocess
import sys

COUNT = 1000
STEP_TIMEOUT_S = 90  # each wait; well inside ctest's 300 s, so that a hang names its step
STARTED = []  # every process started: killed on the way out, whatever happened


def fail(message):
    print(f"tensormq example: FAIL: {message}", flush=True)
    sys.exit(1)


def started(p):
    STARTED.append(p)
    return p


def wait_for(p, who, uri):
    try:
        return p.communicate(timeout=STEP_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        fail(f"{uri}: the {who} did not finish within {STEP_TIMEOUT_S} s")


def start_consumer(binary, uri, *extra):
    p = started(subprocess.Popen([binary, uri, str(COUNT), *extra], stdout=subprocess.PIPE, text=True))
    line = p.stdout.readline()
    if "listening" not in line:
        fail(f"consumer did not start on {uri}: {line!r}")
    return p


def summary(output, pattern, who):
    m = re.search(pattern, output)
    if not m:
        fail(f"no summary from the {who}: {output!r}")
    return [int(g) for g in m.groups()]


def run(producer, consumer, uri, kill):
    first = start_consumer(consumer, uri, "--last", str(COUNT - 1), "--hold", "8")
    prod = started(subprocess.Popen([producer, uri, str(COUNT)], stdout=subprocess.PIPE, text=True))
    second = None
    if kill:
        for line in first.stdout:
            if "received 200" in line:
                break
        else:
            fail(f"{uri}: the first consumer ended (status {first.wait()}) before it had received 200 tensors")
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_consumer(consumer, uri, "--last", str(COUNT - 1))
    last_consumer = second or first
    out = wait_for(last_consumer, "consumer", uri)
    if last_consumer.returncode != 0:
        fail(f"{uri}: consumer exited {last_consumer.returncode}: {out!r}")
    received, first_id, last_id, wrong, copied = summary(
        out, r"received (\d+) \(ids (-?\d+) to (-?\d+)\), wrong values (\d+), bytes_copied (\d+)", "consumer")
    pout = wait_for(prod, "producer", uri)
    if prod.returncode != 0:
        fail(f"{uri}: producer exited {prod.returncode}: {pout!r}")
    sent, pcopied, reclaimed, in_use = summary(
        pout, r"sent (\d+) to \S+, bytes_copied (\d+), slots reclaimed (\d+), slots in use (\d+)", "producer")
    print(f"{uri}: producer sent {sent}, bytes_copied {pcopied}, reclaimed {reclaimed}; "
          f"{'second ' if kill else ''}consumer received {received} (ids {first_id}..{last_id}), wrong {wrong}, "
          f"bytes_copied {copied}")
    checks = [(sent == COUNT, "the producer sent every tensor"), (wrong == 0, "every value is right"),
              (last_id == COUNT - 1, "the last tensor arrived"), (in_use == 0, "no slot left in use")]
    if kill:
        checks += [(reclaimed > 0, "the killed consumer's slots were reclaimed"),
                   (first_id > 200 and received == COUNT - first_id, "the new consumer got every tensor from its first on"),
                   (pcopied == 0 and copied == 0, "bytes_copied is 0 on both sides")]
    else:
        checks += [(received == COUNT and first_id == 0, "every tensor arrived, in order")]
    for ok, what in checks:
        if not ok:
            fail(f"{uri}: not true that {what}")


def main():
    try:
        checks(sys.argv[1], sys.argv[2])
    finally:
        for p in STARTED:
            if p.poll() is None:
                p.kill()
                p.wait()


def checks(producer, consumer):
    run(producer, consumer, f"shm://tensormq-example-{os.getpid()}", kill=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run(producer, consumer, f"tcp://127.0.0.1:{port}", kill=False)
    cuda = f"cuda://tensormq-example-{os.getpid()}"
    probe = subprocess.run([consumer, cuda, "0"], capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    if probe.returncode == 0:
        run(producer, consumer, cuda, kill=True)
    elif "no CUDA channel here" in probe.stderr:
        print(f"{cuda}: not run here: {probe.stderr.strip()}")
    else:
        fail(f"{cuda}: the consumer failed otherwise than refusing CUDA: {probe.stderr!r}")
    print("tensormq example: PASS")


if __name__ == "__main__":
    main()
