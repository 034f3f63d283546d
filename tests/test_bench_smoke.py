"""Smoke test of the benchmark suite: every benchmark runs at the tiny size and reports.

Timing targets are never asserted here (the machine may be loaded); only that every
benchmark ran (``ok``: here everything a benchmark needs is installed, so ``not available``
is a failure too, e.g. a benchmark that no longer imports), that the JSON has the expected
keys and that the measured values are positive and finite.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import BENCHMARKS  # noqa: E402


def _pos(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _nonneg(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x >= 0


def _med(d: dict[str, Any]) -> Any:
    return d["median"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-out")
    work = tmp_path_factory.mktemp("bench-work")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--tiny",
            "--no-progress",
            "--out",
            str(out),
            "--work-dir",
            str(work),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    path = out / "results.json"
    assert path.exists(), (
        f"no results.json\nstdout:{proc.stdout[-3000:]}\nstderr:{proc.stderr[-3000:]}"
    )
    data = json.loads(path.read_text())
    data["_rc"] = proc.returncode
    data["_stderr"] = proc.stderr[-5000:]
    data["_out"] = str(out)
    return data


def test_every_benchmark_reports(results: dict[str, Any]) -> None:
    assert set(results["benchmarks"]) == set(BENCHMARKS)
    for name, res in results["benchmarks"].items():
        status = res["status"]
        assert status == "ok", f"{name}: {status}\n{res.get('traceback', '')}"
        assert _nonneg(res["wall_seconds"])
    assert results["_rc"] == 0, results["_stderr"]


def test_meta(results: dict[str, Any]) -> None:
    meta = results["meta"]
    for key in ("cpus", "torch", "loadavg_start", "loadavg_end", "preset", "repeats"):
        assert key in meta
    assert meta["preset"] == "tiny"
    assert _pos(meta["harness_peak_rss_bytes"])


def test_headlines_are_well_formed(results: dict[str, Any]) -> None:
    for name, res in results["benchmarks"].items():
        if res["status"] != "ok":
            continue
        assert res["headline"], name
        for h in res["headline"]:
            assert "metric" in h and "value" in h, (name, h)
            if isinstance(h["value"], float):
                assert math.isfinite(h["value"]), (name, h)


def _ok(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    res = results["benchmarks"][name]
    return res if res["status"] == "ok" else None


def test_baselines_always_measured(results: dict[str, Any]) -> None:
    """Baselines need nothing from deltad: they are there even if GetDelta is not."""
    tp = results["benchmarks"]["throughput"]
    for kind in ("tcp", "grpc_best"):
        assert tp["baselines"][kind], kind
        for v in tp["baselines"][kind].values():
            assert _pos(_med(v))
    merge = results["benchmarks"]["merge"]
    for p in merge["points"]:
        assert _pos(p["ids"]) and _pos(_med(p["torch_unique_s"]))


def test_values_are_sane(results: dict[str, Any]) -> None:
    if r := _ok(results, "throughput"):
        for p in r["points"]:
            assert _pos(_med(p["gbps"])) and p["wire_bytes"] == p["expected_wire_bytes"]
    if r := _ok(results, "merge"):
        for p in r["points"]:
            assert _pos(_med(p["merge_s"])) and _pos(p["ratio"])
    if r := _ok(results, "tracking"):
        assert set(r["variants"]) >= {"none", "deltad"}
        for v in r["variants"].values():
            assert _pos(_med(v["step_s"])) and _pos(v["peak_rss_bytes"])
    if r := _ok(results, "stall"):
        for p in r["points"]:
            assert _pos(_med(p["stall_s"])) and _pos(_med(p["write_gbps"]))
            assert _pos(p["rows_per_segment"])
    if r := _ok(results, "timed_publish"):
        for rnd in r["rounds"]:
            assert _pos(rnd["on_loop_pct"]) and math.isfinite(rnd["extra_cpu_pct"])
            assert rnd["publish"]["segments"] >= 3 and _pos(rnd["baseline_a"]["step_s"])
    if r := _ok(results, "fanout"):
        for p in r["points"]:
            assert _pos(_med(p["aggregate_gbps"])) and _pos(p["p50_s"]) and _pos(p["p99_s"])
            assert _nonneg(_med(p["sidecar_cpu_s"]))
        tree = r["tree"]  # through relays: levels 0 (sidecar), 1 and 2
        assert {p["level"] for p in tree["points"]} == {0, 1, 2}
        for p in tree["points"]:
            assert _pos(p["p50_s"]) and _nonneg(p["serving_cpu_s_per_gb"])
        assert [f["level"] for f in tree["freshness"] if _pos(f["p99_s"])] == [0, 1, 2]
        assert tree["overload"] and all(o["failed"] == 0 for o in tree["overload"])
        assert r["scale_model"]["rows"]
        fleet = r["fleet"]  # many consumers in worker processes: direct, 1 and 2 relay levels
        assert {(p["config"], p["level"]) for p in fleet["points"]} == {
            ("direct", 0),
            ("1 level", 1),
            ("2 levels", 2),
        }
        assert {p["consumers"] for p in fleet["points"]} == set(fleet["counts"])
        for p in fleet["points"]:
            assert p["failed"] == 0, p
            assert p["pulls"] == p["consumers"] * fleet["pulls_per_consumer"]
            assert _pos(p["p50_s"]) and p["p99_s"] >= p["p50_s"] and _pos(p["aggregate_gbps"])
            assert all(_nonneg(v) for v in p["cpu_s_per_gb"].values())
            assert all(_pos(v) for v in p["peak_rss_bytes"].values())
        split = fleet["per_pull_cost"]
        # (10 ms CPU ticks: a tiny run's split may round to 0)
        assert _nonneg(split["fixed_cpu_s_per_pull"]) and _nonneg(split["cpu_s_per_gb_marginal"])
        assert r["scale_model"]["cost_model"] == "pulls_per_s x fixed + D x marginal"
    if r := _ok(results, "freshness"):
        measured = [p for p in r["points"] if p["steps_measured"]]
        assert measured
        for p in measured:
            assert _nonneg(p["lag_p50_s"]) and _nonneg(p["lag_p99_s"])
            assert p["lag_p99_s"] >= p["lag_p50_s"]
            assert _pos(p["peak_rss_bytes"].get("trainer"))
    if r := _ok(results, "gendiff"):
        for p in r["points"]:
            assert 0 < p["diff_bytes"] < p["full_bytes"] and _pos(_med(p["diff_s"]))
            assert _pos(_med(p["full_s"])) and _pos(_med(p["herd_s"]))
    if r := _ok(results, "bootstrap_mem"):
        for p in r["points"]:
            assert _pos(p["tables_bytes"]) and p["peak_rss"] >= p["rss_before"] > 0
    if r := _ok(results, "fidelity"):
        for p in r["points"]:
            assert _nonneg(p["bytes_per_hour"]) and _pos(p["full_sync_bytes_per_hour"])
            assert _nonneg(p["rmse"]) and _nonneg(p["max_abs"])
        exact = next(p for p in r["points"] if p["consumer"] == "rows-fp32")
        assert exact["rmse"] == 0.0


def test_plots_written(results: dict[str, Any]) -> None:
    for name, res in results["benchmarks"].items():
        if res["status"] == "ok":
            assert "plot_error" not in res, (name, res.get("plot_error"))
            for p in res.get("plots", []):
                assert Path(p).stat().st_size > 0


def test_the_scale_model_ends_when_a_node_cannot_fan_out() -> None:
    """A measured send cost so high that one node serves one consumer (F = 1) used to loop
    forever growing a tree that never reaches the predictors (a tiny, loaded run hung)."""
    from bench.fanout_scale import scale_model

    tree = {
        "points": [{"consumers": 2, "serving_cpu_s_per_gb": 40.0}],
        "mirror": [],
        "idle_cores": [0.02, 0.03],
        "freshness": [{"level": 0, "p99_s": 0.05}, {"level": 1, "p99_s": 0.09}],
    }
    rows = {r["delta_mb_per_s_per_rank"]: r for r in scale_model(tree)["rows"]}
    assert rows[1.0]["fanout_per_node"] == 12 and rows[1.0]["relay_levels"] == 3
    assert rows[10.0]["fanout_per_node"] == 1 and rows[10.0]["relay_levels"] is None
