"""Writing a segment file: its arrays laid out, streamed through the checksum, atomically."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from deltad.errors import SpoolError
from deltad.segment.framing import (
    FORMAT_VERSION,
    IDENTITY_FORMAT_VERSION,
    MAGICS,
    PREFIX,
    TRAILER,
    Checksum,
    align,
)
from deltad.segment.header import SegmentHeader, ShardMeta, dtype_name
from deltad.segment.rows import ShardRows
from deltad.segment.spool import write_atomic
from deltad.types import SegmentKind


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    arr = t.detach().contiguous().cpu()
    if arr.dtype == torch.bfloat16:
        arr = arr.view(torch.int16)
    flat: Any = arr.numpy().reshape(-1).view(np.uint8)
    return memoryview(flat)


class _ChecksumWriter:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.checksum = Checksum(FORMAT_VERSION)
        self.pos = 0

    def write(self, b: bytes | memoryview) -> None:
        self.f.write(b)
        self.checksum.update(b)
        self.pos += len(b)

    def pad_to(self, pos: int) -> None:
        if pos > self.pos:
            self.write(b"\0" * (pos - self.pos))


def write_segment(
    path: Path,
    *,
    model: str,
    generation: int,
    rank: int,
    world_size: int,
    seq: int,
    step: int,
    kind: SegmentKind,
    shards: Sequence[ShardRows],
    first_seq: int | None = None,
    fsync: bool = True,
    created_unix: float | None = None,
    first_created_unix: float | None = None,
    values_of: Callable[[int], torch.Tensor] | None = None,
) -> SegmentHeader:
    """Write a segment atomically (temp file, fsync, rename, fsync dir); return its header.

    ``values_of(i)``: shard ``i``'s values, made as the file is written (its ``shards``' values
    are then only shapes and dtypes, e.g. ``device="meta"`` tensors), so a merge need not hold
    every shard's values at once.

    ``created_unix`` (default: now) is when its rows were read from the trainer; a relay that
    mirrors a segment keeps the upstream's, so ages mean the same at every level. A merge
    keeps its newest input's and gives its oldest input's as ``first_created_unix``."""
    path = Path(path)
    metas: list[ShardMeta] = []
    off = 0
    for c in shards:
        c.check()
        ids_off = off
        off = align(off + c.ids.numel() * 8)
        vals_off = off
        off = align(off + c.values.numel() * c.values.element_size())
        raw_off = ev_off = None
        n_evicted = 0
        if c.raw_ids is not None:
            raw_off = off
            off = align(off + c.raw_ids.numel() * 8)
            n_evicted = 0 if c.evicted is None else c.evicted.numel()
            ev_off = off
            off = align(off + n_evicted * 8)
        metas.append(
            ShardMeta(
                c.shard,
                dtype=dtype_name(c.values.dtype),
                count=c.ids.numel(),
                ids_offset=ids_off,
                values_offset=vals_off,
                raw_ids_offset=raw_off,
                evicted_count=n_evicted,
                evicted_offset=ev_off,
            )
        )
    version = IDENTITY_FORMAT_VERSION if any(m.has_identities for m in metas) else FORMAT_VERSION
    magic, end_magic = MAGICS[version]
    header = SegmentHeader(
        model=model,
        generation=generation,
        rank=rank,
        world_size=world_size,
        seq=seq,
        first_seq=seq if first_seq is None else first_seq,
        step=step,
        kind=kind,
        created_unix=time.time() if created_unix is None else created_unix,
        shards=tuple(metas),
        format_version=version,
        first_created_unix=first_created_unix,
    )
    raw = header.to_json()
    payload_start = align(PREFIX.size + len(raw))

    def stream(f: BinaryIO) -> None:
        w = _ChecksumWriter(f)
        w.write(PREFIX.pack(magic, len(raw), 0))
        w.write(raw)
        w.pad_to(payload_start)
        for i, (c, m) in enumerate(zip(shards, metas, strict=True)):
            w.pad_to(payload_start + m.ids_offset)
            w.write(_as_bytes_view(c.ids))
            w.pad_to(payload_start + m.values_offset)
            if values_of is None:
                w.write(_as_bytes_view(c.values))
            else:
                values = values_of(i)
                if values.shape != c.values.shape or values.dtype != c.values.dtype:
                    raise ValueError(
                        f"shard {i}: values {tuple(values.shape)} {values.dtype} "
                        f"!= {tuple(c.values.shape)} {c.values.dtype}"
                    )
                w.write(_as_bytes_view(values))
                del values
            if c.raw_ids is not None and m.raw_ids_offset is not None:
                w.pad_to(payload_start + m.raw_ids_offset)
                w.write(_as_bytes_view(c.raw_ids))
                if c.evicted is not None and m.evicted_offset is not None:
                    w.pad_to(payload_start + m.evicted_offset)
                    w.write(_as_bytes_view(c.evicted))
        w.pad_to(payload_start + off)
        f.write(TRAILER.pack(w.checksum.value(), end_magic))

    try:
        write_atomic(path, stream, fsync=fsync, suffix=".dseg")
    except OSError as e:
        raise SpoolError(f"cannot write segment {path}: {e}") from e
    return header
