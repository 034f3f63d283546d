"""`deltad demo`: the whole loop on this machine, with a report and checks.

It starts an embedded Redis, the reference trainer (``deltad train``: gloo ranks, a small
DLRM, Zipf traffic, mixed sharding types), one ``deltad serve`` per rank and three predictors
(``deltad consume``: rows/fp32, top-k/int8, and serving-int8: a torchrec int8-quantized
ClickModel answering forwards while it syncs, pulling rows packed in its tables' layout
(packed-int8) and the trainer's dense state), all as subprocesses with logs in the work
directory. When training ends, the predictors catch up with the final head, stop, and write
their tables; the demo then checks

* the rows/fp32 predictor's tables are bit-equal to the trainer's final tables;
* the top-k/int8 predictor, once no rows are owed, is within the int8 row-wise rounding
  bound of the trainer's final tables: ``|served - trained| <= (row max - row min + 1e-8) / 510``
  per row (plus float32 rounding of code * scale + bias);
* the serving-int8 predictor's weights (every table byte and the dense parameters and
  buffers) and its forward output on a fixed batch are bit-equal to the trainer's final
  model (``deltad train --final-model``: its tables and dense state) quantized by torchrec
  (``quantize_embeddings``);
* ``serving-zch``: that predictor's managed-collision table (the reference model's ``zch``,
  served by torchrec's ``QuantManagedCollisionEmbeddingBagCollection``): its rows, its
  remapper's lookup buffers and the embeddings it serves for raw ids it holds, raw ids evicted
  during the run and raw ids never seen (its exit probe) are bit-equal to the same model's.

Exit 0 only if all hold; otherwise one line on stderr and exit 1. Every child is stopped on
exit or Ctrl-C (SIGTERM, a bounded wait, then SIGKILL).

:class:`Demo` runs the loop; the work directory and the children are
:mod:`deltad.demo_procs`, the predictors' logs and the traffic table :mod:`deltad.demo_report`,
the checks :mod:`deltad.demo_checks`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from deltad import output
from deltad.config import MAX_COUNT, MAX_SECONDS, Range
from deltad.demo_checks import SERVING, TABLES, ZCH, run_checks
from deltad.demo_procs import (
    Child,
    Children,
    DemoFailed,
    WorkDir,
    terminate_as_interrupt,
    wait_serving,
)
from deltad.demo_report import PredictorLog, Report, traffic_lines

__all__ = ["MODEL", "SERVING", "TABLES", "ZCH", "Demo", "DemoFailed", "PredictorLog", "run"]

MODEL = "demo"


#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {
    "duration": Range(0, MAX_SECONDS, lo_open=True),
    "rows": Range(1, MAX_COUNT),
    "dim": Range(1, 1 << 16),
    "world_size": Range(1, 64),
    "publish_every": Range(0, 3600, lo_open=True),
    "pull_interval": Range(0, 3600, lo_open=True),
    "topk_fraction": Range(0, 1, lo_open=True),
    "settle_timeout": Range(0, MAX_SECONDS, lo_open=True),
}


#: The defaults of the flags that ``--scenario bad-update`` (a fixed shape) refuses when given:
#: their argparse default is None (not given), filled in from here by :func:`check_args`.
DEFAULTS: dict[str, int | float] = {
    "duration": 60.0,
    "world_size": 2,
    "publish_every": 0.5,
    "topk_fraction": 0.5,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `deltad demo`."""

    def default(dest: str) -> str:
        return f" (default: {DEFAULTS[dest]:g}; not with --scenario bad-update)"

    p.add_argument("--duration", type=float, help="seconds of training" + default("duration"))
    p.add_argument("--rows", type=int, default=20_000, help="rows per table")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--world-size", type=int, help="trainer ranks" + default("world_size"))
    p.add_argument(
        "--publish-every", type=float, help="seconds between segments" + default("publish_every")
    )
    p.add_argument("--pull-interval", type=float, default=0.1, help="predictor pull interval")
    p.add_argument(
        "--topk-fraction", type=float, help="top-k predictor fraction" + default("topk_fraction")
    )
    p.add_argument("--settle-timeout", type=float, default=60.0, help="catch-up limit (s)")
    p.add_argument(
        "--workdir",
        type=Path,
        help="spool, logs, tables: a new or an empty directory (default: a temp dir)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--scenario",
        choices=("default", "bad-update", "silent-bad-update"),
        default="default",
        help="bad-update: a NaN step, the validation gate, a canary and a rollback "
        "(deltad.demo_rollout), at a fixed shape (2 ranks, 40 steps, a segment every 2 steps, "
        "no top-k predictor): it takes --rows, --dim, --pull-interval, --settle-timeout, "
        "--workdir and --keep, and refuses --duration, --world-size, --publish-every and "
        "--topk-fraction; silent-bad-update: flipped labels, the canary evaluator holds and "
        "rolls back (deltad.demo_quality; the same flags); default: the whole loop, with its "
        "report and checks",
    )


def check_args(args: argparse.Namespace) -> None:
    """ConfigError (one line, exit 2, before anything starts) for a flag the scenario cannot
    honour; then the defaults of the flags left out (:data:`DEFAULTS`)."""
    if getattr(args, "scenario", "default") == "bad-update":
        from deltad.demo_rollout import check_flags

        check_flags(args)
    if getattr(args, "scenario", "default") == "silent-bad-update":
        from deltad.demo_quality import check_flags as check_quality_flags

        check_quality_flags(args)
    for dest, value in DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


class Demo:
    """Runs the whole loop: starts the children, follows training, lets the predictors
    settle, and writes the report with its checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.predictors: list[str] = []
        self.dir = WorkDir(args.workdir, args.keep)
        self.work, self.spool, self.logs = self.dir.path, self.dir.spool, self.dir.logs
        self.children = Children(self.work, self.logs)
        #: the children's environment (see :class:`Children`)
        self.env = self.children.env

    def discard(self, *, keep_logs: bool = False) -> str:
        """Remove the temporary work directory after an early end (see :class:`WorkDir`)."""
        return self.dir.discard(keep_logs=keep_logs)

    def run(self) -> int:
        from deltad.redisutil import EmbeddedRedis

        a = self.args
        t_start = time.monotonic()
        output.line(
            f"deltad demo: {a.world_size} ranks, {a.duration:.0f}s of training; logs in {self.logs}"
        )
        redis = EmbeddedRedis(self.work / "redis")
        url = redis.start()
        # The URL holds the offset store's password: children get it in their environment,
        # never on a command line (where `ps` shows it).
        self.env["DELTAD_REDIS_URL"] = url
        try:
            trainer = self.children.spawn("trainer", self.trainer_argv())
            sidecars = [
                self.children.spawn(f"sidecar-{r}", self.serve_argv(r)) for r in range(a.world_size)
            ]
            endpoints = [wait_serving(s) for s in sidecars]
            preds = {
                "rows-fp32": ["--form", "rows", "--dtype", "fp32"],
                "topk-int8": [
                    "--form",
                    "topk",
                    "--fraction",
                    str(a.topk_fraction),
                    "--dtype",
                    "int8",
                ],
                SERVING: [  # pulls packed-int8 rows (its tables' layout) and dense
                    "--form",
                    "rows",
                    "--serve-dtype",
                    "int8",
                    "--tables",
                    TABLES,
                    "--rows",
                    str(a.rows),
                    "--dim",
                    str(a.dim),
                    "--serve-interval",
                    "0.01",
                    "--final-state",
                    str(self.work / f"{SERVING}-state.pt"),
                ],
            }
            self.predictors = list(preds)
            logs = {}
            for name, extra in preds.items():
                self.children.spawn(name, self.consume_argv(name, extra))
                logs[name] = PredictorLog(self.logs / f"{name}.jsonl")
            self.follow_training(trainer, endpoints, logs)
            final_step = self.final_head_step(endpoints)
            self.settle(logs, final_step)
            self.stop_predictors()
            for lg in logs.values():
                lg.refresh()
            report = self.report(logs, time.monotonic() - t_start, final_step)
        finally:
            self.children.stop_all()
            redis.stop()
        print(report.text)
        if report.failures:
            output.line(
                f"deltad demo: check failed: {'; '.join(report.failures)} (work directory "
                f"kept for inspection: {self.work})",
                level="ERROR",
            )
            return 1
        self.dir.remove_if_temporary()
        return 0

    def trainer_argv(self) -> list[str]:
        a = self.args
        return [
            "train",
            "--world-size", str(a.world_size),
            "--model", MODEL,
            "--spool", str(self.spool),
            "--tables", TABLES,
            "--rows", str(a.rows),
            "--dim", str(a.dim),
            "--sharding", "mixed",
            "--duration", str(a.duration),
            "--publish-every-seconds", str(a.publish_every),
            "--final-tables", str(self.work / "trainer-final.pt"),
            "--final-model", str(self.work / "trainer-model.pt"),
            "--result-json", str(self.work / "trainer-result.json"),
            "--no-progress",
        ]  # fmt: skip

    def serve_argv(self, rank: int) -> list[str]:
        return [
            "serve",
            "--spool", str(self.spool),
            "--model", MODEL,
            "--rank", str(rank),
            "--listen", "127.0.0.1:0",
        ]  # fmt: skip

    def consume_argv(self, name: str, extra: list[str]) -> list[str]:
        return [
            "consume",
            "--consumer", name,
            "--model", MODEL,
            "--interval", str(self.args.pull_interval),
            "--long-poll", "5",  # pull as soon as a rank publishes (the interval: a fallback)
            "--json-log", str(self.logs / f"{name}.jsonl"),
            *([] if name == SERVING else ["--final-tables", str(self.work / f"{name}-final.pt")]),
            *extra,
        ]  # fmt: skip

    def follow_training(
        self, trainer: Child, endpoints: list[str], logs: dict[str, PredictorLog]
    ) -> None:
        """Progress bars until the trainer exits (bounded by its duration plus start-up)."""
        from tqdm import tqdm

        a = self.args
        limit = time.monotonic() + a.duration + 240.0
        off = a.no_progress or not sys.stderr.isatty()
        bars = {"trainer": tqdm(desc="trainer step", unit="step", disable=off, position=0)}
        for i, name in enumerate(logs, start=1):
            bars[name] = tqdm(desc=f"{name} step", unit="step", disable=off, position=i)
        try:
            while trainer.proc.poll() is None:
                if time.monotonic() > limit:
                    raise DemoFailed(f"trainer still running after {a.duration + 240:.0f}s")
                self.children.check_alive()
                head = self.head_step(endpoints)
                if head is not None:
                    _set(bars["trainer"], head)
                for name, lg in logs.items():
                    lg.refresh()
                    if lg.step is not None:
                        _set(bars[name], lg.step, f"{lg.bytes / 1e6:.1f} MB")
                time.sleep(0.25)
        finally:
            for b in bars.values():
                b.close()
        if trainer.proc.returncode != 0:
            raise DemoFailed(f"trainer exited with {trainer.proc.returncode}; see {trainer.log}")

    def head_step(self, endpoints: list[str]) -> int | None:
        """The lowest head step over ranks (what an aligned consumer can serve), or None."""
        import grpc

        from deltad.v1 import delta_pb2 as pb
        from deltad.v1 import delta_pb2_grpc as pb_grpc

        steps = []
        for ep in endpoints:
            with grpc.insecure_channel(ep) as ch:
                try:
                    s = pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=5.0)
                except grpc.RpcError:
                    return None
                if s.head_seq < 0:
                    return None
                steps.append(int(s.head_step))
        return min(steps) if steps else None

    def final_head_step(self, endpoints: list[str]) -> int:
        """The step of the trainer's final segment, once every sidecar has indexed it."""
        result = json.loads((self.work / "trainer-result.json").read_text())
        want = int(result["steps"])
        step: int | None = None
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            step = self.head_step(endpoints)
            if step == want:
                return want
            time.sleep(0.1)
        raise DemoFailed(f"sidecars show head step {step}, trainer ended at step {want}")

    def settle(self, logs: dict[str, PredictorLog], final_step: int) -> None:
        """Wait (bounded) until both predictors serve the final step and owe nothing."""
        deadline = time.monotonic() + self.args.settle_timeout
        while time.monotonic() < deadline:
            self.children.check_alive()
            for lg in logs.values():
                lg.refresh()
            if all(
                lg.step == final_step and lg.owed == 0 and lg.last_rows == 0 for lg in logs.values()
            ):
                return
            time.sleep(0.1)
        state = {n: (lg.step, lg.owed) for n, lg in logs.items()}
        raise DemoFailed(f"predictors (step, owed) {state} did not reach step {final_step}")

    def stop_predictors(self) -> None:
        """Stop the predictors; each writes its tables on the way out (bounded wait)."""
        a = self.args
        # each predictor writes its tables on the way out: 30 s, plus 60 s per GB of fp32
        # tables (six tables of --rows x --dim; 1 M x 64 is 1.5 GB, written by three at once)
        gb = 6 * a.rows * a.dim * 4 / 1e9
        self.children.stop(self.predictors, 30.0 + 60.0 * gb)

    # ---- report ----------------------------------------------------------------------------

    def report(self, logs: dict[str, PredictorLog], elapsed: float, final_step: int) -> Report:
        """The traffic table and the checks (:mod:`deltad.demo_checks`) from the files the
        trainer and the predictors wrote in the work directory."""
        import torch

        a = self.args
        result = json.loads((self.work / "trainer-result.json").read_text())
        truth: dict[str, torch.Tensor] = torch.load(
            self.work / "trainer-final.pt", map_location="cpu", weights_only=True
        )
        int8_table_bytes = sum(t.shape[0] * (t.shape[1] + 8) for t in truth.values())
        packed_table_bytes = sum(  # packed-int8 rows: scale, bias, codes, 16-byte aligned
            t.shape[0] * ((t.shape[1] + 4 + 15) // 16 * 16) for t in truth.values()
        )
        table_bytes = {"topk-int8": int8_table_bytes, SERVING: packed_table_bytes}
        out = traffic_lines(a, result, truth, logs, elapsed, table_bytes)
        lines, failures = run_checks(self.work, a.rows, a.dim, truth, logs[SERVING], final_step)
        return Report("\n".join([*out, *lines]), failures)


def _set(bar: Any, n: int, postfix: str | None = None) -> None:
    if n > bar.n:
        bar.update(n - bar.n)
    if postfix:
        bar.set_postfix_str(postfix, refresh=False)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 only if its checks hold."""
    check_args(args)
    kind: type[Demo] = Demo
    if getattr(args, "scenario", "default") == "bad-update":
        from deltad.demo_rollout import BadUpdateDemo

        kind = BadUpdateDemo
    if getattr(args, "scenario", "default") == "silent-bad-update":
        from deltad.demo_quality import SilentBadUpdateDemo

        kind = SilentBadUpdateDemo
    demo = kind(args)
    try:
        with terminate_as_interrupt():
            return demo.run()
    except DemoFailed as e:
        output.line(f"deltad demo: {e}; {demo.discard(keep_logs=True)}", level="ERROR")
        return 1
    except KeyboardInterrupt:
        output.line(f"deltad demo: interrupted; {demo.discard()}", level="WARNING")
        return 130
