"""Retention in the archive, against a real SeaweedFS and a shared file system: objects the
rank's manifest no longer names (merged away by the sidecar's retention, an older generation)
are deleted once the grace has passed, never before; what is left rebuilds the trainer's tables
exactly; an older manifest read within the grace still finds every object it names."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from s3kit import Seaweed, archive_url, s3_env, seaweed  # noqa: F401
from serverkit import MODEL, SpoolWriter, server_config, wait_for
from test_archive import _assert_archive_rebuilds, _manifest

from deltad.serve.archive.fetch import read_manifest
from deltad.serve.archive.layout import ArchiveManifest
from deltad.serve.archive.opening import open_store
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis

pytestmark = pytest.mark.timeout(180)


def _keys(url: str, endpoint: str | None) -> set[str]:
    s = open_store(url, endpoint=endpoint)
    try:
        return set(s.list(f"{MODEL}/"))
    finally:
        s.close()


def _archived(url: str, endpoint: str | None) -> ArchiveManifest | None:
    """The rank's manifest; None while there is none yet."""
    s = open_store(url, endpoint=endpoint)
    try:
        return read_manifest(s, MODEL, 0)
    finally:
        s.close()


def _named(url: str, endpoint: str | None) -> set[str]:
    """The keys the rank's manifest names, with the manifest and its generation's manifest."""
    m = _manifest(url, endpoint)
    return {o.key for o in (*m.entries, *m.dense)} | {
        f"{MODEL}/rank-00000/manifest.json",
        m.generation_key,
    }


def _settled(url: str, endpoint: str | None, seq: int, quiet_s: float = 1.0) -> bool:
    """The manifest is at ``seq`` and names the same objects ``quiet_s`` later: retention has
    stopped merging (it runs every 50 ms here), so a sweep meets no merge in flight."""
    first = _manifest(url, endpoint)
    if first.head.seq != seq:
        return False
    time.sleep(quiet_s)
    return [o.key for o in _manifest(url, endpoint).entries] == [o.key for o in first.entries]


def _merging(
    root: Path, redis_url: str, url: str, endpoint: str | None, **kw: Any
) -> SidecarServer:
    kw.setdefault("archive_base_deltas", 0.0)  # (the archive takes each served base)
    cfg = server_config(
        root, redis_url, archive_url=url, archive_endpoint=endpoint, merge_min_segments=2,
        retention_interval_s=0.05, **kw,
    )  # fmt: skip
    return SidecarServer(cfg).start()


@pytest.mark.usefixtures("s3_env")
def test_objects_merged_away_and_an_older_generation_are_deleted_after_the_grace(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = archive_url()
    srv = _merging(
        tmp_path / "spool", redis_server.url, url, seaweed.endpoint, archive_gc_grace_s=1.0
    )
    try:
        uploader = srv.archive.uploader if srv.archive else None
        assert uploader is not None
        for _ in range(6):
            spool.delta()
            time.sleep(0.1)  # each one archived before retention merges it
        wait_for(
            lambda: (
                (m := _manifest(url, seaweed.endpoint)).head.seq == spool.seq and len(m.entries) < 7
            ),
            30,
            "the archive at the head, merged",
        )
        # what no manifest names goes, once the grace has passed; nothing else does
        wait_for(
            lambda: _keys(url, seaweed.endpoint) == _named(url, seaweed.endpoint),
            30,
            "the store holding only what the manifest names",
        )
        assert uploader.deleted > 0
        labels = {"model": MODEL, "rank": "0"}
        assert srv.metrics.registry.get_sample_value("deltad_archive_deleted_total", labels)
        _assert_archive_rebuilds(url, seaweed.endpoint, spool)
        # a trainer restart: the older generation's objects and its manifest go too
        spool.start_generation(2, start_step=spool.step)
        spool.delta()
        wait_for(
            lambda: (
                _manifest(url, seaweed.endpoint).generation == 2
                and _keys(url, seaweed.endpoint) == _named(url, seaweed.endpoint)
            ),
            30,
            "only generation 2 in the store",
        )
        assert not [k for k in _keys(url, seaweed.endpoint) if "/gen-00000000000000000001/" in k]
        _assert_archive_rebuilds(url, seaweed.endpoint, spool)
    finally:
        srv.stop(0)


def test_within_the_grace_an_older_manifest_finds_every_object_it_names(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """A reader that took the manifest before a merge (a cold start, a restore) still finds
    every object it names while the grace lasts; a sweep past the grace deletes exactly the
    objects no manifest names any more. A shared file system archive."""
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    srv = _merging(tmp_path / "spool", redis_server.url, url, None, restore_window_steps=0)
    try:
        uploader = srv.archive.uploader if srv.archive else None
        assert uploader is not None
        spool.delta()
        wait_for(
            lambda: (m := _archived(url, None)) is not None and m.head.seq == spool.seq,
            10,
            "the archive",
        )
        before = _manifest(url, None)
        for _ in range(5):
            spool.delta()
            time.sleep(0.1)
        wait_for(
            lambda: (
                (m := _manifest(url, None)).head.seq == spool.seq
                and m.entries[0].seq > before.head.seq
            ),
            30,
            "the archive merged past the older manifest's head",
        )
        # a merge still under way would upload (and name) a base after the sweep below
        wait_for(lambda: _settled(url, None, spool.seq), 30, "retention done merging")
        store = open_store(url)
        try:
            old = {o.key for o in (*before.entries, *before.dense)}
            unnamed = old - _named(url, None)
            assert unnamed  # merged away, and (600 s of grace) still there
            assert uploader.sweep() == 0
            for o in before.entries:
                assert store.size(o.key) == o.size, o.key
            # past the grace: the unnamed ones go (the older manifest's and those merged in
            # between), nothing the manifest names
            assert uploader.sweep(now=time.time() + 601) >= len(unnamed)
            assert _keys(url, None) == _named(url, None)
        finally:
            store.close()
        _assert_archive_rebuilds(url, None, spool)
    finally:
        srv.stop(0)


@pytest.mark.parametrize("due", ["never", "deltas", "age"])
def test_the_archive_keeps_its_own_base_and_uploads_a_fresh_one_only_when_due(
    tmp_path: Path, redis_server: EmbeddedRedis, due: str
) -> None:
    """The served log's retention moves its base forward every two segments here; the
    archive keeps its base and the deltas after it (the whole rank is not uploaded again each
    time), and takes a fresh base (the served one) once its deltas reach the fraction of the
    base's bytes, or its base's age, it is given. Either way it rebuilds the tables exactly."""
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    knobs = {
        "never": {"archive_base_deltas": 1000.0},
        "deltas": {"archive_base_deltas": 0.5},
        "age": {"archive_base_deltas": 1000.0, "archive_base_every_s": 0.5},
    }[due]
    srv = _merging(tmp_path / "spool", redis_server.url, url, None, **knobs)
    try:
        for _ in range(8):
            spool.delta()
            time.sleep(0.15)  # each one archived before retention merges it
        if due == "age":
            time.sleep(0.6)
            spool.delta()
        wait_for(lambda: _manifest(url, None).head.seq == spool.seq, 20, "the archive's head")
        snap = srv.log.snapshot()
        assert snap is not None and snap.base.seq > 0  # the served base moved forward
        m = _manifest(url, None)
        bases = [k for k in _keys(url, None) if "/seg-000000000000-" in k]
        if due == "never":
            # the first base and every delta after it, as published: one base uploaded
            assert m.entries[0].seq == 0 and len(m.entries) == spool.seq + 1
            assert len(bases) == 1
        else:
            # a fresh base was taken from the served log; the deltas after it are bounded
            wait_for(lambda: _manifest(url, None).entries[0].seq > 0, 20, "a fresh base")
            m = _manifest(url, None)
            assert len(bases) >= 2 or m.entries[0].seq > 0
            if due == "deltas":
                after = sum(o.size for o in m.entries[1:])
                assert after < 0.5 * m.entries[0].size + max(o.size for o in m.entries)
        _assert_archive_rebuilds(url, None, spool)
    finally:
        srv.stop(0)
