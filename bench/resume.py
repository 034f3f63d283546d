"""A bootstrap over a link that drops: what resuming a broken stream costs.

A consumer bootstraps a window (a base of 4 tables x dim 64 and 4 deltas of 1 %) from
``deltad serve`` (window cache off: every stream builds its messages) through a TCP proxy in
this process (:class:`bench.netproxy.DroppingProxy`). The baseline goes through the same
proxy with no cut; the measured arm has its link cut every ``--drop-mb`` MB, and each retry
goes on where the last stream broke (``GetDeltaRequest.resume``; started over, no attempt
would ever get past the first cut). Per arm: wall time of the pull, bytes the link carried,
the sidecar's CPU. The baseline is measured twice per repeat (the noise line). The consumer
stages rows (a ``TensorDictApplier``), as the reference predictor does, with the library's
retries and backoff (``ConsumerConfig`` defaults).

``python -m bench.resume [--window-mb 256] [--drop-mb 32] [--repeats 3] [--record]``: prints
one JSON line; ``--record`` writes bench/results/resume.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    DIM,
    MB,
    TABLES,
    Children,
    Context,
    CpuMonitor,
    consumer_config,
    metric_sums,
    record_standalone,
    rows_per_table,
    summarize,
)
from bench.deltad_procs import MODEL, start_sidecar
from bench.netproxy import DroppingProxy


def _bootstrap(endpoint: str, name: str, drop_bytes: int, cpu: CpuMonitor) -> dict[str, float]:
    """One consumer's bootstrap through a proxy cutting every ``drop_bytes`` (0: never)."""
    from deltad.consume.appliers import TensorDictApplier
    from deltad.consume.client import DeltaConsumer

    drops = 10**6 if drop_bytes else 0
    with DroppingProxy(endpoint, drop_after=drop_bytes or 1, drops=drops) as link:
        # the library's retries and backoff (an attempt that brought messages uses none up
        # and waits only the initial backoff, 0.05-0.1 s)
        cfg = consumer_config(name, MODEL, link.endpoint)
        applier = TensorDictApplier()
        with DeltaConsumer(cfg) as c:
            cpu.reset()
            t0 = time.perf_counter()
            r = c.sync(applier)
            seconds = time.perf_counter() - t0
            sidecar_cpu = cpu.seconds()
        if r.missing or not r.deltas or not r.deltas[0].resync:
            raise RuntimeError(f"bootstrap {name} failed: {r.missing}")
        return {
            "seconds": seconds,
            "link_bytes": float(link.forwarded),
            "cuts": float(link.cut),
            "sidecar_cpu_s": sidecar_cpu,
            "rows": float(r.rows),
        }


def run(window_mb: int, drop_mb: int, repeats: int, work: Path) -> dict[str, Any]:
    from bench.datagen import write_spool

    rows = rows_per_table(window_mb * MB)
    write_spool(
        work, model=MODEL, tables=TABLES, rows_per_table=rows, dim=DIM, deltas=4,
        delta_fraction=0.01,
    )  # fmt: skip
    samples: list[dict[str, float]] = []
    with Children() as kids:
        side = start_sidecar(
            kids, work, Context(), extra=["--window-cache-bytes", "0"], metrics=True
        )
        cpu = CpuMonitor(side.proc.pid)
        _bootstrap(side.endpoint, "warm", 0, cpu)  # (untimed: first touch of the log)
        for i in range(repeats):
            clean = _bootstrap(side.endpoint, f"clean-{i}", 0, cpu)
            cut = _bootstrap(side.endpoint, f"cut-{i}", drop_mb * MB, cpu)
            again = _bootstrap(side.endpoint, f"clean-again-{i}", 0, cpu)
            samples.append(
                {
                    "time_ratio": cut["seconds"] / clean["seconds"],
                    "link_bytes_ratio": cut["link_bytes"] / clean["link_bytes"],
                    "sidecar_cpu_ratio": cut["sidecar_cpu_s"] / max(clean["sidecar_cpu_s"], 1e-9),
                    "noise": again["seconds"] / clean["seconds"],
                    "cuts": cut["cuts"],
                    "clean_s": clean["seconds"],
                    "cut_s": cut["seconds"],
                    "clean_link_mb": clean["link_bytes"] / MB,
                    "cut_link_mb": cut["link_bytes"] / MB,
                }
            )
        sums = metric_sums(side.metrics_port) if side.metrics_port else {}
        side.stop()
    keys = ["time_ratio", "link_bytes_ratio", "sidecar_cpu_ratio", "noise", "cuts"]
    return {
        "window_mb": window_mb,
        "drop_mb": drop_mb,
        "samples": samples,
        **{k: summarize([s[k] for s in samples]) for k in keys},
        "sidecar_resumed_streams": sums.get("deltad_getdelta_resumed_total"),
        "sidecar_resumed_messages": sums.get("deltad_getdelta_resumed_messages_total"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__)
    p.add_argument("--window-mb", type=int, default=256, help="the bootstrap window's size")
    p.add_argument("--drop-mb", type=int, default=32, help="the link is cut every this many MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", action="store_true", help="write bench/results/resume.json")
    a = p.parse_args(argv)
    if a.drop_mb < 4 or a.window_mb < a.drop_mb:
        # (a stream goes on after whole messages: the sidecar's 2 MB chunks)
        p.error("--drop-mb must be >= 4 (whole 2 MB messages between cuts) and <= --window-mb")
    with tempfile.TemporaryDirectory(prefix="deltad-resume-") as tmp:
        result = run(a.window_mb, a.drop_mb, a.repeats, Path(tmp))
    text = record_standalone("resume", result, argv, a.record)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
