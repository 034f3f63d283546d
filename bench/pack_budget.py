"""Benchmark: packed-int8 bootstraps under pack-once budgets of 0, 25, 50, 100 and 200 % of a
window's packed rows, vs the store off (issue 41 item 2), with the store's memory.

One spool (a base of every row of 4 tables, dim 64, and 4 deltas of 10 % skewed rows: a
fresh consumer's window is the base merged with the deltas, range by range). One ``deltad
serve`` per setting, all at once (no window cache: every pull builds its window; no retention),
``--packed-cache-bytes`` = share x the window's packed rows (rows x packed row bytes; the
parts' packed rows, base and deltas, are ~1.4x that), and two sidecars with the store off
(``--packed-cache-bytes 0``): ``off`` is the baseline, ``off-b`` the noise line (the same
configuration measured as if it were a setting). Rounds: a fresh consumer of each sidecar
bootstraps in packed-int8, in a shuffled order each round; the first round warms (it fills
the stores) and is left out. Per setting: median seconds per pull over the repeats (range
too) and the sidecar's CPU seconds per pull; ratio = baseline's median / the setting's
median (> 1: faster than the store off), the same of the sidecar's CPU seconds (steadier on a
shared machine than wall time); and the store's gauge after the last round
(``deltad_packed_cache_bytes``, within its budget) and the sidecar's VmRSS.

``python -m bench.pack_budget [--rows N] [--repeats R] [--record]``: prints one JSON line
(``--record``: also bench/results/pack-budget.json).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Children,
    Context,
    CpuMonitor,
    NotAvailable,
    metric_sums,
    proc_status,
    ratio,
    record_standalone,
    summarize,
)

#: budgets as shares of the window's packed rows (0: the store holds nothing, as off)
SHARES = (0.0, 0.25, 0.5, 1.0, 2.0)
TABLES, DIM = 4, 64


def measure(ctx: Context, *, rows: int, repeats: int) -> dict[str, Any]:
    """Every setting, ``repeats`` rounds after a warm one (see the module doc)."""
    from bench import deltad_procs
    from bench.datagen import write_spool
    from bench.throughput import client_pull
    from deltad import wire
    from deltad.types import WireDtype

    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why)
    per_table = rows // TABLES
    window_packed = TABLES * per_table * wire.packed_row_bytes(DIM, WireDtype.PACKED_INT8, 16)
    settings: dict[str, int] = {"off": 0, "off-b": 0}
    for share in SHARES[1:]:
        settings[f"{round(share * 100)}%"] = int(share * window_packed)
    settings["0%"] = 0  # (the same store as off: a budget that holds nothing)
    out: dict[str, Any] = {
        "rows": TABLES * per_table,
        "dim": DIM,
        "tables": TABLES,
        "window_packed_bytes": window_packed,
        "repeats": repeats,
        "settings": {},
    }
    with ctx.tmpdir("packbudget") as tmp, Children() as kids:
        first = tmp / "spool-0"
        write_spool(
            first, model=deltad_procs.MODEL, tables=TABLES, rows_per_table=per_table, dim=DIM,
            deltas=4, delta_fraction=0.1,
        )  # fmt: skip
        spools = [first]
        for i in range(1, len(settings)):  # one sidecar per spool: the same files, hard-linked
            spools.append(tmp / f"spool-{i}")
            shutil.copytree(first, spools[-1], copy_function=os.link)
        sides = {}
        for spool, (name, budget) in zip(spools, settings.items(), strict=True):
            ctx.status(f"pack budget: starting the {name} sidecar")
            extra = [*deltad_procs.NO_RETENTION, "--window-cache-entries", "0"]
            extra += ["--packed-cache-bytes", str(budget)]
            sides[name] = deltad_procs.start_sidecar(kids, spool, ctx, extra=extra, metrics=True)
        seconds: dict[str, list[float]] = {n: [] for n in sides}
        cpu: dict[str, list[float]] = {n: [] for n in sides}
        order = list(sides)
        rng = random.Random(0)
        for r in range(repeats + 1):
            rng.shuffle(order)
            for name in order:
                side = sides[name]
                ctx.status(f"pack budget: round {r} {name}")
                mon = CpuMonitor(side.proc.pid)
                got = client_pull(
                    {}, side.endpoint, side.model, f"r{r}-{name.replace('%', 'pct')}", "packed-int8"
                )
                if got["rows"] != TABLES * per_table:
                    raise RuntimeError(f"{name}: {got['rows']} rows")
                if r:  # (round 0 warms: it fills the stores)
                    seconds[name].append(got["seconds"])
                    cpu[name].append(mon.seconds())
        base = summarize(seconds["off"])["median"]
        base_cpu = summarize(cpu["off"])["median"]
        for name, side in sides.items():
            g = metric_sums(side.metrics_port) if side.metrics_port else {}
            st = proc_status(side.proc.pid)
            s = summarize(seconds[name])
            out["settings"][name] = {
                "budget_bytes": settings[name],
                "seconds": s,
                "sidecar_cpu_s": summarize(cpu[name]),
                "cpu_vs_off": ratio(base_cpu, summarize(cpu[name])["median"]),
                "speed_vs_off": ratio(base, s["median"]),
                "speed_vs_off_range": [ratio(base, s["max"]), ratio(base, s["min"])],
                "packed_cache_bytes": g.get("deltad_packed_cache_bytes"),
                "packed_refused": g.get("deltad_packed_cache_refused_total"),
                "within_budget": g.get("deltad_packed_cache_bytes", 0) <= settings[name],
                "rss_bytes": st.get("VmRSS"),
            }
    return out


def run(ctx: Context) -> dict[str, Any]:
    """The benchmark at the context's size."""
    rows = ctx.pick(800_000, 400_000, 40_000)
    repeats = max(5, ctx.repeats) if not ctx.tiny else 2
    return measure(ctx, rows=rows, repeats=repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=800_000, help="rows of the window (all tables)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (after a warm one)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--record", action="store_true", help="write bench/results/pack-budget.json")
    a = ap.parse_args(argv)
    ctx = Context(work_dir=a.work_dir, status=lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    result = measure(ctx, rows=a.rows, repeats=a.repeats)
    result["wall_s"] = time.monotonic() - t0
    print(record_standalone("pack_budget", result, argv, a.record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
