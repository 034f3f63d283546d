"""Synthetic segments and spools for the benchmarks that do not need a trainer.

Ids are skewed like real embedding traffic: row ``i`` is touched by a segment with
probability ``min(1, c / sqrt(i + 1))``, so hot rows recur across segments (merging has real
work to do) and every segment's ids are unique and ascending, as the format requires.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from deltad.segment.format import Segment, SegmentHeader, ShardRows, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.types import SegmentKind, Shard


def skewed_unique_ids(num_rows: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """About ``count`` unique ascending ids in ``[0, num_rows)``, hot rows first."""
    count = min(count, num_rows)
    i = torch.arange(1, num_rows + 1, dtype=torch.float32)
    w = i.rsqrt_()
    c = count / float(w.sum())
    p = (w * c).clamp_(max=1.0)
    # One rescale so that clamping does not lose too many ids.
    short = count - float(p.sum())
    if short > 0:
        free = float((p < 1).sum())
        if free:
            p = (p + short / free).clamp_(max=1.0)
    mask = torch.rand(num_rows, generator=gen) < p
    return mask.nonzero().squeeze(1)


def make_segments(
    *,
    total_ids: int,
    num_segments: int,
    dim: int,
    table: str = "t0",
    num_rows: int | None = None,
    seed: int = 0,
    model: str = "bench",
    generation: int = 1,
) -> list[Segment]:
    """In-memory delta segments 1..S of one table whose ids add up to about ``total_ids``."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_ids // num_segments)
    rows = num_rows or max(per * 2, total_ids)
    segs: list[Segment] = []
    for k in range(num_segments):
        ids = skewed_unique_ids(rows, per, gen)
        values = torch.full((ids.numel(), dim), float(k), dtype=torch.float32)
        chunk = ShardRows(
            shard=Shard(table, rows, dim, 0, rows, 0, dim),
            ids=ids,
            values=values,
        )
        header = SegmentHeader(
            model=model,
            generation=generation,
            rank=0,
            world_size=1,
            seq=k + 1,
            first_seq=k + 1,
            step=(k + 1) * 10,
            kind=SegmentKind.DELTA,
            created_unix=time.time(),
            shards=(),
        )
        segs.append(Segment(header=header, shards=[chunk]))
    return segs


def write_spool(
    root: Path,
    *,
    model: str,
    tables: int,
    rows_per_table: int,
    dim: int,
    deltas: int = 2,
    delta_fraction: float = 0.1,
    generation: int = 1,
    seed: int = 0,
) -> dict[str, int]:
    """A spool holding a base segment (every row) and ``deltas`` skewed delta segments.

    A fresh consumer's window is then the whole table set (base + deltas merged): its rows
    payload is ``tables * rows_per_table * (8 + dim * wire_bytes)``. Returns sizes.
    """
    layout = SpoolLayout(root, model)
    layout.ensure_writable()
    infos = tuple(
        TableInfo(
            name=f"t{i}",
            num_rows=rows_per_table,
            dim=dim,
            dtype="float32",
            module="sparse_arch.embedding_collection",
            kind="ec",
            sharding_type="table_wise",
        )
        for i in range(tables)
    )
    layout.write_manifest(
        GenerationManifest(
            model=model,
            generation=generation,
            world_size=1,
            start_step=0,
            created_unix=time.time(),
            tables=infos,
        ),
        fsync=False,
    )
    gen = torch.Generator().manual_seed(seed)

    def chunk(t: TableInfo, ids: torch.Tensor, fill: float) -> ShardRows:
        vals = torch.randn(ids.numel(), dim, generator=gen).add_(fill)
        return ShardRows(
            shard=Shard(t.name, t.num_rows, dim, 0, t.num_rows, 0, dim),
            ids=ids,
            values=vals,
        )

    base_chunks = [chunk(t, torch.arange(t.num_rows), 0.0) for t in infos]
    write_segment(
        layout.segment_path(generation, 0, 0),
        model=model,
        generation=generation,
        rank=0,
        world_size=1,
        seq=0,
        step=0,
        kind=SegmentKind.BASE,
        shards=base_chunks,
        fsync=False,
    )
    del base_chunks
    delta_rows = 0
    for s in range(1, deltas + 1):
        chunks = [
            chunk(t, skewed_unique_ids(t.num_rows, int(t.num_rows * delta_fraction), gen), s)
            for t in infos
        ]
        delta_rows += sum(c.ids.numel() for c in chunks)
        write_segment(
            layout.segment_path(generation, 0, s),
            model=model,
            generation=generation,
            rank=0,
            world_size=1,
            seq=s,
            step=s * 10,
            kind=SegmentKind.DELTA,
            shards=chunks,
            fsync=False,
        )
    return {
        "rows": tables * rows_per_table,
        "delta_rows": delta_rows,
        "segments": deltas + 1,
        "generation": generation,
    }


def publish_deltas(
    spools: list[Path],
    *,
    model: str,
    tables: int,
    rows_per_table: int,
    dim: int,
    changed: int,
    interval_s: float,
    stop: Any,
    first_seq: int = 3,
    seed: int = 7,
) -> int:
    """Write the same delta segment (``changed`` random rows of each of ``tables`` float
    tables, generation 1, rank 0) into every spool every ``interval_s`` seconds, as a
    trainer publishes, until ``stop`` (a threading.Event) is set; the last seq written.
    Seqs start at ``first_seq`` (after :func:`write_spool`'s base and two deltas)."""
    layouts = [SpoolLayout(s, model) for s in spools]
    gen = torch.Generator().manual_seed(seed)
    seq = first_seq - 1
    while not stop.wait(interval_s):  # bounded by stop
        seq += 1
        shards = []
        for t in range(tables):
            ids = torch.randperm(rows_per_table, generator=gen)[:changed].sort().values
            values = torch.randn(ids.numel(), dim, generator=gen)
            shard = Shard(f"t{t}", rows_per_table, dim, 0, rows_per_table, 0, dim)
            shards.append(ShardRows(shard=shard, ids=ids, values=values))
        for layout in layouts:
            write_segment(
                layout.segment_path(1, 0, seq), model=model, generation=1, rank=0,
                world_size=1, seq=seq, step=seq * 10, kind=SegmentKind.DELTA, shards=shards,
                fsync=False,
            )  # fmt: skip
    return seq
