"""Endpoint flags are HOST:PORT with a real port (gRPC takes port 99999 as 34463: a typo that
reaches another server), and a command whose stdout reader goes away neither prints a
traceback nor, for a sidecar, stops serving or leaves its embedded Redis behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serverkit import SpoolWriter, redis_server, server_config
from spoolkit import child_env

from deltad.commands import healthcheck
from deltad.commands import main as cli
from deltad.config import ConsumerConfig, RelayConfig, check_endpoint
from deltad.errors import ConfigError
from deltad.serve.edge.app import SidecarServer, machine_name
from deltad.serve.relay.server import RelayServer
from deltad.store import EmbeddedRedis

__all__ = ["redis_server"]


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1:50051", "localhost:1", "sidecar-0.ns.svc:65535", "[::1]:80",
     "dns:///sidecar:443", "ipv4:10.0.0.1:5", "unix:/run/deltad.sock"],
)  # fmt: skip
def test_a_valid_endpoint_is_taken_as_it_is(value: str) -> None:
    assert check_endpoint("--sidecar", value) == value


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1:99999", "127.0.0.1:115535", "host:0", "host", "host:", ":80", "h:80 ",
     "a:b:1", "[::1]:70000", ""],
)  # fmt: skip
def test_an_endpoint_without_a_valid_port_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"--sidecar must be HOST:PORT with a port in 1\.\.65535"):
        check_endpoint("--sidecar", value)
    with pytest.raises(ConfigError, match="sidecar endpoint"):
        ConsumerConfig("c", sidecars=("127.0.0.1:1", value))


def test_a_listen_address_may_take_any_free_port_but_not_a_wrapped_one() -> None:
    assert check_endpoint("--listen", "0.0.0.0:0", listen=True) == "0.0.0.0:0"
    assert check_endpoint("--listen", "[::]:50051", listen=True) == "[::]:50051"
    for bad in ("127.0.0.1:65536", "unix:/run/x.sock"):
        with pytest.raises(ConfigError, match=r"port in 0\.\.65535"):
            check_endpoint("--listen", bad, listen=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--listen", "127.0.0.1:99999"], "--listen, DELTAD_LISTEN) must be HOST:PORT"),
        (["serve", "--upstream", "127.0.0.1:99999"], "upstream (--upstream) must be HOST:PORT"),
        (["status", "--target", "127.0.0.1:99999"], "--target must be HOST:PORT"),
        (["rollout", "status", "--target", "127.0.0.1:70000"], "--target must be HOST:PORT"),
        (["consume", "--consumer", "c", "--sidecar", "127.0.0.1:70000"], "sidecar endpoint"),
    ],
)
def test_a_wrapped_port_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    if argv[0] == "serve":
        argv = [*argv, "--spool", str(tmp_path / "spool")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert next(a for a in argv if a.endswith(("99999", "70000"))) in err[0]
    assert not (tmp_path / "spool").exists()  # (refused before the sidecar made anything)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["127.0.0.1:99999"], "target must be HOST:PORT"),
        (["127.0.0.1:50051", "--timeout", "nan"], "--timeout must be a finite number"),
        (["127.0.0.1:50051", "--timeout", "-1"], "--timeout must be a finite number"),
    ],
)
def test_a_bad_healthcheck_argument_is_exit_2_not_unhealthy(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    t0 = time.monotonic()
    assert healthcheck.main(argv) == 2  # (1 would read as "the sidecar is unhealthy")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert time.monotonic() - t0 < 1  # (nothing dialled)


def _redis_of(spool: Path) -> list[int]:
    """Pids of redis-server processes whose command line names ``spool``."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "redis-server" in cmd and str(spool) in cmd:
            pids.append(int(d.name))
    return pids


@pytest.mark.slow  # a `deltad serve` subprocess (imports torch)
def test_a_sidecar_whose_stdout_reader_went_away_serves_on_and_stops_its_redis(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    SpoolWriter(spool)
    r, w = os.pipe()
    os.close(r)  # nobody will read its stdout: its first line meets a closed pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(spool), "--model", "m",
         "--listen", "127.0.0.1:0", "--metrics-port", "0", "--grace-period", "1"],
        stdout=w, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    os.close(w)
    try:
        deadline = time.monotonic() + 60
        while not _redis_of(spool) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        assert _redis_of(spool)
        time.sleep(3)  # (past its "serving ... on" line)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    deadline = time.monotonic() + 10
    while _redis_of(spool) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _redis_of(spool)  # (its embedded Redis stopped with it)


@pytest.mark.slow  # a `deltad status` subprocess
def test_a_command_whose_stdout_reader_went_away_exits_like_one_killed_by_sigpipe(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """`deltad status | head -1` without a traceback."""
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    try:
        for closed in (False, True):
            r, w = os.pipe()
            if closed:
                os.close(r)
            out = subprocess.run(
                [sys.executable, "-m", "deltad.commands.main", "status", "--target", f"127.0.0.1:{srv.port}"],
                stdout=w, stderr=subprocess.PIPE, text=True, env=child_env(), timeout=60,
            )  # fmt: skip
            os.close(w)
            if not closed:
                with os.fdopen(r) as f:
                    assert "rank 0" in f.read()
                assert out.returncode == 0, out.stderr
                continue
            assert out.returncode == 128 + signal.SIGPIPE, out.stderr
            assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    finally:
        srv.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("upstream_host", ["127.0.0.1", "localhost"])
def test_a_relay_whose_upstream_is_itself_is_refused_at_start(
    tmp_path: Path, redis_server: EmbeddedRedis, upstream_host: str
) -> None:
    port = _free_port()
    cfg = server_config(tmp_path / "relay", redis_server.url, listen=f"127.0.0.1:{port}")
    relay = RelayServer(cfg, RelayConfig(upstream=f"{upstream_host}:{port}", consumer="r"))
    with pytest.raises(ConfigError, match=f"--upstream {upstream_host}:{port} is this relay"):
        relay.start()
    with socket.socket() as s:  # (it stopped: its port is free again)
        s.bind(("127.0.0.1", port))


def test_listening_beyond_this_machine_without_tokens_is_warned_about(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    SpoolWriter(tmp_path / "spool")
    for listen, tokens, warned in (
        ("0.0.0.0:0", (), True),
        ("0.0.0.0:0", ("s3cret",), False),
        ("127.0.0.1:0", (), False),
    ):
        caplog.clear()
        cfg = server_config(tmp_path / "spool", redis_server.url, listen=listen, tokens=tokens)
        with caplog.at_level("WARNING", logger="deltad.serve.edge.app"):
            srv = SidecarServer(cfg).start()
            srv.stop(0)
        if listen.startswith("0.0.0.0"):  # (registered for discovery: a name others reach)
            assert srv.endpoint == f"{machine_name()}:{srv.port}"
        said = [r.getMessage() for r in caplog.records if "with no tokens" in r.getMessage()]
        assert len(said) == int(warned), (listen, tokens, said)
        if warned:
            assert "admin ones (Rollout, Forget)" in said[0]


def test_a_spool_whose_parent_does_not_exist_is_refused_and_nothing_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --spool made the whole path and an embedded Redis in it; the sidecar makes
    at most the spool directory itself (a volume's mount point exists)."""
    typo = tmp_path / "nonexistent" / "spool"
    assert cli.main(["serve", "--spool", str(typo), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither it nor its parent directory exists" in err[-1], err
    assert not (tmp_path / "nonexistent").exists()


def test_a_rank_beyond_the_spools_world_size_is_an_error_line(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    for rank in (0, 1):
        SpoolWriter(tmp_path / "spool", rank=rank, world_size=2)
    for rank, said in ((5, "has world size 2 (ranks 0..1)"), (1, None)):
        caplog.clear()
        cfg = server_config(tmp_path / "spool", redis_server.url, rank=rank)
        with caplog.at_level("WARNING", logger="deltad.serve.edge.app"):
            SidecarServer(cfg).start().stop(0)
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        if said is None:
            assert not errors, errors
        else:
            assert len(errors) == 1 and said in errors[0] and "mistyped --rank" in errors[0]


def test_the_name_a_sidecar_on_every_address_registers_is_not_a_loopback_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/etc/hosts often maps the host name to 127.0.0.1, and getfqdn() then says "localhost":
    predictors on other machines would dial themselves."""
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-0")
    assert machine_name() == "trainer-0"
    monkeypatch.setattr(socket, "getfqdn", lambda: "trainer-0.ns.svc.cluster.local")
    assert machine_name() == "trainer-0.ns.svc.cluster.local"
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost.localdomain")
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert machine_name() == "localhost"  # (then the sidecar says to set --advertise)
