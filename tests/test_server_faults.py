"""Crashes and outages: kill -9 of `deltad serve`, SIGTERM, Redis down and restarted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from serverkit import Client, Replica, SpoolWriter, redis_server, server_config, wait_for
from spoolkit import cli_sidecar

from deltad.consume import decode, window
from deltad.serve.edge.app import SidecarServer
from deltad.serve.state.offsets import OffsetStore
from deltad.store import EmbeddedRedis
from deltad.types import Form
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]


def _serve(spool: Path, redis_url: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(spool), "--model", "m",
         "--listen", "127.0.0.1:0", "--redis-url", redis_url, "--poll-interval", "0.02",
         "--grace-period", "2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("serving m rank 0 on "):
        proc.kill()
        raise AssertionError(f"no ready line: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, line.rsplit(" ", 1)[1]


def _equal(rep: Replica, spool: SpoolWriter) -> bool:
    return all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)


def _pull_until(c: Client, consumer: str, seq: int) -> window.RankDelta:
    deadline = time.monotonic() + 10
    while True:
        d = c.pull(consumer)
        if d.to_seq >= seq or time.monotonic() > deadline:
            return d
        time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_loses_nothing(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    proc, target = _serve(tmp_path / "spool", redis_server.url)
    rep, top = Replica(), Replica()
    try:
        c = Client(target)
        for name, r in (("k", rep), ("tk", top)):
            d = c.pull(name)
            r.apply(d)
            c.commit(d)
        spool.delta()
        d = _pull_until(c, "k", 1)
        rep.apply(d)
        c.commit(d)
        d = c.pull("tk", Form.TOPK, k=5)  # rows stay owed to "tk" across the crash
        assert d.to_seq == 1 and sum(s.owed for s in d.shards) == 90
        top.apply(d)
        c.commit(d)
        late = c.pull("late")  # issued before the crash, committed after it
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        c.close()
        spool.delta()
        spool.delta()
        proc, target = _serve(tmp_path / "spool", redis_server.url)
        c = Client(target)
        assert c.commit(late).committed.seq == 1
        d = _pull_until(c, "k", 3)
        assert not d.resync and (d.from_seq, d.to_seq) == (1, 3)
        rep.apply(d)
        c.commit(d)
        assert _equal(rep, spool)
        for _ in range(30):
            d = c.pull("tk", Form.TOPK, k=5)
            top.apply(d)
            c.commit(d)
            if d.to_seq == 3 and all(s.owed == 0 for s in d.shards):
                break
        assert _equal(top, spool)
        out = subprocess.run(
            [sys.executable, "-m", "deltad.commands.main", "status", "--target", target, "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        st = json.loads(out.stdout)
        assert st["head_seq"] == 3
        assert [c["consumer"] for c in st["consumers"]] == ["k", "late", "tk"]
        assert {"lag_segments", "lag_seconds", "owed_rows"} <= set(st["consumers"][0])
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert proc.stderr is not None and "stopping" in proc.stderr.read()


@pytest.mark.slow
def test_bad_flags_exit_2_with_a_message(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path), "--tls-cert", "x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "tls" in out.stderr and out.stdout == ""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        for port, why in ((70000, "in [0, 65535]"), (taken.getsockname()[1], "cannot serve")):
            out = subprocess.run(
                [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path),
                 "--listen", "127.0.0.1:0", "--metrics-port", str(port)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 2 and why in out.stderr, out.stderr
    for flag in ("--poll-interval", "--retention-interval"):  # 0 would spin a core
        out = subprocess.run(
            [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path), flag, "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2 and f"{flag} must be a finite number in" in out.stderr, (
            out.stderr
        )
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "status", "--target", "127.0.0.1:1", "--timeout", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "UNAVAILABLE" in out.stderr


def test_redis_outage_is_unavailable_and_never_resets_a_cursor(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    r = EmbeddedRedis(tmp_path / "redis")
    r.start()
    srv = SidecarServer(server_config(tmp_path / "spool", r.url)).start()
    srv.store.calls.attempts = 2
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        d = c.pull("r")
        c.commit(d)
        spool.delta()
        wait_for(lambda: srv.log.snapshot().head.seq == 1)  # type: ignore[union-attr]
        pending = c.pull("r")
        r.stop(kill=True)
        for call in (lambda: c.pull("r"), lambda: c.commit(pending)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unavailable" in (e.value.details() or "")
        r = EmbeddedRedis(tmp_path / "redis")  # same socket and password: the same URL
        r.start()
        d = c.pull("r")  # continues from its committed cursor, not from the base
        assert not d.resync and (d.from_seq, d.to_seq) == (0, 1)
    finally:
        c.close()
        srv.stop(0)
        r.stop()


def test_stop_lets_streams_in_flight_finish(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    SpoolWriter(tmp_path / "spool", tables={"big": (200_000, 16)})
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        req = pb.GetDeltaRequest(consumer="s", chunk_bytes=64 * 1024)
        stream = decode.raw_get_delta(c.channel)(req, timeout=30)
        asm = decode.WindowAssembler()
        asm.add(next(stream))
        stopper = threading.Thread(target=srv.stop, args=(10.0,))
        stopper.start()
        time.sleep(0.2)
        for m in stream:
            asm.add(m)
        assert asm.result().rows == 200_000
        stopper.join(15)
        assert not stopper.is_alive()
        with pytest.raises(grpc.RpcError):
            c.pull("s2")
    finally:
        c.close()
        srv.stop(0)


def test_env_vars_configure_serve(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    SpoolWriter(tmp_path / "spool")
    env = {**os.environ, "DELTAD_SPOOL": str(tmp_path / "spool"), "DELTAD_MODEL": "m",
           "DELTAD_LISTEN": "127.0.0.1:0", "DELTAD_REDIS_URL": redis_server.url,
           "DELTAD_ADVERTISE": "sidecar-0.example:7000"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "serving m rank 0 on sidecar-0.example:7000"
        ranks = OffsetStore.from_url(redis_server.url, "m").ranks()
        assert ranks[0]["endpoint"] == "sidecar-0.example:7000" and ranks[0]["generation"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_embedded_redis_keeps_cursors_across_a_sidecar_kill(tmp_path: Path) -> None:
    """Without --redis-url the sidecar runs Redis in the spool; it outlives a killed sidecar
    (other ranks use it) and the restarted sidecar reuses it, cursors intact. (The restart is
    the same command line in this process: the killed one is the process under test.)"""
    SpoolWriter(tmp_path / "spool")
    args = ["--spool", str(tmp_path / "spool"), "--model", "m", "--listen", "127.0.0.1:0"]
    url_file = tmp_path / "spool" / "m" / "redis" / "embedded.url"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    restarted: SidecarServer | None = None
    try:
        assert proc.stdout is not None
        c = Client(proc.stdout.readline().split()[-1])
        c.commit(c.pull("e"))
        c.close()
        proc.kill()
        proc.wait(10)
        restarted = cli_sidecar(*args)
        c = Client(restarted.endpoint)
        d = c.pull("e")
        assert not d.resync and d.from_seq == 0
        c.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        if restarted is not None:
            restarted.stop(0)
        try:
            redis.Redis.from_url(url_file.read_text().strip()).shutdown(nosave=True)
        except (redis.RedisError, OSError):
            pass
