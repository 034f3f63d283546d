"""Benchmark: a predictor serving a torchrec int8-quantized model while deltad updates it.

In one process, the reference ClickModel quantized by torchrec (int8) with a
:class:`deltad.consume.quant.QuantApplier`:

* **forward latency under apply**: a thread runs forwards back to back on a fixed batch;
  first with nothing applied (idle), then while windows (a fraction of every table's rows,
  float rows as the rows form delivers them) are applied at the demo's publish rate (one
  every 0.5 s), in ``chunk`` and ``window`` consistency. Reported: p50 / p99 of each phase,
  the p99 of the forwards that overlapped an apply, the longest write-lock hold, and the
  ratio p99(apply) / p99(idle) (goal <= 1.2); and once more (``chunk-packed``) with windows
  of rows already packed, as a packed wire delivers them (the apply then only copies).
* **apply throughput** into the int8 tables, rows/s, against a bare fbgemm in-place update
  of the same rows: ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` + the TBE row layout +
  ``torch.ops.fbgemm.emb_inplace_update`` (loaded from fbgemm_gpu_embedding_inplace_ops.so),
  once from float rows and once from rows already packed (goal >= 0.8x).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Context, NotAvailable, med, metric, pyplot, summarize

#: the demo's publish interval: one window per this many seconds
WINDOW_EVERY_S = 0.5


def _percentile(xs: list[float], q: float) -> float | None:
    from deltad.reference.consumers.predictor import percentile

    return percentile(xs, q)


def run(ctx: Context) -> dict[str, Any]:
    """Latency idle vs under apply (both consistencies), then apply throughput vs bare."""
    from bench.deltad_procs import module_unavailable

    why = module_unavailable("deltad.consume.quant", "deltad.reference.consumers.serving")
    if why:
        raise NotAvailable(why)
    import torch
    from deltad.reference.consumers.serving import ServingConfig, build_serving_model

    from deltad.types import ApplyConsistency, ServeDtype

    rows = ctx.pick(500_000, 100_000, 2_000)
    dim = ctx.pick(64, 64, 8)
    window_frac = ctx.pick(0.02, 0.02, 0.05)
    phase_s = ctx.pick(20.0, 8.0, 2.0)
    batch = ctx.pick(512, 256, 32)
    tables = {f"t{i}": rows for i in range(4)}
    torch.set_num_threads(1)  # one core per side: the forward thread and the applier
    ctx.status("serving: building the int8 model")
    cfg = ServingConfig(
        ServeDtype.INT8, tables, rows, dim, batch_size=batch, interval_s=0.0, chunk_rows=4096,
        zch_slots=0,  # ordinary tables, as recorded (managed-collision tables: bench.zch)
    )  # fmt: skip
    model, applier = build_serving_model(cfg)
    gen = torch.Generator().manual_seed(0)
    per_table = max(1, int(rows * window_frac))
    size = {
        "tables": len(tables) + 1,
        "rows_per_table": rows,
        "dim": dim,
        "window_rows": per_table * (len(tables) + 1),
        "window_every_s": WINDOW_EVERY_S,
        "batch": batch,
        "phase_s": phase_s,
    }

    def window(packed: bool = False) -> list[Any]:
        """A window of float rows (the rows form) or of rows already packed (a packed wire)."""
        ds = [_delta(applier, name, per_table, gen) for name in [*tables, "seq"]]
        if packed:
            for d in ds:
                s = d.shards[0]
                s.packed = applier.quant_tables[s.shard.table].pack(s.values)
                s.values = None
        return ds

    ctx.status("serving: forward latency idle")
    idle = _latency_phase(model, applier, cfg, phase_s, None)
    modes = {}
    phases = [
        ("chunk", ApplyConsistency.CHUNK, False),
        ("window", ApplyConsistency.WINDOW, False),
        ("chunk-packed", ApplyConsistency.CHUNK, True),  # a packed wire: the apply only copies
    ]
    for key, mode, packed in phases:
        ctx.status(f"serving: forward latency under apply ({key})")
        applier.consistency = mode
        windows = [window(packed) for _ in range(int(phase_s / WINDOW_EVERY_S) + 1)]
        modes[key] = _latency_phase(model, applier, cfg, phase_s, windows)
        busy = modes[key]
        busy["p99_ratio_vs_idle"] = (
            busy["p99_ms"] / idle["p99_ms"] if busy["p99_ms"] and idle["p99_ms"] else None
        )
    applier.consistency = ApplyConsistency.CHUNK
    ctx.status("serving: apply throughput vs bare fbgemm")
    tput = _throughput(applier, [*tables, "seq"], per_table * 5, ctx.repeats, gen)
    head = [
        metric(f"forward p99 while {what} are applied ({key.split('-')[0]}), vs idle",
               modes[key]["p99_ms"], "ms", baseline=idle["p99_ms"], baseline_unit="ms idle",
               ratio=modes[key]["p99_ratio_vs_idle"])
        for key, what in (("chunk", "windows"), ("window", "windows"),
                          ("chunk-packed", "packed windows"))
    ]  # fmt: skip
    for kind in ("float", "packed"):
        t = tput.get(kind)
        if t and t.get("bare_rows_per_s"):
            head.append(
                metric(f"apply into int8 tables from {kind} rows, vs bare fbgemm",
                       med(t["deltad_rows_per_s"]), "rows/s", baseline=med(t["bare_rows_per_s"]),
                       baseline_unit="rows/s bare emb_inplace_update", ratio=t["ratio"])
            )  # fmt: skip
    return {"size": size, "idle": idle, "apply": modes, "throughput": tput, "headline": head}


def _delta(applier: Any, table: str, n: int, gen: Any) -> Any:
    import torch

    from deltad.consume.window import RankDelta, ShardUpdate
    from deltad.types import Cursor, Form, Shard, WireDtype

    t = applier.quant_tables[table]
    ids = torch.randperm(t.num_rows, generator=gen)[:n].sort().values
    values = torch.randn(ids.numel(), t.dim, generator=gen) * 0.05
    s = ShardUpdate(Shard.columns_of(table, t.num_rows, t.dim, 0, t.dim), ids, values)
    return RankDelta(
        rank=0, generation=0, resync=False, from_seq=0, to_seq=1, to_step=1, form=Form.ROWS,
        wire_dtype=WireDtype.FP32, cursor=Cursor("bench", 0, 0, 1, 1), shards=[s],
    )  # fmt: skip


def _latency_phase(
    model: Any, applier: Any, cfg: Any, seconds: float, windows: list[list[Any]] | None
) -> dict[str, Any]:
    """Forwards back to back for ``seconds``; apply ``windows`` every WINDOW_EVERY_S."""
    from deltad.reference.consumers.serving import fixed_batch

    b = fixed_batch(cfg)
    forward = applier.serve(lambda x: model(x)[1])
    for _ in range(3):
        forward(b)  # warm up
    stop = threading.Event()
    applying = threading.Event()
    lat: list[float] = []
    overlapped: list[float] = []

    def loop() -> None:
        while not stop.is_set() and len(lat) < 1_000_000:
            during = applying.is_set()
            t0 = time.perf_counter()
            forward(b)
            dt = time.perf_counter() - t0
            lat.append(dt)
            if during or applying.is_set():
                overlapped.append(dt)

    th = threading.Thread(target=loop)
    th.start()
    applies: list[float] = []
    holds: list[float] = []
    try:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        for w in windows or []:
            if time.monotonic() >= end:
                break
            time.sleep(max(0.0, nxt - time.monotonic()))
            applying.set()
            t0 = time.perf_counter()
            applier.apply(w)
            applies.append(time.perf_counter() - t0)
            applying.clear()
            holds.append(applier.stats.max_hold_s)
            nxt += WINDOW_EVERY_S
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        stop.set()
        th.join(60)
    ms = [x * 1e3 for x in lat]
    over = [x * 1e3 for x in overlapped]
    return {
        "forwards": len(ms),
        "p50_ms": _percentile(ms, 50),
        "p99_ms": _percentile(ms, 99),
        "overlapped_forwards": len(over),
        "overlapped_p99_ms": _percentile(over, 99),
        "windows": len(applies),
        "apply_s": summarize(applies) if applies else None,
        "max_hold_ms": max(holds) * 1e3 if holds else None,
    }


def _inplace_op() -> Any:
    """``torch.ops.fbgemm.emb_inplace_update`` as the installed fbgemm has it: fbgemm 1.9
    registers it when fbgemm_gpu is imported; fbgemm 1.8 only in
    ``fbgemm_gpu_embedding_inplace_ops.so``, which ``import fbgemm_gpu`` does not load, so it
    is loaded here (only then: under 1.9 a second load would register the op twice)."""
    import fbgemm_gpu
    import torch

    try:
        return torch.ops.fbgemm.emb_inplace_update
    except (AttributeError, RuntimeError):
        pass
    lib = Path(fbgemm_gpu.__file__).parent / "fbgemm_gpu_embedding_inplace_ops.so"
    torch.ops.load_library(str(lib))
    return torch.ops.fbgemm.emb_inplace_update


def _bare_update(op: Any, applier: Any, updates: list[tuple[str, Any, Any]]) -> None:
    """One emb_inplace_update per TBE for packed rows ``(table, ids, rows)``."""
    import torch

    by_tbe: dict[int, list[tuple[Any, Any, Any]]] = {}
    for name, ids, rows in updates:
        t = applier.quant_tables[name]
        by_tbe.setdefault(id(t.tbe), []).append((t, ids, rows))
    for parts in by_tbe.values():
        tbe = parts[0][0].tbe
        table_idx = torch.cat(
            [torch.full((ids.numel(),), t.index, dtype=torch.int32) for t, ids, _ in parts]
        )
        row_idx = torch.cat([ids for _, ids, _ in parts])
        rows = torch.cat([r for _, _, r in parts])
        offsets = torch.arange(rows.shape[0] + 1, dtype=torch.int64) * rows.shape[1]
        op(
            dev_weights=tbe.weights_host,
            uvm_weights=tbe.weights_uvm,
            weights_placements=tbe.weights_placements,
            weights_offsets=tbe.weights_offsets,
            weights_tys=tbe.weights_tys,
            D_offsets=tbe.D_offsets,
            update_weights=rows.reshape(-1),
            update_table_indices=table_idx,
            update_row_indices=row_idx,
            update_offsets=offsets,
            row_alignment=tbe.row_alignment,
            lxu_cache_weights=tbe.lxu_cache_weights,
            lxu_cache_locations=None,
        )


def _throughput(applier: Any, names: list[str], n: int, repeats: int, gen: Any) -> dict[str, Any]:
    import torch

    from deltad.consume.quant import pack_rows

    try:
        op = _inplace_op()
    except (OSError, RuntimeError) as e:
        return {"status": f"bare emb_inplace_update not available: {e}"}
    out: dict[str, Any] = {}
    for kind in ("float", "packed"):
        ours: list[float] = []
        bare: list[float] = []
        for rep in range(max(4, 2 * repeats)):
            deltas = [_delta(applier, name, n, gen) for name in names]
            total = sum(d.shards[0].ids.numel() for d in deltas)
            if kind == "packed":
                for d in deltas:
                    s = d.shards[0]
                    s.packed = applier.quant_tables[s.shard.table].pack(s.values)
                    s.values = None

            def run_ours(deltas: list[Any] = deltas) -> None:
                applier.apply(deltas)

            def run_bare(deltas: list[Any] = deltas, kind: str = kind) -> None:
                updates = []
                for d in deltas:
                    s = d.shards[0]
                    t = applier.quant_tables[s.shard.table]
                    if kind == "float":  # the layout any caller must produce
                        rows = pack_rows(s.values, t.dtype, t.row_bytes)
                    else:
                        rows = s.packed
                    updates.append((s.shard.table, s.ids, rows))
                _bare_update(op, applier, updates)

            # the same rows both ways, in alternating order; both must leave the same bytes
            order = [(run_ours, ours), (run_bare, bare)]
            snapshot: dict[str, Any] = {}
            for i, (fn, samples) in enumerate(order if rep % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                fn()
                samples.append(total / (time.perf_counter() - t0))
                if i == 0:
                    snapshot = {k: v.clone() for k, v in applier.tables().items()}
            if not all(torch.equal(v, snapshot[k]) for k, v in applier.tables().items()):
                raise AssertionError("bare fbgemm update wrote other bytes than deltad")
        out[kind] = {
            "rows": n * len(names),
            "deltad_rows_per_s": summarize(ours),
            "bare_rows_per_s": summarize(bare),
            "ratio": (med(summarize(ours)) or 0.0) / (med(summarize(bare)) or 1.0),
        }
    return out


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Forward p50 / p99 idle and under apply (chunk, window)."""
    plt = pyplot()
    from bench.common import save_figure

    phases = {"idle": result["idle"], **{f"apply ({k})": v for k, v in result["apply"].items()}}
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(phases))
    ax.bar([x - 0.2 for x in xs], [p["p50_ms"] or 0 for p in phases.values()], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [p["p99_ms"] or 0 for p in phases.values()], 0.4, label="p99")
    ax.set_xticks(list(xs), list(phases))
    ax.set_ylabel("forward latency (ms)")
    ax.set_title("int8 serving model: forwards while deltad applies windows")
    ax.legend()
    return save_figure(fig, out_dir, "serving_latency")
