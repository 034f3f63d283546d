"""One pull's window: choose the entries, merge, apply top-k / owed rows, encode; and the cache
of encoded windows that several consumers share."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from deltad import wire
from deltad.segment.format import ShardRows
from deltad.serve.index.log import DenseEntry, LogSnapshot
from deltad.serve.index.merge import (
    admitted_raw_ids,
    merge_identities,
    merge_rows,
    plan_shard,
)
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.windows import encode
from deltad.types import Form, Shard, ShardKey, WireDtype
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowSpec:
    """Everything that decides a window's bytes (the cache key when no rows are owed)."""

    rank: int
    generation: int
    resync: bool
    from_seq: int  # cursor seq (-1 for a base window)
    to_seq: int
    form: Form
    dtype: WireDtype
    tables: tuple[str, ...]
    k: int
    fraction: float
    max_rows: int
    chunk_bytes: int
    row_alignment: int = 0  # packed dtypes (else 0)
    dense: bool = False  # with the newest dense state at or before the head, if newer


class EncodedWindow:
    """A window streamed while it is merged and encoded.

    The header, the row count and the owed rows are known when the window is returned (after
    the plan); the RowChunks are produced on demand, in the threads that read them with
    :meth:`iter_chunks`: a reader that needs a chunk nobody has produced yet produces it (one
    at a time), the others wait for it. No producer thread: a second thread merging while the
    gRPC thread sends contends for the GIL, and measured slower (0.4-0.5x bare gRPC vs
    0.77x at 1 GB, 2 cores). A ``kept`` window keeps its chunks (shared by concurrent readers
    and the cache; the last reader to stop early produces the rest); otherwise the one
    reader streams them without keeping any. ``payload_bytes`` and ``merge_seconds``
    are final once the last chunk is out.
    """

    def __init__(
        self,
        header: bytes,
        to_seq: int,
        to_step: int,
        rows: int,
        owed: dict[ShardKey, ShardRows],
        merge_seconds: float,
        *,
        kept: bool = True,
    ) -> None:
        self.header = header
        self.to_seq = to_seq
        self.to_step = to_step
        self.rows = rows
        self.owed = owed
        self.merge_seconds = merge_seconds
        self.payload_bytes = 0
        self.kept = kept
        #: an upper bound of :attr:`nbytes` known at once (what the cache reserves for it;
        #: set by build_window). None: unknown, and the cache reserves nothing while it is
        #: live (the budget then holds only once it is done; windows built elsewhere should
        #: set it, see :func:`window_bound`)
        self.bound: int | None = None
        self._cond = threading.Condition()
        self._chunks: list[bytes] = []
        self._produce: Iterator[tuple[bytes | None, float]] | None = None
        self._producing = False
        self._readers = 0
        self._done = False
        self._error: BaseException | None = None
        self._on_done: list[Callable[[EncodedWindow], None]] = []

    @property
    def owed_rows(self) -> int:
        return sum(r.ids.numel() for r in self.owed.values())

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload_bytes

    @property
    def done(self) -> bool:
        return self._done

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def chunks(self) -> list[bytes]:
        """Every chunk (produces the rest; kept windows only)."""
        assert self.kept
        return list(self.iter_chunks())

    def start(self, produce: Iterator[tuple[bytes | None, float]]) -> EncodedWindow:
        """Produce from ``produce``: (chunk or None, seconds spent), as readers need them."""
        self._produce = produce
        return self

    def finish_with(self, chunks: Iterable[bytes]) -> EncodedWindow:
        """A window whose chunks are all known now."""
        for c in chunks:
            self._chunks.append(c)
            self.payload_bytes += len(c)
        self._finish(None)
        return self

    def on_done(self, fn: Callable[[EncodedWindow], None]) -> None:
        """Call ``fn(self)`` once the last chunk is produced (now if it is)."""
        with self._cond:
            if not self._done:
                self._on_done.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            self._error = error
            self._done = True
            self._producing = False
            self._produce = None
            callbacks, self._on_done = self._on_done, []
            self._cond.notify_all()
        for fn in callbacks:
            fn(self)

    def _next(self) -> bytes | None:
        """The next chunk from the producer (None: no more); the caller holds the turn."""
        assert self._produce is not None
        for c, seconds in self._produce:
            self.merge_seconds += seconds
            if c is not None:
                self.payload_bytes += len(c)
                return c
        return None

    def iter_chunks(self) -> Iterator[bytes]:
        """The chunks in order, producing them as needed; re-raises the producer's error.

        A kept window's last reader that stops early produces the rest before it goes (the
        cache then holds a complete window, and no half-built one keeps its segments).
        """
        if not self.kept:
            yield from self._stream()
            return
        with self._cond:
            self._readers += 1
        i = 0
        try:
            while True:
                c = self._chunk(i)
                if c is None:
                    return
                i += 1
                yield c
        finally:
            with self._cond:
                self._readers -= 1
                rest = self._readers == 0 and not self._done
            if rest:
                try:
                    while self._chunk(i) is not None:
                        i += 1
                except Exception:
                    log.warning("window: producing the rest failed", exc_info=True)

    def _chunk(self, i: int) -> bytes | None:
        """Chunk ``i`` of a kept window (None past the end), produced if nobody has yet."""
        with self._cond:
            while i >= len(self._chunks) and not self._done and self._producing:
                self._cond.wait()
            if i < len(self._chunks):
                return self._chunks[i]
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            self._producing = True  # this reader's turn to produce the next chunk
        try:
            c = self._next()
        except BaseException as e:
            self._finish(e)
            raise
        if c is None:
            self._finish(None)
            return None
        with self._cond:
            self._chunks.append(c)
            self._producing = False
            self._cond.notify_all()
        return c

    def _stream(self) -> Iterator[bytes]:
        """The one reader of a window not kept: produce and hand over, keeping nothing."""
        produce, self._produce = self._produce, None
        if produce is None:  # finished already (finish_with) or a second reader
            if not self._done:
                raise RuntimeError("a window that is not kept has one reader")
            yield from self._chunks
            return
        error: BaseException | None = None
        try:
            for c, seconds in produce:
                self.merge_seconds += seconds
                if c is not None:
                    self.payload_bytes += len(c)
                    yield c
        except GeneratorExit:
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            close = getattr(produce, "close", None)
            if close is not None:
                close()
            self._finish(error)


def _header(
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


def build_window(
    snap: LogSnapshot,
    spec: WindowSpec,
    to_step: int,
    owed: dict[ShardKey, ShardRows],
    *,
    kept: bool = True,
    lazy: bool = True,
    runs: RunCache | None = None,
    spill: SpillStore | None = None,
) -> EncodedWindow:
    """Plan the window ``spec`` over ``snap`` for a consumer owed ``owed``; merge and encode it.

    Returns once the header (every shard's row count) and the owed rows are known, so that
    streaming starts at once. A complete window (no top-k, row budget or owed rows) is planned
    from the union of its ids alone, and each RowChunk's rows are merged right before it is
    encoded (:class:`_MergedShard`); otherwise every shard is merged and planned first (top-k
    and owed rows need the values) and encoded chunk by chunk. With ``lazy`` the chunks are
    produced as :meth:`EncodedWindow.iter_chunks` reads them; otherwise before returning.
    ``kept``: see :class:`EncodedWindow`.

    ``to_seq`` may equal ``from_seq`` (nothing new): the owed rows are still served.

    A base window (resync) is always complete: top-k and max_rows do not apply to it, and
    rows owed from the previous generation are dropped.

    With ``runs``, a window of many deltas is merged from a few pre-merged runs of them
    (:mod:`deltad.serve.index.runs`; bit-equal), so its cost does not grow with its segment count.
    With ``spill`` too, a base window starts from the spilled merged base
    (:mod:`deltad.serve.index.spill`), not from the base and every delta.
    """
    t0 = time.perf_counter()
    keys = [k for k in snap.base.shards if not spec.tables or k[0] in spec.tables]
    if spec.resync:
        owed = {}
    parts = window_parts(snap, spec, runs, spill)
    complete = spec.resync or (spec.form is not Form.TOPK and not spec.max_rows and not owed)
    with_values = spec.form is not Form.IDS or not complete
    new_owed = {k: v for k, v in owed.items() if k not in keys}
    # (rows, or None: merge its values later from ``by_key``), header line
    plan: list[tuple[ShardRows | None, ShardLine]] = []
    by_key: dict[ShardKey, list[ShardRows]] = {}
    sources: dict[int, _MergedShard] = {}
    idents: dict[int, encode.Identities] = {}
    held_state = [] if spec.resync else snap.upto(spec.from_seq)

    def identities(key: ShardKey, r: ShardRows) -> encode.Identities | None:
        """A managed-collision shard's identities in this window (admitted: FORM_IDS)."""
        if r.raw_ids is None:
            return None
        evicted = r.evicted if r.evicted is not None else torch.empty(0, dtype=torch.int64)
        admitted = admitted_raw_ids(r, key, held_state) if spec.form is Form.IDS else None
        return encode.Identities(r.raw_ids, evicted, admitted)

    wanted = set(keys)
    for part in parts:
        for key, c in part.items():
            if key in wanted:
                by_key.setdefault(key, []).append(c)
    if complete:
        for key in keys:
            cs = by_key.get(key)
            if cs is None:
                continue
            if len(cs) == 1 or not with_values:
                r = merge_rows(cs, with_values=with_values)
                idn = identities(key, r)
                if idn is not None:
                    idents[len(plan)] = idn
                plan.append((r, ShardLine(r.shard, r.ids.numel()).with_identities(idn)))
            else:  # the ids now (the count); the values range by range as chunks are encoded
                src = _MergedShard(cs)
                sources[len(plan)] = src
                idn = None
                if any(c.has_identities for c in cs):  # raw ids: one int64 per slot, merged now
                    idn = encode.Identities(*merge_identities(cs, src.ids))
                    idents[len(plan)] = idn
                line = ShardLine(cs[-1].shard, src.ids.numel()).with_identities(idn)
                plan.append((None, line))
    else:
        merged = {k: merge_rows(cs, with_values=with_values) for k, cs in by_key.items()}
        head_state = snap.upto(spec.to_seq)
        budget = spec.max_rows if spec.max_rows and not spec.resync else None
        for key in keys:
            m, o = merged.get(key), owed.get(key)
            if m is None and o is None:
                continue
            ws = plan_shard(
                key,
                m,
                o,
                head_state=head_state,
                held_state=held_state,
                form=spec.form,
                k=spec.k,
                fraction=spec.fraction,
                budget=budget,
            )
            n_owed = 0 if ws.owed is None else ws.owed.ids.numel()
            if ws.owed is not None and n_owed:
                new_owed[key] = ws.owed
            if budget is not None:
                # (re-identified slots may go beyond it: nothing is left for the rest)
                budget = max(0, budget - ws.rows.ids.numel())
            idn = identities(key, ws.rows)
            if idn is not None:
                idents[len(plan)] = idn
            line = ShardLine(ws.rows.shard, ws.rows.ids.numel(), n_owed).with_identities(idn)
            plan.append((ws.rows, line))
    dense = window_dense(snap, spec)
    bound = window_bound(spec, [m for _, m in plan], dense)
    win = EncodedWindow(
        _header(spec, to_step, plan, dense),
        spec.to_seq,
        to_step,
        sum(m.count for _, m in plan),
        new_owed,
        time.perf_counter() - t0,
        kept=kept,
    )
    win.bound = len(win.header) + bound

    def produce() -> Iterator[tuple[bytes | None, float]]:
        """(chunk, seconds spent on it), shard by shard."""
        t = time.perf_counter()
        for i, (r, m) in enumerate(plan):
            dtype = m.wire_dtype(spec.dtype)
            if r is None:
                chunks = sources[i].encode(
                    i, dtype, spec.chunk_bytes, spec.row_alignment, idents.get(i)
                )
            else:
                values = None if spec.form is Form.IDS else r.values
                chunks = encode.encode_shard_chunks(
                    i, r.ids, values, dtype, spec.chunk_bytes, spec.row_alignment, idents.get(i)
                )
            for msg in chunks:
                yield msg, time.perf_counter() - t
                t = time.perf_counter()
        if dense is not None:
            for msg in encode.encode_dense_chunks(dense.state, spec.chunk_bytes):
                yield msg, time.perf_counter() - t
                t = time.perf_counter()

    if lazy:
        return win.start(produce())
    out = []
    for msg, seconds in produce():
        win.merge_seconds += seconds
        if msg is not None:
            out.append(msg)
    return win.finish_with(out)


def window_parts(
    snap: LogSnapshot,
    spec: WindowSpec,
    runs: RunCache | None = None,
    spill: SpillStore | None = None,
) -> list[dict[ShardKey, ShardRows]]:
    """The chunks of the window ``spec`` over ``snap``, oldest first, as a list of parts (one
    per entry, or pre-merged runs of them from ``runs``): merged oldest first, they give the
    window. A resync window is the base and the deltas up to ``to_seq``; otherwise the entries
    holding segments in ``(from_seq, to_seq]`` (see :meth:`LogSnapshot.after`)."""
    entries = snap.entries
    if spec.resync:
        lo = 0
    else:
        lo = next((i for i, e in enumerate(entries) if e.seq > spec.from_seq), len(entries))
    hi = lo
    while hi < len(entries) and entries[hi].seq <= spec.to_seq:
        hi += 1
    head: list[dict[ShardKey, ShardRows]] = []
    if lo == 0 and hi > 1 and spill is not None and runs is not None:
        gen, deltas = snap.generation, entries[1:]
        direct = [entries[0].shards, *runs.window_parts(gen, deltas, 0, hi - 1)]
        if spill.only_when_merged and ranged(direct):
            return direct  # streamed range by range: one copy, no merge to save
        got = spill.base_parts(
            gen, entries, hi, lambda a, b: runs.window_parts(gen, deltas, a, b), ranged
        )
        if got is not None:
            return got
        return direct
    if lo == 0 and hi > 0:  # the base: whole, never part of a run
        head, lo = [entries[0].shards], 1
    if hi <= lo:
        return head
    if runs is None:
        return head + [e.shards for e in entries[lo:hi]]
    return head + runs.window_parts(snap.generation, entries[1:], lo - 1, hi - 1)


#: a complete window's shard is streamed range by range from at most this many parts whose
#: rows are at most this many times its union (else merged whole first: _MergedShard)
RANGED_MAX_PARTS = 8
RANGED_MAX_OVERLAP = 2
#: framing of one serialized RowChunk / DenseChunk message at most (tags and varints)
_CHUNK_FRAMING = 64


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


def ranged(parts: list[dict[ShardKey, ShardRows]]) -> bool:
    """Whether a base window of ``parts`` (the base first) is sure to stream range by range
    (:class:`_MergedShard` ``ranged``: few parts, little overlap) rather than merge whole
    shards first."""
    if len(parts) > RANGED_MAX_PARTS:
        return False
    for key, base in parts[0].items():
        total = sum(p[key].ids.numel() for p in parts if key in p)
        if total > RANGED_MAX_OVERLAP * base.ids.numel():  # (the union holds the base's ids)
            return False
    return True


def window_dense(snap: LogSnapshot, spec: WindowSpec) -> DenseEntry | None:
    """The dense state a window carries: with ``spec.dense``, the newest one taken at or before
    the head's segment, if the consumer does not hold it yet (it is newer than the cursor, or
    the window is a resync)."""
    if not spec.dense:
        return None
    d = snap.dense_at(spec.to_seq)
    if d is None or (not spec.resync and d.seq <= spec.from_seq):
        return None
    return d


def _rows(t: torch.Tensor) -> Any:
    """A contiguous [n, w] tensor as a numpy array of n opaque rows (a view, as in merge)."""
    raw = t.contiguous().view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, raw.shape[1]))).reshape(-1)


class _MergedShard:
    """A complete window's shard over several segments' parts (oldest first), merged RowChunk by
    RowChunk.

    Same rows and values as :func:`~deltad.serve.index.merge.merge_rows` (union of ids, latest
    value wins), but the values are never merged into one shard-sized tensor: each RowChunk's
    row range is assembled right before it is encoded, in the message itself (fp32), in a
    reused buffer (other wire dtypes), or taken as a view of the one part that holds all of
    it. Measured (1 GB fp32 window, base + 2 deltas, 2 cores): the whole-shard merge costs
    0.44 s before encoding; ranges cost <0.1 s.
    """

    def __init__(self, parts: list[ShardRows]) -> None:
        self.parts = parts
        self.row_start = min(c.shard.row_start for c in parts)
        n = max(c.shard.row_end for c in parts) - self.row_start
        # a part with every row of the shard (a base segment) makes the union trivial
        self.full = any(c.ids.numel() == n for c in parts)
        if self.full:
            self.ids = torch.arange(self.row_start, self.row_start + n, dtype=torch.int64)
        else:
            self.ids = merge_rows(parts, with_values=False).ids
        # Range by range writes every part's rows (oldest first) and loops over the parts
        # per range: heavy overlap or many segments take merge_rows (one merge, all threads).
        total = sum(c.ids.numel() for c in parts)
        self.ranged = (
            len(parts) <= RANGED_MAX_PARTS and total <= RANGED_MAX_OVERLAP * self.ids.numel()
        )

    def encode(
        self,
        index: int,
        dtype: WireDtype,
        chunk_bytes: int,
        alignment: int = 0,
        idn: encode.Identities | None = None,
    ) -> Iterator[bytes]:
        """The shard's RowChunk messages (``index`` in the header), in row order
        (``alignment``: of packed rows; ``idn``: a managed-collision shard's identities, see
        :func:`~deltad.serve.windows.encode.encode_shard_chunks`)."""
        ids, cs = self.ids, self.parts
        n = ids.numel()
        if n == 0:
            yield from encode.extra_identity_chunks(index, 0, idn, chunk_bytes)
            return
        if not self.ranged:
            m = merge_rows(cs)
            yield from encode.encode_shard_chunks(
                index, m.ids, m.values, dtype, chunk_bytes, alignment, idn
            )
            return
        last = cs[-1]
        width = last.shard.col_end - last.shard.col_start
        step = encode.rows_per_chunk(width, dtype, chunk_bytes, alignment, idn is not None)
        bounds = torch.arange(0, n + step, step).clamp_(max=n)
        dests, spans = [], []
        for c in cs:
            d = c.ids - self.row_start if self.full else torch.searchsorted(ids, c.ids)
            dests.append(d.numpy())
            spans.append(torch.searchsorted(d, bounds).tolist())
        # Messages are built in place (encode.ChunkMessage) for fp32 / fp16 / bf16: rows go
        # straight into the message when the segment dtype is the wire dtype (one copy in
        # all), else they are merged in ``buf`` and cast into it; int8 quantizes ``buf`` and
        # packed dtypes pack it.
        wire_torch = wire.WIRE_TORCH_DTYPE.get(dtype)
        direct = last.values.dtype == wire_torch
        buf = torch.empty(0 if direct else min(step, n), width, dtype=last.values.dtype)
        buf_rows = _rows(buf)
        src_rows = [_rows(c.values) for c in cs]
        row_bytes = width * last.values.element_size()
        wire_row_bytes = width * wire.WIRE_ITEMSIZE[dtype] if wire_torch is not None else 0
        for r in range(len(bounds) - 1):
            a, b = int(bounds[r]), int(bounds[r + 1])
            # the newest part holding every row of [a, b): older parts are overwritten by it
            first = 0
            for j in range(len(cs) - 1, -1, -1):
                lo, hi = spans[j][r], spans[j][r + 1]
                if hi - lo == b - a:
                    first = j
                    break
            later = [j for j in range(first + 1, len(cs)) if spans[j][r + 1] > spans[j][r]]
            lo, hi = spans[first][r], spans[first][r + 1]
            ev, ad = encode.identity_runs(idn, a, b)
            if hi - lo == b - a and not later:  # nothing newer in this range: a view
                vals = cs[first].values[lo:hi]
                yield encode.encode_rows(index, a, ids[a:b], vals, dtype, alignment, idn, ev, ad)
                continue
            msg = None
            if wire_torch is not None:
                msg = encode.ChunkMessage(
                    index,
                    a,
                    b - a,
                    (b - a) * wire_row_bytes,
                    raw_ids=idn is not None,
                    evicted=ev[1] - ev[0],
                    admitted=ad[1] - ad[0],
                )
                msg.ids[:] = ids[a:b].numpy()
                encode.put_identities(msg, idn, a, b, ev, ad)
            if direct:
                assert msg is not None
                out = msg.values.view(np.dtype((np.void, row_bytes)))
            else:
                out = buf_rows[: b - a]
            if hi - lo == b - a:
                out[:] = src_rows[first][lo:hi]
                todo = later
            else:  # no one part covers the range; together they cover every row of it
                todo = [j for j in range(len(cs)) if spans[j][r + 1] > spans[j][r]]
            for j in todo:
                lo, hi = spans[j][r], spans[j][r + 1]
                out[dests[j][lo:hi] - a] = src_rows[j][lo:hi]
            del out
            if msg is None:  # int8, packed: quantize / pack the merged rows
                yield encode.encode_rows(
                    index, a, ids[a:b], buf[: b - a], dtype, alignment, idn, ev, ad
                )
                continue
            if not direct:  # cast the merged rows into the message
                assert wire_torch is not None
                into = torch.from_numpy(msg.values).view(wire_torch).view(b - a, width)
                into.copy_(buf[: b - a])
                del into
            yield msg.data
        yield from encode.extra_identity_chunks(index, n, idn, chunk_bytes)


class WindowCache:
    """LRU of encoded windows under a byte budget that holds the windows being streamed too;
    concurrent requests for one window build it once.

    A window being built is shared: the first request plans it and streams it while the
    producer fills it; requests arriving meanwhile read along (waiting for chunks not yet
    produced). Such a live window's bytes are reserved in the budget from the start (its
    :attr:`EncodedWindow.bound`, known once planned), evicting older cached windows if need
    be; a finished one stays in the LRU. A window that does not fit (bigger than the budget,
    or the budget is taken by live windows) is streamed without being kept: its one reader
    produces each chunk and drops it once sent, and nobody else shares it. So the cached
    and live windows' bytes (:attr:`nbytes`) never exceed ``max_bytes``.
    """

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[WindowSpec, EncodedWindow] = OrderedDict()
        self._lru_bytes = 0
        self._live: dict[WindowSpec, EncodedWindow] = {}
        self._reserved = 0
        self._held: dict[int, int] = {}  # id(live window) -> bytes reserved for it
        self._building: dict[WindowSpec, threading.Lock] = {}
        self.hits = 0
        #: windows streamed without being kept (did not fit), and the most bytes held at once
        self.unkept = 0
        self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the cached windows plus those reserved for live (kept) ones."""
        return self._lru_bytes + self._reserved

    def _lookup(self, spec: WindowSpec) -> EncodedWindow | None:
        hit = self._lru.get(spec)
        if hit is not None:
            self._lru.move_to_end(spec)
        else:
            hit = self._live.get(spec)
        if hit is not None:
            self.hits += 1
        return hit

    def hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` kept outside the LRU (cached generation diffs) against the budget,
        evicting older cached windows for room; False (nothing held) if they do not fit."""
        with self._lock:
            if nbytes > self.max_bytes or not self._evict(nbytes):
                return False
            self._reserved += nbytes
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
            return True

    def release(self, nbytes: int) -> None:
        """Give back bytes taken by :meth:`hold`."""
        with self._lock:
            self._reserved -= nbytes

    def _evict(self, need: int) -> bool:
        """Drop the oldest cached windows until ``need`` more bytes fit (lock held)."""
        while self._lru and self._lru_bytes + self._reserved + need > self.max_bytes:
            _, old = self._lru.popitem(last=False)
            self._lru_bytes -= old.nbytes
        return self._lru_bytes + self._reserved + need <= self.max_bytes

    def get(
        self, spec: WindowSpec, build: Callable[[bool], EncodedWindow]
    ) -> tuple[EncodedWindow, bool]:
        """The window for ``spec`` and whether it came from the cache.

        ``build(kept)`` plans the window (see :func:`build_window`); ``kept`` is False when
        the cache is off (the one reader may drop chunks as it streams them).
        """
        if self.entries <= 0:
            return build(False), False
        with self._lock:
            hit = self._lookup(spec)
            if hit is not None:
                return hit, True
            gate = self._building.setdefault(spec, threading.Lock())
        with gate:  # a second caller waits here while the first one plans
            with self._lock:
                hit = self._lookup(spec)
                if hit is not None:
                    return hit, True
            try:
                win = build(True)
                with self._lock:
                    need = win.bound or 0
                    if need <= self.max_bytes and self._evict(need):
                        self._live[spec] = win
                        self._reserved += need
                        self._held[id(win)] = need
                        self.peak_bytes = max(self.peak_bytes, self.nbytes)
                    else:  # streamed by its one reader, chunks dropped as they are sent
                        win.kept = False
                        self.unkept += 1
            finally:
                with self._lock:
                    self._building.pop(spec, None)
        if win.kept:
            win.on_done(lambda w: self._done(spec, w))
        return win, False

    def abandon(self, spec: WindowSpec, win: EncodedWindow) -> None:
        """The caller that built ``win`` will not read it (its pull failed first): release
        its reservation unless somebody else reads it already (then it completes normally)."""
        with self._lock:
            if self._live.get(spec) is not win or win.done or win._readers:
                return
            del self._live[spec]
            self._reserved -= self._held.pop(id(win), 0)

    def _done(self, spec: WindowSpec, win: EncodedWindow) -> None:
        with self._lock:
            if self._live.get(spec) is win:
                del self._live[spec]
            held = self._held.pop(id(win), None)
            if held is None:  # abandoned: neither reserved nor cached any more
                return
            self._reserved -= held
            if win.bound is not None and win.nbytes > win.bound:  # a bug: it must hold
                log.error("window of %d bytes over its bound %d", win.nbytes, win.bound)
            if win.failed or win.nbytes > self.max_bytes or not self._evict(win.nbytes):
                return
            self._lru[spec] = win
            self._lru_bytes += win.nbytes
            while len(self._lru) > self.entries:
                _, old = self._lru.popitem(last=False)
                self._lru_bytes -= old.nbytes
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
