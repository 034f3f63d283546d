"""The demo's C++ predictor (``serving-cpp``): where ``deltad-predictor-cpp`` was built for this
torch (``make setup``: ``build/cpp``), the demo exports the reference model it serves (int8,
managed-collision table included) as a TorchScript artifact, runs the C++ predictor beside the
Python ones, and checks that its final state (every table's bytes, the remapper's buffers, the
dense weights) and its forward on the artifact's batch are bit-equal to the trainer's final
model quantized by torchrec, exported the same way (see docs/cpp.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltad.demo.checks import TABLES, Check

NAME = "serving-cpp"


def binary() -> tuple[Path | None, str]:
    """The C++ predictor built for this torch (None, and why not, when there is none)."""
    import torch

    build = Path(__file__).resolve().parents[2] / "build" / "cpp"
    exe = build / "deltad-predictor-cpp"
    if not exe.is_file():
        return None, "not built (make setup builds it where its packages are: make system-deps)"
    try:
        built_for = (build / "torch-version.txt").read_text().strip()
    except OSError:
        built_for = "?"
    if built_for != torch.__version__:
        return None, f"built for torch {built_for}, not {torch.__version__}"
    return exe, ""


def serving_config(rows: int, dim: int) -> Any:
    """The reference model the demo's serving predictors serve (int8, its tables)."""
    from deltad.reference.consumers.serving import ServingConfig
    from deltad.reference.trainer.cli import parse_tables
    from deltad.types import ServeDtype

    return ServingConfig(ServeDtype.INT8, parse_tables(TABLES, rows), rows, dim)


def export(work: Path, rows: int, dim: int) -> Path:
    """The artifact the C++ predictor loads: the model code's weights (deltad sends every one)."""
    import warnings

    from deltad.consume.export import export_reference

    path = work / f"{NAME}-model.pt"
    with warnings.catch_warnings():  # (TorchScript's notes on torchrec's annotations)
        warnings.simplefilter("ignore")
        export_reference(serving_config(rows, dim), path)
    return path


def argv(exe: Path, endpoints: list[str], model: str, artifact: Path, work: Path) -> list[str]:
    return [
        str(exe), "--sidecars", ",".join(endpoints), "--model", model, "--consumer", NAME,
        "--artifact", str(artifact), "--long-poll", "5", "--interval", "0.5",
        "--final-state", str(work / f"{NAME}-state.pt"),
    ]  # fmt: skip


def check(work: Path, rows: int, dim: int, final: dict[str, Any]) -> Check:
    """The C++ predictor's final state and forward against the trainer's final model
    (``final``: its state_dict) quantized by torchrec and exported as its artifact was."""
    import warnings

    import torch
    from torch.jit._pickle import restore_type_tag

    from deltad.consume.export import artifact_state, export_reference, reference_serving

    cfg = serving_config(rows, dim)
    ref_path = work / f"{NAME}-reference.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_reference(cfg, ref_path, final)
    want = artifact_state(ref_path)
    with torch.serialization.safe_globals([restore_type_tag]):
        got = torch.load(work / f"{NAME}-state.pt", map_location="cpu", weights_only=True)
    tables = [k for k in want if k.startswith("table.")]
    buffers = [k for k in want if "_mch_" in k]
    weights = set(got) - {"forward"} == set(want) and all(
        torch.equal(got[k], want[k]) for k in want
    )
    model, inputs = reference_serving(cfg, final)
    with torch.inference_mode():
        forward = "forward" in got and torch.equal(got["forward"], model(*inputs))
    ok = weights and forward
    return Check(
        f"check {NAME}: the C++ predictor's {len(tables)} int8 tables, {len(buffers)} "
        f"managed-collision buffers, {len(want) - len(tables) - len(buffers)} dense tensors and "
        f"forward bit-equal to the trainer's final model quantized by torchrec: "
        f"{'ok' if ok else 'FAILED'} (weights {'equal' if weights else 'DIFFER'}, forward "
        f"{'equal' if forward else 'DIFFERS'})",
        ok,
    )
