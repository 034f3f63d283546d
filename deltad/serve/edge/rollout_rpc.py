"""The Rollout RPC (admin role only, enforced at the edge): read or change the model's release
state (deltad.serve.rollout) in Redis (deltad.serve.state.release).

Bad steps and globs get INVALID_ARGUMENT, and so do a field the action does not take (a group
with hold, ``force`` with anything but a release: :data:`TAKES`) and a rollback to a step this
rank's log cannot restore (``restore_check``, deltad.serve.index.restore.restorable: the
reason); a control refused as things stand (a release past a step the validation gate failed
without ``force``, a release or pin to a step older than this rank's log's base, which no new
consumer could be served, a rollback, release or pin to a step another rank's log no longer
holds, as its registry entry tells (``peers_check``), any change asked of a relay, which
follows its upstream's state)
FAILED_PRECONDITION; Redis down UNAVAILABLE. ``restore_window`` (the oldest and newest step a
rollback can restore, None: unknown) is shown in every answer and bounds a rollback when no
``restore_check`` is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import grpc

from deltad.errors import OffsetStoreError, RolloutError, RolloutRefused
from deltad.serve import rollout as ro
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.index.log import SegmentLog
from deltad.serve.rollout import ReleaseState
from deltad.serve.state.release import (
    InvalidReleaseState,
    RolloutSource,
    RolloutStore,
    RolloutView,
)
from deltad.serve.windows.decide import LogView
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)

#: (oldest, newest) step a rollback can restore now; None: not known (any step <= head)
RestoreWindow = Callable[[], tuple[int, int] | None]


A = pb.RolloutAction

#: The actions that name a consumer group ("*" for a rollback without one).
_GROUP_ACTIONS = frozenset({A.ROLLOUT_PIN, A.ROLLOUT_CANARY, A.ROLLOUT_ROLLBACK})

#: The request fields each action takes (besides ``action``); any other is refused.
TAKES: dict[int, frozenset[str]] = {
    A.ROLLOUT_STATUS: frozenset(),
    A.ROLLOUT_HOLD: frozenset(),
    A.ROLLOUT_RELEASE: frozenset({"step", "force", "generation"}),
    A.ROLLOUT_PIN: frozenset({"group", "step", "generation"}),
    A.ROLLOUT_UNPIN: frozenset({"group"}),
    A.ROLLOUT_CANARY: frozenset({"group"}),
    A.ROLLOUT_UNCANARY: frozenset({"group"}),
    A.ROLLOUT_ROLLBACK: frozenset({"group", "step", "force", "generation"}),
}


def check_fields(action: int, req: pb.RolloutRequest) -> None:
    """RolloutError naming the fields of ``req`` that ``action`` does not take (none is
    ignored: a hold with a group would hold everybody, a status with a step change
    nothing the caller meant)."""
    takes = TAKES.get(action)
    if takes is None:
        return
    given = {
        "step": req.HasField("step"),
        "group": bool(req.group),
        "force": req.force,
        "generation": req.HasField("generation"),
    }
    stray = sorted(f for f, on in given.items() if on and f not in takes)
    if stray:
        name = A.Name(action).removeprefix("ROLLOUT_").lower()
        raise RolloutError(f"{name} takes no {', no '.join(stray)}")


def below_base(verb: str, step: int, base: int | None, later: str) -> None:
    """RolloutRefused if ``step`` is older than this rank's log's base (``base``, None: no
    log): nothing older is served to a new consumer, whose pulls would fail."""
    if base is not None and step < base:
        raise RolloutRefused(
            f"cannot {verb} step {step}: step {step} is older than the log's base "
            f"(step {base}), the oldest state a new consumer can be served; {later} step "
            f"{base} or later"
        )


class RolloutControl:
    """Serves Rollout for one sidecar (``store`` None: a relay, read-only)."""

    def __init__(
        self,
        seglog: SegmentLog,
        source: RolloutSource,
        store: RolloutStore | None,
        restore_window: RestoreWindow | None = None,
        restore_check: Callable[[int], str] | None = None,
        consumers: Callable[[], list[str]] | None = None,
        peers_check: Callable[[int], str] | None = None,
    ) -> None:
        self.log = seglog
        #: the consumer names the offset store knows (how many a group's glob matches is
        #: said in the answer: a glob that matches nobody is likely a typo)
        self.consumers = consumers
        self.source = source
        self.store = store
        #: the steps the log can restore (deltad.serve.index.restore); None: unknown
        self.restore_window = restore_window
        #: why a step cannot be restored ("" if it can; deltad.serve.index.restore.restorable)
        self.restore_check = restore_check
        #: why another rank's log cannot hold a step ("" if every one can, as far as their
        #: registry entries tell: deltad.serve.index.restore.unrestorable)
        self.peers_check = peers_check

    def _peers(self, verb: str, step: int) -> None:
        """RolloutRefused if another rank cannot serve ``step`` (a step one rank's retention
        merged away is a state the model cannot be at: its consumers' pulls there would fail,
        and the others' would wait on them)."""
        why = self.peers_check(step) if self.peers_check is not None else ""
        if why:
            raise RolloutRefused(
                f"cannot {verb} step {step}: {why}; every rank must hold it (keep the same "
                "restore window on every rank: --restore-window-steps)"
            )

    def _change(
        self, action: int, req: pb.RolloutRequest, head: int, gen: int, base: int | None
    ) -> tuple[Callable[[ReleaseState], ReleaseState], Callable[[], str]]:
        """The state change ``action`` asks for and its description (once the change ran);
        RolloutError if bad. ``base``: the step of this rank's log's base (None: no log)."""
        check_fields(action, req)
        step = int(req.step) if req.HasField("step") else None
        group = req.group
        head_known = head if head >= 0 else None
        # (the generation a step names: none known without a log)
        known_gen = gen if head >= 0 else None
        if req.HasField("generation") and req.generation != gen:
            # (an evaluator that scored a step of one generation must not release the same
            # step number of the next: the trainer restarted in between)
            what = f"step {step} of " if step is not None else ""
            raise RolloutRefused(
                f"{what}generation {req.generation} asked, but this sidecar serves generation "
                f"{gen}: nothing changed (ask again of a sidecar of that generation, or name "
                f"generation {gen})"
            )
        if action == A.ROLLOUT_HOLD:
            if head < 0:
                raise RolloutRefused("nothing to hold: this sidecar has no log yet")
            said = f"held (at step {head} of generation {gen} if the head was released)"
            return partial(ro.hold, head_step=head, generation=gen), lambda: said
        if action == A.ROLLOUT_RELEASE:
            if head < 0:
                raise RolloutRefused("nothing to release: this sidecar has no log yet")
            note = ""
            if step is not None:
                ro.check_step(step, head)
                below_base("release to", step, base, "release")
                step, note = self._resolved(step)
                self._peers("release to", step)
            what = (
                "released to the head"
                if step is None
                else f"released to step {step}{note} (generation {gen})"
            )
            forced: list[bool] = [False]

            def release(state: ReleaseState) -> ReleaseState:
                # "forced" only if the gate held back a step this release serves (decided on
                # the state the change applies to: the store may run it more than once)
                bad = ro.gate_open(state, gen)
                forced[0] = req.force and bad is not None and (step is None or step >= bad)
                return ro.release(
                    state, to_step=step, head_step=head, generation=gen, force=req.force
                )

            return release, lambda: what + (" (forced past the gate)" if forced[0] else "")
        if action == A.ROLLOUT_PIN:
            if step is None:
                raise RolloutError("pin needs a step")
            ro.check_group(group)
            ro.check_step(step, head_known)
            below_base(f"pin {group} at", step, base, "pin")
            step, note = self._resolved(step)
            self._peers(f"pin {group} at", step)
            pinned = f"pinned {group} at step {step}{note} (generation {gen})"
            change = partial(
                ro.pin, group=group, step=step, head_step=head_known, generation=known_gen
            )
            return change, lambda: pinned
        if action == A.ROLLOUT_UNPIN:
            return partial(ro.unpin, group=group), lambda: f"unpinned {group}"
        if action == A.ROLLOUT_CANARY:
            return partial(ro.canary, group=group, on=True), (
                lambda: f"canary {group} follows the head"
            )
        if action == A.ROLLOUT_UNCANARY:
            return partial(ro.canary, group=group, on=False), lambda: f"canary {group} stopped"
        if action == A.ROLLOUT_ROLLBACK:
            if step is None:
                raise RolloutError("rollback needs a step (--to-step)")
            group = group or "*"
            ro.check_step(step, head_known)
            # the log's own answer when it can give one (a step retention keeps for the
            # release state, e.g. the gate's last good step, is restorable outside the
            # window); the window's bounds otherwise
            reason = self.restore_check(step) if self.restore_check is not None else ""
            window = self.restore_window() if self.restore_window is not None else None
            # outside the window only a step the release state holds (retention keeps it on
            # every sidecar, relays mirror it): another one the log happens to hold (a lagging
            # consumer's) may be gone from a relay's log
            held = ro.served_steps(self.source.state(), gen)
            if (
                not reason
                and window is not None
                and not window[0] <= step <= window[1]
                and self._state_step(step) not in {self._state_step(h) for h in held} - {None}
            ):
                reason = (
                    f"step {step} is outside the restore window (steps {window[0]}..{window[1]})"
                )
            if reason:
                raise RolloutError(f"cannot roll back to step {step}: {reason}")
            step, note = self._resolved(step)
            self._peers("roll back to", step)
            ordered = f"rollback of {group} to step {step} ordered{note} (generation {gen})"
            forward: list[str] = [""]
            to = step

            def rollback(state: ReleaseState) -> ReleaseState:
                # (said when forced: decided on the state the change applies to)
                forward[0] = ro.forward_of(state, to, group, known_gen)
                return ro.rollback(
                    state, to_step=to, group=group, head_step=head_known,
                    first_epoch=int(time.time()), generation=known_gen, force=req.force,
                )  # fmt: skip

            return rollback, lambda: ordered + (f" (forced: {forward[0]})" if forward[0] else "")
        raise RolloutError(f"unknown rollout action {action}")

    def _restore_point(self, step: int) -> tuple[int, int] | str:
        """This rank's log's restore point of ``step`` (LogView.restore_point; "" no log)."""
        snap = self.log.snapshot()
        return LogView.of(snap).restore_point(step) if snap is not None else ""

    def _state_step(self, step: int) -> int | None:
        """The published step whose state is the state at ``step`` (None: not held)."""
        got = self._restore_point(step)
        return None if isinstance(got, str) else got[1]

    def _resolved(self, step: int) -> tuple[int, str]:
        """The step a control names, as recorded: the state at a step that was not published
        is that of the newest published before it, so that step is recorded (a relay mirrors
        to it, retention keeps it) and the answer says so; ``step`` itself if this rank's
        log cannot tell."""
        got = self._restore_point(step)
        if isinstance(got, str) and "inside merged segment" in got:
            # (a cap there would serve the entry before the merged one: not step's state)
            raise RolloutError(f"step {step} is not a state this log holds: {got}")
        if isinstance(got, str) or got[1] == step:
            return step, ""
        return got[1], f" (step {step} was not published: its state is that of step {got[1]})"

    def _matching(self, action: int, group: str) -> str:
        """How many known consumers ``group`` matches, for the answer of a control that
        names a group ("" for others, or if the names cannot be read)."""
        if self.consumers is None or action not in _GROUP_ACTIONS:
            return ""
        group = group or "*"
        try:
            names = self.consumers()
        except OffsetStoreError:
            return ""
        n = sum(ro.matches(group, c) for c in names)
        # (a relay's predictors register at the relay, not here: they are not counted)
        known = f"the {len(names)} consumers of this sidecar, relays' predictors not counted"
        if n == 0:
            log.warning("rollout: group %s matches none of %s", group, known)
            return f"; {group} matches none of {known}" + ("" if group == "*" else " (a typo?)")
        return f"; {group} matches {n} of {known}"

    @staticmethod
    def _after(
        action: int, req: pb.RolloutRequest, old: ReleaseState, new: ReleaseState, gen: int
    ) -> str:
        """What the answer must add about the new state, where the gate, a pin or the
        generation bends it: a release leaves the pinned groups where they are (unpin frees
        them); a canary or a release of a generation whose gate failed stops before it."""
        out = ""
        if action == A.ROLLOUT_RELEASE and new.pins:
            pins = ", ".join(
                f"{p.group} at step {p.step}"
                + ("" if ro.of_generation(p.generation, gen) else f" of generation {p.generation}")
                for p in new.pins
            )
            out += f"; still pinned (unpin --group G to release them): {pins}"
        bad = ro.gate_open(new, gen)
        if bad is not None and action in (A.ROLLOUT_RELEASE, A.ROLLOUT_CANARY):
            good = new.gate_good_step
            at = "nothing" if good is None or good < 0 else f"at most step {good}"
            if action == A.ROLLOUT_CANARY or new.release_step is None or new.release_step >= bad:
                out += f"; step {bad} failed the validation gate: served {at} until it is accepted"
        return out

    def Rollout(self, req: pb.RolloutRequest, context: grpc.ServicerContext) -> pb.RolloutResponse:
        snap = self.log.snapshot()
        head = snap.head.step if snap is not None else -1
        gen = snap.generation if snap is not None else 0
        base = snap.base.step if snap is not None else None
        window = self.restore_window() if self.restore_window is not None else None
        resp = pb.RolloutResponse(
            generation=gen,
            head_step=head,
            restore_oldest_step=window[0] if window else -1,
            restore_newest_step=window[1] if window else -1,
        )
        action = req.action
        if action == pb.RolloutAction.ROLLOUT_STATUS:
            try:
                check_fields(action, req)
            except RolloutError as e:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            resp.state = self.source.state_json()
            return resp
        if self.store is None:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this is a relay: it follows its upstream's release state; send rollout "
                "controls to the model's sidecars",
            )
        assert self.store is not None
        try:
            change, describe = self._change(action, req, head, gen, base)
            before: list[ReleaseState] = []

            def recorded(st: ReleaseState) -> ReleaseState:
                # (a state recorded before steps named their generation: the generation
                # served now, as it was applied until now)
                st = ro.stamped(st, gen) if head >= 0 else st
                before[:] = [st]
                return change(st)

            state = self.store.update(recorded)
            what = describe() + self._after(action, req, before[0], state, gen)
            what += self._matching(action, req.group)
            if self.store.replaced:
                what += (
                    f"; the value in Redis was refused ({self.store.replaced}): replaced, "
                    f"starting from the last valid state this sidecar read"
                )
        except InvalidReleaseState as e:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RolloutRefused as e:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RolloutError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OffsetStoreError as e:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        if isinstance(self.source, RolloutView):
            self.source.set(state)
        log.warning("rollout: %s (by an admin request; state version %d)", what, state.version)
        resp.state = state.to_json()
        resp.message = what
        return resp
