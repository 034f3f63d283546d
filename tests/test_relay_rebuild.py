"""A relay that restarts on an empty spool rebuilds its log from its upstream while its
predictors keep their cursors (issue 40 item 3). Seen before: during a hold at step 24, a relay
restarted empty answered a predictor already at step 24 with a resync at step 20, the oldest
step of its restore window, while it re-copied its log, and the predictor served step 20. The
rule: a server never answers a consumer with a state older than the one its cursor says it
holds; until its log reaches that state, the consumer gets nothing new. (Here the predictor
pulled while the rebuilding relay stood at step 23 in 2 of 3 runs; when the rebuild is faster
than a pull, the check is only that it follows on without a resync.)"""

from __future__ import annotations

import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from spoolkit import FakeTrainer, wait_for
from test_relay import db, predictor, server_config, status
from test_rollout import A, rollout, settle, sync_to

from deltad.config import RelayConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer

pytestmark = pytest.mark.timeout(180)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _relay(upstream: str, spool: Path, redis_url: str, listen: str) -> RelayServer:
    cfg = replace(
        server_config(spool, 0, redis_url), listen=listen, restore_window_steps=12
    )  # a restore window from step 18: the mirror rebuilds from there, one step at a time
    return RelayServer(
        cfg,
        RelayConfig(upstream=upstream, consumer="relay", poll_interval_s=0.02, fsync=False,
                    backoff_initial_s=0.05, backoff_max_s=0.5),
    ).start()  # fmt: skip


def _equal(a: TensorDictApplier, truth: dict[str, torch.Tensor]) -> bool:
    held = a.tables()
    return held.keys() == truth.keys() and all(torch.equal(held[n], truth[n]) for n in truth)


def test_a_relay_restarted_empty_during_a_hold_never_sends_its_predictor_back(
    tmp_path: Path, redis_url: str
) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    for s in range(1, 25):
        ft.step(s)
    side = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    listen = f"127.0.0.1:{_port()}"
    relay_db = db(redis_url, 1)
    relay = _relay(side.endpoint, tmp_path / "relay", relay_db, listen)
    try:
        wait_for(lambda: status(listen).head_step == 24, 30, "the relay at step 24")
        st = rollout(side.endpoint, A.ROLLOUT_HOLD)  # the fleet held at step 24
        settle([side.endpoint, listen], st.version)
        with predictor("p", [listen]) as c:
            a = TensorDictApplier()
            sync_to(c, a, 24)
            for s in range(25, 31):  # the trainer goes on; the fleet stays at 24
                ft.step(s)
            wait_for(lambda: status(side.endpoint).head_step == 30, 30, "the sidecar at 30")
            relay.stop(0.2)
            shutil.rmtree(tmp_path / "relay")  # a new node: the relay's spool is gone
            relay = _relay(side.endpoint, tmp_path / "relay", relay_db, listen)
            seen: list[tuple[int | None, bool, int]] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # bounded: the relay rebuilds meanwhile
                r = c.sync(a.apply)
                seen.append((r.step, r.resync, status(listen).head_step))
                assert r.step in (None, 24), seen  # never older than what it holds
                assert _equal(a, ft.history[24]), seen
                if status(listen).head_step == 30 and len(seen) > 20:
                    break
                time.sleep(0.05)
            assert status(listen).head_step == 30, "the relay did not rebuild its log"
            # released: on to the head, from its cursor (no full resync)
            st = rollout(side.endpoint, A.ROLLOUT_RELEASE)
            settle([side.endpoint, listen], st.version)
            r = sync_to(c, a, 30)
            assert _equal(a, ft.history[30])
    finally:
        relay.stop(0.2)
        side.stop(0.2)
