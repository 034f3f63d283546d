"""Packed wire dtypes: rows in the byte layout of TorchRec's quantized inference tables.

The truth is torchrec itself: a float EBC quantized with ``quantize_embeddings`` (fbgemm's
inference TBE underneath); the packed bytes deltad sends for the same float rows must equal the
bytes of that table's rows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from serverkit import Client, SpoolWriter, redis_server, server_config, wait_for
from torchrec.inference.modules import quantize_embeddings
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from deltad import wire
from deltad.consume import decode, quant
from deltad.consume.quant import QuantApplier, quant_tables, quantize_model
from deltad.serve.edge.app import SidecarServer
from deltad.serve.windows import encode
from deltad.store import EmbeddedRedis
from deltad.types import Form, ServeDtype, WireDtype
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]

PACKED = [WireDtype.PACKED_INT8, WireDtype.PACKED_INT4, WireDtype.PACKED_FP16]
_QDTYPE = {
    WireDtype.PACKED_INT8: torch.qint8,
    WireDtype.PACKED_INT4: torch.quint4x2,
    WireDtype.PACKED_FP16: torch.float16,
}
_SERVE = {
    ServeDtype.INT8: WireDtype.PACKED_INT8,
    ServeDtype.INT4: WireDtype.PACKED_INT4,
    ServeDtype.FP16: WireDtype.PACKED_FP16,
}


class _Holder(torch.nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc


def torchrec_rows(table: torch.Tensor, dtype: WireDtype) -> torch.Tensor:
    """The rows of ``table`` as torchrec's quantized inference table holds them (int8 / int4:
    fp16 scale, fp16 bias, codes, padding): the packed wire's layout, byte for byte."""
    n, dim = table.shape
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=n, feature_names=["f"])
        ],
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(table)
    q = quantize_embeddings(_Holder(ebc), dtype=_QDTYPE[dtype], inplace=False)
    w = q.ebc.state_dict()["embedding_bags.t.weight"]
    return w.contiguous().view(torch.uint8).reshape(n, -1)


def _same_bytes(packed: torch.Tensor, table: torch.Tensor, dtype: WireDtype) -> None:
    want = torchrec_rows(table, dtype)
    used = wire.packed_data_bytes(table.shape[1], dtype)
    assert packed.dtype is torch.uint8 and packed.shape[0] == want.shape[0]
    if packed.shape[1] == want.shape[1]:  # the table's own row size: the whole row
        assert torch.equal(packed, want)
    assert torch.equal(packed[:, :used], want[:, :used])
    assert not packed[:, used:].any()  # padding is zero


@pytest.mark.parametrize("dtype", PACKED)
def test_one_packer_for_the_wire_and_the_applier(dtype: WireDtype) -> None:
    """The applier's packer is the wire's (same bytes, the TBE layout: scale and bias first);
    rows are packed block by block (more rows than one block here)."""
    n = wire.PACK_BLOCK_ROWS + 37
    table = torch.randn(n, 16) * torch.logspace(-3, 1, n).unsqueeze(1)
    out = torch.full((n, 32), 7, dtype=torch.uint8)
    wire.pack_rows(table, dtype, out)
    _same_bytes(out, table, dtype)
    serve = {v: k for k, v in _SERVE.items()}[dtype]
    assert quant.packed_wire_dtype(serve) is dtype
    assert torch.equal(quant.pack_rows(table, serve, 32), out)
    if dtype is not WireDtype.PACKED_FP16:  # scale and bias first: the first 4 bytes are fp16
        sb = out[:, :4].contiguous().view(torch.float16).float()
        assert torch.equal(sb[:, 1], table.amin(dim=1).half().float())  # bias = fp16(min)
    with pytest.raises(ValueError, match="need"):
        wire.pack_rows(table, dtype, out[:, :8])


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("dim", [4, 8, 16, 24, 64])
def test_packed_rows_equal_torchrec_quantization(dtype: WireDtype, dim: int) -> None:
    torch.manual_seed(dim)
    table = torch.randn(50, dim) * torch.logspace(-4, 1, 50).unsqueeze(1)
    table[3] = 0.25  # a constant row
    rb = wire.packed_row_bytes(dim, dtype, 16)
    assert rb % 16 == 0
    assert torchrec_rows(table, dtype).shape[1] == rb  # torchrec's CPU row alignment is 16
    ids = torch.arange(50, dtype=torch.int64)
    msgs = [encode.encode_header(_header(dtype, dim, 50, 16))]
    msgs += encode.encode_shard_chunks(0, ids, table, dtype, 64 * 7)  # several chunks
    msgs.append(encode.encode_trailer(pb.DeltaTrailer(rows=50)))
    for zero_copy in (False, True):
        d = decode.decode_stream(msgs, zero_copy=zero_copy)
        assert d.wire_dtype is dtype and all(s.values is None for s in d.shards)
        packed = torch.cat([s.packed for s in d.shards if s.packed is not None])
        assert torch.equal(torch.cat([s.ids for s in d.shards]), ids)
        _same_bytes(packed, table, dtype)
    # parsed protobuf messages decode the same
    parsed = decode.decode_stream(pb.GetDeltaResponse.FromString(m) for m in msgs)
    assert parsed.shards[0].packed is not None
    _same_bytes(parsed.shards[0].packed, table, dtype)


_LEAN_PACK = """
import sys, torch
from deltad import wire
from deltad.types import WireDtype
assert wire.preload_quantizer()
table = torch.load(sys.argv[1])
outs = {}
for name in ("PACKED_INT8", "PACKED_INT4"):
    dtype = WireDtype[name]
    out = torch.empty(table.shape[0], wire.packed_row_bytes(table.shape[1], dtype, 16), dtype=torch.uint8)
    wire.pack_rows(table, dtype, out)
    outs[name] = out
torch.save(outs, sys.argv[2])
print(sorted(m for m in sys.modules if m.split(".")[0] in ("fbgemm_gpu", "sympy")))
"""


def test_the_sidecar_loads_only_fbgemm_s_quantizers_and_packs_the_same_bytes(
    tmp_path: Path,
) -> None:
    """A process that has not imported ``fbgemm_gpu`` (the sidecar) loads only the library
    holding the quantizers (not the package, whose import pulls in sympy: ~45 MB of RSS), and
    its packed rows are byte-equal to torchrec's quantization."""
    torch.manual_seed(5)
    table = torch.randn(300, 24) * torch.logspace(-4, 1, 300).unsqueeze(1)
    torch.save(table, tmp_path / "table.pt")
    done = subprocess.run(
        [sys.executable, "-c", _LEAN_PACK, str(tmp_path / "table.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"  # neither the fbgemm_gpu package nor sympy imported
    outs = torch.load(tmp_path / "out.pt")
    for name in ("PACKED_INT8", "PACKED_INT4"):
        _same_bytes(outs[name], table, WireDtype[name])


def _header(dtype: WireDtype, dim: int, n: int, align: int) -> pb.DeltaHeader:
    return pb.DeltaHeader(
        form=pb.FORM_ROWS,
        dtype=wire.dtype_to_pb(dtype),
        row_alignment=align,
        slices=[
            pb.TableSlice(
                table="t",
                num_rows=n,
                dim=dim,
                col_start=0,
                col_end=dim,
                count=n,
                row_bytes=wire.packed_row_bytes(dim, dtype, align),
            )
        ],
    )


def test_packed_row_sizes_and_alignment() -> None:
    # fbgemm row layout: int8 dim 16 -> 32 B, dim 32 -> 48 B; int4 dim 16 -> 16 B; fp16 2 * D
    assert wire.packed_row_bytes(16, WireDtype.PACKED_INT8, 16) == 32
    assert wire.packed_row_bytes(32, WireDtype.PACKED_INT8, 16) == 48
    assert wire.packed_row_bytes(16, WireDtype.PACKED_INT4, 16) == 16
    assert wire.packed_row_bytes(24, WireDtype.PACKED_FP16, 16) == 48
    assert wire.packed_row_bytes(16, WireDtype.PACKED_INT8, 1) == 20
    assert wire.check_row_alignment(0) == 16
    assert wire.packed_refusal(WireDtype.PACKED_INT8, 8, 0, 8) is None
    assert wire.packed_refusal(WireDtype.PACKED_FP16, 7, 0, 7) is None
    assert "multiple of 2" in str(wire.packed_refusal(WireDtype.PACKED_INT8, 7, 0, 7))
    assert "multiple of 4" in str(wire.packed_refusal(WireDtype.PACKED_INT4, 6, 0, 6))
    assert "column-wise" in str(wire.packed_refusal(WireDtype.PACKED_FP16, 8, 0, 4))
    for bad in (3, 12, 8192):
        with pytest.raises(ValueError, match="power of two"):
            wire.check_row_alignment(bad)


def test_decoder_refuses_a_packed_slice_of_the_wrong_size() -> None:
    h = _header(WireDtype.PACKED_INT8, 8, 2, 16)
    h.slices[0].row_bytes = 12  # unpadded: not the 16-byte rows the alignment says
    with pytest.raises(decode.StreamDecodeError, match="expected 16"):
        decode.decode_stream([encode.encode_header(h)])
    h = _header(WireDtype.PACKED_INT8, 8, 2, 16)
    h.slices[0].col_end = 4  # a column slice cannot be packed
    with pytest.raises(decode.StreamDecodeError, match="column-wise"):
        decode.decode_stream([encode.encode_header(h)])
    h.slices[0].dtype = pb.WIRE_DTYPE_FP32  # ... it travels as fp32, without row_bytes
    with pytest.raises(decode.StreamDecodeError, match="without row_bytes"):
        decode.decode_stream([encode.encode_header(h)])
    h.slices[0].row_bytes = 0
    h.slices[0].count = 0
    assert decode.decode_stream(
        [encode.encode_header(h), encode.encode_trailer(pb.DeltaTrailer())]
    ).slices[0].values.shape == (0, 4)
    h.slices[0].dtype = pb.WIRE_DTYPE_INT8  # fp32 is the only fallback
    with pytest.raises(decode.StreamDecodeError, match="only fp32"):
        decode.decode_stream([encode.encode_header(h)])
    h = _header(WireDtype.PACKED_INT8, 8, 2, 16)
    h.dtype, h.row_alignment = pb.WIRE_DTYPE_FP16, 0
    h.slices[0].row_bytes, h.slices[0].dtype = 0, pb.WIRE_DTYPE_FP32  # not in a packed response
    with pytest.raises(decode.StreamDecodeError, match="only fp32"):
        decode.decode_stream([encode.encode_header(h)])


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_pull_through_a_real_sidecar(
    tmp_path, redis_server: EmbeddedRedis, dtype: WireDtype
) -> None:
    """Base, then merged deltas (one of which touches every row again), pulled packed: the
    bytes of every row equal torchrec's quantization of the true float row at the head."""
    specs = {"t0": (300, 16), "t1": (200, 8)}
    spool = SpoolWriter(tmp_path / "spool", tables=specs)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    served = _quant_ebc(specs, dtype)  # a QuantApplier copies the rows, at any alignment
    applier = QuantApplier(served)
    try:
        held: dict[str, torch.Tensor] = {}
        d = c.pull("p", dtype=dtype, chunk_bytes=1)  # smallest chunks
        applier.apply([d])
        assert d.resync and d.wire_dtype is dtype
        for s in d.shards:
            assert s.values is None and s.packed is not None
            held.setdefault(
                s.shard.table, torch.zeros(s.shard.num_rows, s.packed.shape[1], dtype=torch.uint8)
            )
            held[s.shard.table][s.ids] = s.packed
        c.commit(d)
        spool.delta()
        spool.delta({"t0": list(range(300)), "t1": [1, 2, 3]})
        spool.delta()
        wait_for(lambda: (sn := srv.log.snapshot()) is not None and sn.head.seq == 3)
        for align in (64, 0):  # the default (16) last: its rows update ``held``
            d = c.pull("p", dtype=dtype, row_alignment=align)
            assert d.rows > 300
            for s in d.shards:
                assert s.packed is not None
                assert s.packed.shape[1] == wire.packed_row_bytes(s.shard.dim, dtype, align or 16)
                _same_bytes(s.packed, spool.truth[s.shard.table][s.ids], dtype)
            if align == 64:
                applier.apply([d])
                tables = quant_tables(served)
                for t in specs:  # rows of 64-byte alignment into tables of 16
                    assert torch.equal(tables[t].rows, torchrec_rows(spool.truth[t], dtype))
        for s in d.shards:
            assert s.packed is not None
            held[s.shard.table][s.ids] = s.packed
        for t, rows in held.items():
            _same_bytes(rows, spool.truth[t], dtype)
        # top-k over packed rows: the planning is on float values, only the encoding packs
        d = c.pull("p", Form.TOPK, dtype=dtype, k=5)
        assert all(s.packed is not None and s.packed.shape[0] == 5 for s in d.shards)
        for s in d.shards:
            assert s.packed is not None
            _same_bytes(s.packed, spool.truth[s.shard.table][s.ids], dtype)
    finally:
        c.close()
        srv.stop(0)


def _quant_ebc(specs: dict[str, tuple[int, int]], dtype: WireDtype) -> torch.nn.Module:
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[t])
            for t, (n, d) in specs.items()
        ],
        device=torch.device("cpu"),
    )
    serve = {v: k for k, v in _SERVE.items()}[dtype]
    return quantize_model(_Holder(ebc), serve)


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_pull_sends_column_wise_shards_as_fp32(
    tmp_path, redis_server: EmbeddedRedis, dtype: WireDtype
) -> None:
    """A rank holding tables column-wise: a packed pull sends those slices as fp32 values
    (TableSlice.dtype), a QuantApplier assembles their rows, and the served table bytes equal
    torchrec's quantization of the true tables, after the base and after merged deltas."""
    specs = {"t0": (100, 8), "t1": (60, 16)}
    spool = SpoolWriter(tmp_path / "spool", tables=specs, col_split=2)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    served = _quant_ebc(specs, dtype)
    applier = QuantApplier(served)
    try:
        wait_for(lambda: srv.log.snapshot() is not None)
        for step in range(3):
            if step:
                spool.delta({"t0": [0, 5, 99], "t1": list(range(0, 60, 2))})
                wait_for(lambda s=step: (sn := srv.log.snapshot()) is not None and sn.head.seq == s)
            d = c.pull("p", dtype=dtype, raw=step != 1)  # the protobuf decoder once
            assert d.wire_dtype is dtype and len(d.shards) == 4  # 2 tables x 2 column slices
            for s in d.shards:
                assert s.packed is None and s.values is not None
                assert s.values.dtype is torch.float32
                assert s.values.shape == (s.ids.numel(), s.shard.col_end - s.shard.col_start)
                assert torch.equal(
                    s.values, spool.truth[s.shard.table][s.ids, s.shard.col_start : s.shard.col_end]
                )
            applier.apply([d])
            c.commit(d)
            tables = quant_tables(served)
            assert applier.pending_rows == 0
            for t in specs:
                assert torch.equal(tables[t].rows, torchrec_rows(spool.truth[t], dtype)), t
        # a fresh consumer: base + 2 deltas merged range by range (MergedShard), as fp32
        fresh = _quant_ebc(specs, dtype)
        d = c.pull("r", dtype=dtype, chunk_bytes=1)
        assert d.resync and all(s.packed is None for s in d.shards)
        QuantApplier(fresh).apply([d])
        for t in specs:
            assert torch.equal(quant_tables(fresh)[t].rows, torchrec_rows(spool.truth[t], dtype))
        # ids need no packing; a bad alignment is still refused
        assert c.pull("q", Form.IDS, dtype=dtype).rows == 320  # 2 col slices each
        with pytest.raises(grpc.RpcError) as e:
            c.pull("q", dtype=dtype, row_alignment=24)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.close()
        srv.stop(0)
