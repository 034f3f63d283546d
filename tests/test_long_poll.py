"""Long-polling Status (StatusRequest.wait_ms): the call is held until the rank's head passes
the caller's, and relays use it instead of polling. Real sidecars and relays on port 0, a real
Redis; the trainer is tests/spoolkit's FakeTrainer."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, db, equal, predictor, server_config

from deltad import knobs
from deltad.config import ConfigError, RelayConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


def _status(endpoint: str, req: pb.StatusRequest, timeout: float = 30) -> pb.StatusResponse:
    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.DeltaServiceStub(ch).Status(req, timeout=timeout)


def _status_calls(server: SidecarServer) -> float:
    """Status RPCs the server has answered (its own per-RPC counter)."""
    total = 0.0
    for metric in server.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "deltad_rpc_requests_total" and s.labels.get("method") == "Status":
                total += s.value
    return total


def test_a_long_poll_answers_when_the_head_moves(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    server = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        now = _status(server.endpoint, pb.StatusRequest())
        assert not now.waited and now.head_seq == 0
        got: list[pb.StatusResponse] = []
        ask = pb.StatusRequest(after_generation=now.generation, after_seq=now.head_seq,
                               wait_ms=25_000)  # fmt: skip
        t = threading.Thread(target=lambda: got.append(_status(server.endpoint, ask)))
        t.start()
        time.sleep(0.5)
        assert not got  # held: nothing new yet
        ft.step(10)
        t.join(timeout=20)  # answered by the new head, not by the 25 s wait running out
        assert got and got[0].waited
        assert (got[0].generation, got[0].head_seq, got[0].head_step) == (1, 1, 10)
        # a head already past the caller's: answered at once, with the head
        past = _status(server.endpoint, pb.StatusRequest(after_generation=1, after_seq=0,
                                                         wait_ms=25_000), timeout=5)  # fmt: skip
        assert past.waited and past.head_seq == 1
        # a new generation is past any seq of the old one
        ask = pb.StatusRequest(after_generation=1, after_seq=1, wait_ms=25_000)
        got.clear()
        t = threading.Thread(target=lambda: got.append(_status(server.endpoint, ask)))
        t.start()
        time.sleep(0.3)
        FakeTrainer(tmp_path / "spool", world_size=1, generation=2, seed=5).start(100)
        t.join(timeout=20)
        assert got and got[0].generation == 2 and got[0].head_seq == 0
    finally:
        server.stop(0.2)


def test_a_stopping_sidecar_answers_its_long_polls_before_its_stores_close(
    tmp_path: Path, redis_url: str
) -> None:
    """Long polls held when the sidecar stops are answered at once (with what it has), and
    none is still running when stop() returns: none reads Redis or the log after the stores
    close (before, a handler went on polling the release state for up to a second, into a
    Redis that had gone)."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    server = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    got: list[pb.StatusResponse | grpc.RpcError] = []

    def poll(ask: pb.StatusRequest) -> None:
        try:
            got.append(_status(server.endpoint, ask))
        except grpc.RpcError as e:
            got.append(e)

    try:
        now = _status(server.endpoint, pb.StatusRequest())
        asks = [
            pb.StatusRequest(after_generation=now.generation, after_seq=now.head_seq,
                             wait_ms=25_000),
            pb.StatusRequest(after_generation=now.generation, after_seq=now.head_seq,
                             wait_ms=25_000, after_rollout_version=now.rollout_version),
        ]  # fmt: skip
        threads = [threading.Thread(target=poll, args=(a,)) for a in asks]
        for t in threads:
            t.start()
        wait_for(lambda: server.servicer.status.waiters == 2, 10, "two long polls held")
    finally:
        server.stop(0.5)
    assert server.servicer.status.waiters == 0
    for t in threads:
        t.join(timeout=10)
    assert len(got) == 2
    for r in got:
        assert isinstance(r, pb.StatusResponse) and r.waited, r


def test_a_long_poll_runs_out_and_respects_the_callers_deadline(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    server = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        start = time.monotonic()
        st = _status(server.endpoint, pb.StatusRequest(after_generation=1, after_seq=0,
                                                       wait_ms=1200))  # fmt: skip
        assert st.waited and st.head_seq == 0
        assert time.monotonic() - start >= 1.1  # it did wait
        # a caller's deadline shorter than its wait: answered before the deadline, not
        # DEADLINE_EXCEEDED
        st = _status(server.endpoint, pb.StatusRequest(after_generation=1, after_seq=0,
                                                       wait_ms=60_000), timeout=1.5)  # fmt: skip
        assert st.waited and st.head_seq == 0
    finally:
        server.stop(0.2)


def test_long_polls_past_the_waiter_places_answer_at_once(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    with knobs.override(STATUS_WAITERS=1):
        server = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
        try:
            ask = pb.StatusRequest(after_generation=1, after_seq=0, wait_ms=20_000)
            holder = threading.Thread(target=lambda: _status(server.endpoint, ask))
            holder.start()
            wait_for(lambda: server.servicer.status.waiters == 1, 10, "one waiter held")
            st = _status(server.endpoint, ask, timeout=5)  # no place: at once, not waited
            assert not st.waited and st.head_seq == 0
            ft.step(10)  # releases the holder
            holder.join(timeout=20)
            assert not holder.is_alive()
            wait_for(lambda: server.servicer.status.waiters == 0, 10, "the waiter's place freed")
        finally:
            server.stop(0.2)


@contextlib.contextmanager
def _sidecar_and_relay(
    tmp_path: Path, redis_url: str, **relay: Any
) -> Iterator[tuple[SidecarServer, RelayServer]]:
    side = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        cfg = server_config(tmp_path / "relay", 0, db(redis_url, 1))
        rc = RelayConfig(upstream=side.endpoint, consumer="r", fsync=False, **relay)
        r = RelayServer(cfg, rc).start()
        try:
            yield side, r
        finally:
            r.stop(0.2)
    finally:
        side.stop(0.2)


def test_a_relay_long_polls_its_upstream_instead_of_polling(tmp_path: Path, redis_url: str) -> None:
    """An idle relay makes a few Status calls (long polls), not one per 20 ms; new steps still
    reach its predictors at once, bit-equal."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    with _sidecar_and_relay(tmp_path, redis_url, poll_interval_s=0.02) as (side, relay):
        wait_for(lambda: at_step([relay.endpoint], 10), 30, "relay at step 10")
        before = _status_calls(side)
        time.sleep(2.0)
        idle_calls = _status_calls(side) - before
        assert idle_calls <= 3, idle_calls  # polling every 20 ms would be ~100 calls
        with predictor("p", [relay.endpoint]) as c:
            applier = TensorDictApplier()
            c.sync(applier.apply)
            for step in (20, 30):
                ft.step(step, touch=7)
                wait_for(lambda s=step: at_step([relay.endpoint], s), 30, f"relay at {step}")  # type: ignore[misc]
                r = c.sync(applier.apply)
                assert r.step == step and equal(applier, ft.history[step])


def test_a_relay_without_long_polls_polls(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    with _sidecar_and_relay(tmp_path, redis_url, poll_interval_s=0.05, long_poll_s=0) as (
        side,
        relay,
    ):
        wait_for(lambda: at_step([relay.endpoint], 0), 30, "relay has the base")
        before = _status_calls(side)
        time.sleep(1.0)
        assert _status_calls(side) - before >= 5  # polled every 50 ms
        ft.step(10)
        wait_for(lambda: at_step([relay.endpoint], 10), 30, "relay at step 10")


def test_relay_long_poll_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="long_poll_s"):
        RelayConfig(upstream="h:1", long_poll_s=-1)


@contextlib.contextmanager
def _sidecars(tmp_path: Path, redis_url: str, world: int) -> Iterator[list[SidecarServer]]:
    servers = [
        SidecarServer(server_config(tmp_path / "spool", r, redis_url)).start() for r in range(world)
    ]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop(0.2)


def test_a_consumer_waits_for_any_rank_to_publish(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    with (
        _sidecars(tmp_path, redis_url, 2) as servers,
        predictor("w", [s.endpoint for s in servers], dense=False) as c,
    ):
        assert c.wait_for_new(5.0)  # nothing pulled yet: a pull is due at once
        applier = TensorDictApplier()
        c.sync(applier.apply)
        start = time.monotonic()
        assert not c.wait_for_new(1.2)  # nothing new: the wait runs out
        assert time.monotonic() - start >= 1.0
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(c.wait_for_new(25.0)))
        t.start()
        time.sleep(0.5)
        assert not got
        ft.step(10, ranks=[1])  # one rank publishes: enough to wake the wait
        t.join(timeout=20)
        assert got == [True]
        ft.step(10, ranks=[0])
        wait_for(lambda: c.sync(applier.apply).step == 10, 30, "both ranks at step 10")
        assert equal(applier, ft.history[10])


def test_a_following_predictor_pulls_when_the_trainer_publishes(
    tmp_path: Path, redis_url: str
) -> None:
    """`deltad consume --long-poll`: with a 30 s interval, new steps still arrive within
    moments, because each publish answers the predictor's held Status."""
    from deltad.reference.consumers.predictor import SyncLoop, SyncLoopConfig

    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    with _sidecars(tmp_path, redis_url, 1) as servers:
        loop = SyncLoop(
            SyncLoopConfig(
                consumer=predictor("f", [servers[0].endpoint], dense=False).config,
                interval_s=30.0, long_poll_s=20.0, duration_s=100.0,
            )
        )  # fmt: skip
        t = threading.Thread(target=loop.run)
        t.start()
        try:
            wait_for(lambda: loop.served_step == 0, 30, "bootstrapped")
            for step in (10, 20, 30):
                ft.step(step)
                wait_for(lambda s=step: loop.served_step == s, 15, f"step {step} served")  # type: ignore[misc]
            assert equal(loop.applier, ft.history[30])  # type: ignore[arg-type]
        finally:
            stopped = time.monotonic()
            loop.stop()
            t.join(timeout=30)
        assert not t.is_alive()
        assert time.monotonic() - stopped < 10  # stop() ends the held wait, not its 20 s
