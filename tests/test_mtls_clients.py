"""mTLS on the client side: under ``--tls-client-ca`` every deltad client (the consumer library,
`deltad status`, the healthcheck, a relay's upstream connection) works with a client certificate
and fails without one; certificates and tokens are re-read without a restart (the sidecar on
reload/SIGHUP, a client when its files change). Real sidecars on port 0, real openssl PKI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serverkit import SpoolWriter, server_config
from spoolkit import child_env, wait_for

from deltad.clientauth import ClientAuth
from deltad.commands.healthcheck import main as healthcheck_main
from deltad.commands.main import main as deltad_main
from deltad.config import ConfigError, ConsumerConfig, RelayConfig
from deltad.consume.client import DeltaConsumer
from deltad.errors import ConsumerError
from deltad.serve.edge import app
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.store import EmbeddedRedis
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


def _install(src: Path, dst: Path) -> None:
    """Copy a PKI's files over the live ones (a rotation: new inode, like a rename)."""
    dst.mkdir(exist_ok=True)
    for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"):
        tmp = dst / f".{name}.new"
        shutil.copy(src / name, tmp)
        os.replace(tmp, dst / name)


@contextlib.contextmanager
def mtls_sidecar(tmp_path: Path, url: str, live: Path, **kw: object) -> Iterator[SidecarServer]:
    SpoolWriter(tmp_path / "spool")
    cfg = server_config(
        tmp_path / "spool", url, listen="localhost:0", tls_cert=live / "server.pem",
        tls_key=live / "server.key", tls_client_ca=live / "ca.pem", **kw,
    )  # fmt: skip
    srv = SidecarServer(cfg).start()
    try:
        yield srv
    finally:
        srv.stop(0)


def _consumer(target: str, live: Path, *, cert: bool = True, retries: int = 1) -> DeltaConsumer:
    cfg = ConsumerConfig(
        "pred", model="m", sidecars=(target,), tls_ca=live / "ca.pem",
        tls_cert=live / "client.pem" if cert else None,
        tls_key=live / "client.key" if cert else None,
        max_retries=retries, backoff_initial_s=0.05, backoff_max_s=0.1, rpc_deadline_s=5.0,
    )  # fmt: skip
    return DeltaConsumer(cfg)


def test_every_client_presents_a_certificate(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live = tmp_path / "live"
    _install(pki / "a", live)
    with mtls_sidecar(tmp_path, redis_server.url, live) as srv:
        target = f"localhost:{srv.port}"
        # the consumer library
        with _consumer(target, live) as c:
            assert c.pull().rows == 1500
        with _consumer(target, live, cert=False) as c:
            got = c.pull()  # the handshake is refused: no client certificate
            assert not got.deltas and "UNAVAILABLE" in got.missing[0]
        # deltad status
        tls = ["--tls-ca", str(live / "ca.pem")]
        mine = ["--tls-cert", str(live / "client.pem"), "--tls-key", str(live / "client.key")]
        assert deltad_main(["status", "--target", target, "--json", *tls, *mine]) == 0
        assert json.loads(capsys.readouterr().out)["head_seq"] == 0
        assert deltad_main(["status", "--target", target, "--timeout", "3", *tls]) == 2
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert deltad_main(["status", "--target", target, *tls, "--tls-cert", "x.pem"]) == 2
        assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
        # deltad consume (the reference predictor)
        consume = ["consume", "--consumer", "cli", "--model", "m", "--sidecar", target,
                   "--pulls", "1", "--interval", "0", *tls]  # fmt: skip
        assert deltad_main([*consume, "--discovery-timeout", "2", *mine]) == 0
        assert "consumer cli: 1 pulls, 1500 rows" in capsys.readouterr().err
        # no sidecar answers a client without a certificate (each handshake is refused at
        # once: the wait for discovery runs out however long it is)
        assert deltad_main([*consume, "--discovery-timeout", "0.5"]) == 2
        assert "no sidecar answered" in capsys.readouterr().err
        # the healthcheck
        assert healthcheck_main([target, *tls, *mine]) == 0
        assert healthcheck_main([target, *tls, "--timeout", "2"]) == 1
        # a relay's upstream connection
        relay_cfg = server_config(tmp_path / "relay", None, grace_period_s=0.2)
        up = dict(upstream=target, consumer="relay", tls_ca=live / "ca.pem", fsync=False,
                  poll_interval_s=0.02, backoff_initial_s=0.05, backoff_max_s=0.2)  # fmt: skip
        relay = RelayServer(
            relay_cfg, RelayConfig(tls_cert=live / "client.pem", tls_key=live / "client.key", **up)
        ).start()
        try:
            wait_for(lambda: relay.mirror is not None and relay.mirror.written >= 1, 30)
        finally:
            relay.stop(0.2)
        bare = RelayServer(
            server_config(tmp_path / "relay-bare", None, grace_period_s=0.2), RelayConfig(**up)
        ).start()
        try:
            time.sleep(1.0)
            assert bare.mirror is not None and bare.mirror.written == 0
        finally:
            bare.stop(0.2)


def test_config_refuses_half_a_client_pair(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        ConsumerConfig("c", sidecars=("h:1",), tls_cert=tmp_path / "c.pem")
    with pytest.raises(ConfigError, match="token or token_file"):
        ConsumerConfig("c", sidecars=("h:1",), token="t", token_file=tmp_path / "t")
    with pytest.raises(ConfigError, match="upstream tls_cert"):
        RelayConfig(upstream="h:1", tls_key=tmp_path / "k")
    with pytest.raises(ConsumerError, match="cannot read TLS client key"):
        DeltaConsumer(
            ConsumerConfig(
                "c", sidecars=("h:1",), tls_cert=tmp_path / "no.pem", tls_key=tmp_path / "no"
            )
        )


def test_a_token_no_header_can_carry_is_refused_on_the_client_naming_its_file(
    tmp_path: Path,
) -> None:
    """Review 11: a token file with binary or non-ASCII bytes made `deltad status` print
    gRPC core's multi-line dump and "INTERNAL: Invalid metadata", blaming the server."""
    import subprocess
    import sys

    bad = tmp_path / "tok"
    bad.write_bytes(b"\xff\xfe s3cret\n")
    out = subprocess.run(
        [sys.executable, "-m", "deltad", "status", "--target", "127.0.0.1:1", "--token-file",
         str(bad)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"deltad status: error: token file {bad}: the token must be printable ASCII without "
        "spaces (a header carries it)"
    ]
    for token in ("héllo", "two words"):
        with pytest.raises(ConfigError, match="printable ASCII"):
            ClientAuth(token=token)


def test_certificates_rotate_without_a_restart(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole PKI is replaced (new CA): the sidecar reloads its files, a running consumer
    re-reads its own when they change and reconnects; nobody restarts."""
    monkeypatch.setattr(app, "CREDENTIALS_WATCH_S", 3600.0)  # reloads only when asked here
    live = tmp_path / "live"
    _install(pki / "a", live)
    with mtls_sidecar(tmp_path, redis_server.url, live) as srv:
        target = f"localhost:{srv.port}"
        with _consumer(target, live, retries=3) as c:
            first = c.pull()
            assert first.rows == 1500
            c.commit(first)
            _install(pki / "b", live)
            # the sidecar still holds CA a: a client of CA b is refused on a new connection
            assert "UNAVAILABLE" in c.pull().missing[0]
            assert srv.reload_credentials()  # what SIGHUP does in `deltad serve`
            # the consumer re-read its files and reconnected (once its channel's reconnect
            # backoff after the refused handshakes allows: about a second)
            wait_for(lambda: not c.pull().missing, 15, "a pull with the new certificates")
            # a client that still presents CA a's certificate is refused now
            old = grpc.ssl_channel_credentials(
                root_certificates=(live / "ca.pem").read_bytes(),
                private_key=(pki / "a" / "client.key").read_bytes(),
                certificate_chain=(pki / "a" / "client.pem").read_bytes(),
            )
            with grpc.secure_channel(target, old) as ch, pytest.raises(grpc.RpcError) as e:
                pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # a broken file is refused at reload: the good ones stay in force
        (live / "server.key").write_text("not a key\n")
        assert not srv.reload_credentials()
        with _consumer(target, live) as c:
            assert c.pull().rows == 1500


def test_the_sidecar_notices_rotated_files_by_itself(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path
) -> None:
    """A mounted secret is rewritten without a signal: within CREDENTIALS_WATCH_S the sidecar
    serves the new certificate; a broken file is reported once and the good one stays."""
    live = tmp_path / "live"
    _install(pki / "a", live)
    with mtls_sidecar(tmp_path, redis_server.url, live) as srv:
        target = f"localhost:{srv.port}"
        _install(pki / "b", live)
        with _consumer(target, live, retries=3) as c:
            wait_for(lambda: not c.pull().missing, 20, "a pull with the rotated certificates")
        (live / "server.key").write_text("not a key\n")
        wait_for(lambda: not srv.watch_credentials(), 10, "the broken key looked at")
        with _consumer(target, live) as c:
            assert c.pull().rows == 1500


def test_token_file_is_reread_when_it_changes(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    SpoolWriter(tmp_path / "spool")
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-1 pred consume\n")
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, tokens_file=tokens)
    ).start()
    mine = tmp_path / "my-token"
    mine.write_text("tok-1\n")
    try:
        cfg = ConsumerConfig(
            "pred", model="m", sidecars=(srv.endpoint,), token_file=mine, max_retries=0
        )
        with DeltaConsumer(cfg) as c:
            c.commit(c.pull())
            tokens.write_text("tok-2 pred consume\n")
            assert srv.reload_credentials()
            assert "UNAUTHENTICATED" in c.pull().missing[0]
            mine.write_text("tok-2\n")
            assert c.pull().missing == {}
        # deltad status reads its token from a file too (tok-2 may consume, not list others)
        assert deltad_main(["status", "--target", srv.endpoint, "--token-file", str(mine)]) == 0
        mine.write_text("tok-1\n")
        assert deltad_main(["status", "--target", srv.endpoint, "--token-file", str(mine)]) == 2
    finally:
        srv.stop(0)


@pytest.mark.slow
def test_a_reload_says_what_it_reloaded_and_leaves_unchanged_tls_files_alone(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    pki: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(app, "CREDENTIALS_WATCH_S", 3600.0)  # reloads only when asked here
    live = tmp_path / "live"
    _install(pki / "a", live)
    with mtls_sidecar(tmp_path, redis_server.url, live) as srv:

        def reloaded() -> list[str]:
            caplog.clear()
            with caplog.at_level("WARNING", logger="deltad.serve.edge.credentials"):
                assert srv.reload_credentials()
            return [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]

        assert reloaded() == []  # (SIGHUP with nothing changed: nothing to say)
        _install(pki / "b", live)
        assert reloaded() == ["TLS certificate, key and client CA reloaded (new connections)"]
        assert reloaded() == []


def test_deltad_serve_reloads_certificates_on_sighup(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path
) -> None:
    """The real CLI process: SIGHUP swaps its certificate for new connections."""
    live = tmp_path / "live"
    _install(pki / "a", live)
    SpoolWriter(tmp_path / "spool")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path / "spool"),
         "--model", "m", "--listen", "localhost:0", "--redis-url", redis_server.url,
         "--tls-cert", str(live / "server.pem"), "--tls-key", str(live / "server.key"),
         "--tls-client-ca", str(live / "ca.pem")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = line.strip().rsplit(":", 1)[-1]
        target = f"localhost:{port}"

        def status_ok(pkidir: Path) -> bool:
            creds = grpc.ssl_channel_credentials(
                root_certificates=(pkidir / "ca.pem").read_bytes(),
                private_key=(pkidir / "client.key").read_bytes(),
                certificate_chain=(pkidir / "client.pem").read_bytes(),
            )
            with grpc.secure_channel(target, creds) as ch:
                try:
                    pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=3)
                    return True
                except grpc.RpcError:
                    return False

        assert status_ok(pki / "a") and not status_ok(pki / "b")
        _install(pki / "b", live)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: status_ok(pki / "b"), 10)
        assert not status_ok(pki / "a")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    # logged (by SIGHUP, maybe by the file watcher first), never printed besides
    assert 1 <= err.count("TLS certificate, key and client CA reloaded") <= 2, err
    assert "deltad serve: credentials reloaded" not in err


@pytest.mark.slow  # two `deltad serve` subprocesses
def test_handshakes_of_clients_without_a_certificate_do_not_flood_the_sidecars_log(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path
) -> None:
    """gRPC's core logs each failed handshake (INFO, unthrottled) unless told otherwise:
    deltad sets GRPC_VERBOSITY=ERROR by default; INFO in the environment brings them back."""
    live = tmp_path / "live"
    _install(pki / "a", live)
    SpoolWriter(tmp_path / "spool")
    for verbosity, flooded in ((None, False), ("INFO", True)):
        env = {k: v for k, v in child_env().items() if k != "GRPC_VERBOSITY"}
        if verbosity is not None:
            env["GRPC_VERBOSITY"] = verbosity
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path / "spool"),
             "--model", "m", "--listen", "localhost:0", "--redis-url", redis_server.url,
             "--tls-cert", str(live / "server.pem"), "--tls-key", str(live / "server.key"),
             "--tls-client-ca", str(live / "ca.pem")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            port = proc.stdout.readline().strip().rsplit(":", 1)[-1]
            no_cert = grpc.ssl_channel_credentials(root_certificates=(live / "ca.pem").read_bytes())
            for _ in range(3):
                with (
                    grpc.secure_channel(f"localhost:{port}", no_cert) as ch,
                    pytest.raises(grpc.RpcError),
                ):
                    pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=2)
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        assert ("Handshake failed" in err) == flooded, (verbosity, err[-2000:])
