"""BufferPool: a buffer is handed out again only once nothing refers to its memory."""

from __future__ import annotations

import pytest
import torch

from deltad.buffers import GRANULE, BufferPool, storage_refs


def test_this_torch_can_count_storage_references() -> None:
    t = torch.empty(8)
    idle = storage_refs(t)
    assert idle is not None
    v = t[:4]
    assert storage_refs(t) == idle + 1
    del v
    assert storage_refs(t) == idle


def test_a_held_tensor_is_never_handed_out_again() -> None:
    pool = BufferPool(min_bytes=0)
    a = pool.take((100, 4), torch.float32)
    a.fill_(1.0)
    pool.end_round()
    b = pool.take((100, 4), torch.float32)
    b.fill_(2.0)
    assert torch.all(a == 1.0)
    assert pool.reused == 0 and pool.allocated == 2


@pytest.mark.parametrize("keep", ["view", "numpy", "slice_of_view"])
def test_any_alias_keeps_a_buffer_busy(keep: str) -> None:
    pool = BufferPool(min_bytes=0)
    a = pool.take((64, 8), torch.float32)
    a.fill_(3.0)
    alias: object
    if keep == "view":
        alias = a.view(-1)
    elif keep == "numpy":
        alias = a.numpy()
    else:
        alias = a[1:][2:]
    del a
    pool.end_round()
    b = pool.take((64, 8), torch.float32)
    b.fill_(4.0)
    assert float(torch.as_tensor(alias).flatten()[0]) == 3.0
    assert pool.reused == 0
    del alias, b
    pool.end_round()
    pool.take((64, 8), torch.float32)
    assert pool.reused == 1  # both buffers free now: one of them comes back


def test_released_buffers_come_back_and_unused_ones_are_dropped() -> None:
    pool = BufferPool(min_bytes=0)
    ids = pool.take((1000,), torch.int64)
    vals = pool.take((1000, 16), torch.float32)
    ptrs = {ids.data_ptr(), vals.data_ptr()}
    del ids, vals
    pool.end_round()
    again = pool.take((900, 16), torch.float32)  # smaller: fits the values buffer
    assert again.data_ptr() in ptrs and pool.reused == 1
    pool.end_round()  # the ids buffer went unused this round: dropped
    assert pool.nbytes == 1 * (-(-1000 * 16 * 4 // GRANULE) * GRANULE)


def test_max_bytes_bounds_what_the_pool_keeps() -> None:
    pool = BufferPool(max_bytes=GRANULE, min_bytes=0)
    a = pool.take((GRANULE // 4,), torch.float32)
    b = pool.take((10,), torch.float32)  # over the bound: a plain tensor, not kept
    assert pool.nbytes == GRANULE and pool.allocated == 1
    assert a.numel() == GRANULE // 4 and b.numel() == 10
    with pytest.raises(ValueError):
        BufferPool(max_bytes=-1)


def test_empty_and_small_tensors_take_no_buffer() -> None:
    pool = BufferPool(min_bytes=1 << 16)
    assert pool.take((0, 16), torch.float32).shape == (0, 16)
    assert pool.take((100, 16), torch.float32).shape == (100, 16)  # 6.4 kB: plain
    assert pool.nbytes == 0 and pool.allocated == 0
    assert pool.take((1 << 12, 16), torch.float32).shape == (1 << 12, 16)  # 256 kB: pooled
    assert pool.allocated == 1
