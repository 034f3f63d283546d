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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from deltad import output
from deltad.config import MAX_COUNT, MAX_SECONDS, Range
from deltad.parent import PARENT_PID_ENV

MODEL = "demo"
#: pooled tables of the trainer and of the serving predictor's model code
TABLES = "4"
#: the predictor serving a torchrec int8-quantized model
SERVING = "serving-int8"
#: the check of that predictor's managed-collision tables (the reference model's ``zch``)
ZCH = "serving-zch"
#: relative slack on the int8 bound for float32 arithmetic in code * scale + bias
BOUND_SLACK = 1e-5


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `deltad demo`."""
    p.add_argument("--duration", type=float, default=60.0, help="seconds of training")
    p.add_argument("--rows", type=int, default=20_000, help="rows per table")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--world-size", type=int, default=2, help="trainer ranks")
    p.add_argument("--publish-every", type=float, default=0.5, help="seconds between segments")
    p.add_argument("--pull-interval", type=float, default=0.1, help="predictor pull interval")
    p.add_argument("--topk-fraction", type=float, default=0.5, help="top-k predictor fraction")
    p.add_argument("--settle-timeout", type=float, default=60.0, help="catch-up limit (s)")
    p.add_argument("--workdir", type=Path, help="spool, logs, tables (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--scenario",
        choices=("default", "bad-update"),
        default="default",
        help="bad-update: a NaN step, the validation gate, a canary and a rollback "
        "(deltad.demo_rollout); default: the report above",
    )


@dataclass
class Child:
    """A subprocess of the demo, its log file and what it printed so far."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class PredictorLog:
    """What a predictor's JSON log says so far (read incrementally)."""

    path: Path
    offset: int = 0
    pulls: int = 0
    rows: int = 0
    bytes: int = 0
    dense_bytes: int = 0
    step: int | None = None
    owed: int = 0
    last_rows: int = 0
    steps_served: int = 0
    freshness: list[float] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    def refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            rec = json.loads(line)
            if rec.get("event") == "summary":
                self.summary = rec
            if rec.get("event") != "pull":
                continue
            self.pulls += 1
            self.rows += rec["rows"]
            self.bytes += rec["bytes"]
            self.dense_bytes += rec.get("dense_bytes", 0)
            self.owed = rec["owed"]
            self.last_rows = rec["rows"]
            if rec["step"] is not None and rec["step"] != self.step:
                self.steps_served += 1
            self.step = rec["step"]
            if rec["freshness_s"] is not None:
                self.freshness.append(float(rec["freshness_s"]))


def _tables_line(truth: dict[str, Any], rows_total: int, dim: int) -> str:
    """``5 tables x 100000 rows x dim 16`` (rows per table), or each table's rows if they differ."""
    counts = {n: int(t.shape[0]) for n, t in truth.items()}
    if len(set(counts.values())) == 1:
        return f"{len(counts)} tables x {next(iter(counts.values()))} rows x dim {dim}"
    each = ", ".join(f"{n} {c}" for n, c in counts.items())
    return f"{len(counts)} tables ({each} rows; {rows_total} in all), dim {dim}"


class Demo:
    """Runs the children, follows them, and writes the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[Child] = []
        self.predictors: list[str] = []
        self.tmp = args.workdir is None
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="deltad-demo-")).resolve()
        self.spool = self.work / "spool"
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (root, self.env.get("PYTHONPATH")) if p)
        self.env.setdefault("MALLOC_MMAP_MAX_", "0")
        self.env.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))

    # ---- children --------------------------------------------------------------------------

    def spawn(self, name: str, argv: Sequence[str]) -> Child:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "deltad.cli", *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, PARENT_PID_ENV: str(os.getpid())},
                cwd=self.work,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        """SIGTERM every child (its process group), wait bounded, SIGKILL the rest."""
        for c in reversed(self.children):
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for c in reversed(self.children):
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait(timeout=10.0)
        self.children.clear()

    def wait_serving(self, child: Child, timeout_s: float = 120.0) -> str:
        """Endpoint from the sidecar's ``serving <model> rank <r> on <host:port>`` line."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in child.log.read_text(errors="replace").splitlines():
                parts = line.split()
                if len(parts) >= 6 and parts[0] == "serving" and parts[4] == "on":
                    return parts[5]
            if child.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise DemoFailed(f"{child.name} did not start serving; see {child.log}")

    # ---- the run ---------------------------------------------------------------------------

    def discard(self, *, keep_logs: bool = False) -> str:
        """Remove the temporary work directory (spool, tables, the embedded Redis and its
        secret; with ``keep_logs`` all but ``logs/``) after an early end, unless ``--keep`` or
        ``--workdir``; says what it did."""
        if not self.tmp or self.args.keep:
            return f"work directory kept: {self.work}"
        if not keep_logs:
            shutil.rmtree(self.work, ignore_errors=True)
            return f"removed its work directory {self.work} (--keep keeps it)"
        for p in self.work.iterdir() if self.work.is_dir() else ():
            if p != self.logs:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        return (
            f"removed its work directory {self.work} but its logs ({self.logs}; --keep keeps all)"
        )

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
            trainer = self.spawn("trainer", self.trainer_argv())
            sidecars = [self.spawn(f"sidecar-{r}", self.serve_argv(r)) for r in range(a.world_size)]
            endpoints = [self.wait_serving(s) for s in sidecars]
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
                self.spawn(name, self.consume_argv(name, extra))
                logs[name] = PredictorLog(self.logs / f"{name}.jsonl")
            self.follow_training(trainer, endpoints, logs)
            final_step = self.final_head_step(endpoints)
            self.settle(logs, final_step)
            self.stop_predictors()
            for lg in logs.values():
                lg.refresh()
            report = self.report(logs, time.monotonic() - t_start, final_step)
        finally:
            self.stop_all()
            redis.stop()
        print(report.text)
        if report.failures:
            output.line(
                f"deltad demo: check failed: {'; '.join(report.failures)} (work directory "
                f"kept for inspection: {self.work})",
                level="ERROR",
            )
            return 1
        if self.tmp and not a.keep:
            shutil.rmtree(self.work, ignore_errors=True)
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
                self.check_alive()
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

    def check_alive(self) -> None:
        for c in self.children:
            if c.name != "trainer" and c.proc.poll() is not None:
                raise DemoFailed(f"{c.name} exited with {c.proc.returncode}; see {c.log}")

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
            self.check_alive()
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
        a = self.args
        # each predictor writes its tables on the way out: 30 s, plus 60 s per GB of fp32
        # tables (six tables of --rows x --dim; 1 M x 64 is 1.5 GB, written by three at once)
        gb = 6 * a.rows * a.dim * 4 / 1e9
        deadline = time.monotonic() + 30.0 + 60.0 * gb
        for c in self.children:
            if c.name in self.predictors:
                _signal_group(c.proc, signal.SIGTERM)
        for c in self.children:
            if c.name in self.predictors:
                try:
                    rc = c.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise DemoFailed(f"{c.name} did not stop; see {c.log}") from None
                if rc != 0:
                    raise DemoFailed(f"{c.name} exited with {rc}; see {c.log}")

    # ---- report ----------------------------------------------------------------------------

    def report(self, logs: dict[str, PredictorLog], elapsed: float, final_step: int) -> Report:
        import torch

        from deltad import wire
        from deltad.reference.consumers.predictor import percentile

        a = self.args
        result = json.loads((self.work / "trainer-result.json").read_text())
        truth: dict[str, torch.Tensor] = torch.load(
            self.work / "trainer-final.pt", map_location="cpu", weights_only=True
        )
        rows_total = sum(t.shape[0] for t in truth.values())
        fp32_table_bytes = sum(t.numel() * 4 for t in truth.values())
        int8_table_bytes = sum(t.shape[0] * (t.shape[1] + 8) for t in truth.values())
        packed_table_bytes = sum(  # packed-int8 rows: scale, bias, codes, 16-byte aligned
            t.shape[0] * ((t.shape[1] + 4 + 15) // 16 * 16) for t in truth.values()
        )
        table_bytes = {"topk-int8": int8_table_bytes, SERVING: packed_table_bytes}
        segs = [int(r["segments"]) for r in result["ranks"]]
        out = [
            "",
            f"deltad demo: {a.world_size} ranks, {_tables_line(truth, rows_total, a.dim)}, trained {result['steps']} steps in {a.duration:.0f}s, "
            f"{sum(segs)} segments ({', '.join(map(str, segs))} per rank), "
            f"publish every {a.publish_every}s; run time {elapsed:.0f}s",
            f"{'predictor':<12} {'pulls':>6} {'rows':>10} {'bytes':>12} {'dense':>10} "
            f"{'full syncs':>12} {'ratio':>7} {'fresh p50':>9} {'p99':>7}",
        ]
        for name, lg in logs.items():
            full = table_bytes.get(name, fp32_table_bytes) * lg.steps_served
            p50, p99 = percentile(lg.freshness, 50), percentile(lg.freshness, 99)
            out.append(
                f"{name:<12} {lg.pulls:>6} {lg.rows:>10} {_mb(lg.bytes):>12} "
                f"{_mb(lg.dense_bytes):>10} {_mb(full):>12} "
                f"{(lg.bytes / full if full else 0):>7.1%} {_sec(p50):>9} {_sec(p99):>7}"
            )
        out.append(
            "  bytes: rows and dense state received (dense: of which the trainer's dense state); "
            "full syncs: a whole-table copy (same dtype) at every step the predictor served; "
            "freshness: segment created -> rows applied (aim: p50 <= 0.5s, p99 <= 2s)"
        )
        failures = []
        rows_tables = torch.load(
            self.work / "rows-fp32-final.pt", map_location="cpu", weights_only=True
        )
        equal = set(rows_tables) == set(truth) and all(
            torch.equal(rows_tables[n], truth[n].to(rows_tables[n].dtype)) for n in truth
        )
        out.append(
            f"check rows-fp32: tables bit-equal to the trainer's final tables at step "
            f"{final_step}: {'ok' if equal else 'FAILED'}"
        )
        if not equal:
            failures.append("rows-fp32 tables differ from the trainer's final tables")
        topk = torch.load(self.work / "topk-int8-final.pt", map_location="cpu", weights_only=True)
        worst = 0.0
        within = set(topk) == set(truth)
        for n, t in truth.items():
            if n not in topk:
                continue
            ref = t.to(torch.float32)
            bound = wire.int8_error_bound(ref)
            bound = bound * (1 + BOUND_SLACK) + ref.abs().amax(dim=1) * BOUND_SLACK
            err = (topk[n].to(torch.float32) - ref).abs().amax(dim=1)
            within = within and bool((err <= bound).all())
            worst = max(worst, float((err / bound.clamp_min(1e-12)).max()))
        out.append(
            f"check topk-int8: every element within its row's int8 bound "
            f"(row max - row min + 1e-8) / 510 once nothing is owed: {'ok' if within else 'FAILED'} "
            f"(worst error = {worst:.2f} x bound)"
        )
        if not within:
            failures.append("topk-int8 error exceeds the int8 bound")
        del rows_tables, topk  # big tables (1M x 64 x 5 = 1.3 GB each): before the next load
        model_state: dict[str, torch.Tensor] = torch.load(
            self.work / "trainer-model.pt", map_location="cpu", weights_only=True
        )
        line, ok, ref = self.check_serving(model_state, logs[SERVING])
        out.append(line)
        if not ok:
            failures.append(f"{SERVING} weights or forward differ from torchrec's quantization")
        line, ok = self.check_serving_zch(ref)
        out.append(line)
        if not ok:
            failures.append(f"{ZCH} remapper or forward on raw ids differ from the trainer's")
        return Report("\n".join(out), failures)

    def check_serving(self, final: dict[str, Any], lg: PredictorLog) -> tuple[str, bool, Any]:
        """Compare the serving predictor with the trainer's final model (``final``: its
        state_dict, tables and dense state) quantized by torchrec in the same model code; its
        forward latency during apply and idle. Also returns that reference model."""
        import torch

        from deltad.consume.mc import LOOKUP_BUFFERS, training_only_state
        from deltad.consume.quant import quant_tables, quantize_model
        from deltad.reference.consumers.serving import (
            ServingConfig,
            click_model,
            fixed_batch,
            forward_path,
            serving_state,
        )
        from deltad.reference.trainer.cli import parse_tables
        from deltad.types import ServeDtype

        a = self.args
        state_file = self.work / f"{SERVING}-state.pt"
        got = torch.load(state_file, map_location="cpu", weights_only=True)
        logits = torch.load(forward_path(state_file), map_location="cpu", weights_only=True)
        cfg = ServingConfig(ServeDtype.INT8, parse_tables(TABLES, a.rows), a.rows, a.dim)
        model = click_model(cfg).eval()
        model.load_state_dict(final)  # strict: every weight is the trainer's final one
        ref = quantize_model(model, ServeDtype.INT8, inplace=True)
        # the trainer's MCH eviction bookkeeping is not served (see deltad.consume.mc)
        skip = training_only_state(ref)
        want = {k: v for k, v in serving_state(ref).items() if k not in skip}
        got = {k: v for k, v in got.items() if k not in skip}
        n_tables = len(quant_tables(ref))
        dense = len([k for k in want if not _table_key(k) and not k.endswith(LOOKUP_BUFFERS)])
        weights = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        with torch.inference_mode():
            forward = torch.equal(logits, ref(fixed_batch(cfg))[1])
        ok = weights and forward
        s = lg.summary or {}
        line = (
            f"check {SERVING}: {n_tables} int8 tables, {dense} dense tensors and forward "
            f"output on a fixed batch bit-equal to the trainer's final model quantized by "
            f"torchrec: {'ok' if ok else 'FAILED'} "
            f"(weights {'equal' if weights else 'DIFFER'}, forward "
            f"{'equal' if forward else 'DIFFERS'})\n"
            f"  {SERVING} serving: {s.get('forwards', 0)} forwards, latency p50/p99 idle "
            f"{_ms(s.get('forward_idle_p50_ms'))}/{_ms(s.get('forward_idle_p99_ms'))}, during "
            f"apply {_ms(s.get('forward_apply_p50_ms'))}/{_ms(s.get('forward_apply_p99_ms'))} "
            f"({s.get('forward_apply_samples', 0)} forwards), longest lock hold "
            f"{_ms(s.get('max_hold_ms'))}"
        )
        return line, ok, ref

    def check_serving_zch(self, ref: Any) -> tuple[str, bool]:
        """The serving predictor's managed-collision tables against ``ref`` (the trainer's
        final model quantized by torchrec): rows, the remapper's lookup buffers, and the
        served embeddings of raw ids held, evicted and never seen (its exit probe)."""
        import torch

        from deltad.consume.mc import LOOKUP_BUFFERS, probe_forward, remappers
        from deltad.reference.consumers.serving import serving_state, zch_path

        state_file = self.work / f"{SERVING}-state.pt"
        mc = remappers(ref)
        if not mc:
            return (
                f"check {ZCH}: FAILED (the reference model has no managed-collision table)",
                False,
            )
        probe_file = zch_path(state_file)
        if not probe_file.exists():
            return f"check {ZCH}: FAILED ({SERVING} wrote no managed-collision probe)", False
        probe = torch.load(probe_file, map_location="cpu", weights_only=True)
        got = torch.load(state_file, map_location="cpu", weights_only=True)
        want = serving_state(ref)
        parts, ok = [], True
        for name, rm in sorted(mc.items()):
            rkeys = [k for k in want if _table_key(k, name)]
            rows = len(rkeys) == 1 and all(k in got and torch.equal(got[k], want[k]) for k in rkeys)
            keys = [k for k in want if k.endswith(LOOKUP_BUFFERS) and f".{name}." in k]
            lookup = len(keys) == 2 and all(torch.equal(got[k], want[k]) for k in keys)
            p = probe.get(name)
            forward = False
            counts = "no probe"
            if p is not None:
                raw = torch.cat([p["held"], p["evicted"], p["never"]])
                with torch.inference_mode():
                    forward = torch.equal(p["out"], probe_forward(ref, name, raw))
                held = set(rm.slot_raw.tolist())
                # the probe's kinds, checked against the trainer's final map
                kinds = (
                    set(p["held"].tolist()) <= held
                    and not (set(p["evicted"].tolist()) | set(p["never"].tolist())) & held
                )
                forward = forward and kinds and p["evicted"].numel() > 0
                counts = (
                    f"{p['held'].numel()} held, {p['evicted'].numel()} evicted, "
                    f"{p['never'].numel()} never-seen raw ids"
                )
            good = rows and lookup and forward
            ok = ok and good
            parts.append(
                f"{name} ({rm.size} slots; rows {'equal' if rows else 'DIFFER'}, lookup buffers "
                f"{'equal' if lookup else 'DIFFER'}, forward on {counts} "
                f"{'equal' if forward else 'DIFFERS'})"
            )
        line = (
            f"check {ZCH}: {len(mc)} managed-collision table(s) of {SERVING} bit-equal to the "
            f"trainer's final model quantized by torchrec: {'ok' if ok else 'FAILED'} "
            f"({'; '.join(parts)})"
        )
        return line, ok


def _table_key(key: str, table: str | None = None) -> bool:
    """``key`` (a state_dict name of a quantized model) holds a table's rows (``table``'s)."""
    parts = key.split(".")
    return (
        len(parts) >= 3
        and parts[-1] == "weight"
        and parts[-3] in ("embedding_bags", "embeddings")
        and (table is None or parts[-2] == table)
    )


@dataclass
class Report:
    text: str
    failures: list[str]


class DemoFailed(Exception):
    """A child failed or a bounded wait ran out."""


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _set(bar: Any, n: int, postfix: str | None = None) -> None:
    if n > bar.n:
        bar.update(n - bar.n)
    if postfix:
        bar.set_postfix_str(postfix, refresh=False)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}ms"


def _sec(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so the children are cleaned up either way."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 only if its checks hold."""
    if getattr(args, "scenario", "default") == "bad-update":
        from deltad import demo_rollout

        with _terminate_as_interrupt():
            return demo_rollout.run(args)
    demo = Demo(args)
    try:
        with _terminate_as_interrupt():
            return demo.run()
    except DemoFailed as e:
        output.line(f"deltad demo: {e}; {demo.discard(keep_logs=True)}", level="ERROR")
        return 1
    except KeyboardInterrupt:
        output.line(f"deltad demo: interrupted; {demo.discard()}", level="WARNING")
        return 130
