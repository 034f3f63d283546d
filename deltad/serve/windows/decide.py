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

    @classmethod
    def of(cls, snap: LogSnapshot) -> LogView:
        return cls(snap.generation, tuple((e.seq, e.step) for e in snap.entries))

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


@dataclass(frozen=True)
class WindowAsk:
    """The parts of a GetDeltaRequest that choose the window."""

    consumer: str
    from_base: bool = False
    max_step: int | None = None
    #: no generation diff: a cursor of an older generation resyncs (GetDeltaRequest field 14)
    no_diff: bool = False

    @classmethod
    def of(cls, req: Any) -> WindowAsk:
        return cls(
            req.consumer,
            bool(req.from_base),
            int(req.max_step) if req.HasField("max_step") else None,
            bool(req.no_generation_diff),
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


def decide_window(
    ask: WindowAsk,
    stored: StoredCursor | None,
    log: LogView,
    previous: LogView | None = None,
    previous_missing: str = "",
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
    refused, leaving tables older than the cursor says)."""
    gen = log.generation
    if stored is not None and stored.generation > gen:
        return WindowDecision(
            gen, False, -1, -1, -1,
            refusal=f"consumer {ask.consumer!r} is at generation {stored.generation}, newer "
            f"than the served {gen}; this sidecar has not seen it yet",
        )  # fmt: skip
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
    if stored is not None and stored.generation == gen:
        if resync and to_seq < stored.seq:
            to_seq, to_step = log.head
        elif not resync and to_seq <= stored.seq:
            to_seq, to_step = stored.seq, stored.step
    if resync or stored is None:
        return WindowDecision(gen, True, -1, to_seq, to_step, reason=reason)
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
    return None
