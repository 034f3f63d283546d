"""Overload: more consumers at once than one sidecar has stream slots; every pull must end whole.

Part of ``deltad bench --only fanout`` (key ``tree.overload``).
"""

from __future__ import annotations

import time
from typing import Any

from bench import deltad_procs
from bench.common import (
    DIM,
    MB,
    TABLES,
    Children,
    Context,
    consumer_config,
    percentile,
    rows_per_table,
)
from bench.wire_baselines import ClientWorker


def overload(ctx: Context, kids: Children, workers: list[ClientWorker]) -> list[dict[str, Any]]:
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
            rows_per_table=rows_per_table(window), dim=DIM, deltas=2,
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
                        "call", module="bench.fanout_overload", func="client_pull_many",
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

    from deltad.consume.client import DeltaConsumer

    out: list[dict[str, Any]] = [{} for _ in range(n)]

    def one(i: int) -> None:
        res: dict[str, Any] = {"seconds": None, "bytes": 0, "missing": 0, "error": None}
        try:
            cfg = consumer_config(f"{prefix}-{i}", model, endpoint, reuse_buffers_bytes=0)
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
