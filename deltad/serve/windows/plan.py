"""Plan a window (parts, header lines, owed rows, top-k); its chunks are produced as read."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogSnapshot
from deltad.serve.index.merge import (
    admitted_raw_ids,
    merge_identities,
    merge_rows,
    plan_shard,
)
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.windows import encode
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.header import ShardLine, window_bound, window_header
from deltad.serve.windows.merged import MergedShard
from deltad.serve.windows.packed import PackedStore
from deltad.serve.windows.parts import window_dense, window_parts
from deltad.serve.windows.spec import WindowSpec
from deltad.types import Form, ShardKey


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
    packed: PackedStore | None = None,
) -> EncodedWindow:
    """Plan the window ``spec`` over ``snap`` for a consumer owed ``owed``; merge and encode it.

    Returns once the header (every shard's row count) and the owed rows are known, so that
    streaming starts at once. A complete window (no top-k, row budget or owed rows) is planned
    from the union of its ids alone, and each RowChunk's rows are merged right before it is
    encoded (:class:`~deltad.serve.windows.merged.MergedShard`); otherwise every shard is merged
    and planned first (top-k and owed rows need the values) and encoded chunk by chunk. With
    ``lazy`` the chunks are produced as :meth:`EncodedWindow.iter_chunks` reads them; otherwise
    before returning.
    ``kept``: see :class:`EncodedWindow`.

    ``to_seq`` may equal ``from_seq`` (nothing new): the owed rows are still served.

    A base window (resync) is always complete: top-k and max_rows do not apply to it, and
    rows owed from the previous generation are dropped.

    With ``runs``, a window of many deltas is merged from a few pre-merged runs of them
    (:mod:`deltad.serve.index.runs`; bit-equal), so its cost does not grow with its segment count.
    With ``spill`` too, a base window starts from the spilled merged base
    (:mod:`deltad.serve.index.spill`), not from the base and every delta. With ``packed``,
    packed dtypes copy the parts' rows packed once (:mod:`deltad.serve.windows.packed`)
    instead of packing them for this window.
    """
    t0, cpu0 = time.perf_counter(), time.thread_time()
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
    sources: dict[int, MergedShard] = {}
    whole: set[int] = set()  # plan lines whose rows are one part's, as they are in the log
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
                whole.add(len(plan))
                idn = identities(key, r)
                if idn is not None:
                    idents[len(plan)] = idn
                plan.append((r, ShardLine(r.shard, r.ids.numel()).with_identities(idn)))
            else:  # the ids now (the count); the values range by range as chunks are encoded
                src = MergedShard(cs)
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
        window_header(spec, to_step, plan, dense),
        spec.to_seq,
        to_step,
        sum(m.count for _, m in plan),
        new_owed,
        time.perf_counter() - t0,
        kept=kept,
    )
    win.bound = len(win.header) + bound
    win.build_cpu_seconds = time.thread_time() - cpu0  # the plan: ids merged, header

    def produce() -> Iterator[tuple[bytes | None, float]]:
        """(chunk, seconds spent on it), shard by shard; the building thread's CPU time for
        each chunk goes to ``win.build_cpu_seconds`` (whichever thread resumes it)."""
        t = time.perf_counter()
        cpu = time.thread_time()
        for i, (r, m) in enumerate(plan):
            dtype = m.wire_dtype(spec.dtype)
            rows = None
            packable = r is not None and i in whole and i not in idents and with_values
            if packable and r is not None and packed is not None:
                rows = packed.rows(r, dtype, spec.row_alignment)
            skip = win.skip
            if r is None:
                chunks = sources[i].encode(
                    i, dtype, spec.chunk_bytes, spec.row_alignment, idents.get(i), packed=packed,
                    skip=skip,
                )  # fmt: skip
            elif rows is not None:
                chunks = encode.encode_packed_chunks(i, r.ids, rows, spec.chunk_bytes, skip)
            else:
                values = None if spec.form is Form.IDS else r.values
                chunks = encode.encode_shard_chunks(
                    i, r.ids, values, dtype, spec.chunk_bytes, spec.row_alignment, idents.get(i),
                    skip,
                )  # fmt: skip
            for msg in chunks:
                win.build_cpu_seconds += time.thread_time() - cpu
                yield msg, time.perf_counter() - t
                t, cpu = time.perf_counter(), time.thread_time()
        if dense is not None:
            for msg in encode.encode_dense_chunks(dense.state, spec.chunk_bytes, win.skip):
                win.build_cpu_seconds += time.thread_time() - cpu
                yield msg, time.perf_counter() - t
                t, cpu = time.perf_counter(), time.thread_time()

    if lazy:
        return win.start(produce())
    out = []
    for msg, seconds in produce():
        win.merge_seconds += seconds
        if msg is not None:
            out.append(msg)
    return win.finish_with(out)
