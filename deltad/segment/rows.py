"""Segments in memory: a shard's rows, a segment, and applying segments onto full tables."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from deltad.errors import SpoolError
from deltad.segment.header import SegmentHeader
from deltad.types import Shard, ShardKey


@dataclass
class ShardRows:
    """Rows of one shard: global ids (int64, unique, ascending) and their values
    (``[len(ids), shard.width]``; an ids-only merge on the sidecar leaves them empty).

    A shard of a managed-collision table also carries its slots' identities: ``raw_ids``
    (int64, aligned with ``ids``: the raw id each listed slot holds after this segment's step,
    :data:`deltad.types.EMPTY_RAW_ID` for a slot emptied) and ``evicted`` (int64, ascending,
    unique: the raw ids that left the shard's slots since the previous segment). Both are
    None for ordinary tables. A base lists every slot, so its ``raw_ids`` is the whole
    slot -> raw id map of the shard.
    """

    shard: Shard
    ids: torch.Tensor
    values: torch.Tensor
    raw_ids: torch.Tensor | None = None
    evicted: torch.Tensor | None = None

    @property
    def has_identities(self) -> bool:
        return self.raw_ids is not None

    def check(self) -> None:
        """Raise SpoolError unless ids and values have the shapes a segment stores."""
        if self.ids.dtype != torch.int64 or self.ids.dim() != 1:
            raise SpoolError(f"shard {self.shard.table}: ids must be a 1-D int64 tensor")
        width = self.shard.width
        if self.values.dim() != 2 or self.values.shape != (self.ids.numel(), width):
            raise SpoolError(
                f"shard {self.shard.table}: values shape {tuple(self.values.shape)} != "
                f"({self.ids.numel()}, {width})"
            )
        if self.evicted is not None and self.raw_ids is None:
            raise SpoolError(f"shard {self.shard.table}: evicted raw ids without raw_ids")
        for name, t in (("raw_ids", self.raw_ids), ("evicted", self.evicted)):
            if t is not None and (t.dtype != torch.int64 or t.dim() != 1):
                raise SpoolError(f"shard {self.shard.table}: {name} must be a 1-D int64 tensor")
        if self.raw_ids is not None and self.raw_ids.numel() != self.ids.numel():
            raise SpoolError(
                f"shard {self.shard.table}: {self.raw_ids.numel()} raw ids for "
                f"{self.ids.numel()} slots"
            )

    @property
    def key(self) -> ShardKey:
        return self.shard.key

    def with_rows(
        self,
        ids: torch.Tensor,
        values: torch.Tensor,
        raw_ids: torch.Tensor | None = None,
        evicted: torch.Tensor | None = None,
    ) -> ShardRows:
        """Other rows of the same shard (with their identities, for a managed-collision one)."""
        return ShardRows(self.shard, ids, values, raw_ids, evicted)


@dataclass
class Segment:
    """A segment in memory: its header and its shards' rows (views into the file when read)."""

    header: SegmentHeader
    shards: list[ShardRows] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(c.ids.numel() for c in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(
            c.ids.nbytes
            + c.values.nbytes
            + (0 if c.raw_ids is None else c.raw_ids.nbytes)
            + (0 if c.evicted is None else c.evicted.nbytes)
            for c in self.shards
        )


def apply_segments(
    tables: dict[str, torch.Tensor], segments: Iterable[Segment]
) -> dict[str, torch.Tensor]:
    """Apply segments in order onto full tables (allocated on first sight); return them.

    The reference rebuild used by tests and tools: ``tables[name][ids, cols] = values``.
    """
    for seg in segments:
        for r in seg.shards:
            sh = r.shard
            t = tables.get(sh.table)
            if t is None:
                t = torch.zeros(sh.num_rows, sh.dim, dtype=r.values.dtype)
                tables[sh.table] = t
            if r.ids.numel():
                t[r.ids, sh.col_start : sh.col_end] = r.values.to(t.dtype)
    return tables
