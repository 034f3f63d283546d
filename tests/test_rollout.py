"""The release controls end to end (issue 21): hold, release, pin, canary, rollback orders and the
validation gate, across 2 ranks of real sidecars (and relays) sharing a real Redis, with real
DeltaConsumers; the trainer is tests/spoolkit's FakeTrainer (the reference trainer: slow test)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from spoolkit import FakeTrainer, wait_for
from test_relay import predictor, server_config, tree

from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer, PullResult
from deltad.serve.edge.app import GATE_HEALTH, SidecarServer
from deltad.serve.rollout import ReleaseState
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

A = pb.RolloutAction


def rollout(endpoint: str, action: int, *, token: str | None = None, **kw: object) -> ReleaseState:
    """One Rollout call (admin); the state it answers."""
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(endpoint) as ch:
        resp = pb_grpc.DeltaServiceStub(ch).Rollout(
            pb.RolloutRequest(action=action, **kw),  # type: ignore[arg-type]
            timeout=10,
            metadata=md,
        )
    return ReleaseState.from_json(resp.state)


def status(endpoint: str, consumer: str = "") -> pb.StatusResponse:
    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(consumer=consumer), timeout=10)


def settle(endpoints: list[str], version: int) -> None:
    """Wait until every server applies the state of ``version`` (or a newer one)."""
    wait_for(
        lambda: all(status(e).rollout_version >= version for e in endpoints),
        10,
        f"release state version {version} everywhere",
    )


def heads(endpoints: list[str], step: int) -> None:
    wait_for(lambda: all(status(e).head_step == step for e in endpoints), 30, f"heads at {step}")


def sync_to(c: DeltaConsumer, applier: TensorDictApplier, step: int) -> PullResult:
    """Pull until the consumer serves ``step`` (bounded); the last pull."""
    last: list[PullResult] = []

    def done() -> bool:
        last[:] = [c.sync(applier.apply)]
        return last[0].step == step

    wait_for(done, 20, f"consumer {c.config.consumer} at step {step}")
    return last[0]


def equal(applier: TensorDictApplier, truth: dict[str, torch.Tensor]) -> bool:
    """Bit-equal tables (NaN equal to NaN: a row the operator let through)."""
    got = applier.tables()
    return all(torch.allclose(got[n], t, rtol=0, atol=0, equal_nan=True) for n, t in truth.items())


@contextlib.contextmanager
def fleet(
    tmp_path: Path, redis_url: str, levels: int = 0
) -> Iterator[tuple[FakeTrainer, list[list[str]]]]:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(1)
    ft.step(2)
    with tree(tmp_path, redis_url, 2, levels) as eps:
        heads(eps[-1], 2)
        yield ft, eps


def test_hold_stops_both_ranks_at_one_step_and_release_moves_them(
    tmp_path: Path, redis_url: str
) -> None:
    with fleet(tmp_path, redis_url) as (ft, [eps]), predictor("p-1", eps) as c:
        applier = TensorDictApplier()
        sync_to(c, applier, 2)
        s = rollout(eps[1], A.ROLLOUT_HOLD)  # any rank: the state is model-wide
        assert (s.release_step, s.held) == (2, True)
        settle(eps, s.version)
        ft.step(3)
        ft.step(4)
        heads(eps, 4)
        r = c.sync(applier.apply)
        assert r.step == 2 and r.head_step == 4 and r.cap_step == 2
        assert r.caught_up  # caught up to the release, not behind
        assert {d.to_step for d in r.deltas} == {2} and r.rows == 0
        assert equal(applier, ft.history[2])
        assert [st.cap_step for st in (status(e, "p-1") for e in eps)] == [2, 2]
        s = rollout(eps[0], A.ROLLOUT_RELEASE, step=3)
        settle(eps, s.version)
        r = sync_to(c, applier, 3)
        assert r.caught_up and r.release_step == 3
        assert equal(applier, ft.history[3])
        s = rollout(eps[0], A.ROLLOUT_RELEASE)
        settle(eps, s.version)
        r = sync_to(c, applier, 4)
        assert r.caught_up and r.cap_step is None
        assert equal(applier, ft.history[4])


def test_a_pin_keeps_its_glob_at_the_step_while_others_move_and_unpin_frees_it(
    tmp_path: Path, redis_url: str
) -> None:
    with (
        fleet(tmp_path, redis_url) as (ft, [eps]),
        predictor("eu-1", eps) as pinned,
        predictor("us-1", eps) as free,
    ):
        a_pinned, a_free = TensorDictApplier(), TensorDictApplier()
        s = rollout(eps[0], A.ROLLOUT_PIN, group="eu-*", step=1)
        settle(eps, s.version)
        sync_to(pinned, a_pinned, 1)  # a bootstrap is capped too
        assert equal(a_pinned, ft.history[1])
        ft.step(3)
        heads(eps, 3)
        sync_to(free, a_free, 3)
        r = pinned.sync(a_pinned.apply)
        assert r.step == 1 and r.caught_up
        consumers = {
            c.consumer: c.cap_step
            for c in pb_grpc.DeltaServiceStub(grpc.insecure_channel(eps[0]))
            .ListConsumers(pb.ListConsumersRequest(), timeout=10)
            .consumers
        }
        assert consumers == {"eu-1": 1, "us-1": -1}
        s = rollout(eps[0], A.ROLLOUT_UNPIN, group="eu-*")
        settle(eps, s.version)
        sync_to(pinned, a_pinned, 3)
        assert equal(a_pinned, ft.history[3])


def test_a_canary_group_follows_the_head_while_the_rest_holds(
    tmp_path: Path, redis_url: str
) -> None:
    with (
        fleet(tmp_path, redis_url) as (ft, [eps]),
        predictor("pred-canary-1", eps) as canary,
        predictor("pred-1", eps) as rest,
    ):
        a_canary, a_rest = TensorDictApplier(), TensorDictApplier()
        rollout(eps[0], A.ROLLOUT_HOLD)
        s = rollout(eps[0], A.ROLLOUT_CANARY, group="pred-canary-*")
        settle(eps, s.version)
        ft.step(3)
        heads(eps, 3)
        sync_to(canary, a_canary, 3)
        assert equal(a_canary, ft.history[3])
        r = rest.sync(a_rest.apply)
        assert r.step == 2 and r.caught_up
        s = rollout(eps[0], A.ROLLOUT_UNCANARY, group="pred-canary-*")
        settle(eps, s.version)
        ft.step(4)
        heads(eps, 4)
        r = canary.sync(a_canary.apply)
        assert r.step == 3  # stopped where it was (not rolled back), until a release passes it


def test_pins_and_holds_survive_a_sidecar_restart_and_a_new_generation(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(1)
    ft.step(2)
    cfgs = [server_config(tmp_path / "spool", r, redis_url) for r in range(2)]
    servers = [SidecarServer(c).start() for c in cfgs]
    eps = [s.endpoint for s in servers]
    try:
        heads(eps, 2)
        rollout(eps[0], A.ROLLOUT_HOLD)
        s = rollout(eps[0], A.ROLLOUT_PIN, group="pinned-*", step=1)
        for srv in servers:
            srv.stop(0.2)
        ft.step(3)
        servers = [SidecarServer(c).start() for c in cfgs]  # new ports, same Redis
        eps = [s.endpoint for s in servers]
        heads(eps, 3)
        after = rollout(eps[1], A.ROLLOUT_STATUS)
        assert after == s  # read back from Redis by a fresh process
        with predictor("p-1", eps) as c, predictor("pinned-1", eps) as pc:
            a, pa = TensorDictApplier(), TensorDictApplier()
            assert c.sync(a.apply).step == 2
            assert pc.sync(pa.apply).step == 1
            # the trainer restarts from a checkpoint: a new generation, from step 1
            new = FakeTrainer(tmp_path / "spool", world_size=2, generation=2, seed=5)
            new.start(1)
            new.step(2)
            new.step(3)
            wait_for(
                lambda: all(status(e).generation == 2 and status(e).head_step == 3 for e in eps),
                30,
                "the new generation",
            )
            # the hold names a state, (generation 1, step 2): nothing of generation 2 is
            # served past it (issue 39: it was, as "step 2" of the new generation)
            for cons, app, truth in ((c, a, ft.history[2]), (pc, pa, ft.history[1])):
                r = cons.sync(app.apply)
                assert not r.deltas and len(r.missing) == 2, r
                assert all("generation 2 is not released" in w for w in r.missing.values())
                assert equal(app, truth)
            assert status(eps[0], "p-1").cap_step == -2  # (nothing of this generation)
            # a release that names generation 2 (sent to a sidecar serving it) lets it through
            rollout(eps[0], A.ROLLOUT_RELEASE, step=2, generation=2)
            r = sync_to(c, a, 2)
            assert all(d.generation == 2 for d in r.deltas)
            assert equal(a, new.history[2])
            assert not pc.sync(pa.apply).deltas and equal(pa, ft.history[1])  # still pinned
            rollout(eps[0], A.ROLLOUT_PIN, group="pinned-*", step=1)  # (of generation 2)
            sync_to(pc, pa, 1)
            assert equal(pa, new.history[1])
            assert c.sync(a.apply).step == 2
    finally:
        for srv in servers:
            srv.stop(0.2)


def test_rollback_records_an_order_and_caps_the_group(tmp_path: Path, redis_url: str) -> None:
    with fleet(tmp_path, redis_url) as (_, [eps]):
        assert rollout(eps[0], A.ROLLOUT_STATUS).rollback is None
        before = int(time.time())
        s = rollout(eps[0], A.ROLLOUT_ROLLBACK, step=1)
        assert s.rollback is not None and (s.rollback.to_step, s.rollback.group) == (1, "*")
        assert (s.release_step, s.held) == (1, True)
        # numbering starts at the time in seconds (a state deleted from Redis and begun
        # again never gives an epoch cursors recorded: review 8, stop 34), then counts up
        first = s.rollback.epoch
        assert before <= first <= int(time.time())
        s = rollout(eps[0], A.ROLLOUT_ROLLBACK, step=1, group="g-*")
        assert s.rollback is not None and s.rollback.epoch == first + 1
        assert s.rollback.group == "g-*"


@pytest.mark.parametrize(
    ("kw", "code", "text"),
    [
        ({"action": A.ROLLOUT_PIN, "group": "a b", "step": 1}, "INVALID_ARGUMENT", "group must"),
        ({"action": A.ROLLOUT_PIN, "group": "a*"}, "INVALID_ARGUMENT", "pin needs a step"),
        ({"action": A.ROLLOUT_RELEASE, "step": 99}, "INVALID_ARGUMENT", "past the head step 2"),
        ({"action": A.ROLLOUT_ROLLBACK, "step": -1}, "INVALID_ARGUMENT", ">= 0"),
        ({"action": A.ROLLOUT_UNPIN, "group": "x"}, "INVALID_ARGUMENT", "no pin of group"),
    ],
)
def test_bad_steps_and_globs_are_invalid_arguments(
    tmp_path: Path, redis_url: str, kw: dict[str, object], code: str, text: str
) -> None:
    with fleet(tmp_path, redis_url) as (_, [eps]):
        action = kw.pop("action")
        with pytest.raises(grpc.RpcError) as e:
            rollout(eps[0], action, **kw)  # type: ignore[arg-type]
        assert e.value.code().name == code and text in (e.value.details() or "")
        assert rollout(eps[0], A.ROLLOUT_STATUS).version == 0  # nothing changed


def test_only_the_admin_role_may_use_the_controls(tmp_path: Path, redis_url: str) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("pred-tok  pred-*  consume\nops-tok  *  consume,admin\n")
    ft = FakeTrainer(tmp_path / "spool")
    ft.start(0)
    cfg = server_config(tmp_path / "spool", 0, redis_url)
    cfg.tokens_file = tokens
    srv = SidecarServer(cfg).start()
    try:
        for action in (A.ROLLOUT_STATUS, A.ROLLOUT_HOLD, A.ROLLOUT_RELEASE):
            with pytest.raises(grpc.RpcError) as e:
                rollout(srv.endpoint, action, token="pred-tok")
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as e:
                rollout(srv.endpoint, action)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rollout(srv.endpoint, A.ROLLOUT_HOLD, token="ops-tok").held
    finally:
        srv.stop(0.2)


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _gate_health(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as ch:
        return int(
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service=GATE_HEALTH), timeout=10)
            .status
        )


def test_the_gate_holds_on_a_nan_segment_and_status_metrics_health_say_why(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(1)
    ft.step(2)
    servers = []
    try:
        for r in range(2):
            cfg = server_config(tmp_path / "spool", r, redis_url)
            cfg.metrics_port = 0
            servers.append(SidecarServer(cfg).start())
        eps = [s.endpoint for s in servers]
        heads(eps, 2)
        with predictor("pred-1", eps) as c, predictor("pred-canary-1", eps) as cc:
            a, ca = TensorDictApplier(), TensorDictApplier()
            sync_to(c, a, 2)
            rollout(eps[0], A.ROLLOUT_CANARY, group="pred-canary-*")
            ft.step(3, poison=float("nan"))
            ft.step(4)
            heads(eps, 4)
            wait_for(lambda: rollout(eps[0], A.ROLLOUT_STATUS).gate_bad_step == 3, 10, "gate")
            s = rollout(eps[0], A.ROLLOUT_STATUS)
            assert (s.held, s.release_step, s.gate_good_step) == (True, 2, 2)
            assert "non-finite" in s.gate_reason
            settle(eps, s.version)
            for cons, app in ((c, a), (cc, ca)):  # a canary never passes the gate either
                r = cons.sync(app.apply)
                assert r.step == 2 and r.caught_up and r.head_step == 4
                assert all(torch.isfinite(t).all() for t in app.tables().values())
            bad = [st for st in (status(e) for e in eps) if st.gate_reason]
            assert len(bad) == 1 and bad[0].gate_bad_step == 3  # the rank with the NaN row
            bad_srv = servers[bad[0].rank]
            wait_for(lambda: _gate_health(bad_srv.endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "gate health")  # fmt: skip
            assert bad_srv.metrics_port is not None
            assert _metric(bad_srv.metrics_port, "deltad_gate_failures_total") == 1
            assert _metric(bad_srv.metrics_port, "deltad_gate_held") == 1
            assert _metric(bad_srv.metrics_port, "deltad_rollout_held") == 1
            assert _metric(bad_srv.metrics_port, "deltad_gate_check_seconds") > 0
            # the hold is the model's: the other rank's probe and gauge say so too (review 4,
            # stop 34, #6: they said SERVING and 0), its failure count stays its own
            good_srv = servers[1 - bad[0].rank]
            assert good_srv.metrics_port is not None
            wait_for(lambda: _gate_health(good_srv.endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "the other rank's gate health")  # fmt: skip
            assert _metric(good_srv.metrics_port, "deltad_gate_held") == 1
            assert _metric(good_srv.metrics_port, "deltad_gate_failures_total") == 0
            # releasing past it is an explicit decision
            with pytest.raises(grpc.RpcError) as e:
                rollout(eps[0], A.ROLLOUT_RELEASE)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "failed the validation gate" in (e.value.details() or "")
            s = rollout(eps[0], A.ROLLOUT_RELEASE, force=True)
            assert s.gate_accepted_step == 4 and not s.held
            settle(eps, s.version)
            sync_to(c, a, 4)
            assert equal(a, ft.history[4])  # the operator let the NaN row through
            for srv in servers:
                wait_for(lambda s=srv: _gate_health(s.endpoint) == health_pb2.HealthCheckResponse.SERVING, 10, "gate health")  # type: ignore[misc]  # fmt: skip
    finally:
        for srv in servers:
            srv.stop(0.2)


def test_controls_and_the_gate_reach_predictors_through_relays(
    tmp_path: Path, redis_url: str
) -> None:
    with (
        fleet(tmp_path, redis_url, levels=1) as (ft, [sidecars, relays]),
        predictor("pred-1", relays) as c,
        predictor("pred-canary-1", relays) as cc,
    ):
        a, ca = TensorDictApplier(), TensorDictApplier()
        sync_to(c, a, 2)
        s = rollout(sidecars[0], A.ROLLOUT_HOLD)
        s = rollout(sidecars[0], A.ROLLOUT_CANARY, group="pred-canary-*")
        settle(relays, s.version)  # the relays follow the sidecars' state
        ft.step(3)
        heads(relays, 3)  # the relays mirror past the hold (their canaries need it)
        sync_to(cc, ca, 3)
        assert equal(ca, ft.history[3])
        assert c.sync(a.apply).step == 2
        with pytest.raises(grpc.RpcError) as e:  # a relay takes no controls
            rollout(relays[0], A.ROLLOUT_RELEASE)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        ft.step(4, poison=float("inf"))
        ft.step(5)
        heads(sidecars, 5)
        wait_for(lambda: rollout(sidecars[0], A.ROLLOUT_STATUS).gate_bad_step == 4, 10, "gate")
        # the failed segment never reaches a relay: the mirror of its rank stops below it
        bad = [st.rank for st in (status(e) for e in sidecars) if st.gate_reason]
        assert len(bad) == 1 and status(relays[bad[0]]).head_step == 3
        assert "non-finite" in status(relays[0]).rollout_state  # the state tells the relays
        s = rollout(sidecars[0], A.ROLLOUT_RELEASE, step=3)
        settle(relays, s.version)
        sync_to(c, a, 3)
        assert equal(a, ft.history[3])
        assert cc.sync(ca.apply).step == 3


def test_the_rollout_cli_changes_and_shows_the_state_and_exits_2_on_bad_input(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltad.commands.main import main

    with fleet(tmp_path, redis_url) as (_, [eps]):

        def cli(*args: str) -> tuple[int, str, str]:
            code = main(["rollout", *args, "--target", eps[0]])
            out = capsys.readouterr()
            return code, out.out, out.err

        code, out, err = cli("pin", "--group", "eu-*", "--to-step", "1")
        assert code == 0, err
        assert "pinned eu-* at step 1" in out and "pin: eu-* at step 1" in out
        code, out, _ = cli("status", "--json")
        assert code == 0 and json.loads(out)["state"]["pins"] == [["eu-*", 1]]
        for bad, text in (
            (("pin", "--to-step", "1"), "needs --group"),
            (("release", "--to-step", "7"), "past the head step 2"),
            (("canary", "--group", "x", "--force"), "--force goes with release, rollback only"),
            (("unpin", "--group", "nope"), "no pin of group"),
        ):
            code, _, err = cli(*bad)
            assert code == 2, err
            assert len(err.strip().splitlines()) == 1 and text in err
        assert main(["status", "--target", eps[0]]) == 0
        out = capsys.readouterr().out
        assert "rollout:" in out and "pin: eu-* at step 1" in out


def test_a_rollback_outside_the_restore_window_is_refused_when_it_is_known(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool")
    ft.start(0)
    ft.step(1)
    ft.step(2)
    srv = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        heads([srv.endpoint], 2)
        control = srv.servicer.rollout_control
        assert control is not None
        control.restore_window = lambda: (1, 2)  # a window narrower than the log's
        control.restore_check = None  # (the log's own answer wins when there is one)
        with pytest.raises(grpc.RpcError) as e:
            rollout(srv.endpoint, A.ROLLOUT_ROLLBACK, step=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the restore window (steps 1..2)" in (e.value.details() or "")
        s = rollout(srv.endpoint, A.ROLLOUT_ROLLBACK, step=1)
        assert s.rollback is not None and s.rollback.to_step == 1
    finally:
        srv.stop(0.2)


def test_a_mirror_pull_passes_the_caps_only_with_the_relay_or_admin_role(
    tmp_path: Path, redis_url: str
) -> None:
    from deltad.consume import decode

    tokens = tmp_path / "tokens"
    tokens.write_text("pred-tok  *  consume\nrelay-tok  relay-*  relay\nops-tok  *  admin\n")
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(1)
    cfg = server_config(tmp_path / "spool", 0, redis_url)
    cfg.tokens_file = tokens
    srv = SidecarServer(cfg).start()

    def at(srv: SidecarServer, step: int) -> None:
        wait_for(lambda: (snap := srv.log.snapshot()) is not None and snap.head.step == step)

    try:
        at(srv, 1)
        rollout(srv.endpoint, A.ROLLOUT_HOLD, token="ops-tok")
        ft.step(2)
        at(srv, 2)

        def pull(name: str, token: str) -> int:
            req = pb.GetDeltaRequest(consumer=name, form=pb.FORM_ROWS, mirror=True)
            with grpc.insecure_channel(srv.endpoint) as ch:
                md = (("authorization", f"Bearer {token}"),)
                return decode.pull(ch, req, timeout=10, metadata=md).to_step

        assert pull("pred-1", "pred-tok") == 1  # a consumer claiming to be a mirror: capped
        assert pull("relay-1", "relay-tok") == 2
        assert pull("relay-2", "ops-tok") == 2
    finally:
        srv.stop(0.2)


def test_a_nan_segment_already_in_the_spool_holds_the_model_when_the_sidecars_start(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(1)
    ft.step(2, poison=float("nan"))
    ft.step(3)
    with tree(tmp_path, redis_url, 2, 0) as [eps], predictor("p-1", eps) as c:
        heads(eps, 3)
        s = rollout(eps[0], A.ROLLOUT_STATUS)
        assert (s.gate_bad_step, s.gate_good_step, s.release_step, s.held) == (2, 1, 1, True)
        a = TensorDictApplier()
        r = c.sync(a.apply)  # a bootstrap: capped below the failed step too
        assert r.step == 1 and r.caught_up and equal(a, ft.history[1])
