"""The reference predictor (consumers.predictor) against real in-process sidecars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from spoolkit import FakeTrainer

from consumers.predictor import Predictor, PredictorConfig, percentile
from deltad.config import ConsumerConfig, ServerConfig
from deltad.server.app import SidecarServer

pytestmark = pytest.mark.timeout(120)


def test_predictor_logs_pulls_and_writes_final_tables(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(10)
    init = tmp_path / "init.pt"
    torch.save({n: torch.zeros_like(t) for n, t in ft.tables.items()}, init)
    servers = [
        SidecarServer(
            ServerConfig(
                spool_dir=tmp_path / "spool",
                model="m",
                rank=r,
                listen="127.0.0.1:0",
                redis_url=redis_url,
                poll_interval_s=0.02,
                grace_period_s=0.5,
            )
        ).start()
        for r in range(2)
    ]
    try:
        cfg = PredictorConfig(
            consumer=ConsumerConfig(
                consumer="pred", model="m", sidecars=tuple(s.endpoint for s in servers)
            ),
            interval_s=0.01,
            pulls=3,
            init_tables=init,
            final_tables=tmp_path / "final.pt",
            json_log=str(tmp_path / "log.jsonl"),
        )
        summary = Predictor(cfg).run()
    finally:
        for s in servers:
            s.stop(0.5)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for n, t in ft.history[10].items():
        assert torch.equal(final[n], t), n
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["pull", "pull", "pull", "summary"]
    first = lines[0]
    assert first["step"] == 10 and first["head_step"] == 10 and first["step_lag"] == 0
    assert first["resync"] and first["rows"] == 64 + 40 and first["bytes"] > 0
    assert first["freshness_s"] is not None and first["freshness_s"] >= 0
    assert lines[1]["rows"] == 0 and lines[1]["freshness_s"] is None  # nothing new to serve
    assert summary.pulls == 3 and summary.rows == 104 and summary.freshness_samples == 1


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)


def test_consume_resume_needs_init_tables(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "deltad.cli", "consume", "--consumer", "p", "--resume",
         "--sidecar", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--resume needs --init-tables" in out.stderr, out.stderr
