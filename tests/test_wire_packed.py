"""Packed wire dtypes: rows in the byte layout of TorchRec's quantized inference tables.

The truth is torchrec itself: a float EBC quantized with ``quantize_embeddings`` (fbgemm's
inference TBE underneath); the packed bytes deltad sends for the same float rows must equal the
bytes of that table's rows.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from serverkit import Client, SpoolWriter, redis_server, server_config, wait_for
from torchrec.inference.modules import quantize_embeddings
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from deltad import wire
from deltad.consume import decode
from deltad.redisutil import EmbeddedRedis
from deltad.serve import encode
from deltad.serve.app import SidecarServer
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]

PACKED = [WireDtype.PACKED_INT8, WireDtype.PACKED_INT4, WireDtype.PACKED_FP16]
_QDTYPE = {
    WireDtype.PACKED_INT8: torch.qint8,
    WireDtype.PACKED_INT4: torch.quint4x2,
    WireDtype.PACKED_FP16: torch.float16,
}


class _Holder(torch.nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc


def torchrec_rows(table: torch.Tensor, dtype: WireDtype) -> torch.Tensor:
    """The rows of ``table`` as torchrec's quantized inference table holds them, in the wire's
    order (codes, scale, bias, padding; the TBE keeps scale and bias first)."""
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
    rows = w.contiguous().view(torch.uint8).reshape(n, -1)
    if dtype is WireDtype.PACKED_FP16:
        return rows
    data = wire.packed_data_bytes(dim, dtype) - wire.PACKED_SCALE_BIAS_BYTES
    sb = wire.PACKED_SCALE_BIAS_BYTES
    return torch.cat([rows[:, sb : sb + data], rows[:, :sb], rows[:, sb + data :]], dim=1)


def _same_bytes(packed: torch.Tensor, table: torch.Tensor, dtype: WireDtype) -> None:
    want = torchrec_rows(table, dtype)
    used = wire.packed_data_bytes(table.shape[1], dtype)
    assert packed.dtype is torch.uint8 and packed.shape[0] == want.shape[0]
    assert torch.equal(packed[:, :used], want[:, :used])
    assert not packed[:, used:].any()  # padding is zero


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


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_pull_through_a_real_sidecar(
    tmp_path, redis_server: EmbeddedRedis, dtype: WireDtype
) -> None:
    """Base, then merged deltas (one of which touches every row again), pulled packed: the
    bytes of every row equal torchrec's quantization of the true float row at the head."""
    spool = SpoolWriter(tmp_path / "spool", tables={"t0": (300, 16), "t1": (200, 8)})
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        held: dict[str, torch.Tensor] = {}
        d = c.pull("p", dtype=dtype, chunk_bytes=1)  # smallest chunks
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


def test_packed_pull_of_column_wise_shards_is_refused(
    tmp_path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool", tables={"t0": (100, 8)}, col_split=2)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        wait_for(lambda: srv.log.snapshot() is not None)
        with pytest.raises(grpc.RpcError) as e:
            c.pull("p", dtype=WireDtype.PACKED_INT8)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "column-wise" in str(e.value.details())
        # ids need no packing; fp32 values of column slices are fine
        assert c.pull("p", Form.IDS, dtype=WireDtype.PACKED_INT8).rows == 200  # 2 col slices
        assert c.pull("p", dtype=WireDtype.FP32).rows == 200
        with pytest.raises(grpc.RpcError) as e:
            c.pull("q", dtype=WireDtype.PACKED_FP16, row_alignment=24)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.close()
        srv.stop(0)
