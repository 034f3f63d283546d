"""Benchmark: GetDelta at wire speed (issue 22 items 2, 3, 6), every figure a ratio measured
in one run, each next to a noise line (the same baseline measured twice).

Own spool: a base (every row of 4 tables, dim 64) and 16 deltas of 1 % skewed rows (``--deltas``); a
``deltad serve`` (no retention), a bare gRPC server (:mod:`bench.wire_baselines`: the same
bytes in messages of the sidecar's chunk size, built once), one client process each.

* **fp32**: a consumer pulls the whole base window (base + 16 deltas) in fp32, window cache
  off (every pull merges and encodes), against a bare gRPC stream of its bytes;
* **packed-int8**, cache off (every pull merges packed rows; the packed store is warm after
  the untimed warm-up) and cache on (the encoded window is reused): against a bare stream of
  *its* bytes; plus the first packed pull of a fresh sidecar (it packs the log once);
* **fp32, cache on**: the window built by an earlier pull (predictors at one cursor): the
  sidecar only hands its messages to gRPC, the bare server builds each (one copy) first;
* **prefetch off**: the uncached windows again from a sidecar with ``--prefetch-messages 0``
  (chunks built in gRPC's handler thread, no overlap of building and sending; the default
  with fewer than 4 usable cores) against one with ``3``, and the speed ratio prefetch on /
  off;
* **16 cursors** (own spool, a 128 MB base window): 16 consumers committed at seqs 0..15 pull
  to the head (16 distinct windows ``(i, 16]``, cache off, runs on) in fp32 and in
  packed-int8: the sidecar's CPU for the 16 int8 pulls over its CPU for the 16 fp32 pulls.

Noise: every bare stream is measured twice in a row (``bare`` and ``bare_again``), and the
fp32 cursor round twice; ``noise`` is their ratio. ``process_noise``: the bare stream over the
same stream from a second bare server process (same code): a process's speed on these 2 cores
depends on the process too (measured 0.37-0.51 CPU-s per GB for the bare server across
processes), which repeats within one process do not show. CPU: the sidecar's per GB of each pull and
the bare server's per GB of the first bare stream after it (``bare_server_cpu_s_per_gb``); with
the client on the same cores, speed follows the two sides' CPU together. The sidecar's own
split of it (its /metrics: ``deltad_window_build_cpu_seconds_total``,
``deltad_getdelta_stream_cpu_seconds_total``): building the messages, and the gRPC handler
thread's chunk loop, where gRPC copies and sends them (as the bare server's handler does).

``python -m bench.wire_speed [--quick] [--send-only] [--record]`` (results: bench/results/wire-speed.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    DELTAS,
    DIM,
    GB,
    MB,
    TABLES,
    Children,
    Context,
    CpuMonitor,
    machine_info,
    med,
    metric_sums,
    ratio,
    rows_per_table,
    summarize,
)
from bench.wire_baselines import ClientWorker, grpc_server_main, start_server

CHUNK = 2 * MB  # the sidecar's default --chunk-bytes


def _pull(
    w: ClientWorker, side: Any, consumer: str, dtype: str, keep: bool = True, **kw: Any
) -> dict[str, Any]:
    r: dict[str, Any] = w.call(
        "call", module="bench.throughput", func="client_pull",
        kwargs={"endpoint": side.endpoint, "model": side.model, "consumer": consumer,
                "dtype": dtype, "keep": keep, **kw},
    )  # fmt: skip
    return r


def _bare(w: ClientWorker, port: int, nbytes: int) -> float:
    r = w.call("grpc", port=port, nbytes=nbytes, chunk=CHUNK, single_thread=True, reuse=True)
    return float(r["seconds"])


def _paired(
    pull: dict[str, Any],
    w: ClientWorker,
    port: int,
    cpu: CpuMonitor | None,
    other_port: int | None = None,
) -> dict[str, float]:
    """One pull's figures with two bare streams of its bytes right after it (``cpu``: the
    bare server's, for the first of them), and one from the other bare server process
    (``other_port``): the same code in another process, whose speed differs by more than
    one process's repeats do."""
    nbytes = int(pull["bytes"])
    if cpu is not None:
        cpu.reset()
    a = _bare(w, port, nbytes)
    bare_cpu = cpu.seconds() if cpu is not None else float("nan")
    b = _bare(w, port, nbytes)
    row = {
        "bytes": nbytes,
        "pull_s": pull["seconds"],
        "bare_s": a,
        "bare_again_s": b,
        "vs_bare": a / pull["seconds"],
        "noise": b / a,
        "bare_server_cpu_s": bare_cpu,
    }
    if other_port is not None:
        c = _bare(w, other_port, nbytes)
        row["bare_other_s"] = c
        row["process_noise"] = a / c
    return row


#: the sidecar's own account of a pull's CPU (its /metrics): building the messages, and the
#: gRPC handler thread's chunk loop (handing them to gRPC, which copies and sends them)
_CPU_SPLIT = {
    "build": "deltad_window_build_cpu_seconds_total",
    "stream": "deltad_getdelta_stream_cpu_seconds_total",
}


def _timed(
    worker: ClientWorker, side: Any, consumer: str, dtype: str, cpu: CpuMonitor
) -> tuple[dict[str, Any], float]:
    """One pull, the sidecar's CPU for it, and (``r["cpu_split"]``) its own split of it."""
    before = metric_sums(side.metrics_port)
    cpu.reset()
    r = _pull(worker, side, consumer, dtype)
    seconds = cpu.seconds()
    after = metric_sums(side.metrics_port)
    r["cpu_split"] = {k: after.get(m, 0.0) - before.get(m, 0.0) for k, m in _CPU_SPLIT.items()}
    return r, seconds


def run(
    ctx: Context, send_only: bool = False, swap: bool = False, deltas: int = DELTAS
) -> dict[str, Any]:
    from bench import deltad_procs
    from bench.datagen import write_spool

    window = ctx.pick(1024 * MB, 256 * MB, 8 * MB)
    rows = rows_per_table(window)
    repeats = ctx.repeats
    out: dict[str, Any] = {"dim": DIM, "tables": TABLES, "deltas": deltas, "rows_per_table": rows}
    with ctx.tmpdir("wirespeed") as spool, Children() as kids:
        write_spool(
            spool, model=deltad_procs.MODEL, tables=TABLES, rows_per_table=rows, dim=DIM,
            deltas=deltas, delta_fraction=0.01,
        )  # fmt: skip
        bare_conn, bare_port, bare_pid = start_server(kids, grpc_server_main, 2 * window)
        bare_cpu = CpuMonitor(bare_pid)
        # (a second bare server process: the process-to-process noise line)
        other_conn, other_port, _ = start_server(kids, grpc_server_main, 2 * window)
        worker, base_worker = ClientWorker(kids), ClientWorker(kids)
        worker.call("call", module="bench.throughput", func="client_warm", kwargs={})
        configs = ["off", "off_noprefetch"] + ([] if send_only else ["on"])
        if swap:  # (the two uncached sidecars in the other order: load drifts over a run)
            configs[:2] = configs[1::-1]
        for cache in configs:
            extra = list(deltad_procs.NO_RETENTION)
            if cache.startswith("off"):
                extra += ["--window-cache-entries", "0"]
            else:  # (room for both windows: the 1 GB fp32 one is over the default budget)
                extra += ["--window-cache-bytes", str(3 * window)]
            # (prefetch explicitly on or off: its default depends on the cores here)
            extra += ["--prefetch-messages", "0" if cache.endswith("noprefetch") else "3"]
            side = deltad_procs.start_sidecar(kids, spool, ctx, extra=extra, metrics=True)
            cpu = CpuMonitor(side.proc.pid)
            try:
                ctx.status(f"wire speed, window cache {cache}: warm-up")
                # the first packed pull of this sidecar packs the log's rows (once)
                first, first_cpu = _timed(worker, side, f"{cache}-p8", "packed-int8", cpu)
                _pull(worker, side, f"{cache}-fp32", "fp32")
                _bare(base_worker, bare_port, int(first["bytes"]))
                _bare(base_worker, other_port, int(first["bytes"]))
                res: dict[str, list[dict[str, float]]] = {"fp32": [], "packed-int8": []}
                for r in range(repeats):
                    ctx.status(f"wire speed, window cache {cache}: repeat {r + 1}/{repeats}")
                    order = ["fp32", "packed-int8"] if r % 2 == 0 else ["packed-int8", "fp32"]
                    for dtype in order:
                        tag = "p8" if dtype == "packed-int8" else "fp32"
                        p, c = _timed(worker, side, f"{cache}-{tag}", dtype, cpu)
                        row = _paired(p, base_worker, bare_port, bare_cpu, other_port)
                        row["sidecar_cpu_s"] = c
                        for k, v in p["cpu_split"].items():
                            row[f"sidecar_{k}_cpu_s"] = v
                        res[dtype].append(row)
                out[f"cache_{cache}"] = {
                    "first_packed_pull": {
                        "seconds": first["seconds"], "bytes": first["bytes"],
                        "sidecar_cpu_s": first_cpu,
                    },
                    **{d: _summary(v) for d, v in res.items()},
                }  # fmt: skip
            finally:
                side.stop()
        # 16 cursors: an own, smaller spool (16 kept consumers hold a base window each)
        if send_only:
            worker.close()
            base_worker.close()
            bare_conn.close()
            other_conn.close()
            out["headline"] = _headline(out)
            return out
        cur_window = ctx.pick(128 * MB, 64 * MB, 4 * MB)
        with ctx.tmpdir("wirespeed-cursors") as cur_spool:
            write_spool(
                cur_spool, model=deltad_procs.MODEL, tables=TABLES,
                rows_per_table=rows_per_table(cur_window), dim=DIM, deltas=DELTAS,
                delta_fraction=0.01,
            )  # fmt: skip
            extra = [*deltad_procs.NO_RETENTION, "--window-cache-entries", "0"]
            side = deltad_procs.start_sidecar(kids, cur_spool, ctx, extra=extra)
            try:
                out["cursors"] = _cursors(ctx, worker, side, CpuMonitor(side.proc.pid))
                out["cursors"]["window_bytes_fp32"] = cur_window
            finally:
                side.stop()
        worker.close()
        base_worker.close()
        bare_conn.close()
        other_conn.close()
    out["headline"] = _headline(out)
    return out


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "bytes": rows[0]["bytes"],
        "samples": rows,
        "vs_bare": summarize([r["vs_bare"] for r in rows]),
        "noise": summarize([r["noise"] for r in rows]),
        "process_noise": summarize([r["process_noise"] for r in rows if "process_noise" in r]),
        "gbps": summarize([r["bytes"] / r["pull_s"] / GB for r in rows]),
        "sidecar_cpu_s_per_gb": summarize([r["sidecar_cpu_s"] / (r["bytes"] / GB) for r in rows]),
        **{
            f"sidecar_{k}_cpu_s_per_gb": summarize(
                [r[f"sidecar_{k}_cpu_s"] / (r["bytes"] / GB) for r in rows]
            )
            for k in _CPU_SPLIT
        },
        "bare_server_cpu_s_per_gb": summarize(
            [r["bare_server_cpu_s"] / (r["bytes"] / GB) for r in rows]
        ),
    }


def _cursors(ctx: Context, worker: ClientWorker, side: Any, cpu: CpuMonitor) -> dict[str, Any]:
    """16 consumers committed at seqs 0..15, then each pulls to the head (not committing, so
    every round pulls the same 16 windows ``(i, 16]``): sidecar CPU per round and dtype."""
    names = [f"cur-{i}" for i in range(DELTAS)]
    for i, n in enumerate(names):  # (untimed) each consumer to its cursor, committed
        _pull(worker, side, n, "fp32", max_step=i * 10, commit=True)
    rounds: dict[str, list[float]] = {"fp32": [], "packed-int8": [], "fp32_again": []}
    bytes_: dict[str, int] = {}
    for r in range(ctx.repeats + 1):
        for key in ("fp32", "packed-int8", "fp32_again"):
            ctx.status(f"16 cursors: {key} round {r + 1}")
            dtype = "fp32" if key.startswith("fp32") else key
            cpu.reset()
            got = [_pull(worker, side, n, dtype) for n in names]
            if r == 0:
                continue  # warm-up: runs merged, packed rows made, pages touched
            rounds[key].append(cpu.seconds())
            bytes_[key] = sum(int(g["bytes"]) for g in got)
    return {
        "sidecar_cpu_s": {k: summarize(v) for k, v in rounds.items()},
        "bytes": bytes_,
        "int8_vs_fp32_cpu": [
            a / b for a, b in zip(rounds["packed-int8"], rounds["fp32"], strict=True)
        ],
        "noise": [a / b for a, b in zip(rounds["fp32_again"], rounds["fp32"], strict=True)],
    }


#: the sidecars measured (keys of the results) as the headline names them; packed windows are
#: never prefetched (:meth:`deltad.serve.windows.getdelta.WindowServer._chunks`)
_CONFIGS = {
    "cache_off": "off, prefetch 3",
    "cache_off_noprefetch": "off, prefetch off (the default with < 4 cores)",
    "cache_on": "on",
}


def _headline(out: dict[str, Any]) -> list[dict[str, Any]]:
    def cell(key: str, dtype: str) -> dict[str, Any]:
        s = out[key][dtype]
        return {
            "what": f"GetDelta {dtype}, window cache {_CONFIGS[key]}: x bare gRPC of its bytes",
            "ratio": med(s["vs_bare"]),
            "noise": med(s["noise"]),
            # the bare server over the same code in another process: how much its speed
            # depends on the process (memory placement, caches) rather than on the code
            "process_noise": med(s["process_noise"]),
            "process_noise_range": [s["process_noise"].get("min"), s["process_noise"].get("max")],
            "sidecar_cpu_s_per_gb": med(s["sidecar_cpu_s_per_gb"]),
            # of which building the messages / the gRPC handler's chunk loop (sending; building
            # too without prefetch and for packed windows)
            "sidecar_build_cpu_s_per_gb": med(s["sidecar_build_cpu_s_per_gb"]),
            "sidecar_stream_cpu_s_per_gb": med(s["sidecar_stream_cpu_s_per_gb"]),
            "bare_server_cpu_s_per_gb": med(s["bare_server_cpu_s_per_gb"]),
        }

    rows = [cell("cache_off", "fp32"), cell("cache_off", "packed-int8")]
    rows += [cell("cache_off_noprefetch", "fp32"), cell("cache_off_noprefetch", "packed-int8")]
    for dtype in ("fp32", "packed-int8"):
        on, off = out["cache_off"][dtype], out["cache_off_noprefetch"][dtype]
        rows.append(
            {
                "what": f"GetDelta {dtype}, window cache off: prefetch on / off (speed)",
                "ratio": ratio(med(on["vs_bare"]), med(off["vs_bare"])),
                "noise": med(on["noise"]),
            }
        )
    if "cache_on" not in out:
        return rows
    rows.append(cell("cache_on", "fp32"))  # (a window built before: gRPC's copy and send)
    rows.append(cell("cache_on", "packed-int8"))
    cur = out["cursors"]
    cpu = cur["sidecar_cpu_s"]
    rows.append(
        {
            "what": "16 cursors: sidecar CPU packed-int8 / fp32",
            "ratio": ratio(med(cpu["packed-int8"]), med(cpu["fp32"])),
            "noise": ratio(med(cpu["fp32_again"]), med(cpu["fp32"])),
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire_speed", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a 256 MB window (else 1 GB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", action="store_true", help="write bench/results/wire-speed.json")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument(
        "--prefetch-off-first", action="store_true", help="the prefetch-off sidecar first"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--deltas",
        type=int,
        default=DELTAS,
        help=f"deltas of 1 %% after the base of the pulled windows (default {DELTAS}; 0: the "
        "base alone, as right after retention folded them in)",
    )
    p.add_argument(
        "--send-only",
        action="store_true",
        help="only the uncached windows, prefetch on and off (no cache-on, no 16 cursors)",
    )
    a = p.parse_args(argv)
    if not 0 <= a.deltas <= 64:
        p.error("--deltas must be in [0, 64]")
    ctx = Context(quick=a.quick, repeats=a.repeats)
    if a.work_dir is not None:
        ctx.work_dir = a.work_dir
    ctx.status = lambda msg: print(msg, file=sys.stderr, flush=True)
    t0 = time.time()
    result = run(ctx, send_only=a.send_only, swap=a.prefetch_off_first, deltas=a.deltas)
    result["machine"] = machine_info()
    result["seconds"] = time.time() - t0
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    source = f"python -m bench.wire_speed {argv_text} ({result['date']})"
    text = json.dumps({"source": source, "result": result}, indent=1, default=str)
    if a.out is not None:
        a.out.write_text(text)
    if a.record:
        path = Path(__file__).parent / "results" / "wire-speed.json"
        path.write_text(text)
    for h in result["headline"]:
        print(json.dumps(h))
    return 0


if __name__ == "__main__":
    sys.exit(main())
