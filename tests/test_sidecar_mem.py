"""The sidecar's memory near the data (issue #16 item 4): the window cache's budget holds the
windows being streamed too (a window that does not fit is streamed, not kept), and a base
window larger than the window cache is served from a spilled merged base (an unnamed file)
instead of being merged again for every bootstrap; bit-equal, invalidated by a new generation
or a retention merge."""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from serverkit import Client, Replica, SpoolWriter, redis_server, server_config, wait_for
from spoolkit import FakeTrainer

from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.index.merge import merge_entries
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.windows.cache import WindowCache
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.spec import WindowSpec
from deltad.store import EmbeddedRedis
from deltad.types import Form, WireDtype

DELTAS = 21

__all__ = ["redis_server"]


def _snapshot(tmp_path: Path) -> LogSnapshot:
    ft = FakeTrainer(tmp_path, world_size=1, tables={"t0": (300, 8), "t1": (120, 4)})
    ft.start(0)
    for s in range(1, DELTAS + 1):
        ft.step(s * 10, touch=40)
    log = SegmentLog(SpoolLayout(tmp_path, "m"), 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and len(snap.entries) == DELTAS + 1
    return snap


def _base_spec(
    snap: LogSnapshot, to: int, form: Form, dtype: WireDtype, **kw: object
) -> WindowSpec:
    return WindowSpec(
        0,
        snap.generation,
        True,
        -1,
        to,
        form,
        dtype,
        (),
        0,
        0.0,
        0,
        1024,
        **kw,  # type: ignore[arg-type]
    )


def _window(snap: LogSnapshot, spec: WindowSpec, **kw: object) -> tuple[bytes, bytes, int]:
    w = build_window(snap, spec, spec.to_seq * 10, {}, lazy=False, **kw)  # type: ignore[arg-type]
    return w.header, b"".join(w.chunks), w.rows


@pytest.mark.parametrize(
    ("form", "dtype", "align"),
    [
        (Form.ROWS, WireDtype.FP32, 0),
        (Form.ROWS, WireDtype.FP16, 0),
        (Form.ROWS, WireDtype.BF16, 0),
        (Form.ROWS, WireDtype.INT8, 0),
        (Form.ROWS, WireDtype.PACKED_INT4, 8),
        (Form.IDS, WireDtype.FP32, 0),
    ],
)
def test_base_windows_from_the_spill_equal_merged_ones(
    tmp_path: Path, form: Form, dtype: WireDtype, align: int
) -> None:
    snap = _snapshot(tmp_path)
    runs = RunCache(1 << 30)
    spill = SpillStore(tmp_path / "spill", 1 << 30, only_when_merged=False)
    for to in [*range(0, DELTAS + 1), 3, 1]:  # (older heads than the spill: from the base)
        spec = _base_spec(snap, to, form, dtype, row_alignment=align)
        want = _window(snap, spec)
        assert _window(snap, spec, runs=runs, spill=spill) == want, to
    # every base window at a head from the first delta on used a spill; spilled again at
    # most once per head (when the deltas after it would be merged whole, or more than
    # REFRESH_AFTER of them)
    assert spill.hits == DELTAS
    assert 1 <= spill.built <= DELTAS // 2, spill.built  # (6 here: reused across heads)
    assert 0 < spill.nbytes <= spill.max_bytes


def test_the_spill_is_reused_and_has_no_name(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    runs = RunCache(1 << 30)
    spill = SpillStore(tmp_path / "spill", 1 << 30, only_when_merged=False)
    spec = _base_spec(snap, DELTAS, Form.ROWS, WireDtype.FP32)
    first = _window(snap, spec, runs=runs, spill=spill)
    for _ in range(3):
        assert _window(snap, spec, runs=runs, spill=spill) == first
    assert spill.built == 1 and spill.hits == 4
    # nothing in its 0700 directory has a name; the mapping is of a deleted / unnamed file
    d = tmp_path / "spill"
    assert os.listdir(d) == []
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert spill.current is not None
    maps = Path("/proc/self/maps").read_text()
    mine = [ln for ln in maps.splitlines() if str(d) in ln]
    assert mine and all("(deleted)" in ln for ln in mine)


def test_a_spill_too_big_for_its_disk_budget_is_not_made(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    runs = RunCache(1 << 30)
    spill = SpillStore(tmp_path / "spill", 1000, only_when_merged=False)
    spec = _base_spec(snap, DELTAS, Form.ROWS, WireDtype.FP32)
    assert _window(snap, spec, runs=runs, spill=spill) == _window(snap, spec)
    assert spill.built == 0 and spill.nbytes == 0


@pytest.mark.parametrize("touch", [10, 250])
def test_the_spill_is_used_only_where_it_saves_a_merge(tmp_path: Path, touch: int) -> None:
    """By default a base window whose base and runs stream range by range (light deltas) is
    not spilled; one whose deltas overlap heavily (merged whole otherwise) is, once."""
    ft = FakeTrainer(tmp_path, world_size=1, tables={"t0": (300, 8), "t1": (120, 4)})
    ft.start(0)
    for s in range(1, 7):
        ft.step(s * 10, touch=touch)
    log = SegmentLog(SpoolLayout(tmp_path, "m"), 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None
    runs, spill = RunCache(1 << 30), SpillStore(tmp_path / "spill", 1 << 30)
    spec = _base_spec(snap, snap.head.seq, Form.ROWS, WireDtype.FP32)
    want = _window(snap, spec)
    for _ in range(3):
        assert _window(snap, spec, runs=runs, spill=spill) == want
    assert (spill.built, spill.hits) == ((0, 0) if touch == 10 else (1, 3))


def test_the_spill_is_dropped_on_a_new_generation_and_a_retention_merge(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    runs = RunCache(1 << 30)
    spill = SpillStore(tmp_path / "spill", 1 << 30, only_when_merged=False)
    spec = _base_spec(snap, DELTAS, Form.ROWS, WireDtype.FP32)
    _window(snap, spec, runs=runs, spill=spill)
    assert spill.built == 1
    # a new generation (same files, other generation number): not reused
    newer = LogSnapshot(snap.generation + 1, snap.manifest, snap.entries)
    nspec = replace(spec, generation=newer.generation)
    assert _window(newer, nspec, runs=runs, spill=spill) == _window(newer, nspec)
    assert spill.built == 2
    # a retention merge of deltas 1..4 into one entry: same log content, other entries
    e = snap.entries
    merged = replace(
        e[4], first_seq=e[1].first_seq, shards=merge_entries(list(e[1:5])), created_unix=1.0
    )
    after = LogSnapshot(newer.generation, snap.manifest, (e[0], merged, *e[5:]))
    assert _window(after, nspec, runs=runs, spill=spill) == _window(after, nspec)
    assert spill.built == 3
    # a base moved forward (the base merged with deltas 1..3)
    base = replace(
        e[3], first_seq=e[0].first_seq, kind=e[0].kind, shards=merge_entries(list(e[:4]))
    )
    fwd = LogSnapshot(newer.generation, snap.manifest, (base, *e[4:]))
    assert _window(fwd, nspec, runs=runs, spill=spill) == _window(fwd, nspec)
    assert spill.built == 4
    assert os.listdir(tmp_path / "spill") == []


def test_windows_over_the_cache_budget_are_streamed_and_not_kept(tmp_path: Path) -> None:
    """Concurrent readers of distinct windows, some bigger than what is left of the budget:
    every window is bit-equal to one built alone, and the cache's own accounting (cached plus
    reserved for live windows) never exceeds its budget, sampled while they stream."""
    snap = _snapshot(tmp_path)
    specs = [
        _base_spec(snap, to, Form.ROWS, dt)
        for to in (DELTAS, DELTAS - 5, DELTAS - 9)
        for dt in (WireDtype.FP32, WireDtype.FP16, WireDtype.INT8)
    ]
    want = {s: _window(snap, s) for s in specs}
    sizes = sorted(len(h) + len(b) for h, b, _ in want.values())
    budget = sizes[-1] + sizes[0]  # the biggest and one small one at most
    cache = WindowCache(entries=8, max_bytes=budget)
    # First, in order: while the biggest window streams (reserved in the budget), the next
    # biggest cannot fit beside it, so it is streamed without being kept.
    by_size = sorted(specs, key=lambda s: len(want[s][0]) + len(want[s][1]))
    live, _ = cache.get(by_size[-1], lambda kept: build_window(snap, by_size[-1], 0, {}, kept=kept))
    live_chunks = live.iter_chunks()
    first = next(live_chunks)
    second, _ = cache.get(
        by_size[-2], lambda kept: build_window(snap, by_size[-2], 0, {}, kept=kept)
    )
    assert b"".join(second.iter_chunks()) == want[by_size[-2]][1]
    assert first + b"".join(live_chunks) == want[by_size[-1]][1]
    assert cache.unkept > 0
    over = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def sample() -> None:
        while not stop.is_set():
            if cache.nbytes > budget:
                over[0] += 1
            stop.wait(0.0005)

    def reader(spec: WindowSpec) -> None:
        try:
            for _ in range(3):
                win, _ = cache.get(spec, lambda kept: build_window(snap, spec, 0, {}, kept=kept))
                got = (win.header, b"".join(win.iter_chunks()), win.rows)
                _h, b, r = want[spec]
                assert got[1:] == (b, r)
        except BaseException as e:  # reported below
            errors.append(e)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=reader, args=(s,)) for s in specs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    sampler.join(10)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)
    assert over[0] == 0 and cache.peak_bytes <= budget
    assert cache.nbytes <= budget and cache._reserved == 0


def test_a_sidecar_bootstraps_from_one_spill(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    """Real sidecar, Redis, gRPC: a window cache smaller than the base; fresh consumers
    bootstrap one after another (after one more delta too) bit-equal, from one spilled base."""
    spool = SpoolWriter(tmp_path / "spool", tables={"t0": (3000, 8), "t1": (900, 4)})
    for _ in range(6):  # heavy deltas: base + runs would be merged whole per bootstrap
        spool.delta(n=2500)
    cfg = server_config(tmp_path / "spool", redis_server.url, window_cache_bytes=20_000)
    srv = SidecarServer(cfg).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        wait_for(lambda: srv.log.snapshot().head.seq == 6, what="seq 6")  # type: ignore[union-attr]
        ws = srv.servicer.windows
        for i in range(3):
            rep = Replica()
            d = c.pull(f"boot{i}")
            assert d.resync and d.to_seq == 6
            rep.apply(d)
            for t in spool.specs:
                assert torch.equal(rep.tables[t], spool.truth[t]), (i, t)
        assert ws.spill.built == 1 and ws.spill.hits == 3
        assert ws.cache.unkept == 3 and ws.cache.nbytes <= 20_000
        spool.delta(n=500)
        wait_for(lambda: srv.log.snapshot().head.seq == 7, what="seq 7")  # type: ignore[union-attr]
        rep = Replica()
        d = c.pull("late")
        assert d.to_seq == 7
        rep.apply(d)
        for t in spool.specs:
            assert torch.equal(rep.tables[t], spool.truth[t]), t
        assert ws.spill.built == 1  # the spill plus the new delta
        assert os.listdir(srv.log.layout.model_dir / ".spill") == []
    finally:
        c.close()
        srv.stop(0)


def test_concurrent_pulls_stay_within_the_cache_budget(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Real sidecar, Redis, gRPC: 8 consumers pull distinct windows (table subsets, chunk
    sizes) at once, twice, through a window cache that fits about one of them: every window is
    bit-equal to the truth and the cache's own accounting (cached + reserved for live
    windows), sampled while they stream, never exceeds its budget."""
    spool = SpoolWriter(tmp_path / "spool", tables={"t0": (6000, 16), "t1": (3000, 8)})
    for _ in range(3):
        spool.delta(n=500)
    budget = 450_000  # the whole base window is ~500 kB; t0 alone ~400 kB
    cfg = server_config(tmp_path / "spool", redis_server.url, window_cache_bytes=budget)
    srv = SidecarServer(cfg).start()
    c = Client(f"127.0.0.1:{srv.port}")
    cache = srv.servicer.windows.cache
    over, errors = [0], []
    stop = threading.Event()
    asks = [(t, cb) for t in (["t0"], ["t1"], ["t0", "t1"], []) for cb in (64 << 10, 96 << 10)]

    def sample() -> None:
        while not stop.is_set():
            over[0] += cache.nbytes > budget
            stop.wait(0.0005)

    def consumer(i: int) -> None:
        tables, chunk = asks[i]
        try:
            for r in range(2):
                rep = Replica()
                d = c.pull(f"c{i}-{r}", tables=tables, chunk_bytes=chunk)
                rep.apply(d)
                for t in tables or spool.specs:
                    assert torch.equal(rep.tables[t], spool.truth[t]), (i, t)
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        wait_for(lambda: srv.log.snapshot().head.seq == 3, what="seq 3")  # type: ignore[union-attr]
        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=consumer, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        sampler.join(10)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in threads)
        assert over[0] == 0 and cache.peak_bytes <= budget
        assert cache.unkept > 0  # some were streamed without being kept
    finally:
        stop.set()
        c.close()
        srv.stop(0)


def test_a_window_built_but_never_read_gives_its_reservation_back(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    spec = _base_spec(snap, DELTAS, Form.ROWS, WireDtype.FP32)
    want = _window(snap, spec)
    cache = WindowCache(entries=4, max_bytes=1 << 30)
    win, hit = cache.get(
        spec, lambda kept: build_window(snap, spec, spec.to_seq * 10, {}, kept=kept)
    )
    assert not hit and win.kept and cache.nbytes == win.bound > 0
    cache.abandon(spec, win)  # e.g. its pull failed before streaming
    assert cache.nbytes == 0
    # a reader that had it already still gets every byte; it is not cached afterwards
    assert (win.header, b"".join(win.iter_chunks()), win.rows) == want
    assert cache.nbytes == 0 and spec not in cache._lru
    # once a reader is streaming it, abandoning is a no-op (the window completes normally)
    other = _base_spec(snap, DELTAS - 1, Form.ROWS, WireDtype.FP32)
    w2, _ = cache.get(other, lambda kept: build_window(snap, other, 0, {}, kept=kept))
    it = w2.iter_chunks()
    next(it)
    cache.abandon(other, w2)
    assert cache.nbytes == w2.bound
    list(it)
    assert cache.nbytes == w2.nbytes  # now cached
