"""Benchmark: the sidecar's memory against the data it serves, bootstraps larger than the
window cache, and the CPU of consumers at one cursor against the bare gRPC floor
(issue #16 items 4 and 2b; results in bench/README.md, "Sidecar memory and encode-once").

Own spool: a base (every row of 4 tables, dim 64) and 16 deltas of 1 % skewed rows; spawned
consumer processes; a fresh ``deltad serve`` (no retention) per measurement.

* **memory**: N fresh consumers pull N distinct base windows at once (consumer i to seq
  ``i % 16 + 1``), with a window cache big enough for all of them (``kept``: every live window
  is held whole, the old behaviour) and with a budget of half a window (``bounded``: windows
  that do not fit are streamed, not kept; bootstraps start from the spilled base). What
  counts: ``log`` = the indexed entries' private copies (sum of the segment files' sizes; the
  sidecar copies each verified segment into private memory), ``cache`` = the window cache
  budget + the run cache budget (a quarter of a window here), ``baseline`` = the same binary's RSS serving a tiny spool
  after one pull (python + torch + grpc, measured in the same run). Ratio: (peak RSS -
  baseline) / (log + cache). The spill is a mapped file (page cache): its resident pages
  count in RSS as ``RssFile`` but not in ``RssAnon``; both peaks are sampled (every 10 ms).
* **bootstrap**: a second spool (a quarter of the window; 13 heavy deltas of 30 % skewed
  rows, so that the base and its runs would be merged whole: where the spill is used) and a
  window cache of half its window; 5 fresh consumers bootstrap one after another: sidecar
  CPU per bootstrap with the spill and without it (``--spill-max-bytes 0``: each one merges
  the base and the runs again). With light deltas the spill is not used (a bootstrap then
  streams the base and runs range by range: one copy, no merge).
* **encode-once**: N = 1 and 8 fresh consumers pull one base window at once from a fresh
  sidecar (after a warm-up round at another head: a long-lived sidecar's warm heap), vs a
  bare gRPC server streaming the same bytes in 2 MB messages built once and shared
  (:func:`bench.fanout.floor_round`): sidecar CPU per extra consumer / the floor's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    DELTAS,
    DIM,
    MB,
    TABLES,
    Children,
    Context,
    CpuMonitor,
    NotAvailable,
    med,
    proc_peak_rss,
    proc_status,
    ratio,
    rows_per_table,
    summarize,
    warm_workers,
)
from bench.wire_baselines import ClientWorker, grpc_server_main, start_server

HEAVY_DELTAS = 13


class _Peaks:
    """Peak RssAnon / RssFile / VmRSS of a process, sampled every 10 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            for k, v in proc_status(self.pid).items():
                self.peak[k] = max(self.peak.get(k, 0), v)

    def __enter__(self) -> _Peaks:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)
        for k, v in proc_status(self.pid).items():
            self.peak[k] = max(self.peak.get(k, 0), v)


def _pull(
    workers: list[ClientWorker], side: Any, tag: str, seqs: list[int], dtype: str = "fp32"
) -> tuple[list[dict[str, Any]], float]:
    """Every worker pulls at once (fresh consumers ``tag-i`` to ``seqs[i]``); (results, sidecar
    CPU seconds)."""
    cpu = CpuMonitor(side.proc.pid)
    start_at = time.time() + 0.5 + 0.05 * len(workers)
    for i, w in enumerate(workers):
        w.send(
            "call", module="bench.throughput", func="client_pull",
            kwargs={"endpoint": side.endpoint, "model": side.model, "consumer": f"{tag}-{i}",
                    "dtype": dtype, "max_step": seqs[i] * 10, "start_at": start_at},
        )  # fmt: skip
    time.sleep(max(0.0, start_at - time.time()))
    cpu.reset()
    res = [w.recv("client_pull", 600.0) for w in workers]
    return res, cpu.seconds()


def _sidecar(
    kids: Children, spool: Path, ctx: Context, cache: int, runs: int, spill: bool = True
) -> Any:
    from bench import deltad_procs
    from bench.common import settle as _settle

    extra = [*deltad_procs.NO_RETENTION, "--window-cache-bytes", str(cache)]
    extra += ["--run-cache-bytes", str(runs)]
    if not spill:
        extra += ["--spill-max-bytes", "0"]
    side = deltad_procs.start_sidecar(kids, spool, ctx, extra=extra)
    _settle(CpuMonitor(side.proc.pid))
    return side


def run(ctx: Context) -> dict[str, Any]:
    """Memory, bootstrap and encode-once sections (see the module docstring)."""
    from bench import deltad_procs
    from bench.datagen import write_spool
    from bench.fanout import floor_round

    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    window = ctx.pick(512 * MB, 32 * MB, 1 * MB)
    n = ctx.pick(6, 16, 2)
    fan = ctx.pick([1, 8], [1, 8], [1, 2])
    rows = rows_per_table(window)
    run_cache = window // 4  # runs of 16 deltas of 1 %: a few % of the window
    result: dict[str, Any] = {"window_bytes_fp32": window, "consumers": n}
    with ctx.tmpdir("sidecar-mem") as work, Children() as kids:
        spool, tiny = work / "spool", work / "tiny"
        kw = {"model": deltad_procs.MODEL, "tables": TABLES, "dim": DIM, "deltas": DELTAS}
        write_spool(spool, rows_per_table=rows, delta_fraction=0.01, **kw)  # type: ignore[arg-type]
        write_spool(tiny, rows_per_table=64, delta_fraction=0.1, **kw)  # type: ignore[arg-type]
        # bootstraps: heavy deltas (13 of 30 % skewed rows: base + runs 8, 4, 1 overlap
        # beyond what streams range by range, so a bootstrap without the spill merges whole
        # shards), a quarter of the window
        heavy, h_window = work / "heavy", window // 4
        kw_h = {**kw, "deltas": HEAVY_DELTAS}
        h_rows = rows_per_table(h_window)
        write_spool(heavy, rows_per_table=h_rows, delta_fraction=0.3, **kw_h)  # type: ignore[arg-type]
        result["heavy_log_bytes"] = sum(p.stat().st_size for p in heavy.rglob("seg-*"))
        log_bytes = sum(p.stat().st_size for p in spool.rglob("seg-*"))
        result["log_bytes"] = log_bytes
        workers = warm_workers(kids, max(n, *fan))
        try:
            # the fixed process baseline: the same binary serving a tiny log
            side = _sidecar(kids, tiny, ctx, 1 << 30, run_cache)
            try:
                _pull(workers[:1], side, "base", [DELTAS])
                result["baseline"] = proc_status(side.proc.pid)
                # a pull's fixed cost (register, Redis, commit; ~no bytes): 8 fresh consumers
                k = fan[-1]
                _, fixed = _pull(workers[:k], side, "fixed", [DELTAS] * k)
                result["fixed_cpu_s_per_pull"] = fixed / k
            finally:
                side.stop()
            base_rss = result["baseline"].get("VmRSS", 0)
            base_anon = result["baseline"].get("RssAnon", 0)
            base_shmem = result["baseline"].get("RssShmem", 0)
            # memory: N distinct base windows at once
            mem = []
            for name, cache in (("kept", n * window * 2), ("bounded", window // 2)):
                ctx.status(f"sidecar_mem: {n} distinct windows, {name}")
                side = _sidecar(kids, spool, ctx, cache, run_cache)
                try:
                    with _Peaks(side.proc.pid) as pk:
                        res, cpu_s = _pull(
                            workers[:n], side, f"m-{name}", [i % DELTAS + 1 for i in range(n)]
                        )
                    budget = log_bytes + cache + run_cache
                    hwm = proc_peak_rss(side.proc.pid) or 0
                    mem.append(
                        {
                            "config": name, "window_cache_bytes": cache,
                            "run_cache_bytes": run_cache, "peak_rss": hwm,
                            "peak_rss_anon": pk.peak.get("RssAnon", 0),
                            "peak_rss_file": pk.peak.get("RssFile", 0),
                            "peak_rss_shmem": pk.peak.get("RssShmem", 0),
                            "sidecar_cpu_s": cpu_s,
                            "pull_s": [x["seconds"] for x in res],
                            "bytes": [x["bytes"] for x in res],
                            "ratio": (hwm - base_rss) / budget,
                            "ratio_anon": (pk.peak.get("RssAnon", 0) - base_anon) / budget,
                            "ratio_private": (
                                pk.peak.get("RssAnon", 0) + pk.peak.get("RssShmem", 0)
                                - base_anon - base_shmem
                            ) / budget,
                            "log_plus_cache_bytes": budget,
                        }
                    )  # fmt: skip
                finally:
                    side.stop()
            result["memory"] = mem
            # bootstrap: a window over the cache, bootstrapped one after another
            boot = []
            for spill in (True, False):
                ctx.status(f"sidecar_mem: sequential bootstraps, spill={spill}")
                side = _sidecar(kids, heavy, ctx, h_window // 2, 4 * h_window, spill=spill)
                try:
                    cpus = [
                        _pull(workers[:1], side, f"b-{spill}-{i}", [HEAVY_DELTAS])[1]
                        for i in range(3)
                    ]
                    with _Peaks(side.proc.pid) as pk:
                        cpus += [
                            _pull(workers[:1], side, f"b2-{spill}-{i}", [HEAVY_DELTAS])[1]
                            for i in range(2)
                        ]
                    boot.append(
                        {
                            "spill": spill, "cpu_s": cpus, "peak_rss": proc_peak_rss(side.proc.pid),
                            "peak_rss_anon": pk.peak.get("RssAnon", 0),
                        }
                    )  # fmt: skip
                finally:
                    side.stop()
            result["bootstrap"] = boot
            # encode-once: N at one cursor vs the bare gRPC floor
            fanout: list[dict[str, Any]] = []
            floor: list[dict[str, Any]] = []
            bare_conn, bare_port, bare_pid = start_server(kids, grpc_server_main, 2 * window)
            try:
                for r in range(ctx.repeats):
                    for k in fan:
                        ctx.status(f"sidecar_mem: {k} at one cursor, round {r + 1}")
                        side = _sidecar(kids, spool, ctx, 2 * window, run_cache)
                        try:
                            _pull(workers[:k], side, f"w-{k}-{r}", [DELTAS - 1] * k)
                            res, cpu_s = _pull(workers[:k], side, f"f-{k}-{r}", [DELTAS] * k)
                            # the same window again, cached: the send path alone
                            _, cached_s = _pull(workers[:k], side, f"g-{k}-{r}", [DELTAS] * k)
                            idle = CpuMonitor(side.proc.pid)  # its background threads alone
                            time.sleep(2.0)
                            idle_rate = idle.seconds() / 2.0
                        finally:
                            side.stop()
                        fanout.append(
                            {"consumers": k, "round": r, "cpu_s": cpu_s, "bytes": res[0]["bytes"],
                             "cached_cpu_s": cached_s, "pull_s": [x["seconds"] for x in res],
                             "idle_cpu_per_s": idle_rate}
                        )  # fmt: skip
                        floor.append(
                            floor_round(bare_pid, bare_port, workers[:k], res[0]["bytes"], r)
                        )
            finally:
                bare_conn.close()
            result["encode_once"] = {"sidecar": fanout, "floor": floor}
        finally:
            for w in workers:
                w.close()
    result["headline"] = _headline(result, fan)
    return result


def _headline(result: dict[str, Any], fan: list[int]) -> list[dict[str, Any]]:
    mem = {m["config"]: m for m in result["memory"]}
    boot = {b["spill"]: b for b in result["bootstrap"]}
    eo = result["encode_once"]

    def cpu(rows: list[dict[str, Any]], key: str, k: int) -> float | None:
        xs = [x[key] for x in rows if x["consumers"] == k]
        return med(summarize(xs)) if xs else None

    lo, hi = fan[0], fan[-1]
    s_per = f_per = None
    s1, sk = cpu(eo["sidecar"], "cpu_s", lo), cpu(eo["sidecar"], "cpu_s", hi)
    f1, fk = cpu(eo["floor"], "server_cpu_s", lo), cpu(eo["floor"], "server_cpu_s", hi)
    c1, ck = cpu(eo["sidecar"], "cached_cpu_s", lo), cpu(eo["sidecar"], "cached_cpu_s", hi)
    c_per = None
    if None not in (s1, sk, f1, fk, c1, ck):
        s_per, f_per = (sk - s1) / (hi - lo), (fk - f1) / (hi - lo)  # type: ignore[operator]
        c_per = (ck - c1) / (hi - lo)  # type: ignore[operator]
    n = result["consumers"]
    later_on = med(summarize(boot[True]["cpu_s"][1:3]))
    later_off = med(summarize(boot[False]["cpu_s"][1:3]))
    return [
        {
            "metric": f"sidecar peak RSS over baseline / (log + cache budgets), {n} distinct "
            "windows, bounded cache",
            "value": mem["bounded"]["ratio"], "unit": "x", "target": "<= 1.2x",
            "met": bool(mem["bounded"]["ratio"] <= 1.2),
        },
        {
            "metric": "the same, private memory only (anonymous + the log's sealed copies; "
            "not the spill's page cache)",
            "value": mem["bounded"]["ratio_private"], "unit": "x", "target": "<= 1.2x",
            "met": bool(mem["bounded"]["ratio_private"] <= 1.2),
        },
        {
            "metric": f"every live window kept whole (the old behaviour; cache fits all {n}): "
            "peak RSS over baseline / the bounded run's (log + cache budgets)",
            "value": (mem["kept"]["peak_rss"] - result["baseline"].get("VmRSS", 0))
            / mem["bounded"]["log_plus_cache_bytes"],
            "unit": "x",
        },

        {
            "metric": "sidecar CPU, 2nd-3rd bootstrap over the cache, spill / no spill",
            "value": ratio(later_on, later_off), "unit": "x",
        },
        {
            "metric": "sidecar CPU, 1st bootstrap (writes the spill), spill / no spill",
            "value": ratio(boot[True]["cpu_s"][0], boot[False]["cpu_s"][0]), "unit": "x",
        },
        {
            "metric": f"sidecar CPU per extra consumer at one cursor ({lo}->{hi}) / bare gRPC "
            "floor",
            "value": ratio(s_per, f_per), "unit": "x", "target": "<= 1.1x",
            "met": bool(s_per is not None and f_per and s_per / f_per <= 1.1),
        },
        {
            "metric": "the same, window already cached (the send path alone) / floor",
            "value": ratio(c_per, f_per), "unit": "x",
        },
        {
            "metric": "a pull's fixed sidecar CPU (register, Redis, commit; tiny window)",
            "value": result.get("fixed_cpu_s_per_pull"), "unit": "s",
        },
        {"metric": "sidecar CPU per extra consumer", "value": s_per, "unit": "s"},
        {"metric": "bare gRPC floor CPU per extra stream", "value": f_per, "unit": "s"},
    ]  # fmt: skip
