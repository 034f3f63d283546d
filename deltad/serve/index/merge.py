"""Window merge (union of ids, latest value wins), value lookup at a cursor, top-k with owed rows;
a managed-collision shard's identities (raw ids, evicted) merge with its rows.

The merge of one table shard over several segments uses a mark array over the shard's row
range instead of ``torch.unique``: every segment's ids are unique, sorted and inside the
shard's ``[row_start, row_end)``, so marking ``id - row_start`` and taking the nonzero entries
yields the sorted union in O(ids + shard rows); each segment's rows are then copied into place
oldest first, so the latest value wins. Sparse windows (ids << shard rows) sort instead.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogEntry
from deltad.types import EMPTY_RAW_ID, Form, ShardKey


def merge_rows(
    parts: Sequence[ShardRows], *, with_values: bool = True, out: torch.Tensor | None = None
) -> ShardRows:
    """Latest-value merge of one shard's parts (its rows in each segment), oldest first
    (views when only one). ``out``: the values go there (``[rows of the union, width]``, e.g.
    a mapped file) instead of a new tensor.

    A managed-collision shard's identities merge too (:func:`merge_identities`): each slot
    keeps its newest raw id, and the evicted raw ids are the union of the parts' minus those
    a slot holds at the end (also without values: the ids form reports them)."""
    merged = _merge_rows(parts, with_values=with_values, out=out)
    if len(parts) == 1 or not any(c.has_identities for c in parts):
        return merged
    raw_ids, evicted = merge_identities(parts, merged.ids)
    return merged.with_rows(merged.ids, merged.values, raw_ids, evicted)


def merge_identities(
    parts: Sequence[ShardRows], ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw id of each of ``ids`` — the union of the parts' slots — from the newest part that
    lists it; evicted raw ids: the union of the parts' minus the raw ids held at the end,
    ascending). Parts without identities (none in a verified log) contribute none.

    "Held at the end" is checked against the slots the parts after the first list, not the
    whole map: a raw id evicted in part ``j`` (held by no slot then) that a slot holds at the
    end was admitted by a later part, which lists that slot. Only the (delta-sized) evicted
    candidates are sorted, and those raw ids are searched into them (measured: ``torch.isin``
    against a 1 M-slot map took seconds here).
    """
    n = ids.numel()
    raw = torch.full((n,), EMPTY_RAW_ID, dtype=torch.int64)
    # a union that is a whole row range (a base is in it): a slot's place is its offset
    dense = n > 0 and int(ids[-1]) - int(ids[0]) + 1 == n
    later = torch.zeros(n, dtype=torch.bool)  # slots listed by a part after the first
    for i, c in enumerate(parts):
        if c.raw_ids is None or c.ids.numel() == 0:
            continue
        if c.ids.numel() == n:  # every slot of the union (a base): row for row
            raw.copy_(c.raw_ids)
            if i:
                later[:] = True
            continue
        at = c.ids - int(ids[0]) if dense else torch.searchsorted(ids, c.ids)
        raw[at] = c.raw_ids
        if i:
            later[at] = True
    gone = [c.evicted.numpy() for c in parts if c.evicted is not None and c.evicted.numel()]
    if not gone:
        return raw, torch.empty(0, dtype=torch.int64)
    cand = np.unique(np.concatenate(gone)) if len(gone) > 1 else gone[0]
    held = raw[later].numpy()
    if held.size:  # drop the candidates a later-listed slot holds (sorted: search into them)
        at_np = np.searchsorted(cand, held).clip(max=len(cand) - 1)
        keep = np.ones(len(cand), dtype=bool)
        keep[at_np[cand[at_np] == held]] = False
        cand = cand[keep]
    return raw, torch.from_numpy(np.ascontiguousarray(cand, dtype=np.int64)).clone()


def _merge_rows(
    parts: Sequence[ShardRows], *, with_values: bool = True, out: torch.Tensor | None = None
) -> ShardRows:
    last = parts[-1]
    if len(parts) == 1:
        if out is not None:
            out.copy_(last.values)
            return last.with_rows(last.ids, out, last.raw_ids, last.evicted)
        return last.with_rows(last.ids, last.values, last.raw_ids, last.evicted)
    row_start = min(c.shard.row_start for c in parts)
    n = max(c.shard.row_end for c in parts) - row_start
    total = sum(c.ids.numel() for c in parts)
    width = last.shard.col_end - last.shard.col_start
    if total * 4 < n or len(parts) >= 32000:
        # sparse window: sorting its few ids beats a pass over the whole shard
        ids = torch.unique(torch.cat([c.ids for c in parts]))
        if not with_values:
            return last.with_rows(ids, last.values[:0])
        values = _values_out(out, ids.numel(), width, last.values.dtype)
        rows = _rows(values)
        for c in parts:
            if c.ids.numel():
                rows[torch.searchsorted(ids, c.ids).numpy()] = _rows(c.values)
        return last.with_rows(ids, values)
    slot_dtype = torch.int32 if n < 2**31 else torch.int64
    if any(c.ids.numel() == n for c in parts):
        # a part holds every row of the range (a base): the union is all of it, no marks
        # (measured: 0.16 s of marks and nonzero over a 128 MB base saved)
        ids = torch.arange(row_start, row_start + n, dtype=torch.int64)
        if not with_values:
            return last.with_rows(ids, last.values[:0])
        values = _values_out(out, n, width, last.values.dtype)
        if values.numel() == 0:
            return last.with_rows(ids, values)
        slot = torch.arange(n, dtype=slot_dtype)
        _copy_oldest_first(parts, row_start, ids, slot, values, parallel=total >= PARALLEL_MIN_IDS)
        return last.with_rows(ids, values)
    touched = torch.zeros(n, dtype=torch.bool)
    for c in parts:
        touched[c.ids - row_start if row_start else c.ids] = True
    local = touched.nonzero().squeeze(1)
    ids = local + row_start if row_start else local
    if not with_values:
        return last.with_rows(ids, last.values[:0])
    values = _values_out(out, ids.numel(), width, last.values.dtype)
    if values.numel() == 0:
        return last.with_rows(ids, values)
    # slot[row] = position of the row in ``ids``: a running count of the marks (one pass;
    # int32 where it fits: half the bytes of int64, 0.065 -> 0.035 s over 10 M rows).
    slot = torch.cumsum(touched, 0, dtype=slot_dtype).sub_(1)
    _copy_oldest_first(parts, row_start, ids, slot, values, parallel=total >= PARALLEL_MIN_IDS)
    return last.with_rows(ids, values)


def _values_out(out: torch.Tensor | None, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(n, width, dtype=dtype)
    if tuple(out.shape) != (n, width) or out.dtype != dtype:
        raise ValueError(f"merge output {tuple(out.shape)} {out.dtype} != ({n}, {width}) {dtype}")
    return out


#: below this many ids a merge copies in the calling thread (a thread hop costs more)
PARALLEL_MIN_IDS = 200_000
#: output bytes per block of the row copies (a few blocks stay in a shared L3 cache)
BLOCK_BYTES = 4 << 20
#: cap on blocks x parts per merge (each visit is a Python step)
MAX_BLOCK_VISITS = 100_000
#: merge threads (0 = one per usable core, at most 4); tests set it
MERGE_THREADS = int(os.environ.get("DELTAD_MERGE_THREADS", "0") or 0)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _workers() -> int:
    """Threads for a merge's row copies: the cores this process may use, at most 4 (its own
    threads, not torch's intra-op pool, which the sidecar keeps at one: deltad.perf)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, MERGE_THREADS or cores))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="deltad-merge")
        return _pool


def _copy_oldest_first(
    parts: Sequence[ShardRows],
    row_start: int,
    ids: torch.Tensor,
    slot: torch.Tensor,
    values: torch.Tensor,
    *,
    parallel: bool,
) -> None:
    """Copy every part's rows into ``values`` (row ``slot[id - row_start]``), oldest first.

    Later parts overwrite earlier ones, so the latest value wins. The output is cut into
    blocks of about :data:`BLOCK_BYTES` (at id boundaries), and each block takes every part's
    rows for it, oldest first, so the order holds within every block; a run of blocks per
    worker thread (numpy's row copies release the GIL). A block stays in cache while the
    parts overwrite its rows, instead of every part sweeping the whole output. Measured
    (10 M Zipf ids, dim 16, 2 cores): 8 / 64 segments 0.58 / 0.85 s in one thread -> 0.33-0.38
    / 0.45-0.5 s in two parts -> 64 segments 0.37-0.40 s in 4 MB blocks.
    """
    out = _rows(values)
    workers = _workers() if parallel else 1
    n = ids.numel()
    # (at most ~MAX_BLOCK_VISITS block x part visits: a window of thousands of small parts
    # would otherwise spend more on the Python loop than on the copies)
    by_size = -(-n * out.itemsize // BLOCK_BYTES)
    blocks = max(workers, min(by_size, MAX_BLOCK_VISITS // max(1, len(parts))))
    # block boundaries as ids, so each part's (sorted) ids split with one searchsorted
    cuts = ids[torch.arange(1, blocks, dtype=torch.int64) * n // blocks]
    dests: list[Any] = []
    bounds, rows = [], []
    for c in parts:
        if c.ids.numel() == 0:
            continue
        local = c.ids - row_start if row_start else c.ids
        # a part with every row of the union lands row for row: a slice copy (None)
        dests.append(None if c.ids.numel() == n else slot[local].numpy())
        bounds.append([0, *torch.searchsorted(c.ids, cuts).tolist(), c.ids.numel()])
        rows.append(_rows(c.values))

    def run(first: int, last: int) -> None:
        for b in range(first, last):
            for d, bs, r in zip(dests, bounds, rows, strict=True):
                lo, hi = bs[b], bs[b + 1]
                if hi > lo:
                    if d is None:
                        out[lo:hi] = r[lo:hi]
                    else:
                        out[d[lo:hi]] = r[lo:hi]

    if workers == 1:
        run(0, blocks)
        return
    spans = [(blocks * w // workers, blocks * (w + 1) // workers) for w in range(workers)]
    for f in [_executor().submit(run, a, b) for a, b in spans]:
        f.result()


def _rows(t: torch.Tensor) -> Any:
    """A contiguous [n, w] tensor as a numpy array of n opaque rows (a view, no copy).

    Row copies by index on these are 3-4x faster than ``index_copy_`` for narrow rows
    (measured: 16 x 125k rows of 16 floats, 60 ms vs 210-250 ms on 2 cores).
    """
    raw = t.contiguous().view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, raw.shape[1]))).reshape(-1)


def merge_entries(
    entries: Sequence[LogEntry], keys: Iterable[ShardKey] | None = None, *, with_values: bool = True
) -> dict[ShardKey, ShardRows]:
    """Merge each shard (all, or ``keys``) over ``entries`` (oldest first)."""
    wanted = None if keys is None else set(keys)
    by_key: dict[ShardKey, list[ShardRows]] = {}
    for e in entries:
        for k, c in e.shards.items():
            if wanted is None or k in wanted:
                by_key.setdefault(k, []).append(c)
    return {k: merge_rows(cs, with_values=with_values) for k, cs in by_key.items()}


def lookup(
    entries: Sequence[LogEntry], key: ShardKey, ids: torch.Tensor, like: ShardRows
) -> torch.Tensor:
    """Values of ``ids`` (sorted) in the state after ``entries`` (oldest first); zeros if never
    written."""
    out = torch.zeros(
        ids.numel(), like.shard.col_end - like.shard.col_start, dtype=like.values.dtype
    )
    need = torch.arange(ids.numel())
    for e in reversed(entries):
        if need.numel() == 0:
            break
        c = e.shards.get(key)
        if c is None or c.ids.numel() == 0:
            continue
        want = ids[need]
        p = torch.searchsorted(c.ids, want).clamp_(max=c.ids.numel() - 1)
        hit = c.ids[p] == want
        out[need[hit]] = c.values[p[hit]]
        need = need[~hit]
    return out


def lookup_raw(entries: Sequence[LogEntry], key: ShardKey, ids: torch.Tensor) -> torch.Tensor:
    """Raw ids held by the slots ``ids`` (sorted) of a managed-collision shard in the state
    after ``entries`` (oldest first); ``EMPTY_RAW_ID`` where never listed."""
    out = torch.full((ids.numel(),), EMPTY_RAW_ID, dtype=torch.int64)
    need = torch.arange(ids.numel())
    for e in reversed(entries):
        if need.numel() == 0:
            break
        c = e.shards.get(key)
        if c is None or c.raw_ids is None or c.ids.numel() == 0:
            continue
        want = ids[need]
        p = torch.searchsorted(c.ids, want).clamp_(max=c.ids.numel() - 1)
        hit = c.ids[p] == want
        out[need[hit]] = c.raw_ids[p[hit]]
        need = need[~hit]
    return out


def has_identities(entries: Sequence[LogEntry], key: ShardKey) -> bool:
    """Whether ``key`` is a managed-collision shard in ``entries`` (its base says)."""
    for e in entries:
        c = e.shards.get(key)
        if c is not None:
            return c.has_identities
    return False


def admitted_raw_ids(
    rows: ShardRows, key: ShardKey, held_state: Sequence[LogEntry]
) -> torch.Tensor:
    """Raw ids that entered the slots of ``rows`` (identities at the head) since the state
    after ``held_state``: those a slot holds now and did not hold there, ascending."""
    assert rows.raw_ids is not None
    held = lookup_raw(held_state, key, rows.ids)
    new = rows.raw_ids[(rows.raw_ids != held) & (rows.raw_ids != EMPTY_RAW_ID)]
    return torch.from_numpy(np.unique(new.numpy()))


@dataclass
class WindowShard:
    """What one shard contributes to a pull: rows to send, and rows left owed."""

    rows: ShardRows  # values at the head (empty [0, w] for IDS is fine: not sent)
    owed: ShardRows | None


def plan_shard(
    key: ShardKey,
    merged: ShardRows | None,
    owed: ShardRows | None,
    *,
    head_state: Sequence[LogEntry],
    held_state: Sequence[LogEntry],
    form: Form,
    k: int,
    fraction: float,
    budget: int | None,
) -> WindowShard:
    """Choose the rows of one shard to send; the rest become owed (held values kept).

    Candidates are the window's ids plus the rows already owed. With no owed rows, no top-k and
    no row budget, this is the merged window itself. Otherwise the held value of a candidate is
    its owed value if owed, else its value at the consumer's cursor (``held_state``); top-k
    ranks by L2 of (head - held), ``budget`` caps the count, unsent rows become owed.

    A managed-collision shard's rows go with their raw ids at the head and the window's
    evicted raw ids; a slot whose raw id at the head differs from the one at the cursor is
    always sent (beyond ``k`` and ``budget`` if need be), so no slot is owed with a stale
    identity. Owed rows carry no identities (a slot owed holds its identity at the cursor).
    """
    assert merged is not None or owed is not None
    like = merged if merged is not None else owed
    assert like is not None
    mc = (merged is not None and merged.has_identities) or has_identities(head_state, key)
    if owed is None and form is not Form.TOPK and (budget is None or budget >= like.ids.numel()):
        return WindowShard(like, None)
    if owed is None:
        cand = like.ids
    elif merged is None:
        cand = owed.ids
    else:
        cand = torch.unique(torch.cat([merged.ids, owed.ids]))
    whole = merged is not None and cand.numel() == merged.ids.numel()
    head = merged.values if whole and merged is not None else lookup(head_state, key, cand, like)
    head_raw = forced = evicted = None
    if mc:
        if whole and merged is not None and merged.raw_ids is not None:
            head_raw = merged.raw_ids
        else:
            head_raw = lookup_raw(head_state, key, cand)
        forced = head_raw != lookup_raw(held_state, key, cand)
        evicted = (
            merged.evicted
            if merged is not None and merged.evicted is not None
            else torch.empty(0, dtype=torch.int64)
        )
    n = cand.numel()
    take = n
    if form is Form.TOPK:
        take = min(n, k) if k > 0 else min(n, math.ceil(fraction * n))
    if budget is not None:
        take = max(0, min(take, budget))
    if forced is not None:
        take = max(take, int(forced.sum()))
    if take >= n:
        return WindowShard(like.with_rows(cand, head, head_raw, evicted), None)
    held = lookup(held_state, key, cand, like)
    if owed is not None:
        p = torch.searchsorted(cand, owed.ids)
        held[p] = owed.values
    if form is Form.TOPK:
        score = (head.to(torch.float32) - held.to(torch.float32)).norm(dim=1)
        if forced is not None:
            score[forced] = math.inf  # re-identified slots first, whatever moved
        chosen = torch.topk(score, take, sorted=False).indices.sort().values
    elif forced is not None:  # a row budget: the re-identified slots, then in id order
        order = torch.argsort((~forced).to(torch.int8), stable=True)
        chosen = order[:take].sort().values
    else:
        chosen = torch.arange(take)
    keep = torch.ones(n, dtype=torch.bool)
    keep[chosen] = False
    rest = keep.nonzero().squeeze(1)
    return WindowShard(
        like.with_rows(
            cand[chosen],
            head[chosen],
            None if head_raw is None else head_raw[chosen],
            evicted,
        ),
        like.with_rows(cand[rest], held[rest]),
    )
