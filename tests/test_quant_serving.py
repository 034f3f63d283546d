"""A predictor serving a torchrec quantized model, synced from real sidecars over a real
trainer's spool, ends bit-exact with quantizing the trainer's final model (its float tables
and its dense state, which the publisher sends) with torchrec: every weight byte, the dense
parameters and buffers, and the forward output on a fixed batch."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from deltad.reference.consumers.predictor import SyncLoop, SyncLoopConfig
from deltad.reference.consumers.serving import ServingConfig, fixed_batch, serving_state
from deltad.reference.trainer.model import ClickModel
from deltad.reference.trainer.train import TrainConfig, run_training
from spoolkit import child_env, wait_for

from deltad.config import ConsumerConfig, PullOptions, ServerConfig
from deltad.consume.client import DeltaConsumer
from deltad.consume.mc import training_only_state
from deltad.consume.quant import packed_wire_dtype, quantize_model
from deltad.serve.edge.app import SidecarServer
from deltad.types import Form, ServeDtype, WireDtype

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TABLES = {"t0": 120, "t1": 90}
SEQ_ROWS = 80
DIM = 16


@contextlib.contextmanager
def sidecars(spool: Path, redis_url: str, world: int) -> Iterator[list[SidecarServer]]:
    servers: list[SidecarServer] = []
    try:
        for rank in range(world):
            cfg = ServerConfig(
                spool_dir=spool, model="m", rank=rank, listen="127.0.0.1:0",
                redis_url=redis_url, poll_interval_s=0.02, grace_period_s=0.5,
            )  # fmt: skip
            servers.append(SidecarServer(cfg).start())
        yield servers
    finally:
        for s in servers:
            s.stop(0.5)


def train(
    tmp_path: Path, world_size: int, seed: int, sharding: dict[str, str], steps: int = 6
) -> int:
    """Run the reference trainer to its end; the step of its final segment."""
    cfg = TrainConfig(
        spool_dir=tmp_path / "spool", model="m", world_size=world_size, tables=TABLES,
        seq_rows=SEQ_ROWS, dim=DIM, sharding=sharding, steps=steps, publish_every_steps=2,
        batch_size=32, final_model=tmp_path / "final.pt", seed=seed, progress=False,
        fsync=False,
    )  # fmt: skip
    return run_training(cfg).steps


def reference(dtype: ServeDtype, final: dict[str, torch.Tensor]) -> Any:
    """The trainer's final model (``--final-model``: tables and dense state) quantized by
    torchrec, in the predictor's model code (its own initial weights all overwritten)."""
    torch.manual_seed(123)
    m = ClickModel(TABLES, SEQ_ROWS, dim=DIM).eval()
    m.load_state_dict(final)  # strict: every weight is the trainer's
    return quantize_model(m, dtype)


def serving_predictor(
    name: str,
    servers: list[SidecarServer],
    dtype: ServeDtype,
    form: Form,
    k: int = 0,
    wire_dtype: WireDtype = WireDtype.FP32,
) -> SyncLoop:
    pull = PullOptions(form=form, k=k, wire_dtype=wire_dtype)
    consumer = ConsumerConfig(
        consumer=name, model="m", sidecars=tuple(s.endpoint for s in servers), pull=pull
    )
    serving = ServingConfig(
        dtype=dtype, tables=TABLES, seq_rows=SEQ_ROWS, dim=DIM, chunk_rows=16, interval_s=0.0
    )
    return SyncLoop(SyncLoopConfig(consumer=consumer, interval_s=0.0, serving=serving))


def sync(pred: SyncLoop, consumer: DeltaConsumer, step: int, start: int = 0) -> int:
    """Pull until ``pred`` serves ``step``, owes nothing and gets nothing new (bounded)."""
    for n in range(start + 1, start + 300):
        rec = pred.pull_once(consumer, n)
        if rec.step == step and rec.owed == 0 and rec.rows == 0:
            return n
    raise AssertionError(f"{pred.config.consumer.consumer} never caught up with step {step}")


def assert_bit_exact(pred: SyncLoop, dtype: ServeDtype, final_tables: Path) -> None:
    final = torch.load(final_tables, weights_only=True)
    ref = reference(dtype, final)
    assert pred.model is not None and pred.forwards is not None
    got, want = serving_state(pred.model), serving_state(ref)
    assert got.keys() == want.keys()
    for key in training_only_state(ref):  # the MCH's eviction bookkeeping is not served
        del got[key], want[key]
    assert any(k.endswith("_mch_sorted_raw_ids") for k in got)  # the zch table's remapper
    assert any(k.startswith("over.") for k in got)  # dense weights are compared too
    for key in got:
        assert torch.equal(got[key], want[key]), f"{dtype.value}: {key} differs"
    assert pred.config.serving is not None
    with torch.inference_mode():
        expected = ref(fixed_batch(pred.config.serving))[1]
    assert torch.equal(pred.forwards.output(), expected)


@pytest.mark.parametrize(
    ("world_size", "sharding", "rows_dtype", "topk_dtype", "packed"),
    [
        (1, {}, ServeDtype.INT4, ServeDtype.FP32, False),
        (2, {"t0": "cw", "t1": "rw", "seq": "cw"}, ServeDtype.FP16, ServeDtype.INT8, False),
        (2, {"t0": "cw", "t1": "tw", "seq": "rw"}, ServeDtype.INT8, ServeDtype.INT4, True),
    ],
    ids=["ws1", "ws2-cw", "ws2-packed"],
)
def test_quantized_predictors_bootstrap_and_follow_a_new_generation(
    tmp_path: Path,
    redis_url: str,
    world_size: int,
    sharding: dict[str, str],
    rows_dtype: ServeDtype,
    topk_dtype: ServeDtype,
    packed: bool,
) -> None:
    """Two serving predictors pull while a 2-rank (or 1-rank) trainer trains, then owe
    nothing: bit-exact with its final model quantized by torchrec (tables, dense, forward).
    ``packed``: they pull rows packed in their tables' layout (packed-int8 / packed-int4;
    the column-wise t0 travels as fp32 slices), the end-to-end path of a packed wire."""

    def wire(dtype: ServeDtype) -> WireDtype:
        return packed_wire_dtype(dtype) if packed else WireDtype.FP32

    with sidecars(tmp_path / "spool", redis_url, world_size) as servers:
        preds = {
            "rows": serving_predictor(
                "q-rows", servers, rows_dtype, Form.ROWS, 0, wire(rows_dtype)
            ),
            "topk": serving_predictor(
                "q-topk", servers, topk_dtype, Form.TOPK, 7, wire(topk_dtype)
            ),
        }
        consumers = {n: DeltaConsumer(p.config.consumer) for n, p in preds.items()}
        pulls = dict.fromkeys(preds, 0)
        try:
            for c in consumers.values():
                c.connect()
            for p in preds.values():
                assert p.forwards is not None
                p.forwards.start()
            for seed in (0, 1):  # then the trainer restarts: a new generation, other tables
                step = train_while_pulling(
                    tmp_path, world_size, seed, sharding, preds, consumers, pulls
                )
                for n, p in preds.items():
                    pulls[n] = sync(p, consumers[n], step, pulls[n])
                    assert p.records[-1].step == step
                    assert_bit_exact(p, p.config.serving.dtype, tmp_path / "final.pt")  # type: ignore[union-attr]
            assert any(r.resync for r in preds["rows"].records[1:])  # the new generation
            dense = [r.dense_bytes for p in preds.values() for r in p.records]
            assert sum(dense) > 0  # the dense state came from the publisher
            assert any(r.owed > 0 for r in preds["topk"].records)  # top-k owed, then paid
            for p in preds.values():
                assert p.forwards is not None and p.forwards.error is None
                assert p.forwards.forwards > 0
        finally:
            for p in preds.values():
                if p.forwards is not None:
                    p.forwards.stop()
            for c in consumers.values():
                c.close()


def train_while_pulling(
    tmp_path: Path,
    world_size: int,
    seed: int,
    sharding: dict[str, str],
    preds: dict[str, SyncLoop],
    consumers: dict[str, DeltaConsumer],
    pulls: dict[str, int],
) -> int:
    """Train in a thread while the predictors pull (bounded); the trainer's final step."""
    out: list[int] = []
    th = threading.Thread(
        target=lambda: out.append(train(tmp_path, world_size, seed, sharding, steps=40))
    )
    th.start()
    deadline = time.monotonic() + 400
    while th.is_alive() and time.monotonic() < deadline:
        for n, p in preds.items():
            pulls[n] += 1
            p.pull_once(consumers[n], pulls[n])
        time.sleep(0.05)
    th.join(max(0.0, deadline - time.monotonic()))
    assert out, "the trainer did not finish"
    return out[0]


def test_killed_quantized_predictor_bootstraps_again(tmp_path: Path, redis_url: str) -> None:
    """`deltad consume --serve-dtype int8` killed mid-run, started again from its model code
    alone: it bootstraps from deltad and writes a state bit-exact with torchrec's."""
    step = train(tmp_path, 1, seed=0, sharding={})
    with sidecars(tmp_path / "spool", redis_url, 1) as servers:
        log = tmp_path / "pred.jsonl"

        def consume(*extra: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "q", "--model", "m",
                 "--sidecar", servers[0].endpoint, "--serve-dtype", "int8", "--tables",
                 ",".join(f"{t}:{r}" for t, r in TABLES.items()), "--seq-rows", str(SEQ_ROWS),
                 "--dim", str(DIM), "--interval", "0.05", "--json-log", str(log), *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(),
            )  # fmt: skip

        first = consume("--pulls", "100000")
        try:
            wait_for(lambda: log.exists() and '"rows":0' in log.read_text(), 120.0, "a pull")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        log.unlink()
        state = tmp_path / "state.pt"
        second = consume("--pulls", "3", "--final-state", str(state))
        _, err = second.communicate(timeout=180)
        assert second.returncode == 0, err
        assert "forwards (int8)" in err and "during apply" in err, err
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[0]["resync"] and lines[0]["step"] == step  # bootstrapped again, to the head
    summary = lines[-1]
    assert summary["event"] == "summary" and summary["forwards"] > 0
    got = torch.load(state, weights_only=True)
    ref = reference(ServeDtype.INT8, torch.load(tmp_path / "final.pt"))
    want = serving_state(ref)
    assert any(k.startswith("bottom.") for k in want)
    assert got.keys() == want.keys()
    skip = training_only_state(ref)  # the MCH's eviction bookkeeping is not served
    for key in got:
        if key not in skip:
            assert torch.equal(got[key], want[key]), key
