"""Freshness signals survive retention: head age (Status, `deltad status`) and a consumer's
lag_seconds (ListConsumers, the deltad_consumer_lag_seconds gauge) measure when the trainer
published the steps, not when a merge rewrote them. A real sidecar whose retention merges while
the trainer (tests/serverkit's SpoolWriter) is stalled."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serverkit import Client, SpoolWriter, server_config, wait_for

from deltad.commands.status import render
from deltad.errors import SegmentCorruptError
from deltad.segment.format import read_header, write_segment
from deltad.segment.validate import check_header
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.types import SegmentKind
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)

STALL_S = 1.5


def _lag(srv: SidecarServer, consumer: str) -> float:
    infos = {i.consumer: i for i in srv.servicer.consumer_infos()}
    return infos[consumer].lag_seconds


def _gauge(srv: SidecarServer, consumer: str) -> float:
    m = srv.metrics
    return float(m.lag_seconds.labels(**m._labels, consumer=consumer)._value.get())


def test_head_age_and_lag_survive_a_merge_while_the_trainer_stalls(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, merge_min_segments=2)
    ).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        spool.delta()  # seq 1
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 1)
        c.commit(c.pull("slow"))  # "slow" stands at seq 1
        published = time.time()
        for _ in range(4):
            spool.delta()  # seqs 2..5, then the trainer stalls
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 5)
        time.sleep(STALL_S)
        assert srv.retention.run_once()  # merges 2..5 (between the pin at 1 and the head)
        snap = srv.log.snapshot()
        assert snap is not None
        assert [(e.first_seq, e.seq) for e in snap.entries] == [(0, 0), (1, 1), (2, 5)]
        merged = read_header(snap.head.path)
        assert merged.first_created_unix is not None
        assert merged.first_created_unix <= merged.created_unix <= published + 1.0
        st = c.stub.Status(pb.StatusRequest(), timeout=10)
        assert st.head_age_seconds >= STALL_S  # not the merged file's age (~0)
        assert f"(age {st.head_age_seconds:.1f}s)" in render(st, pb.ListConsumersResponse())
        lag = _lag(srv, "slow")
        assert lag >= STALL_S  # seq 2, its oldest uncommitted step, is that old
        assert _gauge(srv, "slow") == pytest.approx(lag, abs=0.5)
        # the base forward merge (nobody live behind it) keeps the newest step's time too
        c.commit(c.pull("slow"))
        assert _lag(srv, "slow") == 0.0
        while srv.retention.run_once():
            pass
        snap = srv.log.snapshot()
        assert snap is not None and len(snap.entries) == 1
        st = c.stub.Status(pb.StatusRequest(), timeout=10)
        assert st.head_age_seconds >= STALL_S
        # the trainer moves again: fresh
        spool.delta()
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 6)
        assert c.stub.Status(pb.StatusRequest(), timeout=10).head_age_seconds < STALL_S
    finally:
        c.close()
        srv.stop(0)


def test_first_created_is_optional_and_checked(tmp_path: Path) -> None:
    """Unmerged segments (and files of older deltads) have no first_created_unix; a merged
    one's must be a number no later than created_unix."""
    spool = SpoolWriter(tmp_path / "spool")
    path = spool.layout.segment_path(1, 0, 0)
    h = read_header(path)
    assert h.first_created_unix is None and h.first_created == h.created_unix
    assert b"first_created_unix" not in h.to_json()
    t0 = 1_700_000_000.0
    kw = dict(model="m", generation=1, rank=0, world_size=1, seq=3, first_seq=1, step=30,
              kind=SegmentKind.DELTA, shards=[], fsync=False)  # fmt: skip
    ok = write_segment(tmp_path / "ok.dseg", created_unix=t0, first_created_unix=t0 - 60, **kw)
    assert read_header(tmp_path / "ok.dseg").first_created == t0 - 60
    check_header(ok, spool.layout.read_manifest(1), generation=1, rank=0, seq=3)
    bad = write_segment(tmp_path / "bad.dseg", created_unix=t0, first_created_unix=t0 + 1, **kw)
    with pytest.raises(SegmentCorruptError, match="after created_unix"):
        check_header(bad, spool.layout.read_manifest(1), generation=1, rank=0, seq=3)
