"""Managed-collision (ZCH) tables on the trainer: tracked under DMP (gloo), published with
their slots' raw ids, and rebuilt bit-exactly from base + segments at every published step
(rows, slot -> raw id map, and the MCH remapper buffers derived from it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from deltad.reference.trainer.data import Batch
from deltad.reference.trainer.train import shard_model
from deltad.reference.trainer.zch import mc_module
from shardkit import spawn
from torch import nn
from torchrec import KeyedJaggedTensor

from deltad.config import PublisherConfig, TrackerConfig
from deltad.errors import UnsupportedModelError
from deltad.publish.copier import RowCopier
from deltad.publish.mc import slot_raw_ids
from deltad.publish.publisher import SegmentPublisher
from deltad.publish.tracker import DeltaTracker
from deltad.segment.format import read_segment
from deltad.segment.spool import SpoolLayout
from deltad.types import EMPTY_RAW_ID, SegmentKind, TrainLoop

SLOTS = 32  # per table (row-wise: split over the ranks)
RAW_IDS = 1000  # >= 10x the slots: ids are admitted and evicted all the time
DIM = 8
STEPS = 8


class McToy(nn.Module):
    """One MC table (EBC or EC) plus one ordinary EBC table, no dense parameters."""

    def __init__(self, kind: str, policy: str, buckets: int, interval: int = 2) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        meta = torch.device("meta")
        self.kind = kind
        self.mc = mc_module(
            kind,
            "z",
            "fz",
            slots=SLOTS,
            raw_ids=RAW_IDS,
            dim=DIM,
            policy=policy,
            eviction_interval=interval,
            buckets=buckets,
            device=meta,
        )
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="p", embedding_dim=DIM, num_embeddings=16, feature_names=["fp"]
                )
            ],
            device=meta,
        )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.ebc(batch.sparse).values().sum()
        if self.kind == "ebc":
            loss = loss + self.mc(batch.seq)[0].values().sum()
        else:
            loss = loss + self.mc(batch.seq)[0]["fz"].values().sum()
        return loss, loss.detach()


def mc_batch(rank: int, index: int, size: int = 8, *, fresh: bool = False) -> Batch:
    """Raw ids drawn from a window that slides over the raw-id space (old ids go cold, new
    ones arrive: LRU and LFU both evict), deterministic in (rank, index). ``fresh``: each
    batch's window is new (every eviction replaces slots the batch before looked up)."""
    g = torch.Generator().manual_seed(7919 * rank + index)
    lengths = torch.randint(1, 4, (size,), generator=g)
    n = int(lengths.sum())
    start = (index * (61 if fresh else 37)) % (
        RAW_IDS // 2 - 60
    )  # in both halves: each rank owns one at ws 2
    raw = start + torch.randint(0, 60, (n,), generator=g)
    raw += (RAW_IDS // 2) * torch.randint(0, 2, (n,), generator=g)
    seq = KeyedJaggedTensor.from_lengths_sync(["fz"], raw, lengths)
    pl = torch.randint(0, 3, (size,), generator=g)
    pooled = KeyedJaggedTensor.from_lengths_sync(
        ["fp"], torch.randint(0, 16, (int(pl.sum()),), generator=g), pl
    )
    return Batch(torch.zeros(size, 1), pooled, seq, torch.zeros(size))


def mc_dmp(world_size: int, kind: str, policy: str, interval: int = 2) -> Any:
    return shard_model(
        McToy(kind, policy, world_size, interval),
        {"z": "rw", "p": "tw"},
        world_size=world_size,
        learning_rate=0.1,
    )


def _mch(dmp: Any) -> Any:
    return dmp.module.mc._managed_collision_collection._managed_collision_modules["z"]


def _state(tracker: DeltaTracker, dmp: Any) -> dict[str, Any]:
    """The trainer's state now: every local shard's rows, the MC shard's slot map and its
    MCH remapper buffers."""
    mch = _mch(dmp)
    return {
        "rows": {s.shard.table: s.weight.detach().clone() for s in tracker.shards},
        "slots": slot_raw_ids(mch),
        "sorted": mch._mch_sorted_raw_ids.clone(),
        "mapping": mch._mch_remapped_ids_mapping.clone(),
    }


def _rebuild_worker(
    rank: int, world_size: int, spool: str, kind: str, policy: str, loop: str, slow: bool = False
) -> None:
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    if slow:  # the copier far behind the loop: the next forward's eviction must wait for it
        real_copy = RowCopier.copy_rows

        def slow_copy(self: RowCopier, *args: Any, **kwargs: Any) -> torch.Tensor:
            if threading.current_thread().name == "deltad-copier":
                time.sleep(0.1)
            return real_copy(self, *args, **kwargs)

        RowCopier.copy_rows = slow_copy  # type: ignore[method-assign]
    torch.manual_seed(rank)
    # slow: evict at every forward, each batch's ids all new and more than the slots, so that
    # every eviction resets slots the segment before it lists (the rows the copier reads)
    dmp = mc_dmp(world_size, kind, policy, 1 if slow else 2)
    train_loop = TrainLoop(loop)
    cfg = PublisherConfig(
        Path(spool), model="mc", every_steps=1, fsync=False, train_loop=train_loop
    )
    pub = SegmentPublisher(dmp, cfg)
    (info,) = [t for t in pub.tracker.tables if t.name == "z"]
    assert info.managed_collision and info.sharding_type == "row_wise"
    assert info.module == "mc._embedding_module" and info.kind == kind
    assert not [t for t in pub.tracker.tables if t.name == "p" and t.managed_collision]
    # The MCH buffers are identities, never dense state (they differ per rank).
    assert not [n for n in pub.dense_tensors() if "managed_collision" in n]
    pub.start(0)
    assert pub._copier is not None  # rows are copied in the background (CPU weights)
    states = {0: _state(pub.tracker, dmp)}
    batches = iter([mc_batch(rank, i, 32 if slow else 8, fresh=slow) for i in range(STEPS)])
    if train_loop is TrainLoop.PLAIN:
        opt = dmp.fused_optimizer

        def step_fn() -> None:
            dmp(next(batches))[0].backward()
            opt.step()
    else:
        cls = (
            TrainPipelineBase if train_loop is TrainLoop.PIPELINE_BASE else TrainPipelineSparseDist
        )
        pipeline = cls(dmp, dmp.fused_optimizer, torch.device("cpu"))

        def step_fn() -> None:
            pipeline.progress(batches)

    gen = pub.generation
    assert gen is not None
    for step in range(1, STEPS + 1):
        step_fn()
        if step == STEPS // 2:  # a sidecar's request: a fresh base (the whole map) mid-run
            pub.layout.rebase_request_path(gen, rank).touch()
        pub.maybe_publish(step)
        # the state right after the publish call is the segment's cut (the background copy
        # still runs; the next forward's MC compute waits for it)
        states[step] = _state(pub.tracker, dmp)
    if train_loop is TrainLoop.PIPELINE_SPARSE_DIST:
        assert len(pipeline._pipelined_modules) == 2  # the MC module ran pipelined too
    pub.close(STEPS)

    layout = SpoolLayout(Path(spool), "mc")
    assert layout.generations() == [gen]
    manifest = layout.read_manifest(gen)
    assert next(t for t in manifest.tables if t.name == "z").managed_collision
    segs = [read_segment(p) for _, p in layout.segments(gen, rank)]
    assert segs[0].header.kind is SegmentKind.BASE
    assert segs[STEPS // 2].header.kind is SegmentKind.BASE  # the fresh base
    assert segs[0].header.format_version == 3
    rows: dict[str, torch.Tensor] = {}
    slots = torch.empty(0, dtype=torch.int64)
    evictions = changed_slots = 0
    mch = _mch(dmp)
    offset = int(mch._output_global_offset)
    for seg in segs:
        want = states[seg.header.step]
        for sh in seg.shards:
            local = sh.ids - sh.shard.row_start
            if seg.header.kind is SegmentKind.BASE:
                rows[sh.shard.table] = sh.values.clone()
            else:
                rows[sh.shard.table][local] = sh.values
            if sh.shard.table != "z":
                assert sh.raw_ids is None and sh.evicted is None
                continue
            assert sh.raw_ids is not None and sh.evicted is not None
            assert sh.shard.row_start == offset
            old = slots.clone()
            if seg.header.kind is SegmentKind.BASE:
                assert torch.equal(local, torch.arange(SLOTS // world_size))
                slots = sh.raw_ids.clone()
            else:
                slots[local] = sh.raw_ids
                # every slot whose identity changed is listed
                moved = (old != want["slots"]).nonzero().view(-1)
                assert torch.isin(moved, local).all(), (seg.header.step, moved, local)
                changed_slots += moved.numel()
                # evicted: exactly the raw ids held before and by no slot now
                gone = old[(old != EMPTY_RAW_ID) & ~torch.isin(old, slots)]
                assert torch.equal(sh.evicted, torch.unique(gone)), seg.header.step
                evictions += sh.evicted.numel()
        # bit-exact at this step: rows, the slot map, and the remapper buffers it implies
        for table, t in rows.items():
            assert torch.equal(t, want["rows"][table]), (seg.header.step, table)
        assert torch.equal(slots, want["slots"]), seg.header.step
        assert torch.equal(torch.sort(slots).values, want["sorted"]), seg.header.step
        held = want["sorted"] != EMPTY_RAW_ID
        assert torch.equal(slots[want["mapping"][held] - offset], want["sorted"][held])
    assert changed_slots > 0 and evictions > 0, "the test must admit and evict ids"
    assert (slots != EMPTY_RAW_ID).sum() > 0


CASES = [
    # (world size, kind, policy, loop)
    (1, "ebc", "lru", "plain"),
    (1, "ec", "lfu", "plain"),
    (2, "ebc", "lfu", "pipeline-sparse-dist"),
    (2, "ec", "lru", "pipeline-sparse-dist"),
    (2, "ebc", "lru", "plain"),
    (1, "ec", "lru", "pipeline-sparse-dist"),
    (2, "ec", "lfu", "pipeline-base"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_a_slow_background_copy_holds_back_the_next_eviction(tmp_path: Path, kind: str) -> None:
    spawn(_rebuild_worker, 1, tmp_path, str(tmp_path / "spool"), kind, "lfu", "plain", True)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "kind", "policy", "loop"), CASES)
def test_mc_tables_rebuild_bit_exactly_from_base_and_segments_at_every_step(
    tmp_path: Path, world_size: int, kind: str, policy: str, loop: str
) -> None:
    spawn(_rebuild_worker, world_size, tmp_path, str(tmp_path / "spool"), kind, policy, loop)


def _refusals_worker(rank: int, world_size: int) -> None:
    """What deltad and TorchRec 1.8 refuse for MC tables, and detach."""
    # TorchRec 1.8 shards MC tables row-wise only (ManagedCollisionCollectionSharder); the
    # planner finds no option for any other sharding, on CPU as on GPU. (World size 1: the
    # planner raises on rank 0 only, which would leave other ranks in its broadcast.)
    for other in ("tw", "cw", "twrw"):
        with pytest.raises(Exception, match=r"(?i)sharding|no .*option|plan"):
            shard_model(
                McToy("ebc", "lru", world_size),
                {"z": other, "p": "tw"},
                world_size=world_size,
                learning_rate=0.1,
            )
    dmp = mc_dmp(world_size, "ec", "lru")
    # A train loop whose next forward (eviction, remap) runs before the publish: refused.
    with pytest.raises(UnsupportedModelError, match="managed-collision"):
        DeltaTracker(dmp, TrackerConfig(train_loop=TrainLoop.PIPELINE_FUSED_SPARSE_DIST))
    mcc = dmp.module.mc._managed_collision_collection
    assert "compute" not in mcc.__dict__  # the refused tracker left nothing behind
    tracker = DeltaTracker(dmp)
    with pytest.raises(UnsupportedModelError, match="already has a tracker"):
        DeltaTracker(dmp)
    # Looked-up slots are tracked through the lookup modules' forward hooks.
    dmp(mc_batch(rank, 0))[0].backward()
    drained = {s.shard.table: ids for s, ids in tracker.drain()}
    assert drained["z"].numel() > 0
    tracker.detach()
    assert "compute" not in mcc.__dict__ and "evict" not in mcc.__dict__
    dmp(mc_batch(rank, 1))[0].backward()
    again = DeltaTracker(dmp)  # detached: a new tracker may attach
    assert all(ids.numel() == 0 for _, ids in again.drain())
    again.detach()


@pytest.mark.slow
def test_mc_tables_shard_row_wise_only_and_unsafe_loops_are_refused(tmp_path: Path) -> None:
    spawn(_refusals_worker, 1, tmp_path)


def test_slot_identities_diff_the_map_and_report_the_raw_ids_evicted() -> None:
    from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from deltad.publish.mc import McShardState

    mch = MCHManagedCollisionModule(
        zch_size=8,
        device=torch.device("cpu"),
        eviction_policy=LRU_EvictionPolicy(),
        eviction_interval=1,
        input_hash_size=100,
    ).train()

    def feed(*ids: int) -> None:
        values = torch.tensor(ids, dtype=torch.int64)
        mch({"f": JaggedTensor(values=values, lengths=torch.tensor([len(ids)]))})

    state = McShardState(mch, 8)
    assert torch.equal(state.last, torch.full((8,), EMPTY_RAW_ID))
    feed(10, 11, 12)
    first = state.take()
    assert sorted(first.slots[first.changed].tolist()) == [10, 11, 12]
    assert first.evicted.numel() == 0
    assert torch.equal(slot_raw_ids(mch), first.slots)
    # Nothing changed: nothing owed; a reset row is owed even with its raw id unchanged.
    assert state.take().changed.numel() == 0
    state.mark_reset(torch.tensor([3]))
    assert state.take().changed.tolist() == [3]
    # More new ids than free slots (the last slot is the MCH's miss slot, never filled):
    # LRU evicts the least recently seen ids.
    feed(20, 21, 22, 23, 24, 25, 26)
    feed(30, 31, 32, 33)
    second = state.take()
    held = set(second.slots.tolist()) - {EMPTY_RAW_ID}
    assert {30, 31, 32} <= held and second.slots[-1] == EMPTY_RAW_ID
    gone = {10, 11, 12} - held
    assert gone and second.evicted.tolist() == sorted(gone)
    moved = (first.slots != second.slots).nonzero().view(-1)
    assert torch.equal(moved, second.changed)
