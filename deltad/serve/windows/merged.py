"""A complete window's shard merged range by range, each RowChunk right before it is encoded."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from deltad import wire
from deltad.segment.format import ShardRows
from deltad.serve.index.merge import merge_rows
from deltad.serve.windows import encode
from deltad.serve.windows.encode import Identities, Skip
from deltad.serve.windows.packed import PackedStore
from deltad.types import ShardKey, WireDtype

#: a base window of at most this many parts whose rows are at most this many times its union
#: streams range by range at about the cost of one copy: a spilled merged base would save
#: nothing (:func:`ranged`)
RANGED_MAX_PARTS = 8
RANGED_MAX_OVERLAP = 2
#: a complete window's shard streams range by range (:class:`MergedShard`) unless its ranges
#: x parts exceed this (each visit is a Python step); beyond it, it is merged whole first
STREAM_MAX_VISITS = 50_000


def ranged(parts: list[dict[ShardKey, ShardRows]]) -> bool:
    """Whether a base window of ``parts`` (the base first) streams at about the cost of one
    copy (few parts, little overlap: :class:`MergedShard` writes few rows twice), so that a
    spilled merged base would save nothing."""
    if len(parts) > RANGED_MAX_PARTS:
        return False
    for key, base in parts[0].items():
        total = sum(p[key].ids.numel() for p in parts if key in p)
        if total > RANGED_MAX_OVERLAP * base.ids.numel():  # (the union holds the base's ids)
            return False
    return True


def _on_host(ids: torch.Tensor, *parts: ShardRows) -> bool:
    """Whether ``ids`` and every part's values are contiguous in host memory (then rows are
    copied from their addresses)."""
    tensors = (ids, *(c.values for c in parts))
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def _rows(t: torch.Tensor) -> Any:
    """A contiguous [n, w] tensor as a numpy array of n opaque rows (a view, as in merge)."""
    raw = t.contiguous().view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, raw.shape[1]))).reshape(-1)


class MergedShard:
    """A complete window's shard over several segments' parts (oldest first), merged RowChunk by
    RowChunk.

    Same rows and values as :func:`~deltad.serve.index.merge.merge_rows` (union of ids, latest
    value wins), but the values are never merged into one shard-sized tensor: each RowChunk's
    row range is assembled right before it is encoded, in the message itself (fp32), in a
    reused buffer (other wire dtypes), or taken as a view of the one part that holds all of
    it. Measured (1 GB fp32 window, base + 2 deltas, 2 cores): the whole-shard merge costs
    0.44 s before encoding; ranges cost <0.1 s. Many parts or heavy overlap stream too: each
    range takes every part's rows for it, oldest first, the same copies a whole merge makes
    without its shard-sized output and second pass (measured, 264 MB fp32 shard, 2 cores,
    CPU-ms merged whole / ranged: base + 16 deltas of 1 % 105-248 / 50-66, + 64 of 1 %
    159-283 / 92-94, + 16 of 30 % 405-1301 / 206-230); only a window of more than
    :data:`STREAM_MAX_VISITS` ranges x parts is merged whole (all threads).
    """

    def __init__(self, parts: list[ShardRows]) -> None:
        self.parts = parts
        self.row_start = min(c.shard.row_start for c in parts)
        n = max(c.shard.row_end for c in parts) - self.row_start
        # a part with every row of the shard (a base segment) makes the union trivial
        whole = [c for c in parts if c.ids.numel() == n]
        self.full = bool(whole)
        if whole:  # its ids (unique, ascending, n of them) are row_start, row_start + 1, ...
            self.ids = whole[-1].ids
        else:
            self.ids = merge_rows(parts, with_values=False).ids
        #: None: stream range by range unless :meth:`merges_whole`; True / False force it
        self.ranged: bool | None = None

    def merges_whole(self, step: int) -> bool:
        """Whether :meth:`encode` merges the shard whole first with RowChunks of ``step`` rows:
        more than :data:`STREAM_MAX_VISITS` ranges x parts (or ``ranged`` set False)."""
        if self.ranged is not None:
            return not self.ranged
        return -(-self.ids.numel() // max(1, step)) * len(self.parts) > STREAM_MAX_VISITS

    def encode(
        self,
        index: int,
        dtype: WireDtype,
        chunk_bytes: int,
        alignment: int = 0,
        idn: encode.Identities | None = None,
        *,
        packed: PackedStore | None = None,
        skip: Skip | None = None,
    ) -> Iterator[bytes]:
        """The shard's RowChunk messages (``index`` in the header), in row order
        (``alignment``: of packed rows; ``idn``: a managed-collision shard's identities, see
        :func:`~deltad.serve.windows.encode.encode_shard_chunks`; ``packed``: where the parts'
        packed rows are kept, used for shards without identities; ``skip``: the first
        messages left out unbuilt, see :class:`~deltad.serve.windows.encode.Skip`)."""
        ids, cs = self.ids, self.parts
        n = ids.numel()
        if n == 0:
            yield from encode.extra_identity_chunks(index, 0, idn, chunk_bytes, skip)
            return
        prows = None if idn is not None else self._packed_parts(packed, dtype, alignment)
        last = cs[-1]
        width = last.shard.col_end - last.shard.col_start
        step = encode.rows_per_chunk(width, dtype, chunk_bytes, alignment, idn is not None)
        if self.merges_whole(step):
            if prows is not None:  # merged packed: the bytes of packing the merged rows
                m = merge_rows(prows)
                yield from encode.encode_packed_chunks(index, m.ids, m.values, chunk_bytes, skip)
                return
            m = merge_rows(cs)
            yield from encode.encode_shard_chunks(
                index, m.ids, m.values, dtype, chunk_bytes, alignment, idn, skip
            )
            return
        if prows is not None:  # rows packed once: merged as opaque rows, like fp32 ones
            yield from self._ranged(index, ids, prows, step, None, skip=skip)
            return
        yield from self._ranged(index, ids, cs, step, dtype, alignment, idn, skip)
        yield from encode.extra_identity_chunks(index, n, idn, chunk_bytes, skip)

    def _packed_parts(
        self, packed: PackedStore | None, dtype: WireDtype, alignment: int
    ) -> list[ShardRows] | None:
        """The parts with their rows packed in ``dtype`` (uint8 rows, under a shard whose
        columns are the packed row's bytes), or None if any of them is not in ``packed``."""
        if packed is None or not dtype.packed:
            return None
        got = packed.rows_of(self.parts, dtype, alignment)  # all of the shard's parts, or none
        if got is None:
            return None
        out = []
        for c, rows in zip(self.parts, got, strict=True):
            shard = replace(c.shard, col_start=0, col_end=rows.shape[1])
            out.append(ShardRows(shard, c.ids, rows))
        return out

    def _ranged(
        self,
        index: int,
        ids: torch.Tensor,
        cs: list[ShardRows],
        step: int,
        dtype: WireDtype | None,
        alignment: int = 0,
        idn: Identities | None = None,
        skip: Skip | None = None,
    ) -> Iterator[bytes]:
        """RowChunks of ``step`` rows, each range merged from ``cs`` right before it is
        encoded; ``dtype`` None: the parts' values are the wire's bytes already (packed, no
        identities); ``idn``, ``skip``: see :meth:`encode`."""
        n = ids.numel()
        last = cs[-1]
        width = last.shard.col_end - last.shard.col_start
        bounds = torch.arange(0, n + step, step).clamp_(max=n)
        dests: list[Any] = []
        spans: list[list[int]] = []
        for c in cs:
            if self.full and c.ids.numel() == n:
                # every row of the shard, row for row: its span of a range is the range; it
                # covers every range, so it is never scattered (no dests: a pass over n ids
                # saved, ~15 % of a packed window's CPU)
                dests.append(None)
                spans.append(bounds.tolist())
                continue
            if self.full:
                d = c.ids - self.row_start if self.row_start else c.ids
            else:
                d = torch.searchsorted(ids, c.ids)
            dests.append(d.numpy())
            spans.append(torch.searchsorted(d, bounds).tolist())
        # Messages are built in place (encode.ChunkMessage) for fp32 / fp16 / bf16: rows go
        # straight into the message when the segment dtype is the wire dtype (one copy in
        # all), else they are merged in ``buf`` and cast into it; int8 quantizes ``buf`` and
        # packed dtypes pack it.
        wire_torch = last.values.dtype if dtype is None else wire.WIRE_TORCH_DTYPE.get(dtype)
        direct = last.values.dtype == wire_torch
        buf = torch.empty(0 if direct else min(step, n), width, dtype=last.values.dtype)
        buf_rows = _rows(buf)
        src_rows = [_rows(c.values) for c in cs]
        row_bytes = width * last.values.element_size()
        wire_row_bytes = 0
        if wire_torch is not None:
            wire_row_bytes = row_bytes if dtype is None else width * wire.WIRE_ITEMSIZE[dtype]
        cuts: list[int] = bounds.tolist()
        # rows sent as they are, no identities: messages framed once per count and filled
        # from addresses (encode.RowFraming), no ChunkMessage or tensor slice per message
        framing = None
        if direct and idn is None and ids.dtype == torch.int64 and _on_host(ids, *cs):
            framing = encode.RowFraming(index, row_bytes)
            ids_at = ids.data_ptr()
            values_at = [c.values.data_ptr() for c in cs]
        for r in range(len(cuts) - 1):
            if encode.skips(skip):
                continue
            a, b = cuts[r], cuts[r + 1]
            # the newest part holding every row of [a, b): older parts are overwritten by it
            first = 0
            for j in range(len(cs) - 1, -1, -1):
                lo, hi = spans[j][r], spans[j][r + 1]
                if hi - lo == b - a:
                    first = j
                    break
            later = [j for j in range(first + 1, len(cs)) if spans[j][r + 1] > spans[j][r]]
            lo, hi = spans[first][r], spans[first][r + 1]
            if framing is not None:
                data, i_at, v_at = framing.new(a, b - a)
                encode.put(data, i_at, ids_at + a * 8, (b - a) * 8)
                if hi - lo == b - a:
                    encode.put(data, v_at, values_at[first] + lo * row_bytes, (hi - lo) * row_bytes)
                    todo = later
                else:  # no one part covers the range; together they cover every row of it
                    todo = [j for j in range(len(cs)) if spans[j][r + 1] > spans[j][r]]
                if todo and row_bytes:
                    rows = encode.writable(data, v_at, (b - a) * row_bytes).view(src_rows[0].dtype)
                    for j in todo:
                        lo, hi = spans[j][r], spans[j][r + 1]
                        rows[dests[j][lo:hi] - a] = src_rows[j][lo:hi]
                    del rows
                yield data
                continue
            ev, ad = encode.identity_runs(idn, a, b)
            if hi - lo == b - a and not later and not direct:
                # nothing newer, rows to cast / quantize / pack: encoded from a view (rows
                # already in the wire's dtype, packed ones too, take the one copy below)
                assert dtype is not None
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
                msg.fill("ids", ids, a, b - a)
                encode.put_identities(msg, idn, a, b, ev, ad)
            out: Any = None if direct else buf_rows[: b - a]
            if hi - lo == b - a:
                if direct:  # one flat byte copy into the message (ChunkMessage.fill)
                    assert msg is not None
                    msg.fill("values", cs[first].values, lo, hi - lo)
                else:
                    out[:] = src_rows[first][lo:hi]
                todo = later
            else:  # no one part covers the range; together they cover every row of it
                todo = [j for j in range(len(cs)) if spans[j][r + 1] > spans[j][r]]
            if todo and out is None:  # rows scattered into the message: a view of its values
                assert msg is not None
                out = msg.values.view(np.dtype((np.void, row_bytes)))
            for j in todo:
                lo, hi = spans[j][r], spans[j][r + 1]
                out[dests[j][lo:hi] - a] = src_rows[j][lo:hi]
            del out
            if msg is None:  # int8, packed: quantize / pack the merged rows
                assert dtype is not None
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
