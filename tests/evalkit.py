"""Shared pieces of the evaluator tests: a reference trainer subprocess with held-out
examples, sidecars with a norm gate, an in-process evaluator, predictor loops."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spoolkit import child_env
from test_relay import server_config

from deltad.clientauth import ClientAuth
from deltad.config import ConsumerConfig, GateConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer, PullResult
from deltad.errors import DeltadError
from deltad.evaluate.control import RolloutClient
from deltad.evaluate.evaluator import CanaryEvaluator, EvalConfig
from deltad.evaluate.labelled import read_examples
from deltad.evaluate.record import VerdictStore
from deltad.evaluate.scoring import ClickModelScorer, reference_model
from deltad.evaluate.verdict import Thresholds
from deltad.serve.edge.app import SidecarServer
from deltad.store.client import connect

#: the model every evaluator test trains: 3 pooled tables of 400 rows, dim 8, no zch table
TABLES = {"t0": 400, "t1": 400, "t2": 400}
SHAPE = ["--tables", "3", "--rows", "400", "--dim", "8", "--zch-slots", "0"]
#: a gate a healthy run of that model passes (the corruptions must pass it too)
GATE = GateConfig(max_norm_jump=(("*", 2.0),), max_changed_fraction=(("*", 1.0),))


#: The trainer's pace (``--step-interval``): an online trainer's is its stream's. Unpaced, this
#: small model runs tens of steps a second on a quiet machine, and the evaluator (a verdict
#: every ~0.3-1 s on 2 loaded cores) may score none of the corrupt steps before the model
#: trains past them.
STEP_INTERVAL_S = 0.4


def trainer(tmp: Path, *extra: str, steps: int = 60, world: int = 2) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "train", "--spool", str(tmp / "spool"),
         "--model", "m", "--world-size", str(world), *SHAPE, "--steps", str(steps),
         "--step-interval", str(STEP_INTERVAL_S),
         "--publish-every-steps", "1", "--no-progress", "--holdout-dir", str(tmp / "hold"),
         *extra],
        env={**child_env(), "TMPDIR": str(tmp)}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def golden(tmp: Path) -> Path:
    """The golden set the trainer's ``--golden-out`` writes (its function), 1024 examples."""
    from deltad.reference.trainer.holdout import golden_examples

    from deltad.evaluate.labelled import write_examples

    path = tmp / "golden.jsonl"
    write_examples(path, golden_examples(TABLES, 400, 1024))
    return path


def kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)


@contextlib.contextmanager
def sidecars(tmp: Path, redis_url: str, world: int = 2) -> Iterator[list[str]]:
    servers = []
    try:
        for r in range(world):
            cfg = dataclasses.replace(server_config(tmp / "spool", r, redis_url), gate=GATE)
            servers.append(SidecarServer(cfg).start())
        yield [s.endpoint for s in servers]
    finally:
        for s in reversed(servers):
            s.stop(0.2)


def evaluator(
    tmp: Path, redis_url: str, eps: list[str], name: str = "eval-m", **kw: object
) -> CanaryEvaluator:
    consumer = ConsumerConfig(
        consumer=name, model="m", sidecars=tuple(eps), rpc_deadline_s=10.0, max_retries=3,
        backoff_initial_s=0.05, heartbeat_interval_s=0.5,
    )  # fmt: skip
    th = Thresholds(eps=0.05, delta=0.3, min_examples=512)
    cfg = EvalConfig(
        consumer=consumer, thresholds=th, labelled_dir=tmp / "hold", progressive_examples=512,
        poll_s=0.3, release_delay_s=1.0, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return CanaryEvaluator(
        cfg,
        make_model=lambda: reference_model(TABLES, 400, dim=8, zch_slots=0),
        scorer=ClickModelScorer(list(TABLES), zch=False),
        golden=read_examples(tmp / "golden.jsonl"),
        control=RolloutClient(list(eps), ClientAuth()),
        store=VerdictStore(connect(redis_url), "m"),
    )


class Follower:
    """A predictor loop: sync every 20 ms until stopped; keeps every pull's step."""

    def __init__(self, c: DeltaConsumer, applier: Any = None) -> None:
        self.c = c
        self.applier = applier if applier is not None else TensorDictApplier()
        self.results: list[PullResult] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = self.c.sync(self.applier)
                if r.step is not None:
                    self.results.append(r)
            except DeltadError:
                pass
            self.stop.wait(0.02)

    @property
    def steps(self) -> set[int]:
        return {r.step for r in self.results if r.step is not None}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
