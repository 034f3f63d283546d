"""The Rollout RPC (admin role only, enforced at the edge): read or change the model's release
state (deltad.serve.rollout) in Redis (deltad.serve.state.release).

Bad steps and globs get INVALID_ARGUMENT, and so does a rollback to a step this rank's log cannot
restore (``restore_check``, deltad.serve.index.restore.restorable: the reason); a control refused
as things stand (a release past a step the validation gate failed without ``force``, any change
asked of a relay, which follows its upstream's state) FAILED_PRECONDITION; Redis down
UNAVAILABLE. ``restore_window`` (the oldest and newest step a rollback can restore, None:
unknown) is shown in every answer and bounds a rollback when no ``restore_check`` is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import grpc

from deltad.errors import OffsetStoreError, RolloutError, RolloutRefused
from deltad.serve import rollout as ro
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.index.log import SegmentLog
from deltad.serve.rollout import ReleaseState
from deltad.serve.state.release import RolloutSource, RolloutStore, RolloutView
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)

#: (oldest, newest) step a rollback can restore now; None: not known (any step <= head)
RestoreWindow = Callable[[], tuple[int, int] | None]


class RolloutControl:
    """Serves Rollout for one sidecar (``store`` None: a relay, read-only)."""

    def __init__(
        self,
        seglog: SegmentLog,
        source: RolloutSource,
        store: RolloutStore | None,
        restore_window: RestoreWindow | None = None,
        restore_check: Callable[[int], str] | None = None,
    ) -> None:
        self.log = seglog
        self.source = source
        self.store = store
        #: the steps the log can restore (deltad.serve.index.restore); None: unknown
        self.restore_window = restore_window
        #: why a step cannot be restored ("" if it can; deltad.serve.index.restore.restorable)
        self.restore_check = restore_check

    def _change(
        self, action: int, req: pb.RolloutRequest, head: int, gen: int
    ) -> tuple[Callable[[ReleaseState], ReleaseState], str]:
        """The state change ``action`` asks for and its description; RolloutError if bad."""
        step = int(req.step) if req.HasField("step") else None
        group = req.group
        A = pb.RolloutAction
        head_known = head if head >= 0 else None
        if action == A.ROLLOUT_HOLD:
            if head < 0 and step is None:
                raise RolloutRefused("nothing to hold: this sidecar has no log yet")
            return partial(ro.hold, head_step=head), "held"
        if action == A.ROLLOUT_RELEASE:
            if head < 0:
                raise RolloutRefused("nothing to release: this sidecar has no log yet")
            what = "released to the head" if step is None else f"released to step {step}"
            if req.force:
                what += " (forced past the gate)"
            return (
                partial(ro.release, to_step=step, head_step=head, generation=gen, force=req.force),
                what,
            )
        if action == A.ROLLOUT_PIN:
            if step is None:
                raise RolloutError("pin needs a step")
            return partial(ro.pin, group=group, step=step, head_step=head_known), (
                f"pinned {group} at step {step}"
            )
        if action == A.ROLLOUT_UNPIN:
            return partial(ro.unpin, group=group), f"unpinned {group}"
        if action == A.ROLLOUT_CANARY:
            return partial(ro.canary, group=group, on=True), f"canary {group} follows the head"
        if action == A.ROLLOUT_UNCANARY:
            return partial(ro.canary, group=group, on=False), f"canary {group} stopped"
        if action == A.ROLLOUT_ROLLBACK:
            if step is None:
                raise RolloutError("rollback needs a step (--to-step)")
            group = group or "*"
            ro.check_step(step, head_known)
            reason = self.restore_check(step) if self.restore_check is not None else ""
            window = self.restore_window() if self.restore_window is not None else None
            if not reason and window is not None and not window[0] <= step <= window[1]:
                reason = (
                    f"step {step} is outside the restore window (steps {window[0]}..{window[1]})"
                )
            if reason:
                raise RolloutError(f"cannot roll back to step {step}: {reason}")
            return partial(ro.rollback, to_step=step, group=group, head_step=head_known), (
                f"rollback of {group} to step {step} ordered"
            )
        raise RolloutError(f"unknown rollout action {action}")

    def Rollout(self, req: pb.RolloutRequest, context: grpc.ServicerContext) -> pb.RolloutResponse:
        snap = self.log.snapshot()
        head = snap.head.step if snap is not None else -1
        gen = snap.generation if snap is not None else 0
        window = self.restore_window() if self.restore_window is not None else None
        resp = pb.RolloutResponse(
            generation=gen,
            head_step=head,
            restore_oldest_step=window[0] if window else -1,
            restore_newest_step=window[1] if window else -1,
        )
        action = req.action
        if action == pb.RolloutAction.ROLLOUT_STATUS:
            resp.state = self.source.state().to_json()
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
            change, what = self._change(action, req, head, gen)
            state = self.store.update(change)
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
