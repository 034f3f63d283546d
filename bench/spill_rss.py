"""Benchmark: a sidecar's peak and idle RSS when bootstraps read a spilled base, retention off
(issue 41 item 3), against the sizing bound (README "Sizing", docs/sizing.md).

One spool: a base of every row of 4 tables (dim 64) and 4 heavy deltas (30 % skewed rows:
their base window would be merged whole, so bootstraps start from the spill); ``deltad serve``
with retention off, a window cache of a quarter of the base (bootstraps do not fit it: they
stream from the spill), explicit run and packed budgets, no previous generation kept. Fresh
consumers bootstrap in fp32 then packed-int8 (twice each); VmRSS, RssAnon and RssFile are
sampled every 10 ms for their peaks; then the sidecar idles (the free heap handed back) and
its RSS and gauges are read. Bound = 1.2 x log + window cache + run cache + packed budget +
384 MiB (``deltad.serve.memory.RUNTIME_BYTES``). Also: the spill's resident pages after each
pull (``deltad_spill_resident_bytes``) and the gauges' sum / VmRSS.

``python -m bench.spill_rss [--rows N] [--record]``: one JSON line (``--record``: also
bench/results/spill-rss.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RSS_PARTS, Children, Context, metric_sums, proc_status, record_standalone

TABLES, DIM = 4, 64


class _Peaks:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, {}  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            for k, v in proc_status(self.pid).items():
                self.peak[k] = max(self.peak.get(k, 0), v)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._t.join(5)
        return dict(self.peak)


def measure(ctx: Context, *, rows: int) -> dict[str, Any]:
    from bench import deltad_procs
    from bench.datagen import write_spool
    from bench.throughput import client_pull
    from deltad import wire
    from deltad.serve.memory import RUNTIME_BYTES
    from deltad.types import WireDtype

    per_table = rows // TABLES
    base_bytes = TABLES * per_table * (8 + DIM * 4)
    window_cache = base_bytes // 4
    run_cache = 64 << 20
    packed = TABLES * per_table * wire.packed_row_bytes(DIM, WireDtype.PACKED_INT8, 16) * 3 // 2
    out: dict[str, Any] = {"rows": TABLES * per_table, "dim": DIM, "pulls": []}
    with ctx.tmpdir("spillrss") as spool, Children() as kids:
        write_spool(
            spool, model=deltad_procs.MODEL, tables=TABLES, rows_per_table=per_table, dim=DIM,
            deltas=4, delta_fraction=0.3,
        )  # fmt: skip
        extra = [*deltad_procs.NO_RETENTION, "--window-cache-bytes", str(window_cache)]
        extra += ["--run-cache-bytes", str(run_cache), "--packed-cache-bytes", str(packed)]
        extra += ["--generation-keep", "0"]
        os.environ["DELTAD_KNOB_IDLE_HEAP_TRIM_S"] = "4"  # (the child's environment)
        side = deltad_procs.start_sidecar(kids, spool, ctx, extra=extra, metrics=True)
        assert side.metrics_port is not None
        pid = side.proc.pid
        time.sleep(2.0)
        g = metric_sums(side.metrics_port)
        log_bytes = g["deltad_log_bytes"]
        bound = 1.2 * log_bytes + window_cache + run_cache + packed + RUNTIME_BYTES
        out.update(log_bytes=log_bytes, bound_bytes=bound, start_rss=proc_status(pid)["VmRSS"])
        peaks = _Peaks(pid)
        for i, dtype in enumerate(("fp32", "fp32", "packed-int8", "packed-int8")):
            ctx.status(f"spill rss: bootstrap {i} {dtype}")
            got = client_pull({}, side.endpoint, side.model, f"b{i}", dtype)
            g = metric_sums(side.metrics_port)
            rss = proc_status(pid)["VmRSS"]
            out["pulls"].append(
                {
                    "dtype": dtype,
                    "seconds": got["seconds"],
                    "rss": rss,
                    "spill_bytes": g["deltad_spill_bytes"],
                    "spill_resident_bytes": g["deltad_spill_resident_bytes"],
                    "gauges_over_rss": sum(g[k] for k in RSS_PARTS) / rss,
                }
            )
        peak = peaks.stop()
        time.sleep(12.0)  # idle: the free heap handed back
        g = metric_sums(side.metrics_port)
        idle = proc_status(pid)
        out.update(
            peak=peak,
            idle=idle,
            idle_gauges={k: g[k] for k in (*RSS_PARTS, "deltad_spill_bytes")},
            idle_gauges_over_rss=sum(g[k] for k in RSS_PARTS) / idle["VmRSS"],
            peak_over_bound=peak.get("VmRSS", 0) / bound,
            idle_over_bound=idle["VmRSS"] / bound,
        )
    return out


def run(ctx: Context) -> dict[str, Any]:
    return measure(ctx, rows=ctx.pick(1_000_000, 400_000, 40_000))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the base (all tables)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--record", action="store_true", help="write bench/results/spill-rss.json")
    a = ap.parse_args(argv)
    ctx = Context(work_dir=a.work_dir, status=lambda m: print(m, file=sys.stderr, flush=True))
    print(record_standalone("spill_rss", measure(ctx, rows=a.rows), argv, a.record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
