"""A window's header: its shard lines, the message and its per-pull marks, the bytes it bounds."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deltad import wire
from deltad.segment.format import ShardRows
from deltad.serve.index.log import DenseEntry
from deltad.serve.windows import encode
from deltad.serve.windows.spec import WindowSpec
from deltad.types import Form, Shard, WireDtype
from deltad.v1 import delta_pb2 as pb

#: framing of one serialized RowChunk / DenseChunk message at most (tags and varints)
_CHUNK_FRAMING = 64


@dataclass(frozen=True)
class ShardLine:
    """A shard's line in the window header (a ``TableSlice`` message)."""

    shard: Shard
    count: int
    owed: int = 0
    #: a managed-collision shard: raw ids with its rows, and this many evicted / admitted
    identities: bool = False
    evicted: int = 0
    admitted: int = 0

    def with_identities(self, idn: encode.Identities | None) -> ShardLine:
        """This line announcing ``idn`` (None: an ordinary shard, unchanged)."""
        if idn is None:
            return self
        admitted = 0 if idn.admitted is None else idn.admitted.numel()
        return replace(self, identities=True, evicted=idn.evicted.numel(), admitted=admitted)

    def wire_dtype(self, dtype: WireDtype) -> WireDtype:
        """The dtype this shard's values travel in for a request of ``dtype`` (a packed one
        sends the shards it cannot pack, column-wise ones, as fp32)."""
        s = self.shard
        return wire.slice_dtype(dtype, s.dim, s.col_start, s.col_end)


def window_header(
    spec: WindowSpec,
    to_step: int,
    lines: list[tuple[ShardRows | None, ShardLine]],
    dense: DenseEntry | None = None,
) -> bytes:
    header = pb.DeltaHeader(
        rank=spec.rank,
        generation=spec.generation,
        resync=spec.resync,
        from_seq=-1 if spec.resync else spec.from_seq,
        to_seq=spec.to_seq,
        to_step=to_step,
        form=wire.form_to_pb(spec.form),
        dtype=wire.dtype_to_pb(spec.dtype),
        row_alignment=spec.row_alignment if spec.dtype.packed else 0,
    )
    if dense is not None:
        header.dense.seq, header.dense.step = dense.seq, dense.step
        for t in dense.state.header.tensors:
            header.dense.tensors.add(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
    with_values = spec.form is not Form.IDS
    for _, m in lines:
        line = pb.TableSlice(
            table=m.shard.table,
            num_rows=m.shard.num_rows,
            dim=m.shard.dim,
            col_start=m.shard.col_start,
            col_end=m.shard.col_end,
            count=m.count,
            owed=m.owed,
            identities=m.identities,
            evicted_count=m.evicted,
            admitted_count=m.admitted,
        )
        if with_values and spec.dtype.packed:
            dtype = m.wire_dtype(spec.dtype)
            if dtype.packed:
                line.row_bytes = wire.packed_row_bytes(m.shard.dim, dtype, spec.row_alignment)
            else:  # a shard it cannot pack: fp32 values (see the proto)
                line.dtype = wire.dtype_to_pb(dtype)
        header.slices.append(line)
    return encode.encode_header(header)


def window_bound(spec: WindowSpec, lines: list[ShardLine], dense: DenseEntry | None) -> int:
    """An upper bound of the encoded chunks' bytes of a window whose header lines are
    ``lines`` (known before any chunk is produced: the cache reserves it)."""
    total = 0
    for m in lines:
        extras = m.evicted + m.admitted
        total += extras * 8 + encode.extra_chunks(extras, spec.chunk_bytes) * _CHUNK_FRAMING
        if not m.count:
            continue
        width = m.shard.col_end - m.shard.col_start
        dtype = m.wire_dtype(spec.dtype) if spec.form is not Form.IDS else None
        step = encode.rows_per_chunk(
            width, dtype, spec.chunk_bytes, spec.row_alignment, m.identities
        )
        row = 16 if m.identities else 8
        if dtype is not None and dtype.packed:
            row += wire.packed_row_bytes(width, dtype, spec.row_alignment)
        elif dtype is not None:
            row += width * wire.WIRE_ITEMSIZE[dtype] + (8 if dtype is WireDtype.INT8 else 0)
        total += m.count * row + -(-m.count // step) * _CHUNK_FRAMING
    if dense is not None:
        step = max(1, spec.chunk_bytes)
        for t in dense.state.header.tensors:
            total += t.nbytes + (t.nbytes // step + 1) * _CHUNK_FRAMING
    return total


def with_rollback(header: bytes, step: int, epoch: int) -> bytes:
    """A serialized header message marked as following the rollback to ``step`` (``epoch``)."""
    msg = pb.GetDeltaResponse.FromString(header)
    msg.header.rollback_to_step, msg.header.rollback_epoch = step, epoch
    return msg.SerializeToString()


def with_reason(header: bytes, reason: str) -> bytes:
    """A serialized header message with ``resync_reason`` set to ``reason``."""
    msg = pb.GetDeltaResponse.FromString(header)
    msg.header.resync_reason = reason[:512]
    return msg.SerializeToString()


def with_dense_missing(header: bytes, reason: str) -> bytes:
    """A serialized header message with ``dense_missing`` set to ``reason``."""
    msg = pb.GetDeltaResponse.FromString(header)
    msg.header.dense_missing = reason[:512]
    return msg.SerializeToString()


def with_upstream_lost(header: bytes, reason: str) -> bytes:
    """A serialized header message with ``upstream_lost`` set to ``reason`` (a relay)."""
    msg = pb.GetDeltaResponse.FromString(header)
    msg.header.upstream_lost = reason[:512]
    return msg.SerializeToString()


def with_resumed(header: bytes, messages: int) -> bytes:
    """A serialized header message marked as continuing a broken stream after ``messages``."""
    msg = pb.GetDeltaResponse.FromString(header)
    msg.header.resumed_messages = messages
    return msg.SerializeToString()
