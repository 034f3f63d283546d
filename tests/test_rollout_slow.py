"""Release controls with the reference trainer (2 gloo ranks) training and publishing: a hold
stops a predictor at one step on both ranks while a canary follows the head; a release takes it
to the trainer's final tables, bit for bit. Real processes, Redis and gRPC."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from evalkit import Follower
from spoolkit import child_env, wait_for
from test_relay import equal, predictor, status, tree
from test_rollout import A, rollout, settle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_hold_canary_and_release_while_the_reference_trainer_trains(
    tmp_path: Path, redis_url: str
) -> None:
    final = tmp_path / "final.pt"
    train = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "train", "--spool", str(tmp_path / "spool"),
         "--model", "m", "--world-size", "2", "--tables", "3", "--rows", "400", "--dim", "8",
         "--steps", "80", "--publish-every-steps", "2", "--no-progress",
         "--final-tables", str(final)],
        env={**child_env(), "TMPDIR": str(tmp_path)}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    followers: list[Follower] = []
    try:
        with (
            tree(tmp_path, redis_url, 2, 0) as [eps],
            predictor("pred-1", eps) as held_c,
            predictor("pred-canary-1", eps) as canary_c,
        ):
            wait_for(lambda: all(status(e).head_step >= 4 for e in eps), 200, "first segments")
            rollout(eps[0], A.ROLLOUT_HOLD)
            s = rollout(eps[1], A.ROLLOUT_CANARY, group="pred-canary-*")
            settle(eps, s.version)
            held_step = s.release_step
            assert held_step is not None
            held, canary = Follower(held_c), Follower(canary_c)
            followers += [held, canary]
            assert train.wait(300) == 0, train.stderr.read().decode() if train.stderr else ""
            truth = torch.load(final, weights_only=True)
            last = max(status(e).head_step for e in eps)
            assert last > held_step  # the trainer went on past the hold
            wait_for(lambda: equal(canary.applier, truth), 60, "the canary at the final tables")
            wait_for(lambda: len(held.results) > 3, 30, "held pulls")
            steps = {r.step for r in held.results}
            assert steps == {held_step}, steps  # both ranks, one step, all along
            assert all(r.caught_up and r.cap_step == held_step for r in held.results[-3:])
            assert not equal(held.applier, truth)
            s = rollout(eps[0], A.ROLLOUT_RELEASE)
            settle(eps, s.version)
            wait_for(lambda: equal(held.applier, truth), 60, "the released predictor")
            time.sleep(0.1)
            assert held.results[-1].caught_up
    finally:
        for f in followers:
            f.close()
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
            train.wait(30)
