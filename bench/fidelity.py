"""Benchmark 7: bytes shipped per predictor-hour vs the predictor's row error.

One live run (:mod:`bench.live`): ``deltad train`` publishing every P seconds and several
``deltad consume`` predictors pulling every P seconds, one per way of shipping rows:
``rows`` in every wire dtype and ``topk`` with several k (rows per table per pull).

* **bytes per hour**: payload bytes of every pull after the initial base (resync), over the
  time from the base being applied to the end of training, extrapolated to one hour.
* **full-table sync per hour**: every row of every table, every P seconds, in the same wire
  dtype (``rows x dim x itemsize``, + 8 bytes per row of scale/bias for int8): the
  alternative deltad replaces. ``ratio`` = full-sync bytes / deltad bytes.
* **error**: each predictor's tables when it stopped vs the trainer's tables at the step it
  served (rebuilt exactly from the spool's segments): RMSE and max |diff| over all rows.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from bench.common import Context, NotAvailable, pyplot, save_figure
from bench.live import (
    TINY_PUBLISH_S,
    ConsumerSpec,
    TrainerSpec,
    run_live,
    tables_at_step,
    tiny_shared_run,
)

ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def _errors(pred: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> dict[str, float]:
    sq = 0.0
    n = 0
    mx = 0.0
    for name, t in truth.items():
        p = pred.get(name)
        if p is None or p.shape != t.shape:
            return {"rmse": math.nan, "max_abs": math.nan, "missing_table": 1.0}
        d = p.float() - t.float()
        sq += float((d * d).sum())
        n += d.numel()
        mx = max(mx, float(d.abs().max()) if d.numel() else 0.0)
    return {"rmse": math.sqrt(sq / max(n, 1)), "max_abs": mx}


def run(ctx: Context) -> dict[str, Any]:
    """One live run with a predictor per (form, k, dtype)."""
    from bench.deltad_procs import module_unavailable

    why = module_unavailable(
        "deltad.reference.trainer.cli", "deltad.serve.cli", "deltad.reference.consumers.cli"
    )
    if why:
        raise NotAvailable(why)
    interval = TINY_PUBLISH_S if ctx.tiny else 1.0
    trainer = ctx.pick(
        TrainerSpec(rows=500_000, dim=32, batch_size=1024, duration_s=40.0),
        TrainerSpec(rows=50_000, dim=16, batch_size=512, duration_s=15.0),
        TrainerSpec(tables=2, rows=2_000, dim=8, batch_size=64, duration_s=3.0),
    )
    trainer.publish_every_seconds = interval
    ks = ctx.pick([100, 1000, 10000], [100, 1000], [16])
    dtypes = ctx.pick(["fp32", "fp16", "bf16", "int8"], ["fp32", "int8"], ["fp32", "int8"])
    specs: list[tuple[ConsumerSpec, dict[str, Any]]] = []
    for d in dtypes:
        specs.append(
            (
                ConsumerSpec(f"rows-{d}", ["--form", "rows", "--dtype", d], interval),
                {"form": "rows", "dtype": d, "k": None},
            )
        )
    for k in ks:
        specs.append(
            (
                ConsumerSpec(f"topk{k}-fp32", ["--form", "topk", "--k", str(k)], interval),
                {"form": "topk", "dtype": "fp32", "k": k},
            )
        )
    if not ctx.tiny:
        k = ks[len(ks) // 2]
        specs.append(
            (
                ConsumerSpec(
                    f"topk{k}-int8", ["--form", "topk", "--k", str(k), "--dtype", "int8"], interval
                ),
                {"form": "topk", "dtype": "int8", "k": k},
            )
        )
    ctx.status(f"fidelity: live run {trainer.duration_s:.0f}s, {len(specs)} predictors")
    with contextlib.ExitStack() as stack:
        if ctx.tiny:  # the smoke test shares one live run with the freshness benchmark
            live = tiny_shared_run(ctx)
            trainer = ctx.cache["tiny_live_spec"]
        else:
            work = stack.enter_context(ctx.tmpdir("fidelity"))
            live = run_live(
                ctx,
                work,
                trainer,
                [c for c, _ in specs],
                tail_s=2.0,
                startup_s=ctx.pick(15.0, 10.0, 4.0),
            )
        n_tables = trainer.tables + 1  # + the sequence table
        total_rows = n_tables * trainer.rows
        points = []
        truth_cache: dict[int, dict[str, torch.Tensor]] = {}
        for c, meta in specs:
            pulls = live.pulls.get(c.name, [])
            served = [p for p in pulls if p.get("step") is not None]
            base_done = next((p["t"] for p in served if p.get("resync")), None)
            if base_done is None and served:
                base_done = served[0]["t"]
            steady = [
                p
                for p in pulls
                if base_done is not None
                and p["t"] > base_done
                and p["t"] <= live.trainer_end_unix
                and not p.get("resync")
            ]
            span = (live.trainer_end_unix - base_done) if base_done else 0.0
            nbytes = sum(int(p.get("bytes") or 0) for p in steady)
            per_hour = nbytes / span * 3600.0 if span > 0 else None
            per_row = trainer.dim * ITEMSIZE[meta["dtype"]] + (8 if meta["dtype"] == "int8" else 0)
            full_per_hour = total_rows * per_row * 3600.0 / interval
            err: dict[str, float] = {"rmse": math.nan, "max_abs": math.nan}
            step = served[-1]["step"] if served else None
            path = live.final_tables.get(c.name)
            if step is not None and path is not None:
                if step not in truth_cache:
                    truth_cache[step] = tables_at_step(live.spool, step)
                pred = torch.load(path, map_location="cpu")
                err = _errors(pred, truth_cache[step])
            points.append(
                {
                    "consumer": c.name,
                    **meta,
                    "pulls": len(pulls),
                    "steady_pulls": len(steady),
                    "steady_seconds": span,
                    "bytes_steady": nbytes,
                    "bytes_per_hour": per_hour,
                    "full_sync_bytes_per_hour": full_per_hour,
                    "ratio_vs_full_sync": (full_per_hour / per_hour) if per_hour else None,
                    "served_step": step,
                    "owed_last": steady[-1].get("owed") if steady else None,
                    **err,
                }
            )
    result: dict[str, Any] = {
        "trainer": trainer.__dict__,
        "publish_every_s": interval,
        "table_rows_total": total_rows,
        "trainer_steps": live.trainer_result.get("steps"),
        "points": points,
        "peak_rss_bytes": live.peak_rss_bytes,
    }
    ref = next((p for p in points if p["consumer"] == "rows-fp32"), None)
    if ref is None or not ref["bytes_per_hour"]:
        raise NotAvailable("the rows-fp32 predictor pulled nothing after its base", result)
    head = []
    for p in points:
        is_ref = p["consumer"] == "rows-fp32"
        head.append(
            {
                "metric": f"{p['consumer']}: GB/predictor-hour (RMSE {p['rmse']:.2g}, max {p['max_abs']:.2g})",
                "value": (p["bytes_per_hour"] or 0) / 1e9,
                "unit": "GB/h",
                "baseline": p["full_sync_bytes_per_hour"] / 1e9,
                "baseline_unit": "GB/h full sync",
                "ratio": p["ratio_vs_full_sync"],
                "target": ">= 20x fewer bytes at equal error" if is_ref else "",
                "met": (
                    bool((p["ratio_vs_full_sync"] or 0) >= 20 and (p["rmse"] or 0) == 0)
                    if is_ref
                    else None
                ),
            }
        )
    result["headline"] = head
    return result


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Bytes per predictor-hour vs RMSE, one point per predictor; full-sync lines."""
    plt = pyplot()
    pts = [p for p in result.get("points", []) if p.get("bytes_per_hour")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    floor = 1e-9
    for p in pts:
        rmse = p["rmse"] if p["rmse"] == p["rmse"] else None
        if rmse is None:
            continue
        ax.scatter(max(rmse, floor), p["bytes_per_hour"] / 1e9, label=p["consumer"])
        ax.annotate(p["consumer"], (max(rmse, floor), p["bytes_per_hour"] / 1e9), fontsize=7)
    fulls = {p["dtype"]: p["full_sync_bytes_per_hour"] for p in result.get("points", [])}
    for d, v in fulls.items():
        ax.axhline(v / 1e9, ls="--", lw=0.8, color="grey")
        ax.text(floor, v / 1e9, f"full sync {d}", fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"row error vs trainer (RMSE; exact shown at {floor:g})")
    ax.set_ylabel("GB per predictor-hour")
    ax.set_title(f"bytes vs fidelity (publish every {result.get('publish_every_s')} s)")
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.92)
    return save_figure(fig, out_dir, "fidelity", tight=False)
