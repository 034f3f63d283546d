"""Relays end to end: the reference trainer through two relay levels, and a relay process
killed with SIGKILL while rows stream through it. Real processes, Redis and gRPC."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from spoolkit import FakeTrainer, child_env, read_serving_line, stop_process
from test_relay import db, equal, predictor, start_relay, status, tree

from deltad.consume.appliers import TensorDictApplier
from deltad.errors import DeltadError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _follow(c: object, applier: TensorDictApplier, stop: threading.Event) -> threading.Thread:
    """A predictor loop: sync every 20 ms until ``stop`` (a rank that is down only waits)."""

    def run() -> None:
        while not stop.is_set():
            try:
                c.sync(applier.apply)  # type: ignore[attr-defined]
            except DeltadError:
                pass
            stop.wait(0.02)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_reference_trainer_through_two_relay_levels_is_bit_equal(
    tmp_path: Path, redis_url: str
) -> None:
    """trainer (2 gloo ranks, mixed sharding) -> sidecar -> relay -> relay -> predictor,
    while it trains; the predictor ends with the trainer's final tables, bit for bit."""
    final = tmp_path / "final.pt"
    train = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "train", "--spool", str(tmp_path / "spool"),
         "--model", "m", "--world-size", "2", "--tables", "3", "--rows", "400", "--dim", "8",
         "--steps", "40", "--publish-every-steps", "2", "--generation", "3", "--no-progress",
         "--final-tables", str(final)],
        env={**child_env(), "TMPDIR": str(tmp_path)}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    stop = threading.Event()
    try:
        with tree(tmp_path, redis_url, 2, 2) as levels, predictor("p", levels[2]) as c:
            applier = TensorDictApplier()
            follower = _follow(c, applier, stop)
            assert train.wait(300) == 0, train.stderr.read().decode() if train.stderr else ""
            truth = torch.load(final, weights_only=True)
            deadline = time.monotonic() + 60
            while not equal(applier, truth) and time.monotonic() < deadline:
                time.sleep(0.1)
            stop.set()
            follower.join(30)
            assert equal(applier, truth)
            heads = [status(e) for lv in levels for e in lv]
            assert len({(s.generation, s.head_seq, s.head_step) for s in heads[0::2]}) == 1
            assert heads[-1].upstream == levels[1][1] and heads[0].upstream == ""
    finally:
        stop.set()
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
            train.wait(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _relay_process(spool: Path, upstream: str, port: int) -> subprocess.Popen[str]:
    """`deltad serve --upstream` with its embedded Redis (append-only, fsync always)."""
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(spool), "--model", "m",
         "--rank", "0", "--listen", f"127.0.0.1:{port}", "--upstream", upstream,
         "--upstream-consumer", "killed", "--poll-interval", "0.02", "--grace-period", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        start_new_session=True,
    )  # fmt: skip


def test_kill_9_of_a_relay_mid_stream_loses_nothing_downstream(
    tmp_path: Path, redis_url: str
) -> None:
    """sidecar -> relay (a process, SIGKILLed 4 times while the trainer publishes) -> relay
    -> predictors on both relays: both end with the trainer's final tables."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables={"t0": (3000, 16), "t1": (800, 8)})
    ft.start(0)
    rng = random.Random(7)
    port = _free_port()
    with tree(tmp_path, redis_url, 1, 0) as levels:
        proc = _relay_process(tmp_path / "killed", levels[0][0], port)
        killed = read_serving_line(proc, 60)
        below = start_relay(killed, tmp_path / "below", 0, db(redis_url, 1), consumer="below")
        stop = threading.Event()
        try:
            with predictor("direct", [killed]) as c1, predictor("via", [below.endpoint]) as c2:
                a1, a2 = TensorDictApplier(), TensorDictApplier()
                followers = [_follow(c1, a1, stop), _follow(c2, a2, stop)]
                step = 0

                def publish(seconds: float) -> None:
                    nonlocal step
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        step += 10
                        ft.step(step, touch=200)
                        time.sleep(0.03)

                for _ in range(4):
                    publish(rng.uniform(0.3, 1.0))
                    os.killpg(proc.pid, signal.SIGKILL)  # mid-stream: rows keep coming
                    proc.wait(30)
                    if proc.stdout is not None:
                        proc.stdout.close()
                    publish(rng.uniform(0.1, 0.4))
                    proc = _relay_process(tmp_path / "killed", levels[0][0], port)
                    read_serving_line(proc, 60)
                publish(0.5)
                truth = ft.history[step]
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and not (equal(a1, truth) and equal(a2, truth)):
                    time.sleep(0.1)
                stop.set()
                for f in followers:
                    f.join(30)
                assert equal(a1, truth) and equal(a2, truth)
                assert status(killed).head_step == step == status(below.endpoint).head_step
        finally:
            stop.set()
            below.stop(0.2)
            stop_process(proc)
