"""Benchmark 3: GetDelta throughput vs bare gRPC and raw loopback TCP.

A spool holds a base segment (every row of 4 tables, dim 64) plus two skewed delta segments;
a fresh consumer's window is therefore every row. For each window size and wire dtype a new
consumer (in its own process) pulls the window from ``deltad serve`` (another process):
server merge + stream + client rebuild into tensors. Delivered GB/s = payload bytes on the
wire (ids + values [+ int8 scale/bias]) / wall time of the pull.

Baselines, measured in the same run for the same byte counts: (a) the bare gRPC stream of
:mod:`bench.wire_baselines` at its best chunk size, (b) raw loopback TCP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import (
    GB,
    MB,
    Children,
    Context,
    NotAvailable,
    PeakRssMonitor,
    med,
    ratio,
    save_figure,
    summarize,
)
from bench.wire_baselines import (
    ClientWorker,
    grpc_server_main,
    start_server,
    tcp_server_main,
)

DIM = 64
TABLES = 4
WIRE_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def wire_bytes(rows: int, dim: int, dtype: str) -> int:
    """Payload bytes of ``rows`` rows on the wire (ids + values [+ scale/bias])."""
    per = 8 + dim * WIRE_ITEMSIZE[dtype] + (8 if dtype == "int8" else 0)
    return rows * per


def measure_baselines(
    ctx: Context, byte_counts: list[int], chunks: list[int], repeats: int
) -> dict[str, Any]:
    """Raw TCP and bare gRPC (every chunk size) for each byte count; best chunk chosen."""
    out: dict[str, Any] = {"tcp": {}, "grpc": {}, "grpc_best": {}}
    top = max(byte_counts)
    with Children() as kids:
        worker = ClientWorker(kids)
        try:
            tcp_conn, tcp_port = start_server(kids, tcp_server_main, top)
            grpc_conn, grpc_port = start_server(kids, grpc_server_main, top)
            for n in byte_counts:
                ctx.status(f"baselines {n / MB:.0f} MB")
                worker.call("tcp", port=tcp_port, nbytes=min(n, 16 * MB), chunk=MB)  # warm
                tcp = [
                    worker.call("tcp", port=tcp_port, nbytes=n, chunk=4 * MB)["seconds"]
                    for _ in range(repeats)
                ]
                out["tcp"][n] = summarize([n / s / GB for s in tcp])
                per_chunk: dict[int, Any] = {}
                for c in chunks:
                    worker.call("grpc", port=grpc_port, nbytes=min(n, 8 * c), chunk=c)  # warm
                    secs = [
                        worker.call("grpc", port=grpc_port, nbytes=n, chunk=c)["seconds"]
                        for _ in range(repeats)
                    ]
                    per_chunk[c] = summarize([n / s / GB for s in secs])
                out["grpc"][n] = per_chunk
                best = max(per_chunk, key=lambda c: per_chunk[c]["median"] or 0.0)
                out["grpc_best"][n] = {"chunk_bytes": best, **per_chunk[best]}
            worker.call("tcp_close", port=tcp_port)
            grpc_conn.close()
            tcp_conn.close()
        finally:
            worker.close()
    return out


# ----------------------------------------------------------------------- client side (worker)


def client_pull(
    state: dict[str, Any],
    endpoint: str,
    model: str,
    consumer: str,
    dtype: str,
    form: str = "rows",
    k: int = 0,
    max_step: int | None = None,
    start_at: float | None = None,
) -> dict[str, Any]:
    """Runs in the client worker: one fresh consumer pulls its whole window once.

    With ``start_at`` (unix time) the pull starts then, after connecting: several workers
    started together pull at the same moment.
    """
    import time

    from deltad.client import DeltaConsumer
    from deltad.config import ConsumerConfig, PullOptions
    from deltad.perf import tune_malloc
    from deltad.types import Form, WireDtype

    tune_malloc()  # as `deltad consume` does at startup
    cfg = ConsumerConfig(
        consumer=consumer,
        model=model,
        sidecars=(endpoint,),
        pull=PullOptions(form=Form(form), k=k, wire_dtype=WireDtype(dtype), max_step=max_step),
        align_steps=False,
        rpc_deadline_s=600.0,
    )
    with DeltaConsumer(cfg) as c:
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        start_unix = time.time()
        res = c.pull()
        dt = time.perf_counter() - t0
        end_unix = time.time()
        rows = res.rows
        nbytes = res.bytes
        vals = sum(s.values.numel() for d in res.deltas for s in d.slices if s.values is not None)
        del res
    return {
        "seconds": dt,
        "bytes": nbytes,
        "rows": rows,
        "values": vals,
        "start_unix": start_unix,
        "end_unix": end_unix,
    }


def client_decompose(
    state: dict[str, Any], endpoint: str, consumer: str, dtype: str
) -> dict[str, Any]:
    """Runs in the client worker: one raw GetDelta, timed in phases.

    ``first_s``: request to the first message (the server's merge + encode; the header goes
    out after them); ``stream_s``: first to last message, with the client's per-chunk decode;
    ``result_s``: building the RankDelta; ``merge_s``: the server's own figure (trailer).
    """
    import time

    import grpc

    from deltad import wire
    from deltad.config import PullOptions
    from deltad.types import WireDtype
    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(endpoint, options=opts) as ch:
        pb_grpc.DeltaServiceStub(ch).Register(pb.RegisterRequest(consumer=consumer), timeout=30)
        req = wire.request_from_options(consumer, PullOptions(wire_dtype=WireDtype(dtype)))
        asm = wire.WindowAssembler()
        t0 = time.perf_counter()
        first = None
        nbytes = 0
        for msg in wire.raw_get_delta(ch)(req, timeout=600):
            if first is None:
                first = time.perf_counter()
            nbytes += len(msg)
            asm.add(msg)
        t1 = time.perf_counter()
        delta = asm.result()
        t2 = time.perf_counter()
        merge_s = float(asm.trailer.merge_seconds) if asm.trailer is not None else None
        rows = delta.rows
        del delta, asm
    return {
        "first_s": (first or t1) - t0,
        "stream_s": t1 - (first or t1),
        "result_s": t2 - t1,
        "total_s": t2 - t0,
        "server_merge_s": merge_s,
        "message_bytes": nbytes,
        "rows": rows,
    }


def client_warm(state: dict[str, Any]) -> dict[str, Any]:
    """Runs in the client worker: import the consumer library before any timing."""
    import deltad.client
    import deltad.wire  # noqa: F401

    return {}


# ----------------------------------------------------------------------- the benchmark


def run(ctx: Context) -> dict[str, Any]:
    """Measure baselines, then GetDelta for every window size and wire dtype."""
    from bench import deltad_procs

    sizes = ctx.pick([64 * MB, 256 * MB, 1024 * MB], [16 * MB, 64 * MB], [4 * MB])
    dtypes = ctx.pick(["fp32", "fp16", "bf16", "int8"], ["fp32", "int8"], ["fp32"])
    chunks = ctx.pick([1 * MB, 2 * MB, 4 * MB], [1 * MB, 4 * MB], [1 * MB])
    repeats = ctx.repeats
    rows_for = {s: s // wire_bytes(1, DIM, "fp32") // TABLES * TABLES for s in sizes}
    counts = sorted({wire_bytes(rows_for[s], DIM, d) for s in sizes for d in dtypes})
    base = measure_baselines(ctx, counts, chunks, repeats)
    result: dict[str, Any] = {
        "dim": DIM,
        "tables": TABLES,
        "window_sizes_bytes": sizes,
        "dtypes": dtypes,
        "baselines": base,
    }
    why = deltad_procs.sidecar_unavailable()
    if why:
        raise NotAvailable(why, result)
    points: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    for size in sizes:
        rows = rows_for[size]
        with ctx.tmpdir("tput") as spool, Children() as kids:
            ctx.status(f"spool {size / MB:.0f} MB")
            deltad_procs.write_bench_spool(spool, rows=rows, tables=TABLES, dim=DIM)
            mon = PeakRssMonitor().start()
            # Window cache off: every pull pays the merge + encode, as a new window does.
            side = deltad_procs.start_sidecar(
                kids, spool, ctx, extra=["--window-cache-entries", "0"]
            )
            mon.watch("sidecar", side.proc.pid)
            worker = ClientWorker(kids)
            worker.call("call", module="bench.throughput", func="client_warm", kwargs={})
            mon.watch("client", worker.proc.pid)
            try:
                # One untimed pull first: the sidecar maps and faults in the fresh segment
                # files once, as a long-running sidecar has done before any consumer comes.
                ctx.status(f"GetDelta {size / MB:.0f} MB warm-up")
                worker.call(
                    "call",
                    module="bench.throughput",
                    func="client_pull",
                    kwargs={
                        "endpoint": side.endpoint,
                        "model": side.model,
                        "consumer": "tput-warmup",
                        "dtype": "fp32",
                    },
                )
                for dtype in dtypes:
                    ctx.status(f"GetDelta {size / MB:.0f} MB {dtype}")
                    runs = [
                        worker.call(
                            "call",
                            module="bench.throughput",
                            func="client_pull",
                            kwargs={
                                "endpoint": side.endpoint,
                                "model": side.model,
                                "consumer": f"tput-{dtype}-{i}",
                                "dtype": dtype,
                            },
                        )
                        for i in range(repeats)
                    ]
                    nbytes = runs[0]["bytes"]
                    gbps = summarize([r["bytes"] / r["seconds"] / GB for r in runs])
                    expect = wire_bytes(rows, DIM, dtype)
                    g = base["grpc_best"].get(expect) or {}
                    t = base["tcp"].get(expect) or {}
                    points.append(
                        {
                            "window_bytes_fp32": size,
                            "dtype": dtype,
                            "rows": runs[0]["rows"],
                            "wire_bytes": nbytes,
                            "expected_wire_bytes": expect,
                            "seconds": summarize([r["seconds"] for r in runs]),
                            "gbps": gbps,
                            # Rows delivered, counted at their fp32 size: what the predictor
                            # gets per second whatever the wire dtype.
                            "fp32_equiv_gbps": summarize(
                                [
                                    wire_bytes(r["rows"], DIM, "fp32") / r["seconds"] / GB
                                    for r in runs
                                ]
                            ),
                            "rows_per_s": summarize([r["rows"] / r["seconds"] for r in runs]),
                            "bare_grpc_gbps": med(g),
                            "bare_grpc_chunk": g.get("chunk_bytes"),
                            "tcp_gbps": med(t),
                            "vs_bare_grpc": ratio(med(gbps), med(g)),
                            "vs_tcp": ratio(med(gbps), med(t)),
                        }
                    )
                if size == max(sizes):
                    ctx.status("GetDelta phases")
                    phases = [
                        worker.call(
                            "call",
                            module="bench.throughput",
                            func="client_decompose",
                            kwargs={
                                "endpoint": side.endpoint,
                                "consumer": f"phases-{i}",
                                "dtype": "fp32",
                            },
                        )
                        for i in range(repeats)
                    ]
                    result["phases_fp32_largest"] = {
                        k: summarize([p[k] for p in phases if p[k] is not None])
                        for k in ("first_s", "stream_s", "result_s", "total_s", "server_merge_s")
                    }
                    result["phases_fp32_largest"]["message_bytes"] = phases[0]["message_bytes"]
            finally:
                worker.close()
                side.stop()
                for k, v in mon.stop().items():
                    peaks[k] = max(peaks.get(k, 0), v)
    result["points"] = points
    result["peak_rss_bytes"] = peaks
    result["headline"] = _headline(points)
    return result


def _headline(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not points:
        return out
    largest = max(p["window_bytes_fp32"] for p in points)
    for p in points:
        if p["window_bytes_fp32"] != largest:
            continue
        gb = med(p["gbps"])
        out.append(
            {
                "metric": (
                    f"GetDelta {largest / MB:.0f} MB window, {p['dtype']} "
                    f"(rows at fp32 size: {med(p['fp32_equiv_gbps']) or 0:.2f} GB/s)"
                ),
                "value": gb,
                "unit": "GB/s",
                "baseline": p["bare_grpc_gbps"],
                "ratio": p["vs_bare_grpc"],
                "target": ">= 2 GB/s and >= 0.95x bare gRPC",
                "met": bool(gb and gb >= 2.0 and (p["vs_bare_grpc"] or 0) >= 0.95),
            }
        )
    tcp = [p["tcp_gbps"] for p in points if p["window_bytes_fp32"] == largest and p["tcp_gbps"]]
    if tcp:
        out.append({"metric": "raw loopback TCP (ceiling)", "value": max(tcp), "unit": "GB/s"})
    return out


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """GB/s vs window size: deltad per dtype, bare gRPC and TCP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = result.get("points", [])
    for dtype in result.get("dtypes", []):
        ps = sorted((p for p in pts if p["dtype"] == dtype), key=lambda p: p["window_bytes_fp32"])
        if ps:
            ax.plot(
                [p["window_bytes_fp32"] / MB for p in ps],
                [med(p["gbps"]) for p in ps],
                marker="o",
                label=f"deltad GetDelta {dtype}",
            )
    base = result.get("baselines", {})
    for key, label, style in (
        ("grpc_best", "bare gRPC (best chunk)", "--"),
        ("tcp", "raw TCP", ":"),
    ):
        d = base.get(key, {})
        xs = sorted(int(n) for n in d)
        if xs:
            ax.plot(
                [x / MB for x in xs],
                [med(d[x] if x in d else d[str(x)]) for x in xs],
                style,
                marker="s",
                label=label,
            )
    ax.axhline(2.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes delivered (MB)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("GetDelta throughput vs baselines")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "throughput")
