"""A gRPC server that replays recorded conformance vectors (docs/conformance.md) to a client.

    python -m deltad.conformance.replay --vectors tests/vectors --port 0

prints ``replaying <n> vectors on <host:port>[,<host:port> ...]`` (one endpoint per rank, in
rank order) and serves ``deltad.v1.DeltaService`` on each until SIGTERM / SIGINT. A call picks
its vector by the ``deltad-vector`` metadata key, else by its consumer name (a vector's
consumer is its name), else as the last call from the same peer did, else ``--vector``.

Each (vector, rank) replays its recorded pulls in order: Status answers the status recorded
before the next pull, GetDelta serves the next recorded stream (the first attempt of a pull
recorded with ``cut_after`` is cut, UNAVAILABLE, and a request resuming it gets the recorded
rest; one with ``refuse_first_ms`` is first refused RESOURCE_EXHAUSTED with
``deltad-retry-after-ms``), Register and Commit answer as recorded. Past the last pull a
refused (hostile) pull is served again, else an empty window at the last cursor. Forget (the
vector's consumer) starts the vector over. Every call is logged (``--log``: JSON lines).

Credentials, to test a client's: ``--token T`` refuses (UNAUTHENTICATED) every call without
exactly one ``authorization: Bearer T``; ``--tls-cert/--tls-key`` serve TLS, and
``--tls-client-ca`` requires a client certificate it signed (mTLS).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deltad.conformance import vectors as vf
from deltad.v1 import delta_pb2 as pb

SERVICE = "deltad.v1.DeltaService"
VECTOR_KEY = "deltad-vector"
RETRY_AFTER_KEY = "deltad-retry-after-ms"
#: the longest a long poll is held (as a sidecar: STATUS_MAX_WAIT_S)
MAX_WAIT_S = 30.0


@dataclass
class _Progress:
    index: int = 0  # the next pull
    attempts: int = 0  # attempts at it so far
    cursor: pb.Cursor | None = None  # the last served trailer's cursor


@dataclass
class Replayer:
    """The replay state of every (vector, rank), shared by the rank servers."""

    vectors: dict[str, vf.Vector]
    default: str | None = None
    log_path: Path | None = None
    #: every call must carry exactly one ``authorization: Bearer <token>`` (None: no check)
    token: str | None = None
    log: list[dict[str, Any]] = field(default_factory=list)
    _progress: dict[tuple[str, int], _Progress] = field(default_factory=dict)
    _peers: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, name: str | None = None) -> None:
        """Start ``name`` (or every vector) over."""
        with self._lock:
            for key in list(self._progress):
                if name is None or key[0] == name:
                    del self._progress[key]

    def _note(self, entry: dict[str, Any]) -> None:
        entry["t"] = round(time.time(), 3)
        with self._lock:
            self.log.append(entry)
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    f.write(json.dumps(entry) + "\n")

    def commits(self, name: str, rank: int) -> list[pb.Cursor]:
        """The cursors committed to ``name``'s rank, in order."""
        out = []
        for e in self.log:
            if e["vector"] == name and e["rank"] == rank and e["method"] == "Commit" and e["ok"]:
                c = pb.Cursor()
                c.ParseFromString(bytes.fromhex(e["cursor"]))
                out.append(c)
        return out

    def calls(self, name: str, method: str) -> list[dict[str, Any]]:
        return [e for e in self.log if e["vector"] == name and e["method"] == method]

    # ---- vector lookup -------------------------------------------------------------------

    def vector_of(self, context: grpc.ServicerContext, consumer: str, rank: int) -> vf.Vector:
        name = ""
        auth = []
        for key, value in context.invocation_metadata() or ():
            if key == VECTOR_KEY:
                name = str(value)
            elif key == "authorization":
                auth.append(str(value))
        if self.token is not None and auth != [f"Bearer {self.token}"]:
            why = "more than one authorization header" if len(auth) > 1 else "invalid bearer token"
            self._note({"vector": name or consumer, "rank": rank, "method": "auth", "ok": False})
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"replay: {why}")
        peer = context.peer() or ""
        with self._lock:
            if not name and consumer:
                name = consumer
            if not name:
                name = self._peers.get(peer, "") or (self.default or "")
            if name in self.vectors:
                self._peers[peer] = name
        v = self.vectors.get(name)
        if v is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"replay: no vector {name or consumer!r} (name it with the consumer name or "
                f"the {VECTOR_KEY} metadata key)",
            )
            raise AssertionError  # (abort raises)
        if rank >= v.world_size:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"replay: vector {v.name} has {v.world_size} rank(s), this is rank {rank}",
            )
        return v

    def progress(self, v: vf.Vector, rank: int) -> _Progress:
        with self._lock:
            return self._progress.setdefault((v.name, rank), _Progress())

    # ---- the RPCs ------------------------------------------------------------------------

    def status(self, rank: int, req: pb.StatusRequest, context: grpc.ServicerContext) -> bytes:
        v = self.vector_of(context, req.consumer, rank)
        pulls = v.ranks[rank].pulls
        p = self.progress(v, rank)
        rec = pulls[min(p.index, len(pulls) - 1)]
        resp = pb.StatusResponse.FromString(v.bytes_of(rec.status))
        if req.wait_ms:
            resp.waited = True
            if (resp.generation, resp.head_seq) <= (req.after_generation, req.after_seq):
                left = context.time_remaining()
                wait = min(req.wait_ms / 1000, MAX_WAIT_S, left if left is not None else MAX_WAIT_S)
                end = time.monotonic() + max(0.0, wait - 0.05)
                while time.monotonic() < end and context.is_active():
                    time.sleep(0.05)
        self._note({"vector": v.name, "rank": rank, "method": "Status", "ok": True,
                    "index": p.index, "wait_ms": req.wait_ms})  # fmt: skip
        return resp.SerializeToString()

    def register(self, rank: int, req: pb.RegisterRequest, context: grpc.ServicerContext) -> bytes:
        v = self.vector_of(context, req.consumer, rank)
        self._note({"vector": v.name, "rank": rank, "method": "Register", "ok": True})
        return v.bytes_of(v.ranks[rank].register)

    def heartbeat(
        self, rank: int, req: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> bytes:
        v = self.vector_of(context, req.consumer, rank)
        self._note({"vector": v.name, "rank": rank, "method": "Heartbeat", "ok": True,
                    "release": req.release})  # fmt: skip
        return pb.HeartbeatResponse(
            lease_expires_in_seconds=0.0 if req.release else 30.0
        ).SerializeToString()

    def forget(self, rank: int, req: pb.ForgetRequest, context: grpc.ServicerContext) -> bytes:
        v = self.vector_of(context, req.consumer, rank)
        self.reset(v.name)
        self._note({"vector": v.name, "rank": rank, "method": "Forget", "ok": True})
        return pb.ForgetResponse(forgotten=True).SerializeToString()

    def commit(self, rank: int, req: pb.CommitRequest, context: grpc.ServicerContext) -> bytes:
        v = self.vector_of(context, req.consumer, rank)
        entry = {"vector": v.name, "rank": rank, "method": "Commit",
                 "cursor": req.cursor.SerializeToString().hex(), "ok": False}  # fmt: skip
        for rec in v.ranks[rank].pulls:
            if rec.commit is None:
                continue
            resp = pb.CommitResponse.FromString(v.bytes_of(rec.commit))
            if resp.committed == req.cursor:
                entry["ok"] = True
                self._note(entry)
                return resp.SerializeToString()
        self._note(entry)
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"replay: vector {v.name} rank {rank}: cursor seq {req.cursor.seq} pull "
            f"{req.cursor.pull_id!r} is not one the recording committed",
        )
        raise AssertionError

    def get_delta(
        self, rank: int, req: pb.GetDeltaRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        v = self.vector_of(context, req.consumer, rank)
        pulls = v.ranks[rank].pulls
        p = self.progress(v, rank)
        entry: dict[str, Any] = {"vector": v.name, "rank": rank, "method": "GetDelta",
                                 "index": p.index, "ok": False}  # fmt: skip
        if p.index >= len(pulls):
            last = pulls[-1]
            if last.commit is None:  # a refused (hostile) pull: served again
                entry["served"] = "again"
                self._note(entry)
                yield from v.stream(last.stream)
                return
            entry["served"] = "empty"
            self._note(entry)
            yield from _empty_window(v, last)
            return
        rec = pulls[p.index]
        p.attempts += 1
        if rec.refuse_first_ms is not None and p.attempts == 1:
            entry["served"] = "refused"
            self._note(entry)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(rec.refuse_first_ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "replay: at the stream limit")
        msgs = v.stream(rec.stream)
        if req.HasField("resume") and rec.resumed_stream is not None:
            head = pb.GetDeltaResponse.FromString(msgs[0]).header
            r = req.resume
            if (r.generation, r.to_seq, r.from_seq, r.messages) == (
                head.generation, head.to_seq, head.from_seq, rec.cut_after,
            ):  # fmt: skip
                msgs = v.stream(rec.resumed_stream)
                entry["served"] = "resumed"
        cut = rec.cut_after is not None and p.attempts == (2 if rec.refuse_first_ms else 1)
        if cut:
            assert rec.cut_after is not None
            entry["served"] = f"cut after {rec.cut_after}"
            self._note(entry)
            yield from msgs[: 1 + rec.cut_after]
            context.abort(grpc.StatusCode.UNAVAILABLE, "replay: the stream broke")
        entry.setdefault("served", "stream")
        for m in msgs:
            if not context.is_active():
                self._note(entry)
                return
            yield m
        with self._lock:
            p.index += 1
            p.attempts = 0
        entry["ok"] = True
        self._note(entry)


def _empty_window(v: vf.Vector, last: vf.PullRecord) -> Iterator[bytes]:
    """An empty window at the last recorded pull's cursor (nothing new)."""
    msgs = v.stream(last.stream)
    h = pb.GetDeltaResponse.FromString(msgs[0]).header
    t = pb.GetDeltaResponse.FromString(msgs[-1]).trailer
    header = pb.DeltaHeader(
        rank=h.rank, generation=t.cursor.generation, from_seq=t.cursor.seq, to_seq=t.cursor.seq,
        to_step=t.cursor.step, form=h.form, dtype=h.dtype, row_alignment=h.row_alignment,
    )  # fmt: skip
    yield pb.GetDeltaResponse(header=header).SerializeToString()
    trailer = pb.DeltaTrailer(cursor=t.cursor)
    yield pb.GetDeltaResponse(trailer=trailer).SerializeToString()


def _identity(b: bytes) -> bytes:
    return b


def handler(replayer: Replayer, rank: int) -> grpc.GenericRpcHandler:
    """The DeltaService of ``rank``: answers are the recorded bytes, sent as they are."""

    def unary(fn: Any, request_type: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: fn(rank, req, ctx),
            request_deserializer=request_type.FromString,
            response_serializer=_identity,
        )

    def unimplemented(req: Any, ctx: grpc.ServicerContext) -> bytes:
        ctx.abort(grpc.StatusCode.UNIMPLEMENTED, "replay: not recorded")
        raise AssertionError

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "GetDelta": grpc.unary_stream_rpc_method_handler(
                lambda req, ctx: replayer.get_delta(rank, req, ctx),
                request_deserializer=pb.GetDeltaRequest.FromString,
                response_serializer=_identity,
            ),
            "Status": unary(replayer.status, pb.StatusRequest),
            "Register": unary(replayer.register, pb.RegisterRequest),
            "Heartbeat": unary(replayer.heartbeat, pb.HeartbeatRequest),
            "Commit": unary(replayer.commit, pb.CommitRequest),
            "Forget": unary(replayer.forget, pb.ForgetRequest),
            "ListConsumers": grpc.unary_unary_rpc_method_handler(
                unimplemented, request_deserializer=pb.ListConsumersRequest.FromString
            ),
            "Rollout": grpc.unary_unary_rpc_method_handler(
                unimplemented, request_deserializer=pb.RolloutRequest.FromString
            ),
        },
    )


class ReplayServer:
    """One gRPC server per rank (rank ``r`` on ``port + r``, or free ports for port 0)."""

    def __init__(
        self,
        vectors_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ranks: int = 0,
        vector: str | None = None,
        log_path: Path | None = None,
        token: str | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        tls_client_ca: Path | None = None,
    ) -> None:
        if (tls_cert is None) != (tls_key is None) or (tls_client_ca and not tls_cert):
            raise ValueError("TLS needs --tls-cert and --tls-key (and them for --tls-client-ca)")
        self.credentials = None
        if tls_cert is not None and tls_key is not None:
            self.credentials = grpc.ssl_server_credentials(
                [(tls_key.read_bytes(), tls_cert.read_bytes())],
                root_certificates=tls_client_ca.read_bytes() if tls_client_ca else None,
                require_client_auth=tls_client_ca is not None,
            )
        vecs = vf.load_all(vectors_dir)
        if not vecs:
            raise ValueError(f"no vectors (*/{vf.MANIFEST}) in {vectors_dir}")
        if vector is not None and vector not in vecs:
            raise ValueError(f"no vector {vector!r} in {vectors_dir}")
        self.replayer = Replayer(vecs, vector, log_path, token)
        self.ranks = ranks or max(v.world_size for v in vecs.values())
        self.host, self.port = host, port
        self.servers: list[grpc.Server] = []
        self.endpoints: list[str] = []

    def start(self) -> ReplayServer:
        for r in range(self.ranks):
            s = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            s.add_generic_rpc_handlers((handler(self.replayer, r),))
            address = f"{self.host}:{self.port + r if self.port else 0}"
            bound = (
                s.add_secure_port(address, self.credentials)
                if self.credentials is not None
                else s.add_insecure_port(address)
            )
            if not bound:
                raise OSError(f"cannot listen on {self.host}:{self.port + r}")
            s.start()
            self.servers.append(s)
            self.endpoints.append(f"{self.host}:{bound}")
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop(0)

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m deltad.conformance.replay",
        description="Replay recorded conformance vectors as a DeltaService (one port per rank).",
    )
    p.add_argument("--vectors", type=Path, required=True, help="directory of vector directories")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="rank r listens on port + r (0: free ports)")
    p.add_argument(
        "--ranks", type=int, default=0, help="rank servers (0: the vectors' largest world)"
    )
    p.add_argument("--vector", default=None, help="vector of calls that name none")
    p.add_argument("--log", type=Path, default=None, help="append every call as a JSON line")
    p.add_argument("--token", default=None, help="require `authorization: Bearer TOKEN`")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS with this certificate")
    p.add_argument("--tls-key", type=Path, default=None, help="and this key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, default=None, help="require client certs (mTLS)")
    args = p.parse_args(argv)
    try:
        srv = ReplayServer(
            args.vectors, host=args.host, port=args.port, ranks=args.ranks, vector=args.vector,
            log_path=args.log, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        ).start()  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    print(f"replaying {len(srv.replayer.vectors)} vectors on {','.join(srv.endpoints)}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
