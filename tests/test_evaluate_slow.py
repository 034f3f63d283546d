"""The canary evaluator end to end (issue 39): the reference trainer (2 gloo ranks) writing
held-out examples, real sidecars with a norm gate, Redis, predictors and evaluators."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from evalkit import Follower, evaluator, golden, kill, sidecars, trainer
from spoolkit import wait_for
from test_relay import predictor
from test_rollout import A, rollout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_good_steps_are_released_and_corrupt_labels_hold_and_roll_the_canaries_back(
    tmp_path: Path, redis_url: str
) -> None:
    """Passing steps are released; flipped labels from step 24 pass the norm gate but fail
    NE: the fleet holds at the last good step, the canary group rolls back to it (its tables
    bit-equal to the evaluator's release copy), no other predictor ever gets a bad step."""
    bad = 24
    golden(tmp_path)
    followers: list[Follower] = []
    ev = train = None
    try:
        with sidecars(tmp_path, redis_url) as eps:
            rollout(eps[0], A.ROLLOUT_CANARY, group="pred-canary-*")
            ev = evaluator(tmp_path, redis_url, eps)
            train = trainer(tmp_path, "--corrupt-labels-from-step", str(bad), steps=44)
            wait_for(lambda: _head(eps) >= 1, 120, "the first published step")
            ev.start()
            held0 = rollout(eps[0], A.ROLLOUT_STATUS).release_step
            assert held0 is not None and held0 < bad  # held at the head it found
            main, canary = predictor("pred-1", eps), predictor("pred-canary-1", eps)
            with main, canary:
                fm, fc = Follower(main), Follower(canary)
                followers += [fm, fc]
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
                # nobody outside the canary group was ever served a corrupt step
                assert fm.steps and max(fm.steps) < bad, sorted(fm.steps)
                wait_for(lambda: fm.results[-1].step == rel, 30, "the fleet at the release")
    finally:
        for f in followers:
            f.close()
        if ev is not None:
            ev.close()
        if train is not None:
            kill(train)


def _head(eps: list[str]) -> int:
    from test_rollout import status

    return min(status(e).head_step for e in eps)
