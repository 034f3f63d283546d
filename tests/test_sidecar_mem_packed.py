"""The pack-once store under a budget smaller than what pulls ask of it (issue 41 item 2): a
window bigger than the budget keeps a stable part of its rows packed and packs the rest per
chunk (it never evicts what the same pull uses), windows taking turns do not evict each other
pull after pull, evicted rows are freed, and the budget holds; every window bit-equal to one
built with the store off."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch

from bench.datagen import write_spool
from deltad import wire
from deltad.segment.spool import SpoolLayout
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.windows.packed import PackedStore, Pins, pinning
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.spec import WindowSpec
from deltad.types import Form, WireDtype

TABLES, ROWS, DIM = 4, 3000, 32
DT = WireDtype.PACKED_INT8


def _snapshot(root: Path, deltas: int = 3) -> LogSnapshot:
    write_spool(
        root, model="m", tables=TABLES, rows_per_table=ROWS, dim=DIM, deltas=deltas,
        delta_fraction=0.35,
    )  # fmt: skip
    log = SegmentLog(SpoolLayout(root, "m"), 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None
    return snap


@pytest.fixture(scope="module")
def snap(tmp_path_factory: pytest.TempPathFactory) -> LogSnapshot:
    """One log for the module's tests (base + 3 deltas of 35 %)."""
    return _snapshot(tmp_path_factory.mktemp("packed"))


def _spec(snap: LogSnapshot, alignment: int = 16) -> WindowSpec:
    return WindowSpec(
        0, snap.generation, True, -1, snap.head.seq, Form.ROWS, DT, (), 0, 0.0, 0, 64 << 10,
        row_alignment=alignment,
    )  # fmt: skip


def _pull(snap: LogSnapshot, spec: WindowSpec, store: PackedStore | None) -> bytes:
    """One window streamed by its one reader (pins held while it produces, as a pull's)."""
    w = build_window(snap, spec, 0, {}, kept=False, packed=store)
    return w.header + b"".join(w.iter_chunks())


def _parts_bytes(snap: LogSnapshot, alignment: int = 16) -> int:
    row = wire.packed_row_bytes(DIM, DT, alignment)
    return sum(c.ids.numel() * row for e in snap.entries for c in e.shards.values())


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0, 2.0])
def test_a_window_bigger_than_the_budget_keeps_a_stable_part_packed(
    snap: LogSnapshot, share: float
) -> None:
    spec = _spec(snap)
    want = _pull(snap, spec, None)
    store = PackedStore(int(share * _parts_bytes(snap)))
    first = _pull(snap, spec, store)
    assert first == want
    packed_once = store.packed
    assert store.nbytes <= store.max_bytes and store.peak_bytes <= store.max_bytes
    for _ in range(3):
        assert _pull(snap, spec, store) == want
    # nothing packed whole again: what was kept is reused, the rest packed per chunk
    assert store.packed == packed_once, (store.packed, packed_once)
    assert store.peak_bytes <= store.max_bytes
    if share >= 1.0:
        assert store.refused == 0 and store.hits > 0
    else:
        assert store.refused > 0  # (the rest of the window, per chunk)
        assert store.nbytes > 0 or share < 0.3  # (a base shard is ~20 % of the parts)


def test_windows_taking_turns_do_not_evict_each_other_pull_after_pull(snap: LogSnapshot) -> None:
    """Three row alignments under a budget that holds one of them: after the first rounds
    the store keeps packing nothing whole (the ones kept stay, the others go per chunk)."""
    specs = [_spec(snap, a) for a in (16, 32, 64)]
    want = {s.row_alignment: _pull(snap, s, None) for s in specs}
    store = PackedStore(_parts_bytes(snap, 64))
    for _ in range(2):
        for s in specs:
            assert _pull(snap, s, store) == want[s.row_alignment]
    settled = store.packed
    for _ in range(4):
        for s in specs:
            assert _pull(snap, s, store) == want[s.row_alignment]
    assert store.packed == settled, (store.packed, settled)
    assert store.hits > 0 and store.peak_bytes <= store.max_bytes


def test_pinned_rows_are_never_evicted_and_evicted_rows_are_freed(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path, deltas=0)
    parts = list(snap.base.shards.values())
    size = parts[0].ids.numel() * wire.packed_row_bytes(DIM, DT, 16)
    store = PackedStore(size)  # room for one part
    pins = Pins()
    with pinning(pins):
        rows = store.rows(parts[0], DT, 16)
        assert rows is not None
        # the same pull's next part does not fit beside the pinned one: per chunk (None)
        assert store.rows(parts[1], DT, 16) is None
    assert store.nbytes == size and store.refused == 1
    gone = weakref.ref(rows)
    del rows
    pins.release()
    # unpinned: a part asked for more often takes its room, and the evicted rows are freed
    for _ in range(2):
        store.rows(parts[1], DT, 16)
    assert store.rows(parts[1], DT, 16) is not None
    gc.collect()
    assert gone() is None and store.nbytes == size and store.entries == 1


def test_concurrent_windows_stay_within_the_budget(snap: LogSnapshot) -> None:
    specs = [_spec(snap, a) for a in (16, 32, 64)]
    want = {s.row_alignment: _pull(snap, s, None) for s in specs}
    store = PackedStore(_parts_bytes(snap) // 2)
    errors: list[BaseException] = []

    def reader(s: WindowSpec) -> None:
        try:
            for _ in range(3):
                assert _pull(snap, s, store) == want[s.row_alignment]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in specs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)
    assert store.peak_bytes <= store.max_bytes and store.nbytes <= store.max_bytes
    assert all(e.pins == 0 for e in store._lru.values())


def test_the_parts_of_one_shard_are_kept_together_or_not_at_all(snap: LogSnapshot) -> None:
    key = next(iter(snap.base.shards))
    parts = [e.shards[key] for e in snap.entries if key in e.shards]
    assert len(parts) > 1
    row = wire.packed_row_bytes(DIM, DT, 16)
    group = sum(p.ids.numel() * row for p in parts)
    # room for the base part, not for the group: nothing packed, nothing kept
    store = PackedStore(group - 1)
    assert store.rows_of(parts, DT, 16) is None
    assert store.nbytes == 0 and store.packed == 0
    # room for the group: all of it, each part's rows as packed alone
    store = PackedStore(group)
    got = store.rows_of(parts, DT, 16)
    assert got is not None and store.nbytes == group and store.packed == len(parts)
    for p, rows in zip(parts, got, strict=True):
        alone = PackedStore(group).rows(p, DT, 16)
        assert alone is not None and torch.equal(rows, alone)
    assert store.rows_of(parts, DT, 16) is not None and store.packed == len(parts)
