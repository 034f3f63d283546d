"""GetDelta encoding on the serving side: serialized ``GetDeltaResponse`` messages.

:func:`encode_header`, :func:`encode_trailer` and :func:`encode_shard_chunks` return
*serialized* messages (``bytes``). The servicer hands them to gRPC as they are (no response
serializer), so each RowChunk costs exactly one copy: :class:`ChunkMessage` writes the field
tags and varint lengths into a new ``bytes`` object, and a merge or :func:`encode_chunk` fills
its ids / scale-bias / values fields directly (:meth:`ChunkMessage.fill`: one ``memmove`` of a
tensor's rows; writable arrays where rows are scattered), with no intermediate tensor.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltad.segment.format import DenseState, tensor_bytes
from deltad.types import WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.wire import (
    DEFAULT_ROW_ALIGNMENT,
    WIRE_ITEMSIZE,
    WIRE_TORCH_DTYPE,
    pack_rows,
    packed_row_bytes,
    quantize,
)


class Skip:
    """Messages a stream leaves out at its start, unbuilt (a resumed stream: see
    ``GetDeltaRequest.resume``). Each encoder asks :meth:`take` before building a message and
    goes to the next one without building it while it says True."""

    __slots__ = ("left",)

    def __init__(self, left: int = 0) -> None:
        self.left = left

    def take(self) -> bool:
        """Whether the next message is left out (then one fewer is)."""
        if self.left > 0:
            self.left -= 1
            return True
        return False


def skips(skip: Skip | None) -> bool:
    """Whether the next message is left out (see :class:`Skip`); an attribute read when
    nothing is (the stream loop's case)."""
    return skip is not None and skip.left > 0 and skip.take()


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


_MEMMOVE = ctypes.memmove  # (a ctypes foreign call: the GIL is released while it copies)


def copy_to(address: int, limit: int, src: torch.Tensor, start: int = 0, count: int = -1) -> None:
    """Copy rows ``[start, start + count)`` (all from ``start`` if ``count`` < 0) of tensor
    ``src`` to ``address``, where ``limit`` bytes may be written (a field of a
    :class:`ChunkMessage`: :meth:`ChunkMessage.fill`): one ``memmove`` from the tensor's memory,
    no tensor or array views made (per message they cost more than a 2 MB copy's tenth). From a
    device or non-contiguous tensor, the rows copied are gathered to the host first. ValueError
    (nothing written) if the rows are not all in ``src`` or their bytes exceed ``limit``."""
    shape = src.shape
    rows = shape[0] if shape else 1
    row = src.element_size() * math.prod(shape[1:])
    n = rows - start if count < 0 else count
    if start < 0 or n < 0 or start + n > rows or n * row > limit:
        raise ValueError(
            f"copy of rows [{start}, {start + n}) of {rows} ({n * row} bytes) into {limit} bytes"
        )
    if not n:
        return
    if src.is_cpu and src.is_contiguous():
        _MEMMOVE(address, src.data_ptr() + start * row, n * row)
        return
    # a strided or device tensor: only the rows copied are gathered to the host, never the
    # whole tensor (a part's values are shard-sized)
    part = (src[start : start + n] if shape else src).contiguous().cpu()
    _MEMMOVE(address, part.data_ptr(), n * row)


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


class _BytesData:
    """The data of a new ``bytes`` object as a writable uint8 array (``np.asarray`` of it),
    through numpy's array interface; the array keeps the ``bytes`` alive. (A ctypes array
    type per message length cost ~8 us more a message whose size had not been seen.)"""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, data: bytes) -> None:
        self.owner = data
        self.__array_interface__ = {
            "data": (id(data) + _BYTES_DATA, False),
            "shape": (len(data),),
            "typestr": "|u1",
            "version": 3,
        }


def _field_view(name: str, dtype: Any, doc: str) -> Any:
    """A read-only property of :class:`ChunkMessage`: a writable ``dtype`` view of field
    ``name`` (its ``_view``)."""
    return property(lambda m: m._view(name).view(dtype), doc=doc)


class ChunkMessage:
    """One serialized GetDeltaResponse{chunk} built in place: the framing is written, and the
    ids, scale/bias and values fields are left to fill, by :meth:`fill` (rows of a tensor,
    one ``memmove``) or through writable numpy views into the message itself (:attr:`ids`,
    :attr:`values`, ..., made when first asked for).

    Fill every byte of :attr:`ids`, :attr:`scale_bias` (INT8) and :attr:`values` (uint8),
    and of :attr:`raw_ids`, :attr:`evicted`, :attr:`admitted` (int64; a managed-collision
    shard's identities, when sized), drop the views, then send :attr:`data`. Rows written
    straight into :attr:`values` (a merge's row copies, a cast) cost one copy in all, where
    building a tensor first and then joining it into a message costs two. The framing is
    written with ``memmove`` and no view is made unless asked for: a message costs ~5 us
    besides its copies (numpy views of every field cost ~45 us, a fifth of a 2 MB copy).
    """

    __slots__ = ("_at", "_buf", "_fields", "data")

    def __init__(
        self,
        slice_index: int,
        offset: int,
        count: int,
        values_nbytes: int,
        sb_nbytes: int = 0,
        *,
        raw_ids: bool = False,
        evicted: int = 0,
        admitted: int = 0,
    ) -> None:
        inner = b"\x18" + _varint(count) + b"\x22" + _varint(count * 8)
        if offset:
            inner = b"\x10" + _varint(offset) + inner
        if slice_index:
            inner = b"\x08" + _varint(slice_index) + inner
        fields: list[tuple[str, bytes, int]] = [("ids", inner, count * 8)]
        for name, tag, n in (
            ("scale_bias", b"\x2a", sb_nbytes),
            ("values", b"\x32", values_nbytes),
            ("raw_ids", b"\x3a", count * 8 if raw_ids and count else 0),
            ("evicted", b"\x42", evicted * 8),
            ("admitted", b"\x4a", admitted * 8),
        ):
            if n:
                fields.append((name, tag + _varint(n), n))
        size = 0
        for _, h, n in fields:
            size += len(h) + n
        head = b"\x12" + _varint(size)
        self.data = _NEW_BYTES(len(head) + size)
        at = id(self.data) + _BYTES_DATA
        _MEMMOVE(at, head, len(head))
        pos = len(head)
        #: name -> (offset of the field's bytes, their length)
        spans: dict[str, tuple[int, int]] = {}
        for name, h, n in fields:
            _MEMMOVE(at + pos, h, len(h))
            pos += len(h)
            spans[name] = (pos, n)
            pos += n
        self._fields = spans
        self._buf: Any = None
        self._at = at

    def fill(self, name: str, src: torch.Tensor, start: int = 0, count: int = -1) -> None:
        """Copy rows ``[start, start + count)`` of ``src`` (all from ``start`` if ``count``
        < 0) into field ``name`` from its first byte (:func:`copy_to`: one ``memmove``, no
        view; ValueError if they do not fit the field)."""
        at, n = self._fields.get(name, (len(self.data), 0))
        copy_to(self._at + at, n, src, start, count)

    def _view(self, name: str) -> Any:
        """A writable uint8 view of field ``name`` (empty if it has no bytes)."""
        if self._buf is None:
            self._buf = np.asarray(_BytesData(self.data))  # every view keeps the message alive
        at, n = self._fields.get(name, (len(self.data), 0))
        return self._buf[at : at + n]

    #: writable numpy views of the fields, made when asked for (empty where a field is unsized)
    ids = _field_view("ids", np.int64, "int64 view of the ids.")
    scale_bias = _field_view("scale_bias", np.float32, "float32 (scale, bias) pairs (INT8).")
    values = _field_view("values", np.uint8, "uint8 view of the values' bytes.")
    raw_ids = _field_view("raw_ids", np.int64, "int64 view of the raw ids (identities).")
    evicted = _field_view("evicted", np.int64, "int64 view of the evicted raw ids.")
    admitted = _field_view("admitted", np.int64, "int64 view of the admitted raw ids.")


@dataclass(frozen=True)
class Identities:
    """A managed-collision shard's identities in a window: ``raw_ids`` aligned with the rows
    sent, the window's ``evicted`` raw ids and (FORM_IDS) the ``admitted`` ones."""

    raw_ids: torch.Tensor
    evicted: torch.Tensor
    admitted: torch.Tensor | None = None

    @property
    def extras(self) -> int:
        """Evicted and admitted raw ids: spread over the shard's chunks."""
        return self.evicted.numel() + (0 if self.admitted is None else self.admitted.numel())


def put_identities(
    m: ChunkMessage,
    idn: Identities | None,
    a: int,
    b: int,
    ev: tuple[int, int],
    ad: tuple[int, int],
) -> None:
    if idn is None:
        return
    if b > a:
        m.raw_ids[:] = idn.raw_ids[a:b].numpy()
    if ev[1] > ev[0]:
        m.evicted[:] = idn.evicted[ev[0] : ev[1]].numpy()
    if ad[1] > ad[0] and idn.admitted is not None:
        m.admitted[:] = idn.admitted[ad[0] : ad[1]].numpy()


def encode_chunk(
    slice_index: int,
    offset: int,
    ids: torch.Tensor,
    values: torch.Tensor | None,
    scale_bias: torch.Tensor | None = None,
    idn: Identities | None = None,
    ev: tuple[int, int] = (0, 0),
    ad: tuple[int, int] = (0, 0),
) -> bytes:
    """One serialized GetDeltaResponse{chunk}.

    ``ids`` int64 [n], ``values`` [n, w] already in the wire dtype (or None for FORM_IDS),
    ``scale_bias`` float32 [n, 2] for INT8. Exactly one copy of the row bytes. ``idn``: the
    shard's identities, of which this chunk carries raw ids ``[offset, offset + n)`` and the
    evicted / admitted ones in the ranges ``ev`` / ``ad``.
    """
    nvals = 0 if values is None else values.numel() * values.element_size()
    sb = _bytes_view(scale_bias) if scale_bias is not None and scale_bias.numel() else None
    m = ChunkMessage(
        slice_index,
        offset,
        ids.numel(),
        nvals,
        0 if sb is None else len(sb),
        raw_ids=idn is not None,
        evicted=ev[1] - ev[0],
        admitted=ad[1] - ad[0],
    )
    m.fill("ids", ids)
    if sb is not None:
        m.scale_bias.view(np.uint8)[:] = np.frombuffer(sb, dtype=np.uint8)
    if nvals:
        assert values is not None
        m.fill("values", values)
    put_identities(m, idn, offset, offset + ids.numel(), ev, ad)
    data = m.data
    del m
    return data


def rows_per_chunk(
    width: int,
    dtype: WireDtype | None,
    chunk_bytes: int,
    alignment: int = DEFAULT_ROW_ALIGNMENT,
    identities: bool = False,
) -> int:
    """Rows that fit a chunk of about ``chunk_bytes`` (ids, values and int8 scale/bias, or
    packed rows of ``alignment``; with ``identities``, a raw id and room for one evicted and
    one admitted raw id per row)."""
    row = 8 + (24 if identities else 0)
    if dtype is not None and dtype.packed:
        row += packed_row_bytes(width, dtype, alignment)
    elif dtype is not None:
        row += width * WIRE_ITEMSIZE[dtype] + (8 if dtype is WireDtype.INT8 else 0)
    return max(1, chunk_bytes // row)


def extra_chunks(extras: int, chunk_bytes: int) -> int:
    """At most how many RowChunks with no rows follow a managed-collision shard's row chunks
    to carry the ``extras`` evicted and admitted raw ids they had no room for."""
    return -(-extras // max(1, chunk_bytes // 8))


def encode_rows(
    slice_index: int,
    offset: int,
    ids: torch.Tensor,
    values: torch.Tensor | None,
    dtype: WireDtype,
    alignment: int = DEFAULT_ROW_ALIGNMENT,
    idn: Identities | None = None,
    ev: tuple[int, int] = (0, 0),
    ad: tuple[int, int] = (0, 0),
) -> bytes:
    """One serialized RowChunk of float rows ``values`` (None: FORM_IDS) in ``dtype``: cast or
    quantized (:func:`~deltad.wire.quantize`), or packed (:func:`~deltad.wire.pack_rows`,
    straight into the message); ``idn``, ``ev``, ``ad``: see :func:`encode_chunk`."""
    if values is None or not dtype.packed:
        wire_vals, sb = quantize(values, dtype) if values is not None else (None, None)
        return encode_chunk(slice_index, offset, ids, wire_vals, sb, idn, ev, ad)
    n, dim = values.shape
    row_bytes = packed_row_bytes(dim, dtype, alignment)
    m = ChunkMessage(
        slice_index,
        offset,
        n,
        n * row_bytes,
        raw_ids=idn is not None,
        evicted=ev[1] - ev[0],
        admitted=ad[1] - ad[0],
    )
    m.fill("ids", ids)
    if n:
        pack_rows(values, dtype, torch.from_numpy(m.values).view(n, row_bytes))
    put_identities(m, idn, offset, offset + n, ev, ad)
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
    idn: Identities | None = None,
    skip: Skip | None = None,
) -> Iterator[bytes]:
    """Serialized RowChunk messages of one shard (values None for FORM_IDS; ``skip``: the
    first ones left out unbuilt, see :class:`Skip`).

    Values are quantized (or packed) chunk by chunk (every wire dtype is row-wise), so the
    first chunk is ready at once and no shard-sized temporary is allocated. A managed-
    collision shard's chunks (``idn``) carry their rows' raw ids and runs of its evicted and
    admitted raw ids (:func:`identity_runs`); chunks without rows carry the rest
    (:func:`extra_identity_chunks`).
    """
    ids = ids.contiguous()
    width = values.shape[1] if values is not None and values.dim() == 2 else 0
    step = rows_per_chunk(
        width, dtype if values is not None else None, chunk_bytes, alignment, idn is not None
    )
    if idn is None and _sent_as_they_are(ids, values, dtype):
        assert values is not None
        yield from _plain_chunks(slice_index, ids, values, step, skip)
        return
    n = ids.numel()
    for off in range(0, n, step):
        if skips(skip):
            continue
        end = min(n, off + step)
        vals = values[off:end] if values is not None else None
        ev, ad = identity_runs(idn, off, end)
        yield encode_rows(slice_index, off, ids[off:end], vals, dtype, alignment, idn, ev, ad)
    yield from extra_identity_chunks(slice_index, n, idn, chunk_bytes, skip)


def _sent_as_they_are(ids: torch.Tensor, values: torch.Tensor | None, dtype: WireDtype) -> bool:
    """Whether rows ``values`` go on the wire byte for byte (already in ``dtype``, not INT8 or
    packed, 2-D and, as ``ids``, contiguous in host memory): :func:`_plain_chunks` may send them."""
    return (
        values is not None
        and values.dim() == 2
        and WIRE_TORCH_DTYPE.get(dtype) == values.dtype
        and dtype is not WireDtype.INT8
        and values.is_cpu
        and ids.is_cpu
        and ids.dtype == torch.int64
        and values.is_contiguous()
        and ids.is_contiguous()
    )


class RowFraming:
    """The framing of one shard's RowChunks of ids and plain values (no scale/bias, no
    identities): per message only the offset and, for the last, the count differ, so the
    parts that depend on the count are made once per count. :meth:`new` makes a message with
    its framing written and its ids and values fields left to fill, without the Python cost of
    a :class:`ChunkMessage` (~40 us a message, a fifth of a 2 MB message's copy). Its messages
    are byte-equal to :class:`ChunkMessage`'s (tested)."""

    __slots__ = ("_lead", "_row", "_tails")

    def __init__(self, slice_index: int, row_bytes: int) -> None:
        self._lead = b"\x08" + _varint(slice_index) if slice_index else b""
        self._row = row_bytes
        #: count -> (ids framing, values framing, bytes after the ids framing)
        self._tails: dict[int, tuple[bytes, bytes, int]] = {}

    def new(self, offset: int, count: int) -> tuple[bytes, int, int]:
        """A message of ``count`` rows from ``offset``: (the ``bytes``, the offset in it of
        its ids field's first byte, of its values field's); fill both before it is seen."""
        tail = self._tails.get(count)
        if tail is None:
            vals = count * self._row
            ids_head = b"\x18" + _varint(count) + b"\x22" + _varint(count * 8)
            vals_head = b"\x32" + _varint(vals) if vals else b""
            tail = self._tails[count] = (ids_head, vals_head, count * 8 + len(vals_head) + vals)
        ids_head, vals_head, rest = tail
        inner = self._lead + (b"\x10" + _varint(offset) if offset else b"") + ids_head
        head = b"\x12" + _varint(len(inner) + rest) + inner
        data = _NEW_BYTES(len(head) + rest)
        at = id(data) + _BYTES_DATA
        _MEMMOVE(at, head, len(head))
        ids_at = len(head)
        if vals_head:
            _MEMMOVE(at + ids_at + count * 8, vals_head, len(vals_head))
        return data, ids_at, ids_at + count * 8 + len(vals_head)


def put(data: bytes, at: int, src_address: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_address`` to byte ``at`` of a message being built (one that
    nobody else has seen yet: see :meth:`RowFraming.new`)."""
    _MEMMOVE(id(data) + _BYTES_DATA + at, src_address, nbytes)


def writable(data: bytes, at: int, nbytes: int) -> Any:
    """A writable uint8 array of bytes ``[at, at + nbytes)`` of a message being built (one
    that nobody else has seen yet); it keeps the message alive."""
    return np.asarray(_BytesData(data))[at : at + nbytes]


def _plain_chunks(
    slice_index: int, ids: torch.Tensor, values: torch.Tensor, step: int, skip: Skip | None
) -> Iterator[bytes]:
    """The RowChunks of :func:`encode_shard_chunks` for rows sent as they are
    (:func:`_sent_as_they_are`), built from addresses: per message a :class:`RowFraming`
    message and two memmoves (ids, values), no tensor slices."""
    n = ids.numel()
    row = values.shape[1] * values.element_size()
    framing = RowFraming(slice_index, row)
    ids_at, values_at = ids.data_ptr(), values.data_ptr()
    for off in range(0, n, step):
        if skips(skip):
            continue
        count = min(step, n - off)
        data, i, v = framing.new(off, count)
        put(data, i, ids_at + off * 8, count * 8)
        put(data, v, values_at + off * row, count * row)
        yield data


def identity_runs(
    idn: Identities | None, a: int, b: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The evicted and admitted raw ids the chunk of rows ``[a, b)`` carries: entries
    ``[a, b)`` of each list (as many as there are)."""
    if idn is None:
        return (0, 0), (0, 0)
    n_ev = idn.evicted.numel()
    n_ad = 0 if idn.admitted is None else idn.admitted.numel()
    return (min(n_ev, a), min(n_ev, b)), (min(n_ad, a), min(n_ad, b))


def extra_identity_chunks(
    slice_index: int, n: int, idn: Identities | None, chunk_bytes: int, skip: Skip | None = None
) -> Iterator[bytes]:
    """RowChunks of no rows after a shard's ``n`` rows: the evicted and admitted raw ids past
    entry ``n`` (the row chunks carried the first ``n`` of each), up to ``chunk_bytes`` each."""
    if idn is None:
        return
    n_ev = idn.evicted.numel()
    n_ad = 0 if idn.admitted is None else idn.admitted.numel()
    e, a = min(n, n_ev), min(n, n_ad)
    per = max(1, chunk_bytes // 8)
    empty = torch.empty(0, dtype=torch.int64)
    while e < n_ev or a < n_ad:
        ev = (e, min(n_ev, e + per))
        ad = (a, min(n_ad, a + per - (ev[1] - ev[0])))
        e, a = ev[1], ad[1]
        if skips(skip):
            continue
        yield encode_chunk(slice_index, n, empty, None, None, idn, ev, ad)


def encode_packed_chunks(
    slice_index: int,
    ids: torch.Tensor,
    packed: torch.Tensor,
    chunk_bytes: int,
    skip: Skip | None = None,
) -> Iterator[bytes]:
    """Serialized RowChunk messages of one shard whose rows are already packed (uint8
    [n, row_bytes], e.g. from :class:`~deltad.serve.windows.packed.PackedStore`): the same
    messages as :func:`encode_shard_chunks` of the float rows, each one copy of packed rows."""
    ids = ids.contiguous()
    step = max(1, chunk_bytes // (8 + packed.shape[1]))  # (as rows_per_chunk: same chunks)
    for off in range(0, ids.numel(), step):
        if skips(skip):
            continue
        end = off + step
        yield encode_chunk(slice_index, off, ids[off:end], packed[off:end])


def encode_dense_chunks(
    state: DenseState, chunk_bytes: int, skip: Skip | None = None
) -> Iterator[bytes]:
    """Serialized DenseChunk messages of a dense state: each tensor's bytes in runs of at
    most ``chunk_bytes``, tensors in the order of its header (``DeltaHeader.dense``)."""
    step = max(1, chunk_bytes)
    for i, m in enumerate(state.header.tensors):
        data = tensor_bytes(state.tensors[m.name])
        for off in range(0, len(data), step):
            if skips(skip):
                continue
            chunk = pb.DenseChunk(tensor=i, offset=off, data=bytes(data[off : off + step]))
            yield pb.GetDeltaResponse(dense=chunk).SerializeToString()
