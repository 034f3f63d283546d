"""State diffs: a window of the rows that differ bit-exactly between a held state and the head."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from deltad import wire
from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogSnapshot
from deltad.serve.index.merge import merge_rows
from deltad.serve.windows import encode
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.header import ShardLine
from deltad.serve.windows.parts import window_dense, window_parts
from deltad.serve.windows.spec import WindowSpec
from deltad.types import EMPTY_RAW_ID, Form, ShardKey
from deltad.v1 import delta_pb2 as pb

#: Rows compared per step (bounds the comparison's temporary memory).
COMPARE_ROWS = 1 << 16


class Incompatible(Exception):
    """The two states' tables or shards differ: no diff (the message says how)."""


def _bits(values: torch.Tensor) -> torch.Tensor:
    """``values`` as integers of the same width (a bit-exact comparison: -0.0 != 0.0, NaN of
    one payload == itself)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return values.contiguous().view(ints[values.element_size()])


def diff_rows(old: ShardRows, new: ShardRows, owed: ShardRows | None = None) -> ShardRows:
    """The rows of ``new`` whose values differ bit-exactly from ``old``'s, and the rows of
    ``owed`` (the consumer's values for them are stale); ids ascending. Both states must hold
    the same row ids (:class:`Incompatible` otherwise)."""
    if not torch.equal(old.ids, new.ids):
        raise Incompatible(f"rows of {new.shard.table} held differ between the generations")
    n = new.ids.numel()
    changed = torch.zeros(n, dtype=torch.bool)
    a, b = _bits(old.values), _bits(new.values)
    for lo in range(0, n, COMPARE_ROWS):
        hi = min(n, lo + COMPARE_ROWS)
        changed[lo:hi] = (a[lo:hi] != b[lo:hi]).any(dim=1)
    if old.raw_ids is not None and new.raw_ids is not None:
        changed |= old.raw_ids != new.raw_ids  # re-identified, even with an equal row
    if owed is not None and owed.ids.numel():
        at = torch.searchsorted(new.ids, owed.ids).clamp_(max=max(n - 1, 0))
        hit = new.ids[at] == owed.ids if n else torch.zeros(0, dtype=torch.bool)
        changed[at[hit]] = True
    idx = changed.nonzero().squeeze(1)
    if new.raw_ids is None:
        return new.with_rows(new.ids[idx], new.values[idx])
    # evicted: the raw ids the consumer's map holds and the new one does not
    held = torch.unique(old.raw_ids) if old.raw_ids is not None else new.raw_ids[:0]
    evicted = held[~torch.isin(held, new.raw_ids) & (held != EMPTY_RAW_ID)]
    return new.with_rows(new.ids[idx], new.values[idx], new.raw_ids[idx], evicted)


def diff_identities(old: ShardRows, rows: ShardRows, form: Form) -> encode.Identities | None:
    """The identities a diff's rows of a managed-collision shard carry (admitted: FORM_IDS,
    the raw ids of its slots that held another raw id in ``old``)."""
    if rows.raw_ids is None or rows.evicted is None:
        return None
    admitted = None
    if form is Form.IDS:
        was = (
            old.raw_ids[torch.searchsorted(old.ids, rows.ids)]
            if old.raw_ids is not None and rows.ids.numel()
            else torch.full_like(rows.raw_ids, EMPTY_RAW_ID)
        )
        new = rows.raw_ids[(rows.raw_ids != was) & (rows.raw_ids != EMPTY_RAW_ID)]
        admitted = torch.unique(new)
    return encode.Identities(rows.raw_ids, rows.evicted, admitted)


def _state(parts: list[dict[ShardKey, ShardRows]], key: ShardKey) -> ShardRows | None:
    cs = [p[key] for p in parts if key in p]
    return merge_rows(cs) if cs else None


def state_diff_window(
    old_parts: list[dict[ShardKey, ShardRows]],
    snap: LogSnapshot,
    spec: WindowSpec,
    to_step: int,
    owed: dict[ShardKey, ShardRows],
    **header_fields: int,
) -> EncodedWindow:
    """The window that takes a consumer holding the state of ``old_parts`` (oldest first; the
    base first) and owed ``owed`` to the state of ``snap`` at ``spec.to_seq``: every row that
    differs bit-exactly, complete in every form, with the dense state at ``to_seq`` when
    asked for. ``header_fields``: set on the DeltaHeader (what kind of diff it is: a
    generation diff, a rollback). Raises :class:`Incompatible`."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    full = replace(spec, resync=True, from_seq=-1)
    new_parts = window_parts(snap, full)
    keys = [k for k in snap.base.shards if not spec.tables or k[0] in spec.tables]
    plan: list[ShardRows] = []
    idents: list[encode.Identities | None] = []
    for key in keys:
        new, prev = _state(new_parts, key), _state(old_parts, key)
        if new is None or prev is None:
            raise Incompatible(f"no state of {key[0]} in one of the generations")
        if new.has_identities != prev.has_identities:
            raise Incompatible(f"{key[0]} is managed-collision in one generation only")
        r = diff_rows(prev, new, owed.get(key))
        plan.append(r)
        idents.append(diff_identities(prev, r, spec.form))
    dense = window_dense(snap, full)
    header = pb.DeltaHeader(
        rank=spec.rank,
        generation=snap.generation,
        resync=False,
        from_seq=spec.from_seq,
        to_seq=spec.to_seq,
        to_step=to_step,
        form=wire.form_to_pb(spec.form),
        dtype=wire.dtype_to_pb(spec.dtype),
        row_alignment=spec.row_alignment if spec.dtype.packed else 0,
    )
    for name, value in header_fields.items():
        setattr(header, name, value)
    if dense is not None:
        header.dense.seq, header.dense.step = dense.seq, dense.step
        for t in dense.state.header.tensors:
            header.dense.tensors.add(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
    with_values = spec.form is not Form.IDS
    for r, idn in zip(plan, idents, strict=True):
        s = r.shard
        line = pb.TableSlice(
            table=s.table, num_rows=s.num_rows, dim=s.dim, col_start=s.col_start,
            col_end=s.col_end, count=r.ids.numel(),
        )  # fmt: skip
        if idn is not None:
            line.identities = True
            line.evicted_count = idn.evicted.numel()
            line.admitted_count = 0 if idn.admitted is None else idn.admitted.numel()
        if with_values and spec.dtype.packed:
            dtype = ShardLine(s, 0).wire_dtype(spec.dtype)
            if dtype.packed:
                line.row_bytes = wire.packed_row_bytes(s.dim, dtype, spec.row_alignment)
            else:
                line.dtype = wire.dtype_to_pb(dtype)
        header.slices.append(line)

    def chunks() -> Iterator[bytes]:
        for i, r in enumerate(plan):
            dtype = ShardLine(r.shard, 0).wire_dtype(spec.dtype)
            values = r.values if with_values else None
            yield from encode.encode_shard_chunks(
                i, r.ids, values, dtype, spec.chunk_bytes, spec.row_alignment, idents[i]
            )
        if dense is not None:
            yield from encode.encode_dense_chunks(dense.state, spec.chunk_bytes)

    rows = sum(r.ids.numel() for r in plan)
    out = list(chunks())
    win = EncodedWindow(
        encode.encode_header(header), spec.to_seq, to_step, rows, {}, time.perf_counter() - t0
    )
    win.build_cpu_seconds = time.thread_time() - cpu0  # built here, whole
    return win.finish_with(out)
