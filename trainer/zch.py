"""Managed-collision (ZCH) tables for the reference trainer, on CPU with gloo.

* :func:`mc_module` builds an MC-EBC / MC-EC of one table: an ``MCHManagedCollisionModule``
  (zero-collision hashing) with LRU or LFU eviction maps raw ids from a space much larger
  than the table onto its rows ("slots"), admitting and evicting ids while training runs.
* :func:`mc_sharders`: TorchRec's MC sharders, with the EBC one offering row-wise on CPU
  (TorchRec's EBC sharder offers it only on CUDA; it runs with gloo). Row-wise is the only
  sharding TorchRec 1.8 has for MC tables (``ManagedCollisionCollectionSharder``).
* :func:`enable_cpu_eviction`: fbgemm 1.x has no CPU kernel for
  ``fbgemm::reset_weight_momentum``, which TorchRec calls when an MC module evicts (to zero
  the evicted slots' rows and optimizer state before re-initializing the rows); without it
  the first eviction of a CPU MC model raises ``NotImplementedError``. This installs the
  same reset, in Python, for CPU TBEs only (the CUDA path is untouched).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no torch at import time: `deltad --help` imports the CLI that reads these
    import torch

#: Eviction policies by name.
POLICIES = ("lru", "lfu")
#: Slots of the reference model's managed-collision table, and its raw-id space per slot.
ZCH_SLOTS = 1000
ZCH_RAW_PER_SLOT = 20


def eviction_policy(name: str) -> Any:
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy

    if name == "lru":
        return LRU_EvictionPolicy()
    if name == "lfu":
        return LFU_EvictionPolicy()
    raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, not {name!r}")


def mc_module(
    kind: str,
    table: str,
    feature: str,
    *,
    slots: int,
    raw_ids: int,
    dim: int,
    policy: str = "lru",
    eviction_interval: int = 1,
    buckets: int = 1,
    device: torch.device | None = None,
) -> Any:
    """A ManagedCollisionEmbeddingBagCollection (``kind`` "ebc") or -EmbeddingCollection
    ("ec") of one table ``table`` with ``slots`` rows, looked up by ``feature`` with raw ids
    in ``[0, raw_ids)``; its embedding table on ``device`` (``meta`` for DMP). ``buckets``:
    the MCH's uniform buckets; TorchRec's planner wants a multiple of the world size."""
    import torch
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    mch = MCHManagedCollisionModule(
        zch_size=slots,
        device=torch.device("cpu"),
        eviction_policy=eviction_policy(policy),
        eviction_interval=eviction_interval,
        input_hash_size=raw_ids,
        buckets=buckets,
    )
    kinds = {
        "ebc": (EmbeddingBagConfig, EmbeddingBagCollection, ManagedCollisionEmbeddingBagCollection),
        "ec": (EmbeddingConfig, EmbeddingCollection, ManagedCollisionEmbeddingCollection),
    }
    if kind in kinds:
        config_type, collection_type, mc_type = kinds[kind]
        tables = [
            config_type(
                name=table, embedding_dim=dim, num_embeddings=slots, feature_names=[feature]
            )
        ]
        return mc_type(
            collection_type(tables=tables, device=device),
            ManagedCollisionCollection({table: mch}, tables),
            return_remapped_features=False,
        )
    raise ValueError(f"kind must be 'ebc' or 'ec', not {kind!r}")


def mc_tables(model: torch.nn.Module) -> set[str]:
    """Names of the managed-collision tables of an (unsharded) model."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    return {
        name
        for m in model.modules()
        if isinstance(m, BaseManagedCollisionEmbeddingCollection)
        for name in m._managed_collision_collection._managed_collision_modules
    }


def mc_sharders(ebc_sharder: Any, ec_sharder: Any) -> list[Any]:
    """MC-EBC and MC-EC sharders around the given EBC / EC sharders (their fused params)."""
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder

    return [
        ManagedCollisionEmbeddingBagCollectionSharder(
            ebc_sharder, ManagedCollisionCollectionSharder()
        ),
        ManagedCollisionEmbeddingCollectionSharder(ec_sharder, ManagedCollisionCollectionSharder()),
    ]


_installed = False


def enable_cpu_eviction() -> None:
    """Give CPU TBEs the reset TorchRec's MC eviction calls (see the module docstring):
    the evicted slots' rows and their EXACT_ROWWISE_ADAGRAD momentum are zeroed, as the
    CUDA kernel does; TorchRec then re-initializes the rows with the table's ``init_fn``."""
    global _installed
    if _installed:
        return
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen as Tbe,
    )

    original = Tbe.reset_embedding_weight_momentum

    @torch.no_grad()
    def reset(
        self: Any,
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        if self.current_device.type != "cpu":
            original(self, pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids)
            return
        weights = self.split_embedding_weights()
        states = self.split_optimizer_states()
        offsets = pruned_indices_offsets.tolist()
        for b, t in enumerate(logical_table_ids.tolist()):
            idx = pruned_indices[offsets[b] : offsets[b + 1]].to(torch.int64)
            weights[t][idx] = 0
            for state in states[t]:
                state[idx] = 0

    Tbe.reset_embedding_weight_momentum = reset
    _installed = True
