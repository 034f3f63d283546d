"""A predictor and a relay are back within seconds of a sidecar that was away or went silent.

gRPC's own reconnect backoff (1 s growing x1.6 to two minutes by default) made a channel that
had seen its sidecar down for a while fail every call for many seconds after the sidecar was
back (30 s after a 90 s outage, measured): the channels follow the clients' backoff now.
A connection whose sidecar went silent was kept until gRPC's 60 s ping timeout; it is left
within the clients' RPC deadline now, and idle ones are pinged (:mod:`deltad.channels`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, db, server_config, start_relay

from bench.netproxy import DroppingProxy
from deltad import knobs
from deltad.config import ConsumerConfig, RelayConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

#: Long enough that gRPC's default backoff would wait >= 2.6 s past it (attempts at about
#: 1, 2.6, 5.2, 9.3, 15.8 s, each wait +-20 %), short enough for the suite.
OUTAGE_S = 10.0
#: Back within this of the restart (the clients' backoff_max_s is 0.5 s).
BACK_WITHIN_S = 2.0


def _predictor(endpoint: str, rpc_deadline_s: float) -> DeltaConsumer:
    """A predictor that retries once, with a backoff of at most 0.5 s."""
    return DeltaConsumer(
        ConsumerConfig(
            consumer="p", model="m", sidecars=(endpoint,), rpc_deadline_s=rpc_deadline_s,
            max_retries=1, backoff_initial_s=0.05, backoff_max_s=0.5, heartbeat_interval_s=0.5,
        )
    )  # fmt: skip


def _idle_predictor(endpoint: str) -> DeltaConsumer:
    """A predictor that makes no call between its pulls (no heartbeats: a long lease)."""
    return DeltaConsumer(
        ConsumerConfig(
            consumer="p", model="m", sidecars=(endpoint,), heartbeat_interval_s=3600.0,
            lease_ttl_s=7200.0,
        )
    )  # fmt: skip


def _sync_until(
    consumer: DeltaConsumer, applier: TensorDictApplier, step: int, within_s: float
) -> None:
    """Sync until the predictor serves ``step``; AssertionError after ``within_s``."""
    since = time.monotonic()
    while True:  # bounded by within_s
        r = consumer.sync(applier.apply)
        if r.step == step:
            return
        took = time.monotonic() - since
        assert took < within_s, f"the predictor is not at step {step} after {took:.1f} s: {r}"
        time.sleep(0.05)


def test_a_predictor_and_a_relay_reconnect_within_their_backoff_after_an_outage(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    cfg = server_config(tmp_path / "spool", 0, redis_url)
    sidecar = SidecarServer(cfg).start()
    endpoint = sidecar.endpoint
    relay = start_relay(endpoint, tmp_path / "relay", 0, db(redis_url, 1))  # backoff <= 0.5 s
    consumer = _predictor(endpoint, rpc_deadline_s=5.0)
    applier = TensorDictApplier()
    try:
        with consumer:
            assert consumer.sync(applier.apply).step == 10
            wait_for(lambda: at_step([relay.endpoint], 10), 30, "the relay at step 10")

            sidecar.stop(0)
            down = time.monotonic()
            failed = 0
            while time.monotonic() - down < OUTAGE_S:  # bounded: the outage
                r = consumer.sync(applier.apply)
                assert r.step is None and r.missing, r
                failed += 1
                time.sleep(0.1)
            assert failed >= 5

            ft.step(20)
            cfg.listen = endpoint  # the same port
            sidecar = SidecarServer(cfg).start()
            _sync_until(consumer, applier, 20, BACK_WITHIN_S)
            assert applier.tables()["t0"].equal(ft.history[20]["t0"])
            wait_for(lambda: at_step([relay.endpoint], 20), BACK_WITHIN_S, "the relay at step 20")
    finally:
        relay.stop(0.2)
        sidecar.stop(0.2)


#: A silent connection is left within a keepalive (1 s here) and the ping timeout (the clients'
#: RPC deadline, 2 s here), plus a retry; with gRPC's defaults it was kept 60 s, or for good.
SILENT_BACK_WITHIN_S = 8.0


def test_a_sidecar_gone_silent_is_left_within_the_ping_timeout(
    tmp_path: Path, redis_url: str
) -> None:
    """The link to the sidecar goes silent (no FIN, no RST: a dead node, a partition), for
    a predictor and a relay; new connections get through. Both leave the dead connection and
    are at the next step within seconds."""
    with knobs.override(KEEPALIVE_S=1.0):  # (read when the channels are made)
        _silent_link(tmp_path, redis_url)


def _silent_link(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    sidecar = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    proxy = DroppingProxy(sidecar.endpoint, drop_after=1 << 40, drops=0).__enter__()
    relay = RelayServer(
        server_config(tmp_path / "relay", 0, db(redis_url, 1)),
        RelayConfig(upstream=proxy.endpoint, consumer="relay", poll_interval_s=0.02,
                    fsync=False, backoff_initial_s=0.05, backoff_max_s=0.5, rpc_deadline_s=2.5),
    ).start()  # fmt: skip
    consumer = _predictor(proxy.endpoint, rpc_deadline_s=2.0)
    applier = TensorDictApplier()
    try:
        with consumer:
            assert consumer.sync(applier.apply).step == 10
            wait_for(lambda: at_step([relay.endpoint], 10), 30, "the relay at step 10")
            # two connections: channels of one process with the same options share one
            assert proxy.blackhole() == 2  # the predictor's and the relay's
            ft.step(20)
            silent = time.monotonic()
            _sync_until(consumer, applier, 20, SILENT_BACK_WITHIN_S)
            assert applier.tables()["t0"].equal(ft.history[20]["t0"])
            left = SILENT_BACK_WITHIN_S - (time.monotonic() - silent)
            wait_for(lambda: at_step([relay.endpoint], 20), max(left, 0.1), "the relay at 20")
            assert proxy.silenced > 0  # the silent connections were used and went nowhere
    finally:
        relay.stop(0.2)
        proxy.__exit__(None, None, None)
        sidecar.stop(0.2)


def test_keepalive_pings_of_an_idle_predictor_are_accepted(tmp_path: Path, redis_url: str) -> None:
    """A predictor idle between pulls pings its sidecar (``knobs.KEEPALIVE_S``, 1 s here);
    the sidecar lets the pings in rather than sending it away (gRPC's server default answers
    a client pinging more often than every 5 minutes without a call with GOAWAY
    "too_many_pings" after two strikes): its one connection lives on."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    sidecar = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        with (
            knobs.override(KEEPALIVE_S=1.0),
            DroppingProxy(sidecar.endpoint, drop_after=1 << 40, drops=0) as proxy,
            _idle_predictor(proxy.endpoint) as consumer,
        ):
            assert consumer.pull().step == 0
            assert proxy.accepted == 1
            time.sleep(6.0)  # >= 5 pings without a call
            assert consumer.pull().step == 0
            assert proxy.accepted == 1, "the sidecar sent the pinging predictor away"
    finally:
        sidecar.stop(0.2)


def test_the_sidecar_closes_the_connection_of_a_predictor_gone_silent(
    tmp_path: Path, redis_url: str
) -> None:
    """A predictor's link goes silent (its node died) while it sits idle and sends no pings of
    its own: the sidecar pings it (``knobs.SERVER_KEEPALIVE_S``, 1 s here) and closes the
    connection once no answer comes (``PING_TIMEOUT_S``, 1 s here), instead of holding it for
    gRPC's default two hours."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    with knobs.override(SERVER_KEEPALIVE_S=1.0, PING_TIMEOUT_S=1.0):
        sidecar = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    try:
        with (
            knobs.override(KEEPALIVE_S=0.0, PING_TIMEOUT_S=60.0),  # the client never pings
            DroppingProxy(sidecar.endpoint, drop_after=1 << 40, drops=0) as proxy,
            _idle_predictor(proxy.endpoint) as consumer,
        ):
            assert consumer.pull().step == 0
            time.sleep(2.5)  # (the sidecar's pings of the idle connection are answered)
            assert proxy.target_closed == 0 and proxy.accepted == 1
            assert proxy.blackhole() == 1
            wait_for(lambda: proxy.target_closed == 1, 10.0, "the sidecar to close it")
    finally:
        sidecar.stop(0.2)
