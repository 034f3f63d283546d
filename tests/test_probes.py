"""Probes that mean what they say (issue 23, item 1): liveness apart from readiness, a relay
refused by its upstream, an embedded Redis that cannot restart on a full spool, an empty
spool, a predictor started before the trainer, a dead rank address, an aborted stream.
Real sidecars, relays and Redis servers throughout."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serverkit import SpoolWriter, server_config
from spoolkit import FakeTrainer, child_env, wait_for

from deltad.commands import status
from deltad.commands.healthcheck import LIVENESS_SERVICE, check
from deltad.config import ConsumerConfig, RelayConfig
from deltad.consume.client import DeltaConsumer
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.store import EmbeddedRedis
from deltad.store import datadir as redisdir
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


def _status(endpoint: str) -> pb.StatusResponse:
    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=10)


def _health(endpoint: str, service: str = "") -> str:
    return check(endpoint, service=service, timeout_s=5.0)


def _not_serving_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "NOT_SERVING" in r.getMessage()]


@pytest.fixture
def sidecar_of(tmp_path: Path) -> Iterator[list[SidecarServer]]:
    started: list[SidecarServer] = []
    yield started
    for s in reversed(started):
        s.stop(0)


def test_liveness_stays_serving_while_readiness_reports_the_offset_store_down(
    tmp_path: Path, sidecar_of: list[SidecarServer], caplog: pytest.LogCaptureFixture
) -> None:
    redis = EmbeddedRedis(tmp_path / "redis")
    redis.start()
    try:
        SpoolWriter(tmp_path / "spool")
        srv = SidecarServer(server_config(tmp_path / "spool", redis.url))
        sidecar_of.append(srv.start())
        ep = srv.endpoint
        assert _health(ep) == "SERVING" and _health(ep, LIVENESS_SERVICE) == "SERVING"
        assert _status(ep).health_reason == ""
        caplog.set_level(logging.WARNING, logger="deltad")
        redis.stop(kill=True)
        wait_for(lambda: _health(ep) == "NOT_SERVING", 30, "readiness to fail")
        assert _health(ep, LIVENESS_SERVICE) == "SERVING"  # a restart would not fix Redis
        assert "did not answer" in _status(ep).health_reason
        for _ in range(4):  # more failed probes: no more lines
            srv.probe_redis()
        assert len(_not_serving_lines(caplog)) == 1
        redis.start()
        wait_for(lambda: _health(ep) == "SERVING", 30, "readiness to come back")
        assert _status(ep).health_reason == ""
    finally:
        redis.stop()


def test_a_full_spool_turns_the_embedded_redis_sidecar_not_serving_once_and_it_recovers(
    tmp_path: Path,
    sidecar_of: list[SidecarServer],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded Redis (real) dies; writing its config to restart it fails with ENOSPC
    (simulated at that one seam: no size-limited file system without root)."""
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", None))
    sidecar_of.append(srv.start())
    ep = srv.endpoint
    embedded = srv._embedded
    assert embedded is not None and _health(ep) == "SERVING"
    real_write = redisdir._write_private

    def full(path: Path, data: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    caplog.set_level(logging.INFO, logger="deltad")
    monkeypatch.setattr(redisdir, "_write_private", full)
    pid = embedded.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _health(ep) == "NOT_SERVING", 30, "NOT_SERVING on a full spool")
    reason = _status(ep).health_reason
    assert "cannot restart" in reason and "No space left on device" in reason, reason
    assert str(tmp_path) not in reason  # no paths to clients
    for _ in range(4):
        srv.probe_redis()
    assert _health(ep, LIVENESS_SERVICE) == "SERVING"
    assert len(_not_serving_lines(caplog)) == 1
    assert not [r for r in caplog.records if r.exc_info]  # no traceback per probe
    monkeypatch.setattr(redisdir, "_write_private", real_write)  # space returns
    wait_for(lambda: _health(ep) == "SERVING", 30, "SERVING once space returns")
    assert _status(ep).health_reason == ""


def _relay(tmp_path: Path, name: str, upstream: str, redis_url: str, **kw: object) -> RelayServer:
    cfg = server_config(tmp_path / f"relay-{name}", redis_url)
    return RelayServer(
        cfg,
        RelayConfig(upstream=upstream, consumer=name, poll_interval_s=0.02, fsync=False,
                    backoff_initial_s=0.02, backoff_max_s=0.1, **kw),  # type: ignore[arg-type]
    ).start()  # fmt: skip


def test_a_relay_its_upstream_refuses_is_not_serving_with_the_reason(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """No token, a wrong token, a name outside the token's scope: NOT_SERVING with the
    reason in Status and one log line per change; a fixed token brings it back."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    tokens = tmp_path / "tokens"
    tokens.write_text("good relay-* consume\n")
    up = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, tokens_file=tokens)
    ).start()
    caplog.set_level(logging.INFO, logger="deltad")
    token_file = tmp_path / "relay-token"
    token_file.write_text("wrong\n")
    relays: list[RelayServer] = []
    try:
        cases = [
            ("relay-none", {}, "UNAUTHENTICATED"),
            ("relay-wrong", {"token_file": token_file}, "UNAUTHENTICATED"),
            ("outsider", {"token": "good"}, "PERMISSION_DENIED"),
        ]
        for name, kw, code in cases:
            r = _relay(tmp_path, name, up.endpoint, redis_server.url, **kw)
            relays.append(r)
            wait_for(lambda r=r: _health(r.endpoint) == "NOT_SERVING", 30, f"{name} refused")
            reason = _status(r.endpoint).health_reason
            assert "refuses this relay" in reason and code in reason, reason
            assert _health(r.endpoint, LIVENESS_SERVICE) == "SERVING"
        wrong = relays[1]
        assert wrong.mirror is not None and wrong.mirror.pulls == 0
        per_relay = [r for r in _not_serving_lines(caplog) if "refuses" in r.getMessage()]
        assert len(per_relay) == 3  # one line per change, not per retry
        token_file.write_text("good\n")  # fixed: re-read, mirrors, SERVING again
        wait_for(lambda: _health(wrong.endpoint) == "SERVING", 30, "the relay to recover")
        wait_for(lambda: _status(wrong.endpoint).head_step == 10, 30, "the relay to mirror")
        assert _status(wrong.endpoint).health_reason == ""
    finally:
        for r in relays:
            r.stop(0.2)
        up.stop(0.2)


def test_a_relay_that_does_not_trust_its_upstreams_certificate_is_not_serving(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path
) -> None:
    SpoolWriter(tmp_path / "spool")
    a = pki / "a"
    cfg = server_config(
        tmp_path / "spool", redis_server.url, listen="localhost:0",
        tls_cert=a / "server.pem", tls_key=a / "server.key",
    )  # fmt: skip
    up = SidecarServer(cfg).start()
    relay = _relay(
        tmp_path, "relay-b", f"localhost:{up.port}", redis_server.url,
        tls_ca=pki / "b" / "ca.pem",
    )  # fmt: skip
    try:
        wait_for(lambda: _health(relay.endpoint) == "NOT_SERVING", 30, "the wrong CA refused")
        assert "refuses this relay" in _status(relay.endpoint).health_reason
    finally:
        relay.stop(0.2)
        up.stop(0.2)


def test_an_empty_spool_says_it_has_no_segment_yet_and_shows_no_age(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    sidecar_of: list[SidecarServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="deltad")
    srv = SidecarServer(server_config(tmp_path / "mistyped", redis_server.url))
    sidecar_of.append(srv.start())
    assert any("no segment of model 'm'" in r.getMessage() for r in caplog.records)
    st, consumers = status.fetch(srv.endpoint)
    text = status.render(st, consumers)
    assert "no segment yet" in text and "age" not in text, text
    assert "head seq -1" not in text


def test_a_rank_whose_only_base_was_quarantined_says_so_not_check_your_flags(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    """Review 10: with its only segment quarantined, status said "nothing published ...; check
    --spool and --model", pointing the operator at the wrong thing."""
    spool = SpoolWriter(tmp_path / "spool")
    base = spool.layout.segment_path(1, 0, 0)
    raw = bytearray(base.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # its checksum fails
    base.write_bytes(bytes(raw))
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())
    st, consumers = status.fetch(srv.endpoint)
    text = status.render(st, consumers)
    assert "1 file(s) of this rank quarantined" in text and "fresh base" in text, text
    assert "check --spool" not in text
    # what the model is stays known from its manifest (review 13: "rank 0/0 generation 0")
    assert (st.generation, st.world_size, st.head_seq) == (1, 1, -1)


def test_forgetting_a_live_consumer_says_it_was_live(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    sidecar_of: list[SidecarServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review 10: `deltad status --forget NAME` forgot a predictor that was pulling, with no
    word of it."""
    from deltad.commands.main import main

    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())
    srv.store.register("busy", 300.0)
    srv.store.register("gone", 0.05)
    assert main(["status", "--target", srv.endpoint, "--forget", "busy"]) == 0
    out = capsys.readouterr().out
    assert "consumer busy: forgotten (it was live" in out and "full tables" in out, out
    wait_for(lambda: srv.store.lease_remaining(["gone"])["gone"] == 0, 10, "the lease gone")
    assert main(["status", "--target", srv.endpoint, "--forget", "gone"]) == 0
    assert capsys.readouterr().out.strip() == "consumer gone: forgotten"


def test_wait_for_new_waits_for_the_first_publish_and_says_nothing_is_published(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    """A predictor started before its trainer: no spin, and the reason says why."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())
    cfg = ConsumerConfig("pred", model="m", sidecars=(srv.endpoint,), rpc_deadline_s=10.0)
    with DeltaConsumer(cfg) as c:
        res = c.pull()
        assert set(res.missing.values()) == {"nothing published yet"}, res.missing
        assert not res.caught_up
        assert c.wait_for_new(0.5) is False  # nothing came: it waited, it did not say "pull"
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(c.wait_for_new(30.0)))
        waiter.start()
        ft.start(0)  # the trainer's first segment ends the wait
        waiter.join(40)
        assert got == [True]
        res = c.pull()
        assert not res.missing and res.deltas and res.caught_up


@pytest.mark.slow  # a subprocess that imports torch
def test_consume_with_one_dead_rank_address_fails_with_one_line(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    for rank in (0, 1):
        SpoolWriter(tmp_path / "spool", rank=rank, world_size=2)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "c", "--model", "m",
         "--pulls", "1", "--discovery-timeout", "2", "--sidecar", srv.endpoint,
         "--sidecar", "127.0.0.1:1"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode != 0, out.stderr
    assert "rank 1 at 127.0.0.1:1" in out.stderr and "not every sidecar" in out.stderr
    assert "waiting up to" in out.stderr  # it said what it waits for
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # a subprocess that imports torch
def test_consume_whose_every_pull_is_refused_exits_1_with_the_reason(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    """Review 4 (stop 34) #7: `deltad consume --pulls N` whose pulls all came back without a
    step to serve (here nothing is published yet) exited 0 with "step None"; it exits 1 and
    says why. Once a pull is served, the same command exits 0."""
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())
    final = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "c", "--model", "m",
           "--pulls", "2", "--interval", "0.1", "--discovery-timeout", "5",
           "--sidecar", srv.endpoint, "--final-tables", str(final)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 1, out.stderr
    assert "no pull was served (2 pulls); the last: rank 0: nothing published yet" in out.stderr
    assert "Traceback" not in out.stderr
    assert not final.exists()  # (tables nobody sent would pass for served ones)
    FakeTrainer(tmp_path / "spool", world_size=1).start(0)
    wait_for(lambda: srv.log.snapshot() is not None, 30, "the first segment")
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no pull was served" not in out.stderr and final.exists()


def test_a_client_that_aborts_its_stream_is_counted_as_cancelled(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    SpoolWriter(tmp_path / "spool", tables={"t0": (200_000, 64)})
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url, chunk_bytes=65536))
    sidecar_of.append(srv.start())
    with grpc.insecure_channel(srv.endpoint) as ch:
        stream = pb_grpc.DeltaServiceStub(ch).GetDelta(
            pb.GetDeltaRequest(consumer="quitter"), timeout=30
        )
        next(stream)  # the header: the stream runs
        stream.cancel()

    def counted(code: str) -> float:
        v = srv.metrics.registry.get_sample_value(
            "deltad_rpc_requests_total",
            {"method": "GetDelta", "code": code, "model": "m", "rank": "0"},
        )
        return v or 0.0

    wait_for(lambda: counted("CANCELLED") + counted("UNKNOWN") >= 1, 30, "the RPC counted")
    assert counted("CANCELLED") == 1 and counted("UNKNOWN") == 0


def test_a_consumer_that_stops_before_its_first_commit_is_not_listed_as_live(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    """It failed at once (here: it stopped before committing): its lease ends with it. One
    that committed keeps its lease (its cursor pins the log until the lease runs out)."""
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())

    def live() -> dict[str, bool]:
        _, consumers = status.fetch(srv.endpoint)
        return {c.consumer: c.live for c in consumers.consumers}

    for name in ("quitter", "worker"):
        cfg = ConsumerConfig(name, model="m", sidecars=(srv.endpoint,), lease_ttl_s=600.0)
        with DeltaConsumer(cfg) as c:
            assert live()[name]
            if name == "worker":
                c.commit(c.pull())
    assert live() == {"quitter": False, "worker": True}


def test_caught_up_is_false_while_top_k_rows_are_owed(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    from deltad.config import PullOptions
    from deltad.types import Form

    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
    sidecar_of.append(srv.start())
    cfg = ConsumerConfig(
        "topk", model="m", sidecars=(srv.endpoint,), pull=PullOptions(form=Form.TOPK, k=1)
    )
    with DeltaConsumer(cfg) as c:
        first = c.pull()
        c.commit(first)
        assert first.caught_up  # the full tables: nothing owed
        seq = spool.delta(n=50)
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq)
        res = c.pull()
        assert res.step == res.head_step and res.owed > 0 and not res.caught_up


def test_a_second_sidecar_on_a_ranks_spool_is_refused_at_start(
    tmp_path: Path, redis_server: EmbeddedRedis, sidecar_of: list[SidecarServer]
) -> None:
    """Review 13: a second `deltad serve` on a rank's spool saw no segment at all (the first
    one's retention merged and deleted the files under it), said "check --spool and --model"
    and stayed SERVING, so predictors could be sent to it. One sidecar per rank and spool:
    the second is refused at start, naming the first; once that one stops, it starts."""
    from deltad.errors import SpoolError

    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()
    first = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    try:
        second = SidecarServer(server_config(tmp_path / "spool", redis_server.url))
        with pytest.raises(SpoolError, match=f"another sidecar serves rank 0 .*pid {os.getpid()}"):
            second.start()
        # another rank of the same spool is no conflict
        other = SidecarServer(server_config(tmp_path / "spool", redis_server.url, rank=1))
        sidecar_of.append(other.start())
        # from the command line: one line, exit 2
        out = subprocess.run(
            [sys.executable, "-m", "deltad", "serve", "--spool", str(tmp_path / "spool"),
             "--model", "m", "--listen", "127.0.0.1:0", "--redis-url", redis_server.url],
            capture_output=True, text=True, timeout=120, env=child_env(),
        )  # fmt: skip
        assert out.returncode == 2, out.stderr[-2000:]
        assert "another sidecar serves rank 0" in out.stderr, out.stderr[-2000:]
    finally:
        first.stop(0)
    sidecar_of.append(SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start())
