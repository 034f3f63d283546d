"""Fan-out through relay trees: one window pulled from the sidecar and through relays.

Part of ``deltad bench --only fanout`` (key ``tree``); alone: ``python -m bench.fanout``.
The same fresh-consumer window pulled by N consumers from the sidecar and through one and
two relay levels (``deltad serve --upstream``), cached at every level, 4 pulls per consumer:
pull p50/p99, aggregate GB/s, CPU per delivered GB of the serving node and of the sidecar,
peak RSS per level; each relay's bootstrap time and its CPU per mirrored GB; freshness per
level (a new segment -> its seq in each level's Status). Its per-GB costs feed
:func:`bench.fanout_scale.scale_model`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench import deltad_procs
from bench.common import (
    DIM,
    GB,
    MB,
    TABLES,
    Children,
    Context,
    CpuMonitor,
    NotAvailable,
    med,
    metric,
    percentile,
    proc_peak_rss,
    pyplot,
    rows_per_table,
    save_panels,
    settle,
    spool_and_workers,
    summarize,
    wait_until,
)
from bench.wire_baselines import ClientWorker

#: Relay levels measured: consumers on the sidecar (0), on a relay of it (1), on a relay of
#: that relay (2).
LEVELS = (0, 1, 2)


def _append_delta(spool: Path, seq: int, rows_per_table: int, fraction: float = 0.01) -> int:
    """One more delta segment (``fraction`` of every table's rows) at ``seq``, as a trainer
    would; returns its payload bytes."""
    import torch

    from bench.datagen import skewed_unique_ids
    from deltad.segment.format import ShardRows, write_segment
    from deltad.segment.spool import SpoolLayout
    from deltad.types import SegmentKind, Shard

    layout = SpoolLayout(spool, deltad_procs.MODEL)
    gen = torch.Generator().manual_seed(seq)
    chunks = []
    for t in range(TABLES):
        ids = skewed_unique_ids(rows_per_table, max(1, int(rows_per_table * fraction)), gen)
        vals = torch.randn(ids.numel(), DIM, generator=gen)
        chunks.append(
            ShardRows(Shard(f"t{t}", rows_per_table, DIM, 0, rows_per_table, 0, DIM), ids, vals)
        )
    write_segment(
        layout.segment_path(1, 0, seq), model=deltad_procs.MODEL, generation=1, rank=0,
        world_size=1, seq=seq, step=seq * 10, kind=SegmentKind.DELTA, shards=chunks, fsync=False,
    )  # fmt: skip
    return sum(c.ids.numel() * (8 + DIM * 4) for c in chunks)


def relay_tree(
    ctx: Context,
    kids: Children,
    spool: Path,
    workers: list[ClientWorker],
    counts: list[int],
    rows_per_table: int,
) -> dict[str, Any]:
    """Consumers on the sidecar and through one and two relay levels (``deltad serve
    --upstream``, each with its own spool and embedded Redis), same fresh-consumer window.

    Windows are cached at every level (a warm-up pull first), so a pull costs its serving
    node the per-stream send cost: what a tree multiplies. Measured per (level, N): pull
    p50/p99, aggregate GB/s, CPU of the serving node and of the sidecar per delivered GB.
    Also: each relay's mirror (time and CPU to copy the whole log from its upstream), and
    freshness per level (a new segment written -> its seq at each level's Status).
    """

    deltas = ctx.pick(20, 10, 3)
    pulls = ctx.pick(4, 4, 1)  # per consumer and run: CPU ticks are 10 ms
    out: dict[str, Any] = {
        "bootstrap": [], "mirror": [], "points": [], "freshness": [], "peak_rss_bytes": {},
        "idle_cores": [],
    }  # fmt: skip
    with ctx.tmpdir("relay1") as r1, ctx.tmpdir("relay2") as r2:
        side = deltad_procs.start_sidecar(kids, spool, ctx, extra=deltad_procs.NO_RETENTION)
        chain = [side]
        try:
            head = deltad_procs.head_seq(side.endpoint)
            for lv, rspool in ((1, r1), (2, r2)):
                up = chain[-1]
                relay = deltad_procs.start_sidecar(
                    kids, rspool, ctx, require_head=False,
                    extra=[*deltad_procs.NO_RETENTION, "--upstream", up.endpoint,
                           "--upstream-consumer", f"relay{lv}"],
                )  # fmt: skip
                t0 = time.perf_counter()
                ok = wait_until(lambda e=relay.endpoint: deltad_procs.head_seq(e) == head, 300.0)  # type: ignore[misc]
                if not ok:
                    raise RuntimeError(f"relay level {lv} never caught up:\n{relay.log_tail()}")
                took = time.perf_counter() - t0
                nbytes = int(deltad_procs.status(relay.endpoint).log_bytes)
                out["bootstrap"].append({"level": lv, "seconds": took, "log_bytes": nbytes})
                chain.append(relay)
            # mirroring: large deltas (4 x 25 % of every table) through both levels, once
            # every node is idle (a fresh one imports its int8 kernels in the background)
            for p in chain:
                settle(CpuMonitor(p.proc.pid))
            # idle: each node's own spool poll, and a relay's Status polls of its upstream
            # (counted by both ends); subtracted from the mirror cost below
            idle_s = ctx.pick(3.0, 2.0, 0.5)
            cpus = [CpuMonitor(p.proc.pid) for p in chain]
            time.sleep(idle_s)
            idle = [c.seconds() / idle_s for c in cpus]
            out["idle_cores"] = idle
            cpus = [CpuMonitor(p.proc.pid) for p in chain]
            t_mirror = time.perf_counter()
            nbytes = 0
            for _ in range(4):
                head += 1
                nbytes += _append_delta(spool, head, rows_per_table, 0.25)

                def mirrored(at: int = head) -> bool:
                    return all(deltad_procs.head_seq(p.endpoint) >= at for p in chain)

                if not wait_until(mirrored, 300.0, 0.05):
                    raise RuntimeError("a relay never mirrored a large delta")
            took = time.perf_counter() - t_mirror
            for lv in (1, 2):
                busy = max(0.0, cpus[lv].seconds() - idle[lv] * took)
                out["mirror"].append(
                    {
                        "level": lv, "delta_bytes": nbytes, "seconds": took,
                        "relay_cpu_s": cpus[lv].seconds(), "relay_cpu_s_over_idle": busy,
                        "relay_cpu_s_per_gb": busy / (nbytes / GB),
                    }
                )  # fmt: skip
            for lv in LEVELS:
                serving = chain[lv]
                # warm: the window is merged and cached once per node, as in steady state
                workers[0].call(
                    "call", module="bench.throughput", func="client_pull",
                    kwargs={"endpoint": serving.endpoint, "model": serving.model,
                            "consumer": f"tree-warm-{lv}", "dtype": "fp32"},
                )  # fmt: skip
                for n in counts:
                    ctx.status(f"fanout tree level {lv} x{n}")
                    for r in range(ctx.repeats):
                        out["points"].append(_tree_run(workers[:n], chain, lv, n, r, pulls))
            out["freshness"] = _freshness(chain, spool, head, deltas, rows_per_table)
            for lv, proc in enumerate(chain):
                out["peak_rss_bytes"][f"level{lv}"] = proc_peak_rss(proc.proc.pid) or 0
        finally:
            for p in reversed(chain):
                p.stop()
    return _tree_summary(out, counts)


def _tree_run(
    workers: list[ClientWorker], chain: list[Any], lv: int, n: int, round_: int, pulls: int
) -> dict[str, Any]:
    """``n`` consumers pull the whole window from level ``lv`` at once, ``pulls`` times each
    over a warm connection (uncommitted: the same cached window every time)."""
    serving = chain[lv]
    res: list[dict[str, Any]] = []
    cpus: list[CpuMonitor] = []
    rates: list[float] = []
    for k in range(pulls):
        start_at = time.time() + (1.0 + 0.05 * n if k == 0 else 0.1)
        for i, w in enumerate(workers):
            w.send(
                "call", module="bench.throughput", func="client_pull",
                kwargs={"endpoint": serving.endpoint, "model": serving.model,
                        "consumer": f"tree-{lv}-{n}-{round_}-{i}", "dtype": "fp32",
                        "start_at": start_at, "keep": True},
            )  # fmt: skip
        time.sleep(max(0.0, start_at - time.time()))
        if k == 0:
            cpus = [CpuMonitor(p.proc.pid) for p in chain]
        got = [w.recv("client_pull") for w in workers]
        span = max(x["end_unix"] for x in got) - min(x["start_unix"] for x in got)
        if span > 0:
            rates.append(sum(x["bytes"] for x in got) / span / GB)
        res += got
    cpu_s = [c.seconds() for c in cpus]
    total = sum(x["bytes"] for x in res)
    return {
        "level": lv,
        "consumers": n,
        "round": round_,
        "pull_s": [x["seconds"] for x in res],
        "bytes": total,
        "aggregate_gbps": med(summarize(rates)),
        "serving_cpu_s": cpu_s[lv],
        "sidecar_cpu_s": cpu_s[0],
        "cpu_s_by_level": cpu_s,
        "pulls": pulls,
    }


def _freshness(
    chain: list[Any], spool: Path, head: int, deltas: int, rows_per_table: int
) -> list[dict[str, Any]]:
    """Write ``deltas`` new segments 0.2 s apart; per level, seconds until its Status shows
    each one (the sidecar's poll plus each relay's pull, write and index)."""
    lags: dict[int, list[float]] = {lv: [] for lv in range(len(chain))}
    for k in range(1, deltas + 1):
        seq = head + k
        t0 = time.time()
        _append_delta(spool, seq, rows_per_table)
        written = time.time()
        seen: dict[int, float] = {}
        deadline = time.monotonic() + 30.0
        while len(seen) < len(chain) and time.monotonic() < deadline:
            for lv, p in enumerate(chain):
                if lv not in seen and deltad_procs.head_seq(p.endpoint) >= seq:
                    seen[lv] = time.time() - written
            time.sleep(0.02)  # (20 ms: polling faster would load the nodes it measures)
        for lv, lag in seen.items():
            lags[lv].append(lag)
        time.sleep(max(0.0, 0.2 - (time.time() - t0)))
    return [
        {
            "level": lv,
            "samples": len(xs),
            "p50_s": percentile(xs, 50),
            "p99_s": percentile(xs, 99),
            "max_s": max(xs) if xs else None,
        }
        for lv, xs in lags.items()
    ]


def _tree_summary(raw: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    points = []
    for lv in LEVELS:
        for n in counts:
            rs = [x for x in raw["points"] if x["level"] == lv and x["consumers"] == n]
            if not rs:
                continue
            pulls = [s for x in rs for s in x["pull_s"]]
            gb = sum(x["bytes"] for x in rs) / GB
            points.append(
                {
                    "level": lv,
                    "consumers": n,
                    "p50_s": percentile(pulls, 50),
                    "p99_s": percentile(pulls, 99),
                    "aggregate_gbps": summarize([x["aggregate_gbps"] for x in rs]),
                    "serving_cpu_s_per_gb": sum(x["serving_cpu_s"] for x in rs) / gb,
                    "sidecar_cpu_s_per_gb": sum(x["sidecar_cpu_s"] for x in rs) / gb,
                    "bytes_per_consumer": rs[0]["bytes"] // (n * rs[0]["pulls"]),
                }
            )
    return {**raw, "points": points, "runs": raw["points"]}


def tree_headline(tree: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The headline rows of the tree (``n`` consumers per level) and of the overload runs."""
    pts = {(p["level"], p["consumers"]): p for p in tree.get("points", [])}
    fresh = {f["level"]: f for f in tree.get("freshness", [])}
    out = [
        metric(f"failed pulls, {ov['consumers']} consumers on "
               f"{ov['max_concurrent_streams']} stream slot(s)", ov["failed"], "pulls",
               target="0", met=ov["failed"] == 0)
        for ov in tree.get("overload", [])
    ]  # fmt: skip
    for lv in LEVELS:
        p = pts.get((lv, n))
        if p is None:
            continue
        at = f"level {lv} ({n} consumers)"
        out += [
            metric(f"{at}: sidecar CPU per delivered GB", p["sidecar_cpu_s_per_gb"], "s/GB"),
            metric(f"{at}: serving node CPU per delivered GB", p["serving_cpu_s_per_gb"], "s/GB"),
            metric(f"{at}: pull p99", p["p99_s"], "s"),
        ]
        if lv in fresh and fresh[lv]["p99_s"] is not None:
            out.append(metric(f"level {lv}: freshness p99", fresh[lv]["p99_s"], "s"))
    return out


def plot_tree(points: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Pull p99, serving node and sidecar CPU per delivered GB vs consumers, per level."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for lv in LEVELS:
        ps = sorted((p for p in points if p["level"] == lv), key=lambda p: p["consumers"])
        xs = [p["consumers"] for p in ps]
        name = "direct" if lv == 0 else f"{lv} relay level{'s' if lv > 1 else ''}"
        axes[0].plot(xs, [p["p99_s"] for p in ps], "o-", label=f"{name} p99")
        axes[1].plot(xs, [p["serving_cpu_s_per_gb"] for p in ps], "o-", label=name)
        axes[2].plot(xs, [p["sidecar_cpu_s_per_gb"] for p in ps], "o-", label=name)
    ylabels = ("pull time (s)", "serving node CPU s per delivered GB",
               "trainer sidecar CPU s per delivered GB")  # fmt: skip
    title = "fan-out through relays (cached window)"
    return save_panels(fig, axes, ylabels, title, out_dir, "fanout-tree")


def sizes(ctx: Context) -> tuple[int, list[int]]:
    """The fan-out's window (fp32 bytes) and consumer counts at the context's preset."""
    return ctx.pick(128 * MB, 16 * MB, 1 * MB), ctx.pick([1, 4, 8, 16], [1, 2, 4], [1, 2])


def tree_only(ctx: Context) -> dict[str, Any]:
    """Only the relay tree (:func:`relay_tree`): its own spool and consumer workers, at the
    context's preset sizes. What ``python -m bench.fanout`` runs."""
    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window, counts = sizes(ctx)
    rows = rows_per_table(window)
    with spool_and_workers(ctx, "fanout-tree", max(counts), rows=rows) as (spool, kids, workers):
        tree = relay_tree(ctx, kids, spool, workers, counts, rows)
    return {"window_bytes": window, **tree}
