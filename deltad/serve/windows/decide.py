"""The GetDelta window decision, as pure functions of (request, stored cursor, log view).

No I/O, no gRPC: :func:`decide_window` says which window a consumer gets: the full tables
(a resync: from the base) or the segments after its cursor, up to which seq and step, and
whether rows owed from a top-k pull must be loaded. :func:`check_request` is the one check of
a request's own fields, made at the edge (deltad.serve.edge.gate) before the servicer runs.
The servicer (deltad.serve.edge.service) loads what the decision names and streams it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from deltad import wire
from deltad.config import check_name
from deltad.errors import ConfigError
from deltad.serve.index.log import LogSnapshot
from deltad.serve.rollout import Rollback
from deltad.serve.state.offsets import StoredCursor
from deltad.types import Form

#: k, max_rows above this are rejected as absurd.
MAX_COUNT = 1 << 40
#: Methods whose request names a consumer (``consumer`` field).
NAMED = frozenset({"GetDelta", "Commit", "Register", "Heartbeat", "Forget"})


@dataclass(frozen=True)
class LogView:
    """What the decision needs of a log snapshot: its generation and every entry's
    (seq, step), base first."""

    generation: int
    entries: tuple[tuple[int, int], ...]
    #: every entry's first_seq (a merged entry's < its seq), base first; () if unknown
    first_seqs: tuple[int, ...] = ()

    @classmethod
    def of(cls, snap: LogSnapshot) -> LogView:
        return cls(
            snap.generation,
            tuple((e.seq, e.step) for e in snap.entries),
            tuple(e.first_seq for e in snap.entries),
        )

    @property
    def base_seq(self) -> int:
        return self.entries[0][0]

    @property
    def head(self) -> tuple[int, int]:
        return self.entries[-1]

    def last_at_or_before_step(self, max_step: int | None) -> tuple[int, int]:
        """(seq, step) of the newest entry with step <= ``max_step`` (at least the base)."""
        if max_step is None:
            return self.head
        best = self.entries[0]
        for e in self.entries[1:]:
            if e[1] > max_step:
                break
            best = e
        return best

    def restore_point(self, step: int) -> tuple[int, int] | str:
        """(seq, step) of the entry whose state is exactly the state at trainer step ``step``
        (the newest entry at or before it), or why this log cannot restore that step: it is
        older than the base, or it falls inside a merged entry (a retention merge swallowed
        the segments around it; see deltad.serve.index.restore)."""
        base_seq, base_step = self.entries[0]
        if step < base_step:
            return f"step {step} is older than the log's base (seq {base_seq}, step {base_step})"
        best = self.entries[0]
        for i, e in enumerate(self.entries[1:], 1):
            if e[1] > step:
                first = self.first_seqs[i] if self.first_seqs else e[0]
                if best[1] != step and first != e[0]:
                    return (
                        f"step {step} falls inside merged segment seq {first}..{e[0]} "
                        f"(steps {best[1]}..{e[1]}): not a restore point"
                    )
                break
            best = e
        return best

    def holds_state_at(self, seq: int) -> bool:
        """Whether the state after segment ``seq`` is in this log (an entry ends there)."""
        return any(s == seq for s, _ in self.entries)


@dataclass(frozen=True)
class WindowAsk:
    """The parts of a GetDeltaRequest that choose the window."""

    consumer: str
    from_base: bool = False
    max_step: int | None = None
    #: no generation diff: a cursor of an older generation resyncs (GetDeltaRequest field 14)
    no_diff: bool = False
    #: a relay's mirror pull (GetDeltaRequest.mirror): its resync may end before its cursor
    mirror: bool = False

    @classmethod
    def of(cls, req: Any) -> WindowAsk:
        return cls(
            req.consumer,
            bool(req.from_base),
            int(req.max_step) if req.HasField("max_step") else None,
            bool(req.no_generation_diff),
            bool(req.mirror),
        )


@dataclass(frozen=True)
class WindowDecision:
    """Which window to serve; ``refusal`` set: none (UNAVAILABLE with that message)."""

    generation: int
    resync: bool
    from_seq: int  # -1 for a resync (from the base)
    to_seq: int
    to_step: int
    #: Rows owed from the cursor's top-k pull to load first ("" none; never with a resync).
    owed_token: str = ""
    #: Why (for the log line and a resync's header): "asked", "no cursor", "new generation:
    #: <why no diff>", "behind the base", "generation diff", "cursor" (an ordinary window).
    reason: str = "cursor"
    refusal: str = ""
    #: A generation diff (see deltad.serve.windows.gendiff): the cursor's (older generation, seq),
    #: whose held log the window is diffed against; None otherwise.
    diff_from: tuple[int, int] | None = None
    #: A rollback (deltad.serve.rollout.Rollback) this window follows: the order's step; the
    #: window goes BACK from the cursor (``from_seq``) to ``to_seq``, the restore point at or
    #: before that step (a diff of the two states, or a resync with ``resync``), and its commit
    #: may move the cursor back. None: not a rollback.
    rollback_to: int | None = None
    #: The epoch of the rollback order in force for this consumer (0: none): the pull records
    #: it, so that once committed the consumer is never rolled back by that order again.
    rollback_epoch: int = 0
    #: A relay's mirror asked for the full tables at a step before its cursor (a relay on a
    #: fresh spool under a hold: it needs the held step's state): its commit may move the
    #: cursor back, as a rollback's does.
    moves_back: bool = False

    def resynced(self, reason: str) -> WindowDecision:
        """The same window served from the base instead (the owed rows could not be read)."""
        return replace(self, resync=True, from_seq=-1, owed_token="", reason=reason, diff_from=None)


def _no_diff(ask: WindowAsk, stored: StoredCursor, previous: LogView | None) -> str:
    """Why a cursor of an older generation cannot get a generation diff ("" if it can)."""
    if ask.no_diff:
        return "no generation diff asked"
    if previous is None:
        return "the previous generation's log is not held"
    if previous.generation != stored.generation:
        return (
            f"the cursor is of generation {stored.generation}; the log held is of "
            f"generation {previous.generation}"
        )
    if stored.seq < previous.base_seq:
        return f"the cursor (seq {stored.seq}) is behind the held log's base {previous.base_seq}"
    if stored.seq > previous.head[0]:
        return f"the cursor (seq {stored.seq}) is past the held log's head {previous.head[0]}"
    if all(seq != stored.seq for seq, _ in previous.entries):
        # the state at the cursor is not in the log (merged past an expired consumer)
        return f"the cursor (seq {stored.seq}) is inside a merged segment of the held log"
    return ""


def _rollback(
    ask: WindowAsk, stored: StoredCursor, log: LogView, order: Rollback
) -> WindowDecision:
    """The window of a consumer (cursor of the log's generation, past ``order.to_step``) that
    has not followed ``order`` yet: back to the restore point of the order's step."""
    gen = log.generation
    target = log.restore_point(order.to_step)
    if isinstance(target, str):
        return WindowDecision(
            gen, False, -1, -1, -1,
            refusal=f"rollback to step {order.to_step} (epoch {order.epoch}) cannot be "
            f"served: {target}",
        )  # fmt: skip
    to_seq, to_step = target
    why = f"rollback to step {order.to_step}"
    if ask.from_base:
        resync = "asked"
    elif stored.seq < log.base_seq:
        resync = "behind the base"
    elif not log.holds_state_at(stored.seq):
        resync = f"the cursor (seq {stored.seq}) is inside a merged segment"
    else:
        resync = ""
    if resync:
        return WindowDecision(
            gen, True, -1, to_seq, to_step, reason=f"{why}: {resync}",
            rollback_to=order.to_step, rollback_epoch=order.epoch,
        )  # fmt: skip
    return WindowDecision(
        gen, False, stored.seq, to_seq, to_step, stored.owed_token, why,
        rollback_to=order.to_step, rollback_epoch=order.epoch,
    )  # fmt: skip


def decide_window(
    ask: WindowAsk,
    stored: StoredCursor | None,
    log: LogView,
    previous: LogView | None = None,
    previous_missing: str = "",
    rollback: Rollback | None = None,
) -> WindowDecision:
    """The window for ``ask`` given the consumer's committed cursor and the log.

    * a cursor of a newer generation than the log: refused (this sidecar is behind);
    * a cursor of an older generation whose log ``previous`` still holds it: a generation
      diff (``diff_from``), unless ``from_base`` or ``no_diff`` is asked;
    * no cursor, one of an older generation (``previous_missing``: why its log is not held),
      one behind the base (merged past an expired consumer), or ``from_base`` asked: a
      resync from the base;
    * otherwise the segments after the cursor.

    The window ends at the newest entry with step <= ``max_step`` (the head without one); a
    window after the cursor never ends before it (nothing new: an empty window at the cursor),
    and neither does an asked-for resync of the cursor's generation (its commit would be
    refused, leaving tables older than the cursor says).

    ``rollback``: the rollback order that applies to this consumer (deltad.serve.rollout.cap_for).
    A consumer whose cursor is of the log's generation, past the order's step, and that has
    not followed the order yet (``stored.rollback_epoch`` < its epoch) goes back to the
    restore point of that step (:meth:`LogView.restore_point`: refused if the log cannot
    restore it), whatever ``max_step`` says; every other decision only carries the order's
    epoch, so that its commit records that the consumer is at or before that step."""
    decision = _decide(ask, stored, log, previous, previous_missing, rollback)
    if rollback is not None and not decision.rollback_epoch and not decision.refusal:
        decision = replace(decision, rollback_epoch=rollback.epoch)
    return decision


def _decide(
    ask: WindowAsk,
    stored: StoredCursor | None,
    log: LogView,
    previous: LogView | None,
    previous_missing: str,
    rollback: Rollback | None,
) -> WindowDecision:
    gen = log.generation
    if stored is not None and stored.generation > gen:
        return WindowDecision(
            gen, False, -1, -1, -1,
            refusal=f"consumer {ask.consumer!r} is at generation {stored.generation}, newer "
            f"than the served {gen}; this sidecar has not seen it yet",
        )  # fmt: skip
    if (
        rollback is not None
        and stored is not None
        and stored.generation == gen
        and stored.rollback_epoch < rollback.epoch
        and stored.step > rollback.to_step
    ):
        return _rollback(ask, stored, log, rollback)
    if stored is None:
        reason = "no cursor"
    elif stored.generation < gen and not ask.from_base:
        why = _no_diff(ask, stored, previous)
        if not why:
            to_seq, to_step = log.last_at_or_before_step(ask.max_step)
            return WindowDecision(
                gen, False, -1, to_seq, to_step, stored.owed_token, "generation diff",
                diff_from=(stored.generation, stored.seq),
            )  # fmt: skip
        if previous is None and previous_missing:
            why = previous_missing
        reason = f"new generation: {why}"
    elif stored.generation < gen:
        reason = "asked"
    elif stored.seq < log.base_seq:
        reason = "behind the base"
    elif ask.from_base:
        reason = "asked"
    else:
        reason = "cursor"
    resync = reason != "cursor"
    to_seq, to_step = log.last_at_or_before_step(ask.max_step)
    back = False
    if stored is not None and stored.generation == gen:
        if resync and to_seq < stored.seq:
            if ask.mirror and ask.from_base:
                back = True  # (a relay that lost its spool: the tables it asks for)
            else:
                to_seq, to_step = log.head
        elif not resync and to_seq <= stored.seq:
            to_seq, to_step = stored.seq, stored.step
    if resync or stored is None:
        return WindowDecision(gen, True, -1, to_seq, to_step, reason=reason, moves_back=back)
    return WindowDecision(gen, False, stored.seq, to_seq, to_step, stored.owed_token, reason)


def check_request(method: str, req: Any) -> str | None:
    """The one check of a DeltaService request's own fields (the log is not consulted):
    None if it may go on, else the INVALID_ARGUMENT message."""
    if method in NAMED:
        try:
            check_name("consumer", req.consumer)
        except ConfigError as e:
            return str(e)
    if method == "Status" and req.consumer:  # (the consumer whose cap is asked)
        try:
            check_name("consumer", req.consumer)
        except ConfigError as e:
            return str(e)
    if method == "Register":
        ttl = req.lease_ttl_seconds
        if ttl and not 0 < ttl <= 86400:  # 0: the server's default
            return "lease_ttl_seconds must be in (0, 86400]"
    if method != "GetDelta":
        return None
    try:
        form = wire.form_from_pb(req.form)
        dtype = wire.dtype_from_pb(req.dtype)
    except ValueError as e:
        return str(e)
    frac = req.fraction
    if math.isnan(frac) or frac < 0 or frac > 1:
        return f"fraction must be in (0, 1], got {frac}"
    if req.k > MAX_COUNT or req.max_rows > MAX_COUNT:
        return f"k and max_rows must be <= {MAX_COUNT}"
    if form is Form.TOPK and req.k == 0 and frac == 0:
        return "FORM_TOPK needs k > 0 or a fraction in (0, 1]"
    if dtype.packed:
        try:
            wire.check_row_alignment(req.row_alignment)
        except ValueError as e:
            return str(e)
    if req.HasField("resume"):
        r = req.resume
        if not 0 < r.messages <= MAX_COUNT or r.to_seq < 0 or not -1 <= r.from_seq <= r.to_seq:
            return (
                f"resume needs messages in [1, {MAX_COUNT}] and -1 <= from_seq <= to_seq, got "
                f"{r.messages}, {r.from_seq} and {r.to_seq}"
            )
    return None
