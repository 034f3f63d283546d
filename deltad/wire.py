"""The GetDelta wire: server-side encoding and client-side decoding into tensors.

Server side: :func:`encode_header`, :func:`encode_trailer` and :func:`encode_slice_chunks`
return *serialized* ``GetDeltaResponse`` messages (``bytes``). The servicer passes them
through an identity response serializer, so each RowChunk costs exactly one copy (see
PERF-NOTES.md): :class:`ChunkMessage` writes the field tags and varint lengths into a new
``bytes`` object and exposes its ids / scale-bias / values fields as writable arrays, which a
merge fills directly (no intermediate tensor) or :func:`encode_chunk` copies tensors into.

Client side (the consumer library calls these)::

    delta = pull(channel, request, timeout=30, metadata=[("authorization", "Bearer t")])

or, with any iterable of stream messages (parsed ``GetDeltaResponse`` protos *or* raw
``bytes`` from :func:`raw_get_delta`)::

    delta = decode_stream(messages)          # -> deltad.window.RankDelta

:class:`WindowAssembler` is the incremental form (``add(msg)`` per message, ``result()``).
Raw bytes take the fast path: RowChunk framing is parsed by hand and every row is copied
once, straight from the received buffer into preallocated float32 / int64 tensors
(dequantizing fp16 / bf16 / int8 on the way).

Quantization (values on the wire): fp32, fp16, bf16 casts; int8 is row-wise affine:
``value = code * scale + bias`` with a float32 ``(scale, bias)`` pair per row, ``code`` in
[-128, 127] (error at most scale / 2 = (max - min) / 510 per row).
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from deltad.buffers import BufferPool
from deltad.config import PullOptions
from deltad.errors import ConsumerError
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.window import Cursor, RankDelta, SliceUpdate

GET_DELTA_METHOD = "/deltad.v1.DeltaService/GetDelta"
#: The largest GetDelta message a consumer accepts (its channel's receive limit); the
#: sidecar never sends a larger one, whatever its --chunk-bytes / --max-message-bytes.
CONSUMER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: A header announcing a slice of more values than this (rows x columns) is refused before
#: anything is allocated (2**36 float32 values: 256 GiB).
MAX_SLICE_ELEMENTS = 1 << 36

_FORM_TO_PB: dict[Form, pb.Form] = {
    Form.IDS: pb.FORM_IDS,
    Form.ROWS: pb.FORM_ROWS,
    Form.TOPK: pb.FORM_TOPK,
}
_FORM_FROM_PB: dict[int, Form] = {int(v): k for k, v in _FORM_TO_PB.items()}
_FORM_FROM_PB[pb.FORM_UNSPECIFIED] = Form.ROWS
_DTYPE_TO_PB: dict[WireDtype, pb.WireDtype] = {
    WireDtype.FP32: pb.WIRE_DTYPE_FP32,
    WireDtype.FP16: pb.WIRE_DTYPE_FP16,
    WireDtype.BF16: pb.WIRE_DTYPE_BF16,
    WireDtype.INT8: pb.WIRE_DTYPE_INT8,
}
_DTYPE_FROM_PB: dict[int, WireDtype] = {int(v): k for k, v in _DTYPE_TO_PB.items()}
_DTYPE_FROM_PB[pb.WIRE_DTYPE_UNSPECIFIED] = WireDtype.FP32
#: bytes per value on the wire
WIRE_ITEMSIZE = {WireDtype.FP32: 4, WireDtype.FP16: 2, WireDtype.BF16: 2, WireDtype.INT8: 1}
#: the torch dtype of the values on the wire, where they are plain floats (not INT8)
WIRE_TORCH_DTYPE = {
    WireDtype.FP32: torch.float32,
    WireDtype.FP16: torch.float16,
    WireDtype.BF16: torch.bfloat16,
}


class StreamDecodeError(ConsumerError):
    """A GetDelta stream is malformed or incomplete."""


def form_to_pb(form: Form) -> pb.Form:
    return _FORM_TO_PB[form]


def form_from_pb(value: int) -> Form:
    """Form of a proto enum value; ValueError for unknown values."""
    try:
        return _FORM_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown form {value}") from None


def dtype_to_pb(dtype: WireDtype) -> pb.WireDtype:
    return _DTYPE_TO_PB[dtype]


def dtype_from_pb(value: int) -> WireDtype:
    """WireDtype of a proto enum value; ValueError for unknown values."""
    try:
        return _DTYPE_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown wire dtype {value}") from None


def cursor_to_pb(c: Cursor) -> pb.Cursor:
    return pb.Cursor(
        consumer=c.consumer,
        rank=c.rank,
        generation=c.generation,
        seq=c.seq,
        step=c.step,
        pull_id=c.pull_id,
    )


def cursor_from_pb(c: pb.Cursor) -> Cursor:
    return Cursor(c.consumer, c.rank, c.generation, c.seq, c.step, c.pull_id)


def request_from_options(
    consumer: str, opts: PullOptions, *, chunk_bytes: int = 0
) -> pb.GetDeltaRequest:
    """The GetDeltaRequest for a consumer's PullOptions."""
    req = pb.GetDeltaRequest(
        consumer=consumer,
        form=form_to_pb(opts.form),
        k=opts.k,
        fraction=opts.fraction,
        tables=list(opts.tables),
        max_rows=opts.max_rows,
        dtype=dtype_to_pb(opts.wire_dtype),
        auto_commit=opts.auto_commit,
        chunk_bytes=chunk_bytes,
    )
    if opts.max_step is not None:
        req.max_step = opts.max_step
    return req


# ---------------------------------------------------------------------------------------------
# encoding (server)


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


def _fbgemm_rowwise_int8() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """fbgemm's fused row-wise 8-bit quantizer, or None where fbgemm is not installed."""
    global _FBGEMM_Q8
    if _FBGEMM_Q8 is None:
        try:
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

            _FBGEMM_Q8 = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized
        except (ImportError, OSError, AttributeError, RuntimeError):
            _FBGEMM_Q8 = False
    return _FBGEMM_Q8 or None


_FBGEMM_Q8: Any = None


def preload_quantizer() -> bool:
    """Load fbgemm's int8 kernel now (its import takes ~0.4 s here) rather than in the first
    INT8 pull; True if it is available. Safe to call from any thread, any number of times."""
    return _fbgemm_rowwise_int8() is not None


def quantize(values: torch.Tensor, dtype: WireDtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values in the wire dtype (contiguous) and, for INT8, float32 [n, 2] (scale, bias).

    INT8 uses fbgemm's fused row-wise quantizer where fbgemm is installed (measured, 2 MB
    chunks, one thread: 17.9 GB/s of fp32 rows against 5.2 for the torch ops below): its
    ``u8 * scale + min`` is this wire's ``(u8 - 128) * scale + (min + 128 * scale)``, and
    ``u8 - 128`` as int8 is ``u8`` with its top bit flipped.
    """
    if dtype is WireDtype.FP32:
        return values.to(torch.float32).contiguous(), None
    if dtype is WireDtype.FP16:
        return values.to(torch.float16).contiguous(), None
    if dtype is WireDtype.BF16:
        return values.to(torch.bfloat16).contiguous(), None
    v = values.to(torch.float32)
    n, w = v.shape
    if v.numel() == 0:
        return torch.empty(v.shape, dtype=torch.int8), torch.empty(n, 2)
    fused = _fbgemm_rowwise_int8()
    if fused is not None:
        q = fused(v.contiguous())  # uint8 [n, w + 8]: codes, then float32 scale and min
        codes = q[:, :w].view(torch.int8).bitwise_xor(-128)
        sb = q[:, w:].contiguous().view(torch.float32)
        sb[:, 1].add_(sb[:, 0], alpha=128.0)
        return codes, sb
    lo, hi = torch.aminmax(v, dim=1, keepdim=True)
    scale = (hi - lo) / 255.0
    # One temporary, then in place; a reciprocal multiply instead of a broadcast divide.
    # Measured (2 MB chunks of fp32 rows): 0.28 -> 7.4 GB/s.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = v.sub(lo).mul_(inv).round_().clamp_(0, 255).sub_(128).to(torch.int8)
    bias = lo + 128.0 * scale
    return codes.contiguous(), torch.cat([scale, bias], dim=1).contiguous()


def dequantize(
    codes: torch.Tensor, scale_bias: torch.Tensor | None, dtype: WireDtype
) -> torch.Tensor:
    """float32 values from wire values (the inverse of :func:`quantize`, up to rounding)."""
    if dtype is WireDtype.INT8:
        assert scale_bias is not None
        return codes.to(torch.float32) * scale_bias[:, :1] + scale_bias[:, 1:]
    return codes.to(torch.float32)


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
    m.ids[:] = ids.numpy()
    if sb is not None:
        m.scale_bias.view(np.uint8)[:] = np.frombuffer(sb, dtype=np.uint8)
    if vals is not None:
        m.values[:] = np.frombuffer(vals, dtype=np.uint8)
    return m.data


def rows_per_chunk(width: int, dtype: WireDtype | None, chunk_bytes: int) -> int:
    """Rows that fit a chunk of about ``chunk_bytes`` (ids, values and int8 scale/bias)."""
    row = 8
    if dtype is not None:
        row += width * WIRE_ITEMSIZE[dtype] + (8 if dtype is WireDtype.INT8 else 0)
    return max(1, chunk_bytes // row)


def encode_slice_chunks(
    slice_index: int,
    ids: torch.Tensor,
    values: torch.Tensor | None,
    dtype: WireDtype,
    chunk_bytes: int,
) -> Iterator[bytes]:
    """Serialized RowChunk messages of one slice (values None for FORM_IDS).

    Values are quantized chunk by chunk (every wire dtype is row-wise), so the first chunk is
    ready at once and no slice-sized temporary is allocated.
    """
    ids = ids.contiguous()
    width = values.shape[1] if values is not None and values.dim() == 2 else 0
    step = rows_per_chunk(width, dtype if values is not None else None, chunk_bytes)
    for off in range(0, ids.numel(), step):
        end = off + step
        wire_vals, sb = quantize(values[off:end], dtype) if values is not None else (None, None)
        yield encode_chunk(slice_index, off, ids[off:end], wire_vals, sb)


# ---------------------------------------------------------------------------------------------
# decoding (client)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise StreamDecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise StreamDecodeError("varint too long")


def _skip_field(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wire_type == 5:
        return pos + 4
    raise StreamDecodeError(f"unsupported wire type {wire_type}")


def _view(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A read-only tensor over received bytes (no copy; keeps the bytes alive)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(buf, dtype=dtype)


class _Slot:
    """A slice being filled: preallocated tensors (copy mode) or per-chunk parts (zero-copy)."""

    def __init__(
        self, s: pb.TableSlice, with_values: bool, zero_copy: bool, pool: BufferPool | None
    ) -> None:
        self.meta = s
        self.count = s.count
        self.width = s.col_end - s.col_start
        self.with_values = with_values
        self.parts: list[tuple[int, torch.Tensor, torch.Tensor | None]] | None = None
        self.ids = self.values = None
        self.ids_np: Any = None
        self.values_np: Any = None
        if zero_copy:
            self.parts = []
        else:
            empty = torch.empty if pool is None else pool.take
            self.ids = empty((s.count,), dtype=torch.int64)
            self.ids_np = self.ids.numpy()
            if with_values:
                self.values = empty((s.count, self.width), dtype=torch.float32)
                self.values_np = self.values.numpy()
        self.filled = 0

    def updates(self) -> list[SliceUpdate]:
        m = self.meta

        def update(ids: torch.Tensor, values: torch.Tensor | None, owed: int) -> SliceUpdate:
            return SliceUpdate(
                m.table, m.num_rows, m.dim, m.col_start, m.col_end, ids, values, owed
            )

        if self.parts is None:
            assert self.ids is not None
            return [update(self.ids, self.values, m.owed)]
        if not self.parts:
            empty = torch.empty(0, self.width) if self.with_values else None
            return [update(torch.empty(0, dtype=torch.int64), empty, m.owed)]
        self.parts.sort(key=lambda p: p[0])
        return [
            update(ids, values, m.owed if i == 0 else 0)
            for i, (_, ids, values) in enumerate(self.parts)
        ]


class WindowAssembler:
    """Builds a :class:`~deltad.window.RankDelta` from one GetDelta stream, message by message.

    Feed every message in order with :meth:`add` (a parsed ``GetDeltaResponse`` or its raw
    serialized ``bytes``), then call :meth:`result`. Raises :class:`StreamDecodeError` on a
    malformed or incomplete stream.

    By default each table slice becomes one SliceUpdate whose tensors are filled with one copy.
    With ``zero_copy=True`` each RowChunk becomes its own SliceUpdate (so a table slice may
    appear several times, in row order; ``owed`` is on its first part) whose ids and fp32
    values are read-only views of the received bytes: no copy at all (fp16 / bf16 / int8 are
    dequantized per chunk, one copy). Which is faster depends on the allocator: with
    :func:`deltad.perf.tune_malloc` the copy lands in reused heap pages while the received
    messages, which views keep alive, are fresh pages every pull; measured (1 GB fp32 window,
    loopback, 2 cores, steady state) the copy took 0.64-0.84 s per pull, views 0.79-1.05 s.

    With a :class:`~deltad.buffers.BufferPool` the copy mode fills buffers of earlier pulls
    that nothing references any more, so its pages are already mapped (see that module).
    """

    def __init__(self, *, zero_copy: bool = False, pool: BufferPool | None = None) -> None:
        self.zero_copy = zero_copy
        self.pool = pool
        self.header: pb.DeltaHeader | None = None
        self.trailer: pb.DeltaTrailer | None = None
        self.form = Form.ROWS
        self.dtype = WireDtype.FP32
        self.slots: list[_Slot] = []
        self.bytes = 0

    def add(self, msg: pb.GetDeltaResponse | bytes) -> None:
        if isinstance(msg, bytes | bytearray | memoryview):
            self._add_raw(memoryview(msg))
            return
        which = msg.WhichOneof("msg")
        if which == "header":
            self._on_header(msg.header)
        elif which == "chunk":
            c = msg.chunk
            self._on_chunk(
                c.slice,
                c.offset,
                c.count,
                memoryview(c.ids),
                memoryview(c.scale_bias),
                memoryview(c.values),
            )
        elif which == "trailer":
            self._on_trailer(msg.trailer)
        else:
            raise StreamDecodeError("empty GetDeltaResponse")

    def _add_raw(self, buf: memoryview) -> None:
        if len(buf) < 2:
            raise StreamDecodeError("empty GetDeltaResponse")
        tag, pos = _read_varint(buf, 0)
        n, pos = _read_varint(buf, pos)
        body = buf[pos : pos + n]
        if len(body) != n:
            raise StreamDecodeError("bad GetDeltaResponse framing")
        if pos + n != len(buf):
            # fields after the first (a newer server's additions): decode the whole message
            try:
                msg = pb.GetDeltaResponse.FromString(bytes(buf))
            except DecodeError as e:
                raise StreamDecodeError(f"bad GetDeltaResponse: {e}") from e
            self.add(msg)
            return
        try:
            if tag == 0x0A:
                self._on_header(pb.DeltaHeader.FromString(bytes(body)))
            elif tag == 0x12:
                self._parse_chunk(body)
            elif tag == 0x1A:
                self._on_trailer(pb.DeltaTrailer.FromString(bytes(body)))
            else:
                raise StreamDecodeError(f"unexpected field tag {tag:#x} in GetDeltaResponse")
        except DecodeError as e:
            raise StreamDecodeError(f"bad GetDeltaResponse: {e}") from e

    def _parse_chunk(self, buf: memoryview) -> None:
        fields = [0, 0, 0]
        blobs = [memoryview(b""), memoryview(b""), memoryview(b"")]
        pos = 0
        while pos < len(buf):
            key, pos = _read_varint(buf, pos)
            num, wt = key >> 3, key & 7
            if 1 <= num <= 3 and wt == 0:
                fields[num - 1], pos = _read_varint(buf, pos)
            elif 4 <= num <= 6 and wt == 2:
                n, pos = _read_varint(buf, pos)
                blobs[num - 4] = buf[pos : pos + n]
                pos += n
            else:
                pos = _skip_field(buf, pos, wt)
        if pos != len(buf):
            raise StreamDecodeError("truncated RowChunk")
        self._on_chunk(fields[0], fields[1], fields[2], blobs[0], blobs[1], blobs[2])

    def _on_header(self, h: pb.DeltaHeader) -> None:
        if self.header is not None:
            raise StreamDecodeError("second header in one stream")
        self.header = h
        try:
            self.form = form_from_pb(h.form)
            self.dtype = dtype_from_pb(h.dtype)
        except ValueError as e:
            raise StreamDecodeError(str(e)) from e
        with_values = self.form is not Form.IDS
        for s in h.slices:
            if not 0 <= s.col_start <= s.col_end <= s.dim or s.count > s.num_rows:
                raise StreamDecodeError(
                    f"slice {s.table[:64]!r}: columns {s.col_start}..{s.col_end} of {s.dim}, "
                    f"{s.count} rows of {s.num_rows}: not a slice of its table"
                )
            if s.count * max(1, s.col_end - s.col_start) > MAX_SLICE_ELEMENTS:
                raise StreamDecodeError(
                    f"slice {s.table[:64]!r} of {s.count} x {s.col_end - s.col_start}: too large"
                )
        self.slots = [_Slot(s, with_values, self.zero_copy, self.pool) for s in h.slices]

    def _on_chunk(
        self,
        index: int,
        offset: int,
        count: int,
        ids: memoryview,
        scale_bias: memoryview,
        values: memoryview,
    ) -> None:
        if self.header is None or self.trailer is not None:
            raise StreamDecodeError("row chunk outside header..trailer")
        if index >= len(self.slots):
            raise StreamDecodeError(f"chunk for slice {index} of {len(self.slots)}")
        slot = self.slots[index]
        end = offset + count
        if end > slot.count or len(ids) != count * 8:
            raise StreamDecodeError(f"chunk rows {offset}..{end} outside slice of {slot.count}")
        if offset != slot.filled:  # each slice's rows come in order, once: no gap, no overlap
            raise StreamDecodeError(
                f"chunk rows {offset}..{end} of slice {index}: expected row {slot.filled} next"
            )
        if slot.parts is not None:
            vals = None
            if slot.with_values:
                if self.dtype is WireDtype.FP32 and len(values) == count * slot.width * 4:
                    vals = _view(values, torch.float32).view(count, slot.width)
                else:
                    out = np.empty((count, slot.width), dtype=np.float32)
                    self._fill_values(out, slot.width, count, scale_bias, values)
                    vals = torch.from_numpy(out)
            slot.parts.append((offset, _view(ids, torch.int64), vals))
        else:
            slot.ids_np[offset:end] = np.frombuffer(ids, dtype=np.int64)
            if slot.values_np is not None:
                out = slot.values_np[offset:end]
                self._fill_values(out, slot.width, count, scale_bias, values)
        slot.filled += count
        self.bytes += len(ids) + len(scale_bias) + len(values)

    def _fill_values(
        self, out: Any, w: int, count: int, scale_bias: memoryview, values: memoryview
    ) -> None:
        """Write ``count`` rows of wire values, dequantized to float32, into ``out``."""
        if len(values) != count * w * WIRE_ITEMSIZE[self.dtype]:
            raise StreamDecodeError(f"chunk values of {len(values)} bytes for {count}x{w}")
        if count == 0 or w == 0:
            return
        if self.dtype is WireDtype.FP32:
            out[...] = np.frombuffer(values, dtype=np.float32).reshape(count, w)
        elif self.dtype in (WireDtype.FP16, WireDtype.BF16):
            # torch's vectorized casts: numpy's float16 -> float32 ran at ~1.2 GB/s of wire
            # bytes (the fp16 pull's bottleneck), bf16 bit shifts at ~6 GB/s.
            half = torch.float16 if self.dtype is WireDtype.FP16 else torch.bfloat16
            torch.from_numpy(out).copy_(_view(values, half).view(count, w))
        else:
            if len(scale_bias) != count * 8:
                raise StreamDecodeError("int8 chunk without a (scale, bias) per row")
            # torch: a cast then two in-place passes, 3-6 GB/s of wire bytes against 1.2 for
            # numpy's mixed int8 x float32 multiply
            sb = _view(scale_bias, torch.float32).view(count, 2)
            t = torch.from_numpy(out)
            t.copy_(_view(values, torch.int8).view(count, w))
            t.mul_(sb[:, :1]).add_(sb[:, 1:])

    def _on_trailer(self, t: pb.DeltaTrailer) -> None:
        if self.header is None:
            raise StreamDecodeError("trailer before header")
        if self.trailer is not None:
            raise StreamDecodeError("second trailer in one stream")
        self.trailer = t

    def result(self) -> RankDelta:
        """The decoded window; StreamDecodeError if the stream was cut short."""
        h, t = self.header, self.trailer
        if h is None or t is None:
            raise StreamDecodeError("stream ended before its trailer")
        for s in self.slots:
            if s.filled != s.count:
                raise StreamDecodeError(
                    f"slice {s.meta.table}: {s.filled} of {s.count} rows received"
                )
        slices = [u for s in self.slots for u in s.updates()]
        if self.pool is not None:
            self.pool.end_round()
        return RankDelta(
            rank=h.rank,
            generation=h.generation,
            resync=h.resync,
            from_seq=h.from_seq,
            to_seq=h.to_seq,
            to_step=h.to_step,
            form=self.form,
            wire_dtype=self.dtype,
            cursor=cursor_from_pb(t.cursor),
            slices=slices,
            committed=t.committed,
            rows=sum(s.count for s in self.slots),
            bytes=self.bytes,
        )


def decode_stream(
    messages: Iterable[pb.GetDeltaResponse | bytes],
    *,
    zero_copy: bool = False,
    pool: BufferPool | None = None,
) -> RankDelta:
    """Decode a whole GetDelta stream (parsed messages or raw bytes) into a RankDelta
    (``zero_copy``, ``pool``: see :class:`WindowAssembler`)."""
    asm = WindowAssembler(zero_copy=zero_copy, pool=pool)
    for m in messages:
        asm.add(m)
    return asm.result()


def raw_get_delta(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """GetDelta as a callable whose stream yields raw serialized messages (the fast path)."""
    return channel.unary_stream(
        GET_DELTA_METHOD,
        request_serializer=pb.GetDeltaRequest.SerializeToString,
        response_deserializer=None,
    )


def pull(
    channel: grpc.Channel,
    request: pb.GetDeltaRequest,
    *,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    zero_copy: bool = False,
    pool: BufferPool | None = None,
) -> RankDelta:
    """Run one GetDelta on ``channel`` over the raw fast path and decode it.

    gRPC errors propagate as ``grpc.RpcError``; a malformed stream raises StreamDecodeError.
    ``zero_copy``, ``pool``: see :class:`WindowAssembler`.
    """
    stream = raw_get_delta(channel)(request, timeout=timeout, metadata=metadata)
    return decode_stream(stream, zero_copy=zero_copy, pool=pool)
