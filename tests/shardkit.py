"""Helpers for multi-process gloo tests of the tracker and publisher: a toy sharded model.

The toy model has no dense parameters, so DistributedModelParallel wraps nothing in DDP.
Its EBC holds one table per sharding type (the table-wise one looked up by two features);
its EC a row-wise and a column-wise table. Batches are deterministic in (rank, index), so
every rank can compute the ids every rank was fed.
"""

from __future__ import annotations

import os
import sys
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deltad.reference.trainer.data import Batch
from deltad.reference.trainer.train import shard_model
from tensordict import TensorDict
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

ROWS = 100
DIM = 16
#: EBC table -> (sharding, features)
EBC_TABLES = {
    "e_tw": ("tw", ["f_tw", "g_tw"]),
    "e_rw": ("rw", ["f_rw"]),
    "e_cw": ("cw", ["f_cw"]),
    "e_twrw": ("twrw", ["f_twrw"]),
}
#: EC table -> (sharding, features)
EC_TABLES = {"s_rw": ("rw", ["s_rw"]), "s_cw": ("cw", ["s_cw"])}
EBC_FEATURES = [f for _, fs in EBC_TABLES.values() for f in fs]
EC_FEATURES = [f for _, fs in EC_TABLES.values() for f in fs]
FEATURE_TABLE = {f: t for t, (_, fs) in {**EBC_TABLES, **EC_TABLES}.items() for f in fs}


class Toy(nn.Module):
    """EBC + EC, no dense parameters; forward returns a scalar to backprop."""

    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=fs)
                for t, (_, fs) in EBC_TABLES.items()
            ],
            device=meta,
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=fs)
                for t, (_, fs) in EC_TABLES.items()
            ],
            device=meta,
        )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, detached loss): the sum of every embedding, so every looked-up row moves."""
        loss = self.ebc(batch.sparse).values().sum()
        seq = self.ec(batch.seq)
        for feature in EC_FEATURES:  # fx-traceable (the sparse-dist pipeline traces this)
            loss = loss + seq[feature].values().sum()
        return loss, loss.detach()


def toy_dmp(world_size: int, sharding: dict[str, str] | None = None) -> Any:
    """The toy model sharded as EBC_TABLES / EC_TABLES say (or ``sharding`` overrides)."""
    plan = {t: st for t, (st, _) in {**EBC_TABLES, **EC_TABLES}.items()}
    plan.update(sharding or {})
    return shard_model(Toy(), plan, world_size=world_size, learning_rate=0.1, cw_min_partition=4)


def batch(rank: int, index: int, *, tensordict: bool = False, size: int = 8) -> Batch:
    """One rank's batch: pooled features for the EBC (KJT or TensorDict), a KJT for the EC."""
    g = torch.Generator().manual_seed(1000 * rank + index)

    def jagged(keys: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        lengths = [torch.randint(0, 4, (size,), generator=g) for _ in keys]
        values = [torch.randint(0, ROWS, (int(n.sum()),), generator=g) for n in lengths]
        return values, lengths

    pv, pl = jagged(EBC_FEATURES)
    sv, sl = jagged(EC_FEATURES)
    seq = KeyedJaggedTensor.from_lengths_sync(EC_FEATURES, torch.cat(sv), torch.cat(sl))
    pooled: Any = KeyedJaggedTensor.from_lengths_sync(EBC_FEATURES, torch.cat(pv), torch.cat(pl))
    if tensordict:
        pooled = TensorDict(
            {
                k: torch.nested.nested_tensor_from_jagged(
                    v, offsets=torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
                )
                for k, v, n in zip(EBC_FEATURES, pv, pl, strict=True)
            },
            batch_size=[size],
        )
    return Batch(torch.zeros(size, 1), pooled, seq, torch.zeros(size))


def fed_ids(batches: list[Batch]) -> dict[str, set[int]]:
    """Global ids each table was looked up with across ``batches``."""
    out: dict[str, set[int]] = {t: set() for t in FEATURE_TABLE.values()}
    for b in batches:
        for kjt in (b.sparse_kjt(), b.seq):
            for k in kjt.keys():  # noqa: SIM118 (a KJT, not a dict)
                out[FEATURE_TABLE[k]].update(kjt[k].values().tolist())
    return out


def _entry(rank: int, fn: Callable[..., None], world_size: int, init: str, args: tuple) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # A worker that finished skips the interpreter's teardown: there, a native thread of the
    # torch / TorchRec stack is sometimes destroyed while still joinable ("terminate called
    # without an active exception", SIGABRT with no Python frame; 1 in 3-6 runs of the
    # tracker test in a fresh clone, 0 in 20 with this exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., None], world_size: int, tmp_path: Path, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; re-raise failures.

    A Python exception in a worker (a failed assertion included) fails at once. A worker
    killed by a *signal* gets one more attempt of the whole group, a safety net for aborts in
    native code; a second abort fails the test. (The aborts seen so far came from interpreter
    teardown after a worker had finished, which workers now skip: see ``_entry``.)
    """
    for attempt in (1, 2):
        init = f"file://{tmp_path}/pg-{uuid.uuid4().hex}"
        try:
            mp.start_processes(
                _entry, args=(fn, world_size, init, args), nprocs=world_size, start_method="spawn"
            )
            return
        except mp.ProcessExitedException as e:
            if attempt == 2 or e.signal_name is None:
                raise
            warnings.warn(f"gloo worker killed by {e.signal_name}; retrying once", stacklevel=2)
