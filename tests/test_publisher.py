"""SegmentPublisher on a real 2-rank gloo DMP: base + deltas rebuild the tables bit-exactly."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit import batch, spawn, toy_dmp

from deltad import knobs
from deltad.buffers import BufferPool
from deltad.config import PublisherConfig, TrackerConfig
from deltad.errors import ConfigError, SpoolError
from deltad.publish.copier import RowCopier
from deltad.publish.publisher import SegmentPublisher
from deltad.publish.tracker import DeltaTracker
from deltad.segment.format import apply_segments, read_segment
from deltad.segment.spool import SpoolLayout, TableInfo
from deltad.types import SegmentKind, Shard, TrainLoop

MAX_STEPS = 200


def _gather(obj: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _full_tables(dmp: Any, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in dmp.state_dict().items():
        full = torch.empty(value.size()) if rank == 0 else None
        value.gather(dst=0, out=full)
        if full is not None:
            out[key.split(".")[-2]] = full
    return out


def _publisher_worker(rank: int, world_size: int, spool: str, blocked: str) -> None:
    dmp = toy_dmp(world_size)
    tracker = DeltaTracker(dmp)

    # An unwritable spool fails on every rank (none is left waiting in a collective).
    bad = SegmentPublisher(
        dmp, PublisherConfig(Path(blocked) / "spool", every_steps=1), tracker=tracker
    )
    with pytest.raises(SpoolError, match="not writable"):
        bad.start(0)
    with pytest.raises(SpoolError, match="not started"):
        bad.maybe_publish(1)

    # Time-based publishing: the decision is collective, so identical on every rank.
    cfg = PublisherConfig(Path(spool), model="toy", every_seconds=0.02, max_pending_writes=1)
    pub = SegmentPublisher(dmp, cfg, tracker=tracker)
    gen = pub.start(0)
    assert len(set(_gather(gen, world_size))) == 1
    published: list[int] = []
    step = 0
    while len(published) < 3 and step < MAX_STEPS:  # same on all ranks: published agrees
        step += 1
        dmp(batch(rank, step))[0].backward()
        if pub.maybe_publish(step) is not None:
            published.append(step)
    pub.close(step)
    with pytest.raises(SpoolError, match="closed"):
        pub.maybe_publish(step + 1)
    assert len(set(map(tuple, _gather(published, world_size)))) == 1
    assert len(published) == 3

    stats = pub.stats
    assert [s.seq for s in stats.segments] == list(range(len(published) + 2))
    assert [s.step for s in stats.segments] == [0, *published, step]
    assert stats.segments[0].kind is SegmentKind.BASE
    assert stats.segments[0].rows == sum(
        s.shard.row_end - s.shard.row_start for s in tracker.shards
    )
    assert all(s.write_s > 0 for s in stats.segments) and stats.rows > stats.segments[0].rows
    assert stats.calls == step and stats.stall_s > 0

    tables = _full_tables(dmp, rank)
    dist.barrier()
    if rank != 0:
        return
    layout = SpoolLayout(Path(spool), "toy")
    manifest = layout.read_manifest(gen)
    assert manifest.world_size == world_size and len(manifest.tables) == len(tables)
    segments = []
    for r in range(world_size):
        listed = layout.segments(gen, r)
        assert [seq for seq, _ in listed] == list(range(len(published) + 2))
        for _, path in listed:
            seg = read_segment(path)  # verifies the checksum
            assert seg.header.rank == r and seg.header.generation == gen
            segments.append(seg)
    segments.sort(key=lambda s: s.header.seq)
    rebuilt = apply_segments({}, segments)
    for name, full in tables.items():
        assert torch.equal(rebuilt[name], full), name


@pytest.mark.slow
def test_publisher_rebuilds_tables_bit_exactly(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    spawn(_publisher_worker, 2, tmp_path, str(tmp_path / "spool"), str(blocked))


def _background_copy_worker(rank: int, world_size: int, spool: str, barrier: bool) -> None:
    """Train with publishes every step while the copier is slowed down: each segment must
    still hold the rows as they were at its step (the next backward waits for the copy)."""
    real_copy = RowCopier.copy_rows

    def slow_copy(self: RowCopier, *args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread().name == "deltad-copier":
            time.sleep(0.2)  # far longer than the next step's forward
        return real_copy(self, *args, **kwargs)

    RowCopier.copy_rows = slow_copy  # type: ignore[method-assign]
    dmp = toy_dmp(world_size)
    tracker = DeltaTracker(dmp)
    if not barrier:  # the control: without the update barrier the copies read later rows
        tracker.add_update_barrier = lambda barrier, armed=None: None  # type: ignore[method-assign]
    cfg = PublisherConfig(Path(spool), model="toy", every_steps=1, fsync=False)
    pub = SegmentPublisher(dmp, cfg, tracker=tracker)
    gen = pub.start(0)
    assert pub._copier is not None  # CPU weights and a real tracker: copies in the background
    snapshots = {0: _full_tables(dmp, rank)}
    fired = [0]
    real_before_update = tracker._before_update

    def count_barrier(grad: torch.Tensor | None) -> None:
        fired[0] += 1
        real_before_update(grad)

    tracker._before_update = count_barrier  # type: ignore[method-assign]
    for step in range(1, 6):
        hooks, fired_before = tracker.stats.update_hooks, fired[0]
        copying = pub._copier.copying()
        dmp(batch(rank, step))[0].backward()
        # With a copy in flight (every step after the first: each copy is slowed far past
        # the next forward), every lookup of the forward (EBC: TW, RW, CW, TWRW; EC: RW, CW)
        # put the barrier on its output, and every one of them ran in the backward: no
        # lookup's gradient reaches its kernel's update without passing the barrier (not just
        # the first to run). With none in flight (step 1: only the base, copied in start())
        # no lookup pays for a gradient hook.
        assert copying == (step > 1)
        if barrier and copying:
            assert tracker.stats.update_hooks - hooks >= 4
        else:
            assert tracker.stats.update_hooks == hooks
        assert fired[0] - fired_before == tracker.stats.update_hooks - hooks
        stats = pub.maybe_publish(step)
        assert stats is not None and stats.rows == 0  # the loop did not copy: the copier will
        snapshots[step] = _full_tables(dmp, rank)
    if barrier:  # an untracked training step (tracking paused) still waits for the copy
        waits = pub.stats.barrier_waits
        with tracker.paused():
            dmp(batch(rank, 99))[0].backward()
        assert pub.stats.barrier_waits == waits + 1
    pub.close(5)  # no tracked lookup since step 5: the final segment is empty
    assert not tracker._barriers  # a closed publisher holds no backward back
    if barrier:
        assert pub.stats.barrier_waits >= 4  # every backward after a publish waited for it
        assert pub.stats.barrier_wait_s > 0 and pub.stats.barrier_wait_s <= pub.stats.stall_s
        assert all(s.rows > 0 and s.copy_s > 0 for s in pub.stats.segments[1:-1])
    dist.barrier()
    if rank != 0:
        return
    layout = SpoolLayout(Path(spool), "toy")
    by_seq: dict[int, list[Any]] = {}
    for r in range(world_size):
        for seq, path in layout.segments(gen, r):
            by_seq.setdefault(seq, []).append(read_segment(path))
    rebuilt: dict[str, torch.Tensor] = {}
    cuts_equal = []
    for seq in sorted(by_seq):
        rebuilt = apply_segments(rebuilt, by_seq[seq])
        want = snapshots[by_seq[seq][0].header.step]
        cuts_equal.append(all(torch.equal(rebuilt[n], t) for n, t in want.items()))
    assert len(cuts_equal) == 7 and cuts_equal[0]  # base, 5 deltas, the final one
    if barrier:
        assert all(cuts_equal), cuts_equal
    else:
        assert not all(cuts_equal), "the slowed copy should have overlapped an update"


@pytest.mark.slow
@pytest.mark.parametrize("barrier", [True, False], ids=["barrier", "control-without-barrier"])
def test_background_copies_are_a_consistent_cut(tmp_path: Path, barrier: bool) -> None:
    spawn(_background_copy_worker, 2, tmp_path, str(tmp_path / "spool"), barrier)


def _write_failure_worker(rank: int, world_size: int, spool: str) -> None:
    from deltad.serve.index.log import SegmentLog

    dmp = toy_dmp(world_size)
    tracker = DeltaTracker(dmp)
    cfg = PublisherConfig(
        Path(spool), model="toy", every_steps=1, max_pending_writes=1, rebase_retry_s=0
    )
    pub = SegmentPublisher(dmp, cfg, tracker=tracker)
    gen = pub.start(0)
    d = pub.layout.rank_dir(gen, 1)
    if rank == 1:  # rank 1's directory becomes unusable: its next segments cannot be written
        d.rename(d.with_name(d.name + ".moved"))
        d.write_text("not a directory")
    dist.barrier()
    for step in (1, 2, 3):  # training goes on, on every rank: no publish raises
        dmp(batch(rank, step))[0].backward()
        pub.maybe_publish(step)
        if rank == 1 and step == 1:
            deadline = time.monotonic() + 60
            while pub.stats.write_errors == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
    if rank == 1:  # every segment of steps 1-3 failed or was skipped (all before the restore)
        deadline = time.monotonic() + 60
        while pub.stats.write_errors + pub.stats.skipped_segments < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pub.stats.write_errors >= 1 and "cannot write" in pub.stats.last_write_error
        assert pub._writer.error is None
    dist.barrier()
    if rank == 1:  # space (here: the directory) returns
        d.unlink()
        d.with_name(d.name + ".moved").rename(d)
    dist.barrier()
    dmp(batch(rank, 4))[0].backward()
    stats = pub.maybe_publish(4)  # rank 1 answers with a fresh base, rank 0 a delta
    assert stats is not None and stats.kind is (SegmentKind.BASE if rank else SegmentKind.DELTA)
    pub.close(5)
    assert pub._writer.thread is not None and not pub._writer.thread.is_alive()
    tables = _full_tables(dmp, rank)
    dist.barrier()
    if rank == 0:  # what a sidecar of each rank serves rebuilds the trainer's tables exactly
        rebuilt: dict[str, torch.Tensor] = {}
        for r in range(world_size):
            log = SegmentLog(pub.layout, r)
            log.refresh()
            snap = log.snapshot()
            assert snap is not None and snap.head.step == 5
            apply_segments(rebuilt, [e.segment for e in snap.entries])
        assert rebuilt.keys() == tables.keys()
        assert all(torch.equal(rebuilt[n], t) for n, t in tables.items())
    dist.barrier()


@pytest.mark.slow
def test_a_failed_write_on_one_rank_never_stops_training_and_a_fresh_base_heals_it(
    tmp_path: Path,
) -> None:
    spawn(_write_failure_worker, 2, tmp_path, str(tmp_path / "spool"))


class _FakeTracker:
    """One CPU shard of a 64 x 4 table; ``drain`` returns the rows set by the test."""

    def __init__(self, weight: torch.Tensor) -> None:
        from deltad.publish.tracker import TrackedShard

        rows, dim = weight.shape
        self.shard = TrackedShard(
            module="m", kind="ec", sharding_type="row_wise",
            shard=Shard("t", rows, dim, 0, rows, 0, dim), weight=weight,
        )  # fmt: skip
        self.shards = [self.shard]
        self.tables = [TableInfo("t", rows, dim, "float32", "m", "ec", "row_wise")]
        self.next: torch.Tensor = torch.empty(0, dtype=torch.int64)
        #: rows a device cache (UVM caching) holds newer than ``weight``: {row: values}
        self.cached: dict[int, torch.Tensor] = {}

    def drain(self) -> list[tuple[Any, torch.Tensor]]:
        return [(self.shard, self.next)]

    def flush_caches(self) -> int:
        for row, values in self.cached.items():
            self.shard.weight[row] = values
        self.cached.clear()
        return 1


def test_pooled_copy_buffers_are_never_reused_while_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow writer with segments queued: every segment still holds its rows as published."""
    import deltad.publish.writer as writer_mod

    real_write = writer_mod.write_segment

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_segment", slow_write)
    weight = torch.zeros(64, 4)
    tracker = _FakeTracker(weight)
    cfg = PublisherConfig(tmp_path, model="toy", every_steps=1, max_pending_writes=2, fsync=False)
    pub = SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker)  # type: ignore[arg-type]
    gen = pub.start(0)
    gen_rows = torch.Generator().manual_seed(0)
    expected: list[tuple[torch.Tensor, torch.Tensor]] = []
    ptrs: set[int] = set()
    for step in range(1, 25):
        weight.add_(1.0)
        n = int(torch.randint(1, 64, (1,), generator=gen_rows))
        tracker.next = torch.randperm(64, generator=gen_rows)[:n].sort().values
        expected.append((tracker.next.clone(), weight[tracker.next].clone()))
        stats = pub.maybe_publish(step)
        assert stats is not None
        ptrs.update(b.data_ptr() for b in _pool_buffers(pub))
    pub.close(25)
    # Queued (2) + being written (1) + being filled (1), plus re-allocations as rows grew.
    assert len(ptrs) < 24
    layout = SpoolLayout(tmp_path, "toy")
    listed = layout.segments(gen, 0)
    assert len(listed) == 26  # base, 24 deltas, the final one
    for (ids, values), (_, path) in zip(expected, listed[1:25], strict=True):
        seg = read_segment(path)
        assert torch.equal(seg.shards[0].ids, ids)
        assert torch.equal(seg.shards[0].values, values)
    assert pub._writer.thread is not None and not pub._writer.thread.is_alive()


def _pool_buffers(pub: SegmentPublisher) -> list[torch.Tensor]:
    with pub._rows.pool._lock:
        return [b.base for b in pub._rows.pool._buffers]


def test_writer_thread_is_reniced(tmp_path: Path) -> None:
    tracker = _FakeTracker(torch.zeros(8, 4))
    cfg = PublisherConfig(tmp_path, model="toy", every_steps=1, fsync=False)
    pub = SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker)  # type: ignore[arg-type]
    with knobs.override(WRITER_NICE=7):
        pub.start(0)
        tracker.next = torch.tensor([1, 3])
        pub.publish(1)
        assert pub._writer.thread is not None and pub._writer.thread.native_id is not None
        deadline = time.monotonic() + 5
        while pub.stats.segments[-1].write_s == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer_nice = os.getpriority(os.PRIO_PROCESS, pub._writer.thread.native_id)
    assert writer_nice == min(main_nice + 7, 19)
    assert main_nice == os.getpriority(os.PRIO_PROCESS, 0)  # the loop's thread is untouched
    pub.close(2)
    with pytest.raises(ConfigError), knobs.override(WRITER_NICE=20):
        pass


def test_copy_buffer_pool_hands_out_the_smallest_free_buffer_that_fits() -> None:
    """The publisher's pool settings: 1/8 headroom, the smallest free buffer that fits, and
    free buffers a round did not use are dropped (rows grew)."""
    pool = BufferPool(min_bytes=0, granule=16, headroom=0.125)
    row = 4 * 4  # 4 float32 columns
    a, b, c = (pool.take((n, 4), torch.float32) for n in (80, 8, 40))
    sizes = {x.data_ptr(): x.untyped_storage().nbytes() for x in (a, b, c)}
    assert [sizes[x.data_ptr()] for x in (a, b, c)] == [90 * row, 9 * row, 45 * row]
    ptr_a, ptr_b, ptr_c = (x.data_ptr() for x in (a, b, c))
    del a, b, c
    pool.end_round()
    c2 = pool.take((30, 4), torch.float32)
    assert c2.data_ptr() == ptr_c  # not the first free one
    b2 = pool.take((9, 4), torch.float32)
    assert b2.data_ptr() == ptr_b
    del b2
    pool.end_round()  # a was not used this round: dropped
    d = pool.take((200, 4), torch.float32)  # rows grew: a new one
    assert d.data_ptr() not in (ptr_a, ptr_b) and d.untyped_storage().nbytes() == 225 * row
    pool.end_round()
    assert pool.nbytes == (45 + 225) * row  # b dropped too; c2 and d still referenced


def test_rows_a_device_cache_holds_are_flushed_before_they_are_read(tmp_path: Path) -> None:
    """UVM-caching kernels keep updated rows in a device cache; the weights deltad reads see
    them only after a flush. The base and every delta are read after one."""
    weight = torch.zeros(64, 4)
    tracker = _FakeTracker(weight)
    pub = SegmentPublisher(
        None,  # type: ignore[arg-type]
        PublisherConfig(tmp_path / "spool", every_steps=1, publish_dense=False),
        tracker=tracker,  # type: ignore[arg-type]
    )  # type: ignore[arg-type]
    tracker.cached = {5: torch.full((4,), 5.0)}
    gen = pub.start(0)
    tracker.cached = {3: torch.full((4,), 3.0)}
    tracker.next = torch.tensor([3])
    pub.maybe_publish(1)
    pub.close(1)
    layout = SpoolLayout(tmp_path / "spool", "model")
    base = read_segment(layout.segment_path(gen, 0, 0)).shards[0]
    delta = read_segment(layout.segment_path(gen, 0, 1)).shards[0]
    assert torch.equal(base.values[5], torch.full((4,), 5.0))
    assert delta.ids.tolist() == [3] and torch.equal(delta.values[0], torch.full((4,), 3.0))


def test_cache_flush_is_found_only_on_kernels_with_a_cache() -> None:
    from deltad.publish.tracker import cache_flush

    class Tbe:  # the attributes of fbgemm's SplitTableBatchedEmbeddingBagsCodegen used
        def __init__(self, cache_rows: int) -> None:
            self.lxu_cache_weights = torch.zeros(cache_rows, 4)
            self.flushed = 0

        def flush(self) -> None:
            self.flushed += 1

    class Fused:  # torchrec's BatchedFusedEmbedding(Bag) wraps the TBE
        def __init__(self, tbe: Tbe) -> None:
            self._emb_module = tbe

    assert cache_flush(Fused(Tbe(0))) is None  # CPU / HBM kernels: no cache
    cached = Tbe(16)
    flush = cache_flush(Fused(cached))
    assert flush is not None
    flush()
    assert cached.flushed == 1
    assert cache_flush(object()) is None


def _fake_publisher(spool: Path, generation: int | None) -> tuple[SegmentPublisher, _FakeTracker]:
    """A publisher of one 64 x 4 shard; no process group unless torch.distributed is up."""
    tracker = _FakeTracker(torch.zeros(64, 4))
    cfg = PublisherConfig(spool, model="toy", every_steps=1, fsync=False, generation=generation)
    return SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker), tracker  # type: ignore[arg-type]


def _run(pub: SegmentPublisher, tracker: _FakeTracker, steps: int) -> int:
    """start, ``steps`` delta segments, close; the generation."""
    gen = pub.start(0)
    for step in range(1, steps + 1):
        tracker.shard.weight.add_(1.0)
        tracker.next = torch.arange(step, step + 4)
        pub.publish(step)
    pub.close(steps + 1)
    return gen


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _refusal_worker(rank: int, world_size: int, spool: str) -> None:
    for requested in (5, 3):  # the existing generation, and a smaller one
        pub, _ = _fake_publisher(Path(spool), requested)
        with pytest.raises(SpoolError) as info:
            pub.start(0)
        # The same clear message on every rank: what exists, and what to pass instead.
        assert str(info.value).startswith(
            f"generation {requested} is not newer than generation 5, which already exists in"
        ), info.value
        assert "pass generation 6 or larger (--generation), or none" in str(info.value)
        assert pub.generation is None
        with pytest.raises(SpoolError, match="not started"):
            pub.publish(1)
    # No rank is left in a collective: the ranks go on together, and the default (time-based)
    # generation starts one newer than 5 on every rank.
    pub, tracker = _fake_publisher(Path(spool), None)
    gen = _run(pub, tracker, 2)
    assert gen > 5 and len(set(_gather(gen, world_size))) == 1


@pytest.mark.slow
def test_reused_or_smaller_generation_is_refused_on_every_rank(tmp_path: Path) -> None:
    """A restart with an existing generation id would overwrite that run's manifest and first
    segments and leave its later ones: refused on both ranks, the old files untouched."""
    spool = tmp_path / "spool"
    gen = _run(*_fake_publisher(spool, 5), 3)
    assert gen == 5
    layout = SpoolLayout(spool, "toy")
    before = _snapshot(layout.generation_dir(5))
    assert len(before) == 1 + 5  # manifest, base, 3 deltas, final
    spawn(_refusal_worker, 2, tmp_path, str(spool))
    assert _snapshot(layout.generation_dir(5)) == before
    assert layout.read_manifest(5).world_size == 1
    newest = layout.latest_generation()
    assert newest is not None and newest > 5
    assert [len(layout.segments(newest, r)) for r in range(2)] == [4, 4]


def test_default_generation_is_newer_than_the_spools_newest(tmp_path: Path) -> None:
    """A clock behind the spool's newest generation (a clock that went back, or a newest one
    that was given explicitly) still gives a new run a larger generation, or the sidecar,
    which only switches to a larger one, would never serve it."""
    spool = tmp_path / "spool"
    ahead = time.time_ns() + 10**15  # ~11.6 days ahead of the clock
    assert _run(*_fake_publisher(spool, ahead), 1) == ahead
    gen = _run(*_fake_publisher(spool, None), 1)
    assert gen == ahead + 1
    layout = SpoolLayout(spool, "toy")
    assert layout.latest_generation() == gen
    assert [s for s, _ in layout.segments(gen, 0)] == [0, 1, 2]
    assert [s for s, _ in layout.segments(ahead, 0)] == [0, 1, 2]
    # A generation directory without a manifest (a run that died before writing it) counts.
    layout.generation_dir(gen + 10).mkdir()
    assert _run(*_fake_publisher(spool, None), 0) == gen + 11


def test_new_generations_start_normally(tmp_path: Path) -> None:
    """An empty spool takes any requested generation; a larger one after it is accepted, the
    default one is time-based; each is a complete log of its own."""
    spool = tmp_path / "spool"
    layout = SpoolLayout(spool, "toy")
    assert _run(*_fake_publisher(spool, 7), 2) == 7
    assert _run(*_fake_publisher(spool, 8), 1) == 8
    t0 = time.time_ns()
    gen = _run(*_fake_publisher(spool, None), 1)
    assert t0 <= gen <= time.time_ns()
    assert layout.generations() == [7, 8, gen]
    for g, n in ((7, 4), (8, 3), (gen, 3)):
        assert layout.read_manifest(g).generation == g
        segs = [read_segment(p) for _, p in layout.segments(g, 0)]
        assert [s.header.seq for s in segs] == list(range(n))
        assert all(s.header.generation == g for s in segs)
    with pytest.raises(SpoolError, match=f"generation 9 is not newer than generation {gen}"):
        _fake_publisher(spool, 9)[0].start(0)
    with pytest.raises(SpoolError, match="out of range"):
        _fake_publisher(spool, -1)[0].start(0)
    assert layout.generations() == [7, 8, gen]


def _per_host_worker(rank: int, world_size: int, root: str) -> None:
    dmp = toy_dmp(world_size)
    tracker = DeltaTracker(dmp)
    spool = Path(root) / f"host-{rank}"  # a spool per host: one pod per rank, nothing shared
    pub = SegmentPublisher(dmp, PublisherConfig(spool, model="toy", every_steps=1), tracker=tracker)
    pub.start(0)
    dmp(batch(rank, 1))[0].backward()
    pub.maybe_publish(1)
    pub.close(1)


@pytest.mark.slow
def test_a_spool_per_host_gets_everything_its_sidecar_needs(tmp_path: Path) -> None:
    """With a spool per rank's host, rank 1's sidecar sees its generation (the manifest was
    rank 0's alone, so that sidecar never served) and serves base and deltas."""
    from deltad.serve.index.log import SegmentLog

    spawn(_per_host_worker, 2, tmp_path, str(tmp_path))
    manifests = []
    for rank in (0, 1):
        layout = SpoolLayout(tmp_path / f"host-{rank}", "toy")
        seglog = SegmentLog(layout, rank)
        seglog.refresh()
        snap = seglog.snapshot()
        assert snap is not None and snap.manifest.world_size == 2, rank
        assert [e.seq for e in snap.entries] == [0, 1, 2]
        manifests.append(layout.manifest_path(snap.generation).read_bytes())
    assert manifests[0] == manifests[1]


def test_the_train_loop_is_set_in_the_publisher_config(tmp_path: Path) -> None:
    """One config: a tracker passed in must track the loop PublisherConfig names."""
    tracker = _FakeTracker(torch.zeros(8, 4))
    tracker.config = TrackerConfig(train_loop=TrainLoop.PIPELINE_BASE)  # type: ignore[attr-defined]
    cfg = PublisherConfig(tmp_path, every_steps=1)
    with pytest.raises(ConfigError, match=r"PublisherConfig\.train_loop"):
        SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker)  # type: ignore[arg-type]
    cfg = PublisherConfig(tmp_path, every_steps=1, train_loop=TrainLoop.PIPELINE_BASE)
    pub = SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker)  # type: ignore[arg-type]
    assert pub.tracker is tracker
    with pytest.raises(ConfigError, match="must be a PublisherConfig"):
        SegmentPublisher(torch.nn.Module(), None, tracker=tracker)  # type: ignore[arg-type]
    named = PublisherConfig(tmp_path, every_steps=1, train_loop="pipeline-base")  # type: ignore[arg-type]
    assert named.train_loop is TrainLoop.PIPELINE_BASE
    with pytest.raises(ConfigError, match="train_loop"):
        PublisherConfig(tmp_path, every_steps=1, train_loop="bogus")  # type: ignore[arg-type]


def _timed_worker(rank: int, world_size: int, spool: str) -> None:
    """Time-based publishing with uneven step times (rank 1 sleeps): every rank publishes at
    the same steps, and a step that does not publish issues no collective of the publisher's
    (counted by wrapping torch.distributed's all_reduce and broadcast, and by its own stats).
    The publish's one all-reduce is issued by the copier thread (on the publisher's own
    group), so the loop issues none at all."""
    dmp = toy_dmp(world_size)
    cfg = PublisherConfig(Path(spool), model="toy", every_seconds=0.6, fsync=False)
    pub = SegmentPublisher(dmp, cfg)
    calls = [0]  # issued by the training loop's thread
    off_loop: list[str] = []  # the threads that issued the others
    loop_thread = threading.current_thread()
    real = {n: getattr(dist, n) for n in ("all_reduce", "broadcast")}

    def counting(name: str) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is loop_thread:
                calls[0] += 1
            else:
                off_loop.append(threading.current_thread().name)
            return real[name](*a, **kw)

        return call

    for n in real:
        setattr(dist, n, counting(n))
    try:
        pub.start(0)
        published: list[int] = []
        per_step: list[tuple[int, int, int]] = []  # (step, wrapped calls, publisher's count)
        step = 0
        while len(published) < 4 and step < MAX_STEPS:
            step += 1
            dmp(batch(rank, step))[0].backward()
            time.sleep(0.005 if rank == 0 else 0.03)  # uneven: rank 1 is much slower
            before, own = calls[0], pub.stats.collectives
            if pub.maybe_publish(step) is not None:
                published.append(step)
            per_step.append((step, calls[0] - before, pub.stats.collectives - own))
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    issued_off_loop = len(off_loop)
    pub.close(step)
    assert len(published) == 4
    assert len(set(map(tuple, _gather(published, world_size)))) == 1
    for s, wrapped, own in per_step:
        assert (wrapped, own) == ((0, 1) if s in published else (0, 0)), (s, wrapped, own)
    # each publish's all-reduce was issued by the copier before the next backward could
    # update a row (it issues before it copies, and the backward waits for the copy); the
    # last one may be issued by close()
    assert issued_off_loop >= len(published) - 1
    assert set(off_loop) == {"deltad-copier"}, off_loop
    # the first publish (step 1) measured the pace: later ones are several steps apart
    gaps = [b - a for a, b in itertools.pairwise(published)]
    assert published[0] == 1 and max(gaps) > 1, published


@pytest.mark.slow
def test_time_based_publishing_agrees_on_every_rank_without_a_per_step_collective(
    tmp_path: Path,
) -> None:
    spawn(_timed_worker, 2, tmp_path, str(tmp_path / "spool"))


def test_time_based_publishing_predicts_the_step_of_the_next_publish(tmp_path: Path) -> None:
    """One process: the first step publishes (nothing measured), then the next publish is
    predicted from the measured pace, and is decided without waiting for the clock."""
    tracker = _FakeTracker(torch.zeros(64, 4))
    cfg = PublisherConfig(tmp_path, model="toy", every_seconds=0.1, fsync=False)
    pub = SegmentPublisher(torch.nn.Module(), cfg, tracker=tracker)  # type: ignore[arg-type]
    pub.start(0)
    published = []
    for step in range(1, 40):
        time.sleep(0.01)
        tracker.next = torch.arange(step % 60, step % 60 + 4)
        if pub.maybe_publish(step) is not None:
            published.append(step)
    pub.close(40)
    assert published[0] == 1
    gaps = [b - a for a, b in itertools.pairwise(published)]
    # ~10 steps of 10 ms per 0.1 s (a loaded machine only makes steps longer: fewer steps)
    assert gaps and all(1 <= g <= 11 for g in gaps) and max(gaps) >= 3
    assert pub.stats.collectives == 0  # not distributed


def _found_then_raised_together(
    dmp: Any, pub: SegmentPublisher, rank: int, step: int, rank1_error: str
) -> None:
    """Rank 1's failure is found by the publish at ``step`` (nobody raises yet), the next
    step trains on both ranks, and both raise at the call after it: rank 1 its own error,
    rank 0 that another rank failed."""
    assert pub.maybe_publish(step) is not None
    dmp(batch(rank, step + 1))[0].backward()
    with pytest.raises(SpoolError) as info:
        pub.maybe_publish(step + 1)
    expected = rank1_error if rank == 1 else "failed on another rank"
    assert expected in str(info.value)


def _agreement_worker(rank: int, world_size: int, spool: str, flag: str) -> None:
    """The publish's all-reduce is waited for at the next call: a rank's publish returns
    before a slower rank has reached its own; a fatal failure on one rank raises on both,
    together, at the call after the publish that found it, and the step between them trains
    on both ranks (nobody is left alone in a collective)."""
    import deltad.publish.writer as writer_mod

    dmp = toy_dmp(world_size)
    tracker = DeltaTracker(dmp)
    cfg = PublisherConfig(Path(spool), model="toy", every_steps=1, fsync=False)
    pub = SegmentPublisher(dmp, cfg, tracker=tracker)
    pub.start(0)
    published = Path(flag)
    dmp(batch(rank, 1))[0].backward()
    if rank == 1:  # rank 1 reaches the publish only once rank 0 has come back from its own
        deadline = time.monotonic() + 60
        while not published.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert published.exists(), "rank 0's publish waited for rank 1"
    before = pub.stats.collectives
    assert pub.maybe_publish(1) is not None
    if rank == 0:
        published.write_text("1")
    assert pub.stats.collectives == before + 1  # the publish's one all-reduce

    if rank == 1:  # once segment 1 is written, every write of rank 1 fails in a way no
        # fresh base heals
        deadline = time.monotonic() + 60
        while pub.stats.segments[-1].write_s == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.stats.segments[-1].write_s > 0

        def broken(*a: Any, **kw: Any) -> None:
            raise RuntimeError("segment encoder bug")

        writer_mod.write_segment = broken  # type: ignore[assignment]
    dmp(batch(rank, 2))[0].backward()
    assert pub.maybe_publish(2) is not None  # rank 1's writer fails on this segment, later
    if rank == 1:
        deadline = time.monotonic() + 60
        while pub._writer.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(pub._writer.error, RuntimeError)
    dist.barrier()
    dmp(batch(rank, 3))[0].backward()
    _found_then_raised_together(dmp, pub, rank, 3, "segment encoder bug")
    with pytest.raises(SpoolError):  # close stops the threads; the failure stays reported
        pub.close(4)
    assert pub._writer.thread is not None and not pub._writer.thread.is_alive()


def test_the_publish_agreement_is_waited_for_a_step_later_and_a_failure_raises_on_every_rank(
    tmp_path: Path,
) -> None:
    spawn(_agreement_worker, 2, tmp_path, str(tmp_path / "spool"), str(tmp_path / "published"))


def _dead_copier_worker(rank: int, world_size: int, spool: str) -> None:
    """The copier issues each publish's all-reduce on the publisher's own group. When rank 1's
    copier is gone, its publish finds it, the all-reduce it would have issued is issued by the
    next call instead, and both ranks raise there together (nobody waits forever in it)."""
    dmp = toy_dmp(world_size)
    cfg = PublisherConfig(Path(spool), model="toy", every_steps=1, fsync=False)
    pub = SegmentPublisher(dmp, cfg)
    pub.start(0)
    assert pub._copier is not None and pub._ranks._side is not None  # gloo, CPU weights
    dmp(batch(rank, 1))[0].backward()
    assert pub.maybe_publish(1) is not None
    dmp(batch(rank, 2))[0].backward()
    if rank == 1:  # the copier thread ends (as if it had died)
        pub._copier._queue.put(None)
        pub._copier.thread.join(30)
        assert not pub._copier.alive()
    _found_then_raised_together(dmp, pub, rank, 2, "copier thread stopped")


@pytest.mark.slow
def test_a_dead_copier_raises_on_every_rank_though_it_never_issued_its_all_reduce(
    tmp_path: Path,
) -> None:
    spawn(_dead_copier_worker, 2, tmp_path, str(tmp_path / "spool"))
