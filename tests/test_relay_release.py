"""A relay and the model's release state when things go wrong (review 4, stop 34, #2 and #3):
a relay started during a hold serves the held step to new predictors (its mirror ends a
segment at every step the release state serves), and a relay restarted while its upstream is
unreachable applies the last state it followed (kept in its spool), never "everything
released"; one that never heard a state serves nothing. Real sidecars and relays on port 0,
real Redis, real DeltaConsumers; the truth is FakeTrainer's history."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from serverkit import server_config
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, db, equal, predictor
from test_rollback import SHAPES, Release, relay_of

from deltad.config import RelayConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.serve import rollout as ro
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.restore import restorable
from deltad.serve.relay.server import RelayServer
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)


def _trained(tmp_path: Path) -> FakeTrainer:
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    for step in (10, 20, 30, 40):
        ft.step(step, touch=25)
    return ft


def _sidecar(tmp_path: Path, redis_url: str, release: Release) -> SidecarServer:
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_url, grace_period_s=0.2, merge_min_segments=2)
    ).start()
    release.watch(srv)
    return srv


def _relay(upstream: str, spool: Path, redis_url: str) -> RelayServer:
    """A relay as relay_of makes it, not waited for (its upstream may be down)."""
    cfg = server_config(spool, db(redis_url, 1), grace_period_s=0.2)
    return RelayServer(
        cfg,
        RelayConfig(upstream=upstream, consumer="relay", poll_interval_s=0.02, fsync=False,
                    backoff_initial_s=0.05, backoff_max_s=0.5),
    ).start()  # fmt: skip


def test_a_relay_started_during_a_hold_serves_the_held_step_and_canaries_the_head(
    tmp_path: Path, redis_url: str
) -> None:
    """Held at 20 with the head at 40, a fresh relay used to copy the head (its base at
    step 40): every new predictor behind it was refused ("pin or release a later step").
    Its mirror now stops at 20 first: a new predictor gets exactly step 20, a canary the
    head, and step 20 stays restorable in the relay's log."""
    ft = _trained(tmp_path)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None
    try:
        wait_for(lambda: at_step([srv.endpoint], 40), 30, "the head")
        release.change(lambda st: replace(st, release_step=20, held=True))
        release.change(lambda st: ro.canary(st, "can-*"))
        relay = relay_of(srv.endpoint, tmp_path / "relay", 0, redis_url, release)
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay at the head")  # type: ignore[union-attr]
        snap = relay.server.log.snapshot()
        assert snap is not None and [e.step for e in snap.entries] == [20, 40]
        assert restorable(snap, 20) == ""
        with predictor("new-1", [relay.endpoint]) as c, predictor("can-1", [relay.endpoint]) as k:
            a, b = TensorDictApplier(), TensorDictApplier()
            r = c.sync(a.apply)
            assert (r.step, r.cap_step) == (20, 20) and equal(a, ft.history[20])
            assert k.sync(b.apply).step == 40 and equal(b, ft.history[40])
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)


def test_a_relay_restarted_while_its_upstream_is_down_keeps_the_hold_it_followed(
    tmp_path: Path, redis_url: str
) -> None:
    """The relay mirrored every step up to 40 while the model was released, then followed a
    hold at 20. Relay and sidecar stop; the relay restarts with the sidecar still down: it used to
    start from "everything released" and serve step 40. It now applies the state it kept in
    its spool: a new predictor gets exactly step 20. Without that file (a spool from before,
    or the write failed) it serves nothing: UNAVAILABLE with the reason, and its Status and
    `deltad status` say the state is not known."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None
    try:
        relay = relay_of(srv.endpoint, tmp_path / "relay", 0, redis_url, release)
        for step in (10, 20, 30, 40):  # the relay mirrors each step as it comes
            ft.step(step, touch=25)
            wait_for(lambda s=step: at_step([relay.endpoint], s), 30, f"the relay at {step}")  # type: ignore[misc,union-attr]
        release.change(lambda st: replace(st, release_step=20, held=True))
        kept = tmp_path / "relay" / "m" / "sidecar" / "release-state-rank0.json"
        assert kept.exists()
        upstream = srv.endpoint
        relay.stop(0)
        srv.stop(0)
        relay = _relay(upstream, tmp_path / "relay", redis_url)
        with predictor("new-1", [relay.endpoint]) as c:
            a = TensorDictApplier()
            r = c.sync(a.apply)
            assert (r.step, r.cap_step) == (20, 20) and equal(a, ft.history[20])
        relay.stop(0)
        kept.unlink()
        relay = _relay(upstream, tmp_path / "relay", redis_url)
        with grpc.insecure_channel(relay.endpoint) as ch:
            stub = pb_grpc.DeltaServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.GetDelta(pb.GetDeltaRequest(consumer="new-2", form=pb.FORM_ROWS),
                                   timeout=10))  # fmt: skip
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "has not heard its upstream's release state" in (e.value.details() or "")
            st = stub.Status(pb.StatusRequest(), timeout=10)
            assert '"unknown":true' in st.rollout_state
        from deltad import status

        assert "not heard from the upstream yet" in "\n".join(
            status.rollout_lines(status.fetch(relay.endpoint)[0])
        )
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)
