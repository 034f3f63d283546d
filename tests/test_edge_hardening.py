"""Every flag and input checked, at the gRPC edge (issue 23, item 3): garbage to the open
health service, echoed fields bounded, no absolute paths in a client's error details.
A real sidecar and a real Redis."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from serverkit import Client, SpoolWriter, server_config

from deltad import wire
from deltad.redisutil import EmbeddedRedis
from deltad.serve.edge.app import SidecarServer
from deltad.serve.edge.grpcutil import MAX_DETAILS, public_details
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def test_garbage_to_the_health_check_is_invalid_argument_with_one_log_line(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    caplog.set_level(logging.INFO)
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            codes = set()
            for payload in (b"\xff" * 40, b"\x0a\xff\xff\x7f", b"\x08" + b"\xff" * 11) * 10:
                for method, call in (
                    ("Check", ch.unary_unary("/grpc.health.v1.Health/Check")),
                    ("Watch", ch.unary_stream("/grpc.health.v1.Health/Watch")),
                ):
                    try:
                        out = call(payload, timeout=5)
                        if method == "Watch":
                            next(iter(out))  # type: ignore[call-overload]
                    except grpc.RpcError as e:
                        codes.add(e.code())
            assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
            ok = ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
            assert ok == b"\x08\x01"  # a valid empty request still answers SERVING
    finally:
        srv.stop(0)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "malformed" in lines[0].getMessage(), lines
    assert not [r for r in caplog.records if r.exc_info]


def test_a_huge_pull_id_gets_a_bounded_error_not_resource_exhausted(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(srv.endpoint)
    try:
        d = c.pull("c")
        for pull_id in ("p" * 100_000, "q" * 100):  # too long; the right length, unknown
            cursor = wire.cursor_to_pb(d.cursor)
            cursor.pull_id = pull_id
            with pytest.raises(grpc.RpcError) as err:
                c.stub.Commit(pb.CommitRequest(consumer="c", cursor=cursor), timeout=10)
            assert err.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ), err.value
            assert len(err.value.details() or "") < 400
    finally:
        c.close()
        srv.stop(0)


def test_error_details_to_clients_carry_no_absolute_paths_and_are_bounded() -> None:
    msg = "cannot read /etc/deltad/tokens and /spool/m/gen-1/rank-0/seg-7: unix:///run/r.sock"
    out = public_details(msg)
    assert "/etc/deltad" not in out and "/spool/m" not in out and "/run/" not in out, out
    assert ".../tokens" in out and ".../seg-7" in out
    assert len(public_details("x" * 100_000)) <= MAX_DETAILS
    assert public_details("rank 3 of 4: step 10/20 ok") == "rank 3 of 4: step 10/20 ok"


def test_a_refusal_names_no_tokens_file_path_to_the_client(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The grant's source (tokens file and line) stays in the server's log."""
    SpoolWriter(tmp_path / "spool")
    tokens = tmp_path / "secret-dir" / "tokens"
    tokens.parent.mkdir()
    tokens.write_text("alice-token alice consume\n")
    cfg = server_config(tmp_path / "spool", redis_server.url, tokens_file=tokens)
    srv = SidecarServer(cfg).start()
    c = Client(srv.endpoint, token="alice-token")
    caplog.set_level(logging.INFO)
    try:
        with pytest.raises(grpc.RpcError) as err:
            c.pull("bob")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = err.value.details() or ""
        assert "tokens" in details and str(tmp_path) not in details, details
        assert any(str(tokens) in r.getMessage() for r in caplog.records)  # the log has it
    finally:
        c.close()
        srv.stop(0)
