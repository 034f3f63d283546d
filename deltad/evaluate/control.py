"""The evaluator's hands: the admin ``Rollout`` RPC (what ``deltad rollout`` sends), to the
first of the model's sidecars that answers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deltad.clientauth import ClientAuth
from deltad.commands.rollout import call
from deltad.errors import ConfigError, SidecarUnavailableError
from deltad.serve.rollout import ReleaseState
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)
A = pb.RolloutAction


@dataclass(frozen=True)
class Answer:
    """A Rollout answer: the state after it, the head and generation, the message."""

    state: ReleaseState
    head_step: int
    generation: int
    message: str


class RolloutClient:
    """Sends Rollout controls to ``targets`` (the model's sidecars, any rank: the state is
    model-wide); the next target when one does not answer."""

    def __init__(self, targets: list[str], auth: ClientAuth, timeout_s: float = 10.0) -> None:
        if not targets:
            raise ConfigError("the evaluator needs a sidecar of the model for its controls")
        self.targets, self.auth, self.timeout_s = list(targets), auth, timeout_s

    def send(self, req: pb.RolloutRequest) -> Answer:
        last: Exception | None = None
        for t in self.targets:
            try:
                resp = call(t, req, auth=self.auth, timeout=self.timeout_s)
            except SidecarUnavailableError as e:
                last = e
                continue
            state = ReleaseState.from_json(resp.state) if resp.state else ReleaseState()
            if req.action != A.ROLLOUT_STATUS:
                log.warning("evaluator: rollout %s: %s", A.Name(req.action), resp.message)
            return Answer(state, resp.head_step, resp.generation, resp.message)
        assert last is not None
        raise last

    def status(self) -> Answer:
        return self.send(pb.RolloutRequest(action=A.ROLLOUT_STATUS))

    def hold(self) -> Answer:
        return self.send(pb.RolloutRequest(action=A.ROLLOUT_HOLD))

    def release(self, step: int) -> Answer:
        return self.send(pb.RolloutRequest(action=A.ROLLOUT_RELEASE, step=step))

    def rollback(self, group: str, step: int) -> Answer:
        return self.send(pb.RolloutRequest(action=A.ROLLOUT_ROLLBACK, group=group, step=step))

    def unpin(self, group: str) -> Answer:
        return self.send(pb.RolloutRequest(action=A.ROLLOUT_UNPIN, group=group))

    def canary(self, group: str) -> Answer:
        return self.send(pb.RolloutRequest(action=A.ROLLOUT_CANARY, group=group))
