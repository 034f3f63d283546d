"""The rollout controls refuse what they would otherwise ignore or record to no one's good: a flag
(or request field) the action does not take, and a release or pin to a step older than the
answering sidecar's log's base (no new predictor could be served it); and ``release --force``
says "forced past the gate" only when the gate held a step back. Real sidecars on port 0, a
real Redis, `deltad rollout` run in-process, real DeltaConsumers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, equal, predictor, server_config

from deltad.consume.appliers import TensorDictApplier
from deltad.serve.edge.app import SidecarServer
from deltad.serve.rollout import ReleaseState
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

A = pb.RolloutAction


@contextlib.contextmanager
def sidecar(ft: FakeTrainer, tmp_path: Path, redis_url: str, head: int) -> Iterator[str]:
    """One rank's sidecar over ``ft``'s spool, once it serves ``head``; its endpoint."""
    srv = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        wait_for(lambda: at_step([srv.endpoint], head), 30, f"the head at step {head}")
        yield srv.endpoint
    finally:
        srv.stop(0.2)


def rollout(endpoint: str, action: int, **kw: object) -> ReleaseState:
    with grpc.insecure_channel(endpoint) as ch:
        resp = pb_grpc.DeltaServiceStub(ch).Rollout(
            pb.RolloutRequest(action=action, **kw),  # type: ignore[arg-type]
            timeout=10,
        )
    return ReleaseState.from_json(resp.state)


def refused(endpoint: str, action: int, **kw: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        rollout(endpoint, action, **kw)
    return e.value


def cli(endpoint: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``deltad rollout ARGV --target endpoint``: exit code, stdout, and the command's own
    stderr lines (the sidecar runs in this process: its log lines share stderr)."""
    from deltad.commands.main import main

    code = main(["rollout", *argv, "--target", endpoint])
    out = capsys.readouterr()
    own = [ln for ln in out.err.splitlines() if ln.startswith("deltad") or "Traceback" in ln]
    return code, out.out, "\n".join(own)


#: The flags that go with some actions only, and those actions.
TAKES = {
    "--group": {"pin", "unpin", "canary", "rollback"},
    "--step": {"release", "pin", "rollback"},
    "--to-step": {"release", "pin", "rollback"},
    "--force": {"release", "rollback"},
    "--off": {"canary"},
    "--generation": {"release", "pin", "rollback"},
}
#: Each action with the flags it needs.
NEEDS = {
    "status": [],
    "hold": [],
    "release": [],
    "pin": ["--group", "g-*", "--step", "1"],
    "unpin": ["--group", "g-*"],
    "canary": ["--group", "g-*"],
    "rollback": ["--to-step", "1"],
}
VALUE = {
    "--group": ["x*"],
    "--step": ["1"],
    "--to-step": ["1"],
    "--force": [],
    "--off": [],
    "--generation": ["1"],
}
NAMED = {"--step": "--to-step/--step", "--to-step": "--to-step/--step"}


def test_every_flag_an_action_does_not_take_is_refused_with_one_line_and_exit_2(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every action x flag: a flag the action does not take is an error naming it and the
    actions it goes with (nothing sent, nothing changed); every other combination is sent."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(1)
    ft.step(2)
    with sidecar(ft, tmp_path, redis_url, 2) as ep:
        # the reported ones: a hold of the whole fleet, a release to the head... ignoring them
        code, _, err = cli(ep, capsys, "hold", "--group", "x*")
        assert code == 2 and err == (
            "deltad rollout: error: --group goes with pin, unpin, canary, rollback only, not hold"
        )
        code, _, err = cli(ep, capsys, "release", "--group", "G", "--off", "--to-step", "300")
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "--group goes with pin, unpin, canary, rollback only" in err
        assert "--off goes with canary only" in err
        for flag, value in (("--group", ""), ("--step", "0"), ("--to-step", "0")):
            code, _, err = cli(ep, capsys, "hold", flag, value)  # given, even empty or 0
            assert code == 2 and f"{NAMED.get(flag, flag)} goes with" in err, err
        for action, needs in NEEDS.items():
            for flag, actions in TAKES.items():
                if action in actions:
                    continue
                code, _, err = cli(ep, capsys, action, *needs, flag, *VALUE[flag])
                assert code == 2, (action, flag, err)
                assert len(err.splitlines()) == 1, err
                want = f"{NAMED.get(flag, flag)} goes with {', '.join(sorted_(actions))} only"
                assert want in err and f"not {action}" in err, err
        assert rollout(ep, A.ROLLOUT_STATUS).version == 0  # nothing was sent

        # every combination the actions take is sent and done
        for argv, said in (
            (["status"], "release: head"),
            (["hold"], "held"),
            (["release"], "released to the head"),
            (["release", "--to-step", "1"], "released to step 1"),
            (["release", "--step", "2", "--force"], "released to step 2"),
            (["pin", "--group", "g-*", "--to-step", "1"], "pinned g-* at step 1"),
            (["pin", "--group", "g-*", "--step", "2"], "pinned g-* at step 2"),
            (["unpin", "--group", "g-*"], "unpinned g-*"),
            (["canary", "--group", "c-*"], "canary c-* follows the head"),
            (["canary", "--group", "c-*", "--off"], "canary c-* stopped"),
            (["rollback", "--to-step", "1", "--group", "g-*"], "rollback of g-* to step 1"),
            (["rollback", "--step", "1"], "rollback of * to step 1"),
            (["release", "--to-step", "2", "--generation", "1"], "released to step 2"),
            (["pin", "--group", "g-*", "--step", "2", "--generation", "1"], "pinned g-* at"),
            (["rollback", "--step", "1", "--generation", "1", "--force"], "rollback of *"),
        ):
            code, out, err = cli(ep, capsys, *argv)
            assert code == 0 and said in out, (argv, out, err)
        assert rollout(ep, A.ROLLOUT_STATUS).version == 14  # every change but status


def sorted_(actions: set[str]) -> list[str]:
    """``actions`` in the order `deltad rollout --help` lists them."""
    return [a for a in NEEDS if a in actions]


def test_the_rpc_refuses_a_field_its_action_does_not_take(tmp_path: Path, redis_url: str) -> None:
    """The same rule at the sidecar, for any client: INVALID_ARGUMENT naming the field,
    nothing recorded (a hold with a group would have held everybody)."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(1)
    takes = {
        A.ROLLOUT_STATUS: set(),  # (issue 37: it answered OK with a group, step or force)
        A.ROLLOUT_HOLD: set(),
        A.ROLLOUT_RELEASE: {"step", "force", "generation"},
        A.ROLLOUT_PIN: {"group", "step", "generation"},
        A.ROLLOUT_UNPIN: {"group"},
        A.ROLLOUT_CANARY: {"group"},
        A.ROLLOUT_UNCANARY: {"group"},
        A.ROLLOUT_ROLLBACK: {"group", "step", "force", "generation"},
    }
    fields: dict[str, object] = {"group": "x*", "step": 1, "force": True, "generation": 1}
    with sidecar(ft, tmp_path, redis_url, 1) as ep:
        for action, ok in takes.items():
            for field, value in fields.items():
                if field in ok:
                    continue
                kw = {f: fields[f] for f in ok if f != "force"}
                e = refused(ep, action, **kw, **{field: value})
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (action, field)
                name = A.Name(action).removeprefix("ROLLOUT_").lower()
                assert f"{name} takes no {field}" in (e.details() or ""), e.details()
        assert rollout(ep, A.ROLLOUT_STATUS).version == 0
        assert rollout(ep, A.ROLLOUT_HOLD).held  # and without it, it holds


def test_a_release_or_pin_older_than_the_logs_base_is_refused_and_new_predictors_still_pull(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The log's base is step 366: a release to step 200 or a pin at step 100 would cap every
    new predictor below anything the log holds (each pull FAILED_PRECONDITION): refused with
    FAILED_PRECONDITION naming the base (as a rollback is), nothing recorded; the CLI exits 2
    with one line. A release to the base and a pin at a later step are served."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(366)
    ft.step(370)
    ft.step(380)
    with sidecar(ft, tmp_path, redis_url, 380) as ep:
        e = refused(ep, A.ROLLOUT_RELEASE, step=200)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.details() == (
            "cannot release to step 200: step 200 is older than the log's base (step 366), "
            "the oldest state a new consumer can be served; release step 366 or later"
        )
        e = refused(ep, A.ROLLOUT_RELEASE, step=365, force=True)  # force is for the gate
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        e = refused(ep, A.ROLLOUT_PIN, group="pred-*", step=100)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (e.details() or "").startswith(
            "cannot pin pred-* at step 100: step 100 is older than the log's base (step 366)"
        )
        assert rollout(ep, A.ROLLOUT_STATUS).version == 0
        for argv in (
            ("release", "--to-step", "200"),
            ("pin", "--group", "pred-*", "--step", "100"),
        ):
            code, _, err = cli(ep, capsys, *argv)
            assert code == 2 and len(err.splitlines()) == 1, err
            assert err.startswith("deltad rollout: error: FAILED_PRECONDITION: cannot ")
            assert "older than the log's base (step 366)" in err
        assert rollout(ep, A.ROLLOUT_STATUS).version == 0
        # at the base and later: recorded, and new predictors are served
        code, out, err = cli(ep, capsys, "release", "--to-step", "366")
        assert code == 0 and "released to step 366" in out, err
        code, out, err = cli(ep, capsys, "pin", "--group", "pred-eu-*", "--step", "370")
        assert code == 0 and "pinned pred-eu-* at step 370" in out, err
        for name, step in (("pred-1", 366), ("pred-eu-1", 370)):
            with predictor(name, [ep]) as c:
                applier = TensorDictApplier()
                r = c.sync(applier.apply)
                assert r.step == step and r.caught_up
                assert equal(applier, ft.history[step])


def test_release_force_says_forced_past_the_gate_only_when_the_gate_held_a_step_back(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(1)
    ft.step(2)
    with sidecar(ft, tmp_path, redis_url, 2) as ep:
        code, out, err = cli(ep, capsys, "release", "--force", "--to-step", "1")  # no gate failure
        assert code == 0, err
        assert out.splitlines()[0] == "released to step 1 (generation 1)"
        ft.step(3, poison=float("nan"))
        ft.step(4)
        wait_for(lambda: rollout(ep, A.ROLLOUT_STATUS).gate_bad_step == 3, 10, "the gate")
        # "the head" below is step 4 only once the sidecar has indexed it (the gate fails
        # step 3 first; CI once released to a head still at step 3)
        wait_for(lambda: at_step([ep], 4), 10, "the head at step 4")
        # below the failed step: the gate holds nothing back from this release
        code, out, err = cli(ep, capsys, "release", "--force", "--to-step", "2")
        assert code == 0, err
        assert out.splitlines()[0] == "released to step 2 (generation 1)"
        code, out, err = cli(ep, capsys, "release", "--force")
        assert code == 0, err
        assert out.splitlines()[0] == "released to the head (forced past the gate)"
        assert rollout(ep, A.ROLLOUT_STATUS).gate_accepted_step == 4
        # accepted already: nothing is forced any more
        code, out, err = cli(ep, capsys, "release", "--force", "--to-step", "4")
        assert code == 0, err
        assert out.splitlines()[0] == "released to step 4 (generation 1)"
