"""Pack once (issue 22 item 2): packed rows are made once per row version (a log entry's or a
merged run's rows, kept packed under a byte budget), not once per pull; the windows built
from them are byte-equal to windows packed fresh, and their rows to torchrec's quantization."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from spoolkit import FakeTrainer
from test_wire_packed import torchrec_rows

from deltad import wire
from deltad.config import ConfigError, ServerConfig
from deltad.consume import decode
from deltad.segment.spool import SpoolLayout
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.index.merge import merge_entries
from deltad.serve.index.runs import RunCache
from deltad.serve.windows import encode
from deltad.serve.windows.packed import PackedStore
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.spec import WindowSpec
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb

DELTAS = 13
PACKED = [WireDtype.PACKED_INT8, WireDtype.PACKED_INT4, WireDtype.PACKED_FP16]


def _snapshot(tmp_path: Path, touch: int = 40) -> LogSnapshot:
    ft = FakeTrainer(tmp_path, world_size=1, tables={"t0": (300, 8), "t1": (120, 16)})
    ft.start(0)
    for s in range(1, DELTAS + 1):
        ft.step(s * 10, touch=touch)
    log = SegmentLog(SpoolLayout(tmp_path, "m"), 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and len(snap.entries) == DELTAS + 1
    return snap


def _spec(snap: LogSnapshot, lo: int, to: int, dtype: WireDtype, align: int) -> WindowSpec:
    return WindowSpec(
        0, snap.generation, lo < 0, lo, to, Form.ROWS, dtype, (), 0, 0.0, 0, 700, align
    )  # fmt: skip


def _window(snap: LogSnapshot, spec: WindowSpec, **kw: object) -> list[bytes]:
    w = build_window(snap, spec, spec.to_seq * 10, {}, lazy=False, **kw)  # type: ignore[arg-type]
    return [w.header, *w.chunks]


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("align", [0, 8, 64])
def test_windows_from_the_pack_once_store_equal_windows_packed_fresh(
    tmp_path: Path, dtype: WireDtype, align: int
) -> None:
    """Windows at every cursor (bases, single segments, runs, ranged and whole merges) are
    the same messages, byte for byte, whether their rows come packed from the store or are
    packed for the pull; a second round packs nothing."""
    snap = _snapshot(tmp_path)
    runs, store = RunCache(1 << 30), PackedStore(1 << 30)
    cursors = [(-1, DELTAS), (-1, 3), (0, DELTAS), (2, 3), (5, DELTAS), (1, 9), (12, DELTAS)]
    want = {c: _window(snap, _spec(snap, *c, dtype, align), runs=runs) for c in cursors}
    for c in cursors:
        assert _window(snap, _spec(snap, *c, dtype, align), runs=runs, packed=store) == want[c]
    packed, rows = store.packed, store.rows_packed
    assert packed > 0 and store.nbytes > 0
    for c in reversed(cursors):
        assert _window(snap, _spec(snap, *c, dtype, align), runs=runs, packed=store) == want[c]
    assert (store.packed, store.rows_packed) == (packed, rows)  # every row was packed once
    assert store.hits > 0


@pytest.mark.parametrize("dtype", PACKED)
def test_rows_in_the_store_equal_fresh_packing_and_torchrec_quantization(
    tmp_path: Path, dtype: WireDtype
) -> None:
    """Each part's stored rows, and the rows a consumer decodes from a window merged out of
    stored rows, equal torchrec's quantization of the float rows at that window's head."""
    snap = _snapshot(tmp_path)
    store = PackedStore(1 << 30)
    for e in snap.entries:
        for part in e.shards.values():
            rows = store.rows(part, dtype, 16)
            assert rows is not None
            assert torch.equal(rows, torchrec_rows(part.values, dtype))
    head = merge_entries(list(snap.entries))
    msgs = _window(snap, _spec(snap, -1, DELTAS, dtype, 16), runs=RunCache(1 << 30), packed=store)
    d = decode.decode_stream([*msgs, encode.encode_trailer(pb.DeltaTrailer())])
    for s in d.shards:
        assert s.packed is not None
        table = next(r for k, r in head.items() if k[0] == s.shard.table)
        assert torch.equal(s.ids, table.ids)
        assert torch.equal(s.packed, torchrec_rows(table.values, dtype))


def test_the_store_holds_its_budget_and_forgets_rows_of_freed_parts(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    dtype = WireDtype.PACKED_INT8
    base = snap.base.shards
    sizes = {
        k: p.ids.numel() * wire.packed_row_bytes(p.shard.dim, dtype, 16) for k, p in base.items()
    }
    # a budget for the biggest base part only: the other one evicts it, nothing goes over
    store = PackedStore(max(sizes.values()))
    for p in base.values():
        assert store.rows(p, dtype, 16) is not None
        assert store.nbytes <= store.max_bytes
    assert store.nbytes == sizes[list(base)[-1]]
    # a part over the whole budget is not kept (its windows pack per chunk)
    small = PackedStore(min(sizes.values()) - 1)
    assert small.rows(next(iter(base.values())), dtype, 16) is None and small.nbytes == 0
    # rows of a part that is freed (a run evicted, a merge replaced it) go with it
    merged = merge_entries(list(snap.entries[1:5]))
    fresh = PackedStore(1 << 30)
    for p in merged.values():
        assert fresh.rows(p, dtype, 16) is not None
    assert fresh.nbytes > 0
    del merged, p
    gc.collect()
    assert fresh.nbytes == 0
    # column-wise shards and other dtypes are never packed
    assert fresh.rows(next(iter(base.values())), WireDtype.FP32, 16) is None


@pytest.mark.parametrize("budget", [-1, (1 << 40) + 1])
def test_a_packed_cache_budget_out_of_range_is_refused(tmp_path: Path, budget: int) -> None:
    with pytest.raises(ConfigError, match="--packed-cache-bytes"):
        ServerConfig(spool_dir=tmp_path, model="m", packed_cache_bytes=budget)
