"""The reference predictor (`deltad consume`) never exits on what the wire brings: each hostile
conformance vector (docs/conformance.md) is replayed to a real predictor process, which
bootstraps from the vector's base, then meets the hostile pull again and again (the replay
serves a refused last pull again): it refuses it every time (a window it cannot apply) or
reports the rank missing (a stream it cannot decode), commits nothing of it, stays at the base's
step, and ends when told to (its pull budget) with exit 0 and its summary."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from deltad.conformance import vectors as vf
from deltad.conformance.replay import ReplayServer

VECTORS = Path(__file__).parent / "vectors"
ALL = vf.load_all(VECTORS)
#: the hostile vectors a float predictor replays (the packed one needs a serving model of its
#: tables; tests/test_conformance.py refuses it with the quantized applier)
HOSTILE = sorted(
    n
    for n, v in ALL.items()
    if any(p["outcome"] == "refused" for p in v.manifest["pulls"])
    and "packed" not in v.manifest["request"]["dtype"].lower()
)
PULLS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_the_hostile_vectors_are_the_ones_recorded() -> None:
    assert len(HOSTILE) >= 7 and {"hostile-mc-duplicate", "hostile-truncated"} <= set(HOSTILE)


def test_the_predictor_refuses_every_hostile_vector_and_keeps_running(tmp_path: Path) -> None:
    with ExitStack() as stack:
        runs, servers = {}, {}
        for name in HOSTILE:
            v = ALL[name]
            srv = servers[name] = stack.enter_context(ReplayServer(VECTORS, vector=name))
            req = v.manifest["request"]
            argv = [
                sys.executable, "-m", "deltad", "consume", "--consumer", name,
                "--model", v.manifest["model"], "--pulls", str(PULLS), "--interval", "0.1",
                "--form", req["form"].removeprefix("FORM_").lower(),
                "--dtype", req["dtype"].removeprefix("WIRE_DTYPE_").lower(),
                "--json-log", str(tmp_path / f"{name}.jsonl"), "--rpc-deadline", "10",
            ]  # fmt: skip
            for ep in srv.endpoints[: v.world_size]:
                argv += ["--sidecar", ep]
            runs[name] = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        for name, proc in runs.items():
            _out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, (name, proc.returncode, err[-2000:])
            lines = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            pulls = [x for x in lines if x["event"] == "pull"]
            summary = [x for x in lines if x["event"] == "summary"]
            assert len(pulls) == PULLS and len(summary) == 1, (name, lines)
            base_step = pulls[0]["step"]
            assert pulls[0]["rows"] > 0 and not pulls[0]["missing"] and not pulls[0]["refused"]
            for p in pulls[1:]:  # the hostile pull, refused or undecodable, every time
                assert p["refused"] or p["missing"], (name, p)
                assert p["step"] == base_step and p["rows"] == 0, (name, p)
            assert summary[0]["step"] == base_step, (name, summary)
            for r in range(ALL[name].world_size):  # the base's commit, nothing after it
                assert len(servers[name].replayer.commits(name, r)) == 1, (name, r)
