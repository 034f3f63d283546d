"""A predictor and a relay are back within their retry backoff of a sidecar that was away.

gRPC's own reconnect backoff (1 s growing x1.6 to two minutes by default) made a channel that
had seen its sidecar down for a while fail every call for many seconds after the sidecar was
back (30 s after a 90 s outage, measured): the channels follow the clients' backoff now
(:mod:`deltad.channels`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, db, server_config, start_relay

from deltad.config import ConsumerConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.serve.edge.app import SidecarServer

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

#: Long enough that gRPC's default backoff would wait >= 2.6 s past it (attempts at about
#: 1, 2.6, 5.2, 9.3, 15.8 s, each wait +-20 %), short enough for the suite.
OUTAGE_S = 10.0
#: Back within this of the restart (the clients' backoff_max_s is 0.5 s).
BACK_WITHIN_S = 2.0


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
    consumer = DeltaConsumer(
        ConsumerConfig(
            consumer="p", model="m", sidecars=(endpoint,), rpc_deadline_s=5.0, max_retries=1,
            backoff_initial_s=0.05, backoff_max_s=0.5, heartbeat_interval_s=0.5,
        )
    )  # fmt: skip
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
            back = time.monotonic()
            while True:  # bounded by BACK_WITHIN_S
                r = consumer.sync(applier.apply)
                if r.step == 20:
                    break
                took = time.monotonic() - back
                assert took < BACK_WITHIN_S, f"the predictor is not back {took:.1f} s after: {r}"
                time.sleep(0.05)
            assert applier.tables()["t0"].equal(ft.history[20]["t0"])
            wait_for(lambda: at_step([relay.endpoint], 20), BACK_WITHIN_S, "the relay at step 20")
    finally:
        relay.stop(0.2)
        sidecar.stop(0.2)
