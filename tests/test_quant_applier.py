"""QuantApplier: in-place row updates of torchrec quantized inference models, bit-exact."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from deltad.reference.trainer.data import ClickStream
from deltad.reference.trainer.model import ClickModel
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from deltad.consume.quant import QuantApplier, pack_rows, quant_tables, quantize_model
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConfigError, ConsumerError
from deltad.types import ApplyConsistency, Cursor, Form, ServeDtype, Shard, WireDtype

pytestmark = pytest.mark.timeout(120)

TABLES = {"t0": 50, "t1": 37}  # two tables: one TBE holds both
SEQ_ROWS = 29
DIM = 16
DTYPES = [ServeDtype.INT8, ServeDtype.INT4, ServeDtype.FP16, ServeDtype.FP32]


def float_model(seed: int = 0) -> ClickModel:
    torch.manual_seed(seed)
    return ClickModel(TABLES, SEQ_ROWS, dim=DIM, zch_slots=0).eval()  # ordinary tables only


def float_tables(m: Any) -> dict[str, torch.Tensor]:
    out = {n: m.ebc.embedding_bags[n].weight for n in TABLES}
    out["seq"] = m.ec.embeddings["seq"].weight
    return out


def batch() -> object:
    return ClickStream(TABLES, SEQ_ROWS, batch_size=16, seed=3).next_batch()


def delta(slices: list[ShardUpdate], *, resync: bool = False, rank: int = 0) -> RankDelta:
    return RankDelta(
        rank=rank, generation=0, resync=resync, from_seq=0, to_seq=1, to_step=1,
        form=Form.ROWS, wire_dtype=WireDtype.FP32, cursor=Cursor("c", rank, 0, 1, 1),
        shards=slices,
    )  # fmt: skip


def sl(
    table: str, ids: torch.Tensor, values: torch.Tensor, c0: int = 0, c1: int = DIM
) -> ShardUpdate:
    rows = SEQ_ROWS if table == "seq" else TABLES.get(table, 10)
    return ShardUpdate(Shard.columns_of(table, rows, DIM, c0, c1), ids, values)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes behind torchrec's UInt4Tensor state_dict wrapper (or the tensor itself)."""
    return getattr(t, "elem", t)


def assert_same(served: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every state_dict byte and the forward output on a fixed batch are equal."""
    a, b = served.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(raw(a[k]), raw(b[k])), k
    with torch.inference_mode():
        out_a, out_b = served(batch())[1], ref(batch())[1]
    assert torch.equal(out_a, out_b)


def random_updates(fm: torch.nn.Module, gen: torch.Generator) -> list[ShardUpdate]:
    """Change random rows of every float table in ``fm``; the slices that say so."""
    out = []
    for name, w in float_tables(fm).items():
        ids = torch.randperm(w.shape[0], generator=gen)[: w.shape[0] // 3]
        vals = torch.randn(ids.numel(), DIM, generator=gen) * 0.3
        vals[0] = 0.0  # a constant row (scale 0) is quantized too
        with torch.no_grad():
            w[ids] = vals
        out.append(sl(name, ids, vals))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("packed", [False, True], ids=["float", "packed"])
def test_rows_applied_in_place_equal_quantizing_the_updated_tables(
    dtype: ServeDtype, packed: bool
) -> None:
    fm = float_model()
    served = quantize_model(fm, dtype)
    applier = QuantApplier(served)
    weights_before = {n: t.rows.data_ptr() for n, t in applier.quant_tables.items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        slices = random_updates(fm, gen)
        if packed:
            for s in slices:
                assert s.values is not None
                s.packed = pack_rows(s.values, dtype)  # type: ignore[attr-defined]
                s.values = None
        assert applier.apply([delta(slices)]) == sum(s.ids.numel() for s in slices)
    assert {n: t.rows.data_ptr() for n, t in applier.quant_tables.items()} == weights_before
    ref = quantize_model(fm, dtype)
    assert_same(served, ref)
    # and it really changed something: the untouched quantized model differs
    stale = quantize_model(float_model(), dtype)
    assert any(
        not torch.equal(raw(a), raw(b))
        for a, b in zip(stale.state_dict().values(), ref.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_column_shards_complete_rows_across_ranks_and_windows(dtype: ServeDtype) -> None:
    fm = float_model()
    served = quantize_model(fm, dtype)
    applier = QuantApplier(served, chunk_rows=3)
    w = fm.ec.embeddings["seq"].weight
    ids = torch.tensor([3, 7, 11, 20])
    new = torch.randn(4, DIM)
    with torch.no_grad():
        w[ids] = new
    # window 1: rank 0 sends columns 0:8 of all four rows, rank 1 columns 8:16 of two of them
    applier.apply([
        delta([sl("seq", ids, new[:, :8], 0, 8)], rank=0),
        delta([sl("seq", ids[:2], new[:2, 8:], 8, 16)], rank=1),
    ])  # fmt: skip
    quantized = dtype in (ServeDtype.INT8, ServeDtype.INT4)
    assert applier.pending_rows == (2 if quantized else 0)
    # window 2: the rest of the columns arrive
    applier.apply([delta([sl("seq", ids[2:], new[2:, 8:], 8, 16)], rank=1)])
    assert applier.pending_rows == 0
    assert_same(served, quantize_model(fm, dtype))
    # window 3 (top-k: ranks pick rows independently): only rank 1 resends row 3's columns
    later = torch.randn(1, 8)
    with torch.no_grad():
        w[3, 8:] = later[0]
    applier.apply([delta([sl("seq", ids[:1], later, 8, 16)], rank=1)])
    assert_same(served, quantize_model(fm, dtype))


def test_dense_weights_and_rows_of_one_window() -> None:
    fm = float_model()
    served = quantize_model(fm, ServeDtype.INT8)
    applier = QuantApplier(served)
    trained = float_model(seed=5)  # other dense weights and tables
    rows = [
        sl(n, torch.arange(w.shape[0]), w.detach().clone())
        for n, w in float_tables(trained).items()
    ]
    d = delta(rows)
    dense = {k: v for k, v in trained.state_dict().items() if not k.startswith(("ebc.", "ec."))}
    # + the non-persistent buffer the publisher sends too (it names every named_buffer)
    assert dense and applier.dense_names == sorted({*dense, "tri"})
    dense["tri"] = dict(trained.named_buffers())["tri"]
    d.dense = dense  # type: ignore[attr-defined]
    applier.apply([d])
    assert_same(served, quantize_model(trained, ServeDtype.INT8))
    # apply_dense alone, by state_dict name (a DMP's "module." prefix is accepted)
    again = float_model(seed=9)
    applier.apply_dense(
        {f"module.{k}": v for k, v in again.state_dict().items() if k.startswith("over.")}
    )
    served_any: Any = served
    assert torch.equal(served_any.over[0].weight, again.over[0].weight)
    with pytest.raises(ConsumerError, match="not in the serving model"):
        applier.apply_dense({"nope.weight": torch.zeros(1)})
    with pytest.raises(ConsumerError, match="sent"):
        applier.apply_dense({"over.0.weight": torch.zeros(2, 2)})


def test_bad_shard_updates_write_nothing() -> None:
    fm = float_model()
    served = quantize_model(fm, ServeDtype.INT8)
    applier = QuantApplier(served)
    before = copy.deepcopy(served.state_dict())
    good = sl("t0", torch.tensor([1, 2]), torch.randn(2, DIM))
    for bad, why in [
        (sl("t9", torch.tensor([1]), torch.randn(1, DIM)), "not in the inference model"),
        (
            ShardUpdate(
                Shard.columns_of("t0", 51, DIM, 0, DIM), torch.tensor([1]), torch.randn(1, DIM)
            ),
            "shape",
        ),
        (sl("t0", torch.tensor([50]), torch.randn(1, DIM)), "out of range"),
        (sl("t0", torch.tensor([1]), torch.randn(1, 3)), "values"),
        (
            ShardUpdate(Shard.columns_of("t0", 50, DIM, 0, DIM), torch.tensor([1]), None),
            "no values",
        ),
    ]:
        with pytest.raises(ConsumerError, match=why):
            applier.apply([delta([good]), delta([bad], rank=1)])
    p = sl("t1", torch.tensor([1]), torch.randn(1, DIM))
    p.packed = torch.zeros(1, 7, dtype=torch.uint8)  # type: ignore[attr-defined]
    with pytest.raises(ConsumerError, match="packed rows of 7 bytes"):
        applier.apply([delta([good, p])])
    for k, v in served.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_bf16_is_a_clear_error_and_never_reaches_torchrec() -> None:
    with pytest.raises(ConfigError, match="bf16 is not supported"):
        quantize_model(float_model(), ServeDtype.BF16)
    with pytest.raises(ConfigError, match="not one of"):
        quantize_model(float_model(), "int3")


def test_tables_share_one_tbe_at_their_offsets() -> None:
    served = quantize_model(float_model(), ServeDtype.INT4)
    t = quant_tables(served)
    assert set(t) == {"t0", "t1", "seq"}
    assert t["t0"].tbe is t["t1"].tbe and (t["t0"].index, t["t1"].index) == (0, 1)
    assert t["t0"].row_bytes == 16 and t["t0"].data_bytes == DIM // 2 + 4
    sd = served.state_dict()  # torchrec's state_dict shares the TBE storage
    assert raw(sd["ebc.embedding_bags.t1.weight"]).data_ptr() == t["t1"].rows.data_ptr()


def test_shard_quant_model_needs_cuda() -> None:
    """torchrec (1.8 and 1.9) cannot shard a quantized model for inference on CPU: its sharded
    TBE allocates on CUDA even with compute_device="cpu"; the applier serves unsharded models.
    A CPU torch build says "not compiled with CUDA" (AssertionError); a CUDA build on a machine
    without a GPU (torch 2.14.1 here) "no NVIDIA driver" (RuntimeError)."""
    from torchrec.inference.modules import shard_quant_model

    served = quantize_model(float_model(), ServeDtype.INT8)
    with pytest.raises((AssertionError, RuntimeError), match=r"CUDA|NVIDIA"):
        shard_quant_model(served, world_size=1, compute_device="cpu", sharding_device="cpu")


class BigRows(torch.nn.Module):
    """One EBC table of wide rows: copying a window takes long enough for a reader to land
    in the middle of it (without the lock, WINDOW readers see mixed windows)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        cfg = EmbeddingBagConfig(
            name="big", embedding_dim=dim, num_embeddings=rows, feature_names=["f"]
        )
        self.ebc = EmbeddingBagCollection(tables=[cfg])


@pytest.mark.parametrize("mode", list(ApplyConsistency), ids=lambda m: m.value)
def test_concurrent_readers_never_see_a_torn_row(mode: ApplyConsistency) -> None:
    """Readers in a thread during applies: every row they see is wholly one version (CHUNK);
    with WINDOW, all rows they see are of one window. Rows are told apart by a checksum."""
    n, dim = 64, 4096
    served = quantize_model(BigRows(n, dim), ServeDtype.INT8)
    applier = QuantApplier(served, consistency=mode, chunk_rows=4)
    rows = applier.quant_tables["big"].rows
    versions = [torch.full((n, dim), float(v)) + torch.arange(dim) * 1e-3 for v in range(1, 80)]
    weights = torch.randint(
        1, 1 << 20, (rows.shape[1] // 4,), generator=torch.Generator().manual_seed(0)
    )

    def checksum(x: torch.Tensor) -> torch.Tensor:
        return (x.contiguous().view(torch.int32).to(torch.int64) * weights).sum(1)

    version_of = dict.fromkeys(checksum(rows).tolist(), -1)  # the initial rows
    for v, values in enumerate(versions):
        version_of[int(checksum(pack_rows(values[:1], ServeDtype.INT8, rows.shape[1]))[0])] = v
    stop = threading.Event()
    seen: list[set[int]] = []

    def reader() -> None:
        while not stop.is_set() and len(seen) < 20_000:
            with applier.serving():
                snap = rows.clone()
            seen.append({version_of.get(c, -2) for c in checksum(snap).tolist()})

    th = threading.Thread(target=reader)
    th.start()
    try:
        for values in versions:
            applier.apply(
                [
                    delta(
                        [
                            ShardUpdate(
                                Shard.columns_of("big", n, dim, 0, dim), torch.arange(n), values
                            )
                        ]
                    )
                ]
            )
    finally:
        stop.set()
        th.join(30)
    assert len(seen) > 10 and not th.is_alive()
    assert all(-2 not in s for s in seen), "a reader saw a torn row"
    if mode is ApplyConsistency.WINDOW:
        assert all(len(s) == 1 for s in seen), "a reader saw two windows at once"
    assert applier.stats.chunks == n // 4 and applier.stats.rows == n
    assert applier.stats.max_hold_s > 0


def test_forwards_run_during_applies() -> None:
    """A real forward through serve() while windows are applied: it returns and at the end
    equals the forward of torchrec's quantization of the final tables."""
    fm = float_model()
    served = quantize_model(fm, ServeDtype.INT8)
    applier = QuantApplier(served, chunk_rows=3)
    forward = applier.serve(lambda b: served(b)[1])
    b = batch()
    stop = threading.Event()
    outputs: list[torch.Tensor] = []

    def loop() -> None:
        while not stop.is_set() and len(outputs) < 10_000:
            outputs.append(forward(b))

    th = threading.Thread(target=loop)
    th.start()
    gen = torch.Generator().manual_seed(4)
    try:
        for _ in range(20):
            applier.apply([delta(random_updates(fm, gen))])
    finally:
        stop.set()
        th.join(30)
    assert outputs and not th.is_alive()
    assert_same(served, quantize_model(fm, ServeDtype.INT8))


@pytest.mark.slow  # subprocesses that import torch
def test_consume_serve_dtype_flag_errors() -> None:
    """`deltad consume`: bf16 and contradictory serving flags exit 2 with one clear line."""
    import subprocess
    import sys

    from spoolkit import child_env

    base = [
        sys.executable,
        "-m",
        "deltad.commands.main",
        "consume",
        "--consumer",
        "p",
        "--sidecar",
        "127.0.0.1:1",
    ]
    for extra, why in (
        (["--serve-dtype", "bf16"], "invalid choice: 'bf16'"),  # not offered
        (["--final-state", "x.pt"], "--final-state needs --serve-dtype"),
        (["--serve-dtype", "int8", "--init-tables", "x.pt"], "bootstraps from deltad"),
        (["--serve-dtype", "int8", "--dim", "6"], "dim a multiple of 4"),
        (["--dtype", "packed-int8"], "use it with --serve-dtype int8"),
        (["--serve-dtype", "int4", "--dtype", "packed-int8"], "use it with --serve-dtype int8"),
        (["--serve-dtype", "fp32", "--dtype", "packed-fp16"], "use it with --serve-dtype fp16"),
    ):
        out = subprocess.run(
            [*base, *extra], capture_output=True, text=True, timeout=60, env=child_env()
        )
        lines = [x for x in out.stderr.splitlines() if x.startswith("deltad")]
        assert out.returncode == 2 and why in out.stderr and len(lines) == 1, (extra, out.stderr)


def test_consume_pulls_the_serving_tables_packed_form_by_default() -> None:
    """`deltad consume --serve-dtype X` pulls rows packed in X's table layout unless --dtype
    says otherwise; fp32 tables take fp32 values, plain predictors fp32."""
    from deltad.reference.consumers.cli import _wire_dtype

    assert _wire_dtype(None, "int8") is WireDtype.PACKED_INT8
    assert _wire_dtype(None, "int4") is WireDtype.PACKED_INT4
    assert _wire_dtype(None, "fp16") is WireDtype.PACKED_FP16
    assert _wire_dtype(None, "fp32") is WireDtype.FP32
    assert _wire_dtype(None, None) is WireDtype.FP32
    assert _wire_dtype("fp32", "int8") is WireDtype.FP32
    assert _wire_dtype("packed-int4", "int4") is WireDtype.PACKED_INT4


@pytest.mark.parametrize("width", [80, 36, 7])
def test_row_copy_moves_bits_as_they_are(width: int) -> None:
    """Rows copied as 16-byte / 4-byte words / bytes keep every bit: NaN payloads (signalling
    ones too), negative zeros; rows of a view into a wider buffer land at their offsets."""
    from deltad.consume.inplace import copy_rows

    gen = torch.Generator().manual_seed(width)
    buf = torch.zeros(64, 96, dtype=torch.uint8)
    target = buf[:, :width]  # a strided view, as a table inside a TBE's buffer
    rows = torch.randint(0, 256, (40, width), dtype=torch.uint8, generator=gen)
    special = torch.tensor([0x7FF0000000000001, 0x7FF4000000000000, -(2**63), 1])
    if width >= 8:
        rows[:4, :8] = special.view(torch.uint8).view(4, 8)
    ids = torch.randperm(64, generator=gen)[:40]
    copy_rows(target, ids, rows)
    assert torch.equal(target[ids], rows)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[ids] = False
    assert not buf[untouched].any() and not buf[:, width:].any()
