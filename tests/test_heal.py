"""Self-healing spool: a quarantined or missing segment and a full spool heal through a fresh
base from the publisher beside the sidecar, without a trainer restart, with nothing lost.

A real publisher (one CPU shard), a real sidecar and Redis, a consumer that pulls and commits;
the full spool is a real tmpfs (skipped with the reason where mounting is not allowed)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from serverkit import Client, Replica, redis_server, server_config, wait_for

from deltad.config import PublisherConfig
from deltad.publish.publisher import SegmentPublisher
from deltad.publish.tracker import TrackedShard
from deltad.segment.spool import TableInfo
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import GAP_GRACE_S
from deltad.store import EmbeddedRedis
from deltad.types import Shard

__all__ = ["redis_server"]

ROWS, DIM = 256, 8


class _Tracker:
    """One CPU shard of a ROWS x DIM table; ``drain`` returns the rows the test touched."""

    def __init__(self) -> None:
        self.weight = torch.zeros(ROWS, DIM)
        self.shard = TrackedShard(
            module="m", kind="ec", sharding_type="row_wise",
            shard=Shard("t", ROWS, DIM, 0, ROWS, 0, DIM), weight=self.weight,
        )  # fmt: skip
        self.shards = [self.shard]
        self.tables = [TableInfo("t", ROWS, DIM, "float32", "m", "ec", "row_wise")]
        self.touched: set[int] = set()
        self.gen = torch.Generator().manual_seed(1)

    def step(self) -> None:
        ids = torch.randperm(ROWS, generator=self.gen)[:16]
        self.weight[ids] += torch.randn(16, DIM, generator=self.gen)
        self.touched.update(ids.tolist())

    def drain(self) -> list[tuple[Any, torch.Tensor]]:
        ids = torch.tensor(sorted(self.touched), dtype=torch.int64)
        self.touched.clear()
        return [(self.shard, ids)]

    def flush_caches(self) -> int:
        return 0


def _publisher(spool: Path, tracker: _Tracker, **kw: Any) -> SegmentPublisher:
    cfg = PublisherConfig(spool, model="m", every_steps=1, fsync=False, rebase_retry_s=0, **kw)
    return SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker)  # type: ignore[arg-type]


def _written(pub: SegmentPublisher, seq: int) -> None:
    assert pub.generation is not None
    path = pub.layout.segment_path(pub.generation, 0, seq)
    wait_for(lambda: path.exists() or pub.stats.write_errors > 0, 10, f"seq {seq} written")


def _sync(c: Client, rep: Replica, name: str = "p") -> int:
    d = c.pull(name)
    rep.apply(d)
    c.commit(d)
    return d.to_seq


def _caught_up(c: Client, rep: Replica, tracker: _Tracker, seq: int) -> bool:
    return _sync(c, rep) >= seq and torch.equal(rep.tables["t"], tracker.weight)


@contextlib.contextmanager
def _stack(spool: Path, url: str, tracker: _Tracker, **kw: Any) -> Iterator[Any]:
    pub = _publisher(spool, tracker, **kw)
    pub.start(0)
    srv = SidecarServer(server_config(spool, url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        yield pub, srv, c
    finally:
        c.close()
        srv.stop(0)
        with contextlib.suppress(Exception):
            pub.close(10**6)


def test_a_quarantined_segment_heals_without_a_trainer_restart(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    tracker, rep = _Tracker(), Replica()
    with _stack(tmp_path / "spool", redis_server.url, tracker) as (pub, srv, c):
        _sync(c, rep)
        for step in (1, 2):
            tracker.step()
            pub.publish(step)
        _written(pub, 2)
        wait_for(lambda: _caught_up(c, rep, tracker, 2), 10, "consumer at seq 2")
        with srv.log._lock:  # damage seq 3 on disk before the sidecar indexes it
            tracker.step()
            pub.publish(3)
            _written(pub, 3)
            path = pub.layout.segment_path(pub.generation or 0, 0, 3)
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
        wait_for(lambda: srv.log.quarantined == 1, 10, "quarantine")
        request = pub.layout.rebase_request_path(pub.generation or 0, 0)
        assert request.exists()
        tracker.step()
        t0 = time.monotonic()
        stats = pub.publish(4)  # the trainer's next publish answers with a fresh base
        assert stats.kind.value == "base" and stats.seq == 4 and not request.exists()
        wait_for(lambda: _caught_up(c, rep, tracker, 4), 10, "healed")
        healed_s = time.monotonic() - t0
        assert healed_s < 5  # the bound: the publish after the request + a write + a poll
        assert srv.log.snapshot().base.seq == 4  # type: ignore[union-attr]
        # the log goes on from the fresh base
        tracker.step()
        pub.publish(5)
        wait_for(lambda: _caught_up(c, rep, tracker, 5), 10, "delta after the base")
        assert pub.stats.rebases == 1 and srv.log.rebase_requests == 1
    print(f"healed {healed_s:.2f} s after the publish that followed the request")


def test_a_missing_segment_heals_after_the_gap_grace(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    tracker, rep = _Tracker(), Replica()
    with _stack(tmp_path / "spool", redis_server.url, tracker) as (pub, srv, c):
        _sync(c, rep)
        with srv.log._lock:  # seq 1 disappears before the sidecar sees it
            tracker.step()
            pub.publish(1)
            _written(pub, 1)
            pub.layout.segment_path(pub.generation or 0, 0, 1).unlink()
        tracker.step()
        pub.publish(2)  # held back behind the gap
        _written(pub, 2)
        request = pub.layout.rebase_request_path(pub.generation or 0, 0)
        t0 = time.monotonic()
        wait_for(request.exists, GAP_GRACE_S + 5, "a fresh base asked for")
        assert time.monotonic() - t0 <= GAP_GRACE_S + 2
        tracker.step()
        assert pub.publish(3).kind.value == "base"
        wait_for(lambda: _caught_up(c, rep, tracker, 3), 10, "healed")


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs at ``where``; the reason if it cannot be."""
    where.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run mount: {e}"
    if r.returncode != 0:
        return f"mounting a tmpfs is not allowed here: {r.stderr.strip()}"
    return None


def test_a_full_spool_never_stops_training_and_nothing_is_lost(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    mnt = tmp_path / "small"
    reason = _mount_tmpfs(mnt, "1m")
    if reason is not None:
        pytest.skip(reason)
    try:
        tracker, rep = _Tracker(), Replica()
        # the embedded store is elsewhere (redis_server); the sidecar's own files stay tiny
        with _stack(mnt / "spool", redis_server.url, tracker) as (pub, _srv, c):
            _sync(c, rep)
            filler = mnt / f"filler-{uuid.uuid4().hex}"
            # fill the spool's filesystem to the last byte
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            for step in range(1, 21):  # training goes on: no publish raises
                tracker.step()
                pub.publish(step)
                time.sleep(0.01)
            wait_for(lambda: pub.stats.write_errors > 0, 10, "a failed write")
            assert pub.stats.last_write_error
            assert pub.stats.skipped_segments + pub.stats.write_errors >= 2
            assert pub._writer.queue.qsize() <= pub.config.max_pending_writes  # bounded memory
            os.unlink(filler)  # space returns
            tracker.step()
            stats = pub.publish(21)
            assert stats.kind.value == "base"
            _written(pub, stats.seq)
            wait_for(lambda: _caught_up(c, rep, tracker, stats.seq), 10, "caught up")
            # every row touched while the spool was full is in the tables: nothing lost
            assert torch.equal(rep.tables["t"], tracker.weight)
            tracker.step()
            assert pub.publish(22).kind.value == "delta"
            wait_for(lambda: _caught_up(c, rep, tracker, stats.seq + 1), 10, "deltas again")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
