"""Dense state: rank 0 publishes the model's dense parameters and buffers with its segments;
the sidecar serves the newest one at or before a window's head; consumers get rows and dense
weights of one step.

The trainer side runs a real 2-rank gloo DMP (the toy model of shardkit plus an MLP with a
BatchNorm, wrapped in DDP by DMP, trained by a dense Adagrad next to the fused optimizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deltad.reference.trainer.train import _optimizer, shard_model
from shardkit import Toy, batch, spawn
from torch import nn

from deltad.config import PublisherConfig
from deltad.publish.publisher import SegmentPublisher
from deltad.publish.tracker import DeltaTracker
from deltad.segment.format import read_dense, read_segment
from deltad.segment.spool import SpoolLayout

STEPS = 7
DENSE_NAMES = {
    "mlp.0.weight",
    "mlp.0.bias",
    "mlp.1.weight",
    "mlp.1.bias",
    "mlp.1.running_mean",
    "mlp.1.running_var",
    "mlp.1.num_batches_tracked",
    "mlp.2.weight",
    "mlp.2.bias",
}


class DenseToy(Toy):
    """The toy EBC + EC with a dense MLP (parameters and BatchNorm buffers) on top."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def forward(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        loss, _ = super().forward(b)
        x = torch.stack([b.seq.lengths()[:8].float(), *[b.seq.lengths()[:8].float() * 0.5] * 3], 1)
        loss = loss * 0.01 + self.mlp(x).pow(2).sum()
        return loss, loss.detach()


def dense_dmp(world_size: int) -> Any:
    torch.manual_seed(0)
    from shardkit import EBC_TABLES, EC_TABLES

    plan = {t: st for t, (st, _) in {**EBC_TABLES, **EC_TABLES}.items()}
    return shard_model(DenseToy(), plan, world_size=world_size, learning_rate=0.1)


def _train_worker(rank: int, world_size: int, spool: str, every: int) -> None:
    dmp = dense_dmp(world_size)
    opt = _optimizer(dmp, 0.05)
    cfg = PublisherConfig(Path(spool), model="toy", every_steps=1, dense_every_steps=every)
    pub = SegmentPublisher(dmp, DeltaTracker(dmp), cfg)
    gen = pub.start(0)
    truth: dict[int, dict[str, torch.Tensor]] = {
        0: {n: t.detach().clone() for n, t in pub.dense_tensors().items()}
    }
    for step in range(1, STEPS + 1):
        loss, _ = dmp(batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        truth[step] = {n: t.detach().clone() for n, t in pub.dense_tensors().items()}
        pub.maybe_publish(step)
    pub.close(STEPS)
    assert set(truth[0]) == DENSE_NAMES, sorted(truth[0])
    # replicated: every rank's dense parameters are the same at every step (DDP); buffers
    # (BatchNorm statistics) are each rank's own until DDP broadcasts rank 0's next forward
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, truth)
    for other in gathered[1:]:
        for step, state in truth.items():
            assert all(torch.equal(state[n], other[step][n]) for n in state if "running" not in n)
    assert not torch.equal(truth[0]["mlp.0.weight"], truth[STEPS]["mlp.0.weight"])
    assert int(truth[STEPS]["mlp.1.num_batches_tracked"]) == STEPS
    dist.barrier()
    if rank != 0:
        return
    layout = SpoolLayout(Path(spool), "toy")
    assert layout.dense_files(gen, 1) == []  # rank 0 publishes replicated state once
    files = layout.dense_files(gen, 0)
    seg_step = {seq: read_segment(p).header.step for seq, p in layout.segments(gen, 0)}
    # the base, the due ones, and the final segment (close(STEPS): a second one at STEPS)
    want_steps = [0, *(s for s in range(1, STEPS + 1) if every == 0 or s % every == 0), STEPS]
    assert [seg_step[seq] for seq, _ in files] == want_steps
    for seq, path in files:
        d = read_dense(path)
        assert d.header.seq == seq and d.header.step == seg_step[seq] and d.header.rank == 0
        state = truth[d.header.step]
        assert set(d.tensors) == DENSE_NAMES
        for name, t in state.items():
            assert d.tensors[name].dtype == t.dtype and torch.equal(d.tensors[name], t), name
    stats = pub.stats
    assert stats.dense_bytes == sum(read_dense(p).nbytes for _, p in files)
    assert [s.step for s in stats.segments if s.dense_bytes] == want_steps


@pytest.mark.slow
@pytest.mark.parametrize("every", [0, 3])
def test_dense_state_at_each_step_equals_the_trainers(tmp_path: Path, every: int) -> None:
    """2-rank gloo DMP: the dense state rank 0 published with the segment of step S equals
    the trainer's dense parameters and buffers after step S, bit for bit (every segment, or
    every 3 steps plus the base and the final segment)."""
    spawn(_train_worker, 2, tmp_path, str(tmp_path / "spool"), every)
