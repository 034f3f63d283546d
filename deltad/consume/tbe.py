"""A quantized model's tables: built (quantize_model), found in fbgemm IntNBit TBEs, rows packed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deltad import wire
from deltad.errors import ConfigError, ConsumerError, UnsupportedModelError
from deltad.needs import need
from deltad.types import ServeDtype, WireDtype

#: fp16 scale + fp16 bias in front of an int8 / int4 row (fbgemm's default layout)
SCALE_BIAS_BYTES = 4


def serve_torch_dtype(dtype: ServeDtype | str) -> torch.dtype:
    """The ``quantize_embeddings`` dtype of a serving dtype; bf16 raises ConfigError."""
    try:
        d = ServeDtype(dtype)
    except ValueError:
        raise ConfigError(f"serving dtype {dtype!r} is not one of int8, int4, fp16, fp32") from None
    if d is ServeDtype.BF16:
        raise ConfigError(
            "serving dtype bf16 is not supported: torchrec 1.8's quantize_embeddings("
            "dtype=torch.bfloat16) crashes the process (SIGFPE); use fp16, fp32, int8 or int4"
        )
    return {
        ServeDtype.INT8: torch.qint8,
        ServeDtype.INT4: torch.quint4x2,
        ServeDtype.FP16: torch.float16,
        ServeDtype.FP32: torch.float32,
    }[d]


def quantize_model(
    model: torch.nn.Module, dtype: ServeDtype | str, *, inplace: bool = False
) -> torch.nn.Module:
    """``quantize_embeddings`` for every EmbeddingBagCollection *and* EmbeddingCollection.

    The same call a predictor uses to build its serving model from float model code; bf16
    raises ConfigError before torchrec is called. Managed-collision modules (MC-EC / MC-EBC)
    become torchrec's ``QuantManagedCollisionEmbedding(Bag)Collection``: quantized tables
    behind the float MCH remapper (see :mod:`deltad.consume.mc`). ``model`` must not *be* an
    MC module itself (torchrec swaps children only): wrap it. Without torchrec or fbgemm,
    ConfigError with the install hint.
    """
    torch_dtype = serve_torch_dtype(dtype)
    need("fbgemm_gpu", "torchrec", purpose="quantize_model()")
    from torchrec import EmbeddingCollection
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection
    from torchrec.quant.embedding_modules import (
        QuantManagedCollisionEmbeddingBagCollection,
        QuantManagedCollisionEmbeddingCollection,
    )

    mapping: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
        EmbeddingCollection: QuantEmbeddingCollection,
        ManagedCollisionEmbeddingCollection: QuantManagedCollisionEmbeddingCollection,
        ManagedCollisionEmbeddingBagCollection: QuantManagedCollisionEmbeddingBagCollection,
    }
    return quantize_embeddings(
        model,
        dtype=torch_dtype,
        inplace=inplace,
        additional_qconfig_spec_keys=list(mapping),
        additional_mapping=mapping,
    )


#: the packed wire dtype of each quantized serving dtype's rows (same layout)
_PACKED_WIRE = {
    ServeDtype.INT8: WireDtype.PACKED_INT8,
    ServeDtype.INT4: WireDtype.PACKED_INT4,
    ServeDtype.FP16: WireDtype.PACKED_FP16,
}


def packed_wire_dtype(dtype: ServeDtype | str) -> WireDtype:
    """The wire dtype whose rows are this serving dtype's table rows, byte for byte (fp32:
    plain fp32 values, which are its rows)."""
    d = ServeDtype(dtype)
    return _PACKED_WIRE.get(d, WireDtype.FP32)


def data_row_bytes(dtype: ServeDtype, dim: int) -> int:
    """Bytes of one packed row without fbgemm's alignment padding."""
    if dtype is ServeDtype.FP32:
        return 4 * dim
    if dtype in _PACKED_WIRE:
        return wire.packed_data_bytes(dim, _PACKED_WIRE[dtype])
    raise ConfigError(f"no row layout for serving dtype {dtype.value}")


def pack_rows(
    values: torch.Tensor,
    dtype: ServeDtype,
    row_bytes: int | None = None,
    *,
    scale_bias_last: bool = False,
) -> torch.Tensor:
    """Float rows ``[n, dim]`` -> uint8 ``[n, row_bytes]`` in a TBE's row layout.

    Exactly torchrec's quantization of a float table (``quantize_state_dict``): int8 / int4 /
    fp16 through :func:`deltad.wire.pack_rows` (the sidecar's packer: same bytes as a packed
    pull), fp32 by a copy; zero padded to ``row_bytes`` (default: no padding).
    """
    x = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
    n, dim = x.shape
    width = data_row_bytes(dtype, dim)
    out = torch.empty(n, width if row_bytes is None else row_bytes, dtype=torch.uint8)
    if out.shape[1] < width:
        raise ConsumerError(f"row_bytes {row_bytes} < {width} bytes of a {dtype.value} row")
    if dtype is ServeDtype.FP32:
        out[:, :width] = x.view(torch.uint8)
        out[:, width:] = 0
    else:
        wire.pack_rows(x, _PACKED_WIRE[dtype], out, scale_bias_last=scale_bias_last)
    return out


@dataclass
class QuantTable:
    """One table of a quantized module: where its rows live and how they are laid out."""

    name: str
    module: str  # FQN of the quant EBC / EC holding it
    num_rows: int
    dim: int
    dtype: ServeDtype
    rows: torch.Tensor  # uint8 [num_rows, row_bytes]: a view of the TBE's weight buffer
    data_bytes: int  # row bytes without the alignment padding
    scale_bias_last: bool  # fbgemm reverse_qparam
    tbe: torch.nn.Module = field(repr=False)
    index: int = 0  # the table's index in its TBE

    @property
    def row_bytes(self) -> int:
        return int(self.rows.shape[1])

    @property
    def quantized(self) -> bool:
        return self.dtype in (ServeDtype.INT8, ServeDtype.INT4)

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """Float rows -> this table's padded row bytes."""
        return pack_rows(values, self.dtype, self.row_bytes, scale_bias_last=self.scale_bias_last)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """fp16 / fp32 rows ``ids`` as float32 (exact); int rows are not decodable exactly."""
        raw = self.rows[ids, : self.data_bytes].contiguous()
        if self.dtype is ServeDtype.FP16:
            return raw.view(torch.float16).float()
        if self.dtype is ServeDtype.FP32:
            return raw.view(torch.float32).clone()
        raise ConsumerError(f"table {self.name}: {self.dtype.value} rows cannot be decoded")


_SPARSE_TO_SERVE = {"int8": ServeDtype.INT8, "int4": ServeDtype.INT4, "fp16": ServeDtype.FP16}
_SPARSE_TO_SERVE["fp32"] = ServeDtype.FP32


def quant_tables(model: torch.nn.Module) -> dict[str, QuantTable]:
    """Every table of every torchrec.quant EBC / EC in ``model``, by name."""
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEBC,
    )
    from torchrec.quant.embedding_modules import (
        EmbeddingCollection as QuantEC,
    )

    out: dict[str, QuantTable] = {}
    for fqn, m in model.named_modules():
        if not isinstance(m, QuantEBC | QuantEC):
            continue
        key_to_tables: dict[Any, list[Any]] = m._key_to_tables
        for (_, configs), tbe in zip(key_to_tables.items(), m._emb_modules, strict=True):
            kind = type(tbe).__name__
            if kind != "IntNBitTableBatchedEmbeddingBagsCodegen":
                raise UnsupportedModelError(f"{fqn}: {kind} tables are not supported")
            if tbe.index_remappings_array.numel() or tbe.index_remapping_hash_table.numel():
                raise UnsupportedModelError(f"{fqn}: pruned (remapped) tables are not supported")
            if tbe.scale_bias_size_in_bytes != SCALE_BIAS_BYTES:
                raise UnsupportedModelError(
                    f"{fqn}: scale/bias of {tbe.scale_bias_size_in_bytes} bytes is not supported"
                )
            splits = tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)
            for i, (config, (rows, _, _)) in enumerate(zip(configs, splits, strict=True)):
                name, num_rows, dim, sparse_type, _ = tbe.embedding_specs[i]
                assert name == config.name
                dtype = _SPARSE_TO_SERVE.get(sparse_type.value)
                if dtype is None:
                    raise UnsupportedModelError(f"table {name}: {sparse_type.value} rows")
                if rows.device.type != "cpu":
                    raise UnsupportedModelError(f"table {name}: rows on {rows.device}")
                if name in out:
                    raise ConsumerError(f"table {name!r} appears twice in the inference model")
                out[name] = QuantTable(
                    name=name,
                    module=fqn,
                    num_rows=int(num_rows),
                    dim=int(dim),
                    dtype=dtype,
                    rows=rows,
                    data_bytes=data_row_bytes(dtype, int(dim)),
                    scale_bias_last=bool(tbe.reverse_qparam),
                    tbe=tbe,
                    index=i,
                )
    return out


def table_rows(t: QuantTable, packed: torch.Tensor) -> torch.Tensor:
    """Packed wire rows (checked: :meth:`~deltad.consume.quant.QuantApplier._check`) as
    ``t``'s padded rows."""
    rows = packed.to("cpu")
    if rows.shape[1] > t.row_bytes:  # a larger wire alignment: padding only
        rows = rows[:, : t.row_bytes]
    if rows.shape[1] != t.row_bytes:
        padded = torch.zeros(rows.shape[0], t.row_bytes, dtype=torch.uint8)
        padded[:, : rows.shape[1]] = rows
        rows = padded
    return rows.contiguous()


def dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict entries that are not quantized embedding tables (shared), and
    its non-persistent buffers (the publisher sends every buffer, as named_buffers names it)."""
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEBC,
    )
    from torchrec.quant.embedding_modules import (
        EmbeddingCollection as QuantEC,
    )

    skip = [f"{fqn}." for fqn, m in model.named_modules() if isinstance(m, QuantEBC | QuantEC)]
    if "." in skip:  # the model is itself one quant module: nothing dense
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if any(name.startswith(p) for p in skip):
            continue
        out[name] = value.data if isinstance(value, torch.nn.Parameter) else value
    for name, buf in model.named_buffers():
        if name not in out and not any(name.startswith(p) for p in skip):
            out[name] = buf
    return out
