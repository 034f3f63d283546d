"""A live deltad pipeline for the freshness and fidelity benchmarks.

Starts the real processes (``deltad train`` with world size 1, ``deltad serve``, and any
number of ``deltad consume`` predictors), lets them run for a bounded time, stops them all and
returns what they logged: the predictors' JSON lines, the segment headers left in the spool
(retention is switched off so every segment stays readable) and peak RSS of each role.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import Children, Context, PeakRssMonitor, deltad_command, wait_until
from bench.deltad_procs import MODEL, start_sidecar


@dataclass
class TrainerSpec:
    """The reference trainer's size and publishing for a live run."""

    tables: int = 4
    rows: int = 100_000
    dim: int = 32
    batch_size: int = 1024
    publish_every_seconds: float = 1.0
    duration_s: float = 20.0


@dataclass
class ConsumerSpec:
    """One ``deltad consume`` predictor."""

    name: str
    args: list[str] = field(default_factory=list)  # e.g. ["--form", "topk", "--k", "100"]
    interval_s: float = 0.1


@dataclass
class LiveResult:
    """What a live run left behind."""

    spool: Path
    pulls: dict[str, list[dict[str, Any]]]
    final_tables: dict[str, Path]
    trainer_tables: Path
    trainer_result: dict[str, Any]
    segments: list[dict[str, Any]]  # rank 0 headers: seq, step, created_unix, kind, rows
    peak_rss_bytes: dict[str, int]
    started_unix: float
    trainer_end_unix: float


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def segment_headers(spool: Path, model: str = MODEL) -> list[dict[str, Any]]:
    """Headers of every rank-0 segment of the newest generation, by seq."""
    from deltad.segment.format import read_header
    from deltad.segment.spool import SpoolLayout

    layout = SpoolLayout(spool, model)
    gen = layout.latest_generation()
    if gen is None:
        return []
    out = []
    for seq, path in layout.segments(gen, 0):
        h = read_header(path)
        out.append(
            {
                "seq": seq,
                "first_seq": h.first_seq,
                "step": h.step,
                "created_unix": h.created_unix,
                "kind": h.kind.value,
                "rows": sum(c.count for c in h.shards),
                "path": str(path),
            }
        )
    return out


def tables_at_step(spool: Path, step: int, model: str = MODEL) -> dict[str, torch.Tensor]:
    """The trainer's tables right after ``step``, rebuilt from the spool's segments."""
    from deltad.segment.format import apply_segments, read_segment

    tables: dict[str, torch.Tensor] = {}
    for h in segment_headers(spool, model):
        if h["step"] > step:
            break
        apply_segments(tables, [read_segment(Path(h["path"]), verify=False)])
    return tables


def run_live(
    ctx: Context,
    work: Path,
    trainer: TrainerSpec,
    consumers: list[ConsumerSpec],
    *,
    tail_s: float = 3.0,
    startup_s: float = 10.0,
) -> LiveResult:
    """Trainer + sidecar + predictors; everything stopped after.

    The trainer runs ``trainer.duration_s + startup_s``: the predictors need a few seconds to
    start and apply the base, so ``duration_s`` is about the steady part of the run.
    """
    spool = work / "spool"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    trainer_tables = work / "trainer-final.pt"
    trainer_json = work / "trainer-result.json"
    mon = PeakRssMonitor().start()
    started = time.time()
    with Children() as kids:
        targs = [
            *deltad_command(),
            "train",
            "--world-size", "1",
            "--spool", str(spool),
            "--model", MODEL,
            "--tables", str(trainer.tables),
            "--rows", str(trainer.rows),
            "--dim", str(trainer.dim),
            "--sharding", "tw",
            "--batch-size", str(trainer.batch_size),
            "--duration", str(trainer.duration_s + startup_s),
            "--publish-every-seconds", str(trainer.publish_every_seconds),
            "--final-tables", str(trainer_tables),
            "--result-json", str(trainer_json),
            "--no-progress",
        ]  # fmt: skip
        tproc = kids.popen(targs, log_path=logs / "deltad.reference.trainer.log")
        mon.watch("trainer", tproc.pid)
        # The sidecar starts alongside the trainer and indexes the spool once it appears.
        side = start_sidecar(
            kids,
            spool,
            ctx,
            extra=["--retention-interval", "1000000", "--poll-interval", "0.02"],
            require_head=False,
        )
        mon.watch("sidecar", side.proc.pid)
        cprocs = {}
        finals = {}
        for c in consumers:
            finals[c.name] = work / f"{c.name}-final.pt"
            cargs = [
                *deltad_command(),
                "consume",
                "--consumer", c.name,
                "--model", MODEL,
                "--sidecar", side.endpoint,
                "--interval", str(c.interval_s),
                "--json-log", str(logs / f"{c.name}.jsonl"),
                "--final-tables", str(finals[c.name]),
                *c.args,
            ]  # fmt: skip
            cprocs[c.name] = kids.popen(cargs, log_path=logs / f"{c.name}.log")
            mon.watch(f"predictor:{c.name}", cprocs[c.name].pid)
        ok = wait_until(
            lambda: tproc.poll() is not None or bool(segment_headers(spool)), 180.0, 0.2
        )
        if not ok or (tproc.poll() is not None and tproc.returncode != 0):
            raise RuntimeError(
                "deltad train did not publish a base segment:\n"
                + (logs / "deltad.reference.trainer.log").read_text(errors="replace")[-3000:]
            )
        budget = trainer.duration_s + 240.0
        wait_until(lambda: tproc.poll() is not None, budget, 0.2)
        trainer_end = time.time()
        if tproc.poll() is None:
            kids.stop_popen(tproc)
        # Let the predictors pick up the final segment, then stop them (SIGTERM: they save).
        time.sleep(tail_s)
        for p in cprocs.values():
            kids.stop_popen(p, timeout=60)
        side.stop()
        peaks = mon.stop()
    result: dict[str, Any] = {}
    try:
        result = json.loads(trainer_json.read_text())
    except (OSError, ValueError):
        result = {
            "error": (logs / "deltad.reference.trainer.log").read_text(errors="replace")[-2000:]
        }
    segs = segment_headers(spool)
    if segs:  # training ended at the last cut (the trainer process still gathers and saves)
        trainer_end = min(trainer_end, max(h["created_unix"] for h in segs))
    return LiveResult(
        spool=spool,
        pulls={
            c.name: [r for r in _read_jsonl(logs / f"{c.name}.jsonl") if r.get("event") == "pull"]
            for c in consumers
        },
        final_tables={k: v for k, v in finals.items() if v.exists()},
        trainer_tables=trainer_tables,
        trainer_result=result,
        segments=segs,
        peak_rss_bytes=peaks,
        started_unix=started,
        trainer_end_unix=trainer_end,
    )


#: The smoke test's single live run, shared by the freshness and fidelity benchmarks.
TINY_PUBLISH_S = 0.5


def tiny_shared_run(ctx: Context) -> LiveResult:
    """One small live run for both freshness and fidelity under ``--tiny`` (memoized)."""
    import shutil
    import tempfile

    hit = ctx.cache.get("tiny_live")
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    work = Path(tempfile.mkdtemp(prefix="deltad-bench-tinylive-", dir=ctx.work_dir))
    ctx.cleanups.append(lambda: shutil.rmtree(work, ignore_errors=True))
    spec = TrainerSpec(
        tables=2,
        rows=2_000,
        dim=8,
        batch_size=64,
        publish_every_seconds=TINY_PUBLISH_S,
        duration_s=3.0,
    )
    consumers = [
        ConsumerSpec("fresh", ["--form", "rows"], 0.1),
        ConsumerSpec("rows-fp32", ["--form", "rows", "--dtype", "fp32"], TINY_PUBLISH_S),
        ConsumerSpec("rows-int8", ["--form", "rows", "--dtype", "int8"], TINY_PUBLISH_S),
        ConsumerSpec("topk16-fp32", ["--form", "topk", "--k", "16"], TINY_PUBLISH_S),
    ]
    ctx.status("tiny live run (shared by freshness and fidelity)")
    live = run_live(ctx, work, spec, consumers, tail_s=1.0, startup_s=4.0)
    ctx.cache["tiny_live"] = live
    ctx.cache["tiny_live_spec"] = spec
    return live
