"""Retention keeps the log bounded without losing a row; quarantine; crash leftovers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serverkit import Client, Replica, SpoolWriter, redis_server, server_config, wait_for

from deltad.segment.format import read_header, write_segment
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import SegmentLog
from deltad.serve.index.merge import merge_entries, merge_plan
from deltad.store import EmbeddedRedis
from deltad.types import SegmentKind
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]


def _equal(rep: Replica, spool: SpoolWriter) -> bool:
    return all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)


def _sync(c: Client, consumer: str, rep: Replica) -> None:
    d = c.pull(consumer)
    rep.apply(d)
    c.commit(d)


def _retain(srv: SidecarServer) -> int:
    n = 0
    while srv.retention.run_once():
        n += 1
        assert n < 100
    return n


@pytest.fixture
def setup(tmp_path: Path, redis_server: EmbeddedRedis):  # type: ignore[no-untyped-def]
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, merge_min_segments=2)
    ).start()
    c = Client(f"127.0.0.1:{srv.port}")
    yield spool, srv, c
    c.close()
    srv.stop(0)


def _head(srv: SidecarServer, seq: int) -> None:
    wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq)


def test_log_stays_bounded_with_a_lagging_consumer_and_loses_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    spool, srv, c = setup
    lag, fast = Replica(), Replica()
    for name in ("lag", "fast"):
        c.stub.Register(pb.RegisterRequest(consumer=name, lease_ttl_seconds=60))
    _sync(c, "lag", lag)
    _sync(c, "fast", fast)
    for _ in range(12):
        spool.delta(n=30)
        _head(srv, spool.seq)
        _sync(c, "fast", fast)
        _retain(srv)
    assert _equal(fast, spool)
    snap = srv.log.snapshot()
    assert snap is not None
    # base (pinned by "lag" at 0), one merged run up to "fast"'s cursor: 2 files, not 13
    assert [(e.first_seq, e.seq) for e in snap.entries] == [(0, 0), (1, 12)]
    assert len(spool.layout.segments(1, 0)) == 2
    assert snap.entries[1].segment.num_rows <= 2 * 12 * 30
    _sync(c, "lag", lag)
    assert _equal(lag, spool)
    # both at 12 now: the base moves forward to 12
    _retain(srv)
    snap = srv.log.snapshot()
    assert snap is not None and [(e.first_seq, e.seq) for e in snap.entries] == [(0, 12)]
    assert read_header(snap.base.path).kind is SegmentKind.BASE
    spool.delta()
    _head(srv, 13)
    _sync(c, "lag", lag)
    assert _equal(lag, spool)
    # a new consumer starts from the merged base and is exact
    new = Replica()
    _sync(c, "new", new)
    assert _equal(new, spool)


def test_expired_consumer_pins_nothing_and_resyncs_from_the_merged_base(setup) -> None:  # type: ignore[no-untyped-def]
    spool, srv, c = setup
    rep = Replica()
    # a lease long enough to outlast the steps below on a loaded machine, short enough to wait
    c.stub.Register(pb.RegisterRequest(consumer="gone", lease_ttl_seconds=2.0))
    _sync(c, "gone", rep)
    for _ in range(3):
        spool.delta()
    _head(srv, 3)
    _retain(srv)
    assert srv.log.snapshot().base.seq == 0  # type: ignore[union-attr]  # pinned while live
    # the lease runs out (GetDelta renewed it to 2 s): polled, not slept past
    wait_for(lambda: srv.store.lease_remaining(["gone"])["gone"] <= 0, 10, "gone's lease to end")
    _retain(srv)
    snap = srv.log.snapshot()
    assert snap is not None and snap.base.seq == 3 and len(snap.entries) == 1
    d = c.pull("gone")
    assert d.resync and d.to_seq == 3
    rep.apply(d)
    c.commit(d)
    assert _equal(rep, spool)


def test_corrupt_segment_is_quarantined_and_never_served(setup) -> None:  # type: ignore[no-untyped-def]
    spool, srv, c = setup
    rep = Replica()
    _sync(c, "q", rep)
    path = spool.layout.segment_path(1, 0, 1)
    srv.log._lock.acquire()  # hold indexing while the file is damaged in place
    try:
        spool.delta()
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x55
        path.write_bytes(bytes(raw))
    finally:
        srv.log._lock.release()
    spool.delta()
    wait_for(lambda: srv.log.quarantined == 1, what="quarantine")
    assert not path.exists() and len(list(spool.layout.quarantine_dir.iterdir())) == 1
    st = c.stub.Status(pb.StatusRequest())
    assert st.quarantined == 1 and st.head_seq == 0  # seq 2 is held back behind the gap
    assert c.pull("q").rows == 0
    body = srv.metrics.registry.get_sample_value(
        "deltad_quarantined_segments_total", {"model": "m", "rank": "0"}
    )
    assert body == 1.0
    assert SegmentLog(spool.layout, 0).quarantined == 1  # a restarted sidecar still reports it
    assert SegmentLog(spool.layout, 1).quarantined == 0
    # the trainer's next generation repairs it
    spool.start_generation(2)
    wait_for(lambda: srv.log.snapshot().generation == 2)  # type: ignore[union-attr]
    _sync(c, "q", rep)
    assert _equal(rep, spool)


def test_restart_deletes_files_covered_by_a_merged_segment(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    for _ in range(3):
        spool.delta()
    log = SegmentLog(spool.layout, 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None
    merged = merge_entries(snap.entries[1:])
    # a merge that crashed after writing seg 3 as 1..3 but before deleting seg 1 and 2
    write_segment(
        spool.layout.segment_path(1, 0, 3), model="m", generation=1, rank=0, world_size=1,
        seq=3, first_seq=1, step=spool.step, kind=SegmentKind.DELTA,
        shards=list(merged.values()),
    )  # fmt: skip
    log = SegmentLog(spool.layout, 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None
    assert [(e.first_seq, e.seq) for e in snap.entries] == [(0, 0), (1, 3)]
    assert [s for s, _ in spool.layout.segments(1, 0)] == [0, 3]


def test_a_merge_overtaken_by_a_new_generation_leaves_no_file_behind(
    setup, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The trainer restarts (new generation) while a merge of the old one runs: the merged
    file, written into the dropped generation's directory, is deleted, not leaked."""
    import deltad.serve.index.retention as retention

    spool, srv, c = setup
    for _ in range(4):
        spool.delta()
    _head(srv, 4)

    def merge_then_restart(entries):  # type: ignore[no-untyped-def]
        merged = merge_plan(entries)
        spool.start_generation(2)
        srv.log.refresh()
        assert srv.log.snapshot().generation == 2  # type: ignore[union-attr]
        return merged

    monkeypatch.setattr(retention, "merge_plan", merge_then_restart)
    assert srv.retention.run_once() is False
    old = spool.layout.rank_dir(1, 0)
    assert not old.exists() or not list(old.iterdir())
    rep = Replica()
    _sync(c, "fresh", rep)
    assert _equal(rep, spool)


def test_a_directory_named_like_a_segment_is_quarantined_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    path = spool.layout.segment_path(1, 0, 1)
    path.mkdir()  # not a regular file: quarantined (moved away), never opened as a segment
    seglog = SegmentLog(spool.layout, 0)
    with caplog.at_level("WARNING", logger="deltad.serve.index.files"):
        for _ in range(5):
            seglog.refresh()
    assert sum(r.message.startswith("quarantined segment") for r in caplog.records) == 1
    assert seglog.snapshot().head.seq == 0 and seglog.quarantined == 1  # type: ignore[union-attr]
    assert not path.exists()
    spool.seq = 0
    spool.delta()
    seglog.refresh()
    assert seglog.snapshot().head.seq == 1  # type: ignore[union-attr]
