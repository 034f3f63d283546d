"""The reference predictor (consumers.predictor) against real in-process sidecars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deltad.reference.consumers.predictor import SyncLoop, SyncLoopConfig, percentile
from spoolkit import FakeTrainer

from deltad.config import ConsumerConfig, ServerConfig
from deltad.serve.edge.app import SidecarServer

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
        cfg = SyncLoopConfig(
            consumer=ConsumerConfig(
                consumer="pred", model="m", sidecars=tuple(s.endpoint for s in servers)
            ),
            interval_s=0.01,
            pulls=3,
            init_tables=init,
            final_tables=tmp_path / "final.pt",
            json_log=str(tmp_path / "log.jsonl"),
        )
        summary = SyncLoop(cfg).run()
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


@pytest.mark.slow
def test_consume_resume_needs_init_tables(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "p", "--resume",
         "--sidecar", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--resume needs --init-tables" in out.stderr, out.stderr
    for bad, why in (
        (["--form", "topk"], "top-k needs k > 0 or a fraction"),
        (["--form", "topk", "--fraction", "2"], "--fraction must be a finite number in [0, 1]"),
        (["--k", "-1"], "--k must be a finite number in [0,"),
        (["--max-rows", "-5"], "--max-rows must be a finite number in [0,"),
        (["--pulls", "-1"], "--pulls must be a finite number in [0,"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "p",
             "--sidecar", "127.0.0.1:1", *bad],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2 and why in out.stderr, (bad, out.stderr)


@pytest.mark.parametrize(
    # one handler takes both signals: the fast lane sends SIGTERM, the full suite both
    "sig",
    ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)],
)
def test_consume_stops_cleanly_and_saves_its_tables_on_a_signal(
    tmp_path: Path, redis_url: str, sig: str
) -> None:
    """SIGTERM (an orchestrator) and SIGINT (Ctrl-C) alike: finish the pull, commit, write
    --final-tables, exit 0 (tables a later --resume can start from)."""
    import signal
    import subprocess
    import sys
    import time

    from spoolkit import child_env, wait_for

    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    srv = SidecarServer(
        ServerConfig(
            spool_dir=tmp_path / "spool", model="m", listen="127.0.0.1:0",
            redis_url=redis_url, poll_interval_s=0.02, grace_period_s=0.5,
        )
    ).start()  # fmt: skip
    log = tmp_path / "log.jsonl"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "sig", "--model", "m",
             "--sidecar", srv.endpoint, "--interval", "0.05", "--json-log", str(log),
             "--final-tables", str(tmp_path / "final.pt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        wait_for(lambda: log.exists() and log.read_text().count("\n") >= 1, 60.0, "a pull")
        time.sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        srv.stop(0.5)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for n, t in ft.history[10].items():
        assert torch.equal(final[n], t), n
