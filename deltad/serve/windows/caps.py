"""The release cap: the newest step the rollout state and the validation gate let a consumer get."""

from __future__ import annotations

import bisect
from dataclasses import replace

from deltad.serve.index.log import SegmentLog
from deltad.serve.rollout import NOTHING, Cap, ReleaseState, cap_for, gate_open, lower
from deltad.serve.state.offsets import StoredCursor
from deltad.serve.state.release import RolloutSource
from deltad.serve.windows.decide import LogView, WindowDecision


class ReleaseCaps:
    """The caps of one rank's consumers: the release state (:attr:`rollout`) and the rank's
    validation gate, with what an operator released past it."""

    def __init__(self, seglog: SegmentLog) -> None:
        self.log = seglog
        #: the release state applied to every window (deltad.serve.state.release; set by the
        #: sidecar: Redis, or a relay's upstream); everything released until set
        self.rollout: RolloutSource = _Released()

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
        newest step of ``generation`` it may be served: that cap's step and the gate's,
        whichever is lower, as the newest step this log published at or before it (what a
        window ends at, and what Status says), or :data:`NOTHING` (-2): nothing of
        ``generation`` (its release names another generation, or no step is good)."""
        state = self.rollout.state()
        gate = self.gate_cap(state, generation)
        if mirror:
            return Cap(None), gate
        cap = cap_for(state, consumer, generation)
        # a step another rank's gate failed caps this rank too (every rank agrees)
        bad = gate_open(state, generation)
        model_gate = None if bad is None else bad - 1
        step = lower(lower(cap.max_step, gate), model_gate)
        if step is not None and step < 0:
            return cap, NOTHING
        return cap, self.published(step, generation)

    def published(self, step: int | None, generation: int) -> int | None:
        """The newest step this log published at or before ``step`` (``step`` itself if it
        is not below the head, if the log is of another generation, or older than its
        base: nothing to resolve)."""
        snap = self.log.snapshot()
        if step is None or snap is None or snap.generation != generation:
            return step
        entries = snap.entries
        if step >= entries[-1].step or step < entries[0].step:
            return step
        i = bisect.bisect_right(entries, step, key=lambda e: e.step)
        return entries[i - 1].step


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
    """Whether ``d`` would take the consumer past ``cap``: a consumer at or below the cap,
    or one past it that ``d`` takes further than its cursor's entry (the log holds nothing
    at or below the cap for it)."""
    if cap is None or d.to_step <= cap:
        return False
    # (only a consumer already past the cap may be served the entry its cursor is in: one
    # at or below the cap whose state the log no longer holds would be moved past it)
    if stored is not None and stored.generation == d.generation and stored.step > cap:
        first = next((e for e in log.entries if e[0] >= stored.seq), None)
        if first is not None and d.to_seq <= first[0]:
            return False
    return True


class _Released:
    """Everything released (no rollout state known)."""

    known = True
    unknown_reason = ""

    def state(self) -> ReleaseState:
        return ReleaseState()

    def state_json(self) -> str:
        return ReleaseState().to_json()
