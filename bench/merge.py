"""Benchmark 5: window merge cost vs ids in the window and number of segments.

Segments are in-memory skewed delta segments of one table (dim 16, see
:mod:`bench.datagen`). deltad's merge (union of ids, latest value wins, values gathered)
is timed against a bare ``torch.unique`` of the same concatenated ids, in the same process,
interleaved repeat by repeat so that load from other processes hits both alike.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import Context, NotAvailable, med, pyplot, ratio, save_figure, summarize
from bench.datagen import make_segments

DIM = 16


def merge_function() -> tuple[Callable[..., Any] | None, str]:
    """deltad's window merge as ``f(segments) -> merged``, or (None, why not)."""
    try:
        from deltad.serve.index.merge import merge_rows
    except Exception as e:
        return (
            None,
            f"deltad.serve.index.merge.merge_rows cannot be imported ({type(e).__name__}: {e})",
        )

    def merge(segs: Sequence[Any], with_values: bool = True) -> Any:
        return merge_rows([c for seg in segs for c in seg.shards], with_values=with_values)

    return merge, "merge_rows"


def _unique(ids: list[torch.Tensor]) -> torch.Tensor:
    return torch.unique(torch.cat(ids), sorted=True)


def _time(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    return dt


def run(ctx: Context) -> dict[str, Any]:
    """Sweep ids (at 8 segments) and segments (at a middle size)."""
    m = 1_000_000
    id_sweep = ctx.pick([1 * m, 5 * m, 10 * m, 25 * m, 50 * m], [1 * m, 4 * m], [200_000])
    seg_sweep = ctx.pick([1, 4, 16, 64], [2, 16], [2, 8])
    mid = ctx.pick(10 * m, 2 * m, 200_000)
    configs = [(n, 8) for n in id_sweep] + [(mid, s) for s in seg_sweep if s != 8]
    merge, how = merge_function()
    points: list[dict[str, Any]] = []
    for n, s in configs:
        ctx.status(f"merge {n / 1e6:.1f}M ids x {s} segs")
        segs = make_segments(total_ids=n, num_segments=s, dim=DIM, seed=n + s)
        ids = [c.ids for seg in segs for c in seg.shards]
        total = sum(t.numel() for t in ids)
        uniq_t: list[float] = []
        merge_t: list[float] = []
        ids_only_t: list[float] = []
        unique_count = int(torch.unique(torch.cat(ids)).numel())
        for _ in range(ctx.repeats):
            uniq_t.append(_time(functools.partial(_unique, ids)))
            if merge is not None:
                merge_t.append(_time(functools.partial(merge, segs)))
                ids_only_t.append(_time(functools.partial(merge, segs, with_values=False)))
        p: dict[str, Any] = {
            "target_ids": n,
            "ids": total,
            "unique_ids": unique_count,
            "segments": s,
            "table_rows": segs[0].shards[0].shard.num_rows,
            "dim": DIM,
            "torch_unique_s": summarize(uniq_t),
        }
        if merge is not None:
            p["merge_s"] = summarize(merge_t)
            p["ratio"] = ratio(med(p["merge_s"]), med(p["torch_unique_s"]))
            p["merge_ids_only_s"] = summarize(ids_only_t)
            p["ids_only_ratio"] = ratio(med(p["merge_ids_only_s"]), med(p["torch_unique_s"]))
        points.append(p)
        del segs, ids
        gc.collect()
    result: dict[str, Any] = {"dim": DIM, "points": points}
    if merge is None:
        raise NotAvailable(how, result)
    result["merge_function"] = f"deltad.serve.index.merge.{how}"
    big = max(points, key=lambda p: (p["ids"], -p["segments"]))
    worst = max(points, key=lambda p: p.get("ratio") or 0.0)
    result["headline"] = [
        {
            "metric": f"merge {big['ids'] / 1e6:.1f}M ids / {big['segments']} segments",
            "value": med(big["merge_s"]),
            "unit": "s",
            "baseline": med(big["torch_unique_s"]),
            "ratio": big["ratio"],
            "target": "<= 1.5x torch.unique",
            "met": bool(big["ratio"] is not None and big["ratio"] <= 1.5),
        },
        {
            "metric": f"worst ratio ({worst['ids'] / 1e6:.1f}M ids / {worst['segments']} segs)",
            "value": worst.get("ratio"),
            "unit": "x",
            "target": "<= 1.5x torch.unique",
            "met": bool(worst.get("ratio") is not None and worst["ratio"] <= 1.5),
        },
    ]
    return result


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Merge seconds and torch.unique seconds vs ids (8 segments) and vs segments."""
    plt = pyplot()
    pts = result.get("points", [])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    by_ids = sorted((p for p in pts if p["segments"] == 8), key=lambda p: p["ids"])
    for key, label in (("merge_s", "deltad merge"), ("torch_unique_s", "torch.unique")):
        a.plot(
            [p["ids"] / 1e6 for p in by_ids], [med(p.get(key)) for p in by_ids], "o-", label=label
        )
    a.set_xlabel("ids in window (M), 8 segments")
    a.set_ylabel("seconds (median)")
    a.legend()
    if pts:
        targets = [p["target_ids"] for p in pts]
        n_mid = max(set(targets), key=targets.count)
        by_seg = sorted((p for p in pts if p["target_ids"] == n_mid), key=lambda p: p["segments"])
        for key, label in (("merge_s", "deltad merge"), ("torch_unique_s", "torch.unique")):
            b.plot(
                [p["segments"] for p in by_seg],
                [med(p.get(key)) for p in by_seg],
                "o-",
                label=label,
            )
        b.set_xscale("log", base=2)
        b.set_xlabel(f"segments ({n_mid / 1e6:.1f}M ids)")
        b.legend()
    fig.suptitle("window merge cost")
    return save_figure(fig, out_dir, "merge")
