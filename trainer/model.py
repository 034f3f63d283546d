"""The reference model: a small DLRM with pooled (EBC), sequence (EC) and managed-collision
(ZCH) embeddings.

``dense -> bottom MLP`` and one pooled embedding per EBC table, the mean-pooled sequence
embedding (EC) and, by default, the pooled embedding of a **managed-collision** table meet in
a pairwise dot-product interaction; the over-arch maps the interactions and the dense vector
to one click logit. ``forward(batch)`` returns ``(loss, logits)`` as TorchRec's train
pipelines expect.

The managed-collision table (``zch_slots > 0``, the default :data:`ZCH_SLOTS`, as the
reference trainer's; ``zch_slots=0``: none;
``deltad.reference.trainer.train.build_unsharded(TrainConfig(...))`` builds the trainer's
exact model): module ``zch``, a
``ManagedCollisionEmbeddingBagCollection`` whose table ``zch`` (feature ``f_zch``) has
``zch_slots`` rows ("slots"); an ``MCHManagedCollisionModule`` with LRU eviction (every
forward) maps raw ids from ``[0, zch_raw_ids)``, by default 20x the slots, onto them, so ids
are admitted and evicted all the time. In a deltad manifest the table is ``zch`` with module
``zch._embedding_module`` (the inner EBC), kind ``ebc``, ``managed_collision`` true; its MCH
is ``zch._managed_collision_collection._managed_collision_modules.zch``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)

from .data import SEQ_FEATURE, ZCH_TABLE, Batch, feature_name
from .zch import ZCH_RAW_PER_SLOT, ZCH_SLOTS, mc_module

__all__ = ["ZCH_SLOTS", "ClickModel"]


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ClickModel(nn.Module):
    """DLRM-style click model; embedding tables are created on ``device`` (``meta`` for DMP)."""

    def __init__(
        self,
        tables: dict[str, int],
        seq_rows: int,
        *,
        dim: int,
        num_dense: int = 8,
        hidden: int = 32,
        zch_slots: int = ZCH_SLOTS,
        zch_raw_ids: int = 0,
        zch_policy: str = "lru",
        zch_buckets: int = 1,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=t, embedding_dim=dim, num_embeddings=rows, feature_names=[feature_name(t)]
                )
                for t, rows in tables.items()
            ],
            device=device,
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=SEQ_FEATURE,
                    embedding_dim=dim,
                    num_embeddings=seq_rows,
                    feature_names=[SEQ_FEATURE],
                )
            ],
            device=device,
        )
        self.pooled_keys = [feature_name(t) for t in tables]
        #: The managed-collision EBC (None without one): raw ids in [0, zch_raw_ids).
        self.zch: nn.Module | None = None
        self.zch_raw_ids = 0
        if zch_slots > 0:
            self.zch_raw_ids = zch_raw_ids or ZCH_RAW_PER_SLOT * zch_slots
            self.zch = mc_module(
                "ebc",
                ZCH_TABLE,
                feature_name(ZCH_TABLE),
                slots=zch_slots,
                raw_ids=self.zch_raw_ids,
                dim=dim,
                policy=zch_policy,
                buckets=zch_buckets,
                device=device,
            )
        self.bottom = _mlp([num_dense, hidden, dim])
        # dense vector, pooled tables, pooled sequence (, pooled zch)
        n = len(tables) + 2 + (self.zch is not None)
        self.tri: torch.Tensor
        self.register_buffer("tri", torch.triu_indices(n, n, offset=1), persistent=False)
        self.over = _mlp([dim + n * (n - 1) // 2, hidden, 1])
        self.loss = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        dense = self.bottom(batch.dense)
        pooled = self.ebc(batch.sparse)
        seq = self.ec(batch.seq)[SEQ_FEATURE]
        # Mean over each sample's sequence (written with tensor ops only: the sparse-dist
        # pipeline fx-traces this forward).
        lengths = seq.lengths()
        rows = torch.repeat_interleave(lengths)
        seq_sum = torch.zeros_like(dense).index_add(0, rows, seq.values())
        seq_mean = seq_sum / lengths.clamp(min=1).unsqueeze(1).type_as(dense)
        parts = [dense, *[pooled[k] for k in self.pooled_keys], seq_mean]
        if self.zch is not None:
            # batch.zch, not batch.zch_kjt(): the sparse-dist pipeline fx-traces this forward
            # and must see the KJT as a batch attribute (a traced proxy is never None)
            zch = batch.zch if batch.zch is not None else batch.zch_kjt()
            parts.append(self.zch(zch)[0][feature_name(ZCH_TABLE)])
        feats = torch.stack(parts, dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        logits = self.over(torch.cat([dense, inter], dim=1)).squeeze(1)
        return self.loss(logits, batch.labels), logits.detach()
