"""Windows at many cursors: N consumers at N cursors vs N at one, with pre-merged runs and without.

Part of ``deltad bench --only fanout`` (key ``cursors``); see :func:`cursors`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench import deltad_procs
from bench.common import (
    DELTAS,
    GB,
    MB,
    Children,
    Context,
    CpuMonitor,
    NotAvailable,
    med,
    metric,
    percentile,
    proc_peak_rss,
    ratio,
    rows_per_table,
    settle,
    spool_and_workers,
    summarize,
)
from bench.wire_baselines import ClientWorker

#: sidecar flag that turns pre-merged runs off (the baseline: windows merged from segments)
NO_RUNS = ["--run-cache-bytes", "0"]


def cursors(ctx: Context) -> dict[str, Any]:
    """N consumers at N different cursors vs N at one cursor, with pre-merged runs
    (:mod:`deltad.serve.index.runs`, the default) and without (``--run-cache-bytes 0``), same run.

    Own spool (base + 16 deltas of 1 % skewed rows, 4 tables, dim 64) and N worker processes;
    a fresh sidecar per run (no retention). Modes:

    * ``fresh-same``: N fresh consumers pull the base window to the head (one window, cached);
    * ``fresh-diff``: fresh consumer i pulls to seq ``i % 16 + 1`` (N base windows of base +
      1..16 deltas: the "different windows" mode above);
    * ``stag-same`` / ``stag-diff``: each consumer first pulls up to seq 0 (same) or seq
      ``i % 16`` (diff) and commits (untimed), then all pull to the head at once: N windows
      ``(cursor, 16]`` of deltas (staggered predictors catching up).

    Also the bootstrap herd: 1, 2 and 8 (quick: 1, 2, 4) fresh consumers pulling one window at
    once (concurrent identical windows are built once, see
    :class:`deltad.serve.windows.cache.WindowCache`): pull p50 and sidecar CPU against one.

    Every run has an unmeasured warm-up round first (see :func:`_cursor_run`): a fresh
    process's first distinct windows pay first-touch page faults on every byte they keep
    (~140 k minor faults for 16 x 32 MB), which a long-lived sidecar pays once; both rounds'
    CPU and minor faults are recorded (``cold_*`` is the warm-up round).
    """
    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window = ctx.pick(128 * MB, 32 * MB, 1 * MB)
    n = ctx.pick(16, 16, 2)
    herd = ctx.pick([1, 2, 8], [1, 2, 4], [1, 2])
    rows = rows_per_table(window)
    runs: list[dict[str, Any]] = []
    with spool_and_workers(ctx, "cursors", max(n, *herd), rows=rows) as (spool, kids, workers):
        plan = [
            ("fresh-same", True), ("fresh-diff", True), ("fresh-diff", False),
            ("stag-same", True), ("stag-diff", True), ("stag-diff", False),
        ]  # fmt: skip
        for r in range(ctx.repeats):
            for mode, with_runs in plan:
                ctx.status(f"fanout cursors {mode} runs={with_runs} round {r + 1}")
                runs.append(_cursor_run(ctx, kids, spool, workers[:n], mode, with_runs, r))
            for h in herd:
                ctx.status(f"fanout bootstrap herd x{h} round {r + 1}")
                runs.append(_cursor_run(ctx, kids, spool, workers[:h], "herd", True, r))
        ctx.status("fanout: a predictor's bootstrap RSS")
        memory = _bootstrap_rss(ctx, kids, spool)

    def pick(mode: str, with_runs: bool, consumers: int = n) -> list[dict[str, Any]]:
        return [
            x for x in runs
            if x["mode"] == mode and x["runs"] == with_runs and x["consumers"] == consumers
        ]  # fmt: skip

    def cpu(mode: str, with_runs: bool, consumers: int = n) -> float | None:
        xs = [x["sidecar_cpu_s"] for x in pick(mode, with_runs, consumers)]
        return med(summarize(xs)) if xs else None

    def cold(mode: str, with_runs: bool) -> float | None:
        xs = [x["cold_sidecar_cpu_s"] for x in pick(mode, with_runs)]
        return med(summarize(xs)) if xs else None

    points = []
    for mode, with_runs, consumers in sorted(
        {(x["mode"], x["runs"], x["consumers"]) for x in runs}
    ):
        rs = pick(mode, with_runs, consumers)
        pulls = [s for x in rs for s in x["pull_s"]]
        points.append(
            {
                "mode": mode, "runs": with_runs, "consumers": consumers,
                "sidecar_cpu_s": summarize([x["sidecar_cpu_s"] for x in rs]),
                "p50_s": percentile(pulls, 50), "p99_s": percentile(pulls, 99),
                "bytes_per_consumer_mean": sum(sum(x["bytes_per_consumer"]) for x in rs)
                / max(1, sum(len(x["bytes_per_consumer"]) for x in rs)),
                "aggregate_gbps": summarize([x["aggregate_gbps"] for x in rs]),
            }
        )  # fmt: skip
    herd_p50 = {
        h: next(p["p50_s"] for p in points if p["mode"] == "herd" and p["consumers"] == h)
        for h in herd
    }
    headline: list[dict[str, Any]] = [
        metric(f"sidecar CPU, {n} fresh consumers at {n} heads / {n} at one, runs",
               ratio(cpu("fresh-diff", True), cpu("fresh-same", True)), "x", target="<= 2x"),
        metric("the same without runs (windows merged from segments, same run)",
               ratio(cpu("fresh-diff", False), cpu("fresh-same", True)), "x"),
        metric(f"sidecar CPU, {n} consumers at {n} cursors / {n} at one, runs",
               ratio(cpu("stag-diff", True), cpu("stag-same", True)), "x", target="<= 2x"),
        metric("the same without runs",
               ratio(cpu("stag-diff", False), cpu("stag-same", True)), "x"),
        metric(f"fresh sidecar (warm-up round): {n} at {n} heads / {n} at one, runs",
               ratio(cold("fresh-diff", True), cold("fresh-same", True)), "x"),
        metric("fresh sidecar (warm-up round): the same without runs",
               ratio(cold("fresh-diff", False), cold("fresh-same", True)), "x"),
        *[metric(f"bootstrap herd: pull p50, {h} at once / 1",
                 ratio(herd_p50[h], herd_p50[herd[0]]), "x") for h in herd[1:]],
        *[metric(f"bootstrap herd: sidecar CPU, {h} at once / 1",
                 ratio(cpu("herd", True, h), cpu("herd", True, herd[0])), "x") for h in herd[1:]],
    ]  # fmt: skip
    for line in headline:
        if "target" in line:
            v = line["value"]
            line["met"] = bool(isinstance(v, float) and v <= 2.0)
    headline.append(
        metric("bootstrap: predictor peak RSS over its RSS before / its tables",
               ratio(memory["peak_rss"] - memory["rss_before"], memory["tables_bytes"]), "x")
    )  # fmt: skip
    return {"window_bytes_fp32": window, "consumers": n, "points": points, "runs": runs,
            "bootstrap_rss": memory, "headline": headline}  # fmt: skip


def _bootstrap_rss(ctx: Context, kids: Children, spool: Path) -> dict[str, Any]:
    """A fresh predictor process bootstraps (base window into a TensorDictApplier): its RSS
    before, its peak, its tables' bytes; and the sidecar's peak RSS against its log."""

    side = deltad_procs.start_sidecar(kids, spool, ctx, extra=deltad_procs.NO_RETENTION)
    w = ClientWorker(kids)
    try:
        settle(CpuMonitor(side.proc.pid))
        out: dict[str, Any] = w.call(
            "call", module="bench.throughput", func="client_bootstrap_rss",
            kwargs={"endpoint": side.endpoint, "model": side.model, "consumer": "rss-0"},
        )  # fmt: skip
        out["sidecar_peak_rss"] = proc_peak_rss(side.proc.pid) or 0
        out["log_bytes"] = sum(p.stat().st_size for p in spool.rglob("seg-*"))
    finally:
        w.close()
        side.stop()
    return out


def _cursor_run(
    ctx: Context,
    kids: Children,
    spool: Path,
    workers: list[ClientWorker],
    mode: str,
    with_runs: bool,
    round_: int,
) -> dict[str, Any]:

    extra = deltad_procs.NO_RETENTION + ([] if with_runs else NO_RUNS)
    side = deltad_procs.start_sidecar(kids, spool, ctx, extra=extra)
    tag = f"cur-{mode}-{with_runs}-{len(workers)}-{round_}"
    try:
        cpu = CpuMonitor(side.proc.pid)
        settle_s = settle(cpu)
        if mode.startswith("stag"):  # (untimed) every consumer to its cursor, committed
            for i, w in enumerate(workers):
                seq = 0 if mode == "stag-same" else i % DELTAS
                w.send(
                    "call", module="bench.throughput", func="client_pull",
                    kwargs={"endpoint": side.endpoint, "model": side.model,
                            "consumer": f"{tag}-{i}", "dtype": "fp32", "max_step": seq * 10,
                            "commit": True, "keep": True},
                )  # fmt: skip
            for w in workers:
                w.recv("client_pull")
            settle(cpu)
        # Two rounds on the fresh sidecar: a warm-up (its heap pages are touched for the first
        # time, runs are merged), then the measured one (the steady state of a long-lived
        # sidecar; its windows are not cached). Warm-up windows: fresh modes, fp32 at other
        # heads (fresh-diff: seq (i + 8) % 16 + 1; one head, 15, otherwise); staggered modes
        # (a cursor is committed), the same windows in fp16. Uncommitted: same cursors.
        out = {}
        for phase in ("warm", "measured"):
            start_at = time.time() + 1.0 + 0.05 * len(workers)
            for i, w in enumerate(workers):
                seq = (i % DELTAS) + 1 if mode == "fresh-diff" else DELTAS
                dtype = "fp32"
                if phase == "warm" and mode.startswith("stag"):
                    dtype = "fp16"
                elif phase == "warm":
                    seq = ((i + 8) % DELTAS) + 1 if mode == "fresh-diff" else DELTAS - 1
                w.send(
                    "call", module="bench.throughput", func="client_pull",
                    kwargs={"endpoint": side.endpoint, "model": side.model,
                            "consumer": f"{tag}-{i}", "dtype": dtype, "max_step": seq * 10,
                            "start_at": start_at, "keep": True},
                )  # fmt: skip
            time.sleep(max(0.0, start_at - time.time()))
            cpu.reset()
            faults = _minflt(side.proc.pid)
            res_ = [w.recv("client_pull") for w in workers]
            out[phase] = (res_, cpu.seconds(), _minflt(side.proc.pid) - faults)
            settle(cpu)
        res, cpu_s, faults = out["measured"]
        rss = proc_peak_rss(side.proc.pid) or 0
    finally:
        side.stop()
    total = sum(x["bytes"] for x in res)
    span = max(x["end_unix"] for x in res) - min(x["start_unix"] for x in res)
    return {
        "mode": mode,
        "runs": with_runs,
        "consumers": len(workers),
        "round": round_,
        "pull_s": [x["seconds"] for x in res],
        "bytes_per_consumer": [x["bytes"] for x in res],
        "aggregate_gbps": total / span / GB if span > 0 else None,
        "sidecar_cpu_s": cpu_s,
        "sidecar_minor_faults": faults,
        "cold_sidecar_cpu_s": out["warm"][1],
        "cold_sidecar_minor_faults": out["warm"][2],
        "sidecar_cpu_s_per_gb": cpu_s / (total / GB) if total else None,
        "sidecar_settle_s": settle_s,
        "sidecar_peak_rss": rss,
    }


def _minflt(pid: int) -> int:
    """Minor page faults of a process so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0
