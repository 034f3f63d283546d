"""A relay and the model's release state when things go wrong (review 4, stop 34, #2 and #3):
a relay started during a hold serves the held step to new predictors (its mirror ends a
segment at every step the release state serves), and a relay restarted while its upstream is
unreachable applies the last state it followed (kept in its spool), never "everything
released"; one that never heard a state serves nothing. Real sidecars and relays on port 0,
real Redis, real DeltaConsumers; the truth is FakeTrainer's history."""

from __future__ import annotations

import time
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


@pytest.mark.parametrize(("window", "entries"), [(0, [20, 40]), (1000, [0, 10, 20, 30, 40])])
def test_a_relay_started_during_a_hold_serves_the_held_step_and_canaries_the_head(
    tmp_path: Path, redis_url: str, window: int, entries: list[int]
) -> None:
    """Held at 20 with the head at 40, a relay restarted on a fresh spool (a tmpfs pod) under
    its old consumer name, whose upstream cursor is at the head, used to copy the head (its
    base at step 40): every new predictor behind it was refused ("pin or release a later
    step"), and so was it when it only asked for step 20 (a resync never ended before the
    cursor; review 7, stop 34, #1). Its mirror now asks for the tables at 20 first (its
    commit may move its upstream cursor back), then the head; with a restore window, every
    upstream entry in it, so its log restores what its upstream's does. A new predictor gets
    exactly step 20, a canary the head."""
    ft = _trained(tmp_path)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None

    def start(spool: Path) -> RelayServer:
        return relay_of(srv.endpoint, spool, 0, redis_url, release, window)

    try:
        wait_for(lambda: at_step([srv.endpoint], 40), 30, "the head")
        relay = start(tmp_path / "relay-before")  # its upstream cursor: the head
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the first relay at the head")  # type: ignore[union-attr]
        relay.stop(0)
        release.servers.remove(relay.server)
        relay = None
        release.change(lambda st: replace(st, release_step=20, held=True))
        release.change(lambda st: ro.canary(st, "can-*"))
        relay = start(tmp_path / "relay")  # a fresh spool, the same consumer name upstream
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay at the head")  # type: ignore[union-attr]
        snap = relay.server.log.snapshot()
        assert snap is not None and [e.step for e in snap.entries] == entries
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
        # a predictor there is told why (review 9: "nothing published yet" on an empty one)
        with predictor("new-3", [relay.endpoint]) as c:
            r = c.pull()
            assert "not heard from the upstream yet" in r.missing.get(0, ""), r.missing
        from deltad.commands import status

        st, consumers = status.fetch(relay.endpoint)
        assert "not heard from the upstream yet" in "\n".join(status.rollout_lines(st))
        rows = [ln.split() for ln in status.render(st, consumers).splitlines()]
        caps = [r[-1] for r in rows if r and r[0] in ("new-1", "new-2", "new-3")]
        assert caps and set(caps) == {"-"}, caps  # (not "head": it serves nobody)
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)


@pytest.mark.slow  # (waits out a keepalive / a reconnect: 10-25 s)
def test_a_relay_that_lost_its_upstream_says_so_to_predictors_status_and_metrics(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 5 (stop 34) #1, #2: with its upstream gone, a relay kept saying nothing: its
    predictors reported caught up on an old model and no probe or metric showed it. Now,
    once mirroring has failed for LOST_AFTER_S, every window's header and its Status say so
    (PullResult.upstream_lost: not caught up; `deltad status`: LOST), and /metrics has the
    relay's own series (upstream up, contact age, lost, mirror lag, pulls, errors, bytes).
    Readiness stays SERVING (it still serves its log). The upstream back, all clears."""
    import urllib.request

    from deltad.commands import status
    from deltad.commands.healthcheck import check
    from deltad.serve.relay import mirror

    monkeypatch.setattr(mirror, "LOST_AFTER_S", 0.5)

    def metric(port: int, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        for line in text.decode().splitlines():
            if line.startswith((name + "{", name + " ")):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    ft = _trained(tmp_path)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    port = srv.port
    relay: RelayServer | None = None
    try:
        cfg = server_config(tmp_path / "relay", db(redis_url, 1), grace_period_s=0.2)
        cfg.metrics_port = 0
        relay = RelayServer(
            cfg,
            RelayConfig(upstream=srv.endpoint, consumer="relay", poll_interval_s=0.02,
                        fsync=False, backoff_initial_s=0.05, backoff_max_s=0.2),
        ).start()  # fmt: skip
        mp = relay.server.metrics_port
        assert mp is not None
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay at the head")  # type: ignore[union-attr]
        with predictor("p", [relay.endpoint]) as c:
            a = TensorDictApplier()
            r = c.sync(a.apply)
            assert r.caught_up and not r.upstream_lost and equal(a, ft.history[40])
            assert metric(mp, "deltad_upstream_up") == 1 and metric(mp, "deltad_upstream_lost") == 0
            assert metric(mp, "deltad_mirror_lag_segments") == 0
            assert metric(mp, "deltad_mirror_pulls_total") >= 1
            assert metric(mp, "deltad_mirror_bytes_total") > 0
            srv.stop(0)  # the upstream is gone
            wait_for(lambda: metric(mp, "deltad_upstream_lost") == 1, 30, "the relay lost it")
            r = c.sync(a.apply)
            assert not r.caught_up and set(r.upstream_lost) == {0}, r
            assert "relay lost its upstream" in r.upstream_lost[0]
            assert metric(mp, "deltad_upstream_up") == 0
            assert metric(mp, "deltad_mirror_errors_total") >= 1
            assert metric(mp, "deltad_upstream_contact_age_seconds") > 0.5
            st, consumers = status.fetch(relay.endpoint)
            assert "relay lost its upstream" in st.upstream_lost
            assert "LOST:" in status.render(st, consumers)
            assert check(relay.endpoint) == "SERVING"  # it still serves what it has
            # the upstream comes back on its port
            back = SidecarServer(
                server_config(tmp_path / "spool", redis_url, listen=f"127.0.0.1:{port}")
            ).start()
            try:
                wait_for(lambda: metric(mp, "deltad_upstream_lost") == 0, 30, "the relay back")
                ft.step(50, touch=25)
                wait_for(lambda: at_step([relay.endpoint], 50), 30, "the relay at 50")  # type: ignore[union-attr]
                r = c.sync(a.apply)
                assert r.caught_up and not r.upstream_lost and equal(a, ft.history[50])
            finally:
                back.stop(0)
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)


def test_a_relay_below_one_that_lost_its_upstream_says_so_too(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar goes; the level-1 relay stays up and loses it. The level-2 relay still
    reaches level 1, yet its predictors must not look caught up: it passes level 1's word on
    (woken by level 1's long poll: within a second, not after the whole wait)."""
    from test_relay import start_relay

    from deltad.serve.relay import mirror

    monkeypatch.setattr(mirror, "LOST_AFTER_S", 0.5)
    _trained(tmp_path)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relays: list[RelayServer] = []
    try:
        relays.append(start_relay(srv.endpoint, tmp_path / "r1", 0, db(redis_url, 1)))
        relays.append(start_relay(relays[0].endpoint, tmp_path / "r2", 0, db(redis_url, 2)))
        wait_for(lambda: at_step([relays[1].endpoint], 40), 30, "level 2 at the head")
        with predictor("p", [relays[1].endpoint]) as c:
            a = TensorDictApplier()
            assert c.sync(a.apply).caught_up
            srv.stop(0)
            wait_for(lambda: c.sync(a.apply).upstream_lost != {}, 5, "level 2 passes it on")
            r = c.sync(a.apply)
            assert not r.caught_up
            why = r.upstream_lost[0]
            assert f"upstream {relays[0].endpoint}: relay lost its upstream {srv.endpoint}" in why
    finally:
        for x in reversed(relays):
            x.stop(0)
        srv.stop(0)


def test_a_relay_started_during_a_hold_at_an_unpublished_step_reaches_the_head(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 6 (stop 34) #1: held at step 25 (steps 10..40 published every 10: the state of
    25 is step 20's), a fresh relay asked its upstream for max_step 25 again and again, got
    an empty window at 20 each time, and never passed it (381 pulls in 3 s). Its stops are
    the upstream's own entries now: it mirrors 20, then the head, and a new predictor is
    served exactly step 20."""
    ft = _trained(tmp_path)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None
    try:
        wait_for(lambda: at_step([srv.endpoint], 40), 30, "the head")
        release.change(lambda st: replace(st, release_step=25, held=True))
        relay = relay_of(srv.endpoint, tmp_path / "relay", 0, redis_url, release, window=0)
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay at the head")  # type: ignore[union-attr]
        snap = relay.server.log.snapshot()
        assert snap is not None and [e.step for e in snap.entries] == [20, 40]
        assert relay.mirror is not None and relay.mirror.pulls <= 4, relay.mirror.pulls
        with predictor("new-1", [relay.endpoint]) as c:
            a = TensorDictApplier()
            assert c.sync(a.apply).step == 20 and equal(a, ft.history[20])
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)


@pytest.mark.slow  # (waits out a keepalive / a reconnect: 10-25 s)
def test_a_relay_whose_upstream_goes_silent_says_it_lost_it(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 6 (stop 34) #5: through a link that goes silent (a partition: no FIN, no RST),
    the relay's long poll hangs; its channel's keepalive ping goes unanswered within about
    10-20 s (deltad.channels), the round fails, and after LOST_AFTER_S the relay says it
    lost its upstream, well before a call's own deadline (300 s for a pull's message). A new
    connection gets through: it clears."""
    from bench.netproxy import DroppingProxy
    from deltad.serve.relay import mirror

    monkeypatch.setattr(mirror, "LOST_AFTER_S", 0.5)
    _trained(tmp_path)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None
    try:
        with DroppingProxy(srv.endpoint, drop_after=1 << 40, drops=0) as link:
            cfg = server_config(tmp_path / "relay", db(redis_url, 1), grace_period_s=0.2)
            relay = RelayServer(
                cfg,
                RelayConfig(upstream=link.endpoint, consumer="relay", poll_interval_s=0.02,
                            long_poll_s=5.0, fsync=False, backoff_initial_s=0.05,
                            backoff_max_s=0.2),
            ).start()  # fmt: skip
            m = relay.mirror
            assert m is not None
            wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay at the head")  # type: ignore[union-attr]
            assert m.lost() == ""
            assert link.blackhole() >= 1
            started = time.monotonic()
            wait_for(lambda: m.lost() != "", 40, "the relay says it lost it")
            assert time.monotonic() - started < 25.0
            assert "relay lost its upstream" in m.lost()
            wait_for(lambda: m.lost() == "", 60, "the relay reconnected")
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)


def test_a_relay_below_a_gate_hold_waits_instead_of_pulling_in_a_loop(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 8 (stop 34) #2: the sidecar's gate holds at step 20 (NaN at 30); the relay's
    mirror pulls came back empty, short of the upstream's head, and it pulled again at once:
    hundreds of pulls a second, reported nowhere. It now waits for the head or the release
    state to move: a release past the gate (--force) takes it on at once."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    ft.step(10, touch=25)
    ft.step(20, touch=25)
    ft.step(30, touch=25, poison=float("nan"))
    ft.step(40, touch=25)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None
    try:
        wait_for(lambda: srv.rollout.state().gate_bad_step == 30, 30, "the gate holds")
        relay = relay_of(srv.endpoint, tmp_path / "relay", 0, redis_url, release, window=0)
        wait_for(lambda: at_step([relay.endpoint], 20), 30, "the relay at the last good step")  # type: ignore[union-attr]
        m = relay.mirror
        assert m is not None
        time.sleep(0.5)
        before = m.pulls
        time.sleep(2.0)
        assert m.pulls - before <= 2, m.pulls - before
        release.change(
            lambda st: ro.release(st, None, head_step=40, generation=ft.generation, force=True)
        )
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay past the gate")  # type: ignore[union-attr]
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)


def test_a_relay_whose_upstream_lost_its_cursor_keeps_its_log(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 9 (stop 34) #2: a relay whose upstream lost its cursor (a relay above it
    restarted on a fresh spool, with a fresh Redis) got the full tables and replaced its log
    with a base at the head: held steps and restore points gone, held predictors resynced
    past the hold. It now puts the full tables in as one segment after its head: its log
    keeps what it held, and a predictor held at 20 is still served 20."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    release = Release(redis_url)
    srv = _sidecar(tmp_path, redis_url, release)
    relay: RelayServer | None = None
    try:
        relay = relay_of(srv.endpoint, tmp_path / "relay", 0, redis_url, release, window=0)
        for step in (10, 20, 30):
            ft.step(step, touch=25)
            wait_for(lambda s=step: at_step([relay.endpoint], s), 30, f"the relay at {step}")  # type: ignore[misc,union-attr]
        release.change(lambda st: replace(st, release_step=20, held=True))
        snap = relay.server.log.snapshot()
        assert snap is not None
        before = [e.step for e in snap.entries]
        assert 20 in before
        assert srv.store.forget("relay", 1)  # the upstream loses the relay's cursor
        ft.step(40, touch=25)
        wait_for(lambda: at_step([relay.endpoint], 40), 30, "the relay at 40")  # type: ignore[union-attr]
        snap = relay.server.log.snapshot()
        assert snap is not None and [e.step for e in snap.entries] == [*before, 40]
        with predictor("new-1", [relay.endpoint]) as c:
            a = TensorDictApplier()
            assert c.sync(a.apply).step == 20 and equal(a, ft.history[20])
            release.change(lambda st: replace(st, release_step=None, held=False))
            assert c.sync(a.apply).step == 40 and equal(a, ft.history[40])
    finally:
        if relay is not None:
            relay.stop(0)
        srv.stop(0)
