"""Issue 37: the rollout controls refuse what no consumer could match or what they do not take,
a release state in Redis that no control could have written is refused as a bad segment is
(never served past), and a control that the gate, a pin or a rollback would bend says so (or is
refused). Real sidecars on port 0, a real Redis, `deltad rollout` / `deltad status` run
in-process, real DeltaConsumers."""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis as redis_py
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, equal, predictor, server_config

from deltad.consume.appliers import TensorDictApplier
from deltad.serve import rollout as ro
from deltad.serve.edge.app import SidecarServer
from deltad.serve.rollout import ReleaseState
from deltad.serve.state.release import RolloutStore
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)

A = pb.RolloutAction


@contextlib.contextmanager
def sidecar(
    ft: FakeTrainer, tmp_path: Path, redis_url: str, head: int, *, metrics: bool = False
) -> Iterator[SidecarServer]:
    """One rank's sidecar over ``ft``'s spool, once it serves ``head``."""
    cfg = server_config(tmp_path / "spool", 0, redis_url)
    if metrics:
        cfg.metrics_port = 0
    srv = SidecarServer(cfg).start()
    try:
        wait_for(lambda: at_step([srv.endpoint], head), 30, f"the head at step {head}")
        yield srv
    finally:
        srv.stop(0.2)


def call(endpoint: str, action: int, **kw: object) -> pb.RolloutResponse:
    with grpc.insecure_channel(endpoint) as ch:
        resp: pb.RolloutResponse = pb_grpc.DeltaServiceStub(ch).Rollout(
            pb.RolloutRequest(action=action, **kw),  # type: ignore[arg-type]
            timeout=10,
        )
    return resp


def refused(endpoint: str, action: int, **kw: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(endpoint, action, **kw)
    return e.value


def status(endpoint: str, consumer: str = "") -> pb.StatusResponse:
    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(consumer=consumer), timeout=10)


def cli(
    capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str, str]:  # (exit code, stdout, the command's own stderr lines)
    from deltad.commands.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    own = [ln for ln in out.err.splitlines() if ln.startswith("deltad ")]
    return code, out.out, "\n".join(own)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def trained(tmp_path: Path, steps: tuple[int, ...] = (1, 2)) -> FakeTrainer:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    for s in steps:
        ft.step(s)
    return ft


# --- 1. globs bounded and checked as consumer names; every action refuses stray fields ------


@pytest.mark.parametrize(
    ("action", "group", "said"),
    [
        (A.ROLLOUT_CANARY, "..", "starts with a letter or a digit"),
        (A.ROLLOUT_CANARY, "-x", "starts with a letter or a digit"),
        (A.ROLLOUT_PIN, "..", "starts with a letter or a digit"),
        (A.ROLLOUT_ROLLBACK, "-*", "starts with a letter or a digit"),
        (A.ROLLOUT_CANARY, "p" * 129, "glob of 1..128"),
        (A.ROLLOUT_PIN, "x*" + "y" * 127, "got 129 characters"),
        (A.ROLLOUT_CANARY, "[.-]*", "starts with a letter or a digit"),
        (A.ROLLOUT_CANARY, "pred \u00e9*", "printable characters without spaces"),
    ],
)
def test_a_group_no_consumer_name_can_match_is_an_invalid_argument(
    action: int, group: str, said: str
) -> None:
    """The rule of deltad.config.check_name (1..128 of [A-Za-z0-9_.-], the first a letter or
    digit) applies to a new group's glob; fnmatch's *, ?, [...] aside."""
    with pytest.raises(ro.RolloutError, match=said.replace("(", "\\(").replace(".", "\\.")):
        ro.check_group(group)
    assert ro.check_group("x" * 128) and ro.check_group("*") and ro.check_group("[a-z]*-1?")


def test_the_rpc_refuses_unmatchable_globs_and_status_with_fields(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ft = trained(tmp_path)
    with sidecar(ft, tmp_path, redis_url, 2) as srv:
        ep = srv.endpoint
        for action, kw in (
            (A.ROLLOUT_CANARY, {"group": ".."}),
            (A.ROLLOUT_CANARY, {"group": "-x"}),
            (A.ROLLOUT_CANARY, {"group": "g" * 129}),
            (A.ROLLOUT_PIN, {"group": "..", "step": 1}),
            (A.ROLLOUT_ROLLBACK, {"group": "-x", "step": 1}),
        ):
            e = refused(ep, action, **kw)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (action, kw)
            details = e.details() or ""
            assert "can match no consumer" in details or "1..128" in details, details
        # ROLLOUT_STATUS takes no field (it answered OK with any: the README said otherwise)
        for kw in ({"group": "g-*"}, {"step": 1}, {"force": True}, {"generation": 1}):
            e = refused(ep, A.ROLLOUT_STATUS, **kw)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
            assert f"status takes no {next(iter(kw))}" in (e.details() or "")
        assert call(ep, A.ROLLOUT_STATUS).state  # and without a field it answers
        # the CLI: exit 2, one line
        code, _, err = cli(capsys, "rollout", "canary", "--group", "..", "--target", ep)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "INVALID_ARGUMENT" in err and "starts with a letter or a digit" in err
        assert ReleaseState.from_json(call(ep, A.ROLLOUT_STATUS).state).version == 0


# --- 2. a release state in Redis that no control could have written is refused --------------


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ("{}", "no held, no release_step, no version"),
        ('{"release_step":null,"held":false,"version":3,"pins":[["*",9223372036854775807]]}',
         "pins\\[0\\] step must be an integer in 0..9007199254740991"),
        ('{"release_step":5,"held":true,"version":3,"colour":"red"}', "unknown field 'colour'"),
        ('{"release_step":5,"held":"yes","version":3}', "held must be true or false"),
        ('{"release_step":5.0,"held":true,"version":3}', "release_step must be an integer"),
        ('{"release_step":null,"held":true,"version":3}', "held, but no release step"),
        ('{"release_step":5,"held":true,"version":3,"pins":[["a b",1]]}', "not a group glob"),
        ('{"release_step":5,"held":true,"version":3,"release_generation":-1}',
         "release_generation"),
        ('{"release_step":5,"held":true,"version":3,"pins":[["a*",1]],"pin_generations":[]}',
         "pin_generations holds 0 items for 1"),
    ],
)  # fmt: skip
def test_a_state_no_control_could_have_written_is_refused(raw: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        ReleaseState.from_json(raw)


def test_a_bad_state_in_redis_is_never_served_past_the_release_and_is_said_and_counted(
    tmp_path: Path,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Held at step 1, the head at 4: ``{}`` (everything released, as read before) and a pin
    of ``*`` at step 2^63-1 written straight into Redis are refused: the predictor stays at
    step 1 bit-exact; the log says it (rate-limited), /metrics counts each bad value,
    `deltad status` shows it. A control sent then writes the last valid state back, changed."""
    ft = trained(tmp_path, (1, 2, 3, 4))
    client = redis_py.Redis.from_url(redis_url)
    key = RolloutStore(client, "m").key
    with (
        sidecar(ft, tmp_path, redis_url, 4, metrics=True) as srv,
        predictor("pred-1", [srv.endpoint]) as c,
    ):
        ep = srv.endpoint
        assert srv.metrics_port is not None
        call(ep, A.ROLLOUT_RELEASE, step=1)
        a = TensorDictApplier()
        assert c.sync(a.apply).step == 1 and equal(a, ft.history[1])
        assert metric(srv.metrics_port, "deltad_release_state_refusing") == 0
        with caplog.at_level(logging.WARNING, logger="deltad.serve.state.release"):
            for n, (bad, why) in enumerate(
                (
                    ("{}", "no held"),
                    ('{"release_step":null,"held":false,"version":9,'
                     '"pins":[["*",9223372036854775807]]}', "pins[0] step"),
                ),
                1,
            ):  # fmt: skip
                client.set(key, bad)
                wait_for(lambda w=why: w in status(ep).rollout_state, 10, "the refusal")  # type: ignore[misc]
                for _ in range(3):  # (pulled again and again: still step 1, nothing new)
                    r = c.sync(a.apply)
                    assert r.step in (None, 1) and equal(a, ft.history[1]), r
                assert status(ep, "pred-1").cap_step == 1
                assert metric(srv.metrics_port, "deltad_release_state_refused_total") == n
                assert metric(srv.metrics_port, "deltad_release_state_refusing") == 1
        said = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert len(said) == 1, said  # (rate-limited: once a minute)
        assert "the last valid one (version 1) stays in force" in said[0]
        code, out, _ = cli(capsys, "status", "--target", ep)
        assert code == 0 and "release: step 1 (version 1)" in out, out
        assert "the value in Redis is REFUSED" in out and "pins[0] step" in out, out
        # a control repairs it: from the last valid state, the refused value replaced
        code, out, err = cli(capsys, "rollout", "hold", "--target", ep)
        assert code == 0, err
        assert "the value in Redis was refused" in out and "replaced" in out, out
        stored = ReleaseState.from_json(client.get(key))  # type: ignore[arg-type]
        assert (stored.release_step, stored.held, stored.pins) == (1, True, ())
        wait_for(lambda: "refused" not in status(ep).rollout_state, 10, "repaired")
        assert metric(srv.metrics_port, "deltad_release_state_refusing") == 0
        assert c.sync(a.apply).step in (None, 1) and equal(a, ft.history[1])


def test_a_sidecar_that_never_read_a_valid_state_serves_nothing_and_controls_say_why(
    tmp_path: Path, redis_url: str
) -> None:
    trained(tmp_path)
    client = redis_py.Redis.from_url(redis_url)
    key = RolloutStore(client, "m").key
    client.set(key, "{}")
    cfg = server_config(tmp_path / "spool", 0, redis_url)
    srv = SidecarServer(cfg).start()
    try:
        wait_for(lambda: status(srv.endpoint).head_step == 2, 30, "the head")
        with grpc.insecure_channel(srv.endpoint) as ch, pytest.raises(grpc.RpcError) as e:
            list(
                pb_grpc.DeltaServiceStub(ch).GetDelta(
                    pb.GetDeltaRequest(consumer="c", form=pb.FORM_ROWS), timeout=10
                )
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no held, no release_step, no version" in (e.value.details() or "")
        e2 = refused(srv.endpoint, A.ROLLOUT_HOLD)
        assert e2.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"never read a valid one to start from: fix the value, or delete {key}" in (
            e2.details() or ""
        )
        assert client.get(key) == b"{}"  # nothing written over it
    finally:
        srv.stop(0.2)


# --- 3. controls the gate, a pin or a rollback bends say so (or are refused) -----------------


def test_a_pin_past_the_gate_is_refused_as_a_release_is_and_status_names_published_steps(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps published every 2; the gate fails step 6 (NaN). Issue 37: `pin --step 8` was
    accepted silently (served 4, shown as cap 5), `release --to-step 8` refused; status said
    `release: step 1 (held)` beside `holding at step 4` and "serving at most step 5", a step
    never published. Now the pin is refused like the release; status shows one release step,
    each consumer's cap as a published step, and the gate's hold of the canaries."""
    ft = trained(tmp_path, (2,))
    with (
        sidecar(ft, tmp_path, redis_url, 2) as srv,
        predictor("pred-canary-1", [srv.endpoint]) as cc,
        predictor("pred-1", [srv.endpoint]) as c,
    ):
        ep = srv.endpoint
        call(ep, A.ROLLOUT_RELEASE, step=0)  # (the fleet at 0; canaries follow the head)
        call(ep, A.ROLLOUT_CANARY, group="pred-canary-*")
        ft.step(4)
        ft.step(6, poison=float("nan"))
        ft.step(8)
        wait_for(lambda: status(ep).head_step == 8, 30, "the head at 8")
        wait_for(
            lambda: ReleaseState.from_json(call(ep, A.ROLLOUT_STATUS).state).gate_bad_step == 6,
            10,
            "the gate",
        )
        ca, a = TensorDictApplier(), TensorDictApplier()
        assert cc.sync(ca.apply).step == 4 and equal(ca, ft.history[4])
        assert c.sync(a.apply).step == 0
        for argv in (["pin", "--group", "pred-*", "--step", "8"], ["release", "--to-step", "8"]):
            code, _, err = cli(capsys, "rollout", *argv, "--target", ep)
            assert code == 2 and len(err.splitlines()) == 1, err
            assert "FAILED_PRECONDITION: step 6 failed the validation gate" in err, err
        assert (
            "would be served at most step 4"
            in refused(ep, A.ROLLOUT_PIN, group="pred-*", step=7).details()
        )
        code, out, _ = cli(
            capsys, "rollout", "pin", "--group", "pred-1", "--step", "5", "--target", ep
        )
        assert code == 0 and "pinned pred-1 at step 4 (step 5 was not published" in out, out
        code, out, _ = cli(capsys, "status", "--target", ep)
        assert code == 0
        rel = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("release:")]
        assert rel == ["release: step 0, held (version 4)"], out
        assert "gate: step 6 failed (generation 1)" in out, out
        assert "canaries held at step 4; the fleet stays at its release step 0" in out, out
        assert "canary: pred-canary-* follows the head (at most step 4 while the gate holds)" in out
        assert "serving at most step 5" not in out and "gate here" not in out, out
        caps = {
            ln.split()[0]: ln.split()[-1]
            for ln in out.splitlines()
            if ln.strip().startswith(("pred-1 ", "pred-canary-1 "))
        }
        assert caps == {"pred-1": "4", "pred-canary-1": "4"}, out  # (5 was never published)
        assert status(ep, "pred-canary-1").cap_step == 4
        assert c.sync(a.apply).step == 4 and equal(a, ft.history[4])


def test_a_rollback_that_would_move_a_held_fleet_forward_is_refused_without_force(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 37: a fleet held at step 1 and ordered `rollback --to-step 3` moved FORWARD from
    1 to 3 without a word. Refused unless --force; forced, the answer says it."""
    ft = trained(tmp_path, (1, 2, 3, 4))
    with sidecar(ft, tmp_path, redis_url, 4) as srv, predictor("pred-1", [srv.endpoint]) as c:
        ep = srv.endpoint
        call(ep, A.ROLLOUT_RELEASE, step=1)
        call(ep, A.ROLLOUT_HOLD)
        a = TensorDictApplier()
        assert c.sync(a.apply).step == 1
        code, _, err = cli(capsys, "rollout", "rollback", "--to-step", "3", "--target", ep)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "the fleet is held at step 1: a rollback to step 3 would move it FORWARD" in err
        assert "release (--to-step 3)" in err and "rollback --force" in err
        assert c.sync(a.apply).step in (None, 1) and equal(a, ft.history[1])
        code, out, err = cli(
            capsys, "rollout", "rollback", "--to-step", "3", "--force", "--target", ep
        )
        assert code == 0, err
        assert (
            "(forced: the fleet is held at step 1: a rollback to step 3 would move it FORWARD)"
            in out
        )
        # backward needs no force
        code, out, err = cli(capsys, "rollout", "rollback", "--to-step", "2", "--target", ep)
        assert code == 0 and "FORWARD" not in out, (out, err)


def test_a_stored_state_round_trips_with_generations_and_old_readers_still_read_it() -> None:
    s = ro.pin(ro.hold(ReleaseState(), 7, generation=3), "p-*", 5, head_step=7, generation=3)
    s = ro.rollback(s, 4, "q-*", head_step=7, generation=3)
    d = json.loads(s.to_json())
    # (an older reader checks "pins" as [group, step] and "rollbacks" as [step, group, epoch])
    assert d["pins"][0] == ["q-*", 4] and d["pin_generations"] == [3, 3]
    assert d["rollbacks"][0][:2] == [4, "q-*"] and d["rollback_generations"] == [3]
    assert d["release_generation"] == 3 and ReleaseState.from_json(s.to_json()) == s
    legacy = ReleaseState.from_json('{"release_step":5,"held":true,"version":2,"pins":[["a*",1]]}')
    assert legacy.release_generation is None and legacy.pins[0].generation is None
    assert ro.cap_for(legacy, "z", 7).max_step == 5  # (applied to whatever is served, as before)
    stamped = ro.stamped(legacy, 7)
    assert stamped.release_generation == 7 and stamped.pins[0].generation == 7
    # the reference trainer's generations are nanosecond times (past 2^53): kept exactly
    big = ro.gate_failed(
        ro.hold(ReleaseState(), 9, generation=1795879637312637354),
        generation=1795879637312637354, bad_step=10, good_step=9, reason="nan",
    )  # fmt: skip
    assert ReleaseState.from_json(big.to_json()) == big


def test_a_relay_passes_on_that_the_models_stored_state_is_refused() -> None:
    from deltad.serve.state.release import FollowedRollout

    state = ReleaseState(release_step=3, held=True, version=2)
    d = json.loads(state.to_json())
    d["refused"] = "the release state in Redis (k) is malformed: no held"
    follow = FollowedRollout(None)
    follow.follow(json.dumps(d))
    assert follow.state() == state
    shown = json.loads(follow.state_json())
    assert shown["refused"].endswith("no held") and ReleaseState.from_json(follow.state_json())
    follow.follow(state.to_json())  # (repaired upstream)
    assert "refused" not in json.loads(follow.state_json())
