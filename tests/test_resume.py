"""GetDeltaRequest.resume on the wire: a resync stream asked to go on after K messages is the
whole stream's tail, byte for byte (built again or from the window cache, fp32 or packed);
any other window is served from its start and says so (resumed_messages 0); a resume past the
window's end or with bad fields is refused. Real sidecars, real Redis, raw gRPC streams."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from serverkit import MODEL, Client, Replica, SpoolWriter, resumed, server_config, wait_for
from spoolkit import FakeTrainer, ZchWriter
from test_dense import _state, _write_dense
from test_relay import db, status

from bench.netproxy import DroppingProxy
from deltad import wire
from deltad.config import ConsumerConfig, PullOptions, RelayConfig
from deltad.consume import decode
from deltad.consume.appliers import TensorDictApplier, _TensorStage
from deltad.consume.client import DeltaConsumer
from deltad.consume.window import ShardUpdate
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.serve.windows.request import MIN_CHUNK_BYTES
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def _spool(root: Path, deltas: int = 3) -> SpoolWriter:
    w = SpoolWriter(root, tables={"t0": (20_000, 16), "t1": (3000, 8)})
    for _ in range(deltas):
        w.delta(n=500)
    return w


def _serve(root: Path, redis_url: str, cache: bool = True, **kw: object) -> SidecarServer:
    """A sidecar sending 64 kB messages (``cache`` False: windows built for each stream)."""
    if not cache:
        kw["window_cache_bytes"] = 0
    cfg = server_config(root, redis_url, chunk_bytes=MIN_CHUNK_BYTES, **kw)
    return SidecarServer(cfg).start()


def _request(consumer: str, dtype: WireDtype = WireDtype.FP32, **kw: object) -> pb.GetDeltaRequest:
    return pb.GetDeltaRequest(
        consumer=consumer, form=wire.form_to_pb(Form.ROWS), dtype=wire.dtype_to_pb(dtype), **kw
    )


def _consumer(name: str, *endpoints: str, **kw: Any) -> ConsumerConfig:
    """A consumer of ``endpoints`` (one per rank) with short backoffs; ``kw`` overrides."""
    opts: dict[str, Any] = {
        "rpc_deadline_s": 10.0, "max_retries": 2, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.2,
    }  # fmt: skip
    opts.update(kw)
    return ConsumerConfig(consumer=name, model=MODEL, sidecars=endpoints, **opts)


def _stream(srv: SidecarServer, req: pb.GetDeltaRequest) -> list[bytes]:
    with grpc.insecure_channel(srv.endpoint) as ch:
        return list(decode.raw_get_delta(ch)(req, timeout=30))


def _header(msg: bytes) -> pb.DeltaHeader:
    m = pb.GetDeltaResponse.FromString(msg)
    assert m.WhichOneof("msg") == "header"
    return m.header


def _resume(h: pb.DeltaHeader, messages: int) -> pb.StreamResume:
    return pb.StreamResume(
        generation=h.generation, from_seq=h.from_seq, to_seq=h.to_seq, messages=messages
    )


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "built"])
@pytest.mark.parametrize("dtype", [WireDtype.FP32, WireDtype.PACKED_INT8])
@pytest.mark.parametrize("deltas", [3, 0], ids=["merged", "base-only"])
def test_a_resumed_resync_stream_is_the_tail_of_the_whole_stream(
    tmp_path: Path, redis_url: str, cache: bool, dtype: WireDtype, deltas: int
) -> None:
    """Resumed after k messages (in a shard, at a shard's end, in the dense state, at the
    end), from a window in the cache or one built for that stream alone (which leaves the
    first k messages out unbuilt), merged from a base and deltas or a base alone: the whole
    stream's tail, byte for byte."""
    w = _spool(tmp_path, deltas)
    _write_dense(w, _state(3))
    step = w.step
    srv = _serve(tmp_path, redis_url, cache)
    try:
        whole = _stream(srv, _request("a", dtype, max_step=step, with_dense=True))
        h = _header(whole[0])
        assert h.resync and h.resumed_messages == 0 and h.to_step == step
        assert h.HasField("dense") and len(h.slices) == 2
        body = whole[1:-1]
        kinds = [pb.GetDeltaResponse.FromString(m).WhichOneof("msg") for m in body]
        first_dense = kinds.index("dense")
        t0_end = sum(
            pb.GetDeltaResponse.FromString(m).chunk.slice == 0 for m in body if m[:1] == b"\x12"
        )
        assert len(body) >= 12 and 0 < t0_end < first_dense < len(body) - 2
        for k in (1, 5, t0_end, first_dense + 2, len(body) - 1, len(body)):
            got = _stream(
                srv,
                _request(f"b{k}", dtype, max_step=step, with_dense=True, resume=_resume(h, k)),
            )
            gh = _header(got[0])
            assert gh.resumed_messages == k
            gh.resumed_messages = 0
            assert gh == h  # the same window (and the same reason: no cursor)
            assert got[1:-1] == body[k:], k  # byte for byte
            trailer = pb.GetDeltaResponse.FromString(got[-1]).trailer
            assert trailer.cursor.seq == h.to_seq and trailer.rows == sum(s.count for s in h.slices)
        assert resumed(srv)[0] == 6
    finally:
        srv.stop(0.5)


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "built"])
def test_a_resumed_managed_collision_window_is_the_tail_too(
    tmp_path: Path, redis_url: str, cache: bool
) -> None:
    """A managed-collision table (raw ids with every row, evictions in the deltas) beside an
    ordinary one: resumed anywhere, the tail byte for byte."""
    w = ZchWriter(tmp_path, mc={"zch": (6000, 8)}, tables={"t0": (4000, 8)})
    for _ in range(3):
        w.delta(n=300)
    srv = _serve(tmp_path, redis_url, cache)
    try:
        whole = _stream(srv, _request("a", max_step=w.step))
        h = _header(whole[0])
        assert h.resync and any(s.identities for s in h.slices)
        body = whole[1:-1]
        assert len(body) >= 6
        for k in range(1, len(body) + 1):
            got = _stream(srv, _request(f"b{k}", max_step=w.step, resume=_resume(h, k)))
            assert _header(got[0]).resumed_messages == k
            assert got[1:-1] == body[k:], k
    finally:
        srv.stop(0.5)


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "built"])
def test_a_resumed_incremental_window_is_the_tail_and_top_k_is_not_resumed(
    tmp_path: Path, redis_url: str, cache: bool
) -> None:
    """A complete window from a committed cursor (the rows changed since, a predictor far
    behind) goes on where it broke like a resync; a top-k window, built from the values, is
    served from its start."""
    w = _spool(tmp_path, deltas=0)
    srv = _serve(tmp_path, redis_url, cache)
    try:
        c = Client(srv.endpoint)
        try:
            for name in ("rows", "topk"):
                c.commit(c.pull(name))
        finally:
            c.close()
        for _ in range(6):
            w.delta(n=3000)
        wait_for(lambda: status(srv.endpoint).head_seq == 6, 10, "the sidecar at seq 6")
        whole = _stream(srv, _request("rows", max_step=w.step))
        h = _header(whole[0])
        assert not h.resync and h.from_seq == 0 and h.to_seq == 6
        body = whole[1:-1]
        assert len(body) >= 5
        for k in (1, len(body) // 2, len(body)):
            got = _stream(srv, _request("rows", max_step=w.step, resume=_resume(h, k)))
            assert _header(got[0]).resumed_messages == k
            assert got[1:-1] == body[k:], k
        topk = _request("topk", max_step=w.step, k=5000)
        topk.form = wire.form_to_pb(Form.TOPK)
        first = _stream(srv, topk)
        th = _header(first[0])
        assert not th.resync and th.from_seq == 0
        topk.resume.CopyFrom(_resume(th, 1))
        got = _stream(srv, topk)
        assert _header(got[0]).resumed_messages == 0 and len(got) == len(first)
    finally:
        srv.stop(0.5)


def test_any_other_window_is_served_from_its_start(tmp_path: Path, redis_url: str) -> None:
    """The head moved past the window (no max_step), another generation, an incremental
    window: resumed_messages 0 and the whole window."""
    w = _spool(tmp_path)
    srv = _serve(tmp_path, redis_url)
    try:
        first = _stream(srv, _request("a", max_step=20))
        h = _header(first[0])
        assert h.to_step == 20
        for req in (
            _request("b", resume=_resume(h, 2)),  # up to the head: seq 3, not 2
            _request("c", max_step=20, resume=pb.StreamResume(generation=9, to_seq=2, messages=2)),
        ):
            got = _stream(srv, req)
            gh = _header(got[0])
            assert gh.resumed_messages == 0
            assert len(got) >= len(first) - 1  # all of it
            decode.decode_stream(got)  # complete
        # the resync's resume asked of an incremental window (a committed cursor): not it
        c = Client(srv.endpoint)
        try:
            c.commit(c.pull("d", max_step=20))
        finally:
            c.close()
        w.delta(n=100)
        got = _stream(srv, _request("d", resume=_resume(h, 1)))
        gh = _header(got[0])
        assert not gh.resync and gh.resumed_messages == 0
        d = decode.decode_stream(got)
        assert d.rows > 0 and d.from_seq == h.to_seq
    finally:
        srv.stop(0.5)


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "built"])
def test_a_resume_past_the_end_or_with_bad_fields_is_refused(
    tmp_path: Path, redis_url: str, cache: bool
) -> None:
    _spool(tmp_path)
    srv = _serve(tmp_path, redis_url, cache)
    try:
        whole = _stream(srv, _request("a", max_step=30))
        h = _header(whole[0])
        n = len(whole) - 2
        with pytest.raises(grpc.RpcError) as e:
            _stream(srv, _request("b", max_step=30, resume=_resume(h, n + 1)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the window has fewer" in (e.value.details() or "")
        for bad in (
            pb.StreamResume(generation=h.generation, to_seq=h.to_seq, messages=0),
            pb.StreamResume(generation=h.generation, to_seq=-1, messages=1),
            pb.StreamResume(generation=h.generation, from_seq=5, to_seq=h.to_seq, messages=1),
            pb.StreamResume(generation=h.generation, from_seq=-2, to_seq=h.to_seq, messages=1),
            pb.StreamResume(generation=h.generation, to_seq=h.to_seq, messages=(1 << 40) + 1),
        ):
            with pytest.raises(grpc.RpcError) as e:
                _stream(srv, _request("c", max_step=30, resume=bad))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "resume needs" in (e.value.details() or "")
        # nothing of those was recorded as the consumers' cursors
        assert _header(_stream(srv, _request("c", max_step=30))[0]).resync
    finally:
        srv.stop(0.5)


def test_a_bootstrap_over_a_link_that_keeps_dropping_finishes(
    tmp_path: Path, redis_url: str
) -> None:
    """The predictor reaches its sidecar through a link cut every 300 kB during a 1.5 MB
    bootstrap: started over at each cut it would never finish; resumed, it does, bit-equal,
    every row staged once, with more cuts than it has retries (an attempt that brought
    messages does not use one up)."""
    w = _spool(tmp_path)
    srv = _serve(tmp_path, redis_url)
    try:
        with DroppingProxy(srv.endpoint, drop_after=300_000, drops=1000) as link:
            cfg = _consumer("far", link.endpoint)
            applier = _Counting()
            with DeltaConsumer(cfg) as c:
                r = c.sync(applier)
            assert r.resync and not r.missing, r.missing
            assert link.cut > 3, link.cut  # more than 1 + max_retries attempts
        for t, truth in w.truth.items():
            assert torch.equal(applier.tables()[t], truth), t
        assert applier.rows == {"t0": 20_000, "t1": 3000}  # every row staged once
        assert resumed(srv)[0] >= 3
    finally:
        srv.stop(0.5)


class _CountingStage(_TensorStage):
    def __init__(self, applier: _Counting) -> None:
        super().__init__(applier)
        self._counting = applier

    def _write(self, update: ShardUpdate) -> int:
        n = super()._write(update)
        rows = self._counting.rows
        rows[update.shard.table] = rows.get(update.shard.table, 0) + n
        return n


class _Counting(TensorDictApplier):
    """Counts the rows its stages take, per table."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, int] = {}

    def stage(self) -> _TensorStage:
        return _CountingStage(self)


def test_an_assembled_pull_over_a_dropping_link_resumes_or_starts_over(
    tmp_path: Path, redis_url: str
) -> None:
    """``DeltaConsumer.pull()`` without an applier (windows assembled in memory) goes on
    where a cut left it too; when the window cannot be continued (the trainer restarted
    while the link was down) the attempt starts over, nothing staged to spoil, and the same
    pull brings the new generation."""
    w = _spool(tmp_path)
    srv = _serve(tmp_path, redis_url)

    def cfg(endpoint: str, name: str) -> ConsumerConfig:
        return _consumer(name, endpoint, max_retries=20, align_steps=False)

    try:
        with DroppingProxy(srv.endpoint, drop_after=300_000, drops=1000) as link:
            with DeltaConsumer(cfg(link.endpoint, "assembled")) as c:
                r = c.pull()
            assert not r.missing and r.deltas[0].resync and link.cut >= 3
            replica = Replica()
            replica.apply(r.deltas[0])
            for t, truth in w.truth.items():
                assert torch.equal(replica.tables[t], truth), t
        streams, _ = resumed(srv)
        assert streams >= 3

        def restart() -> None:  # the trainer restarts while the link is down
            w.start_generation(2, 100)
            time.sleep(0.5)  # (the sidecar takes the new generation before the retry)

        with DroppingProxy(srv.endpoint, drop_after=300_000, drops=1, on_cut=restart) as link:
            with DeltaConsumer(cfg(link.endpoint, "restarted")) as c:
                r = c.pull()
            assert not r.missing and link.cut == 1
            d = r.deltas[0]
            assert d.resync and d.generation == 2
            replica = Replica()
            replica.apply(d)
            for t, truth in w.truth.items():
                assert torch.equal(replica.tables[t], truth), t
        assert resumed(srv)[0] == streams  # that one was not resumed
    finally:
        srv.stop(0.5)


def test_a_relay_mirrors_a_base_over_a_link_that_keeps_dropping(
    tmp_path: Path, redis_url: str
) -> None:
    """A relay whose link to its upstream is cut every 300 kB during a 1.5 MB base: each
    mirror pull goes on where the last broke (started over, none would get past the first
    300 kB), and the relay's log reaches the upstream's head; a predictor behind the relay,
    over a link cut as often, bootstraps the same tables from it (the relay resumes its
    streams as a sidecar does)."""
    w = _spool(tmp_path / "spool")
    srv = _serve(tmp_path / "spool", redis_url)
    try:
        with DroppingProxy(srv.endpoint, drop_after=300_000, drops=1000) as link:
            # (its messages smaller than what the link carries between cuts: a stream goes on
            # after whole messages)
            cfg = server_config(tmp_path / "relay", db(redis_url, 1), chunk_bytes=MIN_CHUNK_BYTES)
            relay = RelayServer(
                cfg,
                RelayConfig(
                    upstream=link.endpoint, consumer="relay", poll_interval_s=0.02,
                    fsync=False, backoff_initial_s=0.05, backoff_max_s=0.5,
                ),
            ).start()  # fmt: skip
            try:
                wait_for(lambda: status(relay.endpoint).head_seq == 3, 60, "the relay at seq 3")
                assert link.cut >= 3 and relay.mirror.upstream.resumed >= 3, (
                    link.cut,
                    relay.mirror.upstream.resumed,
                )
                with DroppingProxy(relay.endpoint, drop_after=300_000, drops=1000) as far:
                    cfg = _consumer("behind", far.endpoint, max_retries=20)
                    applier = _Counting()
                    with DeltaConsumer(cfg) as c:
                        r = c.sync(applier)
                    assert r.resync and not r.missing, r.missing
                    assert far.cut >= 3, far.cut
            finally:
                relay.stop(0.2)
        for t, truth in w.truth.items():
            assert torch.equal(applier.tables()[t], truth), t
        assert applier.rows == {"t0": 20_000, "t1": 3000}
    finally:
        srv.stop(0.5)


def test_a_relay_does_not_back_off_from_an_upstream_stream_that_progressed(
    tmp_path: Path, redis_url: str
) -> None:
    """Each cut of a link that drops every 150 kB breaks a mirror pull that brought messages:
    the relay retries after its initial backoff (0.05 s), not after a doubling one (up to
    30 s here: with a dozen cuts, minutes). The base is mirrored well within 20 s."""
    _spool(tmp_path / "spool")
    srv = _serve(tmp_path / "spool", redis_url)
    try:
        with DroppingProxy(srv.endpoint, drop_after=150_000, drops=1000) as link:
            relay = RelayServer(
                server_config(tmp_path / "relay", db(redis_url, 2)),
                RelayConfig(
                    upstream=link.endpoint, consumer="relay", poll_interval_s=0.02,
                    fsync=False, backoff_initial_s=0.05, backoff_max_s=30.0,
                ),
            ).start()  # fmt: skip
            try:
                wait_for(lambda: status(relay.endpoint).head_seq == 3, 20, "the relay at seq 3")
                assert link.cut >= 8, link.cut
            finally:
                relay.stop(0.2)
    finally:
        srv.stop(0.5)


def test_two_ranks_one_behind_a_dropping_link_bootstrap_one_step(
    tmp_path: Path, redis_url: str
) -> None:
    """World size 2, rank 1's sidecar behind a link cut every 300 kB, rank 0's not: the
    aligned pull resumes rank 1 alone and both ranks' rows are of one step, bit-equal to the
    trainer's tables there; a later step then comes as a delta."""
    ft = FakeTrainer(tmp_path / "spool", world_size=2, tables={"t0": (40_000, 16), "t1": (500, 8)})
    ft.start(0)
    ft.step(10)
    servers = [
        SidecarServer(
            server_config(tmp_path / "spool", redis_url, rank=r, chunk_bytes=MIN_CHUNK_BYTES)
        ).start()
        for r in range(2)
    ]
    try:
        with DroppingProxy(servers[1].endpoint, drop_after=300_000, drops=1000) as link:
            cfg = _consumer("two", servers[0].endpoint, link.endpoint)
            applier = _Counting()
            with DeltaConsumer(cfg) as c:
                r = c.sync(applier)
                assert not r.missing and r.step == 10 and {d.rank for d in r.deltas} == {0, 1}
                assert link.cut >= 3, link.cut
                for n, t in ft.history[10].items():
                    assert torch.equal(applier.tables()[n], t), n
                assert applier.rows == {"t0": 40_000, "t1": 500}  # each row staged once
                ft.step(20)
                wait_for(lambda: all(status(s.endpoint).head_step == 20 for s in servers), 10)
                r = c.sync(applier)
                assert not r.missing and r.step == 20 and not any(d.resync for d in r.deltas)
                for n, t in ft.history[20].items():
                    assert torch.equal(applier.tables()[n], t), n
        assert resumed(servers[1])[0] >= 3 and resumed(servers[0]) == (0, 0)
    finally:
        for s in servers:
            s.stop(0.5)


def test_a_predictor_far_behind_catches_up_over_a_dropping_link(
    tmp_path: Path, redis_url: str
) -> None:
    """A predictor at step 0 while the trainer moved on (an incremental window of ~2.4 MB,
    not a resync), its link cut every 300 kB: the window goes on where each cut left it and
    the predictor ends at the head, bit-equal."""
    w = _spool(tmp_path, deltas=0)
    srv = _serve(tmp_path, redis_url)
    try:
        cfg = _consumer("behind", srv.endpoint, align_steps=False)
        replica = Replica()
        with DeltaConsumer(cfg) as c:
            r = c.pull()
            replica.apply(r.deltas[0])
            c.commit(r)
        for _ in range(6):
            w.delta(n=6000)
        wait_for(lambda: status(srv.endpoint).head_seq == 6, 10, "the sidecar at seq 6")
        with DroppingProxy(srv.endpoint, drop_after=300_000, drops=1000) as link:
            with DeltaConsumer(replace(cfg, sidecars=(link.endpoint,), resume=True)) as c:
                r = c.pull()
            assert not r.missing, r.missing
            d = r.deltas[0]
            assert not d.resync and d.from_seq == 0 and d.to_seq == 6 and link.cut > 3
            replica.apply(d)
        for t, truth in w.truth.items():
            assert torch.equal(replica.tables[t], truth), t
        assert resumed(srv)[0] > 3
    finally:
        srv.stop(0.5)


def test_a_declined_resume_does_not_make_attempts_free(tmp_path: Path, redis_url: str) -> None:
    """A window the sidecar will not build the same again (max_rows) behind a dropping link:
    the consumer asks to resume, is served the window from its start, starts over; from
    then on an attempt that brought messages is a failed attempt like any other, so the pull
    ends after 1 + max_retries of them instead of starting over for ever."""
    w = _spool(tmp_path, deltas=0)
    srv = _serve(tmp_path, redis_url)
    try:
        pull = PullOptions(max_rows=1_000_000)
        cfg = _consumer("capped", srv.endpoint, align_steps=False, pull=pull)
        with DeltaConsumer(cfg) as c:
            c.commit(c.pull())
        for _ in range(6):
            w.delta(n=6000)
        wait_for(lambda: status(srv.endpoint).head_seq == 6, 10, "the sidecar at seq 6")
        with DroppingProxy(srv.endpoint, drop_after=300_000, drops=1000) as link:
            with DeltaConsumer(replace(cfg, sidecars=(link.endpoint,), resume=True)) as c:
                r = c.pull()
            assert 0 in r.missing and "no answer after 3 attempts" in r.missing[0], r.missing
            assert 3 <= link.cut <= 8, link.cut  # (a declined resume starts over once in one)
        assert resumed(srv)[0] == 0
    finally:
        srv.stop(0.5)
