"""The canary evaluator (issue 39): how fast it stops a silent bad update, how long good
steps wait for their release, false holds on a healthy run, its CPU per scored step, and the
weakest corruption it catches.

Each run: an embedded Redis, one in-process sidecar per rank (a norm gate a healthy run
passes: ``--gate-max-norm-jump 2 --gate-max-changed-fraction 1``), the reference trainer (2
gloo ranks, 3 tables of ``--rows`` x 8, held-out examples, publishing every
``--publish-every`` seconds) and ``deltad evaluate`` (a child process; golden set of 1024
examples, 512 held-out examples per verdict, eps 0.06, delta 0.3). Read from the evaluator's
verdicts in Redis: for a corrupt run, the seconds from the publish of the first corrupt step
it judged to its failed verdict (the canaries' rollback order and the fleet's hold, taken in
the same round); for good steps, the seconds from a step's publish to its verdict and
release (the release lag: the freshness of every predictor outside the canary group); the
evaluator's CPU seconds (``/proc/<pid>/stat``) per verdict; failed verdicts on a healthy run
(false holds). Corruptions: labels flipped at fractions ``--fractions``, and the first table
fed the second's ids.

    python -m bench.eval [--healthy-seconds 1800] [--repeats 5] [--only healthy,labels,feature]
        [--json bench/results/eval.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import child_env, percentile

MODEL = "m"
TABLES = {"t0": 0, "t1": 0, "t2": 0}
CLK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def every_verdict(store: Any) -> list[Any]:
    """Every verdict the evaluators recorded, by step (the per-step keys, not the bounded list
    of recent ones: a 30-minute run has thousands)."""
    from deltad.evaluate.record import Verdict

    keys = list(store.r.scan_iter(match=store.key("verdict", "*"), count=1000))
    raw = [x for x in store.r.mget(keys) if x] if keys else []
    return sorted((Verdict.from_json(x) for x in raw), key=lambda v: (v.generation, v.step))


def run_once(
    work: Path, *, rows: int, seconds: float, publish_every: float, corrupt: list[str],
    bad_step: int, release_delay: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """One trainer run judged by one evaluator; what the verdicts say."""
    from deltad.reference.trainer.holdout import golden_examples

    from deltad.config import GateConfig, ServerConfig
    from deltad.evaluate.labelled import write_examples
    from deltad.evaluate.record import VerdictStore
    from deltad.serve.edge.app import SidecarServer
    from deltad.store.client import connect
    from deltad.store.embedded import EmbeddedRedis

    work.mkdir(parents=True, exist_ok=True)
    tables = {t: rows for t in TABLES}
    write_examples(work / "golden.jsonl", golden_examples(tables, rows, 1024))
    redis = EmbeddedRedis(work / "redis")
    url = redis.start()
    gate = GateConfig(max_norm_jump=(("*", 2.0),), max_changed_fraction=(("*", 1.0),))
    servers = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(2):
            cfg = ServerConfig(
                spool_dir=work / "spool", model=MODEL, rank=r, listen="127.0.0.1:0",
                redis_url=url, poll_interval_s=0.02, grace_period_s=0.5,
                retention_interval_s=3600.0, gate=gate,
            )  # fmt: skip
            servers.append(SidecarServer(cfg).start())
        eps = [s.endpoint for s in servers]
        shape = ["--tables", "3", "--rows", str(rows), "--dim", "8", "--zch-slots", "0"]
        store = VerdictStore(connect(url), MODEL)
        ev = subprocess.Popen(
            [sys.executable, "-m", "deltad.commands.main", "evaluate", "--redis-url", url, "--model",
             MODEL, *[x for e in eps for x in ("--sidecar", e)],
             "--golden", str(work / "golden.jsonl"), "--labelled-dir", str(work / "hold"),
             *shape, "--eps", "0.06", "--delta", "0.3", "--min-examples", "512",
             "--progressive-examples", "512", "--poll-interval", "0.3",
             "--release-delay", str(release_delay)],
            env=child_env(), stdout=open(work / "eval.out", "wb"),  # noqa: SIM115
            stderr=open(work / "eval.log", "wb"),  # noqa: SIM115
            start_new_session=True,
        )  # fmt: skip
        procs.append(ev)
        # the evaluator first (it holds the model at the first step it sees), then the trainer
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and b"evaluating" not in (work / "eval.out").read_bytes():
            if ev.poll() is not None:
                raise RuntimeError(f"deltad evaluate exited: see {work / 'eval.log'}")
            time.sleep(0.2)
        train = subprocess.Popen(
            [sys.executable, "-m", "deltad.commands.main", "train", "--spool", str(work / "spool"),
             "--model", MODEL, "--world-size", "2", *shape, "--duration", str(seconds),
             "--publish-every-seconds", str(publish_every), "--no-progress",
             "--holdout-dir", str(work / "hold"), *corrupt],
            env=child_env(), stdout=subprocess.DEVNULL, stderr=open(work / "train.log", "wb"),  # noqa: SIM115
            start_new_session=True,
        )  # fmt: skip
        procs.append(train)
        # the release step as the sidecars have it, every 0.1 s: (unix time, release step)
        releases: list[tuple[float, int | None]] = []
        stop = threading.Event()

        def watch() -> None:
            from deltad.clientauth import ClientAuth
            from deltad.errors import DeltadError
            from deltad.evaluate.control import RolloutClient

            rc = RolloutClient(eps, ClientAuth())
            while not stop.wait(0.1):
                try:
                    releases.append((time.time(), rc.status().state.release_step))
                except DeltadError:  # (a sidecar busy: the next poll)
                    continue

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        train.wait(seconds + 600)
        time.sleep(3.0)  # (the last step's verdict)
        stop.set()
        watcher.join(10)
        cpu = _cpu_s(ev.pid)
        verdicts = every_verdict(store)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for s in servers:
            s.stop(0.2)
        redis.stop()
    # (the first few steps of a fresh model are noise; a corrupt run counts from bad_step)
    judged = [v for v in verdicts if v.step >= 5]
    good = [v for v in judged if v.passed and (not corrupt or v.step < bad_step)]
    failed = [v for v in judged if not v.passed]
    lag = []
    for v in good:  # from its publish to the first time the release step reached it
        at = next((t for t, r in releases if r is not None and r >= v.step), None)
        if v.published_unix and at is not None:
            lag.append(at - v.published_unix)
    released = [r for _, r in releases if r is not None]
    first_bad = next((v for v in failed if v.step >= bad_step), None) if corrupt else None
    return {
        "corrupt": corrupt,
        "verdicts": len(verdicts),
        "passed": sum(v.passed for v in judged),
        "failed": len(failed),
        "false_holds": len([v for v in failed if not corrupt or v.step < bad_step]),
        "detected_step": first_bad.step if first_bad else None,
        "steps_to_detect": (first_bad.step - bad_step) if first_bad else None,
        "detect_s": (first_bad.decided_unix - first_bad.published_unix) if first_bad else None,
        # from the publish of the first corrupt step judged (the canaries' exposure)
        "corrupt_publish_to_hold_s": (
            first_bad.decided_unix
            - min(v.published_unix for v in judged if v.step >= bad_step and v.published_unix)
        )
        if first_bad
        else None,
        # step, verdict, published, decided, then per scored set: its name, the candidate's NE
        # and the release's NE (what the corruption did to the model, step by step)
        "judged": [
            [v.step, v.verdict, round(v.published_unix, 3), round(v.decided_unix, 3)]
            + [x for s in v.sets for x in (s.name, s.candidate.get("ne"), s.release.get("ne"))]
            for v in verdicts
        ],
        "released_corrupt_steps": bool(corrupt) and any(r >= bad_step for r in released),
        "max_release_step": max(released) if released else None,
        "release_lag_p50_s": statistics.median(lag) if lag else None,
        "release_lag_p99_s": percentile(lag, 99) if lag else None,
        "cpu_s_per_verdict": cpu / max(1, len(verdicts)),
    }


def _spread(xs: list[float]) -> dict[str, Any]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Item 7 over the repeats: medians with their range (the range is the noise line)."""
    out: dict[str, Any] = {}
    for name, reps in runs.items():
        out[name] = {
            "repeats": len(reps),
            "false_holds": sum(r["false_holds"] for r in reps),
            "verdicts": sum(r["verdicts"] for r in reps),
            "caught": sum(r["detected_step"] is not None for r in reps),
            "released_corrupt": sum(bool(r["released_corrupt_steps"]) for r in reps),
            "corrupt_publish_to_hold_s": _spread([r["corrupt_publish_to_hold_s"] for r in reps]),
            "steps_to_detect": _spread([r["steps_to_detect"] for r in reps]),
            "release_lag_p50_s": _spread([r["release_lag_p50_s"] for r in reps]),
            "release_lag_p99_s": _spread([r["release_lag_p99_s"] for r in reps]),
            "cpu_s_per_verdict": _spread([r["cpu_s_per_verdict"] for r in reps]),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--publish-every", type=float, default=0.5)
    p.add_argument("--seconds", type=float, default=40.0, help="training time of a corrupt run")
    p.add_argument("--healthy-seconds", type=float, default=120.0, help="the healthy run")
    p.add_argument("--bad-step", type=int, default=30)
    p.add_argument("--fractions", default="0.1,0.25,0.5,1.0")
    p.add_argument("--release-delay", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1, help="runs of each corruption")
    p.add_argument(
        "--only", default="healthy,labels,feature",
        help="which runs: healthy, labels (one per fraction), feature",
    )  # fmt: skip
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    plan: list[tuple[str, float, list[str]]] = []
    if "healthy" in only:
        plan.append(("healthy", a.healthy_seconds, []))
    for _ in range(a.repeats):
        if "labels" in only:
            for f in a.fractions.split(","):
                plan.append(
                    (
                        f"labels-{f}",
                        a.seconds,
                        ["--corrupt-labels-from-step", str(a.bad_step), "--corrupt-fraction", f],
                    )
                )
        if "feature" in only:
            plan.append(("feature", a.seconds, ["--corrupt-feature-from-step", str(a.bad_step)]))
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        base = dict(
            rows=a.rows, publish_every=a.publish_every, bad_step=a.bad_step,
            release_delay=a.release_delay,
        )  # fmt: skip
        for i, (name, seconds, corrupt) in enumerate(plan):
            r = run_once(Path(tmp) / f"{name}-{i}", seconds=seconds, corrupt=corrupt,
                         **base)  # type: ignore[arg-type]  # fmt: skip
            runs.setdefault(name, []).append(r)
            print(json.dumps({name: {k: v for k, v in r.items() if k != "judged"}}), flush=True)
    caught = [k for k, reps in runs.items() if k != "healthy" and all(
        r["detected_step"] is not None for r in reps)]  # fmt: skip
    out = {
        "summary": summarize(runs), "runs": runs, "caught": caught,
        "config": dataclasses.asdict(_Cfg(**vars(a))),
    }  # fmt: skip
    if a.json:  # the shape of bench/results/*.json: where it comes from, then the result
        doc = {
            "source": "python -m bench.eval " + " ".join(argv if argv is not None else sys.argv[1:]),
            "meta": {"recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "result": out,
        }  # fmt: skip
        a.json.write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps(out["summary"], indent=2, default=str))
    return 0


@dataclasses.dataclass
class _Cfg:
    rows: int
    publish_every: float
    seconds: float
    healthy_seconds: float
    bad_step: int
    fractions: str
    release_delay: float
    repeats: int
    only: str
    json: Path | None


if __name__ == "__main__":
    sys.exit(main())
