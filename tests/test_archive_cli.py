"""The archive's command lines: `deltad serve --archive` (its URL checked, exit 2 with one line)
and `deltad consume --bootstrap-from` cold-starting from a real SeaweedFS, its credentials in the
environment, bit-equal to the trainer's tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from s3kit import ACCESS_KEY, SECRET_KEY, Seaweed, archive_url, s3_env, seaweed  # noqa: F401
from serverkit import MODEL, SpoolWriter, wait_for
from spoolkit import child_env, cli_sidecar

from deltad.errors import ConfigError
from deltad.serve.archive.fetch import read_manifest
from deltad.serve.archive.opening import open_store
from deltad.store import EmbeddedRedis


def _archiving(root: Path, redis: EmbeddedRedis, url: str, s3: Seaweed) -> Any:
    """`deltad serve --archive URL --archive-endpoint` of ``root`` (in process, its CLI)."""
    return cli_sidecar(
        "--spool", str(root), "--model", MODEL, "--listen", "127.0.0.1:0",
        "--redis-url", redis.url, "--archive", url, "--archive-endpoint", s3.endpoint,
    )  # fmt: skip


def _serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "serve", *argv],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--archive", "ftp://host/x"], "expected file:///path or s3://bucket/prefix"),
        (["--archive", "s3://key:secret@bucket/p"], "no credentials in it"),
        (["--archive", "s3://b/p", "--archive-endpoint", "ftp://x"], "an http:// or https://"),
        (["--archive-endpoint", "http://127.0.0.1:1"], "--archive-endpoint needs --archive"),
    ],
)
def test_a_bad_archive_flag_is_refused_before_anything_is_served(
    tmp_path: Path, redis_server: EmbeddedRedis, flags: list[str], says: str
) -> None:
    (tmp_path / "spool").mkdir()
    with pytest.raises(ConfigError, match=re.escape(says)):
        cli_sidecar(
            "--spool", str(tmp_path / "spool"), "--model", MODEL, "--listen", "127.0.0.1:0",
            "--redis-url", redis_server.url, *flags,
        )  # fmt: skip


@pytest.mark.slow
def test_deltad_serve_with_a_bad_archive_url_says_one_line_and_exits_2(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    (tmp_path / "spool").mkdir()
    got = _serve(
        "--spool", str(tmp_path / "spool"), "--model", MODEL, "--listen", "127.0.0.1:0",
        "--redis-url", redis_server.url, "--archive", "s3://key:secret@bucket/p",
    )  # fmt: skip
    assert got.returncode == 2, got.stderr
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no credentials in it" in lines[0], got.stderr


def test_the_archive_flags_reach_the_config(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    from deltad.commands.main import build_parser
    from deltad.serve import cli as serve_cli

    args = build_parser().parse_args(
        [
            "serve",
            "--spool",
            str(tmp_path),
            "--archive",
            "file:///mnt/a",
            "--archive-lag-bound",
            "7",
        ]
    )
    cfg = serve_cli.build_config(args)
    assert (cfg.archive_url, cfg.archive_endpoint, cfg.archive_lag_bound_s) == (
        "file:///mnt/a",
        None,
        7.0,
    )
    with pytest.raises(ConfigError, match="archive-lag-bound"):
        serve_cli.build_config(
            build_parser().parse_args(
                ["serve", "--spool", str(tmp_path), "--archive-lag-bound", "0"]
            )
        )


@pytest.mark.slow
@pytest.mark.usefixtures("s3_env")
def test_deltad_consume_bootstrap_from_cold_starts_from_the_store_bit_equal(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables={"t0": (3000, 32), "t1": (800, 16)})
    url = archive_url()
    srv = _archiving(root, redis_server, url, seaweed)
    try:
        for _ in range(3):
            spool.delta()
        store = open_store(url, endpoint=seaweed.endpoint)

        def archived() -> bool:
            m = read_manifest(store, MODEL, 0)
            return m is not None and m.head.seq == spool.seq

        wait_for(archived, 30, "the archive")
        store.close()
        spool.delta()  # the tail, from the sidecar
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == spool.seq, 10)
        env = child_env()
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        final = tmp_path / "final.pt"
        got = subprocess.run(
            [
                sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "cold", "--model",
                MODEL, "--sidecar", f"127.0.0.1:{srv.port}", "--pulls", "1", "--bootstrap-from",
                url, "--bootstrap-endpoint", seaweed.endpoint, "--final-tables", str(final),
            ],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr + got.stdout
        assert "cold start from" in got.stdout + got.stderr
        tables = torch.load(final, weights_only=True)
        for t in spool.specs:
            assert torch.equal(tables[t], spool.truth[t]), t
    finally:
        srv.stop(0)


@pytest.mark.slow
@pytest.mark.usefixtures("s3_env")
def test_a_predictor_killed_during_its_cold_start_loses_nothing(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    """kill -9 of `deltad consume --bootstrap-from` inside its cold start (a first run times
    it: the kills land at a quarter, half and three quarters of it, while it reads the store,
    asks the sidecar for its ids or applies): the next one of the same name cold-starts again
    or goes on from what was committed, and ends bit-equal with the trainer, who went on
    publishing meanwhile."""
    import time

    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables={"t0": (300_000, 32), "t1": (100_000, 32)})  # ~50 MB
    url = archive_url()
    srv = _archiving(root, redis_server, url, seaweed)
    env = child_env()
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    final = tmp_path / "final.pt"

    def consume(name: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", name,
                "--model", MODEL, "--sidecar", f"127.0.0.1:{srv.port}", "--pulls", "2",
                "--bootstrap-from", url, "--bootstrap-endpoint", seaweed.endpoint,
                "--final-tables", str(final),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip

    def archived() -> None:
        store = open_store(url, endpoint=seaweed.endpoint)
        try:
            wait_for(
                lambda: (
                    (m := read_manifest(store, MODEL, 0)) is not None and m.head.seq == spool.seq
                ),
                30,
                "the archive",
            )
        finally:
            store.close()

    try:
        spool.delta()
        archived()
        # a first run, timed: when its cold start ended (its line), and how long it took
        t0 = time.monotonic()
        p = consume("timing")
        assert p.stdout is not None
        ended = took = None
        for line in p.stdout:
            m = re.search(r"cold start from .* bytes in (\d+) ms", line)
            if m:
                ended, took = time.monotonic() - t0, int(m.group(1)) / 1000
        assert p.wait(60) == 0 and ended is not None and took is not None
        began = ended - took
        for f in (0.25, 0.5, 0.75):
            p = consume("cold")
            time.sleep(began + f * took)
            p.kill()
            p.wait(30)
            spool.delta()  # the trainer goes on
            archived()
        p = consume("cold")
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        tables = torch.load(final, weights_only=True)
        for t in spool.specs:
            assert torch.equal(tables[t], spool.truth[t]), t
    finally:
        srv.stop(0)
