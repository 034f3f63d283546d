"""The relay's own spool: the head of its log, and the segments and dense states a mirror writes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import UpstreamError
from deltad.segment.format import ShardRows, encode_dense, write_dense, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.serve.index.log import SegmentLog
from deltad.types import SegmentKind, Shard, ShardKey
from deltad.v1 import delta_pb2 as pb

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LocalHead:
    """The head of the relay's own log: what it holds, and how to write more of it."""

    generation: int
    seq: int
    step: int
    world_size: int
    #: every (table, col_start, col_end) of the base, in order, with its shard's row range
    ranges: dict[ShardKey, tuple[int, int]]
    dtypes: dict[str, torch.dtype]


class MirrorSpool:
    """Writes the windows a relay pulled into its spool: a resync as a base, a delta as one
    merged segment, a dense state before the segment that makes it visible (see
    :mod:`deltad.serve.relay.mirror`). ``head`` is the relay's log head (None: no base yet)."""

    def __init__(self, seglog: SegmentLog, model: str, *, fsync: bool) -> None:
        self.log = seglog
        self.layout: SpoolLayout = seglog.layout
        self.model = model
        self.rank = seglog.rank
        self.fsync = fsync
        #: local segments and dense state files written (for tests and logs)
        self.written = 0
        self.dense_written = 0
        self.head = self._read_head()

    def _read_head(self) -> LocalHead | None:
        self.log.refresh()
        snap = self.log.snapshot()
        if snap is None:
            return None
        ranges = {k: (c.shard.row_start, c.shard.row_end) for k, c in snap.base.shards.items()}
        return LocalHead(
            snap.generation,
            snap.head.seq,
            snap.head.step,
            snap.manifest.world_size,
            ranges,
            {t.name: _DTYPES.get(t.dtype, torch.float32) for t in snap.manifest.tables},
        )

    def write_base(self, d: RankDelta, created: float, manifest: GenerationManifest | None) -> None:
        """``d`` (a resync: every row) as a base ``0..to_seq``; ``manifest`` first if ``d``
        starts a generation (None: the head's)."""
        loc = self.head
        if manifest is not None:
            self.layout.write_manifest(manifest, fsync=self.fsync)
            dtypes = {t.name: _DTYPES.get(t.dtype, torch.float32) for t in manifest.tables}
            world = manifest.world_size
        else:
            assert loc is not None
            dtypes, world = loc.dtypes, loc.world_size
        ranges: dict[ShardKey, tuple[int, int]] = {}
        rows = []
        for s in d.shards:
            ids, values, raw = _sorted(s)
            n = ids.numel()
            # a base holds every row of the shard: its row range is that of its ids
            r0, r1 = (int(ids[0]), int(ids[-1]) + 1) if n else (0, 0)
            ranges[s.shard.key] = (r0, r1)
            rows.append(_shard_rows(s, r0, r1, ids, values, dtypes, raw))
        self._write_dense(d)
        self._write(d, SegmentKind.BASE, 0, world, rows, created)
        self.head = LocalHead(d.generation, d.to_seq, d.to_step, world, ranges, dtypes)

    def write_delta(self, d: RankDelta, created: float) -> None:
        """``d`` as one segment ``head.seq + 1..to_seq``; UpstreamError for a shard the
        base did not have."""
        loc = self.head
        assert loc is not None
        got = {s.shard.key: s for s in d.shards}
        unknown = set(got) - set(loc.ranges)
        if unknown:
            raise UpstreamError(f"upstream sent shards {sorted(unknown)} its base did not have")
        rows = []
        for key, (r0, r1) in loc.ranges.items():
            s = got.get(key)
            if s is None:
                continue
            ids, values, raw = _sorted(s)
            rows.append(_shard_rows(s, r0, r1, ids, values, loc.dtypes, raw))
        self._write_dense(d)
        self._write(d, SegmentKind.DELTA, loc.seq + 1, loc.world_size, rows, created)
        self.head = LocalHead(
            d.generation, d.to_seq, d.to_step, loc.world_size, loc.ranges, loc.dtypes
        )

    def _write_dense(self, d: RankDelta) -> None:
        """The window's dense state as ``dense-<seq>`` (before the segment that makes it
        visible: a log that sees segment ``to_seq`` finds it), unless the relay has it."""
        if d.dense_seq is None or d.dense_step is None:
            return
        path = self.layout.dense_path(d.generation, self.rank, d.dense_seq)
        if path.exists():
            return
        data = encode_dense(
            model=self.model, generation=d.generation, rank=self.rank, seq=d.dense_seq,
            step=d.dense_step, tensors=d.dense,
        )  # fmt: skip
        write_dense(path, data, fsync=self.fsync)
        self.dense_written += 1

    def _write(
        self,
        d: RankDelta,
        kind: SegmentKind,
        first_seq: int,
        world: int,
        rows: list[ShardRows],
        created: float,
    ) -> None:
        write_segment(
            self.layout.segment_path(d.generation, self.rank, d.to_seq),
            model=self.model,
            generation=d.generation,
            rank=self.rank,
            world_size=world,
            seq=d.to_seq,
            first_seq=first_seq,
            step=d.to_step,
            kind=kind,
            shards=rows,
            fsync=self.fsync,
            created_unix=created,
        )
        self.written += 1
        self.log.refresh()  # serve it now, not at the next poll


def _sorted(s: ShardUpdate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The shard's ids ascending (segments require it) with their values (and raw ids, of a
    managed-collision shard)."""
    ids, raw = s.ids, s.raw_ids
    assert s.values is not None, "a rows-form pull carries values"
    values = s.values
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        order = torch.argsort(ids)
        ids, values = ids[order], values[order]
        raw = None if raw is None else raw[order]
    return ids, values, raw


def _shard_rows(
    s: ShardUpdate,
    r0: int,
    r1: int,
    ids: torch.Tensor,
    values: torch.Tensor,
    dtypes: dict[str, torch.dtype],
    raw: torch.Tensor | None = None,
) -> ShardRows:
    # fp32 on the wire carries fp16 / bf16 table values exactly: cast back to the table's dtype
    # (a managed-collision shard keeps its raw ids and the window's evicted: version 3)
    sh = s.shard
    dtype = dtypes.get(sh.table, torch.float32)
    evicted = s.evicted_raw_ids
    return ShardRows(
        Shard(sh.table, sh.num_rows, sh.dim, r0, r1, sh.col_start, sh.col_end),
        ids.contiguous(),
        values.to(dtype).contiguous(),
        None if raw is None else raw.contiguous(),
        None if raw is None or evicted is None else evicted.contiguous(),
    )


def status_manifest(st: pb.StatusResponse, d: RankDelta) -> GenerationManifest:
    """The generation manifest a relay writes for ``d``'s generation, from the upstream's
    Status (the owning module's name does not travel: it is empty)."""
    return GenerationManifest(
        model=st.model,
        generation=d.generation,
        world_size=st.world_size,
        start_step=d.to_step,
        created_unix=time.time(),
        tables=tuple(
            TableInfo(
                t.table,
                t.num_rows,
                t.dim,
                t.dtype,
                "",
                t.kind,
                t.sharding_type,
                managed_collision=t.managed_collision,
            )
            for t in st.tables
        ),
    )


def clean_temp_files(layout: SpoolLayout, rank: int) -> int:
    """Delete segment temp files a killed relay left in its rank's directories; return how
    many (only the relay writes there, and it has not started yet)."""
    gone = 0
    for g in layout.generations():
        d: Path = layout.rank_dir(g, rank)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if n.startswith(".tmp-"):
                (d / n).unlink(missing_ok=True)
                gone += 1
    return gone
