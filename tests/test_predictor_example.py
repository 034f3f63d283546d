"""The predictor example the README gives (see /work/notes/ops.md), run as written against
sidecars with their default offset store (the embedded Redis in the spool, which predictors
cannot reach): the predictor lists the sidecars, one per rank, and knows it has caught up
when ``sync()`` returns a pull with nothing missing at the newest published step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from serverkit import SpoolWriter, server_config, wait_for

from deltad import ConsumerConfig, DeltaConsumer, TensorDictApplier
from deltad.serve.edge.app import SidecarServer

pytestmark = pytest.mark.timeout(90)


def test_readme_predictor_against_the_embedded_redis_default(tmp_path: Path) -> None:
    spools = [SpoolWriter(tmp_path / "spool", rank=r, world_size=2) for r in range(2)]
    for s in spools:
        s.delta()  # step 10 on both ranks
    servers = [
        SidecarServer(server_config(tmp_path / "spool", None, rank=r)).start() for r in range(2)
    ]
    try:
        assert all(s.redis_url.startswith("unix://") for s in servers)  # embedded, private
        sidecars = tuple(s.endpoint for s in servers)
        for srv in servers:
            wait_for(lambda srv=srv: (x := srv.log.snapshot()) is not None and x.head.seq == 1)

        # --- the example ---------------------------------------------------------------
        applier = TensorDictApplier()  # or TorchRecApplier(inference_model)
        config = ConsumerConfig("ranker-pred-1", model="m", sidecars=sidecars)  # rank order
        with DeltaConsumer(config) as consumer:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                result = consumer.sync(applier.apply)  # pull every rank, apply, commit
                caught_up = not result.missing and result.step == result.head_step
                if caught_up:
                    break
                time.sleep(0.1)
            # -----------------------------------------------------------------------------
            assert caught_up and result.step == 10 and result.resync
            assert result.source_unix is not None and time.time() - result.source_unix < 30
            for t in spools[0].specs:
                want = torch.cat([s.shard(t) for s in spools])
                assert torch.equal(applier.tables()[t], want)
            # nothing new: the next sync is empty and still caught up
            again = consumer.sync(applier.apply)
            assert again.rows == 0 and not again.missing and again.step == again.head_step == 10
            # the trainer moves on one rank only: not caught up, nothing applied until both
            spools[0].delta()
            wait_for(lambda: (x := servers[0].log.snapshot()) is not None and x.head.seq == 2)
            behind = consumer.sync(applier.apply)
            assert behind.step == 10 and behind.head_step == 20
            assert behind.step != behind.head_step
    finally:
        for srv in servers:
            srv.stop(0)
