"""The default demo's loop (:class:`Demo`): starts the children, follows training, lets the
predictors settle, and writes the report with its checks (see :mod:`deltad.demo`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from deltad import output
from deltad.demo import archive, cpp
from deltad.demo.checks import SERVING, TABLES, ZCH, run_checks
from deltad.demo.procs import (
    Child,
    Children,
    DemoFailed,
    WorkDir,
    statuses,
    wait_serving,
)
from deltad.demo.report import PredictorLog, Report, traffic_lines

__all__ = ["MODEL", "SERVING", "TABLES", "ZCH", "Demo", "DemoFailed", "PredictorLog"]

MODEL = "demo"


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
        #: ``--archive``'s store, once started (None: no archive)
        self.store: archive.DemoStore | None = None

    def discard(self, *, keep_logs: bool = False) -> str:
        """Remove the temporary work directory after an early end (see :class:`WorkDir`)."""
        return self.dir.discard(keep_logs=keep_logs)

    def run(self) -> int:
        from deltad.store import EmbeddedRedis

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
            self.store = archive.start_store(
                getattr(a, "archive", None), getattr(a, "archive_endpoint", None), self.work,
                self.env,
            )  # fmt: skip
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
            if self.start_cpp(endpoints):
                logs[cpp.NAME] = PredictorLog(self.logs / f"{cpp.NAME}.jsonl")
            self.follow_training(trainer, endpoints, logs)
            final_step = self.final_head_step(endpoints)
            self.settle(logs, final_step)
            if self.store is not None:
                self.cold_start(endpoints)
            self.stop_predictors()
            if self.store is not None:
                self.store_relays(final_step)
            for lg in logs.values():
                lg.refresh()
            report = self.report(logs, time.monotonic() - t_start, final_step)
        finally:
            self.children.stop_all()
            redis.stop()
            if self.store is not None:
                self.store.stop()
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

    def start_cpp(self, endpoints: list[str]) -> bool:
        """The C++ predictor (:mod:`deltad.demo.cpp`), where it was built for this torch;
        whether it started."""
        exe, why = cpp.binary()
        if exe is None:
            output.line(f"deltad demo: no {cpp.NAME} predictor: {why}")
            return False
        artifact = cpp.export(self.work, self.args.rows, self.args.dim)
        self.children.spawn(
            cpp.NAME, cpp.argv(exe, endpoints, MODEL, artifact, self.work), executable=True
        )
        self.predictors.append(cpp.NAME)
        return True

    def cold_start(self, endpoints: list[str]) -> None:
        """Once every rank's archive holds its log: a predictor bootstraps from the store
        (:mod:`deltad.demo.archive`), then pulls the tail from the sidecars and exits."""
        assert self.store is not None
        archive.wait_archived(self.children, endpoints, self.args.settle_timeout)
        argv = archive.consume_argv(self.store.url, self.store.endpoint, self.work, self.logs)
        archive.run(self.children, argv, self.args.settle_timeout + 120.0)

    def store_relays(self, final_step: int) -> None:
        """The trainer's sidecars stop; a relay per rank follows the archive; once every relay
        holds the trainer's final step (a big model's log takes a while to fetch), a
        predictor behind them pulls what they serve and exits (:mod:`deltad.demo.archive`)."""
        assert self.store is not None
        world = self.args.world_size
        self.children.stop([f"sidecar-{r}" for r in range(world)], 30.0)
        relays = [
            self.children.spawn(
                f"{archive.RELAY_NAME}-{r}",
                archive.relay_argv(r, self.store.url, self.store.endpoint, self.work),
                env={"DELTAD_REDIS_URL": ""},  # (each embeds its own Redis)
            )
            for r in range(world)
        ]
        endpoints = [wait_serving(r) for r in relays]

        def at_final_step() -> bool:
            got = statuses(endpoints)
            return got is not None and all(st.head_step == final_step for st in got)

        # (not Children.wait_until: the stopped sidecars and predictors are exited children)
        deadline = time.monotonic() + self.args.settle_timeout + 120.0
        while not at_final_step():  # bounded by the deadline
            if time.monotonic() > deadline or any(r.proc.poll() is not None for r in relays):
                raise DemoFailed(f"the store relays did not reach step {final_step}")
            time.sleep(0.2)
        argv = archive.relay_consume_argv(endpoints, self.work, self.logs)
        archive.run(self.children, argv, self.args.settle_timeout + 120.0, archive.RELAY_NAME)

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
            *(archive.serve_flags(self.store.url, self.store.endpoint)
              if self.store is not None else []),
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
        got = statuses(endpoints)
        if not got or any(s.head_seq < 0 for s in got):
            return None
        return min(int(s.head_step) for s in got)

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
        """The traffic table and the checks (:mod:`deltad.demo.checks`) from the files the
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
        table_bytes = {
            "topk-int8": int8_table_bytes,
            SERVING: packed_table_bytes,
            cpp.NAME: packed_table_bytes,
        }
        out = traffic_lines(a, result, truth, logs, elapsed, table_bytes)
        lines, failures = run_checks(self.work, a.rows, a.dim, truth, logs[SERVING], final_step)
        if cpp.NAME in logs:
            final = torch.load(
                self.work / "trainer-model.pt", map_location="cpu", weights_only=True
            )
            check = cpp.check(self.work, a.rows, a.dim, final)
            lines.append(check.line)
            if not check.ok:
                failures.append(
                    f"{cpp.NAME} weights or forward differ from torchrec's quantization"
                )
        if self.store is not None:
            check = archive.check(self.work, self.logs, truth, self.store.url)
            lines.append(check.line)
            if not check.ok:
                failures.append(f"{archive.NAME} did not bootstrap from the archive bit-equal")
            check = archive.check_relay(self.work, truth, self.store.url, a.world_size)
            lines.append(check.line)
            if not check.ok:
                failures.append(f"{archive.RELAY_NAME} did not serve the archive bit-equal")
        return Report("\n".join([*out, *lines]), failures)


def _set(bar: Any, n: int, postfix: str | None = None) -> None:
    if n > bar.n:
        bar.update(n - bar.n)
    if postfix:
        bar.set_postfix_str(postfix, refresh=False)
