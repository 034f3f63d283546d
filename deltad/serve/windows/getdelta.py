"""GetDelta of one sidecar: decide the window (:func:`deltad.serve.windows.decide.decide_window`, a
pure function), load what it names (the cursor, owed rows), plan and stream it (header,
chunks, trailer: pre-serialized bytes), record the pull, optionally commit it. At ``-v`` one
log line per pull (consumer, rank, window seq range, rows, bytes, ms).

The request's own fields were checked at the edge (deltad.serve.edge.gate); what depends on the
log (unknown tables, tables a packed dtype cannot serve) is checked here.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from deltad import wire
from deltad.config import ServerConfig, clip
from deltad.errors import OffsetStoreError, OwedBudgetError, SpoolError
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.rollout import Cap, ReleaseState, cap_for, gate_open, lower
from deltad.serve.state.offsets import CommitRejected, OffsetStore, PendingPull, StoredCursor
from deltad.serve.state.owed import OwedStore
from deltad.serve.state.release import RolloutSource
from deltad.serve.windows import encode
from deltad.serve.windows.cache import WindowCache
from deltad.serve.windows.decide import LogView, WindowAsk, WindowDecision, decide_window
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.gendiff import GenerationDiffs, with_reason, with_rollback
from deltad.serve.windows.packed import PackedStore
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.prefetch import Prefetch, PrefetchStopped
from deltad.serve.windows.rollback import RollbackWindows
from deltad.serve.windows.spec import WindowSpec
from deltad.serve.windows.streams import StreamSlots
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)

MIN_CHUNK_BYTES = 64 * 1024


class WindowServer:
    """Serves GetDelta for one rank (see the module docstring)."""

    def __init__(
        self,
        config: ServerConfig,
        seglog: SegmentLog,
        store: OffsetStore,
        owed: OwedStore,
        metrics: SidecarMetrics,
        streams: StreamSlots,
    ) -> None:
        self.config = config
        self.log = seglog
        self.store = store
        self.owed = owed
        self.metrics = metrics
        self.streams = streams
        self.cache = WindowCache(config.window_cache_entries, config.window_cache_bytes)
        self.runs = RunCache(config.run_cache_bytes)
        self.packed = PackedStore(config.packed_cache_bytes)
        self.gendiff = GenerationDiffs(seglog, owed, metrics, self.cache)
        # bootstraps bigger than the window cache start from a spilled merged base
        self.spill = SpillStore(seglog.layout.model_dir / ".spill", config.spill_max_bytes)
        self.rollbacks = RollbackWindows(self.cache)
        #: the release state applied to every window (deltad.serve.state.release; set by the
        #: sidecar: Redis, or a relay's upstream); everything released until set
        self.rollout: RolloutSource = _Released()

        #: Set by a relay (deltad.serve.relay.mirror): (snapshot, to_seq, to_step) -> why a
        #: ``with_dense`` window ending there lacks its dense state ("" if it does not).
        self.dense_check: Callable[[LogSnapshot, int, int], str] | None = None

    def gate_cap(self, state: ReleaseState, generation: int) -> int | None:
        """The newest step the validation gate lets any window of ``generation`` end at
        (None: no gate failure stands), given what an operator released past."""
        gate = self.log.gate
        if gate is None:
            return None
        accepted = state.gate_accepted_step if state.gate_generation == generation else None
        return gate.cap(generation, accepted)

    def cap(
        self, consumer: str, generation: int, *, mirror: bool = False
    ) -> tuple[Cap, int | None]:
        """The release state's cap of ``consumer`` (none for a relay's mirror) and the
        newest step it may be served: that cap's step and the gate's, whichever is lower."""
        state = self.rollout.state()
        gate = self.gate_cap(state, generation)
        if mirror:
            return Cap(None), gate
        cap = cap_for(state, consumer)
        # a step another rank's gate failed caps this rank too (every rank agrees)
        bad = gate_open(state, generation)
        model_gate = None if bad is None else bad - 1
        return cap, lower(lower(cap.max_step, gate), model_gate)

    def snapshot(self, context: grpc.ServicerContext) -> LogSnapshot:
        snap = self.log.snapshot()
        if snap is None:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"no base segment for model {self.config.model!r} rank {self.config.rank} "
                f"in {self.config.spool_dir} yet",
            )
        return snap

    def spec(
        self, req: pb.GetDeltaRequest, snap: LogSnapshot, context: grpc.ServicerContext
    ) -> WindowSpec:
        """The request's form, tables and limits as a WindowSpec (the window's seqs still
        to be decided); NOT_FOUND for unknown tables, INVALID_ARGUMENT for tables a packed
        dtype cannot serve here (column-wise shards)."""
        form, dtype = wire.form_from_pb(req.form), wire.dtype_from_pb(req.dtype)
        known = {t.name for t in snap.manifest.tables}
        unknown = sorted(set(req.tables) - known)
        if unknown:
            _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"{len(unknown)} unknown table(s) {clip(unknown, 256)}; model "
                f"{self.config.model!r} has {clip(sorted(known), 512)}",
            )
        tables = tuple(sorted(set(req.tables)))
        align = 0
        if dtype.packed:  # shards that cannot be packed (column-wise) travel as fp32
            align = wire.check_row_alignment(req.row_alignment)  # checked at the edge
        # a chunk and its framing fit in the server's send limit and in every consumer's
        # receive limit (a larger --max-message-bytes must not make pulls fail)
        limit = min(self.config.max_message_bytes, wire.CONSUMER_MAX_MESSAGE_BYTES)
        cap = max(MIN_CHUNK_BYTES, limit - 64 * 1024)
        chunk = min(max(req.chunk_bytes or self.config.chunk_bytes, MIN_CHUNK_BYTES), cap)
        return WindowSpec(
            self.config.rank, snap.generation, False, -1, -1, form, dtype, tables, int(req.k),
            float(req.fraction), int(req.max_rows), chunk, align, req.with_dense,
        )  # fmt: skip

    def serve(self, req: pb.GetDeltaRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The consumer's window after its committed cursor: header, chunks, trailer."""
        started = time.monotonic()
        consumer = req.consumer
        snap = self.snapshot(context)
        shape = self.spec(req, snap, context)
        slot = self.streams.acquire(context, consumer)
        win: EncodedWindow | None = None
        hit = False
        try:
            rank, gen = self.config.rank, snap.generation
            try:
                stored = self.store.get_cursor(consumer, rank)
                self.store.touch(consumer, self.config.lease_ttl_s)
            except OffsetStoreError as e:
                _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            # the release state and the validation gate bound the window (a window past
            # the cap is never served; a cursor past it gets an empty window at the cursor)
            # (cap.rollback: the rollback order this consumer must follow first, whatever
            # the cap; decide_window turns it into a rollback window)
            cap, max_step = self.cap(consumer, gen, mirror=req.mirror)
            ask = WindowAsk.of(req)
            ask = replace(ask, max_step=lower(ask.max_step, max_step))
            view = LogView.of(snap)
            decision = decide_window(
                ask, stored, view, *self.gendiff.previous(), rollback=cap.rollback
            )
            decision = within_cap(decision, stored, view, max_step)
            if past_cap(decision, stored, view, max_step):
                # the oldest state the log holds (its base) is past the cap already
                gate = self.gate_cap(self.rollout.state(), gen)
                if gate is not None and gate < snap.base.step:
                    _abort(
                        context,
                        grpc.StatusCode.UNAVAILABLE,
                        f"the base of generation {gen} (step {snap.base.step}) failed the "
                        f"validation gate; nothing can be served until a new base or generation",
                    )
                _abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the release state caps consumer {consumer!r} at step {max_step}, older "
                    f"than the oldest state this log holds (step {snap.base.step}): pin or "
                    f"release a later step",
                )
            if decision.refusal:
                _abort(context, grpc.StatusCode.UNAVAILABLE, decision.refusal)
            diff, diff_hit, decision = self.gendiff.window(consumer, snap, shape, decision)
            owed = {}
            if decision.rollback_to is not None and not decision.resync:
                try:
                    if decision.owed_token:
                        owed = self.owed.load(consumer, decision.owed_token, gen)
                    diff, diff_hit = self.rollbacks.window(snap, shape, decision, owed)
                    owed = {}
                except SpoolError as e:
                    log.warning("%s: rollback from the base: %s", consumer, e)
                    decision = decision.resynced(f"rollback to step {decision.rollback_to}: {e}")
            if decision.owed_token and diff is None:
                try:
                    owed = self.owed.load(consumer, decision.owed_token, gen)
                except SpoolError as e:
                    # The rows owed to it are unknown (file lost or corrupt): the consumer
                    # gets the full tables again, never a window missing them.
                    log.warning("%s: resync from the base: %s", consumer, e)
                    decision = decision.resynced("owed rows lost")
            to_seq, to_step = decision.to_seq, decision.to_step
            spec = replace(shape, resync=decision.resync, from_seq=decision.from_seq, to_seq=to_seq)
            # The window is planned here (header, owed rows); its chunks are merged and
            # encoded as the stream sends them (see build_window).
            # (a base window that the window cache cannot keep: from the spilled base)
            spill = self.spill if spec.resync and snap.base.nbytes > self.cache.max_bytes else None
            if diff is not None:
                win, hit = diff, diff_hit
            elif owed:
                win, hit = (
                    build_window(
                        snap, spec, to_step, owed, kept=False, runs=self.runs, packed=self.packed
                    ),
                    False,
                )
            else:
                win, hit = self.cache.get(
                    spec,
                    lambda kept: build_window(
                        snap,
                        spec,
                        to_step,
                        {},
                        kept=kept,
                        runs=self.runs,
                        spill=spill,
                        packed=self.packed,
                    ),
                )
            pull_id = uuid.uuid4().hex
            token = pull_id if win.owed else ""
            try:
                if win.owed:
                    self.owed.save(consumer, token, gen, to_seq, win.owed)
                self.store.record_pull(
                    consumer,
                    rank,
                    PendingPull(
                        pull_id, gen, to_seq, to_step, token, win.owed_rows,
                        decision.rollback_epoch, decision.rollback_to is not None,
                    ),
                )  # fmt: skip
                self.owed.gc(consumer, {token, stored.owed_token if stored else ""})
            except OffsetStoreError as e:
                _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            except OwedBudgetError as e:
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except SpoolError as e:
                _abort(context, grpc.StatusCode.INTERNAL, str(e))
            if hit:
                self.metrics.cache_hits.inc()
            if decision.rollback_to is not None:
                self.metrics.rollbacks.inc()
            header = with_reason(win.header, decision.reason) if decision.resync else win.header
            if decision.rollback_to is not None and decision.resync:
                header = with_rollback(header, decision.rollback_to, decision.rollback_epoch)
            dense_missing = ""
            if req.with_dense and self.dense_check is not None:
                dense_missing = self.dense_check(snap, to_seq, to_step)
                if dense_missing:
                    header = with_dense_missing(header, dense_missing)
            yield header
            chunks: Iterator[bytes] = win.iter_chunks()
            ahead = None
            if self.config.prefetch_messages > 0:  # build the next chunks while gRPC sends
                ahead = Prefetch(
                    chunks,
                    max_items=self.config.prefetch_messages,
                    max_bytes=self.config.prefetch_bytes,
                )
                context.add_callback(ahead.stop)  # cancel / deadline: stop building
                chunks = ahead
            try:
                for c in chunks:
                    if time.monotonic() > slot.deadline:
                        _abort(
                            context,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"GetDelta stream exceeded stream_deadline_s="
                            f"{self.config.stream_deadline_s}",
                        )
                    yield c
            except PrefetchStopped:
                _abort(context, grpc.StatusCode.CANCELLED, "GetDelta stream cancelled")
            finally:
                if ahead is not None:
                    ahead.close()
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
            log.info(
                "pull %s rank %d seq %d..%d step %d (%s%s%s): %d rows, %d bytes%s, %.0f ms%s",
                consumer, rank, decision.from_seq, to_seq, to_step,
                "resync: " if decision.resync else "", decision.reason,
                ", committed" if committed else "", win.rows, win.payload_bytes,
                "" if ahead is None else
                f" (prefetch: sender waited {ahead.reader_waits}x, builder {ahead.producer_waits}x)",
                (time.monotonic() - started) * 1000,
                f"; dense state missing: {dense_missing}" if dense_missing else "",
            )  # fmt: skip
        finally:
            slot.release()
            if win is not None and not hit:  # (built but never read: free its reservation)
                self.cache.abandon(spec, win)


def within_cap(
    d: WindowDecision, stored: StoredCursor | None, log: LogView, cap: int | None
) -> WindowDecision:
    """``d``, unless it is a resync of a cursor past the release cap that decide_window sent
    to the head (so that its commit is not refused): then to the cursor's own state (the
    first entry at or after it), no further past the cap than the consumer already is."""
    if (
        cap is None
        or not d.resync
        or stored is None
        or stored.generation != d.generation
        or d.to_step <= cap
        or d.to_seq <= stored.seq
    ):
        return d
    seq, step = next(e for e in log.entries if e[0] >= stored.seq)
    return replace(d, to_seq=seq, to_step=step)


def past_cap(d: WindowDecision, stored: StoredCursor | None, log: LogView, cap: int | None) -> bool:
    """Whether ``d`` would take the consumer past ``cap`` (further than its own cursor is
    already: the log holds nothing at or below the cap for it)."""
    if cap is None or d.to_step <= cap:
        return False
    if stored is not None and stored.generation == d.generation:
        first = next((e for e in log.entries if e[0] >= stored.seq), None)
        if first is not None and d.to_seq <= first[0]:
            return False
    return True


class _Released:
    """Everything released (no rollout state known)."""

    def state(self) -> ReleaseState:
        return ReleaseState()


def with_dense_missing(header: bytes, reason: str) -> bytes:
    """A serialized header message with ``dense_missing`` set to ``reason``."""
    msg = pb.GetDeltaResponse.FromString(header)
    msg.header.dense_missing = reason[:512]
    return msg.SerializeToString()
