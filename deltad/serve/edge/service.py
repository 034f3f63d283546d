"""The DeltaService servicer of one sidecar (one rank).

GetDelta streams pre-serialized messages (bytes) with no response serializer (gRPC sends the bytes as they are);
:func:`handlers` registers the service that way. Every RPC is bounded: GetDelta by a
concurrency limit and a deadline (deltad.serve.windows.streams), Redis calls by bounded retries (then
UNAVAILABLE). GetDelta itself is deltad.serve.windows.getdelta (its window decision a pure function,
deltad.serve.windows.decide), Status deltad.serve.edge.status_rpc; the requests' own fields are
checked once, at the edge (deltad.serve.edge.gate). At ``-v``: one log line per pull and per
commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from deltad.config import ServerConfig, clip
from deltad.errors import OffsetStoreError
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.edge.rollout_rpc import RolloutControl
from deltad.serve.edge.status_rpc import StatusRpc
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.rollout import cap_for
from deltad.serve.state.offsets import CommitRejected, OffsetStore, StoredCursor
from deltad.serve.state.owed import OwedStore
from deltad.serve.state.redis_calls import answer_by
from deltad.serve.windows.getdelta import WindowServer
from deltad.serve.windows.streams import StreamSlots
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)

#: Longest pull_id a Commit may carry (the server issues 32 hex digits).
MAX_PULL_ID = 128

SERVICE_NAME = "deltad.v1.DeltaService"

_REJECT_CODES = {
    "no_consumer": grpc.StatusCode.NOT_FOUND,
    "unknown_pull": grpc.StatusCode.FAILED_PRECONDITION,
    "mismatch": grpc.StatusCode.FAILED_PRECONDITION,
    "old_generation": grpc.StatusCode.FAILED_PRECONDITION,
    "behind": grpc.StatusCode.FAILED_PRECONDITION,
}


class DeltaServicer:
    """Implements deltad.v1.DeltaService over a SegmentLog and an OffsetStore."""

    def __init__(
        self,
        config: ServerConfig,
        seglog: SegmentLog,
        store: OffsetStore,
        owed: OwedStore,
        metrics: SidecarMetrics,
    ) -> None:
        self.config = config
        self.log = seglog
        self.store = store
        self.owed = owed
        self.metrics = metrics
        #: GetDelta's concurrency limit, waiting line and stream deadlines
        self.streams = StreamSlots(config, metrics)
        #: GetDelta itself
        self.windows = WindowServer(config, seglog, store, owed, metrics, self.streams)
        self.cache = self.windows.cache
        self.runs = self.windows.runs
        #: Set by a relay (deltad.serve.relay.mirror): the upstream it mirrors, shown in Status.
        self.upstream = ""
        #: The Rollout RPC (set by the sidecar once its release state is connected).
        self.rollout_control: RolloutControl | None = None
        #: Set by the server (deltad.serve.edge.app): why readiness is NOT_SERVING, or "".
        self.health_reason: Callable[[], str] = lambda: ""
        #: the Status RPC and its long polls
        self.status = StatusRpc(config, seglog, self.windows)

    # --- helpers -------------------------------------------------------------------------

    @property
    def refused(self) -> int:
        """GetDelta calls refused for want of a stream slot."""
        return self.streams.refused

    @property
    def _streams(self) -> int:
        return self.streams.active

    @property
    def _queue(self) -> Any:
        return self.streams.queue

    def cancel_overdue(self) -> int:
        """Cancel GetDelta streams past ``stream_deadline_s`` (see StreamSlots)."""
        return self.streams.cancel_overdue()

    # --- RPCs ----------------------------------------------------------------------------

    def GetDelta(self, req: pb.GetDeltaRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The consumer's window after its committed cursor: header, chunks, trailer (bytes);
        see deltad.serve.windows.getdelta."""
        return self.windows.serve(req, context)

    def Commit(self, req: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        """Forward-only commit of a cursor this server issued to this consumer."""
        started = time.monotonic()
        consumer = req.consumer  # checked at the edge
        c = req.cursor
        if c.consumer != consumer:
            _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"cursor belongs to consumer {clip(c.consumer)}, not {consumer!r}",
            )
        if c.rank != self.config.rank:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cursor is for rank {c.rank}; this sidecar serves rank {self.config.rank}",
            )
        snap = self.log.snapshot()
        if snap is not None and c.generation != snap.generation:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cursor is of generation {c.generation}; the log is at generation "
                f"{snap.generation}: pull again (resync)",
            )
        if not c.pull_id:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "cursor has no pull_id")
        if len(c.pull_id) > MAX_PULL_ID:  # ours are 32 hex digits
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pull_id {clip(c.pull_id, 40)} is longer than {MAX_PULL_ID} characters",
            )
        try:
            stored = self.store.commit(
                consumer,
                self.config.rank,
                pull_id=c.pull_id,
                generation=c.generation,
                seq=c.seq,
                step=c.step,
            )
        except CommitRejected as e:
            _abort(context, _REJECT_CODES[e.reason], str(e))
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        # Keep the committed rows and those of a pull made since (a commit of this cursor
        # repeated after a newer pull must not delete that pull's owed rows).
        try:
            pending = self.store.pending_pulls([consumer], self.config.rank)[consumer]
        except OffsetStoreError as e:
            log.warning("%s: owed files not collected: %s", consumer, e)
        else:
            self.owed.gc(consumer, {stored.owed_token, pending.owed_token if pending else ""})
        log.info(
            "commit %s rank %d seq %d step %d (owed rows %d): %.0f ms", consumer,
            self.config.rank, stored.seq, stored.step, stored.owed_rows,
            (time.monotonic() - started) * 1000,
        )  # fmt: skip
        return pb.CommitResponse(committed=self._cursor_pb(consumer, stored))

    def _cursor_pb(self, consumer: str, s: StoredCursor | None) -> pb.Cursor:
        if s is None:
            return pb.Cursor(consumer=consumer, rank=self.config.rank, seq=-1, step=-1)
        return pb.Cursor(
            consumer=consumer,
            rank=self.config.rank,
            generation=s.generation,
            seq=s.seq,
            step=s.step,
            pull_id=s.pull_id,
        )

    def Register(
        self, req: pb.RegisterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterResponse:
        """Create or renew the lease; answer the committed cursor (seq -1: none)."""
        consumer = req.consumer  # checked at the edge
        ttl = req.lease_ttl_seconds or self.config.lease_ttl_s  # in (0, 86400]: the edge
        try:
            self.store.register(consumer, ttl)
            stored = self.store.get_cursor(consumer, self.config.rank)
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.RegisterResponse(cursor=self._cursor_pb(consumer, stored), lease_ttl_seconds=ttl)

    def Heartbeat(
        self, req: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        """Renew a registered consumer's lease (or end it: ``release``)."""
        consumer = req.consumer  # checked at the edge
        try:
            if req.release:
                self.store.release(consumer)
                return pb.HeartbeatResponse(lease_expires_in_seconds=0.0)
            left = self.store.heartbeat(consumer, self.config.lease_ttl_s)
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        if left is None:
            _abort(
                context, grpc.StatusCode.NOT_FOUND, f"unknown consumer {consumer!r}: Register first"
            )
        return pb.HeartbeatResponse(lease_expires_in_seconds=left)

    def consumer_infos(self) -> list[pb.ConsumerInfo]:
        """Every known consumer's standing on this rank (also feeds the lag metrics)."""
        snap = self.log.snapshot()
        names = self.store.consumers()
        leases = self.store.lease_remaining(names)
        cursors = self.store.cursors(names, self.config.rank)
        elsewhere = self._consumers_of_other_ranks(snap, [n for n in names if cursors[n] is None])
        now = time.time()
        out = []
        exported: set[str] = set()
        worst = (0, 0.0)  # the largest lag of a live consumer: segments, seconds
        state = self.windows.rollout.state()
        for name in names:
            stored = cursors[name]
            cap = (
                self.windows.cap(name, snap.generation)[1]
                if snap is not None
                else cap_for(state, name).max_step
            )
            info = pb.ConsumerInfo(
                consumer=name,
                cursor=self._cursor_pb(name, stored),
                live=leases[name] > 0,
                lease_expires_in_seconds=leases[name],
                owed_rows=stored.owed_rows if stored else 0,
                cap_step=-1 if cap is None else cap,
            )
            if name in elsewhere:  # (a per-rank relay of another rank: not behind here)
                info.lag_segments = -1
            elif snap is not None:
                seq = -1 if stored is None or stored.generation != snap.generation else stored.seq
                info.lag_segments = max(0, snap.head.seq - seq)
                info.lag_seconds = lag_seconds(snap, seq, now)
                if info.live:  # (a series per name ever seen would grow for forget_after_s)
                    self.metrics.set_lag(name, info.lag_segments, info.lag_seconds)
                    exported.add(name)
                    worst = (max(worst[0], info.lag_segments), max(worst[1], info.lag_seconds))
            out.append(info)
        self.metrics.keep_lag_of(exported)
        live = sum(1 for n in names if leases[n] > 0)
        self.metrics.set_consumers(live, len(names) - live, *worst)
        return out

    def _consumers_of_other_ranks(self, snap: LogSnapshot | None, names: list[str]) -> set[str]:
        """Of ``names`` (consumers with no cursor on this rank), those with one on another
        rank: they consume other ranks only (a relay per rank, a consumer of some ranks), so
        they are not behind on this one (``lag_segments`` -1, no lag series). A consumer with
        no cursor anywhere (registered, never committed) is behind everywhere."""
        world = snap.manifest.world_size if snap is not None else 1
        left = set(names)
        found: set[str] = set()
        for rank in range(world):
            if not left:
                break
            if rank == self.config.rank:
                continue
            got = self.store.cursors(sorted(left), rank)
            hits = {n for n, c in got.items() if c is not None}
            found |= hits
            left -= hits
        return found

    def ListConsumers(
        self, req: pb.ListConsumersRequest, context: grpc.ServicerContext
    ) -> pb.ListConsumersResponse:
        """Every known consumer with cursor, liveness, lag and owed rows on this rank."""
        try:
            return pb.ListConsumersResponse(consumers=self.consumer_infos())
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))

    def Forget(self, req: pb.ForgetRequest, context: grpc.ServicerContext) -> pb.ForgetResponse:
        """Drop a consumer's state on every rank (admin; see the proto)."""
        name = req.consumer  # checked at the edge
        snap = self.log.snapshot()
        world = max(snap.manifest.world_size if snap is not None else 1, self.config.rank + 1)
        try:
            forgotten = self.store.forget(name, world)
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        self.owed.drop(name)
        self.metrics.keep_lag_of(set(self.store.consumers()))
        log.warning("consumer %r forgotten by an admin request (known: %s)", name, forgotten)
        return pb.ForgetResponse(forgotten=forgotten)

    def Status(self, req: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        """Model, generation, head, base, log size, quarantine count and local tables; with
        ``wait_ms`` a long poll (see deltad.serve.edge.status_rpc)."""
        return self.status.Status(
            req, context, upstream=self.upstream, health_reason=self.health_reason
        )

    def Rollout(self, req: pb.RolloutRequest, context: grpc.ServicerContext) -> pb.RolloutResponse:
        """Read or change the model's release state (admin; see deltad.serve.edge.rollout_rpc)."""
        if self.rollout_control is None:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "the release state is not connected yet")
        return self.rollout_control.Rollout(req, context)


def lag_seconds(snap: LogSnapshot, seq: int, now: float) -> float:
    """Age of the oldest step a consumer at ``seq`` has not committed: when the trainer
    published it (a merged entry it stands before: its oldest input's time; one it stands
    inside: the entry's newest), 0 if it is at the head. Merges do not make it younger."""
    pending = next((e for e in snap.entries if e.seq > seq), None)
    if pending is None:
        return 0.0
    t = pending.first_created_unix if seq < pending.first_seq else pending.created_unix
    return max(0.0, now - t)


def handlers(servicer: DeltaServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers; GetDelta's responses are already serialized bytes."""

    def unary(fn: Any, req: Any, resp: Any) -> grpc.RpcMethodHandler:
        def bounded(request: Any, context: grpc.ServicerContext) -> Any:
            # (its calls to Redis give up in time to answer before the caller's deadline)
            with answer_by(context.time_remaining()):
                return fn(request, context)

        return grpc.unary_unary_rpc_method_handler(
            bounded, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "GetDelta": grpc.unary_stream_rpc_method_handler(
                servicer.GetDelta,
                request_deserializer=pb.GetDeltaRequest.FromString,
                response_serializer=None,  # (bytes already: gRPC sends them as they are)
            ),
            "Commit": unary(servicer.Commit, pb.CommitRequest, pb.CommitResponse),
            "Register": unary(servicer.Register, pb.RegisterRequest, pb.RegisterResponse),
            "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse),
            "ListConsumers": unary(
                servicer.ListConsumers, pb.ListConsumersRequest, pb.ListConsumersResponse
            ),
            "Status": unary(servicer.Status, pb.StatusRequest, pb.StatusResponse),
            "Forget": unary(servicer.Forget, pb.ForgetRequest, pb.ForgetResponse),
            "Rollout": unary(servicer.Rollout, pb.RolloutRequest, pb.RolloutResponse),
        },
    )
