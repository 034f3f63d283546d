"""The segment file format (version 2; version 1 is still read): what one rank publishes at
one step boundary.

A segment is a set of "latest value" rows per table shard, in one file::

    offset 0   magic  b"DLTSEG02"  (b"DLTSEG01")       8 bytes
           8   header length H (uint32 LE)             4 bytes
          12   reserved (0)                            4 bytes
          16   header: UTF-8 JSON, H bytes             (see SegmentHeader / ShardMeta)
               zero padding to a multiple of 64
           P   payload: per shard, ids then values, each 64-byte aligned; offsets in the
               header are relative to P. ids are int64 LE global row ids, unique, ascending;
               values are row-major [count, col_end - col_start] in the shard's dtype.
        end-16 checksum of every byte before the trailer: 8 bytes
               v2: XXH3-64 (uint64 LE); v1: crc32 (uint32 LE), then 4 reserved zero bytes
        end-8  magic  b"DLTEND02"  (b"DLTEND01")       8 bytes

Files are written to a hidden temp name in the destination directory, fsynced, renamed into
place and the directory fsynced, so a reader never sees half a segment. A segment that merges
the original segments ``first_seq..seq`` carries both numbers (a base has ``first_seq == 0``).
Writers write version 2 (XXH3 runs at ~30 GB/s here, zlib's crc32 at ~4); readers read both.
See docs/segment-format.md for the rules readers follow.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.spool import write_atomic
from deltad.types import SegmentKind, Shard, ShardKey

FORMAT_VERSION = 2
#: The version written when a shard carries managed-collision identities (raw ids, evictions):
#: a reader of version 2 refuses such a segment rather than serving slots without identities.
IDENTITY_FORMAT_VERSION = 3
#: Versions this module reads, with their leading and trailing magic.
MAGICS: dict[int, tuple[bytes, bytes]] = {
    1: (b"DLTSEG01", b"DLTEND01"),
    2: (b"DLTSEG02", b"DLTEND02"),
    3: (b"DLTSEG03", b"DLTEND03"),
}
MAGIC, END_MAGIC = MAGICS[FORMAT_VERSION]
_VERSION_OF_MAGIC = {m: v for v, (m, _) in MAGICS.items()}
ALIGN = 64
_PREFIX = struct.Struct("<8sII")
_TRAILER = struct.Struct("<Q8s")  # checksum (v1: crc32 in the low 4 bytes), end magic


class _Checksum:
    """The running checksum of a segment version: XXH3-64 (v2) or zlib crc32 (v1)."""

    def __init__(self, version: int) -> None:
        self._xxh = xxhash.xxh3_64() if version >= 2 else None
        self._crc = 0

    def update(self, b: bytes | memoryview) -> None:
        if self._xxh is not None:
            self._xxh.update(b)
        else:
            self._crc = zlib.crc32(b, self._crc)

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc


def checksum(buf: bytes | memoryview, version: int = FORMAT_VERSION) -> int:
    """The checksum a segment of ``version`` stores for the bytes ``buf``."""
    c = _Checksum(version)
    c.update(buf)
    return c.value()


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The on-disk name of a value dtype; raises SpoolError for unsupported ones."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise SpoolError(f"unsupported segment value dtype {dtype}") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ShardMeta:
    """Where one shard's rows sit in a segment, and what they are.

    On disk (the header's ``chunks`` list) the shard's fields stand flat beside the others.
    """

    shard: Shard
    dtype: str
    count: int  # number of rows of the shard in this segment
    ids_offset: int = 0
    values_offset: int = 0
    #: Version 3, managed-collision tables only: where the ``count`` raw ids (int64, aligned
    #: with ``ids``: the raw id each slot holds now, ``EMPTY_RAW_ID`` for an emptied slot) sit.
    raw_ids_offset: int | None = None
    #: Version 3: raw ids evicted from the shard's slots since the previous segment (int64,
    #: ascending, unique), ``evicted_count`` of them at ``evicted_offset``.
    evicted_count: int = 0
    evicted_offset: int | None = None

    @property
    def has_identities(self) -> bool:
        """The shard is of a managed-collision table and carries its slots' raw ids."""
        return self.raw_ids_offset is not None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            **asdict(self.shard),
            "dtype": self.dtype,
            "count": self.count,
            "ids_offset": self.ids_offset,
            "values_offset": self.values_offset,
        }
        if self.has_identities:  # absent for ordinary tables: version-2 headers unchanged
            d["raw_ids_offset"] = self.raw_ids_offset
            d["evicted_count"] = self.evicted_count
            d["evicted_offset"] = self.evicted_offset
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardMeta:
        d = dict(d)
        shard = Shard(**{f: d.pop(f) for f in _SHARD_FIELDS})
        return cls(shard, **d)


_SHARD_FIELDS = tuple(f.name for f in fields(Shard))


@dataclass(frozen=True)
class SegmentHeader:
    """Everything about a segment except its rows."""

    model: str
    generation: int
    rank: int
    world_size: int
    seq: int
    first_seq: int
    step: int
    kind: SegmentKind
    created_unix: float
    shards: tuple[ShardMeta, ...]
    format_version: int = FORMAT_VERSION
    #: A merge of ``first_seq..seq``: when the trainer published ``first_seq`` (the oldest step
    #: in it); ``created_unix`` is then when it published ``seq`` (the newest). None (files
    #: written before this field, and unmerged segments): ``created_unix``.
    first_created_unix: float | None = None

    @property
    def first_created(self) -> float:
        """When the trainer published the oldest step this segment holds."""
        return self.created_unix if self.first_created_unix is None else self.first_created_unix

    def to_json(self) -> bytes:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["kind"] = self.kind.value
        d["chunks"] = [m.to_dict() for m in d.pop("shards")]
        if self.first_created_unix is None:  # unmerged: the header older deltads read
            del d["first_created_unix"]
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SegmentHeader:
        try:
            d = json.loads(raw)
            if d.get("format_version") not in MAGICS:
                raise SegmentCorruptError(
                    f"segment format version {d.get('format_version')} is not one of "
                    f"{sorted(MAGICS)} (written by a newer deltad?)"
                )
            d["kind"] = SegmentKind(d["kind"])
            d["shards"] = tuple(ShardMeta.from_dict(c) for c in d.pop("chunks"))
            return cls(**d)
        except SegmentCorruptError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise SegmentCorruptError(f"bad segment header: {e}") from e


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


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    arr = t.detach().contiguous().cpu()
    if arr.dtype == torch.bfloat16:
        arr = arr.view(torch.int16)
    flat: Any = arr.numpy().reshape(-1).view(np.uint8)
    return memoryview(flat)


class _ChecksumWriter:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.checksum = _Checksum(FORMAT_VERSION)
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
        off = _align(off + c.ids.numel() * 8)
        vals_off = off
        off = _align(off + c.values.numel() * c.values.element_size())
        raw_off = ev_off = None
        n_evicted = 0
        if c.raw_ids is not None:
            raw_off = off
            off = _align(off + c.raw_ids.numel() * 8)
            n_evicted = 0 if c.evicted is None else c.evicted.numel()
            ev_off = off
            off = _align(off + n_evicted * 8)
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
    payload_start = _align(_PREFIX.size + len(raw))

    def stream(f: BinaryIO) -> None:
        w = _ChecksumWriter(f)
        w.write(_PREFIX.pack(magic, len(raw), 0))
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
        f.write(_TRAILER.pack(w.checksum.value(), end_magic))

    try:
        write_atomic(path, stream, fsync=fsync, suffix=".dseg")
    except OSError as e:
        raise SpoolError(f"cannot write segment {path}: {e}") from e
    return header


def _version_of(magic: bytes, path: Path) -> int:
    version = _VERSION_OF_MAGIC.get(magic)
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
    if size < _PREFIX.size + _TRAILER.size:
        raise SegmentCorruptError(f"{path}: truncated ({size} bytes)")
    magic, hlen, _ = _PREFIX.unpack_from(buf, 0)
    version = _version_of(magic, path)
    if _PREFIX.size + hlen > size - _TRAILER.size:
        raise SegmentCorruptError(f"{path}: header length {hlen} past end of file")
    header = _checked_header(bytes(buf[_PREFIX.size : _PREFIX.size + hlen]), version, path)
    return version, _align(_PREFIX.size + hlen), header


def read_header(path: Path) -> SegmentHeader:
    """Read only a segment's header (no checksum verification)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_PREFIX.size)
            if len(head) < _PREFIX.size:
                raise SegmentCorruptError(f"{path}: truncated")
            magic, hlen, _ = _PREFIX.unpack(head)
            version = _version_of(magic, path)
            if hlen > 64 * 1024 * 1024:
                raise SegmentCorruptError(f"{path}: absurd header length {hlen}")
            raw = f.read(hlen)
            if len(raw) != hlen:
                raise SegmentCorruptError(f"{path}: truncated header")
    except OSError as e:
        raise SpoolError(f"cannot read segment {path}: {e}") from e
    return _checked_header(raw, version, path)


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
    stored, end_magic = _TRAILER.unpack_from(mm, size - _TRAILER.size)
    if end_magic != MAGICS[version][1]:
        raise SegmentCorruptError(f"{path}: missing end marker (truncated?)")
    if verify and checksum(memoryview(mm)[: size - _TRAILER.size], version) != stored:
        raise SegmentCorruptError(f"{path}: checksum mismatch")
    arr = np.frombuffer(mm, dtype=np.uint8)
    shards: list[ShardRows] = []
    limit = size - _TRAILER.size
    for m in header.shards:
        width = m.shard.width
        dtype = _DTYPES.get(m.dtype)
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


# --- dense state files ---------------------------------------------------------------------
#
# A dense state is the model's dense parameters and buffers (everything that is not a sharded
# embedding table) at one step, written by rank 0 next to its segment of the same seq::
#
#     offset 0   magic b"DLTDNS01", header length H (uint32 LE), reserved (0)     16 bytes
#           16   header: UTF-8 JSON (DenseHeader), zero padding to a multiple of 64
#            P   payload: each tensor's bytes (row-major, its dtype, LE), 64-byte aligned;
#                offsets in the header are relative to P
#        end-16  XXH3-64 of every byte before the trailer (uint64 LE), b"DNSEND01"
#
# Built in memory (dense state is small next to tables) with the segments' checksum, then
# written with deltad.segment.spool.write_atomic.

DENSE_MAGIC, DENSE_END_MAGIC = b"DLTDNS01", b"DNSEND01"
DENSE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class DenseTensorMeta:
    """One dense tensor in a dense state file."""

    name: str  # its name in the model's state_dict (parameters and buffers)
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "int64", "bool"
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class DenseHeader:
    """Everything about a dense state file except its tensor bytes."""

    model: str
    generation: int
    rank: int
    seq: int  # the seq of the rank's segment taken at the same drain point
    step: int
    created_unix: float
    tensors: tuple[DenseTensorMeta, ...]
    format_version: int = DENSE_FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DenseHeader:
        try:
            d = json.loads(raw)
            if d.get("format_version") != DENSE_FORMAT_VERSION:
                raise SegmentCorruptError(
                    f"dense format version {d.get('format_version')} is not "
                    f"{DENSE_FORMAT_VERSION} (written by a newer deltad?)"
                )
            d["tensors"] = tuple(
                DenseTensorMeta(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"]
            )
            return cls(**d)
        except SegmentCorruptError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise SegmentCorruptError(f"bad dense header: {e}") from e


@dataclass
class DenseState:
    """A dense state in memory: header and tensors (views into the mapped file when read)."""

    header: DenseHeader
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.header.tensors)


def dense_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dense file's dtype name; SegmentCorruptError if it is none."""
    dt = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dt, torch.dtype) or dt.is_complex:
        raise SegmentCorruptError(f"unknown dense dtype {name!r}")
    return dt


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor (row-major), without a copy where it is contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    arr: Any = flat.view(torch.uint8).numpy()
    return memoryview(arr)


def encode_dense(
    *, model: str, generation: int, rank: int, seq: int, step: int, tensors: dict[str, torch.Tensor]
) -> bytes:
    """The bytes of a dense state file holding ``tensors`` (CPU; any real dtype)."""
    metas: list[DenseTensorMeta] = []
    views: list[memoryview] = []
    off = 0
    for name, t in tensors.items():
        if t.is_complex():
            raise SpoolError(f"dense tensor {name}: complex dtype {t.dtype} is not supported")
        v = tensor_bytes(t.cpu())
        metas.append(
            DenseTensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, len(v))
        )
        views.append(v)
        off = _align(off + len(v))
    header = DenseHeader(model, generation, rank, seq, step, time.time(), tuple(metas))
    raw = header.to_json()
    start = _align(_PREFIX.size + len(raw))
    out = bytearray(start + off + _TRAILER.size)
    _PREFIX.pack_into(out, 0, DENSE_MAGIC, len(raw), 0)
    out[_PREFIX.size : _PREFIX.size + len(raw)] = raw
    for m, v in zip(metas, views, strict=True):
        out[start + m.offset : start + m.offset + m.nbytes] = v
    body = memoryview(out)[: start + off]
    _TRAILER.pack_into(out, start + off, checksum(body), DENSE_END_MAGIC)
    return bytes(out)


def write_dense(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write an encoded dense state atomically (:func:`deltad.segment.spool.write_atomic`)."""
    try:
        write_atomic(Path(path), data, fsync=fsync)
    except OSError as e:
        raise SpoolError(f"cannot write dense state {path}: {e}") from e


def decode_dense(buf: Any, path: Path | str = "<dense>", *, verify: bool = True) -> DenseState:
    """A dense state from its file bytes (``bytes``, or a mapping kept alive by the views)."""
    path = Path(path)
    size = len(buf)
    if size < _PREFIX.size + _TRAILER.size:
        raise SegmentCorruptError(f"{path}: truncated ({size} bytes)")
    magic, hlen, _ = _PREFIX.unpack_from(buf, 0)
    if magic != DENSE_MAGIC:
        raise SegmentCorruptError(f"{path}: not a deltad dense state (magic {magic!r})")
    if _PREFIX.size + hlen > size - _TRAILER.size:
        raise SegmentCorruptError(f"{path}: header length {hlen} past end of file")
    stored, end = _TRAILER.unpack_from(buf, size - _TRAILER.size)
    if end != DENSE_END_MAGIC:
        raise SegmentCorruptError(f"{path}: missing end marker (truncated?)")
    if verify and checksum(memoryview(buf)[: size - _TRAILER.size]) != stored:
        raise SegmentCorruptError(f"{path}: checksum mismatch")
    header = DenseHeader.from_json(bytes(buf[_PREFIX.size : _PREFIX.size + hlen]))
    start = _align(_PREFIX.size + hlen)
    arr = np.frombuffer(buf, dtype=np.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for m in header.tensors:
        dt = dense_dtype(m.dtype)
        itemsize = torch.empty((), dtype=dt).element_size()
        count = 1
        for s in m.shape:
            count *= s
        a, b = start + m.offset, start + m.offset + m.nbytes
        if m.nbytes != count * itemsize or b > size - _TRAILER.size or min(m.shape, default=0) < 0:
            raise SegmentCorruptError(f"{path}: dense tensor {m.name!r} does not fit its bytes")
        with warnings.catch_warnings():  # read-only ``bytes``: the views are never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(arr[a:b]) if m.nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[m.name] = raw.view(dt).reshape(m.shape)
    return DenseState(header, tensors)


def read_dense(path: Path, *, verify: bool = True) -> DenseState:
    """Map a dense state file; its tensors are views of the mapping (copy-on-write)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise SegmentCorruptError(f"{path}: empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise SpoolError(f"cannot read dense state {path}: {e}") from e
    return decode_dense(mm, path, verify=verify)
