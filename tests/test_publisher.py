"""SegmentPublisher on a real 2-rank gloo DMP: base + deltas rebuild the tables bit-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit import batch, spawn, toy_dmp

from deltad.config import PublisherConfig
from deltad.errors import SpoolError
from deltad.publisher import SegmentPublisher
from deltad.segment import apply_segments, read_segment
from deltad.spool import SpoolLayout
from deltad.tracker import DeltaTracker
from deltad.types import SegmentKind

MAX_STEPS = 200


def _gather(obj: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _full_tables(dmp: Any, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in dmp.state_dict().items():
        full = torch.empty(value.size()) if rank == 0 else None
        value.gather(dst=0, out=full)
        if full is not None:
            out[key.split(".")[-2]] = full
    return out


def _publisher_worker(rank: int, world_size: int, spool: str, blocked: str) -> None:
    dmp = toy_dmp(world_size)
    tracker = DeltaTracker(dmp)

    # An unwritable spool fails on every rank (none is left waiting in a collective).
    bad = SegmentPublisher(dmp, tracker, PublisherConfig(Path(blocked) / "spool", every_steps=1))
    with pytest.raises(SpoolError, match="not writable"):
        bad.start(0)
    with pytest.raises(SpoolError, match="not started"):
        bad.maybe_publish(1)

    # Time-based publishing: the decision is collective, so identical on every rank.
    cfg = PublisherConfig(Path(spool), model="toy", every_seconds=0.02, max_pending_writes=1)
    pub = SegmentPublisher(dmp, tracker, cfg)
    gen = pub.start(0)
    assert len(set(_gather(gen, world_size))) == 1
    published: list[int] = []
    step = 0
    while len(published) < 3 and step < MAX_STEPS:  # same on all ranks: published agrees
        step += 1
        dmp(batch(rank, step))[0].backward()
        if pub.maybe_publish(step) is not None:
            published.append(step)
    pub.close(step)
    with pytest.raises(SpoolError, match="closed"):
        pub.maybe_publish(step + 1)
    assert len(set(map(tuple, _gather(published, world_size)))) == 1
    assert len(published) == 3

    stats = pub.stats
    assert [s.seq for s in stats.segments] == list(range(len(published) + 2))
    assert [s.step for s in stats.segments] == [0, *published, step]
    assert stats.segments[0].kind is SegmentKind.BASE
    assert stats.segments[0].rows == sum(s.row_end - s.row_start for s in tracker.shards)
    assert all(s.write_s > 0 for s in stats.segments) and stats.rows > stats.segments[0].rows
    assert stats.calls == step and stats.stall_s > 0

    tables = _full_tables(dmp, rank)
    dist.barrier()
    if rank != 0:
        return
    layout = SpoolLayout(Path(spool), "toy")
    manifest = layout.read_manifest(gen)
    assert manifest.world_size == world_size and len(manifest.tables) == len(tables)
    segments = []
    for r in range(world_size):
        listed = layout.segments(gen, r)
        assert [seq for seq, _ in listed] == list(range(len(published) + 2))
        for _, path in listed:
            seg = read_segment(path)  # verifies the checksum
            assert seg.header.rank == r and seg.header.generation == gen
            segments.append(seg)
    segments.sort(key=lambda s: s.header.seq)
    rebuilt = apply_segments({}, segments)
    for name, full in tables.items():
        assert torch.equal(rebuilt[name], full), name


@pytest.mark.slow
def test_publisher_rebuilds_tables_bit_exactly(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    spawn(_publisher_worker, 2, tmp_path, str(tmp_path / "spool"), str(blocked))
