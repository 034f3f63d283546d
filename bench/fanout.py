"""Benchmark 4: fan-out, N consumers pulling at once from one sidecar.

A spool holds a base (every row of 4 tables, dim 64) and 16 small deltas. Consumers are
spawned worker processes (kept across runs); a fresh sidecar is started for every run so
that no window is cached from an earlier one.

* **same window**: N fresh consumers pull the same window (cursor -1 to one ``max_step``),
  so the sidecar can merge and encode it once and stream it N times.
* **different windows**: consumer i pulls up to a different ``max_step`` (seq ``i % 16 + 1``):
  N windows of about the same size, each merged and encoded separately.

Per run: every consumer's pull time (p50 / p99), aggregate throughput (bytes delivered by
all / span from the first start to the last end) and the sidecar's CPU seconds (psutil,
user + system, sidecar process and its children) over the run.

The other parts of this benchmark, each in its own module: **relay trees**
(:mod:`bench.fanout_tree`: the same window through one and two relay levels);
**overload** (:mod:`bench.fanout_overload`: 128 and 256 consumers on one sidecar, 0 failed
pulls); **cursors** (:mod:`bench.fanout_cursors`: N consumers at N cursors, pre-merged runs);
and :func:`bench.fanout_scale.scale_model`, the extrapolation to 4,096 predictors x 64 ranks
documented in bench/README.md.

**Fleet** (:mod:`bench.fleet`, key ``fleet``): 64 and 256 consumers in worker processes,
directly and through one and two relay levels of ``deltad serve`` processes; its per-pull
and per-GB costs feed :func:`scale_model`.

**Floor** (baseline, same run): a bare gRPC server (:mod:`bench.wire_baselines`) streams
the same number of bytes to N clients at once from messages built once and shared, so each
stream costs only gRPC's send path and the kernel's loopback copy. Its CPU per extra stream
is what any sidecar pays per consumer in this stack; ``floor_ratio`` is the ratio deltad
would reach if its own per-consumer cost were exactly that floor:
``(cpu_1 + (N - 1) * floor_per_stream) / cpu_1``.
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
    PeakRssMonitor,
    med,
    metric,
    percentile,
    pyplot,
    ratio,
    rows_per_table,
    save_panels,
    settle,
    spool_and_workers,
    summarize,
)
from bench.fanout_cursors import cursors
from bench.fanout_overload import overload
from bench.fanout_scale import scale_model
from bench.fanout_tree import plot_tree, relay_tree, sizes, tree_headline, tree_only
from bench.wire_baselines import ClientWorker, grpc_server_main, start_server


def run(ctx: Context) -> dict[str, Any]:
    """Every (mode, N) for ``ctx.repeats`` rounds."""
    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window, counts = sizes(ctx)
    rows = rows_per_table(window)
    runs: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    with spool_and_workers(ctx, "fanout", max(counts), rows=rows) as (spool, kids, workers):
        mon = PeakRssMonitor().start()
        for i, w in enumerate(workers):
            mon.watch(f"predictor{i}", w.proc.pid)
        # The smoke test (tiny) shares one sidecar: numbers are meaningless there anyway.
        shared = (
            deltad_procs.start_sidecar(kids, spool, ctx, extra=deltad_procs.NO_RETENTION)
            if ctx.tiny
            else None
        )
        floor: list[dict[str, Any]] = []
        bare_conn = None
        try:
            # (keep its pipe open: the server stops when the pipe closes)
            bare_conn, bare_port, bare_pid = start_server(kids, grpc_server_main, window)
            for r in range(ctx.repeats):
                for mode in ("same", "different"):
                    for n in counts:
                        ctx.status(f"fanout {mode} x{n} round {r + 1}")
                        runs.append(_one(ctx, kids, spool, workers[:n], mode, n, r, shared))
                nbytes = min(max(runs[0]["bytes_per_consumer"]), window)
                for n in counts:
                    ctx.status(f"fanout floor x{n} round {r + 1}")
                    floor.append(floor_round(bare_pid, bare_port, workers[:n], nbytes, r))
            if shared is not None:  # (one sidecar per rank and spool: the tree starts its own)
                shared.stop()
                shared = None
            ctx.status("fanout: relay tree")
            tree = relay_tree(ctx, kids, spool, workers, counts, rows)
            tree["overload"] = overload(ctx, kids, workers)
        finally:
            if bare_conn is not None:
                bare_conn.close()
            if shared is not None:
                shared.stop()
            peaks = mon.stop()
    points: list[dict[str, Any]] = []
    for mode in ("same", "different"):
        for n in counts:
            rs = [x for x in runs if x["mode"] == mode and x["consumers"] == n]
            pulls = [s for x in rs for s in x["pull_s"]]
            points.append(
                {
                    "mode": mode,
                    "consumers": n,
                    "aggregate_gbps": summarize([x["aggregate_gbps"] for x in rs]),
                    "p50_s": percentile(pulls, 50),
                    "p99_s": percentile(pulls, 99),
                    "sidecar_cpu_s": summarize([x["sidecar_cpu_s"] for x in rs]),
                    "bytes_per_consumer": rs[0]["bytes_per_consumer"],
                }
            )
    floor_points: list[dict[str, Any]] = [
        {
            "consumers": n,
            "server_cpu_s": summarize([x["server_cpu_s"] for x in floor if x["consumers"] == n]),
            "aggregate_gbps": summarize(
                [x["aggregate_gbps"] for x in floor if x["consumers"] == n]
            ),
        }
        for n in counts
    ]
    result: dict[str, Any] = {
        "window_bytes_fp32": window,
        "points": points,
        "floor": floor_points,
        "floor_runs": floor,
        "runs": runs,
        "peak_rss_bytes": {
            "sidecar": max((x["sidecar_peak_rss"] for x in runs), default=0),
            "predictor_max": max(peaks.values(), default=0),
        },
    }

    def cpu(mode: str, n: int) -> float | None:
        for p in points:
            if p["mode"] == mode and p["consumers"] == n:
                return med(p["sidecar_cpu_s"])
        return None

    n8 = 8 if 8 in counts else max(counts)
    r_same = ratio(cpu("same", n8), cpu("same", 1))
    r_diff = ratio(cpu("different", n8), cpu("different", 1))
    f1, f8 = (
        next((med(p["server_cpu_s"]) for p in floor_points if p["consumers"] == n), None)
        for n in (1, n8)
    )
    c1, c8 = cpu("same", 1), cpu("same", n8)
    floor_per = (f8 - f1) / (n8 - 1) if f1 is not None and f8 is not None and n8 > 1 else None
    deltad_per = (c8 - c1) / (n8 - 1) if c1 is not None and c8 is not None and n8 > 1 else None
    floor_ratio = ratio(c1 + (n8 - 1) * floor_per, c1) if c1 and floor_per is not None else None
    result["per_extra_consumer_cpu_s"] = {"deltad": deltad_per, "bare_grpc_floor": floor_per}
    result["tree"] = tree
    ctx.status("fanout: cursors")
    result["cursors"] = cursors(ctx)
    ctx.status("fanout: fleet")
    from bench import fleet

    result["fleet"] = fleet.run(ctx)
    result["scale_model"] = scale_model(tree, fleet=result["fleet"])
    top = [p for p in points if p["consumers"] == max(counts)]
    result["headline"] = [
        *result["fleet"]["headline"],
        *result["cursors"]["headline"],
        *tree_headline(tree, max(counts)),
        metric(f"sidecar CPU, {n8} consumers same window / 1", r_same, "x", target="<= 1.5x",
               met=bool(r_same is not None and r_same <= 1.5)),
        metric(f"least possible ratio with gRPC's own send cost (floor), {n8} / 1",
               floor_ratio, "x"),
        metric("CPU per extra consumer, deltad / bare gRPC shared-message floor",
               ratio(deltad_per, floor_per), "x"),
        metric(f"sidecar CPU, {n8} consumers different windows / 1", r_diff, "x"),
        *[
            metric(f"aggregate, {p['consumers']} consumers, {p['mode']} window",
                   med(p["aggregate_gbps"]), "GB/s")
            for p in top
        ],
    ]  # fmt: skip
    return result


def _one(
    ctx: Context,
    kids: Children,
    spool: Path,
    workers: list[ClientWorker],
    mode: str,
    n: int,
    round_: int,
    shared: Any = None,
) -> dict[str, Any]:

    # no retention: the window stays base + 16 deltas, merged by the pull (once, shared)
    side = shared or deltad_procs.start_sidecar(kids, spool, ctx, extra=deltad_procs.NO_RETENTION)
    try:
        cpu = CpuMonitor(side.proc.pid)
        # A fresh sidecar indexes (and verifies) the spool after it answers: let it finish, so
        # that the runs count the pulls, not the start-up.
        settle_s = settle(cpu)
        head_step = DELTAS * 10
        # Every consumer connects first, then all pull at the same moment.
        start_at = time.time() + 1.0 + 0.05 * n
        for i, w in enumerate(workers):
            seq = DELTAS if mode == "same" else (i % DELTAS) + 1
            w.send(
                "call",
                module="bench.throughput",
                func="client_pull",
                kwargs={
                    "endpoint": side.endpoint,
                    "model": side.model,
                    "consumer": f"fan-{mode}-{n}-{round_}-{i}",
                    "dtype": "fp32",
                    "max_step": min(seq * 10, head_step),
                    "start_at": start_at,
                },
            )
        time.sleep(max(0.0, start_at - time.time()))
        cpu.reset()  # count the pulls, not the registrations
        res = [w.recv("client_pull") for w in workers]
        cpu_s = cpu.seconds()
        from bench.common import proc_peak_rss

        rss = proc_peak_rss(side.proc.pid) or 0
    finally:
        if shared is None:
            side.stop()
    total = sum(x["bytes"] for x in res)
    span = max(x["end_unix"] for x in res) - min(x["start_unix"] for x in res)
    late = max(x["start_unix"] for x in res) - start_at
    return {
        "mode": mode,
        "consumers": n,
        "round": round_,
        "pull_s": [x["seconds"] for x in res],
        "bytes_per_consumer": [x["bytes"] for x in res],
        "aggregate_gbps": total / span / GB if span > 0 else None,
        "sidecar_cpu_s": cpu_s,
        "sidecar_settle_s": settle_s,
        "sidecar_peak_rss": rss,
        "latest_start_after_start_at_s": late,
    }


def floor_round(
    server_pid: int, port: int, workers: list[ClientWorker], nbytes: int, round_: int
) -> dict[str, Any]:
    """N bare gRPC streams of ``nbytes`` at once, from messages the server built once."""
    cpu = CpuMonitor(server_pid)
    for w in workers[:1]:  # build the shared messages (untimed), warm the channel
        w.call("grpc", port=port, nbytes=nbytes, chunk=2 * MB, single_thread=True, shared=True)
    start_at = time.time() + 0.5 + 0.05 * len(workers)
    for w in workers:
        w.send(
            "grpc",
            port=port,
            nbytes=nbytes,
            chunk=2 * MB,
            single_thread=True,
            shared=True,
            start_at=start_at,
        )
    time.sleep(max(0.0, start_at - time.time()))
    cpu.reset()
    res = [w.recv("grpc") for w in workers]
    cpu_s = cpu.seconds()
    span = max(x["end_unix"] for x in res) - min(x["start_unix"] for x in res)
    return {
        "consumers": len(workers),
        "round": round_,
        "server_cpu_s": cpu_s,
        "aggregate_gbps": sum(x["bytes"] for x in res) / span / GB if span > 0 else None,
    }


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Aggregate GB/s, p99 pull time and sidecar CPU vs consumers, per mode."""
    plt = pyplot()
    pts = result.get("points", [])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for mode in ("same", "different"):
        ps = sorted((p for p in pts if p["mode"] == mode), key=lambda p: p["consumers"])
        xs = [p["consumers"] for p in ps]
        axes[0].plot(xs, [med(p["aggregate_gbps"]) for p in ps], "o-", label=f"{mode} window")
        axes[1].plot(xs, [p["p50_s"] for p in ps], "o-", label=f"{mode} p50")
        axes[1].plot(xs, [p["p99_s"] for p in ps], "x--", label=f"{mode} p99")
        axes[2].plot(xs, [med(p["sidecar_cpu_s"]) for p in ps], "o-", label=f"{mode} window")
    paths = save_panels(
        fig, axes, ("aggregate GB/s", "pull completion (s)", "sidecar CPU seconds per run"),
        f"fan-out, {result.get('window_bytes_fp32', 0) / MB:.0f} MB window", out_dir, "fanout",
    )  # fmt: skip
    tree = result.get("tree", {}).get("points", [])
    return paths + (plot_tree(tree, out_dir) if tree else [])


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.fanout``: only the relay tree (the rest runs in ``deltad bench --only
    fanout``); ``--record`` writes ``bench/results/fanout-tree.json`` (the scale model's relay
    inputs and the figures). Default sizes: the full preset's; ``--quick``: 16 MB, 1-4."""
    from bench.run import run_part

    def report(res: dict[str, Any]) -> None:
        print("idle cores per level:", [round(x, 4) for x in res["idle_cores"]])
        print("freshness:", [(f["level"], f["p50_s"], f["p99_s"]) for f in res["freshness"]])
        for m in res["mirror"]:
            print(f"mirror level {m['level']}: {m['relay_cpu_s_per_gb']:.2f} CPU-s/GB")
        for p in res["points"]:
            print(
                f"level {p['level']} x{p['consumers']}: p50 {p['p50_s']:.3f} "
                f"p99 {p['p99_s']:.3f} s, serving {p['serving_cpu_s_per_gb']:.2f} "
                f"sidecar {p['sidecar_cpu_s_per_gb']:.2f} s/GB"
            )

    return run_part("python -m bench.fanout", main.__doc__, "fanout-tree", tree_only, report, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
