"""Bootstrap memory of a predictor: peak RSS over its tables while it pulls its first window.

A fresh client process (one per measurement, so nothing of an earlier pull is in its heap)
connects, builds its applier (its tables, for a quantized model, already allocated), resets
its peak RSS (``/proc/self/clear_refs``), bootstraps from a ``deltad serve`` child and reports
``(VmHWM - VmRSS before the pull) / tables' bytes``:

* ``assembled``: ``pull()`` then ``applier.apply(deltas)``: the whole window is decoded, then
  written (TensorDictApplier: into newly allocated tables) -- the path before streaming;
* ``streamed``: ``sync(applier.apply)``: each chunk of the resync window goes into the
  applier's staged tables as it arrives (:class:`deltad.consume.appliers.ResyncStage`).

Appliers: ``dict`` (:class:`TensorDictApplier`, fp32 wire, fp32 tables) and ``int8``
(:class:`QuantApplier` over a quantized torchrec EmbeddingCollection holding the spool's
tables; packed-int8 wire, the rows as the model stores them, and fp32 wire, packed by the
applier). Sizes: the spool's fp32 table set (the int8 tables are ~1/3 of it at dim 64).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import DIM, TABLES, Children, Context, NotAvailable, consumer_config

#: (applier, wire dtype) measured at each size
CASES = [("dict", "fp32"), ("int8", "packed-int8"), ("int8", "fp32")]


def run(ctx: Context) -> dict[str, Any]:
    """Every case x size x path, each in a fresh client process."""
    from bench import deltad_procs
    from bench.wire_baselines import ClientWorker

    why = deltad_procs.sidecar_unavailable() or deltad_procs.module_unavailable(
        "torchrec", "deltad.consume.quant"
    )
    if why:
        raise NotAvailable(why)
    sizes_mb = ctx.pick([16, 512], [16, 128], [4])
    sizes_mb = ctx.cache.get("bootstrap_mem_sizes_mb", sizes_mb)  # a one-off driver's sizes
    repeats = max(1, ctx.pick(1, 1, 1) if ctx.repeats <= 0 else min(ctx.repeats, 2))
    points: list[dict[str, Any]] = []
    for mb in sizes_mb:
        rows = (mb << 20) // (DIM * 4 + 8)
        with ctx.tmpdir("bootmem") as spool, Children() as kids:
            deltad_procs.write_bench_spool(spool, rows=rows, tables=TABLES, dim=DIM)
            side = deltad_procs.start_sidecar(kids, spool, ctx, extra=deltad_procs.NO_RETENTION)
            try:
                for applier, wire in ctx.cache.get("bootstrap_mem_cases", CASES):
                    for path in ("assembled", "streamed"):
                        for rep in range(repeats):
                            ctx.status(f"bootstrap memory {mb} MB {applier} {wire} {path}")
                            w = ClientWorker(kids)
                            try:
                                out: dict[str, Any] = w.call(
                                    "call", module="bench.bootstrap_mem", func="client_bootstrap",
                                    kwargs={"endpoint": side.endpoint, "model": side.model,
                                            "consumer": f"m{mb}-{applier}-{wire}-{path}-{rep}",
                                            "applier": applier, "wire": wire,
                                            "streamed": path == "streamed",
                                            "rows_per_table": rows // TABLES},
                                )  # fmt: skip
                            finally:
                                w.close()
                            out.update(size_mb=mb, applier=applier, wire=wire, path=path)
                            out["ratio"] = (out["peak_rss"] - out["rss_before"]) / max(
                                1, out["tables_bytes"]
                            )
                            ctx.log(
                                f"bootstrap memory {mb} MB {applier}/{wire} {path}: "
                                f"{out['ratio']:.2f}x of {out['tables_bytes'] / 1e6:.0f} MB tables "
                                f"(peak {out['peak_rss'] / 1e6:.0f} MB, before "
                                f"{out['rss_before'] / 1e6:.0f} MB, {out['pull_s']:.2f} s)"
                            )
                            points.append(out)
            finally:
                side.stop()
    big = max(sizes_mb)

    def best(applier: str, wire: str, path: str) -> float | None:
        xs = [
            p["ratio"]
            for p in points
            if (p["applier"], p["wire"], p["path"], p["size_mb"]) == (applier, wire, path, big)
        ]
        return min(xs) if xs else None

    headline = []
    for applier, wire in ctx.cache.get("bootstrap_mem_cases", CASES):
        for path in ("streamed", "assembled"):
            headline.append(
                {
                    "metric": f"predictor bootstrap peak RSS / tables, {applier} {wire}, "
                    f"{path}, {big} MB",
                    "value": best(applier, wire, path),
                    "unit": "x",
                    **({"target": "<= 1.2x"} if path == "streamed" else {}),
                }
            )
    return {"dim": DIM, "tables": TABLES, "points": points, "headline": headline}


def _status(key: str) -> int:
    from bench.common import proc_status_bytes

    return proc_status_bytes(key) or 0


def _quant_model(rows_per_table: int) -> Any:
    """A quantized (int8) torchrec EmbeddingCollection with the bench spool's tables."""
    import torch
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from deltad.consume.quant import quantize_model

    with torch.no_grad():
        ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=f"t{i}",
                    embedding_dim=DIM,
                    num_embeddings=rows_per_table,
                    feature_names=[f"f{i}"],
                )
                for i in range(TABLES)
            ],
            device=torch.device("cpu"),
        )
        holder = torch.nn.ModuleDict({"ec": ec})  # quantize_embeddings swaps children
        q = quantize_model(holder, "int8")
        del ec, holder
    return q


def client_bootstrap(
    state: dict[str, Any],
    endpoint: str,
    model: str,
    consumer: str,
    applier: str,
    wire: str,
    streamed: bool,
    rows_per_table: int,
) -> dict[str, Any]:
    """Runs in a fresh client worker: one bootstrap, its RSS before and its peak."""
    import contextlib
    import ctypes
    import gc

    from deltad.config import PullOptions
    from deltad.consume.appliers import Applier, TensorDictApplier
    from deltad.consume.client import DeltaConsumer
    from deltad.consume.quant import QuantApplier
    from deltad.perf import tune_malloc, tune_threads
    from deltad.types import WireDtype

    tune_malloc()
    tune_threads()
    cfg = consumer_config(
        consumer, model, endpoint, pull=PullOptions(wire_dtype=WireDtype(wire), dense=False)
    )
    a: Applier = (
        TensorDictApplier() if applier == "dict" else QuantApplier(_quant_model(rows_per_table))
    )
    c = DeltaConsumer(cfg).connect()
    try:
        gc.collect()
        # tune_malloc keeps freed heap pages (no trim): the float model quantize_model built
        # and dropped would stay resident and be reused by the pull, hiding what it costs
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # peak RSS := current RSS
        except OSError:
            pass
        before = _status("VmRSS:")
        t0 = time.perf_counter()
        if streamed:
            res = c.sync(a.apply)
            assert all(d.stage is not None for d in res.deltas), "not streamed"
        else:
            res = c.pull()
            a.apply(res.deltas)
            c.commit(res)
        pull_s = time.perf_counter() - t0
        peak = _status("VmHWM:")
        tables = sum(t.nbytes for t in a.tables().values())
        nbytes = res.bytes
        del res
    finally:
        c.close()
    return {
        "rss_before": before,
        "peak_rss": peak,
        "tables_bytes": tables,
        "bytes": nbytes,
        "pull_s": pull_s,
    }


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """No plot: the numbers are a small table (bench/README.md)."""
    return []
