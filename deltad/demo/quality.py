"""`deltad demo --scenario silent-bad-update`: corrupted labels pass the norm gate; the canary
evaluator fails them, holds the fleet and rolls the canaries back; the fleet is released
again once the model recovers (or by the operator at the end).

The reference trainer (2 gloo ranks, a segment every step, held-out examples and a golden
set for the evaluator) trains ``STEPS`` steps, one every ``STEP_INTERVAL_S`` (``--step-interval``:
an online trainer's pace is its stream's), and flips the training labels from step ``BAD`` for
``CORRUPT`` steps (``--corrupt-labels-from-step``). One ``deltad serve`` per rank runs a
norm gate a healthy run passes; ``deltad evaluate`` (consumer ``eval-m``) judges every step;
two predictors (``deltad consume``, fp32 rows, a long poll) follow: ``pred-canary-0`` in the
canary group ``pred-canary-*`` (the operator's ``rollout canary``) and ``pred-main-0``.

``check quality-gate`` holds only if, from the predictors' own logs and the release state:
the gate failed no step; the evaluator failed a corrupt step; ``pred-main-0`` never served a
step the evaluator did not pass (so none of the corrupt steps); ``pred-canary-0`` served a
corrupt step and rolled back; and the fleet was released past the corruption afterwards
(by the evaluator once the model recovered, or by the operator's ``release`` at the end).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from deltad import output
from deltad.demo.loop import MODEL, Demo
from deltad.demo.procs import DemoFailed, wait_serving
from deltad.demo.rollout import _all_at, _StepLog
from deltad.errors import ConfigError

STEPS, BAD, CORRUPT, START = 70, 30, 6, 8
STEP_INTERVAL_S = 0.5
RANKS = 2
TABLES_N = 3
CANARY_PRED, MAIN_PRED, EVALUATOR = "pred-canary-0", "pred-main-0", "eval-m"
FIXED: dict[str, int | None] = {
    "duration": None,
    "world_size": RANKS,
    "publish_every": None,
    "topk_fraction": None,
}


def check_flags(args: argparse.Namespace) -> None:
    """ConfigError naming the flags the fixed shape cannot honour."""
    bad = [
        "--" + dest.replace("_", "-")
        for dest, fixed in FIXED.items()
        if getattr(args, dest, None) is not None and getattr(args, dest) != fixed
    ]
    if bad:
        raise ConfigError(
            f"--scenario silent-bad-update has a fixed shape ({RANKS} ranks, {STEPS} steps, a "
            f"segment every step) and does not take {', '.join(bad)}; it takes --rows, --dim, "
            "--pull-interval, --settle-timeout, --workdir and --keep"
        )


class SilentBadUpdateDemo(Demo):
    """The silent-bad-update scenario (see the module docstring)."""

    def run(self) -> int:
        from deltad.store import EmbeddedRedis

        a = self.args
        t0 = time.monotonic()
        output.line(f"deltad demo --scenario silent-bad-update: logs in {self.logs}")
        redis = EmbeddedRedis(self.work / "redis")
        self.env["DELTAD_REDIS_URL"] = redis.start()
        lines: list[str] = []
        try:
            self.write_golden()
            sidecars = [
                self.children.spawn(f"sidecar-{r}", self.serve_argv(r)) for r in range(RANKS)
            ]
            endpoints = [wait_serving(s) for s in sidecars]
            self.target = endpoints[0]
            self.rollout("canary", "--group", "pred-canary-*")
            # the evaluator first: it holds the model at the first step it sees
            evaluator = self.children.spawn(EVALUATOR, self.evaluate_argv(endpoints))
            self._until(lambda: b"evaluating" in evaluator.log.read_bytes(), 300,
                        "the evaluator")  # fmt: skip
            trainer = self.children.spawn("trainer", self.trainer_argv())
            self._until(lambda: self.status()["head_step"] >= START, 600, "the first steps")
            self._until(lambda: self.status()["state"].get("release_step") is not None, 120,
                        "the evaluator's hold")  # fmt: skip
            preds = {n: ["--form", "rows", "--dtype", "fp32"] for n in (CANARY_PRED, MAIN_PRED)}
            self.predictors = list(preds)
            logs = {}
            for name, extra in preds.items():
                self.children.spawn(name, self.consume_argv(name, extra))
                logs[name] = _StepLog(self.logs / f"{name}.jsonl")
            self._until(lambda: trainer.proc.poll() is not None, 900, "training")
            if trainer.proc.returncode != 0:
                raise DemoFailed(f"trainer exited with {trainer.proc.returncode}")
            head = self.status()["head_step"]
            self._until(lambda: self._judged(head), a.settle_timeout, "the last verdict")
            state = self.status()["state"]
            released_by = "the evaluator"
            rel = state.get("release_step")
            if rel is None or rel < BAD + CORRUPT:
                released_by = "the operator"
                self.rollout("release", "--to-step", str(head))
                rel = head
            self._until(lambda: _all_at({0: logs[MAIN_PRED]}, rel), a.settle_timeout,
                        f"{MAIN_PRED} at the release")  # fmt: skip
            verdicts = self.verdicts()
            self.children.stop([EVALUATOR], 30.0)
            self.stop_predictors()
            for lg in logs.values():
                lg.refresh()
            lines += self._check(state, verdicts, logs, rel, released_by)
        finally:
            self.children.stop_all()
            redis.stop()
        ok = lines[-1].endswith(": ok")
        head_line = (
            f"deltad demo --scenario silent-bad-update: {RANKS} ranks, {STEPS} steps (labels "
            f"flipped at steps {BAD}..{BAD + CORRUPT - 1}); run time "
            f"{time.monotonic() - t0:.0f}s"
        )
        print("\n".join([head_line, *lines]))
        if not ok:
            output.line(
                f"deltad demo: check failed: quality-gate (work directory kept for inspection: "
                f"{self.work})",
                level="ERROR",
            )
            return 1
        self.dir.remove_if_temporary()
        return 0

    def _check(
        self,
        state: dict[str, Any],
        verdicts: dict[int, str],
        logs: dict[str, _StepLog],
        rel: int,
        released_by: str,
    ) -> list[str]:
        corrupt = set(range(BAD, BAD + CORRUPT))
        main = _served(logs[MAIN_PRED])
        canary = _served(logs[CANARY_PRED])
        failed = sorted(s for s, v in verdicts.items() if v == "fail" and s >= BAD)
        passed = {s for s, v in verdicts.items() if v == "pass"}
        first = min(main) if main else None
        unscored = sorted(s for s in main if s not in passed and s != first)
        gate_ok = state.get("gate_bad_step") is None
        ok = (
            gate_ok
            and bool(failed)
            and not (main & corrupt)
            and not unscored
            and bool(canary & corrupt)
            and logs[CANARY_PRED].rollback_pulls > 0
            and rel >= BAD + CORRUPT
        )
        return [
            f"  evaluator verdicts: {sum(v == 'pass' for v in verdicts.values())} pass, "
            f"{sum(v == 'fail' for v in verdicts.values())} fail (first failed step "
            f"{failed[0] if failed else None})",
            f"check quality-gate: the norm gate passed every step "
            f"({'yes' if gate_ok else 'NO: ' + str(state.get('gate_reason'))}); the evaluator "
            f"failed {len(failed)} steps from {failed[0] if failed else None}; {MAIN_PRED} "
            f"served steps {_span(main)}, none corrupt ({'NO' if main & corrupt else 'yes'}) "
            f"and none unscored ({unscored or 'yes'}); {CANARY_PRED} served "
            f"corrupt steps {_span(canary & corrupt)} and rolled back "
            f"{logs[CANARY_PRED].rollback_pulls} times; released again to step {rel} by "
            f"{released_by}: {'ok' if ok else 'FAILED'}",
        ]

    def write_golden(self) -> None:
        """The golden set ``deltad train --golden-out`` would write (1024 examples)."""
        from deltad.evaluate.labelled import write_examples
        from deltad.reference.trainer.cli import parse_tables
        from deltad.reference.trainer.holdout import golden_examples

        a = self.args
        tables = parse_tables(str(TABLES_N), a.rows)
        write_examples(self.work / "golden.jsonl", golden_examples(tables, a.rows, 1024))

    def _judged(self, head: int) -> bool:
        return head in self.verdicts() or self.status()["state"].get("release_step") == head

    def verdicts(self) -> dict[int, str]:
        """step -> verdict, from ``deltad evaluate --status --json``."""
        p = subprocess.run(
            [sys.executable, "-m", "deltad.commands.main", "evaluate", "--status", "--json",
             "--model", MODEL, "--last", "200"],
            env=self.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if p.returncode != 0:
            raise DemoFailed(f"deltad evaluate --status: exit {p.returncode}: {p.stderr}")
        return {v["step"]: v["verdict"] for v in json.loads(p.stdout)["verdicts"]}

    def rollout(self, *argv: str) -> str:
        cmd = [
            sys.executable,
            "-m",
            "deltad.commands.main",
            "rollout",
            *argv,
            "--target",
            self.target,
        ]
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        with open(self.logs / "operator.log", "a") as f:
            f.write(
                f"$ deltad rollout {' '.join(argv)}\n{p.stdout}{p.stderr}(exit {p.returncode})\n"
            )
        if p.returncode != 0:
            raise DemoFailed(f"deltad rollout {' '.join(argv)}: exit {p.returncode}: {p.stderr}")
        return p.stdout

    def status(self) -> dict[str, Any]:
        from deltad.clientauth import ClientAuth
        from deltad.commands.rollout import call
        from deltad.v1 import delta_pb2 as pb

        resp = call(self.target, pb.RolloutRequest(action=pb.ROLLOUT_STATUS), auth=ClientAuth())
        return {"state": json.loads(resp.state or "{}"), "head_step": resp.head_step}

    def _until(self, cond: Any, timeout_s: float, what: str) -> None:
        self.children.wait_until(cond, timeout_s, what, poll_s=0.2)

    def trainer_argv(self) -> list[str]:
        a = self.args
        return [
            "train", "--world-size", str(RANKS), "--model", MODEL, "--spool", str(self.spool),
            "--tables", str(TABLES_N), "--rows", str(a.rows), "--dim", str(a.dim),
            "--zch-slots", "0", "--steps", str(STEPS), "--publish-every-steps", "1",
            # an online trainer's pace (its stream's): the corrupt steps last seconds, as
            # a bad hour of labels lasts, not the milliseconds this small model would take
            "--step-interval", str(STEP_INTERVAL_S),
            "--holdout-dir", str(self.work / "holdout"),
            "--corrupt-labels-from-step", str(BAD), "--corrupt-steps", str(CORRUPT),
            "--no-progress",
        ]  # fmt: skip

    def serve_argv(self, rank: int) -> list[str]:
        return [
            *super().serve_argv(rank), "--restore-window-steps", str(STEPS),
            "--gate-max-norm-jump", "2", "--gate-max-changed-fraction", "1",
        ]  # fmt: skip

    def evaluate_argv(self, endpoints: list[str]) -> list[str]:
        a = self.args
        return [
            "evaluate", "--model", MODEL, *[x for e in endpoints for x in ("--sidecar", e)],
            "--consumer", EVALUATOR, "--golden", str(self.work / "golden.jsonl"),
            "--labelled-dir", str(self.work / "holdout"), "--tables", str(TABLES_N),
            "--rows", str(a.rows), "--dim", str(a.dim), "--zch-slots", "0",
            "--eps", "0.06", "--delta", "0.3", "--min-examples", "512",
            "--progressive-examples", "512", "--poll-interval", "0.3", "--release-delay", "1",
        ]  # fmt: skip


def _served(lg: _StepLog) -> set[int]:
    """Every step a predictor's log says it served."""
    out = set()
    try:
        with open(lg.path, "rb") as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("event") == "pull" and rec.get("step") is not None:
                    out.add(int(rec["step"]))
    except FileNotFoundError:
        pass
    return out


def _span(steps: set[int]) -> str:
    return f"{min(steps)}..{max(steps)}" if steps else "none"
