"""The end-of-run checks of `deltad demo`: each predictor's tables and model against the trainer's.

Every check returns a :class:`Check`: the ``check <name>: ... ok|FAILED`` report line (users
and tests grep it) and whether it held.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltad.demo.report import PredictorLog, ms

#: pooled tables of the trainer and of the serving predictor's model code
TABLES = "4"
#: the predictor serving a torchrec int8-quantized model
SERVING = "serving-int8"
#: the check of that predictor's managed-collision tables (the reference model's ``zch``)
ZCH = "serving-zch"
#: relative slack on the int8 bound for float32 arithmetic in code * scale + bias
BOUND_SLACK = 1e-5


@dataclass
class Check:
    """One check's report line and whether it held."""

    line: str
    ok: bool


def run_checks(
    work: Path,
    rows: int,
    dim: int,
    truth: dict[str, Any],
    serving_log: PredictorLog,
    final_step: int,
) -> tuple[list[str], list[str]]:
    """Every check, in the report's order, on the files the trainer and the predictors wrote
    in ``work`` (``truth``: the trainer's final tables); their lines and what failed."""
    import torch

    lines: list[str] = []
    failures: list[str] = []

    def load(name: str) -> Any:
        return torch.load(work / name, map_location="cpu", weights_only=True)

    def report(check: Check, failure: str) -> None:
        lines.append(check.line)
        if not check.ok:
            failures.append(failure)

    # big tables (1M x 64 x 5 = 1.3 GB each): each is freed before the next load
    report(
        check_rows_fp32(truth, load("rows-fp32-final.pt"), final_step),
        "rows-fp32 tables differ from the trainer's final tables",
    )
    report(
        check_topk_int8(truth, load("topk-int8-final.pt")),
        "topk-int8 error exceeds the int8 bound",
    )
    state_file = work / f"{SERVING}-state.pt"
    check, ref = check_serving(state_file, rows, dim, load("trainer-model.pt"), serving_log)
    report(check, f"{SERVING} weights or forward differ from torchrec's quantization")
    report(
        check_serving_zch(state_file, ref),
        f"{ZCH} remapper or forward on raw ids differ from the trainer's",
    )
    return lines, failures


def check_rows_fp32(truth: dict[str, Any], tables: dict[str, Any], final_step: int) -> Check:
    """The rows/fp32 predictor's tables are bit-equal to the trainer's final tables."""
    import torch

    equal = set(tables) == set(truth) and all(
        torch.equal(tables[n], truth[n].to(tables[n].dtype)) for n in truth
    )
    return Check(
        f"check rows-fp32: tables bit-equal to the trainer's final tables at step "
        f"{final_step}: {'ok' if equal else 'FAILED'}",
        equal,
    )


def check_topk_int8(truth: dict[str, Any], topk: dict[str, Any]) -> Check:
    """The top-k/int8 predictor's tables are within each row's int8 rounding bound of the
    trainer's final tables (plus float32 rounding of code * scale + bias)."""
    import torch

    from deltad import wire

    worst = 0.0
    within = set(topk) == set(truth)
    for n, t in truth.items():
        if n not in topk:
            continue
        ref = t.to(torch.float32)
        bound = wire.int8_error_bound(ref)
        bound = bound * (1 + BOUND_SLACK) + ref.abs().amax(dim=1) * BOUND_SLACK
        err = (topk[n].to(torch.float32) - ref).abs().amax(dim=1)
        within = within and bool((err <= bound).all())
        worst = max(worst, float((err / bound.clamp_min(1e-12)).max()))
    return Check(
        f"check topk-int8: every element within its row's int8 bound "
        f"(row max - row min + 1e-8) / 510 once nothing is owed: {'ok' if within else 'FAILED'} "
        f"(worst error = {worst:.2f} x bound)",
        within,
    )


def check_serving(
    state_file: Path, rows: int, dim: int, final: dict[str, Any], lg: PredictorLog
) -> tuple[Check, Any]:
    """Compare the serving predictor (its final state in ``state_file``) with the trainer's
    final model (``final``: its state_dict, tables and dense state) quantized by torchrec in
    the same model code; its forward latency during apply and idle. Also returns that
    reference model."""
    import torch

    from deltad.consume.mc import LOOKUP_BUFFERS, training_only_state
    from deltad.consume.quant import quant_tables, quantize_model
    from deltad.reference.consumers.serving import (
        ServingConfig,
        click_model,
        fixed_batch,
        forward_path,
        serving_state,
    )
    from deltad.reference.trainer.cli import parse_tables
    from deltad.types import ServeDtype

    got = torch.load(state_file, map_location="cpu", weights_only=True)
    logits = torch.load(forward_path(state_file), map_location="cpu", weights_only=True)
    cfg = ServingConfig(ServeDtype.INT8, parse_tables(TABLES, rows), rows, dim)
    model = click_model(cfg).eval()
    model.load_state_dict(final)  # strict: every weight is the trainer's final one
    ref = quantize_model(model, ServeDtype.INT8, inplace=True)
    # the trainer's MCH eviction bookkeeping is not served (see deltad.consume.mc)
    skip = training_only_state(ref)
    want = {k: v for k, v in serving_state(ref).items() if k not in skip}
    got = {k: v for k, v in got.items() if k not in skip}
    n_tables = len(quant_tables(ref))
    dense = len([k for k in want if not table_key(k) and not k.endswith(LOOKUP_BUFFERS)])
    weights = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with torch.inference_mode():
        forward = torch.equal(logits, ref(fixed_batch(cfg))[1])
    ok = weights and forward
    s = lg.summary or {}
    line = (
        f"check {SERVING}: {n_tables} int8 tables, {dense} dense tensors and forward "
        f"output on a fixed batch bit-equal to the trainer's final model quantized by "
        f"torchrec: {'ok' if ok else 'FAILED'} "
        f"(weights {'equal' if weights else 'DIFFER'}, forward "
        f"{'equal' if forward else 'DIFFERS'})\n"
        f"  {SERVING} serving: {s.get('forwards', 0)} forwards, latency p50/p99 idle "
        f"{ms(s.get('forward_idle_p50_ms'))}/{ms(s.get('forward_idle_p99_ms'))}, during "
        f"apply {ms(s.get('forward_apply_p50_ms'))}/{ms(s.get('forward_apply_p99_ms'))} "
        f"({s.get('forward_apply_samples', 0)} forwards), longest lock hold "
        f"{ms(s.get('max_hold_ms'))}"
    )
    return Check(line, ok), ref


def check_serving_zch(state_file: Path, ref: Any) -> Check:
    """The serving predictor's managed-collision tables against ``ref`` (the trainer's
    final model quantized by torchrec): rows, the remapper's lookup buffers, and the
    served embeddings of raw ids held, evicted and never seen (its exit probe)."""
    import torch

    from deltad.consume.mc import LOOKUP_BUFFERS, probe_forward, remappers
    from deltad.reference.consumers.serving import serving_state, zch_path

    mc = remappers(ref)
    if not mc:
        return Check(
            f"check {ZCH}: FAILED (the reference model has no managed-collision table)", False
        )
    probe_file = zch_path(state_file)
    if not probe_file.exists():
        return Check(f"check {ZCH}: FAILED ({SERVING} wrote no managed-collision probe)", False)
    probe = torch.load(probe_file, map_location="cpu", weights_only=True)
    got = torch.load(state_file, map_location="cpu", weights_only=True)
    want = serving_state(ref)
    parts, ok = [], True
    for name, rm in sorted(mc.items()):
        rkeys = [k for k in want if table_key(k, name)]
        rows = len(rkeys) == 1 and all(k in got and torch.equal(got[k], want[k]) for k in rkeys)
        keys = [k for k in want if k.endswith(LOOKUP_BUFFERS) and f".{name}." in k]
        lookup = len(keys) == 2 and all(torch.equal(got[k], want[k]) for k in keys)
        p = probe.get(name)
        forward = False
        counts = "no probe"
        if p is not None:
            raw = torch.cat([p["held"], p["evicted"], p["never"]])
            with torch.inference_mode():
                forward = torch.equal(p["out"], probe_forward(ref, name, raw))
            held = set(rm.slot_raw.tolist())
            # the probe's kinds, checked against the trainer's final map
            kinds = (
                set(p["held"].tolist()) <= held
                and not (set(p["evicted"].tolist()) | set(p["never"].tolist())) & held
            )
            forward = forward and kinds and p["evicted"].numel() > 0
            counts = (
                f"{p['held'].numel()} held, {p['evicted'].numel()} evicted, "
                f"{p['never'].numel()} never-seen raw ids"
            )
        good = rows and lookup and forward
        ok = ok and good
        parts.append(
            f"{name} ({rm.size} slots; rows {'equal' if rows else 'DIFFER'}, lookup buffers "
            f"{'equal' if lookup else 'DIFFER'}, forward on {counts} "
            f"{'equal' if forward else 'DIFFERS'})"
        )
    line = (
        f"check {ZCH}: {len(mc)} managed-collision table(s) of {SERVING} bit-equal to the "
        f"trainer's final model quantized by torchrec: {'ok' if ok else 'FAILED'} "
        f"({'; '.join(parts)})"
    )
    return Check(line, ok)


def table_key(key: str, table: str | None = None) -> bool:
    """``key`` (a state_dict name of a quantized model) holds a table's rows (``table``'s)."""
    parts = key.split(".")
    return (
        len(parts) >= 3
        and parts[-1] == "weight"
        and parts[-3] in ("embedding_bags", "embeddings")
        and (table is None or parts[-2] == table)
    )
