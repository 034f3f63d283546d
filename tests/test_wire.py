"""The GetDelta wire format: hand-built messages are valid protobuf; the decoder's both paths."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch

from deltad import errors, wire
from deltad.buffers import BufferPool
from deltad.consume import decode
from deltad.serve.windows import encode
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb


def _stream(
    ids: torch.Tensor, values: torch.Tensor | None, dtype: WireDtype, chunk_bytes: int
) -> list[bytes]:
    header = pb.DeltaHeader(
        rank=1,
        generation=9,
        from_seq=3,
        to_seq=5,
        to_step=50,
        form=wire.form_to_pb(Form.IDS if values is None else Form.ROWS),
        dtype=wire.dtype_to_pb(dtype),
    )
    width = 0 if values is None else values.shape[1]
    header.slices.add(table="t", num_rows=10**6, dim=width + 2, col_start=2, col_end=2 + width,
                      count=ids.numel(), owed=4)  # fmt: skip
    msgs = [encode.encode_header(header)]
    msgs += encode.encode_shard_chunks(0, ids, values, dtype, chunk_bytes)
    cursor = pb.Cursor(consumer="c", rank=1, generation=9, seq=5, step=50, pull_id="p")
    msgs.append(encode.encode_trailer(pb.DeltaTrailer(cursor=cursor, rows=ids.numel())))
    return msgs


def test_hand_built_chunks_parse_as_protobuf() -> None:
    ids = torch.arange(1000, 1300)
    vals = torch.randn(300, 6)
    msgs = _stream(ids, vals, WireDtype.INT8, 4096)
    assert len(msgs) > 3
    parsed = [pb.GetDeltaResponse.FromString(m) for m in msgs]
    offset = 0
    for m in parsed[1:-1]:
        c = m.chunk
        assert c.offset == offset and c.slice == 0
        assert len(c.ids) == 8 * c.count and len(c.values) == 6 * c.count
        assert len(c.scale_bias) == 8 * c.count
        offset += c.count
    assert offset == 300
    assert parsed[0].SerializeToString() == msgs[0]


@pytest.mark.parametrize(
    ("slice_index", "rows", "dim", "dtype", "chunk_bytes", "skip"),
    [
        (0, 300, 6, WireDtype.FP32, 4096, 0),
        (5, 1000, 64, WireDtype.FP32, 20_000, 2),  # (offsets and counts past one varint byte)
        (200, 7, 3, WireDtype.FP16, 1 << 20, 0),  # (one chunk; a two-byte slice index)
        (1, 50, 0, WireDtype.FP32, 64, 1),  # (rows of no width: no values field)
        (2, 40_000, 4, WireDtype.BF16, 200_000, 3),
    ],
)
def test_rows_sent_as_they_are_are_built_from_addresses_byte_equal_to_protobuf(
    slice_index: int, rows: int, dim: int, dtype: WireDtype, chunk_bytes: int, skip: int
) -> None:
    """Rows already in the wire dtype take the address path (no tensor slices, no
    ChunkMessage); their messages are byte-equal to the general path's (taken for a strided
    view of the same rows) and to protobuf's serialization of the same chunks."""
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randperm(10**6, generator=gen)[:rows].sort().values
    vals = torch.randn(rows, dim, generator=gen).to(wire.WIRE_TORCH_DTYPE[dtype])
    strided = torch.empty(rows, dim + 1, dtype=vals.dtype)[:, :dim]
    strided.copy_(vals)
    assert encode._sent_as_they_are(ids, vals, dtype)
    assert dim == 0 or not encode._sent_as_they_are(ids, strided, dtype)
    assert not encode._sent_as_they_are(ids, vals.float(), WireDtype.INT8)
    fast = list(encode.encode_shard_chunks(slice_index, ids, vals, dtype, chunk_bytes,
                                           skip=encode.Skip(skip)))  # fmt: skip
    step = encode.rows_per_chunk(dim, dtype, chunk_bytes)
    offsets = list(range(0, rows, step))[skip:]
    assert len(fast) == len(offsets) >= 1
    if dim:  # the general path, for the strided view
        general = list(encode.encode_shard_chunks(slice_index, ids, strided, dtype, chunk_bytes,
                                                  skip=encode.Skip(skip)))  # fmt: skip
        assert fast == general
    raw = vals.view(torch.int16) if dtype is WireDtype.BF16 else vals
    for off, msg in zip(offsets, fast, strict=True):
        end = min(rows, off + step)
        assert msg == encode.encode_rows(slice_index, off, ids[off:end], vals[off:end], dtype)
        chunk = pb.RowChunk(slice=slice_index, offset=off, count=end - off,
                            ids=ids[off:end].numpy().tobytes(),
                            values=raw[off:end].numpy().tobytes())  # fmt: skip
        assert msg == pb.GetDeltaResponse(chunk=chunk).SerializeToString()


@pytest.mark.parametrize("sb_nbytes", [0, 16])
def test_a_message_built_in_place_is_protobuf_and_outlives_its_builder(sb_nbytes: int) -> None:
    m = encode.ChunkMessage(3, 70000, 2, 2 * 5 * 4, sb_nbytes)
    ids, sb, values = m.ids, m.scale_bias, m.values
    del m
    gc.collect()  # the views alone keep the message alive
    ids[:] = [11, 2**40]
    values[:] = np.arange(40, dtype=np.uint8)
    if sb_nbytes:
        sb[:] = [0.5, -1.0, 2.0, 3.0]
    base = values
    while isinstance(base, np.ndarray):
        base = base.base
    data = base.owner
    assert isinstance(data, bytes)
    c = pb.GetDeltaResponse.FromString(data).chunk
    assert (c.slice, c.offset, c.count) == (3, 70000, 2)
    assert np.frombuffer(c.ids, dtype=np.int64).tolist() == [11, 2**40]
    assert c.values == bytes(range(40))
    assert np.frombuffer(c.scale_bias, dtype=np.float32).tolist() == (
        [0.5, -1.0, 2.0, 3.0] if sb_nbytes else []
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_rows_filled_by_address_equal_the_rows_and_never_overrun(dtype: torch.dtype) -> None:
    """``ChunkMessage.fill`` writes rows ``[start, start + count)`` of a tensor into a field
    with one memmove: the same bytes as the rows, for a contiguous tensor, a transposed
    (non-contiguous) one, and no rows. Rows that do not fit the field, or are not all in the
    tensor, are refused (ValueError) before a byte is written."""
    rows = (torch.arange(7 * 6) % 251).to(dtype).view(7, 6)
    for src in (rows, rows.t().contiguous().t()):
        assert src.is_contiguous() == (src is rows)
        for start, count in ((0, 7), (2, 3), (6, 1), (3, 0), (4, -1)):
            n = 7 - start if count < 0 else count
            m = encode.ChunkMessage(0, start, n, n * 6 * rows.element_size())
            m.fill("values", src, start, count)
            m.fill("ids", torch.arange(start, start + n))
            c = pb.GetDeltaResponse.FromString(m.data).chunk
            want = rows[start : start + n].contiguous().view(torch.uint8).numpy().tobytes()
            assert c.values == want
            assert np.frombuffer(c.ids, dtype=np.int64).tolist() == list(range(start, start + n))
    m = encode.ChunkMessage(0, 0, 2, 2 * 6 * rows.element_size())
    before = bytearray(m.data)  # (a copy: bytes(m.data) would be m.data itself)
    for bad in (
        lambda: m.fill("values", rows, 0, 3),  # 3 rows into a field of 2
        lambda: m.fill("values", rows, 6, 2),  # rows 6, 7 of 7
        lambda: m.fill("values", rows, -1, 1),
        lambda: m.fill("ids", torch.arange(3)),  # 3 ids into 2
        lambda: m.fill("scale_bias", rows, 0, 1),  # a field this message has not
    ):
        with pytest.raises(ValueError):
            bad()
    assert m.data == bytes(before)


@pytest.mark.parametrize("dtype", [d for d in WireDtype if not d.packed])
def test_raw_and_parsed_decoding_agree(dtype: WireDtype) -> None:
    ids = torch.arange(0, 5000, 7)
    vals = torch.randn(ids.numel(), 5) * 3
    msgs = _stream(ids, vals, dtype, 1000)
    raw = decode.decode_stream(msgs)
    parsed = decode.decode_stream(pb.GetDeltaResponse.FromString(m) for m in msgs)
    for d in (raw, parsed):
        assert (d.rank, d.generation, d.from_seq, d.to_seq, d.to_step) == (1, 9, 3, 5, 50)
        assert d.cursor.pull_id == "p" and d.rows == ids.numel() and d.wire_dtype is dtype
        (s,) = d.shards
        assert (s.shard.col_start, s.shard.col_end, s.owed) == (2, 7, 4)
        assert torch.equal(s.ids, ids)
    a, b = raw.shards[0].values, parsed.shards[0].values
    assert a is not None and b is not None and torch.equal(a, b)
    expect = wire.dequantize(*wire.quantize(vals, dtype), dtype)
    assert torch.equal(a, expect)
    if dtype is WireDtype.FP32:
        assert torch.equal(a, vals)
    elif dtype is WireDtype.INT8:
        span = vals.amax(1, keepdim=True) - vals.amin(1, keepdim=True)
        assert ((a - vals).abs() <= span / 510 + 1e-5).all()


@pytest.fixture(params=["fbgemm", "torch"])
def int8_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with fbgemm's fused quantizer, then with the plain torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(wire, "_FBGEMM_Q8", False)
    else:
        assert wire._fbgemm_rowwise_int8() is not None, "fbgemm-gpu-cpu is a dependency"
    return str(request.param)


def test_int8_constant_rows_are_exact(int8_path: str) -> None:
    vals = torch.full((3, 4), 2.5)
    vals[1] = -7.0
    codes, sb = wire.quantize(vals, WireDtype.INT8)
    assert torch.equal(wire.dequantize(codes, sb, WireDtype.INT8), vals)


def test_int8_error_is_half_a_step_on_either_path(int8_path: str) -> None:
    vals = torch.randn(3000, 48) * torch.logspace(-3, 3, 3000).unsqueeze(1)
    codes, sb = wire.quantize(vals, WireDtype.INT8)
    assert codes.dtype is torch.int8 and codes.shape == vals.shape and sb.shape == (3000, 2)
    assert codes.is_contiguous() and sb.is_contiguous()
    back = wire.dequantize(codes, sb, WireDtype.INT8)
    span = vals.amax(1, keepdim=True) - vals.amin(1, keepdim=True)
    assert ((back - vals).abs() <= span / 510 * 1.001 + 1e-6).all()
    assert int(codes.min()) == -128 and int(codes.max()) == 127  # every row spans the range


def test_int8_tiny_range_rows_meet_the_documented_bound(int8_path: str) -> None:
    """Rows of range 1e-6..2e-3 (freshly initialised rows of large tables): fbgemm's epsilon
    broke (max - min) / 510 there by up to 2 * 255e-8 / range (5 % at 1e-4) while the scale
    sent was range / 255; the bound checked is the one the quantizer gives."""
    torch.manual_seed(3)
    span = torch.logspace(-6, math.log10(2e-3), 4000).unsqueeze(1)
    vals = torch.rand(4000, 64) * span + torch.randn(4000, 1) * 0.01
    codes, sb = wire.quantize(vals, WireDtype.INT8)
    back = wire.dequantize(codes, sb, WireDtype.INT8)
    err = (back - vals).abs().amax(dim=1)
    bound = wire.int8_error_bound(vals)
    assert bool((err <= bound * (1 + 1e-5) + vals.abs().amax(dim=1) * 1e-6).all()), float(
        (err / bound).max()
    )
    # the bound is tight: half a step is reached on some rows
    assert float((err / bound).max()) > 0.9


def test_ids_form_has_no_values() -> None:
    ids = torch.tensor([5, 9, 11])
    d = decode.decode_stream(_stream(ids, None, WireDtype.FP32, 1 << 20))
    assert (
        d.form is Form.IDS and d.shards[0].values is None and d.shards[0].ids.tolist() == [5, 9, 11]
    )


def test_truncated_or_malformed_streams_raise() -> None:
    msgs = _stream(torch.arange(100), torch.randn(100, 3), WireDtype.FP32, 512)
    with pytest.raises(errors.StreamDecodeError, match="before its trailer"):
        decode.decode_stream(msgs[:-1])
    with pytest.raises(errors.StreamDecodeError, match="expected row 0 next"):  # a gap
        decode.decode_stream([msgs[0], *msgs[2:]])
    with pytest.raises(errors.StreamDecodeError, match="rows received"):  # one chunk short
        decode.decode_stream([*msgs[:-2], msgs[-1]])
    with pytest.raises(errors.StreamDecodeError):
        decode.decode_stream([msgs[0], msgs[1][:-3], *msgs[2:]])
    with pytest.raises(errors.StreamDecodeError, match="outside header"):
        decode.decode_stream(msgs[1:])
    with pytest.raises(errors.StreamDecodeError, match="second trailer"):
        decode.decode_stream([*msgs, msgs[-1]])


@pytest.mark.parametrize("zero_copy", [False, True])
def test_duplicated_or_reordered_chunks_are_refused(zero_copy: bool) -> None:
    """Chunk counts alone would add up with a chunk sent twice and another missing: the
    window must be refused, never returned with stale or uninitialised rows."""
    msgs = _stream(torch.arange(100), torch.randn(100, 3), WireDtype.FP32, 512)
    assert len(msgs) > 4
    pool = BufferPool(max_bytes=1 << 30) if not zero_copy else None
    twice = [msgs[0], msgs[1], msgs[1], *msgs[3:]]
    swapped = [msgs[0], msgs[2], msgs[1], *msgs[3:]]
    for bad in (twice, swapped):
        with pytest.raises(errors.StreamDecodeError, match="expected row"):
            decode.decode_stream(bad, zero_copy=zero_copy, pool=pool)


def test_malformed_headers_and_messages_are_stream_errors() -> None:
    """Whatever a buggy or mismatched server sends raises StreamDecodeError (a per-rank
    failure the consumer reports), not a protobuf, torch or numpy error."""
    msgs = _stream(torch.arange(10), torch.randn(10, 3), WireDtype.FP32, 512)
    header = pb.GetDeltaResponse.FromString(msgs[0]).header

    def with_slice(**kw: int) -> bytes:
        h = pb.DeltaHeader()
        h.CopyFrom(header)
        for k, v in kw.items():
            setattr(h.slices[0], k, v)
        return pb.GetDeltaResponse(header=h).SerializeToString()

    for bad in (
        with_slice(col_start=3, col_end=1),
        with_slice(col_end=99),
        with_slice(count=2**62, num_rows=2**63 - 1),
        with_slice(count=11),
    ):
        for zero_copy in (False, True):
            with pytest.raises(errors.StreamDecodeError, match="slice"):
                decode.decode_stream([bad, *msgs[1:]], zero_copy=zero_copy)
    with pytest.raises(errors.StreamDecodeError, match="bad GetDeltaResponse"):
        decode.decode_stream([b"\x0a\x03\xff\xff\xff", *msgs[1:]])  # a header of garbage


def test_fields_a_newer_server_adds_are_skipped() -> None:
    """A response carrying a field this client does not know decodes as the same window."""
    ids, vals = torch.arange(40), torch.randn(40, 3)
    msgs = _stream(ids, vals, WireDtype.FP32, 512)
    extra = b"\xa0\x06\x01"  # field 100, varint 1: unknown to this version
    d = decode.decode_stream([m + extra for m in msgs])
    assert torch.equal(d.shards[0].ids, ids) and torch.equal(d.shards[0].values, vals)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [WireDtype.FP32, WireDtype.INT8])
def test_zero_copy_parts_match_the_copied_shard(dtype: WireDtype) -> None:
    ids = torch.arange(3, 9000, 3)
    vals = torch.randn(ids.numel(), 6)
    msgs = _stream(ids, vals, dtype, 8192)
    whole = decode.decode_stream(msgs)
    parts = decode.decode_stream(msgs, zero_copy=True)
    assert len(parts.shards) == len(msgs) - 2 > 1 and parts.rows == whole.rows
    assert [s.owed for s in parts.shards][:2] == [4, 0]
    cat_ids = torch.cat([s.ids for s in parts.shards])
    cat_vals = torch.cat([s.values for s in parts.shards if s.values is not None])
    assert torch.equal(cat_ids, whole.shards[0].ids)
    assert torch.equal(cat_vals, whole.shards[0].values)  # type: ignore[arg-type]
