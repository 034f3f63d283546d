"""Conformance vectors (docs/conformance.md) replayed to the C++ client: the reference C++
predictor (`deltad-predictor-cpp`: deltad::Consumer, the C++ decoder and the TorchScript
applier) serving a torchrec-quantized model of each vector's tables, exported with
:func:`deltad.consume.export.export_torchscript`, pulls every recorded window from the replay
server (real gRPC) and must end in the vector's expected state: every table's bytes equal to
torchrec's quantization of the expected tables (fp32 serving for the float wires: the floats
themselves; the packed wires' own layouts), managed-collision lookup buffers equal to those of
the expected slot map, and its last commit on every rank the expected cursor. A hostile pull is
refused: nothing of it applied or committed, the predictor keeps going and exits 0 when told.

`dense` is replayed into a model that holds the vector's dense tensors under its names, with
their dtypes (float32, float16, int64, bool), read by its forward: the C++ predictor must end
holding each one's bytes. The ids forms (`ids`, `mc-ids`: the C++ predictor serves rows) are
replayed by tests/test_conformance.py only.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_conformance import ALL, VECTORS, _dim_of
from test_cpp_predictor import BIN, SmallModel, load_state
from test_cpp_predictor import pytestmark as cpp_marks
from torch import nn

from deltad.conformance import vectors as vf
from deltad.conformance.replay import ReplayServer
from deltad.consume.export import export_torchscript
from deltad.mch import lookup_buffers
from deltad.types import EMPTY_RAW_ID

#: the serving dtype of each packed vector's model (the wire's layout)
PACKED_SERVE = {
    "WIRE_DTYPE_PACKED_INT8": "int8",
    "WIRE_DTYPE_PACKED_INT4": "int4",
    "WIRE_DTYPE_PACKED_FP16": "fp16",
}
NOT_HERE = {"ids", "mc-ids"}
NAMES = sorted(n for n in ALL if n not in NOT_HERE)

pytestmark = [*cpp_marks, pytest.mark.timeout(300)]


class TablesModel(nn.Module):
    """One pooled table per vector table (feature ``f_<name>``); the forward pools each."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.keys = [f"f_{n}" for n in shapes]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[k])
                for (n, (r, d)), k in zip(shapes.items(), self.keys, strict=True)
            ],
            device=torch.device("cpu"),
        )

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor

        out = self.ebc(KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths))
        return torch.cat([out[k] for k in self.keys], dim=1)


class DenseHolder(nn.Module):
    """``inner``'s forward, plus the vector's dense tensors (zeros of their dtypes and shapes)
    under the names it publishes them by, each read by the forward (a C++ applier skips the
    tensors a forward does not read)."""

    def __init__(self, inner: nn.Module, dense: list[dict[str, object]]) -> None:
        super().__init__()
        self.inner = inner
        self.names = [str(e["name"]) for e in dense]
        for e in dense:
            *parents, leaf = str(e["name"]).split(".")
            owner: nn.Module = self
            for part in parents:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            dtype = getattr(torch, str(e["dtype"]))
            # (the vector records every tensor flat; a BatchNorm's counter is 0-dim, as sent)
            shape = [] if leaf == "num_batches_tracked" else list(e["shape"])  # type: ignore[call-overload]
            zeros = torch.zeros(shape, dtype=dtype)
            # (parameters, not buffers: torchrec's tracer folds buffers it reads into constants)
            owner.register_parameter(leaf, nn.Parameter(zeros, requires_grad=False))

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = self.inner(values, lengths)
        over = getattr(self.over, "0")
        extra = over.weight.sum() + over.bias.float().sum()
        extra = extra + self.bn.num_batches_tracked.float().sum() + self.mask.float().sum()
        return out + extra * 0.0


def _dims(v: vf.Vector) -> dict[str, tuple[int, int]]:
    return {
        e["name"]: (e["shape"][0], _dim_of(v, e["name"])) for e in v.manifest["expected"]["tables"]
    }


def _mc(v: vf.Vector) -> bool:
    return bool(v.manifest["strict_identities"])


def quantized(v: vf.Vector) -> nn.Module:
    """The vector's tables as a torchrec-quantized model (seeded: deterministic): the managed-
    collision vectors' ZchWriter tables (t0 40 x 4, zch 64 x 8) in int8; the others in the
    packed wire's dtype, or fp32 for a float wire."""
    from deltad.consume.quant import quantize_model

    torch.manual_seed(0)
    if _mc(v):
        return quantize_model(SmallModel().eval(), "int8")
    dtype = PACKED_SERVE.get(v.manifest["request"]["dtype"], "fp32")
    q = quantize_model(TablesModel(_dims(v)).eval(), dtype)
    if v.manifest["request"].get("with_dense"):
        return DenseHolder(q, v.manifest["expected"]["dense"])
    return q


def artifact(v: vf.Vector, q: nn.Module, path: Path) -> Path:
    """``q`` exported, with example inputs of its forward."""
    if _mc(v):
        slots = expected(v, "slots")["zch"]
        raw = torch.from_numpy(slots[slots != EMPTY_RAW_ID][:8].astype(np.int64))
        n = raw.numel()
        inputs: tuple[torch.Tensor, ...] = (
            torch.arange(n, dtype=torch.int64) % 40, torch.ones(n, dtype=torch.int64),
            raw, torch.ones(n, dtype=torch.int64),
        )  # fmt: skip
    else:
        k = len(v.manifest["expected"]["tables"])
        inputs = (torch.zeros(k, dtype=torch.int64), torch.ones(k, dtype=torch.int64))
    export_torchscript(q, path, example_inputs=inputs)
    return path


def expected(v: vf.Vector, kind: str) -> dict[str, np.ndarray]:
    return {e["name"]: vf.read_array(v.root, e) for e in v.manifest["expected"][kind]}


def expected_rows(v: vf.Vector, q: nn.Module) -> dict[str, torch.Tensor]:
    """Each table's bytes as ``q``'s TBE holds them: packed vectors' rows as carried; float
    rows packed as torchrec packs them into its serving dtype."""
    from deltad.consume.quant import quant_tables

    held = quant_tables(q)
    out = {}
    for n, want in expected(v, "tables").items():
        t = torch.from_numpy(want)
        out[n] = t if want.dtype == np.uint8 else held[n].pack(t)
    return out


def predictor_argv(v: vf.Vector, srv: ReplayServer, art: Path, state: Path) -> list[str]:
    req = v.manifest["request"]
    form = req["form"].removeprefix("FORM_").lower()
    argv = [
        str(BIN), "--sidecars", ",".join(srv.endpoints[: v.world_size]), "--model",
        v.manifest["model"], "--consumer", v.name, "--artifact", str(art),
        "--form", form, "--wire-dtype",
        req["dtype"].removeprefix("WIRE_DTYPE_").lower().replace("_", "-"),
        *([] if req.get("with_dense") else ["--no-dense"]),
        "--long-poll", "0", "--interval", "0.05", "--rpc-deadline", "10",
        "--max-retries", "3", "--pulls", str(len(v.manifest["pulls"]) + 2),
        "--final-state", str(state),
    ]  # fmt: skip
    if form == "topk":
        argv += ["--k", str(req["k"])]
    return argv


@pytest.mark.parametrize("name", NAMES)
def test_the_cpp_client_reaches_each_vectors_state(name: str, tmp_path: Path) -> None:
    v = ALL[name]
    q = quantized(v)
    art = artifact(v, q, tmp_path / "model.pt")
    state = tmp_path / "state.pt"
    with ReplayServer(VECTORS, vector=name) as srv:
        done = subprocess.run(
            predictor_argv(v, srv, art, state), capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, (name, done.returncode, done.stderr[-3000:])
        got = load_state(state)
        for n, want in expected_rows(v, q).items():
            held = got[f"table.{n}"]
            assert held.shape == want.shape and torch.equal(held, want), (name, n)
        moved = 0  # (the artifact holds zeros: what the vector sends must have moved some)
        for e in v.manifest["expected"]["dense"]:  # every dense tensor's bytes and dtype
            want = torch.from_numpy(vf.read_array(v.root, e).copy())
            held = got[f"attr.{e['name']}"].reshape(want.shape)  # (its attribute: its name)
            assert held.dtype == want.dtype and torch.equal(held, want), (name, e["name"])
            moved += not torch.equal(want, torch.zeros_like(want))
        assert moved or not v.manifest["expected"]["dense"], name
        if _mc(v):
            raw = torch.from_numpy(expected(v, "slots")["zch"].astype(np.int64))
            sorted_raw, mapping = lookup_buffers(raw, 0)
            mc = {k: t for k, t in got.items() if k.startswith("attr.")}
            assert any(torch.equal(t, sorted_raw) for t in mc.values()), name
            assert any(torch.equal(t, mapping) for t in mc.values()), name
        for r, c in enumerate(v.manifest["expected"]["cursors"]):
            commits = srv.replayer.commits(name, r)
            assert commits, f"{name} rank {r}: nothing committed"
            assert {f: getattr(commits[-1], f) for f in c} == c, (name, r)
        if any(p["outcome"] == "refused" for p in v.manifest["pulls"]):
            # the hostile pull refused every time it came: only the base was committed
            for r in range(v.world_size):
                assert len(srv.replayer.commits(name, r)) == 1, (name, r)
