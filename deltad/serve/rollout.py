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
#: A cap of "nothing of the generation served": the consumer's release names a state of
#: another generation (a hold, pin or release recorded before the trainer restarted), so it
#: keeps what it holds and is served nothing new until a release names this generation
#: (ConsumerInfo.cap_step / StatusResponse.cap_step say -2).
NOTHING = -2
#: The largest step (and generation, epoch, version) a stored state may hold: 2^53 - 1, an
#: integer every JSON reader keeps exact; past it a value was not written by the controls.
MAX_STEP = (1 << 53) - 1
#: The largest generation a stored state may hold (StatusResponse.generation is a uint64; the
#: reference trainer's are nanosecond times).
MAX_GENERATION = (1 << 63) - 1


@dataclass(frozen=True)
class Pin:
    """Consumers whose name matches ``group`` (an fnmatch glob) stay at ``step`` of
    ``generation`` (None: recorded before pins named one; of whatever generation is served)."""

    group: str
    step: int
    generation: int | None = None


@dataclass(frozen=True)
class Rollback:
    """Consumers matching ``group`` ("*": all) past ``to_step`` go back to exactly its state.

    ``epoch`` numbers the orders, so a consumer that already rolled back to one order is not
    rolled back again by it (and a new order with the same step is a new order)."""

    to_step: int
    group: str = "*"
    epoch: int = 0
    #: the generation ``to_step`` is of (None: recorded before orders named one); an order
    #: applies to cursors of that generation only
    generation: int | None = None


@dataclass(frozen=True)
class ReleaseState:
    """Everything a sidecar or relay needs to decide how far a consumer may be served.

    * ``release_step``: None, the head is released; else serve at most this step of
      ``release_generation`` (None: recorded before releases named a generation, of whatever
      generation is served); nothing of another generation is served past a release or a
      hold: a restarted trainer's new generation waits for a release that names it.
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
    #: the generation ``release_step`` is of (None: the head is released, or not recorded)
    release_generation: int | None = None

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
            # (beside the older fields, not inside them: a reader that predates generations
            # reads "pins" and "rollbacks" as it always did)
            "release_generation": self.release_generation,
            "pin_generations": [p.generation for p in self.pins],
            "rollback_generations": [r.generation for r in self.rollbacks],
        }
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReleaseState:
        """The state of its stored form; ValueError naming the field if it is not one the
        controls could have written (see :func:`check_stored`): not a JSON object, a field
        missing or unknown, a step that is not an integer in 0..2^53-1, a group that is not
        a glob, ..., so no reader takes a hand-edited or corrupt value (``{}``, a pin of
        ``*`` at step 2^63-1) as a release."""
        if len(raw) > MAX_STATE_BYTES:
            raise ValueError(f"release state: {len(raw)} bytes, more than {MAX_STATE_BYTES}")
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("release state: not a JSON object")
        unknown = sorted(set(d) - KNOWN_FIELDS)
        if unknown:
            raise ValueError(f"release state: unknown field {', '.join(unknown)[:64]!r}")
        rbs = d.get("rollbacks")
        if rbs is None:  # written before "rollbacks": the one order
            rbs = [] if d.get("rollback") is None else [d["rollback"]]
        rbs = _items("rollbacks", rbs, 3)
        if len(rbs) > MAX_ROLLBACKS + 1:
            raise ValueError(
                f"release state: {len(rbs)} rollback orders (at most {MAX_ROLLBACKS + 1})"
            )
        rb_gens = _gens("rollback_generations", d.get("rollback_generations"), len(rbs))
        orders = tuple(
            Rollback(_step(f"rollbacks[{i}] step", r[0]), _glob(f"rollbacks[{i}] group", r[1]),
                     _step(f"rollbacks[{i}] epoch", r[2]), rb_gens[i])
            for i, r in enumerate(rbs)
        )  # fmt: skip
        if d.get("rollback") is not None:  # (the newest order, for older readers)
            _items("rollback", [d["rollback"]], 3)
        last = _step("last_rollback_epoch", d.get("last_rollback_epoch", 0))
        held = d.get("held", False)
        if not isinstance(held, bool):
            raise ValueError(f"release state: held must be true or false, not {held!r:.32}")
        pins = _items("pins", d.get("pins", []), 2)
        canaries = _items("canary", d.get("canary", []))
        if len(pins) > MAX_GROUPS or len(canaries) > MAX_GROUPS:
            raise ValueError(f"release state: more than {MAX_GROUPS} pins or canary groups")
        pin_gens = _gens("pin_generations", d.get("pin_generations"), len(pins))
        if not isinstance(d.get("redacted", False), bool):
            raise ValueError("release state: redacted must be true or false")
        # (-1: a base failed the gate, no step is good: gate_failed)
        release_step = _step("release_step", d.get("release_step"), none=True, lo=-1)
        if held and release_step is None:
            raise ValueError("release state: held, but no release step to hold at")
        state = cls(
            release_step=release_step,
            held=held,
            gate_reason=_text("gate_reason", d.get("gate_reason", "")),
            gate_good_step=_step("gate_good_step", d.get("gate_good_step"), none=True, lo=-1),
            pins=tuple(
                Pin(_glob(f"pins[{i}] group", g), _step(f"pins[{i}] step", st), pin_gens[i])
                for i, (g, st) in enumerate(pins)
            ),
            canary=tuple(_glob(f"canary[{i}]", g) for i, g in enumerate(canaries)),
            rollbacks=orders,
            last_rollback_epoch=max([last, *(r.epoch for r in orders)]),
            version=_step("version", d.get("version", 0)),
            gate_bad_step=_step("gate_bad_step", d.get("gate_bad_step"), none=True),
            gate_generation=_gen("gate_generation", d.get("gate_generation")),
            gate_accepted_step=_step("gate_accepted_step", d.get("gate_accepted_step"), none=True),
            release_generation=_gen("release_generation", d.get("release_generation")),
        )
        missing = sorted(REQUIRED_FIELDS - d.keys())
        if missing:  # (every writer wrote them: "{}" is no state)
            raise ValueError(
                f"release state: no {', no '.join(missing)} (every writer writes them)"
            )
        if state.gate_bad_step is not None and state.gate_generation is None:
            raise ValueError("release state: a gate failure (gate_bad_step) of no generation")
        return state

    @property
    def rollback(self) -> Rollback | None:
        """The newest rollback order (None: none)."""
        return self.rollbacks[-1] if self.rollbacks else None

    def bumped(self, **changes: Any) -> ReleaseState:
        """A copy with ``changes`` and the next version."""
        return replace(self, version=self.version + 1, **changes)


#: The fields a stored state holds: those every writer wrote (since the first) and the others.
REQUIRED_FIELDS = frozenset({"release_step", "held", "version"})
KNOWN_FIELDS = REQUIRED_FIELDS | frozenset(
    {
        "gate_reason", "gate_good_step", "pins", "canary", "rollback", "rollbacks",
        "last_rollback_epoch", "gate_bad_step", "gate_generation", "gate_accepted_step",
        "release_generation", "pin_generations", "rollback_generations",
        # (a relay's Status: see redacted_json; a sidecar's, while Redis holds a bad value)
        "redacted", "refused",
    }
)  # fmt: skip
#: A stored state larger than this is not one the controls wrote.
MAX_STATE_BYTES = 1 << 20
#: Pins, and canary groups, a stored state may hold.
MAX_GROUPS = 1024


def _step(name: str, value: Any, *, none: bool = False, lo: int = 0, hi: int = MAX_STEP) -> Any:
    """``value`` if it is an integer in ``lo``..``hi`` (or None where ``none``), else
    ValueError."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(
            f"release state: {name} must be an integer in {lo}..{hi}, not {value!r:.32}"
        )
    return value


def _gen(name: str, value: Any) -> Any:
    """A generation (or None): an integer in 0..:data:`MAX_GENERATION` (the reference
    trainer's are nanosecond times, past 2^53)."""
    return _step(name, value, none=True, hi=MAX_GENERATION)


def _glob(name: str, value: Any) -> str:
    """``value`` if it is a group glob a control could have recorded (printable, no space,
    at most :data:`MAX_STORED_GROUP` characters), else ValueError."""
    group = _text(name, value)
    if (
        not group
        or len(group) > MAX_STORED_GROUP
        or not group.isprintable()
        or any(c.isspace() for c in group)
    ):
        raise ValueError(f"release state: {name} is not a group glob: {group[:64]!r}")
    return group


def _gens(name: str, value: Any, n: int) -> list[int | None]:
    """The generations of ``n`` pins or orders (None: a state written before they were
    recorded: n Nones)."""
    if value is None:
        return [None] * n
    items = _items(name, value)
    if len(items) != n:
        raise ValueError(f"release state: {name} holds {len(items)} items for {n}")
    return [_gen(f"{name}[{i}]", g) for i, g in enumerate(items)]


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


def of_generation(recorded: int | None, generation: int | None) -> bool:
    """Whether a step recorded of generation ``recorded`` (None: not recorded, any) is a step
    of ``generation`` (None: any)."""
    return recorded is None or generation is None or recorded == generation


def target_step(state: ReleaseState, consumer: str, generation: int | None = None) -> int | None:
    """The newest step of ``generation`` (None: whatever is served; as before generations
    were recorded) that ``consumer`` may be served (None: the head; :data:`NOTHING`: none,
    its pin or release names a state of another generation), before any rollback.

    A pin wins over a canary, a canary over the release step; a canary never passes the
    gate's last good step of the generation the gate failed."""
    for pin in state.pins:
        if matches(pin.group, consumer):
            return pin.step if of_generation(pin.generation, generation) else NOTHING
    if any(matches(g, consumer) for g in state.canary):
        if state.held and of_generation(state.gate_generation, generation):
            return state.gate_good_step
        return None
    if state.release_step is None:
        return None
    return state.release_step if of_generation(state.release_generation, generation) else NOTHING


def served_steps(state: ReleaseState, generation: int) -> set[int]:
    """The steps below the head whose state ``state`` serves to some consumer of
    ``generation``: the release step (a hold or a release to a step; the gate's last good
    step is one then) and every pin's step, those of ``generation``. Retention keeps each in
    the log, and a relay's mirror ends a segment at each (deltad.serve.relay.mirror)."""
    steps = {p.step for p in state.pins if of_generation(p.generation, generation)}
    if state.release_step is not None and of_generation(state.release_generation, generation):
        steps.add(state.release_step)
    # (as target_step serves it to canaries while held)
    if (
        (state.held and of_generation(state.gate_generation, generation))
        or gate_open(state, generation) is not None
    ) and state.gate_good_step is not None:
        steps.add(state.gate_good_step)
    return {s for s in steps if s >= 0}


def unreleased(state: ReleaseState, generation: int) -> bool:
    """Whether some consumer is held (a release step or a pin) at a state of another
    generation than ``generation``: any step of ``generation`` may be released to it later,
    so a relay mirrors each (deltad.serve.relay.mirror) as the upstream's log holds them."""
    if state.release_step is not None and not of_generation(state.release_generation, generation):
        return True
    return any(not of_generation(p.generation, generation) for p in state.pins)


@dataclass(frozen=True)
class Cap:
    """How a window is bounded for one consumer: ``max_step`` (None: the head;
    :data:`NOTHING`: nothing of the generation served) and a rollback order it must follow
    first (None: none); ``reasons``: why it is bent (said in refusals and status)."""

    max_step: int | None
    rollback: Rollback | None = None
    reasons: tuple[str, ...] = field(default=())


def order_for(state: ReleaseState, consumer: str, generation: int | None = None) -> Rollback | None:
    """The rollback order ``consumer`` follows: the newest whose group matches it (a newer
    order naming it replaces an older one; orders for other groups do not), among those of
    ``generation`` (None: any)."""
    for rb in reversed(state.rollbacks):
        if matches(rb.group, consumer) and of_generation(rb.generation, generation):
            return rb
    return None


def cap_for(state: ReleaseState, consumer: str, generation: int | None = None) -> Cap:
    """The cap :func:`target_step` and the rollback order put on ``consumer``'s window of
    ``generation`` (None: whatever is served)."""
    step = target_step(state, consumer, generation)
    why: tuple[str, ...] = ()
    if step == NOTHING:
        why = (not_released(state, consumer, generation),)
    return Cap(step, order_for(state, consumer, generation), why)


def not_released(state: ReleaseState, consumer: str, generation: int | None) -> str:
    """Why ``consumer`` is served nothing of ``generation``: the state it is held at."""
    pin = next((p for p in state.pins if matches(p.group, consumer)), None)
    if pin is not None:
        at = f"pinned ({pin.group}) at generation {pin.generation} step {pin.step}"
    else:
        held = "held" if state.held else "released"
        at = f"{held} at generation {state.release_generation} step {state.release_step}"
    return (
        f"consumer {consumer!r} is {at}; generation {generation} is not released to it: it "
        f"keeps what it holds until a release names generation {generation} (deltad "
        "rollout release, answered by a sidecar of that generation)"
    )


def stamped(state: ReleaseState, generation: int) -> ReleaseState:
    """``state`` with the generation of every step recorded before steps named one set to
    ``generation`` (the one served now: how the state was applied until now). A control
    stamps the state it changes, so an old state names its generation from then on."""
    if generation <= 0:
        return state
    rg = state.release_generation
    if state.release_step is not None and rg is None:
        rg = generation
    pins = tuple(
        p if p.generation is not None else replace(p, generation=generation) for p in state.pins
    )
    orders = tuple(
        r if r.generation is not None else replace(r, generation=generation)
        for r in state.rollbacks
    )
    return replace(state, release_generation=rg, pins=pins, rollbacks=orders)


# ---- the controls, as pure changes of a state -----------------------------------------------
#
# Each takes the current state and returns the next (the store bumps ``version`` and writes it
# atomically); RolloutError for bad arguments, RolloutRefused when things stand in the way.

#: A new group glob: at most as long as a consumer name (deltad.config.NAME_PATTERN).
MAX_GROUP = 128
#: A group a stored state may hold (and a control may remove): older controls took globs
#: up to this long.
MAX_STORED_GROUP = 256
#: Rollback orders of distinct groups in force at once (a release to the head ends the
#: model-wide ones, an unpin a group's).
MAX_ROLLBACKS = 32
#: What a consumer name is made of (deltad.config.check_name), and fnmatch's own characters.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_FIRST_CHARS = frozenset(c for c in _NAME_CHARS if c.isalnum())
_GLOB_CHARS = frozenset("*?[]!")


def check_group(group: str, *, new: bool = True) -> str:
    """``group`` if it is a usable consumer-name glob, else RolloutError. A ``new`` group (a
    pin, a canary, a rollback order being created) is bounded and checked as a consumer name
    is (deltad.config.check_name: 1..128 characters of ``[A-Za-z0-9_.-]``, the first a letter
    or digit), with fnmatch's ``*``, ``?`` and ``[...]`` besides: it must be able to match
    some name. A glob with any other character, a ``!`` outside ``[...]``, a ``[`` never
    closed or holding no name character, a first character no name starts with (``..``,
    ``-x``) or longer than a name would match nobody, silently. Removing a group takes any
    group the state holds (one recorded before this check still goes)."""
    limit = MAX_GROUP if new else MAX_STORED_GROUP
    if (
        not group
        or len(group) > limit
        or not group.isprintable()
        or any(c.isspace() for c in group)
    ):
        raise RolloutError(
            f"group must be a consumer-name glob of 1..{limit} printable characters "
            f"without spaces (a consumer name is at most {MAX_GROUP}), got {len(group)} "
            f"characters: {group[:64]!r}"
        )
    if new:
        _check_matchable(group)
    return group


def _check_matchable(group: str) -> None:
    """RolloutError unless some consumer name (``[A-Za-z0-9][A-Za-z0-9_.-]{0,127}``) matches
    ``group``: each of its parts holds a name character, and it can begin with a letter or
    digit."""
    odd = sorted({c for c in group if c not in _NAME_CHARS and c not in _GLOB_CHARS})
    if odd:
        raise RolloutError(
            f"group {group[:64]!r} can match no consumer: names are made of letters, digits, "
            f"'_', '.' and '-' (and a glob of '*', '?', '[...]'), not {''.join(odd)!r}"
        )
    # each part of the glob: None for "*" (any run of name characters), else the name
    # characters the one character it matches may be
    parts: list[frozenset[str] | None] = []
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
            chars = _NAME_CHARS - members if negated else _NAME_CHARS & members
            if not chars:
                raise RolloutError(
                    f"group {group[:64]!r} can match no consumer: '[{group[i + 1 : k]}]' "
                    "is not a set of name characters"
                )
            parts.append(frozenset(chars))
            i = k + 1
            continue
        parts.append(None if c == "*" else _NAME_CHARS if c == "?" else frozenset(c))
        i += 1
    first = parts[0]
    if first is not None and not first & _FIRST_CHARS:
        raise RolloutError(
            f"group {group[:64]!r} can match no consumer: a consumer name starts with a letter "
            "or a digit"
        )


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


def hold(state: ReleaseState, head_step: int, generation: int | None = None) -> ReleaseState:
    """Serve nobody past the current release step (the head step of ``generation`` now if
    the head is released); canaries keep following the head (below a gate failure)."""
    if state.release_step is None:
        return replace(state, release_step=head_step, release_generation=generation, held=True)
    return replace(state, held=True)


def release(
    state: ReleaseState,
    to_step: int | None,
    *,
    head_step: int,
    generation: int,
    force: bool = False,
) -> ReleaseState:
    """Release to the head (``to_step`` None: of every generation from now on) or to
    ``to_step`` of ``generation``.

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
    rg = None if to_step is None else generation
    return replace(
        state, release_step=to_step, release_generation=rg, held=False, rollbacks=orders, **gate
    )


def pin(
    state: ReleaseState,
    group: str,
    step: int,
    *,
    head_step: int | None,
    generation: int | None = None,
) -> ReleaseState:
    """Keep consumers matching ``group`` at ``step`` of ``generation`` (replaces a pin of the
    same group). A step at or past one the validation gate failed in ``generation`` is
    refused, as a release to it is (release --force accepts the failure first)."""
    check_group(group)
    check_step(step, head_step)
    bad = gate_open(state, generation) if generation is not None else None
    if bad is not None and step >= bad:
        raise RolloutRefused(
            f"step {bad} failed the validation gate ({state.gate_reason or 'no reason'}): a pin "
            f"at step {step} would be served at most step {state.gate_good_step} (the newest "
            f"good step); pin at a step below {bad}, or accept the failure first (release "
            "--force)"
        )
    pins = (*(p for p in state.pins if p.group != group), Pin(group, step, generation))
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


def forward_of(state: ReleaseState, to_step: int, group: str, generation: int | None) -> str:
    """Why a rollback of ``group`` to ``to_step`` of ``generation`` would move consumers
    FORWARD ("" if it moves nobody forward): the group's pin, or the release step held (of
    the whole fleet, for "*"), is older than ``to_step`` or of another generation."""
    if group != "*":
        p = next((p for p in state.pins if p.group == group), None)
        if p is None:
            if group in state.canary or state.release_step is None:
                return ""
            at, gen = state.release_step, state.release_generation
            who = f"{group} follows the release (step {at})"
        else:
            at, gen, who = p.step, p.generation, f"{group} is pinned at step {p.step}"
    else:
        if state.release_step is None:
            return ""
        at, gen = state.release_step, state.release_generation
        who = f"the fleet is {'held' if state.held else 'released'} at step {at}"
    if not of_generation(gen, generation):
        return (
            f"{who} of generation {gen}: a rollback to step {to_step} of generation "
            f"{generation} would move it FORWARD to a generation not released to it"
        )
    if at < to_step:
        return f"{who}: a rollback to step {to_step} would move it FORWARD"
    return ""


def rollback(
    state: ReleaseState,
    to_step: int,
    group: str = "*",
    *,
    head_step: int | None,
    first_epoch: int = 1,
    generation: int | None = None,
    force: bool = False,
) -> ReleaseState:
    """Order consumers matching ``group`` back to ``to_step`` (of ``generation``) and cap
    them there, so none rolls forward again until a release: for every consumer ("*"), the
    release step held at ``to_step``, the canaries stopped and the pins past it dropped; for
    a group, a pin of it at ``to_step``. The order replaces older orders of the same group
    (all of them for "*") and stays beside those of other groups, so a consumer away now
    follows it when it comes back (:func:`order_for`).

    An order that would move its consumers FORWARD (held or pinned at an older step, or at
    another generation: :func:`forward_of`) is refused unless ``force`` (a release moves a
    fleet forward; a rollback that does so is likely a typo)."""
    check_group(group)
    check_step(to_step, head_step)
    ahead = forward_of(state, to_step, group, generation)
    if ahead and not force:
        raise RolloutRefused(
            f"{ahead}; release (--to-step {to_step}) or pin to move it forward, or rollback --force"
        )
    # (``first_epoch``: where numbering starts in a state with no order in its history; the
    # Rollout RPC passes the time in seconds, so a state lost or deleted from Redis never gives
    # an epoch again that cursors recorded as followed)
    epoch = max([state.last_rollback_epoch, *(r.epoch for r in state.rollbacks)]) + 1
    if not state.last_rollback_epoch and not state.rollbacks:
        epoch = max(epoch, first_epoch)
    order = Rollback(to_step, group, epoch, generation)
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
        pins = tuple(
            p
            for p in state.pins
            if p.step <= to_step or not of_generation(p.generation, generation)
        )
        return replace(
            state, rollbacks=orders, release_step=to_step, release_generation=generation,
            held=True, canary=(), pins=pins, last_rollback_epoch=epoch,
        )  # fmt: skip
    # (first: a pin of a narrower group, e.g. pred-main-* under pred-*, would take its
    # consumers forward again past the order's step)
    pins = (Pin(group, to_step, generation), *(p for p in state.pins if p.group != group))
    return replace(state, rollbacks=orders, pins=pins, last_rollback_epoch=epoch)


def gate_failed(
    state: ReleaseState, *, generation: int, bad_step: int, good_step: int, reason: str
) -> ReleaseState:
    """The validation gate failed ``bad_step`` of ``generation``: hold the model at
    ``good_step`` (the newest step before it), unless the state knows already (an earlier
    or equal failure of that generation) or an operator accepted the step. A release step
    of another generation stays (its consumers are served nothing of this one anyway)."""
    if state.gate_generation == generation:
        if state.gate_accepted_step is not None and state.gate_accepted_step >= bad_step:
            return state
        known = state.gate_bad_step
        if gate_open(state, generation) is not None and known is not None and known <= bad_step:
            return state
    rs, rg = state.release_step, state.release_generation
    if rs is None:
        rs, rg = good_step, generation
    elif of_generation(rg, generation):
        rs, rg = min(rs, good_step), generation
    accepted = state.gate_accepted_step if state.gate_generation == generation else None
    return replace(
        state,
        release_step=rs,
        release_generation=rg,
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
    if "pin_generations" in d:
        d["pin_generations"] = []
    rb = d.get("rollback")
    if rb is not None and rb[1] not in ("", "*"):
        d["rollback"] = None
    if "rollbacks" in d:
        kept = [i for i, r in enumerate(d["rollbacks"]) if r[1] in ("", "*")]
        if isinstance(d.get("rollback_generations"), list):
            d["rollback_generations"] = [d["rollback_generations"][i] for i in kept]
        d["rollbacks"] = [d["rollbacks"][i] for i in kept]
        # (a reader that knows only "rollback" must still see an order for every consumer)
        d["rollback"] = d["rollbacks"][-1] if d["rollbacks"] else None
    d["redacted"] = True
    return json.dumps(d, separators=(",", ":"), sort_keys=True)


def describe(
    state: ReleaseState, *, redacted: bool = False, generation: int | None = None
) -> list[str]:
    """The state as short human lines (``deltad rollout status``, ``deltad status``);
    ``generation``: the one served, to tell a state of another generation. One release
    step; a pin, canary or release the gate bends says the step it is served at most, and
    every step named is one the state holds (a gate's good step is a published one)."""
    g = generation

    def of(recorded: int | None) -> str:  # (" of generation G" when not the one served)
        return "" if recorded is None or recorded == g else f" of generation {recorded}"

    gate_here = (
        state.gate_bad_step is not None
        and bool(state.gate_reason)
        and of_generation(state.gate_generation, g)
    )
    good = state.gate_good_step
    if state.release_step is None:
        rel = "release: head"
    else:
        rel = f"release: step {state.release_step}{of(state.release_generation)}"
        if state.release_step < 0:  # (gate_failed on a base: no step of it is good)
            rel = f"release: no step{of(state.release_generation)} (its base failed the gate)"
        rel += ", held" if state.held else ""
    lines = [f"{rel} (version {state.version})"]
    if state.release_step is not None and not of_generation(state.release_generation, g):
        lines.append(
            f"release: generation {g}, served now, is not released: consumers outside canary "
            f"groups keep generation {state.release_generation} step {state.release_step} "
            f"and are served nothing of generation {g} until a release names it (deltad "
            "rollout release, sent to a sidecar of that generation)"
        )
    if state.gate_bad_step is not None and state.gate_reason:
        if not gate_here:
            lines.append(
                f"gate: step {state.gate_bad_step} failed in an earlier generation "
                f"({state.gate_generation}; {g} is served now): {state.gate_reason}"
            )
        else:
            rs = state.release_step
            if good is None or good < 0:
                held = "no step before it is good: nothing is served"
            elif rs is not None and of_generation(state.release_generation, g) and rs < good:
                held = f"canaries held at step {good}; the fleet stays at its release step {rs}"
            else:
                held = f"holding the fleet{' and canaries' if state.canary else ''} at step {good}"
            lines.append(
                f"gate: step {state.gate_bad_step} failed (generation {state.gate_generation}): "
                f"{state.gate_reason}; {held}"
            )
    if state.gate_accepted_step is not None and (
        of_generation(state.gate_generation, g) or state.held
    ):
        lines.append(
            f"gate: released past by an operator up to step {state.gate_accepted_step}"
            f"{of(state.gate_generation)}"
        )
    bad = gate_open(state, g)
    for p in state.pins:
        bent = ""
        if not of_generation(p.generation, g):
            bent = f" (served nothing of generation {g}: it keeps its state)"
        elif bad is not None and p.step >= bad:
            at = "nothing" if good is None or good < 0 else f"at most step {good}"
            bent = f" (served {at}: step {bad} failed the gate)"
        lines.append(f"pin: {p.group} at step {p.step}{of(p.generation)}{bent}")
    for c in state.canary:
        bent = ""
        if state.held and of_generation(state.gate_generation, g) and good is not None:
            bent = f" (at most step {good} while the gate holds)" if good >= 0 else " (nothing)"
        lines.append(f"canary: {c} follows the head{bent}")
    for rb in state.rollbacks:
        lines.append(
            f"rollback: {rb.group} to step {rb.to_step}{of(rb.generation)} (order {rb.epoch})"
        )
    if redacted:
        lines.append("pins, canary groups and group rollbacks: shown to admin credentials only")
    return lines
