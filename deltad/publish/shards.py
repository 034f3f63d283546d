"""What a tracker tracks: a model's sharded EC / EBC modules, their tables, and each local shard.

What the lookups see (TorchRec 1.8, measured): the ids after the input dist, i.e. the ids this
rank's shards are looked up with. Table-wise and column-wise shards see global row ids (they
hold every row); row-wise and table-row-wise shards see **shard-local** ids (rank 1 of a
100-row table split 50/50 reports global row 95 as 45). Each key of the lookup's features
belongs, in order, to one table shard of the lookup's grouped configs (a rank holding two
column shards of one table sees that feature twice); the tracker records local ids per shard
and :class:`TrackedShard` carries the shard's global row and column range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deltad.config import TrackerConfig
from deltad.errors import UnsupportedModelError
from deltad.publish.mc import McShardState, check_mch, managed_collision_types
from deltad.segment.spool import TableInfo
from deltad.types import Shard

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


@dataclass
class LookupShards:
    """One lookup (sharding type) of a sharded module: its local shards, in feature order."""

    module: Any  # the sharded EC / EBC
    keys: tuple[str, ...]  # the feature keys of its lookups, in order
    shards: list[TrackedShard]
    key_shard: list[int]  # per key: index of its shard in ``shards``


@dataclass
class ModelShards:
    """Every sharded EC / EBC of a model to track, with its tables and local shards."""

    #: fqn -> sharded EC / EBC
    modules: dict[str, Any] = field(default_factory=dict)
    #: inner EC / EBC fqn -> its sharded MC-EC / MC-EBC
    mc_inner: dict[str, Any] = field(default_factory=dict)
    #: fqn -> sharded MC-EC / MC-EBC (their inner EC / EBC are tracked as MC tables)
    mc_parents: dict[str, Any] = field(default_factory=dict)
    #: every table of the tracked modules (global shapes; also those with no local shard)
    tables: list[TableInfo] = field(default_factory=list)
    lookups: list[LookupShards] = field(default_factory=list)


def find_shards(model: nn.Module, config: TrackerConfig) -> ModelShards:
    """The sharded EC / EBC modules of ``model`` to track (all but ``config.fqns_to_skip``),
    or UnsupportedModelError for a model the tracker cannot track exactly."""
    found = ModelShards()
    lookahead = config.train_loop.lookahead
    ec_type, ebc_type = _sharded_types()
    mc_types = managed_collision_types()
    named = list(model.named_modules())
    if mc_types is not None:
        found.mc_parents = {
            clean_fqn(fqn): mod for fqn, mod in named if isinstance(mod, mc_types[0])
        }
    for fqn, mod in named:
        name = clean_fqn(fqn)
        parent_name = name.rpartition(".")[0]
        parent = found.mc_parents.get(parent_name)
        if mc_types is not None and isinstance(mod, mc_types[1]) and parent is None:
            raise UnsupportedModelError(
                f"{name} is a managed-collision collection outside a managed-collision "
                "EC / EBC: deltad tracks MC tables only inside "
                "ManagedCollisionEmbeddingCollection / ManagedCollisionEmbeddingBagCollection"
            )
        if not isinstance(mod, (ec_type, ebc_type)):
            continue
        if any(s in name.split(".") or s == name for s in config.fqns_to_skip):
            continue
        kind = "ebc" if isinstance(mod, ebc_type) else "ec"
        mc = parent if parent is not None and parent._embedding_module is mod else None
        if mc is not None and lookahead:
            raise UnsupportedModelError(
                f"{parent_name} is a managed-collision module: train loop "
                f"{config.train_loop.value} runs the next forward (where eviction "
                "rewrites rows and the remapper) before this step's update is published; "
                "use the plain loop or TrainPipelineBase / TrainPipelineSparseDist"
            )
        _add_module(found, name, kind, mod, mc)
    if not found.modules:
        raise UnsupportedModelError(
            "no sharded EmbeddingCollection / EmbeddingBagCollection to track: wrap the "
            "model with DistributedModelParallel (and check PublisherConfig.fqns_to_skip)"
        )
    return found


def _add_module(found: ModelShards, name: str, kind: str, mod: Any, mc: Any = None) -> None:
    """Add a sharded EC / EBC; ``mc``: the sharded MC-EC / MC-EBC it is the inner module of
    (its tables are managed-collision tables), else None."""
    if mc is not None:
        found.mc_inner[name] = mc
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
        if any(t.name == table for t in found.tables):
            raise UnsupportedModelError(
                f"table name {table!r} is used by more than one tracked module; segments "
                "key rows by table name (rename it or skip a module via fqns_to_skip)"
            )
        found.tables.append(
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
    local = _local_shards(name, mod, configs)
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
                shard = _shard(name, kind, t, w, plan, configs, local, flush, mc)
                for feature in t.feature_names:
                    keys.append(feature)
                    key_shard.append(len(shards))
                shards.append(shard)
        if not shards:
            continue
        found.lookups.append(LookupShards(mod, tuple(keys), shards, key_shard))
    found.modules[name] = mod


def _local_shards(
    name: str, mod: Any, configs: dict[str, Any]
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
    """Table shard ``t`` of a lookup's kernel, whose weights are ``w``; it must be the
    state_dict's local shard (a view of the same memory)."""
    cfg = configs[t.name]
    meta = t.local_metadata
    r0, c0 = (0, 0) if meta is None else (int(meta.shard_offsets[0]), int(meta.shard_offsets[1]))
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
        shard=Shard(t.name, cfg.num_embeddings, cfg.embedding_dim, r0, r0 + rows, c0, c0 + cols),
        weight=w,
        flush=flush,
        mc=state,
    )
