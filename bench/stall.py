"""Benchmark 2: publish stall per segment and background write rate vs segment size.

The reference DLRM trains with deltad's tracker + publisher; segment size (rows x dim) is
varied through the embedding dim and the publish interval in steps (more steps = more rows
touched per segment). From :class:`deltad.publish.publisher.PublisherStats` per delta segment:

* ``stall_s``: what ``publish()`` held the training loop (with background copies, the
  default on CPU: a swap of the tracker's bitmaps);
* ``barrier_wait_s``: what backward passes waited for a background copy (loop time too);
* ``copy_s``: the copier thread's time per segment (read the drained ids, copy the rows),
  overlapping the next forward;
* ``write_s``: the background writer's time (serialize, checksum, write, fsync, rename),
  giving the write rate ``nbytes / write_s``.

The stall is also reported relative to the median step time of the same run.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.common import (
    GB,
    Children,
    Context,
    NotAvailable,
    med,
    medf,
    pyplot,
    save_figure,
    summarize,
)
from bench.tracking import run_worker


def run(ctx: Context) -> dict[str, Any]:
    """Sweep dims x publish intervals; one spawned process per dim."""
    from bench.deltad_procs import module_unavailable
    from bench.dlrm import DlrmSize

    why = module_unavailable(
        "deltad.reference.trainer.model", "deltad.publish.tracker", "deltad.publish.publisher"
    )
    if why:
        raise NotAvailable(why)
    base = ctx.pick(
        DlrmSize(rows=500_000, seq_rows=500_000, batch=8192, pooling=8, seq_len=16),
        DlrmSize.small(),
        DlrmSize.tiny(),
    )
    dims = ctx.pick([16, 64, 128], [16, 64], [8])
    intervals = ctx.pick([1, 4, 16], [1, 4], [1, 2])
    segments_per_run = ctx.pick(5, 3, 2)
    points: list[dict[str, Any]] = []
    groups = [dims] if ctx.tiny else [[d] for d in dims]
    for group in groups:
        ctx.status(f"stall dims {group}")
        with ctx.tmpdir("stall") as spool, Children() as kids:
            specs = [
                {
                    "variant": "deltad",
                    "size": asdict(replace(base, dim=d)),
                    "warmup": 1,
                    "steps": k * segments_per_run,
                    "spool": str(spool / f"d{d}-k{k}"),
                    "publish_every": 10,
                    "publish_steps": k,
                    "seed": 0,
                }
                for d in group
                for k in intervals
            ]
            for spec, res in zip(specs, run_worker(kids, specs), strict=True):
                segs = res.get("segments", [])
                if not segs:
                    continue
                step = res["median_step_s"]
                stalls = [s["stall_s"] for s in segs]
                copies = [s.get("copy_s", 0.0) for s in segs]
                barrier = res.get("barrier_wait_s", 0.0) / len(segs)  # per segment
                rates = [s["nbytes"] / s["write_s"] / GB for s in segs if s["write_s"] > 0]
                points.append(
                    {
                        "dim": spec["size"]["dim"],
                        "publish_steps": spec["publish_steps"],
                        "segments": len(segs),
                        "rows_per_segment": statistics.median(s["rows"] for s in segs),
                        "bytes_per_segment": statistics.median(s["nbytes"] for s in segs),
                        "stall_s": summarize(stalls),
                        "barrier_wait_s_per_segment": barrier,
                        "copy_s": summarize(copies),
                        "write_s": summarize([s["write_s"] for s in segs]),
                        "write_gbps": summarize(rates),
                        "step_s": step,
                        "stall_pct_of_step": medf(summarize(stalls)) / step * 100.0,
                        "stall_pct_of_interval": medf(summarize(stalls))
                        / (step * spec["publish_steps"])
                        * 100.0,
                        "peak_rss_bytes": res["peak_rss_bytes"],
                    }
                )
    if not points:
        raise NotAvailable("the publisher reported no delta segments")
    biggest = max(points, key=lambda p: p["bytes_per_segment"])
    head = [
        {
            "metric": (
                f"stall per segment, largest ({biggest['rows_per_segment']:,.0f} rows x "
                f"{biggest['dim']})"
            ),
            "value": medf(biggest["stall_s"]) * 1000.0,
            "unit": "ms",
            "baseline": biggest["step_s"] * 1000.0,
            "baseline_unit": "ms/step",
            "ratio": medf(biggest["stall_s"]) / biggest["step_s"],
        },
        {
            "metric": "backward waits for the background copy, per segment, largest",
            "value": biggest["barrier_wait_s_per_segment"] * 1000.0,
            "unit": "ms",
            "baseline": biggest["step_s"] * 1000.0,
            "baseline_unit": "ms/step",
            "ratio": biggest["barrier_wait_s_per_segment"] / biggest["step_s"],
        },
        {
            "metric": "background copy per segment (copier thread, overlaps the forward), largest",
            "value": medf(biggest["copy_s"]) * 1000.0,
            "unit": "ms",
        },
        {
            "metric": "background write rate, largest segment",
            "value": med(biggest["write_gbps"]),
            "unit": "GB/s",
        },
    ]
    return {"size": asdict(base), "points": points, "headline": head}


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Stall (ms) and write rate (GB/s) vs segment bytes."""
    plt = pyplot()
    pts = sorted(result.get("points", []), key=lambda p: p["bytes_per_segment"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for d in sorted({p["dim"] for p in pts}):
        ps = [p for p in pts if p["dim"] == d]
        xs = [p["bytes_per_segment"] / 1e6 for p in ps]
        a.plot(xs, [medf(p["stall_s"]) * 1000 for p in ps], "o-", label=f"dim {d}")
        b.plot(xs, [med(p["write_gbps"]) for p in ps], "o-", label=f"dim {d}")
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel("segment size (MB)")
        ax.legend(fontsize=8)
    a.set_ylabel("stall per segment (ms, median)")
    b.set_ylabel("background write rate (GB/s)")
    fig.suptitle("publish stall and write rate")
    return save_figure(fig, out_dir, "stall")
