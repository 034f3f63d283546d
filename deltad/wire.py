"""The GetDelta wire's shared definitions: method name, limits, enum and cursor mappings, and
the value codec (:func:`quantize` / :func:`dequantize`) that both sides agree on.

The serving side's encoder is :mod:`deltad.serve.windows.encode`; the consuming side's decoder is
:mod:`deltad.consume.decode`.

Quantization (values on the wire): fp32, fp16, bf16 casts; int8 is row-wise affine:
``value = code * scale + bias`` with a float32 ``(scale, bias)`` pair per row, ``code`` in
[-128, 127]. Its error bound, documented and checked (:func:`int8_error_bound`), is
``(max - min + INT8_EPSILON) / 510`` per row (``INT8_EPSILON = 1e-8``, fbgemm's): fbgemm's
quantizer computes codes with the step ``(max - min + 1e-8) / 255``, and :func:`quantize`
sends that step as the scale, so the error is at most half of it (up to float32 rounding).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltad.config import PullOptions
from deltad.types import Cursor, Form, WireDtype
from deltad.v1 import delta_pb2 as pb

GET_DELTA_METHOD = "/deltad.v1.DeltaService/GetDelta"
#: The largest GetDelta message a consumer accepts (its channel's receive limit); the
#: sidecar never sends a larger one, whatever its --chunk-bytes / --max-message-bytes.
CONSUMER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: A header announcing a TableSlice of more values than this (rows x columns) is refused before
#: anything is allocated (2**36 float32 values: 256 GiB).
MAX_SLICE_ELEMENTS = 1 << 36
#: Trailing metadata of a GetDelta refused with RESOURCE_EXHAUSTED (the sidecar's stream
#: limit): milliseconds the sidecar suggests waiting before trying again.
RETRY_AFTER_KEY = "deltad-retry-after-ms"
#: Trailing metadata of a refused call: what kind of refusal it is, for a client to act on
#: without parsing the message. :data:`REFUSED_HELD_STATE`: a GetDelta's ``holding`` names a
#: state the server will not serve from (FAILED_PRECONDITION; the client pulls its full tables).
REFUSAL_KEY = "deltad-refusal"
REFUSED_HELD_STATE = "held-state"

_FORM_TO_PB: dict[Form, pb.Form] = {
    Form.IDS: pb.FORM_IDS,
    Form.ROWS: pb.FORM_ROWS,
    Form.TOPK: pb.FORM_TOPK,
}
_FORM_FROM_PB: dict[int, Form] = {int(v): k for k, v in _FORM_TO_PB.items()}
_FORM_FROM_PB[pb.FORM_UNSPECIFIED] = Form.ROWS
_DTYPE_TO_PB: dict[WireDtype, pb.WireDtype] = {
    WireDtype.FP32: pb.WIRE_DTYPE_FP32,
    WireDtype.FP16: pb.WIRE_DTYPE_FP16,
    WireDtype.BF16: pb.WIRE_DTYPE_BF16,
    WireDtype.INT8: pb.WIRE_DTYPE_INT8,
    WireDtype.PACKED_INT8: pb.WIRE_DTYPE_PACKED_INT8,
    WireDtype.PACKED_INT4: pb.WIRE_DTYPE_PACKED_INT4,
    WireDtype.PACKED_FP16: pb.WIRE_DTYPE_PACKED_FP16,
}
_DTYPE_FROM_PB: dict[int, WireDtype] = {int(v): k for k, v in _DTYPE_TO_PB.items()}
_DTYPE_FROM_PB[pb.WIRE_DTYPE_UNSPECIFIED] = WireDtype.FP32
#: bytes per value on the wire (not for packed dtypes: see :func:`packed_row_bytes`)
WIRE_ITEMSIZE = {WireDtype.FP32: 4, WireDtype.FP16: 2, WireDtype.BF16: 2, WireDtype.INT8: 1}
#: Packed dtypes: the row alignment when a request leaves it 0 (TorchRec's CPU inference
#: tables: ``quantize_embeddings`` builds its TBEs with ``row_alignment=16``).
DEFAULT_ROW_ALIGNMENT = 16
MAX_ROW_ALIGNMENT = 4096
#: bits per code of the packed row-wise dtypes
PACKED_BITS = {WireDtype.PACKED_INT8: 8, WireDtype.PACKED_INT4: 4}
#: fp16 scale + fp16 bias at the front of a packed int8 / int4 row (the TBE row layout)
PACKED_SCALE_BIAS_BYTES = 4
#: rows packed per fbgemm call in :func:`pack_rows` (its int8 op runs ~1.6x faster on blocks
#: that stay in cache than on a 2 MB chunk at once; the block is then moved into place)
PACK_BLOCK_ROWS = 4096
#: the torch dtype of the values on the wire, where they are plain floats (not INT8)
WIRE_TORCH_DTYPE = {
    WireDtype.FP32: torch.float32,
    WireDtype.FP16: torch.float16,
    WireDtype.BF16: torch.bfloat16,
}


def form_to_pb(form: Form) -> pb.Form:
    return _FORM_TO_PB[form]


def form_from_pb(value: int) -> Form:
    """Form of a proto enum value; ValueError for unknown values."""
    try:
        return _FORM_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown form {value}") from None


def dtype_to_pb(dtype: WireDtype) -> pb.WireDtype:
    return _DTYPE_TO_PB[dtype]


def dtype_from_pb(value: int) -> WireDtype:
    """WireDtype of a proto enum value; ValueError for unknown values."""
    try:
        return _DTYPE_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown wire dtype {value}") from None


def cursor_to_pb(c: Cursor) -> pb.Cursor:
    return pb.Cursor(
        consumer=c.consumer,
        rank=c.rank,
        generation=c.generation,
        seq=c.seq,
        step=c.step,
        pull_id=c.pull_id,
    )


def cursor_from_pb(c: pb.Cursor) -> Cursor:
    return Cursor(c.consumer, c.rank, c.generation, c.seq, c.step, c.pull_id)


def request_from_options(
    consumer: str, opts: PullOptions, *, chunk_bytes: int = 0
) -> pb.GetDeltaRequest:
    """The GetDeltaRequest for a consumer's PullOptions."""
    req = pb.GetDeltaRequest(
        consumer=consumer,
        form=form_to_pb(opts.form),
        k=opts.k,
        fraction=opts.fraction,
        tables=list(opts.tables),
        max_rows=opts.max_rows,
        dtype=dtype_to_pb(opts.wire_dtype),
        auto_commit=opts.auto_commit,
        chunk_bytes=chunk_bytes,
        row_alignment=opts.row_alignment if opts.wire_dtype.packed else 0,
        with_dense=opts.dense,
    )
    if opts.max_step is not None:
        req.max_step = opts.max_step
    return req


#: fbgemm's epsilon in its row-wise quantizers' step: codes = round((x - min) * 255 / (range + eps))
INT8_EPSILON = 1e-8


def int8_error_bound(values: torch.Tensor) -> torch.Tensor:
    """The INT8 wire's error bound per row of ``values`` [n, w] (float32 [n]):
    ``(max - min + INT8_EPSILON) / 510``, before float32 rounding of the dequantized value
    (checks add a relative slack of ~1e-5)."""
    v = values.to(torch.float32)
    return (v.amax(dim=1) - v.amin(dim=1) + INT8_EPSILON) / 510.0


def check_row_alignment(alignment: int) -> int:
    """The alignment a request asks for (0: the default); ValueError if it is not a power of
    two in [1, MAX_ROW_ALIGNMENT]."""
    a = alignment or DEFAULT_ROW_ALIGNMENT
    if not 0 < a <= MAX_ROW_ALIGNMENT or a & (a - 1):
        raise ValueError(
            f"row_alignment must be a power of two in [1, {MAX_ROW_ALIGNMENT}], got {alignment}"
        )
    return a


def packed_data_bytes(dim: int, dtype: WireDtype) -> int:
    """Bytes of a packed row before padding (codes and scale/bias, or fp16 values); fbgemm's
    ``unpadded_row_size_in_bytes``."""
    if dtype is WireDtype.PACKED_INT8:
        return dim + PACKED_SCALE_BIAS_BYTES
    if dtype is WireDtype.PACKED_INT4:
        return (dim + 1) // 2 + PACKED_SCALE_BIAS_BYTES
    if dtype is WireDtype.PACKED_FP16:
        return 2 * dim
    raise ValueError(f"{dtype.value} is not a packed wire dtype")


def packed_row_bytes(dim: int, dtype: WireDtype, alignment: int) -> int:
    """Bytes per packed row of a table of ``dim`` columns: the data padded to ``alignment``
    (fbgemm's ``rounded_row_size_in_bytes``; e.g. int8 dim 16 -> 32, int4 dim 16 -> 16);
    ``alignment`` 0 is the default, 16."""
    alignment = alignment or DEFAULT_ROW_ALIGNMENT
    n = packed_data_bytes(dim, dtype)
    return (n + alignment - 1) // alignment * alignment


def packed_refusal(dtype: WireDtype, dim: int, col_start: int, col_end: int) -> str | None:
    """Why rows of a shard cannot travel packed in ``dtype`` (None: they can). A packed
    request sends such slices as fp32 values instead (:func:`slice_dtype`)."""
    if (col_start, col_end) != (0, dim):
        return (
            f"holds columns {col_start}..{col_end} of {dim} (column-wise): {dtype.value} packs "
            f"whole rows only (scale and bias are per row)"
        )
    # fbgemm's packer writes its fp16 scale / bias at an even offset: dim + 4 (int8) and
    # dim / 2 + 4 (int4) bytes must be even
    multiple = {WireDtype.PACKED_INT8: 2, WireDtype.PACKED_INT4: 4}.get(dtype, 1)
    if dim % multiple:
        return f"has dim {dim}: {dtype.value} rows need a dim that is a multiple of {multiple}"
    return None


def slice_dtype(dtype: WireDtype, dim: int, col_start: int, col_end: int) -> WireDtype:
    """The wire dtype a slice's values travel in for a request of ``dtype``: a packed dtype
    falls back to fp32 for slices it cannot pack (:func:`packed_refusal`: column-wise shards,
    dims fbgemm cannot pack); every other slice travels in ``dtype``."""
    if dtype.packed and packed_refusal(dtype, dim, col_start, col_end) is not None:
        return WireDtype.FP32
    return dtype


def pack_rows(
    values: torch.Tensor, dtype: WireDtype, out: torch.Tensor, *, scale_bias_last: bool = False
) -> None:
    """Write rows ``values`` [n, dim] packed in ``dtype`` into ``out`` uint8 [n, row_bytes], in
    the row layout of a TorchRec inference table (fbgemm ``IntNBitTableBatchedEmbeddingBags
    Codegen``), padding zeroed, so that applying a row is one copy of it:

    * int8 / int4: fp16 scale, fp16 bias, then the codes (int4: two a byte, low nibble
      first). Scale, bias and codes are the bytes of fbgemm's
      ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(values, bits)``, the op torchrec's
      ``quantize_embeddings`` quantizes with (it writes codes first; they are moved behind
      scale and bias here, as torchrec does when it fills the table). ``scale_bias_last``
      keeps the op's order (a TBE built with ``reverse_qparam``).
    * fp16: the fp16 values.

    The one packer of deltad: the sidecar's packed wire forms and
    :class:`~deltad.consume.quant.QuantApplier` (float rows it packs itself) both use it.
    """
    n, dim = values.shape
    data = packed_data_bytes(dim, dtype)
    if out.shape[0] != n or out.shape[1] < data:
        raise ValueError(f"{dtype.value} rows of dim {dim} need [{n}, >= {data}] bytes")
    if n == 0:
        return
    if data < out.shape[1]:
        out[:, data:] = 0
    if dtype is WireDtype.PACKED_FP16:
        out[:, :data].view(torch.float16).copy_(values)
        return
    v = values if values.dtype in (torch.float32, torch.float16) else values.float()
    op, bits, sb = _fbgemm_nbit(), PACKED_BITS[dtype], PACKED_SCALE_BIAS_BYTES
    for a in range(0, n, PACK_BLOCK_ROWS):
        b = min(n, a + PACK_BLOCK_ROWS)
        q = op(v[a:b].contiguous(), bits)  # codes, then fp16 scale and bias
        if scale_bias_last:
            out[a:b, :data] = q
        else:
            out[a:b, :sb] = q[:, data - sb :]
            out[a:b, sb:data] = q[:, : data - sb]


#: the fbgemm library that registers its row-wise quantizers (``torch.ops.fbgemm.FloatTo...``)
FBGEMM_QUANTIZER_LIBRARY = "fbgemm_gpu_py.so"
_QUANTIZER_OPS = (
    "FloatToFused8BitRowwiseQuantized",
    "FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf",
)
_FBGEMM_LOAD_LOCK = threading.Lock()


def _has_fbgemm_quantizers() -> bool:
    return all(hasattr(torch.ops.fbgemm, name) for name in _QUANTIZER_OPS)


def load_fbgemm_quantizers() -> None:
    """Register fbgemm's row-wise quantizer ops, loading as little of fbgemm as it can.

    Where the ``fbgemm_gpu`` package is not imported yet, only the one library that holds the
    quantizers is loaded (``torch.ops.load_library``): ~8 MB resident, against ~50 MB for
    ``import fbgemm_gpu``, whose ``sparse_ops`` pulls in sympy (420 modules) through
    ``torch.fx``. A process that imports ``fbgemm_gpu`` later (a predictor) gets the same ops;
    where the library cannot be loaded alone (another build's layout) the package is imported.
    Raises ImportError where fbgemm is not installed. Thread-safe; idempotent."""
    with _FBGEMM_LOAD_LOCK:
        if _has_fbgemm_quantizers():
            return
        if "fbgemm_gpu" not in sys.modules:
            spec = importlib.util.find_spec("fbgemm_gpu")  # (does not run the package)
            if spec is None or spec.origin is None:
                raise ImportError("fbgemm_gpu is not installed")
            library = Path(spec.origin).parent / FBGEMM_QUANTIZER_LIBRARY
            if library.is_file():
                try:
                    torch.ops.load_library(str(library))
                except (OSError, RuntimeError):
                    pass  # (the package's own loader below says what is missing)
        if not _has_fbgemm_quantizers():
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)


@functools.cache
def _fbgemm_nbit() -> Callable[[torch.Tensor, int], torch.Tensor]:
    """fbgemm's fused N-bit row-wise quantizer with fp16 scale and bias (looked up once)."""
    load_fbgemm_quantizers()
    op: Callable[[torch.Tensor, int], torch.Tensor] = (
        torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf
    )
    return op


def _fbgemm_rowwise_int8() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """fbgemm's fused row-wise 8-bit quantizer, or None where fbgemm is not installed."""
    global _FBGEMM_Q8
    if _FBGEMM_Q8 is None:
        try:
            load_fbgemm_quantizers()
            _FBGEMM_Q8 = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized
        except (ImportError, OSError, AttributeError, RuntimeError):
            _FBGEMM_Q8 = False
    return _FBGEMM_Q8 or None


_FBGEMM_Q8: Any = None


def preload_quantizer() -> bool:
    """Load fbgemm's quantizers now (~0.05 s here, :func:`load_fbgemm_quantizers`) rather than
    in the first INT8 or packed pull; True if they are available. Safe to call from any thread,
    any number of times."""
    return _fbgemm_rowwise_int8() is not None


def quantize(values: torch.Tensor, dtype: WireDtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values in the wire dtype (contiguous) and, for INT8, float32 [n, 2] (scale, bias).

    INT8 uses fbgemm's fused row-wise quantizer where fbgemm is installed (measured, 2 MB
    chunks, one thread: 17.9 GB/s of fp32 rows against 5.2 for the torch ops below): its
    ``u8 * scale + min`` is this wire's ``(u8 - 128) * scale + (min + 128 * scale)``, and
    ``u8 - 128`` as int8 is ``u8`` with its top bit flipped.

    fbgemm computes the codes with the step ``(range + 1e-8) / 255`` but stores
    ``range / 255``; decoding with the stored one breaks ``range / 510`` on rows of range below
    ~0.002 (by ``2 * 255e-8 / range``: 0.9 % at 0.0006). The scale sent is the step the codes
    were computed with, so the error is at most :func:`int8_error_bound` (one extra pass over
    [n] scales; no measurable cost).
    """
    if dtype is WireDtype.FP32:
        return values.to(torch.float32).contiguous(), None
    if dtype is WireDtype.FP16:
        return values.to(torch.float16).contiguous(), None
    if dtype is WireDtype.BF16:
        return values.to(torch.bfloat16).contiguous(), None
    v = values.to(torch.float32)
    n, w = v.shape
    if v.numel() == 0:
        return torch.empty(v.shape, dtype=torch.int8), torch.empty(n, 2)
    fused = _fbgemm_rowwise_int8()
    if fused is not None:
        q = fused(v.contiguous())  # uint8 [n, w + 8]: codes, then float32 scale and min
        codes = q[:, :w].view(torch.int8).bitwise_xor(-128)
        sb = q[:, w:].contiguous().view(torch.float32)
        scale = sb[:, 0]
        scale.mul_(255.0).add_(INT8_EPSILON).div_(255.0)  # the step the codes were made with
        sb[:, 1].add_(scale, alpha=128.0)
        return codes, sb
    lo, hi = torch.aminmax(v, dim=1, keepdim=True)
    scale = (hi - lo) / 255.0
    # One temporary, then in place; a reciprocal multiply instead of a broadcast divide.
    # Measured (2 MB chunks of fp32 rows): 0.28 -> 7.4 GB/s.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = v.sub(lo).mul_(inv).round_().clamp_(0, 255).sub_(128).to(torch.int8)
    bias = lo + 128.0 * scale
    return codes.contiguous(), torch.cat([scale, bias], dim=1).contiguous()


def dequantize(
    codes: torch.Tensor, scale_bias: torch.Tensor | None, dtype: WireDtype
) -> torch.Tensor:
    """float32 values from wire values (the inverse of :func:`quantize`, up to rounding)."""
    if dtype is WireDtype.INT8:
        assert scale_bias is not None
        return codes.to(torch.float32) * scale_bias[:, :1] + scale_bias[:, 1:]
    return codes.to(torch.float32)
