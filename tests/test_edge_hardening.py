"""Every flag and input checked, at the gRPC edge (issue 23, item 3): garbage to the open
health service, echoed fields bounded, no absolute paths in a client's error details.
A real sidecar and a real Redis."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from serverkit import Client, SpoolWriter, server_config, wait_for

from deltad import wire
from deltad.serve.edge.app import SidecarServer
from deltad.serve.edge.grpcutil import MAX_DETAILS, public_details
from deltad.store import EmbeddedRedis
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
            watch = ch.unary_stream("/grpc.health.v1.Health/Watch")(b"", timeout=5)
            assert next(iter(watch)) == b"\x08\x01"  # and Watch still streams
            watch.cancel()  # type: ignore[attr-defined]
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
        for req in (  # any other echoed field: bounded too
            pb.GetDeltaRequest(consumer="c", tables=["t" * 100_000]),
            pb.GetDeltaRequest(consumer="c", tables=[f"t{i}" * 50 for i in range(2000)]),
        ):
            with pytest.raises(grpc.RpcError) as err:
                for _ in c.stub.GetDelta(req, timeout=10):
                    pass
            assert err.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert len(err.value.details() or "") <= 1000
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


def test_owed_rows_are_bounded_per_consumer_and_in_total_and_counted(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Top-k consumers leave owed-row files in the spool: one credential naming many
    consumers could fill the trainer's disk. Past either budget a pull is refused with
    RESOURCE_EXHAUSTED, nothing is written, and the metrics count it."""
    from deltad.types import Form

    spool = SpoolWriter(tmp_path / "spool", tables={"t0": (4000, 16)})
    cfg = server_config(tmp_path / "spool", redis_server.url)
    probe = SidecarServer(cfg).start()  # how big one consumer's owed file is
    c = Client(probe.endpoint)
    try:
        for name in ("first", "second", "third"):  # bootstrapped: a cursor at the base
            c.commit(c.pull(name, Form.TOPK, k=10))
        seq = spool.delta(n=3000)
        wait_for(lambda: (x := probe.log.snapshot()) is not None and x.head.seq == seq)
        c.pull("first", Form.TOPK, k=10)
        one = probe.owed.nbytes
        assert one > 0 and probe.owed.files == 1
    finally:
        c.close()
        probe.stop(0)
    cfg = server_config(
        tmp_path / "spool", redis_server.url, owed_max_bytes=int(one * 2.5),
        owed_max_consumer_bytes=int(one * 1.5),
    )  # fmt: skip
    srv = SidecarServer(cfg).start()
    c = Client(srv.endpoint)
    try:
        assert srv.owed.nbytes == one  # counted from the disk after a restart
        c.pull("second", Form.TOPK, k=10)
        with pytest.raises(grpc.RpcError) as err:
            c.pull("third", Form.TOPK, k=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "owed" in (err.value.details() or "")
        assert srv.owed.files == 2 and srv.owed.nbytes <= cfg.owed_max_bytes
        assert not (srv.layout.sidecar_dir / "owed" / "third").exists()
        c.pull("fourth", Form.ROWS)  # owes nothing: still served
        refused = srv.metrics.registry.get_sample_value(
            "deltad_owed_refused_total", {"model": "m", "rank": "0"}
        )
        assert refused == 1
    finally:
        c.close()
        srv.stop(0)


def test_one_consumers_owed_files_are_bounded_on_their_own(tmp_path: Path) -> None:
    import torch

    from deltad.errors import OwedBudgetError
    from deltad.segment.format import ShardRows
    from deltad.serve.state.owed import OwedStore
    from deltad.types import Shard

    shard = Shard("t", 1000, 8, 0, 1000, 0, 8)
    rows = ShardRows(shard, torch.arange(500), torch.ones(500, 8))
    need = 500 * 8 + 500 * 8 * 4 + 4096
    store = OwedStore(tmp_path, "m", 0, max_consumer_bytes=int(need * 1.5))
    store.save("alice", "a1", 1, 1, {rows.key: rows})
    with pytest.raises(OwedBudgetError, match="alice"):
        store.save("alice", "a2", 1, 2, {rows.key: rows})
    store.save("bob", "b1", 1, 1, {rows.key: rows})  # another consumer has its own budget
    store.gc("alice", set())  # alice's files gone: room again
    store.save("alice", "a3", 1, 3, {rows.key: rows})
    assert store.files == 2 and store.refused == 1
