"""A synthetic click stream: dense features, Zipf-distributed sparse ids, a sequence, labels.

Batches are deterministic in (seed, rank, batch index), so a test can regenerate exactly the
ids a rank was fed. The pooled features go to the EmbeddingBagCollection as a
``KeyedJaggedTensor`` or a ``TensorDict`` of jagged nested tensors; the sequence feature always
goes to the EmbeddingCollection as a KJT.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

#: Name of the sequence feature (and of its table) fed to the EmbeddingCollection.
SEQ_FEATURE = "seq"
#: Name of the managed-collision table (its feature is ``feature_name(ZCH_TABLE)``).
ZCH_TABLE = "zch"


def feature_name(table: str) -> str:
    """The pooled feature that looks up ``table``."""
    return f"f_{table}"


@dataclass
class Batch(Pipelineable):
    """One training batch; movable across devices as TorchRec's train pipelines need."""

    dense: torch.Tensor  # [B, num_dense]
    sparse: Any  # KeyedJaggedTensor or TensorDict: pooled features for the EBC
    seq: KeyedJaggedTensor  # sequence feature for the EC
    labels: torch.Tensor  # [B]
    #: Raw ids of the managed-collision table (a KJT of one key, ``f_zch``); None: none.
    zch: KeyedJaggedTensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            seq=self.seq.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            zch=None if self.zch is None else self.zch.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: Any) -> None:
        self.dense.record_stream(stream)
        self.seq.record_stream(stream)
        self.labels.record_stream(stream)
        if self.zch is not None:
            self.zch.record_stream(stream)
        if isinstance(self.sparse, KeyedJaggedTensor):
            self.sparse.record_stream(stream)
        else:
            for v in self.sparse.values():
                v.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense.pin_memory(),
            self.sparse.pin_memory(),
            self.seq.pin_memory(),
            self.labels.pin_memory(),
            None if self.zch is None else self.zch.pin_memory(),
        )

    def zch_kjt(self) -> KeyedJaggedTensor:
        """The managed-collision raw ids; a batch without them looks up nothing (every
        sample's bag is empty: a zero pooled embedding)."""
        if self.zch is not None:
            return self.zch
        b = self.labels.numel()
        return KeyedJaggedTensor(
            keys=[feature_name(ZCH_TABLE)],
            values=torch.zeros(0, dtype=torch.int64, device=self.labels.device),
            lengths=torch.zeros(b, dtype=torch.int64, device=self.labels.device),
        )

    def sparse_kjt(self) -> KeyedJaggedTensor:
        """The pooled features as a KJT, whatever form the batch carries them in."""
        if isinstance(self.sparse, KeyedJaggedTensor):
            return self.sparse
        keys = list(self.sparse.keys())
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([self.sparse[k].values() for k in keys]),
            lengths=torch.cat([self.sparse[k].offsets().diff() for k in keys]),
        )


class _Zipf:
    """Inverse-CDF sampler of Zipf(alpha) ranks over ``rows`` ids, hot ids spread out."""

    def __init__(self, rows: int, alpha: float, generator: torch.Generator) -> None:
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
        self.cdf = weights.cumsum(0)
        self.cdf /= self.cdf[-1].item()
        self.perm = torch.randperm(rows, generator=generator)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        u = torch.rand(n, dtype=torch.float64, generator=generator)
        ranks = torch.searchsorted(self.cdf, u).clamp_(max=self.perm.numel() - 1)
        return self.perm[ranks]


class ClickStream:
    """Deterministic synthetic batches for one rank.

    ``tables`` maps each pooled table to its row count; ``seq_rows`` is the sequence table's.
    ``zch_raw_ids`` > 0: batches also carry raw ids of the managed-collision table, Zipf over
    ``[0, zch_raw_ids)`` with the hot set drifting (``zch_drift`` ids per batch), so ids keep
    arriving and going cold; drawn from their own generator (the other features' streams
    are the same with or without them).
    """

    def __init__(
        self,
        tables: dict[str, int],
        seq_rows: int,
        *,
        batch_size: int,
        num_dense: int = 8,
        pooling: int = 4,
        seq_len: int = 8,
        alpha: float = 1.05,
        input_format: str = "kjt",
        seed: int = 0,
        rank: int = 0,
        zch_raw_ids: int = 0,
        zch_drift: int = 7,
    ) -> None:
        self.tables = dict(tables)
        self.batch_size = batch_size
        self.num_dense = num_dense
        self.pooling = pooling
        self.seq_len = seq_len
        self.input_format = input_format
        # The id mapping (which ids are hot) is shared by all ranks; the stream is per rank.
        shared = torch.Generator().manual_seed(seed)
        self._zipf = {t: _Zipf(rows, alpha, shared) for t, rows in self.tables.items()}
        self._seq_zipf = _Zipf(seq_rows, alpha, shared)
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
        self.zch_raw_ids = zch_raw_ids
        self.zch_drift = zch_drift
        self._batches = 0
        if zch_raw_ids > 0:
            self._zch_zipf = _Zipf(zch_raw_ids, alpha, shared)
            self._zch_gen = torch.Generator().manual_seed(seed * 1_000_033 + rank + 7)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def take(self, n: int) -> Iterator[Batch]:
        """Exactly ``n`` batches."""
        for _ in range(n):
            yield self.next_batch()

    def next_batch(self) -> Batch:
        g, b = self._gen, self.batch_size
        dense = torch.randn(b, self.num_dense, generator=g)
        keys = [feature_name(t) for t in self.tables]
        lengths = [torch.randint(1, self.pooling + 1, (b,), generator=g) for _ in keys]
        values = [
            self._zipf[t].sample(int(n.sum()), g) for t, n in zip(self.tables, lengths, strict=True)
        ]
        seq_lengths = torch.randint(1, self.seq_len + 1, (b,), generator=g)
        seq_values = self._seq_zipf.sample(int(seq_lengths.sum()), g)
        # A learnable signal: clicks depend on the dense features and on the first id's parity.
        first = values[0][torch.cumsum(lengths[0], 0) - lengths[0]]
        logit = dense[:, 0] + 0.5 * dense[:, 1] + (first % 2).to(dense.dtype) - 0.5
        labels = (torch.rand(b, generator=g) < torch.sigmoid(logit)).to(torch.float32)
        seq = KeyedJaggedTensor.from_lengths_sync(
            keys=[SEQ_FEATURE], values=seq_values, lengths=seq_lengths
        )
        zch = None
        if self.zch_raw_ids > 0:
            zg = self._zch_gen
            zl = torch.randint(1, self.pooling + 1, (b,), generator=zg)
            shift = self._batches * self.zch_drift
            zv = (self._zch_zipf.sample(int(zl.sum()), zg) + shift) % self.zch_raw_ids
            zch = KeyedJaggedTensor.from_lengths_sync(
                keys=[feature_name(ZCH_TABLE)], values=zv, lengths=zl
            )
        self._batches += 1
        return Batch(dense, self._sparse(keys, values, lengths), seq, labels, zch)

    def _sparse(
        self, keys: Sequence[str], values: Sequence[torch.Tensor], lengths: Sequence[torch.Tensor]
    ) -> Any:
        if self.input_format == "kjt":
            return KeyedJaggedTensor.from_lengths_sync(
                keys=list(keys), values=torch.cat(list(values)), lengths=torch.cat(list(lengths))
            )
        return TensorDict(
            {
                k: torch.nested.nested_tensor_from_jagged(
                    v, offsets=torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
                )
                for k, v, n in zip(keys, values, lengths, strict=True)
            },
            batch_size=[self.batch_size],
        )
