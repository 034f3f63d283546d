"""`deltad rollout status|hold|release|pin|unpin|canary|rollback`: the model's release controls
(admin role), sent to one sidecar of the model (any rank: the state is model-wide, in Redis).

::

    deltad rollout hold --target trainer-0:50051 --token-file admin.token
    deltad rollout canary --group 'pred-canary-*'          # follows the head; the rest holds
    deltad rollout release [--to-step S] [--force]          # to the head, or to step S
    deltad rollout pin --group 'pred-eu-*' --step S         # unpin --group 'pred-eu-*'
    deltad rollout rollback --to-step S [--group G]         # order G (default: all) back to S

A hold, pin, release or rollback names a state: a step of the answering sidecar's generation
(``--generation G`` checks it is that one). A trainer restart's new generation reaches held,
pinned or released consumers only when a release names it. A release past a step the
validation gate failed is refused unless ``--force``, and so is a pin at or past it; a rollback
that would move consumers FORWARD (held at an older step or generation) is refused unless
``--force``; a rollback to a
step the answering sidecar's log cannot restore is refused with the reason (see ``status``:
``restorable: steps A..B``), and so is a release or pin to a step older than that log's base;
a flag the action does not take (:data:`FLAGS`), bad steps and globs, a missing admin role, a
relay as target: exit 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json

import grpc

from deltad.clientauth import ClientAuth
from deltad.commands.status import ENDPOINTS as STATUS_ENDPOINTS
from deltad.commands.status import RANGES as STATUS_RANGES
from deltad.commands.status import add_connection_arguments, connection_auth, printable, rpc_failure
from deltad.config import MAX_COUNT, Range
from deltad.errors import ConfigError, SidecarUnavailableError
from deltad.serve.rollout import ReleaseState, describe
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc

#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES = {
    **STATUS_RANGES,
    "step": Range(0, MAX_COUNT, integer=True),
    # (the reference trainer's generations are nanosecond times)
    "generation": Range(0, float(1 << 63), integer=True),
}
#: Its endpoint flags (--target), checked as HOST:PORT by `deltad` before run().
ENDPOINTS = STATUS_ENDPOINTS

ACTIONS = {
    "status": pb.ROLLOUT_STATUS,
    "hold": pb.ROLLOUT_HOLD,
    "release": pb.ROLLOUT_RELEASE,
    "pin": pb.ROLLOUT_PIN,
    "unpin": pb.ROLLOUT_UNPIN,
    "canary": pb.ROLLOUT_CANARY,
    "rollback": pb.ROLLOUT_ROLLBACK,
}


#: The action-specific flags (by argparse dest): how they are spelled and the actions that take
#: them; any other action refuses them (:func:`check_flags`), never ignores them.
FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "group": ("--group", ("pin", "unpin", "canary", "rollback")),
    "step": ("--to-step/--step", ("release", "pin", "rollback")),
    "force": ("--force", ("release", "rollback")),
    "off": ("--off", ("canary",)),
    "generation": ("--generation", ("release", "pin", "rollback")),
}


def check_flags(args: argparse.Namespace) -> None:
    """ConfigError (one line) naming every flag given that ``args.action`` does not take and
    the actions that do."""
    given = {
        dest
        for dest in FLAGS
        if getattr(args, dest) is not None and getattr(args, dest) is not False
    }
    stray = [
        f"{flag} goes with {', '.join(actions)} only, not {args.action}"
        for dest, (flag, actions) in FLAGS.items()
        if dest in given and args.action not in actions
    ]
    if stray:
        raise ConfigError("; ".join(stray))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=list(ACTIONS),
        help="status: show; hold: serve nobody past the release step; release: to the head or "
        "--to-step; pin/unpin: keep --group at --step; canary: --group follows the head "
        "(--off stops it); rollback: order --group (default all) back to --to-step",
    )
    p.add_argument(
        "--group",
        default=None,
        help="pin, unpin, canary, rollback: consumer-name glob (fnmatch), e.g. 'pred-canary-*'",
    )
    p.add_argument(
        "--step",
        "--to-step",
        dest="step",
        type=int,
        default=None,
        help="release, pin, rollback: trainer step (not older than the log's base)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="release: serve steps the validation gate failed (an operator's decision); "
        "rollback: also when it moves consumers forward (held at an older step or generation)",
    )
    p.add_argument(
        "--generation",
        type=int,
        default=None,
        help="release, pin, rollback: the generation --step is of; refused unless it is the "
        "one the target sidecar serves (default: that one)",
    )
    p.add_argument("--off", action="store_true", help="canary: stop the group following the head")
    add_connection_arguments(p)


def request(args: argparse.Namespace) -> pb.RolloutRequest:
    """The RolloutRequest the flags ask for; ConfigError when a needed flag is missing or a
    flag the action does not take is given."""
    check_flags(args)
    action = ACTIONS[args.action]
    if args.action == "canary" and args.off:
        action = pb.ROLLOUT_UNCANARY
    needs_group = args.action in ("pin", "unpin", "canary")
    if needs_group and not args.group:
        raise ConfigError(f"rollout {args.action} needs --group GLOB")
    if args.action in ("pin", "rollback") and args.step is None:
        raise ConfigError(f"rollout {args.action} needs --to-step S (or --step S)")
    req = pb.RolloutRequest(action=action, group=args.group or "", force=args.force)
    if args.step is not None:
        req.step = args.step
    if args.generation is not None:
        req.generation = args.generation
    return req


def call(
    target: str, req: pb.RolloutRequest, *, auth: ClientAuth, timeout: float = 10.0
) -> pb.RolloutResponse:
    """Send ``req`` to the sidecar at ``target``; ConfigError for a refusal (bad argument, no
    admin role, gate in the way), SidecarUnavailableError if it does not answer."""
    with auth.channel(target) as channel:
        try:
            resp: pb.RolloutResponse = delta_pb2_grpc.DeltaServiceStub(channel).Rollout(
                req, timeout=timeout, metadata=auth.metadata()
            )
            return resp
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise SidecarUnavailableError(rpc_failure(target, e, timeout)) from e
            raise ConfigError(f"{e.code().name}: {e.details()}") from e


def run(args: argparse.Namespace) -> int:
    req = request(args)  # a usage error first, before any credential is looked at
    auth = connection_auth(args)
    resp = call(args.target, req, auth=auth, timeout=args.timeout)
    if args.json:
        out = {
            "state": json.loads(resp.state),
            "message": resp.message,
            "generation": resp.generation,
            "head_step": resp.head_step,
            "restore_steps": [resp.restore_oldest_step, resp.restore_newest_step],
        }
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    if resp.message:
        print(printable(resp.message))
    print(f"head step {resp.head_step} (generation {resp.generation})")
    if resp.restore_oldest_step >= 0:
        print(
            f"restorable: steps {resp.restore_oldest_step}..{resp.restore_newest_step} "
            "(this rank's log; rollback --to-step S within them, or to a step the release "
            "state holds)"
        )
    d = json.loads(resp.state) if resp.state else {}
    if d.get("unknown"):  # a relay not yet told by its upstream, Redis's unreadable
        print(printable(f"release state: {d.get('why', 'not known')} (nothing is served)"))
        return 0
    state = ReleaseState.from_json(resp.state) if resp.state else ReleaseState()
    for line in describe(state, generation=resp.generation if resp.head_step >= 0 else None):
        print(printable(line))
    if d.get("refused"):
        print(printable(f"release state: the value in Redis is REFUSED: {d['refused']}"))
    return 0
