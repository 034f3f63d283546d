"""The DeltaService servicer of one sidecar (one rank).

GetDelta streams pre-serialized messages (bytes) through an identity response serializer;
:func:`handlers` registers the service that way. Every RPC is bounded: GetDelta by a
concurrency limit and a deadline, Redis calls by bounded retries (then UNAVAILABLE).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any, NoReturn

import grpc

from deltad import wire
from deltad.config import ServerConfig, check_name, clip
from deltad.errors import ConfigError, OffsetStoreError, SpoolError
from deltad.serve import encode
from deltad.serve.log import LogSnapshot, SegmentLog
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.offsets import CommitRejected, OffsetStore, PullRecord, StoredCursor
from deltad.serve.owed import OwedStore
from deltad.serve.pull import (
    EncodedWindow,
    WindowCache,
    WindowSpec,
    build_window,
    packed_refusal,
)
from deltad.serve.runs import RunCache
from deltad.types import Form
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = "deltad.v1.DeltaService"
MIN_CHUNK_BYTES = 64 * 1024
#: k, max_rows above this are rejected as absurd.
MAX_COUNT = 1 << 40

_REJECT_CODES = {
    "no_consumer": grpc.StatusCode.NOT_FOUND,
    "unknown_pull": grpc.StatusCode.FAILED_PRECONDITION,
    "mismatch": grpc.StatusCode.FAILED_PRECONDITION,
    "old_generation": grpc.StatusCode.FAILED_PRECONDITION,
    "behind": grpc.StatusCode.FAILED_PRECONDITION,
}


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort raises


class _StreamSlot:
    """One unit of the GetDelta concurrency limit, with its stream's deadline; release is
    idempotent."""

    def __init__(
        self, owner: DeltaServicer, context: grpc.ServicerContext, consumer: str, deadline: float
    ) -> None:
        self.owner = owner
        self.context = context
        self.consumer = consumer
        self.deadline = deadline
        self.started = time.monotonic()
        self.held = True

    def release(self) -> None:
        owner = self.owner
        with owner._slot_free:
            if self.held:
                self.held = False
                owner._streams -= 1
                owner._slots.discard(self)
                owner.metrics.active_streams.set(owner._streams)
                took = time.monotonic() - self.started
                owner._stream_seconds += 0.2 * (took - owner._stream_seconds)
                owner._slot_free.notify_all()  # the first waiter in line takes it


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
        self.cache = WindowCache(config.window_cache_entries, config.window_cache_bytes)
        self.runs = RunCache(config.run_cache_bytes)
        self._streams = 0
        self._streams_lock = threading.Lock()
        self._slots: set[_StreamSlot] = set()
        # GetDelta calls waiting for a slot, first come first served (see _acquire)
        self._slot_free = threading.Condition(self._streams_lock)
        self._queue: deque[object] = deque()
        self._stream_seconds = 0.2  # moving average of a stream's duration (retry hints)
        #: GetDelta calls refused for want of a slot (RESOURCE_EXHAUSTED with a retry hint)
        self.refused = 0
        #: Set by a relay (deltad.serve.relay): the upstream it mirrors, shown in Status.
        self.upstream = ""

    # --- helpers -------------------------------------------------------------------------

    def _snapshot(self, context: grpc.ServicerContext) -> LogSnapshot:
        snap = self.log.snapshot()
        if snap is None:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"no base segment for model {self.config.model!r} rank {self.config.rank} "
                f"in {self.config.spool_dir} yet",
            )
        return snap

    def _name(self, context: grpc.ServicerContext, consumer: str) -> str:
        try:
            return check_name("consumer", consumer)
        except ConfigError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _acquire(self, context: grpc.ServicerContext, consumer: str) -> _StreamSlot:
        """A stream slot: at once, or after waiting in line (``max_queued_streams`` callers,
        ``stream_queue_wait_s`` each, first come first served). Past that the call ends with
        RESOURCE_EXHAUSTED and a hint (:data:`deltad.wire.RETRY_AFTER_KEY`) of when a slot is likely
        free, which the consumer library honours."""
        cfg = self.config
        limit = cfg.max_concurrent_streams
        with self._slot_free:
            if (self._streams >= limit or self._queue) and len(
                self._queue
            ) < cfg.max_queued_streams:
                me = object()
                self._queue.append(me)
                until = time.monotonic() + cfg.stream_queue_wait_s
                try:
                    while self._queue[0] is not me or self._streams >= limit:
                        left = until - time.monotonic()
                        if left <= 0 or not context.is_active():
                            break
                        self._slot_free.wait(min(left, 0.5))
                finally:
                    first = self._queue[0] is me
                    self._queue.remove(me)
                    self._slot_free.notify_all()  # the next in line may be first now
                if not first or self._streams >= limit:
                    self._refuse(context)
            elif self._streams >= limit:
                self._refuse(context)
            self._streams += 1
            deadline = time.monotonic() + cfg.stream_deadline_s
            slot = _StreamSlot(self, context, consumer, deadline)
            self._slots.add(slot)
            self.metrics.active_streams.set(self._streams)
        context.add_callback(slot.release)
        return slot

    def _refuse(self, context: grpc.ServicerContext) -> NoReturn:
        """RESOURCE_EXHAUSTED with a retry hint; call with ``_slot_free`` held."""
        cfg = self.config
        # streams ahead of a caller that comes back now, drained max_concurrent at a time
        ahead = len(self._queue) + 1
        hint = min(30.0, max(0.05, self._stream_seconds * ahead / cfg.max_concurrent_streams))
        self.refused += 1
        context.set_trailing_metadata(((wire.RETRY_AFTER_KEY, str(int(hint * 1000))),))
        _abort(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{self._streams} GetDelta streams in flight and {len(self._queue)} waiting "
            f"(max_concurrent_streams={cfg.max_concurrent_streams}, max_queued_streams="
            f"{cfg.max_queued_streams}); retry in {hint:.2f}s",
        )

    def cancel_overdue(self) -> int:
        """Cancel GetDelta streams past ``stream_deadline_s``; return how many.

        The stream checks its deadline between messages; one whose client stopped reading
        waits in a send for flow control and never gets there, holding its slot (and with
        ``max_concurrent_streams`` of them, every other consumer out). The sidecar calls this
        periodically (``SidecarServer``)."""
        now = time.monotonic()
        with self._streams_lock:
            overdue = [s for s in self._slots if s.held and s.deadline < now]
        for s in overdue:
            log.warning(
                "GetDelta of %s cancelled: past stream_deadline_s=%s (client not reading?)",
                s.consumer,
                self.config.stream_deadline_s,
            )
            s.context.cancel()
            s.release()
        return len(overdue)

    def _spec(
        self, req: pb.GetDeltaRequest, snap: LogSnapshot, context: grpc.ServicerContext
    ) -> tuple[Form, Any, tuple[str, ...], int, float, int, int]:
        """Validated (form, dtype, tables, k, fraction, max_rows, chunk_bytes)."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        try:
            form = wire.form_from_pb(req.form)
            dtype = wire.dtype_from_pb(req.dtype)
        except ValueError as e:
            _abort(context, bad, str(e))
        frac = req.fraction
        if math.isnan(frac) or frac < 0 or frac > 1:
            _abort(context, bad, f"fraction must be in (0, 1], got {frac}")
        if req.k > MAX_COUNT or req.max_rows > MAX_COUNT:
            _abort(context, bad, f"k and max_rows must be <= {MAX_COUNT}")
        if form is Form.TOPK and req.k == 0 and frac == 0:
            _abort(context, bad, "FORM_TOPK needs k > 0 or a fraction in (0, 1]")
        known = {t.name for t in snap.manifest.tables}
        unknown = sorted(set(req.tables) - known)
        if unknown:
            _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"{len(unknown)} unknown table(s) {clip(unknown, 256)}; model "
                f"{self.config.model!r} has {clip(sorted(known), 512)}",
            )
        # a chunk and its framing fit in the server's send limit and in every consumer's
        # receive limit (a larger --max-message-bytes must not make pulls fail)
        limit = min(self.config.max_message_bytes, wire.CONSUMER_MAX_MESSAGE_BYTES)
        cap = max(MIN_CHUNK_BYTES, limit - 64 * 1024)
        chunk = min(max(req.chunk_bytes or self.config.chunk_bytes, MIN_CHUNK_BYTES), cap)
        tables = tuple(sorted(set(req.tables)))
        return form, dtype, tables, int(req.k), float(frac), int(req.max_rows), chunk

    def _row_alignment(
        self,
        req: pb.GetDeltaRequest,
        snap: LogSnapshot,
        spec: tuple[Form, Any, tuple[str, ...], int, float, int, int],
        context: grpc.ServicerContext,
    ) -> int:
        """Packed dtypes: the validated row alignment (else 0); INVALID_ARGUMENT for a bad
        alignment or a table whose rows cannot be packed here (column-wise shards)."""
        form, dtype, tables = spec[0], spec[1], spec[2]
        if not dtype.packed:
            return 0
        try:
            align = wire.check_row_alignment(req.row_alignment)
        except ValueError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        why = None if form is Form.IDS else packed_refusal(snap, tables, dtype)
        if why is not None:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, why)
        return align

    # --- RPCs ----------------------------------------------------------------------------

    def GetDelta(self, req: pb.GetDeltaRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The consumer's window after its committed cursor: header, chunks, trailer (bytes)."""
        consumer = self._name(context, req.consumer)
        snap = self._snapshot(context)
        form, dtype, tables, k, frac, max_rows, chunk = parsed = self._spec(req, snap, context)
        align = self._row_alignment(req, snap, parsed, context)
        slot = self._acquire(context, consumer)
        try:
            rank, gen = self.config.rank, snap.generation
            try:
                stored = self.store.get_cursor(consumer, rank)
                self.store.touch(consumer, self.config.lease_ttl_s)
            except OffsetStoreError as e:
                _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            if stored is not None and stored.generation > gen:
                _abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"consumer {consumer!r} is at generation {stored.generation}, newer than "
                    f"the served {gen}; this sidecar has not seen it yet",
                )
            # A cursor of an older generation, or behind a base merged past it (an expired
            # consumer), restarts from the base; so does a consumer that asks to.
            resync = stored is None or stored.generation < gen or stored.seq < snap.base.seq
            resync = resync or req.from_base
            from_seq = -1 if resync or stored is None else stored.seq
            to = snap.last_at_or_before_step(req.max_step if req.HasField("max_step") else None)
            if resync and stored is not None and stored.generation == gen and to.seq < stored.seq:
                # a resync (asked for) never ends behind the committed cursor: its commit
                # would be refused, leaving tables older than the cursor says
                to = snap.head
            to_seq, to_step = to.seq, to.step
            if not resync and stored is not None and to_seq <= stored.seq:
                to_seq, to_step = stored.seq, stored.step
            owed = {}
            if not resync and stored is not None and stored.owed_token:
                try:
                    owed = self.owed.load(consumer, stored.owed_token, gen)
                except SpoolError as e:
                    # The rows owed to it are unknown (file lost or corrupt): the consumer
                    # gets the full tables again, never a window missing them.
                    log.warning("%s: resync from the base: %s", consumer, e)
                    resync, from_seq = True, -1
            spec = WindowSpec(
                rank, gen, resync, from_seq, to_seq, form, dtype, tables, k, frac, max_rows, chunk,
                align, req.with_dense,
            )  # fmt: skip
            # The window is planned here (header, owed rows); its chunks are merged and
            # encoded as the stream sends them (see build_window).
            win: EncodedWindow
            if owed:
                win, hit = (
                    build_window(snap, spec, to_step, owed, kept=False, runs=self.runs),
                    False,
                )
            else:
                win, hit = self.cache.get(
                    spec,
                    lambda kept: build_window(snap, spec, to_step, {}, kept=kept, runs=self.runs),
                )
            pull_id = uuid.uuid4().hex
            token = pull_id if win.owed else ""
            try:
                if win.owed:
                    self.owed.save(consumer, token, gen, to_seq, win.owed)
                self.store.record_pull(
                    consumer, rank, PullRecord(pull_id, gen, to_seq, to_step, token, win.owed_rows)
                )
                self.owed.gc(consumer, {token, stored.owed_token if stored else ""})
            except OffsetStoreError as e:
                _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            except SpoolError as e:
                _abort(context, grpc.StatusCode.INTERNAL, str(e))
            if hit:
                self.metrics.cache_hits.inc()
            yield win.header
            for c in win.iter_chunks():
                if time.monotonic() > slot.deadline:
                    _abort(
                        context,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"GetDelta stream exceeded stream_deadline_s="
                        f"{self.config.stream_deadline_s}",
                    )
                yield c
            if not hit:
                self.metrics.merge_seconds.observe(win.merge_seconds)
            cursor = pb.Cursor(
                consumer=consumer, rank=rank, generation=gen, seq=to_seq, step=to_step,
                pull_id=pull_id,
            )  # fmt: skip
            committed = False
            if req.auto_commit:
                try:
                    self.store.commit(
                        consumer, rank, pull_id=pull_id, generation=gen, seq=to_seq, step=to_step
                    )
                    committed = True
                except CommitRejected as e:
                    log.warning("auto-commit of %s refused: %s", consumer, e)
                except OffsetStoreError as e:
                    _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            self.metrics.rows_served.inc(win.rows)
            self.metrics.bytes_served.inc(win.payload_bytes)
            self.metrics.pulls.inc()
            yield encode.encode_trailer(
                pb.DeltaTrailer(
                    cursor=cursor,
                    rows=win.rows,
                    bytes=win.payload_bytes,
                    committed=committed,
                    merge_seconds=0.0 if hit else win.merge_seconds,
                )
            )
        finally:
            slot.release()

    def Commit(self, req: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        """Forward-only commit of a cursor this server issued to this consumer."""
        consumer = self._name(context, req.consumer)
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
        consumer = self._name(context, req.consumer)
        ttl = req.lease_ttl_seconds or self.config.lease_ttl_s
        if not 0 < ttl <= 86400:
            _abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, "lease_ttl_seconds must be in (0, 86400]"
            )
        try:
            self.store.register(consumer, ttl)
            stored = self.store.get_cursor(consumer, self.config.rank)
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.RegisterResponse(cursor=self._cursor_pb(consumer, stored), lease_ttl_seconds=ttl)

    def Heartbeat(
        self, req: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        """Renew a registered consumer's lease."""
        consumer = self._name(context, req.consumer)
        try:
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
        now = time.time()
        out = []
        for name in names:
            stored = cursors[name]
            info = pb.ConsumerInfo(
                consumer=name,
                cursor=self._cursor_pb(name, stored),
                live=leases[name] > 0,
                lease_expires_in_seconds=leases[name],
                owed_rows=stored.owed_rows if stored else 0,
            )
            if snap is not None:
                seq = -1 if stored is None or stored.generation != snap.generation else stored.seq
                info.lag_segments = max(0, snap.head.seq - seq)
                pending = [e for e in snap.entries if e.seq > seq]
                info.lag_seconds = max(0.0, now - pending[0].created_unix) if pending else 0.0
                self.metrics.set_lag(name, info.lag_segments, info.lag_seconds)
            out.append(info)
        self.metrics.keep_lag_of(set(names))
        return out

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
        try:
            name = check_name("consumer", req.consumer)
        except ConfigError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
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
        """Model, generation, head, base, log size, quarantine count and local tables."""
        cfg = self.config
        snap = self.log.snapshot()
        resp = pb.StatusResponse(
            model=cfg.model, rank=cfg.rank, quarantined=self.log.quarantined, head_seq=-1,
            head_step=-1, base_seq=-1, upstream=self.upstream,
        )  # fmt: skip
        if snap is None:
            return resp
        m = snap.manifest
        resp.generation = snap.generation
        resp.world_size = m.world_size
        resp.head_seq = snap.head.seq
        resp.head_step = snap.head.step
        resp.base_seq = snap.base.seq
        resp.segments = len(snap.entries)
        resp.log_bytes = snap.nbytes
        resp.head_age_seconds = max(0.0, time.time() - snap.head.created_unix)
        resp.dense_steps.extend(d.step for d in snap.dense if d.seq <= snap.head.seq)
        resp.steps.extend(e.step for e in snap.entries)
        for t in m.tables:
            ts = resp.tables.add(
                table=t.name, num_rows=t.num_rows, dim=t.dim, dtype=t.dtype, kind=t.kind,
                sharding_type=t.sharding_type,
            )  # fmt: skip
            for c in snap.base.segment.chunks:
                if c.table == t.name:
                    ts.local_slices.add(
                        table=c.table, num_rows=c.num_rows, dim=c.dim, col_start=c.col_start,
                        col_end=c.col_end, count=c.row_end - c.row_start,
                    )  # fmt: skip
        return resp


def handlers(servicer: DeltaServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers; GetDelta's responses are already serialized bytes."""

    def unary(fn: Any, req: Any, resp: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "GetDelta": grpc.unary_stream_rpc_method_handler(
                servicer.GetDelta,
                request_deserializer=pb.GetDeltaRequest.FromString,
                response_serializer=lambda b: b,
            ),
            "Commit": unary(servicer.Commit, pb.CommitRequest, pb.CommitResponse),
            "Register": unary(servicer.Register, pb.RegisterRequest, pb.RegisterResponse),
            "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse),
            "ListConsumers": unary(
                servicer.ListConsumers, pb.ListConsumersRequest, pb.ListConsumersResponse
            ),
            "Status": unary(servicer.Status, pb.StatusRequest, pb.StatusResponse),
            "Forget": unary(servicer.Forget, pb.ForgetRequest, pb.ForgetResponse),
        },
    )
