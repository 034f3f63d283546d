"""The trainer-side delta tracker: which rows of each local embedding shard were touched.

:class:`DeltaTracker` attaches to every sharded ``EmbeddingCollection`` /
``EmbeddingBagCollection`` of a ``DistributedModelParallel`` model through TorchRec 1.8's
hooks (``register_post_lookup_tracker_fn`` / ``register_post_odist_tracker_fn``):

* The post-lookup hook runs once per sharding type per forward with the features that this
  rank's lookup consumed. It only stashes their id tensors (integers, no autograd state).
* The post-odist hook ("auto-compaction during the output dist") folds the stash into a
  **bool bitmap per local shard** on the weights' device: per feature key, the slice of ids
  it owns (``offset_per_key()``, cached by the input dist) goes ``mask.index_fill_(0, ids,
  True)`` (on CPU ~10x faster than ``mask[ids] = True``). A scatter per key instead of the
  per-step ``torch.unique`` of TorchRec's own tracker; memory is one byte per local row.
  With CPU weights (``deltad.knobs.FOLD_IN_BACKGROUND``) the post-lookup hook adds the ids
  straight to a batch for a **fold thread** that scatters while training goes on, in order,
  with drains queued behind the lookups before them; the thread is woken once per
  ``knobs.FOLD_BATCH_IDS`` ids or at a drain (bounded: the hook blocks when the thread is
  behind), and the post-odist hook has nothing to do. A failed fold (either way)
  is raised by the drain that follows it (never rows without that lookup's), which the
  publisher turns into an error on every rank at its next publish. Raising in the hook would
  stop one rank mid-forward and leave the others waiting in the output dist.
* :meth:`DeltaTracker.drain` folds what is left, returns the sorted unique local row ids of
  each shard (``nonzero()``) and clears the bitmaps. :meth:`DeltaTracker.drain_deferred`
  only swaps each bitmap for a clean spare (constant time) and leaves the ``nonzero()`` and
  the clearing to a :class:`DrainedRows` that another thread resolves (the publisher's
  copier): two bitmaps per lookup then, two bytes per local row (with the fold thread, CPU
  only; :meth:`DeltaTracker.drain` without it works in place).
* Managed-collision tables (the inner EC / EBC of a sharded MC-EC / MC-EBC): their lookups
  run through ``compute()``, where the hooks above never fire; the tracker hooks the lookup
  modules instead, and keeps each slot's raw id (:mod:`deltad.publish.mc`,
  :meth:`DeltaTracker.take_identities`).
* :meth:`DeltaTracker.add_update_barrier`: a callback that every backward pass runs before a
  tracked row can change (a hook on the gradient of each lookup's output), which lets the
  publisher copy rows while the next forward runs.

What the hook sees, and how its ids map to local shards: :mod:`deltad.publish.shards`; the
bitmaps: :mod:`deltad.publish.bitmaps`; the fold thread: :mod:`deltad.publish.fold`.

Where to drain, and lookahead
-----------------------------
Drain at a step boundary: after the (fused) optimizer has applied step N and before anything
of step N+1 updates a row. Every row step N updated was looked up by batch N, so its id is in
the bitmap; reading the rows right after the drain gives a consistent cut.

* Plain loop, ``TrainPipelineBase`` and ``TrainPipelineSparseDist``: ``progress()`` of step N
  may already start the *input* dist of batch N+1, but the lookup of N+1 only runs inside the
  forward of ``progress()`` N+1, so nothing past N is in the bitmap (lookahead 0).
* ``TrainPipelineFusedSparseDist`` / ``TrainPipelineSemiSync`` (lookahead 1, GPU only): the
  lookup of batch N+1 runs before step N's update is applied. Its ids are in the bitmap at
  drain N (a harmless early copy), but the update of those rows happens in step N+1 and no
  new lookup will mark them again. So after clearing, :meth:`drain` re-marks the ids of the
  last ``lookahead`` lookups of every lookup module: those rows are owed to the next segment
  too (a duplicate now, never a lost row).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from deltad import knobs
from deltad.config import TrackerConfig
from deltad.errors import UnsupportedModelError
from deltad.publish.bitmaps import Bitmap, DrainedRows, LookupBitmaps
from deltad.publish.fold import FoldThread
from deltad.publish.mc import SlotIdentities
from deltad.publish.shards import (
    TrackedShard,
    cache_flush,
    clean_fqn,
    find_shards,
)
from deltad.publish.stats import TrackerStats
from deltad.segment.spool import TableInfo

__all__ = [
    "DeltaTracker",
    "DrainedRows",
    "TrackedShard",
    "TrackerStats",
    "cache_flush",
    "clean_fqn",
]


def _always() -> bool:
    return True


def _never() -> bool:
    return False


class DeltaTracker:
    """Records, per local shard, the rows touched since the last :meth:`drain`.

    ``model`` is a ``DistributedModelParallel`` (or any module containing sharded EC / EBC
    modules), with or without DDP around its dense part.
    """

    def __init__(self, model: nn.Module, config: TrackerConfig | None = None) -> None:
        self.config = config or TrackerConfig()
        self._lookahead = self.config.train_loop.lookahead
        self._paused = False
        self.stats = TrackerStats()
        self._pending: list[tuple[LookupBitmaps, torch.Tensor, list[int]]] = []
        self._barriers: list[Callable[[], None]] = []
        #: barrier -> whether it may block now (None: always; see add_update_barrier)
        self._armed: dict[Callable[[], None], Callable[[], bool] | None] = {}
        #: whether this forward's backward must run the barriers (see _barrier_predicate)
        self._barrier_needed: Callable[[], bool] = _never
        found = find_shards(model, self.config)
        self._modules: dict[str, Any] = found.modules  # fqn -> sharded EC / EBC
        self._tables: list[TableInfo] = found.tables
        #: inner EC / EBC fqn -> its sharded MC-EC / MC-EBC
        self._mc_inner: dict[str, Any] = found.mc_inner
        #: fqn -> sharded MC-EC / MC-EBC (their inner EC / EBC are tracked as MC tables)
        self._mc_parents: dict[str, Any] = found.mc_parents
        #: undo of the hooks on MC modules (lookup forward hooks, compute / evict wrappers)
        self._mc_undo: list[Callable[[], None]] = []
        self._lookups: dict[tuple[int, tuple[str, ...]], LookupBitmaps] = {
            (id(lk.module), lk.keys): LookupBitmaps(
                shards=lk.shards, key_shard=lk.key_shard, history=deque(maxlen=self._lookahead)
            )
            for lk in found.lookups
        }
        for name, mod in self._modules.items():
            if name in self._mc_inner:
                continue  # hooked through its lookups (see _hook_mc)
            if mod.post_lookup_tracker_fn is not None or mod.post_odist_tracker_fn is not None:
                raise UnsupportedModelError(
                    f"{name} already has a tracker attached (a DeltaTracker or TorchRec's "
                    "ModelDeltaTracker): one would silently miss lookups; detach it first"
                )
        for name, mod in self._modules.items():
            if name in self._mc_inner:
                self._hook_mc(name, mod, self._mc_inner[name])
                continue
            mod.register_post_lookup_tracker_fn(self._make_lookup_hook(id(mod)))
            mod.register_post_odist_tracker_fn(self._fold_hook)
        self._folder: FoldThread | None = None
        if knobs.FOLD_IN_BACKGROUND and all(s.weight.device.type == "cpu" for s in self.shards):
            self._folder = FoldThread(knobs.MAX_PENDING_FOLDS, self.stats, knobs.FOLD_BATCH_IDS)
            # A tracker dropped without detach() does not leave its thread waiting forever.
            weakref.finalize(self, self._folder.stop)

    # -- hooks ------------------------------------------------------------------------------

    def _make_lookup_hook(self, mod_id: int) -> Any:
        def record(features: Any, embs: Any, module: Any, extra: Any) -> None:
            t0 = time.perf_counter()  # the hook's whole time is the loop's (update hook too)
            # Paused or not: whatever this lookup's backward updates waits for the barriers
            # that may block by then (see _barrier_needed).
            if self._barrier_needed() and isinstance(embs, torch.Tensor) and embs.requires_grad:
                embs.register_hook(self._before_update)
                self.stats.update_hooks += 1
            if self._paused:
                self.stats.record_s += time.perf_counter() - t0
                return
            keys = tuple(features.keys())
            if not keys:
                self.stats.record_s += time.perf_counter() - t0
                return
            lookup = self._lookups.get((mod_id, keys))
            if lookup is None:
                raise UnsupportedModelError(
                    f"lookup features {list(keys)} match no local shard layout of the module"
                )
            # offset_per_key() is cached by the input dist (a host list: no device sync). The
            # values are ids (integers: never part of autograd, no detach needed).
            values, offsets = features.values(), features.offset_per_key()
            if self._folder is not None:  # straight into the fold thread's batch
                self._folder.defer(offsets[-1], self._mark, lookup, values, offsets)
            else:  # folded in the output dist's hook
                self._pending.append((lookup, values, offsets))
            self.stats.lookups += 1
            self.stats.record_s += time.perf_counter() - t0

        return record

    def _hook_mc(self, name: str, mod: Any, parent: Any) -> None:
        """Track a managed-collision EC / EBC: TorchRec runs its inner module through
        ``compute()``, where the post-lookup hooks never fire, so each lookup module gets a
        forward hook (the same record and fold, with the remapped local slot ids it is called
        with). The MC collection's ``compute`` runs the update barriers first (eviction
        rewrites rows in it, in the forward), and its ``evict`` reports the slots reset."""
        record = self._make_lookup_hook(id(mod))

        def looked_up(module: Any, args: Any, output: Any) -> None:
            record(args[0], output, module, None)
            self._fold_hook()

        for lookup in mod._lookups:
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            self._mc_undo.append(lookup.register_forward_hook(looked_up).remove)
        states = {s.shard.table: s.mc for s in self.shards if s.module == name}
        mcc = parent._managed_collision_collection
        if "compute" in mcc.__dict__ or "evict" in mcc.__dict__:
            raise UnsupportedModelError(
                f"{name} already has a tracker attached (a DeltaTracker): detach it first"
            )
        compute, evict = mcc.compute, mcc.evict

        def mc_compute(ctx: Any, dist_input: Any) -> Any:
            if self._barrier_needed():  # rows and the remapper change from here on
                self._before_update(None)
            return compute(ctx, dist_input)

        def mc_evict() -> Any:
            out = evict()
            for table, local in out.items():
                state = states.get(table)
                if local is not None and state is not None:
                    state.mark_reset(local)
            return out

        mcc.compute, mcc.evict = mc_compute, mc_evict

        def undo() -> None:
            for attr in ("compute", "evict"):
                mcc.__dict__.pop(attr, None)

        self._mc_undo.append(undo)

    def _fold_hook(self) -> None:
        if not self._pending:  # (with the fold thread, always: lookups go to its batch)
            return
        t0 = time.perf_counter()
        self._fold()
        self.stats.fold_s += time.perf_counter() - t0

    @torch.no_grad()
    def _fold(self) -> None:
        """Fold stashed ids into the bitmaps (in the output dist, and at drain). Only without
        a fold thread: with one, the lookup hook hands the ids to its batch instead."""
        pending, self._pending = self._pending, []
        for lookup, values, offsets in pending:
            self._mark(lookup, values, offsets)

    def _mark(self, lookup: LookupBitmaps, values: torch.Tensor, offsets: list[int]) -> None:
        lookup.mark(values, offsets)
        if self._lookahead:
            lookup.history.append((values, offsets))

    def _swap_all(self) -> list[tuple[LookupBitmaps, Bitmap]]:
        """Swap in clean bitmaps; re-mark the lookahead lookups into them (see drain)."""
        parts: list[tuple[LookupBitmaps, Bitmap]] = []
        for lk in self._lookups.values():
            parts.append((lk, lk.swap()))
            lk.remark_history()
        return parts

    def _swap_into(self, rows: DrainedRows) -> None:
        """In the fold thread, behind every lookup folded before the drain."""
        assert self._folder is not None
        if self._folder.error is not None:
            rows._fail(self._folder.error)
            return
        try:
            rows._fill(self._swap_all())
        except BaseException as e:
            rows._fail(e)
            raise

    # -- public API -------------------------------------------------------------------------

    @property
    def shards(self) -> list[TrackedShard]:
        """Every local shard tracked on this rank."""
        return [s for lk in self._lookups.values() for s in lk.shards]

    @torch.no_grad()
    def flush_caches(self) -> int:
        """Write device-cached rows back into the shards' weights (each kernel once), so that
        ``weight`` holds every row's current value; returns the kernels flushed (0 on CPU).
        Call at a step boundary, before reading rows (the publisher does)."""
        done: set[int] = set()
        for s in self.shards:
            owner = getattr(s.flush, "__self__", s.flush)
            if s.flush is not None and id(owner) not in done:
                done.add(id(owner))
                s.flush()
        return len(done)

    @property
    def tables(self) -> list[TableInfo]:
        """Every table of the tracked modules (global shapes; also those with no local shard)."""
        return list(self._tables)

    @property
    def lookahead(self) -> int:
        return self._lookahead

    @property
    def managed_collision_modules(self) -> list[str]:
        """fqns of the tracked sharded MC-EC / MC-EBC modules (their own state, e.g. the MCH
        buffers, is published as identities, never as dense state)."""
        return sorted(set(self._mc_parents) & {n.rpartition(".")[0] for n in self._mc_inner})

    @torch.no_grad()
    def take_identities(self) -> dict[TrackedShard, SlotIdentities]:
        """Each managed-collision shard's identities now, diffed against the last call (see
        :class:`deltad.publish.mc.McShardState`); empty without MC tables. Call at the same
        step boundary as the drain, or later but before the next MC compute (the publisher's
        copier does, while the update barrier holds that compute back)."""
        return {s: s.mc.take() for s in self.shards if s.mc is not None}

    @torch.no_grad()
    def drain(self) -> list[tuple[TrackedShard, torch.Tensor]]:
        """Return (shard, sorted unique local row ids) for every local shard, and reset.

        Call at a step boundary (see the module docstring). With lookahead L > 0 the ids of
        the last L lookups are marked again after the reset, so they are owed to the next
        segment as well (again at every drain until newer lookups replace them: owed rows
        are sent at least once). With lookahead 0, draining twice with no forward in between
        returns empty ids.
        """
        if self._folder is not None:  # queued behind the folds; the thread swaps bitmaps
            rows = self.drain_deferred()
            out = rows.resolve()
            self.stats.drain_s += rows.resolve_s
            return out
        t0 = time.perf_counter()
        self._fold()
        out = []
        for lk in self._lookups.values():  # in place: no second bitmap (device memory)
            out += lk.read_and_clear(lk.active)
            lk.remark_history()
        self.stats.drain_s += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def drain_deferred(self) -> DrainedRows:
        """:meth:`drain`, but the ids are read later: ``drain_deferred().resolve()``.

        Only the bitmaps are swapped here (lookups from now on mark clean ones), so the
        training loop pays a constant time; with a fold thread, the swap is queued behind
        the lookups it still folds. The returned rows may be resolved on another thread
        while training goes on; resolve them (until then their bitmaps are not reused, and
        each later drain allocates new ones).
        """
        t0 = time.perf_counter()
        self._fold()
        if self._folder is not None:
            rows = DrainedRows(alive=self._folder.alive)
            self._folder.submit(functools.partial(self._swap_into, rows))
        else:
            rows = DrainedRows(self._swap_all())
        self.stats.drain_s += time.perf_counter() - t0
        return rows

    def add_update_barrier(
        self, barrier: Callable[[], None], armed: Callable[[], bool] | None = None
    ) -> None:
        """Run ``barrier()`` in every backward pass before a tracked shard's weights change.

        It runs when the gradient of a lookup's output is ready, which is before the
        embedding kernel's backward (where fused optimizers update the rows) and before any
        optimizer step. The publisher uses it to copy rows off the training loop's clock.
        Weights written outside a backward (checkpoint loads, manual edits) get no barrier.

        ``armed()``, if given, says whether the barrier may block: it is asked in each
        lookup's forward (on the training loop's thread), and a backward whose forward found
        no barrier armed runs none (a gradient hook costs ~50 us per lookup here). So it must
        become true only on the training loop's thread, at a step boundary (the publisher
        arms it when it hands a copy over, in ``maybe_publish``), and stay true until the
        barrier would return at once. With lookahead (a pipeline that looks batch N+1 up
        before step N's update) every backward runs the barriers.
        """
        self._barriers.append(barrier)
        self._armed[barrier] = armed
        self._barrier_needed = self._barrier_predicate()

    def remove_update_barrier(self, barrier: Callable[[], None]) -> None:
        """Stop running ``barrier`` (no error if it is not registered)."""
        if barrier in self._barriers:
            self._barriers.remove(barrier)
            self._armed.pop(barrier, None)
            self._barrier_needed = self._barrier_predicate()

    def _barrier_predicate(self) -> Callable[[], bool]:
        """Whether a forward's backward must run the barriers (see add_update_barrier), as
        one call for the lookup hook: the publisher's one armed barrier is its own
        ``armed`` (the hook runs for every lookup of every step)."""
        if not self._armed:
            return _never
        checks = [a for a in self._armed.values() if a is not None]
        if self._lookahead or len(checks) < len(self._armed):  # a barrier that always may
            return _always
        if len(checks) == 1:
            return checks[0]
        return lambda: any(a() for a in checks)

    def _before_update(self, grad: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        for barrier in list(self._barriers):
            barrier()  # the publisher accounts its barrier's waits (barrier_wait_s)
        self.stats.backward_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Do not record lookups inside this block (eval / warm-up forwards)."""
        prev, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = prev

    def detach(self) -> None:
        """Remove the hooks from every tracked module, stop the fold thread; pending ids are
        dropped. Waits for the update barriers once (a copy still reading rows finishes
        before the hooks that would hold back the next update are gone)."""
        for barrier in list(self._barriers):
            barrier()
        for name, mod in self._modules.items():
            if name not in self._mc_inner:
                mod.post_lookup_tracker_fn = None
                mod.post_odist_tracker_fn = None
        for undo in self._mc_undo:
            undo()
        self._mc_undo.clear()
        self._modules.clear()
        self._pending.clear()
        self._barriers.clear()
        if self._folder is not None:  # drains still queued are swapped first
            self._folder.stop()
            self._folder = None
