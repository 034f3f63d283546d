"""The two wire baselines GetDelta is compared with, each server in its own process.

* **raw TCP**: loopback socket, the server ``sendall``s a preallocated buffer in chunks, the
  client ``recv_into``s a preallocated buffer (the ceiling on one machine).
* **bare gRPC**: the fastest recipe measured for gRPC Python. A server-streaming method whose messages are built by
  hand in one copy (protobuf tag + varint length joined with a memoryview of the payload,
  shaped like ``GetDeltaResponse{chunk{values}}``) and passed through an identity serializer;
  the client takes raw bytes (no protobuf parsing) and copies each payload into a tensor
  allocated for the stream; its channel either default or with the SingleThreadedUnaryStream
  option (the one deltad's consumer uses), whichever is faster.

Every baseline process applies :func:`deltad.perf.tune_malloc`, as deltad's own do.

Servers are started with :func:`start_tcp_server` / :func:`start_grpc_server` (spawned
processes); clients run in a :class:`ClientWorker` process driven over a pipe so that no
measurement shares a process with the harness.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

_REQ = struct.Struct("<QQ")  # nbytes, chunk
_METHOD = "/deltad.bench.Bare/Stream"
#: the same stream from messages built once and shared by every call (the fan-out floor)
_SHARED_METHOD = "/deltad.bench.Bare/StreamShared"
MAX_MSG = 64 * 1024 * 1024


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = 0
    result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def chunk_prefix(n: int) -> bytes:
    """Serialized ``GetDeltaResponse{chunk: RowChunk{values: <n bytes>}}`` up to the payload."""
    inner = b"\x32" + _varint(n)  # RowChunk.values = field 6, wire type 2
    return b"\x12" + _varint(len(inner) + n) + inner  # GetDeltaResponse.chunk = field 2


def payload_offset(msg: bytes) -> int:
    """Where the payload starts in a message made by :func:`chunk_prefix`."""
    _, pos = _read_varint(msg, 1)
    _, pos = _read_varint(msg, pos + 1)
    return pos


def _source(nbytes: int) -> Any:
    import numpy as np

    buf = np.empty(nbytes, dtype=np.uint8)
    buf[:] = 7  # touch every page before any timing
    return buf


# --------------------------------------------------------------------------- raw TCP


def _tune() -> None:
    """The allocator settings deltad's own processes use (`deltad serve` / `deltad consume`):
    a baseline must not lose for want of a knob deltad turns (measured: 1.3 -> 2.1 GB/s)."""
    from deltad.perf import tune_malloc

    tune_malloc()


def tcp_server_main(port_conn: Any, max_bytes: int) -> None:
    """Spawned: serve clients one after another; per request ``(nbytes, chunk)`` send nbytes.

    A client's EOF ends its connection (the next one is accepted); a request of 0 bytes ends
    the server.
    """
    _tune()
    src = _source(max_bytes).data
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port_conn.send(ls.getsockname()[1])
    try:
        while True:
            conn, _ = ls.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    req = _recv_exact(conn, _REQ.size)
                    if req is None:
                        break
                    nbytes, chunk = _REQ.unpack(req)
                    if nbytes == 0:
                        return
                    off = 0
                    while off < nbytes:
                        n = min(chunk, nbytes - off)
                        conn.sendall(src[off : off + n])
                        off += n
            finally:
                conn.close()
    finally:
        ls.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            return None
        data += part
    return data


# --------------------------------------------------------------------------- bare gRPC


def grpc_server_main(port_conn: Any, max_bytes: int) -> None:
    """Spawned: a bare gRPC server streaming pre-serialized chunks of a preallocated buffer.

    ``Stream`` builds each message as it sends it (one copy, as deltad encodes a window);
    ``StreamShared`` sends messages built once per ``(nbytes, chunk)`` and shared by every
    call, so a call costs only gRPC's own send path: the floor of serving one window to many.
    """
    import threading

    import grpc

    _tune()

    src = _source(max_bytes).data
    built: dict[tuple[int, int], list[bytes]] = {}
    lock = threading.Lock()

    def messages(nbytes: int, chunk: int) -> Any:
        off = 0
        while off < nbytes:
            n = min(chunk, nbytes - off)
            yield b"".join((chunk_prefix(n), src[off : off + n]))
            off += n

    def stream(request: bytes, context: Any) -> Any:
        return messages(*_REQ.unpack(request))

    def stream_shared(request: bytes, context: Any) -> Any:
        key = _REQ.unpack(request)
        with lock:
            if key not in built:
                built[key] = list(messages(*key))
            msgs = built[key]
        yield from msgs

    def method(fn: Any) -> Any:
        return grpc.unary_stream_rpc_method_handler(
            fn, request_deserializer=None, response_serializer=None
        )

    handler = grpc.method_handlers_generic_handler(
        "deltad.bench.Bare", {"Stream": method(stream), "StreamShared": method(stream_shared)}
    )
    opts = [
        ("grpc.max_send_message_length", MAX_MSG),
        ("grpc.max_receive_message_length", MAX_MSG),
    ]
    # as many streams at once as the fan-out benchmark runs consumers
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_conn.send(port)
    # Serve until the parent closes the pipe (or terminates us).
    try:
        port_conn.recv()
    except EOFError:
        pass
    server.stop(grace=1).wait(5)


# --------------------------------------------------------------------------- client worker


def client_worker_main(conn: Any) -> None:
    """Spawned: run measurement commands sent over ``conn`` and send back results.

    Commands are ``(name, kwargs)``; the reply is ``("ok", result)`` or ``("error", text)``.
    ``("exit", {})`` ends the worker.
    """
    import traceback

    _tune()
    state: dict[Any, Any] = {}
    while True:
        try:
            name, kw = conn.recv()
        except EOFError:
            break
        if name == "exit":
            break
        try:
            fn = _COMMANDS[name]
            conn.send(("ok", fn(state, **kw)))
        except Exception:
            conn.send(("error", traceback.format_exc(limit=8)))
    for closer in state.get("_close", []):
        try:
            closer()
        except Exception:
            pass


def _cmd_tcp(state: dict[Any, Any], port: int, nbytes: int, chunk: int) -> dict[str, Any]:
    import numpy as np

    sock = state.get(("tcp", port))
    if sock is None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state[("tcp", port)] = sock
        state.setdefault("_close", []).append(sock.close)
    buf = state.get("tcp_buf")
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        buf[:] = 0
        state["tcp_buf"] = buf
    view = buf.data
    t0 = time.perf_counter()
    sock.sendall(_REQ.pack(nbytes, chunk))
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:nbytes], min(nbytes - got, 4 * 1024 * 1024))
        if n == 0:
            raise ConnectionError("tcp server closed early")
        got += n
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes": got}


def _cmd_tcp_close(state: dict[Any, Any], port: int) -> dict[str, Any]:
    sock = state.pop(("tcp", port), None)
    if sock is not None:
        sock.sendall(_REQ.pack(0, 0))
        sock.close()
    return {}


def _cmd_grpc(
    state: dict[Any, Any],
    port: int,
    nbytes: int,
    chunk: int,
    single_thread: bool = False,
    reuse: bool = False,
    shared: bool = False,
    start_at: float | None = None,
) -> dict[str, Any]:
    """One bare stream of ``nbytes``; ``single_thread``: the channel option that lets the
    reading thread drive the stream (no channel thread handing messages over); ``reuse``:
    copy into the destination tensor of the previous stream instead of a new one (as
    deltad's consumer does with its buffer pool); ``shared``: the server's messages built once
    for every call; ``start_at`` (unix time): start then (several workers at one moment)."""
    import grpc
    import grpc.experimental
    import torch

    ch = state.get(("grpc", port, single_thread))
    if ch is None:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", MAX_MSG),
            ("grpc.max_receive_message_length", MAX_MSG),
        ]
        if single_thread:
            opts.append((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1))
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        grpc.channel_ready_future(ch).result(timeout=30)
        state[("grpc", port, single_thread)] = ch
        state.setdefault("_close", []).append(ch.close)
    method = _SHARED_METHOD if shared else _METHOD
    call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    start_unix = time.time()
    t0 = time.perf_counter()
    out = state.get(("grpc-out", nbytes)) if reuse else None
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
        if reuse:
            state[("grpc-out", nbytes)] = out
    dst = out.numpy().data
    got = 0
    for msg in call(_REQ.pack(nbytes, chunk), timeout=600):
        p = payload_offset(msg)
        n = len(msg) - p
        dst[got : got + n] = memoryview(msg)[p:]
        got += n
    dt = time.perf_counter() - t0
    if got != nbytes:
        raise RuntimeError(f"bare grpc: got {got} of {nbytes} bytes")
    return {"seconds": dt, "bytes": got, "start_unix": start_unix, "end_unix": time.time()}


def _cmd_call(state: dict[Any, Any], module: str, func: str, kwargs: dict[str, Any]) -> Any:
    """Run ``module.func(state, **kwargs)`` in the worker (deltad client measurements)."""
    import importlib

    return getattr(importlib.import_module(module), func)(state, **kwargs)


_COMMANDS: dict[str, Callable[..., Any]] = {
    "tcp": _cmd_tcp,
    "tcp_close": _cmd_tcp_close,
    "grpc": _cmd_grpc,
    "call": _cmd_call,
}


class ClientWorker:
    """A spawned client process driven by :meth:`call`; stopped by :meth:`close`."""

    def __init__(self, children: Any) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = children.process(client_worker_main, child)
        child.close()

    def call(self, name: str, timeout_s: float = 900.0, **kw: Any) -> Any:
        self.send(name, **kw)
        return self.recv(name, timeout_s)

    def send(self, name: str, **kw: Any) -> None:
        """Start a command without waiting (pair with :meth:`recv`)."""
        self.conn.send((name, kw))

    def recv(self, name: str = "command", timeout_s: float = 900.0) -> Any:
        """The result of the command started last."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"client worker: {name} took more than {timeout_s}s")
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"client worker {name} failed:\n{result}")
        return result

    def close(self) -> None:
        try:
            self.conn.send(("exit", {}))
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout=10)


def start_server(
    children: Any, target: Any, max_bytes: int, timeout_s: float = 60.0
) -> tuple[Any, int, int]:
    """Spawn a baseline server process; return (parent end of its pipe, port, pid)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = children.process(target, child, max_bytes)
    child.close()
    if not parent.poll(timeout_s):
        raise TimeoutError("baseline server did not start")
    port = int(parent.recv())
    return parent, port, int(proc.pid)
