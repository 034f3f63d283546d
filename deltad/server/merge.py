"""Window merge (union of ids, latest value wins), value lookup at a cursor, top-k with owed rows.

The merge of one table slice over several segments uses a last-writer index over the shard's
row range instead of ``torch.unique``: every segment's ids are unique, sorted and inside the
shard's ``[row_start, row_end)``, so writing each segment's number and row position at
``id - row_start`` (in order) and taking the nonzero entries yields the sorted union and, for
each id, the segment that wrote it last. That is O(ids + shard rows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from deltad.segment import SegmentChunk
from deltad.server.log import ChunkKey, LogEntry
from deltad.types import Form


@dataclass
class SliceRows:
    """Rows of one table slice: sorted global ids and their values (segment dtype)."""

    table: str
    num_rows: int
    dim: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    ids: torch.Tensor
    values: torch.Tensor

    @property
    def key(self) -> ChunkKey:
        return (self.table, self.col_start, self.col_end)

    @classmethod
    def like(
        cls, c: SegmentChunk | SliceRows, ids: torch.Tensor, values: torch.Tensor
    ) -> SliceRows:
        return cls(
            c.table, c.num_rows, c.dim, c.row_start, c.row_end, c.col_start, c.col_end, ids, values
        )

    def to_chunk(self) -> SegmentChunk:
        return SegmentChunk(
            self.table,
            self.num_rows,
            self.dim,
            self.row_start,
            self.row_end,
            self.col_start,
            self.col_end,
            self.ids,
            self.values,
        )


def merge_chunks(chunks: Sequence[SegmentChunk], *, with_values: bool = True) -> SliceRows:
    """Latest-value merge of one slice's chunks, oldest first (views when only one)."""
    last = chunks[-1]
    if len(chunks) == 1:
        return SliceRows.like(last, last.ids, last.values)
    row_start = min(c.row_start for c in chunks)
    n = max(c.row_end for c in chunks) - row_start
    # writer[r] = 1 + index of the last chunk holding row r (0: none); pos[r] its row there.
    # Measured (2 cores, 4 x 330k ids over 1M rows): 9 ms vs 31 ms for torch.unique.
    writer = torch.zeros(n, dtype=torch.int16 if len(chunks) < 32000 else torch.int32)
    pos = torch.empty(n, dtype=torch.int64) if with_values else None
    for i, c in enumerate(chunks):
        local = c.ids - row_start
        writer[local] = i + 1
        if pos is not None:
            pos[local] = torch.arange(c.ids.numel())
    local_ids = writer.nonzero().squeeze(1)
    ids = local_ids + row_start
    if pos is None:
        return SliceRows.like(last, ids, last.values[:0])
    who = writer[local_ids]
    at = pos[local_ids]
    values = torch.empty(ids.numel(), last.col_end - last.col_start, dtype=last.values.dtype)
    for i, c in enumerate(chunks):
        sel = (who == i + 1).nonzero().squeeze(1)
        if sel.numel():
            values.index_copy_(0, sel, c.values.index_select(0, at[sel]))
    return SliceRows.like(last, ids, values)


def merge_entries(
    entries: Sequence[LogEntry], keys: Iterable[ChunkKey] | None = None, *, with_values: bool = True
) -> dict[ChunkKey, SliceRows]:
    """Merge each slice (all, or ``keys``) over ``entries`` (oldest first)."""
    wanted = None if keys is None else set(keys)
    by_key: dict[ChunkKey, list[SegmentChunk]] = {}
    for e in entries:
        for k, c in e.chunks.items():
            if wanted is None or k in wanted:
                by_key.setdefault(k, []).append(c)
    return {k: merge_chunks(cs, with_values=with_values) for k, cs in by_key.items()}


def lookup(
    entries: Sequence[LogEntry], key: ChunkKey, ids: torch.Tensor, like: SliceRows
) -> torch.Tensor:
    """Values of ``ids`` (sorted) in the state after ``entries`` (oldest first); zeros if never
    written."""
    out = torch.zeros(ids.numel(), like.col_end - like.col_start, dtype=like.values.dtype)
    need = torch.arange(ids.numel())
    for e in reversed(entries):
        if need.numel() == 0:
            break
        c = e.chunks.get(key)
        if c is None or c.ids.numel() == 0:
            continue
        want = ids[need]
        p = torch.searchsorted(c.ids, want).clamp_(max=c.ids.numel() - 1)
        hit = c.ids[p] == want
        out[need[hit]] = c.values[p[hit]]
        need = need[~hit]
    return out


@dataclass
class WindowSlice:
    """What one slice contributes to a pull: rows to send, and rows left owed."""

    rows: SliceRows  # values at the head (empty [0, w] for IDS is fine: not sent)
    owed: SliceRows | None


def plan_slice(
    key: ChunkKey,
    merged: SliceRows | None,
    owed: SliceRows | None,
    *,
    head_state: Sequence[LogEntry],
    held_state: Sequence[LogEntry],
    form: Form,
    k: int,
    fraction: float,
    budget: int | None,
) -> WindowSlice:
    """Choose the rows of one slice to send; the rest become owed (held values kept).

    Candidates are the window's ids plus the rows already owed. With no owed rows, no top-k and
    no row budget, this is the merged window itself. Otherwise the held value of a candidate is
    its owed value if owed, else its value at the consumer's cursor (``held_state``); top-k
    ranks by L2 of (head - held), ``budget`` caps the count, unsent rows become owed.
    """
    assert merged is not None or owed is not None
    like = merged if merged is not None else owed
    assert like is not None
    if owed is None and form is not Form.TOPK and (budget is None or budget >= like.ids.numel()):
        return WindowSlice(like, None)
    if owed is None:
        cand = like.ids
    elif merged is None:
        cand = owed.ids
    else:
        cand = torch.unique(torch.cat([merged.ids, owed.ids]))
    head = (
        merged.values
        if merged is not None and cand.numel() == merged.ids.numel()
        else lookup(head_state, key, cand, like)
    )
    n = cand.numel()
    take = n
    if form is Form.TOPK:
        take = min(n, k) if k > 0 else min(n, math.ceil(fraction * n))
    if budget is not None:
        take = min(take, budget)
    if take >= n:
        return WindowSlice(SliceRows.like(like, cand, head), None)
    held = lookup(held_state, key, cand, like)
    if owed is not None:
        p = torch.searchsorted(cand, owed.ids)
        held[p] = owed.values
    if form is Form.TOPK:
        score = (head.to(torch.float32) - held.to(torch.float32)).norm(dim=1)
        chosen = torch.topk(score, take, sorted=False).indices.sort().values
    else:
        chosen = torch.arange(take)
    keep = torch.ones(n, dtype=torch.bool)
    keep[chosen] = False
    rest = keep.nonzero().squeeze(1)
    return WindowSlice(
        SliceRows.like(like, cand[chosen], head[chosen]),
        SliceRows.like(like, cand[rest], held[rest]),
    )
