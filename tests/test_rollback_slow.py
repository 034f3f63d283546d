"""Rollback end to end with the reference trainer (2 gloo ranks, mixed sharding, dense states):
predictors past step S roll back to it and end bit-exact with the trainer's own dump at S (float
tables; a serving model quantized by torchrec, with packed rows, dense weights and forward); and
kill -9 of a predictor or of a sidecar in the middle of a rollback loses nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deltad.reference.trainer.train import TrainConfig, run_training
from spoolkit import child_env, read_serving_line, stop_process, wait_for
from test_quant_serving import (
    DIM,
    SEQ_ROWS,
    TABLES,
    assert_bit_exact,
    serving_predictor,
    sync,
)
from test_rollback import Release

from deltad.config import ConsumerConfig, PullOptions, ServerConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.consume.quant import packed_wire_dtype
from deltad.serve.edge.app import SidecarServer
from deltad.serve.rollout import ReleaseState, Rollback
from deltad.types import Form, ServeDtype

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

SHARDING = {"t0": "cw", "t1": "rw", "seq": "rw"}
STEPS, DUMP = 16, 8


def train(tmp_path: Path, **kw: object) -> None:
    cfg = TrainConfig(
        spool_dir=tmp_path / "spool", model="m", world_size=2, tables=TABLES, seq_rows=SEQ_ROWS,
        dim=DIM, sharding=SHARDING, steps=STEPS, publish_every_steps=2, batch_size=32,
        final_model=tmp_path / "final.pt", seed=3, progress=False, fsync=False,
        dump_steps=(DUMP,), dump_dir=tmp_path / "dumps", **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    assert run_training(cfg).steps == STEPS


def test_predictors_roll_back_bit_exact_to_the_trainers_dump(
    tmp_path: Path, redis_url: str
) -> None:
    """A float predictor and an int8 serving predictor (packed rows) at the trainer's last
    step roll back to step 8: tables, quantized weights, dense weights and forward output
    equal the trainer's dump at step 8 (quantized by torchrec); in place, no resync."""
    train(tmp_path)
    release = Release()
    servers = [
        SidecarServer(
            ServerConfig(
                spool_dir=tmp_path / "spool", model="m", rank=r, listen="127.0.0.1:0",
                redis_url=redis_url, poll_interval_s=0.02, grace_period_s=0.5,
                restore_window_steps=100, merge_min_segments=2, retention_interval_s=0.05,
            )
        ).start()  # fmt: skip
        for r in range(2)
    ]
    try:
        for s in servers:
            s.set_release(release)
        dtype = ServeDtype.INT8
        pred = serving_predictor(
            "q", servers, dtype, Form.ROWS, 0, packed_wire_dtype(dtype)
        )
        floats = ConsumerConfig(
            consumer="f", model="m", sidecars=tuple(s.endpoint for s in servers),
            pull=PullOptions(dense=True),
        )  # fmt: skip
        with DeltaConsumer(pred.config.consumer) as qc, DeltaConsumer(floats) as fc:
            n = sync(pred, qc, STEPS)
            assert_bit_exact(pred, dtype, tmp_path / "final.pt")
            applier = TensorDictApplier()
            assert fc.sync(applier.apply).step == STEPS
            # retention ran meanwhile: the restore window kept step 8 restorable
            for s in servers:
                snap = s.log.snapshot()
                assert snap is not None and DUMP in [e.step for e in snap.entries]
            release.rollback(DUMP)
            rec = pred.pull_once(qc, n + 1)
            assert rec.step == DUMP and not rec.resync
            dumped = tmp_path / "dumps" / f"model-step-{DUMP}.pt"
            assert_bit_exact(pred, dtype, dumped)
            r = fc.sync(applier.apply)
            assert r.step == DUMP and r.rollback_to == DUMP and not r.resync
            assert r.dense_step == DUMP and r.dense  # the dense state at 8 came with it
            tables = torch.load(tmp_path / "dumps" / f"tables-step-{DUMP}.pt", weights_only=True)
            got = applier.tables()
            for name, t in tables.items():
                assert torch.equal(got[name], t), name
            model = torch.load(dumped, weights_only=True)
            shared = [n for n in r.dense if n in model]  # (non-persistent buffers aside)
            assert any(n.startswith("over.") for n in shared)
            for name in shared:
                assert torch.equal(r.dense[name], model[name]), name
    finally:
        for s in servers:
            s.stop(0.5)


def _serve(spool: Path, rank: int, redis_url: str, state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "deltad.cli", "serve", "--spool", str(spool), "--model", "m",
            "--rank", str(rank), "--listen", "127.0.0.1:0", "--redis-url", redis_url,
            "--restore-window-steps", "100", "--release-state-file", str(state),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        start_new_session=True,
    )  # fmt: skip


def test_kill_9_of_a_sidecar_and_of_a_predictor_in_a_rollback_loses_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    """`deltad serve` subprocesses (2 ranks) reading the release state from a file, and a
    `deltad consume` predictor: rollback to step 8 ordered; the predictor is killed -9 right
    after its rollback pull began, and so is the sidecar of rank 1; both restart; the
    predictor (from its saved tables, --resume) ends at step 8 bit-equal to the trainer's dump
    there, its cursors at 8 on both ranks."""
    train(tmp_path)
    state = tmp_path / "release.json"
    state.write_text(ReleaseState().to_json())
    procs = [_serve(tmp_path / "spool", r, redis_url, state) for r in range(2)]
    pred: subprocess.Popen[str] | None = None
    try:
        eps = [read_serving_line(p, 60) for p in procs]
        saved = tmp_path / "tables.pt"

        def consume(*extra: str) -> subprocess.Popen[str]:
            args = [sys.executable, "-m", "deltad.cli", "consume", "--consumer", "p",
                    "--model", "m", "--interval", "0.05", "--final-tables", str(saved)]  # fmt: skip
            for e in eps:
                args += ["--sidecar", e]
            return subprocess.Popen(
                [*args, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=child_env(), start_new_session=True,
            )  # fmt: skip

        # 1. the predictor follows to the head, saves its tables, stops
        pred = consume("--max-pulls", "3")
        assert pred.wait(120) == 0, pred.stdout.read() if pred.stdout else ""
        pred = None
        # 2. the order; a predictor resumes and is killed -9 in its rollback pull
        order = ReleaseState(release_step=DUMP, held=True, rollback=Rollback(DUMP, "*", 1))
        state.write_text(order.to_json())
        pred = consume("--resume", "--init-tables", str(saved))
        wait_for(lambda: _line_with(pred, "pull"), 60, "the predictor pulling")  # type: ignore[arg-type]
        os.killpg(pred.pid, signal.SIGKILL)
        pred.wait(10)
        pred = None
        # 3. the sidecar of rank 1 dies too, and comes back
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(10)
        procs[1] = _serve(tmp_path / "spool", 1, redis_url, state)
        eps[1] = read_serving_line(procs[1], 60)
        # 4. the predictor restarts from its saved tables: it ends at step 8, exactly
        pred = consume("--resume", "--init-tables", str(saved), "--max-pulls", "3")
        assert pred.wait(120) == 0, pred.stdout.read() if pred.stdout else ""
        got = torch.load(saved, weights_only=True)
        want = torch.load(tmp_path / "dumps" / f"tables-step-{DUMP}.pt", weights_only=True)
        for name, t in want.items():
            assert torch.equal(got[name], t), name
    finally:
        if pred is not None:
            stop_process(pred)
        for p in procs:
            stop_process(p)


def _line_with(proc: subprocess.Popen[str], word: str) -> bool:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return word in line or (line.startswith("{") and word in json.loads(line))
