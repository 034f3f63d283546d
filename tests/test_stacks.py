"""Both tested stacks (issue 37, item 4): the installed torch, fbgemm and torchrec are one of
scripts/install.sh's trios (torch 2.13 + fbgemm 1.8 + torchrec 1.8, or torch 2.14.1 + fbgemm
1.9.0 + torchrec 1.9.2; CI runs the fast lane on each), the install hints name the same
versions, and fbgemm's in-place update op loads the way the installed fbgemm needs and writes
the bytes deltad's applier writes."""

from __future__ import annotations

import importlib.metadata

import torch

from deltad.needs import STACKS, install_hint, installed_stack


def test_the_installed_stack_is_a_tested_trio() -> None:
    """torch, fbgemm and torchrec as scripts/install.sh pins them (DELTAD_STACK), and the
    install hints name the same versions."""
    stack = installed_stack()
    fbgemm, torchrec = STACKS[stack]
    assert importlib.metadata.version("torch").startswith(stack + ".")
    assert importlib.metadata.version("torchrec") == torchrec
    fbgemms = {
        d.metadata["Name"].lower().replace("_", "-"): d.version
        for d in importlib.metadata.distributions()
        if d.metadata["Name"].lower().replace("_", "-").startswith("fbgemm-gpu")
    }
    assert list(fbgemms.values()) == [fbgemm], fbgemms
    assert f"torchrec=={torchrec}" in install_hint("torchrec")
    assert f"=={fbgemm}" in install_hint("fbgemm_gpu")


def test_fbgemms_inplace_update_loads_and_writes_what_the_applier_writes() -> None:
    """The serving bench's baseline (a bare ``emb_inplace_update`` per TBE) on a small int8
    model: the op loads under either fbgemm, and after every window it and the applier leave
    the same bytes (the bench raises otherwise)."""
    from deltad.reference.consumers.serving import ServingConfig, build_serving_model

    from bench.serving import _inplace_op, _throughput
    from deltad.types import ServeDtype

    _inplace_op()  # (loads it, under fbgemm 1.8)
    assert hasattr(torch.ops.fbgemm, "emb_inplace_update")
    tables = {"t0": 300, "t1": 300}
    cfg = ServingConfig(ServeDtype.INT8, tables, 300, 8, batch_size=4, interval_s=0.0,
                        chunk_rows=64, zch_slots=0)  # fmt: skip
    _, applier = build_serving_model(cfg)
    out = _throughput(applier, list(tables), 40, 1, torch.Generator().manual_seed(0))
    assert "status" not in out, out
    assert out["float"]["rows"] == 80 and out["packed"]["ratio"] > 0, out
