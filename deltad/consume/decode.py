"""GetDelta decoding on the consuming side: a stream of messages into tensors.

The consumer library calls these::

    delta = pull(channel, request, timeout=30, metadata=[("authorization", "Bearer t")])

or, with any iterable of stream messages (parsed ``GetDeltaResponse`` protos *or* raw
``bytes`` from :func:`raw_get_delta`)::

    delta = decode_stream(messages)          # -> deltad.consume.window.RankDelta

:class:`WindowAssembler` is the incremental form (``add(msg)`` per message, ``result()``).
Raw bytes take the fast path: RowChunk framing is parsed by hand (:mod:`deltad.consume.rawmsg`)
and every row is copied once, straight from the received buffer into preallocated float32 /
int64 tensors (dequantizing fp16 / bf16 / int8 on the way: :mod:`deltad.consume.wirerows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from deltad.buffers import BufferPool
from deltad.consume import stall
from deltad.consume.rawmsg import (
    CHUNK_TAG,
    DENSE_TAG,
    HEADER_TAG,
    TRAILER_TAG,
    parse_response,
    parse_row_chunk,
    split_response,
)
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.consume.wirerows import chunk_values, fill_values, slice_encodings, view
from deltad.errors import SegmentCorruptError, StreamDecodeError
from deltad.segment.format import dense_dtype
from deltad.types import Form, Shard, WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.wire import GET_DELTA_METHOD, MAX_SLICE_ELEMENTS, cursor_from_pb

if TYPE_CHECKING:
    from deltad.consume.window import ResyncStage


class NotResumed(StreamDecodeError):
    """A stream asked to continue a broken one (:meth:`WindowAssembler.resume_request`) is
    not that window's continuation: the server served the window from its start, or
    another window."""


class _Slot:
    """A slice being filled: preallocated tensors (copy mode) or per-chunk parts (zero-copy)."""

    def __init__(
        self,
        s: pb.TableSlice,
        with_values: bool,
        zero_copy: bool,
        pool: BufferPool | None,
        row_bytes: int = 0,
        dtype: WireDtype = WireDtype.FP32,
        streamed: bool = False,
    ) -> None:
        self.meta = s
        #: rows go to a ResyncStage chunk by chunk: nothing is kept here
        self.streamed = streamed
        #: the dtype of this slice's values (a packed response's fp32 slices differ)
        self.dtype = dtype
        self.count = s.count
        self.width = s.col_end - s.col_start
        self.with_values = with_values
        #: packed dtypes: bytes per row; values are then uint8 [count, row_bytes], kept packed
        self.row_bytes = row_bytes
        self.parts: (
            list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] | None
        ) = None
        self.ids = self.values = None
        self.ids_np: Any = None
        self.values_np: Any = None
        #: a managed-collision slice: raw ids with the rows, and the window's evicted /
        #: admitted raw ids (filled run by run; admitted only in FORM_IDS)
        self.identities = s.identities
        self.raw_ids: torch.Tensor | None = None
        self.evicted = torch.empty(s.evicted_count, dtype=torch.int64)
        self.admitted = (
            torch.empty(s.admitted_count, dtype=torch.int64)
            if s.identities and not with_values
            else None
        )
        self.evicted_filled = self.admitted_filled = 0
        if streamed:
            pass
        elif zero_copy:
            self.parts = []
        else:
            empty = torch.empty if pool is None else pool.take
            self.ids = empty((s.count,), dtype=torch.int64)
            self.ids_np = self.ids.numpy()
            if s.identities:
                self.raw_ids = torch.empty(s.count, dtype=torch.int64)
            if with_values and row_bytes:
                self.values = empty((s.count, row_bytes), dtype=torch.uint8)
                self.values_np = self.values.numpy()
            elif with_values:
                self.values = empty((s.count, self.width), dtype=torch.float32)
                self.values_np = self.values.numpy()
        self.filled = 0

    def updates(self) -> list[ShardUpdate]:
        m = self.meta

        shard = Shard.columns_of(m.table, m.num_rows, m.dim, m.col_start, m.col_end)

        def update(
            ids: torch.Tensor,
            values: torch.Tensor | None,
            owed: int,
            raw: torch.Tensor | None = None,
            first: bool = True,
        ) -> ShardUpdate:
            u = (  # packed rows: in ``packed``, no float values
                ShardUpdate(shard, ids, None, owed, values)
                if self.row_bytes
                else ShardUpdate(shard, ids, values, owed)
            )
            if self.identities:
                none = torch.empty(0, dtype=torch.int64)
                u.raw_ids = raw if raw is not None else none
                u.evicted_raw_ids = self.evicted if first else none
                if self.admitted is not None:
                    u.admitted_raw_ids = self.admitted if first else none
            return u

        if self.streamed:  # rows are in the stage; only what is owed stays with the window
            if not m.owed:
                return []
            none = (
                torch.empty(0, self.row_bytes, dtype=torch.uint8)
                if self.row_bytes
                else torch.empty(0, self.width)
            )
            return [update(torch.empty(0, dtype=torch.int64), none, m.owed)]
        if self.parts is None:
            assert self.ids is not None
            return [update(self.ids, self.values, m.owed, self.raw_ids)]
        if not self.parts:
            empty = None
            if self.with_values:
                empty = (
                    torch.empty(0, self.row_bytes, dtype=torch.uint8)
                    if self.row_bytes
                    else torch.empty(0, self.width)
                )
            return [update(torch.empty(0, dtype=torch.int64), empty, m.owed)]
        self.parts.sort(key=lambda p: p[0])
        return [
            update(ids, values, m.owed if i == 0 else 0, raw, i == 0)
            for i, (_, ids, values, raw) in enumerate(self.parts)
            if i == 0 or ids.numel()  # (a chunk of only evicted / admitted raw ids)
        ]


class WindowAssembler:
    """Builds a :class:`~deltad.consume.window.RankDelta` from one GetDelta stream, message by message.

    Feed every message in order with :meth:`add` (a parsed ``GetDeltaResponse`` or its raw
    serialized ``bytes``), then call :meth:`result`. Raises :class:`StreamDecodeError` on a
    malformed or incomplete stream.

    By default each table slice becomes one ShardUpdate whose tensors are filled with one copy.
    With ``zero_copy=True`` each RowChunk becomes its own ShardUpdate (so a table slice may
    appear several times, in row order; ``owed`` is on its first part) whose ids and fp32
    values are read-only views of the received bytes: no copy at all (fp16 / bf16 / int8 are
    dequantized per chunk, one copy). Which is faster depends on the allocator: with
    :func:`deltad.perf.tune_malloc` the copy lands in reused heap pages while the received
    messages, which views keep alive, are fresh pages every pull; measured (1 GB fp32 window,
    loopback, 2 cores, steady state) the copy took 0.64-0.84 s per pull, views 0.79-1.05 s.

    With a :class:`~deltad.buffers.BufferPool` the copy mode fills buffers of earlier pulls
    that nothing references any more, so its pages are already mapped (see that module).

    With a :class:`~deltad.consume.appliers.ResyncStage` (``stage``), a *resync* window's
    slices that the stage takes (:meth:`ResyncStage.open <deltad.consume.appliers.ResyncStage.open>`)
    are not assembled: each RowChunk's rows are decoded from the received bytes (fp32 and
    packed rows as views of them, other dtypes dequantized per chunk) and written into the
    stage's tables as the chunk arrives, then dropped. The result carries the stage
    (``RankDelta.stage``) and only the slices the stage left. Other windows are assembled.
    """

    def __init__(
        self,
        *,
        zero_copy: bool = False,
        pool: BufferPool | None = None,
        stage: ResyncStage | None = None,
    ) -> None:
        self.zero_copy = zero_copy
        self.pool = pool
        self.stage = stage
        self.streaming = False  # this window's rows go to ``stage``
        self.header: pb.DeltaHeader | None = None
        self.trailer: pb.DeltaTrailer | None = None
        self.form = Form.ROWS
        self.dtype = WireDtype.FP32
        self.slots: list[_Slot] = []
        self.bytes = 0
        #: dense state being received: (name, dtype, shape, buffer, filled) per tensor
        self.dense: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor, list[int]]] = []
        self.dense_bytes = 0
        #: row and dense chunks taken whole since the header (where a resumed stream goes on)
        self.messages = 0
        self._resuming = False  # the next header must continue this window (resume_request)

    @property
    def resumable(self) -> bool:
        """Whether a broken stream of this window may be continued where it broke: some
        chunks arrived, the trailer did not, and the window is one a server builds the same
        again (a resync; a rows / ids window that is no generation diff or rollback; the
        server has the last word, see GetDeltaRequest.resume)."""
        h = self.header
        if h is None or self.trailer is not None or not self.messages:
            return False
        return h.resync or not (
            self.form is Form.TOPK
            or h.HasField("diff_from_generation")
            or h.HasField("rollback_to_step")
        )

    def resume_request(self, request: pb.GetDeltaRequest) -> pb.GetDeltaRequest:
        """``request`` asking to continue this window after :attr:`messages` (pinned to its
        step); the next stream fed to :meth:`add` must then continue it (else
        :class:`NotResumed`)."""
        h = self.header
        assert h is not None and self.resumable
        out = pb.GetDeltaRequest()
        out.CopyFrom(request)
        out.max_step = h.to_step
        out.resume.generation, out.resume.to_seq = h.generation, h.to_seq
        out.resume.from_seq, out.resume.messages = h.from_seq, self.messages
        self._resuming = True
        return out

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
                memoryview(c.raw_ids),
                memoryview(c.evicted),
                memoryview(c.admitted),
            )
        elif which == "trailer":
            self._on_trailer(msg.trailer)
        elif which == "dense":
            self._on_dense(msg.dense.tensor, msg.dense.offset, memoryview(msg.dense.data))
        else:
            raise StreamDecodeError("empty GetDeltaResponse")

    def _add_raw(self, buf: memoryview) -> None:
        split = split_response(buf)
        if split is None:  # fields after the first (a newer server's additions)
            self.add(parse_response(buf))
            return
        tag, body = split
        try:
            if tag == HEADER_TAG:
                self._on_header(pb.DeltaHeader.FromString(bytes(body)))
            elif tag == CHUNK_TAG:
                self._on_chunk(*parse_row_chunk(body))
            elif tag == TRAILER_TAG:
                self._on_trailer(pb.DeltaTrailer.FromString(bytes(body)))
            elif tag == DENSE_TAG:
                c = pb.DenseChunk.FromString(bytes(body))
                self._on_dense(c.tensor, c.offset, memoryview(c.data))
            else:
                raise StreamDecodeError(f"unexpected field tag {tag:#x} in GetDeltaResponse")
        except DecodeError as e:
            raise StreamDecodeError(f"bad GetDeltaResponse: {e}") from e

    def _on_header(self, h: pb.DeltaHeader) -> None:
        if self.header is not None and self._resuming:
            self._on_resumed(self.header, h)
            return
        if self.header is not None:
            raise StreamDecodeError("second header in one stream")
        self.header = h
        self.form, self.dtype, row_bytes, dtypes = slice_encodings(h)
        with_values = self.form is not Form.IDS
        streamed = [False] * len(h.slices)
        if self.stage is not None and h.resync and with_values:
            # every slice is opened before any row arrives: a table the applier refuses
            # fails the pull before anything is staged for it
            for i, s in enumerate(h.slices):
                if s.identities:  # raw ids and rows go to ``apply`` together, not staged
                    continue
                shard = Shard.columns_of(s.table, s.num_rows, s.dim, s.col_start, s.col_end)
                streamed[i] = self.stage.open(h.rank, shard, row_bytes[i])
            self.streaming = any(streamed)
        self.slots = [
            _Slot(s, with_values, self.zero_copy, self.pool, rb, dt, st)
            for s, rb, dt, st in zip(h.slices, row_bytes, dtypes, streamed, strict=True)
        ]
        if h.HasField("dense"):
            self._on_dense_info(h.dense)

    def _on_resumed(self, was: pb.DeltaHeader, h: pb.DeltaHeader) -> None:
        """The header of a stream that should continue this window (see resume_request)."""
        self._resuming = False
        if h.resumed_messages != self.messages:
            raise NotResumed(
                f"the sidecar served seq {h.to_seq} (generation {h.generation}) from its start, "
                f"not seq {was.to_seq} after {self.messages} messages"
                if not h.resumed_messages
                else f"the sidecar resumed after {h.resumed_messages} messages, not {self.messages}"
            )
        a, b = pb.DeltaHeader(), pb.DeltaHeader()
        a.CopyFrom(was)
        b.CopyFrom(h)
        for m in (a, b):  # (per-pull marks)
            m.ClearField("resync_reason")
            m.ClearField("resumed_messages")
        if a != b:
            raise NotResumed(f"the sidecar resumed another window (seq {h.to_seq})")

    def _on_dense_info(self, info: pb.DenseInfo) -> None:
        total = 0
        for t in info.tensors:
            try:
                dtype = dense_dtype(t.dtype)
            except SegmentCorruptError as e:
                raise StreamDecodeError(f"dense tensor {t.name[:64]!r}: {e}") from e
            shape = tuple(int(x) for x in t.shape)
            count = 1
            for x in shape:
                count *= x
            itemsize = torch.empty((), dtype=dtype).element_size()
            total += t.nbytes
            if t.nbytes != count * itemsize or total > MAX_SLICE_ELEMENTS:
                raise StreamDecodeError(
                    f"dense tensor {t.name[:64]!r}: {t.nbytes} bytes for {t.dtype} {list(shape)}"
                )
            buf = torch.empty(t.nbytes, dtype=torch.uint8)
            self.dense.append((t.name, dtype, shape, buf, [0]))

    def _on_dense(self, index: int, offset: int, data: memoryview) -> None:
        if self.header is None or self.trailer is not None or self._resuming:
            raise StreamDecodeError("dense chunk outside header..trailer")
        if index >= len(self.dense):
            raise StreamDecodeError(f"dense chunk for tensor {index} of {len(self.dense)}")
        name, _, _, buf, filled = self.dense[index]
        end = offset + len(data)
        if offset != filled[0] or end > buf.numel():
            raise StreamDecodeError(
                f"dense chunk bytes {offset}..{end} of {name[:64]!r}: expected byte {filled[0]} "
                f"next, of {buf.numel()}"
            )
        if len(data):
            buf[offset:end] = view(data, torch.uint8)
        filled[0] = end
        self.bytes += len(data)
        self.dense_bytes += len(data)
        self.messages += 1

    def _on_chunk(
        self,
        index: int,
        offset: int,
        count: int,
        ids: memoryview,
        scale_bias: memoryview,
        values: memoryview,
        raw_ids: memoryview,
        evicted: memoryview,
        admitted: memoryview,
    ) -> None:
        if self.header is None or self.trailer is not None or self._resuming:
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
        raw = self._identities(slot, index, count, raw_ids, evicted, admitted)
        if slot.streamed:
            self._stream_chunk(slot, count, ids, scale_bias, values)
        elif slot.parts is not None:
            vals = None
            if slot.with_values:
                packed, floats = chunk_values(
                    slot.row_bytes, slot.dtype, slot.width, count, scale_bias, values
                )
                vals = packed if packed is not None else floats
            slot.parts.append((offset, view(ids, torch.int64), vals, raw))
        else:
            slot.ids_np[offset:end] = np.frombuffer(ids, dtype=np.int64)
            if slot.raw_ids is not None and raw is not None:
                slot.raw_ids[offset:end] = raw
            if slot.values_np is not None and slot.row_bytes:
                if len(values) != count * slot.row_bytes:
                    raise StreamDecodeError(f"chunk of {len(values)} bytes for {count} packed rows")
                slot.values_np[offset:end] = np.frombuffer(values, dtype=np.uint8).reshape(
                    count, slot.row_bytes
                )
            elif slot.values_np is not None:
                out = slot.values_np[offset:end]
                fill_values(slot.dtype, out, slot.width, count, scale_bias, values)
        slot.filled += count
        self.bytes += len(ids) + len(scale_bias) + len(values)
        self.bytes += len(raw_ids) + len(evicted) + len(admitted)
        self.messages += 1

    @staticmethod
    def _identities(
        slot: _Slot,
        index: int,
        count: int,
        raw_ids: memoryview,
        evicted: memoryview,
        admitted: memoryview,
    ) -> torch.Tensor | None:
        """Check a chunk's identity fields against its slice; keep its runs of evicted and
        admitted raw ids; its raw ids (a view), or None for an ordinary slice."""
        if not slot.identities:
            if len(raw_ids) or len(evicted) or len(admitted):
                raise StreamDecodeError(f"raw ids in a chunk of slice {index} (not managed)")
            return None
        if len(raw_ids) != count * 8:
            raise StreamDecodeError(
                f"chunk of slice {index}: {len(raw_ids)} bytes of raw ids for {count} rows"
            )
        for name, blob, into, at in (
            ("evicted", evicted, slot.evicted, slot.evicted_filled),
            ("admitted", admitted, slot.admitted, slot.admitted_filled),
        ):
            if not len(blob):
                continue
            n = len(blob) // 8
            if into is None or len(blob) % 8 or at + n > into.numel():
                raise StreamDecodeError(f"chunk of slice {index}: {name} raw ids past its count")
            into[at : at + n] = view(blob, torch.int64)
        slot.evicted_filled += len(evicted) // 8
        slot.admitted_filled += len(admitted) // 8
        return view(raw_ids, torch.int64)

    def _stream_chunk(
        self, slot: _Slot, count: int, ids: memoryview, scale_bias: memoryview, values: memoryview
    ) -> None:
        """One chunk of a streamed slice into the stage: ids, fp32 and packed rows as views of
        the received bytes; fp16 / bf16 / int8 dequantized into a chunk-sized buffer."""
        assert self.stage is not None and self.header is not None
        packed, vals = chunk_values(
            slot.row_bytes, slot.dtype, slot.width, count, scale_bias, values
        )
        m = slot.meta
        shard = Shard.columns_of(m.table, m.num_rows, m.dim, m.col_start, m.col_end)
        self.stage.write(
            self.header.rank, ShardUpdate(shard, view(ids, torch.int64), vals, 0, packed)
        )

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
            if s.evicted_filled != s.evicted.numel() or (
                s.admitted is not None and s.admitted_filled != s.admitted.numel()
            ):
                raise StreamDecodeError(f"slice {s.meta.table}: raw ids missing")
        dense: dict[str, torch.Tensor] = {}
        for name, dtype, shape, buf, filled in self.dense:
            if filled[0] != buf.numel():
                raise StreamDecodeError(
                    f"dense tensor {name[:64]!r}: {filled[0]} of {buf.numel()} bytes received"
                )
            dense[name] = (
                buf.view(dtype).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dtype)
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
            shards=slices,
            committed=t.committed,
            rows=sum(s.count for s in self.slots),
            bytes=self.bytes,
            dense=dense,
            dense_step=h.dense.step if h.HasField("dense") else None,
            dense_bytes=self.dense_bytes,
            dense_seq=h.dense.seq if h.HasField("dense") else None,
            dense_missing=h.dense_missing,
            upstream_lost=h.upstream_lost,
            generation_diff=(
                h.diff_from_generation if h.HasField("diff_from_generation") else None
            ),
            resync_reason=h.resync_reason,
            rollback_to=h.rollback_to_step if h.HasField("rollback_to_step") else None,
            stage=self.stage if self.streaming else None,
        )


class ResumableStream:
    """One window's GetDelta stream across the attempts that pull it: the last attempt's
    assembler, and the request of the next attempt, which goes on where the last broke
    (:meth:`WindowAssembler.resume_request`) unless a resume was declined."""

    def __init__(self, make: Callable[[], WindowAssembler]) -> None:
        self._make = make
        #: the last attempt's assembler
        self.last: WindowAssembler | None = None
        #: the sidecar served a resumed window from its start (set by the caller on
        #: :class:`NotResumed`): no more resumes, and no attempt :meth:`progressed`
        self.declined = False
        self._began = 0  # the last attempt's messages when it began

    @property
    def resumes(self) -> bool:
        """Whether the next attempt goes on with the last one's window."""
        return self.last is not None and self.last.resumable and not self.declined

    def next(self, request: pb.GetDeltaRequest) -> tuple[pb.GetDeltaRequest, WindowAssembler]:
        """The request and the assembler of the next attempt (``request`` as it is and a
        new assembler, or a resume of the last one)."""
        asm = self.last
        if asm is not None and self.resumes:
            request = asm.resume_request(request)
        else:
            asm = self.last = self._make()
        self._began = asm.messages
        return request, asm

    def forget(self) -> None:
        """The next attempt starts over."""
        self.last = None

    def progressed(self) -> bool:
        """Whether the last attempt, which failed, brought messages the next one goes on
        from (never once a resume was declined: a sidecar that ignores ``resume`` would
        otherwise have every attempt start over and "progress" for ever)."""
        asm = self.last
        return self.resumes and asm is not None and asm.messages > self._began


def decode_stream(
    messages: Iterable[pb.GetDeltaResponse | bytes],
    *,
    zero_copy: bool = False,
    pool: BufferPool | None = None,
    stage: ResyncStage | None = None,
    assembler: WindowAssembler | None = None,
) -> RankDelta:
    """Decode a whole GetDelta stream (parsed messages or raw bytes) into a RankDelta
    (``zero_copy``, ``pool``, ``stage``: see :class:`WindowAssembler`; or into
    ``assembler``, e.g. one continuing a broken stream)."""
    asm = assembler or WindowAssembler(zero_copy=zero_copy, pool=pool, stage=stage)
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
    stage: ResyncStage | None = None,
    stall_s: float | None = None,
    assembler: WindowAssembler | None = None,
) -> RankDelta:
    """Run one GetDelta on ``channel`` over the raw fast path and decode it.

    gRPC errors propagate as ``grpc.RpcError``; a malformed stream raises StreamDecodeError.
    ``zero_copy``, ``pool``, ``stage``: see :class:`WindowAssembler`; ``assembler``: decode
    into this one instead (it keeps what arrived if the stream breaks: see
    :meth:`WindowAssembler.resume_request`). ``timeout`` bounds the whole stream;
    ``stall_s`` the wait for each message (:mod:`deltad.consume.stall`: a stream that stalls
    raises :class:`~deltad.consume.stall.StalledStream`).
    """
    asm = assembler or WindowAssembler(zero_copy=zero_copy, pool=pool, stage=stage)
    stream = raw_get_delta(channel)(request, timeout=timeout, metadata=metadata)
    watch = None if stall_s is None else stall.Watched(stream, stall_s)
    try:
        return decode_stream(stream if watch is None else watch.messages(), assembler=asm)
    except grpc.RpcError as e:
        raise e if watch is None else watch.stalled(e) from None
    except BaseException:
        stream.cancel()  # a stream decoded no further (malformed, not the one resumed, ...)
        raise
    finally:
        if watch is not None:
            watch.close()
