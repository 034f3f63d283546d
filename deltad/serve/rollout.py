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

from deltad.errors import RolloutError, RolloutRefused

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
    * ``rollbacks``: the rollback orders in force (:attr:`rollback`: the newest), one per
      group: a consumer that was away when an order was given follows it when it comes
      back, whatever orders for other groups came since.
    * ``version``: bumped on every change (watchers compare it).
    * ``gate_bad_step``, ``gate_generation``, ``gate_accepted_step``: the gate's first failed
      step and what an operator accepted past it (see :func:`gate_failed`, :func:`release`).
    """

    release_step: int | None = HEAD
    held: bool = False
    gate_reason: str = ""
    #: the newest step the validation gate passed (None: the gate has not failed anything)
    gate_good_step: int | None = None
    pins: tuple[Pin, ...] = ()
    canary: tuple[str, ...] = ()
    #: the rollback orders in force, oldest first (a consumer follows the newest one whose
    #: group matches it: :func:`order_for`); at most :data:`MAX_ROLLBACKS`
    rollbacks: tuple[Rollback, ...] = ()
    #: the newest order's epoch ever given (orders end, their epochs are never given again:
    #: a cursor records the highest epoch it followed)
    last_rollback_epoch: int = 0
    version: int = 0
    #: the first step the validation gate failed (None: none), and the generation the gate
    #: fields (failure and acceptance) are of
    gate_bad_step: int | None = None
    gate_generation: int | None = None
    #: an operator released past the gate (``release --force``): steps up to this one of
    #: ``gate_generation`` are served even if the gate failed them
    gate_accepted_step: int | None = None

    def to_json(self) -> str:
        """The stored form (one Redis string per model)."""
        d: dict[str, Any] = {
            "release_step": self.release_step,
            "held": self.held,
            "gate_reason": self.gate_reason,
            "gate_good_step": self.gate_good_step,
            "pins": [[p.group, p.step] for p in self.pins],
            "canary": list(self.canary),
            # (the newest order alone, as readers before "rollbacks" know it)
            "rollback": None
            if self.rollback is None
            else [self.rollback.to_step, self.rollback.group, self.rollback.epoch],
            "rollbacks": [[r.to_step, r.group, r.epoch] for r in self.rollbacks],
            "last_rollback_epoch": self.last_rollback_epoch,
            "version": self.version,
            "gate_bad_step": self.gate_bad_step,
            "gate_generation": self.gate_generation,
            "gate_accepted_step": self.gate_accepted_step,
        }
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReleaseState:
        """The state of its stored form; ValueError naming the field if it is not one (a
        hand-edited or corrupt value: a step that is not a non-negative integer, a group
        that is not a string, ...), so no reader takes a state the controls could not have
        written."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("release state: not a JSON object")
        rbs = d.get("rollbacks")
        if rbs is None:  # written before "rollbacks": the one order
            rbs = [] if d.get("rollback") is None else [d["rollback"]]
        orders = tuple(
            Rollback(_step(f"rollbacks[{i}] step", r[0]), _text(f"rollbacks[{i}] group", r[1]),
                     _step(f"rollbacks[{i}] epoch", r[2]))
            for i, r in enumerate(_items("rollbacks", rbs, 3))
        )  # fmt: skip
        last = _step("last_rollback_epoch", d.get("last_rollback_epoch", 0))
        held = d.get("held", False)
        if not isinstance(held, bool):
            raise ValueError(f"release state: held must be true or false, not {held!r:.32}")
        return cls(
            # (-1: a base failed the gate, no step is good: gate_failed)
            release_step=_step("release_step", d.get("release_step"), none=True, lo=-1),
            held=held,
            gate_reason=_text("gate_reason", d.get("gate_reason", "")),
            gate_good_step=_step("gate_good_step", d.get("gate_good_step"), none=True, lo=-1),
            pins=tuple(
                Pin(_text(f"pins[{i}] group", g), _step(f"pins[{i}] step", st))
                for i, (g, st) in enumerate(_items("pins", d.get("pins", []), 2))
            ),
            canary=tuple(
                _text(f"canary[{i}]", g)
                for i, g in enumerate(_items("canary", d.get("canary", [])))
            ),
            rollbacks=orders,
            last_rollback_epoch=max([last, *(r.epoch for r in orders)]),
            version=_step("version", d.get("version", 0)),
            gate_bad_step=_step("gate_bad_step", d.get("gate_bad_step"), none=True),
            gate_generation=_step("gate_generation", d.get("gate_generation"), none=True),
            gate_accepted_step=_step("gate_accepted_step", d.get("gate_accepted_step"), none=True),
        )

    @property
    def rollback(self) -> Rollback | None:
        """The newest rollback order (None: none)."""
        return self.rollbacks[-1] if self.rollbacks else None

    def bumped(self, **changes: Any) -> ReleaseState:
        """A copy with ``changes`` and the next version."""
        return replace(self, version=self.version + 1, **changes)


def _step(name: str, value: Any, *, none: bool = False, lo: int = 0) -> Any:
    """``value`` if it is an integer >= ``lo`` (or None where ``none``), else ValueError."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"release state: {name} must be an integer >= {lo}, not {value!r:.32}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"release state: {name} must be a string, not {value!r:.32}")
    return value


def _items(name: str, value: Any, width: int = 0) -> list[Any]:
    """``value`` if it is a list (of lists of ``width`` items, if given), else ValueError."""
    ok = isinstance(value, list) and (
        not width or all(isinstance(x, list) and len(x) == width for x in value)
    )
    if not ok:
        shape = f" of [{', '.join(['...'] * width)}]" if width else ""
        raise ValueError(f"release state: {name} must be a list{shape}, not {value!r:.48}")
    return value


def lower(a: int | None, b: int | None) -> int | None:
    """The lower of two step bounds (None: no bound)."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


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


def served_steps(state: ReleaseState, generation: int) -> set[int]:
    """The steps below the head whose state ``state`` serves to some consumer of
    ``generation``: the release step (a hold or a release to a step; the gate's last good
    step is one then) and every pin's step. Retention keeps each in the log, and a relay's
    mirror ends a segment at each (deltad.serve.relay.mirror)."""
    steps = {p.step for p in state.pins}
    if state.release_step is not None:
        steps.add(state.release_step)
    # (as target_step serves it to canaries while held, whatever generation the hold is of)
    if (
        state.held or gate_open(state, generation) is not None
    ) and state.gate_good_step is not None:
        steps.add(state.gate_good_step)
    return steps


@dataclass(frozen=True)
class Cap:
    """How a window is bounded for one consumer: ``max_step`` (None: the head) and a
    rollback order it must follow first (None: none)."""

    max_step: int | None
    rollback: Rollback | None = None
    reasons: tuple[str, ...] = field(default=())


def order_for(state: ReleaseState, consumer: str) -> Rollback | None:
    """The rollback order ``consumer`` follows: the newest whose group matches it (a newer
    order naming it replaces an older one; orders for other groups do not)."""
    for rb in reversed(state.rollbacks):
        if matches(rb.group, consumer):
            return rb
    return None


def cap_for(state: ReleaseState, consumer: str) -> Cap:
    """The cap :func:`target_step` and the rollback order put on ``consumer``'s window."""
    return Cap(target_step(state, consumer), order_for(state, consumer))


# ---- the controls, as pure changes of a state -----------------------------------------------
#
# Each takes the current state and returns the next (the store bumps ``version`` and writes it
# atomically); RolloutError for bad arguments, RolloutRefused when things stand in the way.

#: A group glob: printable, no whitespace, at most this long.
MAX_GROUP = 256
#: Rollback orders of distinct groups in force at once (a release to the head ends the
#: model-wide ones, an unpin a group's).
MAX_ROLLBACKS = 32
#: What a consumer name is made of (deltad.config.check_name), and fnmatch's own characters.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_GLOB_CHARS = frozenset("*?[]!")


def check_group(group: str, *, new: bool = True) -> str:
    """``group`` if it is a usable consumer-name glob, else RolloutError. A ``new`` group (a
    pin, a canary, a rollback order being created) must also be able to match a consumer
    name: names are ``[A-Za-z0-9][A-Za-z0-9_.-]*``, so a glob with any other character, a
    ``!`` outside ``[...]``, or a ``[`` that is never closed or holds nothing (fnmatch takes
    those literally) would match nobody, silently. Removing a group takes any group the
    state holds (one recorded before this check still goes)."""
    if (
        not group
        or len(group) > MAX_GROUP
        or not group.isprintable()
        or any(c.isspace() for c in group)
    ):
        raise RolloutError(
            f"group must be a consumer-name glob of 1..{MAX_GROUP} printable characters "
            f"without spaces, got {group[:64]!r}"
        )
    if new:
        _check_matchable(group)
    return group


def _check_matchable(group: str) -> None:
    odd = sorted({c for c in group if c not in _NAME_CHARS and c not in _GLOB_CHARS})
    if odd:
        raise RolloutError(
            f"group {group[:64]!r} can match no consumer: names are made of letters, digits, "
            f"'_', '.' and '-' (and a glob of '*', '?', '[...]'), not {''.join(odd)!r}"
        )
    i, n = 0, len(group)
    while i < n:
        c = group[i]
        if c == "!" or c == "]":
            raise RolloutError(f"group {group[:64]!r} can match no consumer: {c!r} outside '[...]'")
        if c == "[":
            j = i + 1
            negated = j < n and group[j] == "!"
            j += negated
            # (fnmatch: a "]" right after "[" or "[!" is a member, not the end)
            k = group.find("]", j + 1 if j < n and group[j] == "]" else j)
            if k < 0:
                raise RolloutError(f"group {group[:64]!r} opens a '[' it never closes")
            inner = group[j:k]
            members = _members(inner)
            if not (_NAME_CHARS - members if negated else _NAME_CHARS & members):
                raise RolloutError(
                    f"group {group[:64]!r} can match no consumer: '[{group[i + 1 : k]}]' "
                    "is not a set of name characters"
                )
            i = k + 1
            continue
        i += 1


def _members(inner: str) -> frozenset[str]:
    """The name characters a bracket set's inside ``inner`` holds, as fnmatch reads it
    (``a-z`` a range; a reversed one, ``9-0``, holds nothing)."""
    out: set[str] = set()
    i = 0
    while i < len(inner):
        if i + 2 < len(inner) and inner[i + 1] == "-":
            lo, hi = inner[i], inner[i + 2]
            out |= {c for c in _NAME_CHARS if lo <= c <= hi}
            i += 3
        else:
            out.add(inner[i])
            i += 1
    return frozenset(out)


def check_step(step: int, head_step: int | None) -> int:
    """``step`` if it is >= 0 and (if the head is known) <= the head, else RolloutError."""
    if step < 0:
        raise RolloutError(f"step must be >= 0, got {step}")
    if head_step is not None and step > head_step:
        raise RolloutError(f"step {step} is past the head step {head_step}")
    return step


def gate_open(state: ReleaseState, generation: int | None) -> int | None:
    """The gate's failed step that still stands in the way (None: none): of ``generation``
    (None: any) and not accepted by an operator."""
    bad = state.gate_bad_step
    if bad is None or (generation is not None and state.gate_generation != generation):
        return None
    if state.gate_accepted_step is not None and state.gate_accepted_step >= bad:
        return None
    return bad


def hold(state: ReleaseState, head_step: int) -> ReleaseState:
    """Serve nobody past the current release step (the head step now if the head is
    released); canaries keep following the head (below a gate failure)."""
    step = head_step if state.release_step is None else state.release_step
    return replace(state, release_step=step, held=True)


def release(
    state: ReleaseState,
    to_step: int | None,
    *,
    head_step: int,
    generation: int,
    force: bool = False,
) -> ReleaseState:
    """Release to the head (``to_step`` None) or to ``to_step``.

    A step the validation gate failed (in ``generation``) lies in the way of a release to
    or past it: refused unless ``force`` (the operator accepts every step up to the release
    step, or up to ``head_step`` for a release to the head; a later failure holds again)."""
    if to_step is not None:
        check_step(to_step, head_step)
    bad = gate_open(state, generation)
    gate: dict[str, Any] = {}
    if bad is not None and (to_step is None or to_step >= bad):
        if not force:
            raise RolloutRefused(
                f"step {bad} failed the validation gate ({state.gate_reason or 'no reason'}); "
                f"release --to-step S below {bad}, roll back, or release --force to serve it"
            )
        accepted = head_step if to_step is None else to_step
        gate = dict(gate_accepted_step=accepted, gate_reason="", gate_good_step=None)
    elif bad is None and state.gate_bad_step is not None:
        # an old or accepted failure: its step stays recorded (a rank still serving that
        # generation, its new base late, keeps it out), only its hold ends
        gate = dict(gate_reason="", gate_good_step=None)
    # the model-wide rollback orders end with a release to the head: a consumer away since
    # would go back to the order's step only to come forward again
    orders = state.rollbacks
    if to_step is None:
        orders = tuple(r for r in orders if r.group != "*")
    return replace(state, release_step=to_step, held=False, rollbacks=orders, **gate)


def pin(state: ReleaseState, group: str, step: int, *, head_step: int | None) -> ReleaseState:
    """Keep consumers matching ``group`` at ``step`` (replaces a pin of the same group)."""
    check_group(group)
    check_step(step, head_step)
    pins = (*(p for p in state.pins if p.group != group), Pin(group, step))
    return replace(state, pins=pins)


def unpin(state: ReleaseState, group: str) -> ReleaseState:
    """Drop the pin of ``group``; RolloutError if there is none."""
    check_group(group, new=False)
    if all(p.group != group for p in state.pins):
        have = ", ".join(p.group for p in state.pins) or "none"
        raise RolloutError(f"no pin of group {group!r} (pins: {have})")
    # a rollback order of the group ends with its pin (the group follows the release again)
    orders = tuple(r for r in state.rollbacks if r.group != group)
    return replace(state, pins=tuple(p for p in state.pins if p.group != group), rollbacks=orders)


def canary(state: ReleaseState, group: str, *, on: bool = True) -> ReleaseState:
    """Let ``group`` follow the head (``on``) or stop it (it goes back to the release step's
    cap: it is not rolled back, it stops moving until the release passes it)."""
    check_group(group, new=on)
    if on:
        if group in state.canary:
            return state
        return replace(state, canary=(*state.canary, group))
    if group not in state.canary:
        have = ", ".join(state.canary) or "none"
        raise RolloutError(f"no canary group {group!r} (canaries: {have})")
    return replace(state, canary=tuple(g for g in state.canary if g != group))


def rollback(
    state: ReleaseState,
    to_step: int,
    group: str = "*",
    *,
    head_step: int | None,
    first_epoch: int = 1,
) -> ReleaseState:
    """Order consumers matching ``group`` back to ``to_step`` and cap them there, so none
    rolls forward again until a release: for every consumer ("*"), the release step held
    at ``to_step``, the canaries stopped and the pins past it dropped; for a group, a pin of
    it at ``to_step``. The order replaces older orders of the same group (all of them for
    "*") and stays beside those of other groups, so a consumer away now follows it when it
    comes back (:func:`order_for`)."""
    check_group(group)
    check_step(to_step, head_step)
    # (``first_epoch``: where numbering starts in a state with no order in its history; the
    # Rollout RPC passes the time in seconds, so a state lost or deleted from Redis never gives
    # an epoch again that cursors recorded as followed)
    epoch = max([state.last_rollback_epoch, *(r.epoch for r in state.rollbacks)]) + 1
    if not state.last_rollback_epoch and not state.rollbacks:
        epoch = max(epoch, first_epoch)
    order = Rollback(to_step, group, epoch)
    # the orders it replaces: the same group's, or every order for "*" (a consumer follows
    # the newest order naming it, so they could never apply again)
    kept = () if group == "*" else tuple(r for r in state.rollbacks if r.group != group)
    if len(kept) >= MAX_ROLLBACKS:
        raise RolloutRefused(
            f"{len(kept)} rollback orders of other groups are in force (at most "
            f"{MAX_ROLLBACKS}): unpin groups that are done, or roll back every consumer ('*')"
        )
    orders = (*kept, order)
    if group == "*":  # (a pin past the step would take its group forward again)
        pins = tuple(p for p in state.pins if p.step <= to_step)
        return replace(
            state, rollbacks=orders, release_step=to_step, held=True, canary=(), pins=pins,
            last_rollback_epoch=epoch,
        )  # fmt: skip
    # (first: a pin of a narrower group, e.g. pred-main-* under pred-*, would take its
    # consumers forward again past the order's step)
    pins = (Pin(group, to_step), *(p for p in state.pins if p.group != group))
    return replace(state, rollbacks=orders, pins=pins, last_rollback_epoch=epoch)


def gate_failed(
    state: ReleaseState, *, generation: int, bad_step: int, good_step: int, reason: str
) -> ReleaseState:
    """The validation gate failed ``bad_step`` of ``generation``: hold the model at
    ``good_step`` (the newest step before it), unless the state knows already (an earlier
    or equal failure of that generation) or an operator accepted the step."""
    if state.gate_generation == generation:
        if state.gate_accepted_step is not None and state.gate_accepted_step >= bad_step:
            return state
        known = state.gate_bad_step
        if gate_open(state, generation) is not None and known is not None and known <= bad_step:
            return state
    release_step = good_step if state.release_step is None else min(state.release_step, good_step)
    accepted = state.gate_accepted_step if state.gate_generation == generation else None
    return replace(
        state,
        release_step=release_step,
        held=True,
        gate_reason=reason[:500],
        gate_good_step=good_step,
        gate_bad_step=bad_step,
        gate_generation=generation,
        gate_accepted_step=accepted,
    )


def redacted_json(raw: str) -> str:
    """The stored state ``raw`` for a credential that may see only its own consumers: the
    release step, hold and gate as they are; the pins, canary groups and a group's rollback
    order (other consumers' names and globs) left out, and ``"redacted": true``. ("" stays "":
    no release state.)"""
    if not raw:
        return raw
    d = json.loads(raw)
    d["pins"], d["canary"] = [], []
    rb = d.get("rollback")
    if rb is not None and rb[1] not in ("", "*"):
        d["rollback"] = None
    if "rollbacks" in d:
        d["rollbacks"] = [r for r in d["rollbacks"] if r[1] in ("", "*")]
        # (a reader that knows only "rollback" must still see an order for every consumer)
        d["rollback"] = d["rollbacks"][-1] if d["rollbacks"] else None
    d["redacted"] = True
    return json.dumps(d, separators=(",", ":"), sort_keys=True)


def describe(
    state: ReleaseState, *, redacted: bool = False, generation: int | None = None
) -> list[str]:
    """The state as short human lines (``deltad rollout status``, ``deltad status``);
    ``generation``: the one served, to tell a gate failure of an earlier one."""
    rel = "head" if state.release_step is None else f"step {state.release_step}"
    lines = [f"release: {rel}{' (held)' if state.held else ''} (version {state.version})"]
    earlier = (
        generation is not None
        and state.gate_generation is not None
        and state.gate_generation != generation
    )
    if state.gate_bad_step is not None and state.gate_reason:
        if earlier:
            lines.append(
                f"gate: step {state.gate_bad_step} failed in an earlier generation "
                f"({state.gate_generation}; {generation} is served now): {state.gate_reason}"
            )
            if state.held:
                lines.append(
                    f"gate: the hold it set stays on this generation: its consumers stop at "
                    f"step {state.release_step} until an operator releases them (deltad "
                    "rollout release)"
                )
        else:
            lines.append(
                f"gate: step {state.gate_bad_step} failed (generation {state.gate_generation}): "
                f"{state.gate_reason}; holding at step {state.gate_good_step}"
            )
    if state.gate_accepted_step is not None and not (earlier and not state.held):
        of = f" of generation {state.gate_generation}" if earlier else ""
        lines.append(
            f"gate: released past by an operator up to step {state.gate_accepted_step}{of}"
        )
    for p in state.pins:
        lines.append(f"pin: {p.group} at step {p.step}")
    for g in state.canary:
        lines.append(f"canary: {g} follows the head")
    for rb in state.rollbacks:
        lines.append(f"rollback: {rb.group} to step {rb.to_step} (order {rb.epoch})")
    if redacted:
        lines.append("pins, canary groups and group rollbacks: shown to admin credentials only")
    return lines
