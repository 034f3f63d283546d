"""Row values on the wire: slice encodings checked, chunk values viewed or dequantized."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from deltad.errors import StreamDecodeError
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.wire import (
    MAX_SLICE_ELEMENTS,
    WIRE_ITEMSIZE,
    check_row_alignment,
    dtype_from_pb,
    form_from_pb,
    packed_refusal,
    packed_row_bytes,
)


def view(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A read-only tensor over received bytes (no copy; keeps the bytes alive)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(buf, dtype=dtype)


def slice_encodings(h: pb.DeltaHeader) -> tuple[Form, WireDtype, list[int], list[WireDtype]]:
    """The window's form and wire dtype, and per slice its packed row bytes (0: float values)
    and its values' dtype; StreamDecodeError for a slice that is not one of its table or
    whose encoding the header contradicts."""
    try:
        form = form_from_pb(h.form)
        wire_dtype = dtype_from_pb(h.dtype)
    except ValueError as e:
        raise StreamDecodeError(str(e)) from e
    with_values = form is not Form.IDS
    packed = with_values and wire_dtype.packed
    if packed:
        try:
            align = check_row_alignment(h.row_alignment)
        except ValueError as e:
            raise StreamDecodeError(str(e)) from e
    row_bytes, dtypes = [], []
    for s in h.slices:
        if not 0 <= s.col_start <= s.col_end <= s.dim or s.count > s.num_rows:
            raise StreamDecodeError(
                f"slice {s.table[:64]!r}: columns {s.col_start}..{s.col_end} of {s.dim}, "
                f"{s.count} rows of {s.num_rows}: not a slice of its table"
            )
        if s.count * max(1, s.col_end - s.col_start) > MAX_SLICE_ELEMENTS:
            raise StreamDecodeError(
                f"slice {s.table[:64]!r} of {s.count} x {s.col_end - s.col_start}: too large"
            )
        if (s.evicted_count or s.admitted_count) and not s.identities:
            raise StreamDecodeError(
                f"slice {s.table[:64]!r}: evicted / admitted raw ids without identities"
            )
        if s.admitted_count and with_values:
            raise StreamDecodeError(f"slice {s.table[:64]!r}: admitted raw ids outside ids")
        if s.evicted_count + s.admitted_count > MAX_SLICE_ELEMENTS:
            raise StreamDecodeError(f"slice {s.table[:64]!r}: too many raw ids")
        rb, dtype = 0, wire_dtype
        if s.dtype != pb.WIRE_DTYPE_UNSPECIFIED:  # a packed response's fp32 slice
            if not packed or s.dtype != pb.WIRE_DTYPE_FP32 or s.row_bytes:
                raise StreamDecodeError(
                    f"slice {s.table[:64]!r}: dtype {s.dtype} in a {wire_dtype.value} "
                    f"response (only fp32 slices of a packed one, without row_bytes)"
                )
            dtype = WireDtype.FP32
        elif packed:
            why = packed_refusal(wire_dtype, s.dim, s.col_start, s.col_end)
            rb = packed_row_bytes(s.dim, wire_dtype, align)
            if why is not None or s.row_bytes != rb:
                raise StreamDecodeError(
                    f"slice {s.table[:64]!r}: {why or ''} {s.row_bytes} bytes per "
                    f"{wire_dtype.value} row of dim {s.dim}, expected {rb}"
                )
        row_bytes.append(rb)
        dtypes.append(dtype)
    return form, wire_dtype, row_bytes, dtypes


def chunk_values(
    row_bytes: int,
    dtype: WireDtype,
    width: int,
    count: int,
    scale_bias: memoryview,
    values: memoryview,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One chunk's values: (packed rows, None) as a view of the received bytes, or (None,
    float32 rows): fp32 as a view, fp16 / bf16 / int8 dequantized into a chunk buffer."""
    if row_bytes:
        if len(values) != count * row_bytes:
            raise StreamDecodeError(f"chunk of {len(values)} bytes for {count} packed rows")
        return view(values, torch.uint8).view(count, row_bytes), None
    if dtype is WireDtype.FP32 and len(values) == count * width * 4:
        return None, view(values, torch.float32).view(count, width)
    out = np.empty((count, width), dtype=np.float32)
    fill_values(dtype, out, width, count, scale_bias, values)
    return None, torch.from_numpy(out)


def fill_values(
    dtype: WireDtype,
    out: Any,
    w: int,
    count: int,
    scale_bias: memoryview,
    values: memoryview,
) -> None:
    """Write ``count`` rows of wire values in ``dtype``, dequantized to float32, into
    ``out``."""
    if len(values) != count * w * WIRE_ITEMSIZE[dtype]:
        raise StreamDecodeError(f"chunk values of {len(values)} bytes for {count}x{w}")
    if count == 0 or w == 0:
        return
    if dtype is WireDtype.FP32:
        out[...] = np.frombuffer(values, dtype=np.float32).reshape(count, w)
    elif dtype in (WireDtype.FP16, WireDtype.BF16):
        # torch's vectorized casts: numpy's float16 -> float32 ran at ~1.2 GB/s of wire
        # bytes (the fp16 pull's bottleneck), bf16 bit shifts at ~6 GB/s.
        half = torch.float16 if dtype is WireDtype.FP16 else torch.bfloat16
        torch.from_numpy(out).copy_(view(values, half).view(count, w))
    else:
        if len(scale_bias) != count * 8:
            raise StreamDecodeError("int8 chunk without a (scale, bias) per row")
        # torch: a cast then two in-place passes, 3-6 GB/s of wire bytes against 1.2 for
        # numpy's mixed int8 x float32 multiply
        sb = view(scale_bias, torch.float32).view(count, 2)
        t = torch.from_numpy(out)
        t.copy_(view(values, torch.int8).view(count, w))
        t.mul_(sb[:, :1]).add_(sb[:, 1:])
