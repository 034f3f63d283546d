"""GetDelta's handler: one consumer's pull from one rank's log, from the request to the trailer.

It loads the cursor, decides the window (:func:`deltad.serve.windows.decide.decide_window`, a
pure function) within the consumer's release cap (deltad.serve.windows.caps), takes it from the
window source (deltad.serve.windows.source: owed rows loaded, planned, cached), records the
pull, streams it (header, chunks, trailer: pre-serialized bytes) and optionally commits it. At
``-v`` one log line per pull (consumer, rank, window seq range, rows, bytes, ms).

The request's own fields were checked at the edge (deltad.serve.edge.gate); what depends on the
log (unknown tables, tables a packed dtype cannot serve) is checked by
:mod:`deltad.serve.windows.request`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NoReturn

import grpc

from deltad import wire
from deltad.config import ServerConfig
from deltad.errors import OffsetStoreError, OwedBudgetError, SpoolError
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.ratelog import RateLimitedLog
from deltad.serve.rollout import NOTHING, Cap, ReleaseState, lower
from deltad.serve.state.offsets import CommitRejected, OffsetStore, PendingPull, StoredCursor
from deltad.serve.state.owed import OwedStore
from deltad.serve.state.release import RolloutSource
from deltad.serve.windows import encode
from deltad.serve.windows.caps import ReleaseCaps, past_cap, within_cap
from deltad.serve.windows.decide import LogView, WindowAsk, WindowDecision, decide_window
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.header import (
    with_dense_missing,
    with_reason,
    with_resumed,
    with_rollback,
    with_upstream_lost,
)
from deltad.serve.windows.prefetch import Prefetch, PrefetchStopped
from deltad.serve.windows.request import MIN_CHUNK_BYTES as MIN_CHUNK_BYTES  # (re-exported)
from deltad.serve.windows.request import log_snapshot, request_spec
from deltad.serve.windows.source import SourcedWindow, WindowSource
from deltad.serve.windows.streams import StreamSlot, StreamSlots
from deltad.types import WireDtype
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)


class WindowServer:
    """Serves GetDelta for one rank (see the module docstring); its window source and release
    caps are :attr:`source` and :attr:`caps`."""

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
        self._refusals = RateLimitedLog(logger=log)
        self.streams = streams
        self.source = WindowSource(config, seglog, owed, metrics)
        self.caps = ReleaseCaps(seglog)
        # (the window source's stores, read by the metrics and the status)
        self.cache, self.runs = self.source.cache, self.source.runs
        self.gendiff, self.spill = self.source.gendiff, self.source.spill

        #: Set by a relay (deltad.serve.relay.mirror): (snapshot, to_seq, to_step) -> why a
        #: ``with_dense`` window ending there lacks its dense state ("" if it does not).
        self.dense_check: Callable[[LogSnapshot, int, int], str] | None = None
        #: a relay: why it lost its upstream ("" if it did not; RelayMirror.lost), said in
        #: every window's header and in Status
        self.upstream_check: Callable[[], str] | None = None

    @property
    def rollout(self) -> RolloutSource:
        """The release state applied to every window (see :class:`ReleaseCaps`)."""
        return self.caps.rollout

    @rollout.setter
    def rollout(self, source: RolloutSource) -> None:
        self.caps.rollout = source

    def gate_cap(self, state: ReleaseState, generation: int) -> int | None:
        """See :meth:`ReleaseCaps.gate_cap`."""
        return self.caps.gate_cap(state, generation)

    def cap(
        self, consumer: str, generation: int, *, mirror: bool = False
    ) -> tuple[Cap, int | None]:
        """See :meth:`ReleaseCaps.cap`."""
        return self.caps.cap(consumer, generation, mirror=mirror)

    def serve(self, req: pb.GetDeltaRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The consumer's window after its committed cursor: header, chunks, trailer."""
        started = time.monotonic()
        consumer = req.consumer
        snap = log_snapshot(self.config, self.log, context)
        shape = request_spec(self.config, req, snap, context)
        slot = self.streams.acquire(context, consumer)
        got: SourcedWindow | None = None
        try:
            stored = self._load_cursor(consumer, context)
            decision = self._decide(req, snap, stored, context)
            # planned here (header, owed rows); merged and encoded as the stream sends it
            got = self.source.window(consumer, snap, shape, decision)
            win, hit = got.win, got.hit
            if not hit:  # counted once, when its last chunk is built (by whichever reader)
                win.on_done(self._count_build)
            pull_id = self._record_pull(consumer, snap.generation, got, stored, context)
            resume = self._resume_at(req, got)
            header, dense_missing = self._header(req, snap, got, resume)
            yield header
            chunks, ahead = self._chunks(win, shape.dtype, context, resume, slot)
            thread, cpu = threading.get_ident(), time.thread_time()
            try:  # the hot loop: one deadline check per chunk, nothing else
                for c in chunks:
                    # (resumed: gRPC took the previous message; see StreamSlots.cancel_overdue)
                    slot.progress = now = time.monotonic()
                    if now > slot.deadline:
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
                if threading.get_ident() == thread:  # (not if closed from another thread)
                    self.metrics.stream_cpu_seconds.inc(max(0.0, time.thread_time() - cpu))
            if win.skip.left:  # (left out unbuilt: the window ran out first)
                _past_end(context, resume)
            if not hit:
                self.metrics.merge_seconds.observe(win.merge_seconds)
            committed = self._auto_commit(req, snap.generation, got, pull_id, context)
            yield self._trailer(consumer, snap.generation, got, pull_id, committed)
            self._log_pull(consumer, got, committed, ahead, started, dense_missing, resume)
        finally:
            slot.release()
            if got is not None and not got.hit:  # (built but never read: free its reservation)
                self.source.cache.abandon(got.spec, got.win)

    # --- the steps of a pull (serve) -----------------------------------------------------

    def _load_cursor(self, consumer: str, context: grpc.ServicerContext) -> StoredCursor | None:
        """The consumer's committed cursor on this rank; renews its lease (or registers it).
        UNAVAILABLE if the offset store is."""
        try:
            stored = self.store.get_cursor(consumer, self.config.rank)
            self.store.touch(consumer, self.config.lease_ttl_s)
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return stored

    def _decide(
        self,
        req: pb.GetDeltaRequest,
        snap: LogSnapshot,
        stored: StoredCursor | None,
        context: grpc.ServicerContext,
    ) -> WindowDecision:
        """The window to serve after ``stored``, within the consumer's release cap; aborts
        when the cap is older than the log's base or the decision is a refusal."""
        consumer, gen = req.consumer, snap.generation
        rollout = self.caps.rollout
        if not req.mirror and not rollout.known:
            # a relay that never heard its upstream's release state (a fresh spool, the
            # upstream unreachable), or a sidecar that could not read Redis's since it
            # started, cannot tell a held step from a released one
            _abort(context, grpc.StatusCode.UNAVAILABLE, rollout.unknown_reason)
        # the release state and the validation gate bound the window (a window past
        # the cap is never served; a cursor past it gets an empty window at the cursor)
        # (cap.rollback: the rollback order this consumer must follow first, whatever
        # the cap; decide_window turns it into a rollback window)
        cap, max_step = self.caps.cap(consumer, gen, mirror=req.mirror)
        ask = WindowAsk.of(req)
        ask = replace(ask, max_step=lower(ask.max_step, max_step))
        view = LogView.of(snap)
        if req.HasField("holding"):  # a cold start: the window from the state it holds
            stored = self._held(req, stored, view, max_step, context)
            ask = replace(ask, from_base=False)
        decision = decide_window(
            ask, stored, view, *self.source.gendiff.previous(), rollback=cap.rollback
        )
        decision = within_cap(decision, stored, view, max_step)
        if past_cap(decision, stored, view, max_step):
            if max_step == NOTHING and cap.reasons:
                # held (pinned, released) at a state of another generation: the consumer
                # keeps what it holds; nothing of this one is released to it
                self._refuse(context, consumer, grpc.StatusCode.FAILED_PRECONDITION, cap.reasons[0])
            # the oldest state the log holds (its base) is past the cap already
            gate = self.caps.gate_cap(self.caps.rollout.state(), gen)
            if gate is not None and gate < snap.base.step:
                self._refuse(
                    context, consumer, grpc.StatusCode.UNAVAILABLE,
                    f"the base of generation {gen} (step {snap.base.step}) failed the "
                    f"validation gate; nothing can be served until a new base or generation",
                )  # fmt: skip
            self._refuse(
                context, consumer, grpc.StatusCode.FAILED_PRECONDITION,
                f"the release state caps consumer {consumer!r} at step {max_step}, older "
                f"than the oldest state this log holds (step {snap.base.step}): pin or "
                f"release a later step",
            )  # fmt: skip
        if decision.refusal:
            self._refuse(context, consumer, grpc.StatusCode.UNAVAILABLE, decision.refusal)
        return decision

    def _held(
        self,
        req: pb.GetDeltaRequest,
        stored: StoredCursor | None,
        view: LogView,
        max_step: int | None,
        context: grpc.ServicerContext,
    ) -> StoredCursor:
        """The cursor a cold start's ``holding`` stands for (GetDeltaRequest.holding): the
        state it names, if this log holds it, the consumer has not committed past it and its
        release cap allows it; FAILED_PRECONDITION otherwise (nothing recorded)."""
        h, consumer = req.holding, req.consumer
        at = dict(view.entries)
        why = ""
        if h.generation != view.generation:
            why = f"generation {h.generation} is not the served {view.generation}"
        elif h.seq < view.base_seq or h.seq not in at:
            why = f"seq {h.seq} is not a state this log holds (base {view.base_seq})"
        elif at[h.seq] != h.step:
            why = f"seq {h.seq} is step {at[h.seq]} here, not {h.step}"
        elif stored is not None and stored.generation == h.generation and stored.seq > h.seq:
            why = f"consumer {consumer!r} has committed past it (seq {stored.seq})"
        elif max_step is not None and h.step > max_step:
            why = f"step {h.step} is past the consumer's release cap (step {max_step})"
        if why:
            context.set_trailing_metadata(((wire.REFUSAL_KEY, wire.REFUSED_HELD_STATE),))
            self._refuse(
                context, consumer, grpc.StatusCode.FAILED_PRECONDITION, f"held state: {why}"
            )
        epoch = stored.rollback_epoch if stored is not None else 0
        return StoredCursor(int(h.generation), int(h.seq), int(h.step), rollback_epoch=epoch)

    def _refuse(
        self, context: grpc.ServicerContext, consumer: str, code: grpc.StatusCode, why: str
    ) -> NoReturn:
        """End a GetDelta that nothing can be served to, and say it in this log too (now and
        then: its consumer retries), so an operator sees why predictors are stuck."""
        self._refusals.warning("GetDelta of %s refused (%s): %s", consumer, code.name, why)
        _abort(context, code, why)

    def _record_pull(
        self,
        consumer: str,
        gen: int,
        got: SourcedWindow,
        stored: StoredCursor | None,
        context: grpc.ServicerContext,
    ) -> str:
        """Save the window's owed rows, record the pull (its new id, returned) and drop the
        consumer's older owed rows; then count the pull's cache hit and rollback."""
        win, decision = got.win, got.decision
        pull_id = uuid.uuid4().hex
        token = pull_id if win.owed else ""
        try:
            if win.owed:
                self.owed.save(consumer, token, gen, decision.to_seq, win.owed)
            self.store.record_pull(
                consumer,
                self.config.rank,
                PendingPull(
                    pull_id, gen, decision.to_seq, decision.to_step, token, win.owed_rows,
                    decision.rollback_epoch,
                    decision.rollback_to is not None or decision.moves_back,
                ),
            )  # fmt: skip
            self.owed.gc(consumer, {token, stored.owed_token if stored else ""})
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except OwedBudgetError as e:
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except SpoolError as e:
            _abort(context, grpc.StatusCode.INTERNAL, str(e))
        if got.hit:
            self.metrics.cache_hits.inc()
        if decision.rollback_to is not None:
            self.metrics.rollbacks.inc()
        return pull_id

    def _resume_at(self, req: pb.GetDeltaRequest, got: SourcedWindow) -> int:
        """How many messages after the header this stream leaves out: those a broken stream
        of the same window delivered (``req.resume``); 0 when the window is another (the head
        or the base moved past it, a new generation, a commit moved the cursor) or one not
        built the same again (top-k, max_rows, owed rows, a generation diff, a rollback), or
        none was asked. A complete window's messages are the same whenever it is built: the
        rows changed in ``(from_seq, to_seq]`` (every row for a resync) with their values at
        ``to_seq``, in ranges of the same chunk size (the consumer checks that the rows it
        gets next are the ones it expects)."""
        if not req.HasField("resume"):
            return 0
        r, d = req.resume, got.decision
        same = (d.generation, d.from_seq, d.to_seq) == (r.generation, r.from_seq, r.to_seq)
        complete = d.resync or not (
            req.form == pb.FORM_TOPK
            or req.max_rows
            or d.owed_token
            or d.diff_from is not None
            or d.rollback_to is not None
        )
        if not same or not complete or got.win.owed:
            log.info(
                "pull %s rank %d: resume of seq %d..%d (generation %d) asked, serving seq "
                "%d..%d (generation %d%s) from its start",
                req.consumer, self.config.rank, r.from_seq, r.to_seq, r.generation,
                d.from_seq, d.to_seq, d.generation, "" if complete else ", not complete",
            )  # fmt: skip
            return 0
        return int(r.messages)

    def _header(
        self, req: pb.GetDeltaRequest, snap: LogSnapshot, got: SourcedWindow, resume: int = 0
    ) -> tuple[bytes, str]:
        """The window's header as this pull sends it (a resync's reason, a rollback, missing
        dense state, a resumed stream), and why its dense state is missing ("" if it is
        not)."""
        win, decision = got.win, got.decision
        header = with_reason(win.header, decision.reason) if decision.resync else win.header
        if resume:
            header = with_resumed(header, resume)
        if decision.rollback_to is not None and decision.resync:
            header = with_rollback(header, decision.rollback_to, decision.rollback_epoch)
        dense_missing = ""
        if req.with_dense and self.dense_check is not None:
            dense_missing = self.dense_check(snap, decision.to_seq, decision.to_step)
            if dense_missing:
                header = with_dense_missing(header, dense_missing)
        lost = self.upstream_check() if self.upstream_check is not None else ""
        if lost:
            header = with_upstream_lost(header, lost)
        return header, dense_missing

    def _chunks(
        self,
        win: EncodedWindow,
        dtype: WireDtype,
        context: grpc.ServicerContext,
        skip: int = 0,
        slot: StreamSlot | None = None,
    ) -> tuple[Iterator[bytes], Prefetch | None]:
        """The window's chunks, built ahead while gRPC sends when prefetch is on and building
        them is work (then also the Prefetch, stopped on cancel or deadline; the caller closes
        it). Not for a window whose chunks are all built (a cached one), nor for a packed
        dtype, whose chunks are copies of rows packed once: there the producer thread's
        hand-offs cost about what the overlap saves on 2 cores (measured, 1 GB window, cache
        off: packed-int8 speed with / without prefetch 0.82-1.11, median 0.89 over 5 runs).
        Since chunks are built by address (~0.2 CPU-s per GB), that holds for every dtype on 2
        cores, hence prefetch is off by default there
        (:func:`~deltad.perf.default_prefetch_messages`)."""
        chunks: Iterator[bytes] = win.iter_chunks()
        # a resumed stream: a window built for this stream alone leaves the messages out
        # unbuilt; one shared or cached is read past them (built for the others anyway)
        for _ in range(skip - win.skip_unbuilt(skip)):
            if slot is not None:
                slot.progress = time.monotonic()
            if next(chunks, None) is None:
                _past_end(context, skip)
        if skip:
            self.metrics.resumed_streams.inc()
            self.metrics.resumed_messages.inc(skip)
        if self.config.prefetch_messages <= 0 or win.done or dtype.packed:
            return chunks, None
        ahead = Prefetch(
            chunks,
            max_items=self.config.prefetch_messages,
            max_bytes=self.config.prefetch_bytes,
        )
        context.add_callback(ahead.stop)  # cancel / deadline: stop building
        return ahead, ahead

    def _count_build(self, win: EncodedWindow) -> None:
        self.metrics.build_cpu_seconds.inc(max(0.0, win.build_cpu_seconds))

    def _auto_commit(
        self,
        req: pb.GetDeltaRequest,
        gen: int,
        got: SourcedWindow,
        pull_id: str,
        context: grpc.ServicerContext,
    ) -> bool:
        """Commit the pull if the request asked to; False if it did not or the store refused
        (logged). UNAVAILABLE if the offset store is."""
        if not req.auto_commit:
            return False
        d = got.decision
        try:
            self.store.commit(
                req.consumer,
                self.config.rank,
                pull_id=pull_id,
                generation=gen,
                seq=d.to_seq,
                step=d.to_step,
            )
        except CommitRejected as e:
            log.warning("auto-commit of %s refused: %s", req.consumer, e)
            return False
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return True

    def _trailer(
        self, consumer: str, gen: int, got: SourcedWindow, pull_id: str, committed: bool
    ) -> bytes:
        """Count the pull served and encode its trailer (the cursor to commit, the totals)."""
        win, d = got.win, got.decision
        cursor = pb.Cursor(
            consumer=consumer, rank=self.config.rank, generation=gen, seq=d.to_seq,
            step=d.to_step, pull_id=pull_id,
        )  # fmt: skip
        self.metrics.rows_served.inc(win.rows)
        self.metrics.bytes_served.inc(win.payload_bytes)
        self.metrics.pulls.inc()
        return encode.encode_trailer(
            pb.DeltaTrailer(
                cursor=cursor,
                rows=win.rows,
                bytes=win.payload_bytes,
                committed=committed,
                merge_seconds=0.0 if got.hit else win.merge_seconds,
            )
        )

    def _log_pull(
        self,
        consumer: str,
        got: SourcedWindow,
        committed: bool,
        ahead: Prefetch | None,
        started: float,
        dense_missing: str,
        resume: int = 0,
    ) -> None:
        """The pull's one log line (at ``-v``): its seqs, rows, bytes, the CPU its build took
        (cache misses), prefetch waits, time."""
        win, d = got.win, got.decision
        log.info(
            "pull %s rank %d seq %d..%d step %d (%s%s%s%s): %d rows, %d bytes%s%s, %.0f ms%s",
            consumer, self.config.rank, d.from_seq, d.to_seq, d.to_step,
            "resync: " if d.resync else "", d.reason,
            f", resumed after {resume} messages" if resume else "",
            ", committed" if committed else "", win.rows, win.payload_bytes,
            "" if got.hit else f", built in {win.build_cpu_seconds * 1000:.0f} CPU-ms",
            "" if ahead is None else
            f" (prefetch: sender waited {ahead.reader_waits}x, builder {ahead.producer_waits}x)",
            (time.monotonic() - started) * 1000,
            f"; dense state missing: {dense_missing}" if dense_missing else "",
        )  # fmt: skip


def _past_end(context: grpc.ServicerContext, skip: int) -> None:
    _abort(
        context,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"resume after {skip} messages: the window has fewer",
    )
