"""`deltad demo` end to end at reduced size: real multi-process trainer (gloo), one sidecar per
rank, embedded Redis, two predictors, all as subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from spoolkit import child_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def demo_argv(work: Path, duration: float) -> list[str]:
    return [
        sys.executable, "-m", "deltad.commands.main", "demo",
        "--duration", str(duration), "--rows", "2000", "--dim", "8",
        "--workdir", str(work), "--keep", "--no-progress",
    ]  # fmt: skip


def test_demo_predictor_tables_equal_trainer_final_tables(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [*demo_argv(work, 6), "--archive"],
        capture_output=True, text=True, timeout=280, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check rows-fp32: tables bit-equal to the trainer's final tables" in proc.stdout
    truth = torch.load(work / "trainer-final.pt", weights_only=True)
    rows = torch.load(work / "rows-fp32-final.pt", weights_only=True)
    # 4 pooled tables, the sequence table and the managed-collision table
    assert set(truth) == set(rows) and len(truth) == 6
    for name, t in truth.items():
        assert torch.equal(rows[name], t), name
    topk = torch.load(work / "topk-int8-final.pt", weights_only=True)
    for name, t in truth.items():
        bound = (t.amax(dim=1) - t.amin(dim=1) + 1e-8) / 510 * (1 + 1e-5) + t.abs().amax(
            dim=1
        ) * 1e-5
        assert bool(((topk[name] - t).abs().amax(dim=1) <= bound).all()), name
    # --archive: the demo's embedded SeaweedFS (the dev extra's weed; a file store without
    # it), and a predictor bootstrapped from it, not the sidecars: its tables too are the
    # trainer's
    from deltad.store.seaweed import weed_binary

    (cold,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("check cold-start:")]
    store = "s3://deltad-archive/demo" if weed_binary() else f"file://{work / 'archive'}"
    assert f"({store}: " in cold and cold.endswith(": ok"), cold
    assert "0.00 MB of rows from the sidecars" in cold, cold
    started = torch.load(work / "cold-start-final.pt", weights_only=True)
    assert set(started) == set(truth)
    for name, t in truth.items():
        assert torch.equal(started[name], t), name
    # then relays following the archive, the trainer's sidecars stopped: the same tables
    (relayed,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("check store-relay:")]
    assert relayed.endswith(": ok") and "2 relays following the archive" in relayed, relayed
    behind = torch.load(work / "store-relay-final.pt", weights_only=True)
    assert set(behind) == set(truth)
    for name, t in truth.items():
        assert torch.equal(behind[name], t), name
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(work) in " ".join(p.info["cmdline"] or [])
    ]
    for line in ("rows-fp32", "topk-int8", "fresh p50"):
        assert line in proc.stdout
    # the serving predictor: packed-int8 rows and the dense state, bit-equal to the trainer's
    # final model (tables and dense) quantized by torchrec
    assert "check serving-int8: 6 int8 tables, 8 dense tensors and forward output" in proc.stdout
    # its managed-collision table: rows, remapper lookup buffers, forwards on raw ids
    (zch,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("check serving-zch:")]
    assert "torchrec: ok (zch (" in zch and "lookup buffers equal" in zch, zch
    assert " 0 evicted" not in zch and "never-seen raw ids equal" in zch, zch
    assert "(weights equal, forward equal)" in proc.stdout and "during apply" in proc.stdout
    model = torch.load(work / "trainer-model.pt", weights_only=True)
    assert {
        k for k in model if k.startswith(("bottom.", "over."))
    } and "ec.embeddings.seq.weight" in model
    serving = [line for line in proc.stdout.splitlines() if line.startswith("serving-int8 ")]
    # name, pulls, rows, bytes (2 words), dense bytes (2 words): the dense state was received
    assert len(serving) == 1 and float(serving[0].split()[5]) > 0, serving
    # the C++ predictor, where it is built for this torch (CI: always)
    from deltad.demo import cpp

    exe, why = cpp.binary()
    if exe is None and os.environ.get("DELTAD_REQUIRE_CPP", "") in ("", "0"):
        assert f"no serving-cpp predictor: {why}" in proc.stdout + proc.stderr
    else:
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("check serving-cpp:")]
        assert "torchrec: ok (weights equal, forward equal)" in line, line


@pytest.mark.timeout(900)
def test_the_bad_update_scenario_gates_canaries_and_rolls_back_with_deltad_rollout(
    tmp_path: Path,
) -> None:
    """`deltad demo --scenario bad-update`: the operator's steps are `deltad rollout`
    commands against the real sidecars; all three checks hold, exit 0."""
    work = tmp_path / "demo"
    argv = [
        sys.executable, "-m", "deltad.commands.main", "demo", "--scenario", "bad-update",
        "--rows", "2000", "--dim", "16", "--workdir", str(work), "--keep",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=880, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in ("gate", "canary", "rollback"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"check {check}:"))
        assert line.endswith(": ok"), line
    operator = (work / "logs" / "operator.log").read_text()
    assert "$ deltad rollout rollback --to-step 18 --target " in operator
    assert "failed the validation gate" in operator  # the release to the head, refused
    # the report lists the operator's commands, as they were typed, with their exit codes
    report = proc.stdout.splitlines()
    at = report.index(next(x for x in report if x.startswith("operator commands (answers in")))
    typed = [x.strip() for x in report[at + 1 :] if x.startswith("  $ deltad rollout ")]
    assert [t.split(" --target ")[0] for t in typed] == [
        "$ deltad rollout release --to-step 10",
        "$ deltad rollout pin --group 'pred-canary-*' --step 24",
        "$ deltad rollout release",
        "$ deltad rollout unpin --group 'pred-canary-*'",
        f"$ deltad rollout release --to-step {_gate_good(operator)}",
        "$ deltad rollout rollback --to-step 18",
    ], typed
    assert typed[2].endswith("(exit 2)") and typed[-1].endswith("(exit 0)"), typed
    assert str(work / "logs" / "operator.log") in report[at]
    # and prints each as it runs
    assert proc.stderr.count("$ deltad rollout ") == len(typed), proc.stderr[-2000:]


def _gate_good(operator_log: str) -> int:
    """The step the demo released to after the gate's refusal (the last good step)."""
    releases = re.findall(r"^\$ deltad rollout release --to-step (\d+) ", operator_log, re.M)
    return int(releases[-1])


def test_demo_interrupted_leaves_no_children(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.Popen(
        demo_argv(work, 120),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        logs = work / "logs"
        wait_for(
            lambda: all(
                (logs / f"sidecar-{r}.log").exists()
                and "serving" in (logs / f"sidecar-{r}.log").read_text()
                for r in range(2)
            ),
            120.0,
            "both sidecars serving",
        )
        # The demo spawns its predictors after the sidecars serve: interrupt it only once
        # every child is up (a SIGINT in the middle of spawning tests something else).
        wait_for(
            lambda: all((logs / f"{n}.jsonl").exists() for n in ("rows-fp32", "topk-int8")),
            120.0,
            "both predictors pulling",
        )
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert len(kids) >= 5  # redis, trainer, two sidecars, two predictors (and trainer ranks)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        assert rc == 130, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() - t0 < 45
        _, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_child_follows_its_parent_pid_from_the_environment() -> None:
    """The demo's children set PDEATHSIG themselves, after exec (no preexec_fn in a threaded
    parent); one whose parent is already gone refuses to start."""
    import os

    cmd = [sys.executable, "-m", "deltad.commands.main", "--version"]
    ok = subprocess.run(
        cmd,
        env={**os.environ, "DELTAD_PARENT_PID": str(os.getpid())},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    orphan = subprocess.run(
        cmd,
        env={**os.environ, "DELTAD_PARENT_PID": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert orphan.returncode == 1
    assert "parent process already exited" in orphan.stderr


@pytest.mark.slow  # a demo that fails early: subprocesses importing torch
@pytest.mark.timeout(300)
def test_a_demo_that_fails_early_removes_its_temp_dir_and_says_so(tmp_path: Path) -> None:
    """Its sidecars refuse a bad knob at start: the demo fails early, removes its temporary
    work directory (spool, the embedded Redis and its secret) but the logs it points to,
    and says so, in JSON lines with --log-json."""
    env = {**child_env(), "TMPDIR": str(tmp_path), "DELTAD_KNOB_WRITER_NICE": "99"}
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "--log-json", "demo", "--duration", "5",
         "--rows", "2000", "--dim", "8", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    (work,) = tmp_path.glob("deltad-demo-*")
    assert [p.name for p in work.iterdir()] == ["logs"]  # no spool, no redis secret
    lines = [json.loads(x) for x in out.stderr.splitlines() if x.strip()]  # JSON only
    assert any("removed its work directory" in x["msg"] for x in lines), out.stderr
