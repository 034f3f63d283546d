"""Windows built from pre-merged runs (deltad.serve.index.runs) are bit-equal to windows merged from
their segments, at every cursor, for every form; runs are reused and bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serverkit import Client, Replica, SpoolWriter, redis_server, server_config, wait_for
from spoolkit import FakeTrainer

from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.index.runs import RunCache, cover
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.spec import WindowSpec
from deltad.store import EmbeddedRedis
from deltad.types import Form, WireDtype

DELTAS = 21

__all__ = ["redis_server"]


def _snapshot(tmp_path: Path, merged_at: tuple[int, int] | None = None) -> LogSnapshot:
    ft = FakeTrainer(tmp_path, world_size=1, tables={"t0": (300, 8), "t1": (120, 4)})
    ft.start(0)
    for s in range(1, DELTAS + 1):
        ft.step(s * 10, touch=40)  # 40 of 300 / 120 rows per step: heavy overlap
    log = SegmentLog(SpoolLayout(tmp_path, "m"), 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and len(snap.entries) == DELTAS + 1
    return snap


def _spec(
    snap: LogSnapshot, frm: int, to: int, form: Form = Form.ROWS, dtype: WireDtype = WireDtype.FP32
) -> WindowSpec:
    return WindowSpec(
        0, snap.generation, frm < 0, frm, to, form, dtype, (), 7 if form is Form.TOPK else 0,
        0.0, 0, 1024,
    )  # fmt: skip


def _bytes(snap: LogSnapshot, spec: WindowSpec, runs: RunCache | None, owed=None) -> tuple:  # type: ignore[no-untyped-def]
    w = build_window(snap, spec, spec.to_seq * 10, owed or {}, lazy=False, runs=runs)
    owed_out = {k: (v.ids.tolist(), v.values.tolist()) for k, v in w.owed.items()}
    return w.header, b"".join(w.chunks), w.rows, owed_out, w.owed


def test_cover_is_aligned_and_logarithmic() -> None:
    for lo in range(0, 70):
        for hi in range(lo, 70):
            blocks = cover(lo, hi)
            pos = lo
            for start, size in blocks:
                assert start == pos and size & (size - 1) == 0 and start % size == 0
                pos += size
            assert pos == hi
            assert len(blocks) <= 2 * max(1, (hi - lo).bit_length())


@pytest.mark.parametrize(
    ("form", "dtype"),
    [
        # the rows form's runs are the same in every dtype: INT8 in the fast lane, both in full
        pytest.param(Form.ROWS, WireDtype.FP32, marks=pytest.mark.slow),
        (Form.ROWS, WireDtype.INT8),
        (Form.IDS, WireDtype.FP32),
        (Form.TOPK, WireDtype.FP32),
    ],
)
def test_windows_from_runs_equal_windows_from_segments(
    tmp_path: Path, form: Form, dtype: WireDtype
) -> None:
    snap = _snapshot(tmp_path)
    runs = RunCache(1 << 30)
    compared = 0
    for frm in range(-1, DELTAS + 1):
        for to in range(max(frm, 0), DELTAS + 1):
            spec = _spec(snap, frm, to, form, dtype)
            want = _bytes(snap, spec, None)
            got = _bytes(snap, spec, runs)
            assert got[:4] == want[:4], (frm, to)
            compared += 1
            if form is Form.TOPK and want[4] and to < DELTAS:
                # a consumer owed rows pulls on: the next window (with owed rows) agrees too
                nxt = _spec(snap, to, DELTAS, form, dtype)
                assert _bytes(snap, nxt, runs, want[4])[:4] == _bytes(snap, nxt, None, want[4])[:4]
    assert compared > 200
    assert runs.built > 0 and runs.hits > runs.built  # runs are shared across windows
    assert runs.nbytes <= runs.max_bytes


def test_runs_stay_within_their_budget_and_stay_exact(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    tiny = RunCache(2_000)  # a few runs at most: most are merged, used and dropped
    for frm in range(0, DELTAS, 3):
        spec = _spec(snap, frm, DELTAS)
        assert _bytes(snap, spec, tiny)[:4] == _bytes(snap, spec, None)[:4]
    assert tiny.nbytes <= 2_000
    off = RunCache(0)  # budget 0: no runs at all
    spec = _spec(snap, -1, DELTAS)
    assert _bytes(snap, spec, off)[:4] == _bytes(snap, spec, None)[:4]
    assert off.built == 0


def test_runs_of_an_older_generation_are_dropped(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    runs = RunCache(1 << 30)
    _bytes(snap, _spec(snap, -1, DELTAS), runs)
    assert runs.nbytes > 0
    newer = LogSnapshot(snap.generation + 1, snap.manifest, snap.entries)
    spec = _spec(newer, -1, DELTAS)
    before = runs.built
    _bytes(newer, spec, runs)
    assert runs.built > before  # nothing reused across generations
    assert all(rid[0] == newer.generation for rid in runs._lru)


def test_a_sidecar_serves_consumers_at_many_cursors_from_runs(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Real sidecar and Redis: consumers left at 12 different cursors all catch up bit-equal,
    their windows merged from shared runs."""
    spool = SpoolWriter(tmp_path / "spool", tables={"t0": (2000, 8), "t1": (700, 4)})
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        reps = {f"c{i}": Replica() for i in range(12)}
        for name, rep in reps.items():
            d = c.pull(name)
            rep.apply(d)
            c.commit(d)
        for j in range(12):
            spool.delta(n=300)
            wait_for(lambda j=j: srv.log.snapshot().head.seq == j + 1, what=f"seq {j + 1}")  # type: ignore[union-attr,misc]
            d = c.pull(f"c{j}")  # c{j} stays at cursor j + 1
            reps[f"c{j}"].apply(d)
            c.commit(d)
        for name, rep in reps.items():
            d = c.pull(name)
            assert d.to_seq == 12
            rep.apply(d)
            for t in spool.specs:
                assert torch.equal(rep.tables[t], spool.truth[t]), (name, t)
        assert srv.servicer.runs.built > 0 and srv.servicer.runs.hits > 0
    finally:
        c.close()
        srv.stop(0)
