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
  With CPU weights (``deltad.knobs.FOLD_IN_BACKGROUND``) the hook only hands the stash to a
  **fold thread** that scatters while training goes on, in order, with drains queued behind
  the lookups before them (bounded: the hook blocks when the thread is behind); a failed fold
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

What the hook sees (TorchRec 1.8, measured): the ids after the input dist, i.e. the ids this
rank's shards are looked up with. Table-wise and column-wise shards see global row ids (they
hold every row); row-wise and table-row-wise shards see **shard-local** ids (rank 1 of a
100-row table split 50/50 reports global row 95 as 45). Each key of the lookup's features
belongs, in order, to one table shard of the lookup's grouped configs (a rank holding two
column shards of one table sees that feature twice); the tracker records local ids per shard
and :class:`TrackedShard` carries the shard's global row and column range.

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
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deltad import knobs
from deltad.config import TrackerConfig
from deltad.errors import UnsupportedModelError
from deltad.publish.mc import (
    McShardState,
    SlotIdentities,
    check_mch,
    managed_collision_types,
)
from deltad.segment.spool import TableInfo
from deltad.types import Shard

log = logging.getLogger(__name__)

_DMP_PREFIXES = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.", "module.")


@dataclass(frozen=True, eq=False)
class TrackedShard:
    """One local shard (a row range and column range of a table) and its weight view."""

    module: str  # fqn of the sharded EC / EBC, DMP / DDP prefixes stripped
    kind: str  # "ec" or "ebc"
    sharding_type: str
    shard: Shard  # the table, and the row and column ranges held here
    #: [shard.rows, shard.width] view of the TBE weights (not a copy).
    weight: torch.Tensor = field(repr=False)
    #: Writes a device cache's rows back into ``weight`` (UVM-caching kernels, see
    #: :func:`cache_flush`); None where ``weight`` is always current.
    flush: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    #: A managed-collision table's shard: its slots' identities (see deltad.publish.mc);
    #: None for ordinary tables.
    mc: McShardState | None = field(default=None, repr=False, compare=False)


def cache_flush(emb: Any) -> Callable[[], None] | None:
    """The write-back of an embedding kernel that keeps rows in a device cache, else None.

    fbgemm's UVM-caching TBEs (``EmbeddingComputeKernel.FUSED_UVM_CACHING``) update the rows
    cached in HBM; ``split_embedding_weights()`` views the UVM backing store, which holds a
    cached row's value only after ``flush()``. Such rows must be flushed before they are read
    (the publisher does, at each step boundary). CPU and plain fused kernels have no cache.
    """
    tbe = getattr(emb, "_emb_module", emb)
    cache = getattr(tbe, "lxu_cache_weights", None)
    flush = getattr(tbe, "flush", None)
    if isinstance(cache, torch.Tensor) and cache.numel() > 0 and callable(flush):
        return flush  # type: ignore[no-any-return]
    return None


@dataclass
class TrackerStats:
    """Time the tracker spent inside the training loop (for overhead benchmarks)."""

    lookups: int = 0  # post-lookup hook calls that recorded ids
    update_hooks: int = 0  # update-barrier hooks registered on lookup outputs (all lookups)
    record_s: float = 0.0  # in the post-lookup hook (stashing ids)
    fold_s: float = 0.0  # in the post-odist hook (folding ids, or handing them to the thread)
    drain_s: float = 0.0  # in drain() (last fold, nonzero, reset, re-mark)
    #: CPU seconds of the fold thread (folds and swaps off the loop; 0 without one).
    background_s: float = 0.0

    @property
    def forward_s(self) -> float:
        """What the hooks added to forward passes."""
        return self.record_s + self.fold_s


@dataclass(eq=False)
class _Bitmap:
    """One bool bitmap per shard of a lookup, as views of one flat tensor."""

    flat: torch.Tensor  # bool, concatenation of the shards' bitmaps
    masks: list[torch.Tensor]  # views of ``flat``, one per shard
    key_masks: list[torch.Tensor]  # per key of the features: its shard's bitmap


@dataclass(eq=False)
class _Lookup:
    """One lookup (sharding type) of a sharded module: its shards and their bitmaps.

    ``active`` takes the marks; a drain swaps in a clean spare and hands the marked one to a
    :class:`DrainedRows`, whose ``resolve()`` (maybe on another thread) reads, clears and
    returns it to ``spares``.
    """

    shards: list[TrackedShard]
    key_shard: list[int]  # per key of the features: index of its shard
    #: (ids, offset per key) of the last ``lookahead`` lookups
    history: deque[tuple[torch.Tensor, list[int]]]
    active: _Bitmap = field(init=False)
    spares: list[_Bitmap] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.active = self.new_bitmap()

    def new_bitmap(self) -> _Bitmap:
        sizes = [s.shard.rows for s in self.shards]
        flat = torch.zeros(sum(sizes), dtype=torch.bool, device=self.shards[0].weight.device)
        masks = list(flat.split(sizes))
        return _Bitmap(flat, masks, [masks[i] for i in self.key_shard])

    def swap(self) -> _Bitmap:
        """Make a clean bitmap active; return the one that was."""
        with self.lock:
            fresh = self.spares.pop() if self.spares else None
        old, self.active = self.active, fresh if fresh is not None else self.new_bitmap()
        return old

    def give_back(self, bitmap: _Bitmap) -> None:
        """A resolved (cleared) bitmap becomes a spare again."""
        with self.lock:
            self.spares.append(bitmap)

    def read_and_clear(self, bitmap: _Bitmap) -> list[tuple[TrackedShard, torch.Tensor]]:
        """(shard, sorted unique local row ids) of ``bitmap``, which is then all clear."""
        out = [
            (s, mask.nonzero().view(-1)) for s, mask in zip(self.shards, bitmap.masks, strict=True)
        ]
        bitmap.flat.zero_()
        return out

    def remark_history(self) -> None:
        """Mark the last ``lookahead`` lookups again (they stay owed after a drain)."""
        for values, offsets in self.history:
            self.mark(values, offsets)

    def mark(self, values: torch.Tensor, offsets: list[int]) -> None:
        """Set the bits of the ids of one lookup (key ``i`` owns ``values[o[i]:o[i+1]]``)."""
        for i, mask in enumerate(self.active.key_masks):
            if offsets[i + 1] > offsets[i]:
                ids = values[offsets[i] : offsets[i + 1]].to(torch.int64)
                mask.index_fill_(0, ids, True)


class DrainedRows:
    """The rows one drain took, read out of their bitmaps only when :meth:`resolve` is called.

    The drain itself only swaps bitmaps (constant time; with a fold thread, not even that on
    the training loop's clock: the swap is queued behind the lookups still being folded); the
    ``nonzero()`` over every local row and the clearing happen in :meth:`resolve`, which any
    thread may call, exactly once.
    """

    def __init__(
        self,
        parts: list[tuple[_Lookup, _Bitmap]] | None = None,
        *,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self._parts = parts
        self._error: BaseException | None = None
        self._alive = alive  # the fold thread that fills in ``parts``, if any
        self._ready = threading.Event()
        self._resolved = False
        if parts is not None:
            self._ready.set()
        #: Seconds :meth:`resolve` took (0 until it ran).
        self.resolve_s = 0.0

    def _fill(self, parts: list[tuple[_Lookup, _Bitmap]]) -> None:
        self._parts = parts
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    @torch.no_grad()
    def resolve(self) -> list[tuple[TrackedShard, torch.Tensor]]:
        """(shard, sorted unique local row ids) for every local shard; clears the bitmaps.

        Waits for the fold thread to reach this drain; raises if folding failed (the drained
        rows are then unknown) or the thread is gone.
        """
        if self._resolved:
            raise RuntimeError("DrainedRows.resolve() may be called only once")
        self._resolved = True
        t0 = time.perf_counter()
        # Bounded: the fold thread reaches every queued drain unless it stopped.
        while not self._ready.wait(timeout=1.0):
            if self._alive is not None and not self._alive():
                raise RuntimeError("the tracker's fold thread stopped before this drain")
        if self._error is not None:
            raise RuntimeError(f"folding tracked ids failed: {self._error}") from self._error
        parts, self._parts = self._parts, None
        assert parts is not None
        out: list[tuple[TrackedShard, torch.Tensor]] = []
        for lookup, bitmap in parts:
            out += lookup.read_and_clear(bitmap)
            lookup.give_back(bitmap)
        self.resolve_s = time.perf_counter() - t0
        return out


class _FoldThread:
    """Runs the tracker's folds (and the bitmap swaps between them) in order, off the loop.

    Bounded: at most ``max_pending`` calls wait; the training loop's hook blocks beyond that
    (the thread is behind). The first failure is kept in ``error``; the calls after it still
    run (a drain queued behind it reports it instead of rows missing the failed lookup's).
    """

    def __init__(self, max_pending: int, stats: TrackerStats) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        self._stats = stats  # background_s: this thread's CPU time
        self._thread = threading.Thread(target=self._run, name="deltad-fold", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        self._queue.put(call)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then end the thread (joined unless called from it)."""
        if self.alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout_s)

    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            c0 = time.thread_time()
            try:
                with torch.no_grad():  # grad mode is per thread
                    call()
            except BaseException as e:
                log.error("folding tracked ids: %s", e)
                if self.error is None:
                    self.error = e
            del call  # a queued call holds the tracker: let it go before the next get()
            self._stats.background_s += time.thread_time() - c0


def clean_fqn(fqn: str) -> str:
    """``fqn`` without the DistributedModelParallel / DDP wrapper prefixes: the name the
    unwrapped model (and a predictor's inference model) gives the same module or tensor."""
    for prefix in _DMP_PREFIXES:
        if fqn.startswith(prefix):
            return clean_fqn(fqn[len(prefix) :])
    return fqn


def _sharded_types() -> tuple[type, type]:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return ShardedEmbeddingCollection, ShardedEmbeddingBagCollection


def _dtype_name(data_type: Any) -> str:
    from torchrec.modules.embedding_configs import data_type_to_dtype

    return str(data_type_to_dtype(data_type)).removeprefix("torch.")


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
        self._pending: list[tuple[_Lookup, torch.Tensor, list[int]]] = []
        self._barriers: list[Callable[[], None]] = []
        self._modules: dict[str, Any] = {}  # fqn -> sharded EC / EBC
        self._lookups: dict[tuple[int, tuple[str, ...]], _Lookup] = {}
        self._tables: list[TableInfo] = []
        #: inner EC / EBC fqn -> its sharded MC-EC / MC-EBC
        self._mc_inner: dict[str, Any] = {}
        ec_type, ebc_type = _sharded_types()
        mc_types = managed_collision_types()
        #: fqn -> sharded MC-EC / MC-EBC (their inner EC / EBC are tracked as MC tables)
        self._mc_parents: dict[str, Any] = {}
        #: undo of the hooks on MC modules (lookup forward hooks, compute / evict wrappers)
        self._mc_undo: list[Callable[[], None]] = []
        named = list(model.named_modules())
        if mc_types is not None:
            self._mc_parents = {
                clean_fqn(fqn): mod for fqn, mod in named if isinstance(mod, mc_types[0])
            }
        for fqn, mod in named:
            name = clean_fqn(fqn)
            parent_name = name.rpartition(".")[0]
            parent = self._mc_parents.get(parent_name)
            if mc_types is not None and isinstance(mod, mc_types[1]) and parent is None:
                raise UnsupportedModelError(
                    f"{name} is a managed-collision collection outside a managed-collision "
                    "EC / EBC: deltad tracks MC tables only inside "
                    "ManagedCollisionEmbeddingCollection / ManagedCollisionEmbeddingBagCollection"
                )
            if not isinstance(mod, (ec_type, ebc_type)):
                continue
            if any(s in name.split(".") or s == name for s in self.config.fqns_to_skip):
                continue
            kind = "ebc" if isinstance(mod, ebc_type) else "ec"
            mc = parent if parent is not None and parent._embedding_module is mod else None
            if mc is not None and self._lookahead:
                raise UnsupportedModelError(
                    f"{parent_name} is a managed-collision module: train loop "
                    f"{self.config.train_loop.value} runs the next forward (where eviction "
                    "rewrites rows and the remapper) before this step's update is published; "
                    "use the plain loop or TrainPipelineBase / TrainPipelineSparseDist"
                )
            self._add_module(name, kind, mod, mc)
        if not self._modules:
            raise UnsupportedModelError(
                "no sharded EmbeddingCollection / EmbeddingBagCollection to track: wrap the "
                "model with DistributedModelParallel (and check PublisherConfig.fqns_to_skip)"
            )
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
        self._folder: _FoldThread | None = None
        if knobs.FOLD_IN_BACKGROUND and all(s.weight.device.type == "cpu" for s in self.shards):
            self._folder = _FoldThread(knobs.MAX_PENDING_FOLDS, self.stats)
            # A tracker dropped without detach() does not leave its thread waiting forever.
            weakref.finalize(self, self._folder.stop)

    # -- construction -----------------------------------------------------------------------

    def _add_module(self, name: str, kind: str, mod: Any, mc: Any = None) -> None:
        """Track a sharded EC / EBC; ``mc``: the sharded MC-EC / MC-EBC it is the inner
        module of (its tables are managed-collision tables), else None."""
        if mc is not None:
            self._mc_inner[name] = mc
        if not hasattr(mod, "register_post_lookup_tracker_fn"):
            raise UnsupportedModelError(
                f"{name}: this TorchRec has no post-lookup tracker hooks (need torchrec>=1.8)"
            )
        plan: dict[str, Any] = dict(mod.module_sharding_plan)
        configs: dict[str, Any] = dict(mod._table_name_to_config)
        for table, cfg in configs.items():
            st = plan[table].sharding_type
            if st == "data_parallel":
                raise UnsupportedModelError(
                    f"table {table} of {name} is data-parallel: every rank updates every "
                    "replica, so no rank owns its rows; shard it (TW, RW, CW, TWRW) instead"
                )
            if any(t.name == table for t in self._tables):
                raise UnsupportedModelError(
                    f"table name {table!r} is used by more than one tracked module; segments "
                    "key rows by table name (rename it or skip a module via fqns_to_skip)"
                )
            self._tables.append(
                TableInfo(
                    name=table,
                    num_rows=cfg.num_embeddings,
                    dim=cfg.embedding_dim,
                    dtype=_dtype_name(cfg.data_type),
                    module=name,
                    kind=kind,
                    sharding_type=st,
                    managed_collision=mc is not None,
                )
            )
        local = self._local_shards(name, mod, configs)
        for lookup in mod._lookups:
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            keys: list[str] = []
            shards: list[TrackedShard] = []
            key_shard: list[int] = []
            for emb in getattr(lookup, "_emb_modules", []):
                weights = emb.split_embedding_weights()
                flush = cache_flush(emb)
                for t, w in zip(emb._config.embedding_tables, weights, strict=True):
                    shard = self._shard(name, kind, t, w, plan, configs, local, flush, mc)
                    for feature in t.feature_names:
                        keys.append(feature)
                        key_shard.append(len(shards))
                    shards.append(shard)
            if not shards:
                continue
            self._lookups[(id(mod), tuple(keys))] = self._new_lookup(shards, key_shard)
        self._modules[name] = mod

    def _local_shards(
        self, name: str, mod: Any, configs: dict[str, Any]
    ) -> dict[tuple[str, int, int], torch.Tensor]:
        """(table, row offset, col offset) -> local shard tensor, from the state_dict."""
        out: dict[tuple[str, int, int], torch.Tensor] = {}
        for key, value in mod.state_dict().items():
            parts = key.split(".")
            if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in configs:
                continue
            if not hasattr(value, "local_shards"):
                raise UnsupportedModelError(f"{name}.{key} is not a ShardedTensor")
            for s in value.local_shards():
                r, c = s.metadata.shard_offsets
                out[(parts[-2], int(r), int(c))] = s.tensor
        return out

    def _shard(
        self,
        name: str,
        kind: str,
        t: Any,
        w: torch.Tensor,
        plan: dict[str, Any],
        configs: dict[str, Any],
        local: dict[tuple[str, int, int], torch.Tensor],
        flush: Callable[[], None] | None = None,
        mc: Any = None,
    ) -> TrackedShard:
        cfg = configs[t.name]
        meta = t.local_metadata
        r0, c0 = (
            (0, 0) if meta is None else (int(meta.shard_offsets[0]), int(meta.shard_offsets[1]))
        )
        rows, cols = int(t.local_rows), int(t.local_cols)
        view = local.get((t.name, r0, c0))
        if (
            view is None
            or tuple(view.shape) != (rows, cols)
            or tuple(w.shape) != (rows, cols)
            or view.data_ptr() != w.data_ptr()
        ):
            raise UnsupportedModelError(
                f"cannot map table {t.name} of {name} (rows {r0}+{rows}, cols {c0}+{cols}) to a "
                "local shard whose state_dict tensor is a view of the embedding kernel's weights"
            )
        state = None
        if mc is not None:
            mch = mc._managed_collision_collection._managed_collision_modules[t.name]
            check_mch(mch, f"table {t.name} of {name}", r0, rows)
            state = McShardState(mch, rows)
        return TrackedShard(
            module=name,
            kind=kind,
            sharding_type=plan[t.name].sharding_type,
            shard=Shard(
                t.name, cfg.num_embeddings, cfg.embedding_dim, r0, r0 + rows, c0, c0 + cols
            ),
            weight=w,
            flush=flush,
            mc=state,
        )

    def _new_lookup(self, shards: list[TrackedShard], key_shard: list[int]) -> _Lookup:
        return _Lookup(shards=shards, key_shard=key_shard, history=deque(maxlen=self._lookahead))

    # -- hooks ------------------------------------------------------------------------------

    def _make_lookup_hook(self, mod_id: int) -> Any:
        def record(features: Any, embs: Any, module: Any, extra: Any) -> None:
            # Paused or not, publisher or not yet: whatever this lookup's backward updates
            # waits for the barriers registered by the time the backward runs.
            if isinstance(embs, torch.Tensor) and embs.requires_grad:
                embs.register_hook(self._before_update)
                self.stats.update_hooks += 1
            if self._paused:
                return
            t0 = time.perf_counter()
            keys = tuple(features.keys())
            if not keys:
                return
            lookup = self._lookups.get((mod_id, keys))
            if lookup is None:
                raise UnsupportedModelError(
                    f"lookup features {list(keys)} match no local shard layout of the module"
                )
            # offset_per_key() is cached by the input dist (a host list: no device sync).
            self._pending.append((lookup, features.values().detach(), features.offset_per_key()))
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
            self._before_update(None)  # rows and the remapper change from here on
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
        t0 = time.perf_counter()
        self._fold()
        self.stats.fold_s += time.perf_counter() - t0

    @torch.no_grad()
    def _fold(self) -> None:
        """Fold stashed ids into the bitmaps (in the output dist, and at drain), or hand
        them to the fold thread, which folds them in the same order."""
        pending, self._pending = self._pending, []
        for lookup, values, offsets in pending:
            if self._folder is not None:
                self._folder.submit(functools.partial(self._mark, lookup, values, offsets))
            else:
                self._mark(lookup, values, offsets)

    def _mark(self, lookup: _Lookup, values: torch.Tensor, offsets: list[int]) -> None:
        lookup.mark(values, offsets)
        if self._lookahead:
            lookup.history.append((values, offsets))

    def _swap_all(self) -> list[tuple[_Lookup, _Bitmap]]:
        """Swap in clean bitmaps; re-mark the lookahead lookups into them (see drain)."""
        parts: list[tuple[_Lookup, _Bitmap]] = []
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
        step boundary as the drain (the publisher does, in the loop: the MC state changes in
        the next forward)."""
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

    def add_update_barrier(self, barrier: Callable[[], None]) -> None:
        """Run ``barrier()`` in every backward pass before a tracked shard's weights change.

        It runs when the gradient of a lookup's output is ready, which is before the
        embedding kernel's backward (where fused optimizers update the rows) and before any
        optimizer step. The publisher uses it to copy rows off the training loop's clock.
        Weights written outside a backward (checkpoint loads, manual edits) get no barrier.
        """
        self._barriers.append(barrier)

    def remove_update_barrier(self, barrier: Callable[[], None]) -> None:
        """Stop running ``barrier`` (no error if it is not registered)."""
        if barrier in self._barriers:
            self._barriers.remove(barrier)

    def _before_update(self, grad: torch.Tensor | None) -> None:
        for barrier in list(self._barriers):
            barrier()

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
