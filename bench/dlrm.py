"""The reference DLRM (trainer.model.ClickModel) sharded with DistributedModelParallel.

Used by the tracking and stall benchmarks inside one spawned worker process (gloo, world
size 1). Embedding tables get a fused in-backward SGD (TorchRec's CPU path); the dense part is
wrapped in DDP by DMP (``init_data_parallel``), which TorchRec's ModelDeltaTracker expects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DlrmSize:
    """Model and batch size; ``reference()`` takes ~0.5 s per step on 2 cores."""

    tables: int = 4
    rows: int = 1_000_000
    seq_rows: int = 1_000_000
    dim: int = 64
    batch: int = 4096
    pooling: int = 8
    seq_len: int = 16

    @classmethod
    def reference(cls) -> DlrmSize:
        return cls()

    @classmethod
    def small(cls) -> DlrmSize:
        return cls(tables=2, rows=50_000, seq_rows=50_000, dim=32, batch=512, pooling=4, seq_len=4)

    @classmethod
    def tiny(cls) -> DlrmSize:
        return cls(tables=2, rows=2_000, seq_rows=2_000, dim=8, batch=64, pooling=2, seq_len=2)

    def table_rows(self) -> dict[str, int]:
        return {f"t{i}": self.rows for i in range(self.tables)}


def init_single_process_group() -> None:
    """gloo, world size 1, on a free local port (idempotent)."""
    import torch.distributed as dist

    from bench.common import free_port

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


def build(size: DlrmSize, *, lr: float = 0.05, seed: int = 0) -> tuple[Any, Any, Any]:
    """(dmp_model, dense_optimizer, click_stream) for ``size`` on CPU."""
    import torch.distributed as dist
    from deltad.reference.trainer.data import ClickStream
    from deltad.reference.trainer.model import ClickModel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    init_single_process_group()
    torch.manual_seed(seed)
    model = ClickModel(  # ordinary tables, as recorded (managed-collision tables: bench.zch)
        size.table_rows(), size.seq_rows, dim=size.dim, zch_slots=0, device=torch.device("meta")
    )
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": lr})
    apply_optimizer_in_backward(torch.optim.SGD, model.ec.parameters(), {"lr": lr})
    dmp = DistributedModelParallel(
        module=model, device=torch.device("cpu"), env=None, init_data_parallel=True
    )
    assert dist.is_initialized()
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=lr),
    )
    stream = ClickStream(
        size.table_rows(),
        size.seq_rows,
        batch_size=size.batch,
        pooling=size.pooling,
        seq_len=size.seq_len,
        seed=seed,
    )
    return dmp, dense, stream


def train_step(dmp: Any, dense: Any, batch: Any) -> float:
    """One forward / backward / step; returns the loss."""
    dense.zero_grad()
    loss, _ = dmp(batch)
    loss.backward()
    dense.step()
    return float(loss.detach())
