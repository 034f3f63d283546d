"""The CLI error table: every configuration mistake is one stderr line and exit 2 (never a
traceback, never a silent success), and `deltad consume` refuses a setup that would serve
partial or foreign tables."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from serverkit import SpoolWriter, redis_server, server_config
from spoolkit import child_env

from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis

__all__ = ["redis_server"]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", *args],
        capture_output=True, text=True, env={**child_env(), **(env or {})}, timeout=timeout,
    )  # fmt: skip
    return out.returncode, out.stderr


CASES = [
    ("serve", ["--redis-url", "http://127.0.0.1:6379/0"], {}, "scheme 'http'"),
    ("serve", ["--redis-url", "garbage"], {}, "scheme ''"),
    ("serve", ["--redis-url", "redis://127.0.0.1:99999/0"], {}, "invalid Redis URL"),
    ("serve", ["--redis-url", "redis://127.0.0.1:6379?db=abc"], {}, "db must be a number"),
    ("serve", ["--redis-url", "redis://127.0.0.1:6379/abc"], {}, "db must be a number"),
    ("serve", [], {"DELTAD_RANK": "one"}, "DELTAD_RANK='one' is not a valid int"),
    ("serve", [], {"DELTAD_LEASE_TTL": "soon"}, "DELTAD_LEASE_TTL"),
    ("serve", [], {"DELTAD_MAX_CONSUMERS": "-1"}, "DELTAD_MAX_CONSUMERS"),
    ("serve", [], {"DELTAD_TOKENS": "a,b"}, "DELTAD_TOKENS"),
    ("consume", ["--consumer", "c", "--redis-url", "mongodb://x"], {}, "scheme 'mongodb'"),
    (
        "consume",
        ["--consumer", "c", "--sidecar", "127.0.0.1:1", "--final-tables", "/nonexistent/d/t.pt"],
        {},
        "--final-tables /nonexistent/d/t.pt: not a writable file path",
    ),
    ("bench", ["--repeats", "-1"], {}, "--repeats must be a finite number in [0, 1000]"),
    ("serve", ["--lease-ttl", "nan"], {}, "--lease-ttl must be a finite number"),
    ("serve", [], {"DELTAD_POLL_INTERVAL": "nan"}, "--poll-interval (DELTAD_POLL_INTERVAL) must"),
    ("serve", ["--max-message-bytes", "1099511627776"], {}, "--max-message-bytes must be"),
    ("serve", ["--chunk-bytes", "-1"], {}, "--chunk-bytes must be an integer in"),
    ("serve", ["--stream-deadline", "inf"], {}, "--stream-deadline must be a finite number"),
    ("consume", ["--consumer", "c", "--sidecar", "x:1", "--interval", "nan"], {}, "--interval"),
    ("train", ["--lr", "inf"], {}, "--lr must be a finite number"),
]


@pytest.mark.slow  # subprocesses that import torch
@pytest.mark.parametrize(("cmd", "args", "env", "message"), CASES)
def test_a_config_error_is_one_line_and_exit_2(
    tmp_path: Path, cmd: str, args: list[str], env: dict[str, str], message: str
) -> None:
    if cmd == "serve":
        args = ["--spool", str(tmp_path / "spool"), "--listen", "127.0.0.1:0", *args]
    t0 = time.monotonic()
    code, err = _cli(cmd, *args, env=env)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert time.monotonic() - t0 < 30


@pytest.mark.slow  # subprocesses that import torch
def test_consume_refuses_partial_or_foreign_tables_and_an_unreachable_setup(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    for rank in (0, 1):
        SpoolWriter(tmp_path / "spool", rank=rank, world_size=2)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    ep = f"127.0.0.1:{srv.port}"
    try:
        base = ["consume", "--consumer", "c", "--pulls", "1", "--discovery-timeout", "2"]
        code, err = _cli(*base, "--model", "m", "--sidecar", ep)
        assert code == 2 and "has 2 ranks; give one --sidecar per rank (got 1)" in err, err
        assert len(err.strip().splitlines()) == 1
        code, err = _cli(*base, "--model", "other", "--sidecar", ep, "--sidecar", ep)
        assert code == 2 and "serves model 'm', not --model 'other'" in err, err
        code, err = _cli(*base, "--model", "m", "--sidecar", ep, "--sidecar", ep)
        assert code == 2 and "rank order" in err, err
    finally:
        srv.stop(0)
    t0 = time.monotonic()
    code, err = _cli(*base, "--model", "m", "--sidecar", ep, "--sidecar", "127.0.0.1:1")
    assert code == 2 and "no sidecar answered within 2s" in err, err
    assert time.monotonic() - t0 < 30
