"""Appliers write exactly the rows and columns they are given, atomically, in the table dtype."""

from __future__ import annotations

import threading

import pytest
import torch

from deltad.consume.appliers import TensorDictApplier, TorchRecApplier
from deltad.consume.window import Cursor, RankDelta, ShardUpdate
from deltad.errors import ConsumerError
from deltad.types import Form, Shard, WireDtype


def _delta(slices: list[ShardUpdate], *, rank: int = 0, resync: bool = False) -> RankDelta:
    return RankDelta(
        rank=rank,
        generation=1,
        resync=resync,
        from_seq=0,
        to_seq=1,
        to_step=10,
        form=Form.ROWS,
        wire_dtype=WireDtype.FP32,
        cursor=Cursor("c", rank, 1, 1, 10),
        shards=slices,
        rows=sum(s.ids.numel() for s in slices),
    )


def _update(
    table: str, ids: list[int], c0: int, c1: int, rows: int = 10, dim: int = 8
) -> ShardUpdate:
    return ShardUpdate(
        shard=Shard.columns_of(table, rows, dim, c0, c1),
        ids=torch.tensor(ids, dtype=torch.int64),
        values=torch.randn(len(ids), c1 - c0),
    )


def _expect_only(before: torch.Tensor, after: torch.Tensor, s: ShardUpdate) -> None:
    """``after`` equals ``before`` except at [ids, col_start:col_end], which hold the values."""
    assert s.values is not None
    want = before.clone()
    want[s.ids, s.shard.col_start : s.shard.col_end] = s.values.to(want.dtype)
    assert torch.equal(after, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dict_applier_writes_exactly_given_rows_and_columns(dtype: torch.dtype) -> None:
    base = torch.randn(10, 8).to(dtype)
    applier = TensorDictApplier({"t": base.clone()})
    cw = _update("t", [1, 7, 3], 2, 5)  # a column-wise shard
    assert applier.apply([_delta([cw])]) == 3
    _expect_only(base, applier.tables()["t"], cw)
    full = _update("t", [0, 9], 0, 8)
    before = applier.tables()["t"].clone()
    applier.apply([_delta([full], rank=1)])
    _expect_only(before, applier.tables()["t"], full)


def test_dict_applier_allocates_and_resync_replaces_shape() -> None:
    applier = TensorDictApplier()
    applier.apply([_delta([_update("new", [2], 0, 8)])])
    assert applier.tables()["new"].shape == (10, 8)
    applier.apply([_delta([_update("new", [0, 1], 0, 4, rows=3, dim=4)], resync=True)])
    t = applier.tables()["new"]
    assert t.shape == (3, 4) and torch.count_nonzero(t[2]) == 0


def test_a_bad_shard_update_writes_nothing() -> None:
    base = torch.randn(10, 8)
    applier = TensorDictApplier({"t": base.clone()})
    good = _update("t", [1], 0, 8)
    bad = _update("t", [11], 0, 8)  # row out of range
    with pytest.raises(ConsumerError):
        applier.apply([_delta([good]), _delta([bad], rank=1)])
    assert torch.equal(applier.tables()["t"], base)
    no_values = _update("t", [1], 0, 8)
    no_values.values = None
    with pytest.raises(ConsumerError):
        applier.apply([_delta([no_values])])
    # a resync to a new shape whose second rank is bad: the held table stays, not a blank one
    grown = _update("t", [0, 1], 0, 8, rows=12)
    bad_grown = _update("t", [12], 0, 8, rows=12)
    with pytest.raises(ConsumerError):
        applier.apply([_delta([grown], resync=True), _delta([bad_grown], rank=1, resync=True)])
    assert applier.tables()["t"] is not None and torch.equal(applier.tables()["t"], base)
    # and a good one replaces it, both ranks' rows in the one new table
    other = _update("t", [11], 0, 8, rows=12)
    applier.apply([_delta([grown], resync=True), _delta([other], rank=1, resync=True)])
    t = applier.tables()["t"]
    assert t.shape == (12, 8) and torch.equal(t[11], other.values[0])  # type: ignore[index]
    assert torch.equal(t[0], grown.values[0])  # type: ignore[index]


def test_torchrec_applier_writes_ec_and_ebc_weights_in_place() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["fa"])]
    )
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["fb"])
        ]
    )
    model = torch.nn.ModuleDict({"ec": ec, "ebc": ebc})
    applier = TorchRecApplier(model)
    wa, wb = ec.embeddings["a"].weight, ebc.embedding_bags["b"].weight
    before_a, before_b = wa.detach().clone(), wb.detach().clone()
    sa, sb = _update("a", [4, 0], 0, 8), _update("b", [9], 6, 8)
    applier.apply([_delta([sa, sb])])
    _expect_only(before_a, wa.detach(), sa)
    _expect_only(before_b, wb.detach(), sb)
    assert wa.requires_grad and ec.embeddings["a"].weight is wa  # written in place
    with pytest.raises(ConsumerError):
        applier.apply([_delta([_update("missing", [0], 0, 8)])])
    with pytest.raises(ConsumerError):
        applier.apply([_delta([_update("a", [0], 0, 8, rows=11)])])  # other shape


def test_readers_never_see_half_a_window() -> None:
    """A window of two ranks writes 0s then 1s everywhere; a reader under reading() sees one."""
    applier = TensorDictApplier({"t": torch.zeros(1000, 8)})
    seen: list[set[float]] = []
    stop = threading.Event()

    def reader() -> None:
        for _ in range(2000):
            if stop.is_set():
                return
            with applier.reading():
                seen.append(set(applier.tables()["t"].unique().tolist()))

    th = threading.Thread(target=reader)
    th.start()
    try:
        for v in range(1, 30):
            halves = []
            for rank, rows in enumerate((range(0, 500), range(500, 1000))):
                s = ShardUpdate(
                    Shard.columns_of("t", 1000, 8, 0, 8),
                    torch.tensor(list(rows)),
                    torch.full((500, 8), float(v)),
                )
                halves.append(_delta([s], rank=rank))
            applier.apply(halves)
    finally:
        stop.set()
        th.join(timeout=30)
    assert seen and all(len(s) == 1 for s in seen)
