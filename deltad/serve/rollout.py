"""The model-wide release state: how far each consumer may be served (hold, release, pin,
canary, rollback), as a value type and pure functions.

This module is the seam between the rollout controls (persisted in Redis, set over the
admin RPCs and ``deltad rollout``) and the window decision: the sidecar and every relay read
one :class:`ReleaseState` per model and ask :func:`target_step` how far a consumer may go.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field, replace
from typing import Any

#: Serve every consumer up to the head: no hold, no pin, no canary, no rollback.
HEAD: int | None = None


@dataclass(frozen=True)
class Pin:
    """Consumers whose name matches ``group`` (an fnmatch glob) stay at ``step``."""

    group: str
    step: int


@dataclass(frozen=True)
class Rollback:
    """Consumers matching ``group`` ("*": all) past ``to_step`` go back to exactly its state.

    ``epoch`` numbers the orders, so a consumer that already rolled back to one order is not
    rolled back again by it (and a new order with the same step is a new order)."""

    to_step: int
    group: str = "*"
    epoch: int = 0


@dataclass(frozen=True)
class ReleaseState:
    """Everything a sidecar or relay needs to decide how far a consumer may be served.

    * ``release_step``: None, the head is released; else serve at most this step.
    * ``held``: set by ``hold`` or by the validation gate (``gate_reason`` says why); while
      held, ``release_step`` is the last released (good) step.
    * ``pins``: groups kept at a step (the first matching pin wins).
    * ``canary``: groups that follow the head (bounded by the gate's last good step) while
      the rest stays at ``release_step``.
    * ``rollback``: the last rollback order, if any.
    * ``version``: bumped on every change (watchers compare it).
    """

    release_step: int | None = HEAD
    held: bool = False
    gate_reason: str = ""
    #: the newest step the validation gate passed (None: the gate has not failed anything)
    gate_good_step: int | None = None
    pins: tuple[Pin, ...] = ()
    canary: tuple[str, ...] = ()
    rollback: Rollback | None = None
    version: int = 0

    def to_json(self) -> str:
        """The stored form (one Redis string per model)."""
        d: dict[str, Any] = {
            "release_step": self.release_step,
            "held": self.held,
            "gate_reason": self.gate_reason,
            "gate_good_step": self.gate_good_step,
            "pins": [[p.group, p.step] for p in self.pins],
            "canary": list(self.canary),
            "rollback": None
            if self.rollback is None
            else [self.rollback.to_step, self.rollback.group, self.rollback.epoch],
            "version": self.version,
        }
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReleaseState:
        d = json.loads(raw)
        rb = d.get("rollback")
        return cls(
            release_step=d.get("release_step"),
            held=bool(d.get("held", False)),
            gate_reason=str(d.get("gate_reason", "")),
            gate_good_step=d.get("gate_good_step"),
            pins=tuple(Pin(str(g), int(s)) for g, s in d.get("pins", [])),
            canary=tuple(str(g) for g in d.get("canary", [])),
            rollback=None if rb is None else Rollback(int(rb[0]), str(rb[1]), int(rb[2])),
            version=int(d.get("version", 0)),
        )

    def bumped(self, **changes: Any) -> ReleaseState:
        """A copy with ``changes`` and the next version."""
        return replace(self, version=self.version + 1, **changes)


def matches(group: str, consumer: str) -> bool:
    """A consumer name matches a group glob (fnmatch, case-sensitive)."""
    return fnmatch.fnmatchcase(consumer, group)


def target_step(state: ReleaseState, consumer: str) -> int | None:
    """The newest step ``consumer`` may be served (None: the head), before any rollback.

    A pin wins over a canary, a canary over the release step; a canary never passes the
    gate's last good step."""
    for pin in state.pins:
        if matches(pin.group, consumer):
            return pin.step
    if any(matches(g, consumer) for g in state.canary):
        return state.gate_good_step if state.held else None
    return state.release_step


@dataclass(frozen=True)
class Cap:
    """How a window is bounded for one consumer: ``max_step`` (None: the head) and a
    rollback order it must follow first (None: none)."""

    max_step: int | None
    rollback: Rollback | None = None
    reasons: tuple[str, ...] = field(default=())


def cap_for(state: ReleaseState, consumer: str) -> Cap:
    """The cap :func:`target_step` and the rollback order put on ``consumer``'s window."""
    rb = state.rollback
    rollback = rb if rb is not None and matches(rb.group, consumer) else None
    return Cap(target_step(state, consumer), rollback)
