"""Commit, leases, generations and bad input through the real gRPC service."""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest
import torch
from serverkit import Client, Replica, SpoolWriter, client, redis_server, sidecar, spool, wait_for

from deltad import wire
from deltad.consume import decode
from deltad.serve.edge.app import SidecarServer
from deltad.types import Form
from deltad.v1 import delta_pb2 as pb

__all__ = ["client", "redis_server", "sidecar", "spool"]


def _code(fn: object, *args: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args)  # type: ignore[operator]
    assert e.value.details()  # every refusal says why
    return e.value.code()  # type: ignore[no-any-return]


def test_commit_is_forward_only_and_issued_by_this_server(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    stub = client.stub
    # unknown consumer
    ghost = pb.Cursor(consumer="ghost", rank=0, generation=1, seq=0, step=0, pull_id="x")
    assert _code(stub.Commit, pb.CommitRequest(consumer="ghost", cursor=ghost)) == (
        grpc.StatusCode.NOT_FOUND
    )
    d0 = client.pull("a")
    resp = client.commit(d0)
    assert resp.committed.seq == 0 and resp.committed.pull_id == d0.cursor.pull_id
    assert client.commit(d0).committed.seq == 0  # idempotent
    spool.delta()
    wait_for(lambda: sidecar.log.snapshot().head.seq == 1)  # type: ignore[union-attr]
    d1 = client.pull("a")
    # someone else's cursor
    foreign = pb.CommitRequest(consumer="b", cursor=wire.cursor_to_pb(d1.cursor))
    assert _code(stub.Commit, foreign) == grpc.StatusCode.PERMISSION_DENIED
    # a forged seq on a real pull id
    forged = wire.cursor_to_pb(dataclasses.replace(d1.cursor, seq=5))
    req = pb.CommitRequest(consumer="a", cursor=forged)
    assert _code(stub.Commit, req) == grpc.StatusCode.FAILED_PRECONDITION
    # an unknown pull id
    req = pb.CommitRequest(
        consumer="a", cursor=wire.cursor_to_pb(dataclasses.replace(d1.cursor, pull_id="nope"))
    )
    assert _code(stub.Commit, req) == grpc.StatusCode.FAILED_PRECONDITION
    # another generation
    req = pb.CommitRequest(
        consumer="a", cursor=wire.cursor_to_pb(dataclasses.replace(d1.cursor, generation=0))
    )
    assert _code(stub.Commit, req) == grpc.StatusCode.FAILED_PRECONDITION
    # a superseded pull: d1 is replaced by d2 (same window)
    d2 = client.pull("a")
    assert _code(client.commit, d1) == grpc.StatusCode.FAILED_PRECONDITION
    assert client.commit(d2).committed.seq == 1
    # the older, already replaced cursor cannot move it back
    assert _code(client.commit, d0) == grpc.StatusCode.FAILED_PRECONDITION
    assert sidecar.store.get_cursor("a", 0).seq == 1  # type: ignore[union-attr]


def test_auto_commit_and_register_heartbeat(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    stub = client.stub
    r = stub.Register(pb.RegisterRequest(consumer="auto", lease_ttl_seconds=5))
    assert r.cursor.seq == -1 and r.lease_ttl_seconds == 5
    d = client.pull("auto", auto_commit=True)
    assert d.committed and sidecar.store.get_cursor("auto", 0).seq == 0  # type: ignore[union-attr]
    assert 0 < stub.Heartbeat(pb.HeartbeatRequest(consumer="auto")).lease_expires_in_seconds <= 5
    assert _code(stub.Heartbeat, pb.HeartbeatRequest(consumer="nobody")) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert stub.Register(pb.RegisterRequest(consumer="auto")).cursor.seq == 0
    infos = {c.consumer: c for c in stub.ListConsumers(pb.ListConsumersRequest()).consumers}
    assert infos["auto"].live and infos["auto"].lag_segments == 0
    spool.delta()
    spool.delta()
    wait_for(lambda: sidecar.log.snapshot().head.seq == 2)  # type: ignore[union-attr]
    infos = {c.consumer: c for c in stub.ListConsumers(pb.ListConsumersRequest()).consumers}
    assert infos["auto"].lag_segments == 2 and infos["auto"].lag_seconds >= 0
    st = stub.Status(pb.StatusRequest())
    assert (st.model, st.generation, st.rank, st.world_size) == ("m", 1, 0, 1)
    assert (st.head_seq, st.head_step, st.base_seq, st.segments) == (2, 20, 0, 3)
    assert st.log_bytes > 0 and st.quarantined == 0
    t0 = next(t for t in st.tables if t.table == "t0")
    assert (t0.num_rows, t0.dim, t0.dtype) == (1000, 8, "float32")
    assert [(s.col_start, s.col_end, s.count) for s in t0.local_slices] == [(0, 8, 1000)]
    # discovery: the sidecar registered its endpoint
    assert sidecar.store.ranks()[0]["endpoint"] == f"127.0.0.1:{sidecar.port}"


def test_new_generation_means_resync_never_cross_generation_deltas(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    rep = Replica()
    d = client.pull("g")
    rep.apply(d)
    client.commit(d)
    spool.delta()
    wait_for(lambda: sidecar.log.snapshot().head.seq == 1)  # type: ignore[union-attr]
    stale = client.pull("g")  # a gen-1 pull not committed before the switch
    spool.start_generation(2, start_step=100)
    spool.delta()
    wait_for(lambda: sidecar.log.snapshot().generation == 2)  # type: ignore[union-attr]
    wait_for(lambda: sidecar.log.snapshot().head.seq == 1)  # type: ignore[union-attr]
    assert _code(client.commit, stale) == grpc.StatusCode.FAILED_PRECONDITION
    d = client.pull("g")
    # the sidecar holds generation 1's log: a generation diff against the committed cursor
    # (every row: the new tables are fresh), never a delta of generation 1's seqs
    assert d.generation_diff == 1 and not d.resync
    assert d.generation == 2 and d.from_seq == -1 and d.to_seq == 1
    rep.apply(d)
    client.commit(d)
    assert all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)
    assert not spool.layout.rank_dir(1, 0).exists()  # the old generation's log is gone


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"consumer": "bad name!"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"consumer": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"consumer": "ok\n"}, grpc.StatusCode.INVALID_ARGUMENT),  # no trailing newline
        ({"consumer": "x" * 1_000_000}, grpc.StatusCode.INVALID_ARGUMENT),  # echo is clipped
        ({"tables": [f"t{i}" for i in range(20_000)]}, grpc.StatusCode.NOT_FOUND),
        ({"form": pb.FORM_TOPK}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"form": pb.FORM_TOPK, "fraction": 1.5}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"form": pb.FORM_TOPK, "fraction": -0.1}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"form": pb.FORM_TOPK, "fraction": math.nan}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"form": pb.FORM_TOPK, "k": 2**62}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"form": 42}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"dtype": 42}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"tables": ["nope"]}, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_requests_are_refused_and_the_server_keeps_serving(
    sidecar: SidecarServer, client: Client, kwargs: dict[str, object], code: grpc.StatusCode
) -> None:
    req = pb.GetDeltaRequest(**{"consumer": "ok", **kwargs})  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as e:
        decode.pull(client.channel, req, timeout=10)
    assert e.value.code() == code, e.value.details()
    assert 0 < len(e.value.details() or "") < 2000  # a message, never the whole input back
    assert client.pull("ok", Form.IDS).rows == 1500


def test_oversized_request_and_bad_commit_input(sidecar: SidecarServer, client: Client) -> None:
    huge = pb.GetDeltaRequest(consumer="ok", tables=["x" * 1000] * 20000)  # ~20 MB
    assert _code(lambda: decode.pull(client.channel, huge, timeout=10)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    bad = pb.CommitRequest(consumer="no way", cursor=pb.Cursor(consumer="no way"))
    assert _code(client.stub.Commit, bad) == grpc.StatusCode.INVALID_ARGUMENT
    foreign = pb.CommitRequest(consumer="c", cursor=pb.Cursor(consumer="y" * 1_000_000))
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Commit(foreign, timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert len(e.value.details() or "") < 2000
    other_rank = pb.CommitRequest(consumer="c", cursor=pb.Cursor(consumer="c", rank=3))
    assert _code(client.stub.Commit, other_rank) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.pull("ok", Form.IDS).rows == 1500


def test_from_base_resyncs_and_never_ends_behind_the_cursor(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    """GetDelta(from_base): the full tables whatever the cursor says, and never a window
    ending before the committed cursor (its commit would be refused, leaving old tables)."""
    client.commit(client.pull("fb"))
    spool.delta()
    spool.delta()
    wait_for(lambda: sidecar.log.snapshot().head.seq == 2)  # type: ignore[union-attr]
    d = client.pull("fb")
    client.commit(d)
    assert d.to_seq == 2
    rep = Replica()
    again = client.pull("fb", from_base=True, max_step=10)  # asks for less than it holds
    assert again.resync and again.from_seq == -1 and again.to_seq == 2
    rep.apply(again)
    assert client.commit(again).committed.seq == 2
    assert all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)
    assert client.pull("fb").rows == 0  # and then only what changes
