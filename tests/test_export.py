"""The TorchScript artifact of a torchrec quantized model (deltad.consume.export, `deltad export`):
the loaded module answers as the Python model does, and its manifest names the tensors that
hold every table's rows (the ones its forward reads), the remapper buffers and dense weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spoolkit import child_env

from deltad.consume.export import export_reference, manifest_path, reference_serving

pytestmark = pytest.mark.timeout(120)


def config() -> object:
    from deltad.reference.consumers.serving import ServingConfig

    return ServingConfig(
        dtype="int8", tables={"t0": 50, "t1": 30}, seq_rows=20, dim=8, zch_slots=16
    )


def attr(m: object, name: str) -> torch.Tensor:
    obj = m
    for part in name.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, torch.Tensor)
    return obj


def test_exported_reference_model_answers_as_torchrecs_and_names_its_tensors(
    tmp_path: Path,
) -> None:
    import fbgemm_gpu  # noqa: F401  (the artifact's ops)

    cfg = config()
    man = export_reference(cfg, tmp_path / "m.pt")
    assert json.loads(manifest_path(tmp_path / "m.pt").read_text()) == man
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    model, inputs = reference_serving(cfg)
    examples = [attr(loaded, n) for n in man["examples"]]
    assert all(torch.equal(a, b) for a, b in zip(examples, inputs, strict=True))
    with torch.inference_mode():
        before = loaded(*examples).clone()
        assert torch.equal(before, model(*inputs))
    assert {t["name"] for t in man["tables"]} == {"t0", "t1", "seq", "zch"}
    assert [t["name"] for t in man["tables"] if "mc" in t] == ["zch"]
    assert set(man["dense"]) >= {"bottom.0.weight", "over.2.bias"}
    for t in man["tables"]:  # the named buffers are the ones the forward reads
        host = attr(loaded, man["tbes"][t["tbe"]]["weights_host"])
        n, rb = t["num_rows"], t["row_bytes"]
        rows = host[t["offset"] : t["offset"] + n * rb]
        saved = rows.clone()
        rows.zero_()
        with torch.inference_mode():
            assert not torch.equal(loaded(*examples), before), t["name"]
        rows.copy_(saved)
    with torch.no_grad():
        attr(loaded, man["dense"]["over.2.bias"]).add_(1.0)
    with torch.inference_mode():
        assert torch.allclose(loaded(*examples), before + 1.0, atol=1e-5)  # (the bias moved)


@pytest.mark.slow
def test_deltad_export_writes_the_artifact_and_refuses_a_bad_state(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "deltad", "export", "--tables", "t0:50,t1:30", "--seq-rows",
            "20", "--dim", "8", "--zch-slots", "16"]  # fmt: skip
    ok = subprocess.run([*base, "--out", str(tmp_path / "a.pt")], capture_output=True, text=True,
                        env=child_env(), timeout=120, check=False)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "a.pt").is_file() and manifest_path(tmp_path / "a.pt").is_file()
    (tmp_path / "bad.pt").write_bytes(b"not a state")
    bad = subprocess.run(
        [*base, "--out", str(tmp_path / "b.pt"), "--state", str(tmp_path / "bad.pt")],
        capture_output=True, text=True, env=child_env(), timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "cannot load --state" in bad.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "b.pt").exists()
