"""Top-k owes what it did not send: owed rows persist across pulls and converge exactly."""

from __future__ import annotations

import torch
from serverkit import Client, Replica, SpoolWriter, client, redis_server, sidecar, spool, wait_for

from deltad.consume.window import RankDelta
from deltad.serve.edge.app import SidecarServer
from deltad.types import Form

__all__ = ["client", "redis_server", "sidecar", "spool"]


def _synced(srv: SidecarServer, seq: int) -> None:
    wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq, what=f"seq {seq}")


def _equal(rep: Replica, spool: SpoolWriter) -> bool:
    return all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)


def _topk_sync(client: Client, consumer: str, rep: Replica) -> RankDelta:
    """One top-k pull (k = 10), applied and committed."""
    d = client.pull(consumer, Form.TOPK, k=10)
    rep.apply(d)
    client.commit(d)
    return d


def test_topk_converges_bit_exact_when_training_pauses(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    rep = Replica()
    d = client.pull("p", Form.TOPK, k=10)
    assert d.resync and d.rows == 1500  # a base window is always complete
    rep.apply(d)
    client.commit(d)
    for _ in range(3):
        spool.delta(n=60)
    _synced(sidecar, 3)
    d = client.pull("p", Form.TOPK, k=10)
    assert [s.ids.numel() for s in d.shards] == [10, 10]
    owed = {s.shard.table: s.owed for s in d.shards}
    assert all(o > 0 for o in owed.values())
    # the rows sent are the ones that moved most
    for s in d.shards:
        assert s.values is not None
        moved = (spool.truth[s.shard.table] - rep.tables[s.shard.table]).norm(dim=1)
        assert moved[s.ids].min() >= moved.sort(descending=True).values[9] - 1e-6
    rep.apply(d)
    client.commit(d)
    # without a commit, the owed set does not change: the same pull again
    again = client.pull("p", Form.TOPK, k=10)
    assert {s.shard.table: s.owed for s in again.shards} == {
        t: o - 10 for t, o in owed.items()
    } and not _equal(rep, spool)
    pulls = 0
    while True:
        d = client.pull("p", Form.TOPK, k=10)
        rep.apply(d)
        client.commit(d)
        pulls += 1
        if all(s.owed == 0 for s in d.shards):
            break
        assert pulls < 40
    assert _equal(rep, spool)
    assert sidecar.servicer.consumer_infos()[0].owed_rows == 0


def test_owed_rows_and_new_deltas_compete_with_fraction(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    rep = Replica()
    d = client.pull("f")
    rep.apply(d)
    client.commit(d)
    spool.delta(n=40)
    _synced(sidecar, 1)
    d = client.pull("f", Form.TOPK, fraction=0.25)
    assert [s.ids.numel() for s in d.shards] == [10, 10] and [s.owed for s in d.shards] == [30, 30]
    rep.apply(d)
    client.commit(d)
    # a row owed from before is touched again: it is still sent (once), at its head value
    lo_owed = next(
        i for i in range(1000) if not torch.equal(rep.tables["t0"][i], spool.truth["t0"][i])
    )
    spool.delta({"t0": [lo_owed, 999]})
    _synced(sidecar, 2)
    listed = sidecar.servicer.consumer_infos()
    assert listed[0].owed_rows == 60
    # ROWS form serves every owed row plus the window
    d = client.pull("f", Form.ROWS)
    assert sum(s.owed for s in d.shards) == 0
    rep.apply(d)
    client.commit(d)
    assert _equal(rep, spool)


def test_max_rows_caps_a_rows_pull_and_keeps_the_rest_owed(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    rep = Replica()
    d = client.pull("m", max_rows=5)
    assert d.rows == 1500  # base: complete
    rep.apply(d)
    client.commit(d)
    spool.delta(n=20)
    _synced(sidecar, 1)
    seen = 0
    for _ in range(20):
        d = client.pull("m", max_rows=7)
        assert d.rows <= 7
        seen += d.rows
        rep.apply(d)
        client.commit(d)
        if d.rows == 0:
            break
    assert seen == 40 and _equal(rep, spool)


def test_a_forgotten_consumer_loses_its_owed_rows_and_comes_back_new(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    import os
    import time

    from deltad.v1 import delta_pb2 as pb

    client.stub.Register(pb.RegisterRequest(consumer="gone", lease_ttl_seconds=1))
    client.stub.Register(pb.RegisterRequest(consumer="stays", lease_ttl_seconds=60))
    for name in ("gone", "stays"):
        client.commit(client.pull(name, Form.TOPK, k=10))
    for _ in range(2):
        spool.delta(n=60)
    _synced(sidecar, 2)
    for name in ("gone", "stays"):
        d = client.pull(name, Form.TOPK, k=10)
        assert all(s.owed > 0 for s in d.shards)
        client.commit(d)
    owed_dir = sidecar.owed.root
    files = {n: list((owed_dir / n).iterdir()) for n in ("gone", "stays")}
    assert all(files.values())
    old = time.time() - 7200  # as if written long ago (young files are spared)
    for f in (f for fs in files.values() for f in fs):
        os.utime(f, (old, old))
    sidecar.servicer.consumer_infos()  # sets the lag gauges of both
    lag = sidecar.metrics.registry.get_sample_value
    labels = {"model": "m", "rank": "0"}
    assert lag("deltad_consumer_lag_segments", {**labels, "consumer": "gone"}) == 0
    sidecar.config.forget_after_s = 0.5
    assert sidecar.forget_idle() == []  # "gone" still holds its lease
    wait_for(lambda: sidecar.store.lease_remaining(["gone"])["gone"] == 0, what="lease expiry")
    time.sleep(0.6)
    assert sidecar.forget_idle() == ["gone"]
    assert not (owed_dir / "gone").exists()
    assert all(f.exists() for f in files["stays"])
    assert [c.consumer for c in sidecar.servicer.consumer_infos()] == ["stays"]
    # no lag series left for a forgotten consumer (alerts on it would never clear)
    assert lag("deltad_consumer_lag_segments", {**labels, "consumer": "gone"}) is None
    assert lag("deltad_consumer_lag_seconds", {**labels, "consumer": "gone"}) is None
    assert lag("deltad_consumer_lag_segments", {**labels, "consumer": "stays"}) == 0
    # back again, "gone" is a new consumer: the whole current tables, nothing owed
    rep = Replica()
    d = client.pull("gone", Form.TOPK, k=10)
    assert d.resync and d.rows == 1500 and all(s.owed == 0 for s in d.shards)
    rep.apply(d)
    assert _equal(rep, spool)


def test_a_repeated_commit_keeps_the_newer_pulls_owed_rows(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    """Commit A, pull B, commit A again (a retry), commit B: B's owed rows survive, pulls go
    on and converge (the repeat once deleted B's owed file: every later pull failed)."""
    rep = Replica()
    _topk_sync(client, "retry", rep)
    spool.delta(n=60)
    _synced(sidecar, 1)
    a = _topk_sync(client, "retry", rep)
    spool.delta(n=60)
    _synced(sidecar, 2)
    b = client.pull("retry", Form.TOPK, k=10)
    assert sum(s.owed for s in b.shards) > 0
    client.commit(a)  # the retry of an acknowledged commit
    rep.apply(b)
    client.commit(b)
    for _ in range(40):
        d = _topk_sync(client, "retry", rep)
        assert not d.resync
        if all(s.owed == 0 for s in d.shards):
            break
    assert _equal(rep, spool)


def test_lost_owed_rows_resync_the_consumer(
    spool: SpoolWriter, sidecar: SidecarServer, client: Client
) -> None:
    """The owed file of a committed top-k pull is gone: the next pull sends the full tables
    (a resync), never a window without the owed rows, and never an error forever."""
    rep = Replica()
    _topk_sync(client, "lost", rep)
    spool.delta(n=60)
    _synced(sidecar, 1)
    d = _topk_sync(client, "lost", rep)
    assert sum(s.owed for s in d.shards) > 0
    for f in (sidecar.layout.sidecar_dir / "owed" / "lost").iterdir():
        f.unlink()
    d = client.pull("lost", Form.TOPK, k=10)
    assert d.resync and d.rows == 1500 and all(s.owed == 0 for s in d.shards)
    rep.apply(d)
    client.commit(d)
    assert _equal(rep, spool)
