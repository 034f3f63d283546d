"""The Status RPC: what one sidecar reports about its log, release state and health, and its long poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from deltad import knobs
from deltad.config import ServerConfig
from deltad.errors import SpoolError
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.state.release import VIEW_TTL_S
from deltad.serve.windows.getdelta import WindowServer
from deltad.v1 import delta_pb2 as pb


class StatusRpc:
    """Answers Status over a SegmentLog and the release state its WindowServer follows; at
    most ``knobs.STATUS_WAITERS`` long polls wait at once (:attr:`waiters`)."""

    def __init__(self, config: ServerConfig, seglog: SegmentLog, windows: WindowServer) -> None:
        self.config = config
        self.log = seglog
        self.windows = windows
        #: with an archive: () -> (its URL, segments behind, seconds behind) for Status
        self.archive_lag: Callable[[], tuple[str, int, float]] | None = None
        #: a sidecar with the model's Redis: () -> the evaluators' state JSON for Status
        self.evaluators: Callable[[], str] | None = None
        #: the newest generation a Status reported with a release state read after it appeared
        self._state_generation = -1
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        #: set when the server stops: long polls answer at once (before its stores close)
        self.closing = threading.Event()

    @property
    def waiters(self) -> int:
        """Long-polling Status calls waiting now."""
        return self._waiters

    def close(self, timeout_s: float = 5.0) -> bool:
        """End the long polls (they answer with what they have) and wait, at most
        ``timeout_s``, until none runs: after it none reads the stores. True if none runs."""
        self.closing.set()
        self.log.wake()
        deadline = time.monotonic() + timeout_s
        while self._waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._waiters

    def Status(
        self,
        req: pb.StatusRequest,
        context: grpc.ServicerContext,
        *,
        upstream: str,
        health_reason: Callable[[], str],
    ) -> pb.StatusResponse:
        """Model, generation, head, base, log size, quarantine count and local tables; with
        ``wait_ms`` a long poll (see StatusRequest)."""
        cfg = self.config
        snap, waited = self._snapshot(req, context)
        resp = pb.StatusResponse(
            model=cfg.model, rank=cfg.rank, quarantined=self.log.quarantined, head_seq=-1,
            head_step=-1, base_seq=-1, upstream=upstream, waited=waited,
            health_reason=health_reason(),
        )  # fmt: skip
        check = self.windows.upstream_check
        resp.upstream_lost = check() if check is not None else ""
        if self.evaluators is not None:
            resp.evaluator_state = self.evaluators()
        if self.archive_lag is not None:
            resp.archive, resp.archive_lag_segments, resp.archive_lag_seconds = self.archive_lag()
        self._rollout(req, resp, snap)
        if snap is None:  # (nothing served: the newest manifest still says what the model is)
            self._manifest_only(resp)
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
                sharding_type=t.sharding_type, managed_collision=t.managed_collision,
            )  # fmt: skip
            for sh in (r.shard for r in snap.base.segment.shards):
                if sh.table == t.name:
                    ts.local_slices.add(
                        table=sh.table, num_rows=sh.num_rows, dim=sh.dim, col_start=sh.col_start,
                        col_end=sh.col_end, count=sh.rows,
                    )  # fmt: skip
        return resp

    def _manifest_only(self, resp: pb.StatusResponse) -> None:
        """Generation and world size from the newest manifest of a spool with no segment
        served (a quarantined base, a relay not yet mirrored); left 0 if there is none."""
        layout = self.log.layout
        try:
            gens = layout.generations()
            if gens:
                resp.generation = gens[-1]
                resp.world_size = layout.read_manifest(gens[-1]).world_size
        except SpoolError:
            pass

    def _rollout(
        self, req: pb.StatusRequest, resp: pb.StatusResponse, snap: LogSnapshot | None
    ) -> None:
        """The release state, the asking consumer's cap and this server's gate in Status."""
        source = self.windows.rollout
        if snap is not None and snap.generation != self._state_generation:
            # a generation reported for the first time: the state in this answer is read after
            # it appeared, so a hold written before the trainer restarted is in it. A relay
            # takes both from one answer and mirrors the new generation as the hold needs
            # (deltad.serve.relay.mirror), never from a cached state older than it.
            refresh = getattr(source, "refresh", None)
            if refresh is not None:
                refresh()
            self._state_generation = snap.generation
        state = source.state()
        # (a relay that has not heard its upstream's state yet says so: relays below wait)
        resp.rollout_state = source.state_json()
        resp.rollout_version = state.version
        resp.cap_step = -1
        resp.gate_bad_step = -1
        if snap is None:
            return
        gate = self.log.gate
        gen = snap.generation
        if gate is not None:
            accepted = state.gate_accepted_step if state.gate_generation == gen else None
            f = gate.first_open(gen, accepted)
            if f is not None:
                resp.gate_bad_step, resp.gate_reason = f.step, f.reason
        # no consumer named: the cap of one that matches no pin or canary group
        _, cap = self.windows.cap(req.consumer, gen)
        resp.cap_step = -1 if cap is None else cap

    def _snapshot(
        self, req: pb.StatusRequest, context: grpc.ServicerContext
    ) -> tuple[LogSnapshot | None, bool]:
        """The snapshot to report, after the long poll's wait if one was asked and a waiter's
        place is free (``STATUS_WAITERS``); the wait ends early when the head moves, and
        before the call's own deadline."""
        if req.wait_ms == 0:
            return self.log.snapshot(), False
        with self._waiters_lock:
            if self._waiters >= knobs.STATUS_WAITERS:
                return self.log.snapshot(), False
            self._waiters += 1
        try:
            wait = min(req.wait_ms / 1000.0, knobs.STATUS_MAX_WAIT_S)
            remaining = context.time_remaining()
            if remaining is not None:  # answer before the caller gives up
                wait = min(wait, max(0.0, remaining - 0.25))
            end = time.monotonic() + wait
            snap = self.log.snapshot()
            # a waiter that follows the release state looks at it every VIEW_TTL_S (the
            # sidecar's cached read of Redis), so a release or rollback order wakes it at once
            watch = req.HasField("after_rollout_version")
            step_s = VIEW_TTL_S if watch else 1.0
            # a relay's waiter also wakes when it loses (or regains) its upstream: the relays
            # below say so to their predictors within a step, not after the whole wait
            lost = self.windows.upstream_check
            lost_at_start = lost() if lost is not None else ""
            # bounded by `end`; a cancelled call, or the server stopping, stops waiting
            while context.is_active() and not self.closing.is_set():
                left = end - time.monotonic()
                snap = self.log.wait_past(
                    req.after_generation, req.after_seq, min(left, step_s), self.closing
                )
                if left <= step_s or (
                    snap is not None
                    and (snap.generation, snap.head.seq) > (req.after_generation, req.after_seq)
                ):
                    break
                if watch and self.windows.rollout.state().version != req.after_rollout_version:
                    break  # the release state changed: a relay following it wants to know
                if lost is not None and bool(lost()) != bool(lost_at_start):
                    break
            return snap, True
        finally:
            with self._waiters_lock:
                self._waiters -= 1
