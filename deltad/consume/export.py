"""TorchScript artifacts of torchrec quantized models, for predictors that serve from C++.

::

    served = quantize_model(model, "int8")                  # deltad.consume.quant
    export_torchscript(MyServing(served), "model.pt", example_inputs=(dense, ids, lengths))

writes ``model.pt`` (``torch.jit.save`` of the module traced with ``torchrec.fx`` and scripted:
what a libtorch predictor loads) and ``model.pt.json`` (:func:`manifest_path`), which tells a
C++ applier (``clients/cpp/``, ``deltad-predictor-cpp``) where every table's rows live.

A scripted torchrec quantized module keeps its fbgemm TBEs only as tensors: the tracer turns
``weights_host``, ``weights_offsets``, ``weights_tys``, ``D_offsets`` ... into anonymous
constants (``_tensor_constantN``). This module renames them ``deltad_tbe<i>_<buffer>`` before
scripting, so they are attributes of the loaded module a C++ applier finds by name and writes
with fbgemm's ``emb_inplace_update``. The manifest lists per table its TBE, its index in it,
shape, dtype and row bytes; per managed-collision table the attributes of its remapper's lookup
buffers (``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``) and their slot offset; and the
attribute of each dense parameter / buffer by its state_dict name (as the trainer publishes
it). ``example_inputs`` are kept in the artifact (``deltad_example_<i>``): the fixed batch a
predictor answers and checks.

The module given must take tensors only (TorchScript): wrap a model whose forward takes a
batch object, as :class:`ReferenceServing` wraps the reference ClickModel.
:func:`export_reference` exports that one (``deltad export``: :mod:`deltad.commands.export`).
"""

# (no `from __future__ import annotations`: torchrec.fx and TorchScript read the forward's
# annotations as types)
import json
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltad.errors import ConfigError

#: The manifest's format tag (a C++ applier refuses others).
FORMAT = "deltad-torchscript-1"
#: TBE tensors renamed in the artifact (``deltad_tbe<i>_<name>``).
TBE_TENSORS = (
    "weights_host",
    "weights_uvm",
    "weights_placements",
    "weights_offsets",
    "weights_tys",
    "D_offsets",
)
_MCH_BUFFERS = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")


def manifest_path(artifact: Path | str) -> Path:
    """Where :func:`export_torchscript` writes the manifest of ``artifact``."""
    return Path(f"{artifact}.json")


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _key(t: torch.Tensor) -> tuple[int, str, tuple[int, ...]] | None:
    """What identifies a tensor's memory across the tracer's references to it (None: empty)."""
    if not t.numel():
        return None
    return (t.data_ptr(), str(t.dtype), tuple(t.shape))


def _resolve_annotations(traced: Any, module: nn.Module) -> None:
    """The forward's type annotations as types on the traced graph (a module written under
    ``from __future__ import annotations`` has strings there, which TorchScript refuses)."""
    try:
        hints = typing.get_type_hints(type(module).forward)
    except (NameError, TypeError):
        return
    for node in traced.graph.nodes:
        if node.op == "placeholder" and node.target in hints:
            node.type = hints[node.target]
        elif node.op == "output" and "return" in hints:
            node.type = hints["return"]
    traced.recompile()


def export_torchscript(
    module: nn.Module,
    path: Path | str,
    *,
    example_inputs: Sequence[torch.Tensor] = (),
    dense: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Trace (``torchrec.fx``), script and ``torch.jit.save`` ``module`` (a torchrec quantized
    model, or a module holding one, whose forward takes tensors) to ``path``, its TBE tensors
    renamed (see the module docstring); write the manifest next to it and return it.

    ``dense``: the model's dense parameters and buffers by the names the trainer publishes
    them under (default: :func:`deltad.consume.quant.dense_state` of ``module``, whose names
    are relative to ``module``). Those the traced forward does not use are listed under
    ``"unused_dense"`` (a C++ applier skips them). Raises ConfigError for a model it cannot
    describe (pruned or non-TBE tables)."""
    import torchrec.fx

    from deltad.consume.mc import remappers
    from deltad.consume.quant import dense_state, quant_tables

    path = Path(path)
    tables = quant_tables(module)
    maps = remappers(module)
    tbes: list[Any] = []  # fbgemm IntNBitTableBatchedEmbeddingBagsCodegen modules
    for t in tables.values():
        if not any(t.tbe is x for x in tbes):
            tbes.append(t.tbe)
    wanted: dict[Any, str] = {}  # _key(tensor) -> new attribute name
    for i, tbe in enumerate(tbes):
        for name in TBE_TENSORS:
            k = _key(getattr(tbe, name))
            if k is not None:
                wanted[k] = f"deltad_tbe{i}_{name}"
    traced = torchrec.fx.symbolic_trace(module)
    _resolve_annotations(traced, module)
    found: set[str] = set()
    for node in traced.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attr(traced, node.target)
        new = wanted.get(_key(value)) if isinstance(value, torch.Tensor) else None
        if new is None:
            continue
        if new not in found:
            traced.register_buffer(new, value)
            found.add(new)
        node.target = new
    traced.recompile()
    by_key: dict[Any, str] = {}
    for name, t in [*traced.named_parameters(), *traced.named_buffers()]:
        by_key.setdefault(_key(t), name)
    for node in traced.graph.nodes:  # constants the tracer kept (e.g. a buffer it inlined)
        value = _attr(traced, node.target) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor):
            by_key.setdefault(_key(value), node.target)
    by_key.pop(None, None)
    for i, x in enumerate(example_inputs):
        traced.register_buffer(f"deltad_example_{i}", x.detach().clone())
    tbe_info = []
    for i, tbe in enumerate(tbes):
        names = {n: f"deltad_tbe{i}_{n}" for n in TBE_TENSORS}
        missing = [n for n in ("weights_host", "weights_offsets") if names[n] not in found]
        if missing:
            raise ConfigError(
                f"TBE {i}: the traced forward does not read {missing}: cannot export its tables"
            )
        for n in TBE_TENSORS:  # (a tensor the forward does not read: kept for the update op)
            if names[n] not in found:
                traced.register_buffer(names[n], getattr(tbe, n))
        tbe_info.append({**names, "row_alignment": int(tbe.row_alignment)})
    out_tables = []
    for t in tables.values():
        ti = next(i for i, x in enumerate(tbes) if x is t.tbe)
        entry: dict[str, Any] = {
            "name": t.name,
            "num_rows": t.num_rows,
            "dim": t.dim,
            "dtype": t.dtype.value,
            "row_bytes": t.row_bytes,
            "data_bytes": t.data_bytes,
            "scale_bias_last": t.scale_bias_last,
            "tbe": ti,
            "index": t.index,
            "offset": int(tbes[ti].weights_offsets[t.index]),
        }
        rm = maps.get(t.name)
        if rm is not None:
            attrs = [by_key.get(_key(getattr(rm.module, b))) for b in _MCH_BUFFERS]
            if None in attrs:
                raise ConfigError(f"table {t.name}: its remapper's lookup buffers are not traced")
            entry["mc"] = {"sorted_raw_ids": attrs[0], "mapping": attrs[1], "offset": rm.offset}
        out_tables.append(entry)
    state = dense if dense is not None else dense_state(module)
    dense_attrs: dict[str, str] = {}
    unused: list[str] = []
    mc_attrs = {a for e in out_tables for a in e.get("mc", {}).values() if isinstance(a, str)}
    for name, value in state.items():
        attr = by_key.get(_key(value))
        if attr is None or attr in mc_attrs:
            unused.append(name)
        else:
            dense_attrs[name] = attr
    scripted = torch.jit.script(traced)
    manifest = {
        "format": FORMAT,
        "tbes": tbe_info,
        "tables": out_tables,
        "dense": dense_attrs,
        "unused_dense": sorted(unused),
        "examples": [f"deltad_example_{i}" for i in range(len(example_inputs))],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.jit.save(scripted, str(tmp))
    tmp.replace(path)
    mpath = manifest_path(path)
    mtmp = mpath.with_name(f".tmp-{mpath.name}")
    mtmp.write_text(json.dumps(manifest, indent=1) + "\n")
    mtmp.replace(mpath)
    return manifest


class ReferenceServing(nn.Module):
    """The reference ClickModel's forward (logits) on tensors, for TorchScript: its pooled
    features (one KJT: ``values``, ``lengths``), the sequence feature and the managed-collision
    table's raw ids (empty tensors when the model has none)."""

    def __init__(self, model: nn.Module, keys: list[str], seq_key: str, zch_key: str) -> None:
        super().__init__()
        self.model = model
        self.keys = keys
        self.seq_key = seq_key
        self.zch_key = zch_key
        self.with_zch = getattr(model, "zch", None) is not None

    def forward(
        self,
        dense: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        zch_values: torch.Tensor,
        zch_lengths: torch.Tensor,
    ) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor

        m: Any = self.model
        sparse = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
        seq = KeyedJaggedTensor(keys=[self.seq_key], values=seq_values, lengths=seq_lengths)
        d = m.bottom(dense)
        pooled = m.ebc(sparse)
        s = m.ec(seq)[self.seq_key]
        n = s.lengths()
        rows = torch.repeat_interleave(n)
        seq_sum = torch.zeros_like(d).index_add(0, rows, s.values())
        seq_mean = seq_sum / n.clamp(min=1).unsqueeze(1).type_as(d)
        parts = [d] + [pooled[k] for k in self.keys] + [seq_mean]
        if self.with_zch:
            zch = KeyedJaggedTensor(keys=[self.zch_key], values=zch_values, lengths=zch_lengths)
            parts.append(m.zch(zch)[0][self.zch_key])
        feats = torch.stack(parts, dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, m.tri[0], m.tri[1]]
        out: torch.Tensor = m.over(torch.cat([d, inter], dim=1)).squeeze(1)
        return out


def batch_inputs(batch: Any) -> tuple[torch.Tensor, ...]:
    """A reference batch as :class:`ReferenceServing`'s inputs."""
    sparse = batch.sparse_kjt()
    empty = torch.zeros(0, dtype=torch.int64)
    zch_v = batch.zch.values() if batch.zch is not None else empty
    zch_l = batch.zch.lengths() if batch.zch is not None else empty
    return (
        batch.dense, sparse.values(), sparse.lengths(),
        batch.seq.values(), batch.seq.lengths(), zch_v, zch_l,
    )  # fmt: skip


def reference_serving(
    cfg: Any, state: dict[str, torch.Tensor] | None = None
) -> tuple[ReferenceServing, tuple[torch.Tensor, ...]]:
    """The reference model of a :class:`~deltad.reference.consumers.serving.ServingConfig`
    (its float weights from ``state`` when given, e.g. a trainer's ``--final-model``: strict),
    quantized by torchrec, wrapped for TorchScript; and the config's fixed batch as inputs."""
    from deltad.consume.quant import quantize_model
    from deltad.reference.consumers.serving import click_model, fixed_batch

    torch.manual_seed(cfg.seed)
    model = click_model(cfg).eval()
    if state is not None:
        model.load_state_dict(state)
    served = quantize_model(model, cfg.dtype, inplace=True)
    batch = fixed_batch(cfg)
    sparse = batch.sparse_kjt()
    zch_key = batch.zch.keys()[0] if batch.zch is not None else ""
    wrapper = ReferenceServing(served, list(sparse.keys()), batch.seq.keys()[0], zch_key)
    return wrapper.eval(), batch_inputs(batch)


def export_reference(
    cfg: Any, path: Path | str, state: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """:func:`export_torchscript` of :func:`reference_serving` (dense names: the model's)."""
    from deltad.consume.quant import dense_state

    wrapper, inputs = reference_serving(cfg, state)
    return export_torchscript(
        wrapper, path, example_inputs=inputs, dense=dense_state(wrapper.model)
    )


def artifact_state(path: Path) -> dict[str, torch.Tensor]:
    """An artifact's state as ``deltad-predictor-cpp --final-state`` names it: ``table.<name>``
    (each table's rows, uint8 as stored), ``attr.<attribute>`` (remapper buffers, dense
    tensors); the expected state of a C++ predictor serving the artifact's weights."""
    m = torch.jit.load(str(path))
    man = json.loads(manifest_path(path).read_text())

    def attr(name: str) -> torch.Tensor:
        obj: Any = m
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    out: dict[str, torch.Tensor] = {}
    for t in man["tables"]:
        host = attr(man["tbes"][t["tbe"]]["weights_host"])
        n, rb = t["num_rows"], t["row_bytes"]
        out[f"table.{t['name']}"] = host[t["offset"] : t["offset"] + n * rb].view(n, rb).clone()
        if "mc" in t:
            for a in (t["mc"]["sorted_raw_ids"], t["mc"]["mapping"]):
                out[f"attr.{a}"] = attr(a).clone()
    for a in man["dense"].values():
        out[f"attr.{a}"] = attr(a).detach().clone()
    return out
