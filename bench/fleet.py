"""Fan-out at fleet size: 64 and 256 consumers, directly and through one and two relay levels.

Part of ``deltad bench --only fanout`` (key ``fleet``). What it does, exactly:

* **Processes.** One trainer-side sidecar (``deltad serve``, level 0), ``R`` relays of it
  (``deltad serve --upstream``, level 1) and ``R`` relays of those (level 2, relay ``i`` of
  level 2 mirrors relay ``i % R`` of level 1), each with its own spool and embedded Redis,
  default limits (64 streams, 64 callers in line). Consumers live in ``W`` spawned worker
  processes apart from them (a worker imports torch once: 256 processes importing torch do
  not fit on 2 cores / 24 GB); each worker hosts ``N / W`` consumers, one thread each, and
  every consumer is its own :class:`~deltad.consume.client.DeltaConsumer` with its own gRPC
  channel and its own consumer name (registered, leased and tracked by the serving node).
* **Configurations.** ``direct``: N consumers on the sidecar. ``1 level``: N consumers
  spread round-robin over the level-1 relays. ``2 levels``: over the level-2 relays.
* **A run.** Every serving node has the window cached first (one warm-up pull each), as
  in steady state. The N consumers connect, then at one moment all pull the whole window
  ``pulls`` times back to back, uncommitted (the same cached window each time).
* **Per configuration:** p50/p99 of every pull's time; aggregate GB/s (every byte delivered /
  first start to last end); CPU seconds of each tier (sidecar, level-1 relays, level-2
  relays, consumer workers: user + system from ``/proc/<pid>/stat`` via psutil) over the
  run, and per delivered GB; each tier's idle CPU over the same span (measured before, so
  the polls of the relays can be told from the sends); peak RSS per process of each tier
  (VmHWM, reset through ``/proc/<pid>/clear_refs`` before the run where allowed) and the
  consumer workers' RSS per hosted consumer; failed pulls (an error, rows missing or fewer
  bytes than the window: must be 0).
"""

from __future__ import annotations

import time
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
    consumer_config,
    percentile,
    proc_peak_rss,
    rows_per_table,
    settle,
    spool_and_workers,
    wait_until,
)
from bench.wire_baselines import ClientWorker

#: configuration name -> level whose nodes the consumers pull from
CONFIGS = {"direct": 0, "1 level": 1, "2 levels": 2}


def _reset_hwm(pid: int) -> bool:
    """Reset a process's VmHWM to its current RSS (``clear_refs`` 5); False if not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run(ctx: Context) -> dict[str, Any]:
    """Every configuration x consumer count once per repeat; see the module docstring."""
    counts = ctx.pick([64, 256], [64, 256], [4, 8])
    n_workers = ctx.pick(8, 8, 2)
    relays = ctx.pick(2, 2, 1)
    window = ctx.pick(2 * MB, 1 * MB, 64 * 1024)
    pulls = ctx.pick(3, 2, 1)
    repeats = 1 if ctx.tiny else max(1, min(ctx.repeats, 2))
    rows = max(1, rows_per_table(window))
    out: dict[str, Any] = {
        "what": (
            f"1 sidecar, {relays} relay(s) per level, 2 levels (deltad serve processes); "
            f"consumers in {n_workers} worker processes, one thread + DeltaConsumer + gRPC "
            f"channel + name each; whole window (cached) pulled {pulls}x back to back"
        ),
        "counts": counts,
        "workers": n_workers,
        "relays_per_level": relays,
        "pulls_per_consumer": pulls,
        "repeats": repeats,
        "runs": [],
    }
    with (
        ctx.tmpdir("fleet-relays") as rdir,
        spool_and_workers(ctx, "fleet", n_workers, rows=rows, deltas=2) as (spool, kids, workers),
    ):
        nodes: dict[int, list[Any]] = {0: [], 1: [], 2: []}
        side_ports: list[int] = []  # each node's /metrics port, in start order
        try:
            ctx.status("fleet: sidecar and relays")
            side = deltad_procs.start_sidecar(
                kids, spool, ctx, extra=[*deltad_procs.NO_RETENTION, *_metrics_flags(side_ports)]
            )
            nodes[0].append(side)
            head = deltad_procs.head_seq(side.endpoint)
            for lv in (1, 2):
                for i in range(relays):
                    up = nodes[lv - 1][i % len(nodes[lv - 1])]
                    relay = deltad_procs.start_sidecar(
                        kids, rdir / f"l{lv}-{i}", ctx, require_head=False,
                        extra=[*deltad_procs.NO_RETENTION, "--upstream", up.endpoint,
                               "--upstream-consumer", f"fleet-relay-{lv}-{i}",
                               *_metrics_flags(side_ports)],
                    )  # fmt: skip
                    nodes[lv].append(relay)
            for p, port in zip((p for lv in (0, 1, 2) for p in nodes[lv]), side_ports, strict=True):
                p.metrics_port = port
            every = [p for lv in (0, 1, 2) for p in nodes[lv]]
            if not wait_until(
                lambda: all(deltad_procs.head_seq(p.endpoint) == head for p in every), 300.0, 0.1
            ):
                raise RuntimeError("a relay never mirrored the sidecar's log")
            out["log_bytes"] = int(deltad_procs.status(side.endpoint).log_bytes)
            for p in every:
                settle(CpuMonitor(p.proc.pid))
            idle_s = ctx.pick(2.0, 2.0, 0.5)
            mons = {p.proc.pid: CpuMonitor(p.proc.pid) for p in every}
            time.sleep(idle_s)
            idle = {lv: [mons[p.proc.pid].seconds() / idle_s for p in nodes[lv]] for lv in nodes}
            out["idle_cores_per_node"] = {str(lv): v for lv, v in idle.items()}
            # every serving node keeps the window cached, as in steady state
            for p in every:
                workers[0].call(
                    "call", module="bench.throughput", func="client_pull",
                    kwargs={"endpoint": p.endpoint, "model": p.model,
                            "consumer": f"fleet-warm-{p.proc.pid}", "dtype": "fp32"},
                )  # fmt: skip
            for r in range(repeats):
                for name, lv in CONFIGS.items():
                    for n in counts:
                        ctx.status(f"fleet {name} x{n} round {r + 1}")
                        out["runs"].append(_run(nodes, workers, name, lv, n, r, pulls, idle))
            for lv in (2, 1):  # the split below needs the cores, not their idle polls
                for p in nodes[lv]:
                    p.stop()
            out["split_runs"] = _split(ctx, kids, workers, counts[0], pulls, repeats, rows)
        finally:
            for lv in (2, 1, 0):
                for p in nodes[lv]:
                    p.stop()
    out["window_bytes"] = max((x["window_bytes"] for x in out["runs"]), default=0)
    out["points"] = _summary(out["runs"])
    n0 = counts[0]
    small = [r for r in out["runs"] if r["level"] == 0 and r["consumers"] == n0]
    out["per_pull_cost"] = _per_pull(small, out["split_runs"])
    out["headline"] = _headline(out["points"])
    return out


#: the second window of the per-pull cost split is this many times the fleet's window
SPLIT_FACTOR = 4


def _split(
    ctx: Context, kids: Children, workers: list[ClientWorker], n: int, pulls: int,
    repeats: int, rows: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """N consumers pull a window ``SPLIT_FACTOR`` x larger from a second sidecar (direct), so
    that the serving CPU per pull splits into a fixed part and a part per byte."""
    from bench.datagen import write_spool

    out = []
    with ctx.tmpdir("fleet-big") as spool:
        write_spool(
            spool, model=deltad_procs.MODEL, tables=TABLES, rows_per_table=rows * SPLIT_FACTOR,
            dim=DIM, deltas=2, delta_fraction=0.01,
        )  # fmt: skip
        side = deltad_procs.start_sidecar(kids, spool, ctx, extra=deltad_procs.NO_RETENTION)
        try:
            mon = CpuMonitor(side.proc.pid)
            settle(mon)
            mon.reset()
            time.sleep(1.0)
            idle = mon.seconds()
            workers[0].call(
                "call", module="bench.throughput", func="client_pull",
                kwargs={"endpoint": side.endpoint, "model": side.model,
                        "consumer": "fleet-split-warm", "dtype": "fp32"},
            )  # fmt: skip
            nodes: dict[int, list[Any]] = {0: [side], 1: [], 2: []}
            for r in range(repeats):
                ctx.status(f"fleet split x{n} round {r + 1}")
                out.append(
                    _run(nodes, workers, f"direct {SPLIT_FACTOR}x", 0, n, r, pulls,
                         {0: [idle], 1: [], 2: []})
                )  # fmt: skip
        finally:
            side.stop()
    return out


def _per_pull(small: list[dict[str, Any]], big: list[dict[str, Any]]) -> dict[str, Any]:
    """Sidecar CPU per pull over its idle cost at two window sizes (same N, same run):
    ``cost = fixed + bytes x per_byte``."""

    def per_pull(rs: list[dict[str, Any]]) -> tuple[float, float] | None:
        pulls = sum(len(r["pull_s"]) for r in rs)
        if not rs or not pulls:
            return None
        cpu = sum(max(0.0, r["cpu_s"]["sidecar"] - r["idle_cpu_s"]["sidecar"]) for r in rs)
        return cpu / pulls, sum(r["delivered_bytes"] for r in rs) / pulls

    a, b = per_pull(small), per_pull(big)
    if a is None or b is None or b[1] <= a[1]:
        return {}
    per_byte = max(0.0, (b[0] - a[0]) / (b[1] - a[1]))
    return {
        "consumers": small[0]["consumers"] if small else None,
        "window_bytes": [a[1], b[1]],
        "sidecar_cpu_s_per_pull": [a[0], b[0]],
        "fixed_cpu_s_per_pull": max(0.0, a[0] - a[1] * per_byte),
        "cpu_s_per_gb_marginal": per_byte * GB,
    }


def _run(
    nodes: dict[int, list[Any]],
    workers: list[ClientWorker],
    name: str,
    lv: int,
    n: int,
    round_: int,
    pulls: int,
    idle: dict[int, list[float]],
) -> dict[str, Any]:
    serving = nodes[lv]
    per = -(-n // len(workers))
    pids = {t: [p.proc.pid for p in nodes[t]] for t in nodes}
    for ps in pids.values():
        for pid in ps:
            _reset_hwm(pid)
    start_at = time.time() + 2.0 + 0.03 * n
    sent: list[ClientWorker] = []
    for k, w in enumerate(workers):
        ids = list(range(k * per, min(n, (k + 1) * per)))
        if not ids:
            break
        w.send(
            "call", module="bench.fleet", func="client_fleet",
            kwargs={"consumers": [(f"fleet-{name[0]}-{n}-{round_}-{i}",
                                   serving[i % len(serving)].endpoint) for i in ids],
                    "model": serving[0].model, "start_at": start_at, "pulls": pulls},
        )  # fmt: skip
        sent.append(w)
    rpc0 = _getdelta_codes(serving)
    time.sleep(max(0.0, start_at - time.time()))
    mons = {t: [CpuMonitor(pid) for pid in ps] for t, ps in pids.items()}
    wmons = [CpuMonitor(w.proc.pid) for w in sent]
    t0 = time.monotonic()
    got = [w.recv("client_fleet", 900.0) for w in sent]
    span = time.monotonic() - t0
    cpu = {t: sum(m.seconds() for m in ms) for t, ms in mons.items()}
    worker_cpu = sum(m.seconds() for m in wmons)
    rpc1 = _getdelta_codes(serving)
    codes: dict[str, int] = {}
    if rpc0 is not None and rpc1 is not None:
        codes = {c: rpc1.get(c, 0) - rpc0.get(c, 0) for c in rpc1}
    rss = {t: max((proc_peak_rss(pid) or 0 for pid in ps), default=0) for t, ps in pids.items()}
    results = [x for g in got for x in g["pulls"]]
    full = max((x["bytes"] for x in results), default=0)
    bad = [x for x in results if x["error"] or x["missing"] or x["bytes"] < full]
    ok = [x for x in results if x["seconds"] is not None]
    delivered = sum(x["bytes"] for x in results)
    first = min((x["start_unix"] for x in ok), default=0.0)
    last = max((x["end_unix"] for x in ok), default=0.0)
    tiers = {0: "sidecar", 1: "relay1", 2: "relay2"}
    return {
        "config": name,
        "level": lv,
        "consumers": n,
        "round": round_,
        "window_bytes": full,
        "pull_s": [x["seconds"] for x in ok],
        "pulls": len(results),
        "failed": len(bad),
        "errors": sorted({x["error"] or "missing/short" for x in bad})[:5],
        "delivered_bytes": delivered,
        "aggregate_gbps": delivered / (last - first) / GB if last > first else None,
        "span_s": span,
        "cpu_s": {tiers[t]: cpu[t] for t in tiers},
        "idle_cpu_s": {tiers[t]: sum(idle[t]) * span for t in tiers},
        "consumer_workers_cpu_s": worker_cpu,
        "peak_rss_bytes": {tiers[t]: rss[t] for t in tiers},
        "consumer_worker_rss": [g["rss"] for g in got],
        "consumers_per_worker": per,
        # GetDelta calls the serving nodes answered, by gRPC code (their /metrics): refusals
        # (RESOURCE_EXHAUSTED, with a retry hint the consumers honour) are not failures
        "getdelta_codes": {c: v for c, v in codes.items() if v},
        # > 0: some consumer was still connecting at start_at (its pulls started late)
        "latest_start_after_start_at_s": max(
            (x["start_unix"] for x in ok if x.get("first")), default=start_at
        )
        - start_at,
    }


def _metrics_flags(ports: list[int]) -> list[str]:
    """``deltad serve`` flags for /metrics on a free local port (appended to ``ports``)."""
    from bench.common import free_port

    ports.append(free_port())
    return ["--metrics-port", str(ports[-1]), "--metrics-listen", "127.0.0.1"]


def _getdelta_codes(serving: list[Any]) -> dict[str, int] | None:
    """GetDelta calls answered so far by these nodes, by gRPC code (summed), from their
    Prometheus /metrics; None if a node has no metrics port or does not answer."""
    import re
    import urllib.request

    out: dict[str, int] = {}
    pat = re.compile(r"^deltad_rpc_requests_total\{([^}]*)\}\s+([0-9.e+]+)$")
    for node in serving:
        port = getattr(node, "metrics_port", None)
        if port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            m = pat.match(line)
            if m and 'method="GetDelta"' in m.group(1):
                code = re.search(r'code="([^"]*)"', m.group(1))
                key = code.group(1) if code else "?"
                out[key] = out.get(key, 0) + int(float(m.group(2)))
    return out


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points = []
    keys = sorted({(r["level"], r["consumers"]) for r in runs})
    for lv, n in keys:
        rs = [r for r in runs if r["level"] == lv and r["consumers"] == n]
        pulls = [s for r in rs for s in r["pull_s"]]
        gb = sum(r["delivered_bytes"] for r in rs) / GB
        cpu = {t: sum(r["cpu_s"][t] for r in rs) for t in rs[0]["cpu_s"]}
        idle = {t: sum(r["idle_cpu_s"][t] for r in rs) for t in rs[0]["idle_cpu_s"]}
        wcpu = sum(r["consumer_workers_cpu_s"] for r in rs)
        wrss = [x for r in rs for x in r["consumer_worker_rss"]]
        per_consumer = [
            (x["peak"] - x["before"]) / x["consumers"] for x in wrss if x["consumers"] > 0
        ]
        serving = ("sidecar", "relay1", "relay2")[lv]
        points.append(
            {
                "config": rs[0]["config"],
                "level": lv,
                "consumers": n,
                "pulls": sum(r["pulls"] for r in rs),
                "failed": sum(r["failed"] for r in rs),
                "p50_s": percentile(pulls, 50),
                "p99_s": percentile(pulls, 99),
                "aggregate_gbps": percentile(
                    [r["aggregate_gbps"] for r in rs if r["aggregate_gbps"]], 50
                ),
                "delivered_gb": gb,
                "cpu_s_per_gb": {t: v / gb if gb else None for t, v in cpu.items()},
                "cpu_s_per_gb_over_idle": {
                    t: max(0.0, cpu[t] - idle[t]) / gb if gb else None for t in cpu
                },
                "serving_cpu_s_per_gb": cpu[serving] / gb if gb else None,
                "serving_cpu_s_per_consumer_pull": cpu[serving] / max(1, len(pulls)),
                "consumer_cpu_s_per_gb": wcpu / gb if gb else None,
                "peak_rss_bytes": {
                    t: max(r["peak_rss_bytes"][t] for r in rs) for t in rs[0]["peak_rss_bytes"]
                },
                "consumer_worker_peak_rss_bytes": max((x["peak"] for x in wrss), default=0),
                "consumer_rss_bytes_each": percentile(per_consumer, 50),
                "getdelta_codes": _sum_codes(rs),
            }
        )
    return points


def _sum_codes(rs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rs:
        for c, v in r.get("getdelta_codes", {}).items():
            out[c] = out.get(c, 0) + v
    return out


def _headline(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in points:
        tag = f"fleet {p['config']}, {p['consumers']} consumers"
        out += [
            {
                "metric": f"{tag}: failed pulls",
                "value": p["failed"],
                "unit": "pulls",
                "target": "0",
                "met": p["failed"] == 0,
            },
            {"metric": f"{tag}: pull p50 / p99", "value": p["p99_s"], "unit": "s (p99)"},
            {"metric": f"{tag}: aggregate", "value": p["aggregate_gbps"], "unit": "GB/s"},
            {
                "metric": f"{tag}: sidecar CPU per delivered GB",
                "value": p["cpu_s_per_gb"]["sidecar"],
                "unit": "s/GB",
            },
            {
                "metric": f"{tag}: serving tier CPU per delivered GB",
                "value": p["serving_cpu_s_per_gb"],
                "unit": "s/GB",
            },
        ]
    return out


def client_fleet(
    state: dict[Any, Any],
    consumers: list[tuple[str, str]],
    model: str,
    start_at: float,
    pulls: int,
) -> dict[str, Any]:
    """Runs in a client worker: one thread per ``(name, endpoint)``, each its own
    DeltaConsumer and channel; they connect, then at ``start_at`` pull the whole window
    ``pulls`` times back to back (uncommitted). Per pull: seconds, bytes, rows missing, error;
    and the worker's RSS before its first consumer (VmRSS) and its peak (VmHWM, reset first)
    while they ran."""
    import threading

    from deltad.consume.client import DeltaConsumer
    from deltad.perf import tune_malloc, tune_threads

    tune_malloc()
    tune_threads()
    # the worker's RSS before it ever hosted a consumer (its first call): the baseline
    before = state.setdefault("fleet_rss0", _self_rss())
    _reset_hwm_self()
    out: list[list[dict[str, Any]]] = [[] for _ in consumers]
    ready = threading.Barrier(len(consumers) + 1, timeout=300.0)

    def one(i: int, name: str, endpoint: str) -> None:
        res: list[dict[str, Any]] = []
        c: Any = None
        try:
            cfg = consumer_config(name, model, endpoint)
            c = DeltaConsumer(cfg).connect()
        except Exception as e:
            res.append(_failed(f"connect: {type(e).__name__}: {e}"))
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            pass
        if c is not None:
            try:
                time.sleep(max(0.0, start_at - time.time()))
                for k in range(pulls):
                    t0 = time.perf_counter()
                    s0 = time.time()
                    try:
                        r = c.pull()
                    except Exception as e:  # a pull that gives up: counted as failed
                        res.append(_failed(f"{type(e).__name__}: {e}"))
                        continue
                    res.append(
                        {
                            "seconds": time.perf_counter() - t0,
                            "bytes": r.bytes,
                            "missing": len(r.missing),
                            "error": None,
                            "start_unix": s0,
                            "end_unix": time.time(),
                            "first": k == 0,
                        }
                    )
                    del r
            finally:
                c.close()
        out[i] = res

    threads = [
        threading.Thread(target=one, args=(i, nm, ep), daemon=True, name=f"fleet-{i}")
        for i, (nm, ep) in enumerate(consumers)
    ]
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    deadline = time.monotonic() + 900.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    pulls_out = [x for i, res in enumerate(out) for x in (res or [_failed("hung")])]
    if any(t.is_alive() for t in threads):
        pulls_out.append(_failed("hung"))
    peak = proc_peak_rss(_pid()) or 0
    return {
        "pulls": pulls_out,
        "rss": {"before": before, "peak": peak, "consumers": len(consumers)},
    }


def _failed(error: str) -> dict[str, Any]:
    return {"seconds": None, "bytes": 0, "missing": 0, "error": error[:300]}


def _pid() -> int:
    import os

    return os.getpid()


def _self_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm_self() -> None:
    _reset_hwm(_pid())


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.fleet``: only this part of the fan-out benchmark; ``--record``
    writes ``bench/results/fanout-fleet.json`` (what bench/README.md and bench.plots use)."""
    from bench.run import run_part

    def report(res: dict[str, Any]) -> None:
        for p in res["points"]:
            print(
                f"{p['config']:>8} x{p['consumers']:<4} failed {p['failed']} "
                f"p50 {p['p50_s']:.3f} p99 {p['p99_s']:.3f} s, {p['aggregate_gbps']:.2f} GB/s, "
                f"serving {p['serving_cpu_s_per_gb']:.2f} s/GB"
            )
        print("per pull:", res["per_pull_cost"])

    return run_part("python -m bench.fleet", main.__doc__, "fanout-fleet", run, report, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
