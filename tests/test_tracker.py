"""DeltaTracker on a real 2-rank gloo DMP: which ids the hooks deliver, per sharding type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from deltad.reference.trainer.data import Batch
from shardkit import EBC_TABLES, EC_TABLES, fed_ids, spawn, toy_dmp
from shardkit import batch as make_batch
from torch import nn

from deltad import knobs
from deltad.config import TrackerConfig
from deltad.errors import UnsupportedModelError
from deltad.publish.bitmaps import LookupBitmaps
from deltad.publish.tracker import DeltaTracker
from deltad.types import TrainLoop


def _ids(drained: list) -> dict[tuple[str, int], list[int]]:
    """(table, col_start) -> global ids, from a drain."""
    return {
        (s.shard.table, s.shard.col_start): (ids + s.shard.row_start).tolist() for s, ids in drained
    }


def _expected(tracker: DeltaTracker, fed: dict[str, set[int]]) -> dict[tuple[str, int], list]:
    return {
        (s.shard.table, s.shard.col_start): sorted(
            i for i in fed[s.shard.table] if s.shard.row_start <= i < s.shard.row_end
        )
        for s in tracker.shards
    }


def batch(rank: int, index: int) -> Batch:
    """Pooled features as a TensorDict (a sharded EBC must see one input type throughout:
    after a TensorDict it no longer permutes a KJT's keys); the pipeline test feeds KJTs."""
    return make_batch(rank, index, tensordict=True)


def _tracker_worker(rank: int, world_size: int) -> None:
    dmp = toy_dmp(world_size)
    assert not isinstance(dmp.module, nn.parallel.DistributedDataParallel)
    tracker = DeltaTracker(dmp)

    # Shards: every table with a local shard, CW shards with their column ranges, and weight
    # views that are the state_dict's local shards (the live TBE weights, not copies).
    shards = tracker.shards
    assert {s.shard.table for s in shards} >= {"e_rw", "e_cw", "e_twrw", "s_rw", "s_cw"}
    assert [s.shard.col_end - s.shard.col_start for s in shards if s.shard.table == "e_cw"] == [
        4,
        4,
    ]
    assert {t.name: t.sharding_type for t in tracker.tables} == {
        "e_tw": "table_wise",
        "e_rw": "row_wise",
        "e_cw": "column_wise",
        "e_twrw": "table_row_wise",
        "s_rw": "row_wise",
        "s_cw": "column_wise",
    }
    sd = dmp.state_dict()
    for s in shards:
        key = (
            f"{'ebc.embedding_bags' if s.kind == 'ebc' else 'ec.embeddings'}.{s.shard.table}.weight"
        )
        (local,) = [
            x.tensor
            for x in sd[key].local_shards()
            if x.metadata.shard_offsets[1] == s.shard.col_start
        ]
        assert local.data_ptr() == s.weight.data_ptr()
    before = {id(s): s.weight.clone() for s in shards}

    # Train two steps; the drained ids are exactly the ids fed
    # by all ranks that fall into each local shard, as global ids, and exactly the rows whose
    # values changed.
    fed = [batch(r, i) for r in range(world_size) for i in range(2)]
    for i in range(2):
        dmp(batch(rank, i))[0].backward()
    drained = tracker.drain()
    assert _ids(drained) == _expected(tracker, fed_ids(fed))
    for s, local in drained:
        changed = (s.weight != before[id(s)]).any(dim=1).nonzero().view(-1)
        assert torch.equal(changed, local), s.shard.table

    # Drained twice with no new batch: empty, no error.
    assert all(ids.numel() == 0 for _, ids in tracker.drain())

    # Paused (eval) forwards leave nothing; unpaused they would.
    dmp.eval()
    with tracker.paused():
        dmp(batch(rank, 5))
    assert all(ids.numel() == 0 for _, ids in tracker.drain())
    dmp(batch(rank, 5))
    assert any(ids.numel() for _, ids in tracker.drain())
    dmp.train()

    # One tracker at a time (a second would silently steal the hooks); detach removes them.
    with pytest.raises(UnsupportedModelError, match="already has a tracker"):
        DeltaTracker(dmp)
    tracker.detach()
    for mod in (dmp.module.ebc, dmp.module.ec):
        assert mod.post_lookup_tracker_fn is None and mod.post_odist_tracker_fn is None

    # Lookahead 1: ids of the last lookup stay owed after a drain; folded by the fold thread
    # (the default on CPU: lookups handed to it in batches, or one by one) or always in the
    # output dist's hook, alike.
    for background, batch_ids in ((True, 0), (True, knobs.FOLD_BATCH_IDS), (False, 0)):
        cfg = TrackerConfig(train_loop=TrainLoop.PIPELINE_FUSED_SPARSE_DIST)
        with knobs.override(FOLD_IN_BACKGROUND=background, FOLD_BATCH_IDS=batch_ids):
            ahead = DeltaTracker(dmp, cfg)
            _lookahead_case(ahead, background, batch_ids, rank, world_size, dmp)

    # fqns_to_skip leaves a module out.

    only_ebc = DeltaTracker(dmp, TrackerConfig(fqns_to_skip=("ec",)))
    assert {s.kind for s in only_ebc.shards} == {"ebc"}
    assert {t.name for t in only_ebc.tables} == set(EBC_TABLES)
    only_ebc.detach()

    # A data-parallel table: every rank updates its own replica, nobody owns the rows.
    dp = toy_dmp(world_size, {"e_tw": "data_parallel"})
    with pytest.raises(UnsupportedModelError, match="data-parallel"):
        DeltaTracker(dp)
    assert set(EC_TABLES) <= {t.name for t in tracker.tables}


def _lookahead_case(
    ahead: DeltaTracker, background: bool, batch_ids: int, rank: int, world_size: int, dmp: Any
) -> None:
    assert ahead.lookahead == 1 and (ahead._folder is not None) == background
    ids_a = _expected(ahead, fed_ids([batch(r, 10) for r in range(world_size)]))
    ids_b = _expected(ahead, fed_ids([batch(r, 11) for r in range(world_size)]))
    both = {k: sorted(set(ids_a[k]) | set(ids_b[k])) for k in ids_a}
    with torch.no_grad():
        dmp(batch(rank, 10))  # lookup of A (its update would come in the next step)
        lookups = ahead.stats.lookups
        if ahead._folder is not None:  # the toy's lookups are small: batched until the drain
            assert ahead._folder._submitted == (lookups if batch_ids == 0 else 0)
            assert ahead._folder.deferred == (0 if batch_ids == 0 else lookups)
        assert _ids(ahead.drain()) == ids_a
        assert _ids(ahead.drain()) == ids_a  # still owed: no newer lookup yet
        dmp(batch(rank, 11))
        assert _ids(ahead.drain()) == both
        assert _ids(ahead.drain()) == ids_b
    assert (ahead.stats.background_s > 0) == background
    ahead.detach()


def _fold_failure_worker(rank: int, world_size: int) -> None:
    """A fold that fails in the fold thread is raised by the drain behind it (and every
    later one), never turned into rows missing that lookup's; forwards go on (an error
    raised mid-forward on one rank would leave the others waiting in the output dist)."""
    dmp = toy_dmp(world_size)
    for batch_ids in (knobs.FOLD_BATCH_IDS, 0):  # handed over in a batch, one by one
        with knobs.override(FOLD_BATCH_IDS=batch_ids):
            _fold_failure_case(dmp, rank)


def _fold_failure_case(dmp: Any, rank: int) -> None:
    flaky = DeltaTracker(dmp)
    real_mark, calls = LookupBitmaps.mark, [0]

    def mark(self: LookupBitmaps, values: torch.Tensor, offsets: list[int]) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise IndexError("boom")
        real_mark(self, values, offsets)

    LookupBitmaps.mark = mark  # type: ignore[method-assign]
    expected = "folding tracked ids failed: boom"
    with torch.no_grad():
        dmp(batch(rank, 12))
        with pytest.raises(RuntimeError, match=expected):
            flaky.drain()
        dmp(batch(rank, 13))
        with pytest.raises(RuntimeError, match=expected):
            flaky.drain()
    assert calls[0] >= 2
    flaky.detach()
    LookupBitmaps.mark = real_mark  # type: ignore[method-assign]


def _fold_order_worker(rank: int, world_size: int) -> None:
    """Drains queued behind a fold thread that is held back hold exactly the lookups before
    them, whatever the timing: the thread is blocked while the forwards and drains run."""
    import threading

    def hold(tracker: DeltaTracker) -> threading.Event:
        go = threading.Event()
        assert tracker._folder is not None
        tracker._folder.submit(lambda: go.wait(60))
        return go

    def want(tracker: DeltaTracker, *indices: int) -> dict[tuple[str, int], list]:
        return _expected(
            tracker, fed_ids([batch(r, i) for r in range(world_size) for i in indices])
        )

    with knobs.override(MAX_PENDING_FOLDS=64):
        tracker = DeltaTracker(dmp := toy_dmp(world_size))
    with torch.no_grad():
        go = hold(tracker)
        dmp(batch(rank, 10))
        first = tracker.drain_deferred()
        dmp(batch(rank, 11))
        second = tracker.drain_deferred()
        dmp(batch(rank, 12))
        go.set()
        assert _ids(second.resolve()) == want(tracker, 11)  # resolved out of order
        assert _ids(first.resolve()) == want(tracker, 10)
        assert _ids(tracker.drain()) == want(tracker, 12)
        # Lookups still in the fold thread's batch (their output dist never ran, too): the drain
        # folds them.
        hooks = [(m, m.post_odist_tracker_fn) for m in tracker._modules.values()]
        for m, _ in hooks:
            m.post_odist_tracker_fn = None
        dmp(batch(rank, 13))
        for m, fn in hooks:
            m.post_odist_tracker_fn = fn
        assert tracker._folder is not None and tracker._folder.deferred  # (batched)
        assert _ids(tracker.drain()) == want(tracker, 13)
    tracker.detach()
    assert tracker._folder is None and _ids(tracker.drain()) == want(tracker)  # inline now

    # Lookahead 1, held back: the history is re-marked behind each queued swap, in order.
    with knobs.override(MAX_PENDING_FOLDS=64):
        ahead = DeltaTracker(dmp, TrackerConfig(train_loop=TrainLoop.PIPELINE_FUSED_SPARSE_DIST))
    with torch.no_grad():
        go = hold(ahead)
        dmp(batch(rank, 20))
        d1 = ahead.drain_deferred()
        dmp(batch(rank, 21))
        d2, d3 = ahead.drain_deferred(), ahead.drain_deferred()
        go.set()
        assert _ids(d1.resolve()) == want(ahead, 20)
        assert _ids(d2.resolve()) == want(ahead, 20, 21)
        assert _ids(d3.resolve()) == want(ahead, 21)
    ahead.detach()


def _managed_collision_worker(rank: int, world_size: int) -> None:
    """A sharded managed-collision EBC (built with TorchRec's own sharders, DistanceLFU
    eviction) is tracked: its table is declared managed-collision and its shard carries the
    slots' identities (tests/test_zch_trainer.py covers the segments)."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=64, feature_names=["f"])]
    mch = MCHManagedCollisionModule(
        zch_size=64,
        device=torch.device("cpu"),
        eviction_policy=DistanceLFU_EvictionPolicy(),
        eviction_interval=2,
        input_hash_size=1000,
    )
    model = nn.ModuleDict(
        {
            "mc": ManagedCollisionEmbeddingBagCollection(
                EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                ManagedCollisionCollection({"t": mch}, tables),
            )
        }
    )

    class CpuSharder(ManagedCollisionEmbeddingBagCollectionSharder):  # type: ignore[misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return ["row_wise"]

    sharders = [CpuSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={
            "t": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])
        },
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    tracker = DeltaTracker(dmp)
    (table,) = tracker.tables
    assert table.managed_collision and table.module == "mc._embedding_module"
    (shard,) = tracker.shards
    assert shard.mc is not None
    (ident,) = tracker.take_identities().values()
    assert ident.slots.numel() == 64 and ident.changed.numel() == 0
    tracker.detach()


def _pipeline_worker(rank: int, world_size: int) -> None:
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    for cls in (TrainPipelineBase, TrainPipelineSparseDist):
        dmp = toy_dmp(world_size)
        tracker = DeltaTracker(dmp)  # lookahead 0 is right for these pipelines:
        pipeline = cls(dmp, dmp.fused_optimizer, torch.device("cpu"))
        batches = iter([make_batch(rank, i) for i in range(4)])
        for step in range(4):
            before = [s.weight.clone() for s in tracker.shards]
            pipeline.progress(batches)
            # The drain point after progress() is a consistent cut: the drained rows are
            # exactly the rows the step changed (none of the next batch is looked up yet).
            for (shard, ids), old in zip(tracker.drain(), before, strict=True):
                changed = (shard.weight != old).any(dim=1).nonzero().view(-1)
                assert torch.equal(changed, ids), (cls.__name__, step, shard.shard.table)
        with pytest.raises(StopIteration):
            pipeline.progress(batches)
        if cls is TrainPipelineSparseDist:  # the EBC and EC really ran pipelined
            assert len(pipeline._pipelined_modules) == 2


@pytest.mark.slow
def test_tracker_ids_per_sharding_type(tmp_path: Path) -> None:
    spawn(_tracker_worker, 2, tmp_path)


@pytest.mark.slow
def test_a_failed_fold_is_raised_not_dropped(tmp_path: Path) -> None:
    spawn(_fold_failure_worker, 1, tmp_path)


@pytest.mark.slow
def test_drains_queued_behind_the_fold_thread_hold_their_own_lookups(tmp_path: Path) -> None:
    spawn(_fold_order_worker, 2, tmp_path)


@pytest.mark.slow
def test_managed_collision_modules_are_tracked(tmp_path: Path) -> None:
    spawn(_managed_collision_worker, 1, tmp_path)


@pytest.mark.slow
def test_drain_after_progress_is_a_consistent_cut_in_train_pipelines(tmp_path: Path) -> None:
    spawn(_pipeline_worker, 2, tmp_path)


def test_model_without_sharded_embeddings_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match="no sharded"):
        DeltaTracker(nn.Sequential(nn.Linear(4, 4)))
