"""GetDelta windows against a real sidecar and a real Redis: base, deltas, forms, commits."""

from __future__ import annotations

import torch
from serverkit import Client, Replica, SpoolWriter, client, redis_server, sidecar, spool, wait_for

from deltad.server.app import SidecarServer
from deltad.types import Form, WireDtype

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
    for a, b in zip(d.slices, again.slices, strict=True):
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
    got = {s.table: s.ids.tolist() for s in d.slices}
    assert got == {"t0": [3, 7, 8, 900], "t1": [1]}
    assert all(s.values is None for s in d.slices)
    raw = client.pull("c", Form.ROWS, raw=True, chunk_bytes=1)  # tiny chunks: many messages
    parsed = client.pull("c", Form.ROWS, raw=False)
    for a, b in zip(raw.slices, parsed.slices, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.values, b.values)  # type: ignore[arg-type]
        assert torch.equal(a.values, spool.truth[a.table][a.ids])  # type: ignore[arg-type]


def test_wire_dtypes(spool: SpoolWriter, sidecar: SidecarServer, client: Client) -> None:
    exact = client.pull("q")
    for dtype, tol in ((WireDtype.FP16, 2e-3), (WireDtype.BF16, 1.6e-2), (WireDtype.INT8, 0.0)):
        d = client.pull("q", dtype=dtype)
        assert d.wire_dtype is dtype
        for a, b in zip(exact.slices, d.slices, strict=True):
            assert a.values is not None and b.values is not None
            assert b.values.dtype == torch.float32
            if dtype is WireDtype.INT8:
                span = a.values.amax(1, keepdim=True) - a.values.amin(1, keepdim=True)
                assert ((a.values - b.values).abs() <= span / 510 + 1e-6).all()
            else:
                assert torch.allclose(a.values, b.values, rtol=tol, atol=tol)
