"""``deltad bench`` / ``python -m bench.run``: run the benchmark suite, write JSON and plots.

Each benchmark is a module of this package with ``run(ctx) -> dict`` and optionally
``plot(result, out_dir) -> list[Path]``. A benchmark whose deltad component is missing
reports ``status: "not available: <why>"``; one that fails reports ``status: "error: ..."``
and the others still run. Results go to ``<out>/results.json`` (and a timestamped copy).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    RESULTS_DIR,
    Context,
    NotAvailable,
    machine_info,
    self_peak_rss,
)
from deltad.config import Range

MALLOC_TUNING = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_ARENA_MAX": "1",
}

#: name -> (module, one-line description). Order is the run order: baselines first.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "merge": ("bench.merge", "window merge time vs ids and segments, vs torch.unique"),
    "throughput": (
        "bench.throughput",
        "GetDelta GB/s per window size and wire dtype, vs bare gRPC and raw TCP",
    ),
    "gendiff": ("bench.gendiff", "trainer restart: generation diff vs full resync, bytes and time"),
    "fanout": ("bench.fanout", "1-16 consumers, same / different windows: throughput, CPU"),
    "sidecar_mem": (
        "bench.sidecar_mem",
        "sidecar RSS vs log + cache; spilled bootstraps; encode-once",
    ),
    "tracking": (
        "bench.tracking",
        "training-step overhead: deltad tracker+publisher vs none vs torchrec's tracker",
    ),
    "stall": ("bench.stall", "publish stall per segment and background write rate vs size"),
    "timed_publish": (
        "bench.timed_publish",
        "publishing every 0.5 s at world size 2 vs --no-publish: on-loop %, extra CPU %",
    ),
    "freshness": ("bench.freshness", "trainer step -> predictor serving it: p50/p99 lag"),
    "fidelity": ("bench.fidelity", "bytes per predictor-hour vs row error, rows/top-k/dtypes"),
    "bootstrap_mem": (
        "bench.bootstrap_mem",
        "predictor bootstrap peak RSS / tables, assembled vs streamed",
    ),
    "serving": (
        "bench.serving",
        "int8 serving model: forward p50/p99 under apply vs idle; apply rows/s vs bare fbgemm",
    ),
    "zch": (
        "bench.zch",
        "managed-collision tables: identity bytes per step vs the whole remapper; apply cost",
    ),
}


#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {"repeats": Range(0, 1000, note="0 = the preset")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``deltad bench`` flags."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (~minutes)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="smallest sizes, one repeat (the smoke test; numbers are meaningless)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only these benchmarks (repeatable or comma-separated): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument("--repeats", type=int, default=0, help="repeats per point (0: preset)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output dir")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="scratch dir for spools (default: $TMPDIR); needs ~3 GB free for the full run",
    )
    parser.add_argument(
        "--malloc-tuned",
        action="store_true",
        help="run every process with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4G MALLOC_ARENA_MAX=1 "
        "(the allocator setting of deltad.perf.tune_malloc for large buffers)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--record",
        action="store_true",
        help="also write each finished benchmark to bench/results/<name>.json (committed; "
        "python -m bench.plots draws bench/figures from them)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _selected(only: list[str]) -> list[str]:
    names: list[str] = []
    for item in only:
        names.extend(n.strip() for n in item.split(",") if n.strip())
    if not names:
        return list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"deltad bench: unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    return [n for n in BENCHMARKS if n in names]


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None, tuples lists, paths strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; return 1 if any of them errored, else 0."""
    from tqdm import tqdm

    from deltad.errors import ConfigError

    if args.repeats < 0:
        raise ConfigError(f"--repeats must be >= 0 (0: the preset), not {args.repeats}")
    if args.record and args.tiny:
        raise ConfigError("--record keeps results for the README: not with --tiny")
    names = _selected(args.only)

    def on_term(signum: int, frame: Any) -> None:
        # Unwind normally so that every benchmark's Children context stops its processes.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if args.malloc_tuned:  # inherited by every child (spawned workers and deltad processes)
        os.environ.update(MALLOC_TUNING)
    quick = bool(args.quick or args.tiny)
    repeats = args.repeats or (1 if args.tiny else 2 if quick else 3)
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = args.work_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    work_dir.mkdir(parents=True, exist_ok=True)

    bar = tqdm(names, desc="deltad bench", unit="bench", disable=args.no_progress, file=sys.stderr)

    def log(msg: str) -> None:
        tqdm.write(msg, file=sys.stderr)

    def status(msg: str) -> None:
        bar.set_postfix_str(msg[:60], refresh=True)

    ctx = Context(
        quick=quick,
        tiny=bool(args.tiny),
        repeats=repeats,
        out_dir=out_dir,
        work_dir=work_dir,
        log=log,
        status=status,
    )
    meta = _meta(ctx, selected=names)
    meta["malloc_env"] = {k: os.environ[k] for k in MALLOC_TUNING if k in os.environ}
    preset = meta["preset"]
    results: dict[str, Any] = {"meta": meta, "benchmarks": {}}
    failed = False
    for name in bar:
        bar.set_description(f"bench {name}")
        module, _ = BENCHMARKS[name]
        t0 = time.monotonic()
        res: dict[str, Any]
        try:
            mod = importlib.import_module(module)
            res = {"status": "ok", **mod.run(ctx)}
        except NotAvailable as e:
            res = {"status": f"not available: {e}", **e.partial}
        except Exception as e:
            failed = True
            res = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["wall_seconds"] = time.monotonic() - t0
        results["benchmarks"][name] = res
        log(f"[{name}] {res['status']} ({res['wall_seconds']:.1f}s)")
        if res["status"] == "ok" and not args.no_plots:
            try:
                mod = importlib.import_module(module)
                if hasattr(mod, "plot"):
                    res["plots"] = [str(p) for p in mod.plot(res, out_dir)]
            except Exception as e:  # a plot must never lose the numbers
                res["plot_error"] = f"{type(e).__name__}: {e}"
        _write(results, out_dir)
        if args.record and res["status"] == "ok":
            record(name, res, results["meta"])
    for cleanup in ctx.cleanups:
        try:
            cleanup()
        except Exception as e:
            log(f"cleanup failed: {e}")
    results["meta"]["loadavg_end"] = os.getloadavg()
    results["meta"]["harness_peak_rss_bytes"] = self_peak_rss()
    results["meta"]["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = _write(results, out_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out_dir / f"results-{preset}-{stamp}.json").write_text(path.read_text())
    print(f"deltad bench: results in {path}")
    from bench.report import summary_lines

    for line in summary_lines(results):
        print(line)
    return 1 if failed else 0


def record(
    name: str, result: dict[str, Any], meta: dict[str, Any], results_dir: Path = RESULTS_DIR
) -> Path:
    """Write one benchmark's result as ``results_dir/<name>.json`` (``{"source", "meta",
    "result"}``): the recorded data that bench/README.md quotes and bench.plots draws."""
    results_dir.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "loadavg_recorded": os.getloadavg()}
    meta["recorded_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc = {"source": f"deltad bench --record ({meta.get('preset')})", "meta": meta}
    doc["result"] = {k: v for k, v in result.items() if k != "plots"}
    path = results_dir / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def run_part(
    prog: str,
    doc: str | None,
    name: str,
    fn: Callable[[Context], dict[str, Any]],
    report: Callable[[dict[str, Any]], None],
    argv: list[str] | None,
) -> int:
    """``python -m bench.<part>``: one part of a benchmark alone (``fn(ctx)``), written to
    ``--out/<name>.json``; with ``--record`` to ``bench/results/<name>.json`` too; then
    ``report(result)`` prints its figures."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--quick", action="store_true", help="the quick preset's sizes")
    parser.add_argument("--tiny", action="store_true", help="smoke size")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per configuration")
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--record", action="store_true", help="write bench/results/")
    args = parser.parse_args(argv)
    if args.record and args.tiny:
        parser.error("--record keeps results for the README: not with --tiny")
    ctx = Context(
        quick=args.quick or args.tiny, tiny=args.tiny, repeats=args.repeats,
        out_dir=args.out, work_dir=args.work_dir,
    )  # fmt: skip
    meta = _meta(ctx, command=f"{prog} " + " ".join(argv or []))
    t0 = time.monotonic()
    res = {"status": "ok", **fn(ctx), "wall_seconds": 0.0}
    res["wall_seconds"] = time.monotonic() - t0
    meta["loadavg_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(_clean({"meta": meta, "result": res})))
    if args.record:
        print(record(name, res, meta))
    report(res)
    return 0


def _meta(ctx: Context, **more: Any) -> dict[str, Any]:
    """What a results file says of its run: the machine, the preset, the repeats, ``more``."""
    preset = "tiny" if ctx.tiny else "quick" if ctx.quick else "full"
    return {**machine_info(), "preset": preset, "repeats": ctx.repeats, **more}


def _write(results: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_clean(results), indent=2, sort_keys=False))
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.run``."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
