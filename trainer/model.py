"""The reference model: a small DLRM with pooled (EBC) and sequence (EC) embeddings.

``dense -> bottom MLP`` and one pooled embedding per EBC table plus the mean-pooled sequence
embedding (EC) meet in a pairwise dot-product interaction; the over-arch maps the
interactions and the dense vector to one click logit. ``forward(batch)`` returns
``(loss, logits)`` as TorchRec's train pipelines expect.
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

from .data import SEQ_FEATURE, Batch, feature_name


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
        self.bottom = _mlp([num_dense, hidden, dim])
        n = len(tables) + 2  # dense vector, pooled tables, pooled sequence
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
        feats = torch.stack([dense, *[pooled[k] for k in self.pooled_keys], seq_mean], dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        logits = self.over(torch.cat([dense, inter], dim=1)).squeeze(1)
        return self.loss(logits, batch.labels), logits.detach()
