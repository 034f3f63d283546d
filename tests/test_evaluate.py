"""The canary evaluator's parts (issue 39): metrics as TorchRec computes them, the verdict,
the labelled-example format and holdout spool, batches of examples, the corruptions, the
verdict records' compare-and-set in a real Redis, and the CLI's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spoolkit import child_env

from deltad.errors import ConfigError
from deltad.evaluate.labelled import (
    HoldoutWriter,
    LabelledExample,
    holdout_files,
    newest_examples,
    read_examples,
    write_examples,
)
from deltad.evaluate.metrics import NE, Calibration, Metric, default_metrics
from deltad.evaluate.record import VerdictStore
from deltad.evaluate.verdict import FAIL, PASS, SetScores, Thresholds, Verdict, decide
from deltad.store.client import connect

pytestmark = pytest.mark.timeout(120)


def _preds(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g)
    labels = (torch.rand(n, generator=g) < p).float()
    return p, labels, torch.rand(n, generator=g) + 0.5


def test_ne_and_calibration_are_torchrecs_own() -> None:
    from torchrec.metrics.calibration import CalibrationMetric
    from torchrec.metrics.ne import NEMetric
    from torchrec.metrics.rec_metric import RecTaskInfo

    p, labels, w = _preds(300, 1)
    task = RecTaskInfo(name="t", label_name="l", prediction_name="p", weight_name="w")
    ne = NEMetric(world_size=1, my_rank=0, batch_size=300, tasks=[task], window_size=1000)
    cal = CalibrationMetric(world_size=1, my_rank=0, batch_size=300, tasks=[task], window_size=1000)
    for m in (ne, cal):
        m.update(predictions={"t": p}, labels={"t": labels}, weights={"t": w})
    want_ne = float(ne.compute()["ne-t|lifetime_ne"])
    want_cal = float(cal.compute()["calibration-t|lifetime_calibration"])
    assert NE().compute(p, labels, w) == pytest.approx(want_ne, rel=1e-6)  # (its states: float32)
    assert Calibration().compute(p, labels, w) == pytest.approx(want_cal, rel=1e-6)
    # a perfect predictor of the base rate has NE 1; a better one less
    base = torch.full((300,), float(labels.mean()))
    assert NE().compute(base, labels, torch.ones(300)) == pytest.approx(1.0, abs=1e-9)


def _set(ne_c: float, ne_r: float, cal: float, n: int = 600) -> SetScores:
    return SetScores("golden", n, {"ne": ne_c, "calibration": cal}, {"ne": ne_r, "calibration": 1})


def test_the_verdict_passes_within_eps_and_delta_over_enough_examples() -> None:
    th, ms = Thresholds(eps=0.02, delta=0.1, min_examples=500), default_metrics()
    assert decide([_set(0.80, 0.80, 1.0)], ms, th) == (PASS, ())
    assert decide([_set(0.815, 0.80, 1.09)], ms, th)[0] == PASS  # within both
    verdict, why = decide([_set(0.82, 0.80, 1.0)], ms, th)
    assert verdict == FAIL and "NE 0.8200 > release's 0.8000" in why[0]
    verdict, why = decide([_set(0.80, 0.80, 1.2)], ms, th)
    assert verdict == FAIL and "calibration 1.200 outside [0.9, 1.1]" in why[0]
    verdict, why = decide([_set(0.7, 0.8, 1.0, n=100)], ms, th)
    assert verdict == FAIL and why == ("100 examples scored, fewer than 500",)
    verdict, why = decide([_set(float("nan"), 0.8, 1.0)], ms, th)
    assert verdict == FAIL and "ne not computed" in why[0]
    # every scored set must pass; an empty one is left out
    empty = SetScores("progressive", 0, {}, {})
    assert decide([_set(0.8, 0.8, 1.0), empty], ms, th)[0] == PASS
    assert decide([_set(0.8, 0.8, 1.0), _set(0.9, 0.8, 1.0)], ms, th)[0] == FAIL


def test_a_users_own_metric_takes_part_in_the_verdict() -> None:
    class Accuracy:
        name = "accuracy"

        def compute(self, predictions: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor) -> float:  # fmt: skip
            return float(((predictions > 0.5).double() == labels).double().mean())

        def check(self, candidate: float, release: float, th: Thresholds) -> str:
            return "" if candidate >= release - 0.01 else f"accuracy {candidate} < {release}"

    acc = Accuracy()
    assert isinstance(acc, Metric)
    p, labels, w = _preds(600, 2)
    s = SetScores("golden", 600, {"accuracy": acc.compute(p, labels, w)}, {"accuracy": 0.99})
    verdict, why = decide([s], [acc], Thresholds(min_examples=10))
    assert verdict == FAIL and why[0].startswith("golden: accuracy")


def test_labelled_examples_round_trip_and_bad_lines_are_named(tmp_path: Path) -> None:
    ex = [
        LabelledExample(1.0, (0.5, -1.0), {"f_t0": (3, 4), "seq": ()}, weight=2.0, step=7),
        LabelledExample(0.0, (), {}),
    ]
    f = tmp_path / "g.jsonl"
    assert write_examples(f, ex) == 2
    assert read_examples(f) == ex
    assert read_examples(tmp_path) == ex  # a directory: its *.jsonl files
    f.write_text(ex[0].to_json() + "\n" + '{"label": 2}\n')
    with pytest.raises(ConfigError, match=r"line 2: label must be 0 or 1"):
        read_examples(f)
    f.write_text('{"label": 1, "ids": {"f": [-1]}}\n')
    with pytest.raises(ConfigError, match=r"line 1: ids must map"):
        read_examples(f)
    with pytest.raises(ConfigError, match="No such file"):
        read_examples(tmp_path / "missing.jsonl")


def test_the_holdout_spool_keeps_the_newest_files_per_rank(tmp_path: Path) -> None:
    w0 = HoldoutWriter(tmp_path, rank=0, generation=5, keep=3)
    w1 = HoldoutWriter(tmp_path, rank=1, generation=5, keep=3)
    for step in range(1, 8):
        for w in (w0, w1):
            w.write(step, [LabelledExample(float(step % 2), step=step, rank=w.rank)] * 2)
    files = holdout_files(tmp_path)
    assert [(s, r) for _, s, r, _ in files] == [(s, r) for s in (5, 6, 7) for r in (0, 1)]
    got = newest_examples(tmp_path, 5)
    assert len(got) == 5 and [e.step for e in got] == [7, 7, 7, 7, 6]
    assert {e.step for e in newest_examples(tmp_path, 100, max_step=5)} == {5}
    # a newer generation's files hide the older generation's
    HoldoutWriter(tmp_path, rank=0, generation=6).write(1, [LabelledExample(1.0, step=1)])
    assert [e.step for e in newest_examples(tmp_path, 100)] == [1]
    assert newest_examples(tmp_path / "none", 10) == []


def test_batches_of_examples_are_the_batches_they_came_from() -> None:
    from deltad.reference.trainer.data import ClickStream
    from deltad.reference.trainer.holdout import batch_of, examples_of, split_batch

    tables = {"t0": 50, "t1": 60}
    b = ClickStream(tables, 40, batch_size=24, seed=3, zch_raw_ids=100).next_batch()
    train, held = split_batch(b, 16)
    assert train.labels.numel() == 16 and held.labels.numel() == 8
    ex = examples_of(held, step=9, rank=1)
    assert len(ex) == 8 and all(e.step == 9 and e.rank == 1 for e in ex)
    again = batch_of(ex, list(tables), zch=True)
    assert torch.equal(again.dense, held.dense) and torch.equal(again.labels, held.labels)
    for x, y in ((again.sparse, held.sparse), (again.seq, held.seq), (again.zch, held.zch)):
        assert x.keys() == y.keys()
        assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())
    # the two halves together are the batch
    assert torch.equal(torch.cat([train.labels, held.labels]), b.labels)


def test_the_corruptions_change_what_they_say_and_nothing_else() -> None:
    from deltad.reference.trainer.data import ClickStream
    from deltad.reference.trainer.holdout import corrupt_feature, corrupt_labels

    tables = {"t0": 50, "t1": 60}
    b = ClickStream(tables, 40, batch_size=64, seed=4).next_batch()
    g = torch.Generator().manual_seed(0)
    flipped = corrupt_labels(b, g)
    assert torch.equal(flipped.labels, 1 - b.labels) and flipped.dense is b.dense
    half = corrupt_labels(b, g, fraction=0.5)
    changed = int((half.labels != b.labels).sum())
    assert 0 < changed < 64
    shuffled = corrupt_labels(b, g, mode="shuffle")
    assert shuffled.labels.sum() == b.labels.sum()
    bad = corrupt_feature(b, tables)
    d, orig = bad.sparse.to_dict(), b.sparse.to_dict()
    assert torch.equal(d["f_t0"].values(), orig["f_t1"].values() % 50)
    assert torch.equal(d["f_t1"].values(), orig["f_t1"].values())
    with pytest.raises(ConfigError):
        corrupt_labels(b, g, mode="bogus")


def test_the_first_verdict_on_a_step_wins_and_replicas_adopt_it(redis_url: str) -> None:
    store = VerdictStore(connect(redis_url), "m")
    a = Verdict("m", 3, 10, 8, PASS, by="eval-a", sets=(_set(0.8, 0.8, 1.0),))
    b = Verdict("m", 3, 10, 8, FAIL, reasons=("x",), by="eval-b")
    assert store.put_first(a) == (a, True)
    got, mine = store.put_first(b)
    assert not mine and got == a and store.get(3, 10) == a
    assert store.get(3, 11) is None
    assert [v.step for v in store.recent()] == [10]
    with store.lock() as first, store.lock(wait_s=0.2) as second:
        assert first and not second
    with store.lock() as again:
        assert again
    store.heartbeat("eval-a", 5.0, {"step": 10})
    assert store.alive() == {"eval-a": {"step": 10}}


def test_a_sidecar_says_who_evaluates_and_the_newest_verdicts_in_status(
    tmp_path: Path, redis_url: str
) -> None:
    """A real sidecar over the model's Redis: Status ``evaluator_state`` and `deltad status`
    name the live evaluators and the newest verdicts; with none alive, they say the fleet
    stays at the last release."""
    import contextlib
    import io
    import time

    from serverkit import SpoolWriter, server_config

    from deltad.commands.main import main
    from deltad.serve.edge.app import SidecarServer

    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()
    srv = SidecarServer(server_config(tmp_path / "spool", redis_url)).start()
    target = f"127.0.0.1:{srv.port}"

    def status_text() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["status", "--target", target]) == 0
        return out.getvalue()

    labels = {"model": "m", "rank": "0"}

    def gauges() -> tuple[float | None, float | None]:
        get = srv.metrics.registry.get_sample_value
        return (
            get("deltad_evaluators_alive", labels),
            get("deltad_evaluator_verdict_age_seconds", labels),
        )

    try:
        assert "evaluator:" not in status_text()  # no evaluator ever ran: nothing said
        assert gauges() == (0.0, -1.0)  # (DeltadEvaluatorDown stays quiet)
        store = VerdictStore(connect(redis_url), "m")
        store.put_first(Verdict("m", 1, 7, 5, FAIL, reasons=("ne",), by="eval-a",
                                decided_unix=time.time()))  # fmt: skip
        store.heartbeat("eval-a", 30.0, {"step": 7})
        time.sleep(1.1)  # (the sidecar's view is at most 1 s stale)
        text = status_text()
        assert "evaluator: eval-a alive" in text, text
        assert "step 7 (generation 1) vs release step 5: fail by eval-a" in text, text
        alive, age = gauges()
        assert alive == 1.0 and age is not None and 1.0 <= age < 30, (alive, age)
        store.r.delete(store.key("alive", "eval-a"))  # the evaluator died
        time.sleep(1.1)
        text = status_text()
        assert "evaluator: NONE alive: the fleet stays at the last release" in text, text
        alive, age = gauges()  # what DeltadEvaluatorDown fires on
        assert alive == 0.0 and age is not None and age > 2.0, (alive, age)
    finally:
        srv.stop(0)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "evaluate", *argv],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip


@pytest.mark.slow  # (seven CLI processes: ~20 s)
def test_the_cli_refuses_bad_input_in_one_line_and_shows_the_records(
    tmp_path: Path, redis_url: str
) -> None:
    for argv, want in (
        (["--redis-url", redis_url], "give --golden PATH and/or --labelled-dir DIR"),
        (["--eps", "nan"], "--eps"),
        (["--golden", str(tmp_path / "none.jsonl"), "--redis-url", redis_url], "No such file"),
        (["--labelled-dir", str(tmp_path / "no" / "dir"), "--redis-url", redis_url], "nor its par"),
    ):
        p = _cli(*argv)
        assert p.returncode == 2, p.stderr
        assert want in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = _cli("--status", "--redis-url", redis_url, "--model", "m2")
    assert p.returncode == 0, p.stderr
    assert "none alive: the fleet stays at the last release" in p.stdout
    store = VerdictStore(connect(redis_url), "m2")
    store.put_first(Verdict("m2", 1, 12, 10, FAIL, reasons=("golden: NE up",), by="eval-m2"))
    p = _cli("--status", "--redis-url", redis_url, "--model", "m2", "--json")
    out = json.loads(p.stdout)
    assert out["alive"] == {} and out["verdicts"][0]["step"] == 12
