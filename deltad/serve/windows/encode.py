"""GetDelta encoding on the serving side: serialized ``GetDeltaResponse`` messages.

:func:`encode_header`, :func:`encode_trailer` and :func:`encode_shard_chunks` return
*serialized* messages (``bytes``). The servicer passes them through an identity response
serializer, so each RowChunk costs exactly one copy: :class:`ChunkMessage` writes the field
tags and varint lengths into a new ``bytes`` object and exposes its ids / scale-bias / values
fields as writable arrays, which a merge fills directly (no intermediate tensor) or
:func:`encode_chunk` copies tensors into.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from deltad.segment.format import DenseState, tensor_bytes
from deltad.types import WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.wire import (
    DEFAULT_ROW_ALIGNMENT,
    WIRE_ITEMSIZE,
    pack_rows,
    packed_row_bytes,
    quantize,
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A flat uint8 memoryview of a contiguous CPU tensor (no copy)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr: Any = t.numpy().reshape(-1).view(np.uint8)
    return memoryview(arr)


def copy_bytes(dst: Any, src: torch.Tensor) -> None:
    """Copy the bytes of tensor ``src`` into the numpy array ``dst`` (a field of a
    :class:`ChunkMessage`) as one flat byte copy (a memcpy). A message's fields sit at any
    byte offset, where numpy's typed copies (int64 ids, rows as void elements) take a slower
    unaligned / per-element path."""
    dst.view(np.uint8)[:] = np.frombuffer(_bytes_view(src.contiguous()), dtype=np.uint8)


def encode_header(header: pb.DeltaHeader) -> bytes:
    return pb.GetDeltaResponse(header=header).SerializeToString()


def encode_trailer(trailer: pb.DeltaTrailer) -> bytes:
    return pb.GetDeltaResponse(trailer=trailer).SerializeToString()


def _new_bytes() -> Callable[[int], bytes]:
    """``n -> bytes`` of ``n`` uninitialised bytes: CPython's ``PyBytes_FromStringAndSize(NULL,
    n)``, the C API's way to build a bytes object in place before anyone else sees it."""
    fn = ctypes.pythonapi.PyBytes_FromStringAndSize
    fn.restype = ctypes.py_object
    fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    return lambda n: fn(None, n)  # type: ignore[no-any-return]


_NEW_BYTES = _new_bytes()
#: offset of a bytes object's data from its address (``PyBytesObject.ob_sval``)
_BYTES_DATA = sys.getsizeof(b"") - 1


class ChunkMessage:
    """One serialized GetDeltaResponse{chunk} built in place: the framing is written, and the
    ids, scale/bias and values fields are writable numpy views into the message itself.

    Fill every byte of :attr:`ids`, :attr:`scale_bias` (INT8) and :attr:`values` (uint8),
    drop the views, then send :attr:`data`. Rows written straight into :attr:`values` (a merge's row
    copies, a cast) cost one copy in all, where building a tensor first and then joining it
    into a message costs two.
    """

    __slots__ = ("data", "ids", "scale_bias", "values")

    def __init__(
        self, slice_index: int, offset: int, count: int, values_nbytes: int, sb_nbytes: int = 0
    ) -> None:
        inner = bytearray()
        if slice_index:
            inner += b"\x08" + _varint(slice_index)
        if offset:
            inner += b"\x10" + _varint(offset)
        inner += b"\x18" + _varint(count) + b"\x22" + _varint(count * 8)
        fields = [(bytes(inner), count * 8)]
        if sb_nbytes:
            fields.append((b"\x2a" + _varint(sb_nbytes), sb_nbytes))
        if values_nbytes:
            fields.append((b"\x32" + _varint(values_nbytes), values_nbytes))
        size = sum(len(h) + n for h, n in fields)
        head = b"\x12" + _varint(size)
        self.data = _NEW_BYTES(len(head) + size)
        raw: Any = (ctypes.c_char * len(self.data)).from_address(id(self.data) + _BYTES_DATA)
        raw.owner = self.data  # every view keeps the message alive
        buf: Any = np.frombuffer(raw, dtype=np.uint8)
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        pos = len(head)
        views = []
        for h, n in fields:
            buf[pos : pos + len(h)] = np.frombuffer(h, dtype=np.uint8)
            pos += len(h)
            views.append(buf[pos : pos + n])
            pos += n
        self.ids: Any = views[0].view(np.int64)
        #: float32 (scale, bias) pairs; empty unless ``sb_nbytes``
        self.scale_bias: Any = views[1].view(np.float32) if sb_nbytes else buf[pos:pos]
        self.values: Any = views[-1] if values_nbytes else buf[pos:pos]


def encode_chunk(
    slice_index: int,
    offset: int,
    ids: torch.Tensor,
    values: torch.Tensor | None,
    scale_bias: torch.Tensor | None = None,
) -> bytes:
    """One serialized GetDeltaResponse{chunk}.

    ``ids`` int64 [n], ``values`` [n, w] already in the wire dtype (or None for FORM_IDS),
    ``scale_bias`` float32 [n, 2] for INT8. Exactly one copy of the row bytes.
    """
    vals = _bytes_view(values) if values is not None and values.numel() else None
    sb = _bytes_view(scale_bias) if scale_bias is not None and scale_bias.numel() else None
    m = ChunkMessage(
        slice_index,
        offset,
        ids.numel(),
        0 if vals is None else len(vals),
        0 if sb is None else len(sb),
    )
    copy_bytes(m.ids, ids)
    if sb is not None:
        m.scale_bias.view(np.uint8)[:] = np.frombuffer(sb, dtype=np.uint8)
    if vals is not None:
        m.values[:] = np.frombuffer(vals, dtype=np.uint8)
    return m.data


def rows_per_chunk(
    width: int, dtype: WireDtype | None, chunk_bytes: int, alignment: int = DEFAULT_ROW_ALIGNMENT
) -> int:
    """Rows that fit a chunk of about ``chunk_bytes`` (ids, values and int8 scale/bias, or
    packed rows of ``alignment``)."""
    row = 8
    if dtype is not None and dtype.packed:
        row += packed_row_bytes(width, dtype, alignment)
    elif dtype is not None:
        row += width * WIRE_ITEMSIZE[dtype] + (8 if dtype is WireDtype.INT8 else 0)
    return max(1, chunk_bytes // row)


def encode_rows(
    slice_index: int,
    offset: int,
    ids: torch.Tensor,
    values: torch.Tensor | None,
    dtype: WireDtype,
    alignment: int = DEFAULT_ROW_ALIGNMENT,
) -> bytes:
    """One serialized RowChunk of float rows ``values`` (None: FORM_IDS) in ``dtype``: cast or
    quantized (:func:`~deltad.wire.quantize`), or packed (:func:`~deltad.wire.pack_rows`,
    straight into the message)."""
    if values is None or not dtype.packed:
        wire_vals, sb = quantize(values, dtype) if values is not None else (None, None)
        return encode_chunk(slice_index, offset, ids, wire_vals, sb)
    n, dim = values.shape
    row_bytes = packed_row_bytes(dim, dtype, alignment)
    m = ChunkMessage(slice_index, offset, n, n * row_bytes)
    copy_bytes(m.ids, ids)
    if n:
        pack_rows(values, dtype, torch.from_numpy(m.values).view(n, row_bytes))
    data = m.data
    del m
    return data


def encode_shard_chunks(
    slice_index: int,
    ids: torch.Tensor,
    values: torch.Tensor | None,
    dtype: WireDtype,
    chunk_bytes: int,
    alignment: int = DEFAULT_ROW_ALIGNMENT,
) -> Iterator[bytes]:
    """Serialized RowChunk messages of one shard (values None for FORM_IDS).

    Values are quantized (or packed) chunk by chunk (every wire dtype is row-wise), so the
    first chunk is ready at once and no shard-sized temporary is allocated.
    """
    ids = ids.contiguous()
    width = values.shape[1] if values is not None and values.dim() == 2 else 0
    step = rows_per_chunk(width, dtype if values is not None else None, chunk_bytes, alignment)
    for off in range(0, ids.numel(), step):
        end = off + step
        vals = values[off:end] if values is not None else None
        yield encode_rows(slice_index, off, ids[off:end], vals, dtype, alignment)


def encode_packed_chunks(
    slice_index: int,
    ids: torch.Tensor,
    packed: torch.Tensor,
    chunk_bytes: int,
) -> Iterator[bytes]:
    """Serialized RowChunk messages of one shard whose rows are already packed (uint8
    [n, row_bytes], e.g. from :class:`~deltad.serve.windows.packed.PackedStore`): the same
    messages as :func:`encode_shard_chunks` of the float rows, each one copy of packed rows."""
    ids = ids.contiguous()
    step = max(1, chunk_bytes // (8 + packed.shape[1]))  # (as rows_per_chunk: same chunks)
    for off in range(0, ids.numel(), step):
        end = off + step
        yield encode_chunk(slice_index, off, ids[off:end], packed[off:end])


def encode_dense_chunks(state: DenseState, chunk_bytes: int) -> Iterator[bytes]:
    """Serialized DenseChunk messages of a dense state: each tensor's bytes in runs of at
    most ``chunk_bytes``, tensors in the order of its header (``DeltaHeader.dense``)."""
    step = max(1, chunk_bytes)
    for i, m in enumerate(state.header.tensors):
        data = tensor_bytes(state.tensors[m.name])
        for off in range(0, len(data), step):
            chunk = pb.DenseChunk(tensor=i, offset=off, data=bytes(data[off : off + step]))
            yield pb.GetDeltaResponse(dense=chunk).SerializeToString()
