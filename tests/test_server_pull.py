"""GetDelta windows against a real sidecar and a real Redis: base, deltas, forms, commits."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import generate_latest
from serverkit import (
    Client,
    Replica,
    SpoolWriter,
    client,
    redis_server,
    server_config,
    sidecar,
    spool,
    wait_for,
)

from deltad.commands import status
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb

__all__ = ["client", "redis_server", "sidecar", "spool"]


def _synced(srv: SidecarServer, seq: int) -> None:
    wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq, what=f"seq {seq}")


def test_new_consumer_gets_base_then_deltas(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    rep = Replica()
    d = client.pull("c1")
    assert d.resync and d.from_seq == -1 and d.to_seq == 0 and d.generation == 1
    rep.apply(d)
    client.commit(d)
    for t in spool.specs:
        assert torch.equal(rep.tables[t], spool.truth[t])
    spool.delta()
    spool.delta()
    _synced(sidecar, 2)
    d = client.pull("c1")
    assert not d.resync and (d.from_seq, d.to_seq, d.to_step) == (0, 2, 20)
    assert d.rows <= 200 and d.rows > 50
    rep.apply(d)
    for t in spool.specs:
        assert torch.equal(rep.tables[t], spool.truth[t])
    # at-least-once: without a commit the same window comes again
    again = client.pull("c1")
    assert (again.from_seq, again.to_seq, again.rows) == (0, 2, d.rows)
    for a, b in zip(d.shards, again.shards, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.values, b.values)  # type: ignore[arg-type]
    client.commit(again)
    empty = client.pull("c1")
    assert empty.rows == 0 and empty.to_seq == 2 and not empty.resync


def test_ids_form_and_proto_decoder_match_raw(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    client.commit(client.pull("c"))
    touched = {"t0": [3, 7, 900], "t1": [1]}
    spool.delta(touched)
    spool.delta({"t0": [7, 8]})
    _synced(sidecar, 2)
    d = client.pull("c", Form.IDS)
    got = {s.shard.table: s.ids.tolist() for s in d.shards}
    assert got == {"t0": [3, 7, 8, 900], "t1": [1]}
    assert all(s.values is None for s in d.shards)
    raw = client.pull("c", Form.ROWS, raw=True, chunk_bytes=1)  # tiny chunks: many messages
    parsed = client.pull("c", Form.ROWS, raw=False)
    for a, b in zip(raw.shards, parsed.shards, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.values, b.values)  # type: ignore[arg-type]
        assert torch.equal(a.values, spool.truth[a.shard.table][a.ids])  # type: ignore[arg-type]


def test_wire_dtypes(spool: SpoolWriter, sidecar: SidecarServer, client: Client) -> None:
    exact = client.pull("q")
    for dtype, tol in ((WireDtype.FP16, 2e-3), (WireDtype.BF16, 1.6e-2), (WireDtype.INT8, 0.0)):
        d = client.pull("q", dtype=dtype)
        assert d.wire_dtype is dtype
        for a, b in zip(exact.shards, d.shards, strict=True):
            assert a.values is not None and b.values is not None
            assert b.values.dtype == torch.float32
            if dtype is WireDtype.INT8:
                span = a.values.amax(1, keepdim=True) - a.values.amin(1, keepdim=True)
                assert ((a.values - b.values).abs() <= span / 510 + 1e-6).all()
            else:
                assert torch.allclose(a.values, b.values, rtol=tol, atol=tol)


def test_max_step_bounds_the_window(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    client.commit(client.pull("s"))
    for _ in range(3):
        spool.delta()
    _synced(sidecar, 3)
    d = client.pull("s", max_step=25)  # steps are 10, 20, 30
    assert (d.to_seq, d.to_step) == (2, 20)
    client.commit(d)
    d = client.pull("s", max_step=25)
    assert (d.to_seq, d.rows) == (2, 0)
    assert client.pull("s").to_seq == 3


def test_two_ranks_with_column_shards_rebuild_the_tables(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    writers = [
        SpoolWriter(tmp_path / "spool", rank=r, world_size=2, col_split=2, seed=r) for r in (0, 1)
    ]
    servers = [
        SidecarServer(server_config(tmp_path / "spool", redis_server.url, rank=r)).start()
        for r in (0, 1)
    ]
    rep = Replica()
    try:
        ranks = servers[0].store.ranks()
        assert sorted(ranks) == [0, 1]
        clients = [Client(ranks[r]["endpoint"]) for r in (0, 1)]
        for w in writers:
            w.delta()
        for srv in servers:
            wait_for(lambda s=srv: s.log.snapshot().head.seq == 1)  # type: ignore[misc]
        for c in clients:
            d = c.pull("multi")
            assert len(d.shards) == 4  # 2 tables x 2 column slices
            assert {(s.shard.col_start, s.shard.col_end) for s in d.shards} == {
                (0, 4),
                (4, 8),
                (0, 2),
                (2, 4),
            }
            rep.apply(d)
            c.commit(d)
            c.close()
        for t in writers[0].specs:
            lo = writers[0].rows(t)[1]
            assert torch.equal(rep.tables[t][:lo], writers[0].truth[t][:lo])
            assert torch.equal(rep.tables[t][lo:], writers[1].truth[t][lo:])
    finally:
        for srv in servers:
            srv.stop(0)


def test_empty_spool_is_unavailable_until_the_base_arrives(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        with pytest.raises(grpc.RpcError) as e:
            c.pull("early")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no base" in str(e.value.details())
        assert c.stub.Status(pb.StatusRequest()).head_seq == -1
        spool = SpoolWriter(tmp_path / "spool")
        wait_for(lambda: srv.log.snapshot() is not None)
        rep = Replica()
        rep.apply(c.pull("early"))
        assert all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)
    finally:
        c.close()
        srv.stop(0)


def test_a_consumer_of_another_rank_only_is_not_lagging_on_this_one(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Per-rank relays share the model's consumer list: the relay of rank 1 (a cursor there,
    none on rank 0) is listed on rank 0 with lag -1 ("-") and no lag series (an alert on it
    would never clear); a consumer with no cursor anywhere is behind everywhere."""
    writers = [SpoolWriter(tmp_path / "spool", rank=r, world_size=2, seed=r) for r in (0, 1)]
    servers = [
        SidecarServer(server_config(tmp_path / "spool", redis_server.url, rank=r)).start()
        for r in (0, 1)
    ]
    try:
        for w in writers:
            w.delta()
            w.delta()
        for srv in servers:
            wait_for(lambda s=srv: s.log.snapshot().head.seq == 2)  # type: ignore[misc]
        ranks = servers[0].store.ranks()
        clients = [Client(ranks[r]["endpoint"]) for r in (0, 1)]
        clients[1].commit(clients[1].pull("relay-1"))  # rank 1 only
        clients[0].stub.Register(pb.RegisterRequest(consumer="fresh"))  # no cursor anywhere
        infos = {c.consumer: c for c in servers[0].servicer.consumer_infos()}
        assert infos["relay-1"].lag_segments == -1 and infos["relay-1"].live
        assert infos["fresh"].lag_segments == 3  # (head seq 2 + 1: a bootstrap owed)
        lag = servers[0].metrics.registry.get_sample_value
        labels = {"model": "m", "rank": "0"}
        assert lag("deltad_consumer_lag_segments", {**labels, "consumer": "relay-1"}) is None
        assert lag("deltad_consumer_lag_segments", {**labels, "consumer": "fresh"}) == 3
        on_rank1 = {c.consumer: c for c in servers[1].servicer.consumer_infos()}
        assert on_rank1["relay-1"].lag_segments == 0
        line = next(
            ln for ln in status.render(*status.fetch(ranks[0]["endpoint"])).splitlines()
            if "relay-1" in ln
        )  # fmt: skip
        assert line.split()[3] == "-", line
        for c in clients:
            c.close()
    finally:
        for srv in servers:
            srv.stop(0)


def test_lag_series_are_as_many_as_the_live_consumers_with_counts_and_the_worst_lag(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """A series per name ever registered grew until forget_after_s (7 days): 3,500 expired
    names made 3,500 series per gauge. Only live consumers have one; the counts and the
    largest lag of a live consumer say the rest."""
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    try:
        c = Client(f"127.0.0.1:{srv.port}")
        for i in range(40):  # gone in a second
            c.stub.Register(pb.RegisterRequest(consumer=f"card-{i}", lease_ttl_seconds=0.5))
        c.stub.Register(pb.RegisterRequest(consumer="live", lease_ttl_seconds=60))
        c.commit(c.pull("live"))
        c.stub.Register(pb.RegisterRequest(consumer="behind", lease_ttl_seconds=60))
        spool.delta()
        spool.delta()
        wait_for(lambda: srv.log.snapshot().head.seq == 2)  # type: ignore[union-attr]
        time.sleep(0.8)
        infos = {i.consumer: i for i in srv.servicer.consumer_infos()}
        assert len(infos) == 42 and not infos["card-0"].live
        assert infos["card-0"].lag_segments == 3  # (ListConsumers still says it)
        get = srv.metrics.registry.get_sample_value
        labels = {"model": "m", "rank": "0"}
        text = generate_latest(srv.metrics.registry).decode()
        assert text.count("deltad_consumer_lag_segments{") == 2, text  # live and behind
        assert get("deltad_consumer_lag_segments", {**labels, "consumer": "live"}) == 2
        assert get("deltad_consumer_lag_segments", {**labels, "consumer": "card-0"}) is None
        assert get("deltad_consumers", {**labels, "state": "live"}) == 2
        assert get("deltad_consumers", {**labels, "state": "expired"}) == 40
        assert get("deltad_consumer_lag_segments_max", labels) == 3  # (behind: nothing yet)
        assert (get("deltad_consumer_lag_max_seconds", labels) or 0) > 0
        c.close()
    finally:
        srv.stop(0)
