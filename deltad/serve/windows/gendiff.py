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

The rows are compared by :func:`deltad.serve.windows.statediff.state_diff_window` (as a rollback's).

Cost on the sidecar: one merge of the old state at ``s`` and of the new state at the head per
shard (transiently two copies of this rank's tables), once per (old cursor, window) shape:
diffs without owed rows are cached, so a herd of predictors at one cursor costs one diff.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import replace

from deltad.errors import OffsetStoreError, SpoolError
from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.state.offsets import OffsetStore
from deltad.serve.state.owed import OwedStore
from deltad.serve.windows.cache import WindowCache
from deltad.serve.windows.decide import LogView, WindowDecision
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.spec import WindowSpec
from deltad.serve.windows.statediff import Incompatible, state_diff_window
from deltad.types import ShardKey

log = logging.getLogger(__name__)

#: Diff windows (no owed rows) kept for the consumers at one old cursor.
CACHE_ENTRIES = 4


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


class GenerationDiffs:
    """The generation diffs of one rank's sidecar (called by deltad.serve.windows.source)."""

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
