"""Serving predictors behind one and two relay levels end bit-equal to the real trainer's final
model quantized by torchrec (every table, every dense tensor, the forward output), and stay so
across a trainer restart (a new generation, which reaches them as a generation diff through
the relays). Real 2-rank gloo trainer, real sidecars, relays, Redis and gRPC."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from deltad.reference.consumers.predictor import SyncLoop
from spoolkit import wait_for
from test_quant_serving import (
    assert_bit_exact,
    serving_predictor,
    sidecars,
    sync,
    train_while_pulling,
)
from test_relay import db, start_relay, status

from deltad.consume.client import DeltaConsumer
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.types import Form, ServeDtype

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

WORLD = 2
SHARDING = {"t0": "cw", "t1": "rw", "seq": "tw"}


@contextlib.contextmanager
def relays(
    tmp_path: Path, redis_url: str, upstream: list[SidecarServer | RelayServer], level: int
) -> Iterator[list[RelayServer]]:
    """One relay per rank of ``upstream`` (its own spool and Redis keyspace)."""
    out: list[RelayServer] = []
    try:
        for rank, up in enumerate(upstream):
            spool = tmp_path / f"relay-{level}-{rank}"
            out.append(start_relay(up.endpoint, spool, rank, db(redis_url, level * 4 + rank)))
        yield out
    finally:
        for r in out:
            r.stop(0.5)


def test_serving_predictors_behind_one_and_two_relay_levels_are_bit_equal_across_a_restart(
    tmp_path: Path, redis_url: str
) -> None:
    with (
        sidecars(tmp_path / "spool", redis_url, WORLD) as side,
        relays(tmp_path, redis_url, list(side), 1) as one,
        relays(tmp_path, redis_url, list(one), 2) as two,
    ):
        preds: dict[str, SyncLoop] = {
            "one": serving_predictor("q-one", one, ServeDtype.INT8, Form.ROWS),  # type: ignore[arg-type]
            "two": serving_predictor("q-two", two, ServeDtype.INT8, Form.ROWS),  # type: ignore[arg-type]
        }
        consumers = {n: DeltaConsumer(p.config.consumer) for n, p in preds.items()}
        pulls = dict.fromkeys(preds, 0)
        try:
            for c in consumers.values():
                c.connect()
            for p in preds.values():
                assert p.forwards is not None
                p.forwards.start()
            top = [r.endpoint for r in two]
            for seed in (0, 1):  # then the trainer restarts: a new generation
                step = train_while_pulling(tmp_path, WORLD, seed, SHARDING, preds, consumers, pulls)
                wait_for(
                    lambda s=step: all(status(e).head_step == s for e in top),  # type: ignore[misc]
                    60,
                    f"relays at step {step}",
                )
                for n, p in preds.items():
                    pulls[n] = sync(p, consumers[n], step, pulls[n])
                    last = p.records[-1]
                    assert last.step == step and last.dense_missing == {}
                    assert_bit_exact(p, ServeDtype.INT8, tmp_path / "final.pt")
            for p in preds.values():
                recs = p.records
                assert sum(r.dense_bytes for r in recs) > 0  # dense states came through
                assert not any(r.dense_missing for r in recs)
                # the restart reached them as the rows that differ, through the relays
                assert any(r.generation_diff for r in recs), p.config.consumer.consumer
                assert p.forwards is not None and p.forwards.error is None
            # every relay level holds dense files (rank 0 only) under the upstream's seqs
            for lv in (one, two):
                st = status(lv[0].endpoint)
                assert len(st.dense_steps) > 0 and st.dense_steps[-1] == st.head_step
                assert list(status(lv[1].endpoint).dense_steps) == []
        finally:
            for p in preds.values():
                if p.forwards is not None:
                    p.forwards.stop()
            for c in consumers.values():
                c.close()
