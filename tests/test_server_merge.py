"""The window merge against a reference replay, on every path (sparse, dense, heavy overlap)."""

from __future__ import annotations

import pytest
import torch

from deltad.segment.format import ShardRows
from deltad.serve.index.merge import merge_rows
from deltad.types import Shard


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("per", "rows"), [(20, 100_000), (300, 1000), (900, 1000)])
def test_merge_is_union_with_latest_values(dtype: torch.dtype, per: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(per + rows)
    truth = torch.zeros(rows, 5, dtype=dtype)
    touched = torch.zeros(rows, dtype=torch.bool)
    chunks = []
    for _ in range(6):
        ids = torch.randint(0, rows, (per,), generator=gen).unique()
        vals = torch.randn(ids.numel(), 5, generator=gen).to(dtype)
        chunks.append(ShardRows(Shard("t", rows, 5, 0, rows, 0, 5), ids, vals))
        truth[ids] = vals
        touched[ids] = True
    merged = merge_rows(chunks)
    expect = touched.nonzero().squeeze(1)
    assert torch.equal(merged.ids, expect)
    assert torch.equal(merged.values, truth[expect])
    assert torch.equal(merge_rows(chunks, with_values=False).ids, expect)


def test_shard_offset_and_single_chunk_view() -> None:
    ids = torch.tensor([1000, 1005])
    a = ShardRows(Shard("t", 2000, 2, 1000, 2000, 0, 2), ids, torch.ones(2, 2))
    assert merge_rows([a]).values.data_ptr() == a.values.data_ptr()  # no copy
    b = ShardRows(
        Shard("t", 2000, 2, 1000, 2000, 0, 2), torch.tensor([1005, 1999]), torch.zeros(2, 2)
    )
    m = merge_rows([a, b])
    assert m.ids.tolist() == [1000, 1005, 1999]
    assert m.values.tolist() == [[1, 1], [0, 0], [0, 0]]


@pytest.mark.parametrize("segments", [3, 40])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block_bytes", [4 << 20, 1000])
def test_parallel_merge_of_a_row_wise_shard(
    segments: int, threads: int, block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above PARALLEL_MIN_IDS the copies run in a run of blocks per thread (one block per
    thread here, or hundreds of small ones); the latest value still wins across block
    boundaries, on a shard that does not start at row 0."""
    from deltad.serve.index import merge

    monkeypatch.setattr(merge, "BLOCK_BYTES", block_bytes)
    start, rows = 300_000, 200_000
    gen = torch.Generator().manual_seed(segments)
    truth = torch.zeros(rows, 3)
    touched = torch.zeros(rows, dtype=torch.bool)
    chunks = []
    per = 2 * merge.PARALLEL_MIN_IDS // segments + 1
    for _ in range(segments):
        # Zipf-like: low rows in almost every segment, so parts see heavy overlap
        local = (torch.rand(per, generator=gen) ** 3 * rows).long().unique()
        vals = torch.randn(local.numel(), 3, generator=gen)
        chunks.append(
            ShardRows(Shard("t", start + rows, 3, start, start + rows, 0, 3), local + start, vals)
        )
        truth[local] = vals
        touched[local] = True
    old = merge.MERGE_THREADS
    merge.MERGE_THREADS = threads
    try:
        merged = merge_rows(chunks)
    finally:
        merge.MERGE_THREADS = old
    expect = touched.nonzero().squeeze(1)
    assert sum(c.ids.numel() for c in chunks) >= merge.PARALLEL_MIN_IDS
    assert torch.equal(merged.ids, expect + start)
    assert torch.equal(merged.values, truth[expect])


@pytest.mark.parametrize("base_at", [0, 2])
@pytest.mark.parametrize("rows", [1000, 300_000])
def test_merge_with_a_part_holding_every_row(base_at: int, rows: int) -> None:
    """A base (every row of the shard) among the parts takes the no-marks path and slice
    copies; same union and latest values as a replay, also into a given ``out``."""
    start = 700
    gen = torch.Generator().manual_seed(rows + base_at)
    shard = Shard("t", start + rows, 4, start, start + rows, 0, 4)
    truth = torch.zeros(rows, 4)
    chunks = []
    for i in range(5):
        if i == base_at:
            local = torch.arange(rows)
        else:
            local = torch.randint(0, rows, (rows // 7,), generator=gen).unique()
        vals = torch.randn(local.numel(), 4, generator=gen)
        chunks.append(ShardRows(shard, local + start, vals))
        truth[local] = vals
    expect = torch.arange(rows) + start
    merged = merge_rows(chunks)
    assert torch.equal(merged.ids, expect) and torch.equal(merged.values, truth)
    out = torch.full((rows, 4), float("nan"))
    assert merge_rows(chunks, out=out).values.data_ptr() == out.data_ptr()
    assert torch.equal(out, truth)
    assert torch.equal(merge_rows(chunks, with_values=False).ids, expect)
    with pytest.raises(ValueError, match="merge output"):
        merge_rows(chunks, out=torch.empty(rows - 1, 4))
