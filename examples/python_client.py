#!/usr/bin/env python3
"""A BlockFlow remote client in plain Python: python3-zmq, numpy and the standard library.

It talks to a `blockflow::ClientEndpoint` (e.g. `examples/serve.cpp`) in the wire format of
docs/wire-format.md, and is meant as documentation for writing a client in any language:

* connect a ZeroMQ DEALER socket to the endpoint (the server has a ROUTER);
* send one multipart message: frame 0 is a header of kind `submit` (4) whose target is the task
  name and whose request_id is of your choosing, followed by one descriptor per tensor (dtype code,
  shape, strides in elements, byte count); frames 1..n are the raw little-endian tensor bytes;
* wait (with a timeout) for a message of kind `reply` (5) with the same request_id: either the
  output tensors, or a non-zero status_code (an absl::StatusCode) and a message naming the cause.

Usage:

    python3 examples/python_client.py tcp://127.0.0.1:5555
    python3 examples/python_client.py tcp://10.0.0.1:5555 --key alice.key_secret --server-key server.key

    from python_client import BlockflowClient, RemoteError
    with BlockflowClient("tcp://127.0.0.1:5555", timeout_s=10) as client:
        (y,) = client.submit("affine", np.ones((2, 3), np.float32))

An endpoint behind CURVE (`serve --key ... --authorized-keys DIR`, docs/security.md) admits a
client whose public key is in DIR: pass `key_file` (its `blockflowctl keygen` `.key_secret` file)
and `server_key_file` (the server's `.key`). A refused client gets no reply, only TimeoutError.

Not implemented here, because a remote client does not need them: the shared-memory handle flag
(same-host worker channels only) and bfloat16 (numpy has no such dtype).
"""

import argparse
import os
import struct
import sys
import time

import numpy as np
import zmq

# --- Constants of docs/wire-format.md, version 4 ---------------------------------------------------

MAGIC = 0x57464C42  # the bytes b"BLFW" read as a little-endian u32
VERSION = 4

KIND_SUBMIT = 4  # client -> server: a request for the task named by `target`
KIND_REPLY = 5  # server -> client: outputs, or status_code != 0 and message

# Fixed part of the header, 88 bytes, little-endian ("<"), no padding:
#   magic u32, version u16, kind u8, flags u8, request_id u64, reserved u32 (0), node u32,
#   6 x i64 timestamps (submitted, arrived, dequeued, compute_start, compute_end, sent),
#   status_code i32, target_len u16, num_tensors u16, message_len u32, reserved u32.
FIXED = struct.Struct("<IHBBQII6qiHHII")
assert FIXED.size == 88

# Fixed part of a tensor descriptor, 16 bytes: dtype u8, ndim u8, reserved u16 + u32, byte_count
# u64. Then ndim i64 dimensions, then ndim i64 strides (in elements, not bytes).
DESC = struct.Struct("<BBHIQ")
assert DESC.size == 16

# Wire dtype code -> numpy dtype (explicitly little-endian). 4 = bfloat16 has no numpy equivalent.
DTYPES = {
    1: np.dtype("<f4"),  # float32
    2: np.dtype("<f8"),  # float64
    3: np.dtype("<f2"),  # float16
    5: np.dtype("i1"),  # int8
    6: np.dtype("u1"),  # uint8
    7: np.dtype("<i2"),  # int16
    8: np.dtype("<i4"),  # int32
    9: np.dtype("<i8"),  # int64
    10: np.dtype("?"),  # bool, one byte, 0 or 1
}
CODES = {dtype: code for code, dtype in DTYPES.items()}

MAX_TARGET_BYTES = 255
MAX_MESSAGE_BYTES = 65536
MAX_TENSORS = 64
MAX_DIMS = 8
MAX_TENSOR_BYTES = 1 << 34  # 16 GiB

# absl::StatusCode, the meaning of status_code (0 = OK).
STATUS_NAMES = [
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
    "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
]


class RemoteError(Exception):
    """The server answered the request with an error: `code` is an absl::StatusCode (1..16),
    `message` names the block or path and the cause."""

    def __init__(self, code, message):
        self.code = code
        self.message = message
        super().__init__(f"{STATUS_NAMES[code]} ({code}): {message}")

    @property
    def code_name(self):
        return STATUS_NAMES[self.code]


# --- Encoding a request ------------------------------------------------------------------------------


def contiguous_strides(shape):
    """Row-major strides in elements; a 0 dimension counts as 1, as in the reference codec."""
    strides, running = [], 1
    for dim in reversed(shape):
        strides.append(running)
        running *= max(dim, 1)
    return strides[::-1]


def as_wire_array(array):
    """The array as C-contiguous little-endian data of a wire dtype (copied only when needed)."""
    array = np.asarray(array)
    wire_dtype = array.dtype.newbyteorder("<")  # the same dtype when the host is little-endian
    if wire_dtype not in CODES:
        raise ValueError(f"dtype {array.dtype} has no wire code (supported: {sorted(map(str, CODES))})")
    if array.dtype != wire_dtype or not array.flags.c_contiguous:
        array = array.astype(wire_dtype, order="C")  # keeps 0-d arrays 0-d
    if array.ndim > MAX_DIMS:
        raise ValueError(f"{array.ndim} dimensions, the wire allows {MAX_DIMS}")
    return array


def encode_header(kind, request_id, target, arrays, status_code=0, message=b""):
    """Frame 0 of a message; `arrays` must already be wire arrays (see as_wire_array)."""
    target = target.encode("utf-8")
    if len(target) > MAX_TARGET_BYTES:
        raise ValueError(f"target is {len(target)} bytes, the wire allows {MAX_TARGET_BYTES}")
    if len(arrays) > MAX_TENSORS:
        raise ValueError(f"{len(arrays)} tensors, the wire allows {MAX_TENSORS}")
    parts = [
        FIXED.pack(MAGIC, VERSION, kind, 0, request_id, 0, 0, 0, 0, 0, 0, 0, 0,
                   status_code, len(target), len(arrays), len(message), 0),
        target,
        message,
    ]
    for array in arrays:
        shape = list(array.shape)
        parts.append(DESC.pack(CODES[array.dtype], array.ndim, 0, 0, array.nbytes))
        parts.append(struct.pack(f"<{2 * array.ndim}q", *shape, *contiguous_strides(shape)))
    return b"".join(parts)


# --- Decoding and validating a reply -----------------------------------------------------------------


def required_bytes(shape, strides, itemsize):
    """Bytes a layout spans (docs/wire-format.md, validation step 4)."""
    if any(dim == 0 for dim in shape):
        return 0
    return itemsize * (1 + sum((dim - 1) * stride for dim, stride in zip(shape, strides)))


def overlaps(shape, strides):
    """Whether two elements of a layout share memory, as the C++ side judges it (docs/wire-format.md,
    validation step 4): the dims of more than one element, by stride, must each step past the span
    of those before them."""
    if any(dim == 0 for dim in shape):
        return False
    spanned = 1
    for stride, dim in sorted((st, d) for d, st in zip(shape, strides) if d > 1):
        if stride < spanned:
            return True
        spanned = stride * dim
    return False


def decode_header(frame):
    """Parses and validates frame 0. Returns a dict; raises ValueError naming the problem."""
    buf = memoryview(frame).cast("B")
    size = len(buf)
    if size >= 4 and struct.unpack_from("<I", buf, 0)[0] != MAGIC:
        raise ValueError(f"wire header: bad magic 0x{struct.unpack_from('<I', buf, 0)[0]:08X}")
    if size >= 6 and struct.unpack_from("<H", buf, 4)[0] != VERSION:
        raise ValueError(f"wire header: version {struct.unpack_from('<H', buf, 4)[0]} not supported "
                         f"(expected {VERSION})")
    if size < FIXED.size:
        raise ValueError(f"wire header: truncated: {size} bytes, need at least {FIXED.size}")
    (_, _, kind, flags, request_id, _reserved, _node, *_times, status_code, target_len,
     num_tensors, message_len, reserved) = FIXED.unpack_from(buf, 0)
    if flags != 0:
        raise ValueError(f"wire header: flags 0x{flags:02X} not supported by this client")
    if reserved != 0:
        raise ValueError(f"wire header: reserved field 0x{reserved:08X} must be 0")
    if not 0 <= status_code <= 16:
        raise ValueError(f"wire header: status code {status_code} unknown")
    if target_len > MAX_TARGET_BYTES or message_len > MAX_MESSAGE_BYTES or num_tensors > MAX_TENSORS:
        raise ValueError("wire header: target, message or tensor count over its limit")
    pos = FIXED.size + target_len + message_len
    if size < pos:
        raise ValueError(f"wire header: truncated: {size} bytes, need at least {pos}")
    target = bytes(buf[FIXED.size:FIXED.size + target_len]).decode("utf-8", "replace")
    message = bytes(buf[FIXED.size + target_len:pos]).decode("utf-8", "replace")

    tensors = []
    for i in range(num_tensors):
        if size - pos < DESC.size:
            raise ValueError(f"tensor {i}: truncated descriptor")
        code, ndim, reserved16, reserved32, byte_count = DESC.unpack_from(buf, pos)
        pos += DESC.size
        if code not in DTYPES:
            raise ValueError(f"tensor {i}: dtype code {code} unknown or not supported by numpy")
        if ndim > MAX_DIMS:
            raise ValueError(f"tensor {i}: ndim {ndim} exceeds {MAX_DIMS}")
        if reserved16 != 0 or reserved32 != 0:
            raise ValueError(f"tensor {i}: reserved bytes 2..8 must be 0")
        if size - pos < 16 * ndim:
            raise ValueError(f"tensor {i}: truncated shape/strides")
        dims = struct.unpack_from(f"<{2 * ndim}q", buf, pos)
        pos += 16 * ndim
        shape, strides = list(dims[:ndim]), list(dims[ndim:])
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor {i}: negative dimension or stride in {shape} / {strides}")
        dtype = DTYPES[code]
        need = required_bytes(shape, strides, dtype.itemsize)
        if byte_count > MAX_TENSOR_BYTES or byte_count != need:
            raise ValueError(f"tensor {i}: byte count {byte_count} does not match shape {shape} "
                             f"strides {strides} x {dtype} ({need} bytes)")
        if overlaps(shape, strides):
            raise ValueError(f"tensor {i}: shape {shape} strides {strides}: elements may not overlap")
        tensors.append((dtype, shape, strides, byte_count))
    if pos != size:
        raise ValueError(f"wire header: {size - pos} trailing bytes")
    return dict(kind=kind, request_id=request_id, status_code=status_code, target=target,
                message=message, tensors=tensors)


def frame_to_array(frame, dtype, shape, strides):
    """A numpy array over the frame's bytes (no copy; the array keeps the frame alive)."""
    flat = np.frombuffer(frame, dtype=dtype)
    if any(dim == 0 for dim in shape) or strides == contiguous_strides(shape):
        return flat.reshape(shape)
    byte_strides = [s * dtype.itemsize for s in strides]
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=byte_strides, writeable=False)


# --- The client ----------------------------------------------------------------------------------------


def read_key_file(path, need_secret):
    """The Z85 keys of a `blockflowctl keygen` file: {'public-key': ..., 'secret-key': ...}.
    Lines `name = "value"`; `#` starts a comment. A secret key file must be private (mode 0600)."""
    keys = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, value = line.partition("=")
            keys[name.strip()] = value.strip().strip('"')
    wanted = ["public-key", "secret-key"] if need_secret else ["public-key"]
    for name in wanted:
        if len(keys.get(name, "")) != 40:
            raise ValueError(f"{path}: no 40-character {name}")
    if need_secret and os.stat(path).st_mode & 0o077:
        raise ValueError(f"{path}: a secret key file must be readable by its owner only (chmod 600)")
    return keys


class BlockflowClient:
    """A synchronous client of a blockflow::ClientEndpoint. One request at a time; not thread-safe."""

    def __init__(self, endpoint, timeout_s=60.0, key_file=None, server_key_file=None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)  # close() never waits for unsent requests
        self._socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        if key_file or server_key_file:
            if not (key_file and server_key_file):
                raise ValueError("CURVE needs both key_file (this client's .key_secret) and server_key_file")
            own = read_key_file(key_file, need_secret=True)
            server = read_key_file(server_key_file, need_secret=False)
            self._socket.setsockopt(zmq.CURVE_SERVERKEY, server["public-key"].encode())
            self._socket.setsockopt(zmq.CURVE_PUBLICKEY, own["public-key"].encode())
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, own["secret-key"].encode())
        self._socket.connect(endpoint)
        self._next_id = 1

    def close(self):
        self._socket.close()
        self._context.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, task, *arrays):
        """Runs `task` on the arrays; returns its outputs as a list of numpy arrays (views over
        the received frames: no copy).

        Raises RemoteError for a failed request, TimeoutError when no reply comes within
        timeout_s, ValueError for a reply that breaks the wire format.
        """
        request_id = self._next_id
        self._next_id += 1
        wire_arrays = [as_wire_array(a) for a in arrays]
        header = encode_header(KIND_SUBMIT, request_id, task, wire_arrays)
        # Tensor frames are the arrays' own bytes, flat (a view: no copy).
        frames = [header] + [a.reshape(-1).view(np.uint8) for a in wire_arrays]
        try:
            self._socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise TimeoutError(f"could not send request {request_id} to {self.endpoint} "
                               f"within {self.timeout_s} s") from None

        return self._wait_reply(request_id, task)

    def _wait_reply(self, request_id, task):
        deadline = time.monotonic() + self.timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._socket.poll(left_ms, zmq.POLLIN):
                raise TimeoutError(f"no reply to request {request_id} for task '{task}' from "
                                   f"{self.endpoint} within {self.timeout_s} s")
            frames = self._socket.recv_multipart(copy=False)
            reply = decode_header(frames[0].buffer)
            if reply["kind"] != KIND_REPLY:
                raise ValueError(f"expected a reply message (kind {KIND_REPLY}), got kind {reply['kind']}")
            if reply["request_id"] != request_id:
                if 0 < reply["request_id"] < request_id:
                    continue  # a late reply to an earlier request that timed out: not ours
                raise ValueError(f"reply for request {reply['request_id']}, expected {request_id}")
            tensor_frames = frames[1:]
            if len(tensor_frames) != len(reply["tensors"]):
                raise ValueError(f"wire message: {len(tensor_frames)} tensor frames, header describes "
                                 f"{len(reply['tensors'])} tensors")
            for i, (frame, (_, _, _, byte_count)) in enumerate(zip(tensor_frames, reply["tensors"])):
                if len(frame.buffer) != byte_count:
                    raise ValueError(f"tensor {i}: frame is {len(frame.buffer)} bytes, header says {byte_count}")
            if reply["status_code"] != 0:
                raise RemoteError(reply["status_code"], reply["message"])
            return [frame_to_array(frame.buffer, dtype, shape, strides)
                    for frame, (dtype, shape, strides, _) in zip(tensor_frames, reply["tensors"])]


# --- Demo against examples/serve.cpp --------------------------------------------------------------------


def main(argv):
    parser = argparse.ArgumentParser(prog=argv[0], description="Demo against examples/serve.")
    parser.add_argument("endpoint", help="e.g. tcp://127.0.0.1:5555, served by examples/serve")
    parser.add_argument("--key", help="this client's .key_secret file (CURVE; with --server-key)")
    parser.add_argument("--server-key", help="the server's .key file (CURVE; with --key)")
    args = parser.parse_args(argv[1:])
    if bool(args.key) != bool(args.server_key):
        parser.error("--key and --server-key go together")
    failures = []

    def check(ok, what):
        print(f"  check {what}: {'ok' if ok else 'FAILED'}")
        if not ok:
            failures.append(what)

    with BlockflowClient(args.endpoint, timeout_s=30, key_file=args.key, server_key_file=args.server_key) as client:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        (y,) = client.submit("affine", x)
        print(f"affine: x =\n{x}\n-> y =\n{y}")
        check(y.dtype == np.float32 and y.shape == (2, 3), "affine output is a 2x3 float32")
        check(np.array_equal(y, 3 * x + 1), "affine output == 3*x + 1")

        a = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float64)
        b = np.arange(6, dtype=np.float64).reshape(3, 2).T  # not contiguous: sent as a copy
        (s,) = client.submit("sum2", a, b)
        print(f"sum2: a =\n{a}\n+ b =\n{b}\n-> s =\n{s}")
        check(np.array_equal(s, a + b), "sum2 output == a + b")

        try:
            client.submit("fails", x)
            check(False, "'fails' raises RemoteError")
        except RemoteError as e:
            print(f"fails: RemoteError {e}")
            check(e.code_name == "FAILED_PRECONDITION" and "calibration" in e.message,
                  "'fails' raises RemoteError FAILED_PRECONDITION naming the cause")

    if failures:
        print(f"python client: FAIL ({len(failures)} check(s) failed: {'; '.join(failures)})")
        return 1
    print("python client: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
