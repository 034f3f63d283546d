"""Rollback end to end with the reference trainer (2 gloo ranks, mixed sharding, dense states):
predictors past step S roll back to it and end bit-exact with the trainer's own dump at S (float
tables; a serving model quantized by torchrec, with packed rows, dense weights and forward); and
kill -9 of a predictor or of a sidecar in the middle of a rollback loses nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
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

from deltad.commands.main import main
from deltad.config import ConsumerConfig, PullOptions, ServerConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.consume.quant import packed_wire_dtype
from deltad.serve.edge.app import SidecarServer
from deltad.types import Form, ServeDtype

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

SHARDING = {"t0": "cw", "t1": "rw", "seq": "rw"}
STEPS, DUMP = 16, 8


def train(tmp_path: Path, **kw: object) -> None:
    kw.setdefault("dump_steps", (DUMP,))
    cfg = TrainConfig(
        spool_dir=tmp_path / "spool", model="m", world_size=2, tables=TABLES, seq_rows=SEQ_ROWS,
        dim=DIM, sharding=SHARDING, steps=STEPS, publish_every_steps=2, batch_size=32,
        final_model=tmp_path / "final.pt", seed=3, progress=False, fsync=False,
        dump_dir=tmp_path / "dumps", **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    assert run_training(cfg).steps == STEPS


def test_predictors_roll_back_bit_exact_to_the_trainers_dump(
    tmp_path: Path, redis_url: str
) -> None:
    """A float predictor and an int8 serving predictor (packed rows) at the trainer's last
    step roll back to step 8: tables, quantized weights, dense weights and forward output
    equal the trainer's dump at step 8 (quantized by torchrec); in place, no resync."""
    train(tmp_path)
    release = Release(redis_url)
    servers = []
    for r in range(2):
        cfg = ServerConfig(
            spool_dir=tmp_path / "spool", model="m", rank=r, listen="127.0.0.1:0",
            redis_url=redis_url, poll_interval_s=0.02, grace_period_s=0.5,
            restore_window_steps=100, merge_min_segments=2, retention_interval_s=0.05,
        )  # fmt: skip
        servers.append(SidecarServer(cfg).start())
    try:
        for s in servers:
            release.watch(s)
        dtype = ServeDtype.INT8
        pred = serving_predictor("q", servers, dtype, Form.ROWS, 0, packed_wire_dtype(dtype))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(spool: Path, rank: int, redis_url: str, port: int) -> subprocess.Popen[str]:
    """`deltad serve` on a fixed port (a restarted sidecar is found where it was)."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(spool), "--model", "m",
            "--rank", str(rank), "--listen", f"127.0.0.1:{port}", "--redis-url", redis_url,
            "--restore-window-steps", "100",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        start_new_session=True,
    )  # fmt: skip


def _consume(eps: list[str], saved: Path, log: Path, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "p", "--model", "m",
            "--interval", "0.05", "--final-tables", str(saved), "--json-log", str(log)]  # fmt: skip
    for e in eps:
        args += ["--sidecar", e]
    return subprocess.Popen(
        [*args, *extra], stdout=subprocess.DEVNULL, stderr=log.with_suffix(".err").open("a"),
        text=True,
        env=child_env(), start_new_session=True,
    )  # fmt: skip


def _steps(log: Path) -> list[tuple[int | None, int | None]]:
    """(step, rollback_to) of every pull in a predictor's JSON log so far."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("event") == "pull":
            out.append((rec["step"], rec.get("rollback_to")))
    return out


def _equal_to_dump(saved: Path, dumps: Path, step: int) -> None:
    got = torch.load(saved, weights_only=True)
    want = torch.load(dumps / f"tables-step-{step}.pt", weights_only=True)
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_kill_9_of_a_sidecar_and_of_a_predictor_in_a_rollback_loses_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    """`deltad serve` subprocesses (2 ranks) sharing one Redis, and a `deltad consume`
    predictor at the head. (1) A rollback to step 8 is ordered (`deltad rollout rollback`
    to rank 0) and the
    sidecar of rank 1 is killed -9 at once and restarted: the predictor, retrying, rolls
    back to 8 in place; its tables equal the trainer's dump at 8. (2) It resumes from those
    tables; a rollback to step 4 is ordered and the predictor is killed -9 at once; restarted
    (a new process: its model is gone, it bootstraps), it ends at step 4, equal to the dump
    at 4, with its cursors at step 4 on both ranks."""
    train(tmp_path, dump_steps=(4, DUMP))
    dumps = tmp_path / "dumps"
    ports = [_free_port(), _free_port()]
    procs = [_serve(tmp_path / "spool", r, redis_url, ports[r]) for r in range(2)]
    pred: subprocess.Popen[str] | None = None
    saved, log = tmp_path / "tables.pt", tmp_path / "pred.jsonl"
    try:
        eps = [read_serving_line(p, 60) for p in procs]
        pred = _consume(eps, saved, log)
        wait_for(lambda: (STEPS, None) in _steps(log), 60, "the predictor at the head")
        # (1) the order, and kill -9 of a sidecar in the middle of it
        assert main(["rollout", "rollback", "--to-step", str(DUMP), "--target", eps[0]]) == 0
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(10)
        procs[1] = _serve(tmp_path / "spool", 1, redis_url, ports[1])
        assert read_serving_line(procs[1], 60).endswith(f":{ports[1]}")
        wait_for(lambda: (DUMP, DUMP) in _steps(log), 120, "the predictor rolled back to 8")
        first = next(s for s in _steps(log) if s[0] == DUMP)
        assert first == (DUMP, DUMP)  # one pull took it back (then empty ones, held at 8)
        pred.send_signal(signal.SIGTERM)  # a clean stop writes its tables
        assert pred.wait(60) == 0
        pred = None
        _equal_to_dump(saved, dumps, DUMP)
        # (2) resumed; the next order, and kill -9 of the predictor in the middle of it
        log.unlink()
        pred = _consume(eps, saved, log, "--resume", "--init-tables", str(saved))
        try:
            wait_for(lambda: bool(_steps(log)), 60, "the resumed predictor pulling")
        except AssertionError:
            raise AssertionError(log.with_suffix(".err").read_text()[-3000:]) from None
        assert main(["rollout", "rollback", "--to-step", "4", "--target", eps[0]]) == 0
        os.killpg(pred.pid, signal.SIGKILL)
        pred.wait(10)
        pred = _consume(eps, saved, log, "--pulls", "3")
        assert pred.wait(120) == 0
        pred = None
        _equal_to_dump(saved, dumps, 4)
        from deltad.serve.state.offsets import OffsetStore

        store = OffsetStore.from_url(redis_url, "m")
        for rank in range(2):
            cur = store.get_cursor("p", rank)
            assert cur is not None and cur.step == 4
    finally:
        if pred is not None:
            stop_process(pred)
        for p in procs:
            stop_process(p)
