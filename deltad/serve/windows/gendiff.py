"""Generation diffs: a new generation costs a consumer only the rows that changed.

When a trainer restarts it publishes a new generation (a new base per rank). A consumer whose
cursor is ``(old generation, seq s)`` holds the old generation's state at ``s``. While this
sidecar still holds the old generation's log (:meth:`SegmentLog.previous`, bounded by
``ServerConfig.generation_keep_s`` / ``generation_keep_bytes``), it gets a *generation diff*:
for every shard this rank serves, the rows whose value at the window's head (new base + new
deltas up to ``to_seq``) differs bit-exactly from the old state at ``s`` (old base + old deltas
up to ``s``), plus the rows still owed to it from a top-k / max_rows pull of the old
generation (its tables hold stale values for those). The header says ``resync = false``,
``from_seq = -1`` and ``diff_from_generation``; the consumer overwrites those rows in place and
commits the trailer's cursor, which is of the new generation. A diff is complete in every form
(like a resync, k, fraction and max_rows do not apply); FORM_IDS sends the ids only. The
dense state, when asked for, comes as with a resync.

A managed-collision shard's diff also holds every slot whose raw id differs between the two
states (even with a bit-equal row), with its raw id at the head; its evicted raw ids are those
the old state's map holds and the new one's does not.

Otherwise (the old log not held, the cursor outside it, tables or sharding changed between
the generations, owed rows unreadable, or the request asks ``no_generation_diff``) the
consumer resyncs from the new base, and ``DeltaHeader.resync_reason`` says why.

Cost on the sidecar: one merge of the old state at ``s`` and of the new state at the head per
shard (transiently two copies of this rank's tables), once per (old cursor, window) shape:
diffs without owed rows are cached, so a herd of predictors at one cursor costs one diff.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace

import torch

from deltad import wire
from deltad.errors import OffsetStoreError, SpoolError
from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.index.merge import merge_rows
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.state.offsets import OffsetStore
from deltad.serve.state.owed import OwedStore
from deltad.serve.windows import encode
from deltad.serve.windows.cache import WindowCache
from deltad.serve.windows.decide import LogView, WindowDecision
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.header import ShardLine
from deltad.serve.windows.parts import window_dense, window_parts
from deltad.serve.windows.spec import WindowSpec
from deltad.types import EMPTY_RAW_ID, Form, ShardKey
from deltad.v1 import delta_pb2 as pb

log = logging.getLogger(__name__)

#: Diff windows (no owed rows) kept for the consumers at one old cursor.
CACHE_ENTRIES = 4
#: Rows compared per step (bounds the comparison's temporary memory).
COMPARE_ROWS = 1 << 16


class Incompatible(Exception):
    """The two generations' tables or shards differ: no diff (the message says how)."""


def compatible(old: LogSnapshot, new: LogSnapshot) -> None:
    """Raise :class:`Incompatible` unless ``old`` and ``new`` declare the same tables (names,
    shapes, dtypes), world size and this rank's shards (row and column ranges, value
    dtypes)."""
    if old.manifest.world_size != new.manifest.world_size:
        raise Incompatible(f"world size {old.manifest.world_size} -> {new.manifest.world_size}")

    def tables(s: LogSnapshot) -> dict[str, tuple[int, int, str]]:
        return {t.name: (t.num_rows, t.dim, t.dtype) for t in s.manifest.tables}

    a, b = tables(old), tables(new)
    if a != b:
        changed = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
        raise Incompatible(f"tables changed: {', '.join(changed[:8])}")
    oa, ob = old.base.shards, new.base.shards
    if set(oa) != set(ob):
        raise Incompatible("this rank's shards changed (resharded)")
    for k, c in ob.items():
        o = oa[k]
        if o.shard != c.shard:
            raise Incompatible(f"shard of {k[0]} changed: {o.shard} -> {c.shard}")
        if o.values.dtype != c.values.dtype:
            raise Incompatible(f"values of {k[0]} changed dtype")


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


def build_diff_window(
    old: LogSnapshot,
    old_seq: int,
    snap: LogSnapshot,
    spec: WindowSpec,
    to_step: int,
    owed: dict[ShardKey, ShardRows],
) -> EncodedWindow:
    """The generation diff window ``spec`` (``to_seq`` set) over ``snap`` for a consumer that
    holds ``old`` at ``old_seq`` and is owed ``owed`` (of ``old``'s generation). Raises
    :class:`Incompatible`."""
    compatible(old, snap)
    old_parts = [e.shards for e in old.upto(old_seq)]
    return state_diff_window(
        old_parts, snap, spec, to_step, owed, diff_from_generation=old.generation
    )


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
    t0 = time.perf_counter()
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
    return win.finish_with(out)


def drop_unpinned(seglog: SegmentLog, store: OffsetStore) -> bool:
    """Stop holding the previous generation's log once no live consumer stands on it (no
    committed cursor or pending pull of that generation with a live lease); True if dropped.
    Called by retention each round. A consumer whose lease expired pins nothing: back, it
    resyncs (as it would behind a merged base)."""
    prev = seglog.previous()
    if prev is None:
        return False
    try:
        pins = store.pins(seglog.rank, prev.generation)
    except OffsetStoreError as e:
        log.warning("cannot read the cursors at generation %d: %s", prev.generation, e)
        return False
    if pins:
        return False
    seglog.drop_previous(
        f"generation {prev.generation}'s log was dropped: no live consumer was at it"
    )
    return True


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


class GenerationDiffs:
    """The generation diffs of one rank's sidecar (called by deltad.serve.windows.getdelta)."""

    def __init__(
        self, seglog: SegmentLog, owed: OwedStore, metrics: SidecarMetrics, budget: WindowCache
    ) -> None:
        self.log = seglog
        self.owed = owed
        self.metrics = metrics
        #: cached diffs count against the window cache's byte budget (WindowCache.hold)
        self.budget = budget
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, int, WindowSpec], EncodedWindow] = OrderedDict()
        self._cached_generation: int | None = None  # of the held log the cached diffs are from

    def previous(self) -> tuple[LogView | None, str]:
        """The held previous generation's log view (None: not held) and why it is not."""
        prev = self.log.previous()
        cached = self._cached_generation
        if cached is not None and (prev is None or prev.generation != cached):
            with self._lock:  # the held log is gone: its cached diffs give their bytes back
                self._drop_all()
        return (None if prev is None else LogView.of(prev)), self.log.previous_missing

    def window(
        self, consumer: str, snap: LogSnapshot, shape: WindowSpec, decision: WindowDecision
    ) -> tuple[EncodedWindow | None, bool, WindowDecision]:
        """(the diff window, whether it was cached, the decision): no window unless
        ``decision`` is a generation diff; a diff that cannot be made turns the decision
        into a resync with the reason. Counts diffs and resyncs on a generation change."""
        if decision.diff_from is None:
            if decision.resync and decision.reason.startswith("new generation"):
                self.metrics.generation_resyncs.inc()
            return None, False, decision
        gen, seq = decision.diff_from
        prev = self.log.previous()
        if prev is None:
            with self._lock:
                self._drop_all()
        try:
            if prev is None or prev.generation != gen:
                raise Incompatible(self.log.previous_missing or "the held log moved on")
            owed: dict[ShardKey, ShardRows] = {}
            if decision.owed_token:
                try:
                    owed = self.owed.load(consumer, decision.owed_token, gen)
                except SpoolError as e:
                    raise Incompatible(f"the rows owed of generation {gen} are lost: {e}") from e
            spec = replace(shape, resync=False, from_seq=-1, to_seq=decision.to_seq)
            if owed:
                win = build_diff_window(prev, seq, snap, spec, decision.to_step, owed)
                hit = False
            else:
                win, hit = self._cached(prev, seq, snap, spec, decision.to_step)
        except Incompatible as e:
            log.warning("%s: new generation %d: full resync: %s", consumer, snap.generation, e)
            self.metrics.generation_resyncs.inc()
            return None, False, decision.resynced(f"new generation: {e}")
        self.metrics.generation_diffs.inc()
        return win, hit, replace(decision, reason=f"generation diff from {gen} seq {seq}")

    def _cached(
        self, prev: LogSnapshot, seq: int, snap: LogSnapshot, spec: WindowSpec, to_step: int
    ) -> tuple[EncodedWindow, bool]:
        key = (prev.generation, seq, spec)
        with self._lock:  # a herd at one cursor waits for the first one's diff
            win = self._cache.get(key)
            if win is not None:
                self._cache.move_to_end(key)
                return win, True
            win = build_diff_window(prev, seq, snap, spec, to_step, {})
            if self.budget.hold(win.nbytes):
                if self._cached_generation != prev.generation:
                    self._drop_all()
                self._cache[key] = win
                self._cached_generation = prev.generation
                while len(self._cache) > CACHE_ENTRIES:
                    self.budget.release(self._cache.popitem(last=False)[1].nbytes)
            return win, False

    def _drop_all(self) -> None:
        """Forget the cached diffs (the held log is gone), giving their bytes back."""
        while self._cache:
            self.budget.release(self._cache.popitem()[1].nbytes)
        self._cached_generation = None
