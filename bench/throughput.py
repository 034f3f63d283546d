"""Benchmark 3: GetDelta throughput vs bare gRPC and raw loopback TCP.

A spool holds a base segment (every row of 4 tables, dim 64) plus two skewed delta segments;
a new consumer's window is therefore every row. For each window size and wire dtype one
consumer per dtype (a :class:`~deltad.consume.client.DeltaConsumer` in a client process, its channel
kept open as a predictor's is) pulls that window from ``deltad serve`` (another process)
again and again without committing, so every pull is the whole window: server merge (window
cache off) + stream + client rebuild into tensors. Delivered GB/s = payload bytes on the wire
(ids + values [+ int8 scale/bias]) / wall time of ``pull()``.

Baselines, measured in the same run for the same byte counts, interleaved with the GetDelta
pulls repeat by repeat (so both see the same background load) and after the same untimed
warm-up: (a) the bare gRPC stream of :mod:`bench.wire_baselines` at its best chunk size and channel
kind (default, or single-threaded unary-stream as deltad's consumer uses),
(b) raw loopback TCP. Every process (sidecar, client, baseline servers) runs with
:func:`deltad.perf.tune_malloc`, as deployed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import (
    DIM,
    GB,
    MB,
    TABLES,
    Children,
    Context,
    NotAvailable,
    PeakRssMonitor,
    consumer_config,
    med,
    pyplot,
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

WIRE_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def wire_bytes(rows: int, dim: int, dtype: str) -> int:
    """Payload bytes of ``rows`` rows on the wire (ids + values [+ scale/bias])."""
    per = 8 + dim * WIRE_ITEMSIZE[dtype] + (8 if dtype == "int8" else 0)
    return rows * per


def _bare(
    worker: ClientWorker, port: int, nbytes: int, chunk: int, single: bool, reuse: bool
) -> float:
    r = worker.call(
        "grpc", port=port, nbytes=nbytes, chunk=chunk, single_thread=single, reuse=reuse
    )
    return float(r["seconds"])


def _tcp(worker: ClientWorker, port: int, nbytes: int) -> float:
    return float(worker.call("tcp", port=port, nbytes=nbytes, chunk=4 * MB)["seconds"])


# ----------------------------------------------------------------------- client side (worker)


def client_pull(
    state: dict[Any, Any],
    endpoint: str,
    model: str,
    consumer: str,
    dtype: str,
    form: str = "rows",
    k: int = 0,
    max_step: int | None = None,
    start_at: float | None = None,
    keep: bool = False,
    commit: bool = False,
) -> dict[str, Any]:
    """Runs in the client worker: one consumer pulls its whole window once (and commits it
    with ``commit``: a later call of the same consumer starts from there).

    By default a fresh :class:`DeltaConsumer` (new channel) per call. With ``keep`` the
    consumer and its channel stay in ``state`` and the call pulls again without committing,
    so it gets the same whole window (at-least-once) over a warm connection, as a long-lived
    predictor does. With ``start_at`` (unix time) the pull starts then, after connecting:
    several workers started together pull at the same moment.
    """
    import time

    from deltad.config import PullOptions
    from deltad.consume.client import DeltaConsumer
    from deltad.perf import tune_malloc, tune_threads
    from deltad.types import Form, WireDtype

    tune_malloc()  # as `deltad consume` does at startup
    tune_threads()
    key = ("consumer", endpoint, consumer)
    c = state.get(key) if keep else None
    if c is None:
        pull = PullOptions(form=Form(form), k=k, wire_dtype=WireDtype(dtype), max_step=max_step)
        cfg = consumer_config(consumer, model, endpoint, pull=pull)
        c = DeltaConsumer(cfg).connect()
        if keep:
            state[key] = c
            state.setdefault("_close", []).append(c.close)
    elif (c.config.pull.max_step, c.config.pull.wire_dtype) != (max_step, WireDtype(dtype)):
        import dataclasses  # a kept consumer, pulling to another step or in another dtype now

        pull = dataclasses.replace(c.config.pull, max_step=max_step, wire_dtype=WireDtype(dtype))
        c.config = dataclasses.replace(c.config, pull=pull)
    try:
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        start_unix = time.time()
        res = c.pull()
        dt = time.perf_counter() - t0
        end_unix = time.time()
        rows = res.rows
        nbytes = res.bytes
        dense_bytes = res.dense_bytes
        if commit:
            c.commit(res)
        vals = sum(s.values.numel() for d in res.deltas for s in d.shards if s.values is not None)
        del res
    finally:
        if not keep:
            c.close()
    return {
        "seconds": dt,
        "bytes": nbytes,
        "dense_bytes": dense_bytes,  # part of "bytes"
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
    from deltad.consume import decode
    from deltad.types import WireDtype
    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(endpoint, options=opts) as ch:
        pb_grpc.DeltaServiceStub(ch).Register(pb.RegisterRequest(consumer=consumer), timeout=30)
        req = wire.request_from_options(consumer, PullOptions(wire_dtype=WireDtype(dtype)))
        asm = decode.WindowAssembler()
        t0 = time.perf_counter()
        first = None
        nbytes = 0
        for msg in decode.raw_get_delta(ch)(req, timeout=600):
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


def client_bootstrap_rss(
    state: dict[str, Any], endpoint: str, model: str, consumer: str
) -> dict[str, Any]:
    """Runs in a fresh client worker: one predictor's bootstrap (pull the base window, apply
    it into a :class:`~deltad.consume.appliers.TensorDictApplier`), with the process's RSS
    before and its peak (VmHWM, reset first through ``/proc/self/clear_refs``) during it."""
    import gc

    from bench.common import proc_status_bytes
    from deltad.config import PullOptions
    from deltad.consume.appliers import TensorDictApplier
    from deltad.consume.client import DeltaConsumer
    from deltad.perf import tune_malloc, tune_threads
    from deltad.types import WireDtype

    def status(key: str) -> int:
        return proc_status_bytes(key) or 0

    tune_malloc()
    tune_threads()
    cfg = consumer_config(consumer, model, endpoint, pull=PullOptions(wire_dtype=WireDtype.FP32))
    c = DeltaConsumer(cfg).connect()
    applier = TensorDictApplier()
    try:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # peak RSS := current RSS
        except OSError:
            pass
        before = status("VmRSS:")
        res = c.sync(applier.apply)
        peak = status("VmHWM:")
        tables = sum(t.nbytes for t in applier.tables().values())
        nbytes = res.bytes
        del res
    finally:
        c.close()
    return {"rss_before": before, "peak_rss": peak, "tables_bytes": tables, "bytes": nbytes}


def client_warm(state: dict[str, Any]) -> dict[str, Any]:
    """Runs in the client worker: import the consumer library before any timing."""
    import deltad.consume.client
    import deltad.wire  # noqa: F401

    return {}


# ----------------------------------------------------------------------- the benchmark


class _Probe:
    """One window size's measurements: GetDelta from ``worker``, baselines from
    ``base_worker`` (another process), interleaved."""

    def __init__(
        self,
        worker: ClientWorker,
        base_worker: ClientWorker,
        tcp_port: int,
        grpc_port: int,
        side: Any,
        counts: dict[str, int],
        chunks: list[int],
    ) -> None:
        self.worker, self.base_worker = worker, base_worker
        self.tcp_port, self.grpc_port, self.side = tcp_port, grpc_port, side
        self.counts = counts
        self.fp32 = counts["fp32"]
        self.chunks = chunks
        self.tcp_s: list[float] = []
        self.bare_s: dict[tuple[int, int, bool, bool], list[float]] = {}
        #: per byte count: (first, second) of one bare recipe run twice in a row (noise)
        self.noise_s: dict[int, list[tuple[float, float]]] = {}
        self.runs: dict[str, list[dict[str, Any]]] = {d: [] for d in counts}

    def pull(self, dtype: str, consumer: str) -> dict[str, Any]:
        return dict(
            self.worker.call(
                "call",
                module="bench.throughput",
                func="client_pull",
                kwargs={
                    "endpoint": self.side.endpoint,
                    "model": self.side.model,
                    "consumer": consumer,
                    "dtype": dtype,
                    "keep": True,
                },
            )
        )

    def baselines(self, record: bool = True) -> None:
        t = _tcp(self.base_worker, self.tcp_port, self.fp32)
        if record:
            self.tcp_s.append(t)
        for n in sorted(set(self.counts.values())):
            for c in self.chunks:
                for single in (False, True):
                    for reuse in (False, True):
                        t = _bare(self.base_worker, self.grpc_port, n, c, single, reuse)
                        if record:
                            self.bare_s.setdefault((n, c, single, reuse), []).append(t)
            # the noise of this run: the last recipe again, at once (two identical runs)
            again = _bare(self.base_worker, self.grpc_port, n, self.chunks[-1], True, True)
            if record:
                self.noise_s.setdefault(n, []).append((t, again))

    def getdelta(self, record: bool = True) -> None:
        if self.side is None:
            return
        for d in self.counts:
            res = self.pull(d, f"tput-{d}")
            if record:
                self.runs[d].append(res)

    def into(self, base: dict[str, Any]) -> None:
        base["tcp"][self.fp32] = summarize([self.fp32 / t / GB for t in self.tcp_s])
        for n in sorted(set(self.counts.values())):
            per = {
                f"{c}{'-st' if single else ''}{'-reuse' if reuse else ''}": summarize(
                    [n / t / GB for t in times]
                )
                for (m, c, single, reuse), times in self.bare_s.items()
                if m == n
            }
            base["grpc"][n] = per
            base.setdefault("grpc_noise", {})[n] = summarize(
                [b / a for a, b in self.noise_s.get(n, []) if a > 0]
            )
            best = max(per, key=lambda c: per[c]["median"] or 0.0)
            base["grpc_best"][n] = {
                "chunk_bytes": int(best.split("-")[0]),
                "variant": best,
                **per[best],
            }


def run(ctx: Context) -> dict[str, Any]:
    """Per window size: baselines and GetDelta pulls interleaved, repeat by repeat."""
    from bench import deltad_procs

    sizes = ctx.pick([64 * MB, 256 * MB, 1024 * MB], [16 * MB, 64 * MB], [4 * MB])
    dtypes = ctx.pick(["fp32", "fp16", "bf16", "int8"], ["fp32", "int8"], ["fp32"])
    chunks = ctx.pick([1 * MB, 2 * MB, 4 * MB], [1 * MB, 4 * MB], [1 * MB])
    repeats = ctx.repeats
    rows_for = {s: s // wire_bytes(1, DIM, "fp32") // TABLES * TABLES for s in sizes}
    top = max(wire_bytes(rows_for[s], DIM, "fp32") for s in sizes)
    base: dict[str, Any] = {"tcp": {}, "grpc": {}, "grpc_best": {}}
    result: dict[str, Any] = {
        "dim": DIM,
        "tables": TABLES,
        "window_sizes_bytes": sizes,
        "dtypes": dtypes,
        "baselines": base,
        "method": (
            "per window size, one client process; every repeat measures raw TCP, bare gRPC at "
            "every chunk size and a GetDelta per dtype back to back (order alternating), after "
            "one untimed warm-up of each; every process with deltad.perf.tune_malloc"
        ),
    }
    why = deltad_procs.sidecar_unavailable()
    points: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    with Children() as servers:
        tcp_conn, tcp_port, _ = start_server(servers, tcp_server_main, top)
        grpc_conn, grpc_port, _ = start_server(servers, grpc_server_main, top)
        for size in sizes:
            rows = rows_for[size]
            counts = {d: wire_bytes(rows, DIM, d) for d in ["fp32", *dtypes]}
            with ctx.tmpdir("tput") as spool, Children() as kids:
                # Two client processes: the baselines' buffers and deltad's tensors would
                # otherwise share (and fragment) one heap, each slowing the other.
                worker = ClientWorker(kids)
                base_worker = ClientWorker(kids)
                side = None
                mon = PeakRssMonitor().start()
                try:
                    if not why:
                        ctx.status(f"spool {size / MB:.0f} MB")
                        deltad_procs.write_bench_spool(spool, rows=rows, tables=TABLES, dim=DIM)
                        # Window cache off and no retention (which would merge the deltas into
                        # the base in the background): every pull pays merge + encode.
                        side = deltad_procs.start_sidecar(
                            kids,
                            spool,
                            ctx,
                            extra=["--window-cache-entries", "0", *deltad_procs.NO_RETENTION],
                        )
                        mon.watch("sidecar", side.proc.pid)
                    mon.watch("client", worker.proc.pid)
                    worker.call("call", module="bench.throughput", func="client_warm", kwargs={})
                    probe = _Probe(worker, base_worker, tcp_port, grpc_port, side, counts, chunks)
                    # Untimed warm-up of every path: the sidecar maps and faults in the fresh
                    # segment files once (as a long-running sidecar has), and the client's
                    # heap grows to its steady size (as a predictor's has after its base).
                    ctx.status(f"{size / MB:.0f} MB warm-up")
                    probe.baselines(record=False)
                    probe.getdelta(record=False)
                    for r in range(repeats):
                        ctx.status(f"{size / MB:.0f} MB repeat {r + 1}/{repeats}")
                        if r % 2 == 0:
                            probe.baselines()
                            probe.getdelta()
                        else:
                            probe.getdelta()
                            probe.baselines()
                    probe.into(base)
                    if side is not None:
                        points += [
                            _point(size, rows, d, probe.runs[d], base, counts["fp32"])
                            for d in dtypes
                        ]
                        if size == max(sizes):
                            ctx.status("GetDelta phases")
                            result["phases_fp32_largest"] = _phases(worker, side, repeats)
                finally:
                    worker.close()
                    base_worker.close()
                    if side is not None:
                        side.stop()
                    for k, v in mon.stop().items():
                        peaks[k] = max(peaks.get(k, 0), v)
        tcp_conn.close()
        grpc_conn.close()
    if why:
        raise NotAvailable(why, result)
    result["points"] = points
    result["peak_rss_bytes"] = peaks
    result["headline"] = _headline(points)
    return result


def _point(
    size: int,
    rows: int,
    dtype: str,
    runs: list[dict[str, Any]],
    base: dict[str, Any],
    tcp_key: int,
) -> dict[str, Any]:
    gbps = summarize([r["bytes"] / r["seconds"] / GB for r in runs])
    expect = wire_bytes(rows, DIM, dtype)
    g = base["grpc_best"].get(expect) or {}
    t = base["tcp"].get(tcp_key) or {}
    # Each repeat's pull against the best recipe's stream in the same repeat (interleaved, so
    # both saw the same background load): the median of these ratios is steadier than the
    # ratio of two medians when the load on the box changes between repeats.
    bare = g.get("samples") or []
    paired = [a / b for a, b in zip(gbps.get("samples") or [], bare, strict=False) if b]
    return {
        "window_bytes_fp32": size,
        "dtype": dtype,
        "rows": runs[0]["rows"],
        "wire_bytes": runs[0]["bytes"],
        "expected_wire_bytes": expect,
        "seconds": summarize([r["seconds"] for r in runs]),
        "gbps": gbps,
        # Rows delivered, counted at their fp32 size: what the predictor gets per second
        # whatever the wire dtype.
        "fp32_equiv_gbps": summarize(
            [wire_bytes(r["rows"], DIM, "fp32") / r["seconds"] / GB for r in runs]
        ),
        "rows_per_s": summarize([r["rows"] / r["seconds"] for r in runs]),
        "bare_grpc_gbps": med(g),
        "bare_grpc_chunk": g.get("chunk_bytes"),
        "tcp_gbps": med(t),
        "vs_bare_grpc": ratio(med(gbps), med(g)),
        "vs_bare_grpc_paired": summarize(paired),
        # two identical bare streams in a row, repeat by repeat: the run's own noise
        "bare_grpc_noise": (base.get("grpc_noise") or {}).get(expect),
        "vs_tcp": ratio(med(gbps), med(t)),
    }


def _phases(worker: ClientWorker, side: Any, repeats: int) -> dict[str, Any]:
    phases = [
        worker.call(
            "call",
            module="bench.throughput",
            func="client_decompose",
            kwargs={"endpoint": side.endpoint, "consumer": f"phases-{i}", "dtype": "fp32"},
        )
        for i in range(repeats)
    ]
    out: dict[str, Any] = {
        k: summarize([p[k] for p in phases if p[k] is not None])
        for k in ("first_s", "stream_s", "result_s", "total_s", "server_merge_s")
    }
    out["message_bytes"] = phases[0]["message_bytes"]
    return out


def _headline(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not points:
        return out
    largest = max(p["window_bytes_fp32"] for p in points)
    for p in points:
        if p["window_bytes_fp32"] != largest:
            continue
        gb = med(p["gbps"])
        paired = med(p["vs_bare_grpc_paired"])
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
                "noise": med(p.get("bare_grpc_noise")),
                "target": ">= 2 GB/s and >= 0.95x bare gRPC",
                # strict: both the ratio of medians and the median paired ratio must hold
                "met": bool(
                    gb and gb >= 2.0 and (p["vs_bare_grpc"] or 0) >= 0.95 and (paired or 0) >= 0.95
                ),
            }
        )
        out.append(
            {
                "metric": f"GetDelta {largest / MB:.0f} MB {p['dtype']} / bare gRPC, per repeat",
                "value": paired,
                "unit": "x (median of paired ratios)",
            }
        )
    tcp = [p["tcp_gbps"] for p in points if p["window_bytes_fp32"] == largest and p["tcp_gbps"]]
    if tcp:
        out.append({"metric": "raw loopback TCP (ceiling)", "value": max(tcp), "unit": "GB/s"})
    return out


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """GB/s vs window size: deltad per dtype, bare gRPC and TCP."""
    plt = pyplot()
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
