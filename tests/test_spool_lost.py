"""A spool lost under a running sidecar (a deleted or remounted volume, an operator's
``rm -r``): the sidecar writes the served log back from its verified copies, keeps serving it,
and the trainer's next segments continue it. Predictors following it get the rows they lack,
never a resync; the archive goes on; a sidecar restarted on the spool finds the whole log.

A real publisher (one CPU shard), real sidecars, Redis and a real SeaweedFS archive."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from s3kit import Seaweed, archive_url, s3_env, seaweed  # noqa: F401
from serverkit import MODEL, Client, Replica, SpoolWriter, server_config, wait_for
from test_archive import _write_dense
from test_heal import _publisher, _sync, _Tracker, _written

from deltad.segment.spool import SpoolLayout
from deltad.serve.archive.fetch import read_manifest
from deltad.serve.archive.opening import open_store
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import SegmentLog
from deltad.store import EmbeddedRedis

pytestmark = pytest.mark.timeout(120)


def _delete_under_writers(root: Path) -> None:
    """``rm -rf root`` while the sidecar runs: it may write into the spool meanwhile (its
    rewrite of what it finds lost), which fails one pass with "Directory not empty"; like an
    operator's ``rm -rf`` run again, pass until the directory is gone (bounded)."""
    for _ in range(100):
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            return
    raise AssertionError(f"{root} kept coming back")


def _head(srv: SidecarServer) -> int:
    snap = srv.log.snapshot()
    return -1 if snap is None else snap.head.seq


def _archived_head(url: str, endpoint: str) -> int:
    store = open_store(url, endpoint=endpoint)
    try:
        m = read_manifest(store, "m", 0)
        return -1 if m is None else m.head.seq
    finally:
        store.close()


@pytest.mark.usefixtures("s3_env")
def test_a_spool_deleted_under_a_running_sidecar_is_written_back_and_predictors_go_on(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    url = archive_url()
    tracker, rep = _Tracker(), Replica()
    pub = _publisher(root, tracker)
    pub.start(0)
    srv = SidecarServer(
        server_config(root, redis_server.url, archive_url=url, archive_endpoint=seaweed.endpoint)
    ).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        for seq in range(1, 4):
            tracker.step()
            pub.publish(seq)
            _written(pub, seq)
        wait_for(lambda: _head(srv) == 3, 10, "seq 3 served")
        assert _sync(c, rep) == 3
        gen = pub.generation
        assert gen is not None
        layout = SpoolLayout(root, "m")
        files = {p.name: p.read_bytes() for _, p in layout.segments(gen, 0)}
        assert sorted(files) == [f"seg-{s:012d}.dseg" for s in range(4)]

        _delete_under_writers(root)  # the spool is gone under the running sidecar and trainer
        for seq in range(4, 6):  # the trainer goes on publishing into the empty spool
            tracker.step()
            pub.publish(seq)
            _written(pub, seq)
        wait_for(lambda: _head(srv) == 5, 10, "seq 5 served")
        assert pub.stats.rebases == 0  # no fresh base was needed: the log never broke

        # the served files are back, byte for byte, with the generation's manifest
        assert layout.manifest_path(gen).exists()
        for name, data in files.items():
            assert (layout.rank_dir(gen, 0) / name).read_bytes() == data, name
        labels = {"model": MODEL, "rank": "0"}
        get = srv.metrics.registry.get_sample_value
        # (4: the segments seq 0..3; more when its rewrite raced the rm -rf and was deleted too)
        assert get("deltad_spool_files_rewritten_total", labels) >= 4
        # the rank's lock went with the spool: the sidecar holds it again
        assert layout.rank_lock_path(0).exists()
        with pytest.raises(Exception, match="another sidecar serves rank 0"):
            SidecarServer(server_config(root, redis_server.url)).start()

        # the predictor gets what it lacks, not a resync; its tables are the trainer's
        d = c.pull("p")
        assert not d.resync and (d.from_seq, d.to_seq) == (3, 5)
        rep.apply(d)
        c.commit(d)
        assert torch.equal(rep.tables["t"], tracker.weight)
        wait_for(lambda: _archived_head(url, seaweed.endpoint) == 5, 20, "the archive at seq 5")
    finally:
        c.close()
        srv.stop(0)

    # a sidecar restarted on that spool finds the whole log: no restore, no resync
    srv = SidecarServer(
        server_config(root, redis_server.url, archive_url=url, archive_endpoint=seaweed.endpoint)
    ).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        assert srv.archive is not None and srv.archive.restored is None
        snap = srv.log.snapshot()
        assert snap is not None and (snap.base.seq, snap.head.seq) == (0, 5)
        tracker.step()
        pub.publish(6)
        _written(pub, 6)
        wait_for(lambda: _head(srv) == 6, 10, "seq 6 served")
        d = c.pull("p")
        assert not d.resync and (d.from_seq, d.to_seq) == (5, 6)
        rep.apply(d)
        c.commit(d)
        assert torch.equal(rep.tables["t"], tracker.weight)
        fresh = Replica()
        _sync(c, fresh, "q")  # and a new predictor's bootstrap is the same tables
        assert torch.equal(fresh.tables["t"], tracker.weight)
    finally:
        c.close()
        srv.stop(0)
        pub.close(10**6)


def test_lost_dense_states_and_the_manifest_are_written_back_and_verify(
    tmp_path: Path,
) -> None:
    """The log's own rewrite, dense states included: every file it writes back reads back
    through the spool's verification as the one it replaced; a file the log never served
    (a segment behind a gap) is not invented."""
    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()
    dense = _write_dense(spool, 7)
    spool.delta()
    seglog = SegmentLog(spool.layout, 0)
    seglog.refresh()
    snap = seglog.snapshot()
    assert snap is not None and snap.head.seq == 2 and len(snap.dense) == 1
    before = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in (tmp_path / "spool").rglob("*")
        if p.is_file() and "sidecar" not in p.parts
    }
    shutil.rmtree(tmp_path / "spool")
    seglog.refresh()
    after = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in (tmp_path / "spool").rglob("*")
        if p.is_file() and "sidecar" not in p.parts
    }
    assert after.keys() == before.keys()
    for k, data in before.items():
        if k.name != "generation.json":  # (the manifest's JSON is written anew)
            assert after[k] == data, k
    assert seglog.rewritten == 4  # base, 2 segments, the dense state
    again = SegmentLog(SpoolLayout(tmp_path / "spool", MODEL), 0)
    again.refresh()
    snap2 = again.snapshot()
    assert snap2 is not None and snap2.head.seq == 2 and len(snap2.dense) == 1
    got = snap2.dense[0].state.tensors
    assert got.keys() == dense.keys() and all(torch.equal(got[k], dense[k]) for k in dense)
    # a segment after a gap was never served: lost, it stays lost (the gap heals by a base)
    spool.seq += 1  # seq 3 is never written
    spool.delta()  # seq 4, held back behind the gap
    again.refresh()
    gap_file = spool.layout.segment_path(spool.generation, 0, 4)
    gap_file.unlink()
    again.refresh()
    assert not gap_file.exists() and again.rewritten == 0
