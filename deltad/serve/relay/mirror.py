"""Mirroring one rank's log from an upstream into the relay's spool.

The mirror is a consumer of the upstream (:class:`~deltad.serve.relay.upstream.Upstream`):
rows form, fp32 on the wire (exact for fp32, fp16 and bf16 tables), at-least-once, committed
under ``RelayConfig.consumer``; it writes what it pulls into the relay's spool
(:class:`~deltad.serve.relay.spool.MirrorSpool`), which the relay's sidecar serves.

Numbering: **one local segment per upstream pull**, with the upstream's generation, seqs and
steps. A pull of the upstream window ``(from, to]`` at step ``s`` becomes one segment
``first_seq = local head + 1, seq = to, step = s`` (a merged segment in the log's sense: it
stands for upstream segments ``head+1..to``); a resync pull (the upstream's full tables at
``to``) becomes a base ``0..to``. So a cursor ``(generation, seq, step)`` means the same state
at every level of a tree; a relay's log is only coarser where it pulled several upstream
segments at once (after falling behind). A predictor aligning several ranks on one step gets
no step a rank's relay skipped: such a pull is dropped and retried until the relays' heads
meet, which they do once every relay keeps up (each then pulls one upstream segment at a
time). Creation times are the upstream's too, so ``head_age_seconds`` is the age of the rows.

Durability: a mirrored segment is written atomically (and fsynced, ``RelayConfig.fsync``)
before the upstream cursor is committed, so a relay killed at any point restarts with a local
head at or past its upstream cursor. The upstream then re-sends ``(cursor, to]``; the relay
writes ``(local head, to]`` from it (a superset of the rows since its head, latest values: exact
for ids and rows) or nothing if it already has ``to``, and commits. An upstream cursor past
the local head (the relay's spool was lost) makes it ask for the full tables (``from_base``).

Generations: a resync of a newer upstream generation writes that generation's manifest (tables
from the upstream's Status) and its base; the relay's log switches to it like a sidecar's does
when its trainer restarts. The mirror asks for no generation diff (it needs a base to write);
the relay's own consumers get generation diffs from the previous generation's log it holds
(deltad.serve.windows.gendiff), or resync.

Dense states: the mirror pulls ``with_dense``; a window carrying one (the upstream's newest at or
before its head, with its seq and step) is written as ``dense-<seq>`` *before* the window's
segment, exactly as the trainer's publisher does, so the relay's log (its retention, its
generation diffs, its ``dense_steps``) serves it like a sidecar serves the trainer's, at every
level of a tree. A window the relay serves ``with_dense`` whose dense state it knows it lacks
(the upstream listed a newer dense state at or before the window's step than the relay holds,
or the upstream said its own window lacked one) says so in ``DeltaHeader.dense_missing``:
:meth:`RelayMirror.dense_missing`, so a predictor never looks caught up on init weights.
"""

from __future__ import annotations

import bisect
import logging
import random
import threading
import time
from collections.abc import Callable

import grpc

from deltad import wire
from deltad.config import RelayConfig
from deltad.consume.window import RankDelta
from deltad.errors import DeltadError, UpstreamError
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import LogSnapshot
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.relay.spool import MirrorSpool, status_manifest
from deltad.serve.relay.upstream import Upstream, refuses
from deltad.serve.relay.upstream_health import LOST_AFTER_S, UpstreamHealth, track_upstream_series
from deltad.serve.rollout import served_steps, unreleased
from deltad.serve.state.release import FollowedRollout
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)


def _worth_commit(d: RankDelta) -> bool:
    return d.resync or d.rows > 0 or d.to_seq != d.from_seq


class RelayMirror:
    """Mirrors the upstream's log of one rank into ``server``'s spool (see the module doc).

    :meth:`start` runs :meth:`step` on a thread until :meth:`stop`; an upstream that is down
    is retried with bounded exponential backoff forever (the relay keeps serving what it has).
    An upstream of another model or rank is fatal: ``error`` is set and ``on_fatal`` called.
    """

    def __init__(
        self,
        config: RelayConfig,
        server: SidecarServer,
        on_fatal: Callable[[DeltadError], None] | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.model = server.config.model
        self.rank = server.config.rank
        self.on_fatal = on_fatal
        self.error: DeltadError | None = None
        #: upstream pulls made (for tests and logs)
        self.pulls = 0
        self.upstream = Upstream(config)
        self.spool = MirrorSpool(server.log, self.model, fsync=config.fsync)
        self._needs_base = self.spool.head is None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_problem = ""
        self._rollout_version = 0
        #: the upstream's dense steps (its last Status) and generation, and why its last
        #: window lacked a dense state ("" if it did not): what dense_missing compares with
        self._up_dense: tuple[int, tuple[int, ...]] = (-1, ())
        self._up_dense_missing = ""
        #: the upstream's health as the relay sees it (metrics, :meth:`lost`): when it last
        #: answered a round (monotonic; None: never), since when rounds fail (None: the last
        #: one did not), the last problem, failed rounds, bytes mirrored, and the upstream's
        #: head (generation, seq, step) at its last Status
        self.last_answer: float | None = None
        self.failing_since: float | None = None
        self.problem = ""
        self.errors = 0
        self.bytes = 0
        self.upstream_head: tuple[int, int, int] | None = None
        self._up_lost = ""
        #: (generation, head seq, release-state version) of the upstream when a pull came
        #: back short of its head with nothing new (its gate caps the mirror): nothing to
        #: pull until the head or the release state moves (no hot loop under a gate hold)
        self._capped: tuple[int, int, int] | None = None

    @property
    def written(self) -> int:
        """Local segments written (for tests and logs)."""
        return self.spool.written

    @property
    def dense_written(self) -> int:
        """Dense state files written (for tests and logs)."""
        return self.spool.dense_written

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> RelayMirror:
        self._thread = threading.Thread(target=self._run, name="deltad-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop mirroring: an upstream call in flight is cancelled (closing the channel), so
        this returns at once; nothing half-written is committed."""
        self._stop.set()
        self.upstream.close()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        c = self.config
        delay = c.backoff_initial_s
        while not self._stop.is_set():
            refused = False
            try:
                pulled = self.step()
                self.last_answer, self.failing_since, self.problem = time.monotonic(), None, ""
                delay = c.backoff_initial_s
                self.server.set_problem("upstream", None)
                if self._last_problem:
                    log.info("upstream %s: mirroring again", c.upstream)
                    self._last_problem = ""
                if not pulled:  # a long poll that ran out waited already: at most top up
                    self._stop.wait(max(0.0, c.poll_interval_s - self.upstream.waited_s))
                continue
            except UpstreamError as e:
                self.error = e
                log.error("relay stops: %s", e)
                if self.on_fatal is not None:
                    self.on_fatal(e)
                return
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return  # cancelled by stop()
                problem = f"{e.code().name}: {e.details()}"
                refused = refuses(e)
                if self.upstream.progressed:  # a base going on where it broke: no backing off
                    delay = c.backoff_initial_s
                if refused:  # readiness says so (one line per change, by set_problem)
                    self.server.set_problem(
                        "upstream", f"upstream {c.upstream} refuses this relay: {problem[:300]}"
                    )
            except DeltadError as e:
                if self._stop.is_set():
                    return
                problem = str(e)
            except Exception as e:  # a bug must not end mirroring silently
                if self._stop.is_set():
                    return
                log.exception("relay step failed")
                problem = repr(e)
            self.errors += 1
            self.problem = problem
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            if problem != self._last_problem and not refused:  # once per kind, not per retry
                log.warning("upstream %s: %s (retrying)", c.upstream, problem)
                self._last_problem = problem
            self._stop.wait(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, c.backoff_max_s)

    # ---- one round -------------------------------------------------------------------------

    def step(self) -> bool:
        """Register if needed, flush a pending commit, pull if the upstream moved; True if
        it pulled. gRPC errors propagate (the loop retries them). Credential files that
        changed are re-read first (a new channel if the TLS files did)."""
        up = self.upstream
        up.reconnect_if_changed()
        if not up.registered:
            # (checked first: a relay of another model or rank leaves no consumer upstream)
            self._check_upstream(up.status())
            self._register()
        if up.pending is not None:
            up.commit()
        st = self._status()
        # (when the answer came: its head age is as of then, not as of the question, which a
        # long poll held until the head moved; from the question, every relayed segment was
        # dated one publish interval early)
        answered = time.time()
        self._follow(st)
        self._check_upstream(st)
        self._up_dense = (st.generation, tuple(int(t) for t in st.dense_steps))
        self.upstream_head = (st.generation, st.head_seq, st.head_step)
        self._up_lost = st.upstream_lost  # (a relay above that lost its own upstream)
        loc = self.spool.head
        head = (st.generation, st.head_seq)
        capped = self._capped == (st.generation, st.head_seq, st.rollout_version)
        if st.head_seq < 0 or (
            loc is not None
            and st.generation == loc.generation
            and (st.head_seq <= loc.seq or capped)
            and up.committed is not None
            and (up.committed >= head or capped)
        ):
            if not up.keep_lease():
                self._register()  # the lease expired: take it again
            return False
        if loc is not None and st.generation < loc.generation:
            raise UpstreamError(
                f"upstream {self.config.upstream} is at generation {st.generation}, older than "
                f"the relay's {loc.generation} (another trainer's log?)"
            )
        self._pull(st, answered)
        return True

    def _follow(self, st: pb.StatusResponse) -> None:
        """Take the upstream's release state (rollout-control, issue 21): the relay applies
        it to its own consumers (deltad.serve.state.release.FollowedRollout)."""
        follow = getattr(self.server, "rollout", None)
        if isinstance(follow, FollowedRollout):
            follow.follow(st.rollout_state)
            self._rollout_version = st.rollout_version

    def _check_upstream(self, st: pb.StatusResponse) -> None:
        """UpstreamError (the relay stops) if the upstream serves another model or rank."""
        if st.model != self.model or st.rank != self.rank:
            raise UpstreamError(
                f"upstream {self.config.upstream} serves model {st.model!r} rank {st.rank}; "
                f"this relay serves model {self.model!r} rank {self.rank}"
            )

    def _status(self) -> pb.StatusResponse:
        """The upstream's Status; a long poll (answered when its head passes the relay's)
        when the relay holds a log and owes no commit. The upstream's ``waited_s`` says how
        long it held the call (0 when it did not wait), so the loop polls again at once
        after a wait that ran out, and after ``poll_interval_s`` otherwise."""
        loc, up = self.spool.head, self.upstream
        idle = (
            loc is not None
            and up.pending is None
            and not self._needs_base
            and up.committed is not None
            and up.committed >= (loc.generation, loc.seq)
        )
        after = (loc.generation, loc.seq) if idle and loc is not None else None
        if after is not None and self._capped is not None:
            after = max(after, self._capped[:2])  # (wait past the head the gate holds back)
        return up.status(after, self._rollout_version)

    def _stop_at(self, st: pb.StatusResponse) -> int | None:
        """The step this pull ends at: the oldest step between the relay's head and the
        upstream's that the release state serves (a hold, a release to a step, a pin, a
        rollback order; deltad.serve.rollout.served_steps) or that the relay's restore window
        holds (:meth:`_restore_stops`), so that the relay's log holds its state as the
        upstream's does (a relay started during a hold serves the held step to new
        predictors, and a rollback to it stays possible); with such a policy and no stop
        before it, the head the Status saw; None: up to the head."""
        follow = getattr(self.server, "rollout", None)
        steps: set[int] = set()
        every = False
        if isinstance(follow, FollowedRollout) and follow.known:
            state = follow.state()
            steps = served_steps(state, st.generation) | {r.to_step for r in state.rollbacks}
            # (a generation not released to every consumer: a release may name any of its
            # steps, so each is mirrored, as the upstream's log holds it; issue 39)
            every = unreleased(state, st.generation)
        # each onto the upstream's own entries (the state at a step never published is its
        # newest entry before it): a stop between two entries would end every pull at the
        # entry before it, and the mirror would never pass it
        entries = sorted(int(t) for t in st.steps)
        loc = self.spool.head
        after = -1
        if loc is not None and loc.generation == st.generation and not self._needs_base:
            after = loc.step
        stops: set[int] = set()
        for s in steps:
            at = bisect.bisect_right(entries, s)
            if at and after < entries[at - 1] < st.head_step:
                stops.add(entries[at - 1])
        kept = set(entries) if every else self._restore_stops(st, entries)
        stops |= {e for e in kept if after < e < st.head_step}
        if stops:
            return min(stops)
        # a policy that keeps steps ends the pull at the head the Status saw: "up to the
        # head" would take the entries published since in one segment, and the relay's log
        # would lack the steps between (a release to one of them then never served)
        return st.head_step if (steps or kept) and st.head_step >= 0 else None

    def _restore_stops(self, st: pb.StatusResponse, entries: list[int]) -> set[int]:
        """With a restore window (``--restore-window-steps`` / ``--restore-window-seconds``),
        the upstream's entries inside it, and the one its oldest step needs: the relay
        mirrors them one pull each, so its log restores the steps its upstream's does (a
        rollback the sidecar takes is served behind the relay too), even after falling
        behind or on a fresh spool. (The upstream's Status gives no publish times: a window
        of seconds takes every entry.)"""
        cfg = self.server.config
        if cfg.restore_window_s > 0:
            return set(entries)
        if cfg.restore_window_steps <= 0 or not entries:
            return set()
        at = bisect.bisect_right(entries, st.head_step - cfg.restore_window_steps)
        return set(entries[max(0, at - 1) :])

    def _pull(self, st: pb.StatusResponse, answered: float) -> None:
        d = self.upstream.pull(self._needs_base, self._stop_at(st))
        self.pulls += 1
        self.bytes += d.bytes
        if d.rank != self.rank:
            raise UpstreamError(f"upstream answered rank {d.rank} for rank {self.rank}")
        self._up_dense_missing = d.dense_missing
        same = d.generation == st.generation and d.to_seq == st.head_seq
        created = answered - st.head_age_seconds if same else time.time()
        loc = self.spool.head
        if loc is None or d.generation > loc.generation:
            if not d.resync:
                log.warning("upstream sent a delta of an unseen generation: asking for its base")
                self._needs_base = True
                return
            if d.generation != st.generation:  # the tables to declare are of d's generation
                st = self.upstream.status()
                if d.generation != st.generation:
                    return  # the upstream moved again meanwhile; pull again (nothing committed)
            self.spool.write_base(d, created, status_manifest(st, d))
        elif d.generation < loc.generation:
            raise UpstreamError(
                f"upstream {self.config.upstream} sent generation {d.generation}, older than "
                f"the relay's {loc.generation}"
            )
        elif d.resync:
            if d.to_seq > loc.seq and self._needs_base:  # (asked: the relay's spool is new)
                self.spool.write_base(d, created, None)
            elif d.to_seq > loc.seq:
                # not asked: the upstream lost the relay's cursor (a relay above restarted on
                # a fresh spool) or it fell behind the upstream's base. The full tables at
                # to_seq go in as one segment after the relay's head, so its log keeps the
                # steps before (held steps, restore points) instead of being replaced
                self.spool.write_delta(d, created)
        elif d.from_seq > loc.seq:
            log.warning(
                "upstream cursor seq %d is past the relay's head %d (its spool was lost?): "
                "asking for the full tables",
                d.from_seq,
                loc.seq,
            )
            self._needs_base = True
            return
        elif d.to_seq > loc.seq:
            self.spool.write_delta(d, created)
        elif not d.resync and d.to_seq < st.head_seq:  # nothing new, short of the head
            self._capped = (st.generation, st.head_seq, st.rollout_version)
        self._needs_base = False
        if _worth_commit(d):
            self.upstream.pending = wire.cursor_to_pb(d.cursor)
            self.upstream.commit()

    def _register(self) -> None:
        """Take the upstream lease; ask for the full tables if the relay has no log, or the
        upstream cursor is past its head (the spool was lost or replaced)."""
        c, loc = self.upstream.register(), self.spool.head
        if loc is None:
            self._needs_base = True
        elif c.seq >= 0 and (
            c.generation > loc.generation or (c.generation == loc.generation and c.seq > loc.seq)
        ):
            # committed upstream past what the spool holds: the spool was lost or replaced
            log.warning(
                "upstream cursor (generation %d seq %d) is past the relay's head (generation "
                "%d seq %d): the first pull asks for the full tables",
                c.generation,
                c.seq,
                loc.generation,
                loc.seq,
            )
            self._needs_base = True

    def lost(self) -> str:
        """Why the relay cannot vouch that its head is the model's ("" if it can): mirror
        rounds have failed for :data:`LOST_AFTER_S` (the upstream unreachable or refusing,
        or the relay's own writes failing; a partition, where calls hang, fails them once
        the channel's keepalive ping goes unanswered: deltad.channels, about 10-20 s), or
        the upstream is a relay that says so of itself. Said in every window's header and in
        Status (``upstream_lost``): a predictor behind the relay is then not caught up."""
        up = self.config.upstream
        since = self.failing_since
        if since is not None:
            age = time.monotonic() - since
            if age < LOST_AFTER_S:
                return ""
            return f"relay lost its upstream {up} {age:.0f}s ago: {self.problem}"[:512]
        return f"upstream {up}: {self._up_lost}"[:512] if self._up_lost else ""

    def lag(self) -> tuple[int, int]:
        """(segments, steps) the relay's head is behind its upstream's at the upstream's last
        Status; (-1, -1): not known (no Status yet, or another generation)."""
        up, loc = self.upstream_head, self.spool.head
        if up is None or up[1] < 0:
            return -1, -1
        if loc is None or loc.generation != up[0]:
            return -1, -1
        return max(0, up[1] - loc.seq), max(0, up[2] - loc.step)

    def track(self, metrics: SidecarMetrics) -> None:
        """The relay's own series on its /metrics: the upstream's reachability, how far the
        relay is behind it, and what mirroring did."""
        c = self.config
        track_upstream_series(
            metrics,
            UpstreamHealth(
                last_ok=lambda: self.last_answer,
                failing=lambda: self.failing_since is not None,
                lost=self.lost,
                lag_segments=lambda: self.lag()[0],
                errors=lambda: self.errors,
            ),
        )
        metrics.track(
            "deltad_mirror_lag_steps",
            "Trainer steps the relay's head is behind its upstream's (-1: not known)",
            lambda: float(self.lag()[1]),
        )
        metrics.track_counter(
            "deltad_mirror_pulls", f"Windows pulled from the upstream {c.upstream}",
            lambda: self.pulls,
        )  # fmt: skip
        metrics.track_counter(
            "deltad_mirror_bytes", "Bytes of windows pulled from the upstream",
            lambda: self.bytes,
        )  # fmt: skip

    def dense_missing(self, snap: LogSnapshot, to_seq: int, to_step: int) -> str:
        """Why a window of the relay's log ending at ``to_seq`` (step ``to_step``) lacks the
        dense state it should carry; "" if it does not (or the relay cannot tell): the
        upstream said its window lacked one, or the upstream serves a dense state at or
        before ``to_step`` newer than any the relay holds at or before ``to_seq``."""
        up = self.config.upstream
        if self._up_dense_missing:
            return f"upstream {up}: {self._up_dense_missing}"[:512]
        generation, steps = self._up_dense
        if generation != snap.generation:
            return ""
        expected = max((t for t in steps if t <= to_step), default=None)
        if expected is None:
            return ""
        held = snap.dense_at(to_seq)
        if held is not None and held.step >= expected:
            return ""
        return (
            f"relay of {up} holds no dense state of step {expected} (newest held: "
            f"{'none' if held is None else held.step}); its upstream serves it"
        )
