"""Dense state files: the model's dense parameters and buffers at one step, beside a segment.

A dense state is the model's dense parameters and buffers (everything that is not a sharded
embedding table) at one step, written by rank 0 next to its segment of the same seq::

    offset 0   magic b"DLTDNS01", header length H (uint32 LE), reserved (0)     16 bytes
          16   header: UTF-8 JSON (DenseHeader), zero padding to a multiple of 64
           P   payload: each tensor's bytes (row-major, its dtype, LE), 64-byte aligned;
               offsets in the header are relative to P
       end-16  XXH3-64 of every byte before the trailer (uint64 LE), b"DNSEND01"

Built in memory (dense state is small next to tables) with the segments' checksum, then
written with deltad.segment.spool.write_atomic.
"""

from __future__ import annotations

import json
import mmap
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.framing import PREFIX, TRAILER, align, checksum
from deltad.segment.spool import write_atomic

DENSE_MAGIC, DENSE_END_MAGIC = b"DLTDNS01", b"DNSEND01"
#: most bytes a dense state's header may take
MAX_DENSE_HEADER_BYTES = 64 * 1024 * 1024
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
        off = align(off + len(v))
    header = DenseHeader(model, generation, rank, seq, step, time.time(), tuple(metas))
    raw = header.to_json()
    start = align(PREFIX.size + len(raw))
    out = bytearray(start + off + TRAILER.size)
    PREFIX.pack_into(out, 0, DENSE_MAGIC, len(raw), 0)
    out[PREFIX.size : PREFIX.size + len(raw)] = raw
    for m, v in zip(metas, views, strict=True):
        out[start + m.offset : start + m.offset + m.nbytes] = v
    body = memoryview(out)[: start + off]
    TRAILER.pack_into(out, start + off, checksum(body), DENSE_END_MAGIC)
    return bytes(out)


def write_dense(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write an encoded dense state atomically (:func:`deltad.segment.spool.write_atomic`)."""
    try:
        write_atomic(Path(path), data, fsync=fsync)
    except OSError as e:
        raise SpoolError(f"cannot write dense state {path}: {e}") from e


def read_dense_header_at(fd: int, path: Path) -> tuple[int, DenseHeader]:
    """(header length, header) of the dense state file open at ``fd``, read with ``pread``
    (nothing past the header); ``path`` names it in errors. OSError propagates."""
    head = os.pread(fd, PREFIX.size, 0)
    if len(head) < PREFIX.size:
        raise SegmentCorruptError(f"{path}: truncated")
    magic, hlen, _ = PREFIX.unpack(head)
    if magic != DENSE_MAGIC:
        raise SegmentCorruptError(f"{path}: not a deltad dense state (magic {magic!r})")
    if hlen > MAX_DENSE_HEADER_BYTES:
        raise SegmentCorruptError(f"{path}: absurd header length {hlen}")
    raw = os.pread(fd, hlen, PREFIX.size)
    if len(raw) != hlen:
        raise SegmentCorruptError(f"{path}: truncated header")
    return hlen, DenseHeader.from_json(raw)


def dense_file_size(header: DenseHeader, header_bytes: int) -> int:
    """The bytes of a dense state file with ``header`` (``header_bytes`` long), laid out as
    :func:`encode_dense` lays it out: its tensors one after the other (aligned), each of the
    bytes its shape and dtype make (SegmentCorruptError if its ``nbytes`` says otherwise), not
    from the offsets."""
    payload = 0
    for m in header.tensors:
        count = 1
        for d in m.shape:
            count *= d
        if m.nbytes != count * torch.empty((), dtype=dense_dtype(m.dtype)).element_size():
            raise SegmentCorruptError(f"dense tensor {m.name!r}: nbytes disagrees with its shape")
        payload += align(m.nbytes)
    return align(PREFIX.size + header_bytes) + payload + TRAILER.size


def decode_dense(buf: Any, path: Path | str = "<dense>", *, verify: bool = True) -> DenseState:
    """A dense state from its file bytes (``bytes``, or a mapping kept alive by the views)."""
    path = Path(path)
    size = len(buf)
    if size < PREFIX.size + TRAILER.size:
        raise SegmentCorruptError(f"{path}: truncated ({size} bytes)")
    magic, hlen, _ = PREFIX.unpack_from(buf, 0)
    if magic != DENSE_MAGIC:
        raise SegmentCorruptError(f"{path}: not a deltad dense state (magic {magic!r})")
    if PREFIX.size + hlen > size - TRAILER.size:
        raise SegmentCorruptError(f"{path}: header length {hlen} past end of file")
    stored, end = TRAILER.unpack_from(buf, size - TRAILER.size)
    if end != DENSE_END_MAGIC:
        raise SegmentCorruptError(f"{path}: missing end marker (truncated?)")
    if verify and checksum(memoryview(buf)[: size - TRAILER.size]) != stored:
        raise SegmentCorruptError(f"{path}: checksum mismatch")
    header = DenseHeader.from_json(bytes(buf[PREFIX.size : PREFIX.size + hlen]))
    start = align(PREFIX.size + hlen)
    arr = np.frombuffer(buf, dtype=np.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for m in header.tensors:
        dt = dense_dtype(m.dtype)
        itemsize = torch.empty((), dtype=dt).element_size()
        count = 1
        for s in m.shape:
            count *= s
        a, b = start + m.offset, start + m.offset + m.nbytes
        if m.nbytes != count * itemsize or b > size - TRAILER.size or min(m.shape, default=0) < 0:
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
