"""Benchmark 6: freshness, from a trainer step to the predictor serving it.

For each publish interval a short live run (:mod:`bench.live`): ``deltad train`` (world size
1, small DLRM) publishing every P seconds, ``deltad serve``, and one ``deltad consume``
predictor (rows, fp32) pulling every 0.1 s.

**Lag of step s** = (first time the predictor had applied a window whose step is >= s)
- (time step s ended). Step end times come from the segments' ``created_unix`` (written by the
publisher right after the cut), interpolated linearly between segments; every step between
the first delta and the last served step counts once. This includes the wait for the next
publish, so the floor is about P/2 at the median and P at the tail. Steps that ended before the
predictor applied its first window (start-up: the base) are left out.

Also reported: the predictor's own ``freshness_s`` (segment created -> applied: the pipeline
latency without the publish wait).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Context, NotAvailable, percentile, pyplot, save_figure
from bench.live import ConsumerSpec, LiveResult, TrainerSpec, run_live, tiny_shared_run


def step_lags(segments: list[dict[str, Any]], pulls: list[dict[str, Any]]) -> list[float]:
    """Lag of every step from the first delta to the last served one (see module doc)."""
    deltas = [s for s in segments if s["kind"] == "delta"]
    if len(deltas) < 2:
        return []
    seg_steps = np.array([s["step"] for s in deltas], dtype=np.float64)
    seg_times = np.array([s["created_unix"] for s in deltas], dtype=np.float64)
    served = [(p["t"], p["step"]) for p in pulls if p.get("step") is not None]
    if not served:
        return []
    # Monotone "served step" over time.
    times, steps = [], []
    best = -1
    for t, st in sorted(served):
        if st > best:
            best = st
            times.append(t)
            steps.append(st)
    lags = []
    first = int(seg_steps[0]) - int(seg_steps[1] - seg_steps[0]) + 1 if len(seg_steps) > 1 else 1
    first = max(first, 1)
    for s in range(first, int(min(steps[-1], seg_steps[-1])) + 1):
        i = bisect.bisect_left(steps, s)
        if i >= len(steps):
            break
        t_end = float(np.interp(s, seg_steps, seg_times))
        if s < seg_steps[0]:
            # Before the first delta: extrapolate with the first interval's rate.
            rate = (seg_times[1] - seg_times[0]) / max(seg_steps[1] - seg_steps[0], 1)
            t_end = float(seg_times[0] - (seg_steps[0] - s) * rate)
        if t_end < times[0]:
            continue  # ended before the predictor's first window: start-up, not steady state
        lags.append(max(0.0, times[i] - t_end))
    return lags


def run(ctx: Context) -> dict[str, Any]:
    """One live run per publish interval."""
    from bench.deltad_procs import module_unavailable

    why = module_unavailable(
        "deltad.reference.trainer.cli", "deltad.serve.cli", "deltad.reference.consumers.cli"
    )
    if why:
        raise NotAvailable(why)
    intervals = ctx.pick([0.5, 1.0, 5.0], [0.5, 1.0], [0.5])
    trainer = ctx.pick(
        TrainerSpec(rows=100_000, dim=32, batch_size=1024),
        TrainerSpec(rows=20_000, dim=16, batch_size=512),
        TrainerSpec(tables=2, rows=2_000, dim=8, batch_size=64),
    )
    points = []
    for p in intervals:
        duration = ctx.pick(max(20.0, 6 * p), max(8.0, 4 * p), 3.0)
        ctx.status(f"freshness every {p}s ({duration:.0f}s run)")
        spec = TrainerSpec(
            **{**trainer.__dict__, "publish_every_seconds": p, "duration_s": duration}
        )
        if ctx.tiny:
            live = tiny_shared_run(ctx)
            points.append(_point(p, duration, live))
            continue
        with ctx.tmpdir("fresh") as work:
            live = run_live(
                ctx,
                work,
                spec,
                [ConsumerSpec("fresh", ["--form", "rows"], 0.1)],
                tail_s=ctx.pick(3.0, 2.0, 1.0),
                startup_s=ctx.pick(10.0, 8.0, 3.0),
            )
            points.append(_point(p, duration, live))
    if not any(p["steps_measured"] for p in points):
        raise NotAvailable("the predictor served no trainer step in time", {"points": points})
    head = []
    for p in points:
        at_target = p["publish_every_s"] == 0.5
        ok = (
            p["lag_p50_s"] is not None
            and p["lag_p99_s"] is not None
            and p["lag_p50_s"] <= 0.5
            and p["lag_p99_s"] <= 2.0
        )
        head.append(
            {
                "metric": f"step->served lag p50/p99, publish every {p['publish_every_s']}s",
                "value": f"{_f(p['lag_p50_s'])} / {_f(p['lag_p99_s'])}",
                "unit": "s",
                "baseline": f"pipeline only {_f(p['pipeline_p50_s'])} / {_f(p['pipeline_p99_s'])}",
                "target": "p50 <= 0.5 s, p99 <= 2 s" if at_target else "",
                "met": ok if at_target else None,
            }
        )
    return {"trainer": trainer.__dict__, "points": points, "headline": head}


def _point(p: float, duration: float, live: LiveResult) -> dict[str, Any]:
    pulls = live.pulls.get("fresh", [])
    lags = step_lags(live.segments, pulls)
    own = [x["freshness_s"] for x in pulls if x.get("freshness_s") is not None]
    deltas = [s for s in live.segments if s["kind"] == "delta"]
    return {
        "publish_every_s": p,
        "duration_s": duration,
        "trainer_steps": live.trainer_result.get("steps"),
        "trainer_step_s_median": live.trainer_result.get("step_s_median"),
        "segments": len(deltas),
        "pulls": len(pulls),
        "steps_measured": len(lags),
        "lag_p50_s": percentile(lags, 50),
        "lag_p99_s": percentile(lags, 99),
        "lag_max_s": max(lags) if lags else None,
        "pipeline_p50_s": percentile(own, 50),
        "pipeline_p99_s": percentile(own, 99),
        "peak_rss_bytes": live.peak_rss_bytes,
    }


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """p50 / p99 lag vs publish interval."""
    plt = pyplot()
    pts = [p for p in result.get("points", []) if p["lag_p50_s"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["publish_every_s"] for p in pts]
    ax.plot(xs, [p["lag_p50_s"] for p in pts], "o-", label="step -> served p50")
    ax.plot(xs, [p["lag_p99_s"] for p in pts], "s-", label="step -> served p99")
    ax.plot(xs, [p["pipeline_p50_s"] for p in pts], "x:", label="segment -> applied p50")
    ax.plot(xs, xs, color="grey", lw=0.8, label="publish interval")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("publish interval (s)")
    ax.set_ylabel("lag (s)")
    ax.set_title("freshness")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "freshness")
