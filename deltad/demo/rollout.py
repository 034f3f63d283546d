"""`deltad demo --scenario bad-update`: a bad trainer step, the gate, a canary, and a rollback.

The reference trainer (2 gloo ranks, mixed sharding, a segment and a dense state every 2
steps) trains ``STEPS`` steps; at ``BAD`` it injects a bad update (``--inject-nan-step``: NaN
gradients, so every row that step touches and every dense weight go NaN) and it dumps its
model at the canary's and the rollback's steps (``--dump-steps``). One ``deltad serve`` per
rank (the validation gate on; a restore window over every step) shares one Redis, where the
model's release state lives; three predictors (``deltad consume`` with a long poll:
pred-canary-0 and pred-main-0 with fp32 tables, and serving-int8, a torchrec int8-quantized
model pulling packed rows and the dense state) follow it. The demo is the operator, and runs
``deltad rollout ...`` (:meth:`BadUpdateDemo.rollout`) against rank 0's sidecar:

1. hold: ``release --to-step START`` before any predictor starts;
2. canary: ``pin --group 'pred-canary-*' --step CANARY``: the canary group takes a release
   first while the rest stays at ``START`` (``check canary``);
3. the gate: the sidecars failed the first segment past ``BAD`` (non-finite values) and wrote
   that into the release state; ``release`` to the head is refused with the gate's reason; the
   operator unpins the canary and releases to the last good step instead: every predictor
   gets there and none ever served a step at or past ``BAD`` (``check gate``);
4. ``rollback --to-step ROLLBACK``: every predictor goes back to exactly the trainer's state
   there: fp32 tables bit-equal to its dump, the serving model's weights, dense state and
   forward output bit-equal to the dump quantized by torchrec (``check rollback``).

Exit 0 only if all three checks hold. Its shape is fixed (2 ranks, ``STEPS`` steps, a segment
every 2 steps, no top-k predictor): `deltad demo` refuses ``--duration``, ``--world-size``
(but 2), ``--publish-every`` and ``--topk-fraction`` with it (:func:`check_flags`), and
honours ``--rows``, ``--dim``, ``--pull-interval``, ``--settle-timeout``, ``--workdir`` and
``--keep`` (a temporary work directory is removed after a run whose checks held, but for its
``logs/``). Each ``deltad rollout`` command is printed as it runs and listed again in the
report; ``logs/operator.log`` keeps them with their answers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deltad import output
from deltad.demo.checks import SERVING, TABLES, check_serving
from deltad.demo.loop import MODEL, Demo
from deltad.demo.procs import DemoFailed, wait_serving
from deltad.demo.report import PredictorLog, tables_line
from deltad.errors import ConfigError

STEPS, START, CANARY, BAD, ROLLBACK = 40, 10, 24, 31, 18
#: the trainer's ranks and its segment interval (steps): the scenario's fixed shape
RANKS, PUBLISH_EVERY_STEPS = 2, 2
CANARY_PRED, MAIN_PRED = "pred-canary-0", "pred-main-0"
#: `deltad demo` flags (argparse dest) the scenario's fixed shape cannot honour: when given
#: (not None), each must equal its value here (None: no value is honoured)
FIXED: dict[str, int | None] = {
    "duration": None,  # it trains STEPS steps, whatever the time
    "world_size": RANKS,
    "publish_every": None,  # a segment every PUBLISH_EVERY_STEPS steps, not seconds
    "topk_fraction": None,  # it runs no top-k predictor
}


def check_flags(args: argparse.Namespace) -> None:
    """ConfigError naming every flag given that the fixed shape cannot honour (a flag left
    out is None: `deltad demo` fills in its default after this check)."""
    bad = [
        "--" + dest.replace("_", "-")
        for dest, fixed in FIXED.items()
        if getattr(args, dest, None) is not None and getattr(args, dest) != fixed
    ]
    if bad:
        raise ConfigError(
            f"--scenario bad-update has a fixed shape ({RANKS} ranks, {STEPS} steps, a segment "
            f"every {PUBLISH_EVERY_STEPS} steps, no top-k predictor) and does not take "
            f"{', '.join(bad)}; it takes --rows, --dim, --pull-interval, --settle-timeout, "
            "--workdir and --keep"
        )


class BadUpdateDemo(Demo):
    """The bad-update scenario (see the module docstring)."""

    #: the report header's tables (:func:`deltad.demo.report.tables_line` of the trainer's
    #: dump: its pooled, sequence and managed-collision tables), set by the rollback check
    tables = ""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        #: the operator's commands as run (``$ deltad rollout ...``) with their exit codes:
        #: printed as they run and again in the report (their answers: ``operator.log``)
        self.operator: list[str] = []

    def run(self) -> int:
        from deltad.store import EmbeddedRedis

        a = self.args
        t0 = time.monotonic()
        output.line(f"deltad demo --scenario bad-update: logs in {self.logs}")
        redis = EmbeddedRedis(self.work / "redis")
        self.env["DELTAD_REDIS_URL"] = redis.start()
        lines: list[str] = []
        failures: list[str] = []
        try:
            trainer = self.children.spawn("trainer", self.trainer_argv())
            sidecars = [
                self.children.spawn(f"sidecar-{r}", self.serve_argv(r)) for r in range(RANKS)
            ]
            endpoints = [wait_serving(s) for s in sidecars]
            self.target = endpoints[0]
            # 1. hold the fleet at START before any predictor starts
            self._until(lambda: self.status()["head_step"] >= START, a.duration + 600, "head")
            self.rollout("release", "--to-step", str(START))
            preds = {
                CANARY_PRED: ["--form", "rows", "--dtype", "fp32"],
                MAIN_PRED: ["--form", "rows", "--dtype", "fp32"],
                SERVING: ["--form", "rows", "--serve-dtype", "int8", "--tables", TABLES,
                          "--rows", str(a.rows), "--dim", str(a.dim), "--serve-interval", "0.01",
                          "--final-state", str(self.work / f"{SERVING}-state.pt")],
            }  # fmt: skip
            self.predictors = list(preds)
            logs = {}
            for name, extra in preds.items():
                self.children.spawn(name, self.consume_argv(name, extra))
                logs[name] = _StepLog(self.logs / f"{name}.jsonl")
            self._until(lambda: trainer.proc.poll() is not None, a.duration + 600, "training")
            if trainer.proc.returncode != 0:
                raise DemoFailed(f"trainer exited with {trainer.proc.returncode}")
            self._until(lambda: _all_at(logs, START), a.settle_timeout, f"fleet at {START}")
            # 2. canary: the canary group first
            self.rollout("pin", "--group", "pred-canary-*", "--step", str(CANARY))
            self._until(lambda: _all_at({0: logs[CANARY_PRED]}, CANARY), a.settle_timeout, "canary")
            time.sleep(1.0)  # (the others had time to move, were they not held)
            others = {n: lg.max_step for n, lg in logs.items() if n != CANARY_PRED}
            ok = all(s == START for s in others.values())
            lines.append(
                f"check canary: {CANARY_PRED} took the release to step {CANARY} while "
                f"{', '.join(f'{n} stayed at {s}' for n, s in others.items())}: "
                f"{'ok' if ok else 'FAILED'}"
            )
            failures += [] if ok else ["canary"]
            # 3. the gate: a release to the head is refused; release to the last good step
            refused = self.rollout("release", ok=False)
            state = self.status()["state"]
            good, bad = state.get("gate_good_step"), state.get("gate_bad_step")
            self.rollout("unpin", "--group", "pred-canary-*")
            if good is not None:
                self.rollout("release", "--to-step", str(good))
                self._until(lambda: _all_at(logs, good), a.settle_timeout, f"fleet at {good}")
            served = {n: lg.max_step for n, lg in logs.items()}
            ok = (
                good is not None
                and good < BAD <= (bad or -1)
                and "validation gate" in refused
                and all(s is not None and s <= good for s in served.values())
            )
            lines.append(
                f"check gate: trainer injected NaN at step {BAD}; the gate failed step {bad} "
                f"({state.get('gate_reason') or 'no reason recorded'}) and held the model at "
                f"step {good}; release to the head refused ({refused or 'NOT refused'}); "
                f"released to {good}, predictors served at most steps {served}: "
                f"{'ok' if ok else 'FAILED'}"
            )
            failures += [] if ok else ["gate"]
            # 4. rollback: everyone back to ROLLBACK, exactly
            self.rollout("rollback", "--to-step", str(ROLLBACK))
            self._until(lambda: _all_at(logs, ROLLBACK), a.settle_timeout, "rollback")
            rolled = {n: lg.rollback_pulls for n, lg in logs.items()}
            self.stop_predictors()
            lines += self._check_rollback(rolled, failures)
        finally:
            self.children.stop_all()
            redis.stop()
        head = (
            f"deltad demo --scenario bad-update: {RANKS} ranks, {self.tables}, {STEPS} steps "
            f"(NaN injected at {BAD}); run time {time.monotonic() - t0:.0f}s"
        )
        print("\n".join([head, *lines, *self._operator_lines()]))
        if failures:
            output.line(
                f"deltad demo: check failed: {'; '.join(failures)} (work directory kept for "
                f"inspection: {self.work})",
                level="ERROR",
            )
            return 1
        # (a temporary work directory goes, but not its logs: operator.log is the lesson)
        output.line(f"deltad demo: {self.dir.discard(keep_logs=True)}")
        return 0

    def _operator_lines(self) -> list[str]:
        """The report's list of the operator's commands (their answers: ``operator.log``)."""
        if not self.operator:
            return []
        where = self.logs / "operator.log"
        return [f"operator commands (answers in {where}):", *(f"  {c}" for c in self.operator)]

    def rollout(self, *argv: str, ok: bool = True) -> str:
        """Run ``deltad rollout ARGV --target <rank 0's sidecar>`` as an operator would; its
        output, or (``ok`` False: a refusal is expected) its stderr if it exited 2 ("" if
        it did not refuse). DemoFailed if it fails otherwise."""
        cmd = [sys.executable, "-m", "deltad", "rollout", *argv, "--target", self.target]
        typed = f"$ deltad rollout {shlex.join(argv)} --target {self.target}"
        output.line(typed)
        try:
            p = subprocess.run(
                cmd, env=self.env, cwd=self.work, capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired as e:
            raise DemoFailed(f"deltad rollout {' '.join(argv)}: no answer in 60 s") from e
        self.operator.append(f"{typed}  (exit {p.returncode})")
        with open(self.logs / "operator.log", "a") as f:
            f.write(f"{typed}\n{p.stdout}{p.stderr}(exit {p.returncode})\n")
        if not ok:
            return p.stderr.strip() if p.returncode == 2 else ""
        if p.returncode != 0:
            raise DemoFailed(f"deltad rollout {' '.join(argv)}: exit {p.returncode}: {p.stderr}")
        return p.stdout

    def status(self) -> dict[str, Any]:
        """The release state and the head step of rank 0's sidecar (the Rollout RPC's status,
        in-process: ``deltad rollout status --json`` answers the same)."""
        from deltad.clientauth import ClientAuth
        from deltad.commands.rollout import call
        from deltad.v1 import delta_pb2 as pb

        resp = call(self.target, pb.RolloutRequest(action=pb.ROLLOUT_STATUS), auth=ClientAuth())
        return {"state": json.loads(resp.state), "head_step": resp.head_step}

    def _check_rollback(self, rolled: dict[str, int], failures: list[str]) -> list[str]:
        import torch

        dump = self.work / "dumps"
        tables = torch.load(dump / f"tables-step-{ROLLBACK}.pt", weights_only=True)
        #: the report's header: the tables the trainer trained (its pooled ones, the sequence
        #: and the managed-collision table), as `deltad demo` counts them
        self.tables = tables_line(
            tables, sum(int(t.shape[0]) for t in tables.values()), self.args.dim
        )
        exact = []
        for name in (CANARY_PRED, MAIN_PRED):
            got = torch.load(self.work / f"{name}-final.pt", weights_only=True)
            exact.append(
                got.keys() == tables.keys() and all(torch.equal(got[k], tables[k]) for k in tables)
            )
        model = torch.load(dump / f"model-step-{ROLLBACK}.pt", weights_only=True)
        serving, _ = check_serving(
            self.work / f"{SERVING}-state.pt", self.args.rows, self.args.dim, model,
            PredictorLog(self.logs / f"{SERVING}.jsonl"),
        )  # fmt: skip
        line, serving_ok = serving.line, serving.ok
        in_place = all(n > 0 for n in rolled.values())
        ok = all(exact) and serving_ok and in_place
        failures += [] if ok else ["rollback"]
        return [
            f"check rollback: every predictor back at step {ROLLBACK} in place "
            f"(rollback pulls {rolled}); fp32 tables bit-equal to the trainer's dump at "
            f"{ROLLBACK}: {'yes' if all(exact) else 'NO'}; serving-int8 bit-equal to the dump "
            f"quantized by torchrec: {'yes' if serving_ok else 'NO'}: {'ok' if ok else 'FAILED'}",
            "  " + line.splitlines()[0].replace("final model", f"model at step {ROLLBACK}"),
        ]

    def _until(self, cond: Any, timeout_s: float, what: str) -> None:
        self.children.wait_until(cond, timeout_s, what, poll_s=0.1)

    def trainer_argv(self) -> list[str]:
        a = self.args
        return [
            "train", "--world-size", str(RANKS), "--model", MODEL, "--spool", str(self.spool),
            "--tables", TABLES, "--rows", str(a.rows), "--dim", str(a.dim),
            "--sharding", "mixed", "--steps", str(STEPS),
            "--publish-every-steps", str(PUBLISH_EVERY_STEPS),
            "--inject-nan-step", str(BAD), "--dump-steps", f"{CANARY},{ROLLBACK}",
            "--dump-dir", str(self.work / "dumps"), "--no-progress",
        ]  # fmt: skip

    def serve_argv(self, rank: int) -> list[str]:
        return [*super().serve_argv(rank), "--restore-window-steps", str(STEPS)]


class _StepLog(PredictorLog):
    """A predictor's log with the highest step it served and its rollback pulls."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.max_step: int | None = None
        self.rollback_pulls = 0

    def refresh(self) -> None:
        start = self.offset
        super().refresh()
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(self.offset - start)
        except FileNotFoundError:
            return
        for line in data.splitlines():
            rec = json.loads(line)
            if rec.get("event") != "pull" or rec["step"] is None:
                continue
            self.max_step = max(self.max_step or rec["step"], rec["step"])
            self.rollback_pulls += rec.get("rollback_to") is not None


def _all_at(logs: dict[Any, _StepLog], step: int) -> bool:
    for lg in logs.values():
        lg.refresh()
    return all(lg.step == step for lg in logs.values())
