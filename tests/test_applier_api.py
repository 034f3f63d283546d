"""The appliers' API contract as a library user meets it (outside review 2, items 4, 9, 12):
TorchRecApplier applies the pulled dense state, QuantApplier refuses packed rows of another
table layout, TensorDictApplier refuses tables rows would be truncated into.

Real sidecars (serverkit) and real torchrec models; no mocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serverkit import SpoolWriter, server_config
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from deltad.config import ConsumerConfig, PullOptions
from deltad.consume.appliers import TensorDictApplier, TorchRecApplier
from deltad.consume.client import DeltaConsumer
from deltad.consume.quant import QuantApplier, pack_rows, quantize_model
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConfigError, ConsumerError
from deltad.segment.format import encode_dense, write_dense
from deltad.serve.edge.app import SidecarServer
from deltad.types import Cursor, Form, ServeDtype, Shard, WireDtype

pytestmark = pytest.mark.timeout(120)

SPECS = {"t0": (1000, 8), "t1": (500, 8)}  # dim 8: int8 and int4 rows both pad to 16 bytes


class Ranker(nn.Module):
    """Two EBC tables (the spool's) and dense layers with parameters and buffers on top."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[t])
                for t, (n, d) in SPECS.items()
            ],
            device=torch.device("cpu"),
        )
        self.bn = nn.BatchNorm1d(16)
        self.top = nn.Linear(16, 1)


def dense_of(m: nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's dense state as the publisher takes it: every parameter and buffer
    outside the tables, cloned."""
    named = [*m.named_parameters(), *m.named_buffers()]
    return {n: t.detach().clone() for n, t in named if not n.startswith("ebc.")}


def write_dense_state(spool: SpoolWriter, tensors: dict[str, torch.Tensor]) -> None:
    """A dense state for the SpoolWriter's last segment, as rank 0 writes it."""
    data = encode_dense(
        model=spool.layout.model, generation=spool.generation, rank=0, seq=spool.seq,
        step=spool.step, tensors=tensors,
    )  # fmt: skip
    write_dense(spool.layout.dense_path(spool.generation, 0, spool.seq), data, fsync=False)


def window(
    shards: list[ShardUpdate], wire: WireDtype = WireDtype.FP32, *, resync: bool = False
) -> RankDelta:
    return RankDelta(
        rank=0, generation=1, resync=resync, from_seq=0, to_seq=1, to_step=1, form=Form.ROWS,
        wire_dtype=wire, cursor=Cursor("c", 0, 1, 1, 1), shards=shards,
    )  # fmt: skip


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes behind torchrec's UInt4Tensor state_dict wrapper (or the tensor itself)."""
    return getattr(t, "elem", t)


def snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: raw(v).clone() for k, v in m.state_dict().items()}


# -- TorchRecApplier: the dense state ---------------------------------------------------------


def test_torchrec_applier_applies_the_pulled_dense_state(tmp_path: Path, redis_url: str) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables=SPECS)
    trainer = Ranker(seed=1)
    write_dense_state(spool, dense_of(trainer))  # step 0, with the base
    spool.delta()  # step 10
    with torch.no_grad():  # the trainer's dense step: parameters and buffers move
        trainer.top.weight.mul_(3.0).add_(0.5)
        trainer.bn.running_mean.add_(1.25)
        trainer.bn.num_batches_tracked.add_(7)
        for t in SPECS:
            trainer.ebc.embedding_bags[t].weight.copy_(spool.truth[t])
    write_dense_state(spool, dense_of(trainer))  # step 10's dense state
    serving = Ranker(seed=2).eval()  # other tables and dense weights until the pull
    applier = TorchRecApplier(serving)
    assert applier.dense_names == sorted(dense_of(trainer))
    srv = SidecarServer(server_config(root, redis_url)).start()
    try:
        cfg = ConsumerConfig(consumer="p", model="m", sidecars=(srv.endpoint,))
        with DeltaConsumer(cfg) as c:
            r = c.sync(applier.apply)
            assert (r.step, r.dense_step) == (10, 10) and r.caught_up
    finally:
        srv.stop(0)
    want, got = trainer.state_dict(), serving.state_dict()
    assert got.keys() == want.keys()
    for k in want:  # tables and dense weights: bit-equal to the trainer's at step 10
        assert want[k].dtype == got[k].dtype and torch.equal(got[k], want[k]), k


def test_torchrec_applier_checks_dense_with_the_rows_and_writes_nothing_on_failure() -> None:
    serving = Ranker(seed=2)
    applier = TorchRecApplier(serving)
    before = snapshot(serving)
    rows = ShardUpdate(Shard.columns_of("t0", 1000, 8, 0, 8), torch.arange(3), torch.ones(3, 8))
    bad = window([rows])
    bad.dense = {"top.weight": torch.zeros(2, 2)}  # another shape
    with pytest.raises(ConsumerError, match=r"dense weight top\.weight"):
        applier.apply([bad])
    unknown = window([rows])
    unknown.dense = {"nope.weight": torch.zeros(1)}
    with pytest.raises(ConsumerError, match="not in the serving model"):
        applier.apply([unknown])
    after = snapshot(serving)
    assert all(torch.equal(after[k], before[k]) for k in before)  # not even the rows
    # a DMP's "module." prefix is accepted; values are cast to the served dtype
    good = window([rows])
    good.dense = {"module.top.bias": torch.tensor([2.5], dtype=torch.float64)}
    assert applier.apply([good]) == 3
    assert serving.top.bias.dtype == torch.float32 and float(serving.top.bias.detach()) == 2.5
    assert torch.equal(serving.ebc.embedding_bags["t0"].weight[:3], torch.ones(3, 8))
    assert applier.apply_dense({"top.bias": torch.tensor([-1.0])}) == 1
    assert float(serving.top.bias.detach()) == -1.0


# -- QuantApplier: packed rows of another layout ----------------------------------------------


@pytest.mark.parametrize(
    ("serve", "wire"),
    [(ServeDtype.INT4, WireDtype.PACKED_INT8), (ServeDtype.INT8, WireDtype.PACKED_INT4),
     (ServeDtype.FP16, WireDtype.PACKED_INT8), (ServeDtype.INT8, WireDtype.PACKED_FP16)],
    ids=lambda v: v.value,
)  # fmt: skip
def test_quant_applier_refuses_packed_rows_of_another_layout(
    serve: ServeDtype, wire: WireDtype
) -> None:
    served = quantize_model(Ranker(seed=0), serve)
    applier = QuantApplier(served)
    before = snapshot(served)
    values = torch.randn(5, 8)
    s = ShardUpdate(Shard.columns_of("t0", 1000, 8, 0, 8), torch.arange(5), None)
    s.packed = pack_rows(values, ServeDtype(wire.value[len("packed-") :]))
    with pytest.raises(ConfigError, match=f"table t0: {wire.value} rows are not the layout"):
        applier.apply([window([s], wire)])
    after = snapshot(served)
    assert all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(ConfigError, match=wire.value):  # the up-front check says the same
        applier.check_wire_dtype(wire)


@pytest.mark.parametrize("serve", [ServeDtype.INT8, ServeDtype.INT4, ServeDtype.FP16])
def test_quant_applier_keeps_float_wires_and_its_own_packed_layout(serve: ServeDtype) -> None:
    fm = Ranker(seed=0)
    served = quantize_model(fm, serve)
    applier = QuantApplier(served)
    own = {ServeDtype.INT8: WireDtype.PACKED_INT8, ServeDtype.INT4: WireDtype.PACKED_INT4,
           ServeDtype.FP16: WireDtype.PACKED_FP16}[serve]  # fmt: skip
    for wire in (WireDtype.FP32, WireDtype.FP16, own):
        applier.check_wire_dtype(wire)
        ids = torch.randperm(1000)[:20]
        values = torch.randn(20, 8)
        with torch.no_grad():
            fm.ebc.embedding_bags["t0"].weight[ids] = values
        s = ShardUpdate(Shard.columns_of("t0", 1000, 8, 0, 8), ids, values)
        if wire.packed:
            s.packed, s.values = pack_rows(values, serve), None
        assert applier.apply([window([s], wire)]) == 20
    ref = quantize_model(fm, serve).state_dict()
    got = served.state_dict()
    assert all(torch.equal(raw(got[k]), raw(ref[k])) for k in ref)


def test_quant_applier_refuses_a_mismatched_packed_pull_before_installing_it(
    tmp_path: Path, redis_url: str
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables=SPECS)
    spool.delta()
    served = quantize_model(Ranker(seed=0), ServeDtype.INT4)
    applier = QuantApplier(served)
    before = snapshot(served)
    srv = SidecarServer(server_config(root, redis_url)).start()
    try:
        endpoints = (srv.endpoint,)
        wrong = PullOptions(wire_dtype=WireDtype.PACKED_INT8, dense=False)
        cfg = ConsumerConfig(consumer="p", model="m", sidecars=endpoints, pull=wrong)
        # a bootstrap: its rows are streamed into a stage, which apply refuses to install
        refused = pytest.raises(ConfigError, match="packed-int8 rows are not the layout")
        with DeltaConsumer(cfg) as c, refused:
            c.sync(applier.apply)
        after = snapshot(served)
        assert all(torch.equal(after[k], before[k]) for k in before)
        # the table's own packed layout: bit-equal to quantizing the trainer's tables
        right = PullOptions(wire_dtype=WireDtype.PACKED_INT4, dense=False)
        cfg = ConsumerConfig(consumer="p", model="m", sidecars=endpoints, pull=right)
        with DeltaConsumer(cfg) as c:
            r = c.sync(applier.apply)
            assert r.step == 10 and r.caught_up
    finally:
        srv.stop(0)
    fm = Ranker(seed=0)
    with torch.no_grad():
        for t in SPECS:
            fm.ebc.embedding_bags[t].weight.copy_(spool.truth[t])
    ref, got = quantize_model(fm, ServeDtype.INT4).state_dict(), served.state_dict()
    assert all(torch.equal(raw(got[k]), raw(ref[k])) for k in ref)


# -- TensorDictApplier: floating-point tables only --------------------------------------------


def test_tensor_dict_applier_refuses_tables_rows_would_be_truncated_into() -> None:
    with pytest.raises(ConfigError, match=r"table 't' has dtype torch.int64, not a floating"):
        TensorDictApplier({"t": torch.zeros(1000, 8, dtype=torch.int64)})
    with pytest.raises(ConfigError, match="not a floating-point dtype"):
        TensorDictApplier(dtype=torch.int32)
    with pytest.raises(ConfigError, match="not a tensor"):
        TensorDictApplier({"t": [[0.0]]})  # type: ignore[dict-item]
    ok = TensorDictApplier({"t": torch.zeros(4, 2, dtype=torch.float16)})
    s = ShardUpdate(Shard.columns_of("t", 4, 2, 0, 2), torch.tensor([1]), torch.tensor([[0.5, 2]]))
    assert ok.apply([window([s])]) == 1
    assert ok.tables()["t"][1].tolist() == [0.5, 2.0]
