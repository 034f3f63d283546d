"""A reference decoder and applier of GetDelta windows, written from docs/protocol.md with
numpy and the generated protobuf classes only (no :mod:`deltad.consume`): the recorder computes
each vector's expected state with it, and it is a second reading of the protocol to compare a
client against.

State: per table a float32 ``[num_rows, dim]`` array, or for packed wire dtypes the uint8
``[num_rows, row_bytes]`` rows; per managed-collision table the int64 slot -> raw id map
(``EMPTY_RAW_ID`` = empty); the dense tensors; per rank the cursor to commit. A pull (one
window per rank) is applied whole or not at all: :class:`Refused` leaves the state as it was.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltad.v1 import delta_pb2 as pb

EMPTY_RAW_ID = (1 << 63) - 1
PACKED = {pb.WIRE_DTYPE_PACKED_INT8, pb.WIRE_DTYPE_PACKED_INT4, pb.WIRE_DTYPE_PACKED_FP16}
ITEMSIZE: dict[int, int] = {
    pb.WIRE_DTYPE_FP32: 4,
    pb.WIRE_DTYPE_FP16: 2,
    pb.WIRE_DTYPE_BF16: 2,
    pb.WIRE_DTYPE_INT8: 1,
}
DENSE_DTYPES = {
    "float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": np.uint16,
    "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
    "int64": np.int64, "bool": np.bool_,
}  # fmt: skip


class Refused(Exception):
    """The window (or pull) is malformed or contradicts the state: nothing of it applies."""


def packed_row_bytes(dim: int, dtype: int, alignment: int) -> int:
    sizes: dict[int, int] = {
        pb.WIRE_DTYPE_PACKED_INT8: dim + 4,
        pb.WIRE_DTYPE_PACKED_INT4: (dim + 1) // 2 + 4,
        pb.WIRE_DTYPE_PACKED_FP16: 2 * dim,
    }
    data = sizes[dtype]
    a = alignment or 16
    return (data + a - 1) // a * a


@dataclass
class Slice:
    meta: pb.TableSlice
    dtype: int  # the values' wire dtype (a packed response's unpackable slices: FP32)
    row_bytes: int  # packed: bytes per row (else 0)
    ids: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    raw_ids: list[np.ndarray] = field(default_factory=list)
    evicted: list[np.ndarray] = field(default_factory=list)
    admitted: list[np.ndarray] = field(default_factory=list)
    filled: int = 0

    def cat(self, parts: list[np.ndarray], dtype: Any, width: int | None = None) -> np.ndarray:
        if parts:
            return np.concatenate(parts)
        return np.empty((0,) if width is None else (0, width), dtype=dtype)


@dataclass
class Window:
    header: pb.DeltaHeader
    trailer: pb.DeltaTrailer
    slices: list[Slice]
    dense: dict[str, tuple[str, tuple[int, ...], bytes]]


def _le(buf: bytes, dt: str) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.dtype(dt))


def decode_values(dtype: int, n: int, w: int, values: bytes, scale_bias: bytes) -> np.ndarray:
    """float32 [n, w] of a chunk's values in a float wire dtype (the bytes of docs/protocol.md)."""
    if len(values) != n * w * ITEMSIZE[dtype]:
        raise Refused(f"{len(values)} value bytes for {n}x{w}")
    if dtype == pb.WIRE_DTYPE_FP32:
        return _le(values, "<f4").reshape(n, w).copy()
    if dtype == pb.WIRE_DTYPE_FP16:
        return _le(values, "<f2").astype(np.float32).reshape(n, w)
    if dtype == pb.WIRE_DTYPE_BF16:
        bits = _le(values, "<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(n, w)
    if len(scale_bias) != n * 8:
        raise Refused("int8 chunk without a (scale, bias) per row")
    sb = _le(scale_bias, "<f4").reshape(n, 2)
    codes = _le(values, "i1").astype(np.float32).reshape(n, w)
    # two float32 roundings: (code * scale) rounded, then + bias rounded (no fused multiply-add)
    prod = (codes * sb[:, :1]).astype(np.float32)
    return (prod + sb[:, 1:]).astype(np.float32)


def decode(messages: list[bytes]) -> Window:
    """One GetDelta stream (serialized GetDeltaResponse messages) as a Window; Refused if it
    is malformed or incomplete."""
    header: pb.DeltaHeader | None = None
    trailer: pb.DeltaTrailer | None = None
    slices: list[Slice] = []
    dense_meta: list[tuple[str, str, tuple[int, ...], int]] = []
    dense_buf: list[bytearray] = []
    for raw in messages:
        try:
            m = pb.GetDeltaResponse.FromString(raw)
        except Exception as e:  # (protobuf's DecodeError)
            raise Refused(f"bad message: {e}") from e
        which = m.WhichOneof("msg")
        if which == "header":
            if header is not None:
                raise Refused("second header")
            header = m.header
            form = header.form or pb.FORM_ROWS
            wire = header.dtype or pb.WIRE_DTYPE_FP32
            for ts in header.slices:
                if not 0 <= ts.col_start <= ts.col_end <= ts.dim or ts.count > ts.num_rows:
                    raise Refused(f"slice {ts.table}: not a slice of its table")
                wdt, rb = wire, 0
                if ts.dtype != pb.WIRE_DTYPE_UNSPECIFIED:
                    if wire not in PACKED or ts.dtype != pb.WIRE_DTYPE_FP32 or ts.row_bytes:
                        raise Refused(f"slice {ts.table}: dtype {ts.dtype} in a {wire} response")
                    wdt = pb.WIRE_DTYPE_FP32
                elif wire in PACKED and form != pb.FORM_IDS:
                    rb = packed_row_bytes(ts.dim, wire, header.row_alignment)
                    if ts.row_bytes != rb or (ts.col_start, ts.col_end) != (0, ts.dim):
                        raise Refused(
                            f"slice {ts.table}: {ts.row_bytes} bytes a row, expected {rb}"
                        )
                slices.append(Slice(ts, wdt, rb))
            if header.HasField("dense"):
                for t in header.dense.tensors:
                    if t.dtype not in DENSE_DTYPES:
                        raise Refused(f"dense {t.name}: dtype {t.dtype}")
                    shape = tuple(int(x) for x in t.shape)
                    size = (
                        int(np.prod(shape, dtype=np.int64))
                        * np.dtype(DENSE_DTYPES[t.dtype]).itemsize
                    )
                    if size != t.nbytes:
                        raise Refused(f"dense {t.name}: {t.nbytes} bytes for {shape}")
                    dense_meta.append((t.name, t.dtype, shape, t.nbytes))
                    dense_buf.append(bytearray())
        elif which == "chunk":
            if header is None or trailer is not None:
                raise Refused("row chunk outside header..trailer")
            c = m.chunk
            if c.slice >= len(slices):
                raise Refused(f"chunk for slice {c.slice}")
            s: Slice = slices[c.slice]
            if (
                c.offset != s.filled
                or c.offset + c.count > s.meta.count
                or len(c.ids) != 8 * c.count
            ):
                raise Refused(f"chunk rows {c.offset}+{c.count} of slice {c.slice}")
            s.ids.append(_le(c.ids, "<i8"))
            if (header.form or pb.FORM_ROWS) != pb.FORM_IDS:
                if s.row_bytes:
                    if len(c.values) != c.count * s.row_bytes:
                        raise Refused("packed chunk of the wrong size")
                    s.values.append(_le(c.values, "u1").reshape(c.count, s.row_bytes))
                else:
                    w = s.meta.col_end - s.meta.col_start
                    s.values.append(decode_values(s.dtype, c.count, w, c.values, c.scale_bias))
            if s.meta.identities:
                if len(c.raw_ids) != 8 * c.count:
                    raise Refused("raw ids not aligned with the chunk's rows")
                s.raw_ids.append(_le(c.raw_ids, "<i8"))
                s.evicted.append(_le(c.evicted, "<i8"))
                s.admitted.append(_le(c.admitted, "<i8"))
            elif len(c.raw_ids) or len(c.evicted) or len(c.admitted):
                raise Refused("raw ids in a slice without identities")
            s.filled += c.count
        elif which == "dense":
            if header is None or trailer is not None:
                raise Refused("dense chunk outside header..trailer")
            d = m.dense
            if d.tensor >= len(dense_meta) or d.offset != len(dense_buf[d.tensor]):
                raise Refused("dense chunk out of order")
            dense_buf[d.tensor] += d.data
            if len(dense_buf[d.tensor]) > dense_meta[d.tensor][3]:
                raise Refused("dense chunk past its tensor")
        elif which == "trailer":
            if header is None or trailer is not None:
                raise Refused("trailer out of place")
            trailer = m.trailer
        else:
            raise Refused("empty message")
    if header is None or trailer is None:
        raise Refused("stream ended before its trailer")
    for sl in slices:
        ev = sum(len(x) for x in sl.evicted)
        ad = sum(len(x) for x in sl.admitted)
        if (
            sl.filled != sl.meta.count
            or ev != sl.meta.evicted_count
            or ad != sl.meta.admitted_count
        ):
            raise Refused(f"slice {sl.meta.table}: incomplete")
    dense = {}
    for (name, dname, shape, nbytes), buf in zip(dense_meta, dense_buf, strict=True):
        if len(buf) != nbytes:
            raise Refused(f"dense {name}: {len(buf)} of {nbytes} bytes")
        dense[name] = (dname, shape, bytes(buf))
    return Window(header, trailer, slices, dense)


@dataclass
class State:
    tables: dict[str, np.ndarray] = field(default_factory=dict)
    slots: dict[str, np.ndarray] = field(default_factory=dict)
    dense: dict[str, tuple[str, tuple[int, ...], bytes]] = field(default_factory=dict)
    cursors: dict[int, pb.Cursor] = field(default_factory=dict)
    dense_step: int | None = None


def apply(state: State, windows: list[Window]) -> State:
    """The state after one pull's windows (one per rank), or Refused (``state`` untouched)."""
    new = copy.deepcopy(state)
    told: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    evicted: dict[str, list[np.ndarray]] = {}
    for w in windows:
        h = w.header
        if (h.form or pb.FORM_ROWS) == pb.FORM_IDS:
            raise Refused("a FORM_IDS window carries no values to apply")
        for s in w.slices:
            m = s.meta
            width = s.row_bytes or m.dim
            dtype = np.uint8 if s.row_bytes else np.float32
            t = new.tables.get(m.table)
            if t is None or (h.resync and (t.shape != (m.num_rows, width) or t.dtype != dtype)):
                t = new.tables[m.table] = np.zeros((m.num_rows, width), dtype=dtype)
            if t.shape != (m.num_rows, width) or t.dtype != dtype:
                raise Refused(
                    f"table {m.table}: held {t.shape} {t.dtype}, sent {m.num_rows}x{width}"
                )
            ids = s.cat(s.ids, np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= m.num_rows):
                raise Refused(f"table {m.table}: row id out of range")
            vals = s.cat(s.values, dtype, s.row_bytes or (m.col_end - m.col_start))
            if s.row_bytes:
                t[ids] = vals
            else:
                t[ids, m.col_start : m.col_end] = vals
            if m.identities:
                told.setdefault(m.table, []).append((ids, s.cat(s.raw_ids, np.int64)))
                evicted.setdefault(m.table, []).append(s.cat(s.evicted, np.int64))
                new.slots.setdefault(m.table, np.full(m.num_rows, EMPTY_RAW_ID, dtype=np.int64))
            elif m.table in new.slots:
                raise Refused(f"table {m.table}: managed-collision rows without raw ids")
        if w.dense:
            new.dense.update(w.dense)
            new.dense_step = h.dense.step
        new.cursors[h.rank] = w.trailer.cursor
    for table, updates in told.items():
        slots = new.slots[table]
        if slots.shape[0] != new.tables[table].shape[0]:
            raise Refused(f"table {table}: slot map of another size")
        for ids, raw in updates:
            if raw.size and raw.min() < 0:
                raise Refused(f"table {table}: negative raw id {int(raw.min())}")
            slots[ids] = raw
        held = slots[slots != EMPTY_RAW_ID]
        if np.unique(held).size != held.size:
            raise Refused(f"table {table}: a raw id held by two slots")
        gone = np.concatenate(evicted[table])
        if np.isin(gone, held).any():
            raise Refused(f"table {table}: a raw id evicted but still held")
    return new
