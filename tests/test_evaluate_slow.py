"""The canary evaluator end to end (issue 39): the reference trainer (2 gloo ranks) writing
held-out examples, real sidecars with a norm gate, Redis, predictors and evaluators."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from evalkit import SHAPE, TABLES, Follower, evaluator, golden, kill, sidecars, trainer
from spoolkit import child_env, wait_for
from test_relay import db, predictor, start_relay
from test_rollout import A, rollout, status

from deltad.consume.quant import QuantApplier, quant_tables, quantize_model
from deltad.evaluate.record import VerdictStore
from deltad.evaluate.scoring import reference_model
from deltad.serve.relay.server import RelayServer
from deltad.store.client import connect

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
]


def test_good_steps_are_released_and_corrupt_labels_hold_and_roll_the_canaries_back(
    tmp_path: Path, redis_url: str
) -> None:
    """Passing steps are released; flipped labels from step 24 pass the norm gate but fail
    NE: the fleet holds at the last good step, the canary group rolls back to it (its tables
    bit-equal to the evaluator's release copy), no other predictor ever gets a bad step. The
    same holds for predictors behind a relay per rank (the evaluator acts at the sidecars; the
    relays follow the release state): a main predictor there never gets a bad step, an int8
    canary there rolls back bit-exact."""
    bad = 24
    golden(tmp_path)
    followers: list[Follower] = []
    relays: list[RelayServer] = []
    ev = train = None
    try:
        with sidecars(tmp_path, redis_url) as eps:
            relays = [start_relay(e, tmp_path / f"relay-{r}", r, db(redis_url, r + 1))
                      for r, e in enumerate(eps)]  # fmt: skip
            reps = [x.endpoint for x in relays]
            rollout(eps[0], A.ROLLOUT_CANARY, group="pred-canary-*")
            ev = evaluator(tmp_path, redis_url, eps)
            train = trainer(
                tmp_path, "--corrupt-labels-from-step", str(bad), "--golden-out",
                str(tmp_path / "golden-trainer.jsonl"), "--golden-examples", "1024", steps=44,
            )  # fmt: skip
            wait_for(lambda: _head(eps) >= 5, 120, "the first steps (a trained model)")
            ev.start()
            held0 = rollout(eps[0], A.ROLLOUT_STATUS).release_step
            assert held0 is not None and held0 < bad  # held at the head it found
            main, canary = predictor("pred-1", eps), predictor("pred-canary-1", eps)
            main_r = predictor("pred-2", reps)  # behind the relays
            canary_q = predictor("pred-canary-q", reps)  # int8 serving, behind the relays
            with main, canary, canary_q, main_r:
                fm, fc, fr = Follower(main), Follower(canary), Follower(main_r)
                fq = Follower(canary_q, QuantApplier(quantize_model(reference(), "int8")))
                followers += [fm, fc, fq, fr]
                t = threading.Thread(target=ev.run, daemon=True)
                t.start()
                assert train.wait(240) == 0, train.stderr.read().decode() if train.stderr else ""
                wait_for(lambda: any(not v.passed and v.step >= bad for v in ev.verdicts), 60,
                         "a failed verdict past the corruption")  # fmt: skip
                ev.stop.set()
                t.join(60)
                st = rollout(eps[0], A.ROLLOUT_STATUS)
                passed = [v.step for v in ev.verdicts if v.passed]
                failed = [v for v in ev.verdicts if not v.passed]
                assert passed and max(passed) < bad, [v.line() for v in ev.verdicts]
                assert st.release_step is not None and held0 < st.release_step < bad
                assert st.held and st.release_step in passed
                # the norm gate passed every step: the evaluator alone stopped them
                assert st.gate_bad_step is None and not st.gate_reason
                assert all(v.step >= bad for v in failed), [v.line() for v in failed]
                assert any(v.sets[0].candidate["ne"] > v.sets[0].release["ne"] for v in failed)
                rel = st.release_step
                # the canaries followed the head into the corrupt steps, then rolled back
                assert max(fc.steps) >= bad
                wait_for(lambda: fc.results[-1].step == rel, 30, "the canary back at the release")
                assert ev.release.step == rel
                tables = ev.release.applier.tables()
                got = fc.applier.tables()
                assert all(torch.equal(got[n], tables[n]) for n in tables)
                # and the int8 canary holds torchrec's quantization of the release copy
                wait_for(lambda: fq.results[-1].step == rel, 30, "the int8 canary back")
                assert max(fq.steps) >= bad
                want = quantize_model(ev.release.model, "int8")
                for n, q in quant_tables(want).items():
                    assert torch.equal(fq.applier.quant_tables[n].rows, q.rows), n
                # the trainer's --golden-out is the golden set the test wrote
                g = tmp_path / "golden.jsonl"
                assert (tmp_path / "golden-trainer.jsonl").read_bytes() == g.read_bytes()
                # nobody outside the canary group was ever served a corrupt step
                for f in (fm, fr):
                    assert f.steps and max(f.steps) < bad, sorted(f.steps)
                    wait_for(lambda f=f: f.results[-1].step == rel, 30, "the fleet at release")
                # (the relays hold the corrupt steps: their canary was served them)
                assert all(status(e).head_step >= bad for e in reps)
    finally:
        for f in followers:
            f.close()
        for x in relays:
            x.stop(0.2)
        if ev is not None:
            ev.close()
        if train is not None:
            kill(train)


def reference() -> Any:
    """The evaluator's model (evalkit.evaluator's make_model), float."""
    return reference_model(TABLES, 400, dim=8, zch_slots=0).eval()


def _head(eps: list[str]) -> int:
    return min(status(e).head_step for e in eps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _evaluate_cli(tmp: Path, redis_url: str, eps: list[str], name: str, port: int) -> Any:
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "evaluate", "--redis-url", redis_url, "--model",
         "m", "--sidecar", eps[0], "--sidecar", eps[1], "--consumer", name,
         "--golden", str(tmp / "golden.jsonl"), "--labelled-dir", str(tmp / "hold"), *SHAPE,
         "--eps", "0.06", "--delta", "0.3", "--min-examples", "512",
         "--progressive-examples", "512", "--poll-interval", "0.3", "--release-delay", "1",
         "--metrics-port", str(port)],
        env={**child_env(), "TMPDIR": str(tmp)}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "wb"),
    )  # fmt: skip


def _judged(log: Path) -> dict[int, str]:
    """step -> verdict, from an evaluator's log lines."""
    out = {}
    for m in re.finditer(r"evaluator: step (\d+) \(generation \d+\) vs release step \d+: (\w+)",
                         log.read_text()):  # fmt: skip
        out[int(m.group(1))] = m.group(2)
    return out


def test_two_evaluators_agree_shuffled_labels_hold_and_dead_evaluators_release_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    """Two `deltad evaluate` replicas: one verdict per step, the same in both logs; labels
    shuffled within each batch from step 20 pass the norm gate and fail NE; both killed, the
    release step stays where an operator put it while the trainer goes on."""
    bad = 20
    golden(tmp_path)
    procs: list[Any] = []
    train = None
    try:
        with sidecars(tmp_path, redis_url) as eps:
            ports = [free_port(), free_port()]
            procs = [_evaluate_cli(tmp_path, redis_url, eps, n, p)
                     for n, p in zip(("eval-a", "eval-b"), ports, strict=True)]  # fmt: skip
            train = trainer(
                tmp_path,
                "--corrupt-labels-from-step",
                str(bad),
                "--corrupt-labels-mode",
                "shuffle",
                steps=70,
            )
            store = VerdictStore(connect(redis_url), "m")

            def failed() -> bool:
                return any(not v.passed and v.step >= bad for v in store.recent(50))

            wait_for(failed, 200, "a failed verdict on the shuffled labels")
            # (both act on it: the hold follows the verdict)
            wait_for(lambda: rollout(eps[0], A.ROLLOUT_STATUS).held, 30, "the hold")
            st = rollout(eps[0], A.ROLLOUT_STATUS)
            first_fail = min(v.step for v in store.recent(200) if not v.passed and v.step >= bad)
            # (a shuffle hurts less at once than a flip: a step or two may pass first)
            assert st.held and st.release_step is not None and st.release_step < first_fail
            assert st.gate_bad_step is None  # the norm gate let the corruption through
            assert set(st.canary) == {"eval-a", "eval-b"}
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=5) as r:
                text = r.read().decode()
            assert re.search(r'deltad_eval_ne\{copy="candidate",model="m",set="golden"\}', text)
            assert "deltad_eval_verdict_seconds_count" in text
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
            a, b = _judged(tmp_path / "eval-a.log"), _judged(tmp_path / "eval-b.log")
            both = set(a) & set(b)
            assert both and all(a[s] == b[s] for s in both), (a, b)
            recorded = {v.step: v.verdict for v in store.recent(200)}
            assert all(recorded[s] == v for s, v in {**a, **b}.items())
            assert any(v == "pass" for v in recorded.values())
            # the evaluators are dead: an operator releases a step; nothing moves it after
            head = min(status(e).head_step for e in eps)
            s = rollout(eps[0], A.ROLLOUT_RELEASE, step=head)
            wait_for(lambda: min(status(e).head_step for e in eps) >= head + 3, 180, "3 steps")
            after = rollout(eps[0], A.ROLLOUT_STATUS)
            assert after.release_step == s.release_step == head and not after.held
    finally:
        for p in procs:
            kill(p)
        if train is not None:
            kill(train)


def test_the_silent_bad_update_demo_checks_the_quality_gate(tmp_path: Path) -> None:
    """`deltad demo --scenario silent-bad-update`: exit 0 and `check quality-gate: ... ok`
    (checked by the demo from the predictors' logs, the verdicts and the release state); a
    flag its fixed shape cannot honour is refused in one line."""
    p = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "demo", "--scenario", "silent-bad-update",
         "--rows", "2000", "--dim", "8", "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600, env=child_env(),
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("check quality-gate:"))
    assert line.endswith(": ok") and "none corrupt (yes)" in line, line
    p = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "demo", "--scenario", "silent-bad-update",
         "--duration", "5", "--workdir", str(tmp_path / "demo2")],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    assert p.returncode == 2 and "does not take --duration" in p.stderr, p.stderr


def test_a_trainer_restarted_while_held_reaches_the_fleet_only_once_the_evaluator_passes_it(
    tmp_path: Path, redis_url: str
) -> None:
    """Issue 39 item 3 with a real trainer and evaluator: flipped labels hold the fleet at a
    step of generation 1; the trainer then restarts from scratch (generation 2, clean labels).
    While generation 2's steps pass the held step, a predictor outside the canary group is
    served nothing of it (its cap is a state: generation 1's step); once generation 2's model
    is as good as the release, the evaluator passes one of its steps, releases it, and the
    predictor moves to generation 2."""
    bad = 16
    golden(tmp_path)
    followers: list[Follower] = []
    ev = train = None
    try:
        with sidecars(tmp_path, redis_url) as eps:
            ev = evaluator(tmp_path, redis_url, eps)
            train = trainer(tmp_path, "--corrupt-labels-from-step", str(bad), steps=30)
            wait_for(lambda: _head(eps) >= 5, 120, "the first steps (a trained model)")
            ev.start()
            with predictor("pred-1", eps) as main:
                fm = Follower(main)
                followers.append(fm)
                t = threading.Thread(target=ev.run, daemon=True)
                t.start()
                assert train.wait(240) == 0, train.stderr.read().decode() if train.stderr else ""
                wait_for(lambda: rollout(eps[0], A.ROLLOUT_STATUS).held, 60, "the hold")
                st = rollout(eps[0], A.ROLLOUT_STATUS)
                held, gen1 = st.release_step, st.release_generation
                assert held is not None and held < bad and gen1 is not None
                wait_for(lambda: bool(fm.results) and fm.results[-1].step == held, 30, "at it")
                train = trainer(tmp_path, steps=80)  # from scratch: a new generation
                checked, gen2_past_held = 0, False
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    n = len(fm.results)
                    st = rollout(eps[0], A.ROLLOUT_STATUS)
                    if st.release_generation not in (None, gen1):
                        break
                    checked = n  # pulled while the release still named generation 1
                    s0 = status(eps[0])
                    gen2_past_held |= s0.generation != gen1 and s0.head_step > held
                    time.sleep(0.2)
                else:
                    pytest.fail("the evaluator never released generation 2: "
                                + "; ".join(v.line() for v in ev.verdicts[-5:]))  # fmt: skip
                gen2 = st.release_generation
                assert gen2_past_held, "generation 2 never passed the held step while held"
                before = fm.results[:checked]
                assert before and all(r.step is not None and r.step <= held for r in before)
                assert all(d.generation == gen1 for r in before for d in r.deltas)
                # the release came from a passed verdict on generation 2
                assert any(v.passed and v.generation == gen2 for v in ev.verdicts)
                wait_for(
                    lambda: any(d.generation == gen2 for r in fm.results[checked:]
                                for d in r.deltas),
                    60, "the predictor on generation 2",
                )  # fmt: skip
                ev.stop.set()
                t.join(60)
    finally:
        for f in followers:
            f.close()
        if ev is not None:
            ev.close()
        if train is not None:
            kill(train)
