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

**Relay trees** (:func:`_tree`): the same fresh-consumer window pulled by N consumers from
the sidecar and through one and two relay levels (``deltad serve --upstream``), cached at
every level, 4 pulls per consumer: pull p50/p99, aggregate GB/s, CPU per delivered GB of the
serving node and of the sidecar, peak RSS per level; each relay's bootstrap time and its CPU
per mirrored GB; freshness per level (a new segment -> its seq in each level's Status);
overload (:func:`_overload`: 128 and 256 consumers on one sidecar, 0 failed pulls); and
:func:`scale_model`,
the extrapolation to 4,096 predictors x 64 ranks documented in bench/README.md.

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
    GB,
    MB,
    Children,
    Context,
    CpuMonitor,
    NotAvailable,
    PeakRssMonitor,
    med,
    percentile,
    ratio,
    save_figure,
    settle,
    summarize,
    wait_until,
)
from bench.wire_baselines import ClientWorker, grpc_server_main, start_server

DIM = 64
TABLES = 4
DELTAS = 16


def run(ctx: Context) -> dict[str, Any]:
    """Every (mode, N) for ``ctx.repeats`` rounds."""
    from bench.datagen import write_spool

    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window = ctx.pick(128 * MB, 16 * MB, 1 * MB)
    counts = ctx.pick([1, 4, 8, 16], [1, 2, 4], [1, 2])
    rows = window // (8 + DIM * 4) // TABLES
    runs: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    with ctx.tmpdir("fanout") as spool, Children() as kids:
        ctx.status("fanout: spool")
        write_spool(
            spool,
            model=deltad_procs.MODEL,
            tables=TABLES,
            rows_per_table=rows,
            dim=DIM,
            deltas=DELTAS,
            delta_fraction=0.01,
        )
        ctx.status("fanout: start consumers")
        workers = [ClientWorker(kids) for _ in range(max(counts))]
        for w in workers:
            w.send("call", module="bench.throughput", func="client_warm", kwargs={})
        for w in workers:
            w.recv("client_warm", 300.0)
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
                    floor.append(_floor(bare_pid, bare_port, workers[:n], nbytes, r))
            ctx.status("fanout: relay tree")
            tree = _tree(ctx, kids, spool, workers, counts, rows)
            tree["overload"] = _overload(ctx, kids, workers)
        finally:
            if bare_conn is not None:
                bare_conn.close()
            if shared is not None:
                shared.stop()
            for w in workers:
                w.close()
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
    floor_points = [
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
        *_tree_headline(tree, max(counts)),
        {
            "metric": f"sidecar CPU, {n8} consumers same window / 1",
            "value": r_same,
            "unit": "x",
            "target": "<= 1.5x",
            "met": bool(r_same is not None and r_same <= 1.5),
        },
        {
            "metric": f"least possible ratio with gRPC's own send cost (floor), {n8} / 1",
            "value": floor_ratio,
            "unit": "x",
        },
        {
            "metric": "CPU per extra consumer, deltad / bare gRPC shared-message floor",
            "value": ratio(deltad_per, floor_per),
            "unit": "x",
        },
        {
            "metric": f"sidecar CPU, {n8} consumers different windows / 1",
            "value": r_diff,
            "unit": "x",
        },
        *[
            {
                "metric": f"aggregate, {p['consumers']} consumers, {p['mode']} window",
                "value": med(p["aggregate_gbps"]),
                "unit": "GB/s",
            }
            for p in top
        ],
    ]
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


def _floor(
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.get("points", [])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for mode in ("same", "different"):
        ps = sorted((p for p in pts if p["mode"] == mode), key=lambda p: p["consumers"])
        xs = [p["consumers"] for p in ps]
        axes[0].plot(xs, [med(p["aggregate_gbps"]) for p in ps], "o-", label=f"{mode} window")
        axes[1].plot(xs, [p["p50_s"] for p in ps], "o-", label=f"{mode} p50")
        axes[1].plot(xs, [p["p99_s"] for p in ps], "x--", label=f"{mode} p99")
        axes[2].plot(xs, [med(p["sidecar_cpu_s"]) for p in ps], "o-", label=f"{mode} window")
    axes[0].set_ylabel("aggregate GB/s")
    axes[1].set_ylabel("pull completion (s)")
    axes[2].set_ylabel("sidecar CPU seconds per run")
    for ax in axes:
        ax.set_xlabel("consumers")
        ax.legend(fontsize=8)
    fig.suptitle(f"fan-out, {result.get('window_bytes_fp32', 0) / MB:.0f} MB window")
    paths = save_figure(fig, out_dir, "fanout")
    tree = result.get("tree", {}).get("points", [])
    if tree:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for lv in LEVELS:
            ps = sorted((p for p in tree if p["level"] == lv), key=lambda p: p["consumers"])
            xs = [p["consumers"] for p in ps]
            name = "direct" if lv == 0 else f"{lv} relay level{'s' if lv > 1 else ''}"
            axes[0].plot(xs, [p["p99_s"] for p in ps], "o-", label=f"{name} p99")
            axes[1].plot(xs, [p["serving_cpu_s_per_gb"] for p in ps], "o-", label=name)
            axes[2].plot(xs, [p["sidecar_cpu_s_per_gb"] for p in ps], "o-", label=name)
        axes[0].set_ylabel("pull time (s)")
        axes[1].set_ylabel("serving node CPU s per delivered GB")
        axes[2].set_ylabel("trainer sidecar CPU s per delivered GB")
        for ax in axes:
            ax.set_xlabel("consumers")
            ax.legend(fontsize=8)
        fig.suptitle("fan-out through relays (cached window)")
        paths += save_figure(fig, out_dir, "fanout-tree")
    return paths


# ---- relay trees ------------------------------------------------------------------------

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


def _tree(
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
    from bench.common import proc_peak_rss

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


def _overload(ctx: Context, kids: Children, workers: list[ClientWorker]) -> list[dict[str, Any]]:
    """128 and 256 consumers (threads spread over the worker processes) pull a small window at
    the same moment from one sidecar with its default limits (64 streams, 64 in line): the
    rest are refused with a retry hint, which the consumer library honours. Every pull must
    end with all its rows (failed = 0)."""
    from bench.datagen import write_spool

    totals = ctx.pick([128, 256], [128], [8])
    slots = ctx.pick(64, 64, 2)
    window = ctx.pick(4 * MB, 2 * MB, 256 * 1024)
    out = []
    with ctx.tmpdir("overload") as spool:
        write_spool(
            spool, model=deltad_procs.MODEL, tables=TABLES,
            rows_per_table=window // (8 + DIM * 4) // TABLES, dim=DIM, deltas=2,
        )  # fmt: skip
        for total in totals:
            ctx.status(f"fanout overload x{total}")
            side = deltad_procs.start_sidecar(
                kids, spool, ctx,
                extra=[*deltad_procs.NO_RETENTION, "--max-concurrent-streams", str(slots)],
            )  # fmt: skip
            try:
                per = -(-total // len(workers))
                start_at = time.time() + 3.0 + 0.02 * total
                sent = []
                for k, w in enumerate(workers):
                    n = min(per, total - k * per)
                    if n <= 0:
                        break
                    w.send(
                        "call", module="bench.fanout", func="client_pull_many",
                        kwargs={"endpoint": side.endpoint, "model": side.model,
                                "prefix": f"over-{total}-{k}", "n": n, "start_at": start_at},
                    )  # fmt: skip
                    sent.append(w)
                got = [x for w in sent for x in w.recv("client_pull_many", 900.0)]
            finally:
                side.stop()
            full = max((x["bytes"] for x in got), default=0)
            secs = [x["seconds"] for x in got if x["seconds"] is not None]
            bad = [x for x in got if x["error"] or x["missing"] or x["bytes"] < full]
            out.append(
                {
                    "consumers": total,
                    "max_concurrent_streams": slots,
                    "window_bytes": full,
                    "failed": len(bad),
                    "errors": sorted({x["error"] or "missing" for x in bad})[:5],
                    "p50_s": percentile(secs, 50),
                    "p99_s": percentile(secs, 99),
                    "max_s": max(secs, default=None),
                }
            )
    return out


def client_pull_many(
    state: dict[Any, Any], endpoint: str, model: str, prefix: str, n: int, start_at: float
) -> list[dict[str, Any]]:
    """Runs in a client worker: ``n`` consumers (threads, one channel each) connect, then pull
    their whole window at ``start_at``; per pull its seconds, bytes and any error."""
    import threading

    from deltad.config import ConsumerConfig
    from deltad.consume.client import DeltaConsumer

    out: list[dict[str, Any]] = [{} for _ in range(n)]

    def one(i: int) -> None:
        res: dict[str, Any] = {"seconds": None, "bytes": 0, "missing": 0, "error": None}
        try:
            cfg = ConsumerConfig(
                consumer=f"{prefix}-{i}", model=model, sidecars=(endpoint,), align_steps=False,
                rpc_deadline_s=600.0, reuse_buffers_bytes=0,
            )  # fmt: skip
            with DeltaConsumer(cfg) as c:
                time.sleep(max(0.0, start_at - time.time()))
                t0 = time.perf_counter()
                r = c.pull()
                res.update(seconds=time.perf_counter() - t0, bytes=r.bytes, missing=len(r.missing))
        except Exception as e:  # reported, counted as a failed pull
            res["error"] = f"{type(e).__name__}: {e}"[:300]
        out[i] = res

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600.0)
    return [r or {"seconds": None, "bytes": 0, "missing": 0, "error": "hung"} for r in out]


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


def _tree_headline(tree: dict[str, Any], n: int) -> list[dict[str, Any]]:
    pts = {(p["level"], p["consumers"]): p for p in tree.get("points", [])}
    fresh = {f["level"]: f for f in tree.get("freshness", [])}
    out: list[dict[str, Any]] = []
    for ov in tree.get("overload", []):
        out.append(
            {
                "metric": f"failed pulls, {ov['consumers']} consumers on "
                f"{ov['max_concurrent_streams']} stream slot(s)",
                "value": ov["failed"],
                "unit": "pulls",
                "target": "0",
                "met": ov["failed"] == 0,
            }
        )
    for lv in LEVELS:
        p = pts.get((lv, n))
        if p is None:
            continue
        out += [
            {
                "metric": f"level {lv} ({n} consumers): sidecar CPU per delivered GB",
                "value": p["sidecar_cpu_s_per_gb"],
                "unit": "s/GB",
            },
            {
                "metric": f"level {lv} ({n} consumers): serving node CPU per delivered GB",
                "value": p["serving_cpu_s_per_gb"],
                "unit": "s/GB",
            },
            {"metric": f"level {lv} ({n} consumers): pull p99", "value": p["p99_s"], "unit": "s"},
        ]
        if lv in fresh and fresh[lv]["p99_s"] is not None:
            out.append(
                {"metric": f"level {lv}: freshness p99", "value": fresh[lv]["p99_s"], "unit": "s"}
            )
    return out


def scale_model(
    tree: dict[str, Any],
    *,
    predictors: int = 4096,
    ranks: int = 64,
    delta_mb_per_s: tuple[float, ...] = (1.0, 10.0, 50.0),
    core_budget: float = 0.5,
    nic_gbps: float = 1.25,
    fleet: dict[str, Any] | None = None,
    pulls_per_s: float = 1.0,
) -> dict[str, Any]:
    """Extrapolate the measured per-GB costs to ``predictors`` x ``ranks``.

    Each predictor reads every rank; each serving node (sidecar or relay) serves one rank to
    F consumers, each at the rank's delta rate D (bytes/s). A node sustains F while
    ``F * D * c_send <= core_budget`` cores (c_send: its measured CPU-s per delivered GB, at
    the largest N measured) and ``F * D <= nic_gbps``; a relay also pays ``D * c_mirror`` to
    mirror (measured over its idle cost) and its idle cost (its Status polls of the upstream
    and its spool poll, measured in cores). Relays per level follow from F; freshness p99 at level L is the measured p99 of
    level L (the sidecar's poll plus L relay hops), extended linearly with the measured
    per-hop increment for deeper trees.

    With a measured ``fleet`` (:mod:`bench.fleet`: 64/256 consumers per node) the consumer's
    cost on its node is ``pulls_per_s x fixed + D x marginal``: the fleet's sidecar CPU per
    pull split at two window sizes into a fixed part per pull and a part per GB. Without it
    (or if the split is missing), ``D x c_send``.
    """
    pts = tree.get("points", [])
    if not pts:
        return {}
    top = max(p["consumers"] for p in pts)
    sends = [p["serving_cpu_s_per_gb"] for p in pts if p["consumers"] == top]
    c_send = max(sends)  # the dearest level: conservative
    mirrors = [m["relay_cpu_s_per_gb"] for m in tree.get("mirror", [])]
    c_mirror = max(mirrors) if mirrors else None
    idle = tree.get("idle_cores") or []
    idle_relay = max(idle[1:], default=None)  # a relay's own polling, per relay
    fresh = {f["level"]: f["p99_s"] for f in tree.get("freshness", []) if f["p99_s"] is not None}
    hop = (
        (fresh[max(fresh)] - fresh[0]) / max(fresh)
        if fresh and max(fresh) > 0 and 0 in fresh
        else None
    )
    split = (fleet or {}).get("per_pull_cost") or {}
    fixed = split.get("fixed_cpu_s_per_pull")
    marginal = split.get("cpu_s_per_gb_marginal")
    use_split = fixed is not None and marginal is not None
    fleet_pts = (fleet or {}).get("points") or []
    fleet_top = max((p["consumers"] for p in fleet_pts), default=None)
    fleet_send = [
        p["serving_cpu_s_per_gb"]
        for p in fleet_pts
        if p["consumers"] == fleet_top and p["serving_cpu_s_per_gb"] is not None
    ]

    def per_consumer_cores(d_gb: float) -> float:
        if fixed is not None and marginal is not None:
            return pulls_per_s * float(fixed) + d_gb * float(marginal)
        return d_gb * c_send

    rows: list[dict[str, Any]] = []
    for d_mb in delta_mb_per_s:
        d_gb = d_mb / 1000
        one = per_consumer_cores(d_gb)
        f_cpu = core_budget / one if one > 0 else float("inf")
        f_nic = nic_gbps / d_gb
        fanout = max(1, int(min(f_cpu, f_nic)))
        # levels: the sidecar serves min(F, relays of level 1); each level multiplies by F.
        # A node that cannot serve two consumers at this rate (F = 1) never reaches them all:
        # no tree does, so the row says so instead of looping (bounded: F >= 2 doubles reach).
        if fanout < 2 and predictors > 1:
            rows.append(
                {
                    "delta_mb_per_s_per_rank": d_mb,
                    "fanout_per_node": fanout,
                    "limited_by": "cpu" if f_cpu < f_nic else "nic",
                    "relay_levels": None,
                    "relays": [],
                    "relays_total": None,
                    "note": "one node cannot serve two consumers at this delta rate",
                }
            )
            continue
        levels, reach = 0, fanout
        while reach < predictors:
            levels += 1
            reach *= fanout
        # the narrowest tree: the last level serves every predictor, each level above it
        # serves the one below, the sidecar serves level 1
        widths: list[int] = []
        need = predictors
        for _ in range(levels):
            need = -(-need // fanout)
            widths.insert(0, need)
        per_level = [
            {"level": lv, "relays_per_rank": w, "relays": w * ranks}
            for lv, w in enumerate(widths, start=1)
        ]
        p99 = None
        if hop is not None and 0 in fresh:
            p99 = fresh[0] + levels * hop
        rows.append(
            {
                "delta_mb_per_s_per_rank": d_mb,
                "fanout_per_node": fanout,
                "limited_by": "cpu" if f_cpu < f_nic else "nic",
                "relay_levels": levels,
                "relays": per_level,
                "bytes_per_s_per_link": d_mb * 1e6,
                "node_out_bytes_per_s": min(fanout, predictors) * d_mb * 1e6,
                "predictor_in_bytes_per_s": ranks * d_mb * 1e6,
                "relay_mirror_cores": d_gb * c_mirror if c_mirror is not None else None,
                # every predictor-rank stream costs its serving node per_consumer_cores
                "serving_cores_per_consumer": one,
                "serving_cores_total": predictors * ranks * one,
                "relays_total": sum(x["relays"] for x in per_level),
                "relay_idle_cores_total": (
                    idle_relay * sum(x["relays"] for x in per_level)
                    if idle_relay is not None
                    else None
                ),
                "freshness_p99_s_at_predictor_tier": p99,
            }
        )
    return {
        "predictors": predictors,
        "ranks": ranks,
        "core_budget_per_node": core_budget,
        "nic_gb_per_s": nic_gbps,
        "c_send_cpu_s_per_gb": c_send,
        "cost_model": "pulls_per_s x fixed + D x marginal" if use_split else "D x c_send",
        "pulls_per_s": pulls_per_s if use_split else None,
        "fixed_cpu_s_per_pull": fixed,
        "marginal_cpu_s_per_gb": marginal,
        "fleet_consumers": fleet_top,
        "fleet_serving_cpu_s_per_gb": max(fleet_send) if fleet_send else None,
        "c_mirror_cpu_s_per_gb": c_mirror,
        "relay_idle_cores": idle_relay,
        "idle_cores_by_level": idle,
        "freshness_p99_s_by_level": fresh,
        "per_hop_p99_s": hop,
        "rows": rows,
    }


# ---- windows at many cursors (pre-merged runs) -------------------------------------------

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
    :class:`deltad.serve.windows.pull.WindowCache`): pull p50 and sidecar CPU against one.

    Every run has an unmeasured warm-up round first (see :func:`_cursor_run`): a fresh
    process's first distinct windows pay first-touch page faults on every byte they keep
    (~140 k minor faults for 16 x 32 MB), which a long-lived sidecar pays once; both rounds'
    CPU and minor faults are recorded (``cold_*`` is the warm-up round).
    """
    from bench.datagen import write_spool

    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window = ctx.pick(128 * MB, 32 * MB, 1 * MB)
    n = ctx.pick(16, 16, 2)
    herd = ctx.pick([1, 2, 8], [1, 2, 4], [1, 2])
    rows = window // (8 + DIM * 4) // TABLES
    runs: list[dict[str, Any]] = []
    with ctx.tmpdir("cursors") as spool, Children() as kids:
        write_spool(
            spool, model=deltad_procs.MODEL, tables=TABLES, rows_per_table=rows, dim=DIM,
            deltas=DELTAS, delta_fraction=0.01,
        )  # fmt: skip
        workers = [ClientWorker(kids) for _ in range(max(n, *herd))]
        try:
            for w in workers:
                w.send("call", module="bench.throughput", func="client_warm", kwargs={})
            for w in workers:
                w.recv("client_warm", 300.0)
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
        finally:
            for w in workers:
                w.close()

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
        {
            "metric": f"sidecar CPU, {n} fresh consumers at {n} heads / {n} at one, runs",
            "value": ratio(cpu("fresh-diff", True), cpu("fresh-same", True)),
            "unit": "x", "target": "<= 2x",
        },
        {
            "metric": "the same without runs (windows merged from segments, same run)",
            "value": ratio(cpu("fresh-diff", False), cpu("fresh-same", True)),
            "unit": "x",
        },
        {
            "metric": f"sidecar CPU, {n} consumers at {n} cursors / {n} at one, runs",
            "value": ratio(cpu("stag-diff", True), cpu("stag-same", True)),
            "unit": "x", "target": "<= 2x",
        },
        {
            "metric": "the same without runs",
            "value": ratio(cpu("stag-diff", False), cpu("stag-same", True)),
            "unit": "x",
        },
        {
            "metric": f"fresh sidecar (warm-up round): {n} at {n} heads / {n} at one, runs",
            "value": ratio(cold("fresh-diff", True), cold("fresh-same", True)),
            "unit": "x",
        },
        {
            "metric": "fresh sidecar (warm-up round): the same without runs",
            "value": ratio(cold("fresh-diff", False), cold("fresh-same", True)),
            "unit": "x",
        },
        *[
            {
                "metric": f"bootstrap herd: pull p50, {h} at once / 1",
                "value": ratio(herd_p50[h], herd_p50[herd[0]]),
                "unit": "x",
            }
            for h in herd[1:]
        ],
        *[
            {
                "metric": f"bootstrap herd: sidecar CPU, {h} at once / 1",
                "value": ratio(cpu("herd", True, h), cpu("herd", True, herd[0])),
                "unit": "x",
            }
            for h in herd[1:]
        ],
    ]  # fmt: skip
    for line in headline:
        if "target" in line:
            v = line["value"]
            line["met"] = bool(isinstance(v, float) and v <= 2.0)
    headline.append(
        {
            "metric": "bootstrap: predictor peak RSS over its RSS before / its tables",
            "value": ratio(memory["peak_rss"] - memory["rss_before"], memory["tables_bytes"]),
            "unit": "x",
        }
    )
    return {"window_bytes_fp32": window, "consumers": n, "points": points, "runs": runs,
            "bootstrap_rss": memory, "headline": headline}  # fmt: skip


def _bootstrap_rss(ctx: Context, kids: Children, spool: Path) -> dict[str, Any]:
    """A fresh predictor process bootstraps (base window into a TensorDictApplier): its RSS
    before, its peak, its tables' bytes; and the sidecar's peak RSS against its log."""
    from bench.common import proc_peak_rss

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
    from bench.common import proc_peak_rss

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


def tree_only(ctx: Context) -> dict[str, Any]:
    """Only the relay tree (:func:`_tree`): its own spool and consumer workers, at the
    context's preset sizes. What ``python -m bench.fanout`` runs."""
    from bench.datagen import write_spool

    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window = ctx.pick(128 * MB, 16 * MB, 1 * MB)
    counts = ctx.pick([1, 4, 8, 16], [1, 2, 4], [1, 2])
    rows = window // (8 + DIM * 4) // TABLES
    with ctx.tmpdir("fanout-tree") as spool, Children() as kids:
        write_spool(
            spool, model=deltad_procs.MODEL, tables=TABLES, rows_per_table=rows, dim=DIM,
            deltas=DELTAS, delta_fraction=0.01,
        )  # fmt: skip
        workers = [ClientWorker(kids) for _ in range(max(counts))]
        try:
            for w in workers:
                w.send("call", module="bench.throughput", func="client_warm", kwargs={})
            for w in workers:
                w.recv("client_warm", 300.0)
            tree = _tree(ctx, kids, spool, workers, counts, rows)
        finally:
            for w in workers:
                w.close()
    return {"window_bytes": window, **tree}


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
