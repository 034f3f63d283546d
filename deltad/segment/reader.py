"""Reading a segment file: its header alone, or the whole file mapped, verified, as views.

:func:`read_segment` checks the magic and version, the end marker, the checksum and that
every shard's arrays lie inside the payload; deeper checks of what the header says are
:mod:`deltad.segment.validate`'s.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.framing import (
    IDENTITY_FORMAT_VERSION,
    MAGIC,
    MAGICS,
    PREFIX,
    TRAILER,
    VERSION_OF_MAGIC,
    align,
    checksum,
)
from deltad.segment.header import VALUE_DTYPES, SegmentHeader
from deltad.segment.rows import Segment, ShardRows


def _version_of(magic: bytes, path: Path) -> int:
    version = VERSION_OF_MAGIC.get(magic)
    if version is None:
        if magic[:6] == MAGIC[:6]:
            raise SegmentCorruptError(
                f"{path}: segment format {magic[6:]!r} is not one of {sorted(MAGICS)} "
                "(written by a newer deltad?)"
            )
        raise SegmentCorruptError(f"{path}: not a deltad segment (magic {magic!r})")
    return version


def _checked_header(raw: bytes, version: int, path: Path) -> SegmentHeader:
    header = SegmentHeader.from_json(raw)
    if header.format_version != version:
        raise SegmentCorruptError(
            f"{path}: header says format {header.format_version}, magic says {version}"
        )
    return header


def _parse_prefix(buf: Any, path: Path) -> tuple[int, int, SegmentHeader]:
    """(format version, payload start, header) of a mapped segment."""
    size = len(buf)
    if size < PREFIX.size + TRAILER.size:
        raise SegmentCorruptError(f"{path}: truncated ({size} bytes)")
    magic, hlen, _ = PREFIX.unpack_from(buf, 0)
    version = _version_of(magic, path)
    if PREFIX.size + hlen > size - TRAILER.size:
        raise SegmentCorruptError(f"{path}: header length {hlen} past end of file")
    header = _checked_header(bytes(buf[PREFIX.size : PREFIX.size + hlen]), version, path)
    return version, align(PREFIX.size + hlen), header


#: most bytes a segment's header may take
MAX_HEADER_BYTES = 64 * 1024 * 1024


def read_header(path: Path) -> SegmentHeader:
    """Read only a segment's header (no checksum verification)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return read_header_at(f.fileno(), path)[1]
    except OSError as e:
        raise SpoolError(f"cannot read segment {path}: {e}") from e


def read_header_at(fd: int, path: Path) -> tuple[int, SegmentHeader]:
    """(header length, header) of the segment file open at ``fd``, read with ``pread`` (the
    file's offset is left alone, nothing past the header is read); ``path`` names it in errors.
    OSError propagates."""
    head = os.pread(fd, PREFIX.size, 0)
    if len(head) < PREFIX.size:
        raise SegmentCorruptError(f"{path}: truncated")
    magic, hlen, _ = PREFIX.unpack(head)
    version = _version_of(magic, path)
    if hlen > MAX_HEADER_BYTES:
        raise SegmentCorruptError(f"{path}: absurd header length {hlen}")
    raw = os.pread(fd, hlen, PREFIX.size)
    if len(raw) != hlen:
        raise SegmentCorruptError(f"{path}: truncated header")
    return hlen, _checked_header(raw, version, path)


def file_size(header: SegmentHeader, header_bytes: int) -> int:
    """The bytes of a segment file with ``header`` (``header_bytes`` long), laid out as the
    writer lays it out: prefix and header, each shard's arrays at their offsets (aligned), the
    trailer. KeyError for an unknown value dtype."""
    end = 0
    for m in header.shards:
        esize = torch.empty((), dtype=VALUE_DTYPES[m.dtype]).element_size()
        end = max(
            end, m.ids_offset + m.count * 8, m.values_offset + m.count * m.shard.width * esize
        )
        if m.raw_ids_offset is not None:
            end = max(end, m.raw_ids_offset + m.count * 8)
        if m.evicted_offset is not None:
            end = max(end, m.evicted_offset + m.evicted_count * 8)
    return align(PREFIX.size + header_bytes) + align(end) + TRAILER.size


def read_segment(path: Path, *, verify: bool = True) -> Segment:
    """Map a segment file and return it with zero-copy tensor views of its rows.

    With ``verify`` (the default) the checksum of the whole file (XXH3-64, or crc32 for
    version 1) is checked first and a mismatch raises :class:`SegmentCorruptError`. The views stay valid while referenced.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise SegmentCorruptError(f"{path}: empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise SpoolError(f"cannot read segment {path}: {e}") from e
    version, payload_start, header = _parse_prefix(mm, path)
    stored, end_magic = TRAILER.unpack_from(mm, size - TRAILER.size)
    if end_magic != MAGICS[version][1]:
        raise SegmentCorruptError(f"{path}: missing end marker (truncated?)")
    if verify and checksum(memoryview(mm)[: size - TRAILER.size], version) != stored:
        raise SegmentCorruptError(f"{path}: checksum mismatch")
    arr = np.frombuffer(mm, dtype=np.uint8)
    shards: list[ShardRows] = []
    limit = size - TRAILER.size
    for m in header.shards:
        width = m.shard.width
        dtype = VALUE_DTYPES.get(m.dtype)
        if dtype is None:
            raise SegmentCorruptError(f"{path}: unknown dtype {m.dtype!r}")
        esize = torch.empty((), dtype=dtype).element_size()
        i0 = payload_start + m.ids_offset
        v0 = payload_start + m.values_offset
        i1, v1 = i0 + m.count * 8, v0 + m.count * width * esize
        if i1 > limit or v1 > limit or m.count < 0 or width < 0:
            raise SegmentCorruptError(f"{path}: shard {m.shard.table} points past the payload")
        ids = torch.from_numpy(arr[i0:i1]).view(torch.int64)
        values = torch.from_numpy(arr[v0:v1]).view(dtype).view(m.count, width)
        raw_ids = evicted = None
        if m.raw_ids_offset is not None:
            if version < IDENTITY_FORMAT_VERSION or m.evicted_offset is None:
                raise SegmentCorruptError(
                    f"{path}: shard {m.shard.table} has identities in a version {version} file"
                )
            r0, e0 = payload_start + m.raw_ids_offset, payload_start + m.evicted_offset
            r1, e1 = r0 + m.count * 8, e0 + m.evicted_count * 8
            if r1 > limit or e1 > limit or m.evicted_count < 0:
                raise SegmentCorruptError(f"{path}: shard {m.shard.table} points past the payload")
            raw_ids = torch.from_numpy(arr[r0:r1]).view(torch.int64)
            evicted = torch.from_numpy(arr[e0:e1]).view(torch.int64)
        shards.append(ShardRows(m.shard, ids, values, raw_ids, evicted))
    return Segment(header=header, shards=shards)
